//! DeepSeek-style fp8-e4m3 checkpoints with block scales: the dequantisation equals torch's bit
//! for bit; served as they are (the fp8 kernels) they give exactly the logits of the dequantised
//! f32 checkpoint; and `shimmer convert` turns such a checkpoint into a container holding exactly
//! those values (rounded to the target format).

use shimmer_common::expert_blob::{self, StoredMatrix};
use shimmer_common::{quant, Checkpoint, StDtype};
use shimmer_store::container::Container;
use shimmer_store::convert::{convert, ConvertOptions, DenseQuant};
use shimmer_tests::fixture;

fn reference() -> std::collections::HashMap<String, Vec<f32>> {
    let path = fixture("deepseek_v3_fp8.dequantized.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().into_iter().map(|(name, t)| (name, t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())).collect()
}

fn bf16_round(v: &[f32]) -> Vec<u16> {
    v.iter().map(|x| half::bf16::from_f32(*x).to_bits()).collect()
}

#[test]
fn fp8_block_dequantisation_equals_torch_bit_for_bit() {
    let ckpt = Checkpoint::open(&fixture("deepseek_v3_fp8")).unwrap();
    let want = reference();
    assert!(want.len() > 20, "the fixture quantises every projection");
    for (name, expected) in &want {
        let raw = ckpt.raw(name).unwrap();
        assert_eq!(raw.dtype, StDtype::F8_E4M3, "{name}");
        let (r, c) = (raw.shape[0], raw.shape[1]);
        let scales = ckpt.get(&format!("{name}_scale_inv"), &[r.div_ceil(16), c.div_ceil(16)]).unwrap().to_f32();
        let got = quant::dequantize_fp8_blocks(raw.bytes, r, c, &scales, 16).unwrap();
        assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), expected.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "{name}");
    }
}

/// The fp8 fixture with every fp8 tensor replaced by torch's dequantised f32 values.
fn dequantised_model(dir: &std::path::Path) {
    let src = fixture("deepseek_v3_fp8");
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap();
        if f.file_name() != "model.safetensors" {
            std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
        }
    }
    let want = reference();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in st.tensors() {
        if name.ends_with("_scale_inv") {
            continue;
        }
        match want.get(&name) {
            Some(f) => out.push((name, safetensors::Dtype::F32, t.shape().to_vec(), f.iter().flat_map(|v| v.to_le_bytes()).collect())),
            None => out.push((name, t.dtype(), t.shape().to_vec(), t.data().to_vec())),
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        out.iter().map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

#[test]
fn an_fp8_checkpoint_served_as_it_is_gives_exactly_the_dequantised_models_logits() {
    let tmp = tempfile::tempdir().unwrap();
    dequantised_model(tmp.path());
    let fp8 = shimmer_coordinator::Engine::load(&fixture("deepseek_v3_fp8")).unwrap();
    let f32s = shimmer_coordinator::Engine::load(tmp.path()).unwrap();
    let tokens = [1u32, 5, 9, 2, 7, 3, 11, 4];
    let (a, b) = (fp8.logits_all(&tokens).unwrap(), f32s.logits_all(&tokens).unwrap());
    assert!(a.iter().all(|x| x.is_finite()));
    assert_eq!(a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    // And fp8 stays fp8 in memory: a quarter of the f32 model's expert bytes, plus block scales.
    let bytes = |dir: &std::path::Path| {
        let spec = shimmer_common::ModelSpec::from_dir(dir).unwrap();
        shimmer_experts::InProcessExperts::load(&Checkpoint::open(dir).unwrap(), &spec).unwrap().bytes()
    };
    let (a, b) = (bytes(&fixture("deepseek_v3_fp8")), bytes(tmp.path()));
    assert!(a * 3 < b, "fp8 experts hold {a} bytes, f32 {b}");
}

#[test]
fn an_fp8_checkpoint_converts_to_exactly_its_dequantised_values_and_runs() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("c");
    convert(
        &fixture("deepseek_v3_fp8"),
        &dir,
        ConvertOptions { expert_quant: quant::QuantScheme::Bf16, dense_quant: DenseQuant::Bf16, head_quant: None },
        &mut |_| {},
    )
    .unwrap();
    let want = reference();
    // Dense projections: bf16 of the dequantised values; routers untouched.
    let dense = Checkpoint::open_files(&dir, &["dense.safetensors"]).unwrap();
    let name = "model.layers.0.self_attn.q_a_proj.weight";
    let t = dense.raw(name).unwrap();
    assert_eq!(t.dtype, StDtype::BF16);
    assert_eq!(t.bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect::<Vec<_>>(), bf16_round(&want[name]));
    assert!(!dense.contains(&format!("{name}_scale_inv")));
    assert_eq!(dense.raw("model.layers.1.mlp.gate.weight").unwrap().dtype, StDtype::F32, "routers stay as stored");
    // Experts: each blob holds bf16 of the dequantised gate, up and down.
    let spec = shimmer_common::ModelSpec::from_dir(&dir).unwrap();
    let c = Container::open(&dir, &spec).unwrap();
    let file = std::fs::read(c.experts_path()).unwrap();
    for e in [0usize, 7, 15] {
        let loc = c.location(1, e).unwrap();
        let blob = &file[loc.offset as usize..(loc.offset + loc.length) as usize];
        let stored = expert_blob::decode(blob, c.scheme, c.shape, Some((loc.id, loc.checksum)), "test").unwrap();
        assert!(stored.bias.is_none());
        for (m, part) in stored.matrices.iter().zip(["gate_proj", "up_proj", "down_proj"]) {
            let StoredMatrix::Bf16 { words, .. } = m else { panic!("bf16 container") };
            assert_eq!(words, &bf16_round(&want[&format!("model.layers.1.mlp.experts.{e}.{part}.weight")]), "expert {e} {part}");
        }
    }
    // And the converted model runs, also quantised further to int4.
    let engine = shimmer_coordinator::Engine::load(&dir).unwrap();
    assert_eq!(engine.logits_all(&[1, 2, 3, 4]).unwrap().len(), 4 * spec.vocab_size);
    let out4 = tempfile::tempdir().unwrap();
    convert(
        &fixture("deepseek_v3_fp8"),
        out4.path(),
        ConvertOptions { expert_quant: quant::QuantScheme::Int4 { group: 32 }, dense_quant: DenseQuant::Int8, head_quant: None },
        &mut |_| {},
    )
    .unwrap();
    let engine = shimmer_coordinator::Engine::load(out4.path()).unwrap();
    assert!(engine.logits_all(&[1, 2, 3, 4]).unwrap().iter().all(|x| x.is_finite()));
}

/// DeepSeek-V4's release form (`deepseek_v4_fp8`: UE8M0 `.scale` beside fp8 and packed-FP4
/// weights): a damaged scale is refused naming the tensor, never read as another number.
#[test]
fn a_damaged_release_scale_is_refused_by_name() {
    let load = |dir: &std::path::Path| shimmer_coordinator::Engine::load(dir).err().map(|e| e.to_string()).unwrap_or_default();
    let st = |dir: &std::path::Path| dir.join("model.safetensors");
    // A scale missing: the fp8 weight names both spellings it looked for.
    let dir = shimmer_tests::copy_fixture("deepseek_v4_fp8");
    shimmer_tests::edit_safetensors_header(&st(dir.path()), |h| {
        let v = h.remove("layers.1.attn.wq_a.scale").unwrap();
        h.insert("layers.1.attn.wq_a.scales".into(), v);
    });
    let e = load(dir.path());
    assert!(e.contains("layers.1.attn.wq_a.weight") && e.contains("layers.1.attn.wq_a.scale"), "{e}");
    // A scale grid of the wrong shape, for fp8 and for FP4.
    for (tensor, shape) in [("layers.1.attn.wq_b.scale", [2, 2]), ("layers.1.ffn.experts.0.w1.scale", [8, 4])] {
        let dir = shimmer_tests::copy_fixture("deepseek_v4_fp8");
        shimmer_tests::edit_safetensors_header(&st(dir.path()), |h| h[tensor]["shape"] = serde_json::json!(shape));
        let e = match tensor.contains("experts") {
            // Experts are read when first chosen: through the expert loader.
            true => {
                let ckpt = Checkpoint::open(dir.path()).unwrap();
                let spec = shimmer_common::ModelSpec::from_dir(dir.path()).unwrap();
                shimmer_experts::weights::load_expert(&ckpt, &spec, 1, 0).err().map(|e| e.to_string()).unwrap_or_default()
            }
            false => load(dir.path()),
        };
        assert!(e.contains(tensor) && e.contains("shape"), "{tensor}: {e}");
    }
    // The UE8M0 NaN (255) in a scale.
    let dir = shimmer_tests::copy_fixture("deepseek_v4_fp8");
    let mut bytes = std::fs::read(st(dir.path())).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let at = header["layers.1.attn.wo_b.scale"]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + n + at] = 0xff;
    std::fs::write(st(dir.path()), bytes).unwrap();
    let e = load(dir.path());
    assert!(e.contains("layers.1.attn.wo_b.scale") && e.contains("NaN"), "{e}");
}

/// The release's FP4 experts are read as the MXFP4 they are: each expert's values are the e2m1
/// codes times the UE8M0 scales, as transformers' dequantisation defines them.
#[test]
fn release_fp4_experts_are_their_codes_times_their_scales() {
    let dir = fixture("deepseek_v4_fp8");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let spec = shimmer_common::ModelSpec::from_dir(&dir).unwrap();
    let expert = shimmer_experts::weights::load_expert(&ckpt, &spec, 2, 5).unwrap();
    let raw = ckpt.raw("layers.2.ffn.experts.5.w2.weight").unwrap();
    let scales = ckpt.raw("layers.2.ffn.experts.5.w2.scale").unwrap();
    let (rows, cols) = (raw.shape[0], raw.shape[1] * 2);
    let down = &expert.down;
    assert_eq!((down.rows, down.cols), (rows, cols));
    let mut row = vec![0.0f32; cols];
    for r in 0..rows {
        down.row_f32(r, &mut row);
        for (c, got) in row.iter().enumerate() {
            let byte = raw.bytes[r * cols / 2 + c / 2];
            let code = if c % 2 == 0 { byte & 0xf } else { byte >> 4 };
            let want = quant::E2M1[code as usize] * quant::e8m0_to_f32(scales.bytes[r * scales.shape[1] + c / 32]);
            assert_eq!(got.to_bits(), want.to_bits(), "row {r} column {c}");
        }
    }
}

/// Inkling 2's MXFP8 release form (`inkling2_mxfp8`) is the `inkling2` fixture's model: every
/// routed expert reads back as exactly the values the bf16 checkpoint holds; a damaged scale is
/// refused naming the tensor.
#[test]
fn mxfp8_release_experts_are_their_bf16_twins_values_and_damage_is_named() {
    let (mx, bf) = (fixture("inkling2_mxfp8"), fixture("inkling2"));
    let (cm, cb) = (Checkpoint::open(&mx).unwrap(), Checkpoint::open(&bf).unwrap());
    let spec = shimmer_common::ModelSpec::from_dir(&mx).unwrap();
    for (layer, expert) in [(0, 0), (1, 7), (3, 4)] {
        let a = shimmer_experts::weights::load_expert(&cm, &spec, layer, expert).unwrap();
        let b = shimmer_experts::weights::load_expert(&cb, &spec, layer, expert).unwrap();
        for (x, y) in [(&a.gate, &b.gate), (&a.up, &b.up), (&a.down, &b.down)] {
            same_values_and_products(x, y, &format!("layer {layer} expert {expert}"));
        }
        // Held as fp8 with its group scales: about half of what bf16 takes.
        assert!(a.bytes() * 100 < b.bytes() * 60, "{} bytes against bf16's {}", a.bytes(), b.bytes());
    }
    let st = |dir: &std::path::Path| dir.join("model.safetensors");
    let name = "model.llm.layers.1.mlp.experts.w13_weight_scale";
    let dir = shimmer_tests::copy_fixture("inkling2_mxfp8");
    shimmer_tests::edit_safetensors_header(&st(dir.path()), |h| h[name]["shape"] = serde_json::json!([8, 64, 1]));
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let e = shimmer_experts::weights::load_expert(&ckpt, &spec, 1, 0).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains(name) && e.contains("UE8M0"), "{e}");
    let dir = shimmer_tests::copy_fixture("inkling2_mxfp8");
    let mut bytes = std::fs::read(st(dir.path())).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let at = header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + n + at] = 0xff;
    std::fs::write(st(dir.path()), bytes).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let e = shimmer_experts::weights::load_expert(&ckpt, &spec, 1, 0).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains(name) && e.contains("NaN"), "{e}");
}

/// `x` and `y` hold the same values (bit for bit) and give the same products with any activations
/// (the same canonical dot, whatever form each is held in).
fn same_values_and_products(x: &shimmer_kernels::Matrix, y: &shimmer_kernels::Matrix, what: &str) {
    assert_eq!((x.rows, x.cols), (y.rows, y.cols), "{what}");
    let (mut rx, mut ry) = (vec![0.0f32; x.cols], vec![0.0f32; y.cols]);
    for r in 0..x.rows {
        x.row_f32(r, &mut rx);
        y.row_f32(r, &mut ry);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&rx), bits(&ry), "{what}: row {r}");
    }
    let act: Vec<f32> = (0..x.cols).map(|c| ((c * 37 % 23) as f32 - 11.0) * 0.173).collect();
    let (mut ox, mut oy) = (vec![0.0f32; x.rows], vec![0.0f32; y.rows]);
    x.matvec(&act, &mut ox);
    y.matvec(&act, &mut oy);
    assert_eq!(ox.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), oy.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), "{what}: products");
}

/// Overwrites the bytes at `at` of tensor `name`'s data in a safetensors file.
fn poke(path: &std::path::Path, name: &str, at: usize, data: &[u8]) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = 8 + n + header[name]["data_offsets"][0].as_u64().unwrap() as usize + at;
    bytes[start..start + data.len()].copy_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// Inkling's NVFP4 release form (`inkling_nvfp4`, ModelOpt's layout) is the `inkling` fixture's
/// model: every routed expert reads back as exactly the values the bf16 checkpoint holds (its
/// per-expert factors powers of two), with the same products, in about 1.25 bytes a weight.
#[test]
fn nvfp4_release_experts_are_their_bf16_twins_values() {
    let (nv, bf) = (fixture("inkling_nvfp4"), fixture("inkling"));
    let (cn, cb) = (Checkpoint::open(&nv).unwrap(), Checkpoint::open(&bf).unwrap());
    let spec = shimmer_common::ModelSpec::from_dir(&nv).unwrap();
    let moe: Vec<usize> = (0..spec.layers.len()).filter(|l| spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).collect();
    assert!(!moe.is_empty());
    for &layer in &moe {
        for expert in [0, 1, 2, 7] {
            let a = shimmer_experts::weights::load_expert(&cn, &spec, layer, expert).unwrap();
            let b = shimmer_experts::weights::load_expert(&cb, &spec, layer, expert).unwrap();
            for (x, y) in [(&a.gate, &b.gate), (&a.up, &b.up), (&a.down, &b.down)] {
                same_values_and_products(x, y, &format!("layer {layer} expert {expert}"));
            }
            assert!(a.bytes() * 100 < b.bytes() * 70, "{} bytes against bf16's {}", a.bytes(), b.bytes());
        }
    }
}

/// Each NVFP4 value is `e2m1 · (e4m3 scale · factor)`, the group's scale rounded once to f32 —
/// checked with a factor that is not a power of two; damaged factors, scales and shapes are
/// refused naming the tensor.
#[test]
fn nvfp4_values_are_codes_times_scales_times_factors_and_damage_is_named() {
    let spec = shimmer_common::ModelSpec::from_dir(&fixture("inkling_nvfp4")).unwrap();
    let layer = (0..spec.layers.len()).find(|l| spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).unwrap();
    let base = format!("model.llm.layers.{layer}.mlp.experts.w2_weight");
    let st = |dir: &std::path::Path| dir.join("model.safetensors");
    let load = |dir: &std::path::Path| {
        let ckpt = Checkpoint::open(dir).unwrap();
        shimmer_experts::weights::load_expert(&ckpt, &spec, layer, 1)
    };
    let dir = shimmer_tests::copy_fixture("inkling_nvfp4");
    let factor = 0.3f32;
    poke(&st(dir.path()), &format!("{base}_scale_2"), 4, &factor.to_le_bytes());
    let down = load(dir.path()).unwrap().down;
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let (codes, scales) = (ckpt.raw(&base).unwrap(), ckpt.raw(&format!("{base}_scale")).unwrap());
    assert_eq!(scales.dtype, StDtype::F8_E4M3);
    let (rows, bpr, gpr) = (codes.shape[1], codes.shape[2], scales.shape[2]);
    let cols = bpr * 2;
    assert_eq!((down.rows, down.cols), (rows, cols));
    let mut row = vec![0.0f32; cols];
    for r in 0..rows {
        down.row_f32(r, &mut row);
        for (c, got) in row.iter().enumerate() {
            let byte = codes.bytes[(rows + r) * bpr + c / 2];
            let code = if c % 2 == 0 { byte & 0xf } else { byte >> 4 };
            let want = quant::E2M1[code as usize] * (quant::fp8_e4m3_to_f32(scales.bytes[(rows + r) * gpr + c / 16]) * factor);
            assert_eq!(got.to_bits(), want.to_bits(), "row {r} column {c}");
        }
    }
    // A factor that is not finite; an fp8 NaN scale; scales and factors of the wrong shape; the
    // factors missing.
    let dir = shimmer_tests::copy_fixture("inkling_nvfp4");
    poke(&st(dir.path()), &format!("{base}_scale_2"), 4, &f32::INFINITY.to_le_bytes());
    let e = load(dir.path()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains(&format!("{base}_scale_2")) && e.contains("inf"), "{e}");
    let dir = shimmer_tests::copy_fixture("inkling_nvfp4");
    poke(&st(dir.path()), &format!("{base}_scale"), rows * gpr, &[0x7f]);
    let e = load(dir.path()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains(&format!("{base}_scale")) && e.contains("NaN"), "{e}");
    for (tensor, shape, says) in
        [(format!("{base}_scale"), serde_json::json!([8, rows * gpr]), "fp8-e4m3"), (format!("{base}_scale_2"), serde_json::json!([4, 2]), "one factor each")]
    {
        let dir = shimmer_tests::copy_fixture("inkling_nvfp4");
        shimmer_tests::edit_safetensors_header(&st(dir.path()), |h| h[&tensor]["shape"] = shape.clone());
        let e = load(dir.path()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(&tensor) && e.contains(says), "{tensor}: {e}");
    }
    let dir = shimmer_tests::copy_fixture("inkling_nvfp4");
    shimmer_tests::edit_safetensors_header(&st(dir.path()), |h| {
        let v = h.remove(&format!("{base}_scale_2")).unwrap();
        h.insert(format!("{base}_factor"), v);
    });
    let e = load(dir.path()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains(&base) && e.contains("_scale_2"), "{e}");
}
