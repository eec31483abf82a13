#![no_main]
//! A request's JSON schema and the text a model writes under it, through llguidance as shimmer
//! drives it (`shimmer_coordinator::constraint`): any schema compiles or is refused with a named
//! error; nothing panics; the mask lets through only text that stays valid, and where it lets the
//! text end, the text parses as JSON; a plan, where one is found, is allowed byte by byte and
//! completes the value.
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use shimmer_common::tokenizer::TokenBytes;
use shimmer_coordinator::constraint::{Constraint, Grammar, Vocabulary};

const EOS: u32 = 256;

fn vocabulary() -> &'static Vocabulary {
    static V: OnceLock<Vocabulary> = OnceLock::new();
    V.get_or_init(|| {
        let mut tokens: Vec<TokenBytes> = (0..=255u8).map(|b| TokenBytes { bytes: vec![b], special: false }).collect();
        tokens.push(TokenBytes { bytes: b"<|end|>".to_vec(), special: true });
        for w in [&b"{\""[..], b"\": ", b"\", \"", b"true", b"null", b"\xe4\xb8"] {
            tokens.push(TokenBytes { bytes: w.to_vec(), special: false });
        }
        Vocabulary::new(&tokens, tokens.len(), &[EOS]).expect("the fuzz vocabulary")
    })
}

/// Whether `fed` is JSON (serde_json's own limits — f64's range, 128 levels — aside).
fn parses(fed: &[u8]) -> bool {
    match serde_json::from_slice::<serde_json::Value>(fed) {
        Ok(_) => true,
        Err(e) => e.to_string().contains("out of range") || e.to_string().contains("recursion limit"),
    }
}

fn feed(c: &mut Constraint, bytes: &[u8], fed: &mut Vec<u8>) -> bool {
    for &b in bytes {
        let Ok(allowed) = c.allowed() else { return false };
        if !allowed.contains(b as usize) {
            return false;
        }
        assert!(c.commit(b as u32).is_ok(), "an allowed byte was refused");
        fed.push(b);
    }
    true
}

fuzz_target!(|data: &[u8]| {
    // The schema's JSON, a NUL, then the output text.
    let (schema, text) = match data.iter().position(|b| *b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[][..]),
    };
    let Ok(schema) = serde_json::from_slice::<serde_json::Value>(schema) else { return };
    let Ok(mut c) = vocabulary().compile(&Grammar::JsonSchema(schema)) else { return };
    let mut fed = Vec::new();
    feed(&mut c, text, &mut fed);
    let Ok(allowed) = c.allowed() else { return };
    if allowed.contains(EOS as usize) {
        assert!(parses(&fed), "ended on invalid JSON: {:?}", String::from_utf8_lossy(&fed));
    }
    c.prepare();
    if let Some(plan) = c.plan().map(<[u8]>::to_vec) {
        assert!(feed(&mut c, &plan, &mut fed), "a plan's byte was refused: {:?} after {:?}", String::from_utf8_lossy(&plan), String::from_utf8_lossy(&fed));
        let whole = c.is_finished() || c.allowed().is_ok_and(|a| a.contains(EOS as usize));
        assert!(whole, "the plan did not complete {:?}", String::from_utf8_lossy(&fed));
        assert!(parses(&fed), "a plan completed invalid JSON: {:?}", String::from_utf8_lossy(&fed));
    }
});
