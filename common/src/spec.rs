//! The typed model spec: what `config.json` says, checked, in one shape every crate can use.
//!
//! A family's config dialect, tensor names, router and attention kinds are known only to its one
//! file in `families/`, registered in `families::FAMILIES`; this module finds the family a config
//! names and parses what every family shares. Everything downstream reads `ModelSpec` (data) and
//! never a family name.
//!
//! Both spellings real checkpoints use are accepted: `rope_theta` + `rope_scaling` + `torch_dtype`
//! (most hub checkpoints) and `rope_parameters` + `dtype` (what transformers 5 writes).

use std::path::Path;

use serde_json::Value;

use crate::error::LoadError;
use crate::families::{FamilyDef, FAMILIES};
use crate::json::{check_bounds, Bound, FieldError, FieldResult, Obj};

/// Largest `config.json` we read; real ones are a few KiB.
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// Layers a model may have (DeepSeek-V3: 61; the deepest published MoE has under 100).
pub const MAX_LAYERS: u64 = 1024;
/// Vocabulary entries (the largest published: ~262 k).
pub const MAX_VOCAB: u64 = 1 << 22;
/// Positions of context (the longest published: 10 M).
pub const MAX_POSITIONS: u64 = 1 << 24;
/// Routed experts per layer: what a placement can name (`MAX_EXPERTS` of the control plane).
pub const MAX_EXPERTS: u64 = 1 << 16;
/// Experts a token is routed to: what one wire frame carries.
pub const MAX_TOP_K: u64 = 64;
/// Routed experts in the whole model (MoE layers × experts per layer), what the store's tables,
/// heat and placements are sized by (DeepSeek-V3: 14,848; the control plane's heat limit).
pub const MAX_ROUTED_EXPERTS: u64 = 1 << 20;

/// Every size-like field of `config.json`, checked before any of it is parsed: a config that
/// says `num_hidden_layers: 1000000000` is refused by name instead of sizing tables from it.
/// Each bound is far above every published model (docs/limits.md lists them with why).
pub const CONFIG_BOUNDS: &[Bound] = &[
    Bound { field: "vocab_size", max: MAX_VOCAB },
    Bound { field: "hidden_size", max: 1 << 16 },
    Bound { field: "intermediate_size", max: 1 << 20 },
    Bound { field: "moe_intermediate_size", max: 1 << 20 },
    Bound { field: "num_hidden_layers", max: MAX_LAYERS },
    Bound { field: "num_attention_heads", max: 1024 },
    Bound { field: "num_key_value_heads", max: 1024 },
    Bound { field: "head_dim", max: 4096 },
    Bound { field: "max_position_embeddings", max: MAX_POSITIONS },
    Bound { field: "sliding_window", max: MAX_POSITIONS },
    Bound { field: "num_experts", max: MAX_EXPERTS },
    Bound { field: "num_local_experts", max: MAX_EXPERTS },
    Bound { field: "n_routed_experts", max: MAX_EXPERTS },
    Bound { field: "num_experts_per_tok", max: MAX_TOP_K },
    Bound { field: "n_shared_experts", max: MAX_TOP_K },
    Bound { field: "n_group", max: MAX_EXPERTS },
    Bound { field: "topk_group", max: MAX_EXPERTS },
    Bound { field: "first_k_dense_replace", max: MAX_LAYERS },
    Bound { field: "decoder_sparse_step", max: MAX_LAYERS },
    Bound { field: "kv_lora_rank", max: 1 << 16 },
    Bound { field: "q_lora_rank", max: 1 << 16 },
    Bound { field: "qk_nope_head_dim", max: 4096 },
    Bound { field: "qk_rope_head_dim", max: 4096 },
    Bound { field: "v_head_dim", max: 4096 },
    Bound { field: "bos_token_id", max: MAX_VOCAB },
    Bound { field: "eos_token_id", max: MAX_VOCAB },
    Bound { field: "pad_token_id", max: MAX_VOCAB },
    Bound { field: "eos_token_id[]", max: 1024 },
    Bound { field: "mlp_only_layers", max: MAX_LAYERS },
    Bound { field: "mlp_only_layers[]", max: MAX_LAYERS },
    Bound { field: "layer_types[]", max: MAX_LAYERS },
    Bound { field: "shared_expert_intermediate_size", max: 1 << 20 },
    Bound { field: "full_attention_interval", max: MAX_LAYERS },
    Bound { field: "linear_conv_kernel_dim", max: 64 },
    Bound { field: "linear_key_head_dim", max: 4096 },
    Bound { field: "linear_value_head_dim", max: 4096 },
    Bound { field: "linear_num_key_heads", max: 1024 },
    Bound { field: "linear_num_value_heads", max: 1024 },
    Bound { field: "index_topk", max: MAX_POSITIONS },
    Bound { field: "model_max_length", max: MAX_POSITIONS },
    Bound { field: "num_expert_group", max: MAX_EXPERTS },
    Bound { field: "num_experts_per_token", max: MAX_TOP_K },
    Bound { field: "num_shared_experts", max: MAX_TOP_K },
    Bound { field: "linear_head_dim", max: 4096 },
    Bound { field: "linear_num_heads", max: 1024 },
    Bound { field: "index_head_dim", max: 4096 },
    Bound { field: "index_n_heads", max: 1024 },
    Bound { field: "o_groups", max: 1024 },
    Bound { field: "o_lora_rank", max: 1 << 16 },
    Bound { field: "hc_mult", max: 64 },
    Bound { field: "hc_sinkhorn_iters", max: 1000 },
    Bound { field: "compress_rate_csa", max: 1 << 16 },
    Bound { field: "compress_rate_hca", max: 1 << 16 },
    Bound { field: "compress_ratios[]", max: 1 << 16 },
    Bound { field: "num_hash_layers", max: MAX_LAYERS },
    Bound { field: "unpadded_vocab_size", max: MAX_VOCAB },
    Bound { field: "swa_num_attention_heads", max: 1024 },
    Bound { field: "swa_num_key_value_heads", max: 1024 },
    Bound { field: "swa_head_dim", max: 4096 },
    Bound { field: "sliding_window_size", max: MAX_POSITIONS },
    Bound { field: "d_rel", max: 4096 },
    Bound { field: "rel_extent", max: MAX_POSITIONS },
    Bound { field: "log_scaling_n_floor", max: MAX_POSITIONS },
    Bound { field: "conv_kernel_size", max: 64 },
    Bound { field: "dense_intermediate_size", max: 1 << 20 },
    Bound { field: "dense_mlp_idx", max: MAX_LAYERS },
    Bound { field: "local_layer_ids[]", max: MAX_LAYERS },
    Bound { field: "n_layers_per_attn_res_block", max: MAX_LAYERS },
];

/// The size-like fields of the rope parameters (`rope_scaling` or `rope_parameters`).
pub const ROPE_BOUNDS: &[Bound] = &[Bound { field: "original_max_position_embeddings", max: MAX_POSITIONS }];

/// Size-like fields inside other objects of `config.json`: DeepSeek-V4's compression rates
/// (positions per compressed entry).
pub const NESTED_BOUNDS: &[(&str, &[Bound])] =
    &[("compress_rates", &[Bound { field: "compressed_sparse_attention", max: 1 << 16 }, Bound { field: "heavily_compressed_attention", max: 1 << 16 }])];

/// Where a decoder's dense tensors live: templates with `{L}` for the layer (the families of
/// today share Llama's layout; a family with another names its own in its file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenseNames {
    pub embed: &'static str,
    pub final_norm: &'static str,
    pub lm_head: &'static str,
    pub input_norm: &'static str,
    pub post_attention_norm: &'static str,
    /// Attention projections (without `.weight`/`.bias`: biases are optional).
    pub q: &'static str,
    pub k: &'static str,
    pub v: &'static str,
    pub o: &'static str,
    pub q_norm: &'static str,
    pub k_norm: &'static str,
    /// Per-head attention sink logits (`AttentionSpec::sinks`).
    pub sinks: &'static str,
    /// Where a linear-attention layer's tensors live (`{prefix}.conv1d.weight`, …).
    pub linear_attn: &'static str,
    /// A dense layer's MLP.
    pub mlp_gate: &'static str,
    pub mlp_up: &'static str,
    pub mlp_down: &'static str,
    pub mlp_layout: DenseMlpLayout,
}

/// How a dense MLP's gate and up projections are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseMlpLayout {
    /// `mlp_gate` and `mlp_up` name one `intermediate × hidden` tensor each.
    Separate,
    /// One `2·intermediate × hidden` tensor under `mlp_gate`, gate and up rows interleaved (row
    /// 2j gate j, row 2j + 1 up j: Inkling's release `w13_dn`); `mlp_up` is unused.
    InterleavedGateUp,
}

impl DenseNames {
    /// The layout Llama made standard.
    pub const LLAMA: DenseNames = DenseNames {
        embed: "model.embed_tokens.weight",
        final_norm: "model.norm.weight",
        lm_head: "lm_head.weight",
        input_norm: "model.layers.{L}.input_layernorm.weight",
        post_attention_norm: "model.layers.{L}.post_attention_layernorm.weight",
        q: "model.layers.{L}.self_attn.q_proj",
        k: "model.layers.{L}.self_attn.k_proj",
        v: "model.layers.{L}.self_attn.v_proj",
        o: "model.layers.{L}.self_attn.o_proj",
        q_norm: "model.layers.{L}.self_attn.q_norm.weight",
        k_norm: "model.layers.{L}.self_attn.k_norm.weight",
        sinks: "model.layers.{L}.self_attn.sinks",
        linear_attn: "model.layers.{L}.linear_attn",
        mlp_gate: "model.layers.{L}.mlp.gate_proj.weight",
        mlp_up: "model.layers.{L}.mlp.up_proj.weight",
        mlp_down: "model.layers.{L}.mlp.down_proj.weight",
        mlp_layout: DenseMlpLayout::Separate,
    };
}

/// Where the per-head query/key RMSNorm sits, if the family has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// One RMSNorm over the whole projection (all heads at once), as OLMoE.
    FullProjection,
    /// One RMSNorm of size `head_dim` shared by every head, as Qwen3.
    PerHead,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    /// YaRN as transformers computes it (`_compute_yarn_parameters`).
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        /// Multiplies cos and sin (so q·k by its square).
        attention_factor: f64,
        /// Also scales the attention softmax (DeepSeek's `mscale_all_dim`), if set.
        mscale_all_dim: Option<f64>,
        truncate: bool,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): queries and keys/values pass through
/// low-rank projections, and the cache holds only the compressed latent and the rotary key.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaSpec {
    /// `None`: a plain `q_proj` (DeepSeek-V2-Lite); `Some(r)`: `q_a_proj` → norm → `q_b_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// DeepSeek Sparse Attention (GLM-5): each query attends only to the keys its indexer picks.
    pub indexer: Option<IndexerSpec>,
}

/// DeepSeek Sparse Attention's lightning indexer: per query, `heads` scores `relu(q_h·k_j /
/// √head_dim)` weighted by a per-row `weights_proj` and summed rank every earlier key `j`; the
/// `top_k` best (the higher score first, the lower position on a tie) are the keys attention
/// sees. `k_j` (`head_dim`, after a LayerNorm) is cached per position; the first
/// `qk_rope_head_dim` dims of q and k rotate (interleaved pairs).
#[derive(Debug, Clone, PartialEq)]
pub struct IndexerSpec {
    pub heads: usize,
    pub head_dim: usize,
    pub top_k: usize,
    /// Per layer: runs its own indexer (`full`), or reuses the choice of the last layer that did
    /// (`shared`).
    pub full: Vec<bool>,
}

impl MlaSpec {
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// How a layer mixes information across positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mixer {
    /// Softmax attention over a KV cache (`AttentionSpec::kind`).
    Attention,
    /// Gated DeltaNet (Qwen3-Next, Qwen3.5) or Kimi Delta Attention (Kimi Linear): a recurrent
    /// state per sequence (`GatedDeltaSpec`).
    GatedDeltaNet,
}

/// How a Gated DeltaNet layer's input projections are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaProjections {
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, grouped per key head (q, k, then the group's
    /// values and gates; b then a).
    Grouped,
    /// Qwen3.5: `in_proj_qkv` (all queries, all keys, all values), `in_proj_z`, `in_proj_b`,
    /// `in_proj_a`.
    Separate,
    /// Kimi Delta Attention (Kimi Linear): `q_proj`, `k_proj`, `v_proj` with their own
    /// convolutions (`q_conv1d`, …); a decay per key channel from a low-rank forget gate
    /// (`f_a_proj`, `f_b_proj`, `dt_bias` per channel, `A_log` per head); `b_proj`; a low-rank
    /// output gate (`g_a_proj`, `g_b_proj`) through a sigmoid.
    Kimi,
}

/// Gated DeltaNet: per value head a `key_dim × value_dim` state, decayed by `exp(g)` and
/// corrected by the delta rule each token, read by an L2-normalised query; inputs pass through
/// a depthwise causal convolution; the output through an RMSNorm gated by `silu(z)`.
#[derive(Debug, Clone, PartialEq)]
pub struct GatedDeltaSpec {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
    pub projections: DeltaProjections,
}

impl GatedDeltaSpec {
    /// Channels of the convolution: queries, keys and values.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
    /// Floats of one layer's recurrent state: the convolution's last `conv_kernel − 1` inputs
    /// and every value head's state matrix.
    pub fn state_floats(&self) -> usize {
        self.conv_dim() * (self.conv_kernel - 1) + self.value_heads * self.key_dim * self.value_dim
    }
}

/// What a DeepSeek-V4 layer attends to besides its sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompressKind {
    /// The window only.
    Sliding,
    /// Compressed sparse attention: an entry per `csa_rate` positions, pooled over two
    /// overlapping windows, of which a lightning indexer picks each query's best `indexer_top_k`.
    Sparse,
    /// Heavily compressed attention: an entry per `hca_rate` positions, every one seen.
    Heavy,
}

/// DeepSeek-V4's attention: one shared key-value head (`head_dim`, the key is the value),
/// queries through a low-rank projection with an RMSNorm per head; interleaved rotary on each
/// head's trailing `rope_dim` dims, undone on the output at the query's position; per-head sinks;
/// a sliding window beside the compressed entries of `kinds`; a grouped low-rank output projection
/// (`o_groups` groups of heads, each to `o_lora_rank`, then mixed to the hidden size).
#[derive(Debug, Clone, PartialEq)]
pub struct CompressedSpec {
    pub q_lora_rank: usize,
    pub rope_dim: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub window: usize,
    pub kinds: Vec<CompressKind>,
    pub csa_rate: usize,
    pub hca_rate: usize,
    pub indexer_heads: usize,
    pub indexer_head_dim: usize,
    pub indexer_top_k: usize,
    /// The rotary of compressed layers (their attention, entries and indexer); sliding layers
    /// use `ModelSpec::rope`.
    pub compress_rope: RopeSpec,
    pub names: CompressedNames,
}

/// Tensor-name templates of `CompressedSpec` layers (`{L}` the layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressedNames {
    pub q_a: &'static str,
    pub q_a_norm: &'static str,
    pub q_b: &'static str,
    pub kv: &'static str,
    pub kv_norm: &'static str,
    pub o_a: &'static str,
    pub o_b: &'static str,
    pub sinks: &'static str,
    /// The compressor (`{prefix}.wkv.weight`, `.wgate.weight`, `.ape`, `.norm.weight`), and the
    /// indexer's (`{indexer}.compressor.…`, `{indexer}.wq_b.weight`, `{indexer}.weights_proj.weight`).
    pub compressor: &'static str,
    pub indexer: &'static str,
}

/// Manifold-constrained hyper-connections (DeepSeek-V4): `streams` residual copies, mixed around
/// each sublayer with Sinkhorn-projected weights (`hc_sinkhorn_iters`, `hc_eps`).
#[derive(Debug, Clone, PartialEq)]
pub struct HyperSpec {
    pub streams: usize,
    pub sinkhorn_iters: usize,
    pub eps: f32,
    /// `[mix, base, scale]` name templates around attention, around the MLP, and at the head.
    pub attn: [&'static str; 3],
    pub ffn: [&'static str; 3],
    pub head: [&'static str; 3],
}

#[derive(Debug, Clone, PartialEq)]
pub enum AttentionKind {
    /// Grouped-query attention (MHA, GQA, MQA) with q/k/v/o projections.
    Gqa,
    Mla(MlaSpec),
    Compressed(Box<CompressedSpec>),
    Relative(Box<RelativeSpec>),
}

/// Heads of one kind of Inkling layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Inkling's attention: no rotary; instead a bias on each query–key logit learned per backward
/// distance (`rel_extent` of them: `d_rel` profiles mixed by the query's own states, zero
/// farther back); keys and values pass a short causal convolution with a residual; per-head
/// q/k RMSNorm and a `1/head_dim` scale; sliding and full layers have their own head shapes; full
/// layers scale queries and biases by `1 + α·ln(max(1, (p+1)/n_floor))` past `n_floor`. Around
/// it the layer's attention and MLP outputs pass short convolutions of their own (`conv_kernel`
/// wide, with a residual).
#[derive(Debug, Clone, PartialEq)]
pub struct RelativeSpec {
    pub full: HeadShape,
    pub sliding: HeadShape,
    pub window: usize,
    /// Per layer: a sliding layer (its window is also its bias's reach).
    pub sliding_layers: Vec<bool>,
    pub d_rel: usize,
    pub rel_extent: usize,
    /// `(n_floor, α)` of the full layers' logarithmic query scaling.
    pub log_scaling: Option<(f32, f32)>,
    pub conv_kernel: usize,
    pub names: RelativeNames,
    /// Inkling 2's additions, when the model is one.
    pub v2: Option<Box<Inkling2Spec>>,
}

/// What Inkling 2 adds to `RelativeSpec`: block attention residuals (each layer's inputs are a
/// learned-query softmax over the outputs of earlier blocks of `layers_per_block` layers and the
/// running state; full layers take three, for q, k and v, each normed on its own), per-token
/// sinks, queries, keys and relative states L2-clipped (queries and states after a learned
/// scale), dynamic key/value convolutions on full layers, a sigmoid gate on the attention output,
/// convolutions scaled by `1/√(K+1)` (`1/√(2K+1)` for the dynamic ones), a `1/√d` scale.
#[derive(Debug, Clone, PartialEq)]
pub struct Inkling2Spec {
    pub qk_clip: f32,
    pub rel_clip: f32,
    pub layers_per_block: usize,
    pub names: Inkling2Names,
}

/// Tensor-name templates of Inkling 2 (`{L}` the layer; `attn_query` is numbered from the second
/// layer, as the release numbers it: layer L reads `attn_queries.{L−1}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inkling2Names {
    pub gate: &'static str,
    pub sink: &'static str,
    pub q_scale: &'static str,
    pub rel_scale: &'static str,
    pub k_static: &'static str,
    pub k_dynamic: &'static str,
    pub v_static: &'static str,
    pub v_dynamic: &'static str,
    pub q_input_norm: &'static str,
    pub k_input_norm: &'static str,
    pub v_input_norm: &'static str,
    pub attn_query: &'static str,
    pub mlp_query: &'static str,
    pub output_query: &'static str,
}

/// Tensor-name templates of `RelativeSpec` layers (`{L}` the layer; the attention's without
/// `.weight`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelativeNames {
    pub q: &'static str,
    pub k: &'static str,
    pub v: &'static str,
    pub r: &'static str,
    pub o: &'static str,
    pub q_norm: &'static str,
    pub k_norm: &'static str,
    pub k_conv: &'static str,
    pub v_conv: &'static str,
    pub rel_proj: &'static str,
    pub attn_conv: &'static str,
    pub mlp_conv: &'static str,
    /// The dense MLP's and the router's global scales.
    pub mlp_scale: &'static str,
    pub router_scale: &'static str,
    pub embed_norm: &'static str,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AttentionSpec {
    pub kind: AttentionKind,
    pub qk_norm: QkNorm,
    /// Clamp q, k and v to ±clip after projection (OLMoE's `clip_qkv`).
    pub clip_qkv: Option<f32>,
    /// q/k/v projections (MLA: `q_a_proj`, `kv_a_proj_with_mqa`) carry a bias.
    pub bias: bool,
    /// `o_proj` carries a bias.
    pub o_bias: bool,
    /// Leading dims of each head's rotary part that rotate (partial rotary); the rest pass through.
    pub rotary_dim: usize,
    /// Rotary pairs are interleaved, (x0, x1), (x2, x3), …, instead of split halves.
    pub rope_interleave: bool,
    /// The attention softmax scale.
    pub scale: f32,
    /// Per layer: how many keys (the current one included) a query may see; `None` = all.
    pub sliding_window: Vec<Option<usize>>,
    /// Each head has a learned sink logit that joins its softmax and takes its share of the
    /// probability without contributing a value (gpt-oss).
    pub sinks: bool,
    /// `q_proj` also yields, per head after its query, a gate: the head's output is multiplied by
    /// `σ(gate)` before `o_proj` (Qwen3-Next).
    pub output_gate: bool,
    /// Per layer: softmax attention or a linear-attention mixer.
    pub mixers: Vec<Mixer>,
    /// The Gated DeltaNet layers' shape, when any layer is one.
    pub gated_delta: Option<GatedDeltaSpec>,
    /// No positional encoding at all (Kimi Linear's MLA layers): the rotary part does not rotate.
    pub no_rope: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerMlp {
    Dense { intermediate_size: usize },
    Moe,
}

/// How the router turns logits into (expert, weight) pairs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterScoring {
    /// softmax over all experts in f32, top-k, then optionally renormalise the k weights.
    SoftmaxTopK { norm_topk_prob: bool },
    /// DeepSeek-V3 / GLM-4.5: sigmoid scores; selection on score + `e_score_correction_bias`,
    /// limited to the `topk_group` groups (of `n_group`) whose two best biased scores sum
    /// highest; weights are the unbiased scores, optionally renormalised, times
    /// `routed_scaling_factor`.
    SigmoidGrouped { n_group: usize, topk_group: usize, norm_topk_prob: bool, routed_scaling_factor: f32 },
    /// gpt-oss: the top-k of the raw logits (the router's linear bias included), then a softmax
    /// over those k only.
    TopKSoftmax,
    /// DeepSeek-V4: scores `√softplus(logit)`; selection on score + `e_score_correction_bias`
    /// (or, in a hash layer, the token's fixed row of `tid2eid`); weights the unbiased scores
    /// over their sum, times `routed_scaling_factor`.
    SqrtSoftplus { routed_scaling_factor: f32 },
    /// Inkling: the router also scores `shared` shared experts (its last rows); selection on the
    /// routed experts' sigmoid + `e_score_correction_bias`; weights a softmax over
    /// `logsigmoid` of the chosen and the shared logits, times `route_scale` and the router's
    /// global scale — the shared experts' weights scale their outputs.
    LogSigmoidShared { route_scale: f32, shared: usize },
}

/// The function between an expert's gate/up projections and its down projection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertActivation {
    /// `silu(gate) · up` (SwiGLU).
    Silu,
    /// gpt-oss: `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`, `(u + 1) · g · σ(α·g)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
    /// DeepSeek-V4: `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`, `silu(g) · u`; its
    /// shared experts too.
    ClampedSilu { limit: f32 },
    /// Inkling 2: `cap_g(gate) · σ(gate) · cap_u(up)`, `cap_c(x) = c · tanh(x / c)`.
    SoftcappedSwiglu { gate_cap: f32, up_cap: f32 },
}

#[derive(Debug, Clone, PartialEq)]
pub struct MoeSpec {
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_intermediate_size: usize,
    pub scoring: RouterScoring,
    /// Intermediate size of the always-on shared expert(s) in MoE layers, if any
    /// (`n_shared_experts × moe_intermediate_size`).
    pub shared_intermediate_size: Option<usize>,
    pub activation: ExpertActivation,
    /// Each routed expert's three projections carry a bias (gpt-oss).
    pub expert_bias: bool,
}

/// How a layer's routed experts are laid out in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertLayout {
    /// One `out × in` tensor per expert and projection (`{E}` in the names).
    Separate,
    /// Inkling 2's release: as `FusedStacked`, but each expert's gate and up rows interleaved
    /// (row 2j gate j, row 2j + 1 up j).
    StackedInterleaved,
    /// transformers 5's stacked experts: `ExpertNames::gate` is `experts × 2·intermediate ×
    /// hidden` (each expert's gate rows, then its up rows), `down` `experts × hidden ×
    /// intermediate`; `up` is unused. Shared experts stacked alike (`shared × out × in` each).
    FusedStacked,
    /// gpt-oss: one tensor per projection for all of a layer's experts, `experts × in × out`,
    /// with gate and up fused in `ExpertNames::gate`'s tensor, interleaved along `out` (gate
    /// column j at 2j, up at 2j + 1), each with an `experts × out` `<name>_bias`; or, as OpenAI
    /// ships them, MXFP4 `<name>_blocks` (`experts × out × in/32 × 16`) and `<name>_scales`
    /// (`experts × out × in/32`). `ExpertNames::up` is unused.
    FusedInterleaved,
}

/// Tensor-name templates; `{L}` is the layer index, `{E}` the expert index.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertNames {
    pub router: &'static str,
    /// The router's selection bias (`e_score_correction_bias`), for sigmoid-grouped routers.
    pub router_bias: Option<&'static str>,
    /// The router's linear bias, added to its logits (gpt-oss's `mlp.router.bias`).
    pub router_logit_bias: Option<&'static str>,
    /// `[gate, up, down]` of the shared expert, if the family has one.
    pub shared: Option<[&'static str; 3]>,
    /// A `1 × hidden` weight whose sigmoid scales the shared expert's output (Qwen3-Next).
    pub shared_gate: Option<&'static str>,
    /// A hash layer's `vocab × top_k` table of expert ids (DeepSeek-V4's `tid2eid`).
    pub router_hash: Option<&'static str>,
    pub layout: ExpertLayout,
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

impl ExpertNames {
    pub fn router(&self, layer: usize) -> String {
        fill(self.router, layer, 0)
    }
    pub fn router_bias(&self, layer: usize) -> Option<String> {
        self.router_bias.map(|t| fill(t, layer, 0))
    }
    pub fn shared(&self, layer: usize) -> Option<[String; 3]> {
        self.shared.map(|[g, u, d]| [fill(g, layer, 0), fill(u, layer, 0), fill(d, layer, 0)])
    }
    pub fn shared_gate(&self, layer: usize) -> Option<String> {
        self.shared_gate.map(|t| fill(t, layer, 0))
    }
    pub fn router_hash(&self, layer: usize) -> Option<String> {
        self.router_hash.map(|t| fill(t, layer, 0))
    }
    pub fn router_logit_bias(&self, layer: usize) -> Option<String> {
        self.router_logit_bias.map(|t| fill(t, layer, 0))
    }
    /// `[gate, up, down]` weight names of one expert (`FusedInterleaved`: the layer's fused
    /// gate-up tensor twice, then down).
    pub fn expert(&self, layer: usize, expert: usize) -> [String; 3] {
        [fill(self.gate, layer, expert), fill(self.up, layer, expert), fill(self.down, layer, expert)]
    }
    /// Every tensor name that may hold part of layer `layer`'s routed experts (with `experts` of
    /// them): what a converter moves into the expert container rather than the dense file.
    pub fn tensor_names(&self, layer: usize, experts: usize) -> Vec<String> {
        match self.layout {
            ExpertLayout::Separate => {
                (0..experts).flat_map(|e| self.expert(layer, e)).flat_map(|n| crate::quant::scale_names(&n).into_iter().chain([n])).collect()
            }
            // MXFP8 and NVFP4 experts' scales (`<name>_scale`, and NVFP4's per-expert
            // `<name>_scale_2`: Inkling's releases) go with them.
            ExpertLayout::FusedStacked | ExpertLayout::StackedInterleaved => {
                [fill(self.gate, layer, 0), fill(self.down, layer, 0)].into_iter().flat_map(|n| [format!("{n}_scale"), format!("{n}_scale_2"), n]).collect()
            }
            ExpertLayout::FusedInterleaved => [fill(self.gate, layer, 0), fill(self.down, layer, 0)]
                .into_iter()
                .flat_map(|n| ["", "_bias", "_blocks", "_scales"].map(|suffix| format!("{n}{suffix}")))
                .collect(),
        }
    }
}

fn fill(template: &str, layer: usize, expert: usize) -> String {
    template.replace("{L}", &layer.to_string()).replace("{E}", &expert.to_string())
}

/// Floating-point storage types a checkpoint may declare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatType {
    F32,
    Bf16,
    F16,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// The family's architecture name (`families::FamilyDef::architecture`).
    pub architecture: &'static str,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    /// RMSNorm weights are stored zero-centred: the scale is `1 + w` (Qwen3-Next's norms).
    pub rms_norm_unit_offset: bool,
    pub rope: RopeSpec,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub attention: AttentionSpec,
    /// One entry per layer.
    pub layers: Vec<LayerMlp>,
    pub moe: MoeSpec,
    pub expert_names: ExpertNames,
    pub dense_names: DenseNames,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// `torch_dtype` / `dtype` as declared; tensors are still checked one by one.
    pub declared_dtype: Option<FloatType>,
    /// The side of the square blocks an fp8-e4m3 checkpoint's `<name>_scale_inv` scales cover
    /// (`quantization_config.weight_block_size`; 128, DeepSeek-V3's, when absent).
    pub fp8_block: usize,
    /// The residual as several streams (DeepSeek-V4), if the family has them.
    pub hyper: Option<HyperSpec>,
    /// Per layer: the MoE router's choice is a fixed table per token (`ExpertNames::router_hash`).
    pub hash_routed: Vec<bool>,
    /// Rows of the embedding and the LM head when padded past `vocab_size` (Inkling's
    /// `unpadded_vocab_size` is then `vocab_size`: logits beyond it are never computed).
    pub padded_vocab: Option<usize>,
    /// The final hidden state is divided by this before the LM head (Inkling's muP multiplier).
    pub logit_divisor: f32,
    /// Logits pass `c · tanh(x / c)` (Inkling 2's `final_logit_softcapping`).
    pub logit_softcap: Option<f32>,
}

/// `quantization_config.weight_block_size` (two equal sizes), or 128 when the config has none.
fn fp8_block_size(config: &Value) -> FieldResult<usize> {
    let Some(qc) = config.get("quantization_config") else { return Ok(128) };
    // MXFP8's [1, 32] groups are not square blocks: its scales' shapes say where they apply.
    if qc.get("quant_method").and_then(Value::as_str) == Some("mxfp8") {
        return Ok(128);
    }
    match qc.get("weight_block_size").and_then(|v| v.as_array()).map(|a| a.iter().map(|x| x.as_u64()).collect::<Vec<_>>()) {
        None => Ok(128),
        Some(b) if b.len() == 2 && b[0] == b[1] && b[0].is_some_and(|x| x > 0 && x <= 1 << 16) => Ok(b[0].unwrap_or(128) as usize),
        Some(_) => Err(FieldError::new("quantization_config.weight_block_size", "expected two equal positive block sizes")),
    }
}

/// The quantised forms a `quantization_config` may declare, checked before any tensor is read:
/// block fp8 (`fp8`: DeepSeek-V3's f32 scales, DeepSeek-V4's UE8M0 ones and its FP4 experts),
/// Inkling 2's `mxfp8` experts, Inkling's `modelopt` NVFP4 experts and gpt-oss's `mxfp4` experts.
/// Anything else is refused naming the field — a method shimmer does not
/// read would otherwise surface as a confusing missing tensor.
fn check_quantization(config: &Value) -> FieldResult<()> {
    let Some(qc) = config.get("quantization_config") else { return Ok(()) };
    let Value::Object(qc) = qc else { return Err(FieldError::new("quantization_config", "expected an object")) };
    let field = |key: &str, allowed: &[&str]| -> FieldResult<()> {
        match qc.get(key) {
            None | Some(Value::Null) => Ok(()),
            Some(Value::String(v)) if allowed.contains(&v.as_str()) => Ok(()),
            Some(v) => Err(FieldError::new(&format!("quantization_config.{key}"), format!("{v} is not read (shimmer reads {})", allowed.join(", ")))),
        }
    };
    match qc.get("quant_method").and_then(Value::as_str) {
        Some("fp8") => {
            field("fmt", &["e4m3"])?;
            // Static activation scales would scale inputs too: only dynamic (none stored) is read.
            field("activation_scheme", &["dynamic"])?;
            field("scale_fmt", &["float", "ue8m0"])?;
            field("expert_dtype", &["fp8", "fp4"])
        }
        Some("mxfp4") => Ok(()),
        // Inkling 2's release: fp8-e4m3 experts with a UE8M0 scale per 32 values of a row.
        Some("mxfp8") => {
            field("activation_scheme", &["dynamic"])?;
            field("scale_fmt", &["ue8m0"])?;
            match qc.get("weight_block_size") {
                None | Some(Value::Null) => Ok(()),
                Some(b) if *b == serde_json::json!([1, 32]) => Ok(()),
                Some(b) => Err(FieldError::new("quantization_config.weight_block_size", format!("{b}: MXFP8 scales groups of [1, 32]"))),
            }
        }
        // Inkling's release (ModelOpt NVFP4): routed experts as e2m1 codes with an fp8-e4m3 scale
        // per 16 values and a per-expert f32 `_scale_2`; the other weights as they are.
        Some("modelopt") => check_modelopt_nvfp4(qc),
        Some(other) => Err(FieldError::new(
            "quantization_config.quant_method",
            format!("`{other}` is not read (shimmer reads fp8, mxfp8, mxfp4 and modelopt NVFP4 checkpoints)"),
        )),
        None => Err(FieldError::new("quantization_config.quant_method", "missing")),
    }
}

/// A ModelOpt `quantization_config` must declare NVFP4 weights in groups of 16: `quant_algo:
/// NVFP4`, or (as Inkling's release spells it) a `*weight_quantizer` of e2m1 values (`num_bits`
/// [2, 1]) with e4m3 scales (`block_sizes.scale_bits` [4, 3]); ModelOpt up to 0.29 nests all of it
/// under `quantization`. The activation calibration it may carry (`input_amax`) is not applied:
/// products take the activations as they are, as transformers computes with dequantised weights.
fn check_modelopt_nvfp4(qc: &serde_json::Map<String, Value>) -> FieldResult<()> {
    let (qc, at) = match qc.get("quantization") {
        Some(Value::Object(inner)) => (inner, "quantization_config.quantization"),
        _ => (qc, "quantization_config"),
    };
    let algo = qc.get("quant_algo").and_then(Value::as_str);
    let quantizer = qc.get("modelopt_quant_config").and_then(|m| m.get("quant_cfg")).and_then(|q| q.get("*weight_quantizer"));
    let nvfp4 = match (algo, quantizer) {
        (Some(a), _) => a.eq_ignore_ascii_case("nvfp4"),
        (None, Some(wq)) => {
            wq.get("num_bits") == Some(&serde_json::json!([2, 1]))
                && wq.get("block_sizes").and_then(|b| b.get("scale_bits")) == Some(&serde_json::json!([4, 3]))
        }
        (None, None) => false,
    };
    if !nvfp4 {
        let what = algo.map_or_else(|| format!("{}", quantizer.unwrap_or(&Value::Null)), |a| format!("`{a}`"));
        return Err(FieldError::new(at, format!("ModelOpt {what} is not read (shimmer reads ModelOpt NVFP4: e2m1 weights with e4m3 scales)")));
    }
    match qc.get("group_size") {
        None | Some(Value::Null) => Ok(()),
        Some(g) if g.as_u64() == Some(16) => Ok(()),
        Some(g) => Err(FieldError::new(&format!("{at}.group_size"), format!("{g}: NVFP4 scales groups of 16"))),
    }
}

impl ModelSpec {
    /// Reads and checks `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("config.json");
        let value = read_json_file(&path, MAX_CONFIG_BYTES)?;
        Self::from_json(&value, &path)
    }

    pub fn from_json(value: &Value, path: &Path) -> Result<Self, LoadError> {
        let Value::Object(map) = value else {
            return Err(LoadError::malformed(path, "config is not a JSON object"));
        };
        let obj = Obj(map);
        let field_err = |e: FieldError| LoadError::Field { path: path.to_path_buf(), field: e.field, problem: e.problem };
        check_bounds(map, CONFIG_BOUNDS, "").map_err(field_err)?;
        // An image-text checkpoint keeps its text model's fields under `text_config`.
        let text = match map.get("text_config") {
            Some(Value::Object(text)) => {
                check_bounds(text, CONFIG_BOUNDS, "text_config.").map_err(field_err)?;
                Some(text)
            }
            _ => None,
        };
        for (config, prefix) in std::iter::once((map, "")).chain(text.map(|t| (t, "text_config."))) {
            for nested in ["rope_scaling", "rope_parameters"] {
                if let Some(Value::Object(rope)) = config.get(nested) {
                    check_bounds(rope, ROPE_BOUNDS, &format!("{prefix}{nested}.")).map_err(field_err)?;
                    // DeepSeek-V4 nests a rope per kind of layer.
                    for (kind, inner) in rope {
                        if let Value::Object(inner) = inner {
                            check_bounds(inner, ROPE_BOUNDS, &format!("{prefix}{nested}.{kind}.")).map_err(field_err)?;
                        }
                    }
                }
            }
            for (nested, bounds) in NESTED_BOUNDS {
                if let Some(Value::Object(inner)) = config.get(*nested) {
                    check_bounds(inner, bounds, &format!("{prefix}{nested}.")).map_err(field_err)?;
                }
            }
        }
        let entry = find_family(&obj, path)?;
        let mut spec = (entry.parse)(&obj).map_err(field_err)?;
        check_quantization(value).map_err(field_err)?;
        if let Some(text) = text {
            check_quantization(&Value::Object(text.clone())).map_err(|e| field_err(FieldError { field: format!("text_config.{}", e.field), ..e }))?;
        }
        spec.fp8_block = fp8_block_size(value).map_err(field_err)?;
        // Checks across fields name where the field is: in an image-text config, `text_config`;
        // in the family's own spelling.
        // A head size the config does not state is hidden_size / num_attention_heads: a check on it
        // names the field it came from.
        let states_head_dim = map.get("head_dim").is_some() || text.is_some_and(|t| t.get("head_dim").is_some());
        let derived_head_dim = !states_head_dim && spec.num_heads > 0 && spec.head_dim == spec.hidden_size / spec.num_heads;
        spec.check()
            .map_err(|e| match e.field == "head_dim" && derived_head_dim {
                true => FieldError::new("hidden_size", format!("{} (the head size is hidden_size / num_attention_heads)", e.problem)),
                false => e,
            })
            .map_err(|e| match entry.spellings.iter().find(|(ours, _)| e.field == *ours && map.get(*ours).is_none()) {
                Some((_, theirs)) => FieldError::new(theirs, e.problem),
                None => e,
            })
            .map_err(|e| match text {
                Some(t) if map.get(&e.field).is_none() && t.get(e.field.split('.').next().unwrap_or_default()).is_some() => {
                    FieldError::new(&format!("text_config.{}", e.field), e.problem)
                }
                _ => e,
            })
            .map_err(field_err)?;
        Ok(spec)
    }

    pub fn moe_layer_count(&self) -> usize {
        self.layers.iter().filter(|l| **l == LayerMlp::Moe).count()
    }

    /// Invariants shared by every family; a parser may not hand out a spec that breaks them.
    fn check(&self) -> FieldResult<()> {
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(FieldError::new("num_key_value_heads", format!("{} does not divide num_attention_heads = {}", self.num_kv_heads, self.num_heads)));
        }
        if !self.attention.rotary_dim.is_multiple_of(2) || self.attention.rotary_dim > self.head_dim {
            return Err(FieldError::new(
                "head_dim",
                format!("the rotary part ({} of {}) must be even and fit the head", self.attention.rotary_dim, self.head_dim),
            ));
        }
        if let RouterScoring::SigmoidGrouped { n_group, topk_group, .. } = self.moe.scoring {
            if n_group == 0 || !self.moe.num_experts.is_multiple_of(n_group) || self.moe.num_experts / n_group < 2 {
                return Err(FieldError::new("n_group", format!("{n_group} groups must divide the {} experts into groups of at least 2", self.moe.num_experts)));
            }
            if topk_group == 0 || topk_group > n_group {
                return Err(FieldError::new("topk_group", format!("{topk_group} must be between 1 and n_group = {n_group}")));
            }
            if self.moe.top_k > topk_group * (self.moe.num_experts / n_group) {
                return Err(FieldError::new("num_experts_per_tok", "more than the selected groups hold"));
            }
        }
        if self.attention.mixers.len() != self.num_layers {
            return Err(FieldError::new("layer_types", "per-layer tables disagree with the layer count"));
        }
        if self.attention.mixers.contains(&Mixer::GatedDeltaNet) {
            let Some(g) = &self.attention.gated_delta else {
                return Err(FieldError::new("layer_types", "linear-attention layers without their shape"));
            };
            if g.key_heads == 0 || !g.value_heads.is_multiple_of(g.key_heads) || g.conv_kernel == 0 || g.key_dim == 0 || g.value_dim == 0 {
                return Err(FieldError::new(
                    "linear_num_value_heads",
                    format!("{} value heads must be a multiple of {} key heads (and every size positive)", g.value_heads, g.key_heads),
                ));
            }
        }
        if self.attention.output_gate && !matches!(self.attention.kind, AttentionKind::Gqa) {
            return Err(FieldError::new("architectures", "an attention output gate needs grouped-query attention"));
        }
        if let AttentionKind::Mla(MlaSpec { indexer: Some(ix), qk_rope_head_dim, .. }) = &self.attention.kind {
            if ix.full.len() != self.num_layers || ix.full.first() != Some(&true) {
                return Err(FieldError::new("indexer_types", "one entry per layer, the first \"full\" (a shared layer reuses an earlier choice)"));
            }
            if ix.heads == 0 || ix.top_k == 0 || ix.head_dim < *qk_rope_head_dim {
                return Err(FieldError::new(
                    "index_head_dim",
                    format!("{} must hold the {qk_rope_head_dim} rotary dims (and heads, top-k be positive)", ix.head_dim),
                ));
            }
        }
        if let AttentionKind::Compressed(c) = &self.attention.kind {
            self.check_compressed(c)?;
        }
        if let AttentionKind::Relative(r) = &self.attention.kind {
            if r.sliding_layers.len() != self.num_layers {
                return Err(FieldError::new("layer_types", "per-layer tables disagree with the layer count"));
            }
            for (shape, field) in [(r.full, "num_key_value_heads"), (r.sliding, "swa_num_key_value_heads")] {
                if shape.kv_heads == 0 || shape.head_dim == 0 || !shape.heads.is_multiple_of(shape.kv_heads) {
                    return Err(FieldError::new(field, format!("{} key-value heads must divide {} heads", shape.kv_heads, shape.heads)));
                }
            }
            if r.conv_kernel == 0 || r.rel_extent == 0 || r.window == 0 {
                return Err(FieldError::new("conv_kernel_size", "the convolution, the bias reach and the window must be positive"));
            }
        }
        if let Some(p) = self.padded_vocab {
            if p < self.vocab_size {
                return Err(FieldError::new("unpadded_vocab_size", format!("{} is more than vocab_size = {p}", self.vocab_size)));
            }
        }
        if self.attention.sinks && !matches!(self.attention.kind, AttentionKind::Gqa | AttentionKind::Compressed(_)) {
            return Err(FieldError::new("architectures", "attention sinks need grouped-query attention"));
        }
        if self.moe.top_k > self.moe.num_experts {
            return Err(FieldError::new("num_experts_per_tok", format!("{} is more than the {} experts", self.moe.top_k, self.moe.num_experts)));
        }
        let routed = self.moe_layer_count() as u64 * self.moe.num_experts as u64;
        if routed > MAX_ROUTED_EXPERTS {
            return Err(FieldError::new(
                "num_hidden_layers",
                format!(
                    "{routed} routed experts in all ({} MoE layers of {}) is over the limit of {MAX_ROUTED_EXPERTS} (docs/limits.md)",
                    self.moe_layer_count(),
                    self.moe.num_experts
                ),
            ));
        }
        if self.layers.len() != self.num_layers || self.attention.sliding_window.len() != self.num_layers {
            return Err(FieldError::new("num_hidden_layers", "per-layer tables disagree with the layer count"));
        }
        if let Some(bad) = self.eos_token_ids.iter().find(|id| **id as usize >= self.vocab_size) {
            return Err(FieldError::new("eos_token_id", format!("{bad} is outside the vocabulary of {}", self.vocab_size)));
        }
        Ok(())
    }
}

impl ModelSpec {
    /// What DeepSeek-V4's attention needs of its sizes.
    fn check_compressed(&self, c: &CompressedSpec) -> FieldResult<()> {
        if self.num_kv_heads != 1 {
            return Err(FieldError::new("num_key_value_heads", "must be 1 (one key-value head, shared by every query head)"));
        }
        if c.kinds.len() != self.num_layers {
            return Err(FieldError::new("layer_types", "per-layer tables disagree with the layer count"));
        }
        if !(self.num_heads * self.head_dim).is_multiple_of(c.o_groups) {
            return Err(FieldError::new(
                "o_groups",
                format!("{} does not divide the {} output values of the heads", c.o_groups, self.num_heads * self.head_dim),
            ));
        }
        if c.rope_dim == 0 || !c.rope_dim.is_multiple_of(2) || c.rope_dim > self.head_dim.min(c.indexer_head_dim) {
            return Err(FieldError::new(
                "partial_rotary_factor",
                format!("the rotary part ({}) must be even, positive and fit head_dim {} and index_head_dim {}", c.rope_dim, self.head_dim, c.indexer_head_dim),
            ));
        }
        let Some(hyper) = &self.hyper else { return Ok(()) };
        if hyper.streams == 0 || hyper.sinkhorn_iters == 0 {
            return Err(FieldError::new("hc_mult", "hyper-connection streams and Sinkhorn iterations must be positive"));
        }
        if self.hash_routed.len() != self.num_layers {
            return Err(FieldError::new("mlp_layer_types", "per-layer tables disagree with the layer count"));
        }
        Ok(())
    }
}

fn find_family(obj: &Obj, path: &Path) -> Result<&'static FamilyDef, LoadError> {
    let supported = || FAMILIES.iter().map(|f| f.architecture).collect::<Vec<_>>().join(", ");
    let field = |field: &str, problem: String| LoadError::Field { path: path.to_path_buf(), field: field.into(), problem };
    let architecture = match obj.get("architectures") {
        None => None,
        Some(Value::Array(list)) => match list.first() {
            Some(Value::String(s)) => Some(s.as_str()),
            _ => return Err(field("architectures", "expected a list holding one architecture name".into())),
        },
        Some(v) => return Err(field("architectures", format!("expected a list, got {v}"))),
    };
    let model_type = obj.str_opt("model_type").map_err(|e| field(&e.field, e.problem))?;
    let entry = match (architecture, model_type) {
        (Some(arch), _) => FAMILIES.iter().find(|f| f.architecture == arch).ok_or_else(|| LoadError::Unsupported {
            path: path.to_path_buf(),
            field: "architectures",
            found: arch.to_string(),
            supported: supported(),
        })?,
        (None, Some(mt)) => FAMILIES.iter().find(|f| f.model_types.contains(&mt)).ok_or_else(|| LoadError::Unsupported {
            path: path.to_path_buf(),
            field: "model_type",
            found: mt.to_string(),
            supported: supported(),
        })?,
        (None, None) => return Err(field("architectures", "missing (and no `model_type` either)".into())),
    };
    if let Some(mt) = model_type {
        if !entry.model_types.contains(&mt) {
            return Err(field(
                "model_type",
                format!("`{mt}` contradicts architecture {} (model_type `{}`)", entry.architecture, entry.model_types.join("` or `")),
            ));
        }
    }
    Ok(entry)
}

/// Reads a JSON file with a size limit, mapping every failure to an error naming the file.
pub fn read_json_file(path: &Path, limit: u64) -> Result<Value, LoadError> {
    let meta = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?;
    if meta.len() > limit {
        return Err(LoadError::malformed(path, format!("{} bytes is over the {} byte limit for this file", meta.len(), limit)));
    }
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| LoadError::malformed(path, format!("not valid JSON: {e}")))
}

/// What a family's parser decides; everything else in a spec is parsed once, in `build`.
pub(crate) struct FamilyParts {
    pub attention: AttentionSpec,
    pub layers: Vec<LayerMlp>,
    pub moe: MoeSpec,
    pub expert_names: ExpertNames,
    pub dense_names: DenseNames,
    pub rms_norm_unit_offset: bool,
}

/// What a family parser may need while deciding its parts.
pub(crate) struct Sizes<'a> {
    pub num_layers: usize,
    pub head_dim: usize,
    pub rope: &'a RopeSpec,
}

pub(crate) struct Defaults {
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    /// The field that gives the (rotary) head size explicitly, if the family has one; without
    /// it (or when absent) head_dim is hidden_size / num_attention_heads.
    pub head_dim_field: Option<&'static str>,
    /// `num_key_value_heads` when absent; `None` means "same as the attention heads".
    pub num_kv_heads: Option<usize>,
}

/// Parses the fields every family shares (with the family's defaults), then lets `parts` decide
/// the family-specific ones.
pub(crate) fn build(obj: &Obj, d: &Defaults, architecture: &'static str, parts: impl FnOnce(&Sizes) -> FieldResult<FamilyParts>) -> FieldResult<ModelSpec> {
    let hidden_size = obj.positive("hidden_size")?;
    let num_heads = obj.positive("num_attention_heads")?;
    let num_kv_heads = obj.usize_opt("num_key_value_heads")?.or(d.num_kv_heads).unwrap_or(num_heads);
    if num_kv_heads == 0 {
        return Err(FieldError::new("num_key_value_heads", "must be greater than zero"));
    }
    let explicit = match d.head_dim_field {
        Some(f) => obj.usize_opt(f)?.map(|hd| (f, hd)),
        None => None,
    };
    let head_dim = match explicit {
        Some((_, hd)) if hd > 0 => hd,
        Some((f, _)) => return Err(FieldError::new(f, "must be greater than zero")),
        None => {
            if hidden_size % num_heads != 0 {
                return Err(FieldError::new(
                    "num_attention_heads",
                    format!("{num_heads} does not divide hidden_size = {hidden_size} and no head_dim is given"),
                ));
            }
            hidden_size / num_heads
        }
    };
    let rms_norm_eps = obj.f64_or("rms_norm_eps", d.rms_norm_eps)?;
    if rms_norm_eps <= 0.0 {
        return Err(FieldError::new("rms_norm_eps", "must be positive"));
    }
    let declared_dtype = match (obj.str_opt("dtype")?, obj.str_opt("torch_dtype")?) {
        (Some(s), _) => Some(parse_dtype("dtype", s)?),
        (None, Some(s)) => Some(parse_dtype("torch_dtype", s)?),
        (None, None) => None,
    };
    let num_layers = obj.positive("num_hidden_layers")?;
    let rope = parse_rope(obj, d.rope_theta)?;
    let FamilyParts { attention, layers, moe, expert_names, dense_names, rms_norm_unit_offset } = parts(&Sizes { num_layers, head_dim, rope: &rope })?;
    Ok(ModelSpec {
        fp8_block: 128,
        hyper: None,
        hash_routed: vec![false; num_layers],
        padded_vocab: None,
        logit_divisor: 1.0,
        logit_softcap: None,
        architecture,
        vocab_size: obj.positive("vocab_size")?,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps: rms_norm_eps as f32,
        rms_norm_unit_offset,
        rope,
        max_position_embeddings: obj.positive("max_position_embeddings")?,
        tie_word_embeddings: obj.bool_or("tie_word_embeddings", d.tie_word_embeddings)?,
        attention,
        layers,
        moe,
        expert_names,
        dense_names,
        bos_token_id: obj.ids("bos_token_id")?.first().copied(),
        eos_token_ids: obj.ids("eos_token_id")?,
        declared_dtype,
    })
}

fn parse_dtype(field: &str, s: &str) -> FieldResult<FloatType> {
    match s {
        "float32" => Ok(FloatType::F32),
        "bfloat16" => Ok(FloatType::Bf16),
        "float16" => Ok(FloatType::F16),
        other => Err(FieldError::new(field, format!("unsupported dtype `{other}` (expected float32, bfloat16 or float16)"))),
    }
}

/// `partial_rotary_factor`, wherever the config keeps it (inside the rope parameters in
/// transformers 5, at the top level in older configs).
pub(crate) fn partial_rotary_factor(obj: &Obj) -> FieldResult<Option<f64>> {
    for key in ["rope_parameters", "rope_scaling"] {
        if let Some(p) = obj.obj_opt(key)? {
            if let Some(f) = p.f64_opt("partial_rotary_factor").map_err(|e| nest(key, e))? {
                return Ok(Some(f));
            }
        }
    }
    obj.f64_opt("partial_rotary_factor")
}

pub(crate) fn parse_rope(obj: &Obj, default_theta: f64) -> FieldResult<RopeSpec> {
    // transformers 5: everything under `rope_parameters`; older: `rope_theta` + `rope_scaling`.
    let (field, params) = match obj.obj_opt("rope_scaling")? {
        Some(p) => ("rope_scaling", Some(p)),
        None => ("rope_parameters", obj.obj_opt("rope_parameters")?),
    };
    let top_theta = obj.f64_opt("rope_theta")?;
    let theta = match &params {
        Some(p) => p.f64_opt("rope_theta").map_err(|e| nest(field, e))?.or(top_theta),
        None => top_theta,
    }
    .unwrap_or(default_theta);
    if theta <= 0.0 {
        return Err(FieldError::new("rope_theta", "must be positive"));
    }
    let Some(p) = params else {
        return Ok(RopeSpec { theta, scaling: RopeScaling::None });
    };
    let kind = match p.str_opt("rope_type").map_err(|e| nest(field, e))? {
        Some(k) => k,
        None => p.str_opt("type").map_err(|e| nest(field, e))?.unwrap_or("default"),
    };
    let opt = |key: &str| -> FieldResult<Option<f64>> { p.f64_opt(key).map_err(|e| nest(field, e)) };
    let num = |key: &str| -> FieldResult<f64> {
        opt(key)?.ok_or_else(|| FieldError::new(&format!("{field}.{key}"), format!("missing (needed by rope type `{kind}`)")))
    };
    let positive = |key: &str, v: f64| -> FieldResult<f64> {
        if v > 0.0 {
            Ok(v)
        } else {
            Err(FieldError::new(&format!("{field}.{key}"), format!("must be positive, got {v}")))
        }
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: positive("factor", num("factor")?)? },
        "llama3" => RopeScaling::Llama3 {
            factor: positive("factor", num("factor")?)?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: positive("original_max_position_embeddings", num("original_max_position_embeddings")?)? as usize,
        },
        "yarn" => {
            let original = positive("original_max_position_embeddings", num("original_max_position_embeddings")?)?;
            let factor = match opt("factor")? {
                Some(f) => positive("factor", f)?,
                None => obj.positive("max_position_embeddings")? as f64 / original,
            };
            let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
            let (mscale, mscale_all_dim) = (opt("mscale")?, opt("mscale_all_dim")?);
            let attention_factor = match opt("attention_factor")? {
                Some(a) => a,
                None => match (mscale, mscale_all_dim) {
                    (Some(m), Some(a)) if m != 0.0 && a != 0.0 => get_mscale(factor, m) / get_mscale(factor, a),
                    _ => get_mscale(factor, 1.0),
                },
            };
            let truncate = match p.get("truncate") {
                None => true,
                Some(serde_json::Value::Bool(b)) => *b,
                Some(v) => return Err(FieldError::new(&format!("{field}.truncate"), format!("expected true or false, got {v}"))),
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original as usize,
                beta_fast: opt("beta_fast")?.filter(|b| *b != 0.0).unwrap_or(32.0),
                beta_slow: opt("beta_slow")?.filter(|b| *b != 0.0).unwrap_or(1.0),
                attention_factor,
                mscale_all_dim: mscale_all_dim.filter(|m| *m != 0.0),
                truncate,
            }
        }
        other => {
            return Err(FieldError::new(&format!("{field}.rope_type"), format!("unsupported rope type `{other}` (supported: default, linear, llama3, yarn)")))
        }
    };
    Ok(RopeSpec { theta, scaling })
}

fn nest(parent: &str, e: FieldError) -> FieldError {
    FieldError::new(&format!("{parent}.{}", e.field), e.problem)
}
