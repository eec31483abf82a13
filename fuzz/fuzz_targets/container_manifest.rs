#![no_main]
//! shimmer-manifest.json bytes → a validated container: any input ends in Ok or an error naming
//! the manifest; never an offset or count that was not checked.
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn spec() -> &'static shimmer_common::ModelSpec {
    static SPEC: OnceLock<shimmer_common::ModelSpec> = OnceLock::new();
    SPEC.get_or_init(|| {
        shimmer_common::ModelSpec::from_dir(std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/olmoe"))).expect("fixture config")
    })
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let file_len = u64::from_le_bytes(data[..8].try_into().unwrap_or([0; 8])) >> 40;
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&data[8..]) {
        if let Ok(c) = shimmer_store::container::Container::from_manifest(std::path::Path::new("c"), v, spec(), file_len) {
            for l in 0..8 {
                for e in 0..16 {
                    if let Some(loc) = c.location(l, e) {
                        assert!(loc.offset + loc.length <= file_len);
                    }
                }
            }
        }
    }
});
