#![no_main]
//! tokenizer.json bytes → tokenizer, then a round trip.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = std::env::temp_dir().join(format!("shimmer-fuzz-tok-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    if std::fs::write(dir.join("tokenizer.json"), data).is_ok() {
        if let Ok(t) = shimmer_common::tokenizer::Tokenizer::from_dir(&dir) {
            if let Ok(ids) = t.encode("In the beginning", true) {
                let _ = t.decode(&ids, false);
            }
        }
    }
});
