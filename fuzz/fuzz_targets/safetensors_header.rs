#![no_main]
//! A whole safetensors file's bytes → validated tensor table.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(entries) = shimmer_common::checkpoint::parse_header(data) {
        for (_, e) in entries {
            // Every range the parser hands out must lie inside the file.
            let r = e.byte_range();
            assert!(r.start <= r.end && r.end <= data.len());
        }
    }
});
