//! One `tools/list` entry as offered to the model (issue 17: description and schema limits), and
//! text cut at a limit from the first byte.
#![no_main]

use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decoders::tool_listing_entry(data);
    if let Some((first, rest)) = data.split_first() {
        let _ = decoders::truncate_text(&String::from_utf8_lossy(rest), *first as usize);
    }
});
