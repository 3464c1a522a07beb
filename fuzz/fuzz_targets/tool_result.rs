//! An MCP tool result as a tool server sent it, then capped to a size from the first two bytes.
#![no_main]

use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let cap = u16::from_be_bytes([data[0], data[1]]) as usize;
    if let Ok(result) = decoders::tool_result(&data[2..]) {
        let _ = decoders::cap_tool_result(result, cap);
    }
});
