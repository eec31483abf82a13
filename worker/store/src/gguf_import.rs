//! `shimmer convert --from model.gguf`: a llama.cpp GGUF of a family shimmer runs, written back as
//! that family's Hugging Face checkpoint — `config.json` from the file's metadata, the tensors
//! under the checkpoint's names (llama.cpp's q/k row order undone, stacked experts split), each
//! dequantised exactly as ggml defines its type, `tokenizer.json` and `tokenizer_config.json`
//! (with the chat template) from `tokenizer.*`. The result runs as any checkpoint does, or goes on
//! to `shimmer convert` into a container.
//!
//! Values: by default every tensor keeps its exact values — F32, F16 and BF16 tensors their type,
//! quantised ones f32 (a Q8_0 value `d·q` needs more bits than bf16 holds). `--dtype` rounds all
//! of them to one type instead, to halve or quarter the size.
//!
//! Crash safety: files are written under `.partial` names and renamed, `config.json` last, so a
//! directory without one is never taken for a checkpoint.
//!
//! Must never: drop a tensor of the file (one the family cannot place refuses the import, naming
//! it), write a value other than ggml's dequantisation (or its rounding to `--dtype`), or write
//! into a directory that holds anything.

mod tokenizer;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::json;
use shimmer_common::families::{gguf_dialect, GgufTensor};
use shimmer_common::gguf::{GgmlType, Gguf, Meta};
use shimmer_common::LoadError;

use crate::convert::safetensors_header;

/// Largest safetensors file written; larger checkpoints are sharded with an index.
const SHARD_BYTES: u64 = 4 << 30;

/// The type imported tensors are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportDtype {
    /// Each tensor's exact values: F32/F16/BF16 kept, quantised types as f32.
    Exact,
    F32,
    F16,
    Bf16,
}

impl ImportDtype {
    pub fn parse(s: &str) -> Result<ImportDtype, String> {
        Ok(match s {
            "exact" => ImportDtype::Exact,
            "f32" => ImportDtype::F32,
            "f16" => ImportDtype::F16,
            "bf16" => ImportDtype::Bf16,
            other => return Err(format!("unknown dtype `{other}` (exact, f32, f16, bf16)")),
        })
    }

    /// safetensors' name for what a tensor of `kind` is written as.
    fn written(self, kind: GgmlType) -> &'static str {
        match (self, kind) {
            (ImportDtype::F32, _) => "F32",
            (ImportDtype::F16, _) => "F16",
            (ImportDtype::Bf16, _) => "BF16",
            (ImportDtype::Exact, GgmlType::F16) => "F16",
            (ImportDtype::Exact, GgmlType::BF16) => "BF16",
            (ImportDtype::Exact, _) => "F32",
        }
    }
}

/// What an import wrote.
#[derive(Debug, Clone)]
pub struct ImportReport {
    pub architecture: String,
    pub family: &'static str,
    pub tensors: usize,
    pub bytes: u64,
    pub shards: usize,
}

/// How a checkpoint tensor's values come out of its GGUF tensor(s).
enum Take {
    Whole,
    Expert(usize),
    Unpermute(usize),
    /// `kv_b_proj` from its key half (`source`) and this value half (`GgufTensor::KvB`).
    KvB {
        value: usize,
    },
}

/// One checkpoint tensor: from which GGUF tensor, and how.
struct Planned {
    name: String,
    source: usize,
    take: Take,
    shape: Vec<usize>,
    dtype: &'static str,
    bytes: u64,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> LoadError + '_ {
    move |e| LoadError::io(path, e)
}

/// Puts back rows that llama.cpp's `permute` interleaved: within each head of `rows / heads`
/// rows, permuted row `2i + j` is original row `j · half + i`.
fn unpermute(values: &[f32], rows: usize, heads: usize) -> Result<Vec<f32>, String> {
    if heads == 0 || rows == 0 || !rows.is_multiple_of(2 * heads) || !values.len().is_multiple_of(rows) {
        return Err(format!("{rows} rows do not split into {heads} heads of rotary pairs"));
    }
    let cols = values.len() / rows;
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let from = h * head_dim + 2 * i + j;
                let to = h * head_dim + j * half + i;
                out[to * cols..(to + 1) * cols].copy_from_slice(&values[from * cols..(from + 1) * cols]);
            }
        }
    }
    Ok(out)
}

/// `kv_b_proj` rows per head — key rows (the columns of `keys[h]`, `[rank, nope]`) then value rows
/// (`values[h]`, `[v, rank]`) — as DeepSeek's checkpoints hold them.
fn merge_kv_b(keys: &[f32], values: &[f32], heads: usize, rank: usize, nope: usize, v: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(heads * (nope + v) * rank);
    for h in 0..heads {
        let k = &keys[h * rank * nope..(h + 1) * rank * nope];
        for r in 0..nope {
            out.extend((0..rank).map(|c| k[c * nope + r]));
        }
        out.extend_from_slice(&values[h * v * rank..(h + 1) * v * rank]);
    }
    out
}

fn encode(values: &[f32], dtype: &str, out: &mut Vec<u8>) {
    out.clear();
    match dtype {
        "F16" => values.iter().for_each(|v| out.extend(half::f16::from_f32(*v).to_le_bytes())),
        "BF16" => values.iter().for_each(|v| out.extend(half::bf16::from_f32(*v).to_le_bytes())),
        _ => values.iter().for_each(|v| out.extend(v.to_le_bytes())),
    }
}

fn plan(gguf: &Gguf, meta: &Meta, dtype: ImportDtype) -> Result<Vec<Planned>, String> {
    let dialect = gguf_dialect(meta)?;
    let mut planned = Vec::new();
    for (index, t) in gguf.tensors.iter().enumerate() {
        let place = dialect.tensor(&t.name, meta).ok_or_else(|| format!("tensor `{}` has no place in a {} checkpoint", t.name, meta.architecture))?;
        let written = dtype.written(t.kind);
        let width = if written == "F32" { 4 } else { 2 };
        let shape = t.shape();
        match place {
            GgufTensor::Same(name) => {
                planned.push(Planned { name, source: index, take: Take::Whole, bytes: (t.elements() * width) as u64, shape, dtype: written })
            }
            GgufTensor::Unpermute { name, heads } => {
                if heads == 0 || !shape[0].is_multiple_of(2 * heads) {
                    return Err(format!("tensor `{}` has {} rows, not pairs over {heads} heads", t.name, shape[0]));
                }
                planned.push(Planned { name, source: index, take: Take::Unpermute(heads), bytes: (t.elements() * width) as u64, shape, dtype: written })
            }
            GgufTensor::KvB { name, value } => {
                let v_index = gguf.tensors.iter().position(|u| u.name == value).ok_or_else(|| format!("tensor `{}` has no `{value}` beside it", t.name))?;
                let (k_shape, v_shape) = (shape, gguf.tensors[v_index].shape());
                // keys [heads, rank, nope], values [heads, v, rank].
                if k_shape.len() != 3 || v_shape.len() != 3 || k_shape[0] != v_shape[0] || k_shape[1] != v_shape[2] {
                    return Err(format!("tensors `{}` {k_shape:?} and `{value}` {v_shape:?} are not the two halves of one kv_b_proj", t.name));
                }
                let (heads, rank, nope, v) = (k_shape[0], k_shape[1], k_shape[2], v_shape[1]);
                // Exact: one type for both halves, f32 unless they share a half type.
                let written = if written != dtype.written(gguf.tensors[v_index].kind) { "F32" } else { written };
                let width = if written == "F32" { 4 } else { 2 };
                planned.push(Planned {
                    name,
                    source: index,
                    take: Take::KvB { value: v_index },
                    shape: vec![heads * (nope + v), rank],
                    dtype: written,
                    bytes: (heads * (nope + v) * rank * width) as u64,
                });
            }
            GgufTensor::PartOf(partner) => {
                let paired = gguf.tensors.iter().any(|u| u.name == partner && matches!(dialect.tensor(&u.name, meta), Some(GgufTensor::KvB { .. })));
                if !paired {
                    return Err(format!("tensor `{}` has no `{partner}` to be read with", t.name));
                }
            }
            GgufTensor::Experts { template, count } => {
                if shape.len() != 3 || shape[0] != count {
                    return Err(format!("tensor `{}` has shape {shape:?}, not a stack of {count} experts' matrices", t.name));
                }
                let each = shape[1] * shape[2];
                for e in 0..count {
                    planned.push(Planned {
                        name: template.replace("{E}", &e.to_string()),
                        source: index,
                        take: Take::Expert(e),
                        shape: shape[1..].to_vec(),
                        dtype: written,
                        bytes: (each * width) as u64,
                    });
                }
            }
        }
    }
    let mut names = std::collections::HashSet::new();
    for p in &planned {
        if !names.insert(p.name.as_str()) {
            return Err(format!("two tensors of the file map to `{}`", p.name));
        }
    }
    Ok(planned)
}

/// Imports `from` (a GGUF file) into `to` (a new or empty directory).
pub fn import(from: &Path, to: &Path, dtype: ImportDtype, progress: &mut dyn FnMut(u64, u64)) -> Result<ImportReport, LoadError> {
    let gguf = Gguf::open(from)?;
    let malformed = |m: String| LoadError::malformed(from, m);
    let meta = Meta::new(&gguf.metadata, &gguf.tensors).map_err(malformed)?;
    let dialect = gguf_dialect(&meta).map_err(malformed)?;
    let mut config = dialect.config(&meta).map_err(malformed)?;
    let planned = plan(&gguf, &meta, dtype).map_err(malformed)?;
    let tokenizer = tokenizer::tokenizer_json(&meta).map_err(malformed)?;
    let torch_dtype = match planned.iter().map(|p| p.dtype).collect::<std::collections::BTreeSet<_>>().into_iter().collect::<Vec<_>>()[..] {
        ["BF16"] => "bfloat16",
        ["F16"] => "float16",
        _ => "float32",
    };
    config.insert("torch_dtype".into(), json!(torch_dtype));

    if to.exists() {
        let mut entries = std::fs::read_dir(to).map_err(io(to))?;
        if entries.next().is_some() {
            return Err(LoadError::malformed(to, "the directory to import into is not empty".to_string()));
        }
    }
    std::fs::create_dir_all(to).map_err(io(to))?;

    // Shards of whole tensors, in the file's order (so one stacked tensor's experts are written
    // from one dequantisation).
    let mut shards: Vec<Vec<&Planned>> = vec![Vec::new()];
    let mut shard_bytes = 0u64;
    for p in &planned {
        if shard_bytes > 0 && shard_bytes + p.bytes > SHARD_BYTES {
            shards.push(Vec::new());
            shard_bytes = 0;
        }
        shard_bytes += p.bytes;
        shards.last_mut().expect("one shard at least").push(p);
    }
    let total: u64 = planned.iter().map(|p| p.bytes).sum();
    let mut done = 0u64;
    progress(done, total);
    let file_name =
        |i: usize| if shards.len() == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{:05}.safetensors", i + 1, shards.len()) };
    let mut weight_map = serde_json::Map::new();
    let mut cached: Option<(usize, Vec<f32>)> = None;
    let mut bytes = Vec::new();
    for (i, shard) in shards.iter().enumerate() {
        let name = file_name(i);
        let path = to.join(&name);
        let tmp = to.join(format!("{name}.partial"));
        let entries: Vec<(String, &str, Vec<usize>, u64)> = shard.iter().map(|p| (p.name.clone(), p.dtype, p.shape.clone(), p.bytes)).collect();
        let file = File::create(&tmp).map_err(io(&tmp))?;
        let mut w = BufWriter::with_capacity(8 << 20, file);
        w.write_all(&safetensors_header(&entries, "pt")).map_err(io(&tmp))?;
        for p in shard {
            if cached.as_ref().is_none_or(|(s, _)| *s != p.source) {
                cached = Some((p.source, gguf.dequantize(&gguf.tensors[p.source])));
            }
            let all = &cached.as_ref().expect("just filled").1;
            let values: std::borrow::Cow<[f32]> = match p.take {
                Take::Whole => std::borrow::Cow::Borrowed(&all[..]),
                Take::Expert(e) => {
                    let each = p.shape.iter().product::<usize>();
                    std::borrow::Cow::Borrowed(&all[e * each..(e + 1) * each])
                }
                Take::Unpermute(heads) => {
                    std::borrow::Cow::Owned(unpermute(all, p.shape[0], heads).map_err(|m| LoadError::malformed(from, format!("tensor `{}`: {m}", p.name)))?)
                }
                Take::KvB { value } => {
                    let (k, v) = (gguf.tensors[p.source].shape(), gguf.tensors[value].shape());
                    let values = gguf.dequantize(&gguf.tensors[value]);
                    std::borrow::Cow::Owned(merge_kv_b(all, &values, k[0], k[1], k[2], v[1]))
                }
            };
            encode(&values, p.dtype, &mut bytes);
            w.write_all(&bytes).map_err(io(&tmp))?;
            done += p.bytes;
            progress(done, total);
            weight_map.insert(p.name.clone(), json!(name));
        }
        let file = w.into_inner().map_err(|e| LoadError::io(&tmp, e.into_error()))?;
        file.sync_all().map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
    }
    if shards.len() > 1 {
        write_file(to, "model.safetensors.index.json", &json!({"metadata": {"total_size": total}, "weight_map": weight_map}))?;
    }
    write_file(to, "tokenizer.json", &tokenizer.json)?;
    let mut tokenizer_config = serde_json::Map::new();
    tokenizer_config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    if let Some(b) = &tokenizer.bos {
        tokenizer_config.insert("bos_token".into(), json!(b));
    }
    if let Some(e) = &tokenizer.eos {
        tokenizer_config.insert("eos_token".into(), json!(e));
    }
    if let Some(template) = meta.entries.get("tokenizer.chat_template") {
        let t = template.as_str().ok_or_else(|| LoadError::malformed(from, "`tokenizer.chat_template` is not a string".to_string()))?;
        tokenizer_config.insert("chat_template".into(), json!(t));
    }
    write_file(to, "tokenizer_config.json", &serde_json::Value::Object(tokenizer_config))?;
    let mut generation = serde_json::Map::new();
    if let Some(v) = config.get("bos_token_id") {
        generation.insert("bos_token_id".into(), v.clone());
    }
    // Where llama.cpp would stop, so the import ends answers where llama.cpp does.
    if !tokenizer.stop_ids.is_empty() {
        generation.insert("eos_token_id".into(), json!(tokenizer.stop_ids));
    }
    write_file(to, "generation_config.json", &serde_json::Value::Object(generation))?;
    write_file(to, "config.json", &serde_json::Value::Object(config))?;
    File::open(to).and_then(|d| d.sync_all()).map_err(io(to))?;
    Ok(ImportReport { architecture: meta.architecture.to_string(), family: dialect.family, tensors: planned.len(), bytes: total, shards: shards.len() })
}

/// The `tokenizer.json` a GGUF's `tokenizer.*` metadata stands for (a vocabulary-only file will
/// do: no family or tensor is read).
pub fn tokenizer_json(path: &Path) -> Result<serde_json::Value, LoadError> {
    let gguf = Gguf::open(path)?;
    let meta = Meta::new(&gguf.metadata, &gguf.tensors).map_err(|m| LoadError::malformed(path, m))?;
    tokenizer_of(&meta).map_err(|m| LoadError::malformed(path, m))
}

/// `tokenizer_json` from metadata already read.
pub fn tokenizer_of(meta: &Meta) -> Result<serde_json::Value, String> {
    Ok(tokenizer::tokenizer_json(meta)?.json)
}

fn write_file(dir: &Path, name: &str, value: &serde_json::Value) -> Result<(), LoadError> {
    let path = dir.join(name);
    let tmp = dir.join(format!("{name}.partial"));
    let text = serde_json::to_string_pretty(value).map_err(|e| LoadError::malformed(&path, e.to_string()))?;
    let mut f = File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(text.as_bytes()).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `permute` (reshape(heads, 2, half, cols).swapaxes(1, 2)), written directly.
    fn permute(values: &[f32], rows: usize, heads: usize) -> Vec<f32> {
        let cols = values.len() / rows;
        let half = rows / heads / 2;
        let mut out = Vec::with_capacity(values.len());
        for h in 0..heads {
            for i in 0..half {
                for j in 0..2 {
                    let row = h * 2 * half + j * half + i;
                    out.extend_from_slice(&values[row * cols..(row + 1) * cols]);
                }
            }
        }
        out
    }

    /// llama.cpp's split (view [heads, nope + v, rank], split, transpose the key half), written
    /// directly, undone by `merge_kv_b`.
    #[test]
    fn kv_b_halves_merge_back() {
        let (heads, rank, nope, v) = (3, 4, 2, 5);
        let kv_b: Vec<f32> = (0..heads * (nope + v) * rank).map(|i| i as f32).collect();
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for h in 0..heads {
            let head = &kv_b[h * (nope + v) * rank..(h + 1) * (nope + v) * rank];
            for c in 0..rank {
                keys.extend((0..nope).map(|r| head[r * rank + c]));
            }
            values.extend_from_slice(&head[nope * rank..]);
        }
        assert_eq!(merge_kv_b(&keys, &values, heads, rank, nope, v), kv_b);
    }

    #[test]
    fn unpermute_undoes_llama_cpp_permute() {
        for (rows, heads, cols) in [(8, 1, 3), (16, 2, 5), (24, 3, 1), (64, 4, 2)] {
            let original: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let permuted = permute(&original, rows, heads);
            assert_ne!(permuted, original);
            assert_eq!(unpermute(&permuted, rows, heads).unwrap(), original);
        }
        assert!(unpermute(&[0.0; 12], 6, 2).is_err());
    }
}
