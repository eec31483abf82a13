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
use shimmer_tests::{copy_fixture, fixture, fixtures};

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

/// Replaces, deletes or retypes one value somewhere in `v`; returns the keys on the way to it
/// (outermost first), so a refusal can be checked to name what was damaged.
fn mutate_json(v: &mut Value, rng: &mut Rng) -> Vec<String> {
    match v {
        Value::Object(map) if !map.is_empty() => {
            let keys: Vec<String> = map.keys().cloned().collect();
            let key = keys[rng.below(keys.len())].clone();
            match rng.below(4) {
                0 => {
                    map.remove(&key);
                    vec![key]
                }
                1 => {
                    map.insert(key.clone(), odd_value(rng));
                    vec![key]
                }
                _ => {
                    let mut path = vec![key.clone()];
                    path.extend(mutate_json(map.get_mut(&key).unwrap(), rng));
                    path
                }
            }
        }
        Value::Array(items) if !items.is_empty() => {
            let i = rng.below(items.len());
            if rng.below(3) == 0 {
                items.remove(i);
                vec![]
            } else {
                mutate_json(&mut items[i], rng)
            }
        }
        other => {
            *other = odd_value(rng);
            vec![]
        }
    }
}

fn no_panic<T>(what: &str, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| panic!("panicked on {what}"))
}

/// Whether a refusal names what was damaged: the file and a field, which is one of the mutated
/// keys or, when a cross-field check caught the damage, a key of the config that no longer fits
/// the mutated one.
fn names_the_damage(message: &str, paths: &[Vec<String>], config: &Value) -> bool {
    if !message.contains("config.json") {
        return false;
    }
    // A mutated key named anywhere (`key`, or inside a dotted path like `rope_scaling.factor`).
    let quoted = |k: &str| message.contains(&format!("`{k}`")) || message.contains(&format!(".{k}`")) || message.contains(&format!("`{k}."));
    if paths.iter().flatten().any(|k| quoted(k)) {
        return true;
    }
    // Otherwise a cross-field check: it names a field of the config.
    let field = message.split("field `").nth(1).and_then(|rest| rest.split('`').next());
    field.is_some_and(|f| config.get(f.split('.').next().unwrap_or(f)).is_some())
}

#[test]
fn mutated_configs_are_refused_by_name_or_parse() {
    let mut rng = Rng(0x5eed);
    let (mut parsed, mut refused) = (0, 0);
    for name in fixtures() {
        let original: Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
        for i in 0..1500 {
            let mut v = original.clone();
            let paths: Vec<Vec<String>> = (0..=rng.below(3)).map(|_| mutate_json(&mut v, &mut rng)).collect();
            match no_panic(&format!("{name} config mutation {i}: {v}"), || ModelSpec::from_json(&v, Path::new("config.json"))) {
                Ok(_) => parsed += 1,
                Err(e) => {
                    let message = e.to_string();
                    assert!(names_the_damage(&message, &paths, &original), "{name} config mutation {i} of {paths:?} refused without naming it: {message}");
                    refused += 1;
                }
            }
        }
    }
    assert!(parsed > 1000 && refused > 1000, "parsed {parsed}, refused {refused}: the mutations should reach both outcomes");
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
            _ => {
                mutate_json(&mut h, &mut rng);
            }
        }
        let mut text = h.to_string();
        while !text.len().is_multiple_of(8) {
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

/// A damaged config with the real weights: refused naming the key (or the tensor it no longer
/// fits), or loaded. A config that parses to the same model answers with the same bits; one that
/// parses to another model (another valid value of a key the model reads) runs that model or
/// refuses the prompt, without panicking.
#[test]
fn mutated_configs_with_real_weights_are_refused_by_name_or_answer_as_their_spec_says() {
    let mut rng = Rng(0xc0ffee);
    let ids = [1u32, 2, 3];
    let (mut identical, mut other_model, mut refused) = (0, 0, 0);
    for name in fixtures() {
        let dir = copy_fixture(name);
        let original: Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
        let reference = Engine::load(dir.path()).unwrap();
        let reference_logits: Vec<u32> = reference.logits_all(&ids).unwrap().iter().map(|x| x.to_bits()).collect();
        for i in 0..60 {
            let mut v = original.clone();
            let path = mutate_json(&mut v, &mut rng);
            std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
            let what = format!("{name} config mutation {i} of {path:?}: {v}");
            match no_panic(&what, || Engine::load(dir.path())) {
                Err(e) => {
                    let message = e.to_string();
                    assert!(
                        names_the_damage(&message, std::slice::from_ref(&path), &original) || message.contains("tensor `"),
                        "{what}: refused without naming it: {message}"
                    );
                    refused += 1;
                }
                Ok(engine) if engine.spec == reference.spec => {
                    let logits: Vec<u32> = engine.logits_all(&ids).unwrap().iter().map(|x| x.to_bits()).collect();
                    assert!(logits == reference_logits, "{what}: the same model must give the same logits");
                    identical += 1;
                }
                Ok(engine) => {
                    no_panic(&what, || engine.score(&ids).ok());
                    other_model += 1;
                }
            }
        }
    }
    assert!(identical > 20 && other_model > 20 && refused > 20, "identical {identical}, another model {other_model}, refused {refused}");
}

#[test]
fn mutated_tokenizers_are_refused_by_name_or_work() {
    let mut rng = Rng(0xbeef);
    let dir = copy_fixture("qwen3_moe");
    let original: Value = serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_moe").join("tokenizer.json")).unwrap()).unwrap();
    let (mut loaded, mut refused) = (0, 0);
    for i in 0..150 {
        let mut v = original.clone();
        let path = mutate_json(&mut v, &mut rng);
        std::fs::write(dir.path().join("tokenizer.json"), v.to_string()).unwrap();
        no_panic(&format!("tokenizer mutation {i} of {path:?}"), || match shimmer_common::tokenizer::Tokenizer::from_dir(dir.path()) {
            Ok(t) => {
                // Encoding and decoding either work or fail naming the file; never panic.
                for result in [t.encode("In the beginning, ümlaut <|im_end|>", true).map(|_| ()), t.decode(&[0, 1, 99999], false).map(|_| ())] {
                    if let Err(e) = result {
                        assert!(e.to_string().contains("tokenizer.json"), "tokenizer mutation {i}: {e}");
                    }
                }
                loaded += 1;
            }
            Err(e) => {
                assert!(e.to_string().contains("tokenizer.json"), "tokenizer mutation {i} of {path:?} refused without naming the file: {e}");
                refused += 1;
            }
        });
    }
    assert!(loaded > 20 && refused > 20, "loaded {loaded}, refused {refused}");
}

/// A damaged tiktoken rank file (Kimi's `tiktoken.model`: lines swapped, cut, duplicated, a byte
/// changed) loads and encodes, or is refused naming the file — never a panic. The ones that
/// load still hold every byte as a token, so their encodings decode back to the text.
#[test]
fn mutated_tiktoken_rank_files_are_refused_by_name_or_round_trip() {
    let mut rng = Rng(0x7137);
    let dir = copy_fixture("kimi_linear");
    let original = std::fs::read(fixture("kimi_linear").join("tiktoken.model")).unwrap();
    let lines: Vec<&[u8]> = original.split(|&b| b == b'\n').filter(|l| !l.is_empty()).collect();
    let text = "In the beginning, ümlaut 日本語 DON'T 12345 <|im_end|>";
    let (mut loaded, mut refused) = (0, 0);
    for i in 0..120 {
        let mut mutated: Vec<Vec<u8>> = lines.iter().map(|l| l.to_vec()).collect();
        let at = rng.below(mutated.len());
        let what = rng.below(5);
        match what {
            0 => {
                let other = rng.below(mutated.len());
                let (a, b) = (mutated[at].clone(), mutated[other].clone());
                // Swap the tokens, keep the ranks: a different but valid file.
                let split = |l: &[u8]| l.iter().position(|&c| c == b' ').unwrap_or(l.len());
                mutated[at] = [&b[..split(&b)], &a[split(&a)..]].concat();
                mutated[other] = [&a[..split(&a)], &b[split(&b)..]].concat();
            }
            1 => mutated.truncate(at),
            2 => {
                let copy = mutated[at].clone();
                mutated.insert(rng.below(mutated.len()), copy);
            }
            3 => {
                let line = &mut mutated[at];
                let k = rng.below(line.len());
                line[k] = b"A/+= 9x\r\0"[rng.below(10)];
            }
            _ => mutated[at].clear(),
        }
        std::fs::write(dir.path().join("tiktoken.model"), mutated.join(&b'\n')).unwrap();
        no_panic(&format!("rank file mutation {i} ({what}) at line {at}"), || match shimmer_common::tokenizer::Tokenizer::from_dir(dir.path()) {
            Ok(t) => {
                let ids = t.encode(text, false).unwrap();
                assert_eq!(t.decode(&ids, false).unwrap(), text, "rank file mutation {i}");
                loaded += 1;
            }
            Err(e) => {
                assert!(e.to_string().contains("tiktoken.model"), "rank file mutation {i} refused without naming the file: {e}");
                refused += 1;
            }
        });
    }
    assert!(loaded > 20 && refused > 20, "loaded {loaded}, refused {refused}");
}

/// A damaged chat template renders, or is refused with an error that says where (the template's
/// line) — never a panic.
#[test]
fn mutated_chat_templates_render_or_are_refused_saying_where() {
    let mut rng = Rng(0xabcdef);
    let msgs = [Message::new("system", "s"), Message::new("user", "hi"), Message::new("assistant", "yo")];
    let pieces = [
        "{%",
        "%}",
        "{{",
        "}}",
        "{% for",
        "{% endfor %}",
        "loop.",
        "|tojson",
        "(",
        ")",
        "[",
        "]",
        "'",
        "\"",
        "messages",
        "{% break %}",
        "raise_exception(",
        ".strip()",
        "-",
        "~",
        "|",
    ];
    let (mut rendered, mut refused) = (0, 0);
    for name in fixtures() {
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
            match no_panic(&format!("{name} template mutation {i}: {t}"), || render_template(&t, &msgs, true, Some("<s>"), None)) {
                Ok(_) => rendered += 1,
                Err(e) => {
                    assert!(e.line().is_some(), "{name} template mutation {i} refused without saying where: {e:#}\n{t}");
                    refused += 1;
                }
            }
        }
    }
    assert!(rendered > 200 && refused > 200, "rendered {rendered}, refused {refused}");
}

/// A container's manifest and a usage file, damaged one value at a time: each load ends in an
/// error or in a model that answers exactly as the undamaged one — never a different answer.
#[test]
fn mutated_container_manifests_and_usage_files_fail_or_answer_identically() {
    use shimmer_coordinator::engine::{ExpertOptions, RamBudget, UsageFile};
    let mut rng = Rng(0x3a11);
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("c");
    let opts = shimmer_store::convert::ConvertOptions {
        expert_quant: shimmer_common::quant::QuantScheme::Int8PerRow,
        dense_quant: shimmer_store::convert::DenseQuant::Bf16,
        head_quant: None,
    };
    shimmer_store::convert::convert(&fixture("glm4_moe"), &dir, opts, &mut |_| {}).unwrap();
    let ids = [1u32, 5, 9, 13, 17];
    let usage = out.path().join("usage.json");
    let store = |usage: UsageFile| ExpertOptions { ram: Some(RamBudget::Gb(1e-4)), usage, ..ExpertOptions::default() };
    let learner = Engine::open(&dir, &store(UsageFile::File(usage.clone()))).unwrap();
    let reference = learner.logits_all(&ids).unwrap();
    learner.score(&ids).unwrap(); // a turn: writes the usage file
    drop(learner);
    let manifest_path = dir.join(shimmer_store::container::MANIFEST_FILE);
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
    // Edits that change nothing the manifest means load and answer the same.
    let mut harmless = Vec::new();
    let mut reordered = original.clone();
    reordered["blobs"].as_array_mut().unwrap().reverse();
    harmless.push(reordered);
    let mut extra = original.clone();
    extra["written_by"] = json!("someone else's tool");
    harmless.push(extra);
    for v in &harmless {
        std::fs::write(&manifest_path, v.to_string()).unwrap();
        let logits = Engine::open(&dir, &store(UsageFile::Off)).unwrap().logits_all(&ids).unwrap();
        assert!(logits.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()));
        loaded += 1;
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
