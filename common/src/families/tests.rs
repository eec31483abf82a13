//! Each family's config dialect, parsed from the configs real checkpoints ship: defaults are the
//! transformers configuration classes', both spellings agree, bad fields are refused by name.

use crate::error::LoadError;
use crate::spec::*;
use serde_json::json;
use serde_json::Value;
use std::path::Path;

fn parse(v: Value) -> Result<ModelSpec, LoadError> {
    ModelSpec::from_json(&v, Path::new("config.json"))
}

fn mixtral() -> Value {
    json!({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 100,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "num_local_experts": 8,
        "num_experts_per_tok": 2
    })
}

fn message(r: Result<ModelSpec, LoadError>) -> String {
    r.expect_err("should fail").to_string()
}

#[test]
fn family_defaults_are_the_transformers_defaults() {
    let m = parse(mixtral()).unwrap();
    assert_eq!(m.rope, RopeSpec { theta: 1e6, scaling: RopeScaling::None });
    assert_eq!(m.rms_norm_eps, 1e-5);
    assert!(!m.tie_word_embeddings);
    assert_eq!(m.moe.scoring, RouterScoring::SoftmaxTopK { norm_topk_prob: true });
    assert_eq!(m.attention.sliding_window, vec![None, None]);

    let mut q = mixtral();
    q["architectures"] = json!(["Qwen3MoeForCausalLM"]);
    q["model_type"] = json!("qwen3_moe");
    q["num_experts"] = json!(8);
    q["moe_intermediate_size"] = json!(32);
    q.as_object_mut().unwrap().remove("num_key_value_heads");
    q["sliding_window"] = json!(7); // ignored: use_sliding_window defaults to false
    let q = parse(q).unwrap();
    assert_eq!(q.num_kv_heads, 4);
    assert_eq!(q.rope.theta, 10_000.0);
    assert_eq!(q.rms_norm_eps, 1e-6);
    assert_eq!(q.moe.scoring, RouterScoring::SoftmaxTopK { norm_topk_prob: false });
    assert_eq!(q.attention.qk_norm, QkNorm::PerHead);
    assert_eq!(q.attention.sliding_window, vec![None, None]);
}

#[test]
fn both_config_spellings_give_the_same_spec() {
    let mut old = mixtral();
    old["rope_theta"] = json!(5000.0);
    old["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
    old["torch_dtype"] = json!("bfloat16");
    let mut new = mixtral();
    new["rope_parameters"] = json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0});
    new["dtype"] = json!("bfloat16");
    let (a, b) = (parse(old).unwrap(), parse(new).unwrap());
    assert_eq!(a, b);
    assert_eq!(a.rope.scaling, RopeScaling::Linear { factor: 2.0 });
    assert_eq!(a.declared_dtype, Some(FloatType::Bf16));
}

#[test]
fn qwen3_layer_kinds_follow_sparse_step_and_mlp_only_layers() {
    let mut q = mixtral();
    q["architectures"] = json!(["Qwen3MoeForCausalLM"]);
    q["model_type"] = json!("qwen3_moe");
    q["num_experts"] = json!(8);
    q["moe_intermediate_size"] = json!(32);
    q["num_hidden_layers"] = json!(6);
    q["decoder_sparse_step"] = json!(2);
    q["mlp_only_layers"] = json!([3]);
    q["use_sliding_window"] = json!(true);
    q["sliding_window"] = json!(16);
    let s = parse(q).unwrap();
    let dense = LayerMlp::Dense { intermediate_size: 96 };
    assert_eq!(s.layers, vec![dense, LayerMlp::Moe, dense, dense, dense, LayerMlp::Moe]);
    assert_eq!(s.attention.sliding_window, vec![Some(16); 6]);
}

#[test]
fn bad_configs_name_the_field() {
    let mut v = mixtral();
    v.as_object_mut().unwrap().remove("hidden_size");
    assert!(message(parse(v)).contains("field `hidden_size`: missing"));

    let mut v = mixtral();
    v["num_key_value_heads"] = json!(3);
    assert!(message(parse(v)).contains("field `num_key_value_heads`"));

    let mut v = mixtral();
    v["num_experts_per_tok"] = json!(9);
    assert!(message(parse(v)).contains("field `num_experts_per_tok`"));

    let mut v = mixtral();
    v["hidden_size"] = json!("big");
    assert!(message(parse(v)).contains("field `hidden_size`: expected a non-negative integer"));

    let mut v = mixtral();
    v["rope_scaling"] = json!({"rope_type": "longrope", "factor": 4.0});
    assert!(message(parse(v)).contains("rope_scaling.rope_type"));

    let mut v = mixtral();
    v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
    assert!(message(parse(v)).contains("rope_scaling.original_max_position_embeddings"));

    let mut v = mixtral();
    v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 4.0});
    assert!(message(parse(v)).contains("rope_scaling.low_freq_factor"));

    let mut v = mixtral();
    v["architectures"] = json!(["LlamaForCausalLM"]);
    let m = message(parse(v));
    assert!(m.contains("unsupported architecture `LlamaForCausalLM`") && m.contains("MixtralForCausalLM"), "{m}");

    let mut v = mixtral();
    v["model_type"] = json!("olmoe");
    assert!(message(parse(v)).contains("field `model_type`"));

    let mut v = mixtral();
    v["eos_token_id"] = json!([5, 100]);
    assert!(message(parse(v)).contains("field `eos_token_id`: 100 is outside the vocabulary"));

    assert!(message(parse(json!([1, 2]))).contains("not a JSON object"));
}

#[test]
fn kimi_k2_is_a_deepseek_v3_by_another_model_type() {
    let kimi = json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_routed_experts": 384, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.827,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "torch_dtype": "bfloat16", "eos_token_id": 163585
    });
    let s = parse(kimi).unwrap();
    assert_eq!(s.architecture, "DeepseekV3ForCausalLM");
    assert_eq!(s.layers[0], LayerMlp::Dense { intermediate_size: 18432 });
    assert_eq!(s.moe.shared_intermediate_size, Some(2048));
    let AttentionKind::Mla(m) = &s.attention.kind else { panic!("MLA") };
    assert_eq!((m.kv_lora_rank, m.qk_rope_head_dim), (512, 64));
    // The softmax scale grows by mscale(32, 1)² = (0.1·ln 32 + 1)².
    let ms = 0.1 * 32f64.ln() + 1.0;
    assert!((s.attention.scale as f64 - ms * ms / 192f64.sqrt()).abs() < 1e-6);
}

#[test]
fn gpt_oss_defaults_are_gpt_oss_configs() {
    // The fields a config may leave out: layer kinds, window, rotary, head size, kv heads,
    // biases and the SwiGLU clamp take GptOssConfig's values.
    let v = json!({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 100,
        "hidden_size": 96, "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 16,
        "max_position_embeddings": 131072, "num_local_experts": 8, "num_experts_per_tok": 2
    });
    let s = parse(v.clone()).unwrap();
    assert_eq!(s.head_dim, 64);
    assert_eq!(s.num_kv_heads, 8);
    assert_eq!(s.attention.sliding_window, vec![Some(128), None, Some(128), None]);
    assert!(s.attention.sinks && s.attention.bias && s.attention.o_bias);
    assert_eq!(s.moe.scoring, RouterScoring::TopKSoftmax);
    assert_eq!(s.moe.activation, ExpertActivation::ClampedSwiglu { alpha: 1.702, limit: 7.0 });
    assert!(s.moe.expert_bias);
    assert_eq!(s.expert_names.layout, ExpertLayout::FusedInterleaved);
    assert_eq!(s.rope.theta, 150_000.0);
    let RopeScaling::Yarn { factor, original_max_position_embeddings, truncate, .. } = s.rope.scaling else { panic!("{:?}", s.rope) };
    assert_eq!((factor, original_max_position_embeddings, truncate), (32.0, 4096, false));
    // The hub's spelling (rope_scaling + rope_theta, num_experts) says the same.
    let mut hub = v.clone();
    hub["rope_theta"] = json!(150000);
    hub["rope_scaling"] =
        json!({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 4096});
    hub["num_experts"] = hub["num_local_experts"].take();
    hub.as_object_mut().unwrap().remove("num_local_experts");
    assert_eq!(parse(hub).unwrap(), s);
    // Bad layer kinds and clamps are refused by name.
    let mut bad = v.clone();
    bad["layer_types"] = json!(["sliding_attention", "full_attention", "linear_attention", "full_attention"]);
    assert!(message(parse(bad)).contains("`layer_types`: entry 2"));
    let mut bad = v.clone();
    bad["layer_types"] = json!(["full_attention"]);
    assert!(message(parse(bad)).contains("1 entries for 4 layers"));
    let mut bad = v;
    bad["swiglu_limit"] = json!(-1.0);
    assert!(message(parse(bad)).contains("`swiglu_limit`"));
}

#[test]
fn deepseek_v4_reads_transformers_and_release_spellings_alike() {
    // transformers 5.24's spelling: layer and MLP kinds by name, nested rotary per kind.
    let v = json!({
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 100,
        "hidden_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 5, "num_attention_heads": 4,
        "head_dim": 32, "max_position_embeddings": 4096, "q_lora_rank": 24, "o_groups": 2, "o_lora_rank": 16,
        "layer_types": ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "mlp_layer_types": ["hash_moe", "hash_moe", "hash_moe", "moe", "moe"],
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1, "partial_rotary_factor": 0.25, "attention_factor": 1.0}
        },
        "partial_rotary_factor": 0.25
    });
    let s = parse(v.clone()).unwrap();
    let AttentionKind::Compressed(c) = &s.attention.kind else { panic!("{:?}", s.attention.kind) };
    assert_eq!(c.kinds, [CompressKind::Sliding, CompressKind::Heavy, CompressKind::Sparse, CompressKind::Heavy, CompressKind::Sparse]);
    assert_eq!((c.rope_dim, c.csa_rate, c.hca_rate, c.window, c.indexer_top_k), (8, 4, 128, 128, 512));
    assert_eq!(s.hash_routed, [true, true, true, false, false]);
    assert_eq!(s.num_kv_heads, 1);
    assert_eq!(s.rope, RopeSpec { theta: 10_000.0, scaling: RopeScaling::None });
    let RopeScaling::Yarn { factor, attention_factor, .. } = c.compress_rope.scaling else { panic!("{:?}", c.compress_rope) };
    assert_eq!((c.compress_rope.theta, factor, attention_factor), (160_000.0, 16.0, 1.0));
    assert_eq!(s.moe.scoring, RouterScoring::SqrtSoftplus { routed_scaling_factor: 1.5 });
    assert_eq!(s.moe.activation, ExpertActivation::ClampedSilu { limit: 10.0 });
    let hyper = s.hyper.as_ref().unwrap();
    assert_eq!((hyper.streams, hyper.sinkhorn_iters), (4, 20));
    // The release's older spelling: per-layer compress ratios, a hash-layer count, the rotary
    // head size, a flat YaRN at compress_rope_theta (whose attention factor V4 keeps at 1).
    let mut release = v.clone();
    let o = release.as_object_mut().unwrap();
    for key in ["layer_types", "compress_rates", "mlp_layer_types", "rope_parameters", "partial_rotary_factor"] {
        o.remove(key);
    }
    o.insert("compress_ratios".into(), json!([0, 128, 4, 128, 4]));
    o.insert("num_hash_layers".into(), json!(3));
    o.insert("qk_rope_head_dim".into(), json!(8));
    o.insert("rope_theta".into(), json!(10000.0));
    o.insert("compress_rope_theta".into(), json!(160000.0));
    o.insert("rope_scaling".into(), json!({"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}));
    assert_eq!(parse(release.clone()).unwrap(), s);
    // The release's quantization reads (FP8 with UE8M0 scales, FP4 experts); other forms are
    // refused by name, as are another router, a bad ratio, two kv heads.
    let mut quantized = release.clone();
    quantized["quantization_config"] = json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0", "expert_dtype": "fp4", "weight_block_size": [128, 128]});
    assert_eq!(parse(quantized.clone()).unwrap().fp8_block, 128);
    for (key, value) in [("expert_dtype", json!("nvfp4")), ("scale_fmt", json!("e5m2")), ("activation_scheme", json!("static")), ("quant_method", json!("awq"))]
    {
        let mut bad = quantized.clone();
        bad["quantization_config"][key] = value;
        assert!(message(parse(bad)).contains(&format!("`quantization_config.{key}`")), "{key}");
    }
    let mut bad = release.clone();
    bad["scoring_func"] = json!("softmax");
    assert!(message(parse(bad)).contains("`scoring_func`"));
    let mut bad = release.clone();
    bad["compress_ratios"] = json!([0, 128, 3, 128, 4]);
    assert!(message(parse(bad)).contains("`compress_ratios`: entry 2"));
    let mut bad = release.clone();
    bad["num_key_value_heads"] = json!(2);
    assert!(message(parse(bad)).contains("`num_key_value_heads`"));
    let mut bad = release;
    bad["o_groups"] = json!(3);
    assert!(message(parse(bad)).contains("`o_groups`"));
}

#[test]
fn inkling_reads_its_layer_shapes_padding_and_older_spellings() {
    let v = json!({
        "architectures": ["InklingForCausalLM"], "model_type": "inkling_text", "vocab_size": 120, "unpadded_vocab_size": 100,
        "hidden_size": 64, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 48, "moe_intermediate_size": 16, "max_position_embeddings": 4096
    });
    let s = parse(v.clone()).unwrap();
    let AttentionKind::Relative(r) = &s.attention.kind else { panic!("{:?}", s.attention.kind) };
    // InklingTextConfig's defaults: every sixth layer full, the rest sliding; its head shapes.
    assert_eq!(r.sliding_layers, [true, true, true, true, true, false, true]);
    assert_eq!((r.sliding.heads, r.sliding.kv_heads, r.sliding.head_dim, r.window), (64, 16, 128, 512));
    assert_eq!((r.full.heads, r.full.kv_heads, r.full.head_dim), (4, 2, 16));
    assert_eq!((r.d_rel, r.rel_extent, r.conv_kernel, r.log_scaling), (16, 1024, 4, None));
    assert_eq!(s.attention.sliding_window[5], None);
    assert_eq!((s.vocab_size, s.padded_vocab, s.logit_divisor), (100, Some(120), 24.0));
    assert_eq!(s.moe.scoring, RouterScoring::LogSigmoidShared { route_scale: 8.0, shared: 2 });
    assert!(s.layers.iter().all(|l| *l == LayerMlp::Moe));
    // The older spelling: local_layer_ids, dense_mlp_idx, dense_intermediate_size (then
    // intermediate_size is the experts').
    let mut old = v.clone();
    old["local_layer_ids"] = json!([1, 2]);
    old["dense_mlp_idx"] = json!(1);
    old["dense_intermediate_size"] = json!(40);
    let o = parse(old).unwrap();
    let AttentionKind::Relative(r) = &o.attention.kind else { panic!() };
    assert_eq!(r.sliding_layers, [false, true, true, false, false, false, false]);
    assert_eq!(o.layers[0], LayerMlp::Dense { intermediate_size: 40 });
    assert_eq!(o.moe.expert_intermediate_size, 48);
    // Refused by name: a padded size above the vocabulary, no shared experts, a bad divisor.
    for (field, value, want) in [
        ("unpadded_vocab_size", json!(130), "`unpadded_vocab_size`"),
        ("n_shared_experts", json!(0), "`n_shared_experts`"),
        ("logits_mup_width_multiplier", json!(0.0), "`logits_mup_width_multiplier`"),
        ("swa_num_key_value_heads", json!(3), "`swa_num_key_value_heads`"),
    ] {
        let mut bad = v.clone();
        bad[field] = value;
        assert!(message(parse(bad)).contains(want), "{field}");
    }
}

#[test]
fn inkling2_defaults_are_inkling2_configs() {
    let v = json!({
        "architectures": ["Inkling2ForCausalLM"], "model_type": "inkling2_text", "vocab_size": 300000,
        "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 4096, "moe_intermediate_size": 16
    });
    let s = parse(v.clone()).unwrap();
    let AttentionKind::Relative(r) = &s.attention.kind else { panic!("{:?}", s.attention.kind) };
    let v2 = r.v2.as_ref().unwrap();
    // Inkling2TextConfig's defaults: every sixth layer full; clips, blocks of 6, softcaps.
    assert_eq!(r.sliding_layers, [true, true, true, true, true, false]);
    assert_eq!((r.sliding.heads, r.sliding.kv_heads, r.sliding.head_dim, r.window), (48, 8, 128, 1024));
    assert_eq!(r.log_scaling, Some((128_000.0, 0.1)));
    assert_eq!((v2.qk_clip, v2.rel_clip, v2.layers_per_block), (22.627417, 8.0, 6));
    assert_eq!(s.moe.activation, ExpertActivation::SoftcappedSwiglu { gate_cap: 4.0, up_cap: 25.0 });
    assert_eq!(s.moe.scoring, RouterScoring::SigmoidGrouped { n_group: 1, topk_group: 1, norm_topk_prob: true, routed_scaling_factor: 8.0 });
    assert_eq!((s.vocab_size, s.padded_vocab, s.logit_softcap), (200_058, Some(300_000), Some(30.0)));
    assert_eq!(s.expert_names.layout, ExpertLayout::StackedInterleaved);
    // The aliases transformers maps: intermediate_size for the experts, routed_scaling_factor.
    let mut alias = v.clone();
    alias["intermediate_size"] = alias["moe_intermediate_size"].take();
    alias.as_object_mut().unwrap().remove("moe_intermediate_size");
    alias["routed_scaling_factor"] = json!(8.0);
    assert_eq!(parse(alias).unwrap(), s);
    for (field, value, want) in [
        ("scoring_func", json!("softmax"), "`scoring_func`"),
        ("n_routed_experts", json!(1), "`n_routed_experts`"),
        ("qk_l2_clip_threshold", json!(0.0), "`qk_l2_clip_threshold`"),
        ("unpadded_vocab_size", json!(400000), "`unpadded_vocab_size`"),
    ] {
        let mut bad = v.clone();
        bad[field] = value;
        assert!(message(parse(bad)).contains(want), "{field}");
    }
}

#[test]
fn inkling_image_text_releases_serve_their_text_part_under_the_release_names() {
    let text = json!({
        "model_type": "inkling_text", "vocab_size": 120, "unpadded_vocab_size": 100, "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 48, "moe_intermediate_size": 16, "max_position_embeddings": 4096,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]
    });
    let outer = |arch: &str, model_type: &str, text: &Value| {
        json!({
            "architectures": [arch], "model_type": model_type, "dtype": "bfloat16", "text_config": text,
            "vision_config": {"hidden_size": 32, "model_type": "inkling_vision"}, "audio_config": {"n_mel_bins": 8}
        })
    };
    let s = parse(outer("InklingForConditionalGeneration", "inkling_mm_model", &text)).unwrap();
    // The same model as the text checkpoint's, under the release's names and layouts.
    let mut plain = text.clone();
    plain["architectures"] = json!(["InklingForCausalLM"]);
    plain["dtype"] = json!("bfloat16");
    let p = parse(plain).unwrap();
    assert_eq!((s.architecture, p.architecture), ("InklingForConditionalGeneration", "InklingForCausalLM"));
    assert_eq!((&s.layers, &s.moe, s.vocab_size, s.padded_vocab, s.declared_dtype), (&p.layers, &p.moe, p.vocab_size, p.padded_vocab, p.declared_dtype));
    assert_eq!(s.expert_names.layout, ExpertLayout::StackedInterleaved);
    assert_eq!(s.expert_names.expert(2, 5)[0], "model.llm.layers.2.mlp.experts.w13_weight");
    assert_eq!(s.expert_names.shared(1).unwrap()[0], "model.llm.layers.1.mlp.shared_experts.shared_w13_weight");
    assert_eq!((s.dense_names.mlp_gate, s.dense_names.mlp_layout), ("model.llm.layers.{L}.mlp.w13_dn.weight", DenseMlpLayout::InterleavedGateUp));
    assert_eq!(s.dense_names.lm_head, "model.llm.unembed.weight");
    // A bad field of the text model is named where it is.
    let mut bad = text.clone();
    bad["n_shared_experts"] = json!(0);
    assert!(message(parse(outer("InklingForConditionalGeneration", "inkling_mm_model", &bad))).contains("`text_config.n_shared_experts`"));
    let missing = json!({"architectures": ["InklingForConditionalGeneration"], "model_type": "inkling_mm_model"});
    assert!(message(parse(missing)).contains("`text_config`"));

    let text2 = json!({
        "model_type": "inkling2_text", "vocab_size": 300000, "hidden_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
        "moe_intermediate_size": 16
    });
    let s2 = parse(outer("Inkling2ForConditionalGeneration", "inkling2", &text2)).unwrap();
    let mut plain2 = text2.clone();
    plain2["architectures"] = json!(["Inkling2ForCausalLM"]);
    plain2["dtype"] = json!("bfloat16");
    let mut p2 = parse(plain2).unwrap();
    p2.architecture = s2.architecture;
    assert_eq!(s2, p2, "Inkling 2's release keeps the text checkpoint's names");
    // The MXFP8 release's quantization reads; square blocks are not MXFP8's.
    let mut mx = outer("Inkling2ForConditionalGeneration", "inkling2", &text2);
    mx["quantization_config"] = json!({"quant_method": "mxfp8", "activation_scheme": "dynamic", "scale_fmt": "ue8m0", "weight_block_size": [1, 32]});
    assert!(parse(mx.clone()).is_ok());
    mx["quantization_config"]["weight_block_size"] = json!([128, 128]);
    assert!(message(parse(mx)).contains("`quantization_config.weight_block_size`"));
    // ModelOpt's NVFP4 (Inkling's release) reads in both spellings, also under `text_config` or
    // nested as ModelOpt 0.29 did; its other algorithms and group sizes are refused by name.
    let nvfp4 = json!({"quant_method": "modelopt", "group_size": 16, "modelopt_quant_config": {"quant_cfg": {"*weight_quantizer":
        {"num_bits": [2, 1], "block_sizes": {"-1": 16, "type": "dynamic", "scale_bits": [4, 3]}}}}});
    for qc in [
        nvfp4.clone(),
        json!({"quant_method": "modelopt", "quant_algo": "NVFP4"}),
        json!({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "group_size": 16}}),
    ] {
        let mut m = outer("Inkling2ForConditionalGeneration", "inkling2", &text2);
        m["quantization_config"] = qc.clone();
        assert!(parse(m).is_ok(), "{qc}");
    }
    for (qc, field) in [
        (json!({"quant_method": "modelopt", "quant_algo": "FP8"}), "`quantization_config`"),
        (json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}), "`quantization_config.group_size`"),
        (json!({"quant_method": "modelopt", "quantization": {"quant_algo": "W4A8_AWQ"}}), "`quantization_config.quantization`"),
        (json!({"quant_method": "modelopt", "modelopt_quant_config": {"quant_cfg": {"*weight_quantizer": {"num_bits": 8}}}}), "`quantization_config`"),
    ] {
        let mut m = outer("Inkling2ForConditionalGeneration", "inkling2", &text2);
        m["quantization_config"] = qc.clone();
        assert!(message(parse(m)).contains(field), "{qc}");
    }
    let mut inner = text2.clone();
    inner["quantization_config"] = json!({"quant_method": "modelopt", "quant_algo": "INT4_AWQ"});
    assert!(message(parse(outer("Inkling2ForConditionalGeneration", "inkling2", &inner))).contains("`text_config.quantization_config`"));
    inner["quantization_config"] = nvfp4;
    assert!(parse(outer("Inkling2ForConditionalGeneration", "inkling2", &inner)).is_ok());
    let mut bad2 = text2.clone();
    bad2["qk_l2_clip_threshold"] = json!(-1.0);
    assert!(message(parse(outer("Inkling2ForConditionalGeneration", "inkling2", &bad2))).contains("`text_config.qk_l2_clip_threshold`"));
}

#[test]
fn qwen3_next_defaults_are_qwen3_next_configs() {
    let v = json!({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 100,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 8,
        "num_attention_heads": 4, "max_position_embeddings": 256, "num_experts": 8, "num_experts_per_tok": 2
    });
    let s = parse(v.clone()).unwrap();
    // Every 4th layer full attention, the rest Gated DeltaNet.
    let full: Vec<usize> = (0..8).filter(|l| s.attention.mixers[*l] == Mixer::Attention).collect();
    assert_eq!(full, [3, 7]);
    assert_eq!((s.head_dim, s.num_kv_heads, s.attention.rotary_dim), (256, 2, 64));
    assert!(s.attention.output_gate && s.rms_norm_unit_offset);
    let g = s.attention.gated_delta.clone().unwrap();
    assert_eq!((g.key_heads, g.value_heads, g.key_dim, g.value_dim, g.conv_kernel), (16, 32, 128, 128, 4));
    assert_eq!(g.state_floats(), (2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128);
    assert_eq!(s.moe.shared_intermediate_size, Some(512));
    assert_eq!(s.moe.scoring, RouterScoring::SoftmaxTopK { norm_topk_prob: true });
    assert!(s.expert_names.shared_gate.is_some());
    // full_attention_interval moves the full layers; value heads must group the key heads.
    let mut every_other = v.clone();
    every_other["full_attention_interval"] = json!(2);
    assert_eq!(parse(every_other).unwrap().attention.mixers.iter().filter(|m| **m == Mixer::Attention).count(), 4);
    let mut bad = v;
    bad["linear_num_value_heads"] = json!(24);
    bad["linear_num_key_heads"] = json!(16);
    assert!(message(parse(bad)).contains("`linear_num_value_heads`"));
}

#[test]
fn glm_moe_dsa_defaults_are_glm_moe_dsa_configs() {
    let v = json!({
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 100,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 4,
        "num_attention_heads": 4, "max_position_embeddings": 256, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12
    });
    let s = parse(v.clone()).unwrap();
    let AttentionKind::Mla(m) = &s.attention.kind else { panic!("MLA") };
    let ix = m.indexer.clone().unwrap();
    assert_eq!((ix.heads, ix.head_dim, ix.top_k), (32, 128, 2048));
    assert_eq!(ix.full, vec![true; 4]);
    assert!(s.attention.rope_interleave);
    // The first three layers dense (first_k_dense_replace 3), then MoE; mlp_layer_types overrides.
    assert_eq!(s.layers.iter().filter(|l| **l == LayerMlp::Moe).count(), 1);
    let mut typed = v.clone();
    typed["mlp_layer_types"] = json!(["dense", "sparse", "sparse", "sparse"]);
    typed["indexer_types"] = json!(["full", "shared", "shared", "full"]);
    let t = parse(typed).unwrap();
    assert_eq!(t.layers.iter().filter(|l| **l == LayerMlp::Moe).count(), 3);
    let AttentionKind::Mla(m) = &t.attention.kind else { panic!("MLA") };
    assert_eq!(m.indexer.as_ref().unwrap().full, [true, false, false, true]);
    // A shared first layer has no choice to reuse.
    let mut bad = v;
    bad["indexer_types"] = json!(["shared", "full", "full", "full"]);
    assert!(message(parse(bad)).contains("`indexer_types`"));
}

#[test]
fn kimi_linear_reads_the_published_config_spelling() {
    // As moonshotai/Kimi-Linear publishes it: attribute-map spellings and linear_attn_config with
    // 1-based layer lists.
    let published = json!({
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 100,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 4,
        "num_attention_heads": 4, "model_max_length": 256, "num_experts": 8, "num_experts_per_token": 2,
        "num_expert_group": 2, "topk_group": 1, "num_shared_experts": 1, "moe_renormalize": true,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "first_k_dense_replace": 1,
        "linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1, 3, 4], "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4}
    });
    let s = parse(published.clone()).unwrap();
    assert_eq!(s.max_position_embeddings, 256);
    assert_eq!(s.attention.mixers, [Mixer::GatedDeltaNet, Mixer::Attention, Mixer::GatedDeltaNet, Mixer::GatedDeltaNet]);
    let g = s.attention.gated_delta.clone().unwrap();
    assert_eq!((g.key_heads, g.value_heads, g.key_dim, g.conv_kernel, g.projections), (4, 4, 16, 4, DeltaProjections::Kimi));
    assert!(s.attention.no_rope);
    assert!(matches!(s.moe.scoring, RouterScoring::SigmoidGrouped { n_group: 2, topk_group: 1, .. }));
    // transformers' own spelling of the same model parses to the same spec.
    let mut ours = published.clone();
    let o = ours.as_object_mut().unwrap();
    for (theirs, name) in [
        ("model_max_length", "max_position_embeddings"),
        ("num_experts", "num_local_experts"),
        ("num_experts_per_token", "num_experts_per_tok"),
        ("num_expert_group", "n_group"),
    ] {
        let v = o.remove(theirs).unwrap();
        o.insert(name.into(), v);
    }
    o.remove("linear_attn_config");
    o.insert("layer_types".into(), json!(["linear_attention", "full_attention", "linear_attention", "linear_attention"]));
    o.insert("linear_head_dim".into(), json!(16));
    o.insert("linear_num_heads".into(), json!(4));
    assert_eq!(parse(ours).unwrap(), s);
    // A layer in neither list, and an error in the checkpoint's spelling.
    let mut bad = published.clone();
    bad["linear_attn_config"]["kda_layers"] = json!([1, 3]);
    assert!(message(parse(bad)).contains("layer 4 is in neither list"));
    let mut bad = published;
    bad["num_experts_per_token"] = json!(9);
    assert!(message(parse(bad)).contains("`num_experts_per_token`"), "named as the config spells it");
}

#[test]
fn a_head_size_the_config_does_not_state_is_blamed_on_hidden_size() {
    let mut v = mixtral();
    v["hidden_size"] = json!(4);
    let m = message(parse(v.clone()));
    assert!(m.contains("`hidden_size`") && m.contains("hidden_size / num_attention_heads"), "{m}");
    // Stated, it is named itself.
    v["head_dim"] = json!(1);
    assert!(message(parse(v)).contains("`head_dim`"));
}
