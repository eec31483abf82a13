//! Weight matrices (row-major, `rows × cols`, as a `nn.Linear` weight stores them) and their
//! products with activation rows. Weights stay in their stored precision and are widened to f32
//! inside the dot product; activations and accumulation are f32.
//!
//! Every product is one canonical dot, run with the best ISA the machine has, so results do not
//! depend on the ISA, on threads or on which other rows share a call: `dot.rs`'s (64 FMA lanes,
//! f32 activations) for float and fp8 weights, `qdot.rs`'s (activations quantised to int8 per
//! block of 32, integer products) for int8 / int4 / MXFP4 weights — a matrix's `activations`
//! says which, and every node that loads the same matrix picks the same one.

use std::cell::Cell;

use shimmer_common::{DType, TensorView};

use crate::dot::{self, WeightRow};
use crate::qdot::{self, QuantRows};
use crate::transpose::transpose_into;
use crate::words::Words;

/// How a matrix's products treat their activation rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    /// As they are (f32): `dot.rs`.
    F32,
    /// Quantised to int8 per block of 32, integer products: `qdot.rs`. Only int8, int4 (whole
    /// blocks per group) and MXFP4 weights take it; others fall back to `F32`.
    Int8,
}

impl Activations {
    /// What a matrix stored as `data` uses unless told otherwise: integer products for the
    /// integer formats (a converted container's), f32 for the rest (checkpoints as they are).
    pub fn default_for(data: &WeightData) -> Self {
        match data {
            WeightData::Int8 { .. } | WeightData::Mxfp4 { .. } => Activations::Int8,
            WeightData::Int4 { group, .. } | WeightData::Int6 { group, .. } if *group > 0 && group.is_multiple_of(qdot::QBLOCK) => Activations::Int8,
            _ => Activations::F32,
        }
    }
}

thread_local! {
    /// Quantised activations, reused across calls on this thread (taken out while in use, so a
    /// nested call — rayon may run another product on this thread meanwhile — gets its own).
    static QUANT_SCRATCH: Cell<QuantRows> = Cell::new(QuantRows::default());
    /// A multi-row product's weight-row-major results before their transpose, reused the same way.
    static PRODUCT_SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// `f` over a scratch buffer of `len` floats whose contents are unspecified (every product here
/// writes all of it before reading any), without allocating or zeroing once this thread has
/// warmed up. A buffer above `PRODUCT_SCRATCH_KEPT` is freed after use rather than kept: a
/// long prompt's logits for every row (a vocabulary of 150 k × 512 rows is 300 MB) would
/// otherwise stay resident on the thread for good.
fn with_product_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut t = PRODUCT_SCRATCH.with(|c| c.take());
    if t.len() < len {
        t.resize(len, 0.0);
    }
    let r = f(&mut t[..len]);
    if t.capacity() <= PRODUCT_SCRATCH_KEPT {
        PRODUCT_SCRATCH.with(|c| c.set(t));
    }
    r
}

/// Floats of product scratch a thread keeps between products: 16 MiB, more than a 16-sequence
/// batch's head on a 151 k vocabulary takes.
const PRODUCT_SCRATCH_KEPT: usize = 1 << 22;

/// `f` over `xs` (rows of `n`) quantised — with the 4-bit layout when `nibbles` — without
/// allocating once this thread has warmed up.
fn with_quantized<R>(xs: &[f32], n: usize, nibbles: bool, f: impl FnOnce(&QuantRows) -> R) -> R {
    let mut q = QUANT_SCRATCH.with(|c| c.take());
    q.quantize_for(xs, n, nibbles);
    let r = f(&q);
    QUANT_SCRATCH.with(|c| c.set(q));
    r
}

/// Work below this many multiply-adds stays on the calling thread: rayon's fan-out costs more.
const PARALLEL_MIN_WORK: usize = 1 << 16;
/// The same for one activation row on the integer path, which streams a weight byte in well
/// under a nanosecond: below 2 M multiply-adds — the demo model's 6,144 × 256 head included —
/// waking another thread (a futex wake, ~10 µs on these virtual machines, and the woken thread
/// arrives when the caller has done most of the chunks) costs more than it saves. Demo int4
/// decode medians 3,526 → 3,698 tok/s with its head on one thread, once decode steps start on
/// a compute thread (`Engine::on_compute_thread`; while every step woke the pool from outside,
/// the other thread was often awake anyway and the split paid). Larger models decode as a team
/// (`team.rs`), which splits their products without waking anyone.
const QPARALLEL_MIN_WORK: usize = 1 << 21;

/// Whether a product of `work` multiply-adds is split: over the pool from `pool_min`, over an
/// active team (awake, cheap to share with) from `TEAM_MIN_WORK`; never when the caller said not.
fn spread(parallel: bool, work: usize, pool_min: usize) -> bool {
    parallel && (work >= pool_min || (work >= TEAM_MIN_WORK && crate::team::active().is_some()))
}

/// Weights from which a one-row product is split over an active team (`team.rs`): its threads
/// are awake and take a chunk in well under a microsecond, so products below rayon's bound
/// (`QPARALLEL_MIN_WORK`) pay too.
const TEAM_MIN_WORK: usize = 1 << 15;

#[derive(Debug, Clone, PartialEq)]
pub enum WeightData {
    F32(Words<f32>),
    /// bf16 bit patterns.
    Bf16(Words<u16>),
    /// IEEE half bit patterns.
    F16(Words<u16>),
    /// int8 per-row (`shimmer_common::quant`): `w = q · scales[row]`.
    Int8 {
        q: Words<i8>,
        scales: Words<f32>,
    },
    /// int4 group-scaled, nibbles `q + 8`, low first, rows padded to whole bytes; f16 scales.
    Int4 {
        packed: Words<u8>,
        scales: Words<u16>,
        group: usize,
    },
    /// int6 group-scaled (`shimmer_common::quant::Int6Matrix`): `lo` int4's packed layout of the
    /// low nibbles, `hi` the top two bits; f16 scales.
    Int6 {
        lo: Words<u8>,
        hi: Words<u8>,
        scales: Words<u16>,
        group: usize,
    },
    /// fp8-e4m3 with one scale per tile of `row_block × block` values: `w[r][c] = fp8(q) ·
    /// scales[r / row_block][c / block]`, `scales` being `⌈rows/row_block⌉ × ⌈cols/block⌉`.
    /// DeepSeek-V3's checkpoints have 128 × 128 tiles; MXFP8 (1 × 32) and NVFP4 (1 × 16, its
    /// e2m1 codes exact in e4m3) are held as row groups.
    Fp8 {
        q: Words<u8>,
        scales: Words<f32>,
        block: usize,
        row_block: usize,
    },
    /// MXFP4 (`shimmer_common::quant`): e2m1 nibbles, one e8m0 scale per 32 values of a row.
    Mxfp4 {
        packed: Words<u8>,
        scales: Words<u8>,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
    /// Which canonical dot its products use (`Activations::default_for` unless changed).
    pub activations: Activations,
}

impl Matrix {
    /// A matrix with its format's default activations.
    pub fn new(rows: usize, cols: usize, data: WeightData) -> Self {
        let activations = Activations::default_for(&data);
        Matrix { rows, cols, data, activations }
    }

    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols, "matrix data does not match its shape");
        Matrix::new(rows, cols, WeightData::F32(data.into()))
    }

    /// The same weights with products on `activations` (for measuring what integer activations
    /// cost: `shimmer quant-eval`). A format the integer path cannot take stays on f32.
    pub fn with_activations(mut self, activations: Activations) -> Self {
        self.activations = match activations {
            Activations::Int8 if Activations::default_for(&self.data) == Activations::Int8 => Activations::Int8,
            _ => Activations::F32,
        };
        self
    }

    /// Whether products quantise the activations (`qdot.rs`).
    #[inline]
    pub fn integer_products(&self) -> bool {
        // `activations` is a public field: a format the integer path cannot take stays on f32
        // whatever it says.
        self.activations == Activations::Int8 && Activations::default_for(&self.data) == Activations::Int8
    }

    /// Copies a 2-D checkpoint tensor, keeping its precision.
    pub fn from_view(view: &TensorView<'_>) -> Self {
        let (rows, cols) = match view.shape {
            [r, c] => (*r, *c),
            [n] => (1, *n),
            _ => (1, view.len()),
        };
        let data = match view.dtype {
            DType::F32 => WeightData::F32(view.to_f32().into()),
            DType::Bf16 => WeightData::Bf16(view.to_u16().into()),
            DType::F16 => WeightData::F16(view.to_u16().into()),
        };
        Matrix::new(rows, cols, data)
    }

    /// Wraps a quantised matrix (its buffers checked by `shimmer_common::quant::validate`).
    pub fn from_quant(m: shimmer_common::quant::QuantMatrix) -> Self {
        use shimmer_common::quant::QuantMatrix;
        match m {
            QuantMatrix::Int8 { rows, cols, q, scales } => Matrix::new(rows, cols, WeightData::Int8 { q: q.into(), scales: scales.into() }),
            QuantMatrix::Int4 { rows, cols, group, packed, scales } => {
                Matrix::new(rows, cols, WeightData::Int4 { packed: packed.into(), scales: scales.into(), group })
            }
            QuantMatrix::Mxfp4 { rows, cols, packed, scales } => Matrix::new(rows, cols, WeightData::Mxfp4 { packed: packed.into(), scales: scales.into() }),
        }
    }

    /// Wraps a 6-bit matrix (its buffers checked by `Int6Matrix::validate`).
    pub fn from_int6(m: shimmer_common::quant::Int6Matrix) -> Self {
        let shimmer_common::quant::Int6Matrix { rows, cols, group, lo, hi, scales } = m;
        Matrix::new(rows, cols, WeightData::Int6 { lo: lo.into(), hi: hi.into(), scales: scales.into(), group })
    }

    /// Wraps a block-scaled fp8 matrix (square `block × block` tiles), checking its buffers.
    /// Errors say what does not fit.
    pub fn from_fp8_blocks(rows: usize, cols: usize, q: Vec<u8>, scales: Vec<f32>, block: usize) -> Result<Self, String> {
        Self::from_fp8_tiles(rows, cols, q, scales, block, block)
    }

    /// Wraps an fp8 matrix with one scale per `row_block × block` tile, checking its buffers.
    pub fn from_fp8_tiles(rows: usize, cols: usize, q: Vec<u8>, scales: Vec<f32>, row_block: usize, block: usize) -> Result<Self, String> {
        if block == 0 || row_block == 0 {
            return Err(format!("fp8 scale tiles of {row_block}×{block}"));
        }
        if q.len() != rows * cols {
            return Err(format!("fp8 data is {} bytes, the shape {rows}×{cols} needs {}", q.len(), rows * cols));
        }
        let (br, bc) = (rows.div_ceil(row_block), cols.div_ceil(block));
        if scales.len() != br * bc {
            return Err(format!("block scales hold {} values, {rows}×{cols} in {row_block}×{block} blocks needs {br}×{bc}", scales.len()));
        }
        if let Some(bad) = scales.iter().find(|s| !s.is_finite()) {
            return Err(format!("a block scale is {bad}"));
        }
        if let Some(i) = q.iter().position(|b| b & 0x7f == 0x7f) {
            return Err(format!("element ({}, {}) is an fp8 NaN", i / cols.max(1), i % cols.max(1)));
        }
        Ok(Matrix::new(rows, cols, WeightData::Fp8 { q: q.into(), scales: scales.into(), block, row_block }))
    }

    /// Moves this matrix's weights into 2 MiB pages where the system allows it
    /// (`huge_pages.rs`): for weights loaded once and read every token. Changes no value.
    pub fn prefer_huge_pages(&self) {
        use crate::huge_pages::prefer_huge_pages as advise;
        // Best effort: a matrix left on small pages computes the same, only slower.
        let _moved = match &self.data {
            WeightData::F32(v) => advise(v),
            WeightData::Bf16(v) | WeightData::F16(v) => advise(v),
            WeightData::Int8 { q, .. } => advise(q),
            WeightData::Int4 { packed, .. } | WeightData::Mxfp4 { packed, .. } => advise(packed),
            WeightData::Int6 { lo, hi, .. } => advise(lo) && advise(hi),
            WeightData::Fp8 { q, .. } => advise(q),
        };
    }

    pub fn bytes(&self) -> usize {
        match &self.data {
            WeightData::F32(v) => v.len() * 4,
            WeightData::Bf16(v) | WeightData::F16(v) => v.len() * 2,
            WeightData::Int8 { q, scales } => q.len() + scales.len() * 4,
            WeightData::Int4 { packed, scales, .. } => packed.len() + scales.len() * 2,
            WeightData::Int6 { lo, hi, scales, .. } => lo.len() + hi.len() + scales.len() * 2,
            WeightData::Fp8 { q, scales, .. } => q.len() + scales.len() * 4,
            WeightData::Mxfp4 { packed, scales } => packed.len() + scales.len(),
        }
    }

    /// The matrix of rows `rows` of this one, in order, each row's stored bits and scale as they
    /// are (splitting a fused gate-up tensor moves rows; it never requantises them). fp8 whose
    /// tiles span several rows shares a scale across them and cannot be split: an error says so.
    pub fn take_rows(&self, rows: &[usize]) -> Result<Matrix, String> {
        if let Some(bad) = rows.iter().find(|r| **r >= self.rows) {
            return Err(format!("row {bad} of a {}-row matrix", self.rows));
        }
        fn gather<T: crate::words::Plain>(v: &[T], per_row: usize, rows: &[usize]) -> Words<T> {
            rows.iter().flat_map(|r| v[r * per_row..(r + 1) * per_row].iter().copied()).collect()
        }
        let cols = self.cols;
        let data = match &self.data {
            WeightData::F32(v) => WeightData::F32(gather(v, cols, rows)),
            WeightData::Bf16(v) => WeightData::Bf16(gather(v, cols, rows)),
            WeightData::F16(v) => WeightData::F16(gather(v, cols, rows)),
            WeightData::Int8 { q, scales } => WeightData::Int8 { q: gather(q, cols, rows), scales: gather(scales, 1, rows) },
            WeightData::Int4 { packed, scales, group } => {
                let (bpr, gpr) = (cols.div_ceil(2), cols.div_ceil(*group));
                WeightData::Int4 { packed: gather(packed, bpr, rows), scales: gather(scales, gpr, rows), group: *group }
            }
            WeightData::Int6 { lo, hi, scales, group } => {
                let (bpr, hpr, gpr) = (cols.div_ceil(2), shimmer_common::quant::Int6Matrix::hi_bytes_per_row(cols), cols.div_ceil(*group));
                WeightData::Int6 { lo: gather(lo, bpr, rows), hi: gather(hi, hpr, rows), scales: gather(scales, gpr, rows), group: *group }
            }
            WeightData::Mxfp4 { packed, scales } => {
                let (bpr, gpr) = (cols.div_ceil(2), cols.div_ceil(shimmer_common::quant::MXFP4_GROUP));
                WeightData::Mxfp4 { packed: gather(packed, bpr, rows), scales: gather(scales, gpr, rows) }
            }
            WeightData::Fp8 { q, scales, block, row_block: 1 } => {
                let gpr = cols.div_ceil(*block);
                WeightData::Fp8 { q: gather(q, cols, rows), scales: gather(scales, gpr, rows), block: *block, row_block: 1 }
            }
            WeightData::Fp8 { row_block, .. } => return Err(format!("fp8 rows share a scale per {row_block}-row block: they cannot be taken apart")),
        };
        Ok(Matrix { rows: rows.len(), cols, data, activations: self.activations })
    }

    /// Row `r` widened to f32 (embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let range = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            WeightData::F32(v) => out.copy_from_slice(&v[range]),
            WeightData::Bf16(v) => out.iter_mut().zip(&v[range]).for_each(|(o, b)| *o = bf16_to_f32(*b)),
            WeightData::F16(v) => out.iter_mut().zip(&v[range]).for_each(|(o, b)| *o = half::f16::from_bits(*b).to_f32()),
            WeightData::Int8 { q, scales } => out.iter_mut().zip(&q[range]).for_each(|(o, v)| *o = *v as f32 * scales[r]),
            WeightData::Int4 { .. } | WeightData::Int6 { .. } | WeightData::Fp8 { .. } | WeightData::Mxfp4 { .. } => {
                let row = self.row(r);
                for (c, o) in out.iter_mut().enumerate() {
                    *o = row.get(c);
                }
            }
        }
    }

    /// Row `r` as the dot kernels read it.
    #[inline]
    pub fn row(&self, r: usize) -> WeightRow<'_> {
        let range = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            WeightData::F32(v) => WeightRow::F32(&v[range]),
            WeightData::Bf16(v) => WeightRow::Bf16(&v[range]),
            WeightData::F16(v) => WeightRow::F16(&v[range]),
            WeightData::Int8 { q, scales } => WeightRow::Int8 { q: &q[range], scale: scales[r] },
            WeightData::Int4 { packed, scales, group } => {
                // A shift for the power-of-two groups every container uses: a division per row
                // is a measurable part of a 512-wide row's product.
                let gpr = if group.is_power_of_two() { (self.cols + group - 1) >> group.trailing_zeros() } else { self.cols.div_ceil(*group) };
                let bpr = self.cols.div_ceil(2);
                WeightRow::Int4 { packed: &packed[r * bpr..(r + 1) * bpr], scales: &scales[r * gpr..(r + 1) * gpr], group: *group, n: self.cols }
            }
            WeightData::Int6 { lo, hi, scales, group } => {
                let (bpr, hpr, gpr) = (self.cols.div_ceil(2), shimmer_common::quant::Int6Matrix::hi_bytes_per_row(self.cols), self.cols.div_ceil(*group));
                WeightRow::Int6 {
                    lo: &lo[r * bpr..(r + 1) * bpr],
                    hi: &hi[r * hpr..(r + 1) * hpr],
                    scales: &scales[r * gpr..(r + 1) * gpr],
                    group: *group,
                    n: self.cols,
                }
            }
            WeightData::Fp8 { q, scales, block, row_block } => {
                let gpr = self.cols.div_ceil(*block);
                let sr = (r / row_block) * gpr;
                WeightRow::Fp8 { q: &q[range], scales: &scales[sr..sr + gpr], group: *block }
            }
            WeightData::Mxfp4 { packed, scales } => {
                let (bpr, gpr) = (self.cols.div_ceil(2), self.cols.div_ceil(shimmer_common::quant::MXFP4_GROUP));
                WeightRow::Mxfp4 { packed: &packed[r * bpr..(r + 1) * bpr], scales: &scales[r * gpr..(r + 1) * gpr], n: self.cols }
            }
        }
    }

    #[inline]
    fn dot_row(&self, r: usize, x: &[f32]) -> f32 {
        dot::dot(&self.row(r), x)
    }

    /// `out = W · x` for one activation row (`x.len() == cols`, `out.len() == rows`).
    pub fn matvec(&self, x: &[f32], out: &mut [f32]) {
        self.matvec_on(x, out, true)
    }

    /// `matvec`, on the calling thread only when `parallel` is false (the caller already spreads
    /// independent products over the threads). Same bits either way.
    pub fn matvec_on(&self, x: &[f32], out: &mut [f32], parallel: bool) {
        assert_eq!(x.len(), self.cols, "matvec input length");
        assert_eq!(out.len(), self.rows, "matvec output length");
        if self.integer_products() {
            return with_quantized(x, self.cols, self.nibbles(), |q| self.qmatvec(&q.row(0), 0, out, parallel));
        }
        if let Some(team) = crate::team::active().filter(|_| parallel && self.rows * self.cols >= TEAM_MIN_WORK) {
            // One chunk per thread: a claim costs a cache line's trip between cores, about what
            // a small model's 16 rows take.
            let chunk = self.rows.div_ceil(team.threads()).max(16);
            crate::team::for_each_chunk_mut(team, out, chunk, |c, o| {
                for (i, slot) in o.iter_mut().enumerate() {
                    *slot = self.dot_row(c * chunk + i, x);
                }
            });
        } else if parallel && self.rows * self.cols >= PARALLEL_MIN_WORK {
            let chunk = (self.rows / (4 * rayon::current_num_threads()).max(1)).max(16);
            crate::team::chunks_mut(out, chunk, true, |c, o| {
                for (i, slot) in o.iter_mut().enumerate() {
                    *slot = self.dot_row(c * chunk + i, x);
                }
            });
        } else {
            for (r, slot) in out.iter_mut().enumerate() {
                *slot = self.dot_row(r, x);
            }
        }
    }

    /// Whether the integer path reads this matrix's weights as nibbles (int4, MXFP4).
    fn nibbles(&self) -> bool {
        self.qmatrix().is_some_and(|w| w.nibbles())
    }

    /// The integer path's view of this matrix's rows (int8, int4 and int6 of whole-block groups,
    /// MXFP4).
    fn qmatrix(&self) -> Option<qdot::QMatrix<'_>> {
        let (rows, cols) = (self.rows, self.cols);
        match &self.data {
            WeightData::Int8 { q, scales } => Some(qdot::QMatrix::int8(q, scales, rows, cols)),
            WeightData::Int4 { packed, scales, group } if *group > 0 && group.is_multiple_of(qdot::QBLOCK) => {
                Some(qdot::QMatrix::int4(packed, scales, *group, rows, cols))
            }
            WeightData::Int6 { lo, hi, scales, group } if *group > 0 && group.is_multiple_of(qdot::QBLOCK) => {
                Some(qdot::QMatrix::int6(lo, hi, scales, *group, rows, cols))
            }
            WeightData::Mxfp4 { packed, scales } => Some(qdot::QMatrix::mxfp4(packed, scales, rows, cols)),
            _ => None,
        }
    }

    /// `out[i] = W[first + i] · x` for a quantised activation row.
    fn qmatvec(&self, x: &qdot::QRow<'_>, first: usize, out: &mut [f32], parallel: bool) {
        let Some(w) = self.qmatrix() else { unreachable!("integer products are taken for integer formats only") };
        if let Some(team) = crate::team::active().filter(|_| parallel && out.len() * self.cols >= TEAM_MIN_WORK) {
            let chunk = (out.len().div_ceil(team.threads()).max(16) + 3) & !3;
            crate::team::for_each_chunk_mut(team, out, chunk, |c, o| qdot::qmatvec(&w, x, first + c * chunk, o));
        } else if parallel && out.len() * self.cols >= QPARALLEL_MIN_WORK {
            let chunk = ((out.len() / (4 * rayon::current_num_threads()).max(1)).max(16) + 3) & !3;
            crate::team::chunks_mut(out, chunk, true, |c, o| qdot::qmatvec(&w, x, first + c * chunk, o));
        } else {
            qdot::qmatvec(&w, x, first, out);
        }
    }

    /// `out = W[rows] · x`: the product with a contiguous block of rows only.
    pub fn matvec_rows(&self, rows: std::ops::Range<usize>, x: &[f32], out: &mut [f32]) {
        assert_eq!(x.len(), self.cols, "matvec input length");
        assert_eq!(out.len(), rows.len(), "matvec output length");
        if self.integer_products() {
            return with_quantized(x, self.cols, self.nibbles(), |q| self.qmatvec(&q.row(0), rows.start, out, false));
        }
        for (slot, r) in out.iter_mut().zip(rows) {
            *slot = self.dot_row(r, x);
        }
    }

    /// `out[i] = W · xs[i]` for `n` rows laid out back to back. Each weight row is read once
    /// per group of two or four activation rows (as registers allow); every result is exactly `matvec`'s for that row
    /// (`dot.rs`: one canonical order), whatever else is in the batch.
    pub fn matmul(&self, xs: &[f32], out: &mut [f32]) {
        self.matmul_on(xs, out, true)
    }

    /// `matmul`, on the calling thread only when `parallel` is false. Same bits either way.
    pub fn matmul_on(&self, xs: &[f32], out: &mut [f32], parallel: bool) {
        let n = xs.len() / self.cols.max(1);
        assert_eq!(xs.len(), n * self.cols, "matmul input is not whole rows");
        assert_eq!(out.len(), n * self.rows, "matmul output length");
        if n <= 1 {
            if n == 1 {
                self.matvec_on(xs, out, parallel);
            }
            return;
        }
        if self.integer_products() {
            return with_quantized(xs, self.cols, self.nibbles(), |q| self.qmatmul(q, out, parallel));
        }
        let x_rows: Vec<&[f32]> = xs.chunks_exact(self.cols).collect();
        // Transposed result (weight row major), filled in parallel over weight rows.
        with_product_scratch(self.rows * n, |t| self.matmul_f32_rows(&x_rows, t, out, parallel))
    }

    /// `matmul_on`'s non-integer path: every weight row's results into `t` (weight row major,
    /// all of it written), then transposed into `out`.
    fn matmul_f32_rows(&self, x_rows: &[&[f32]], t: &mut [f32], out: &mut [f32], parallel: bool) {
        let n = x_rows.len();
        let width = dot::batch_width();
        let per_row = |r: usize, o: &mut [f32]| {
            let w = self.row(r);
            let mut i = 0;
            while width >= 4 && i + 4 <= n {
                let [a, b, c, d] = dot::dots::<4>(&w, [x_rows[i], x_rows[i + 1], x_rows[i + 2], x_rows[i + 3]]);
                o[i..i + 4].copy_from_slice(&[a, b, c, d]);
                i += 4;
            }
            while i + 2 <= n {
                let [a, b] = dot::dots::<2>(&w, [x_rows[i], x_rows[i + 1]]);
                o[i..i + 2].copy_from_slice(&[a, b]);
                i += 2;
            }
            while i < n {
                o[i] = dot::dots::<1>(&w, [x_rows[i]])[0];
                i += 1;
            }
        };
        if spread(parallel, self.rows * self.cols * n, PARALLEL_MIN_WORK) {
            crate::team::chunks_mut(t, n, true, per_row);
        } else {
            t.chunks_mut(n).enumerate().for_each(|(r, o)| per_row(r, o));
        }
        transpose_into(t, self.rows, n, n, out);
    }

    /// `matmul_on` for integer products: pairs of weight rows against groups of quantised rows.
    fn qmatmul(&self, q: &QuantRows, out: &mut [f32], parallel: bool) {
        qmatmul_all(&[self], q, &mut [out], parallel);
    }
}

/// `a_out[i] = A · xs[i]` and `b_out[i] = B · xs[i]` for two matrices of one shape and format —
/// an expert's gate and up — in one pass: row r of both is decoded against each activation chunk
/// loaded once (`dot::dots_rows`), in one parallel region. Every result is exactly `matmul`'s.
pub fn matmul_pair(a: &Matrix, b: &Matrix, xs: &[f32], a_out: &mut [f32], b_out: &mut [f32], parallel: bool) {
    assert!(a.rows == b.rows && a.cols == b.cols, "paired matrices differ in shape");
    let (rows, cols) = (a.rows, a.cols);
    let n = xs.len() / cols.max(1);
    assert_eq!(xs.len(), n * cols, "matmul input is not whole rows");
    assert!(a_out.len() == n * rows && b_out.len() == n * rows, "matmul output length");
    if n == 0 {
        return;
    }
    let min_work = if n == 1 && a.integer_products() && b.integer_products() { QPARALLEL_MIN_WORK } else { PARALLEL_MIN_WORK };
    let go_parallel = spread(parallel, 2 * rows * cols * n, min_work);
    match (a.integer_products(), b.integer_products()) {
        (true, true) => return with_quantized(xs, cols, a.nibbles() || b.nibbles(), |q| qmatmul_pair(a, b, q, a_out, b_out, go_parallel)),
        (false, false) => {}
        _ => {
            // One of each kind: two products (the same bits as each alone).
            a.matmul_on(xs, a_out, parallel);
            b.matmul_on(xs, b_out, parallel);
            return;
        }
    }
    let x_rows = |i: usize| &xs[i * cols..(i + 1) * cols];
    if n == 1 {
        // Decode: straight into the outputs.
        let one = |(r, (oa, ob)): (usize, (&mut f32, &mut f32))| {
            let [ra, rb] = dot::dots_rows::<2, 1>([&a.row(r), &b.row(r)], [xs]);
            (*oa, *ob) = (ra[0], rb[0]);
        };
        if go_parallel {
            crate::team::chunk_pairs_mut(a_out, b_out, 16, true, |c, oa, ob| {
                oa.iter_mut().zip(ob.iter_mut()).enumerate().for_each(|(i, slots)| one((16 * c + i, slots)));
            });
        } else {
            a_out.iter_mut().zip(b_out.iter_mut()).enumerate().for_each(one);
        }
        return;
    }
    let width = dot::pair_batch_width();
    // Per weight row: both results for every activation row, side by side ([a; n] then [b; n]).
    let per_row = |r: usize, o: &mut [f32]| {
        let (wa, wb) = (a.row(r), b.row(r));
        let mut i = 0;
        while width >= 2 && i + 2 <= n {
            let [ra, rb] = dot::dots_rows::<2, 2>([&wa, &wb], [x_rows(i), x_rows(i + 1)]);
            o[i..i + 2].copy_from_slice(&ra);
            o[n + i..n + i + 2].copy_from_slice(&rb);
            i += 2;
        }
        while i < n {
            let [ra, rb] = dot::dots_rows::<2, 1>([&wa, &wb], [x_rows(i)]);
            o[i] = ra[0];
            o[n + i] = rb[0];
            i += 1;
        }
    };
    with_product_scratch(rows * 2 * n, |t| {
        if go_parallel {
            crate::team::chunks_mut(t, 2 * n, true, per_row);
        } else {
            t.chunks_mut(2 * n).enumerate().for_each(|(r, o)| per_row(r, o));
        }
        transpose_into(t, rows, n, 2 * n, a_out);
        transpose_into(&t[n..], rows, n, 2 * n, b_out);
    })
}

/// `outs[j][i] = mats[j] · xs[i]` for several matrices over the same rows (attention's q, k and
/// v): with integer products the rows are quantised once and every matrix's blocks of weight
/// rows go to one parallel region (one fork and join instead of one per matrix). Every result
/// is exactly each matrix's own `matmul`'s.
pub fn matmul_many(mats: &[&Matrix], xs: &[f32], outs: &mut [&mut [f32]]) {
    assert_eq!(mats.len(), outs.len(), "one output per matrix");
    let cols = mats.first().map_or(0, |m| m.cols);
    let n = xs.len() / cols.max(1);
    let shared = n > 1 && mats.iter().all(|m| m.cols == cols && m.integer_products());
    if !shared {
        for (m, out) in mats.iter().zip(outs.iter_mut()) {
            m.matmul(xs, out);
        }
        return;
    }
    assert_eq!(xs.len(), n * cols, "matmul input is not whole rows");
    for (m, out) in mats.iter().zip(outs.iter()) {
        assert_eq!(out.len(), n * m.rows, "matmul output length");
    }
    let nibbles = mats.iter().any(|m| m.nibbles());
    with_quantized(xs, cols, nibbles, |q| qmatmul_all(mats, q, outs, true));
}

/// Integer products of matrices over the same quantised rows (`qmatmul` is one of them): blocks
/// of every matrix's weight rows in one parallel region when there is enough work, then each
/// weight-row-major result transposed into its output.
fn qmatmul_all(mats: &[&Matrix], q: &QuantRows, outs: &mut [&mut [f32]], parallel: bool) {
    let n = q.rows();
    let acts: Vec<qdot::QRow<'_>> = (0..n).map(|i| q.row(i)).collect();
    let views: Vec<qdot::QMatrix<'_>> = mats.iter().map(|m| m.qmatrix().expect("integer products are taken for integer formats only")).collect();
    let total: usize = mats.iter().map(|m| m.rows * n).sum();
    with_product_scratch(total, |scratch| {
        // Each matrix's results in its own part of the scratch.
        let mut ts: Vec<&mut [f32]> = Vec::with_capacity(mats.len());
        let mut rest = scratch;
        for m in mats {
            let (t, tail) = std::mem::take(&mut rest).split_at_mut(m.rows * n);
            ts.push(t);
            rest = tail;
        }
        let work: usize = mats.iter().map(|m| m.rows * m.cols * n).sum();
        if spread(parallel, work, PARALLEL_MIN_WORK) {
            let mut pieces: Vec<(usize, usize, &mut [f32])> = Vec::new();
            for (j, (m, t)) in mats.iter().zip(ts.iter_mut()).enumerate() {
                let block = ((m.rows / (4 * rayon::current_num_threads()).max(1)).max(8) + 1) & !1;
                pieces.extend(t.chunks_mut(block * n).enumerate().map(|(c, o)| (j, c * block, o)));
            }
            crate::team::each_mut(&mut pieces, true, |(j, first, o)| qdot::qmatmul_t(&views[*j], &acts, *first, o));
        } else {
            for (w, t) in views.iter().zip(ts.iter_mut()) {
                qdot::qmatmul_t(w, &acts, 0, t);
            }
        }
        for ((m, t), out) in mats.iter().zip(&ts).zip(outs.iter_mut()) {
            transpose_into(t, m.rows, n, n, out);
        }
    })
}

/// `matmul_pair` for integer products.
fn qmatmul_pair(a: &Matrix, b: &Matrix, q: &QuantRows, a_out: &mut [f32], b_out: &mut [f32], parallel: bool) {
    let (rows, n) = (a.rows, q.rows());
    let (Some(qa), Some(qb)) = (a.qmatrix(), b.qmatrix()) else { unreachable!("integer products are taken for integer formats only") };
    if qa.fmt != qb.fmt {
        // Two formats (nothing converts so, but nothing forbids it): each its own product, the
        // same bits as together.
        if n == 1 {
            a.qmatvec(&q.row(0), 0, a_out, parallel);
            b.qmatvec(&q.row(0), 0, b_out, parallel);
        } else {
            a.qmatmul(q, a_out, parallel);
            b.qmatmul(q, b_out, parallel);
        }
        return;
    }
    if n == 1 {
        let x = q.row(0);
        if parallel {
            crate::team::chunk_pairs_mut(a_out, b_out, 16, true, |c, oa, ob| qdot::qmatvec_pair(&qa, &qb, &x, 16 * c, oa, ob));
        } else {
            qdot::qmatvec_pair(&qa, &qb, &x, 0, a_out, b_out);
        }
        return;
    }
    let acts: Vec<qdot::QRow<'_>> = (0..n).map(|i| q.row(i)).collect();
    // Per weight row, A's n results then B's.
    with_product_scratch(rows * 2 * n, |t| {
        if parallel {
            let block = (rows / (4 * rayon::current_num_threads()).max(1)).max(4);
            crate::team::chunks_mut(t, block * 2 * n, true, |c, o| qdot::qmatmul_pair_t(&qa, &qb, &acts, c * block, o));
        } else {
            qdot::qmatmul_pair_t(&qa, &qb, &acts, 0, t);
        }
        transpose_into(t, rows, n, 2 * n, a_out);
        transpose_into(&t[n..], rows, n, 2 * n, b_out);
    })
}

#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// A product too large for the scratch a thread keeps gives the same results and leaves no
    /// more than `PRODUCT_SCRATCH_KEPT` behind; a small one keeps its scratch for the next.
    #[test]
    fn a_large_products_scratch_is_not_kept() {
        let kept = || {
            PRODUCT_SCRATCH.with(|c| {
                let t = c.take();
                let n = t.capacity();
                c.set(t);
                n
            })
        };
        let (rows, cols, n) = (4200usize, 8usize, 1100usize);
        assert!(rows * n > PRODUCT_SCRATCH_KEPT);
        let (w, _) = random(rows, cols, 7);
        let xs: Vec<f32> = (0..n * cols).map(|i| ((i * 7919 % 997) as f32 / 997.0 - 0.5) * 2.0).collect();
        let m = Matrix::from_f32(rows, cols, w);
        for (n, large) in [(n, true), (3, false)] {
            let mut out = vec![0.0f32; n * rows];
            m.matmul_on(&xs[..n * cols], &mut out, false);
            for i in [0, n / 2, n - 1] {
                let mut one = vec![0.0f32; rows];
                m.matvec(&xs[i * cols..(i + 1) * cols], &mut one);
                assert_eq!(
                    out[i * rows..(i + 1) * rows].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "row {i} of {n}"
                );
            }
            if large {
                assert!(kept() <= PRODUCT_SCRATCH_KEPT, "kept {} floats", kept());
            } else {
                assert!(kept() >= 3 * rows, "a small product's scratch is kept");
            }
        }
    }

    fn random(rows: usize, cols: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut s = seed;
        let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
        let x: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * 3.0).collect();
        (w, x)
    }

    #[test]
    fn taken_rows_keep_their_bits_in_every_format() {
        use shimmer_common::quant::{quantize_int4, quantize_int8, quantize_mxfp4};
        let (rows, cols) = (6, 70);
        let (w, x) = random(rows, cols, 5);
        let formats = [
            Matrix::from_f32(rows, cols, w.clone()),
            Matrix::new(rows, cols, WeightData::Bf16(w.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect())),
            Matrix::new(rows, cols, WeightData::F16(w.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect())),
            Matrix::from_quant(quantize_int8(&w, rows, cols)),
            Matrix::from_quant(quantize_int4(&w, rows, cols, 32)),
            Matrix::from_quant(quantize_mxfp4(&w, rows, cols)),
            Matrix::from_int6(shimmer_common::quant::quantize_int6(&w, rows, cols, 32)),
            fp8_matrix(rows, cols, 1, 32),
        ];
        for m in formats {
            let odd = m.take_rows(&[1, 3, 5]).expect("rows in range");
            let (mut full, mut taken) = (vec![0.0; rows], vec![0.0; 3]);
            m.matvec(&x, &mut full);
            odd.matvec(&x, &mut taken);
            let want: Vec<u32> = [1, 3, 5].iter().map(|r| full[*r].to_bits()).collect();
            assert_eq!(taken.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "{:?}", std::mem::discriminant(&m.data));
            assert_eq!(odd.activations, m.activations);
        }
        assert!(Matrix::from_f32(2, 2, vec![0.0; 4]).take_rows(&[2]).is_err());
        let fp8 = Matrix::from_fp8_blocks(2, 2, vec![0; 4], vec![1.0], 128).expect("fp8");
        assert!(fp8.take_rows(&[0]).unwrap_err().contains("cannot be taken apart"));
        let fp8 = Matrix::from_fp8_tiles(2, 2, vec![0; 4], vec![1.0], 2, 2).expect("fp8");
        assert!(fp8.take_rows(&[0]).unwrap_err().contains("2-row block"));
    }

    #[test]
    fn matvec_matches_scalar_reference_on_awkward_shapes() {
        for &(rows, cols) in &[(1, 1), (1, 7), (3, 8), (5, 9), (17, 33), (64, 96), (300, 257), (2, 4099)] {
            let (w, x) = random(rows, cols, (rows * 31 + cols) as u64);
            for dtype in ["f32", "bf16", "f16"] {
                let m = match dtype {
                    "f32" => Matrix::from_f32(rows, cols, w.clone()),
                    "bf16" => Matrix::new(rows, cols, WeightData::Bf16(w.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect())),
                    _ => Matrix::new(rows, cols, WeightData::F16(w.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect())),
                };
                let widened: Vec<f32> = (0..rows)
                    .flat_map(|r| {
                        let mut o = vec![0.0; cols];
                        m.row_f32(r, &mut o);
                        o
                    })
                    .collect();
                let want = reference::matvec(&widened, rows, cols, &x);
                let mut got = vec![0.0; rows];
                m.matvec(&x, &mut got);
                for (g, w) in got.iter().zip(&want) {
                    // f32 accumulation against an f64 reference: error grows like sqrt(cols)·ulp·|terms|.
                    let tol = 1e-5 * (cols as f32).sqrt() * 3.0 * 4.0;
                    assert!((g - w).abs() <= tol, "{dtype} {rows}x{cols}: {g} vs {w}");
                }
            }
        }
    }

    /// A product split over a forward step's team gives the bits it gives on one thread (and
    /// through rayon), in every format, at sizes around the team's bound and past rayon's.
    #[test]
    fn products_over_a_team_are_the_same_bits() {
        use shimmer_common::quant::{quantize_int4, quantize_int8, quantize_mxfp4};
        const { assert!(4100 * 520 > QPARALLEL_MIN_WORK) };
        for &(rows, cols) in &[(128, 256), (300, 160), (1030, 64), (2049, 48), (4100, 520)] {
            let (w, x) = random(rows, cols, (rows + 3 * cols) as u64);
            let mut mats = vec![Matrix::new(rows, cols, WeightData::F32(w.clone().into()))];
            for q in [quantize_int8(&w, rows, cols), quantize_mxfp4(&w, rows, cols), quantize_int4(&w, rows, cols, 32)] {
                mats.push(Matrix::from_quant(q));
            }
            mats.push(Matrix::from_int6(shimmer_common::quant::quantize_int6(&w, rows, cols, 64)));
            for m in &mats {
                let (mut alone, mut pooled) = (vec![0.0f32; rows], vec![0.0f32; rows]);
                m.matvec_on(&x, &mut alone, false);
                m.matvec_on(&x, &mut pooled, true);
                let _turn = crate::team::test_turn();
                let teamed = crate::team::with_team(3, || {
                    assert!(crate::team::active().is_some(), "a team while no other is active");
                    let mut out = vec![0.0f32; rows];
                    m.matvec_on(&x, &mut out, true);
                    out
                });
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&teamed), bits(&alone), "{rows}x{cols} {}", m.integer_products());
                assert_eq!(bits(&pooled), bits(&alone));
            }
        }
    }

    /// A prompt's products over a team (its step is one: `Decoder::forward_segments`) — several
    /// rows through one matrix, q/k/v together, gate and up together, one row or many — give the
    /// bits they give on one thread, in every format.
    #[test]
    fn multi_row_products_over_a_team_are_the_same_bits() {
        use shimmer_common::quant::{quantize_int4, quantize_int8, quantize_mxfp4};
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for &(rows, cols, n) in &[(256, 256, 64), (64, 256, 7), (300, 160, 1), (96, 64, 9)] {
            let (w, _) = random(rows, cols, (rows + cols + n) as u64);
            let (xs, _) = random(n, cols, (7 * rows + cols) as u64);
            let mut mats = vec![Matrix::new(rows, cols, WeightData::F32(w.clone().into()))];
            for q in [quantize_int8(&w, rows, cols), quantize_mxfp4(&w, rows, cols), quantize_int4(&w, rows, cols, 32)] {
                mats.push(Matrix::from_quant(q));
            }
            mats.push(Matrix::from_int6(shimmer_common::quant::quantize_int6(&w, rows, cols, 32)));
            let squared: Vec<f32> = w.iter().map(|x| x * x).collect();
            let shifted: Vec<f32> = w.iter().map(|x| 0.25 - x).collect();
            for m in &mats {
                // Gate and up share a format; q, k and v may not.
                let (second, other) = if m.integer_products() {
                    (Matrix::from_quant(quantize_int4(&squared, rows, cols, 32)), Matrix::from_quant(quantize_int8(&shifted, rows, cols)))
                } else {
                    (Matrix::new(rows, cols, WeightData::F32(squared.clone().into())), Matrix::new(rows, cols, WeightData::F32(shifted.clone().into())))
                };
                let run = |teamed: bool| {
                    let go = || {
                        let mut one = vec![0.0f32; n * rows];
                        m.matmul(&xs, &mut one);
                        let (mut a, mut b) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
                        matmul_pair(m, &second, &xs, &mut a, &mut b, true);
                        let (mut c, mut d) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
                        matmul_many(&[m, &other], &xs, &mut [&mut c, &mut d]);
                        [one, a, b, c, d].map(|v| bits(&v))
                    };
                    if teamed {
                        crate::team::with_team(2, || {
                            assert!(crate::team::active().is_some(), "a team while no other is active");
                            go()
                        })
                    } else {
                        go()
                    }
                };
                let _turn = crate::team::test_turn();
                assert_eq!(run(true), run(false), "{rows}x{cols}, {n} rows, integer {}", m.integer_products());
            }
        }
    }

    #[test]
    fn quantised_matvec_matches_the_dequantised_reference() {
        use shimmer_common::quant::{dequantize, quantize_int4, quantize_int8, quantize_mxfp4};
        for &(rows, cols) in &[(1, 1), (3, 7), (5, 33), (17, 64), (4, 129), (2, 300)] {
            let (w, x) = random(rows, cols, (rows * 7 + cols) as u64);
            let mut formats = vec![quantize_int8(&w, rows, cols), quantize_mxfp4(&w, rows, cols)];
            for g in [32, 64, 128] {
                formats.push(quantize_int4(&w, rows, cols, g));
            }
            let mats = formats.into_iter().map(|qm| (format!("{qm:?}").chars().take(4).collect::<String>(), dequantize(&qm), Matrix::from_quant(qm))).chain(
                [32, 64, 128].map(|g| {
                    let six = shimmer_common::quant::quantize_int6(&w, rows, cols, g);
                    (format!("int6-g{g}"), six.dequantize(), Matrix::from_int6(six))
                }),
            );
            for (label, decoded, m) in mats {
                let want = reference::matvec(&decoded, rows, cols, &x);
                let m = m.with_activations(Activations::F32);
                let mut got = vec![0.0; rows];
                m.matvec(&x, &mut got);
                let mut widened = vec![0.0; cols];
                for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!((g - w).abs() <= 1e-4 * (cols as f32).sqrt() * 4.0, "{label} {rows}x{cols}: {g} vs {w}");
                    m.row_f32(r, &mut widened);
                    let refrow = reference::matvec(&widened, 1, cols, &x)[0];
                    assert!((refrow - w).abs() <= 1e-4 * (cols as f32).sqrt() * 4.0);
                }
            }
        }
    }

    #[test]
    fn integer_products_are_the_qdot_of_each_row_within_the_activation_rounding() {
        use shimmer_common::quant::{dequantize, quantize_int4, quantize_int8, quantize_mxfp4};
        for &(rows, cols) in &[(1, 1), (3, 7), (5, 33), (17, 64), (4, 129), (40, 300), (64, 1024)] {
            let (w, x) = random(rows, cols, (rows * 5 + cols) as u64);
            let mut formats = vec![quantize_int8(&w, rows, cols), quantize_mxfp4(&w, rows, cols)];
            for g in [32, 64, 128] {
                formats.push(quantize_int4(&w, rows, cols, g));
            }
            let mut q = QuantRows::default();
            q.quantize(&x, cols);
            let mats = formats.into_iter().map(|qm| (dequantize(&qm), Matrix::from_quant(qm))).chain([32, 64, 128].map(|g| {
                let six = shimmer_common::quant::quantize_int6(&w, rows, cols, g);
                (six.dequantize(), Matrix::from_int6(six))
            }));
            for (decoded, m) in mats {
                assert!(m.integer_products(), "a container's formats take integer products");
                for parallel in [false, true] {
                    let mut got = vec![0.0; rows];
                    m.matvec_on(&x, &mut got, parallel);
                    for (r, g) in got.iter().enumerate() {
                        assert_eq!(g.to_bits(), qdot::qdot_scalar(&m.row(r), &q.row(0)).to_bits(), "{rows}x{cols} row {r}");
                        let exact: f64 = (0..cols).map(|c| decoded[r * cols + c] as f64 * x[c] as f64).sum();
                        let step: f64 = (0..cols).map(|c| (decoded[r * cols + c] as f64).abs() * q.row(0).scale(c / qdot::QBLOCK) as f64 * 0.5).sum();
                        assert!((*g as f64 - exact).abs() <= step * 1.001 + 1e-5, "{rows}x{cols} row {r}: {g} vs {exact}");
                    }
                }
                let mut part = vec![0.0; rows.min(3)];
                m.matvec_rows(rows - part.len()..rows, &x, &mut part);
                for (i, g) in part.iter().enumerate() {
                    assert_eq!(g.to_bits(), qdot::qdot_scalar(&m.row(rows - part.len() + i), &q.row(0)).to_bits());
                }
                let f = m.clone().with_activations(Activations::F32);
                assert!(!f.integer_products());
            }
        }
        // Float formats never quantise their activations.
        assert!(!Matrix::from_f32(1, 1, vec![1.0]).with_activations(Activations::Int8).integer_products());
    }

    #[test]
    fn rows_are_batch_invariant() {
        let (rows, cols) = (300, 257);
        let (w, _) = random(rows, cols, 7);
        for m in [
            Matrix::from_quant(shimmer_common::quant::quantize_int4(&w, rows, cols, 64)),
            Matrix::from_quant(shimmer_common::quant::quantize_int8(&w, rows, cols)),
            Matrix::from_quant(shimmer_common::quant::quantize_mxfp4(&w, rows, cols)),
            Matrix::from_int6(shimmer_common::quant::quantize_int6(&w, rows, cols, 32)),
            Matrix::from_int6(shimmer_common::quant::quantize_int6(&w, rows, cols, 128)).with_activations(Activations::F32),
            Matrix::from_quant(shimmer_common::quant::quantize_int4(&w, rows, cols, 32)).with_activations(Activations::F32),
            fp8_matrix(rows, cols, 128, 128),
            fp8_matrix(rows, cols, 1, 16),
            Matrix::from_f32(rows, cols, w.clone()),
        ] {
            batch_invariant(&m);
        }
    }

    /// An fp8 matrix in `row_block × block` tiles with every non-NaN code and scales varying by
    /// tile.
    fn fp8_matrix(rows: usize, cols: usize, row_block: usize, block: usize) -> Matrix {
        let q: Vec<u8> = (0..rows * cols).map(|i| (i * 53 % 256) as u8).map(|b| if b & 0x7f == 0x7f { 0x3c } else { b }).collect();
        let scales: Vec<f32> = (0..rows.div_ceil(row_block) * cols.div_ceil(block)).map(|i| 0.001 * (i + 1) as f32).collect();
        Matrix::from_fp8_tiles(rows, cols, q, scales, row_block, block).unwrap()
    }

    #[test]
    fn fp8_matrices_equal_their_block_dequantisation_row_by_row() {
        for &(rows, cols, row_block, block) in
            &[(1, 1, 128, 128), (3, 7, 2, 2), (130, 300, 128, 128), (17, 65, 16, 16), (9, 100, 1, 32), (9, 100, 1, 16), (5, 40, 2, 8)]
        {
            let m = fp8_matrix(rows, cols, row_block, block);
            let WeightData::Fp8 { q, scales, .. } = &m.data else { unreachable!() };
            let want = shimmer_common::quant::dequantize_fp8_tiles(q, rows, cols, scales, row_block, block).unwrap();
            let mut row = vec![0.0; cols];
            for r in 0..rows {
                m.row_f32(r, &mut row);
                assert_eq!(row, want[r * cols..(r + 1) * cols], "{rows}x{cols}/{row_block}x{block} row {r}");
            }
            let x: Vec<f32> = (0..cols).map(|i| (i % 5) as f32 - 2.0).collect();
            let mut got = vec![0.0; rows];
            m.matvec(&x, &mut got);
            for (r, g) in got.iter().enumerate() {
                let f = Matrix::from_f32(1, cols, want[r * cols..(r + 1) * cols].to_vec());
                let mut alone = [0.0];
                f.matvec(&x, &mut alone);
                assert_eq!(g.to_bits(), alone[0].to_bits(), "fp8 row {r} equals its f32 dequantisation exactly");
            }
        }
        let e = Matrix::from_fp8_blocks(2, 2, vec![0x7f, 0, 0, 0], vec![1.0], 128).unwrap_err();
        assert!(e.contains("NaN"), "{e}");
        assert!(Matrix::from_fp8_blocks(2, 2, vec![0; 4], vec![1.0, 2.0], 128).unwrap_err().contains("block scales"));
        assert!(Matrix::from_fp8_blocks(2, 2, vec![0; 4], vec![f32::INFINITY], 128).is_err());
    }

    /// Several matrices over the same rows give each matrix's own bits, in every format and
    /// mix of formats, below and above the parallel bound.
    #[test]
    fn products_of_several_matrices_equal_each_alone() {
        use shimmer_common::quant::{quantize_int4, quantize_int8, quantize_mxfp4};
        for &(n, cols) in &[(1usize, 64usize), (3, 64), (9, 256), (64, 256)] {
            let shapes = [128usize, 64, 64];
            let (_, xs) = random(n, cols, 5 + n as u64);
            let xs: Vec<f32> = (0..n).flat_map(|_| xs.iter().copied()).enumerate().map(|(i, v)| v * (1.0 + i as f32 * 1e-3)).collect();
            let build = |k: usize, rows: usize| {
                let (w, _) = random(rows, cols, 40 + k as u64);
                match k % 5 {
                    0 => Matrix::from_quant(quantize_int8(&w, rows, cols)),
                    1 => Matrix::from_quant(quantize_int4(&w, rows, cols, 32)),
                    2 => Matrix::from_quant(quantize_mxfp4(&w, rows, cols)),
                    4 => Matrix::from_int6(shimmer_common::quant::quantize_int6(&w, rows, cols, 32)),
                    _ => Matrix::new(rows, cols, WeightData::F32(w.into())),
                }
            };
            for mix in [[0, 0, 0], [0, 1, 2], [1, 1, 1], [0, 3, 1], [4, 1, 4], [4, 4, 4]] {
                let mats: Vec<Matrix> = mix.iter().zip(shapes).map(|(k, rows)| build(*k, rows)).collect();
                let want: Vec<Vec<f32>> = mats
                    .iter()
                    .map(|m| {
                        let mut o = vec![0.0f32; n * m.rows];
                        m.matmul(&xs, &mut o);
                        o
                    })
                    .collect();
                let mut got: Vec<Vec<f32>> = mats.iter().map(|m| vec![f32::NAN; n * m.rows]).collect();
                let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|v| v.as_mut_slice()).collect();
                matmul_many(&mats.iter().collect::<Vec<_>>(), &xs, &mut outs);
                for (g, w) in got.iter().zip(&want) {
                    assert_eq!(
                        g.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        w.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{n} rows, {cols} columns, {mix:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn paired_products_equal_separate_ones() {
        let (rows, cols) = (71, 300);
        let (w, _) = random(2 * rows, cols, 3);
        let (wa, wb) = (&w[..rows * cols], &w[rows * cols..]);
        let mut s = 5u64;
        for n in [1usize, 2, 3, 5] {
            let xs: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s)).collect();
            for (a, b) in [
                (
                    Matrix::from_quant(shimmer_common::quant::quantize_int4(wa, rows, cols, 32)),
                    Matrix::from_quant(shimmer_common::quant::quantize_int4(wb, rows, cols, 32)),
                ),
                (
                    Matrix::from_quant(shimmer_common::quant::quantize_mxfp4(wa, rows, cols)),
                    Matrix::from_quant(shimmer_common::quant::quantize_mxfp4(wb, rows, cols)),
                ),
                (Matrix::from_f32(rows, cols, wa.to_vec()), Matrix::from_quant(shimmer_common::quant::quantize_int8(wb, rows, cols))),
                // Two integer formats in one pair.
                (
                    Matrix::from_quant(shimmer_common::quant::quantize_int4(wa, rows, cols, 64)),
                    Matrix::from_quant(shimmer_common::quant::quantize_int8(wb, rows, cols)),
                ),
            ] {
                let (mut pa, mut pb, mut sa, mut sb) = (vec![0.0; n * rows], vec![0.0; n * rows], vec![0.0; n * rows], vec![0.0; n * rows]);
                for parallel in [false, true] {
                    matmul_pair(&a, &b, &xs, &mut pa, &mut pb, parallel);
                    a.matmul(&xs, &mut sa);
                    b.matmul(&xs, &mut sb);
                    assert_eq!(pa.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), sa.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "n={n}");
                    assert_eq!(pb.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), sb.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "n={n}");
                }
            }
        }
    }

    fn batch_invariant(m: &Matrix) {
        let (rows, cols) = (m.rows, m.cols);
        let mut s = 99u64;
        let xs: Vec<f32> = (0..5 * cols).map(|_| lcg(&mut s)).collect();
        let mut batch = vec![0.0; 5 * rows];
        m.matmul(&xs, &mut batch);
        for i in 0..5 {
            let mut alone = vec![0.0; rows];
            m.matvec(&xs[i * cols..(i + 1) * cols], &mut alone);
            assert_eq!(alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), batch[i * rows..(i + 1) * rows].iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }
}
