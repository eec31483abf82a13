#![no_main]
//! config.json bytes → ModelSpec: any input ends in Ok or an error naming a field.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = shimmer_common::ModelSpec::from_json(&v, std::path::Path::new("config.json"));
    }
});
