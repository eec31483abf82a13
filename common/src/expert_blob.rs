//! One routed expert as one contiguous blob — the unit the expert container stores and the store
//! reads with a single `pread` (DESIGN.md §4).
//!
//! A blob holds six sections in this order: gate data, gate scales, up data, up scales, down data,
//! down scales (gate and up are `intermediate × hidden`, down is `hidden × intermediate`). Data is
//! bf16 words, int8 values or packed int4/e2m1 nibbles as `quant.rs` defines them; scales are f32
//! (empty for bf16), or e8m0 bytes for MXFP4. Each section starts at a multiple of 64 bytes, and the blob is zero-padded to a
//! multiple of 4 KiB so that consecutive blobs stay O_DIRECT-aligned. Everything is little-endian.
//! The blob's checksum is XXH3-64 of its identity — layer, expert and format — followed by all
//! its bytes, padding included: a blob moved to another expert's slot, or read as another
//! format, fails it as surely as a flipped byte does.

use crate::error::LoadError;
use crate::quant::{self, QuantMatrix, QuantScheme};

pub const BLOB_ALIGN: usize = 4096;
const SECTION_ALIGN: usize = 64;

/// A matrix as stored in a blob.
#[derive(Debug, Clone, PartialEq)]
pub enum StoredMatrix {
    /// bf16 bit patterns, row-major.
    Bf16 {
        rows: usize,
        cols: usize,
        words: Vec<u16>,
    },
    Quant(QuantMatrix),
}

/// Byte sizes of one matrix's data and scales under `scheme`.
fn sizes(scheme: QuantScheme, rows: usize, cols: usize) -> (usize, usize) {
    match scheme {
        QuantScheme::Bf16 => (rows * cols * 2, 0),
        QuantScheme::Int8PerRow => (rows * cols, rows * 4),
        QuantScheme::Int4 { group } => (rows * QuantMatrix::bytes_per_row_int4(cols), rows * QuantMatrix::groups_per_row(cols, group) * 4),
        QuantScheme::Mxfp4 => (rows * QuantMatrix::bytes_per_row_int4(cols), rows * QuantMatrix::groups_per_row(cols, quant::MXFP4_GROUP)),
    }
}

fn align(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

/// Section (offset, length) pairs for an expert of this shape, and the padded blob length.
pub fn layout(scheme: QuantScheme, hidden: usize, intermediate: usize) -> ([(usize, usize); 6], usize) {
    let shapes = [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)];
    let mut sections = [(0, 0); 6];
    let mut at = 0;
    for (m, (rows, cols)) in shapes.iter().enumerate() {
        let (data, scales) = sizes(scheme, *rows, *cols);
        for (s, len) in [(2 * m, data), (2 * m + 1, scales)] {
            at = align(at, SECTION_ALIGN);
            sections[s] = (at, len);
            at += len;
        }
    }
    (sections, align(at.max(1), BLOB_ALIGN))
}

/// Quantises an expert (f32 values) to `scheme` and lays it out as a blob.
pub fn encode(scheme: QuantScheme, hidden: usize, intermediate: usize, gate: &[f32], up: &[f32], down: &[f32]) -> Vec<u8> {
    let (sections, total) = layout(scheme, hidden, intermediate);
    let mut blob = vec![0u8; total];
    let shapes = [(intermediate, hidden, gate), (intermediate, hidden, up), (hidden, intermediate, down)];
    for (m, (rows, cols, w)) in shapes.iter().enumerate() {
        let (data, scales): (Vec<u8>, Vec<u8>) = match scheme {
            QuantScheme::Bf16 => (w.iter().flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes()).collect(), Vec::new()),
            QuantScheme::Int8PerRow => match quant::quantize_int8(w, *rows, *cols) {
                QuantMatrix::Int8 { q, scales, .. } => (q.iter().map(|v| *v as u8).collect(), scales.iter().flat_map(|s| s.to_le_bytes()).collect()),
                _ => unreachable!("int8 quantisation returns int8"),
            },
            QuantScheme::Int4 { group } => match quant::quantize_int4(w, *rows, *cols, group) {
                QuantMatrix::Int4 { packed, scales, .. } => (packed, scales.iter().flat_map(|s| s.to_le_bytes()).collect()),
                _ => unreachable!("int4 quantisation returns int4"),
            },
            QuantScheme::Mxfp4 => match quant::quantize_mxfp4(w, *rows, *cols) {
                QuantMatrix::Mxfp4 { packed, scales, .. } => (packed, scales),
                _ => unreachable!("mxfp4 quantisation returns mxfp4"),
            },
        };
        let (d, s) = (sections[2 * m], sections[2 * m + 1]);
        blob[d.0..d.0 + d.1].copy_from_slice(&data);
        blob[s.0..s.0 + s.1].copy_from_slice(&scales);
    }
    blob
}

/// Which expert a blob is, as its checksum binds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobId {
    pub layer: usize,
    pub expert: usize,
    pub scheme: QuantScheme,
}

/// The checksum of the blob `id` is: its identity, then its bytes.
pub fn checksum(id: BlobId, blob: &[u8]) -> u64 {
    let mut h = crate::checksum::Hasher::new();
    h.feed(b"shimmer-expert-blob\0");
    h.feed(&(id.layer as u64).to_le_bytes());
    h.feed(&(id.expert as u64).to_le_bytes());
    h.feed(id.scheme.name().as_bytes());
    h.feed(&[0]);
    h.feed(blob);
    h.finish()
}

/// Reads `[gate, up, down]` back from a blob, checking its length and (when given) its checksum
/// as the blob `id`; `what` names the blob in errors (file, layer, expert).
pub fn decode(
    blob: &[u8],
    scheme: QuantScheme,
    hidden: usize,
    intermediate: usize,
    expected_checksum: Option<(BlobId, u64)>,
    what: &str,
) -> Result<[StoredMatrix; 3], LoadError> {
    let (sections, total) = layout(scheme, hidden, intermediate);
    if blob.len() != total {
        return Err(LoadError::malformed(what, format!("blob is {} bytes, its layout needs {total} (truncated or from another format)", blob.len())));
    }
    if let Some((id, want)) = expected_checksum {
        if id.scheme != scheme {
            return Err(LoadError::malformed(what, format!("checked as a {} blob but read as {}", id.scheme.name(), scheme.name())));
        }
        let got = checksum(id, blob);
        if got != want {
            return Err(LoadError::malformed(
                what,
                format!(
                    "checksum mismatch (xxh3 {got:016x} for layer {} expert {}, manifest says {want:016x}): damaged, or another expert's blob",
                    id.layer, id.expert
                ),
            ));
        }
    }
    let shapes = [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)];
    let f32s = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<f32>>();
    let mut out = Vec::with_capacity(3);
    for (m, (rows, cols)) in shapes.iter().enumerate() {
        let (d, s) = (sections[2 * m], sections[2 * m + 1]);
        let (data, scales) = (&blob[d.0..d.0 + d.1], &blob[s.0..s.0 + s.1]);
        let matrix = match scheme {
            QuantScheme::Bf16 => {
                StoredMatrix::Bf16 { rows: *rows, cols: *cols, words: data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect() }
            }
            QuantScheme::Int8PerRow => {
                StoredMatrix::Quant(QuantMatrix::Int8 { rows: *rows, cols: *cols, q: data.iter().map(|v| *v as i8).collect(), scales: f32s(scales) })
            }
            QuantScheme::Int4 { group } => {
                StoredMatrix::Quant(QuantMatrix::Int4 { rows: *rows, cols: *cols, group, packed: data.to_vec(), scales: f32s(scales) })
            }
            QuantScheme::Mxfp4 => StoredMatrix::Quant(QuantMatrix::Mxfp4 { rows: *rows, cols: *cols, packed: data.to_vec(), scales: scales.to_vec() }),
        };
        if let StoredMatrix::Quant(q) = &matrix {
            quant::validate(q, what)?;
        }
        out.push(matrix);
    }
    let [g, u, d]: [StoredMatrix; 3] = out.try_into().map_err(|_| LoadError::malformed(what, "internal: expected three matrices"))?;
    Ok([g, u, d])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect()
    }

    #[test]
    fn every_format_round_trips_through_an_aligned_blob() {
        let (h, i) = (96, 40); // awkward: 40 is not a multiple of 32
        let (g, u, d) = (values(i * h, 1), values(i * h, 2), values(h * i, 3));
        for scheme in [
            QuantScheme::Bf16,
            QuantScheme::Int8PerRow,
            QuantScheme::Int4 { group: 32 },
            QuantScheme::Int4 { group: 64 },
            QuantScheme::Int4 { group: 128 },
            QuantScheme::Mxfp4,
        ] {
            let blob = encode(scheme, h, i, &g, &u, &d);
            assert_eq!(blob.len() % BLOB_ALIGN, 0, "{scheme:?}");
            let (sections, _) = layout(scheme, h, i);
            assert!(sections.iter().all(|(off, _)| off % 64 == 0));
            let id = BlobId { layer: 1, expert: 2, scheme };
            let sum = checksum(id, &blob);
            let back = decode(&blob, scheme, h, i, Some((id, sum)), "test").unwrap();
            for (m, (orig, rows, cols)) in [(&g, i, h), (&u, i, h), (&d, h, i)].into_iter().enumerate() {
                let restored: Vec<f32> = match &back[m] {
                    StoredMatrix::Bf16 { words, .. } => words.iter().map(|w| half::bf16::from_bits(*w).to_f32()).collect(),
                    StoredMatrix::Quant(q) => quant::dequantize(q),
                };
                // The blob holds exactly what the format's scalar definition gives.
                let want: Vec<f32> = match scheme {
                    QuantScheme::Bf16 => orig.iter().map(|v| half::bf16::from_f32(*v).to_f32()).collect(),
                    QuantScheme::Int8PerRow => quant::dequantize(&quant::quantize_int8(orig, rows, cols)),
                    QuantScheme::Int4 { group } => quant::dequantize(&quant::quantize_int4(orig, rows, cols, group)),
                    QuantScheme::Mxfp4 => quant::dequantize(&quant::quantize_mxfp4(orig, rows, cols)),
                };
                assert_eq!(restored, want, "{scheme:?} matrix {m}");
            }
        }
    }

    #[test]
    fn damaged_blobs_are_named_errors() {
        let (h, i) = (64, 32);
        let blob = encode(QuantScheme::Int4 { group: 32 }, h, i, &values(i * h, 1), &values(i * h, 2), &values(h * i, 3));
        let scheme = QuantScheme::Int4 { group: 32 };
        let id = BlobId { layer: 3, expert: 7, scheme };
        let sum = checksum(id, &blob);
        let what = "experts.safetensors layer 3 expert 7";
        let e = decode(&blob[..blob.len() - 1], scheme, h, i, Some((id, sum)), what).unwrap_err().to_string();
        assert!(e.contains("layer 3 expert 7") && e.contains("truncated"), "{e}");
        let mut bad = blob.clone();
        bad[100] ^= 1;
        let e = decode(&bad, scheme, h, i, Some((id, sum)), what).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch"), "{e}");
        // The right bytes under another identity: another expert, another layer, another format.
        for other in [BlobId { expert: 8, ..id }, BlobId { layer: 4, ..id }] {
            let e = decode(&blob, scheme, h, i, Some((other, sum)), what).unwrap_err().to_string();
            assert!(e.contains("checksum mismatch") && e.contains("another expert's blob"), "{other:?}: {e}");
        }
        assert_ne!(checksum(BlobId { scheme: QuantScheme::Int4 { group: 64 }, ..id }, &blob), sum);
        let e = decode(&blob, scheme, h, i, Some((BlobId { scheme: QuantScheme::Int8PerRow, ..id }, sum)), what).unwrap_err().to_string();
        assert!(e.contains("read as"), "{e}");
        // Negative scale bytes: refused even without a checksum.
        let (sections, _) = layout(QuantScheme::Int8PerRow, h, i);
        let mut blob = encode(QuantScheme::Int8PerRow, h, i, &values(i * h, 1), &values(i * h, 2), &values(h * i, 3));
        blob[sections[1].0..sections[1].0 + 4].copy_from_slice(&(-1.0f32).to_le_bytes());
        assert!(decode(&blob, QuantScheme::Int8PerRow, h, i, None, "x").is_err());
    }
}
