//! The single-box engine: a loaded model (spec, tokenizer, chat template, dense decoder, the
//! in-process expert dispatcher) and the operations the CLI and, later, the API offer on it:
//! scoring, and generation that streams text and stops on EOS ids, stop strings or length.

use std::path::Path;
use std::time::Instant;

use shimmer_common::chat_template::{ChatConfig, Message};
use shimmer_common::tokenizer::Tokenizer;
use shimmer_common::{LoadError, ModelSpec};
use std::path::PathBuf;

use shimmer_experts::ExpertDispatch;
use shimmer_model::kv_cache::KvCache;
use shimmer_model::{Decoder, ForwardError, Logits, MoeObserver, Segment};
use shimmer_store::{ExpertStore, StoreTelemetry};
use shimmer_worker::RemoteExperts;

use crate::model_dir::ModelDir;
use crate::sampling::{argmax, Sampler, SamplingParams};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error("{0}")]
    Input(String),
}

/// Where an engine's routed experts are: what the decoder computes them through, and what can be
/// asked of each kind beyond that (the store's counters, the cluster's links) — read from the
/// concrete type, never through `ExpertDispatch`.
pub enum Experts {
    /// In this process's memory, or any dispatcher a caller assembled.
    InProcess(Box<dyn ExpertDispatch>),
    /// The tiered store: a RAM budget over a container or checkpoint.
    Store(Box<ExpertStore>),
    /// On workers, over QUIC.
    Cluster(Box<RemoteExperts>),
}

impl Experts {
    pub fn dispatch(&self) -> &dyn ExpertDispatch {
        match self {
            Experts::InProcess(d) => d.as_ref(),
            Experts::Store(s) => s.as_ref(),
            Experts::Cluster(r) => r.as_ref(),
        }
    }

    pub fn store(&self) -> Option<&ExpertStore> {
        match self {
            Experts::Store(s) => Some(s),
            _ => None,
        }
    }

    pub fn cluster(&self) -> Option<&RemoteExperts> {
        match self {
            Experts::Cluster(r) => Some(r),
            _ => None,
        }
    }
}

pub struct Engine {
    pub spec: ModelSpec,
    pub tokenizer: Tokenizer,
    pub chat: ChatConfig,
    decoder: Decoder,
    experts: Experts,
    /// Every id that ends generation: config.json's and generation_config.json's.
    pub eos_ids: Vec<u32>,
    pub load_ms: f64,
    /// Identity of this model's config and weights (see `Checkpoint::fingerprint`).
    pub fingerprint: String,
    /// `--trace`: the routing recorder every forward pass reports to, when set.
    trace: std::sync::Mutex<Option<crate::trace_recorder::TraceRecorder>>,
    /// Dense weights' bytes, reported beside the expert budget when the store is in use.
    pub dense_bytes: Option<u64>,
    /// The VRAM tier, when experts are computed on a GPU (for its telemetry).
    vram: Option<std::sync::Arc<shimmer_gpu::VramTier>>,
    /// Compute threads (as many as the global rayon pool has: one per core unless set).
    pool: rayon::ThreadPool,
}

/// A conversation's KV cache and the tokens it holds, kept between turns.
#[derive(Clone)]
pub struct Session {
    pub cache: KvCache,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    /// The caller asked to stop (Ctrl-C in the terminal chat).
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct Generation {
    /// Every sampled token except a final EOS.
    pub output_ids: Vec<u32>,
    /// The decoded output, cut before the first stop string.
    pub text: String,
    pub finish_reason: FinishReason,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    /// Tokens produced by decode steps (the first token comes from prefill).
    pub decode_tokens: usize,
    /// Prompt positions taken from the session's cache instead of computed again.
    pub reused_tokens: usize,
}

pub struct Score {
    pub argmax: Vec<u32>,
    pub logprobs: Vec<f32>,
}

/// How much RAM the expert cache may use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RamBudget {
    Gb(f64),
    /// What the machine can spare: available memory less the dense weights and a reserve.
    Auto,
}

impl RamBudget {
    pub fn parse(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(RamBudget::Auto);
        }
        match s.parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 => Ok(RamBudget::Gb(v)),
            _ => Err(format!("`{s}` is not a positive number of GB or `auto`")),
        }
    }
}

/// Where learned routing heat is kept.
#[derive(Debug, Clone, PartialEq)]
pub enum UsageFile {
    /// `shimmer-usage.json` beside the model.
    BesideModel,
    File(PathBuf),
    Off,
}

/// How the routed experts are held: all in memory, or in the tiered store.
#[derive(Debug, Clone)]
pub struct ExpertOptions {
    /// `None`: an unconverted checkpoint's experts all in memory; a container's under `auto`.
    pub ram: Option<RamBudget>,
    pub direct_io: bool,
    pub mirror: Option<PathBuf>,
    pub prefetch: bool,
    pub io_depth: usize,
    pub io_engine: shimmer_store::IoEngine,
    pub usage: UsageFile,
    /// A worker's placement assignment: pinned and read at start (`StoreOptions::assigned`).
    pub assigned: Option<Vec<Vec<u16>>>,
    /// The VRAM tier above RAM (`--gpu`, `--vram-gb`): experts it holds are computed there.
    pub vram: Option<std::sync::Arc<shimmer_gpu::VramTier>>,
}

impl Default for ExpertOptions {
    fn default() -> Self {
        ExpertOptions {
            ram: None,
            direct_io: false,
            mirror: None,
            prefetch: true,
            io_depth: shimmer_store::DEFAULT_IO_DEPTH,
            io_engine: shimmer_store::IoEngine::Auto,
            usage: UsageFile::BesideModel,
            assigned: None,
            vram: None,
        }
    }
}

impl Engine {
    pub fn load(dir: &Path) -> Result<Self, EngineError> {
        Self::open(dir, &ExpertOptions::default())
    }

    /// Loads an unconverted checkpoint or a converted container, with its experts held as `opts`
    /// says: all in this process's memory (a checkpoint without store options), or in the tiered
    /// store (a container, or any store option).
    pub fn open(dir: &Path, opts: &ExpertOptions) -> Result<Self, EngineError> {
        let model = ModelDir::open(dir)?;
        let store = model.is_container() || opts.ram.is_some() || opts.direct_io || opts.mirror.is_some() || opts.io_engine == shimmer_store::IoEngine::Uring;
        let (dense, dense_bytes) = model.dense()?;
        if !store {
            let mut experts = model.in_process_experts(shimmer_common::quant::QuantScheme::Bf16, None)?;
            tracing::debug!(experts_bytes = experts.bytes(), "model loaded");
            if let Some(tier) = &opts.vram {
                experts = experts.with_accelerator(tier.clone());
            }
            let mut engine = Self::new(&model, dense, Experts::InProcess(Box::new(experts)))?;
            engine.vram = opts.vram.clone();
            return Ok(engine);
        }
        let experts = model.expert_store(opts, dense_bytes)?;
        let mut engine = Self::new(&model, dense, Experts::Store(Box::new(experts)))?;
        engine.dense_bytes = Some(dense_bytes);
        engine.vram = opts.vram.clone();
        Ok(engine)
    }

    /// An engine of `model`'s dense part and its routed experts wherever they are; the tokenizer
    /// and chat template come from the model directory.
    pub fn new(model: &ModelDir, decoder: Decoder, experts: Experts) -> Result<Self, EngineError> {
        let dir = &model.dir;
        let spec = model.spec.clone();
        let tokenizer = Tokenizer::from_dir(dir)?;
        let chat = ChatConfig::from_dir(dir)?;
        let mut eos_ids = spec.eos_token_ids.clone();
        for id in &chat.generation_eos_ids {
            if !eos_ids.contains(id) {
                eos_ids.push(*id);
            }
        }
        if eos_ids.is_empty() {
            // Neither config declares one: fall back to the tokenizer's eos_token, as transformers does.
            if let Some(id) = chat.eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t)) {
                eos_ids.push(id);
            }
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(rayon::current_num_threads())
            .thread_name(|i| format!("compute-{i}"))
            .build()
            .map_err(|e| EngineError::Input(format!("cannot start the compute threads: {e}")))?;
        let engine = Engine {
            spec,
            tokenizer,
            chat,
            decoder,
            experts,
            eos_ids,
            load_ms: model.opened_at.elapsed().as_secs_f64() * 1e3,
            fingerprint: model.fingerprint.clone(),
            trace: std::sync::Mutex::new(None),
            dense_bytes: None,
            vram: None,
            pool,
        };
        // A token's weights beyond the last-level cache stream from memory, which picks the
        // integer loops of a decode step's products (`qdot::matvec_isa`; the same bits either
        // way). Experts counted at 4 bits, the fewest any container stores.
        let expert_bytes_at_4_bits = 3 * (engine.spec.hidden_size * engine.spec.moe.expert_intermediate_size) as u64 / 2;
        let streams = engine.active_bytes_per_token(expert_bytes_at_4_bits) > shimmer_kernels::qdot::last_level_cache_bytes();
        shimmer_kernels::qdot::set_decode_streams_from_memory(streams);
        Ok(engine)
    }

    /// Weight bytes one decoded token reads: the dense part, plus top-k routed experts per MoE
    /// layer at `expert_bytes` each.
    pub fn active_bytes_per_token(&self, expert_bytes: u64) -> u64 {
        let moe_layers = self.spec.layers.iter().filter(|k| **k == shimmer_common::spec::LayerMlp::Moe).count() as u64;
        self.decoder.dense_bytes_per_token() + moe_layers * self.spec.moe.top_k as u64 * expert_bytes
    }

    /// Reads every expert the store's budget holds, now (benchmarks of a resident model).
    pub fn preload_experts(&self) -> Result<usize, EngineError> {
        match self.experts.store() {
            Some(s) => Ok(s.preload().map_err(shimmer_model::ForwardError::from)?),
            None => Ok(0),
        }
    }

    /// Which experts of `layer` are in RAM now (`None`: all of them, no store).
    pub fn resident_experts(&self, layer: usize) -> Option<Vec<bool>> {
        self.experts.store().and_then(|s| s.resident(layer))
    }

    /// On a cluster, the time the forward pass has waited for workers so far.
    pub fn network_wait(&self) -> Option<std::time::Duration> {
        self.experts.cluster().map(RemoteExperts::network_wait)
    }

    /// On a cluster, which worker first serves each expert of `layer`.
    pub fn first_holders(&self, layer: usize) -> Option<Vec<u16>> {
        self.experts.cluster().and_then(|r| r.first_holders(layer))
    }

    /// Links to the workers and their counters, when the experts are on a cluster.
    pub fn cluster_telemetry(&self) -> Option<shimmer_cluster::ClusterTelemetry> {
        self.experts.cluster().map(RemoteExperts::telemetry_snapshot)
    }

    /// Which experts of `layer` the VRAM tier holds (`None`: no GPU).
    pub fn vram_experts(&self, layer: usize) -> Option<Vec<bool>> {
        self.vram.as_ref().map(|t| t.resident_in_layer(layer, self.spec.moe.num_experts))
    }

    /// The VRAM tier's counters, when experts are computed on a GPU.
    pub fn gpu_telemetry(&self) -> Option<shimmer_gpu::GpuTelemetry> {
        self.vram.as_ref().map(|t| t.telemetry())
    }

    /// The expert store's counters, when the experts are in one.
    pub fn store_telemetry(&self) -> Option<StoreTelemetry> {
        self.experts.store().map(ExpertStore::telemetry)
    }

    /// Persists what the expert store learned this turn (routing heat); a failure is a warning,
    /// never a lost answer.
    pub fn end_turn(&self) {
        if let Err(e) = self.experts.dispatch().end_turn() {
            tracing::warn!("could not save routing heat: {e}");
        }
    }

    /// Records the routing of every following forward pass to `path` (`--trace`).
    pub fn record_trace(&self, path: &Path) -> Result<(), shimmer_common::trace::TraceError> {
        let recorder = crate::trace_recorder::TraceRecorder::create(path, &self.spec)?;
        *self.trace.lock().unwrap_or_else(|e| e.into_inner()) = Some(recorder);
        Ok(())
    }

    /// Writes out and closes the trace, if one is being recorded.
    pub fn finish_trace(&self) -> Result<(), shimmer_common::trace::TraceError> {
        match self.trace.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(mut r) => r.finish(),
            None => Ok(()),
        }
    }

    /// One forward pass over several sequences at once (the server's continuous batching): each
    /// segment's tokens go after what its cache holds; returns each segment's logits. A
    /// sequence's results are bit-identical to running it alone.
    pub fn forward_batch(&self, segments: &mut [Segment<'_>]) -> Result<Vec<Vec<f32>>, ForwardError> {
        self.forward_batch_observed(segments, &mut shimmer_model::NoObserver)
    }

    /// `forward_batch`, reporting routing and phase times to `observer` (and to the trace
    /// recorder, when one is set).
    pub fn forward_batch_observed(&self, segments: &mut [Segment<'_>], observer: &mut (dyn MoeObserver + Send)) -> Result<Vec<Vec<f32>>, ForwardError> {
        let mut guard = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        let mut recorder = guard.take();
        let result = self.pool.install(|| match recorder.as_mut() {
            Some(recorder) => self.decoder.forward_segments(segments, self.experts.dispatch(), &mut shimmer_model::Tee(recorder, observer)),
            None => self.decoder.forward_segments(segments, self.experts.dispatch(), observer),
        });
        *guard = recorder;
        result
    }

    /// One forward pass, reported to the trace recorder when one is set.
    fn run(&self, tokens: &[u32], cache: &mut KvCache, want: Logits) -> Result<Vec<f32>, ForwardError> {
        let mut guard = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        let mut recorder = guard.take();
        // The whole pass runs on a pool thread: the hundreds of parallel products inside it then
        // split work through the pool's own queues instead of each waking the pool from outside.
        let result = self.pool.install(|| match recorder.as_mut() {
            Some(recorder) => self.decoder.forward_observed(tokens, cache, self.experts.dispatch(), want, recorder),
            None => self.decoder.forward(tokens, cache, self.experts.dispatch(), want),
        });
        *guard = recorder;
        result
    }

    pub fn new_session(&self) -> Session {
        Session { cache: self.decoder.new_cache(), tokens: Vec::new() }
    }

    /// Prompt ids must be in the vocabulary and fit the context.
    pub fn check_prompt(&self, ids: &[u32]) -> Result<(), EngineError> {
        if ids.is_empty() {
            return Err(EngineError::Input("the prompt is empty".into()));
        }
        if let Some(bad) = ids.iter().find(|id| **id as usize >= self.spec.vocab_size) {
            return Err(EngineError::Input(format!("prompt id {bad} is outside the vocabulary (vocab_size {})", self.spec.vocab_size)));
        }
        if ids.len() > self.spec.max_position_embeddings {
            return Err(EngineError::Input(format!(
                "the prompt has {} tokens but the model's context is {} (max_position_embeddings)",
                ids.len(),
                self.spec.max_position_embeddings
            )));
        }
        Ok(())
    }

    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.refuse_certainly_too_long(text)?;
        Ok(self.tokenizer.encode(text, true)?)
    }

    /// A text far longer than the context is refused before it is tokenized whole (which takes
    /// ~100 bytes of memory per byte at once): counted in pieces, it is certainly over.
    fn refuse_certainly_too_long(&self, text: &str) -> Result<(), EngineError> {
        // Below this, tokenizing whole costs little and gives the exact count anyway.
        const COUNT_IN_PIECES_FROM: usize = 256 << 10;
        let context = self.spec.max_position_embeddings;
        if text.len() > COUNT_IN_PIECES_FROM && self.tokenizer.certainly_more_than(text, context)? {
            return Err(EngineError::Input(format!(
                "the prompt has more tokens than the model's context of {context} (max_position_embeddings): its {} bytes were counted in pieces and not tokenized whole",
                text.len()
            )));
        }
        Ok(())
    }

    /// The ids of `messages` rendered with the model's chat template, ready for generation.
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<u32>, EngineError> {
        let messages: Vec<serde_json::Value> = messages.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect();
        self.encode_chat_json(&messages, None)
    }

    /// The ids of API-shaped messages (JSON, with tool calls and results) and tools rendered with
    /// the model's chat template, ready for generation.
    pub fn encode_chat_json(&self, messages: &[serde_json::Value], tools: Option<&serde_json::Value>) -> Result<Vec<u32>, EngineError> {
        Ok(self.encode_chat_with(messages, tools, &serde_json::Map::new())?.0)
    }

    /// `encode_chat_json` with the request's own template variables (`chat_template_kwargs`);
    /// also the rendered text.
    pub fn encode_chat_with(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&serde_json::Value>,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<(Vec<u32>, String), EngineError> {
        let (job, path) = self.chat.job_with(messages, tools, true, extra)?;
        // The template is the checkpoint's code: the binary renders it in a sandbox process.
        let text = crate::template_sandbox::render(&job).map_err(|e| LoadError::malformed(path, format!("chat template failed: {e}")))?;
        self.refuse_certainly_too_long(&text)?;
        // The template already wrote any BOS it wants; the tokenizer must not add another.
        let ids = self.tokenizer.encode(&text, false)?;
        Ok((ids, text))
    }

    /// Teacher forcing over `ids` in one pass.
    pub fn score(&self, ids: &[u32]) -> Result<Score, EngineError> {
        let logits = self.logits_all(ids)?;
        let v = self.spec.vocab_size;
        let mut argmax_ids = Vec::with_capacity(ids.len());
        let mut logprobs = Vec::with_capacity(ids.len().saturating_sub(1));
        for (i, row) in logits.chunks_exact(v).enumerate() {
            argmax_ids.push(argmax(row) as u32);
            if let Some(next) = ids.get(i + 1) {
                logprobs.push(log_softmax_at(row, *next as usize));
            }
        }
        self.end_turn();
        Ok(Score { argmax: argmax_ids, logprobs })
    }

    /// Logits of every position of `ids` (teacher forcing), for tests and tools.
    pub fn logits_all(&self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.check_prompt(ids)?;
        let mut cache = self.decoder.new_cache();
        Ok(self.run(ids, &mut cache, Logits::All)?)
    }

    /// One teacher-forced pass over `ids` (fresh cache) reporting each MoE layer's routing.
    pub fn observe(&self, ids: &[u32], observer: &mut dyn MoeObserver) -> Result<(), EngineError> {
        self.check_prompt(ids)?;
        let mut cache = self.decoder.new_cache();
        self.decoder.forward_observed(ids, &mut cache, self.experts.dispatch(), Logits::Last, observer)?;
        Ok(())
    }

    /// Runs `f` on one of the compute threads, so that the forward passes it makes start there
    /// instead of each waking the pool from outside and waiting for it.
    pub fn on_compute_thread<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Feeds `ids` after what the session holds and returns the last position's logits.
    pub fn step(&self, session: &mut Session, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        let logits = self.run(ids, &mut session.cache, Logits::Last)?;
        session.tokens.extend_from_slice(ids);
        Ok(logits)
    }

    /// Generates after `prompt` (the whole conversation so far, not just the new part): the
    /// session's cached prefix is reused, the rest prefilled. `on_text` receives text as it becomes
    /// final; returning `false` from it cancels.
    pub fn generate(
        &self,
        session: &mut Session,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_text: impl FnMut(&str) -> bool + Send,
    ) -> Result<Generation, EngineError> {
        // The whole generation runs on a compute thread: each step's pass then starts there
        // instead of waking the pool from outside and waiting on it (two thread wake-ups a
        // token, ~7 % of the demo model's decode).
        self.on_compute_thread(|| self.generate_here(session, prompt, opts, on_text))
    }

    fn generate_here(
        &self,
        session: &mut Session,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation, EngineError> {
        self.check_prompt(prompt)?;
        opts.sampling.validate().map_err(EngineError::Input)?;
        // Reuse the longest cached prefix, but always recompute at least the last prompt token:
        // its logits are what the first sampled token comes from.
        let common = session.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(prompt.len() - 1);
        // A recurrent model goes back to its last checkpoint at or before `common`.
        let common = session.cache.truncate(common);
        session.tokens.truncate(common);

        let t0 = Instant::now();
        let mut logits = self.run(&prompt[common..], &mut session.cache, Logits::Last)?;
        session.tokens.extend_from_slice(&prompt[common..]);
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;

        let mut sampler = Sampler::new(opts.sampling.clone());
        let mut stream = TextStream::new(&opts.stop);
        let mut output = Vec::new();
        let t1 = Instant::now();
        let mut decode_tokens = 0;
        let finish = loop {
            if output.len() >= opts.max_tokens {
                break FinishReason::Length;
            }
            let next = sampler.sample(&mut logits, &session.tokens);
            if self.eos_ids.contains(&next) {
                break FinishReason::Stop;
            }
            output.push(next);
            let text = self.tokenizer.decode(&output, true)?;
            let (fresh, stopped) = stream.push(&text);
            if !fresh.is_empty() && !on_text(fresh) {
                break FinishReason::Cancelled;
            }
            if stopped {
                break FinishReason::Stop;
            }
            if session.cache.len() >= session.cache.capacity() || output.len() >= opts.max_tokens {
                break FinishReason::Length;
            }
            logits = self.run(&[next], &mut session.cache, Logits::Last)?;
            session.tokens.push(next);
            decode_tokens += 1;
        };
        let decode_ms = t1.elapsed().as_secs_f64() * 1e3;
        // The turn's end: where a recurrent state's next turn comes back to.
        session.cache.checkpoint();
        self.end_turn();
        let rest = stream.finish();
        if !rest.is_empty() && finish != FinishReason::Cancelled {
            on_text(rest);
        }
        Ok(Generation { output_ids: output, text: stream.text, finish_reason: finish, prefill_ms, decode_ms, decode_tokens, reused_tokens: common })
    }
}

fn log_softmax_at(row: &[f32], i: usize) -> f32 {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = row.iter().map(|v| (*v as f64 - max).exp()).sum::<f64>().ln() + max;
    (row[i] as f64 - lse) as f32
}

/// Turns the growing decoded text into final pieces: holds back an incomplete UTF-8 sequence
/// (decoded as U+FFFD) and any tail that could still become a stop string, and cuts the text
/// before the first stop string.
pub(crate) struct TextStream {
    stops: Vec<String>,
    /// The stop string that ended the text, once one has.
    pub(crate) matched: Option<String>,
    /// The text emitted so far (final).
    pub(crate) text: String,
    /// The latest full decode.
    latest: String,
    stopped: bool,
}

impl TextStream {
    pub(crate) fn new(stops: &[String]) -> Self {
        TextStream { stops: stops.to_vec(), matched: None, text: String::new(), latest: String::new(), stopped: false }
    }

    /// Takes the full decode of the output so far; returns the newly final text and whether a
    /// stop string was reached.
    pub(crate) fn push(&mut self, decoded: &str) -> (&str, bool) {
        self.latest = decoded.to_string();
        let before = self.text.len();
        if let Some((cut, stop)) =
            self.stops.iter().filter(|s| !s.is_empty()).filter_map(|s| decoded.find(s.as_str()).map(|at| (at, s))).min_by_key(|(at, _)| *at)
        {
            if cut >= before && decoded.is_char_boundary(before) {
                self.text.push_str(&decoded[before..cut]);
            }
            self.matched = Some(stop.clone());
            self.stopped = true;
            return (&self.text[before.min(self.text.len())..], true);
        }
        let mut end = decoded.len();
        if decoded.ends_with('\u{FFFD}') {
            end -= '\u{FFFD}'.len_utf8();
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let mut hold = 0;
        for stop in &self.stops {
            for (i, _) in stop.char_indices().skip(1) {
                if decoded[..end].ends_with(&stop[..i]) {
                    hold = hold.max(i);
                }
            }
        }
        end -= hold;
        if end > before && decoded.is_char_boundary(before) && decoded.is_char_boundary(end) && decoded.starts_with(self.text.as_str()) {
            self.text.push_str(&decoded[before..end]);
        }
        (&self.text[before..], false)
    }

    /// Whatever was held back, once generation ends without a stop string: the final text is
    /// the whole decode, an incomplete last character (U+FFFD) included.
    pub(crate) fn finish(&mut self) -> &str {
        let before = self.text.len();
        if !self.stopped && self.latest.len() > before && self.latest.starts_with(self.text.as_str()) {
            let tail = self.latest[before..].to_string();
            self.text.push_str(&tail);
        }
        &self.text[before..]
    }
}

#[cfg(test)]
mod tests {
    use super::TextStream;

    #[test]
    fn stream_holds_back_partial_stop_strings_and_cuts_at_them() {
        let stops = vec!["END".to_string()];
        let mut s = TextStream::new(&stops);
        assert_eq!(s.push("Hello E"), ("Hello ", false));
        assert_eq!(s.push("Hello EN"), ("", false));
        assert_eq!(s.push("Hello ENX"), ("ENX", false));
        assert_eq!(s.push("Hello ENX and END more"), (" and ", true));
        assert_eq!(s.text, "Hello ENX and ");
    }

    #[test]
    fn stream_waits_for_complete_characters() {
        let mut s = TextStream::new(&[]);
        assert_eq!(s.push("caf\u{FFFD}"), ("caf", false));
        assert_eq!(s.push("café"), ("é", false));
        assert_eq!(s.push("café \u{FFFD}"), (" ", false));
        // Generation ended mid-character: the text is the decode as it stands.
        assert_eq!(s.finish(), "\u{FFFD}");
        assert_eq!(s.text, "café \u{FFFD}");
    }
}
