#![no_main]
//! A real config.json (one of the fixtures') with its size-like fields set to what the fuzzer
//! chooses — integers of any size, floats, negatives, strings, lists — then `ModelSpec::from_json`.
//! A field set over its documented bound is always refused, naming a field that is over its bound;
//! what is accepted holds sizes within every bound; nothing panics or allocates from an unchecked
//! size (libFuzzer's -rss_limit_mb and -malloc_limit_mb catch that).
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};
use shimmer_common::spec::{CONFIG_BOUNDS, MAX_EXPERTS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB};

const FIXTURES: [&str; 6] = [
    include_str!("../../tests/fixtures/qwen3_moe/config.json"),
    include_str!("../../tests/fixtures/deepseek_v3/config.json"),
    include_str!("../../tests/fixtures/glm4_moe/config.json"),
    include_str!("../../tests/fixtures/mixtral/config.json"),
    include_str!("../../tests/fixtures/olmoe/config.json"),
    include_str!("../../tests/fixtures/deepseek_v3_fp8/config.json"),
];

/// The value a 9-byte chunk writes: its first byte picks the shape, the other eight the number.
fn value_of(shape: u8, raw: u64) -> Value {
    match shape % 8 {
        0 => json!(raw),
        1 => json!(raw % 4096),
        2 => json!(-((raw % (1 << 40)) as i64)),
        3 => json!(f64::from_bits(raw)),
        4 => json!((raw % 100_000) as f64 * 1e3),
        5 => json!(raw.to_string()),
        6 => Value::Array((0..(raw % 5)).map(|i| json!(raw.rotate_left(i as u32 * 13) % 2048)).collect()),
        _ => Value::Null,
    }
}

fn over_bound(field: &str, v: &Value, max: u64) -> bool {
    let over = |x: &Value| x.as_u64().is_some_and(|n| n > max) || x.as_f64().is_some_and(|f| f.is_finite() && f >= 0.0 && f > max as f64);
    match field.strip_suffix("[]") {
        Some(_) => v.as_array().is_some_and(|items| items.len() as u64 > max),
        None => over(v) || v.as_array().is_some_and(|items| items.iter().any(over)),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else { return };
    let Ok(Value::Object(mut config)) = serde_json::from_str::<Value>(FIXTURES[which as usize % FIXTURES.len()]) else {
        panic!("a fixture's config.json does not parse")
    };
    let mut set_over = Vec::new();
    let mut set = Vec::new();
    for chunk in rest.chunks_exact(10).take(16) {
        let bound = &CONFIG_BOUNDS[chunk[0] as usize % CONFIG_BOUNDS.len()];
        let raw = u64::from_le_bytes(chunk[2..10].try_into().expect("8 bytes"));
        let v = value_of(chunk[1], raw);
        let key = bound.field.trim_end_matches("[]");
        if over_bound(bound.field, &v, bound.max) {
            set_over.push(key);
        } else {
            set_over.retain(|f| *f != key);
        }
        set.push(key);
        config.insert(key.to_string(), v);
    }
    match shimmer_common::ModelSpec::from_json(&Value::Object(config), std::path::Path::new("config.json")) {
        Ok(spec) => {
            assert!(set_over.is_empty(), "accepted with {set_over:?} over their bounds");
            assert!(spec.num_layers as u64 <= MAX_LAYERS && spec.layers.len() == spec.num_layers);
            assert!(spec.vocab_size as u64 <= MAX_VOCAB);
            assert!(spec.max_position_embeddings as u64 <= MAX_POSITIONS);
            assert!(spec.moe.num_experts as u64 <= MAX_EXPERTS);
        }
        Err(e) => {
            // Bounds are checked before anything else reads the config, and the fixture's own
            // values are within them: a refusal with a field set over its bound names one of the
            // fields set (the first with a problem, in the bounds' order).
            if !set_over.is_empty() {
                let shimmer_common::LoadError::Field { field, .. } = &e else { panic!("refused without naming a field: {e}") };
                assert!(set.contains(&field.as_str()), "refused naming {field}, which was not set: {e}");
            }
        }
    }
});
