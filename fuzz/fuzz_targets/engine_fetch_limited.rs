//! A fetch-and-lock response read task by task under a per-task limit from the first two bytes
//! (issue 17): never a panic; a task taken is never far over the limit.
#![no_main]

use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let limit = u16::from_be_bytes([data[0], data[1]]) as usize;
    let _ = decoders::engine_fetch_response_limited(&data[2..], limit);
});
