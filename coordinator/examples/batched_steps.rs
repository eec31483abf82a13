//! A batch's decode steps in a loop, for profiling: `parallel` sequences each prefilled with
//! `prompt` tokens, then `gen` steps of one token each, repeated `rounds` times on fresh
//! sequences; prints each round's step time. Teacher-forced on the model's tokenizer's tokens of
//! a fixed text, as `shimmer bench --parallel` does. With `MARK_DECODE` set, each round's
//! prefill and decode start and end go to stderr in CLOCK_MONOTONIC seconds (`prefill A B`,
//! `decode A B`), to cut a `perf record -k CLOCK_MONOTONIC` profile to one phase.
//!
//! `cargo run --release -p shimmer-coordinator --example batched_steps -- MODEL_DIR [PARALLEL [PROMPT [GEN [ROUNDS [THREADS]]]]]`

use std::time::Instant;

use shimmer_coordinator::engine::{Engine, ExpertOptions, UsageFile};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir =
        std::path::PathBuf::from(args.get(1).ok_or_else(|| anyhow::anyhow!("usage: batched_steps MODEL_DIR [PARALLEL [PROMPT [GEN [ROUNDS [THREADS]]]]]"))?);
    let num = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (parallel, prompt, gen, rounds, threads) = (num(2, 16), num(3, 64), num(4, 32), num(5, 20), num(6, 2));
    let _ = rayon::ThreadPoolBuilder::new().num_threads(threads).build_global();
    let opts = ExpertOptions { usage: UsageFile::Off, ..ExpertOptions::default() };
    let engine = Engine::open(&dir, &opts)?;
    engine.preload_experts()?;
    let words = "The quick brown fox jumps over the lazy dog while the river runs to the sea and ";
    let mut text = engine.tokenizer.encode(&words.repeat(64), true)?;
    text.truncate(prompt + gen);
    anyhow::ensure!(text.len() == prompt + gen, "the text is too short");
    let texts = shimmer_coordinator::bench::batch_texts(&text, parallel);
    for round in 0..rounds {
        let mut sessions: Vec<_> = (0..parallel).map(|_| engine.new_session()).collect();
        let (prefill, decode) = engine.on_compute_thread(|| -> anyhow::Result<(f64, f64)> {
            let t0 = Instant::now();
            let prefill_mark = monotonic();
            shimmer_coordinator::bench::batch_step(&engine, &mut sessions, &texts, 0..prompt)?;
            let prefill = t0.elapsed().as_secs_f64();
            if std::env::var_os("MARK_DECODE").is_some() {
                eprintln!("prefill {prefill_mark:.6} {:.6}", monotonic());
            }
            let t1 = Instant::now();
            let mark = monotonic();
            for step in 0..gen {
                shimmer_coordinator::bench::batch_step(&engine, &mut sessions, &texts, prompt + step..prompt + step + 1)?;
            }
            if std::env::var_os("MARK_DECODE").is_some() {
                eprintln!("decode {mark:.6} {:.6}", monotonic());
            }
            Ok((prefill, t1.elapsed().as_secs_f64()))
        })?;
        println!(
            "round {round}: prefill {:.0} tok/s, decode {:.0} tok/s ({:.1} µs a step)",
            (parallel * prompt) as f64 / prefill,
            (parallel * gen) as f64 / decode,
            decode * 1e6 / gen as f64
        );
    }
    Ok(())
}

/// CLOCK_MONOTONIC in seconds, as `perf record -k CLOCK_MONOTONIC` stamps its samples.
fn monotonic() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec to write.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}
