//! The routing trace format: which experts each token selected at each MoE layer, and which the
//! next MoE layer's router predicted from this layer's input (the one-layer-ahead prefetch hint).
//! Cache, pin and prefetch policies are replayed against these files.
//!
//! Layout (little-endian):
//! ```text
//! "SHMTRACE"                              8-byte magic
//! u32 version (1), u32 moe_layers L, u32 experts E, u32 top_k K
//! L × u32                                 the model layer index of each MoE layer
//! records, one per token:                 L × (K × u16 selected, K × u16 predicted)
//! ```
//! `predicted` is for the *next* MoE layer (`u16::MAX` where there is none: the last layer).
//! Records are appended as tokens are processed; a trailing partial record (a writer killed
//! mid-token) is dropped on read and counted, never misread.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::LoadError;

const MAGIC: &[u8; 8] = b"SHMTRACE";
pub const VERSION: u32 = 1;
/// No prediction (the last MoE layer has no next layer).
pub const NONE: u16 = u16::MAX;
/// Largest trace read into memory.
pub const MAX_TRACE_BYTES: u64 = 4 << 30;

/// Trace files fail like every other file shimmer reads: the path and the problem.
pub type TraceError = LoadError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceHeader {
    pub layers: Vec<u32>,
    pub experts: u32,
    pub top_k: u32,
}

impl TraceHeader {
    fn record_u16s(&self) -> usize {
        self.layers.len() * self.top_k as usize * 2
    }
}

/// One token's routing: per MoE layer, the selected experts and the next layer's predicted ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRecord {
    pub selected: Vec<Vec<u16>>,
    pub predicted: Vec<Vec<u16>>,
}

pub struct TraceWriter {
    path: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
    header: TraceHeader,
}

impl TraceWriter {
    pub fn create(path: &Path, header: TraceHeader) -> Result<Self, TraceError> {
        let io = |source| LoadError::io(path, source);
        if header.experts as usize > NONE as usize || header.top_k == 0 || header.layers.is_empty() {
            return Err(LoadError::malformed(path, "cannot trace this shape (experts < 65535, top_k ≥ 1, ≥ 1 MoE layer)"));
        }
        let mut file = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
        let mut head = MAGIC.to_vec();
        for v in [VERSION, header.layers.len() as u32, header.experts, header.top_k] {
            head.extend_from_slice(&v.to_le_bytes());
        }
        for l in &header.layers {
            head.extend_from_slice(&l.to_le_bytes());
        }
        file.write_all(&head).map_err(io)?;
        Ok(TraceWriter { path: path.to_path_buf(), file, header })
    }

    pub fn header(&self) -> &TraceHeader {
        &self.header
    }

    pub fn append(&mut self, record: &TokenRecord) -> Result<(), TraceError> {
        let k = self.header.top_k as usize;
        let mut buf = Vec::with_capacity(self.header.record_u16s() * 2);
        for (sel, pred) in record.selected.iter().zip(&record.predicted) {
            for i in 0..k {
                buf.extend_from_slice(&sel.get(i).copied().unwrap_or(NONE).to_le_bytes());
            }
            for i in 0..k {
                buf.extend_from_slice(&pred.get(i).copied().unwrap_or(NONE).to_le_bytes());
            }
        }
        self.file.write_all(&buf).map_err(|source| LoadError::io(&self.path, source))
    }

    pub fn flush(&mut self) -> Result<(), TraceError> {
        self.file.flush().map_err(|source| LoadError::io(&self.path, source))
    }
}

pub struct Trace {
    pub header: TraceHeader,
    pub tokens: Vec<TokenRecord>,
    /// Bytes of a partial last record that were dropped.
    pub dropped_bytes: usize,
}

impl Trace {
    pub fn read(path: &Path) -> Result<Self, TraceError> {
        let invalid = |problem: String| LoadError::malformed(path, problem);
        let meta = std::fs::metadata(path).map_err(|source| LoadError::io(path, source))?;
        if meta.len() > MAX_TRACE_BYTES {
            return Err(invalid(format!("{} bytes is over the {MAX_TRACE_BYTES} byte limit", meta.len())));
        }
        let bytes = std::fs::read(path).map_err(|source| LoadError::io(path, source))?;
        if bytes.len() < 24 || &bytes[..8] != MAGIC {
            return Err(invalid("not a shimmer routing trace".into()));
        }
        let u32_at = |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let version = u32_at(8);
        if version != VERSION {
            return Err(invalid(format!("trace format version {version} (this shimmer reads version {VERSION})")));
        }
        let (n_layers, experts, top_k) = (u32_at(12) as usize, u32_at(16), u32_at(20));
        if n_layers == 0 || n_layers > 4096 || top_k == 0 || top_k > 1024 || experts == 0 || experts >= NONE as u32 || top_k > experts {
            return Err(invalid(format!("implausible shape: {n_layers} layers, {experts} experts, top-{top_k}")));
        }
        let body = 24 + 4 * n_layers;
        if bytes.len() < body {
            return Err(invalid("truncated header".into()));
        }
        let layers: Vec<u32> = (0..n_layers).map(|i| u32_at(24 + 4 * i)).collect();
        let header = TraceHeader { layers, experts, top_k };
        let k = top_k as usize;
        let rec_bytes = header.record_u16s() * 2;
        let data = &bytes[body..];
        let count = data.len() / rec_bytes;
        let mut tokens = Vec::with_capacity(count);
        for (t, rec) in data.chunks_exact(rec_bytes).enumerate() {
            let v: Vec<u16> = rec.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
            let mut selected = Vec::with_capacity(n_layers);
            let mut predicted = Vec::with_capacity(n_layers);
            for l in 0..n_layers {
                let sel = &v[l * 2 * k..l * 2 * k + k];
                if let Some(bad) = sel.iter().find(|e| **e as u32 >= experts) {
                    return Err(invalid(format!("token {t}, MoE layer {l}: expert {bad} out of range ({experts} experts)")));
                }
                selected.push(sel.to_vec());
                predicted.push(v[l * 2 * k + k..(l + 1) * 2 * k].iter().copied().filter(|e| (*e as u32) < experts).collect());
            }
            tokens.push(TokenRecord { selected, predicted });
        }
        Ok(Trace { header, tokens, dropped_bytes: data.len() % rec_bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t");
        let header = TraceHeader { layers: vec![1, 2], experts: 8, top_k: 2 };
        let mut w = TraceWriter::create(&path, header.clone()).unwrap();
        let recs: Vec<TokenRecord> =
            (0..5u16).map(|t| TokenRecord { selected: vec![vec![t, t + 1], vec![7, t]], predicted: vec![vec![t + 2, 0], vec![]] }).collect();
        for r in &recs {
            w.append(r).unwrap();
        }
        w.flush().unwrap();
        drop(w);
        let t = Trace::read(&path).unwrap();
        assert_eq!(t.header, header);
        assert_eq!(t.tokens, recs);
        assert_eq!(t.dropped_bytes, 0);
        // A writer killed mid-record: the partial token is dropped and counted.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(&[1, 0, 2]);
        std::fs::write(&path, &bytes).unwrap();
        let t = Trace::read(&path).unwrap();
        assert_eq!((t.tokens.len(), t.dropped_bytes), (5, 3));
        // Bad files are named errors.
        bytes[8] = 9;
        std::fs::write(&path, &bytes).unwrap();
        assert!(Trace::read(&path).err().unwrap().to_string().contains("version 9"));
        std::fs::write(&path, b"nonsense").unwrap();
        assert!(Trace::read(&path).err().unwrap().to_string().contains("not a shimmer routing trace"));
    }
}
