//! The `shimmer` binary's contract: `generate` and `score` flags and JSON shapes, and bad input of
//! every kind ending in one clear error line, exit code 1, and no panic.

use serde_json::Value;
use shimmer_tests::{assert_clean_failure, copy_fixture, edit_safetensors_header, fixture, fixtures, oracle, shimmer};

fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn json_stdout(out: &std::process::Output) -> Value {
    assert!(out.status.success(), "shimmer failed: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout.clone()).expect("utf-8 stdout");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "--json prints exactly one line: {stdout}");
    serde_json::from_str(lines[0]).expect("stdout is one JSON object")
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

#[test]
fn generate_json_reproduces_the_oracle_greedy_continuation() {
    for name in fixtures() {
        let o = oracle(name);
        let p = &o.prompts[1];
        let dir = fixture(name);
        let max = p.greedy.len().to_string();
        let out =
            shimmer(&["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", &ids_arg(&p.ids), "--max-tokens", &max, "--temperature", "0", "--json"]);
        let v = json_stdout(&out);
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, ["prompt_ids", "output_ids", "text", "finish_reason", "timings"]);
        assert_eq!(u32s(&v["prompt_ids"]), p.ids);
        assert_eq!(u32s(&v["output_ids"]), p.greedy, "{name}");
        assert_eq!(v["finish_reason"], "length");
        assert_eq!(v["text"], p.greedy_text);
        for k in ["load_ms", "prefill_ms", "decode_tok_s"] {
            assert!(v["timings"][k].as_f64().expect(k) > 0.0, "{name}: timings.{k}");
        }

        // The same prompt as text tokenizes to the same ids.
        let out = shimmer(&["generate", "--model", dir.to_str().unwrap(), "--prompt", &p.text, "--max-tokens", "3", "--json"]);
        let v = json_stdout(&out);
        assert_eq!(u32s(&v["prompt_ids"]), p.ids, "{name}: --prompt tokenization");
        assert_eq!(u32s(&v["output_ids"]), p.greedy[..3], "{name}: greedy is the default");
    }
}

#[test]
fn generate_streams_text_and_chat_wraps_the_prompt() {
    let name = "qwen3_moe";
    let o = oracle(name);
    let p = &o.prompts[1];
    let dir = fixture(name);
    let out = shimmer(&["generate", "--model", dir.to_str().unwrap(), "--prompt", &p.text, "--max-tokens", "40"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.trim_end_matches('\n'), p.greedy_text);

    let chat = &o.chat[0];
    let user = &chat.messages.iter().find(|m| m.role == "user").unwrap().content;
    let out = shimmer(&["generate", "--model", dir.to_str().unwrap(), "--prompt", user, "--chat", "--max-tokens", "2", "--json"]);
    let v = json_stdout(&out);
    let ids = u32s(&v["prompt_ids"]);
    // ChatML: <|im_start|>user\n…<|im_end|>\n<|im_start|>assistant\n, rendered and tokenized as transformers does.
    let want: Vec<u32> = {
        let eng = shimmer_coordinator::Engine::load(&dir).unwrap();
        eng.encode_chat(&[shimmer_common::chat_template::Message::new("user", user)]).unwrap()
    };
    assert_eq!(ids, want);
    assert!(ids.len() > p.ids.len());
}

#[test]
fn seeded_sampling_is_reproducible_and_stop_strings_cut_the_text() {
    let dir = fixture("olmoe");
    let run = |seed: &str| {
        json_stdout(&shimmer(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "And God said",
            "--max-tokens",
            "24",
            "--temperature",
            "0.9",
            "--top-p",
            "0.95",
            "--top-k",
            "40",
            "--seed",
            seed,
            "--json",
        ]))
    };
    let (a, b, c) = (run("7"), run("7"), run("8"));
    assert_eq!(a["output_ids"], b["output_ids"]);
    assert_ne!(a["output_ids"], c["output_ids"], "a different seed should sample differently");

    let text = a["text"].as_str().unwrap().to_string();
    // Pick a stop string from the middle of the sampled text: the output must end right before it.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cut = text.find(&stop).unwrap();
    let v = json_stdout(&shimmer(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "And God said",
        "--max-tokens",
        "24",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--top-k",
        "40",
        "--seed",
        "7",
        "--stop",
        &stop,
        "--json",
    ]));
    assert_eq!(v["text"].as_str().unwrap(), &text[..cut]);
    assert_eq!(v["finish_reason"], "stop");
}

#[test]
fn score_json_has_one_argmax_per_position_and_one_fewer_logprob() {
    for name in fixtures() {
        let o = oracle(name);
        let p = &o.prompts[0];
        let ids: Vec<u32> = p.ids.iter().chain(&p.greedy).copied().collect();
        let v = json_stdout(&shimmer(&["score", "--model", fixture(name).to_str().unwrap(), "--ids", &ids_arg(&ids), "--json"]));
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, ["argmax", "logprobs", "timings"]);
        let argmax = u32s(&v["argmax"]);
        assert_eq!(argmax.len(), ids.len());
        for (pos, (a, want)) in argmax.iter().zip(&p.argmax).enumerate() {
            if p.margin[pos] >= o.near_tie {
                assert_eq!(a, want, "{name} position {pos}");
            }
        }
        let lps = v["logprobs"].as_array().unwrap();
        assert_eq!(lps.len(), ids.len() - 1);
        for (a, b) in lps.iter().zip(&p.logprobs) {
            assert!((a.as_f64().unwrap() as f32 - b).abs() < 1e-3);
        }
    }
}

// ---- bad input -------------------------------------------------------------------------------

fn generate_on(dir: &std::path::Path) -> std::process::Output {
    shimmer(&["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", "1,2,3", "--max-tokens", "2"])
}

#[test]
fn missing_or_garbled_config_is_named() {
    let d = copy_fixture("olmoe");
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    assert_clean_failure(&generate_on(d.path()), &["config.json", "No such file"]);

    std::fs::write(d.path().join("config.json"), "{\"architectures\": [\"OlmoeForCausalLM\", ").unwrap();
    assert_clean_failure(&generate_on(d.path()), &["config.json", "not valid JSON"]);

    std::fs::write(d.path().join("config.json"), "{\"architectures\": [\"OlmoeForCausalLM\"], \"vocab_size\": 512}").unwrap();
    assert_clean_failure(&generate_on(d.path()), &["config.json", "field `hidden_size`: missing"]);

    assert_clean_failure(&generate_on(&d.path().join("nope")), &["nope", "not a directory"]);
}

#[test]
fn unsupported_architecture_is_named() {
    let d = copy_fixture("mixtral");
    let path = d.path().join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    std::fs::write(&path, cfg.to_string()).unwrap();
    assert_clean_failure(&generate_on(d.path()), &["config.json", "unsupported architecture `GPT2LMHeadModel`", "MixtralForCausalLM"]);
}

#[test]
fn lying_safetensors_headers_are_refused() {
    // Offsets past the end of the file: the file is shorter than its header says.
    let d = copy_fixture("mixtral");
    let st = d.path().join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&st).unwrap().set_len(len - 100).unwrap();
    assert_clean_failure(&generate_on(d.path()), &["model.safetensors", "bad safetensors header"]);

    // Two tensors claiming the same bytes.
    let d = copy_fixture("mixtral");
    let st = d.path().join("model.safetensors");
    edit_safetensors_header(&st, |h| {
        let offsets = h["model.norm.weight"]["data_offsets"].clone();
        h["model.layers.0.input_layernorm.weight"]["data_offsets"] = offsets;
    });
    assert_clean_failure(&generate_on(d.path()), &["model.safetensors", "bad safetensors header"]);

    // A header length that points past the end.
    let d = copy_fixture("mixtral");
    let st = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    bytes[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    std::fs::write(&st, bytes).unwrap();
    assert_clean_failure(&generate_on(d.path()), &["model.safetensors", "bad safetensors header"]);
}

#[test]
fn wrong_dtype_or_shape_for_the_spec_is_named() {
    let d = copy_fixture("mixtral");
    let st = d.path().join("model.safetensors");
    // F16 → I16 keeps every size valid, so only the spec check can catch it.
    edit_safetensors_header(&st, |h| h["model.norm.weight"]["dtype"] = "I16".into());
    assert_clean_failure(&generate_on(d.path()), &["model.safetensors", "model.norm.weight", "dtype I16"]);

    let d = copy_fixture("mixtral");
    let st = d.path().join("model.safetensors");
    edit_safetensors_header(&st, |h| {
        let shape = h["model.layers.0.self_attn.k_proj.weight"]["shape"].as_array().unwrap().clone();
        h["model.layers.0.self_attn.k_proj.weight"]["shape"] = serde_json::json!([shape[1], shape[0]]);
    });
    assert_clean_failure(
        &generate_on(d.path()),
        &["model.safetensors", "model.layers.0.self_attn.k_proj.weight", "shape [80, 40] but the model config needs [40, 80]"],
    );
}

#[test]
fn a_tensor_the_family_needs_but_the_checkpoint_lacks_is_named() {
    let d = copy_fixture("olmoe");
    let st = d.path().join("model.safetensors");
    edit_safetensors_header(&st, |h| {
        let v = h.remove("model.layers.1.self_attn.k_norm.weight").unwrap();
        h.insert("model.layers.1.self_attn.k_norm_renamed.weight".into(), v);
    });
    assert_clean_failure(&generate_on(d.path()), &["model.layers.1.self_attn.k_norm.weight", "does not have it"]);

    // A routed expert, in a sharded checkpoint whose index still names it.
    let d = copy_fixture("qwen3_moe");
    let index: Value = serde_json::from_str(&std::fs::read_to_string(d.path().join("model.safetensors.index.json")).unwrap()).unwrap();
    let tensor = "model.layers.2.mlp.experts.5.down_proj.weight";
    let shard = index["weight_map"][tensor].as_str().unwrap().to_string();
    edit_safetensors_header(&d.path().join(&shard), |h| {
        let v = h.remove(tensor).unwrap();
        h.insert("unused.tensor".into(), v);
    });
    assert_clean_failure(&generate_on(d.path()), &["model.safetensors.index.json", tensor, &shard]);
}

#[test]
fn a_hash_table_naming_an_expert_the_layer_lacks_is_named() {
    // DeepSeek-V4's `tid2eid`: every entry must be one of the layer's experts.
    let d = copy_fixture("deepseek_v4");
    let path = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let tensor = "layers.0.ffn.gate.tid2eid";
    assert_eq!(header[tensor]["dtype"], "I64");
    let start = 8 + header_len + header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    // Token 3's first expert.
    let at = start + 3 * 2 * 8;
    bytes[at..at + 8].copy_from_slice(&99i64.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    assert_clean_failure(&generate_on(d.path()), &[tensor, "token 3 names expert 99"]);
}

#[test]
fn a_tokenizer_that_does_not_parse_is_named() {
    let d = copy_fixture("qwen3_moe");
    std::fs::write(d.path().join("tokenizer.json"), "{\"version\": \"1.0\", \"model\": {\"type\": \"BPE\", \"vocab\": 3}}").unwrap();
    assert_clean_failure(&generate_on(d.path()), &["tokenizer.json", "does not parse"]);
}

#[test]
fn prompt_ids_outside_the_vocabulary_are_refused() {
    let dir = fixture("olmoe");
    let out = shimmer(&["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", "1,512,3"]);
    assert_clean_failure(&out, &["prompt id 512", "outside the vocabulary", "512"]);
    let out = shimmer(&["score", "--model", dir.to_str().unwrap(), "--ids", "1,99999"]);
    assert_clean_failure(&out, &["prompt id 99999", "outside the vocabulary"]);
}

#[test]
fn a_prompt_longer_than_the_context_is_refused() {
    let dir = fixture("mixtral");
    let ids = vec!["5"; 257].join(",");
    let out = shimmer(&["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", &ids]);
    assert_clean_failure(&out, &["257 tokens", "context is 256", "max_position_embeddings"]);
    let out = shimmer(&["score", "--model", dir.to_str().unwrap(), "--ids", &ids, "--json"]);
    assert_clean_failure(&out, &["257 tokens", "context is 256"]);
}

#[test]
fn generation_stops_at_the_context_limit_with_length() {
    let dir = fixture("mixtral");
    let ids = vec!["5"; 250].join(",");
    let v = json_stdout(&shimmer(&["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", &ids, "--max-tokens", "100", "--json"]));
    assert_eq!(v["finish_reason"], "length");
    // 250 prompt positions + 6 generated positions fill the 256-token context; the 7th sampled
    // token has no position left to be fed back, so it is the last.
    assert_eq!(u32s(&v["output_ids"]).len(), 7);
}

#[test]
fn routing_reports_every_moe_layer() {
    let text = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("oracle/README.md");
    for name in fixtures() {
        let dir = fixture(name);
        let v = json_stdout(&shimmer(&["routing", "--model", dir.to_str().unwrap(), "--text", text.to_str().unwrap(), "--chunk", "64", "--json"]));
        let tokens = v["tokens"].as_u64().unwrap();
        let k = v["top_k"].as_u64().unwrap();
        let layers = v["layers"].as_array().unwrap();
        let engine = shimmer_coordinator::Engine::load(&dir).unwrap();
        assert_eq!(layers.len(), engine.spec.moe_layer_count(), "{name}");
        for (i, l) in layers.iter().enumerate() {
            assert_eq!(l["selections"].as_u64().unwrap(), tokens * k, "{name}");
            assert!(l["entropy_bits"].as_f64().unwrap() <= l["max_entropy_bits"].as_f64().unwrap() + 1e-9);
            let recall = &l["next_layer_recall"];
            if i == 0 {
                assert!(recall.is_null());
            } else {
                let r = recall.as_f64().unwrap();
                assert!((0.0..=1.0).contains(&r), "{name}: {r}");
            }
        }
    }
    let out = shimmer(&["routing", "--model", fixture("olmoe").to_str().unwrap(), "--text", "/nonexistent.txt"]);
    assert_clean_failure(&out, &["/nonexistent.txt"]);
}

#[test]
fn quant_eval_measures_formats_against_the_checkpoint() {
    let text = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("oracle/README.md");
    let v = json_stdout(&shimmer(&[
        "quant-eval",
        "--model",
        fixture("olmoe").to_str().unwrap(),
        "--text",
        text.to_str().unwrap(),
        "--quant",
        "bf16,int8,int4-g32,int4-g128",
        "--max-tokens",
        "512",
        "--json",
    ]));
    let f = v["formats"].as_array().unwrap();
    let kl = |i: usize| f[i]["mean_kl_nats"].as_f64().unwrap();
    // "bf16" keeps the checkpoint's own weights: identical distributions.
    assert_eq!(kl(0), 0.0);
    assert_eq!(f[0]["top1_agreement"].as_f64().unwrap(), 1.0);
    // Coarser formats lose more: int8 is far closer than int4.
    assert!(kl(1) > 0.0 && kl(1) < kl(2) && kl(1) < kl(3), "{v}");
    for r in f {
        let a = r["top1_agreement"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&a));
    }
    let out = shimmer(&["quant-eval", "--model", fixture("olmoe").to_str().unwrap(), "--text", text.to_str().unwrap(), "--quant", "int3"]);
    assert_clean_failure(&out, &["unknown quantisation `int3`"]);
    // A converted container measures exactly as the same format quantised in memory.
    let out = tempfile::tempdir().unwrap();
    let c = out.path().join("c");
    assert!(shimmer(&["convert", "--from", fixture("olmoe").to_str().unwrap(), "--to", c.to_str().unwrap(), "--quant", "int4-g32", "--quiet"])
        .status
        .success());
    let w = json_stdout(&shimmer(&[
        "quant-eval",
        "--model",
        fixture("olmoe").to_str().unwrap(),
        "--text",
        text.to_str().unwrap(),
        "--quant",
        "none",
        "--candidate",
        c.to_str().unwrap(),
        "--max-tokens",
        "512",
        "--json",
    ]));
    assert_eq!(w["formats"][0]["mean_kl_nats"], f[2]["mean_kl_nats"], "{w} vs {v}");
    assert_eq!(w["formats"][0]["top1_agreement"], f[2]["top1_agreement"]);
}

#[test]
fn plan_writes_a_valid_placement_and_forecasts_each_worker() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("placement.json");
    let fixture_dir = shimmer_tests::fixture("qwen3_moe");
    let o = shimmer(&[
        "plan",
        "--model",
        fixture_dir.to_str().unwrap(),
        "--workers",
        "127.0.0.2:7070,127.0.0.3:7070,127.0.0.4:7070",
        "--replicas",
        "2",
        "--ram-gb-per-worker",
        "0.001",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["workers"].as_array().unwrap().len(), 3);
    let spec = shimmer_common::ModelSpec::from_dir(&fixture_dir).unwrap();
    let fingerprint = shimmer_coordinator::model_dir::ModelDir::open(&fixture_dir).unwrap().fingerprint;
    let moe: Vec<usize> = (0..spec.num_layers).filter(|l| spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).collect();
    let p = shimmer_cluster::placement::Placement::read(&out).unwrap();
    p.validate(&fingerprint, &moe, spec.moe.num_experts).unwrap();
    let total: f64 = report["workers"].as_array().unwrap().iter().map(|w| w["selections_per_token"].as_f64().unwrap()).sum();
    assert!((total - report["selections_per_token"].as_f64().unwrap()).abs() < 1e-6, "every selection is served somewhere: {report}");
    assert_eq!(p.epoch, 1);
    // Planned again over it: the next epoch; or the one asked for.
    let again = |extra: &[&str]| {
        let o = shimmer(
            &[&["plan", "--model", fixture_dir.to_str().unwrap(), "--workers", "127.0.0.2:7070,127.0.0.3:7070", "--out", out.to_str().unwrap()][..], extra]
                .concat(),
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        shimmer_cluster::placement::Placement::read(&out).unwrap().epoch
    };
    assert_eq!(again(&[]), 2);
    assert_eq!(again(&["--epoch", "7"]), 7);
    assert_eq!(again(&[]), 8);
    let dup = shimmer(&["plan", "--model", fixture_dir.to_str().unwrap(), "--workers", "127.0.0.2:7070,127.0.0.2:7070", "--out", out.to_str().unwrap()]);
    assert_clean_failure(&dup, &["listed twice"]);
    let reps = shimmer(&["plan", "--model", fixture_dir.to_str().unwrap(), "--workers", "127.0.0.2:7070", "--replicas", "2", "--out", out.to_str().unwrap()]);
    assert_clean_failure(&reps, &["replicas"]);
}

#[test]
fn cluster_flags_in_the_wrong_place_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.json");
    let m = shimmer_tests::fixture("qwen3_moe");
    let m = m.to_str().unwrap();
    assert!(shimmer(&["plan", "--model", m, "--workers", "127.0.0.2:7070", "--out", out.to_str().unwrap()]).status.success());
    let p = out.to_str().unwrap();
    // Credentials without a cluster, a placement for a remote chat, a coordinator without one.
    assert_clean_failure(&shimmer(&["generate", "--model", m, "--prompt-ids", "1,2", "--join-token", "a-long-enough-join-token"]), &["--placement"]);
    assert_clean_failure(&shimmer(&["chat", "--url", "http://127.0.0.1:1", "--placement", p]), &["--placement", "--url"]);
    assert_clean_failure(&shimmer(&["coordinator", "--model", m]), &["--placement"]);
    // A cluster without credentials, a short token, bad timeouts, an unknown worker to hold.
    assert_clean_failure(&shimmer(&["generate", "--model", m, "--prompt-ids", "1,2", "--placement", p]), &["join token", "--tls-cert"]);
    assert_clean_failure(&shimmer(&["generate", "--model", m, "--prompt-ids", "1,2", "--placement", p, "--join-token", "short"]), &["at least 16 characters"]);
    assert_clean_failure(
        &shimmer(&["generate", "--model", m, "--prompt-ids", "1,2", "--placement", p, "--join-token", "a-long-enough-join-token", "--worker-timeout-s", "0"]),
        &["--worker-timeout-s"],
    );
    assert_clean_failure(
        &shimmer(&["generate", "--model", m, "--prompt-ids", "1,2", "--placement", p, "--join-token", "a-long-enough-join-token", "--hold", "nobody"]),
        &["nobody"],
    );
    // Operator certificates that are not PEM.
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let j = junk.to_str().unwrap();
    assert_clean_failure(&shimmer(&["worker", "--model", m, "--listen", "127.0.0.1:0", "--tls-cert", j, "--tls-key", j, "--tls-ca", j]), &["junk.pem"]);
}

#[test]
fn the_io_engine_flag_is_checked_and_io_uring_asks_for_a_container() {
    let m = shimmer_tests::fixture("qwen3_moe");
    let m = m.to_str().unwrap();
    assert_clean_failure(&shimmer(&["generate", "--model", m, "--prompt-ids", "1,2", "--io-engine", "aio"]), &["unknown I/O engine \"aio\"", "uring"]);
    // A checkpoint's experts are gathered from several tensors: no blob for a ring to read.
    assert_clean_failure(&shimmer(&["generate", "--model", m, "--prompt-ids", "1,2", "--io-engine", "uring"]), &["checkpoint", "--io-engine threads"]);
    let ids = |out: &std::process::Output| u32s(&json_stdout(out)["output_ids"]);
    let plain = shimmer(&["generate", "--model", m, "--prompt-ids", "1,2", "--max-tokens", "4", "--temperature", "0", "--json", "--io-engine", "threads"]);
    let dir = tempfile::tempdir().unwrap();
    let c = dir.path().join("c");
    assert!(shimmer(&["convert", "--from", m, "--to", c.to_str().unwrap(), "--quant", "bf16", "--quiet"]).status.success());
    // Every expert is read through the ring at its first use.
    let ring_args =
        ["generate", "--model", c.to_str().unwrap(), "--prompt-ids", "1,2", "--max-tokens", "4", "--temperature", "0", "--json", "--io-engine", "uring"];
    let ring = shimmer(&ring_args);
    assert_eq!(ids(&ring), ids(&plain), "the same tokens read through the ring");
    // A ring that fails as a whole, with reads in flight or none: the same tokens, read on.
    let with_fault = |n: &str| {
        let mut cmd = std::process::Command::new(shimmer_tests::shimmer_bin());
        cmd.args(ring_args).env("SHIMMER_IO_RING_FAULT", n);
        shimmer_tests::output_within(&mut cmd, shimmer_tests::COMMAND_LIMIT)
    };
    for n in ["1", "2", "3"] {
        let out = with_fault(n);
        assert_eq!(ids(&out), ids(&plain), "SHIMMER_IO_RING_FAULT={n}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("injected ring failure"), "SHIMMER_IO_RING_FAULT={n}: the failure is logged");
    }
    assert_clean_failure(&with_fault("often"), &["SHIMMER_IO_RING_FAULT=\"often\""]);
}

/// A server on a free port answering every request with `status` and a short body, until the
/// test ends.
fn http_answering(status: &'static str) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            let _ = write!(conn, "HTTP/1.1 {status}\r\ncontent-length: 13\r\nconnection: close\r\n\r\nsecret body\r\n");
        }
    });
    addr
}

#[test]
fn probe_passes_on_2xx_and_otherwise_fails_saying_why_without_the_body() {
    let ok = http_answering("200 OK");
    let out = shimmer(&["probe", &format!("http://{ok}/health")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout.is_empty() && out.stderr.is_empty(), "a passing probe prints nothing");
    let missing = http_answering("503 Service Unavailable");
    let out = shimmer(&["probe", &format!("http://{missing}/ready")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("answered 503") && !err.contains("secret body"), "{err}");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let out = shimmer(&["probe", &format!("http://{closed}/health"), "--timeout-s", "2"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("did not answer"));
    assert_clean_failure(&shimmer(&["probe", "ftp://example/"]), &["http:// or https://"]);
    assert_clean_failure(&shimmer(&["probe", &format!("http://{ok}/"), "--timeout-s", "0"]), &["--timeout-s"]);
    // --chat against something that is not an OpenAI server: a failure naming the URL.
    let out = shimmer(&["probe", "--chat", &format!("http://{missing}")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("http://{missing}/v1/models answered 503")));
}

/// `shimmer doctor --json`: one JSON object describing the machine, with a disk measured at
/// every depth in the directory asked for (its probe file removed afterwards), and flags out of
/// range refused by name.
#[test]
fn doctor_describes_the_machine_and_measures_the_disk_it_is_pointed_at() {
    let dir = tempfile::tempdir().unwrap();
    let out = shimmer(&["doctor", "--json", "--dir", dir.path().to_str().unwrap(), "--disk-probe-mb", "8"]);
    let v = json_stdout(&out);
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(keys, ["cpu", "memory", "numa_nodes", "disks", "gpus", "gpu_check", "recommendations"]);
    // A device checked, or why none was (on this project's machines: no GPU, and `auto` skips
    // lavapipe, a CPU driver).
    let check = &v["gpu_check"];
    assert!(check["device"].is_string() != check["unavailable"].is_string(), "{check}");
    let cores = v["cpu"]["logical_cores"].as_u64().unwrap();
    assert_eq!(cores as usize, std::thread::available_parallelism().unwrap().get());
    assert_eq!(v["cpu"]["integer_kernels"], shimmer_kernels::qdot::int_isa().name());
    assert_eq!(v["cpu"]["integer_one_row_kernels"], shimmer_kernels::qdot::matvec_isa().name());
    assert!(v["cpu"]["features"].as_object().unwrap().values().all(Value::is_boolean));
    for k in ["copy_gb_s_one_thread", "copy_gb_s_all_threads", "read_gb_s_one_thread", "read_gb_s_all_threads"] {
        assert!(v["memory"][k].as_f64().unwrap() > 0.0, "{k}");
    }
    let disk = &v["disks"][0];
    assert_eq!(disk["dir"], dir.path().to_str().unwrap());
    let depths: Vec<u64> = disk["gb_s_by_depth"].as_array().unwrap().iter().map(|d| d[0].as_u64().unwrap()).collect();
    assert_eq!(depths, [1, 2, 4, 8, 16, 32], "{disk}");
    assert!(disk["gb_s_by_depth"].as_array().unwrap().iter().all(|d| d[1].as_f64().unwrap() > 0.0));
    assert!(depths.contains(&disk["best_depth"].as_u64().unwrap()));
    // The same reads through an io_uring ring (this project's machines have one).
    assert_eq!(disk["io_uring"], "available", "{disk}");
    assert!(disk["io_uring_gb_s"].as_f64().unwrap() > 0.0, "{disk}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the probe file is removed");
    let advice: Vec<&str> = v["recommendations"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
    assert!(advice.iter().any(|a| a.starts_with("--threads ")), "{advice:?}");
    // Without --json: one line per finding; nothing written when the disks are skipped.
    let out = shimmer(&["doctor", "--disk-probe-mb", "0"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for head in ["cpu ", "memory ", "advice "] {
        assert!(text.lines().any(|l| l.starts_with(head)), "{head}: {text}");
    }
    assert!(!text.lines().any(|l| l.starts_with("disk ")), "{text}");
    // Bad flags: refused, naming them.
    assert_clean_failure(&shimmer(&["doctor", "--disk-probe-mb", "100000"]), &["--disk-probe-mb"]);
    assert_clean_failure(&shimmer(&["doctor", "--dir", "/no/such/dir"]), &["--dir", "/no/such/dir"]);
}
