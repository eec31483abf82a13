//! `--trace FILE` records every token's routing without changing a token, the same routing
//! whether tokens arrive in one prefill or one by one; `shimmer trace analyze` replays it through
//! the cache policies, none of which (demand-only) beats Belady's optimum.

use shimmer_common::trace::Trace;
use shimmer_tests::{assert_clean_failure, fixture, shimmer};

fn json(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn traces_record_routing_without_changing_tokens() {
    for name in ["qwen3_moe", "deepseek_v3"] {
        let dir = fixture(name);
        let model = dir.to_str().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let (gen_trace, score_trace) = (tmp.path().join("g"), tmp.path().join("s"));
        let plain = json(&shimmer(&["generate", "--model", model, "--prompt", "In the beginning God created", "--max-tokens", "20", "--json"]));
        let traced = json(&shimmer(&[
            "generate",
            "--model",
            model,
            "--prompt",
            "In the beginning God created",
            "--max-tokens",
            "20",
            "--json",
            "--trace",
            gen_trace.to_str().unwrap(),
        ]));
        assert_eq!(plain["output_ids"], traced["output_ids"], "{name}: tracing changed tokens");

        let ids: Vec<u32> =
            traced["prompt_ids"].as_array().unwrap().iter().chain(traced["output_ids"].as_array().unwrap()).map(|v| v.as_u64().unwrap() as u32).collect();
        let g = Trace::read(&gen_trace).unwrap();
        // Every fed position: the prompt, then each sampled token but the last.
        assert_eq!(g.tokens.len(), ids.len() - 1, "{name}");
        let engine = shimmer_coordinator::Engine::load(&dir).unwrap();
        assert_eq!(g.header.layers.len(), engine.spec.moe_layer_count());
        assert_eq!(g.header.top_k as usize, engine.spec.moe.top_k);
        let last = g.header.layers.len() - 1;
        for t in &g.tokens {
            assert!(t.selected.iter().all(|s| s.len() == engine.spec.moe.top_k));
            assert!(t.predicted[..last].iter().all(|p| p.len() == engine.spec.moe.top_k) && t.predicted[last].is_empty());
        }

        // Teacher forcing the same ids in one pass routes every position identically.
        let id_list = ids[..ids.len() - 1].iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let out = shimmer(&["score", "--model", model, "--ids", &id_list, "--json", "--trace", score_trace.to_str().unwrap()]);
        assert!(out.status.success());
        let s = Trace::read(&score_trace).unwrap();
        assert_eq!(s.tokens, g.tokens, "{name}: one prefill and token-by-token decode route alike");
    }
}

#[test]
fn trace_analysis_never_lets_a_demand_policy_beat_belady() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("t");
    let dir = fixture("qwen3_moe");
    let out = shimmer(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "And the LORD spake unto Moses, saying,",
        "--max-tokens",
        "120",
        "--temperature",
        "0.9",
        "--seed",
        "4",
        "--trace",
        file.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    for capacity in ["2", "8", "16", "32"] {
        let r = json(&shimmer(&["trace", "analyze", file.to_str().unwrap(), "--capacity-experts", capacity, "--json"]));
        let policies = r["policies"].as_array().unwrap();
        let opt = policies.iter().find(|p| p["policy"] == "Belady (optimal)").unwrap()["hit_rate"].as_f64().unwrap();
        assert_eq!(policies.len(), 5);
        for p in policies.iter().filter(|p| p["prefetch_reads"] == 0) {
            assert!(p["hit_rate"].as_f64().unwrap() <= opt + 1e-12, "capacity {capacity}: {} beats Belady", p["policy"]);
        }
    }
    // At full capacity (every expert of every layer), only first touches miss.
    let all = json(&shimmer(&["trace", "analyze", file.to_str().unwrap(), "--capacity-experts", "32", "--json"]));
    assert_eq!(all["slots_per_layer"], 16);

    // --ram-gb with the model: the budget in experts of that model (f32 experts of 3 × 24 × 64).
    let eight = json(&shimmer(&["trace", "analyze", file.to_str().unwrap(), "--capacity-experts", "8", "--json"]));
    let by_ram = json(&shimmer(&[
        "trace",
        "analyze",
        file.to_str().unwrap(),
        "--ram-gb",
        &format!("{}", 8.5 * 3.0 * 24.0 * 64.0 * 4.0 / 1e9),
        "--model",
        dir.to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(by_ram, eight);

    assert_clean_failure(&shimmer(&["trace", "analyze", file.to_str().unwrap(), "--capacity-experts", "1"]), &["less than one expert per MoE layer"]);
    std::fs::write(&file, b"garbage").unwrap();
    assert_clean_failure(&shimmer(&["trace", "analyze", file.to_str().unwrap(), "--capacity-experts", "8"]), &["not a shimmer routing trace"]);
}
