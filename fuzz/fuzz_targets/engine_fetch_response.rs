//! A fetch-and-lock response body from the engine: any bytes decode or fail, never panic.
#![no_main]

use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((tasks, _rejected)) = decoders::engine_fetch_response(data) {
        for task in tasks {
            assert!(
                !task.id.trim().is_empty(),
                "a task with a blank id was accepted"
            );
            let _ = task.task_ref();
        }
    }
});
