//! What constrained decoding costs per token on a large vocabulary: a synthetic 150 000-token
//! byte-level vocabulary (words with and without a leading space, numbers, JSON punctuation, CJK
//! characters whole and split, specials), grammars as requests give them, and random walks
//! through each as the batcher samples (closing within the budget). Prints the time to build the
//! vocabulary's index, to compile each grammar, and per token the mask and the closing check.
//!
//! `cargo run --release -p shimmer-coordinator --example grammar_mask [-- VOCAB [WALKS]]`

use std::time::Instant;

use serde_json::json;
use shimmer_common::tokenizer::TokenBytes;
use shimmer_coordinator::constraint::{Grammar, Vocabulary};

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn vocabulary(size: usize) -> Vec<TokenBytes> {
    let mut seen = std::collections::HashSet::new();
    let mut out: Vec<TokenBytes> = (0..=255u8).map(|b| TokenBytes { bytes: vec![b], special: false }).collect();
    for b in 0..=255u8 {
        seen.insert(vec![b]);
    }
    let mut push = |bytes: Vec<u8>, out: &mut Vec<TokenBytes>| {
        if seen.insert(bytes.clone()) {
            out.push(TokenBytes { bytes, special: false });
        }
    };
    for p in ["{\"", "\":", "\": ", "\",", "\", \"", "\"}", "},", "}]", "[{", "],", "\n  ", "\n    ", "\n}", "null", "true", "false", ", "] {
        push(p.as_bytes().to_vec(), &mut out);
    }
    for n in 0..2000 {
        push(n.to_string().into_bytes(), &mut out);
    }
    let mut rng = Lcg(7);
    // CJK characters whole, and a share of them as a 2-byte head (the rest a 1-byte tail).
    for i in 0..12_000u32 {
        let c = char::from_u32(0x4E00 + i).unwrap_or('中');
        let mut b = [0u8; 4];
        let s = c.encode_utf8(&mut b).as_bytes().to_vec();
        if i % 4 == 0 {
            push(s[..2].to_vec(), &mut out);
        }
        push(s, &mut out);
    }
    let (consonants, vowels) = (b"bcdfghjklmnprstvwz", b"aeiouy");
    while out.len() < size - 4 {
        let syllables = 1 + rng.next() as usize % 4;
        let mut w = Vec::new();
        for _ in 0..syllables {
            w.push(consonants[rng.next() as usize % consonants.len()]);
            w.push(vowels[rng.next() as usize % vowels.len()]);
            if rng.next().is_multiple_of(3) {
                w.push(consonants[rng.next() as usize % consonants.len()]);
            }
        }
        if rng.next().is_multiple_of(4) {
            w[0] = w[0].to_ascii_uppercase();
        }
        if rng.next().is_multiple_of(2) {
            w.insert(0, b' ');
        }
        push(w, &mut out);
    }
    for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"] {
        out.push(TokenBytes { bytes: s.as_bytes().to_vec(), special: true });
    }
    out
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let size: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(150_000);
    let walks: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(4);
    let tokens = vocabulary(size);
    let eos = (tokens.len() - 4) as u32;
    let t0 = Instant::now();
    let v = Vocabulary::new(&tokens, tokens.len(), &[eos]).expect("vocabulary");
    println!("vocabulary: {} tokens, index built in {:.0} ms", tokens.len(), t0.elapsed().as_secs_f64() * 1e3);
    let offering = json!({
        "$defs": {"Item": {"properties": {"name": {"maxLength": 12, "type": "string"}, "kind": {"enum": ["ram", "ewe", "goat"], "type": "string"}}, "required": ["name", "kind"], "type": "object", "additionalProperties": false}},
        "properties": {"code": {"pattern": "^[A-Z]{2}[0-9]{3}$", "type": "string"}, "items": {"items": {"$ref": "#/$defs/Item"}, "maxItems": 4, "minItems": 1, "type": "array"},
            "day": {"format": "date", "type": "string"}, "count": {"maximum": 7, "minimum": 1, "type": "integer"}, "note": {"anyOf": [{"type": "string", "maxLength": 200}, {"type": "null"}]}},
        "required": ["code", "items", "day", "count", "note"], "type": "object", "additionalProperties": false
    });
    let weather = json!({"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]});
    let grammars = [
        ("json_object", Grammar::AnyObject),
        ("Pydantic model", Grammar::JsonSchema(offering)),
        (
            "tool call (3 tools)",
            Grammar::ToolCall(vec![
                ("get_weather".into(), Some(weather)),
                ("ping".into(), None),
                ("search".into(), Some(json!({"type": "object", "properties": {"q": {"type": "string"}}}))),
            ]),
        ),
        ("regex", Grammar::Regex("([A-Z][a-z]+ ){1,40}[0-9]{4}\\.".into())),
    ];
    // The baseline: one pass over the vocabulary testing one byte of each token — less than the
    // least a matcher that walks the vocabulary per token (the one llguidance replaced) can do.
    let mut scans = Vec::new();
    let mut sink = 0usize;
    for _ in 0..50 {
        let t = Instant::now();
        sink += tokens.iter().filter(|t| std::hint::black_box(t.bytes.first()) == Some(&b'"')).count();
        scans.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let scan = percentile(&mut scans, 0.5);
    println!("baseline: one pass over the vocabulary, median {scan:.0} µs ({sink} hits)");
    println!("| grammar | compile ms | tokens | mask µs median | p90 | max | median ÷ one pass | closing check µs median | max |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (name, g) in &grammars {
        let (mut masks, mut checks, mut compile) = (Vec::new(), Vec::new(), Vec::new());
        let mut walked = 0;
        for seed in 0..walks {
            let t = Instant::now();
            let mut c = v.compile(g).expect("compiles");
            compile.push(t.elapsed().as_secs_f64() * 1e3);
            let mut rng = Lcg(seed * 31 + 5);
            let budget = 160;
            for used in 0..budget {
                if c.is_finished() {
                    break;
                }
                let t = Instant::now();
                c.prepare();
                let allowed = c.allowed().expect("mask");
                masks.push(t.elapsed().as_secs_f64() * 1e6);
                let choices: Vec<u32> = (0..tokens.len() as u32).filter(|&t| allowed.contains(t as usize) && t != eos).collect();
                if choices.is_empty() || (allowed.contains(eos as usize) && rng.next().is_multiple_of(4)) {
                    break;
                }
                let mut tok = choices[rng.next() as usize % choices.len()];
                let left = budget - used;
                if c.near_end(left) {
                    let t = Instant::now();
                    let fits = c.fits_after(tok, left - 1);
                    checks.push(t.elapsed().as_secs_f64() * 1e6);
                    if !fits {
                        let plan = c.plan_tokens().expect("plan");
                        tok = plan.first();
                    }
                }
                c.commit(tok).expect("commit");
                walked += 1;
            }
        }
        let (cm, mm, m90, mmax) = (percentile(&mut compile, 0.5), percentile(&mut masks, 0.5), percentile(&mut masks, 0.9), percentile(&mut masks, 1.0));
        let (chm, chmax) = if checks.is_empty() { (0.0, 0.0) } else { (percentile(&mut checks, 0.5), percentile(&mut checks, 1.0)) };
        println!("| {name} | {cm:.1} | {walked} | {mm:.0} | {m90:.0} | {mmax:.0} | {:.2} | {chm:.0} | {chmax:.0} |", mm / scan);
    }
}
