//! A Hugging Face safetensors checkpoint, single-file or sharded, mapped read-only with `memmap2`.
//!
//! Every shard's header is validated by the `safetensors` crate (offsets in bounds, contiguous, no
//! overlap, sizes matching dtype × shape) when the checkpoint opens, so a header that lies is an
//! error before any weight is touched. Each tensor is then checked against the shape the spec
//! needs at the moment it is requested.
//!
//! Must never: copy weights it was not asked for, or guess a tensor it cannot find.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::Dtype as StDtype;
use safetensors::SafeTensors;
use serde_json::Value;

use crate::error::LoadError;
use crate::spec::read_json_file;

const INDEX_FILE: &str = "model.safetensors.index.json";
const MAX_INDEX_BYTES: u64 = 64 << 20;

/// Tensor element types the engine computes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
    F16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

pub struct TensorEntry {
    shard: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    /// Absolute byte range inside the shard's mapping.
    start: usize,
    end: usize,
}

/// A borrowed tensor whose dtype is one the engine computes with.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl TensorView<'_> {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements widened to f32 (exact for every supported dtype).
    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            DType::F32 => self.bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            DType::Bf16 => self.bytes.chunks_exact(2).map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()).collect(),
            DType::F16 => self.bytes.chunks_exact(2).map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()).collect(),
        }
    }

    /// The raw 16-bit words of a bf16/f16 tensor (little-endian), for kernels that widen on the fly.
    pub fn to_u16(&self) -> Vec<u16> {
        self.bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect()
    }
}

/// A tensor as stored, whatever its dtype.
#[derive(Clone, Copy)]
pub struct RawTensor<'a> {
    pub dtype: StDtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
    pub file: &'a Path,
}

pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    tensors: HashMap<String, TensorEntry>,
}

impl Checkpoint {
    /// Opens every `*.safetensors` the directory's index names (or, without an index, every
    /// `*.safetensors` file in it) and validates their headers.
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let index_path = dir.join(INDEX_FILE);
        let (files, weight_map) = if index_path.exists() {
            let (files, map) = read_index(&index_path)?;
            (files, Some(map))
        } else {
            (list_safetensors(dir)?, None)
        };
        let mut ckpt = Checkpoint { dir: dir.to_path_buf(), shards: Vec::new(), tensors: HashMap::new() };
        for name in files {
            ckpt.add_shard(dir.join(name))?;
        }
        if let Some(map) = weight_map {
            for (tensor, file) in map {
                let found = ckpt.tensors.get(&tensor).map(|t| &ckpt.shards[t.shard].path);
                let expected = dir.join(&file);
                if found != Some(&expected) {
                    return Err(LoadError::Tensor {
                        path: index_path.clone(),
                        tensor,
                        problem: format!("the index places it in {file}, which does not hold it"),
                    });
                }
            }
        }
        Ok(ckpt)
    }

    fn add_shard(&mut self, path: PathBuf) -> Result<(), LoadError> {
        let file = File::open(&path).map_err(|e| LoadError::io(&path, e))?;
        // SAFETY: the mapping is read-only; a checkpoint changed underneath a running engine is
        // outside what we promise, as for every mmap-based loader.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(&path, e))?;
        let entries = parse_header(&mmap[..]).map_err(|problem| LoadError::malformed(&path, problem))?;
        let shard = self.shards.len();
        for (name, mut entry) in entries {
            if self.tensors.contains_key(&name) {
                return Err(LoadError::Tensor { path: path.clone(), tensor: name, problem: "appears in more than one shard".into() });
            }
            entry.shard = shard;
            self.tensors.insert(name, entry);
        }
        self.shards.push(Shard { path, mmap });
        Ok(())
    }

    /// Opens exactly the named files of `dir` (a converted container's dense weights), without
    /// an index.
    pub fn open_files(dir: &Path, files: &[&str]) -> Result<Self, LoadError> {
        let mut ckpt = Checkpoint { dir: dir.to_path_buf(), shards: Vec::new(), tensors: HashMap::new() };
        for name in files {
            ckpt.add_shard(dir.join(name))?;
        }
        Ok(ckpt)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every tensor name, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry, LoadError> {
        self.tensors.get(name).ok_or_else(|| LoadError::Tensor {
            path: self.dir.clone(),
            tensor: name.to_string(),
            problem: "the model needs it but the checkpoint does not have it".into(),
        })
    }

    /// A tensor of any dtype, unchecked: for converters that handle dtypes the engine does not
    /// compute with (fp8, int8).
    pub fn raw(&self, name: &str) -> Result<RawTensor<'_>, LoadError> {
        let entry = self.entry(name)?;
        let shard = &self.shards[entry.shard];
        Ok(RawTensor { dtype: entry.dtype, shape: &entry.shape, bytes: &shard.mmap[entry.start..entry.end], file: &shard.path })
    }

    /// Identity of config + weights: xxh3 over `config_bytes` and each shard's name, length and
    /// safetensors header (which lists every tensor's name, dtype, shape and offsets). Cheap to
    /// compute, and different whenever the files are not the same model.
    pub fn fingerprint(&self, config_bytes: &[u8]) -> String {
        let mut h = crate::checksum::Hasher::new();
        h.feed(config_bytes);
        for shard in &self.shards {
            h.feed(shard.path.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
            h.feed(&(shard.mmap.len() as u64).to_le_bytes());
            let n = shard.mmap.get(..8).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize);
            h.feed(shard.mmap.get(8..8 + n).unwrap_or_default());
        }
        format!("{:016x}", h.finish())
    }

    /// The tensor `name`, which must have exactly `shape` and a float dtype.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<TensorView<'_>, LoadError> {
        let entry = self.entry(name)?;
        let shard = &self.shards[entry.shard];
        let err = |problem: String| LoadError::Tensor { path: shard.path.clone(), tensor: name.to_string(), problem };
        let dtype = match entry.dtype {
            StDtype::F32 => DType::F32,
            StDtype::BF16 => DType::Bf16,
            StDtype::F16 => DType::F16,
            StDtype::F8_E4M3 => return Err(err("is fp8-e4m3: convert the checkpoint first (`shimmer convert`), which dequantises its block scales".into())),
            other => return Err(err(format!("dtype {other:?} is not supported here (expected F32, BF16 or F16)"))),
        };
        if entry.shape != shape {
            return Err(err(format!("shape {:?} but the model config needs {:?}", entry.shape, shape)));
        }
        Ok(TensorView { dtype, shape: &entry.shape, bytes: &shard.mmap[entry.start..entry.end] })
    }
}

/// Validates a whole safetensors file's header against its length and returns each tensor's
/// absolute byte range (shard index 0). This is the parser a file's bytes first meet; it is fuzzed.
pub fn parse_header(file: &[u8]) -> Result<Vec<(String, TensorEntry)>, String> {
    let (header_len, metadata) = SafeTensors::read_metadata(file).map_err(|e| format!("bad safetensors header: {e}"))?;
    let data_start = 8 + header_len;
    Ok(metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let (start, end) = info.data_offsets;
            (name, TensorEntry { shard: 0, dtype: info.dtype, shape: info.shape.clone(), start: data_start + start, end: data_start + end })
        })
        .collect())
}

impl TensorEntry {
    /// Where the tensor's bytes lie in its shard file.
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        self.start..self.end
    }
}

fn list_safetensors(dir: &Path) -> Result<Vec<String>, LoadError> {
    let entries = std::fs::read_dir(dir).map_err(|e| LoadError::io(dir, e))?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| LoadError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors") {
            names.push(name);
        }
    }
    if names.is_empty() {
        return Err(LoadError::malformed(dir, "no *.safetensors files (and no model.safetensors.index.json)"));
    }
    names.sort();
    Ok(names)
}

/// An index's shard files (in first-seen order) and its (tensor, file) pairs.
type IndexMap = (Vec<String>, Vec<(String, String)>);

/// The index's distinct shard files (in first-seen order) and its tensor → file map.
fn read_index(path: &Path) -> Result<IndexMap, LoadError> {
    let value = read_json_file(path, MAX_INDEX_BYTES)?;
    let Some(Value::Object(map)) = value.get("weight_map") else {
        return Err(LoadError::malformed(path, "no `weight_map` object"));
    };
    let mut files: Vec<String> = Vec::new();
    let mut pairs = Vec::with_capacity(map.len());
    for (tensor, file) in map {
        let Value::String(file) = file else {
            return Err(LoadError::malformed(path, format!("weight_map entry `{tensor}` is not a file name")));
        };
        // A shard name is a plain file in the same directory, never a path out of it.
        if file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(LoadError::malformed(path, format!("weight_map names `{file}`, which is not a plain file name")));
        }
        if !files.contains(file) {
            files.push(file.clone());
        }
        pairs.push((tensor.clone(), file.clone()));
    }
    Ok((files, pairs))
}
