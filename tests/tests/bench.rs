//! `shimmer bench` reports, from one run, speed next to its yardsticks: the disk's bandwidth and
//! Belady's optimum at the store's capacity. Nothing here judges a speed; it checks that the
//! report is complete and self-consistent.

use shimmer_tests::{fixture, shimmer};

#[test]
fn bench_reports_speed_with_disk_limit_and_belady_from_the_same_run() {
    let out = tempfile::tempdir().unwrap();
    let c = out.path().join("c");
    let o = shimmer(&["convert", "--from", fixture("qwen3_moe").to_str().unwrap(), "--to", c.to_str().unwrap(), "--quant", "int4-g32", "--quiet"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = shimmer(&[
        "bench",
        "--model",
        c.to_str().unwrap(),
        "--ram-gb",
        "0.00005",
        "--direct-io",
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "24",
        "--no-usage",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["prompt_tokens"], 16);
    assert_eq!(r["gen_tokens"], 24);
    assert!(r["decode_tok_s"].as_f64().unwrap() > 0.0 && r["prefill_tok_s"].as_f64().unwrap() > 0.0);
    assert!(r["disk_gb_s_at_depth"].as_f64().unwrap() > 0.0, "{r}");
    let store = &r["store"];
    assert!(store["disk_misses"].as_u64().unwrap() > 0, "a small budget reads: {r}");
    assert!(r["decode_read_bytes_per_token"].as_f64().unwrap() > 0.0);
    let limit = r["disk_limit_tok_s"].as_f64().unwrap();
    let frac = r["fraction_of_disk_limit"].as_f64().unwrap();
    assert!((frac - r["decode_tok_s"].as_f64().unwrap() / limit).abs() < 1e-9);
    // The limit counts the reads a token needed: unused prefetches are not part of it.
    let (read, unused) = (r["decode_read_bytes_per_token"].as_f64().unwrap(), r["decode_unused_prefetch_bytes_per_token"].as_f64().unwrap());
    assert!((0.0..=read).contains(&unused), "{r}");
    let needed_limit = r["disk_gb_s_at_depth"].as_f64().unwrap() * 1e9 / (read - unused);
    assert!((limit - needed_limit).abs() <= 1e-9 * limit, "{limit} against {needed_limit}");
    // The disk's busy time lies within the decode's, and the reads it carried are the decode's.
    let (busy, while_busy) = (r["decode_disk_busy_fraction"].as_f64().unwrap(), r["decode_read_gb_s_while_busy"].as_f64().unwrap());
    assert!(busy > 0.0 && busy <= 1.01, "{r}");
    let decode_s = r["decode_ms"].as_f64().unwrap() / 1e3;
    let implied = read * 24.0 / (busy * decode_s) / 1e9;
    assert!((while_busy - implied).abs() <= 1e-6 * implied, "{while_busy} against {implied}");
    // Belady bounds every demand-only policy replayed at the same capacity.
    let replay: Vec<(String, f64)> = serde_json::from_value(r["replay"].clone()).unwrap();
    let belady = replay.iter().find(|(p, _)| p.starts_with("Belady")).expect("Belady in the replay").1;
    for (p, h) in &replay {
        if !p.contains("prefetch") {
            assert!(*h <= belady + 1e-12, "{p} {h} beats Belady {belady}");
        }
    }
    // --preload: every expert read before timing, so a generous budget serves the run from RAM.
    let o = shimmer(&[
        "bench",
        "--model",
        c.to_str().unwrap(),
        "--ram-gb",
        "1",
        "--preload",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "8",
        "--no-usage",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["store"]["disk_misses"], 0, "{r}");
    assert_eq!(r["decode_hit_rate"], 1.0);
    assert_eq!(r["machine"]["threads"], 1);
    assert!(r["roofline_tok_s"].as_f64().unwrap() > 0.0 && r["active_bytes_per_token"].as_u64().unwrap() > 0);
    assert!(r["machine"]["memory_gb_s"].as_f64().unwrap() > 0.0 && r["machine"]["memory_read_gb_s"].as_f64().unwrap() > 0.0, "{r}");
    // A warm-up is bounded before anything runs.
    let o = shimmer(&["bench", "--model", c.to_str().unwrap(), "--warmup", "17", "--gen-tokens", "1"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--warmup must be at most 16"), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `--repetitions N` (llama-bench's `-r`) times N runs on fresh sequences and reports each run's
/// speeds with the medians as the speeds; the count is bounded, and a streaming run's reads per
/// token and hit rate are over every run's decode.
#[test]
fn bench_repetitions_report_every_run_and_their_medians() {
    let out = tempfile::tempdir().unwrap();
    let c = out.path().join("c");
    let o = shimmer(&["convert", "--from", fixture("qwen3_moe").to_str().unwrap(), "--to", c.to_str().unwrap(), "--quant", "int4-g32", "--quiet"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run = |extra: &[&str]| {
        let mut args =
            vec!["bench", "--model", c.to_str().unwrap(), "--prompt-tokens", "6", "--gen-tokens", "5", "--disk-probe-mb", "1", "--no-usage", "--json"];
        args.extend_from_slice(extra);
        shimmer(&args)
    };
    for (reps, extra) in [(3usize, &["--preload"][..]), (4, &["--ram-gb", "0.00005", "--direct-io"][..])] {
        let r_arg = reps.to_string();
        let mut args = vec!["--repetitions", r_arg.as_str()];
        args.extend_from_slice(extra);
        let o = run(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        for (runs, speed) in [("prefill_tok_s_runs", "prefill_tok_s"), ("decode_tok_s_runs", "decode_tok_s")] {
            let mut v: Vec<f64> = r[runs].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            assert_eq!(v.len(), reps, "{runs}: {r}");
            assert!(v.iter().all(|x| *x > 0.0), "{runs}: {r}");
            v.sort_by(f64::total_cmp);
            let got = r[speed].as_f64().unwrap();
            // The median of the times: the middle run for an odd count, between the middle two
            // for an even one.
            let (lo, hi) = if reps % 2 == 1 { (v[reps / 2], v[reps / 2]) } else { (v[reps / 2 - 1], v[reps / 2]) };
            assert!(got >= lo * (1.0 - 1e-9) && got <= hi * (1.0 + 1e-9), "{speed} {got} outside {lo}..{hi}: {r}");
        }
        if reps == 4 {
            let store = &r["store"];
            assert!(store["disk_misses"].as_u64().unwrap() > 0, "a small budget reads: {r}");
            assert!(r["decode_read_bytes_per_token"].as_f64().unwrap() > 0.0 && r["decode_hit_rate"].as_f64().unwrap() < 1.0, "{r}");
        }
    }
    // `--parallel N` (llama-batched-bench's `-npl`): N sequences prefilled together, then
    // decoded a token each a step; the report counts all of them.
    let o = run(&["--preload", "--parallel", "3"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let batched = &r["batched"];
    assert_eq!(batched["sequences"], 3, "{r}");
    let (prefill, decode, ms) = (batched["prefill_tok_s"].as_f64().unwrap(), batched["decode_tok_s"].as_f64().unwrap(), batched["decode_ms"].as_f64().unwrap());
    assert!(prefill > 0.0 && decode > 0.0 && ms > 0.0, "{r}");
    // 3 sequences × 5 tokens in decode_ms.
    assert!((decode * ms / 1e3 - 15.0).abs() < 1e-6, "{r}");
    for bad in ["0", "65"] {
        let o = run(&["--repetitions", bad]);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("--repetitions must be 1 to 64") && err.contains(bad), "{err}");
    }
}

/// `shimmer tune` measures every thread count up to the cores and the container's reads at every
/// depth, writes its choices beside the model, and the other verbs take them under their flags;
/// a tune file that is not one is refused, naming it.
#[test]
fn tune_writes_choices_the_other_verbs_read_under_their_flags() {
    let out = tempfile::tempdir().unwrap();
    let c = out.path().join("c");
    let o = shimmer(&["convert", "--from", fixture("qwen3_moe").to_str().unwrap(), "--to", c.to_str().unwrap(), "--quant", "int8", "--quiet"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = shimmer(&["tune", "--model", c.to_str().unwrap(), "--gen-tokens", "2", "--disk-probe-mb", "1", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let printed: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(!c.join("shimmer-usage.json").exists(), "tune writes nothing but its own file");
    let path = c.join("shimmer-tune.json");
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(printed, written);
    let cores = std::thread::available_parallelism().unwrap().get();
    let tried: Vec<u64> = written["measured"]["decode_tok_s_by_threads"].as_array().unwrap().iter().map(|t| t[0].as_u64().unwrap()).collect();
    assert_eq!(tried.first(), Some(&1));
    assert_eq!(tried.last(), Some(&(cores as u64)));
    assert!(tried.contains(&written["threads"].as_u64().unwrap()), "{written}");
    let depths: Vec<u64> = written["measured"]["disk_gb_s_by_depth"].as_array().unwrap().iter().map(|d| d[0].as_u64().unwrap()).collect();
    assert_eq!(depths, [1, 2, 4, 8, 16, 32]);
    assert!(depths.contains(&written["io_depth"].as_u64().unwrap()));
    // A tiny model fits: no expert budget to choose.
    assert!(written["ram_gb"].is_null(), "{written}");
    // The other verbs read it: threads from the file, unless --threads says otherwise.
    let threads_of = |extra: &[&str]| -> u64 {
        let mut args =
            vec!["bench", "--model", c.to_str().unwrap(), "--prompt-tokens", "4", "--gen-tokens", "2", "--disk-probe-mb", "1", "--no-usage", "--json"];
        args.extend_from_slice(extra);
        let o = shimmer(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["machine"]["threads"].as_u64().unwrap()
    };
    let mut edited = written.clone();
    edited["threads"] = 3.into();
    std::fs::write(&path, edited.to_string()).unwrap();
    assert_eq!(threads_of(&[]), 3);
    assert_eq!(threads_of(&["--threads", "1"]), 1);
    // Not a tune file: refused naming it, by every verb that runs the model.
    edited["io_depth"] = 999.into();
    std::fs::write(&path, edited.to_string()).unwrap();
    for verb in
        [&["bench", "--model", c.to_str().unwrap(), "--no-usage"][..], &["generate", "--model", c.to_str().unwrap(), "--prompt", "a", "--max-tokens", "1"][..]]
    {
        let o = shimmer(verb);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("shimmer-tune.json") && err.contains("io_depth 999"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}
