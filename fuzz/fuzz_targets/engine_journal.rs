//! A journal read answer, then the replay of its steps; also raw step arrays replayed directly.
#![no_main]

use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(journal) = decoders::engine_journal(data) {
        if let Ok(replayed) = decoders::journal_replay(&journal.steps) {
            assert!(replayed.next_seq >= 1);
        }
    }
    let _ = decoders::journal_replay_json(data);
    let _ = decoders::engine_tool_credential(data);
});
