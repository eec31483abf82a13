//! The shared decoder-only forward pass (DESIGN.md §3), dense part only.
//!
//! For each layer: `h += attention(norm(h))` over the KV cache — grouped-query attention (with
//! optional QK-norm, clip, biases, partial or interleaved rotary, sliding window) or multi-head
//! latent attention (`mla.rs`) — then either `h += mlp(norm(h))` (dense layer) or the router picks
//! each row's experts, the `ExpertDispatch` returns Σ w·FFN as fixed-point sums, and those plus
//! any shared expert are added to `h`.
//!
//! All activations are f32; weights stay in their stored precision. Every row is computed by the
//! same code whatever the batch, so prefill and decode agree bit for bit on a row's inputs.

use shimmer_common::spec::{AttentionKind, DenseMlpLayout, DenseNames, ExpertActivation, ExpertLayout, LayerMlp, Mixer, QkNorm};
use shimmer_common::{Checkpoint, LoadError, ModelSpec};
use shimmer_experts::{DispatchError, ExpertDispatch, MoeBatch};
use shimmer_kernels::aligned::AlignedVec;
use shimmer_kernels::attention::{attend_many, AttentionShape, RowsCall};
use shimmer_kernels::{fixed, ops, Matrix};

use super::compressed::Compressed;
use super::gated_delta::GatedDelta;
use super::hyper::{expand, HyperConnection, HyperHead, Spread};
use super::mla::Mla;
use super::relative::Relative;
use super::rope::Rope;
use super::router::Router;
use crate::kv_cache::KvCache;

pub(crate) struct Linear {
    pub weight: Matrix,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    pub fn bytes(&self) -> usize {
        self.weight.bytes() + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }

    pub fn forward(&self, xs: &[f32], out: &mut [f32]) {
        self.weight.matmul(xs, out);
        self.add_bias(out);
    }

    fn add_bias(&self, out: &mut [f32]) {
        if let Some(b) = &self.bias {
            for row in out.chunks_exact_mut(b.len()) {
                row.iter_mut().zip(b).for_each(|(o, b)| *o += b);
            }
        }
    }

    /// `forward` of several layers over the same rows (attention's q, k and v): the rows are
    /// quantised once and the products share one parallel region (`matmul_many`); each output
    /// is its layer's own `forward`'s.
    pub fn forward_many(layers: &[&Linear], xs: &[f32], outs: &mut [&mut [f32]]) {
        let mats: Vec<&Matrix> = layers.iter().map(|l| &l.weight).collect();
        shimmer_kernels::matrix::matmul_many(&mats, xs, outs);
        for (l, out) in layers.iter().zip(outs.iter_mut()) {
            l.add_bias(out);
        }
    }
}

/// A SwiGLU MLP computed by the coordinator: a dense layer's MLP, or a MoE layer's shared expert.
struct DenseMlp {
    gate: Matrix,
    up: Matrix,
    down: Matrix,
    /// Plain SwiGLU, or the family's clamped one for its shared expert (DeepSeek-V4).
    activation: ExpertActivation,
    /// Multiplies the output (Inkling's dense `global_scale`; 1 elsewhere).
    scale: f32,
}

impl DenseMlp {
    fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }

    fn load(ckpt: &Checkpoint, spec: &ModelSpec, [g, u, d]: [&str; 3], hidden: usize, intermediate: usize) -> Result<Self, LoadError> {
        Self::load_as(ckpt, spec, [g, u, d], DenseMlpLayout::Separate, hidden, intermediate)
    }

    fn load_as(
        ckpt: &Checkpoint,
        spec: &ModelSpec,
        [g, u, d]: [&str; 3],
        layout: DenseMlpLayout,
        hidden: usize,
        intermediate: usize,
    ) -> Result<Self, LoadError> {
        let (gate, up) = match layout {
            DenseMlpLayout::Separate => (matrix(ckpt, spec, g, intermediate, hidden)?, matrix(ckpt, spec, u, intermediate, hidden)?),
            DenseMlpLayout::InterleavedGateUp => {
                let both = matrix(ckpt, spec, g, 2 * intermediate, hidden)?;
                let split = |parity: usize| {
                    let rows: Vec<usize> = (0..intermediate).map(|j| 2 * j + parity).collect();
                    both.take_rows(&rows).map_err(|problem| LoadError::Tensor { path: ckpt.dir().to_path_buf(), tensor: g.to_string(), problem })
                };
                (split(0)?, split(1)?)
            }
        };
        Ok(DenseMlp { gate, up, down: matrix(ckpt, spec, d, hidden, intermediate)?, activation: ExpertActivation::Silu, scale: 1.0 })
    }

    /// `out = mlp(x)` for every row (each row's bits as if alone): gate and up in one pass.
    fn forward(&self, x: &[f32], out: &mut [f32]) {
        let (hd, i) = (self.gate.cols, self.gate.rows);
        let n = x.len() / hd;
        let (mut g, mut u) = (vec![0.0f32; n * i], vec![0.0f32; n * i]);
        shimmer_kernels::matrix::matmul_pair(&self.gate, &self.up, x, &mut g, &mut u, true);
        match self.activation {
            ExpertActivation::ClampedSilu { limit } => shimmer_kernels::gating::clamped_silu_in_place(&mut g, &u, limit),
            ExpertActivation::ClampedSwiglu { alpha, limit } => shimmer_kernels::gating::clamped_swiglu_in_place(&mut g, &u, alpha, limit),
            ExpertActivation::SoftcappedSwiglu { gate_cap, up_cap } => shimmer_kernels::gating::softcapped_swiglu_in_place(&mut g, &u, gate_cap, up_cap),
            ExpertActivation::Silu => ops::swiglu_in_place(&mut g, &u),
        }
        self.down.matmul(&g, out);
        if self.scale != 1.0 {
            out.iter_mut().for_each(|v| *v *= self.scale);
        }
    }

    /// `out += Σ_rows down(act(gate·x)·(up·x)·γ_row)`: one shared expert of a bank, weighted per
    /// row by the router (Inkling), the weight applied before `down` as transformers applies it.
    fn add_weighted(&self, x: &[f32], gammas: impl Iterator<Item = f32>, out: &mut [f32]) {
        let (hd, i) = (self.gate.cols, self.gate.rows);
        let n = x.len() / hd;
        let (mut g, mut u) = (vec![0.0f32; n * i], vec![0.0f32; n * i]);
        shimmer_kernels::matrix::matmul_pair(&self.gate, &self.up, x, &mut g, &mut u, true);
        ops::swiglu_in_place(&mut g, &u);
        for (row, gamma) in g.chunks_exact_mut(i).zip(gammas) {
            row.iter_mut().for_each(|v| *v *= gamma);
        }
        let mut y = vec![0.0f32; n * hd];
        self.down.matmul(&g, &mut y);
        add(out, &y);
    }
}

// One per layer, built once at load: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Mlp {
    Dense(DenseMlp),
    /// `shared_gate`: a `1 × hidden` weight whose sigmoid scales the shared expert (Qwen3-Next).
    Moe {
        router: Router,
        shared: Option<DenseMlp>,
        shared_gate: Option<Box<Matrix>>,
        /// Shared experts the router weighs one by one (Inkling).
        bank: Vec<DenseMlp>,
    },
}

struct Gqa {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    window: Option<usize>,
    /// One sink logit per query head.
    sinks: Option<Vec<f32>>,
    /// `q_proj` yields each head's query then its output gate.
    output_gate: bool,
}

// One per layer, built once at load: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Attention {
    Gqa(Gqa),
    Mla(Box<Mla>),
    Delta(GatedDelta),
    Compressed(Box<Compressed>),
    Relative(Box<Relative>),
}

struct Layer {
    input_norm: Vec<f32>,
    post_attention_norm: Vec<f32>,
    attention: Attention,
    mlp: Mlp,
    /// Hyper-connections around the attention and the MLP (DeepSeek-V4).
    hyper: Option<Box<(HyperConnection, HyperConnection)>>,
}

pub struct Decoder {
    spec: ModelSpec,
    embed: Matrix,
    final_norm: Vec<f32>,
    /// `None` when tied to the embedding.
    lm_head: Option<Matrix>,
    layers: Vec<Layer>,
    rope: Rope,
    /// The last collapse of the residual streams, with hyper-connections.
    hyper_head: Option<HyperHead>,
    /// An RMSNorm of each embedded row (Inkling).
    embed_norm: Option<Vec<f32>>,
    /// Inkling 2's block attention residuals.
    blocks: Option<BlockResiduals>,
}

/// Inkling 2's block attention residuals: every `layers_per_block` layers the running state is
/// kept as a block; a layer's attention input (one vector, or one each for q, k and v on full
/// layers), its MLP input and the model's output are each a learned query's softmax over the
/// unweighted-RMS-normed blocks and running state (scale `1/√hidden`) — per row, nothing across
/// positions.
struct BlockResiduals {
    layers_per_block: usize,
    /// Per layer: the attention input's queries (`None` for the first layer, which reads the state
    /// as it is) and the MLP input's query.
    attn: Vec<Option<Vec<f32>>>,
    mlp: Vec<Vec<f32>>,
    output: Vec<f32>,
}

impl BlockResiduals {
    /// For every row: each query's mix of the row's blocks and its `state` (`queries`: m × hidden
    /// → `out`: m outputs of n × hidden).
    fn mix(queries: &[f32], blocks: &[Vec<f32>], state: &[f32], hidden: usize) -> Vec<Vec<f32>> {
        let n = state.len() / hidden;
        let m = queries.len() / hidden;
        let mut out = vec![vec![0.0f32; n * hidden]; m];
        let scale = (hidden as f32).powf(-0.5);
        let mut normed: Vec<Vec<f32>> = Vec::with_capacity(blocks.len() + 1);
        for r in 0..n {
            normed.clear();
            for v in blocks.iter().map(|b| &b[r * hidden..(r + 1) * hidden]).chain(std::iter::once(&state[r * hidden..(r + 1) * hidden])) {
                let mean = ops::sum_of_squares(v) / hidden as f32;
                let inv = 1.0 / (mean + 1e-6).sqrt();
                normed.push(v.iter().map(|x| x * inv).collect());
            }
            for (qi, q) in queries.chunks_exact(hidden).enumerate() {
                let mut logits: Vec<f32> = normed.iter().map(|k| k.iter().zip(q).map(|(a, b)| a * b).sum::<f32>() * scale).collect();
                ops::softmax_in_place(&mut logits);
                let o = &mut out[qi][r * hidden..(r + 1) * hidden];
                for (p, k) in logits.iter().zip(&normed) {
                    o.iter_mut().zip(k).for_each(|(a, v)| *a += p * v);
                }
            }
        }
        out
    }
}

/// Sees each MoE layer's input rows and the router's choices as the forward pass makes them:
/// the routing-trace recorder and the routing analysis hang here. It observes; it cannot change
/// a selection.
pub trait MoeObserver {
    /// `rows` is `n × hidden` (the MoE input after post-attention norm); `experts` and `weights`
    /// are `n × top_k`, in the router's order.
    fn moe_layer(&mut self, layer: usize, rows: &[f32], experts: &[u32], weights: &[f32]);

    /// Whether to compute the one-layer-ahead prediction (the next MoE layer's router on this
    /// layer's rows) and report it through `lookahead`.
    fn wants_lookahead(&self) -> bool {
        false
    }

    /// The next MoE layer's predicted experts (`n × top_k`) for the rows of `layer`.
    fn lookahead(&mut self, _layer: usize, _next_layer: usize, _predicted: &[u32]) {}

    /// Where one forward pass spent its time (called once, at its end).
    fn phases(&mut self, _times: &PhaseTimes) {}
}

/// Wall time of one forward pass by phase: attention (its projections included), routers (and
/// the lookahead prediction), routed and shared experts (dispatch, compute and any wait for
/// reads), and the rest (embedding, norms, dense MLPs, the LM head).
#[derive(Debug, Default, Clone, Copy)]
pub struct PhaseTimes {
    pub attention: std::time::Duration,
    pub router: std::time::Duration,
    pub experts: std::time::Duration,
    pub total: std::time::Duration,
}

/// Reports to two observers (the trace recorder and the server's dashboard).
pub struct Tee<'a>(pub &'a mut dyn MoeObserver, pub &'a mut dyn MoeObserver);

impl MoeObserver for Tee<'_> {
    fn moe_layer(&mut self, layer: usize, rows: &[f32], experts: &[u32], weights: &[f32]) {
        self.0.moe_layer(layer, rows, experts, weights);
        self.1.moe_layer(layer, rows, experts, weights);
    }
    fn wants_lookahead(&self) -> bool {
        self.0.wants_lookahead() || self.1.wants_lookahead()
    }
    fn lookahead(&mut self, layer: usize, next_layer: usize, predicted: &[u32]) {
        self.0.lookahead(layer, next_layer, predicted);
        self.1.lookahead(layer, next_layer, predicted);
    }
    fn phases(&mut self, times: &PhaseTimes) {
        self.0.phases(times);
        self.1.phases(times);
    }
}

/// The observer that does nothing, for the ordinary path.
pub struct NoObserver;

impl MoeObserver for NoObserver {
    fn moe_layer(&mut self, _: usize, _: &[f32], _: &[u32], _: &[f32]) {}
}

/// One sequence's part of a batched forward pass: its new tokens, its own KV cache (the tokens
/// go at positions `cache.len()..`) and which logits it wants back.
pub struct Segment<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
    pub want: Logits,
}

/// Where a segment's rows sit in the batch and where its positions start.
pub(crate) struct SegmentRows<'a> {
    pub rows: std::ops::Range<usize>,
    pub start: usize,
    pub cache: &'a mut KvCache,
}

/// Which positions' logits a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    Last,
    All,
}

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    // Not a `#[source]`: the message already carries the cause, and error chains print it once.
    #[error("expert dispatch failed: {0}")]
    Dispatch(DispatchError),
    #[error("the context is full: {have} positions held + {adding} new > {capacity} (max_position_embeddings)")]
    ContextFull { have: usize, adding: usize, capacity: usize },
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
}

impl From<DispatchError> for ForwardError {
    fn from(e: DispatchError) -> Self {
        ForwardError::Dispatch(e)
    }
}

impl Decoder {
    /// Dense weight bytes one token's forward pass reads: every layer's attention, dense MLP,
    /// router and shared expert, the LM head, and one embedding row (routed experts not
    /// included: the dispatcher holds them). The numerator of the decode roofline.
    pub fn dense_bytes_per_token(&self) -> u64 {
        let mut total = self.embed.bytes() / self.embed.rows.max(1);
        total += self.lm_head.as_ref().unwrap_or(&self.embed).bytes();
        total += self.hyper_head.as_ref().map_or(0, HyperHead::bytes);
        for layer in &self.layers {
            total += match &layer.attention {
                Attention::Gqa(g) => g.q.bytes() + g.k.bytes() + g.v.bytes() + g.o.bytes(),
                Attention::Mla(m) => m.bytes(),
                Attention::Delta(d) => d.bytes(),
                Attention::Compressed(c) => c.bytes(),
                Attention::Relative(r) => r.bytes(),
            };
            if let Some(hc) = &layer.hyper {
                total += hc.0.bytes() + hc.1.bytes();
            }
            total += match &layer.mlp {
                Mlp::Dense(d) => d.bytes(),
                Mlp::Moe { router, shared, shared_gate, bank } => {
                    router.weight.bytes()
                        + shared.as_ref().map_or(0, DenseMlp::bytes)
                        + shared_gate.as_ref().map_or(0, |g| g.bytes())
                        + bank.iter().map(DenseMlp::bytes).sum::<usize>()
                }
            };
        }
        total as u64
    }
}

pub(crate) fn name(template: &str, layer: usize) -> String {
    template.replace("{L}", &layer.to_string())
}

pub(crate) fn vector(ckpt: &Checkpoint, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
    Ok(ckpt.get(name, &[len])?.to_f32())
}

/// An RMSNorm's scale: its weights, or `1 + w` where the model stores them zero-centred (the
/// same f32 addition transformers makes).
pub(crate) fn norm_weight(ckpt: &Checkpoint, spec: &ModelSpec, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
    let mut w = vector(ckpt, name, len)?;
    if spec.rms_norm_unit_offset {
        w.iter_mut().for_each(|x| *x += 1.0);
    }
    Ok(w)
}

/// A weight matrix as stored (`shimmer_experts::weights`: floats, fp8 with block scales, int8).
pub(crate) fn matrix(ckpt: &Checkpoint, spec: &ModelSpec, name: &str, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
    shimmer_experts::weights::load_matrix(ckpt, name, rows, cols, spec.fp8_block)
}

pub(crate) fn linear(ckpt: &Checkpoint, spec: &ModelSpec, base: &str, rows: usize, cols: usize, bias: bool) -> Result<Linear, LoadError> {
    Ok(Linear {
        weight: matrix(ckpt, spec, &format!("{base}.weight"), rows, cols)?,
        bias: if bias { Some(vector(ckpt, &format!("{base}.bias"), rows)?) } else { None },
    })
}

impl Decoder {
    pub fn load(ckpt: &Checkpoint, spec: &ModelSpec) -> Result<Self, LoadError> {
        let names = &spec.dense_names;
        let h = spec.hidden_size;
        let mut layers = Vec::with_capacity(spec.num_layers);
        for l in 0..spec.num_layers {
            let attention = match (&spec.attention.kind, spec.attention.mixers[l], &spec.attention.gated_delta) {
                (_, Mixer::GatedDeltaNet, Some(shape)) => Attention::Delta(GatedDelta::load(ckpt, spec, shape, l)?),
                (AttentionKind::Mla(mla), _, _) => Attention::Mla(Box::new(Mla::load(ckpt, spec, mla, l)?)),
                (AttentionKind::Compressed(c), _, _) => Attention::Compressed(Box::new(Compressed::load(ckpt, spec, c, l)?)),
                (AttentionKind::Relative(r), _, _) => Attention::Relative(Box::new(Relative::load(ckpt, spec, r, l)?)),
                _ => Attention::Gqa(Self::load_gqa(ckpt, spec, names, l)?),
            };
            let mlp = match spec.layers[l] {
                LayerMlp::Dense { intermediate_size: i } => {
                    let tensors = [&name(names.mlp_gate, l), &name(names.mlp_up, l), &name(names.mlp_down, l)];
                    let mut mlp = DenseMlp::load_as(ckpt, spec, tensors.map(String::as_str), names.mlp_layout, h, i)?;
                    if let AttentionKind::Relative(r) = &spec.attention.kind {
                        mlp.scale = vector(ckpt, &name(r.names.mlp_scale, l), 1)?[0];
                    }
                    Mlp::Dense(mlp)
                }
                LayerMlp::Moe => {
                    let e = spec.moe.num_experts;
                    let hashed = spec.hash_routed.get(l).copied().unwrap_or(false);
                    // A hash layer chooses by its table: it has no selection bias.
                    let bias = match spec.expert_names.router_bias(l).filter(|_| !hashed) {
                        Some(b) => Some(vector(ckpt, &b, e)?),
                        None => None,
                    };
                    let hash = match spec.expert_names.router_hash(l).filter(|_| hashed) {
                        Some(t) => Some(expert_table(ckpt, &t, spec.vocab_size, spec.moe.top_k, e)?),
                        None => None,
                    };
                    let layout = spec.expert_names.layout;
                    let stacked = matches!(layout, ExpertLayout::FusedStacked | ExpertLayout::StackedInterleaved);
                    let mut bank = Vec::new();
                    let shared = match (spec.expert_names.shared(l), spec.moe.shared_intermediate_size) {
                        (Some([g, u, d]), Some(i)) if stacked => {
                            let count = match spec.moe.scoring {
                                shimmer_common::spec::RouterScoring::LogSigmoidShared { shared, .. } => shared,
                                _ => 1,
                            };
                            for s in 0..count {
                                // A bank is stacked as the routed experts are: interleaved gate and
                                // up rows in one tensor (`g`, `u` the same name), or apart.
                                let (gate, up, down) = if layout == ExpertLayout::StackedInterleaved {
                                    shimmer_experts::weights::stacked_interleaved_expert(ckpt, &g, &d, count, s, h, i)?
                                } else {
                                    shimmer_experts::weights::stacked_shared(ckpt, [&g, &u, &d], count, s, h, i)?
                                };
                                bank.push(DenseMlp { gate, up, down, activation: ExpertActivation::Silu, scale: 1.0 });
                            }
                            None
                        }
                        (Some([g, u, d]), Some(i)) => {
                            let mut mlp = DenseMlp::load(ckpt, spec, [&g, &u, &d], h, i)?;
                            mlp.activation = spec.moe.activation;
                            Some(mlp)
                        }
                        _ => None,
                    };
                    let logit_bias = match spec.expert_names.router_logit_bias(l) {
                        Some(b) => Some(vector(ckpt, &b, e)?),
                        None => None,
                    };
                    // A router that also scores the shared experts has a row for each.
                    let scored = match spec.moe.scoring {
                        shimmer_common::spec::RouterScoring::LogSigmoidShared { shared, .. } => e + shared,
                        _ => e,
                    };
                    let global_scale = match &spec.attention.kind {
                        AttentionKind::Relative(r) if r.v2.is_none() => vector(ckpt, &name(r.names.router_scale, l), 1)?[0],
                        _ => 1.0,
                    };
                    let router = Router {
                        global_scale,
                        weight: matrix(ckpt, spec, &spec.expert_names.router(l), scored, h)?,
                        bias,
                        logit_bias,
                        scoring: spec.moe.scoring,
                        top_k: spec.moe.top_k,
                        hash,
                    };
                    let shared_gate = match spec.expert_names.shared_gate(l) {
                        Some(g) => Some(Box::new(matrix(ckpt, spec, &g, 1, h)?)),
                        None => None,
                    };
                    Mlp::Moe { router, shared, shared_gate, bank }
                }
            };
            let hyper = match &spec.hyper {
                Some(hs) => {
                    let names = |t: [&str; 3]| t.map(|n| name(n, l));
                    let (a, f) = (names(hs.attn), names(hs.ffn));
                    let load = |n: &[String; 3]| HyperConnection::load(ckpt, spec, [&n[0], &n[1], &n[2]], hs.streams, hs.sinkhorn_iters, hs.eps);
                    Some(Box::new((load(&a)?, load(&f)?)))
                }
                None => None,
            };
            // Inkling 2's full layers norm their q input with their own weight (k and v: in the
            // attention).
            let input_norm = match &spec.attention.kind {
                AttentionKind::Relative(r) if r.v2.is_some() && !r.sliding_layers[l] => r.v2.as_ref().map_or(names.input_norm, |v| v.names.q_input_norm),
                _ => names.input_norm,
            };
            layers.push(Layer {
                input_norm: norm_weight(ckpt, spec, &name(input_norm, l), h)?,
                post_attention_norm: norm_weight(ckpt, spec, &name(names.post_attention_norm, l), h)?,
                attention,
                mlp,
                hyper,
            });
        }
        let hyper_head = match &spec.hyper {
            Some(hs) => Some(HyperHead::load(ckpt, spec, hs.head, hs.streams, hs.eps)?),
            None => None,
        };
        // A padded vocabulary's embedding and head hold rows no token or logit uses.
        let rows = spec.padded_vocab.unwrap_or(spec.vocab_size);
        let lm_head = if spec.tie_word_embeddings { None } else { Some(matrix(ckpt, spec, names.lm_head, rows, h)?) };
        let embed_norm = match &spec.attention.kind {
            AttentionKind::Relative(r) => Some(vector(ckpt, r.names.embed_norm, h)?),
            _ => None,
        };
        let blocks = match &spec.attention.kind {
            AttentionKind::Relative(r) => match &r.v2 {
                Some(v2) => {
                    let mut attn = vec![None];
                    for l in 1..spec.num_layers {
                        // The release numbers attention queries from the second layer.
                        let m = if r.sliding_layers[l] { 1 } else { 3 };
                        let (one, three) = ([h], [3, h]);
                        let shape: &[usize] = if m == 1 { &one } else { &three };
                        let q = ckpt.get(&name(v2.names.attn_query, l - 1), shape)?.to_f32();
                        attn.push(Some(q));
                    }
                    let mlp = (0..spec.num_layers).map(|l| vector(ckpt, &name(v2.names.mlp_query, l), h)).collect::<Result<Vec<_>, _>>()?;
                    Some(BlockResiduals { layers_per_block: v2.layers_per_block, attn, mlp, output: vector(ckpt, v2.names.output_query, h)? })
                }
                None => None,
            },
            _ => None,
        };
        Ok(Decoder {
            blocks,
            embed_norm,
            embed: matrix(ckpt, spec, names.embed, rows, h)?,
            final_norm: norm_weight(ckpt, spec, names.final_norm, h)?,
            lm_head,
            layers,
            rope: Rope::new(&spec.rope, spec.attention.rotary_dim),
            hyper_head,
            spec: spec.clone(),
        })
    }

    fn load_gqa(ckpt: &Checkpoint, spec: &ModelSpec, names: &DenseNames, l: usize) -> Result<Gqa, LoadError> {
        let (h, d) = (spec.hidden_size, spec.head_dim);
        let (qd, kvd) = (spec.num_heads * d, spec.num_kv_heads * d);
        let a = &spec.attention;
        let (q_norm, k_norm) = match a.qk_norm {
            QkNorm::None => (None, None),
            QkNorm::PerHead => (Some(norm_weight(ckpt, spec, &name(names.q_norm, l), d)?), Some(norm_weight(ckpt, spec, &name(names.k_norm, l), d)?)),
            QkNorm::FullProjection => (Some(norm_weight(ckpt, spec, &name(names.q_norm, l), qd)?), Some(norm_weight(ckpt, spec, &name(names.k_norm, l), kvd)?)),
        };
        Ok(Gqa {
            // With an output gate, each head's query is followed by its gate.
            q: linear(ckpt, spec, &name(names.q, l), if a.output_gate { 2 * qd } else { qd }, h, a.bias)?,
            k: linear(ckpt, spec, &name(names.k, l), kvd, h, a.bias)?,
            v: linear(ckpt, spec, &name(names.v, l), kvd, h, a.bias)?,
            o: linear(ckpt, spec, &name(names.o, l), h, qd, a.o_bias)?,
            q_norm,
            k_norm,
            window: a.sliding_window[l],
            sinks: if a.sinks { Some(vector(ckpt, &name(names.sinks, l), spec.num_heads)?) } else { None },
            output_gate: a.output_gate,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn new_cache(&self) -> KvCache {
        let s = &self.spec;
        let (k, v) = match &s.attention.kind {
            AttentionKind::Gqa => (s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim),
            AttentionKind::Mla(m) => (m.kv_lora_rank, m.qk_rope_head_dim),
            // One key per position, which is also its value.
            AttentionKind::Compressed(_) => (s.head_dim, 0),
            // Keys and values live in the auxiliary slot, beside what the convolutions read.
            AttentionKind::Relative(_) => (0, 0),
        };
        let states = (0..s.num_layers)
            .map(|l| match (s.attention.mixers[l], &s.attention.gated_delta) {
                (Mixer::GatedDeltaNet, Some(g)) => g.state_floats(),
                _ => 0,
            })
            .collect();
        let mut cache = KvCache::with_states(states, k, v, s.max_position_embeddings);
        for l in 0..s.num_layers {
            let width = match &s.attention.kind {
                AttentionKind::Compressed(c) => Compressed::aux_width(s, c, l),
                AttentionKind::Relative(r) => Relative::aux_width(s, r, l),
                _ => 0,
            };
            if width > 0 {
                cache = cache.with_aux(l, width);
            }
        }
        // DeepSeek Sparse Attention: each full indexer layer caches its indexer keys.
        if let AttentionKind::Mla(shimmer_common::spec::MlaSpec { indexer: Some(ix), .. }) = &s.attention.kind {
            for (l, full) in ix.full.iter().enumerate() {
                if *full {
                    cache = cache.with_aux(l, ix.head_dim);
                }
            }
        }
        cache
    }

    /// Runs `tokens` at positions `cache.len()..` and returns logits (`vocab` per returned row).
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, experts: &dyn ExpertDispatch, want: Logits) -> Result<Vec<f32>, ForwardError> {
        self.forward_observed(tokens, cache, experts, want, &mut NoObserver)
    }

    /// `forward`, reporting every MoE layer's routing to `observer`.
    pub fn forward_observed(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        experts: &dyn ExpertDispatch,
        want: Logits,
        observer: &mut dyn MoeObserver,
    ) -> Result<Vec<f32>, ForwardError> {
        let mut out = self.forward_segments(&mut [Segment { tokens, cache, want }], experts, observer)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// One forward pass over several sequences at once (continuous batching): every dense
    /// product runs over all their rows together, each MoE layer makes one batch-union dispatch
    /// for all of them, and attention reads each sequence's own cache. Every row is computed as
    /// it would be alone (DESIGN.md §1), so a sequence's logits do not depend on its batch-mates.
    /// Returns each segment's logits (`vocab` per returned row).
    pub fn forward_segments(
        &self,
        segments: &mut [Segment<'_>],
        experts: &dyn ExpertDispatch,
        observer: &mut dyn MoeObserver,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        // Several rows (a prompt, a batch's decode step), or one row of a model whose step reads
        // enough weights: the threads stay awake through the step as a team
        // (`shimmer_kernels::team`) instead of being woken per product — a prompt's step
        // alternates tens of products with serial work (norms, routing, the fixed-point sum), and
        // each wake-up cost as much as a product's split saved. Same bits either way. Below the
        // bound a one-row step's claims cost what splitting saves (the demo model decoded slower
        // with it: `docs/benchmarks.md`, issue 18, third pass).
        let rows: usize = segments.iter().map(|seg| seg.tokens.len()).sum();
        if rows > 1 || self.dense_bytes_per_token() >= TEAM_MIN_STEP_BYTES {
            return shimmer_kernels::team::with_pool_team(|| self.forward_rows(segments, experts, observer));
        }
        self.forward_rows(segments, experts, observer)
    }

    fn forward_rows(&self, segments: &mut [Segment<'_>], experts: &dyn ExpertDispatch, observer: &mut dyn MoeObserver) -> Result<Vec<Vec<f32>>, ForwardError> {
        let s = &self.spec;
        let hd = s.hidden_size;
        let wants: Vec<Logits> = segments.iter().map(|seg| seg.want).collect();
        let tokens: Vec<u32> = segments.iter().flat_map(|seg| seg.tokens.iter().copied()).collect();
        let mut rows = Vec::with_capacity(segments.len());
        let mut n = 0;
        for seg in segments.iter_mut() {
            let (start, len) = (seg.cache.len(), seg.tokens.len());
            if start + len > seg.cache.capacity() {
                return Err(ForwardError::ContextFull { have: start, adding: len, capacity: seg.cache.capacity() });
            }
            if let Some(t) = seg.tokens.iter().find(|t| **t as usize >= s.vocab_size) {
                return Err(ForwardError::TokenOutOfRange { id: *t, vocab: s.vocab_size });
            }
            rows.push(SegmentRows { rows: n..n + len, start, cache: &mut *seg.cache });
            n += len;
        }
        // With hyper-connections the residual is `streams` copies of each row, all starting as
        // its embedding.
        let streams = s.hyper.as_ref().map_or(1, |hs| hs.streams);
        let mut h = vec![0.0f32; n * streams * hd];
        for (t, row) in tokens.iter().zip(h.chunks_exact_mut(streams * hd)) {
            self.embed.row_f32(*t as usize, &mut row[..hd]);
            if let Some(w) = &self.embed_norm {
                let embedded = row[..hd].to_vec();
                ops::rms_norm(&embedded, w, s.rms_norm_eps, &mut row[..hd]);
            }
            for k in 1..streams {
                row.copy_within(..hd, k * hd);
            }
        }
        let mut x = vec![0.0f32; n * hd];
        let mut collapsed = if streams > 1 { vec![0.0f32; n * hd] } else { Vec::new() };
        let mut spread = Spread::default();
        let mut proj = vec![0.0f32; n * hd];
        let t_start = std::time::Instant::now();
        let mut times = PhaseTimes::default();
        // DeepSeek Sparse Attention: the last full indexer layer's choice, per row.
        let mut selection: super::mla::Selection = None;
        if let Some(blocks) = &self.blocks {
            self.block_layers(blocks, &tokens, &mut h, &mut rows, experts, observer, &mut times)?;
        }
        // Inkling 2's layers ran above, around its block residuals.
        let plain_layers: &[Layer] = if self.blocks.is_none() { &self.layers } else { &[] };
        let head_as_team = self.head_as_team(n);
        for (l, layer) in plain_layers.iter().enumerate() {
            if head_as_team && l + 1 == plain_layers.len() {
                // The head's team forms after this layer: a sleeping helper wakes meanwhile.
                shimmer_kernels::team::prewake();
            }
            match &layer.hyper {
                Some(hc) => {
                    hc.0.collapse(&h, &mut collapsed, &mut spread);
                    norm_rows(&collapsed, &layer.input_norm, s.rms_norm_eps, &mut x);
                }
                None => norm_rows(&h, &layer.input_norm, s.rms_norm_eps, &mut x),
            }
            let t = std::time::Instant::now();
            match &layer.attention {
                Attention::Gqa(g) => self.gqa(g, l, &x, &mut rows, &mut proj),
                Attention::Mla(m) => m.forward(s, &self.rope, l, &x, &mut rows, &mut selection, &mut proj),
                Attention::Delta(d) => d.forward(l, &x, &mut rows, &mut proj),
                Attention::Compressed(c) => c.forward(s, l, &x, &mut rows, &mut proj),
                Attention::Relative(r) => r.forward(s, l, &x, &mut rows, &mut proj),
            }
            times.attention += t.elapsed();
            match &layer.hyper {
                Some(hc) => {
                    expand(&mut h, &proj, &spread, streams, hd);
                    hc.1.collapse(&h, &mut collapsed, &mut spread);
                    norm_rows(&collapsed, &layer.post_attention_norm, s.rms_norm_eps, &mut x);
                }
                None => {
                    add(&mut h, &proj);
                    norm_rows(&h, &layer.post_attention_norm, s.rms_norm_eps, &mut x);
                }
            }
            match &layer.mlp {
                Mlp::Dense(mlp) => mlp.forward(&x, &mut proj),
                Mlp::Moe { router, shared, shared_gate, bank } => {
                    self.moe(l, &tokens, router, (shared.as_ref().map(|s| (s, shared_gate.as_deref())), bank), &x, experts, observer, &mut proj, &mut times)?
                }
            }
            if let Attention::Relative(r) = &layer.attention {
                r.convolve_mlp(l, hd, &mut rows, &mut proj);
            }
            match &layer.hyper {
                Some(_) => expand(&mut h, &proj, &spread, streams, hd),
                None => add(&mut h, &proj),
            }
        }
        for seg in rows.iter_mut() {
            seg.cache.commit(seg.rows.len());
            if seg.rows.len() > 1 {
                // A prompt's end: a recurrent state can come back here.
                seg.cache.checkpoint();
            }
        }

        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let vocab = s.vocab_size;
        let wanted: Vec<Vec<usize>> = wants
            .iter()
            .zip(&rows)
            .map(|(want, r)| match want {
                Logits::Last => r.rows.end.checked_sub(1).into_iter().filter(|_| !r.rows.is_empty()).collect(),
                Logits::All => r.rows.clone().collect(),
            })
            .collect();
        // Every wanted row's final state, normed, back to back: one product over all of them
        // reads the head once a step (a batch of sequences each wants its last row; the head read
        // per sequence made 16 sequences decode no faster than one on the demo model). Each
        // row's logits are its own product's bits, alone or in a batch.
        let total: usize = wanted.iter().map(Vec::len).sum();
        let mut normed = vec![0.0f32; total * hd];
        let mut last = vec![0.0f32; hd];
        for (row, xn) in wanted.iter().flatten().zip(normed.chunks_exact_mut(hd)) {
            let state = &h[row * streams * hd..(row + 1) * streams * hd];
            match &self.hyper_head {
                Some(hh) => hh.collapse(state, &mut last),
                None => last.copy_from_slice(state),
            }
            ops::rms_norm(&last, &self.final_norm, s.rms_norm_eps, xn);
            if s.logit_divisor != 1.0 {
                xn.iter_mut().for_each(|v| *v /= s.logit_divisor);
            }
        }
        let mut logits = vec![0.0f32; total * vocab];
        if s.padded_vocab.is_some() {
            for (xn, out) in normed.chunks_exact(hd).zip(logits.chunks_exact_mut(vocab)) {
                head.matvec_rows(0..vocab, xn, out);
            }
        } else if head_as_team {
            shimmer_kernels::team::with_pool_team(|| head.matmul(&normed, &mut logits));
        } else {
            head.matmul(&normed, &mut logits);
        }
        if let Some(cap) = s.logit_softcap {
            logits.iter_mut().for_each(|v| *v = (*v / cap).tanh() * cap);
        }
        let all = if wanted.len() == 1 {
            vec![logits]
        } else {
            let mut rest = logits.as_slice();
            wanted
                .iter()
                .map(|w| {
                    let (mine, tail) = rest.split_at(w.len() * vocab);
                    rest = tail;
                    mine.to_vec()
                })
                .collect()
        };
        times.total = t_start.elapsed();
        observer.phases(&times);
        Ok(all)
    }

    /// Inkling 2's layers: block attention residuals around each attention and MLP; `h` ends as
    /// the output query's mix, ready for the final norm.
    #[allow(clippy::too_many_arguments)]
    fn block_layers(
        &self,
        blocks: &BlockResiduals,
        tokens: &[u32],
        h: &mut [f32],
        rows: &mut [SegmentRows<'_>],
        experts: &dyn ExpertDispatch,
        observer: &mut dyn MoeObserver,
        times: &mut PhaseTimes,
    ) -> Result<(), ForwardError> {
        let s = &self.spec;
        let hd = s.hidden_size;
        let n = h.len() / hd;
        let mut kept: Vec<Vec<f32>> = Vec::new();
        let mut x = vec![0.0f32; n * hd];
        let mut proj = vec![0.0f32; n * hd];
        for (l, layer) in self.layers.iter().enumerate() {
            let Attention::Relative(attention) = &layer.attention else { continue };
            let layer_input = h.to_vec();
            let inputs = match &blocks.attn[l] {
                Some(q) => BlockResiduals::mix(q, &kept, h, hd),
                None => vec![h.to_vec(); if attention.takes_three_inputs() { 3 } else { 1 }],
            };
            norm_rows(&inputs[0], &layer.input_norm, s.rms_norm_eps, &mut x);
            let t = std::time::Instant::now();
            let kv = if attention.takes_three_inputs() { Some((inputs[1].as_slice(), inputs[2].as_slice())) } else { None };
            attention.forward_v2(s, l, &x, kv, rows, &mut proj);
            times.attention += t.elapsed();
            if l % blocks.layers_per_block == 0 {
                kept.push(layer_input);
                h.copy_from_slice(&proj);
            } else {
                add(h, &proj);
            }
            let mlp_input = BlockResiduals::mix(&blocks.mlp[l], &kept, h, hd);
            norm_rows(&mlp_input[0], &layer.post_attention_norm, s.rms_norm_eps, &mut x);
            match &layer.mlp {
                Mlp::Dense(mlp) => mlp.forward(&x, &mut proj),
                Mlp::Moe { router, shared, shared_gate, bank } => {
                    self.moe(l, tokens, router, (shared.as_ref().map(|s| (s, shared_gate.as_deref())), bank), &x, experts, observer, &mut proj, times)?
                }
            }
            attention.convolve_mlp(l, hd, rows, &mut proj);
            add(h, &proj);
        }
        let out = BlockResiduals::mix(&blocks.output, &kept, h, hd);
        h.copy_from_slice(&out[0]);
        Ok(())
    }

    /// Grouped-query attention of every segment's rows (projections over all rows at once;
    /// rotary positions, cache and attention per segment), appending their keys/values.
    fn gqa(&self, g: &Gqa, l: usize, x: &[f32], segments: &mut [SegmentRows<'_>], out: &mut [f32]) {
        let s = &self.spec;
        let a = &s.attention;
        let (hd, d) = (s.hidden_size, s.head_dim);
        let n = x.len() / hd;
        let (qd, kvd) = (s.num_heads * d, s.num_kv_heads * d);
        // The queries on 64-byte boundaries: attention loads each once per key.
        let mut q = AlignedVec::new();
        q.resize(n * qd, 0.0f32);
        let (mut k, mut v) = (vec![0.0f32; n * kvd], vec![0.0f32; n * kvd]);
        let mut gate = Vec::new();
        if g.output_gate {
            // Per head: its query, then its gate.
            let mut both = vec![0.0f32; n * 2 * qd];
            Linear::forward_many(&[&g.q, &g.k, &g.v], x, &mut [&mut both, &mut k, &mut v]);
            gate = vec![0.0f32; n * qd];
            for ((pair, qh), gh) in both.chunks_exact(2 * d).zip(q.chunks_exact_mut(d)).zip(gate.chunks_exact_mut(d)) {
                qh.copy_from_slice(&pair[..d]);
                gh.copy_from_slice(&pair[d..]);
            }
        } else {
            Linear::forward_many(&[&g.q, &g.k, &g.v], x, &mut [&mut q, &mut k, &mut v]);
        }
        // Per-head norms have head_dim-long weights; full-projection norms span the whole row, so
        // the same chunked kernel covers both.
        if let (Some(qn), Some(kn)) = (&g.q_norm, &g.k_norm) {
            let mut scratch = vec![0.0f32; qd.max(kvd)];
            ops::rms_norm_chunks(&mut q, qn, s.rms_norm_eps, &mut scratch);
            ops::rms_norm_chunks(&mut k, kn, s.rms_norm_eps, &mut scratch);
        }
        if let Some(c) = a.clip_qkv {
            for t in q.iter_mut().chain(k.iter_mut()).chain(v.iter_mut()) {
                *t = t.clamp(-c, c);
            }
        }
        let (mut cos, mut sin) = (vec![0.0f32; a.rotary_dim / 2], vec![0.0f32; a.rotary_dim / 2]);
        let shape = AttentionShape { num_heads: s.num_heads, num_kv_heads: s.num_kv_heads, head_dim: d, scale: a.scale };
        let mut attn = vec![0.0f32; n * qd];
        for seg in segments.iter_mut() {
            let (r, start) = (seg.rows.clone(), seg.start);
            for i in r.clone() {
                self.rope.cos_sin(start + i - r.start, &mut cos, &mut sin);
                for head in q[i * qd..(i + 1) * qd].chunks_exact_mut(d).chain(k[i * kvd..(i + 1) * kvd].chunks_exact_mut(d)) {
                    self.rotate(&mut head[..a.rotary_dim], &cos, &sin);
                }
            }
            seg.cache.append(l, &k[r.start * kvd..r.end * kvd], &v[r.start * kvd..r.end * kvd]);
        }
        // Every segment's rows over its own cache (a query sees keys j with pos − j < window,
        // itself included, as transformers' mask); the segments' rows are consecutive in `attn`.
        let mut calls = Vec::with_capacity(segments.len());
        let total = attn.len();
        let mut rest = &mut attn[..];
        for seg in segments.iter() {
            let (r, start) = (seg.rows.clone(), seg.start);
            debug_assert_eq!(total - rest.len(), r.start * qd, "segments' rows are consecutive");
            let (out, tail) = std::mem::take(&mut rest).split_at_mut(r.len() * qd);
            rest = tail;
            let (keys, values) = seg.cache.layer(l, 0..start + r.len());
            calls.push(RowsCall { qs: &q[r.start * qd..r.end * qd], first: start, keys, values, out });
        }
        attend_many(&shape, g.window, g.sinks.as_deref(), &mut calls);
        if g.output_gate {
            attn.iter_mut().zip(&gate).for_each(|(o, gt)| *o *= ops::sigmoid(*gt));
        }
        g.o.forward(&attn, out);
    }

    /// Rotates one head's rotary part in the layout the model uses.
    pub(crate) fn rotate(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        if self.spec.attention.rope_interleave {
            ops::rope_interleaved(x, cos, sin);
        } else {
            ops::rope_rotate_half(x, cos, sin);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn moe(
        &self,
        layer: usize,
        tokens: &[u32],
        router: &Router,
        (shared, bank): (Option<(&DenseMlp, Option<&Matrix>)>, &[DenseMlp]),
        x: &[f32],
        experts: &dyn ExpertDispatch,
        observer: &mut dyn MoeObserver,
        out: &mut [f32],
        times: &mut PhaseTimes,
    ) -> Result<(), ForwardError> {
        let s = &self.spec;
        let t_router = std::time::Instant::now();
        let (hd, k) = (s.hidden_size, s.moe.top_k);
        let n = x.len() / hd;
        let mut ids = Vec::with_capacity(n * k);
        let mut weights = Vec::with_capacity(n * k);
        let mut gammas = Vec::new();
        router.route_rows(x, tokens, &mut ids, &mut weights, &mut gammas);
        observer.moe_layer(layer, x, &ids, &weights);
        // One-layer-ahead prediction: the next MoE layer's router on this layer's rows. It goes
        // to the dispatcher before this layer's dispatch, so its reads overlap this layer's work.
        if observer.wants_lookahead() || experts.wants_lookahead() {
            if let Some(next) = (layer + 1..s.num_layers).find(|l| s.layers[*l] == LayerMlp::Moe) {
                if let Some(predicted) = self.route(next, x, tokens) {
                    if experts.wants_lookahead() {
                        experts.prefetch(next, &predicted);
                    }
                    observer.lookahead(layer, next, &predicted);
                }
            }
        }
        let t_experts = std::time::Instant::now();
        times.router += t_experts - t_router;
        let mut acc = vec![0i64; n * hd];
        experts.dispatch(&MoeBatch { layer, hidden: hd, rows: x, top_k: k, experts: &ids, weights: &weights }, &mut acc)?;
        match shimmer_kernels::team::piece_len(n, hd, TEAM_MIN_SUM_ROWS).map(|rows| rows * hd) {
            // A prompt's sums over the step's team (elementwise: the same bits in any split).
            Some(per) => shimmer_kernels::team::chunks_mut(out, per, false, |c, o| fixed::to_f32(&acc[c * per..c * per + o.len()], o)),
            None => fixed::to_f32(&acc, out),
        }
        if let Some((shared, gate)) = shared {
            // transformers adds the shared expert to the routed sum before the residual.
            let mut y = vec![0.0f32; n * hd];
            shared.forward(x, &mut y);
            if let Some(gate) = gate {
                let mut g = vec![0.0f32; n];
                gate.matmul(x, &mut g);
                for (row, gr) in y.chunks_exact_mut(hd).zip(&g) {
                    let s = ops::sigmoid(*gr);
                    row.iter_mut().for_each(|v| *v *= s);
                }
            }
            add(out, &y);
        }
        if !bank.is_empty() {
            // transformers sums the shared experts in f32, then adds them to the routed sum.
            let mut y = vec![0.0f32; n * hd];
            for (s, expert) in bank.iter().enumerate() {
                expert.add_weighted(x, gammas.iter().skip(s).step_by(bank.len()).copied(), &mut y);
            }
            add(out, &y);
        }
        times.experts += t_experts.elapsed();
        Ok(())
    }

    /// Whether a step of `rows` rows computes its LM head over a team of its own: a one-row step
    /// that runs alone (a model below `TEAM_MIN_STEP_BYTES`) with a head big enough to split —
    /// the demo model's 6,144 × 256 head was a quarter of its decode step on one thread. Its
    /// helper waits awake between steps, or is woken a layer ahead (`team::prewake`).
    fn head_as_team(&self, rows: usize) -> bool {
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        rows == 1
            && self.blocks.is_none()
            && self.spec.padded_vocab.is_none()
            && shimmer_kernels::team::active().is_none()
            && shimmer_kernels::team::pool_threads() > 1
            && head.rows * head.cols >= HEAD_TEAM_MIN_MACS
    }

    /// What layer `layer`'s router would choose for rows `x` of `tokens` (n rows → n × top_k
    /// experts), or `None` for a dense layer. Used to predict a layer's experts from an earlier
    /// layer's state (a hash layer's choice is its table's, so exact).
    pub fn route(&self, layer: usize, x: &[f32], tokens: &[u32]) -> Option<Vec<u32>> {
        let Mlp::Moe { router, .. } = &self.layers.get(layer)?.mlp else {
            return None;
        };
        let (mut ids, mut weights, mut shared) = (Vec::new(), Vec::new(), Vec::new());
        router.route_rows(x, tokens, &mut ids, &mut weights, &mut shared);
        Some(ids)
    }
}

/// Dense weight bytes a decode step must read for it to run as a team: m1b (93 MB int8) gains
/// 10–17 %, the demo model (3–6 MB) loses.
const TEAM_MIN_STEP_BYTES: u64 = 16 << 20;

/// Rows from which a step's team shares converting the experts' fixed-point sums (below it, as
/// for a 16-sequence batch's decode step, the claims cost what the split saves).
const TEAM_MIN_SUM_ROWS: usize = 32;

/// Multiply-adds of an LM head from which a one-row step splits it over a team of its own
/// (`Decoder::head_as_team`).
const HEAD_TEAM_MIN_MACS: usize = 1 << 20;

/// A hash layer's `vocab × top_k` table of expert ids (integers as stored: i64 or i32), each
/// checked to name one of the layer's experts.
fn expert_table(ckpt: &Checkpoint, name: &str, vocab: usize, top_k: usize, experts: usize) -> Result<Vec<u32>, LoadError> {
    let raw = ckpt.raw(name)?;
    let err = |problem: String| LoadError::Tensor { path: raw.file.to_path_buf(), tensor: name.to_string(), problem };
    if raw.shape != [vocab, top_k] {
        return Err(err(format!("shape {:?} but the model config needs [{vocab}, {top_k}]", raw.shape)));
    }
    let values: Vec<i64> = match raw.dtype {
        shimmer_common::StDtype::I64 => raw.bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).collect(),
        shimmer_common::StDtype::I32 => raw.bytes.chunks_exact(4).map(|b| i64::from(i32::from_le_bytes(b.try_into().unwrap_or([0; 4])))).collect(),
        other => return Err(err(format!("dtype {other:?}: expected integer expert ids (I64 or I32)"))),
    };
    values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            u32::try_from(v)
                .ok()
                .filter(|e| (*e as usize) < experts)
                .ok_or_else(|| err(format!("token {} names expert {v}, not one of the {experts}", i / top_k)))
        })
        .collect()
}

pub(crate) fn norm_rows(h: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    ops::rms_norm_rows(h, weight, eps, out);
}

pub(crate) fn add(h: &mut [f32], y: &[f32]) {
    h.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}
