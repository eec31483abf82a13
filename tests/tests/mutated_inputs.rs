//! Seeded mutation testing of every parser that reads a model directory: config.json,
//! safetensors headers, tokenizer.json, chat templates. Thousands of damaged inputs must each end
//! in `Ok` or an error, never a panic. (Coverage-guided fuzz targets for the same parsers live in
//! `fuzz/`; this test keeps the property in every CI run.)

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use serde_json::{json, Value};
use shimmer_common::chat_template::{render_template, Message};
use shimmer_common::checkpoint::parse_header;
use shimmer_common::ModelSpec;
use shimmer_coordinator::Engine;
use shimmer_tests::{copy_fixture, fixture, FAMILIES};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn odd_value(rng: &mut Rng) -> Value {
    match rng.below(12) {
        0 => Value::Null,
        1 => json!(-1),
        2 => json!(0),
        3 => json!(1),
        4 => json!(1e300),
        5 => json!(u64::MAX),
        6 => json!("text"),
        7 => json!([]),
        8 => json!({}),
        9 => json!(true),
        10 => json!(rng.below(5000)),
        _ => json!([rng.below(100), "x"]),
    }
}

/// Replaces, deletes or retypes one value somewhere in `v`.
fn mutate_json(v: &mut Value, rng: &mut Rng) {
    match v {
        Value::Object(map) if !map.is_empty() => {
            let keys: Vec<String> = map.keys().cloned().collect();
            let key = &keys[rng.below(keys.len())];
            match rng.below(4) {
                0 => {
                    map.remove(key);
                }
                1 => {
                    map.insert(key.clone(), odd_value(rng));
                }
                _ => mutate_json(map.get_mut(key).unwrap(), rng),
            }
        }
        Value::Array(items) if !items.is_empty() => {
            let i = rng.below(items.len());
            if rng.below(3) == 0 {
                items.remove(i);
            } else {
                mutate_json(&mut items[i], rng);
            }
        }
        other => *other = odd_value(rng),
    }
}

fn no_panic<T>(what: &str, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| panic!("panicked on {what}"))
}

#[test]
fn mutated_configs_never_panic() {
    let mut rng = Rng(0x5eed);
    for name in FAMILIES {
        let original: Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
        for i in 0..1500 {
            let mut v = original.clone();
            for _ in 0..=rng.below(3) {
                mutate_json(&mut v, &mut rng);
            }
            no_panic(&format!("{name} config mutation {i}: {v}"), || ModelSpec::from_json(&v, Path::new("config.json")).ok());
        }
    }
}

#[test]
fn mutated_safetensors_headers_never_panic() {
    let mut rng = Rng(0xfeed);
    let bytes = std::fs::read(fixture("mixtral").join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    // Raw byte damage to the length prefix and the JSON.
    for i in 0..3000 {
        let mut b = bytes.clone();
        for _ in 0..=rng.below(4) {
            let at = rng.below(8 + n);
            b[at] = rng.next() as u8;
        }
        no_panic(&format!("byte mutation {i}"), || parse_header(&b).ok());
    }
    // Structured damage: offsets, shapes, dtypes, names. Those that still parse go on to a full
    // model load, which must check every tensor against the spec.
    let dir = copy_fixture("mixtral");
    let mut loads = 0;
    for i in 0..400 {
        let mut h = header.clone();
        // Damage that keeps byte sizes consistent (same-width dtypes, permuted shapes, renames)
        // gets past the header check and must be caught against the spec.
        let names: Vec<String> = h.as_object().unwrap().keys().filter(|k| *k != "__metadata__").cloned().collect();
        let victim = names[rng.below(names.len())].clone();
        match rng.below(4) {
            0 => h[&victim]["dtype"] = json!(["I16", "U16", "BF16", "F16"][rng.below(4)]),
            1 => {
                let mut shape = h[&victim]["shape"].as_array().unwrap().clone();
                shape.reverse();
                shape.push(json!(1));
                h[&victim]["shape"] = json!(shape);
            }
            2 => {
                let entry = h.as_object_mut().unwrap().remove(&victim).unwrap();
                h[format!("{victim}.renamed")] = entry;
            }
            _ => mutate_json(&mut h, &mut rng),
        }
        let mut text = h.to_string();
        while text.len() % 8 != 0 {
            text.push(' ');
        }
        let mut b = (text.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(text.as_bytes());
        b.extend_from_slice(&bytes[8 + n..]);
        if no_panic(&format!("header mutation {i}: {h}"), || parse_header(&b).is_ok()) {
            std::fs::write(dir.path().join("model.safetensors"), &b).unwrap();
            no_panic(&format!("load after header mutation {i}: {h}"), || Engine::load(dir.path()).ok());
            loads += 1;
        }
    }
    assert!(loads > 20, "the structured mutations should often keep a valid header ({loads})");
}

#[test]
fn mutated_configs_with_real_weights_fail_cleanly() {
    let mut rng = Rng(0xc0ffee);
    for name in FAMILIES {
        let dir = copy_fixture(name);
        let original: Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
        for i in 0..60 {
            let mut v = original.clone();
            mutate_json(&mut v, &mut rng);
            std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
            let loaded = no_panic(&format!("{name} load with config mutation {i}: {v}"), || Engine::load(dir.path()));
            if let Ok(engine) = loaded {
                // A config that still loads must still run (or refuse the prompt) without panicking.
                no_panic(&format!("{name} run with config mutation {i}: {v}"), || engine.score(&[1, 2, 3]).ok());
            }
        }
    }
}

#[test]
fn mutated_tokenizers_never_panic() {
    let mut rng = Rng(0xbeef);
    let dir = copy_fixture("qwen3_moe");
    let original: Value = serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_moe").join("tokenizer.json")).unwrap()).unwrap();
    for i in 0..150 {
        let mut v = original.clone();
        // Skip the big vocab map most of the time so mutations reach the pipeline settings.
        mutate_json(&mut v, &mut rng);
        std::fs::write(dir.path().join("tokenizer.json"), v.to_string()).unwrap();
        no_panic(&format!("tokenizer mutation {i}"), || {
            if let Ok(t) = shimmer_common::tokenizer::Tokenizer::from_dir(dir.path()) {
                let ids = t.encode("In the beginning, ümlaut <|im_end|>", true).unwrap_or_default();
                let _ = t.decode(&ids, true);
                let _ = t.decode(&[0, 1, 99999], false);
            }
        });
    }
}

#[test]
fn mutated_chat_templates_never_panic() {
    let mut rng = Rng(0xabcdef);
    let msgs = [Message::new("system", "s"), Message::new("user", "hi"), Message::new("assistant", "yo")];
    let pieces = ["{%", "%}", "{{", "}}", "{% for", "{% endfor %}", "loop.", "|tojson", "(", ")", "[", "]", "'", "\"", "messages", "{% break %}", "raise_exception(", ".strip()", "-", "~", "|"];
    for name in FAMILIES {
        let tpl = shimmer_common::chat_template::ChatConfig::from_dir(&fixture(name)).unwrap().template.unwrap();
        for i in 0..400 {
            let mut t: Vec<char> = tpl.chars().collect();
            for _ in 0..=rng.below(3) {
                let at = rng.below(t.len());
                match rng.below(3) {
                    0 => {
                        let end = (at + rng.below(8)).min(t.len());
                        t.drain(at..end);
                    }
                    _ => {
                        let p = pieces[rng.below(pieces.len())];
                        for (k, c) in p.chars().enumerate() {
                            t.insert((at + k).min(t.len()), c);
                        }
                    }
                }
            }
            let t: String = t.into_iter().collect();
            no_panic(&format!("{name} template mutation {i}: {t}"), || render_template(&t, &msgs, true, Some("<s>"), None).ok());
        }
    }
}

/// A container's manifest and a usage file, damaged one value at a time: each load ends in an
/// error or in a model that answers exactly as the undamaged one — never a different answer.
#[test]
fn mutated_container_manifests_and_usage_files_fail_or_answer_identically() {
    use shimmer_coordinator::engine::{ExpertOptions, RamBudget, UsageFile};
    let mut rng = Rng(0x3a11);
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("c");
    let opts = shimmer_worker::convert::ConvertOptions { expert_quant: shimmer_common::quant::QuantScheme::Int8PerRow, dense_quant: shimmer_worker::convert::DenseQuant::Bf16 };
    shimmer_worker::convert::convert(&fixture("glm4_moe"), &dir, opts, &mut |_| {}).unwrap();
    let ids = [1u32, 5, 9, 13, 17];
    let usage = out.path().join("usage.json");
    let store = |usage: UsageFile| ExpertOptions { ram: Some(RamBudget::Gb(1e-4)), usage, ..ExpertOptions::default() };
    let learner = Engine::open(&dir, &store(UsageFile::File(usage.clone()))).unwrap();
    let reference = learner.logits_all(&ids).unwrap();
    learner.score(&ids).unwrap(); // a turn: writes the usage file
    drop(learner);
    let manifest_path = dir.join(shimmer_worker::container::MANIFEST_FILE);
    let original: Value = serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    let (mut loaded, mut refused) = (0, 0);
    for i in 0..300 {
        let mut v = original.clone();
        mutate_json(&mut v, &mut rng);
        std::fs::write(&manifest_path, v.to_string()).unwrap();
        let what = format!("manifest mutation {i}");
        match no_panic(&what, || Engine::open(&dir, &store(UsageFile::Off))) {
            Ok(engine) => match no_panic(&what, || engine.logits_all(&ids)) {
                Ok(logits) => {
                    assert!(logits.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{what} changed the answer: {v}");
                    loaded += 1;
                }
                Err(_) => refused += 1,
            },
            Err(_) => refused += 1,
        }
    }
    assert!(loaded > 0 && refused > 100, "loaded {loaded}, refused {refused}");
    std::fs::write(&manifest_path, original.to_string()).unwrap();
    // The usage file written by the reference run, damaged.
    let original: Value = serde_json::from_slice(&std::fs::read(&usage).unwrap()).unwrap();
    for i in 0..200 {
        let mut v = original.clone();
        mutate_json(&mut v, &mut rng);
        std::fs::write(&usage, v.to_string()).unwrap();
        let what = format!("usage mutation {i}");
        if let Ok(engine) = no_panic(&what, || Engine::open(&dir, &store(UsageFile::File(usage.clone())))) {
            let logits = no_panic(&what, || engine.logits_all(&ids)).unwrap();
            assert!(logits.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{what} changed the answer: {v}");
        }
    }
}
