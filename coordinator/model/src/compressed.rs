//! DeepSeek-V4's attention (`CompressedSpec`): one shared key-value head — each position's key is
//! also its value — seen through a sliding window, beside compressed entries that summarise
//! whole windows of positions: every entry so far (heavily compressed layers) or those a
//! lightning indexer picks for the query (compressed sparse layers).
//!
//! Per position the cache holds its key (key slot; no value slot) and, in a compressed layer, in
//! its auxiliary slot: the compressor's projections of it (`wkv`, and `wgate` plus the position
//! bias `ape` of its place in its window), the indexer's likewise, and — at the last position of
//! a window — that window's entry and indexer key. So a cache cut at any length holds exactly
//! what those positions make, sessions store it like any cache, and nothing is recurrent.
//!
//! An entry of window `w` (positions `w·m..(w+1)·m`) is, per channel, the softmax over its slots'
//! scores of their values: the window's own slots, and in a sparse layer also the previous
//! window's slots of the other half of the projection (overlapping windows); then an RMSNorm and
//! the compressed rotary at position `w·m`. A query at `p` sees entries `w < (p + 1) / m`.
//!
//! Must never: let a query see a position past its own, or an entry whose window it has not
//! reached; choose entries by anything but score (the higher, then the earlier entry).

use shimmer_common::spec::{CompressKind, CompressedSpec};
use shimmer_common::{Checkpoint, LoadError, ModelSpec};
use shimmer_kernels::{attention::attend_gathered, ops, Matrix};

use crate::decoder::{matrix, name, vector, SegmentRows};
use crate::rope::Rope;

/// `x · rsqrt(mean(x²) + eps)` with no weight.
fn unweighted_rms_norm_in_place(x: &mut [f32], eps: f32) {
    let mean = ops::sum_of_squares(x) / x.len() as f32;
    let r = 1.0 / (mean + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= r);
}

/// A compressor: per position `kv` and `gate` projections of `width` (twice `dim` with
/// overlapping windows), pooled per window into an entry of `dim`.
struct Pool {
    rate: usize,
    dim: usize,
    overlap: bool,
    kv: Matrix,
    gate: Matrix,
    /// `rate × width`: added to the gate by place in the window.
    ape: Vec<f32>,
    norm: Vec<f32>,
}

impl Pool {
    fn load(ckpt: &Checkpoint, spec: &ModelSpec, prefix: &str, rate: usize, dim: usize, overlap: bool) -> Result<Self, LoadError> {
        let width = if overlap { 2 * dim } else { dim };
        let h = spec.hidden_size;
        Ok(Pool {
            rate,
            dim,
            overlap,
            kv: matrix(ckpt, spec, &format!("{prefix}.wkv.weight"), width, h)?,
            gate: matrix(ckpt, spec, &format!("{prefix}.wgate.weight"), width, h)?,
            ape: ckpt.get(&format!("{prefix}.ape"), &[rate, width])?.to_f32(),
            norm: vector(ckpt, &format!("{prefix}.norm.weight"), dim)?,
        })
    }

    fn width(&self) -> usize {
        if self.overlap {
            2 * self.dim
        } else {
            self.dim
        }
    }

    fn bytes(&self) -> usize {
        self.kv.bytes() + self.gate.bytes()
    }

    /// Per row of `x` (at positions `first..`): `[kv, gate + ape]` (2 × width).
    fn project(&self, x: &[f32], first: usize, out: &mut Vec<f32>) {
        let (w, n) = (self.width(), x.len() / self.kv.cols);
        let (mut kv, mut gate) = (vec![0.0f32; n * w], vec![0.0f32; n * w]);
        shimmer_kernels::matrix::matmul_pair(&self.kv, &self.gate, x, &mut kv, &mut gate, true);
        out.clear();
        for i in 0..n {
            out.extend_from_slice(&kv[i * w..(i + 1) * w]);
            let place = (first + i) % self.rate;
            out.extend(gate[i * w..(i + 1) * w].iter().zip(&self.ape[place * w..(place + 1) * w]).map(|(g, a)| g + a));
        }
    }

    /// The entry of window `w` from the projections of positions (`row(p)`: `[kv, score]`),
    /// normed and rotated at `w·rate`.
    fn entry<'a>(&self, w: usize, row: impl Fn(usize) -> &'a [f32], rope: &Rope, rope_dim: usize, eps: f32, out: &mut [f32]) {
        let (d, width) = (self.dim, self.width());
        // Slots: (position, offset of its half) — the previous window's first half, then this
        // window's own (second half when overlapping).
        let mut slots: Vec<(usize, usize)> = Vec::with_capacity(2 * self.rate);
        if self.overlap && w > 0 {
            slots.extend(((w - 1) * self.rate..w * self.rate).map(|p| (p, 0)));
        }
        let own = if self.overlap { d } else { 0 };
        slots.extend((w * self.rate..(w + 1) * self.rate).map(|p| (p, own)));
        let mut scores = vec![0.0f32; slots.len()];
        let mut pooled = vec![0.0f32; d];
        for (c, pc) in pooled.iter_mut().enumerate() {
            for ((p, half), s) in slots.iter().zip(scores.iter_mut()) {
                *s = row(*p)[width + half + c];
            }
            ops::softmax_in_place(&mut scores);
            *pc = slots.iter().zip(&scores).map(|((p, half), s)| s * row(*p)[half + c]).sum();
        }
        ops::rms_norm(&pooled, &self.norm, eps, out);
        let (mut cos, mut sin) = (vec![0.0f32; rope_dim / 2], vec![0.0f32; rope_dim / 2]);
        rope.cos_sin(w * self.rate, &mut cos, &mut sin);
        ops::rope_interleaved(&mut out[d - rope_dim..], &cos, &sin);
    }
}

struct Indexer {
    pool: Pool,
    q_b: Matrix,
    weights: Matrix,
    heads: usize,
    head_dim: usize,
    top_k: usize,
}

pub(crate) struct Compressed {
    q_a: Matrix,
    q_a_norm: Vec<f32>,
    q_b: Matrix,
    kv: Matrix,
    kv_norm: Vec<f32>,
    o_a: Matrix,
    o_b: Matrix,
    sinks: Vec<f32>,
    pool: Option<Pool>,
    indexer: Option<Indexer>,
    /// Main rotary on sliding layers, the compressed one elsewhere.
    rope: Rope,
    rope_dim: usize,
    window: usize,
    o_groups: usize,
    o_lora_rank: usize,
}

/// Where each part of a compressed layer's auxiliary row lies.
struct AuxLayout {
    pool: usize,
    indexer: usize,
    entry: usize,
    index_entry: usize,
    width: usize,
}

impl Compressed {
    pub fn load(ckpt: &Checkpoint, spec: &ModelSpec, c: &CompressedSpec, l: usize) -> Result<Self, LoadError> {
        let (h, d, nh) = (spec.hidden_size, spec.head_dim, spec.num_heads);
        let n = &c.names;
        let kind = c.kinds[l];
        let prefix = name(n.compressor, l);
        let pool = match kind {
            CompressKind::Sliding => None,
            CompressKind::Sparse => Some(Pool::load(ckpt, spec, &prefix, c.csa_rate, d, true)?),
            CompressKind::Heavy => Some(Pool::load(ckpt, spec, &prefix, c.hca_rate, d, false)?),
        };
        let indexer = match kind {
            CompressKind::Sparse => {
                let ix = name(n.indexer, l);
                Some(Indexer {
                    pool: Pool::load(ckpt, spec, &format!("{ix}.compressor"), c.csa_rate, c.indexer_head_dim, true)?,
                    q_b: matrix(ckpt, spec, &format!("{ix}.wq_b.weight"), c.indexer_heads * c.indexer_head_dim, c.q_lora_rank)?,
                    weights: matrix(ckpt, spec, &format!("{ix}.weights_proj.weight"), c.indexer_heads, h)?,
                    heads: c.indexer_heads,
                    head_dim: c.indexer_head_dim,
                    top_k: c.indexer_top_k,
                })
            }
            _ => None,
        };
        let rope = match kind {
            CompressKind::Sliding => Rope::new(&spec.rope, c.rope_dim),
            _ => Rope::new(&c.compress_rope, c.rope_dim),
        };
        Ok(Compressed {
            q_a: matrix(ckpt, spec, &name(n.q_a, l), c.q_lora_rank, h)?,
            q_a_norm: vector(ckpt, &name(n.q_a_norm, l), c.q_lora_rank)?,
            q_b: matrix(ckpt, spec, &name(n.q_b, l), nh * d, c.q_lora_rank)?,
            kv: matrix(ckpt, spec, &name(n.kv, l), d, h)?,
            kv_norm: vector(ckpt, &name(n.kv_norm, l), d)?,
            o_a: matrix(ckpt, spec, &name(n.o_a, l), c.o_groups * c.o_lora_rank, nh * d / c.o_groups)?,
            o_b: matrix(ckpt, spec, &name(n.o_b, l), h, c.o_groups * c.o_lora_rank)?,
            sinks: vector(ckpt, &name(n.sinks, l), nh)?,
            pool,
            indexer,
            rope,
            rope_dim: c.rope_dim,
            window: c.window,
            o_groups: c.o_groups,
            o_lora_rank: c.o_lora_rank,
        })
    }

    pub fn bytes(&self) -> usize {
        let mut total = self.q_a.bytes() + self.q_b.bytes() + self.kv.bytes() + self.o_a.bytes() + self.o_b.bytes();
        total += self.pool.as_ref().map_or(0, Pool::bytes);
        total += self.indexer.as_ref().map_or(0, |ix| ix.pool.bytes() + ix.q_b.bytes() + ix.weights.bytes());
        total
    }

    /// Values per position of this layer's auxiliary slot for head size `d` (0: a sliding layer).
    pub fn aux_width(spec: &ModelSpec, c: &CompressedSpec, l: usize) -> usize {
        Self::layout_of(spec.head_dim, c.kinds[l], c.indexer_head_dim).width
    }

    fn layout_of(d: usize, kind: CompressKind, index_dim: usize) -> AuxLayout {
        let (pool_w, index_w, index_entry) = match kind {
            CompressKind::Sliding => return AuxLayout { pool: 0, indexer: 0, entry: 0, index_entry: 0, width: 0 },
            CompressKind::Heavy => (2 * d, 0, 0),
            CompressKind::Sparse => (4 * d, 4 * index_dim, index_dim),
        };
        let entry = pool_w + index_w;
        AuxLayout { pool: 0, indexer: pool_w, entry, index_entry: entry + d, width: entry + d + index_entry }
    }

    fn layout(&self, d: usize) -> AuxLayout {
        match (&self.pool, &self.indexer) {
            (None, _) => Self::layout_of(d, CompressKind::Sliding, 0),
            (Some(_), None) => Self::layout_of(d, CompressKind::Heavy, 0),
            (Some(_), Some(ix)) => Self::layout_of(d, CompressKind::Sparse, ix.head_dim),
        }
    }

    pub fn forward(&self, spec: &ModelSpec, l: usize, x: &[f32], segments: &mut [SegmentRows<'_>], out: &mut [f32]) {
        let (h, d, nh) = (spec.hidden_size, spec.head_dim, spec.num_heads);
        let eps = spec.rms_norm_eps;
        let n = x.len() / h;
        let r = self.q_a.rows;
        let rd = self.rope_dim;
        // Projections of every row at once.
        let mut q_res = vec![0.0f32; n * r];
        self.q_a.matmul(x, &mut q_res);
        let mut scratch = vec![0.0f32; r.max(d)];
        for row in q_res.chunks_exact_mut(r) {
            ops::rms_norm(row, &self.q_a_norm, eps, &mut scratch[..r]);
            row.copy_from_slice(&scratch[..r]);
        }
        let mut q = vec![0.0f32; n * nh * d];
        self.q_b.matmul(&q_res, &mut q);
        q.chunks_exact_mut(d).for_each(|head| unweighted_rms_norm_in_place(head, eps));
        let mut kv = vec![0.0f32; n * d];
        self.kv.matmul(x, &mut kv);
        for row in kv.chunks_exact_mut(d) {
            ops::rms_norm(row, &self.kv_norm, eps, &mut scratch[..d]);
            row.copy_from_slice(&scratch[..d]);
        }
        let (mut index_q, mut index_w) = (Vec::new(), Vec::new());
        if let Some(ix) = &self.indexer {
            index_q = vec![0.0f32; n * ix.heads * ix.head_dim];
            ix.q_b.matmul(&q_res, &mut index_q);
            index_w = vec![0.0f32; n * ix.heads];
            ix.weights.matmul(x, &mut index_w);
        }
        let layout = self.layout(d);
        let (mut cos, mut sin) = (vec![0.0f32; rd / 2], vec![0.0f32; rd / 2]);
        let mut attn = vec![0.0f32; n * nh * d];
        for seg in segments.iter_mut() {
            let (rows, start) = (seg.rows.clone(), seg.start);
            for i in rows.clone() {
                self.rope.cos_sin(start + i - rows.start, &mut cos, &mut sin);
                for head in q[i * nh * d..(i + 1) * nh * d].chunks_exact_mut(d).chain(kv[i * d..(i + 1) * d].chunks_exact_mut(d)) {
                    ops::rope_interleaved(&mut head[d - rd..], &cos, &sin);
                }
                if let Some(ix) = &self.indexer {
                    for head in index_q[i * ix.heads * ix.head_dim..(i + 1) * ix.heads * ix.head_dim].chunks_exact_mut(ix.head_dim) {
                        ops::rope_interleaved(&mut head[ix.head_dim - rd..], &cos, &sin);
                    }
                }
            }
            seg.cache.append(l, &kv[rows.start * d..rows.end * d], &[]);
            if let Some(pool) = &self.pool {
                let aux = self.aux_rows(spec, l, pool, &x[rows.start * h..rows.end * h], start, seg, &layout);
                seg.cache.append_aux(l, &aux);
            }
            let len = rows.len();
            let keys_all = seg.cache.layer(l, 0..start + len).0;
            let aux_all = seg.cache.aux(l, 0..start + len);
            for i in rows.clone() {
                let p = start + i - rows.start;
                let mut keys: Vec<&[f32]> = ((p + 1).saturating_sub(self.window)..=p).map(|j| &keys_all[j * d..(j + 1) * d]).collect();
                if let Some(pool) = &self.pool {
                    let visible = (p + 1) / pool.rate;
                    let entry_row = |w: usize| &aux_all[((w + 1) * pool.rate - 1) * layout.width..((w + 1) * pool.rate) * layout.width];
                    let chosen: Vec<usize> = match &self.indexer {
                        None => (0..visible).collect(),
                        Some(ix) => {
                            let qi = &index_q[i * ix.heads * ix.head_dim..(i + 1) * ix.heads * ix.head_dim];
                            let wi = &index_w[i * ix.heads..(i + 1) * ix.heads];
                            let (score_scale, weight_scale) = ((ix.head_dim as f32).powf(-0.5), (ix.heads as f32).powf(-0.5));
                            let scores: Vec<f32> = (0..visible)
                                .map(|w| {
                                    let key = &entry_row(w)[layout.index_entry..layout.index_entry + ix.head_dim];
                                    qi.chunks_exact(ix.head_dim)
                                        .zip(wi)
                                        .map(|(qh, wh)| {
                                            let dot: f32 = qh.iter().zip(key).map(|(a, b)| a * b).sum();
                                            (dot.max(0.0) * score_scale) * (wh * weight_scale)
                                        })
                                        .sum()
                                })
                                .collect();
                            let mut order: Vec<usize> = (0..visible).collect();
                            order.sort_by(|a, b| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b)));
                            order.truncate(ix.top_k);
                            order
                        }
                    };
                    keys.extend(chosen.iter().map(|&w| &entry_row(w)[layout.entry..layout.entry + d]));
                }
                let qi = &q[i * nh * d..(i + 1) * nh * d];
                attend_gathered(qi, &keys, d, spec.attention.scale, Some(&self.sinks), &mut attn[i * nh * d..(i + 1) * nh * d]);
                // The value is the rotated key: undo the rotation at the query's position.
                self.rope.cos_sin(p, &mut cos, &mut sin);
                sin.iter_mut().for_each(|s| *s = -*s);
                for head in attn[i * nh * d..(i + 1) * nh * d].chunks_exact_mut(d) {
                    ops::rope_interleaved(&mut head[d - rd..], &cos, &sin);
                }
            }
        }
        // Grouped output projection: each group of heads to `o_lora_rank`, then to the hidden size.
        let (g, lr) = (self.o_groups, self.o_lora_rank);
        let per_group = nh * d / g;
        let mut mid = vec![0.0f32; n * g * lr];
        for (row, m) in attn.chunks_exact(nh * d).zip(mid.chunks_exact_mut(g * lr)) {
            for gi in 0..g {
                self.o_a.matvec_rows(gi * lr..(gi + 1) * lr, &row[gi * per_group..(gi + 1) * per_group], &mut m[gi * lr..(gi + 1) * lr]);
            }
        }
        self.o_b.matmul(&mid, out);
    }

    /// The auxiliary rows of a segment's new positions: each position's projections, and at a
    /// window's last position that window's entry (and indexer key).
    #[allow(clippy::too_many_arguments)]
    fn aux_rows(&self, spec: &ModelSpec, l: usize, pool: &Pool, x: &[f32], start: usize, seg: &SegmentRows<'_>, layout: &AuxLayout) -> Vec<f32> {
        let (d, eps, w) = (spec.head_dim, spec.rms_norm_eps, layout.width);
        let n = x.len() / spec.hidden_size;
        let mut rows = vec![0.0f32; n * w];
        let mut part = Vec::new();
        pool.project(x, start, &mut part);
        let pw = 2 * pool.width();
        for i in 0..n {
            rows[i * w + layout.pool..i * w + layout.pool + pw].copy_from_slice(&part[i * pw..(i + 1) * pw]);
        }
        if let Some(ix) = &self.indexer {
            ix.pool.project(x, start, &mut part);
            let iw = 2 * ix.pool.width();
            for i in 0..n {
                rows[i * w + layout.indexer..i * w + layout.indexer + iw].copy_from_slice(&part[i * iw..(i + 1) * iw]);
            }
        }
        let earlier = seg.cache.aux(l, 0..start);
        let mut entries: Vec<(usize, Vec<f32>, Vec<f32>)> = Vec::new();
        for i in 0..n {
            let p = start + i;
            if !(p + 1).is_multiple_of(pool.rate) {
                continue;
            }
            let win = p / pool.rate;
            let row = |q: usize| -> &[f32] {
                if q < start {
                    &earlier[q * w..(q + 1) * w]
                } else {
                    &rows[(q - start) * w..(q - start + 1) * w]
                }
            };
            let mut entry = vec![0.0f32; d];
            pool.entry(win, |q| &row(q)[layout.pool..layout.pool + pw], &self.rope, self.rope_dim, eps, &mut entry);
            let mut index_entry = Vec::new();
            if let Some(ix) = &self.indexer {
                let iw = 2 * ix.pool.width();
                index_entry = vec![0.0f32; ix.head_dim];
                ix.pool.entry(win, |q| &row(q)[layout.indexer..layout.indexer + iw], &self.rope, self.rope_dim, eps, &mut index_entry);
            }
            entries.push((i, entry, index_entry));
        }
        for (i, entry, index_entry) in entries {
            rows[i * w + layout.entry..i * w + layout.entry + d].copy_from_slice(&entry);
            rows[i * w + layout.index_entry..i * w + layout.index_entry + index_entry.len()].copy_from_slice(&index_entry);
        }
        rows
    }
}
