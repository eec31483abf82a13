//! GGUF import: each family's model as llama.cpp's own converter writes it (Q8_0, with the
//! tensors whose rows Q8_0 cannot hold in F16/F32), imported by the real `shimmer convert --from
//! model.gguf`, runs with the logits transformers computes on the same weights dequantised by
//! gguf-py, greedy continuations token for token, and the source tokenizer's and chat template's
//! behaviour (`tests/oracle/make_gguf_models.py` makes the fixtures). Tolerance as
//! `tests/parity.rs`: both sides compute in f32 from identical values.

use std::path::{Path, PathBuf};

use shimmer_coordinator::engine::{Engine, GenerateOptions};
use shimmer_coordinator::sampling::SamplingParams;
use shimmer_tests::{assert_clean_failure, fixture, oracle, oracle_logits, shimmer};

const LOGIT_TOLERANCE: f32 = 5e-4;

/// The families with a GGUF fixture, as `gguf/<family>` fixture names.
fn gguf_models() -> Vec<String> {
    let root = fixture("gguf");
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("model.q8_0.gguf").is_file())
        .map(|e| format!("gguf/{}", e.file_name().to_string_lossy()))
        .collect();
    names.sort();
    assert!(names.len() >= 3, "GGUF fixtures: {names:?}");
    names
}

fn import(name: &str, dir: &Path) -> PathBuf {
    let to = dir.join(name.replace('/', "_"));
    let gguf = fixture(name).join("model.q8_0.gguf");
    let out = shimmer(&["convert", "--from", gguf.to_str().unwrap(), "--to", to.to_str().unwrap(), "--quiet"]);
    assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
    to
}

#[test]
fn imported_gguf_models_match_transformers_on_gguf_pys_weights() {
    let tmp = tempfile::tempdir().unwrap();
    for name in gguf_models() {
        let dir = import(&name, tmp.path());
        let engine = Engine::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let o = oracle(&name);
        let mut worst = 0.0f32;
        for (i, p) in o.prompts.iter().enumerate() {
            assert_eq!(engine.encode_prompt(&p.text).unwrap(), p.ids, "{name}: {:?}", p.text);
            let ids: Vec<u32> = p.ids.iter().chain(&p.greedy).copied().collect();
            let (want, vocab) = oracle_logits(&name, i);
            assert_eq!(vocab, engine.spec.vocab_size, "{name}");
            let got = engine.logits_all(&ids).unwrap();
            assert_eq!(got.len(), want.len());
            for (pos, (g, w)) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)).enumerate() {
                worst = g.iter().zip(w).fold(worst, |m, (a, b)| m.max((a - b).abs()));
                if p.margin[pos] >= o.near_tie {
                    assert_eq!(shimmer_coordinator::sampling::argmax(g) as u32, p.argmax[pos], "{name} prompt {i} position {pos}");
                }
            }
            let opts = GenerateOptions { max_tokens: p.greedy.len(), sampling: SamplingParams::default(), stop: vec![] };
            let mut session = engine.new_session();
            let gen = engine.generate(&mut session, &p.ids, &opts, |_| true).unwrap();
            assert_eq!(gen.output_ids, p.greedy, "{name} prompt {i}: greedy continuation");
            assert_eq!(gen.text, p.greedy_text, "{name} prompt {i}: text");
        }
        eprintln!("{name}: largest |logit - oracle| = {worst:e} (tolerance {LOGIT_TOLERANCE:e})");
        assert!(worst <= LOGIT_TOLERANCE, "{name}: largest logit difference {worst}");
        let mut eos = engine.eos_ids.clone();
        eos.sort();
        assert!(o.eos_ids.iter().all(|id| eos.contains(id)), "{name}: stop ids {eos:?} miss some of {:?}", o.eos_ids);
    }
}

#[test]
fn imported_tokenizers_and_templates_behave_as_the_source() {
    let tmp = tempfile::tempdir().unwrap();
    for name in gguf_models() {
        let dir = import(&name, tmp.path());
        let engine = Engine::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let o = oracle(&name);
        for t in &o.tokenizer {
            assert_eq!(engine.tokenizer.encode(&t.text, true).unwrap(), t.ids, "{name}: {:?}", t.text);
            assert_eq!(engine.tokenizer.encode(&t.text, false).unwrap(), t.ids_no_special, "{name}: {:?}", t.text);
            assert_eq!(engine.tokenizer.decode(&t.ids, false).unwrap(), t.decoded, "{name}: {:?}", t.text);
            assert_eq!(engine.tokenizer.decode(&t.ids, true).unwrap(), t.decoded_skip_special, "{name}: {:?}", t.text);
        }
        assert!(!o.chat.is_empty());
        for c in &o.chat {
            let text = engine.chat.render(&c.messages, c.add_generation_prompt).unwrap();
            assert_eq!(text, c.text, "{name}: add_generation_prompt={}", c.add_generation_prompt);
            assert_eq!(engine.tokenizer.encode(&text, false).unwrap(), c.ids, "{name}: chat ids");
        }
    }
}

#[test]
fn import_refuses_what_it_cannot_do_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = fixture("gguf/qwen3_moe/model.q8_0.gguf");
    let g = gguf.to_str().unwrap();
    // Into a directory that holds something: nothing is overwritten.
    let full = tmp.path().join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("keep.txt"), "mine").unwrap();
    assert_clean_failure(&shimmer(&["convert", "--from", g, "--to", full.to_str().unwrap()]), &["not empty"]);
    assert_eq!(std::fs::read_to_string(full.join("keep.txt")).unwrap(), "mine");
    // Container formats are checked before anything is imported.
    let to = tmp.path().join("x");
    assert_clean_failure(&shimmer(&["convert", "--from", g, "--to", to.to_str().unwrap(), "--quant", "int9"]), &["--quant", "int9"]);
    assert_clean_failure(&shimmer(&["convert", "--from", g, "--to", full.to_str().unwrap(), "--quant", "int8"]), &["not empty"]);
    assert!(!to.exists() && !tmp.path().join("x.gguf-import").exists());
    assert_clean_failure(&shimmer(&["convert", "--from", g, "--to", to.to_str().unwrap(), "--dtype", "f8"]), &["--dtype", "f8"]);
    // A GGUF of an architecture no family reads: the reader's own fixture says `qwen3moe` but has
    // none of its keys.
    let reader_fixture = fixture("gguf/quants.gguf");
    assert_clean_failure(&shimmer(&["convert", "--from", reader_fixture.to_str().unwrap(), "--to", to.to_str().unwrap()]), &["quants.gguf", "`qwen3moe."]);
    assert!(!to.join("config.json").exists());
    // Run directly, a GGUF gets the command that imports it.
    assert_clean_failure(&shimmer(&["generate", "--model", g, "--prompt", "hi", "--max-tokens", "2"]), &["a GGUF file", "shimmer convert --from"]);
}

/// `--quant`/`--dense-quant` with a GGUF: one step gives exactly the container the two steps
/// (import, then convert) give, and leaves no staging directory.
#[test]
fn a_gguf_converts_to_a_container_in_one_step_as_in_two() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = fixture("gguf/olmoe/model.q8_0.gguf");
    let path = |name: &str| tmp.path().join(name);
    let run = |args: &[&str]| {
        let out = shimmer(args);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let g = gguf.to_str().unwrap();
    run(&["convert", "--from", g, "--to", path("checkpoint").to_str().unwrap(), "--quiet"]);
    run(&[
        "convert",
        "--from",
        path("checkpoint").to_str().unwrap(),
        "--to",
        path("two").to_str().unwrap(),
        "--quant",
        "int4-g32",
        "--dense-quant",
        "int8",
        "--quiet",
    ]);
    run(&["convert", "--from", g, "--to", path("one").to_str().unwrap(), "--quant", "int4-g32", "--dense-quant", "int8", "--quiet"]);
    for file in ["experts.safetensors", "dense.safetensors", "config.json", "tokenizer.json"] {
        assert!(std::fs::read(path("one").join(file)).unwrap() == std::fs::read(path("two").join(file)).unwrap(), "{file} differs");
    }
    assert!(!path("one.gguf-import").exists(), "the staging directory is removed");
    let engine = Engine::load(&path("one")).unwrap();
    assert!(engine.logits_all(&[1, 2, 3]).unwrap().iter().all(|x| x.is_finite()));
}

#[test]
fn bf16_import_rounds_every_value_of_the_exact_import_and_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = fixture("gguf/mixtral/model.q8_0.gguf");
    let convert = |dtype: &str| {
        let to = tmp.path().join(dtype);
        let out = shimmer(&["convert", "--from", gguf.to_str().unwrap(), "--to", to.to_str().unwrap(), "--dtype", dtype, "--quiet"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        to
    };
    let (exact, rounded) = (convert("exact"), convert("bf16"));
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(rounded.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    let exact_bytes = std::fs::read(exact.join("model.safetensors")).unwrap();
    let rounded_bytes = std::fs::read(rounded.join("model.safetensors")).unwrap();
    let (exact_st, rounded_st) = (safetensors::SafeTensors::deserialize(&exact_bytes).unwrap(), safetensors::SafeTensors::deserialize(&rounded_bytes).unwrap());
    let mut kinds = std::collections::BTreeSet::new();
    for (name, e) in exact_st.tensors() {
        let r = rounded_st.tensor(&name).unwrap();
        assert_eq!(r.dtype(), safetensors::Dtype::BF16, "{name}");
        assert_eq!(r.shape(), e.shape(), "{name}");
        kinds.insert(format!("{:?}", e.dtype()));
        let values: Vec<f32> = match e.dtype() {
            safetensors::Dtype::F32 => e.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            safetensors::Dtype::F16 => e.data().chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => panic!("{name}: exact import wrote {other:?}"),
        };
        let want: Vec<u8> = values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
        assert!(want == r.data(), "{name}: not the bf16 rounding of the exact import");
    }
    // The exact import wrote the Q8_0 tensors as f32.
    assert!(kinds.contains("F32"), "{kinds:?}");
    let engine = Engine::load(&rounded).unwrap();
    let p = &oracle("gguf/mixtral").prompts[0];
    let opts = GenerateOptions { max_tokens: 8, sampling: SamplingParams::default(), stop: vec![] };
    let gen = engine.generate(&mut engine.new_session(), &p.ids, &opts, |_| true).unwrap();
    assert!(!gen.output_ids.is_empty());
}

/// Vocabularies as llama.cpp ships them for its own tokenizer tests, each rebuilt as
/// `tokenizer.json`, encode llama.cpp's test texts to the ids transformers gives them (their
/// `.out` files) and decode them back: Llama 2's SentencePiece vocabulary whole, and byte-level
/// BPE under each named split (`qwen2`, `qwen35`, `llama-bpe`, `glm4`, `deepseek-v3`), cut to what
/// the texts use by `tests/oracle/make_gguf_vocabs.py`, which checked the full vocabularies
/// against the recorded ids first.
#[test]
fn vocabularies_encode_as_their_tokenizers_do() {
    let dir = fixture("gguf/vocab");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "gguf")).collect();
    files.sort();
    let names: Vec<String> = files.iter().map(|p| p.file_stem().unwrap().to_string_lossy().into_owned()).collect();
    for split in ["llama-spm", "qwen2", "qwen35", "llama-bpe", "glm4", "deepseek-v3"] {
        assert!(names.contains(&format!("ggml-vocab-{split}")), "no vocabulary for {split}: {names:?}");
    }
    for (path, name) in files.iter().zip(&names) {
        let json = shimmer_store::gguf_import::tokenizer_json(path).unwrap_or_else(|e| panic!("{name}: {e}"));
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("tokenizer.json"), serde_json::to_vec(&json).unwrap()).unwrap();
        let tokenizer = shimmer_common::tokenizer::Tokenizer::from_dir(tmp.path()).unwrap();
        let inputs = std::fs::read_to_string(path.with_extension("gguf.inp")).unwrap();
        let outputs = std::fs::read_to_string(path.with_extension("gguf.out")).unwrap();
        let texts: Vec<&str> = inputs.split("\n__ggml_vocab_test__\n").collect();
        let ids: Vec<Vec<u32>> = outputs.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
        assert!(texts.len() >= 30 && texts.len() <= ids.len() + 1, "{name}: {} texts, {} id lines", texts.len(), ids.len());
        let sentencepiece = name.ends_with("-spm");
        let mut checked = 0;
        for (text, want) in texts.iter().zip(&ids) {
            assert_eq!(&tokenizer.encode(text, false).unwrap(), want, "{name}: {text:?}");
            // SentencePiece drops the space it puts in front, so a text that begins with one does
            // not come back as it was; byte-level BPE gives every byte back.
            if !sentencepiece || (!want.is_empty() && !text.starts_with(' ')) {
                assert_eq!(tokenizer.decode(want, true).unwrap(), *text, "{name}: {text:?} decodes back");
            }
            checked += 1;
        }
        assert!(checked >= 30, "{name}");
        if sentencepiece {
            // With special tokens, BOS comes first (`add_bos_token`).
            assert_eq!(tokenizer.encode("Hello", true).unwrap()[0], 1);
        }
    }
}
