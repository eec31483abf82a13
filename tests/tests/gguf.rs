//! GGUF files as gguf-py writes them, read by shimmer: the metadata as written, and every tensor
//! type shimmer reads dequantised to gguf-py's own values bit for bit (the fixture and its
//! expected values come from `tests/oracle/make_gguf_fixture.py`, gguf 0.19.0). Damaged copies
//! are refused by name or read, never a panic.

use std::path::PathBuf;

use shimmer_common::gguf::{GgmlType, Gguf};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/gguf")
}

#[test]
fn every_type_dequantises_to_gguf_pys_values_bit_for_bit() {
    let g = Gguf::open(&fixture().join("quants.gguf")).unwrap();
    let expected_bytes = std::fs::read(fixture().join("quants.expected.safetensors")).unwrap();
    let expected = safetensors::SafeTensors::deserialize(&expected_bytes).unwrap();
    let mut kinds = Vec::new();
    for (name, view) in expected.tensors() {
        let t = g.tensor(&name).unwrap_or_else(|| panic!("{name} is not in the GGUF"));
        assert_eq!(t.shape(), view.shape(), "{name}");
        let want: Vec<u32> = view.data().chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let got: Vec<u32> = g.dequantize(t).iter().map(|v| v.to_bits()).collect();
        let differ = want.iter().zip(&got).filter(|(a, b)| a != b).count();
        assert_eq!(got.len(), want.len(), "{name}");
        assert_eq!(differ, 0, "{name} ({}): {differ} of {} values differ from gguf-py's", t.kind.name(), want.len());
        kinds.push(t.kind);
    }
    for k in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4K, GgmlType::Q6K] {
        assert!(kinds.contains(&k), "the fixture has no {} tensor", k.name());
    }
}

#[test]
fn metadata_reads_as_written() {
    let g = Gguf::open(&fixture().join("quants.gguf")).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.get("general.architecture").and_then(|v| v.as_str()), Some("qwen3moe"));
    assert_eq!(g.get("qwen3moe.block_count").and_then(|v| v.as_u64()), Some(2));
    assert_eq!(g.get("shimmer.note").and_then(|v| v.as_str()), Some("a GGUF reader fixture — ünïcödé"));
    assert_eq!(g.get("shimmer.f32").and_then(|v| v.as_f64()), Some(0.125));
    assert_eq!(g.get("shimmer.flag"), Some(&shimmer_common::gguf::Value::Bool(true)));
    let tokens: Vec<&str> = g.get("shimmer.tokens").and_then(|v| v.as_array()).unwrap().iter().filter_map(|v| v.as_str()).collect();
    assert_eq!(tokens, ["a", "é", "<|im_end|>", ""]);
    let ids: Vec<u64> = g.get("shimmer.ids").and_then(|v| v.as_array()).unwrap().iter().filter_map(|v| v.as_u64()).collect();
    assert_eq!(ids, [3, 1, 4, 1, 5]);
}

#[test]
fn damaged_copies_are_refused_by_name_or_read_never_a_panic() {
    let good = std::fs::read(fixture().join("quants.gguf")).unwrap();
    let header_end = Gguf::parse(&good).unwrap().tensors.iter().map(|t| t.start).min().unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut refused = 0;
    for i in 0..3000 {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let mut b = good.clone();
        let at = (state >> 33) as usize % header_end;
        b[at] = (state >> 20) as u8;
        if i % 7 == 0 {
            b.truncate((state >> 40) as usize % good.len());
        }
        match Gguf::parse(&b) {
            Ok(header) => {
                for t in &header.tensors {
                    assert!(t.start + t.bytes <= b.len(), "{} lies outside the file", t.name);
                }
            }
            Err(e) => {
                assert!(!e.is_empty());
                refused += 1;
            }
        }
    }
    assert!(refused > 100, "only {refused} of 3000 damaged copies were refused");
}
