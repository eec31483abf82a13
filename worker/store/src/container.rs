//! The expert container: the directory `shimmer convert` writes and the store serves from.
//!
//! ```text
//! DIR/
//!   shimmer-manifest.json   written last: its presence means the conversion finished
//!   experts.safetensors     one U8 tensor "layers.{L}.experts.{E}" per routed expert, each an
//!                           expert blob (common::expert_blob), 4 KiB-aligned in the file
//!   dense.safetensors       every other tensor (attention, norms, routers, shared experts, ...)
//!   config.json, tokenizer.json, tokenizer_config.json, chat templates, ...   copied
//! ```
//!
//! Both weight files are ordinary safetensors (the experts file pads its header with spaces so the
//! data starts on a 4 KiB boundary), so standard tools read them. The manifest records the format
//! version, the expert and dense formats, the source checkpoint's fingerprint, and each blob's
//! offset, length and XXH3 checksum.
//!
//! Owns: the manifest's schema and its validation against the model spec and the files on disk.
//! Must never: trust an offset, length or count it has not checked against the file and the spec.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use shimmer_common::checksum::Hasher;
use shimmer_common::expert_blob::{self, BlobId};
use shimmer_common::quant::QuantScheme;
use shimmer_common::spec::LayerMlp;
use shimmer_common::{LoadError, ModelSpec};

pub const MANIFEST_FILE: &str = "shimmer-manifest.json";
pub const EXPERTS_FILE: &str = "experts.safetensors";
pub const DENSE_FILE: &str = "dense.safetensors";
pub const FORMAT_NAME: &str = "shimmer-expert-container";
/// 2: blob checksums bind the blob's identity (layer, expert, format); the dense file is sealed.
pub const FORMAT_VERSION: u64 = 3;

/// The version before int4 scales were f16: its int8, bf16 and MXFP4 containers are the same
/// bytes as today's and still read; its int4 ones (f32 scales) are refused with a way out.
const INT4_F32_SCALES_VERSION: u64 = 2;
const MAX_MANIFEST_BYTES: u64 = 256 << 20;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: String,
    pub version: u64,
    /// `Checkpoint::fingerprint` of the checkpoint this was converted from.
    pub source_fingerprint: String,
    /// Routed experts' format (`QuantScheme::name`).
    pub expert_quant: String,
    /// Dense weights' format: `bf16` (16-bit floats; 16-bit sources kept as they are) or `int8`.
    pub dense_quant: String,
    pub hidden_size: usize,
    pub expert_intermediate_size: usize,
    /// Every blob has this length (a multiple of 4096).
    pub blob_bytes: u64,
    pub experts_file_bytes: u64,
    /// The dense weights file's length and checksum, verified before they are used.
    pub dense: FileSeal,
    pub blobs: Vec<BlobEntry>,
}

impl Manifest {
    /// Why this build cannot serve the container as it is, if it cannot: a version-2 container
    /// with int4 experts or dense weights holds their scales as f32, which this build reads as f16.
    pub fn outdated(&self) -> Option<String> {
        let int4 = |q: &str| q.starts_with("int4");
        (self.version == INT4_F32_SCALES_VERSION && (int4(&self.expert_quant) || int4(&self.dense_quant))).then(|| {
            format!(
                "container format version 2 with {} experts and {} dense weights stores int4 scales as f32; this build stores them as f16 (4.5 bits a weight at int4-g32): re-run `shimmer convert` into a new directory",
                self.expert_quant, self.dense_quant
            )
        })
    }
}

/// A whole file's length and XXH3-64.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileSeal {
    pub bytes: u64,
    pub xxh3: String,
}

impl FileSeal {
    /// Reads `path` through once, in pieces (a dense file may be many GiB).
    pub fn of(path: &Path) -> Result<FileSeal, LoadError> {
        use std::io::Read;
        let mut f = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
        let mut h = Hasher::new();
        let mut buf = vec![0u8; 8 << 20];
        let mut bytes = 0u64;
        loop {
            let n = f.read(&mut buf).map_err(|e| LoadError::io(path, e))?;
            if n == 0 {
                break;
            }
            h.feed(&buf[..n]);
            bytes += n as u64;
        }
        Ok(FileSeal { bytes, xxh3: format!("{:016x}", h.finish()) })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BlobEntry {
    pub layer: usize,
    pub expert: usize,
    /// Absolute byte offset in experts.safetensors.
    pub offset: u64,
    pub length: u64,
    /// XXH3-64 of the blob, 16 hex digits.
    pub xxh3: String,
}

/// Where one expert's blob lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobLocation {
    pub offset: u64,
    pub length: u64,
    pub checksum: u64,
    /// What the checksum binds: the blob's layer, expert and format.
    pub id: BlobId,
}

/// A validated container.
#[derive(Clone)]
pub struct Container {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub scheme: QuantScheme,
    /// Every blob's shape (from the model's config: sizes, and whether experts carry biases).
    pub shape: expert_blob::BlobShape,
    /// The experts' activation (from the model's config).
    pub activation: shimmer_common::spec::ExpertActivation,
    /// Indexed `[layer][expert]`; empty for dense layers.
    locations: Vec<Vec<BlobLocation>>,
}

impl Container {
    pub fn is_container(dir: &Path) -> bool {
        dir.join(MANIFEST_FILE).is_file()
    }

    /// An error when `dir` holds a container's weight files but not its manifest (it would
    /// otherwise be read as a checkpoint and fail on some tensor's name, far from the cause).
    pub fn check_manifest_present(dir: &Path) -> Result<(), LoadError> {
        let weights: Vec<&str> = [EXPERTS_FILE, DENSE_FILE].into_iter().filter(|f| dir.join(f).is_file()).collect();
        if !weights.is_empty() && !Self::is_container(dir) {
            return Err(LoadError::malformed(
                dir.join(MANIFEST_FILE),
                format!(
                    "is missing: {} a shimmer container's, and it cannot be read without its manifest (copy the manifest back, or run `shimmer convert` again)",
                    if weights.len() == 2 { "dense.safetensors and experts.safetensors are" } else { "the weights file here is" }
                ),
            ));
        }
        Ok(())
    }

    /// Checks the dense weights file against its seal in the manifest: its length, then (reading
    /// it through once) its checksum. Called before the dense weights are used.
    pub fn verify_dense(&self) -> Result<(), LoadError> {
        let path = self.dir.join(DENSE_FILE);
        let len = std::fs::metadata(&path).map_err(|e| LoadError::io(&path, e))?.len();
        if len != self.manifest.dense.bytes {
            return Err(LoadError::malformed(&path, format!("is {len} bytes, the manifest says {} (truncated or replaced)", self.manifest.dense.bytes)));
        }
        let seal = FileSeal::of(&path)?;
        if seal.xxh3 != self.manifest.dense.xxh3 {
            return Err(LoadError::malformed(
                &path,
                format!("checksum mismatch (xxh3 {}, the manifest says {}): the dense weights are damaged", seal.xxh3, self.manifest.dense.xxh3),
            ));
        }
        Ok(())
    }

    /// Reads and checks the manifest against the spec and the experts file.
    pub fn open(dir: &Path, spec: &ModelSpec) -> Result<Self, LoadError> {
        let path = dir.join(MANIFEST_FILE);
        let value = shimmer_common::spec::read_json_file(&path, MAX_MANIFEST_BYTES)?;
        let experts_path = dir.join(EXPERTS_FILE);
        let file_len = std::fs::metadata(&experts_path).map_err(|e| LoadError::io(&experts_path, e))?.len();
        Self::from_manifest(dir, value, spec, file_len)
    }

    /// Checks a parsed manifest against the spec and the experts file's length. Pure: this is
    /// the parser a manifest's bytes meet, and it is fuzzed.
    pub fn from_manifest(dir: &Path, value: serde_json::Value, spec: &ModelSpec, file_len: u64) -> Result<Self, LoadError> {
        let path = dir.join(MANIFEST_FILE);
        let bad = |problem: String| LoadError::malformed(&path, problem);
        if value.get("format").and_then(|v| v.as_str()) != Some(FORMAT_NAME) {
            return Err(bad(format!("not a shimmer expert container manifest (`format` is not \"{FORMAT_NAME}\")")));
        }
        match value.get("version").and_then(|v| v.as_u64()) {
            Some(FORMAT_VERSION | INT4_F32_SCALES_VERSION) => {}
            Some(v) => return Err(bad(format!("container format version {v}; this build reads version {FORMAT_VERSION} (re-run `shimmer convert`)"))),
            None => return Err(bad("no `version` number".into())),
        }
        let manifest: Manifest = serde_json::from_value(value).map_err(|e| bad(format!("invalid manifest: {e}")))?;
        if let Some(problem) = manifest.outdated() {
            return Err(bad(problem));
        }
        let scheme = QuantScheme::parse(&manifest.expert_quant).map_err(|e| bad(format!("`expert_quant`: {e}")))?;
        if let Err(e) = crate::convert::DenseQuant::parse_manifest(&manifest.dense_quant) {
            return Err(bad(format!("`dense_quant`: {e}")));
        }
        let (h, i) = (spec.hidden_size, spec.moe.expert_intermediate_size);
        if manifest.hidden_size != h || manifest.expert_intermediate_size != i {
            return Err(bad(format!(
                "made for hidden {} / expert intermediate {}, but config.json says {h} / {i}",
                manifest.hidden_size, manifest.expert_intermediate_size
            )));
        }
        let shape = expert_blob::BlobShape::of(spec);
        let (_, blob_len) = expert_blob::layout(scheme, shape);
        if manifest.blob_bytes != blob_len as u64 {
            return Err(bad(format!("blob_bytes {} but {} experts of this shape take {blob_len}", manifest.blob_bytes, manifest.expert_quant)));
        }
        let experts_path = dir.join(EXPERTS_FILE);
        if file_len != manifest.experts_file_bytes {
            return Err(LoadError::malformed(
                &experts_path,
                format!("is {file_len} bytes, the manifest says {} (truncated or replaced)", manifest.experts_file_bytes),
            ));
        }
        let mut locations: Vec<Vec<Option<BlobLocation>>> =
            spec.layers.iter().map(|k| if *k == LayerMlp::Moe { vec![None; spec.moe.num_experts] } else { Vec::new() }).collect();
        for b in &manifest.blobs {
            let what = format!("blob for layer {} expert {}", b.layer, b.expert);
            let slot =
                locations.get_mut(b.layer).and_then(|l| l.get_mut(b.expert)).ok_or_else(|| bad(format!("{what}: no such MoE layer/expert in config.json")))?;
            if slot.is_some() {
                return Err(bad(format!("{what} is listed twice")));
            }
            if b.length != manifest.blob_bytes
                || b.offset % expert_blob::BLOB_ALIGN as u64 != 0
                || b.offset.checked_add(b.length).is_none_or(|end| end > file_len)
            {
                return Err(bad(format!("{what}: offset {} / length {} is misaligned or outside {EXPERTS_FILE}", b.offset, b.length)));
            }
            let checksum = u64::from_str_radix(&b.xxh3, 16).map_err(|_| bad(format!("{what}: checksum `{}` is not hex", b.xxh3)))?;
            *slot = Some(BlobLocation { offset: b.offset, length: b.length, checksum, id: BlobId { layer: b.layer, expert: b.expert, scheme } });
        }
        let mut complete = Vec::with_capacity(locations.len());
        for (layer, experts) in locations.into_iter().enumerate() {
            let mut row = Vec::with_capacity(experts.len());
            for (expert, loc) in experts.into_iter().enumerate() {
                row.push(loc.ok_or_else(|| bad(format!("no blob for layer {layer} expert {expert}")))?);
            }
            complete.push(row);
        }
        Ok(Container { dir: dir.to_path_buf(), manifest, scheme, shape, activation: spec.moe.activation, locations: complete })
    }

    pub fn location(&self, layer: usize, expert: usize) -> Option<BlobLocation> {
        self.locations.get(layer)?.get(expert).copied()
    }

    /// Bytes one expert takes in memory once read: its matrices and scales, not the blob padding.
    pub fn expert_bytes(&self) -> u64 {
        let (sections, _) = expert_blob::layout(self.scheme, self.shape);
        sections.iter().map(|(_, len)| *len as u64).sum()
    }

    pub fn experts_path(&self) -> PathBuf {
        self.dir.join(EXPERTS_FILE)
    }

    /// The identity of the converted model: the source's fingerprint and both formats (an int4
    /// container is a different model from its bf16 source).
    pub fn fingerprint(&self) -> String {
        fingerprint_of(&self.manifest.source_fingerprint, &self.manifest.expert_quant, &self.manifest.dense_quant)
    }
}

/// The manifest alone, parsed but not checked against a spec (to compare one container with
/// another: a finished conversion, a mirror).
pub fn read_manifest(dir: &Path) -> Result<Manifest, LoadError> {
    let path = dir.join(MANIFEST_FILE);
    let value = shimmer_common::spec::read_json_file(&path, MAX_MANIFEST_BYTES)?;
    serde_json::from_value(value).map_err(|e| LoadError::malformed(&path, format!("invalid manifest: {e}")))
}

pub fn fingerprint_of(source: &str, expert_quant: &str, dense_quant: &str) -> String {
    let mut h = Hasher::new();
    for part in [FORMAT_NAME, source, expert_quant, dense_quant] {
        h.feed(part.as_bytes());
        h.feed(&[0]);
    }
    format!("{:016x}", h.finish())
}

/// The experts file's safetensors header for `count` blobs of `blob_bytes` in (layer, expert)
/// order, padded with spaces so the data starts at a multiple of 4096; returns it with the
/// 8-byte length prefix.
pub fn experts_header(keys: &[(usize, usize)], blob_bytes: u64) -> Vec<u8> {
    let mut json = String::from("{\"__metadata__\":{\"format\":\"shimmer-expert-blobs\",\"version\":\"1\"}");
    for (i, (l, e)) in keys.iter().enumerate() {
        let start = i as u64 * blob_bytes;
        json.push_str(&format!(",\"layers.{l}.experts.{e}\":{{\"dtype\":\"U8\",\"shape\":[{blob_bytes}],\"data_offsets\":[{start},{}]}}", start + blob_bytes));
    }
    json.push('}');
    let total = (8 + json.len()).div_ceil(expert_blob::BLOB_ALIGN) * expert_blob::BLOB_ALIGN;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&((total - 8) as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.resize(total, b' ');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_experts_header_is_valid_safetensors_with_aligned_data() {
        let keys = [(1, 0), (1, 1), (3, 0), (3, 1)];
        let header = experts_header(&keys, 8192);
        assert_eq!(header.len() % 4096, 0);
        let mut file = header.clone();
        file.resize(header.len() + 4 * 8192, 7);
        let entries = shimmer_common::checkpoint::parse_header(&file).unwrap();
        assert_eq!(entries.len(), 4);
        for (name, entry) in entries {
            let r = entry.byte_range();
            assert_eq!(r.start % 4096, 0, "{name}");
            assert_eq!(r.len(), 8192);
        }
    }
}
