//! One routed expert as one contiguous blob — the unit the expert container stores and the store
//! reads with a single `pread` (DESIGN.md §4).
//!
//! A blob holds six sections in this order: gate data, gate scales, up data, up scales, down data,
//! down scales (gate and up are `intermediate × hidden`, down is `hidden × intermediate`), then,
//! for experts with biases (gpt-oss), three more: the gate, up and down biases as f32
//! (`intermediate`, `intermediate`, `hidden` values; absent — zero bytes — otherwise). Data is
//! bf16 words, int8 values or packed int4/e2m1 nibbles as `quant.rs` defines them; scales are f32
//! for int8, f16 for int4, e8m0 bytes for MXFP4 (empty for bf16). Each section starts at a multiple of 64 bytes, and the blob is zero-padded to a
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

/// The shape every blob of a container shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobShape {
    pub hidden: usize,
    pub intermediate: usize,
    /// Each expert carries gate, up and down biases.
    pub biased: bool,
}

impl BlobShape {
    /// The shape of `spec`'s routed experts.
    pub fn of(spec: &crate::ModelSpec) -> Self {
        BlobShape { hidden: spec.hidden_size, intermediate: spec.moe.expert_intermediate_size, biased: spec.moe.expert_bias }
    }
}

/// What a blob holds: `[gate, up, down]`, and their biases if the experts have them.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredExpert {
    pub matrices: [StoredMatrix; 3],
    pub bias: Option<[Vec<f32>; 3]>,
}

/// Byte sizes of one matrix's data and scales under `scheme`.
fn sizes(scheme: QuantScheme, rows: usize, cols: usize) -> (usize, usize) {
    match scheme {
        QuantScheme::Bf16 => (rows * cols * 2, 0),
        QuantScheme::Int8PerRow => (rows * cols, rows * 4),
        QuantScheme::Int4 { group } => (rows * QuantMatrix::bytes_per_row_int4(cols), rows * QuantMatrix::groups_per_row(cols, group) * 2),
        QuantScheme::Mxfp4 => (rows * QuantMatrix::bytes_per_row_int4(cols), rows * QuantMatrix::groups_per_row(cols, quant::MXFP4_GROUP)),
    }
}

fn align(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

/// Section (offset, length) pairs for an expert of this shape (six matrix sections, three bias
/// sections), and the padded blob length.
pub fn layout(scheme: QuantScheme, shape: BlobShape) -> ([(usize, usize); 9], usize) {
    let BlobShape { hidden, intermediate, biased } = shape;
    let shapes = [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)];
    let mut sections = [(0, 0); 9];
    let mut at = 0;
    let biases = if biased { [intermediate * 4, intermediate * 4, hidden * 4] } else { [0; 3] };
    let lengths = shapes.iter().flat_map(|(rows, cols)| {
        let (data, scales) = sizes(scheme, *rows, *cols);
        [data, scales]
    });
    for (s, len) in lengths.chain(biases).enumerate() {
        at = align(at, SECTION_ALIGN);
        sections[s] = (at, len);
        at += len;
    }
    (sections, align(at.max(1), BLOB_ALIGN))
}

/// Quantises an expert (f32 values) to `scheme` and lays it out as a blob, with its biases
/// (f32, as they are) when the shape says the experts have them.
pub fn encode(scheme: QuantScheme, shape: BlobShape, [gate, up, down]: [&[f32]; 3], bias: Option<[&[f32]; 3]>) -> Vec<u8> {
    let BlobShape { hidden, intermediate, .. } = shape;
    let (sections, total) = layout(scheme, shape);
    let mut blob = vec![0u8; total];
    if let Some(biases) = bias.filter(|_| shape.biased) {
        for (b, (off, len)) in biases.iter().zip(&sections[6..]) {
            let bytes: Vec<u8> = b.iter().flat_map(|v| v.to_le_bytes()).collect();
            // A bias of the wrong length is the caller's bug; the blob keeps its layout.
            let n = bytes.len().min(*len);
            blob[*off..*off + n].copy_from_slice(&bytes[..n]);
        }
    }
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

/// The matrices' `(rows, cols)`: gate, up (`intermediate × hidden`), down (`hidden × intermediate`).
pub fn matrix_shapes(shape: BlobShape) -> [(usize, usize); 3] {
    let BlobShape { hidden, intermediate, .. } = shape;
    [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
}

/// Checks a blob as `decode` does — its length against the layout, (when given) its checksum as
/// the blob `id`, every matrix's scales — and returns its sections (`layout`'s), copying nothing:
/// for a reader that views the blob's bytes in place. `what` names the blob in errors.
pub fn check(
    blob: &[u8],
    scheme: QuantScheme,
    shape: BlobShape,
    expected_checksum: Option<(BlobId, u64)>,
    what: &str,
) -> Result<[(usize, usize); 9], LoadError> {
    let (sections, total) = layout(scheme, shape);
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
    // The lengths follow from the layout; what is left to check is the scales (`quant::validate`'s
    // rules, on the stored bytes).
    for m in 0..3 {
        let (at, len) = sections[2 * m + 1];
        let scales = &blob[at..at + len];
        let ok = match scheme {
            QuantScheme::Bf16 => true,
            QuantScheme::Int8PerRow => scales.chunks_exact(4).all(|c| {
                let s = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                s.is_finite() && s >= 0.0
            }),
            QuantScheme::Int4 { group } => {
                matches!(group, 32 | 64 | 128) && scales.chunks_exact(2).all(|c| quant::int4_scale_ok(u16::from_le_bytes([c[0], c[1]])))
            }
            QuantScheme::Mxfp4 => !scales.contains(&255),
        };
        if !ok {
            return Err(LoadError::malformed(what, "quantised data does not match its shape, or a scale is negative or not finite"));
        }
    }
    Ok(sections)
}

/// The gate, up and down biases of a blob `check` passed (`sections` its answer), when the shape
/// has them: f32 copies, a few KB.
pub fn biases(blob: &[u8], shape: BlobShape, sections: &[(usize, usize); 9]) -> Option<[Vec<f32>; 3]> {
    let f32s = |(at, len): (usize, usize)| blob[at..at + len].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<f32>>();
    shape.biased.then(|| [6, 7, 8].map(|s| f32s(sections[s])))
}

/// Reads an expert back from a blob into matrices of its own, checked as `check` does.
pub fn decode(blob: &[u8], scheme: QuantScheme, shape: BlobShape, expected_checksum: Option<(BlobId, u64)>, what: &str) -> Result<StoredExpert, LoadError> {
    let sections = check(blob, scheme, shape, expected_checksum, what)?;
    let f32s = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<f32>>();
    let matrices = matrix_shapes(shape).into_iter().enumerate().map(|(m, (rows, cols))| {
        let (d, s) = (sections[2 * m], sections[2 * m + 1]);
        let (data, scales) = (&blob[d.0..d.0 + d.1], &blob[s.0..s.0 + s.1]);
        match scheme {
            QuantScheme::Bf16 => StoredMatrix::Bf16 { rows, cols, words: data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect() },
            QuantScheme::Int8PerRow => StoredMatrix::Quant(QuantMatrix::Int8 { rows, cols, q: data.iter().map(|v| *v as i8).collect(), scales: f32s(scales) }),
            QuantScheme::Int4 { group } => {
                let scales = scales.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
                StoredMatrix::Quant(QuantMatrix::Int4 { rows, cols, group, packed: data.to_vec(), scales })
            }
            QuantScheme::Mxfp4 => StoredMatrix::Quant(QuantMatrix::Mxfp4 { rows, cols, packed: data.to_vec(), scales: scales.to_vec() }),
        }
    });
    let [g, u, d]: [StoredMatrix; 3] = matrices.collect::<Vec<_>>().try_into().map_err(|_| LoadError::malformed(what, "internal: expected three matrices"))?;
    let bias = biases(blob, shape, &sections);
    Ok(StoredExpert { matrices: [g, u, d], bias })
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
        let (gb, ub, db) = (values(i, 4), values(i, 5), values(h, 6));
        for (scheme, biased) in [false, true].into_iter().flat_map(|b| {
            [
                QuantScheme::Bf16,
                QuantScheme::Int8PerRow,
                QuantScheme::Int4 { group: 32 },
                QuantScheme::Int4 { group: 64 },
                QuantScheme::Int4 { group: 128 },
                QuantScheme::Mxfp4,
            ]
            .map(|s| (s, b))
        }) {
            let shape = BlobShape { hidden: h, intermediate: i, biased };
            let blob = encode(scheme, shape, [&g, &u, &d], Some([&gb, &ub, &db]));
            assert_eq!(blob.len() % BLOB_ALIGN, 0, "{scheme:?}");
            let (sections, _) = layout(scheme, shape);
            assert!(sections.iter().all(|(off, _)| off % 64 == 0));
            let id = BlobId { layer: 1, expert: 2, scheme };
            let sum = checksum(id, &blob);
            let back = decode(&blob, scheme, shape, Some((id, sum)), "test").unwrap();
            assert_eq!(back.bias, biased.then(|| [gb.clone(), ub.clone(), db.clone()]), "{scheme:?}: biases exactly as given");
            if !biased {
                // Experts without biases lay out exactly as before biases existed.
                assert!(sections[6..].iter().all(|s| s.1 == 0));
                assert_eq!(blob.len(), align(sections[5].0 + sections[5].1, BLOB_ALIGN));
            }
            for (m, (orig, rows, cols)) in [(&g, i, h), (&u, i, h), (&d, h, i)].into_iter().enumerate() {
                let restored: Vec<f32> = match &back.matrices[m] {
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
        let shape = BlobShape { hidden: h, intermediate: i, biased: false };
        let blob = encode(QuantScheme::Int4 { group: 32 }, shape, [&values(i * h, 1), &values(i * h, 2), &values(h * i, 3)], None);
        let scheme = QuantScheme::Int4 { group: 32 };
        let id = BlobId { layer: 3, expert: 7, scheme };
        let sum = checksum(id, &blob);
        let what = "experts.safetensors layer 3 expert 7";
        let e = decode(&blob[..blob.len() - 1], scheme, shape, Some((id, sum)), what).unwrap_err().to_string();
        assert!(e.contains("layer 3 expert 7") && e.contains("truncated"), "{e}");
        let mut bad = blob.clone();
        bad[100] ^= 1;
        let e = decode(&bad, scheme, shape, Some((id, sum)), what).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch"), "{e}");
        // The right bytes under another identity: another expert, another layer, another format.
        for other in [BlobId { expert: 8, ..id }, BlobId { layer: 4, ..id }] {
            let e = decode(&blob, scheme, shape, Some((other, sum)), what).unwrap_err().to_string();
            assert!(e.contains("checksum mismatch") && e.contains("another expert's blob"), "{other:?}: {e}");
        }
        assert_ne!(checksum(BlobId { scheme: QuantScheme::Int4 { group: 64 }, ..id }, &blob), sum);
        let e = decode(&blob, scheme, shape, Some((BlobId { scheme: QuantScheme::Int8PerRow, ..id }, sum)), what).unwrap_err().to_string();
        assert!(e.contains("read as"), "{e}");
        // Negative scale bytes: refused even without a checksum.
        let (sections, _) = layout(QuantScheme::Int8PerRow, shape);
        let mut blob = encode(QuantScheme::Int8PerRow, shape, [&values(i * h, 1), &values(i * h, 2), &values(h * i, 3)], None);
        blob[sections[1].0..sections[1].0 + 4].copy_from_slice(&(-1.0f32).to_le_bytes());
        assert!(decode(&blob, QuantScheme::Int8PerRow, shape, None, "x").is_err());
        // int4's scales are f16: a negative or infinite one is refused too.
        let (sections, _) = layout(scheme, shape);
        for bits in [0xbc00u16, 0x7c00] {
            let mut blob = encode(scheme, shape, [&values(i * h, 1), &values(i * h, 2), &values(h * i, 3)], None);
            blob[sections[3].0..sections[3].0 + 2].copy_from_slice(&bits.to_le_bytes());
            assert!(decode(&blob, scheme, shape, None, "x").is_err(), "{bits:#x}");
        }
    }
}
