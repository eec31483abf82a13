//! The header reader against files written here, and each refusal by name.

use super::*;

/// A GGUF v3 file: metadata entries (key, type, value bytes), then tensors (name, dims, type id,
/// data), the data section aligned to 32.
fn gguf(metadata: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[u64], u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(MAGIC.to_le_bytes());
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((metadata.len() as u64).to_le_bytes());
    let string = |b: &mut Vec<u8>, s: &str| {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    };
    for (k, t, v) in metadata {
        string(&mut b, k);
        b.extend(t.to_le_bytes());
        b.extend(v);
    }
    let mut offset = 0u64;
    for (name, dims, t, data) in tensors {
        string(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in *dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(t.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (data.len() as u64).div_ceil(32) * 32;
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for (_, _, _, data) in tensors {
        b.extend(data);
        while b.len() % 32 != 0 {
            b.push(0);
        }
    }
    b
}

fn str_value(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend(s.as_bytes());
    v
}

fn sample() -> Vec<u8> {
    let mut tokens = Vec::new();
    tokens.extend(8u32.to_le_bytes());
    tokens.extend(3u64.to_le_bytes());
    for t in ["a", "é", "<s>"] {
        tokens.extend(str_value(t));
    }
    let f32s: Vec<u8> = [1.5f32, -2.0, 0.25, 8.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut q8 = half::f16::from_f32(0.5).to_le_bytes().to_vec();
    q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
    gguf(
        &[("general.architecture", 8, str_value("qwen3moe")), ("qwen3moe.block_count", 4, 2u32.to_le_bytes().to_vec()), ("tokenizer.ggml.tokens", 9, tokens)],
        &[("a.weight", &[2, 2], 0, f32s), ("b.weight", &[32, 1], 8, q8)],
    )
}

#[test]
fn a_written_file_reads_back() {
    let Header { version, metadata: meta, tensors } = Gguf::parse(&sample()).unwrap();
    assert_eq!(version, 3);
    assert_eq!(meta["general.architecture"].as_str(), Some("qwen3moe"));
    assert_eq!(meta["qwen3moe.block_count"].as_u64(), Some(2));
    let tokens: Vec<&str> = meta["tokenizer.ggml.tokens"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert_eq!(tokens, ["a", "é", "<s>"]);
    assert_eq!(tensors[0].shape(), vec![2, 2]);
    assert_eq!(tensors[1].kind, GgmlType::Q8_0);
    let bytes = sample();
    let t = &tensors[0];
    assert_eq!(dequantize(t.kind, &bytes[t.start..t.start + t.bytes]), vec![1.5, -2.0, 0.25, 8.0]);
    let t = &tensors[1];
    let q = dequantize(t.kind, &bytes[t.start..t.start + t.bytes]);
    assert_eq!(q[0], -8.0);
    assert_eq!(q[31], 7.5);
}

#[test]
fn damaged_headers_are_refused_by_name() {
    let good = sample();
    let refuse = |b: &[u8], needle: &str| {
        let e = Gguf::parse(b).err().unwrap_or_else(|| panic!("accepted; wanted an error naming {needle:?}"));
        assert!(e.contains(needle), "{e:?} does not name {needle:?}");
    };
    refuse(&good[..3], "too short");
    let mut b = good.clone();
    b[0] = b'X';
    refuse(&b, "not a GGUF");
    let mut b = good.clone();
    b[4] = 1;
    refuse(&b, "version 1");
    let mut b = good.clone();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    refuse(&b, "tensors");
    let mut b = good.clone();
    b[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    refuse(&b, "metadata entries");
    // The first key's length.
    let mut b = good.clone();
    b[24..32].copy_from_slice(&(1u64 << 50).to_le_bytes());
    refuse(&b, "metadata key 0");
    // Truncated anywhere in the header: refused, never a panic.
    for cut in 0..good.len() {
        let _ = Gguf::parse(&good[..cut]);
    }
    // A tensor whose data would run past the file.
    refuse(&good[..good.len() - 40], "runs past the end");
    let bad_type = gguf(&[], &[("x", &[4], 3, vec![0; 20])]);
    refuse(&bad_type, "Q4_1");
    let ragged = gguf(&[], &[("x", &[33], 8, vec![0; 68])]);
    refuse(&ragged, "multiple of its block");
    let zero = gguf(&[], &[("x", &[0, 4], 0, vec![])]);
    refuse(&zero, "empty");
    let twice = gguf(&[], &[("x", &[1], 0, vec![0; 4]), ("x", &[1], 0, vec![0; 4])]);
    refuse(&twice, "appears twice");
    let deep = {
        // An array of arrays of … five deep.
        let mut v = Vec::new();
        for _ in 0..5 {
            v.extend(9u32.to_le_bytes());
            v.extend(1u64.to_le_bytes());
        }
        v.extend(0u32.to_le_bytes());
        v.extend(0u64.to_le_bytes());
        gguf(&[("k", 9, v)], &[])
    };
    refuse(&deep, "deeper");
    let huge_array = gguf(&[("k", 9, [8u32.to_le_bytes().to_vec(), (1u64 << 30).to_le_bytes().to_vec()].concat())], &[]);
    refuse(&huge_array, "elements");
    let bad_bool = gguf(&[("k", 7, vec![2])], &[]);
    refuse(&bad_bool, "bool");
    let bad_align = gguf(&[("general.alignment", 4, 24u32.to_le_bytes().to_vec())], &[]);
    refuse(&bad_align, "power of two");
}

#[test]
fn q4k_and_q6k_follow_ggml_layouts() {
    // Q4_K: scales 1..8 and mins 0 on d = 1, dmin = 1; every nibble 3 → sub-block j is 3·(j+1).
    let mut b = half::f16::from_f32(1.0).to_le_bytes().to_vec();
    b.extend(half::f16::from_f32(1.0).to_le_bytes());
    let (sc, mn) = ([1u8, 2, 3, 4, 5, 6, 7, 8], [0u8; 8]);
    let mut packed = [0u8; 12];
    for i in 0..4 {
        packed[i] = sc[i] | ((sc[i + 4] >> 4) << 6);
        packed[4 + i] = mn[i] | ((mn[i + 4] >> 4) << 6);
        packed[8 + i] = (sc[i + 4] & 0x0f) | ((mn[i + 4] & 0x0f) << 4);
    }
    assert_eq!(q4k_scales_mins(&packed), (sc, mn));
    b.extend(packed);
    b.extend([0x33u8; 128]);
    let v = dequantize(GgmlType::Q4K, &b);
    for j in 0..8 {
        assert!(v[j * 32..j * 32 + 32].iter().all(|&x| x == 3.0 * (j + 1) as f32), "sub-block {j}");
    }
    // Q6_K: every 6-bit value 33 (→ 1), scales 1..16, d = 1: value e is scale e/16.
    let mut b = vec![0x11u8; 128];
    b.extend([0xaau8; 64]);
    b.extend((1..=16).map(|s: i8| s as u8));
    b.extend(half::f16::from_f32(1.0).to_le_bytes());
    let v = dequantize(GgmlType::Q6K, &b);
    for (e, x) in v.iter().enumerate() {
        assert_eq!(*x, (e / 16 + 1) as f32, "value {e}");
    }
}
