//! OLMoE (`OlmoeForCausalLM`): Llama's tensor names; GQA with one RMSNorm over the whole q and k
//! projections and `clip_qkv`; softmax top-k routing, renormalised only with `norm_topk_prob`;
//! every layer MoE.

use super::*;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "OlmoeForCausalLM", model_types: &["olmoe"], parse, spellings: &[] };

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults = Defaults { rms_norm_eps: 1e-5, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: None, num_kv_heads: None };
    build(obj, &defaults, FAMILY.architecture, |sz| {
        // transformers sizes k_norm by hidden/heads, so an explicit, different head_dim cannot load there.
        if let Some(hd) = obj.usize_opt("head_dim")? {
            if hd != sz.head_dim {
                return Err(FieldError::new(
                    "head_dim",
                    format!("{hd} differs from hidden_size / num_attention_heads = {}, which OLMoE requires", sz.head_dim),
                ));
            }
        }
        let experts_key = spelling(obj, "num_experts", "num_local_experts")?;
        let clip_qkv = match obj.f64_opt("clip_qkv")? {
            Some(c) if c <= 0.0 => return Err(FieldError::new("clip_qkv", "must be positive")),
            other => other.map(|c| c as f32),
        };
        Ok(FamilyParts {
            attention: {
                let bias = obj.bool_or("attention_bias", false)?;
                gqa(sz, QkNorm::FullProjection, clip_qkv, bias, bias, vec![None; sz.num_layers])
            },
            layers: vec![LayerMlp::Moe; sz.num_layers],
            moe: moe(obj, experts_key, "intermediate_size", obj.bool_or("norm_topk_prob", false)?)?,
            expert_names: GATE_UP_DOWN,
            dense_names: DenseNames::LLAMA,
            rms_norm_unit_offset: false,
        })
    })
}

/// llama.cpp's `olmoe`: top-k weights never renormalised (its graph does not), `clip_qkv` as
/// `attention.clamp_kqv`.
pub(super) const GGUF: GgufDialect = GgufDialect {
    gguf_architecture: "olmoe",
    family: FAMILY.architecture,
    accepts: |_| true,
    config: |meta| {
        let mut c = llama_config(meta, FAMILY.architecture, "olmoe")?;
        let (experts, used, expert_ffn) = moe_counts(meta)?;
        let expert_ffn = match expert_ffn {
            Some(n) => n,
            None => meta.count("feed_forward_length")?,
        };
        c.insert("num_experts".into(), experts.into());
        c.insert("num_experts_per_tok".into(), used.into());
        c.insert("intermediate_size".into(), expert_ffn.into());
        c.insert("norm_topk_prob".into(), false.into());
        c.insert("attention_bias".into(), meta.tensor("blk.0.attn_q.bias").is_some().into());
        if let Some(clip) = meta.float_opt("attention.clamp_kqv")? {
            c.insert("clip_qkv".into(), clip.into());
        }
        // OLMoE sizes its QK-norm by the whole projection: an explicit head_dim must agree.
        c.remove("head_dim");
        Ok(c)
    },
    tensor: |name, meta| llama_tensor(name, meta, &GATE_UP_DOWN, false),
};
