//! How llama.cpp's GGUF export of a family reads back as that family's own checkpoint: the
//! `config.json` its metadata stands for, and which checkpoint tensor each GGUF tensor holds.
//! llama.cpp names tensors the same way for every architecture (`blk.N.attn_q.weight`), so the
//! mapping of the Llama-named families lives here once; each family file says what is its own
//! (its expert names, whether llama.cpp permuted q and k, its config keys) in a `GgufDialect`.
//!
//! Must never: guess a value the file does not hold where the family's config has no default
//! (an error names the missing key); accept a tensor it cannot place (the importer refuses the
//! file naming it, so no weight is silently dropped).

use serde_json::{json, Map, Value as Json};

use super::*;
use crate::gguf::Meta;

/// One family's reading of llama.cpp's files.
pub struct GgufDialect {
    /// llama.cpp's `general.architecture` for the family.
    pub gguf_architecture: &'static str,
    /// The checkpoint architecture it becomes (`architectures[0]`).
    pub family: &'static str,
    /// Whether a file of that architecture is this family's (llama.cpp's `llama` is both Llama
    /// and Mixtral).
    pub(crate) accepts: fn(&Meta) -> bool,
    /// The checkpoint's `config.json` (without `torch_dtype`, which the importer sets).
    pub(crate) config: fn(&Meta) -> Result<Map<String, Json>, String>,
    /// Where one GGUF tensor's values go.
    pub(crate) tensor: fn(&str, &Meta) -> Option<GgufTensor>,
}

impl GgufDialect {
    pub fn config(&self, meta: &Meta) -> Result<Map<String, Json>, String> {
        (self.config)(meta)
    }

    pub fn tensor(&self, name: &str, meta: &Meta) -> Option<GgufTensor> {
        (self.tensor)(name, meta)
    }
}

/// Where a GGUF tensor's values go in the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GgufTensor {
    /// The same values (shape reversed from ggml's order) under the checkpoint's name.
    Same(String),
    /// A q or k projection whose rows llama.cpp reordered for its rotary (`permute` in its
    /// converter: within each of `heads` heads, the two rotary halves interleaved): put back.
    Unpermute { name: String, heads: usize },
    /// A stack `[experts, rows, cols]`: expert `E` is the checkpoint tensor `template` with `{E}`
    /// filled in.
    Experts { template: String, count: usize },
    /// MLA's `kv_b_proj` as llama.cpp splits it for its absorbed attention: this tensor holds each
    /// head's key rows transposed (`[heads, kv_lora_rank, qk_nope]`), `value` the value rows
    /// (`[heads, v_head_dim, kv_lora_rank]`); put back as `[heads × (qk_nope + v_head_dim),
    /// kv_lora_rank]`, key rows first in each head.
    KvB { name: String, value: String },
    /// Read with the tensor named here (the value half of `KvB`).
    PartOf(String),
}

/// The families whose GGUF files shimmer imports.
pub const GGUF_DIALECTS: &[&GgufDialect] = &[&qwen3_moe::GGUF, &olmoe::GGUF, &mixtral::GGUF, &deepseek_v3::GGUF, &glm4_moe::GGUF];

/// The family of a GGUF file, by its architecture.
pub fn gguf_dialect(meta: &Meta) -> Result<&'static GgufDialect, String> {
    let arch = meta.architecture;
    let known = GGUF_DIALECTS.iter().filter(|d| d.gguf_architecture == arch).collect::<Vec<_>>();
    if known.is_empty() {
        let names: Vec<&str> = GGUF_DIALECTS.iter().map(|d| d.gguf_architecture).collect();
        return Err(format!("GGUF architecture `{arch}` is not imported (these are: {})", names.join(", ")));
    }
    known.into_iter().find(|d| (d.accepts)(meta)).copied().ok_or_else(|| match arch {
        "llama" => "this `llama` GGUF has no experts (`llama.expert_count`): dense Llama models are not what shimmer runs".to_string(),
        _ => format!("no family shimmer runs reads this `{arch}` GGUF"),
    })
}

/// The Llama-named families' tensors (GQA attention, optional QK-norm and biases, a softmax
/// router, experts stacked per layer, dense layers' MLPs), by the family's expert names.
pub(crate) fn llama_tensor(name: &str, meta: &Meta, experts: &ExpertNames, permute_qk: bool) -> Option<GgufTensor> {
    let names = DenseNames::LLAMA;
    let same = |s: String| Some(GgufTensor::Same(s));
    match name {
        "token_embd.weight" => return same(names.embed.into()),
        "output_norm.weight" => return same(names.final_norm.into()),
        "output.weight" => return same(names.lm_head.into()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let fill = |t: &str| t.replace("{L}", &layer.to_string());
    let count = meta.count("expert_count").ok()? as usize;
    let heads = meta.count("attention.head_count").ok()? as usize;
    let kv_heads = meta.count_opt("attention.head_count_kv").ok()?.map_or(heads, |h| h as usize);
    let projection = |stem: &str, suffix: &str, heads: usize| {
        let name = format!("{}.{suffix}", fill(stem));
        Some(if permute_qk { GgufTensor::Unpermute { name, heads } } else { GgufTensor::Same(name) })
    };
    match part {
        "attn_norm.weight" => same(fill(names.input_norm)),
        "ffn_norm.weight" => same(fill(names.post_attention_norm)),
        "attn_q.weight" => projection(names.q, "weight", heads),
        "attn_k.weight" => projection(names.k, "weight", kv_heads),
        "attn_q.bias" => projection(names.q, "bias", heads),
        "attn_k.bias" => projection(names.k, "bias", kv_heads),
        "attn_v.weight" => same(format!("{}.weight", fill(names.v))),
        "attn_v.bias" => same(format!("{}.bias", fill(names.v))),
        "attn_output.weight" => same(format!("{}.weight", fill(names.o))),
        "attn_output.bias" => same(format!("{}.bias", fill(names.o))),
        "attn_q_norm.weight" => same(fill(names.q_norm)),
        "attn_k_norm.weight" => same(fill(names.k_norm)),
        "ffn_gate_inp.weight" => same(fill(experts.router)),
        "ffn_gate_exps.weight" => Some(GgufTensor::Experts { template: fill(experts.gate), count }),
        "ffn_up_exps.weight" => Some(GgufTensor::Experts { template: fill(experts.up), count }),
        "ffn_down_exps.weight" => Some(GgufTensor::Experts { template: fill(experts.down), count }),
        "ffn_gate.weight" => same(fill(names.mlp_gate)),
        "ffn_up.weight" => same(fill(names.mlp_up)),
        "ffn_down.weight" => same(fill(names.mlp_down)),
        _ => None,
    }
}

/// What every Llama-named family's config holds, from llama.cpp's keys.
pub(crate) fn llama_config(meta: &Meta, architecture: &str, model_type: &str) -> Result<Map<String, Json>, String> {
    let mut c = common_config(meta, architecture, model_type)?;
    let heads = meta.count("attention.head_count")?;
    let hidden = meta.count("embedding_length")?;
    let kv_heads = meta.count_opt("attention.head_count_kv")?.unwrap_or(heads);
    let head_dim = meta.count_opt("attention.key_length")?.unwrap_or(hidden / heads);
    if let Some(v) = meta.count_opt("attention.value_length")? {
        if v != head_dim {
            return Err(format!("`{}.attention.value_length` {v} differs from the key length {head_dim}", meta.architecture));
        }
    }
    c.insert("num_key_value_heads".into(), json!(kv_heads));
    c.insert("head_dim".into(), json!(head_dim));
    Ok(c)
}

/// What every family's config holds, attention shapes aside (GQA and MLA say those their ways).
pub(crate) fn common_config(meta: &Meta, architecture: &str, model_type: &str) -> Result<Map<String, Json>, String> {
    let hidden = meta.count("embedding_length")?;
    let heads = meta.count("attention.head_count")?;
    if heads == 0 || hidden == 0 {
        return Err(format!("`{}.embedding_length` and `.attention.head_count` must be positive", meta.architecture));
    }
    let embed = meta.tensor("token_embd.weight").ok_or("the file has no `token_embd.weight`")?;
    let vocab = embed.dims.get(1).copied().ok_or("`token_embd.weight` is not a matrix")?;
    let mut c = Map::new();
    c.insert("architectures".into(), json!([architecture]));
    c.insert("model_type".into(), json!(model_type));
    c.insert("hidden_size".into(), json!(hidden));
    c.insert("num_hidden_layers".into(), json!(meta.count("block_count")?));
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("hidden_act".into(), json!("silu"));
    c.insert("tie_word_embeddings".into(), json!(meta.tensor("output.weight").is_none()));
    if let Some(n) = meta.count_opt("context_length")? {
        c.insert("max_position_embeddings".into(), json!(n));
    }
    if let Some(eps) = meta.float_opt("attention.layer_norm_rms_epsilon")? {
        c.insert("rms_norm_eps".into(), json!(eps));
    }
    if let Some(theta) = meta.float_opt("rope.freq_base")? {
        c.insert("rope_theta".into(), json!(theta));
    }
    if let Some(rope) = rope_scaling(meta)? {
        c.insert("rope_scaling".into(), rope);
    }
    for (key, field) in
        [("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id"), ("tokenizer.ggml.padding_token_id", "pad_token_id")]
    {
        if let Some(v) = meta.entries.get(key) {
            let id = v.as_u64().ok_or_else(|| format!("`{key}` is {v:?}, not a token id"))?;
            c.insert(field.into(), json!(id));
        }
    }
    Ok(c)
}

/// `rope_scaling` from llama.cpp's `rope.scaling.*` keys (none, linear and YaRN are what its
/// converter writes for these families).
fn rope_scaling(meta: &Meta) -> Result<Option<Json>, String> {
    let kind = meta.string_opt("rope.scaling.type")?;
    let factor = meta.float_opt("rope.scaling.factor")?;
    match kind {
        None | Some("none") => Ok(None),
        Some("linear") => {
            let factor = factor.ok_or_else(|| format!("`{}.rope.scaling.factor` is missing", meta.architecture))?;
            Ok(Some(json!({"rope_type": "linear", "factor": factor})))
        }
        Some("yarn") => {
            let factor = factor.ok_or_else(|| format!("`{}.rope.scaling.factor` is missing", meta.architecture))?;
            let original = meta.count("rope.scaling.original_context_length")?;
            let mut yarn = json!({"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original});
            for (key, field) in [("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")] {
                if let Some(v) = meta.float_opt(key)? {
                    yarn[field] = json!(v);
                }
            }
            // llama.cpp keeps DeepSeek's `mscale_all_dim` as a tenth of it (and one mscale for both).
            if let Some(log_mul) = meta.float_opt("rope.scaling.yarn_log_multiplier")? {
                yarn["mscale"] = json!(log_mul / 0.1);
                yarn["mscale_all_dim"] = json!(log_mul / 0.1);
            }
            Ok(Some(yarn))
        }
        Some(other) => Err(format!("`{}.rope.scaling.type` `{other}` is not imported (none, linear and yarn are)", meta.architecture)),
    }
}

/// The MoE keys every Llama-named family's llama.cpp export writes.
pub(crate) fn moe_counts(meta: &Meta) -> Result<(u64, u64, Option<u64>), String> {
    Ok((meta.count("expert_count")?, meta.count("expert_used_count")?, meta.count_opt("expert_feed_forward_length")?))
}

/// The sigmoid, group-limited router with a selection bias and shared experts (DeepSeek-V3,
/// GLM-4.5), as llama.cpp's keys give it.
pub(crate) fn grouped_config(meta: &Meta, c: &mut Map<String, Json>) -> Result<(), String> {
    match meta.count_opt("expert_gating_func")? {
        Some(2) => {}
        other => {
            return Err(format!(
                "`{}.expert_gating_func` is {other:?}: only the sigmoid router (2) of these families is run (llama.cpp reads a missing one as softmax, DeepSeek-V2's)",
                meta.architecture
            ))
        }
    }
    let (experts, used, expert_ffn) = moe_counts(meta)?;
    let expert_ffn = expert_ffn.ok_or_else(|| format!("`{}.expert_feed_forward_length` is missing", meta.architecture))?;
    c.insert("n_routed_experts".into(), json!(experts));
    c.insert("num_experts_per_tok".into(), json!(used));
    c.insert("moe_intermediate_size".into(), json!(expert_ffn));
    c.insert("intermediate_size".into(), json!(meta.count_opt("feed_forward_length")?.unwrap_or(expert_ffn)));
    c.insert("n_shared_experts".into(), json!(meta.count_opt("expert_shared_count")?.unwrap_or(0)));
    c.insert("first_k_dense_replace".into(), json!(meta.count_opt("leading_dense_block_count")?.unwrap_or(0)));
    c.insert("routed_scaling_factor".into(), json!(meta.float_opt("expert_weights_scale")?.unwrap_or(1.0)));
    let norm = matches!(meta.arch("expert_weights_norm"), Some(crate::gguf::Value::Bool(true)));
    c.insert("norm_topk_prob".into(), json!(norm));
    c.insert("n_group".into(), json!(meta.count_opt("expert_group_count")?.unwrap_or(1)));
    c.insert("topk_group".into(), json!(meta.count_opt("expert_group_used_count")?.unwrap_or(1)));
    c.insert("scoring_func".into(), json!("sigmoid"));
    Ok(())
}

/// The grouped router's own tensors: its selection bias and the shared expert.
pub(crate) fn grouped_tensor(name: &str) -> Option<GgufTensor> {
    let names = GROUPED_SIGMOID_NAMES;
    let (layer, part) = name.strip_prefix("blk.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let fill = |t: &str| t.replace("{L}", &layer.to_string());
    let [gate, up, down] = names.shared?;
    Some(GgufTensor::Same(match part {
        "exp_probs_b.bias" => fill(names.router_bias?),
        "ffn_gate_shexp.weight" => fill(gate),
        "ffn_up_shexp.weight" => fill(up),
        "ffn_down_shexp.weight" => fill(down),
        _ => return None,
    }))
}
