//! Mixtral (`MixtralForCausalLM`): Llama's attention names, experts under `block_sparse_moe`
//! (w1/w3/w2); GQA with an optional sliding window; softmax top-k, always renormalised.

use super::*;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "MixtralForCausalLM", model_types: &["mixtral"], parse, spellings: &[] };

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults = Defaults { rms_norm_eps: 1e-5, rope_theta: 1_000_000.0, tie_word_embeddings: false, head_dim_field: Some("head_dim"), num_kv_heads: None };
    build(obj, &defaults, FAMILY.architecture, |sz| {
        let window = obj.usize_opt("sliding_window")?;
        if window == Some(0) {
            return Err(FieldError::new("sliding_window", "must be greater than zero"));
        }
        Ok(FamilyParts {
            attention: gqa(sz, QkNorm::None, None, false, false, vec![window; sz.num_layers]),
            layers: vec![LayerMlp::Moe; sz.num_layers],
            // Mixtral always renormalises its top-k weights.
            moe: moe(obj, "num_local_experts", "intermediate_size", true)?,
            expert_names: EXPERT_NAMES,
            dense_names: DenseNames::LLAMA,
            rms_norm_unit_offset: false,
        })
    })
}

const EXPERT_NAMES: ExpertNames = ExpertNames {
    router: "model.layers.{L}.block_sparse_moe.gate.weight",
    router_bias: None,
    router_logit_bias: None,
    shared: None,
    shared_gate: None,
    router_hash: None,
    layout: ExpertLayout::Separate,
    gate: "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight",
    up: "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight",
    down: "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight",
};

/// llama.cpp's `llama` with experts: q and k rows permuted for its rotary (undone here); the
/// window Mixtral's config may name is not in the file (llama.cpp attends to the whole context),
/// so none is set.
pub(super) const GGUF: GgufDialect = GgufDialect {
    gguf_architecture: "llama",
    family: FAMILY.architecture,
    accepts: |meta| meta.count_opt("expert_count").ok().flatten().is_some_and(|n| n > 0),
    config: |meta| {
        let mut c = llama_config(meta, FAMILY.architecture, "mixtral")?;
        let (experts, used, expert_ffn) = moe_counts(meta)?;
        let ffn = match expert_ffn {
            Some(n) => n,
            None => meta.count("feed_forward_length")?,
        };
        c.insert("num_local_experts".into(), experts.into());
        c.insert("num_experts_per_tok".into(), used.into());
        c.insert("intermediate_size".into(), ffn.into());
        c.insert("sliding_window".into(), serde_json::Value::Null);
        Ok(c)
    },
    tensor: |name, meta| llama_tensor(name, meta, &EXPERT_NAMES, true),
};
