//! Every size-like field of a file shimmer reads has a documented bound (docs/limits.md), checked
//! before anything is sized from it: a value over it is refused naming the field, by a process
//! held to a 4 GiB address space — never memory growing until the machine gives out.

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};
use shimmer_common::spec::{CONFIG_BOUNDS, NESTED_BOUNDS, ROPE_BOUNDS};
use shimmer_common::ModelSpec;
use shimmer_tests::{assert_clean_failure, copy_fixture, fixture, fixtures, output_within, shimmer_bin, COMMAND_LIMIT};

/// Numbers real configs carry that size nothing (rates, factors, unread fields).
const NOT_SIZES: &[&str] = &[
    "attention_dropout",
    "initializer_range",
    "clip_qkv",
    "num_nextn_predict_layers",
    "partial_rotary_factor",
    "pretraining_tp",
    "qk_head_dim",
    "rms_norm_eps",
    "rope_theta",
    "routed_scaling_factor",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "beta_fast",
    "beta_slow",
    "factor",
    "mscale",
    "mscale_all_dim",
    "high_freq_factor",
    "low_freq_factor",
    "swiglu_alpha",
    "swiglu_limit",
    "compress_rope_theta",
    "hc_eps",
    "attention_factor",
    "log_scaling_alpha",
    "logits_mup_width_multiplier",
    "route_scale",
    "rms_norm_eps_moe_gate",
    // transformers' own count of an Inkling layer's convolution states; shimmer reads the kernel.
    "number_of_conv_states",
    "qk_l2_clip_threshold",
    "rel_l2_clip_threshold",
    "mlp_gate_softcap",
    "mlp_up_softcap",
    "final_logit_softcapping",
    // An image-text checkpoint's vision tower and its special tokens: shimmer serves the text
    // part and reads none of them.
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "depth",
    "in_channels",
    "num_heads",
    "num_position_embeddings",
    "out_hidden_size",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    // Inkling's image and audio towers (and Inkling 2's vision tower), unread alike.
    "audio_bos_token_id",
    "audio_token_id",
    "image_bos_token_id",
    "mel_vocab_size",
    "n_layers",
    "n_mel_bins",
    "num_channels",
    "text_hidden_size",
    "layer_norm_eps",
    "layer_scale_init_value",
    "mlp_ratio",
    "posemb_grid_size",
    "projection_hidden_dim",
    // Sections of the multimodal rotary: text positions make them plain rotary.
    "mrope_section",
    // quantization_config.weight_block_size: bounded where it is parsed.
    "weight_block_size",
    // ModelOpt's NVFP4 `quantization_config`: each compared with the one value shimmer reads.
    "group_size",
    "num_bits",
    "scale_bits",
    "-1",
];

fn config_of(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap()
}

/// The refusal of `config` (parsed in this process), as its message.
fn refusal(config: &Value) -> String {
    ModelSpec::from_json(config, Path::new("config.json")).err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn every_number_in_a_real_config_is_bounded_or_sizes_nothing() {
    for name in fixtures() {
        let config = config_of(name);
        let mut numbers = Vec::new();
        fn walk(v: &Value, numbers: &mut Vec<String>) {
            if let Value::Object(m) = v {
                for (k, v) in m {
                    let numeric = v.is_number() || v.as_array().is_some_and(|a| !a.is_empty() && a.iter().all(Value::is_number));
                    if numeric {
                        numbers.push(k.clone());
                    }
                    walk(v, numbers);
                }
            }
        }
        walk(&config, &mut numbers);
        for key in numbers {
            let bounded = CONFIG_BOUNDS.iter().chain(ROPE_BOUNDS).chain(NESTED_BOUNDS.iter().flat_map(|(_, b)| b.iter())).any(|b| b.field == key);
            assert!(bounded || NOT_SIZES.contains(&key.as_str()), "{name}: `{key}` has no documented bound and is not listed as sizing nothing");
        }
    }
}

#[test]
fn nested_size_fields_over_their_bound_are_refused_by_name() {
    let mut checked = 0;
    for name in fixtures() {
        let base = config_of(name);
        for (nested, bounds) in NESTED_BOUNDS {
            if base.get(*nested).is_none() {
                continue;
            }
            for b in *bounds {
                let mut config = base.clone();
                config[*nested][b.field] = json!(b.max + 1);
                let why = refusal(&config);
                assert!(why.contains(&format!("{nested}.{}", b.field)), "{name}: {nested}.{} over its bound: {why:?}", b.field);
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "no fixture has a nested size field");
}

#[test]
fn each_bounded_config_field_over_its_bound_is_refused_by_name() {
    for name in fixtures() {
        let base = config_of(name);
        assert!(refusal(&base).is_empty(), "{name}: {}", refusal(&base));
        for b in CONFIG_BOUNDS {
            let mut config = base.clone();
            let (field, what) = match b.field.strip_suffix("[]") {
                Some(list) => {
                    config[list] = json!(vec![0; b.max as usize + 1]);
                    (list, "entries is over the limit")
                }
                None => {
                    config[b.field] = json!(b.max + 1);
                    (b.field, "is over the limit")
                }
            };
            let err = refusal(&config);
            assert!(err.contains(&format!("`{field}`")) && err.contains(what), "{name}: {field} = over {}: {err}", b.max);
            // At the bound itself the bound does not refuse (something else may).
            if !b.field.ends_with("[]") {
                config[b.field] = json!(b.max);
                assert!(!refusal(&config).contains("is over the limit"), "{name}: {field} = {}: {}", b.max, refusal(&config));
            }
        }
        for nested in ["rope_scaling", "rope_parameters"] {
            if base[nested].is_object() {
                let mut config = base.clone();
                config[nested]["original_max_position_embeddings"] = json!(1e12);
                let err = refusal(&config);
                assert!(err.contains(&format!("`{nested}.original_max_position_embeddings`")), "{name}: {err}");
            }
        }
    }
}

/// `shimmer generate` on `dir`, held to a 4 GiB address space.
fn generate_within_4_gib(dir: &Path) -> std::process::Output {
    output_within(
        Command::new("prlimit").arg(format!("--as={}", 4u64 << 30)).arg("--").arg(shimmer_bin()).args([
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "2",
        ]),
        COMMAND_LIMIT,
    )
}

#[test]
fn the_binary_refuses_huge_sizes_within_a_4_gib_address_space() {
    // The examples and variants of them: integers, a float, a list.
    let cases: Vec<(&str, Value, &str)> = vec![
        ("num_hidden_layers", json!(1_000_000_000u64), "`num_hidden_layers`"),
        ("max_position_embeddings", json!(1_000_000_000_000u64), "`max_position_embeddings`"),
        ("max_position_embeddings", json!(1e12), "`max_position_embeddings`"),
        ("vocab_size", json!(u32::MAX), "`vocab_size`"),
        ("num_local_experts", json!(1u64 << 40), "`num_local_experts`"),
        ("mlp_only_layers", json!(vec![1; 200_000]), "`mlp_only_layers`"),
    ];
    for (field, value, named) in cases {
        let d = copy_fixture("qwen3_moe");
        let path = d.path().join("config.json");
        let mut config = config_of("qwen3_moe");
        config[field] = value;
        std::fs::write(&path, config.to_string()).unwrap();
        assert_clean_failure(&generate_within_4_gib(d.path()), &["config.json", named, "over the limit"]);
    }
    // The limit is real: the unmodified model runs under it.
    let out = generate_within_4_gib(&fixture("qwen3_moe"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn fields_each_within_bounds_whose_product_is_too_big_are_refused() {
    let mut config = config_of("olmoe");
    config["num_hidden_layers"] = json!(1024);
    config["num_experts"] = json!(65536);
    let err = refusal(&config);
    assert!(err.contains("routed experts in all") && err.contains("over the limit"), "{err}");
}

/// Chat templates that build values without limit: each fails the render with an error naming
/// the template, quickly, from a process held to 4 GiB — the fuel refuses them all, those that
/// grow while printed through the print budget of the vendored minijinja. The render sandbox is
/// the second wall: a render within the fuel but over the sandbox's memory (lowered to 64 MiB by
/// its environment variable) is stopped with an error saying so.
#[test]
fn hostile_chat_templates_fail_with_a_clear_error_and_the_process_survives_them() {
    let doubling = |step: &str, init: &str, show: &str| {
        format!("{{% set ns = namespace(x={init}) %}}{{% for i in range(40) %}}{{% set ns.x = {step} %}}{{% endfor %}}{show}")
    };
    let cases = [
        (doubling("ns.x + ns.x", "[1]", "{{ ns.x|length }}"), "fuel"),
        (doubling("ns.x ~ ns.x", "\"ab\"", "{{ ns.x|length }}"), "fuel"),
        (doubling("ns.x + ns.x", "[1]", "{{ ns.x|tojson }}"), "fuel"),
        (doubling("[ns.x, ns.x]", "[1]", "{{ ns.x|tojson }}"), "tojson"),
        (doubling("dict(a=ns.x, b=ns.x)", "{}", "{{ ns.x }}"), "fuel"),
        (doubling("[ns.x, ns.x]", "[1]", "{{ ns.x|pprint }}"), "fuel"),
        (doubling("[ns.x, ns.x]", "[1]", "{{ ns.x|string|length }}"), "fuel"),
        ("{% for i in range(90000) %}{% for j in range(90000) %}{{ messages }}{% endfor %}{% endfor %}".to_string(), "fuel"),
    ];
    let d = copy_fixture("qwen3_moe");
    let template = d.path().join("chat_template.jinja");
    // A chat turn on the model; `wrap` sets what runs it (a memory limit, the environment).
    let generate = |wrap: &mut Command| {
        let model = d.path().to_str().unwrap();
        output_within(wrap.args(["generate", "--model", model, "--chat", "--prompt", "hi", "--max-tokens", "2", "--no-usage"]), COMMAND_LIMIT)
    };
    for (t, why) in &cases {
        std::fs::write(&template, t).unwrap();
        let out = generate(Command::new("prlimit").arg(format!("--as={}", 4u64 << 30)).arg("--").arg(shimmer_bin()));
        assert_clean_failure(&out, &["chat_template.jinja", "chat template failed", why]);
    }
    // 64 MiB of string, built within the fuel, in a sandbox of 64 MiB.
    std::fs::write(&template, "{% set ns = namespace(x='ab') %}{% for i in range(25) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x|length }}").unwrap();
    let with_sandbox_of = |mib: &str| generate(Command::new(shimmer_bin()).env("SHIMMER_RENDER_MEMORY_MIB", mib));
    assert_clean_failure(&with_sandbox_of("64"), &["chat_template.jinja", "chat template failed", "more than the 64 MiB a render may use"]);
    assert_clean_failure(&with_sandbox_of("12"), &["SHIMMER_RENDER_MEMORY_MIB", "\"12\"", "from 64 to 65536"]);
    // The same directory with an ordinary template answers.
    std::fs::write(&template, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}").unwrap();
    let out = shimmer_tests::shimmer(&["generate", "--model", d.path().to_str().unwrap(), "--chat", "--prompt", "hi", "--max-tokens", "2", "--no-usage"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The count in pieces that refuses a far-too-long prompt before it is tokenized whole never
/// refuses one that fits: on every fixture's tokenizer, texts of ~300 KB (words, runs without
/// whitespace, multi-byte characters) are "certainly more than" half their exact count and never
/// more than the count itself.
#[test]
fn counting_a_prompt_in_pieces_never_refuses_one_that_fits() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let words = ["the", "LORD", "spake", "unto", "Moses", "42", "naïve", "日本語", "😀", "\n\n", "  ", "x=y+1;", "https://example.com/a?b=c"];
    for name in fixtures() {
        let tok = shimmer_common::tokenizer::Tokenizer::from_dir(&fixture(name)).unwrap();
        for round in 0..3 {
            let mut text = String::new();
            while text.len() < 300_000 {
                let w = words[(next() % words.len() as u64) as usize];
                text.push_str(w);
                // Round 1 writes long runs with no whitespace at all.
                if round != 1 {
                    text.push(' ');
                }
            }
            let exact = tok.encode(&text, false).unwrap().len();
            assert!(!tok.certainly_more_than(&text, exact).unwrap(), "{name} round {round}: refused a text of exactly {exact} tokens");
            assert!(tok.certainly_more_than(&text, exact / 2).unwrap(), "{name} round {round}: {exact} tokens not seen as more than {}", exact / 2);
        }
    }
}
