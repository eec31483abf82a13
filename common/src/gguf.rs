//! GGUF, llama.cpp's model file: its header (metadata and tensor directory) read and checked, and
//! its tensors dequantised to f32 exactly as ggml defines each type (`F32`, `F16`, `BF16`, `Q8_0`,
//! `Q4_0`, `Q4_K`, `Q6_K`) — the same f32 operations in the same order as gguf-py's
//! `gguf.quants.dequantize`, so the values are bit for bit gguf-py's.
//!
//! Every count and length the file gives is bounded by what is left of the file (and by the
//! limits below) before anything is allocated from it; every tensor's bytes must lie inside the
//! data section, aligned as the file says; anything else is refused naming the file and what is
//! wrong. Nothing here knows a model family: mapping llama.cpp's tensor names to a checkpoint's is
//! the family file's business.
//!
//! Must never: allocate from a size the file gives before checking it against the file; read a
//! tensor's bytes outside its range; return values other than ggml's for a type it reads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::LoadError;

/// "GGUF", little-endian.
const MAGIC: u32 = 0x4655_4747;
/// Longest string a GGUF may hold (a key, a token, a chat template).
pub const MAX_STRING_BYTES: u64 = 16 << 20;
/// Most elements of one metadata array (a vocabulary's tokens, scores, merges).
pub const MAX_ARRAY_LEN: u64 = 16 << 20;
/// Deepest nesting of metadata arrays.
const MAX_ARRAY_DEPTH: usize = 4;
/// Most tensors and metadata entries one file may list.
pub const MAX_TENSORS: u64 = 1 << 20;
pub const MAX_METADATA: u64 = 1 << 16;
/// Most dimensions of a tensor (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// An integer value of any width, as u64 (`None` for a negative or non-integer one).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64).or(match *self {
                Value::I8(v) => Some(v as f64),
                Value::I16(v) => Some(v as f64),
                Value::I32(v) => Some(v as f64),
                Value::I64(v) => Some(v as f64),
                _ => None,
            }),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The ggml tensor types shimmer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4K,
    Q6K,
}

impl GgmlType {
    /// The type of ggml's id `id`; `Err` names a known type shimmer does not read, or an unknown id.
    fn of(id: u32) -> Result<GgmlType, String> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            30 => GgmlType::BF16,
            8 => GgmlType::Q8_0,
            2 => GgmlType::Q4_0,
            12 => GgmlType::Q4K,
            14 => GgmlType::Q6K,
            3 => return Err("Q4_1 is not read (convert with Q8_0, Q4_0, Q4_K or Q6_K)".into()),
            6 | 7 => return Err("Q5_0/Q5_1 are not read (convert with Q8_0, Q4_0, Q4_K or Q6_K)".into()),
            10 | 11 | 13 | 15 => return Err(format!("K-quant type {id} is not read (Q4_K and Q6_K are)")),
            16..=29 | 31..=41 => return Err(format!("ggml type {id} (an IQ, TQ or MXFP4 type) is not read")),
            _ => return Err(format!("unknown ggml type {id}")),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    /// Values per block, and bytes per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q6K => (256, 210),
        }
    }
}

/// One tensor of the directory.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml's order: `dims[0]` is the row length (innermost); a checkpoint's shape is the reverse.
    pub dims: Vec<u64>,
    pub kind: GgmlType,
    /// Bytes from the start of the file.
    pub start: usize,
    pub bytes: usize,
}

impl TensorInfo {
    /// The shape as a Hugging Face checkpoint (row-major, outermost first) gives it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn elements(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }
}

/// What a GGUF's header says: its version, metadata and tensor directory.
#[derive(Debug)]
pub struct Header {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
}

/// A GGUF file: its version, metadata, tensor directory, and its bytes.
pub struct Gguf {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    data: memmap2::Mmap,
    path: PathBuf,
}

/// A cursor over the header, refusing reads past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn left(&self) -> u64 {
        (self.bytes.len() - self.at) as u64
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if (n as u64) > self.left() {
            return Err(format!("{what} at byte {} runs past the end of the file ({} bytes)", self.at, self.bytes.len()));
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let len = self.u64(what)?;
        if len > MAX_STRING_BYTES || len > self.left() {
            return Err(format!("{what} at byte {} claims {len} bytes ({} left in the file, at most {MAX_STRING_BYTES})", self.at - 8, self.left()));
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} at byte {} is not UTF-8", self.at - len as usize))
    }

    fn value(&mut self, kind: u32, what: &str, depth: usize) -> Result<Value, String> {
        Ok(match kind {
            0 => Value::U8(self.array::<1>(what)?[0]),
            1 => Value::I8(self.array::<1>(what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("{what} is a bool of value {b}")),
            },
            8 => Value::String(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!("{what} nests arrays deeper than {MAX_ARRAY_DEPTH}"));
                }
                let inner = self.u32(what)?;
                let len = self.u64(what)?;
                // Every element takes at least a byte (a string at least its 8-byte length).
                let least = match inner {
                    8 | 9 => 8,
                    _ => 1,
                };
                if len > MAX_ARRAY_LEN || len.saturating_mul(least) > self.left() {
                    return Err(format!("{what} claims {len} elements ({} bytes left in the file, at most {MAX_ARRAY_LEN})", self.left()));
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(inner, what, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            k => return Err(format!("{what} has unknown value type {k}")),
        })
    }
}

impl Gguf {
    /// Reads and checks `path`'s header (the tensors stay on disk, mapped).
    pub fn open(path: &Path) -> Result<Gguf, LoadError> {
        let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
        // SAFETY: the map is read-only and private to this reader; a file changed underneath
        // gives wrong values, never memory unsafety of ours (bytes are only copied out).
        let data = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
        let Header { version, metadata, tensors } = Self::parse(&data).map_err(|m| LoadError::malformed(path, m))?;
        Ok(Gguf { version, metadata, tensors, data, path: path.to_path_buf() })
    }

    /// The header of a GGUF held in `bytes`: version, metadata, directory (tensor ranges checked
    /// against `bytes`).
    pub fn parse(bytes: &[u8]) -> Result<Header, String> {
        let mut r = Reader { bytes, at: 0 };
        let magic = r.u32("the magic number").map_err(|_| "too short to be a GGUF file".to_string())?;
        if magic != MAGIC {
            return Err(format!("not a GGUF file (magic {magic:#010x}, expected \"GGUF\")"));
        }
        let version = r.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(format!("GGUF version {version} is not read (2 and 3 are)"));
        }
        let tensor_count = r.u64("the tensor count")?;
        let kv_count = r.u64("the metadata count")?;
        // A tensor's entry takes at least 8 + 4 + 8 + 4 + 8 bytes, a metadata entry 8 + 4 + 1.
        if tensor_count > MAX_TENSORS || tensor_count.saturating_mul(32) > r.left() {
            return Err(format!("the file claims {tensor_count} tensors ({} header bytes left, at most {MAX_TENSORS})", r.left()));
        }
        if kv_count > MAX_METADATA || kv_count.saturating_mul(13) > r.left() {
            return Err(format!("the file claims {kv_count} metadata entries ({} bytes left, at most {MAX_METADATA})", r.left()));
        }
        let mut metadata = BTreeMap::new();
        for i in 0..kv_count {
            let key = r.string(&format!("metadata key {i}"))?;
            let kind = r.u32(&format!("the type of `{key}`"))?;
            let value = r.value(kind, &format!("`{key}`"), 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(format!("metadata key `{key}` appears twice"));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() && a <= 1 << 16 => a,
                _ => return Err(format!("`general.alignment` is {v:?}, not a power of two up to 65536")),
            },
        };
        let mut infos = Vec::with_capacity(tensor_count as usize);
        for i in 0..tensor_count {
            let name = r.string(&format!("the name of tensor {i}"))?;
            let n_dims = r.u32(&format!("the dimensions of `{name}`"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(format!("tensor `{name}` has {n_dims} dimensions (1 to {MAX_DIMS})"));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&format!("a dimension of `{name}`"))?);
            }
            let type_id = r.u32(&format!("the type of `{name}`"))?;
            let kind = GgmlType::of(type_id).map_err(|e| format!("tensor `{name}`: {e}"))?;
            let offset = r.u64(&format!("the offset of `{name}`"))?;
            infos.push((name, dims, kind, offset));
        }
        let data_start = (r.at as u64).div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(infos.len());
        let mut names = std::collections::HashSet::new();
        for (name, dims, kind, offset) in infos {
            if !names.insert(name.clone()) {
                return Err(format!("tensor `{name}` appears twice"));
            }
            let elements = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).filter(|&n| n > 0 && n <= bytes.len() as u64 * 8);
            let Some(elements) = elements else {
                return Err(format!("tensor `{name}` has dimensions {dims:?}: empty, or more values than the file could hold"));
            };
            let (per_block, block_bytes) = kind.block();
            if dims[0] % per_block as u64 != 0 {
                return Err(format!("tensor `{name}` ({}) has rows of {} values, not a multiple of its block of {per_block}", kind.name(), dims[0]));
            }
            let size = elements / per_block as u64 * block_bytes as u64;
            if offset % alignment != 0 {
                return Err(format!("tensor `{name}` starts at data offset {offset}, not a multiple of the alignment {alignment}"));
            }
            let start = data_start.checked_add(offset).filter(|s| s.checked_add(size).is_some_and(|end| end <= bytes.len() as u64));
            let Some(start) = start else {
                return Err(format!("tensor `{name}` ({size} bytes at data offset {offset}) runs past the end of the file ({} bytes)", bytes.len()));
            };
            tensors.push(TensorInfo { name, dims, kind, start: start as usize, bytes: size as usize });
        }
        Ok(Header { version, metadata, tensors })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor of the directory.
    pub fn raw(&self, t: &TensorInfo) -> &[u8] {
        &self.data[t.start..t.start + t.bytes]
    }

    /// A tensor's values as f32, in ggml's order (rows of `dims[0]`).
    pub fn dequantize(&self, t: &TensorInfo) -> Vec<f32> {
        dequantize(t.kind, self.raw(t))
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }
}

/// A GGUF's metadata as a model family reads it: most keys sit under the architecture's name
/// (`qwen3moe.block_count`); the tokenizer's under `tokenizer.`. Errors name the full key.
pub struct Meta<'a> {
    pub architecture: &'a str,
    pub entries: &'a BTreeMap<String, Value>,
    pub tensors: &'a [TensorInfo],
}

impl<'a> Meta<'a> {
    pub fn new(entries: &'a BTreeMap<String, Value>, tensors: &'a [TensorInfo]) -> Result<Meta<'a>, String> {
        let architecture = match entries.get("general.architecture") {
            Some(Value::String(a)) => a.as_str(),
            Some(other) => return Err(format!("`general.architecture` is {other:?}, not a string")),
            None => return Err("`general.architecture` is missing".into()),
        };
        Ok(Meta { architecture, entries, tensors })
    }

    /// The value of `{architecture}.{key}`.
    pub fn arch(&self, key: &str) -> Option<&'a Value> {
        self.entries.get(&format!("{}.{key}", self.architecture))
    }

    /// A required non-negative integer under the architecture.
    pub fn count(&self, key: &str) -> Result<u64, String> {
        self.count_opt(key)?.ok_or_else(|| format!("`{}.{key}` is missing", self.architecture))
    }

    pub fn count_opt(&self, key: &str) -> Result<Option<u64>, String> {
        match self.arch(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| format!("`{}.{key}` is {v:?}, not a non-negative integer", self.architecture)),
        }
    }

    pub fn float_opt(&self, key: &str) -> Result<Option<f64>, String> {
        match self.arch(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| format!("`{}.{key}` is {v:?}, not a number", self.architecture)),
        }
    }

    pub fn string_opt(&self, key: &str) -> Result<Option<&'a str>, String> {
        match self.arch(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| format!("`{}.{key}` is {v:?}, not a string", self.architecture)),
        }
    }

    pub fn tensor(&self, name: &str) -> Option<&'a TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// `bytes` of whole blocks of `kind` as f32, as gguf-py computes them (f32 products and
/// differences, in its order; half values widened exactly).
pub fn dequantize(kind: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let (per_block, block_bytes) = kind.block();
    let blocks = bytes.len() / block_bytes;
    let mut out = Vec::with_capacity(blocks * per_block);
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    for block in bytes.chunks_exact(block_bytes) {
        match kind {
            GgmlType::F32 => out.push(f32::from_le_bytes([block[0], block[1], block[2], block[3]])),
            GgmlType::F16 => out.push(f16(block)),
            GgmlType::BF16 => out.push(f32::from_bits((u16::from_le_bytes([block[0], block[1]]) as u32) << 16)),
            GgmlType::Q8_0 => {
                let d = f16(&block[..2]);
                out.extend(block[2..].iter().map(|&q| (q as i8) as f32 * d));
            }
            GgmlType::Q4_0 => {
                let d = f16(&block[..2]);
                let qs = &block[2..];
                out.extend(qs.iter().map(|&q| d * ((q & 0x0f) as i8 - 8) as f32));
                out.extend(qs.iter().map(|&q| d * ((q >> 4) as i8 - 8) as f32));
            }
            GgmlType::Q4K => {
                let (d, dmin) = (f16(&block[..2]), f16(&block[2..4]));
                let scales = &block[4..16];
                let qs = &block[16..];
                let (sc, mn) = q4k_scales_mins(scales);
                for chunk in 0..4 {
                    for (half, shift) in [(0usize, 0u8), (1, 4)] {
                        let j = chunk * 2 + half;
                        let (dj, mj) = (d * sc[j] as f32, dmin * mn[j] as f32);
                        out.extend(qs[chunk * 32..chunk * 32 + 32].iter().map(|&q| dj * ((q >> shift) & 0x0f) as f32 - mj));
                    }
                }
            }
            GgmlType::Q6K => {
                let (ql, qh) = (&block[..128], &block[128..192]);
                let scales = &block[192..208];
                let d = f16(&block[208..210]);
                for e in 0..256 {
                    let (h, r) = (e / 128, e % 128);
                    let low = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
                    let high = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
                    let q = (low | (high << 4)) as i8 - 32;
                    out.push(d * scales[e / 16] as i8 as f32 * q as f32);
                }
            }
        }
    }
    out
}

/// Q4_K's eight 6-bit scales and mins, unpacked from their 12 bytes.
fn q4k_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for i in 0..4 {
        sc[i] = s[i] & 0x3f;
        sc[i + 4] = (s[8 + i] & 0x0f) | ((s[i] >> 2) & 0x30);
        mn[i] = s[4 + i] & 0x3f;
        mn[i + 4] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30);
    }
    (sc, mn)
}

#[cfg(test)]
mod tests;
