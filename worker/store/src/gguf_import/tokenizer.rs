//! A Hugging Face `tokenizer.json` from a GGUF's `tokenizer.ggml.*` metadata: byte-level BPE
//! (`tokenizer.ggml.model = gpt2`: tokens, merges, token types) with the pre-tokenizer its
//! `tokenizer.ggml.pre` names, special tokens from the control-typed entries, and BOS added where
//! `tokenizer.ggml.add_bos_token` says so.
//!
//! Must never: substitute a pre-tokenizer for one it does not know (a different split is a
//! different model); the file is refused naming `tokenizer.ggml.pre`.

use serde_json::{json, Map, Value as Json};
use shimmer_common::gguf::{Meta, Value};

/// llama.cpp's token types (`llama_token_type`).
const TOKEN_UNKNOWN: u64 = 2;
const TOKEN_CONTROL: u64 = 3;
const TOKEN_USER_DEFINED: u64 = 4;

/// The splits of Qwen2's, Qwen3.5's, Llama 3's (also GLM-4.5's) and DeepSeek-V3's `tokenizer.json`
/// (GPT-2's is the one `ByteLevel { use_regex: true }` applies itself).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEEPSEEK3_SPLITS: [&str; 3] = [
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];

fn strings<'a>(meta: &Meta<'a>, key: &str) -> Result<Vec<&'a str>, String> {
    let v = meta.entries.get(key).ok_or_else(|| format!("`{key}` is missing"))?;
    let items = v.as_array().ok_or_else(|| format!("`{key}` is not an array"))?;
    items.iter().enumerate().map(|(i, s)| s.as_str().ok_or_else(|| format!("`{key}`[{i}] is not a string"))).collect()
}

fn token_id(meta: &Meta, key: &str, vocab: usize) -> Result<Option<usize>, String> {
    match meta.entries.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(id) if (id as usize) < vocab => Ok(Some(id as usize)),
            _ => Err(format!("`{key}` is {v:?}, not a token id below the vocabulary's {vocab}")),
        },
    }
}

fn byte_level(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split(regex: &str) -> Json {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

/// The pre-tokenizer llama.cpp applies for `pre`, as `tokenizers` spells it, and whether a word
/// the vocabulary holds whole is taken as it is before any merge (`ignore_merges`, as the source
/// `tokenizer.json` says and llama.cpp copies).
fn pre_tokenizer(pre: &str) -> Result<(Json, bool), String> {
    let sequence = |splits: &[&str]| {
        let mut items: Vec<Json> = splits.iter().map(|r| split(r)).collect();
        items.push(byte_level(false));
        json!({"type": "Sequence", "pretokenizers": items})
    };
    Ok(match pre {
        "gpt-2" | "mpt" | "olmo" | "jais" => (byte_level(true), false),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" => (sequence(&[QWEN2_SPLIT]), false),
        "qwen35" => (sequence(&[QWEN35_SPLIT]), false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "glm4" | "glm5" => (sequence(&[LLAMA3_SPLIT]), true),
        "deepseek-v3" => (sequence(&DEEPSEEK3_SPLITS), false),
        other => {
            return Err(format!(
                "`tokenizer.ggml.pre` `{other}` is not imported (gpt-2, olmo, qwen2, qwen35, llama-bpe, glm4 and deepseek-v3 are): its split is not known here"
            ))
        }
    })
}

/// Token texts llama.cpp ends generation on wherever a vocabulary has them (its `special_eog_ids`
/// list: the entries these families' vocabularies use).
const END_OF_GENERATION: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
];

/// What the tokenizer files say.
pub(super) struct ImportedTokenizer {
    pub json: Json,
    pub bos: Option<String>,
    pub eos: Option<String>,
    /// The ids llama.cpp stops on: EOS, EOT and EOM, and the tokens of `END_OF_GENERATION`.
    pub stop_ids: Vec<usize>,
}

/// The checkpoint's `tokenizer.json`, the BOS/EOS token texts for `tokenizer_config.json` and
/// the stop ids for `generation_config.json`.
pub(super) fn tokenizer_json(meta: &Meta) -> Result<ImportedTokenizer, String> {
    let model = meta.entries.get("tokenizer.ggml.model").and_then(Value::as_str).ok_or("`tokenizer.ggml.model` is missing")?;
    if model == "llama" {
        return sentencepiece(meta);
    }
    if model != "gpt2" {
        return Err(format!("`tokenizer.ggml.model` `{model}` is not imported (byte-level BPE, `gpt2`, and SentencePiece BPE, `llama`, are)"));
    }
    let tokens = strings(meta, "tokenizer.ggml.tokens")?;
    let merges = strings(meta, "tokenizer.ggml.merges")?;
    let types = token_types(meta, tokens.len())?;
    let pre = meta.entries.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("gpt-2");
    let (pre_tokenizer, ignore_merges) = pre_tokenizer(pre)?;
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, (&token, &kind)) in tokens.iter().zip(&types).enumerate() {
        if vocab.insert(token.to_string(), json!(id)).is_some() {
            return Err(format!("`tokenizer.ggml.tokens` lists `{token}` twice"));
        }
        if kind == TOKEN_CONTROL || kind == TOKEN_USER_DEFINED {
            added.push(json!({"id": id, "content": token, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": kind == TOKEN_CONTROL}));
        }
    }
    let merges: Vec<Json> = merges
        .iter()
        .enumerate()
        .map(|(i, m)| m.split_once(' ').map(|(a, b)| json!([a, b])).ok_or_else(|| format!("`tokenizer.ggml.merges`[{i}] `{m}` is not two tokens")))
        .collect::<Result<_, _>>()?;
    let bos = token_id(meta, "tokenizer.ggml.bos_token_id", tokens.len())?;
    let eos = token_id(meta, "tokenizer.ggml.eos_token_id", tokens.len())?;
    let add_bos = matches!(meta.entries.get("tokenizer.ggml.add_bos_token"), Some(Value::Bool(true)));
    let post_processor = match (add_bos, bos) {
        (true, Some(id)) => bos_processor(Some((id, tokens[id]))),
        (true, None) => return Err("`tokenizer.ggml.add_bos_token` is true but `tokenizer.ggml.bos_token_id` is missing".into()),
        (false, _) => json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}),
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges
        }
    });
    finish(meta, tokenizer, &tokens, bos, eos)
}

/// The BOS/EOS texts and the stop ids around a built `tokenizer.json`.
fn finish(meta: &Meta, json: Json, tokens: &[&str], bos: Option<usize>, eos: Option<usize>) -> Result<ImportedTokenizer, String> {
    let mut stop_ids: Vec<usize> = eos.into_iter().collect();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        stop_ids.extend(token_id(meta, key, tokens.len())?);
    }
    stop_ids.extend(tokens.iter().enumerate().filter(|(_, t)| END_OF_GENERATION.contains(t)).map(|(i, _)| i));
    let mut seen = std::collections::HashSet::new();
    stop_ids.retain(|id| seen.insert(*id));
    Ok(ImportedTokenizer { json, bos: bos.map(|i| tokens[i].to_string()), eos: eos.map(|i| tokens[i].to_string()), stop_ids })
}

fn token_types(meta: &Meta, count: usize) -> Result<Vec<u64>, String> {
    match meta.entries.get("tokenizer.ggml.token_type") {
        None => Ok(vec![1; count]),
        Some(v) => {
            let items = v.as_array().ok_or("`tokenizer.ggml.token_type` is not an array")?;
            if items.len() != count {
                return Err(format!("`tokenizer.ggml.token_type` has {} entries for {count} tokens", items.len()));
            }
            items.iter().map(|t| t.as_u64().ok_or_else(|| "`tokenizer.ggml.token_type` holds a non-integer".to_string())).collect()
        }
    }
}

/// BOS added in front where `add_bos_token` says so (transformers' `TemplateProcessing`).
fn bos_processor(bos: Option<(usize, &str)>) -> Json {
    match bos {
        Some((id, text)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": text, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {text: {"id": text, "ids": [id], "tokens": [text]}}
        }),
        None => Json::Null,
    }
}

/// A SentencePiece BPE vocabulary (`tokenizer.ggml.model = llama`: Llama 2, Mistral, Mixtral) as
/// transformers' `LlamaTokenizerFast` spells it: spaces as `▁` (with one in front unless
/// `add_space_prefix` is false), BPE merges recovered from the pieces' scores as transformers'
/// SentencePiece converter orders them, byte fallback through the `<0xNN>` tokens.
fn sentencepiece(meta: &Meta) -> Result<ImportedTokenizer, String> {
    let tokens = strings(meta, "tokenizer.ggml.tokens")?;
    let types = token_types(meta, tokens.len())?;
    let scores: Vec<f64> = match meta.entries.get("tokenizer.ggml.scores") {
        Some(v) => {
            let items = v.as_array().ok_or("`tokenizer.ggml.scores` is not an array")?;
            if items.len() != tokens.len() {
                return Err(format!("`tokenizer.ggml.scores` has {} entries for {} tokens", items.len(), tokens.len()));
            }
            items.iter().map(|s| s.as_f64().ok_or_else(|| "`tokenizer.ggml.scores` holds a non-number".to_string())).collect::<Result<_, _>>()?
        }
        None => return Err("`tokenizer.ggml.scores` is missing (a SentencePiece vocabulary ranks its pieces by them)".into()),
    };
    let mut vocab = Map::new();
    let mut ids = std::collections::HashMap::new();
    let mut added = Vec::new();
    for (id, (&token, &kind)) in tokens.iter().zip(&types).enumerate() {
        if ids.insert(token, id).is_some() {
            return Err(format!("`tokenizer.ggml.tokens` lists `{token}` twice"));
        }
        vocab.insert(token.to_string(), json!(id));
        if kind == TOKEN_CONTROL || kind == TOKEN_USER_DEFINED || kind == TOKEN_UNKNOWN {
            added.push(json!({"id": id, "content": token, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": kind != TOKEN_USER_DEFINED}));
        }
    }
    // transformers' `generate_merges`: every split of every piece into two pieces, per piece by
    // the halves' ids, then all by the piece's score, the left and the right half's lengths
    // (highest first; a stable sort).
    let mut merges: Vec<(&str, &str, f64, usize, usize)> = Vec::new();
    for (&piece, &score) in tokens.iter().zip(&scores) {
        let mut local = Vec::new();
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&il), Some(&ir)) = (ids.get(l), ids.get(r)) {
                local.push((l, r, score, il, ir));
            }
        }
        local.sort_by_key(|m| (m.3, m.4));
        merges.extend(local);
    }
    merges.sort_by(|a, b| {
        let key = |m: &(&str, &str, f64, usize, usize)| (m.2, m.0.chars().count(), m.1.chars().count());
        let (ka, kb) = (key(a), key(b));
        kb.0.total_cmp(&ka.0).then(kb.1.cmp(&ka.1)).then(kb.2.cmp(&ka.2))
    });
    let merges: Vec<Json> = merges.iter().map(|m| json!([m.0, m.1])).collect();
    let unk = token_id(meta, "tokenizer.ggml.unknown_token_id", tokens.len())?.or_else(|| types.iter().position(|&t| t == TOKEN_UNKNOWN));
    let bos = token_id(meta, "tokenizer.ggml.bos_token_id", tokens.len())?;
    let eos = token_id(meta, "tokenizer.ggml.eos_token_id", tokens.len())?;
    let add_bos = !matches!(meta.entries.get("tokenizer.ggml.add_bos_token"), Some(Value::Bool(false)));
    let prefix = !matches!(meta.entries.get("tokenizer.ggml.add_space_prefix"), Some(Value::Bool(false)));
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
    let normalizer = if prefix { json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace]}) } else { replace };
    let mut decoders = vec![json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}), json!({"type": "ByteFallback"}), json!({"type": "Fuse"})];
    if prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": null,
        "post_processor": if add_bos { bos_processor(bos.map(|i| (i, tokens[i]))) } else { Json::Null },
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk.map(|i| tokens[i]), "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges
        }
    });
    finish(meta, tokenizer, &tokens, bos, eos)
}
