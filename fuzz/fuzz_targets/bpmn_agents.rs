//! BPMN XML as the engine serves it (issue 26): any text, through the depth scan, the XML parser
//! (no DTD, node limit) and the `abada.agent.*` property mapping into the one definition parser.
//! None may panic or overflow the stack.
#![no_main]

use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(xml) = std::str::from_utf8(data) else {
        return;
    };
    let _ = decoders::bpmn_agents(xml);
});
