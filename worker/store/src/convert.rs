//! `shimmer convert`: a Hugging Face checkpoint (bf16/f16/f32, or DeepSeek-style fp8-e4m3 with
//! block scales) into an expert container (`container.rs`).
//!
//! Crash safety: every output file is written under a `.partial` name, fsynced and renamed; the
//! manifest is renamed into place last, so a directory without one is never taken for a finished
//! container. Progress through the experts is journaled (`.shimmer-convert.json`, itself replaced
//! atomically) after the blobs it lists are fsynced; a restarted conversion re-verifies those
//! blobs' checksums and continues after them.
//!
//! Must never: leave a manifest that describes bytes not yet durable, or resume from a journal of
//! a different source or format.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use shimmer_common::expert_blob;
use shimmer_common::quant::{self, QuantScheme};
use shimmer_common::spec::LayerMlp;
use shimmer_common::{Checkpoint, LoadError, ModelSpec, StDtype};

use crate::container::{self, BlobEntry, Container, FileSeal, Manifest, DENSE_FILE, EXPERTS_FILE, FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE};

/// Why an int4 matrix could not be written.
const INT4_RANGE: &str = "a weight is too large for int4's f16 group scales (|w| above ~4.6e5); convert it as int8 or bf16";
const INT6_RANGE: &str = "a weight is too large for int6's f16 group scales (|w| above ~2.0e6); convert it as int8 or bf16";

/// Present while a conversion is unfinished (removed after the manifest is in place).
pub const JOURNAL_FILE: &str = ".shimmer-convert.json";
/// Blobs between fsync + journal updates: bounds the work a crash can lose.
const JOURNAL_EVERY_BYTES: u64 = 64 << 20;
/// Largest auxiliary file (tokenizer, template, config) copied.
const MAX_AUX_BYTES: u64 = 256 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseQuant {
    /// 16-bit floats: bf16/f16 tensors kept as they are, f32 and fp8 matrices stored as bf16.
    Bf16,
    /// Weight matrices (2-D `….weight`, except routers) as int8 per row; other tensors as stored.
    Int8,
    /// The layers' matrices (attention, shared experts, dense MLPs) as int4 in groups of `group`
    /// values of a row; the embedding and the LM head as int8 (as llama.cpp's Q4_0 keeps its head
    /// at 6 bits: it decides every logit); routers and vectors as stored.
    Int4 { group: usize },
    /// As `Int4`, in 6 bits (`quant::Int6Matrix`): llama.cpp's Q6_K's place, for the LM head of
    /// a 4-bit container (`--head-quant int6-g32`), where int4 costs a tenth of the top-1
    /// agreement and int8 a third more bytes than this.
    Int6 { group: usize },
}

impl DenseQuant {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(DenseQuant::Bf16),
            "int8" => Ok(DenseQuant::Int8),
            "int4-g32" => Ok(DenseQuant::Int4 { group: 32 }),
            "int4-g64" => Ok(DenseQuant::Int4 { group: 64 }),
            "int4-g128" => Ok(DenseQuant::Int4 { group: 128 }),
            "int6-g32" => Ok(DenseQuant::Int6 { group: 32 }),
            "int6-g64" => Ok(DenseQuant::Int6 { group: 64 }),
            "int6-g128" => Ok(DenseQuant::Int6 { group: 128 }),
            other => Err(format!("unknown dense format `{other}` (expected bf16, int8, int4-g32, int4-g64, int4-g128, int6-g32, int6-g64 or int6-g128)")),
        }
    }
    pub fn name(self) -> String {
        match self {
            DenseQuant::Bf16 => "bf16".into(),
            DenseQuant::Int8 => "int8".into(),
            DenseQuant::Int4 { group } => format!("int4-g{group}"),
            DenseQuant::Int6 { group } => format!("int6-g{group}"),
        }
    }

    /// The manifest's `dense_quant`: this format's name, then `+head-` and the LM head's where it
    /// was chosen apart (`ConvertOptions::head_quant`). In the name, the head's format reaches the
    /// container's fingerprint and the resume journal's check, as the layers' does.
    pub fn manifest_name(self, head: Option<DenseQuant>) -> String {
        match head {
            Some(h) => format!("{}{HEAD_SEPARATOR}{}", self.name(), h.name()),
            None => self.name(),
        }
    }

    /// `manifest_name` read back: the layers' format and the head's, if chosen apart.
    pub fn parse_manifest(s: &str) -> Result<(Self, Option<Self>), String> {
        match s.split_once(HEAD_SEPARATOR) {
            Some((layers, head)) => Ok((Self::parse(layers)?, Some(Self::parse(head).map_err(|e| format!("the LM head's: {e}"))?))),
            None => Ok((Self::parse(s)?, None)),
        }
    }
}

const HEAD_SEPARATOR: &str = "+head-";

pub use shimmer_experts::weights::{int4_scale_name, int6_hi_name, int6_scale_name, INT8_SCALE_SUFFIX};

#[derive(Debug, Clone, Copy)]
pub struct ConvertOptions {
    pub expert_quant: QuantScheme,
    pub dense_quant: DenseQuant,
    /// The LM head's format (the embedding's too where the model ties them), where it differs
    /// from what `dense_quant` gives it (int8 under int8 or int4 layers, bf16 under bf16) — as
    /// llama-quantize's `--output-tensor-type`. The head decides every logit and is read whole
    /// every token: a large vocabulary's head is a quarter of a small MoE's bytes a token.
    pub head_quant: Option<DenseQuant>,
}

/// What the caller hears while converting (for a progress bar).
pub enum ConvertEvent<'a> {
    /// Total bytes to write, and how many of them an earlier, interrupted run already wrote.
    Start {
        total_bytes: u64,
        done_bytes: u64,
    },
    Phase(&'a str),
    Advance(u64),
}

#[derive(Debug, Clone, Default)]
pub struct ConvertReport {
    pub already_done: bool,
    pub blobs: usize,
    pub resumed_blobs: usize,
    pub experts_bytes: u64,
    pub dense_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Journal {
    source_fingerprint: String,
    expert_quant: String,
    dense_quant: String,
    blob_bytes: u64,
    dense_done: Option<FileSeal>,
    /// Checksums of the blobs durably written, in order.
    blobs_done: Vec<String>,
}

/// Test hook: `SHIMMER_CONVERT_CRASH_AT=N` aborts the process (as a kill would: no unwinding, no
/// flushing) at the N-th crash point — after a blob write, a journal update or a rename.
struct CrashPoints {
    remaining: Option<u64>,
}

impl CrashPoints {
    fn from_env() -> Self {
        CrashPoints { remaining: std::env::var("SHIMMER_CONVERT_CRASH_AT").ok().and_then(|v| v.parse().ok()) }
    }
    fn point(&mut self) {
        if let Some(n) = self.remaining.as_mut() {
            *n = n.saturating_sub(1);
            if *n == 0 {
                std::process::abort();
            }
        }
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> LoadError + '_ {
    move |e| LoadError::io(path, e)
}

fn partial(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

fn sync_dir(dir: &Path) -> Result<(), LoadError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// Writes `bytes` to `path` crash-safely: temp file, fsync, rename, fsync the directory.
fn write_atomic(path: &Path, bytes: &[u8], crash: &mut CrashPoints) -> Result<(), LoadError> {
    let tmp = partial(path);
    let mut f = File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))?;
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    crash.point();
    Ok(())
}

/// A source tensor widened to f32; fp8-e4m3 tensors are dequantised with their block scales
/// (`weights::fp8_block_scales`).
fn tensor_f32(ckpt: &Checkpoint, name: &str, shape: &[usize], fp8_block: usize) -> Result<Vec<f32>, LoadError> {
    let raw = ckpt.raw(name)?;
    if raw.dtype != StDtype::F8_E4M3 {
        return Ok(ckpt.get(name, shape)?.to_f32());
    }
    let err = |problem: String| LoadError::Tensor { path: raw.file.to_path_buf(), tensor: name.to_string(), problem };
    let [rows, cols] = *shape else {
        return Err(err(format!("fp8 tensor of shape {shape:?}: only matrices are block-scaled")));
    };
    if raw.shape != shape {
        return Err(err(format!("shape {:?} but the model config needs {shape:?}", raw.shape)));
    }
    let scales = shimmer_experts::weights::fp8_block_scales(ckpt, name, rows, cols, fp8_block)?;
    quant::dequantize_fp8_blocks(raw.bytes, rows, cols, &scales, fp8_block).map_err(err)
}

/// One dense tensor as it will be written.
struct DensePlan {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    bytes: u64,
    kind: DenseKind,
}

enum DenseKind {
    /// Copied byte for byte.
    Copy,
    /// Widened (from f32 or fp8) and stored as bf16.
    ToBf16,
    /// Quantised int8 per row (its scales are the next plan entry).
    Int8,
    /// Quantised int4 in groups of `group` values of a row of `cols` (the stored shape is in
    /// bytes; its scales are the next entry).
    Int4 { group: usize, cols: usize },
    /// Quantised int6 likewise: its low nibbles (int4's layout); its top bits and its scales are
    /// the next two entries.
    Int6 { group: usize, cols: usize },
    /// The top bits of the int6 matrix before.
    TopBits,
    /// The scales of the quantised matrix before.
    Scales,
}

fn dtype_name(d: StDtype) -> Option<&'static str> {
    Some(match d {
        StDtype::F32 => "F32",
        StDtype::BF16 => "BF16",
        StDtype::F16 => "F16",
        StDtype::F64 => "F64",
        StDtype::I64 => "I64",
        StDtype::I32 => "I32",
        StDtype::I8 => "I8",
        StDtype::U8 => "U8",
        StDtype::BOOL => "BOOL",
        _ => return None,
    })
}

fn plan_dense(ckpt: &Checkpoint, spec: &ModelSpec, dense_quant: DenseQuant, head_quant: Option<DenseQuant>) -> Result<Vec<DensePlan>, LoadError> {
    let mut expert_tensors = std::collections::HashSet::new();
    let mut routers = std::collections::HashSet::new();
    for (l, kind) in spec.layers.iter().enumerate() {
        if *kind == LayerMlp::Moe {
            routers.insert(format!("{}.weight", spec.expert_names.router(l)));
            routers.insert(spec.expert_names.router(l));
            expert_tensors.extend(spec.expert_names.tensor_names(l, spec.moe.num_experts));
        }
    }
    // A quantised weight's scales go with it: dequantised into it, never copied on their own.
    let quantised = |n: &&str| ckpt.raw(n).is_ok_and(|r| matches!(r.dtype, StDtype::F8_E4M3 | StDtype::I8 | StDtype::U8));
    let scales_of_quantised: std::collections::HashSet<String> =
        ckpt.tensor_names().into_iter().filter(quantised).flat_map(quant::scale_names).filter(|n| ckpt.contains(n)).collect();
    let embedding_or_head = [spec.dense_names.embed, spec.dense_names.lm_head];
    // The tensor the logits are computed from: the embedding itself where the two are tied.
    let head = if spec.tie_word_embeddings { spec.dense_names.embed } else { spec.dense_names.lm_head };
    let mut plans = Vec::new();
    for name in ckpt.tensor_names() {
        if expert_tensors.contains(name) || scales_of_quantised.contains(name) {
            continue;
        }
        let raw = ckpt.raw(name)?;
        let shape = raw.shape.to_vec();
        let elems: usize = shape.iter().product();
        let is_matrix = shape.len() == 2 && !routers.contains(name);
        // Quantised: weight matrices the model multiplies by (`….weight`); families keep other
        // 2-D tensors (position tables, convolution taps, clip scales) that are read as floats.
        let quantisable = is_matrix && name.ends_with(".weight");
        let float = matches!(raw.dtype, StDtype::F32 | StDtype::BF16 | StDtype::F16 | StDtype::F8_E4M3);
        // Routers are never converted (unless fp8, which must be dequantised): a rounded router
        // could choose other experts.
        let (format, chosen_apart) = match head_quant {
            Some(h) if name == head => (h, true),
            _ => (dense_quant, false),
        };
        // int4 and int6 (the embedding and the head only where chosen apart): packed nibbles,
        // int6's top bits, f16 group scales.
        let grouped = match format {
            DenseQuant::Int4 { group } | DenseQuant::Int6 { group } if chosen_apart || !embedding_or_head.contains(&name) => Some(group),
            _ => None,
        };
        if let (true, true, Some(group)) = (quantisable, float, grouped) {
            let (rows, cols) = (shape[0], shape[1]);
            let (bpr, gpr) = (quant::QuantMatrix::bytes_per_row_int4(cols), quant::QuantMatrix::groups_per_row(cols, group));
            let six = matches!(format, DenseQuant::Int6 { .. });
            let kind = if six { DenseKind::Int6 { group, cols } } else { DenseKind::Int4 { group, cols } };
            plans.push(DensePlan { name: name.to_string(), dtype: "U8", shape: vec![rows, bpr], bytes: (rows * bpr) as u64, kind });
            if six {
                let hpr = quant::Int6Matrix::hi_bytes_per_row(cols);
                plans.push(DensePlan { name: int6_hi_name(name), dtype: "U8", shape: vec![rows, hpr], bytes: (rows * hpr) as u64, kind: DenseKind::TopBits });
            }
            plans.push(DensePlan {
                name: if six { int6_scale_name(name, group) } else { int4_scale_name(name, group) },
                dtype: "F16",
                shape: vec![rows, gpr],
                bytes: (rows * gpr * 2) as u64,
                kind: DenseKind::Scales,
            });
        } else if quantisable && float && format != DenseQuant::Bf16 {
            plans.push(DensePlan { name: name.to_string(), dtype: "I8", shape: shape.clone(), bytes: elems as u64, kind: DenseKind::Int8 });
            plans.push(DensePlan {
                name: format!("{name}{INT8_SCALE_SUFFIX}"),
                dtype: "F32",
                shape: vec![shape[0]],
                bytes: shape[0] as u64 * 4,
                kind: DenseKind::Scales,
            });
        } else if raw.dtype == StDtype::F8_E4M3 || (raw.dtype == StDtype::F32 && is_matrix) {
            plans.push(DensePlan { name: name.to_string(), dtype: "BF16", shape, bytes: elems as u64 * 2, kind: DenseKind::ToBf16 });
        } else {
            let dtype = dtype_name(raw.dtype).ok_or_else(|| LoadError::Tensor {
                path: raw.file.to_path_buf(),
                tensor: name.to_string(),
                problem: format!("dtype {:?} cannot be converted", raw.dtype),
            })?;
            plans.push(DensePlan { name: name.to_string(), dtype, shape, bytes: raw.bytes.len() as u64, kind: DenseKind::Copy });
        }
    }
    Ok(plans)
}

pub(crate) fn safetensors_header(entries: &[(String, &str, Vec<usize>, u64)], metadata: &str) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), serde_json::json!({ "format": metadata }));
    let mut at = 0u64;
    for (name, dtype, shape, bytes) in entries {
        map.insert(name.clone(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + bytes]}));
        at += bytes;
    }
    let json = serde_json::Value::Object(map).to_string();
    // Pad to 8 bytes so the data that follows is aligned for any dtype.
    let total = (8 + json.len()).div_ceil(8) * 8;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&((total - 8) as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.resize(total, b' ');
    out
}

fn write_dense(ckpt: &Checkpoint, plans: &[DensePlan], fp8_block: usize, path: &Path, progress: &mut dyn FnMut(ConvertEvent)) -> Result<(), LoadError> {
    let tmp = partial(path);
    let file = File::create(&tmp).map_err(io(&tmp))?;
    let mut out = std::io::BufWriter::with_capacity(8 << 20, file);
    let entries: Vec<_> = plans.iter().map(|p| (p.name.clone(), p.dtype, p.shape.clone(), p.bytes)).collect();
    out.write_all(&safetensors_header(&entries, "shimmer-dense")).map_err(io(&tmp))?;
    // The scales (and int6's top bits) of the quantised matrix just written, as their bytes.
    let mut pending_scales: Option<Vec<u8>> = None;
    let mut pending_top_bits: Option<Vec<u8>> = None;
    for p in plans {
        let bytes: Vec<u8> = match p.kind {
            DenseKind::Copy => ckpt.raw(&p.name)?.bytes.to_vec(),
            DenseKind::ToBf16 => {
                tensor_f32(ckpt, &p.name, &p.shape, fp8_block)?.iter().flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes()).collect()
            }
            DenseKind::Int8 => {
                let w = tensor_f32(ckpt, &p.name, &p.shape, fp8_block)?;
                match quant::quantize_int8(&w, p.shape[0], p.shape[1]) {
                    quant::QuantMatrix::Int8 { q, scales, .. } => {
                        pending_scales = Some(scales.iter().flat_map(|s| s.to_le_bytes()).collect());
                        q.iter().map(|v| *v as u8).collect()
                    }
                    _ => unreachable!("int8 quantisation returns int8"),
                }
            }
            DenseKind::Int4 { group, cols } => {
                let rows = p.shape[0];
                let w = tensor_f32(ckpt, &p.name, &[rows, cols], fp8_block)?;
                match quant::quantize_int4(&w, rows, cols, group) {
                    quant::QuantMatrix::Int4 { packed, scales, .. } => {
                        if !scales.iter().all(|s| quant::int4_scale_ok(*s)) {
                            return Err(LoadError::Tensor { path: ckpt.dir().to_path_buf(), tensor: p.name.clone(), problem: INT4_RANGE.into() });
                        }
                        pending_scales = Some(scales.iter().flat_map(|s| s.to_le_bytes()).collect());
                        packed
                    }
                    _ => unreachable!("int4 quantisation returns int4"),
                }
            }
            DenseKind::Int6 { group, cols } => {
                let rows = p.shape[0];
                let w = tensor_f32(ckpt, &p.name, &[rows, cols], fp8_block)?;
                let m = quant::quantize_int6(&w, rows, cols, group);
                if !m.scales.iter().all(|s| quant::int4_scale_ok(*s)) {
                    return Err(LoadError::Tensor { path: ckpt.dir().to_path_buf(), tensor: p.name.clone(), problem: INT6_RANGE.into() });
                }
                pending_scales = Some(m.scales.iter().flat_map(|s| s.to_le_bytes()).collect());
                pending_top_bits = Some(m.hi);
                m.lo
            }
            DenseKind::TopBits => pending_top_bits.take().unwrap_or_default(),
            DenseKind::Scales => pending_scales.take().unwrap_or_default(),
        };
        if bytes.len() as u64 != p.bytes {
            return Err(LoadError::Tensor {
                path: ckpt.dir().to_path_buf(),
                tensor: p.name.clone(),
                problem: format!("produced {} bytes, planned {}", bytes.len(), p.bytes),
            });
        }
        out.write_all(&bytes).map_err(io(&tmp))?;
        progress(ConvertEvent::Advance(p.bytes));
    }
    let file = out.into_inner().map_err(|e| LoadError::io(&tmp, e.into_error()))?;
    file.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))?;
    Ok(())
}

/// Converts `from` into a container at `to`, resuming an interrupted conversion there.
pub fn convert(from: &Path, to: &Path, opts: ConvertOptions, progress: &mut dyn FnMut(ConvertEvent)) -> Result<ConvertReport, LoadError> {
    let mut crash = CrashPoints::from_env();
    let spec = ModelSpec::from_dir(from)?;
    let ckpt = Checkpoint::open(from)?;
    let config_path = from.join("config.json");
    let config_bytes = std::fs::read(&config_path).map_err(io(&config_path))?;
    let fp8_block = spec.fp8_block;
    let source_fingerprint = ckpt.fingerprint(&config_bytes);
    let (h, i) = (spec.hidden_size, spec.moe.expert_intermediate_size);
    let shape = expert_blob::BlobShape::of(&spec);
    let (_, blob_len) = expert_blob::layout(opts.expert_quant, shape);
    let blob_bytes = blob_len as u64;
    let expert_quant = opts.expert_quant.name();
    let dense_quant = opts.dense_quant.manifest_name(opts.head_quant);

    if Container::is_container(to) {
        let done = container::read_manifest(to)?;
        if let Some(problem) = done.outdated() {
            return Err(LoadError::malformed(
                to,
                format!("already holds a finished conversion that this build cannot read ({problem}); remove it or choose another --to"),
            ));
        }
        if done.source_fingerprint == source_fingerprint && done.expert_quant == expert_quant && done.dense_quant == dense_quant {
            // A run stopped between the manifest and removing its journal: finish tidying.
            let stale = to.join(JOURNAL_FILE);
            if stale.exists() {
                std::fs::remove_file(&stale).map_err(io(&stale))?;
            }
            return Ok(ConvertReport { already_done: true, blobs: done.blobs.len(), ..Default::default() });
        }
        return Err(LoadError::malformed(
            to,
            format!(
                "already holds a finished conversion of another source or format ({} experts, {} dense, source {}); remove it or choose another --to",
                done.expert_quant, done.dense_quant, done.source_fingerprint
            ),
        ));
    }
    std::fs::create_dir_all(to).map_err(io(to))?;
    let journal_path = to.join(JOURNAL_FILE);
    let fresh = Journal {
        source_fingerprint: source_fingerprint.clone(),
        expert_quant: expert_quant.clone(),
        dense_quant: dense_quant.clone(),
        blob_bytes,
        dense_done: None,
        blobs_done: Vec::new(),
    };
    let mut journal = if journal_path.exists() {
        let j: Journal = serde_json::from_slice(&std::fs::read(&journal_path).map_err(io(&journal_path))?)
            .map_err(|e| LoadError::malformed(&journal_path, format!("unreadable conversion journal ({e}); remove the directory and convert again")))?;
        if (&j.source_fingerprint, &j.expert_quant, &j.dense_quant, j.blob_bytes)
            != (&fresh.source_fingerprint, &fresh.expert_quant, &fresh.dense_quant, fresh.blob_bytes)
        {
            return Err(LoadError::malformed(
                to,
                format!(
                    "holds an interrupted conversion of another source or format ({} experts, {} dense); remove it or choose another --to",
                    j.expert_quant, j.dense_quant
                ),
            ));
        }
        j
    } else {
        if std::fs::read_dir(to).map_err(io(to))?.next().is_some() {
            return Err(LoadError::malformed(to, "is not empty and holds no interrupted conversion; choose an empty or new directory"));
        }
        // The journal comes first: from here on the directory is recognisably ours to resume.
        write_atomic(&journal_path, &serde_json::to_vec(&fresh).unwrap_or_default(), &mut crash)?;
        fresh
    };

    let keys: Vec<(usize, usize)> =
        spec.layers.iter().enumerate().filter(|(_, k)| **k == LayerMlp::Moe).flat_map(|(l, _)| (0..spec.moe.num_experts).map(move |e| (l, e))).collect();
    let plans = plan_dense(&ckpt, &spec, opts.dense_quant, opts.head_quant)?;
    let dense_total: u64 = plans.iter().map(|p| p.bytes).sum();
    let header = container::experts_header(&keys, blob_bytes);
    let experts_total = keys.len() as u64 * blob_bytes;

    // Dense weights first: one file, all or nothing.
    let dense_path = to.join(DENSE_FILE);
    let dense_ok = match &journal.dense_done {
        Some(seal) => dense_path.is_file() && FileSeal::of(&dense_path)? == *seal,
        None => false,
    };
    // Blobs an earlier run finished, re-verified.
    let partial_experts = partial(&to.join(EXPERTS_FILE));
    let mut resumed = 0usize;
    if !journal.blobs_done.is_empty() {
        if let Ok(f) = File::open(&partial_experts) {
            let mut buf = vec![0u8; blob_len];
            for (n, want) in journal.blobs_done.iter().enumerate() {
                let at = header.len() as u64 + n as u64 * blob_bytes;
                let Some(&(layer, expert)) = keys.get(n) else { break };
                let id = expert_blob::BlobId { layer, expert, scheme: opts.expert_quant };
                if f.read_exact_at(&mut buf, at).is_err() || format!("{:016x}", expert_blob::checksum(id, &buf)) != *want {
                    break;
                }
                resumed += 1;
            }
        }
        journal.blobs_done.truncate(resumed);
    }
    let done_bytes = if dense_ok { dense_total } else { 0 } + resumed as u64 * blob_bytes;
    progress(ConvertEvent::Start { total_bytes: dense_total + experts_total, done_bytes });

    if !dense_ok {
        progress(ConvertEvent::Phase("dense weights"));
        write_dense(&ckpt, &plans, fp8_block, &dense_path, progress)?;
        sync_dir(to)?;
        crash.point();
        journal.dense_done = Some(FileSeal::of(&dense_path)?);
        write_atomic(&journal_path, &serde_json::to_vec(&journal).unwrap_or_default(), &mut crash)?;
    }

    progress(ConvertEvent::Phase("experts"));
    let file = OpenOptions::new().create(true).write(true).read(true).truncate(false).open(&partial_experts).map_err(io(&partial_experts))?;
    file.write_all_at(&header, 0).map_err(io(&partial_experts))?;
    let per_batch = ((JOURNAL_EVERY_BYTES / blob_bytes.max(1)) as usize).clamp(1, 256);
    let mut next = resumed;
    while next < keys.len() {
        let batch = &keys[next..(next + per_batch).min(keys.len())];
        let blobs: Vec<Vec<u8>> = batch
            .par_iter()
            .map(|&(l, e)| {
                // The expert as stored (any float, fp8 or MXFP4 form), widened exactly to f32.
                let expert = shimmer_experts::weights::load_expert(&ckpt, &spec, l, e)?;
                let widen = |m: &shimmer_kernels::Matrix| {
                    let mut w = vec![0.0f32; m.rows * m.cols];
                    for (r, row) in w.chunks_exact_mut(m.cols).enumerate() {
                        m.row_f32(r, row);
                    }
                    w
                };
                let (g, u, d) = (widen(&expert.gate), widen(&expert.up), widen(&expert.down));
                let bias = expert.bias.as_ref().map(|b| [b.gate.as_slice(), b.up.as_slice(), b.down.as_slice()]);
                let blob = expert_blob::encode(opts.expert_quant, shape, [&g, &u, &d], bias);
                // What the loader would refuse is never written: int4's f16 scales have a range.
                let what = format!("layer {l} expert {e}");
                expert_blob::decode(&blob, opts.expert_quant, shape, None, &what).map_err(|err| match opts.expert_quant {
                    QuantScheme::Int4 { .. } => LoadError::malformed(&what, INT4_RANGE),
                    _ => err,
                })?;
                Ok(blob)
            })
            .collect::<Result<_, LoadError>>()?;
        for (blob, &(layer, expert)) in blobs.iter().zip(batch) {
            let at = header.len() as u64 + next as u64 * blob_bytes;
            file.write_all_at(blob, at).map_err(io(&partial_experts))?;
            let id = expert_blob::BlobId { layer, expert, scheme: opts.expert_quant };
            journal.blobs_done.push(format!("{:016x}", expert_blob::checksum(id, blob)));
            next += 1;
            progress(ConvertEvent::Advance(blob_bytes));
            crash.point();
        }
        file.sync_data().map_err(io(&partial_experts))?;
        write_atomic(&journal_path, &serde_json::to_vec(&journal).unwrap_or_default(), &mut crash)?;
    }
    let experts_file_bytes = header.len() as u64 + experts_total;
    file.set_len(experts_file_bytes).map_err(io(&partial_experts))?;
    file.sync_all().map_err(io(&partial_experts))?;
    drop(file);
    let experts_path = to.join(EXPERTS_FILE);
    std::fs::rename(&partial_experts, &experts_path).map_err(io(&experts_path))?;
    sync_dir(to)?;
    crash.point();

    // Config, tokenizer, templates: every small regular file that is not a weight file.
    for entry in std::fs::read_dir(from).map_err(io(from))? {
        let entry = entry.map_err(io(from))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let meta = entry.metadata().map_err(io(&entry.path()))?;
        if !meta.is_file()
            || name.starts_with('.')
            || name.ends_with(".safetensors")
            || name == "model.safetensors.index.json"
            || name == MANIFEST_FILE
            || meta.len() > MAX_AUX_BYTES
        {
            continue;
        }
        let bytes = std::fs::read(entry.path()).map_err(io(&entry.path()))?;
        write_atomic(&to.join(&name), &bytes, &mut crash)?;
    }

    let manifest = Manifest {
        format: FORMAT_NAME.into(),
        version: FORMAT_VERSION,
        source_fingerprint,
        expert_quant,
        dense_quant: dense_quant.clone(),
        hidden_size: h,
        expert_intermediate_size: i,
        blob_bytes,
        experts_file_bytes,
        dense: journal.dense_done.clone().ok_or_else(|| LoadError::malformed(to, "internal: the dense weights were not sealed"))?,
        blobs: keys
            .iter()
            .zip(&journal.blobs_done)
            .enumerate()
            .map(|(n, (&(layer, expert), sum))| BlobEntry {
                layer,
                expert,
                offset: header.len() as u64 + n as u64 * blob_bytes,
                length: blob_bytes,
                xxh3: sum.clone(),
            })
            .collect(),
    };
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| LoadError::malformed(to, e.to_string()))?;
    write_atomic(&to.join(MANIFEST_FILE), &json, &mut crash)?;
    std::fs::remove_file(&journal_path).map_err(io(&journal_path))?;
    Ok(ConvertReport { already_done: false, blobs: keys.len(), resumed_blobs: resumed, experts_bytes: experts_total, dense_bytes: dense_total })
}

#[cfg(test)]
mod tests {
    use super::DenseQuant;

    /// Every layers' format with and without a head format reads back as written; a manifest
    /// naming an unknown head format is refused with the head named.
    #[test]
    fn manifest_names_round_trip_and_bad_ones_are_named() {
        let all = [
            DenseQuant::Bf16,
            DenseQuant::Int8,
            DenseQuant::Int4 { group: 32 },
            DenseQuant::Int4 { group: 64 },
            DenseQuant::Int4 { group: 128 },
            DenseQuant::Int6 { group: 32 },
            DenseQuant::Int6 { group: 64 },
            DenseQuant::Int6 { group: 128 },
        ];
        for layers in all {
            assert_eq!(DenseQuant::parse_manifest(&layers.manifest_name(None)), Ok((layers, None)));
            for head in all {
                assert_eq!(DenseQuant::parse_manifest(&layers.manifest_name(Some(head))), Ok((layers, Some(head))));
            }
        }
        assert_eq!(DenseQuant::Int8.manifest_name(Some(DenseQuant::Int4 { group: 32 })), "int8+head-int4-g32");
        let bad = DenseQuant::parse_manifest("int8+head-int3").unwrap_err();
        assert!(bad.contains("LM head") && bad.contains("int3"), "{bad}");
        assert!(DenseQuant::parse_manifest("int5+head-int8").unwrap_err().contains("int5"));
    }
}
