//! `shimmer bench`: prefill and decode speed of one model under the given expert placement, with
//! the yardsticks measured in the same run — the storage's read bandwidth (the disk limit a
//! streaming decode is judged against) and Belady's optimum for the expert cache at the same
//! capacity (from the run's own routing trace).
//!
//! Must never: assert a speed (it reports), or change what the model computes.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;
use shimmer_store::container::Container;
use shimmer_store::StoreTelemetry;

use crate::engine::{Engine, ExpertOptions};

/// Public-domain text (Genesis 1, KJV) the benchmark prompt is cut from, so routing is that of
/// real text rather than of random ids.
const PROMPT_TEXT: &str = "In the beginning God created the heaven and the earth. And the earth was without form, and void; \
and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God said, Let there \
be light: and there was light. And God saw the light, that it was good: and God divided the light from the darkness. And God \
called the light Day, and the darkness he called Night. And the evening and the morning were the first day. And God said, Let \
there be a firmament in the midst of the waters, and let it divide the waters from the waters. And God made the firmament, and \
divided the waters which were under the firmament from the waters which were above the firmament: and it was so.";

#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub experts_format: String,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub load_ms: f64,
    pub prefill_ms: f64,
    pub prefill_tok_s: f64,
    pub decode_ms: f64,
    pub decode_tok_s: f64,
    /// Expert bytes read from storage per decoded token.
    pub decode_read_bytes_per_token: f64,
    /// Of those, prefetches that no access used (issued during the decode, less those used).
    pub decode_unused_prefetch_bytes_per_token: f64,
    /// Time the decode waited on expert reads, as a fraction of decode time.
    pub decode_io_wait_fraction: f64,
    /// Time with at least one expert read in flight (its checksum and decoding included), as a
    /// fraction of decode time: what is left is time the disk had nothing to do.
    pub decode_disk_busy_fraction: f64,
    /// Bytes read ÷ that busy time: the bandwidth the decode's reads got while the disk worked.
    pub decode_read_gb_s_while_busy: f64,
    pub decode_hit_rate: f64,
    /// O_DIRECT (when the filesystem allows) read bandwidth of the experts file, whole blobs,
    /// `io_depth` in flight: the better of threads and an io_uring ring.
    pub disk_gb_s_at_depth: Option<f64>,
    pub disk_gb_s_depth1: Option<f64>,
    /// The two ways of reading at depth, each on its own sample (the one above is the better).
    pub disk_gb_s_threads: Option<f64>,
    pub disk_gb_s_ring: Option<f64>,
    /// How the store read its experts ("uring" or "threads"; empty without a store).
    pub io_engine: String,
    pub io_depth: usize,
    /// disk bandwidth ÷ expert bytes a decoded token needed (read, less unused prefetches).
    pub disk_limit_tok_s: Option<f64>,
    /// decode tok/s ÷ the disk limit.
    pub fraction_of_disk_limit: Option<f64>,
    /// Replayed over this run's trace at the store's capacity: (policy, demand hit rate).
    pub replay: Vec<(String, f64)>,
    pub store: Option<StoreTelemetry>,
    /// Each repetition's prefill and decode speed (`--repetitions`); `prefill_tok_s` and
    /// `decode_tok_s` are their medians (of the times: the same run is the middle one).
    pub prefill_tok_s_runs: Vec<f64>,
    pub decode_tok_s_runs: Vec<f64>,
    /// Time to first token: the prompt's prefill (its last position's logits give the token).
    pub ttft_ms: f64,
    pub peak_rss_bytes: Option<u64>,
    pub machine: Machine,
    /// Weight bytes a decoded token reads (dense part + top-k experts per MoE layer).
    pub active_bytes_per_token: u64,
    /// Memory bandwidth ÷ active bytes per token: decode speed if only memory reads mattered.
    pub roofline_tok_s: f64,
    pub fraction_of_roofline: f64,
    pub batched: Option<BatchedReport>,
}

#[derive(Debug, Serialize)]
pub struct Machine {
    pub cores: usize,
    pub threads: usize,
    pub isa: String,
    /// The integer dot product's ISA (a container's int8 / int4 / MXFP4 weights).
    pub int_isa: String,
    /// The ISA of one activation row's integer products (decode; `qdot::matvec_isa`).
    pub int_isa_one_row: String,
    /// A multi-threaded copy of 256 MiB, best of 3: (read + write) bytes per second.
    pub memory_gb_s: f64,
    /// Multi-threaded reads of the same 256 MiB, best of 3: bytes read per second — the most a
    /// decode that only reads weights could stream (0.8–0.9 of the copy figure on the VMs in
    /// `docs/benchmarks.md`). Beside `memory_gb_s`, which the roofline keeps using.
    pub memory_read_gb_s: f64,
}

/// Memory bandwidth with `threads` threads over 256 MiB (best of three each), as
/// `(copy, read)`: the copy counts reads and writes both (the memory system's sustainable rate);
/// the read-only pass XORs each thread's slice into one word, which the compiler keeps in vector
/// registers, so nothing but loads reaches memory.
pub(crate) fn memory_bandwidth(threads: usize) -> (f64, f64) {
    const BYTES: usize = 256 << 20;
    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    let chunk = BYTES.div_ceil(threads.max(1));
    let (mut copy, mut read) = (0.0f64, 0.0f64);
    for _ in 0..3 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(c));
            }
        });
        copy = copy.max(2.0 * BYTES as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    for _ in 0..3 {
        let t = Instant::now();
        let folded = std::thread::scope(|s| {
            let slices: Vec<_> = dst.chunks(chunk).map(|c| s.spawn(move || xor_words(c))).collect();
            slices.into_iter().map(|h| h.join().unwrap_or(0)).fold(0, |a, b| a ^ b)
        });
        std::hint::black_box(folded);
        read = read.max(BYTES as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    (copy, read)
}

/// Every 8-byte word of `bytes` XORed together (a tail shorter than a word is left out).
fn xor_words(bytes: &[u8]) -> u64 {
    bytes.chunks_exact(8).fold(0, |a, w| a ^ u64::from_ne_bytes(w.try_into().unwrap_or([0; 8])))
}

fn peak_rss() -> Option<u64> {
    crate::model_dir::proc_kb_field("/proc/self/status", "VmHWM")
}

pub struct BenchOptions {
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub probe_mb: u64,
    /// Text to take the tokens from (default: a built-in passage, repeated as needed).
    pub text: Option<String>,
    /// Read every expert the budget holds before timing (a resident-model benchmark).
    pub preload: bool,
    /// Runs of the prompt and decode steps on a throwaway sequence before timing.
    pub warmup: usize,
    /// Also decode this many sequences at once (0: not measured): llama-batched-bench's `-npl`.
    pub parallel: usize,
    /// Timed runs of the prompt and the decode steps, each on a fresh sequence (llama-bench's
    /// `-r`); the report's speeds are their medians. At least 1.
    pub repetitions: usize,
}

/// `parallel` sequences decoded together, each step one forward pass over all of them.
#[derive(Debug, Serialize)]
pub struct BatchedReport {
    pub sequences: usize,
    /// All sequences' prompts in one forward pass: prompt tokens of all ÷ its time.
    pub prefill_tok_s: f64,
    /// Tokens decoded by all sequences ÷ the decode steps' time.
    pub decode_tok_s: f64,
    pub decode_ms: f64,
}

/// The store's counters over decode steps (every repetition's, summed).
#[derive(Default, Clone, Copy)]
struct DecodeIo {
    bytes_read: u64,
    accesses: u64,
    hits: u64,
    wait_ms: f64,
    busy_s: f64,
    /// Bytes of prefetches issued in the window that no access used there.
    unused_prefetch_bytes: u64,
}

impl DecodeIo {
    /// Adds what the store did between `before` and `after`.
    fn add(&mut self, after: &StoreTelemetry, before: &StoreTelemetry) {
        let accesses = |t: &StoreTelemetry| t.ram_hits + t.in_flight_hits + t.disk_misses;
        let hits = |t: &StoreTelemetry| t.ram_hits + t.in_flight_hits;
        let unused = (after.prefetch_issued - before.prefetch_issued).saturating_sub(after.prefetch_useful - before.prefetch_useful);
        self.bytes_read += after.bytes_read - before.bytes_read;
        self.accesses += accesses(after) - accesses(before);
        self.hits += hits(after) - hits(before);
        self.wait_ms += after.io_wait_ms - before.io_wait_ms;
        self.busy_s += after.read_busy_s - before.read_busy_s;
        self.unused_prefetch_bytes += unused * after.expert_bytes;
    }
}

pub fn run(dir: &Path, opts: &ExpertOptions, bench: &BenchOptions) -> Result<BenchReport> {
    let engine = Engine::open(dir, opts).with_context(|| format!("cannot load model {}", dir.display()))?;
    // Decode steps feed the text's next tokens (teacher forcing), not sampled ones: the work per
    // step is a decode step's, and a random-weight model cannot collapse into repeating one token
    // (which would make every expert access a cache hit).
    let want = bench.prompt_tokens.max(1) + bench.gen_tokens;
    let mut text_ids = engine.tokenizer.encode(bench.text.as_deref().unwrap_or(PROMPT_TEXT), true)?;
    if text_ids.is_empty() {
        anyhow::bail!("the benchmark text has no tokens");
    }
    while text_ids.len() < want {
        let again = text_ids.clone();
        text_ids.extend(again);
    }
    text_ids.truncate(want);
    let room = engine.spec.max_position_embeddings;
    if want > room {
        anyhow::bail!("--prompt-tokens + --gen-tokens ({want}) exceed the model's context ({room})");
    }
    let (ids, continuation) = text_ids.split_at(bench.prompt_tokens.max(1));
    if bench.preload {
        engine.preload_experts()?;
    }
    // The prompt, then the continuation a token a step, in a fresh session. Steps run on a
    // compute thread, as `generate` and the server's batcher run them.
    let whole_pass = || {
        engine.on_compute_thread(|| {
            let mut session = engine.new_session();
            engine.step(&mut session, ids)?;
            continuation.iter().try_for_each(|next| engine.step(&mut session, &[*next]).map(drop))
        })
    };
    for _ in 0..bench.warmup {
        // Caches, page tables and the thread pool warm, as llama-bench's warm-up run leaves them;
        // the store's counters start after.
        whole_pass()?;
    }
    // Each repetition on a fresh sequence; the store's counters over every decode (a streaming
    // run's later repetitions find the cache the earlier ones left, as llama-bench's do).
    let (mut prefill_runs_ms, mut decode_runs_ms) = (Vec::new(), Vec::new());
    let mut decode_io: Option<DecodeIo> = None;
    let mut after = None;
    for _ in 0..bench.repetitions.max(1) {
        let mut session = engine.new_session();
        let t0 = Instant::now();
        engine.on_compute_thread(|| engine.step(&mut session, ids))?;
        prefill_runs_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        let before = engine.store_telemetry();
        let t1 = Instant::now();
        engine.on_compute_thread(|| continuation.iter().try_for_each(|next| engine.step(&mut session, &[*next]).map(drop)))?;
        decode_runs_ms.push(t1.elapsed().as_secs_f64() * 1e3);
        after = engine.store_telemetry();
        if let (Some(b), Some(a)) = (&before, &after) {
            decode_io.get_or_insert_default().add(a, b);
        }
    }
    let decode_total_ms: f64 = decode_runs_ms.iter().sum();
    let prefill_ms = median(&prefill_runs_ms);
    let decode_ms = median(&decode_runs_ms);
    // Before the bandwidth probes below allocate their buffers.
    let peak_rss_bytes = peak_rss();
    // The routing trace the policies are replayed on comes from a second, untimed pass over the
    // same tokens (teacher-forced, so routed the same): recording it predicts every layer's
    // next choice, work a plain decode does not do.
    let trace_path = std::env::temp_dir().join(format!("shimmer-bench-{}.trace", std::process::id()));
    engine.record_trace(&trace_path)?;
    let recorded = whole_pass();
    engine.end_turn();
    engine.finish_trace()?;
    recorded?;
    let trace = shimmer_common::trace::Trace::read(&trace_path);
    let _ = std::fs::remove_file(&trace_path);
    let trace = trace?;
    let batched = if bench.parallel > 0 { Some(engine.on_compute_thread(|| batched(&engine, &text_ids, ids.len(), bench.parallel))?) } else { None };

    let gen = (bench.gen_tokens.max(1) * decode_runs_ms.len()) as f64;
    let (mut read_per_token, mut io_wait_fraction, mut hit_rate, mut unused_per_token) = (0.0, 0.0, 1.0, 0.0);
    let (mut busy_fraction, mut gb_s_while_busy) = (0.0, 0.0);
    if let Some(io) = decode_io {
        read_per_token = io.bytes_read as f64 / gen;
        unused_per_token = io.unused_prefetch_bytes.min(io.bytes_read) as f64 / gen;
        io_wait_fraction = if decode_total_ms > 0.0 { io.wait_ms / decode_total_ms } else { 0.0 };
        busy_fraction = if decode_total_ms > 0.0 { io.busy_s * 1e3 / decode_total_ms } else { 0.0 };
        gb_s_while_busy = if io.busy_s > 0.0 { io.bytes_read as f64 / io.busy_s / 1e9 } else { 0.0 };
        hit_rate = if io.accesses > 0 { io.hits as f64 / io.accesses as f64 } else { 1.0 };
    }

    // The disk, measured now, the way the store reads it.
    #[cfg_attr(not(target_os = "linux"), allow(unused_mut))]
    let (mut disk, mut disk1, mut disk_threads, mut disk_ring) = (None, None, None, None);
    let mut format = "checkpoint (as stored)".to_string();
    if Container::is_container(dir) {
        let c = Container::open(dir, &engine.spec)?;
        format = c.manifest.expert_quant.clone();
        // Two disjoint samples, one a way of reading (threads, then the ring), so that neither
        // reads what the other just pulled into a cache below the page cache.
        let sample = shimmer_store::probe::shuffled_within(c.manifest.blobs.iter().map(|b| (b.offset, b.length)).collect(), 2 * bench.probe_mb * 1_000_000);
        let for_threads: Vec<(u64, u64)> = sample.iter().step_by(2).copied().collect();
        let for_ring: Vec<(u64, u64)> = sample.iter().skip(1).step_by(2).copied().collect();
        let experts = c.experts_path();
        let probe = |depth: usize, reads: &[(u64, u64)]| {
            shimmer_store::probe::read_bandwidth(&experts, reads, depth, true)
                .or_else(|_| shimmer_store::probe::read_bandwidth(&experts, reads, depth, false))
                .map(|b| b / 1e9)
                .ok()
        };
        disk_threads = probe(opts.io_depth, &for_threads);
        #[cfg(target_os = "linux")]
        {
            let ring = |direct| shimmer_store::probe::read_bandwidth_ring(&experts, &for_ring, opts.io_depth, direct);
            disk_ring = ring(true).or_else(|_| ring(false)).map(|b| b / 1e9).ok();
        }
        // The disk limit is the better of the two: what this disk gives, however it is asked.
        disk = match (disk_threads, disk_ring) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let few = &for_threads[..for_threads.len().min(64)];
        disk1 = probe(1, few);
    }
    // Against the reads a token needed: a prefetch that went unused is disk time spent, not a
    // read the limit may count (it would let wasted reads raise the fraction).
    let needed_per_token = read_per_token - unused_per_token;
    let disk_limit = disk.filter(|_| needed_per_token > 0.0).map(|gbs| gbs * 1e9 / needed_per_token);
    let decode_tok_s = if decode_ms > 0.0 { bench.gen_tokens as f64 / (decode_ms / 1e3) } else { 0.0 };

    let capacity = after.as_ref().map(|t| t.capacity_experts as usize).unwrap_or(usize::MAX);
    let layers = trace.header.layers.len();
    let all = layers * trace.header.experts as usize;
    let replay = if layers > 0 && !trace.tokens.is_empty() {
        let r = shimmer_store::trace_analysis::analyze(&trace, capacity.min(all).max(layers));
        r.policies.iter().map(|p| (p.policy.clone(), p.hit_rate)).collect()
    } else {
        Vec::new()
    };
    let expert_bytes = match after.as_ref() {
        Some(t) => t.expert_bytes,
        None => shimmer_store::expert_bytes_of(dir, &engine.spec)?,
    };
    let active = engine.active_bytes_per_token(expert_bytes);
    let threads = rayon::current_num_threads();
    let (memory_gb_s, memory_read_gb_s) = memory_bandwidth(threads);
    let machine = Machine {
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        threads,
        isa: shimmer_kernels::dot::isa().name().to_string(),
        int_isa: shimmer_kernels::qdot::int_isa().name().to_string(),
        int_isa_one_row: shimmer_kernels::qdot::matvec_isa().name().to_string(),
        memory_gb_s,
        memory_read_gb_s,
    };
    let roofline = machine.memory_gb_s * 1e9 / active.max(1) as f64;
    Ok(BenchReport {
        ttft_ms: prefill_ms,
        peak_rss_bytes,
        active_bytes_per_token: active,
        roofline_tok_s: roofline,
        fraction_of_roofline: decode_tok_s / roofline,
        machine,
        model: dir.display().to_string(),
        experts_format: format,
        prompt_tokens: ids.len(),
        gen_tokens: bench.gen_tokens,
        load_ms: engine.load_ms,
        prefill_ms,
        prefill_tok_s: ids.len() as f64 / (prefill_ms / 1e3).max(1e-9),
        decode_ms,
        decode_tok_s,
        decode_read_bytes_per_token: read_per_token,
        decode_unused_prefetch_bytes_per_token: unused_per_token,
        decode_io_wait_fraction: io_wait_fraction,
        decode_disk_busy_fraction: busy_fraction,
        decode_read_gb_s_while_busy: gb_s_while_busy,
        decode_hit_rate: hit_rate,
        disk_gb_s_at_depth: disk,
        disk_gb_s_threads: disk_threads,
        disk_gb_s_ring: disk_ring,
        disk_gb_s_depth1: disk1,
        io_depth: opts.io_depth,
        io_engine: after.as_ref().map(|t| t.io_engine.clone()).unwrap_or_default(),
        disk_limit_tok_s: disk_limit,
        fraction_of_disk_limit: disk_limit.map(|l| decode_tok_s / l),
        replay,
        store: after,
        batched,
        prefill_tok_s_runs: prefill_runs_ms.iter().map(|ms| ids.len() as f64 / (ms / 1e3).max(1e-9)).collect(),
        decode_tok_s_runs: decode_runs_ms.iter().map(|ms| if *ms > 0.0 { bench.gen_tokens as f64 / (ms / 1e3) } else { 0.0 }).collect(),
    })
}

/// The middle value (the mean of the two middle ones for an even count); 0 for none.
fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// `n` sequences, each its own text (the benchmark text from a different offset, so their routing
/// differs), prefilled in one pass and then decoded together, one token each per step.
fn batched(engine: &Engine, text: &[u32], prompt: usize, n: usize) -> Result<BatchedReport> {
    let gen = text.len() - prompt;
    let texts = batch_texts(text, n);
    let mut sessions: Vec<_> = (0..n).map(|_| engine.new_session()).collect();
    let t0 = Instant::now();
    batch_step(engine, &mut sessions, &texts, 0..prompt)?;
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for step in 0..gen {
        batch_step(engine, &mut sessions, &texts, prompt + step..prompt + step + 1)?;
    }
    let decode = t1.elapsed().as_secs_f64();
    engine.end_turn();
    Ok(BatchedReport {
        sequences: n,
        prefill_tok_s: (n * prompt) as f64 / prefill.max(1e-9),
        decode_tok_s: (n * gen) as f64 / decode.max(1e-9),
        decode_ms: decode * 1e3,
    })
}

/// `n` texts for a batch: `text` rotated by 7 tokens more for each, so that the sequences differ.
pub fn batch_texts(text: &[u32], n: usize) -> Vec<Vec<u32>> {
    (0..n).map(|i| text.iter().cycle().skip(i * 7 % text.len().max(1)).take(text.len()).copied().collect()).collect()
}

/// One forward pass of a batch: session `i` takes tokens `range` of `texts[i]`, each wanting its
/// last row's logits.
pub fn batch_step(engine: &Engine, sessions: &mut [crate::engine::Session], texts: &[Vec<u32>], range: std::ops::Range<usize>) -> Result<()> {
    use shimmer_model::{Logits, Segment};
    let mut segments: Vec<Segment<'_>> =
        sessions.iter_mut().zip(texts).map(|(s, t)| Segment { tokens: &t[range.clone()], cache: &mut s.cache, want: Logits::Last }).collect();
    engine.forward_batch(&mut segments)?;
    Ok(())
}
