//! `--session FILE`: a conversation's KV cache and history survive the process, for GQA and MLA
//! models alike; continuing in a new process gives byte-identical output to one uninterrupted
//! process, without re-prefilling; files from another model, version or geometry, or damaged
//! ones, are refused with a clear message.

use std::io::Write;
use std::process::{Command, Stdio};

use shimmer_common::checksum::xxh3;
use shimmer_coordinator::engine::{Engine, GenerateOptions};
use shimmer_coordinator::sampling::SamplingParams;
use shimmer_tests::{assert_clean_failure, fixture, oracle, shimmer, shimmer_bin};

fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn a_generate_conversation_split_across_processes_matches_one_process() {
    for name in ["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_next", "glm_moe_dsa", "kimi_linear", "deepseek_v4", "inkling_text", "inkling2_text"]
    {
        let dir = fixture(name);
        let o = oracle(name);
        let (p1, p2) = (&o.prompts[0].ids, &o.prompts[1].ids);
        // One process: two turns on one session.
        let engine = Engine::load(&dir).unwrap();
        let opts = GenerateOptions { max_tokens: 12, sampling: SamplingParams::default(), stop: vec![] };
        let mut s = engine.new_session();
        let g1 = engine.generate(&mut s, p1, &opts, |_| true).unwrap();
        let second: Vec<u32> = p1.iter().chain(&g1.output_ids).chain(p2).copied().collect();
        let g2 = engine.generate(&mut s, &second, &opts, |_| true).unwrap();

        // Two processes sharing a session file.
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("conv.session");
        let run = |ids: &[u32]| {
            shimmer(&[
                "generate",
                "--model",
                dir.to_str().unwrap(),
                "--prompt-ids",
                &ids_arg(ids),
                "--max-tokens",
                "12",
                "--session",
                file.to_str().unwrap(),
                "--json",
            ])
        };
        let out1 = run(p1);
        assert!(out1.status.success(), "{}", String::from_utf8_lossy(&out1.stderr));
        let v1: serde_json::Value = serde_json::from_slice(&out1.stdout).unwrap();
        assert_eq!(v1["output_ids"], serde_json::json!(g1.output_ids), "{name}: first turn");
        let out2 = run(p2);
        assert!(out2.status.success(), "{}", String::from_utf8_lossy(&out2.stderr));
        let v2: serde_json::Value = serde_json::from_slice(&out2.stdout).unwrap();
        assert_eq!(v2["output_ids"], serde_json::json!(g2.output_ids), "{name}: second turn");
        assert_eq!(v2["text"].as_str().unwrap(), g2.text, "{name}: byte-identical text");
        // No re-prefill: everything the first process fed is reused; only the last sampled token
        // and the new prompt are prefilled.
        let stderr = String::from_utf8_lossy(&out2.stderr);
        let want = format!("{} cached positions reused, {} to prefill", p1.len() + g1.output_ids.len() - 1, p2.len() + 1);
        assert!(stderr.contains(&want), "{name}: {stderr}");
    }
}

fn chat(model: &std::path::Path, session: Option<&std::path::Path>, input: &str) -> String {
    let mut args = vec!["chat", "--model", model.to_str().unwrap(), "--temperature", "0", "--max-tokens", "10"];
    if let Some(s) = session {
        args.extend(["--session", s.to_str().unwrap()]);
    }
    let mut child = Command::new(shimmer_bin()).args(&args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = shimmer_tests::wait_within(child, shimmer_tests::COMMAND_LIMIT);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_chat_split_across_processes_is_byte_identical_to_one_process() {
    for name in ["mixtral", "deepseek_v3_plain_q", "qwen3_next"] {
        let dir = fixture(name);
        let one = chat(&dir, None, "Who made the earth?\nAnd the sea?\n");
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("chat.session");
        let first = chat(&dir, Some(&file), "Who made the earth?\n");
        let second = chat(&dir, Some(&file), "And the sea?\n");
        // Each process ends with a fresh prompt at EOF; strip those to join the answers.
        let joined = format!("{}{}", first.trim_end_matches("› \n"), second);
        assert_eq!(joined.as_bytes(), one.as_bytes(), "{name}");
    }
}

fn rewrite_header(path: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let bytes = std::fs::read(path).unwrap();
    let n = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[12..12 + n]).unwrap();
    edit(&mut header);
    let json = serde_json::to_vec(&header).unwrap();
    let mut out = bytes[..8].to_vec();
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(&bytes[12 + n..bytes.len() - 8]);
    let sum = xxh3(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    std::fs::write(path, out).unwrap();
}

#[test]
fn foreign_damaged_or_mismatched_session_files_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("s");
    let model = fixture("qwen3_moe");
    let gen = |model: &std::path::Path| {
        shimmer(&["generate", "--model", model.to_str().unwrap(), "--prompt-ids", "5,6,7", "--max-tokens", "3", "--session", file.to_str().unwrap()])
    };
    assert!(gen(&model).status.success());
    let good = std::fs::read(&file).unwrap();

    assert_clean_failure(&gen(&fixture("qwen3_moe_variant")), &["saved for another model"]);

    std::fs::write(&file, &good[..good.len() - 5]).unwrap();
    assert_clean_failure(&gen(&model), &["checksum mismatch"]);

    std::fs::write(&file, b"hello, not a session").unwrap();
    assert_clean_failure(&gen(&model), &["not a shimmer session file"]);

    std::fs::write(&file, &good).unwrap();
    rewrite_header(&file, |h| h["version"] = 99.into());
    assert_clean_failure(&gen(&model), &["format version 99"]);

    std::fs::write(&file, &good).unwrap();
    rewrite_header(&file, |h| h["k_width"] = 3.into());
    assert_clean_failure(&gen(&model), &["cache geometry"]);

    std::fs::write(&file, &good).unwrap();
    rewrite_header(&file, |h| h["cached"] = 2.into());
    assert_clean_failure(&gen(&model), &["bytes of cache"]);

    // Longer than any session of this model can be (a sparse terabyte): refused before it is
    // read, by a process held to a 4 GiB address space.
    std::fs::write(&file, &good).unwrap();
    std::fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(1 << 40).unwrap();
    let out = shimmer_tests::output_within(
        std::process::Command::new("prlimit").arg(format!("--as={}", 4u64 << 30)).arg("--").arg(shimmer_tests::shimmer_bin()).args([
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt-ids",
            "5,6,7",
            "--max-tokens",
            "3",
            "--session",
            file.to_str().unwrap(),
        ]),
        shimmer_tests::COMMAND_LIMIT,
    );
    assert_clean_failure(&out, &["1099511627776 bytes is more than a session of this model can hold"]);

    // A refused file is left as it was: never half-loaded, never overwritten.
    std::fs::write(&file, b"hello, not a session").unwrap();
    let _ = gen(&model);
    assert_eq!(std::fs::read(&file).unwrap(), b"hello, not a session");
}

#[test]
fn an_mla_session_is_small() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("s");
    let dir = fixture("deepseek_v3");
    let out =
        shimmer(&["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", &ids_arg(&[5; 40]), "--max-tokens", "10", "--session", file.to_str().unwrap()]);
    assert!(out.status.success());
    let engine = Engine::load(&dir).unwrap();
    let shimmer_common::spec::AttentionKind::Mla(m) = &engine.spec.attention.kind else { panic!("MLA fixture") };
    // 49 cached positions × layers × (latent + rotary key) f32, plus a header.
    let cache_bytes = 49 * engine.spec.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 4;
    let len = std::fs::metadata(&file).unwrap().len() as usize;
    assert!(len >= cache_bytes && len < cache_bytes + 4096, "{len} bytes for {cache_bytes} bytes of latent cache");
}

#[test]
fn mutated_session_files_never_panic() {
    // Damage with a recomputed checksum, so the parser behind the checksum is what is exercised.
    let engine = Engine::load(&fixture("deepseek_v3")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("s");
    let opts = GenerateOptions { max_tokens: 4, sampling: SamplingParams::default(), stop: vec![] };
    let mut s = engine.new_session();
    let g = engine.generate(&mut s, &[5, 6, 7, 8], &opts, |_| true).unwrap();
    let history: Vec<u32> = [5, 6, 7, 8].iter().chain(&g.output_ids).copied().collect();
    shimmer_coordinator::session_file::save(&file, &engine, &s, &history, &[]).unwrap();
    let good = std::fs::read(&file).unwrap();
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for i in 0..2000 {
        let mut b = good[..good.len() - 8].to_vec();
        for _ in 0..=(next() % 3) {
            let at = (next() % b.len() as u64) as usize;
            b[at] = next() as u8;
        }
        let sum = xxh3(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        std::fs::write(&file, &b).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shimmer_coordinator::session_file::load(&file, &engine).map(|_| ())));
        assert!(r.is_ok(), "panicked on mutation {i}");
    }
}
