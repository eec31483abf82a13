#![no_main]
//! A request's `response_format` schema and the text a model writes under it: any schema compiles
//! or is refused with a named error; the matcher never panics, accepts only what keeps the text
//! valid, and whatever it lets end parses as JSON.
use libfuzzer_sys::fuzz_target;
use shimmer_common::json_constraint::{Matcher, Schema};

fuzz_target!(|data: &[u8]| {
    // The schema's JSON, a NUL, then the output text.
    let (schema, text) = match data.iter().position(|b| *b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[][..]),
    };
    let Ok(schema) = serde_json::from_slice::<serde_json::Value>(schema) else { return };
    let Ok(schema) = Schema::compile(&schema) else { return };
    let mut m = Matcher::new(std::sync::Arc::new(schema));
    let text = String::from_utf8_lossy(text);
    let mut fed = String::new();
    for c in text.chars() {
        let _ = m.min_to_finish();
        if !m.advance(c) {
            break;
        }
        fed.push(c);
    }
    if m.can_end() {
        assert!(serde_json::from_str::<serde_json::Value>(&fed).is_ok(), "ended on invalid JSON: {fed:?}");
    }
});
