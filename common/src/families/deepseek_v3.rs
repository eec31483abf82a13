//! DeepSeek-V3 (`DeepseekV3ForCausalLM`; also Kimi K2 and other derivatives): multi-head latent
//! attention (with or without `q_lora_rank`, interleaved rotary by default, YaRN's softmax-scale
//! correction), the first `first_k_dense_replace` layers dense, then sigmoid group-limited routing
//! with `e_score_correction_bias` and shared experts.

use super::*;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "DeepseekV3ForCausalLM", model_types: &["deepseek_v3", "kimi_k2"], parse, spellings: &[] };

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults =
        Defaults { rms_norm_eps: 1e-6, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("qk_rope_head_dim"), num_kv_heads: None };
    build(obj, &defaults, FAMILY.architecture, |sz| {
        let mla = MlaSpec {
            q_lora_rank: obj.usize_opt("q_lora_rank")?,
            kv_lora_rank: obj.positive("kv_lora_rank")?,
            qk_nope_head_dim: obj.positive("qk_nope_head_dim")?,
            qk_rope_head_dim: obj.positive("qk_rope_head_dim")?,
            v_head_dim: obj.positive("v_head_dim")?,
            indexer: None,
        };
        if mla.q_lora_rank == Some(0) {
            return Err(FieldError::new("q_lora_rank", "must be greater than zero, or null for a plain q_proj"));
        }
        let (layers, moe) = grouped_moe(obj, sz.num_layers, (2.5, 8, 4, 3))?;
        Ok(FamilyParts {
            attention: mla_attention(obj, sz, mla, obj.bool_or("rope_interleave", true)?)?,
            layers,
            moe,
            expert_names: GROUPED_SIGMOID_NAMES,
            dense_names: DenseNames::LLAMA,
            rms_norm_unit_offset: false,
        })
    })
}

/// llama.cpp's `deepseek2` (DeepSeek-V3 and its derivatives; V2's softmax router is refused): MLA
/// with `kv_b_proj` split per head for absorption (put back here), rotary on adjacent pairs (its
/// graph's, so `rope_interleave`), the key and value sizes under `*_length_mla` (older files:
/// the plain keys, with `kv_b_proj` whole).
pub(super) const GGUF: GgufDialect = GgufDialect {
    gguf_architecture: "deepseek2",
    family: FAMILY.architecture,
    accepts: |_| true,
    config: |meta| {
        let mut c = common_config(meta, FAMILY.architecture, "deepseek_v3")?;
        let heads = meta.count("attention.head_count")?;
        let rope = meta.count("rope.dimension_count")?;
        let key = match meta.count_opt("attention.key_length_mla")? {
            Some(k) => k,
            None => meta.count("attention.key_length")?,
        };
        let value = match meta.count_opt("attention.value_length_mla")? {
            Some(v) => v,
            None => meta.count("attention.value_length")?,
        };
        if key <= rope {
            return Err(format!("`deepseek2` key length {key} leaves nothing beside {rope} rotary dimensions"));
        }
        c.insert("num_key_value_heads".into(), heads.into());
        c.insert("q_lora_rank".into(), meta.count_opt("attention.q_lora_rank")?.into());
        c.insert("kv_lora_rank".into(), meta.count("attention.kv_lora_rank")?.into());
        c.insert("qk_rope_head_dim".into(), rope.into());
        c.insert("qk_nope_head_dim".into(), (key - rope).into());
        c.insert("v_head_dim".into(), value.into());
        c.insert("rope_interleave".into(), true.into());
        grouped_config(meta, &mut c)?;
        Ok(c)
    },
    tensor: |name, meta| {
        let same = |s: String| Some(GgufTensor::Same(s));
        if let Some(t) = grouped_tensor(name) {
            return Some(t);
        }
        match name {
            "token_embd.weight" => return same("model.embed_tokens.weight".into()),
            "output_norm.weight" => return same("model.norm.weight".into()),
            "output.weight" => return same("lm_head.weight".into()),
            _ => {}
        }
        let (layer, part) = name.strip_prefix("blk.")?.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let at = |rest: &str| format!("model.layers.{layer}.{rest}");
        let names = GROUPED_SIGMOID_NAMES;
        let fill = |t: &str| t.replace("{L}", &layer.to_string());
        match part {
            "attn_norm.weight" => same(at("input_layernorm.weight")),
            "ffn_norm.weight" => same(at("post_attention_layernorm.weight")),
            "attn_q.weight" => same(at("self_attn.q_proj.weight")),
            "attn_q_a.weight" => same(at("self_attn.q_a_proj.weight")),
            "attn_q_a_norm.weight" => same(at("self_attn.q_a_layernorm.weight")),
            "attn_q_b.weight" => same(at("self_attn.q_b_proj.weight")),
            "attn_kv_a_mqa.weight" => same(at("self_attn.kv_a_proj_with_mqa.weight")),
            "attn_kv_a_norm.weight" => same(at("self_attn.kv_a_layernorm.weight")),
            "attn_kv_b.weight" => same(at("self_attn.kv_b_proj.weight")),
            "attn_k_b.weight" => Some(GgufTensor::KvB { name: at("self_attn.kv_b_proj.weight"), value: format!("blk.{layer}.attn_v_b.weight") }),
            "attn_v_b.weight" => Some(GgufTensor::PartOf(format!("blk.{layer}.attn_k_b.weight"))),
            "attn_output.weight" => same(at("self_attn.o_proj.weight")),
            "ffn_gate_inp.weight" => same(fill(names.router)),
            "ffn_gate_exps.weight" | "ffn_up_exps.weight" | "ffn_down_exps.weight" => {
                let template = match part {
                    "ffn_gate_exps.weight" => names.gate,
                    "ffn_up_exps.weight" => names.up,
                    _ => names.down,
                };
                Some(GgufTensor::Experts { template: fill(template), count: meta.count("expert_count").ok()? as usize })
            }
            "ffn_gate.weight" => same(at("mlp.gate_proj.weight")),
            "ffn_up.weight" => same(at("mlp.up_proj.weight")),
            "ffn_down.weight" => same(at("mlp.down_proj.weight")),
            _ => None,
        }
    },
};
