//! Continuous batching: one thread owns the forward passes and runs every admitted request in
//! them together. Each step feeds every decoding sequence its one new token and every sequence
//! still reading its prompt a chunk of it (at most `PREFILL_CHUNK` prompt tokens per step, shared
//! out in arrival order, so a long prompt does not stall the others' decoding for long), in one
//! `Engine::forward_batch` — every MoE layer thus makes one batch-union expert dispatch for all of
//! them. Sequences compute exactly as they would alone (DESIGN.md §1), so a request's greedy
//! tokens do not depend on what else is running.
//!
//! Requests wait in a bounded queue (`max_queue`: a full queue is refused at once, the HTTP layer
//! answers 429); at most `max_batch` run at a time. A request whose receiver is gone (the client
//! disconnected) is dropped at the next step, its KV freed.
//!
//! Must never: block on a client, or let one request's sampling see another's tokens.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use super::dashboard::{Breakdown, Dashboard, LastTurn, StepRouting};
use super::prefix_cache::PrefixCache;
use crate::constraint::Constraint;
use crate::engine::{Engine, FinishReason, GenerateOptions, Session, TextStream};
use crate::sampling::Sampler;
use shimmer_model::{Logits, Segment};

/// Prompt tokens one step may prefill, across all sequences.
pub const PREFILL_CHUNK: usize = 256;

/// One generation request.
pub struct Job {
    pub prompt: Vec<u32>,
    pub opts: GenerateOptions,
    /// OpenAI's `presence_penalty` and `frequency_penalty` (over the generated tokens).
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Report each token's log-probability, with this many alternatives (`None`: no logprobs).
    pub logprobs: Option<usize>,
    /// The grammar the output follows (`response_format`, a required tool call, …), compiled.
    pub constraint: Option<Constraint>,
    pub events: UnboundedSender<Event>,
    /// When the request arrived (for the queue-time metric).
    pub submitted: Instant,
    /// Decode the answer with its special tokens (a chat format whose markers are such tokens,
    /// `chat_format.rs`); otherwise they are left out, as transformers' `skip_special_tokens`.
    pub keep_special_tokens: bool,
}

/// A token's log-probability under the model (raw logits, before sampling's processors) and the
/// most likely alternatives at its position.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug)]
pub enum Event {
    /// Text that became final, and the tokens sampled since the last event.
    Text {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// `stop_sequence`: the stop string that ended the answer, if one did.
    Done {
        finish: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        stop_sequence: Option<String>,
    },
    Error {
        fault: Fault,
        message: String,
    },
}

/// Whose the failure is: it decides the HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The request cannot be served as asked (400).
    Request,
    /// The model cannot be computed now: an expert no worker can serve (503).
    Unavailable,
    /// Anything else that went wrong here (500).
    Internal,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SubmitError {
    #[error("the request queue is full ({0} waiting)")]
    QueueFull(usize),
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// What the dashboard and `/metrics` read.
#[derive(Debug, Default, Clone)]
pub struct BatcherStats {
    pub running: usize,
    pub waiting: usize,
    pub steps: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub requests_finished: u64,
    /// Requests that started from a cached prefix, and the prompt tokens that saved.
    pub prefix_hits: u64,
    pub prefix_reused_tokens: u64,
    /// KV held by running requests and by the prefix cache, and the prefix cache's budget.
    pub kv_bytes: u64,
    pub kv_budget_bytes: u64,
}

enum Msg {
    Job(Box<Job>),
    Shutdown,
}

/// The handle the HTTP layer submits through.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::Sender<Msg>,
    queued: Arc<AtomicUsize>,
    max_queue: usize,
    closing: Arc<AtomicBool>,
    pub stats: Arc<Mutex<BatcherStats>>,
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl Batcher {
    /// `kv_budget_bytes`: KV kept from finished requests for prefix reuse (0: none);
    /// `expert_bytes`: one routed expert's bytes (for the bytes-served tiers).
    pub fn start(
        engine: Arc<Engine>,
        max_batch: usize,
        max_queue: usize,
        kv_budget_bytes: usize,
        dash: Arc<Mutex<Dashboard>>,
        expert_bytes: u64,
        metrics: Arc<super::metrics::Metrics>,
    ) -> Batcher {
        let (tx, rx) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let stats = Arc::new(Mutex::new(BatcherStats::default()));
        let (q, st) = (queued.clone(), stats.clone());
        let thread = std::thread::Builder::new()
            .name("batcher".into())
            .spawn(move || {
                let moe_layers: Vec<usize> = (0..engine.spec.num_layers).filter(|l| engine.spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).collect();
                let last_store = engine.store_telemetry();
                let last_network_wait = engine.network_wait();
                let last_vram_hits = engine.gpu_telemetry().map(|g| g.vram_hits);
                Loop {
                    engine,
                    rx,
                    queued: q,
                    stats: st,
                    max_batch: max_batch.max(1),
                    waiting: VecDeque::new(),
                    active: Vec::new(),
                    prefix: PrefixCache::new(kv_budget_bytes),
                    dash,
                    moe_layers,
                    expert_bytes,
                    last_store,
                    last_network_wait,
                    last_vram_hits,
                    metrics,
                }
                .run()
            })
            .expect("cannot start the batcher thread");
        stats.lock().unwrap_or_else(|e| e.into_inner()).kv_budget_bytes = kv_budget_bytes as u64;
        Batcher { tx, queued, max_queue, closing: Arc::new(AtomicBool::new(false)), stats, thread: Arc::new(Mutex::new(Some(thread))) }
    }

    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// Queues a request, or refuses it at once when the queue is full or the server is closing.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        if self.closing.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        let n = self.queued.fetch_add(1, Ordering::SeqCst);
        if n >= self.max_queue {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(n));
        }
        self.tx.send(Msg::Job(Box::new(job))).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            SubmitError::ShuttingDown
        })
    }

    /// Stops admitting, cancels what is queued or running (their streams end with
    /// `FinishReason::Cancelled`, which the API reports as vLLM does, `"abort"`), persists usage,
    /// and waits for the thread.
    pub fn shutdown(&self) {
        self.closing.store(true, Ordering::SeqCst);
        let _ = self.tx.send(Msg::Shutdown);
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// A running request.
struct Seq {
    job: Job,
    session: Session,
    /// Prompt tokens fed so far.
    fed: usize,
    output: Vec<u32>,
    sampler: Sampler,
    text: TextStream,
    /// Counts of each generated token (for the penalties).
    counts: std::collections::HashMap<u32, u32>,
    admitted: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    breakdown: Breakdown,
    /// The grammar the output follows, where the request gave one.
    constraint: Option<Constraint>,
}

struct Loop {
    engine: Arc<Engine>,
    rx: mpsc::Receiver<Msg>,
    queued: Arc<AtomicUsize>,
    stats: Arc<Mutex<BatcherStats>>,
    max_batch: usize,
    waiting: VecDeque<Job>,
    active: Vec<Seq>,
    prefix: PrefixCache,
    dash: Arc<Mutex<Dashboard>>,
    moe_layers: Vec<usize>,
    expert_bytes: u64,
    /// The store's counters after the previous step (for per-step I/O wait and bytes).
    last_store: Option<shimmer_store::StoreTelemetry>,
    /// On a cluster, the network wait so far (its growth is a step's wait on workers).
    last_network_wait: Option<std::time::Duration>,
    /// The VRAM tier's hits so far (its growth is what a step computed from VRAM).
    last_vram_hits: Option<u64>,
    /// Each token's text as it extends an output (built at the first constrained request).
    metrics: Arc<super::metrics::Metrics>,
}

impl Loop {
    fn run(mut self) {
        let engine = self.engine.clone();
        loop {
            // Wait when idle, off the compute threads.
            if self.active.is_empty() && self.waiting.is_empty() {
                match self.rx.recv() {
                    Ok(m) => {
                        if self.take(m) {
                            return self.shut_down();
                        }
                    }
                    Err(_) => break,
                }
            }
            // While there is work the loop runs on a compute thread: each step's pass then
            // starts there instead of waking the pool from outside and waiting on it.
            if engine.on_compute_thread(|| self.serve_until_idle()) {
                return self.shut_down();
            }
        }
    }

    /// Queues a message; true for a shutdown.
    fn take(&mut self, msg: Msg) -> bool {
        match msg {
            Msg::Job(j) => {
                self.waiting.push_back(*j);
                false
            }
            Msg::Shutdown => true,
        }
    }

    /// Takes whatever has arrived and steps until nothing runs or waits; true when told to shut
    /// down.
    fn serve_until_idle(&mut self) -> bool {
        loop {
            let mut shutdown = false;
            while let Ok(msg) = self.rx.try_recv() {
                shutdown |= self.take(msg);
            }
            if shutdown {
                return true;
            }
            self.admit();
            if !self.active.is_empty() {
                self.step();
            }
            self.publish();
            if self.active.is_empty() && self.waiting.is_empty() {
                return false;
            }
        }
    }

    fn shut_down(&mut self) {
        for seq in self.active.drain(..) {
            let _ = seq.job.events.send(Event::Done {
                finish: FinishReason::Cancelled,
                prompt_tokens: seq.job.prompt.len(),
                completion_tokens: seq.output.len(),
                stop_sequence: None,
            });
        }
        for job in self.waiting.drain(..) {
            let _ =
                job.events.send(Event::Done { finish: FinishReason::Cancelled, prompt_tokens: job.prompt.len(), completion_tokens: 0, stop_sequence: None });
        }
        self.engine.end_turn();
    }

    fn admit(&mut self) {
        // Requests whose client left while queued never start.
        self.waiting.retain(|j| {
            let keep = !j.events.is_closed();
            if !keep {
                self.queued.fetch_sub(1, Ordering::SeqCst);
            }
            keep
        });
        while self.active.len() < self.max_batch {
            let Some(job) = self.waiting.pop_front() else { break };
            self.queued.fetch_sub(1, Ordering::SeqCst);
            self.metrics.queued(job.submitted.elapsed());
            if let Err(e) = self.engine.check_prompt(&job.prompt).and_then(|_| job.opts.sampling.validate().map_err(crate::engine::EngineError::Input)) {
                let _ = job.events.send(Event::Error { fault: Fault::Request, message: e.to_string() });
                continue;
            }
            let sampler = Sampler::new(job.opts.sampling.clone());
            let text = TextStream::new(&job.opts.stop);
            // Start from the longest cached prefix of the prompt, if any.
            let session = self.prefix.lookup(&job.prompt).unwrap_or_else(|| self.engine.new_session());
            let fed = session.tokens.len();
            let mut job = job;
            let constraint = job.constraint.take();
            self.active.push(Seq {
                session,
                fed,
                output: Vec::new(),
                sampler,
                text,
                counts: Default::default(),
                job,
                admitted: Instant::now(),
                first_token: None,
                last_token: None,
                breakdown: Breakdown::default(),
                constraint,
            });
        }
    }

    /// One forward pass for every active sequence, then sampling for those that finished their prompt.
    fn step(&mut self) {
        self.active.retain(|s| !s.job.events.is_closed());
        if self.active.is_empty() {
            return;
        }
        // Decoding sequences first (one token each), then prompt chunks in arrival order.
        let mut budget = PREFILL_CHUNK;
        let mut feeds: Vec<Vec<u32>> = Vec::with_capacity(self.active.len());
        for seq in &self.active {
            let remaining = seq.job.prompt.len() - seq.fed;
            if remaining == 0 {
                feeds.push(seq.output.last().map(|t| vec![*t]).unwrap_or_default());
            } else {
                let take = remaining.min(budget);
                budget -= take;
                feeds.push(seq.job.prompt[seq.fed..seq.fed + take].to_vec());
            }
        }
        let mut segments: Vec<Segment<'_>> = Vec::new();
        let mut which = Vec::new();
        // The grammars of the sequences that sample after this pass compute their masks on another
        // thread while it runs (a mask depends only on the tokens already committed).
        let mut constraints: Vec<&mut Constraint> = Vec::new();
        for (i, (seq, feed)) in self.active.iter_mut().zip(&feeds).enumerate() {
            if !feed.is_empty() {
                let samples = seq.fed + feed.len() >= seq.job.prompt.len();
                let Seq { session, constraint, .. } = seq;
                segments.push(Segment { tokens: feed, cache: &mut session.cache, want: Logits::Last });
                which.push(i);
                if let Some(c) = constraint.as_mut().filter(|_| samples) {
                    constraints.push(c);
                }
            }
        }
        let t0 = Instant::now();
        let mut routing = StepRouting::new(self.engine.spec.num_layers, &self.moe_layers, self.engine.spec.moe.num_experts);
        let engine = &self.engine;
        let result = std::thread::scope(|scope| {
            let masks = (!constraints.is_empty()).then(|| {
                scope.spawn(move || {
                    for c in constraints {
                        c.prepare();
                    }
                })
            });
            let result = engine.forward_batch_observed(&mut segments, &mut routing);
            // A mask not prepared (should that thread fail) is computed when sampling.
            let _ = masks.map(|m| m.join());
            result
        });
        drop(segments);
        // What the store (or the cluster) did during the step: its wait for reads (answers), and
        // bytes by tier.
        let store = self.engine.store_telemetry();
        let network_wait = self.last_network_wait.map(|before| {
            let now = self.engine.network_wait().unwrap_or(before);
            self.last_network_wait = Some(now);
            now.saturating_sub(before)
        });
        let store_less = store.is_none() && network_wait.is_none();
        let (io_wait, ram_bytes, disk_bytes, remote_bytes) = match (&store, &self.last_store, network_wait) {
            (_, _, Some(wait)) => (wait, 0, 0, routing.distinct * self.expert_bytes),
            (Some(now), Some(before), None) => (
                std::time::Duration::from_secs_f64((now.io_wait_ms - before.io_wait_ms).max(0.0) / 1e3),
                (now.ram_hits + now.in_flight_hits).saturating_sub(before.ram_hits + before.in_flight_hits) * self.expert_bytes,
                now.bytes_read.saturating_sub(before.bytes_read),
                0,
            ),
            _ => (std::time::Duration::ZERO, routing.distinct * self.expert_bytes, 0, 0),
        };
        self.last_store = store;
        // Experts computed on the GPU from VRAM: served by the tier above RAM.
        let vram_hits = self.engine.gpu_telemetry().map(|g| g.vram_hits);
        let vram_bytes = match (vram_hits, self.last_vram_hits) {
            (Some(now), Some(before)) => now.saturating_sub(before) * self.expert_bytes,
            _ => 0,
        };
        self.last_vram_hits = vram_hits;
        // Without a store every expert not computed from VRAM was in RAM.
        let ram_bytes = if store_less { ram_bytes.saturating_sub(vram_bytes) } else { ram_bytes };
        for i in &which {
            self.active[*i].breakdown.add_step(&routing.phases, io_wait);
        }
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                // A forward error (an unreachable expert) fails every request in this step.
                for i in which.iter().rev() {
                    let seq = self.active.remove(*i);
                    let _ = seq.job.events.send(Event::Error { fault: Fault::Unavailable, message: e.to_string() });
                }
                return;
            }
        };
        tracing::trace!(sequences = which.len(), ms = t0.elapsed().as_secs_f64() * 1e3, "step");
        let mut finished = Vec::new();
        let (mut prompt_tokens, mut generated) = (0u64, 0u64);
        for (i, mut row) in which.iter().copied().zip(logits) {
            let seq = &mut self.active[i];
            let feed = &feeds[i];
            seq.session.tokens.extend_from_slice(feed);
            if seq.fed < seq.job.prompt.len() {
                seq.fed += feed.len();
                prompt_tokens += feed.len() as u64;
                if seq.fed < seq.job.prompt.len() {
                    continue; // more prompt to read before the first token
                }
            }
            generated += 1;
            let t_sample = Instant::now();
            let finish = Self::sample(&self.engine, seq, &mut row);
            seq.breakdown.sampling_ms += t_sample.elapsed().as_secs_f64() * 1e3;
            let now = Instant::now();
            seq.first_token.get_or_insert(now);
            if let Some(prev) = seq.last_token.replace(now) {
                self.metrics.inter_token(now - prev);
            }
            if let Some(finish) = finish {
                finished.push((i, finish));
            }
        }
        {
            let mut dash = self.dash.lock().unwrap_or_else(|e| e.into_inner());
            dash.tiers.vram_bytes += vram_bytes;
            dash.tiers.ram_bytes += ram_bytes;
            dash.tiers.disk_bytes += disk_bytes;
            dash.tiers.remote_bytes += remote_bytes;
            dash.step(&routing, generated, Instant::now());
        }
        for (i, finish) in finished.into_iter().rev() {
            let mut seq = self.active.remove(i);
            let rest = seq.text.finish().to_string();
            if !rest.is_empty() {
                let _ = seq.job.events.send(Event::Text { text: rest, logprobs: Vec::new() });
            }
            let stop_sequence = seq.text.matched.clone();
            {
                let first = seq.first_token.unwrap_or(seq.admitted);
                let ttft_ms = first.duration_since(seq.admitted).as_secs_f64() * 1e3;
                let decode_s = first.elapsed().as_secs_f64();
                let turn = LastTurn {
                    breakdown: seq.breakdown,
                    prompt_tokens: seq.job.prompt.len(),
                    completion_tokens: seq.output.len(),
                    ttft_ms,
                    decode_tok_s: if decode_s > 0.0 { seq.output.len().saturating_sub(1) as f64 / decode_s } else { 0.0 },
                };
                let mut dash = self.dash.lock().unwrap_or_else(|e| e.into_inner());
                dash.ttft_ms = Some(ttft_ms);
                dash.last_turn = Some(turn);
            }
            let _ = seq.job.events.send(Event::Done { finish, prompt_tokens: seq.job.prompt.len(), completion_tokens: seq.output.len(), stop_sequence });
            self.prefix.insert(seq.session);
            self.engine.end_turn();
            self.stats.lock().unwrap_or_else(|e| e.into_inner()).requests_finished += 1;
        }
        let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        st.steps += 1;
        st.prompt_tokens += prompt_tokens;
        st.generated_tokens += generated;
    }

    /// Samples the next token from `logits`; returns why the sequence ends, if it does.
    fn sample(engine: &Engine, seq: &mut Seq, logits: &mut [f32]) -> Option<FinishReason> {
        let lp = seq.job.logprobs.map(|top| logprobs_of(logits, top));
        for (tok, n) in &seq.counts {
            if let Some(l) = logits.get_mut(*tok as usize) {
                *l -= seq.job.presence_penalty + seq.job.frequency_penalty * *n as f32;
            }
        }
        // Constrained output: only the tokens the grammar allows next; the end of text only where
        // the output is whole. Near the end of the budget (tokens left, by `max_tokens` or the
        // context), only tokens after which the grammar can still close in what is left; the
        // logits are kept to sample again from the plan's tokens when the model's choice is not.
        let left = seq.job.opts.max_tokens.saturating_sub(seq.output.len()).min(seq.session.cache.capacity().saturating_sub(seq.session.cache.len()));
        let mut before_mask = None;
        if let Some(c) = &mut seq.constraint {
            if c.near_end(left) {
                before_mask = Some(logits.to_vec());
            }
            let fault = match c.allowed() {
                Ok(allowed) if allowed.apply(logits) => None,
                Ok(_) => Some("constrained decoding reached a point no token of this model's vocabulary can continue".to_string()),
                Err(e) => Some(format!("constrained decoding failed: {e}")),
            };
            if let Some(message) = fault {
                let _ = seq.job.events.send(Event::Error { fault: Fault::Internal, message });
                return Some(FinishReason::Cancelled);
            }
        }
        let mut next = seq.sampler.sample(logits, &seq.session.tokens);
        if let (Some(c), Some(mut again)) = (&mut seq.constraint, before_mask) {
            if !c.fits_after(next, left.saturating_sub(1)) {
                if let Some(plan) = c.plan_tokens() {
                    next = if plan.apply(&mut again) { seq.sampler.sample(&mut again, &seq.session.tokens) } else { plan.first() };
                }
            }
        }
        if engine.eos_ids.contains(&next) {
            return Some(FinishReason::Stop);
        }
        let mut grammar_done = false;
        if let Some(c) = &mut seq.constraint {
            if let Err(e) = c.commit(next) {
                let _ = seq.job.events.send(Event::Error { fault: Fault::Internal, message: format!("constrained decoding failed: {e}") });
                return Some(FinishReason::Cancelled);
            }
            grammar_done = c.is_finished();
        }
        seq.output.push(next);
        *seq.counts.entry(next).or_insert(0) += 1;
        let logprobs: Vec<TokenLogprob> = lp.map(|f| f(next)).into_iter().collect();
        let text = match engine.tokenizer.decode(&seq.output, !seq.job.keep_special_tokens) {
            Ok(t) => t,
            Err(e) => {
                let _ = seq.job.events.send(Event::Error { fault: Fault::Internal, message: e.to_string() });
                return Some(FinishReason::Cancelled);
            }
        };
        let (fresh, stopped) = seq.text.push(&text);
        if !fresh.is_empty() || !logprobs.is_empty() {
            let _ = seq.job.events.send(Event::Text { text: fresh.to_string(), logprobs });
        }
        if stopped || grammar_done {
            return Some(FinishReason::Stop);
        }
        if seq.output.len() >= seq.job.opts.max_tokens || seq.session.cache.len() + 1 > seq.session.cache.capacity() {
            return Some(FinishReason::Length);
        }
        None
    }

    fn publish(&self) {
        let kv = self.prefix.bytes() + self.active.iter().map(|s| s.session.cache.bytes()).sum::<usize>();
        let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        st.prefix_hits = self.prefix.hits;
        st.prefix_reused_tokens = self.prefix.reused_tokens;
        st.kv_bytes = kv as u64;
        st.running = self.active.len();
        // Every request submitted and not yet admitted, whether still in the channel or here.
        st.waiting = self.queued.load(Ordering::SeqCst);
    }
}

/// The log-softmax of `logits` (before any penalty or sampling processor), as a function of the
/// token that gets sampled: its log-probability and the `top` most likely tokens'.
fn logprobs_of(logits: &[f32], top: usize) -> impl FnOnce(u32) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|l| ((l - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = top.min(idx.len());
        idx.select_nth_unstable_by(k.saturating_sub(1), |a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        idx.truncate(k);
        idx.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b)));
        best = idx.into_iter().map(|i| (i, (logits[i as usize] as f64 - log_z) as f32)).collect();
    }
    // The sampler rewrites the logits in place; keep the raw ones for the chosen token.
    let chosen_logits = logits.to_vec();
    move |id| TokenLogprob { id, logprob: (chosen_logits[id as usize] as f64 - log_z) as f32, top: best }
}
