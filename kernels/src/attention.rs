//! Causal attention over the KV cache, fused: scores, an online softmax and the weighted sum of
//! values in one pass over the keys, with no buffer the size of the context. Query vectors that
//! read the same keys go through together in tiles of up to four — the query heads of one GQA
//! group, the heads of an absorbed MLA layer (all of which read the one latent cache), and in
//! prefill the rows of the prompt — so each key and value row is read once per tile.
//!
//! **The canonical order**, per query vector with keys `0..=last` of its key space: keys in
//! blocks of `KEY_BLOCK` from key 0; for each block, scores `s_j = dot(k_j, q)·scale` (the
//! canonical dot, `dot.rs`), `m' = max(m, max_j s_j)`, `c = exp(m − m')` (0 for the first block),
//! `l = l·c + Σ_j exp(s_j − m')` and `o = o·c + Σ_j exp(s_j − m')·v_j`, summed in key order;
//! finally, with a sink logit `z` (gpt-oss), `m' = max(m, z)`, `c = exp(m − m')`,
//! `l = l·c + exp(z − m')`, `o = o·c`; then `o / l`. `exp` is `gating::exp` (multiply-adds in a
//! fixed order, the same on every ISA and every C library); `o = o + e·v` is a multiply, then an
//! add, per element. Nothing in it depends on which other vectors share the tile, so a prompt row
//! attends exactly as the same row does in decode (batch invariance, DESIGN.md §1), and the
//! vector builds of the tile give the scalar build's bits (tested).
//!
//! Must never: let a vector see a key past its `last`, or order a sum by anything but key index.

use crate::dot::{self, dots, Isa, WeightRow};
use crate::gating::exp;

/// Keys per online-softmax block.
pub const KEY_BLOCK: usize = 32;
/// Query vectors per pass over the keys.
pub const TILE: usize = 4;

pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// `dot(key, qs[v])` for the first `qs.len()` (≤ TILE) vectors.
#[inline]
fn scores_of(key: &[f32], qs: &[&[f32]], out: &mut [f32; TILE]) {
    let w = WeightRow::F32(key);
    match *qs {
        [a, b, c, d] => *out = dots::<4>(&w, [a, b, c, d]),
        [a, b, c] => {
            let [x, y] = dots::<2>(&w, [a, b]);
            out[..3].copy_from_slice(&[x, y, dots::<1>(&w, [c])[0]]);
        }
        [a, b] => out[..2].copy_from_slice(&dots::<2>(&w, [a, b])),
        [a] => out[0] = dots::<1>(&w, [a])[0],
        _ => {}
    }
}

/// The online softmax of one tile: vector `v` sees keys `0..=last[v]`; `score(j, s)` fills
/// `s[v] = scaled score of key j` for every vector of the tile, `value(j)` is value row `j`; each
/// vector's result lands in `out[v·d..(v+1)·d]`. `sinks[v]`, if given, is vector `v`'s sink logit:
/// it joins the softmax's denominator and contributes no value.
///
/// Compiled once per ISA from the same body: every step is an IEEE operation in a fixed order
/// (the exponential is `gating::exp`, built from multiply-adds, not libm's), so the vector builds
/// give the scalar build's bits.
fn online_tile<'a>(
    last: &[usize],
    score: impl FnMut(usize, &mut [f32; TILE]),
    value: impl Fn(usize) -> &'a [f32],
    sinks: Option<&[f32; TILE]>,
    out: &mut [f32],
) {
    online_tile_on(dot::isa(), last, per_key(score), value, sinks, out)
}

/// A block scorer (`score(b0, b1, p)` fills `p[v][j − b0]` for keys `b0..b1`) from a per-key one.
#[inline(always)]
fn per_key(mut score: impl FnMut(usize, &mut [f32; TILE])) -> impl FnMut(usize, usize, &mut Scores) {
    let mut s = [0.0f32; TILE];
    move |b0, b1, p| {
        for j in b0..b1 {
            score(j, &mut s);
            for v in 0..TILE {
                p[v][j - b0] = s[v];
            }
        }
    }
}

/// One block's scaled scores, then weights, per vector of the tile.
type Scores = [[f32; KEY_BLOCK]; TILE];

fn online_tile_on<'a>(
    isa: Isa,
    last: &[usize],
    score: impl FnMut(usize, usize, &mut Scores),
    value: impl Fn(usize) -> &'a [f32],
    sinks: Option<&[f32; TILE]>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: `isa` values other than Scalar come from `dot::isa()` or a caller that checked
        // `available()`, so the CPU has AVX-512F (and AVX2+FMA).
        Isa::Avx512 => return unsafe { online_tile_avx512(last, score, value, sinks, out) },
        // SAFETY: as above, AVX2 and FMA.
        Isa::Avx2 => return unsafe { online_tile_avx2(last, score, value, sinks, out) },
        _ => {}
    }
    let _ = isa; // read only by the x86 dispatch above
    online_tile_body(last, score, value, sinks, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn online_tile_avx512<'a>(
    last: &[usize],
    score: impl FnMut(usize, usize, &mut Scores),
    value: impl Fn(usize) -> &'a [f32],
    sinks: Option<&[f32; TILE]>,
    out: &mut [f32],
) {
    online_tile_body(last, score, value, sinks, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn online_tile_avx2<'a>(
    last: &[usize],
    score: impl FnMut(usize, usize, &mut Scores),
    value: impl Fn(usize) -> &'a [f32],
    sinks: Option<&[f32; TILE]>,
    out: &mut [f32],
) {
    online_tile_body(last, score, value, sinks, out)
}

#[inline(always)]
fn online_tile_body<'a>(
    last: &[usize],
    mut score: impl FnMut(usize, usize, &mut Scores),
    value: impl Fn(usize) -> &'a [f32],
    sinks: Option<&[f32; TILE]>,
    out: &mut [f32],
) {
    let count = last.len();
    let d = out.len() / count.max(1);
    let mut m = [f32::NEG_INFINITY; TILE];
    let mut l = [0.0f32; TILE];
    out.iter_mut().for_each(|x| *x = 0.0);
    let Some(&max_last) = last.iter().max() else { return };
    // One vector's block of scores, then of weights, contiguous (so the exponentials vectorise).
    let mut p: Scores = [[0.0f32; KEY_BLOCK]; TILE];
    let mut b0 = 0;
    while b0 <= max_last {
        let b1 = (b0 + KEY_BLOCK).min(max_last + 1);
        score(b0, b1, &mut p);
        let mut len = [0usize; TILE];
        let mut c = [0.0f32; TILE];
        for v in 0..count {
            if b0 > last[v] {
                continue;
            }
            len[v] = b1.min(last[v] + 1) - b0;
            let pv = &mut p[v][..len[v]];
            let m_new = m[v].max(block_max(pv));
            c[v] = if m[v] == f32::NEG_INFINITY { 0.0 } else { exp(m[v] - m_new) };
            pv.iter_mut().for_each(|x| *x = exp(*x - m_new));
            m[v] = m_new;
            l[v] *= c[v];
        }
        // The denominators' sums in key order, all of the tile's lanes together over the keys
        // every vector sees (lanes past `count` sum unused values), then each vector's own rest.
        let common = len[..count].iter().copied().min().unwrap_or(0);
        #[allow(clippy::needless_range_loop)] // j indexes every vector's row
        for j in 0..common {
            for v in 0..TILE {
                l[v] += p[v][j];
            }
        }
        for v in 0..count {
            for e in &p[v][common..len[v]] {
                l[v] += e;
            }
        }
        // The vectors that see keys of this block, rescaled; then the keys all of them see, one
        // pass over those value rows for all of them, and each vector's own rest alone.
        let mut live: [(&mut [f32], &[f32]); TILE] = Default::default();
        let mut n_live = 0;
        for (v, o) in out.chunks_exact_mut(d).enumerate().take(count) {
            if len[v] > 0 {
                let cv = c[v];
                o.iter_mut().for_each(|x| *x *= cv);
                live[n_live] = (o, &p[v][..len[v]]);
                n_live += 1;
            }
        }
        let shared = live[..n_live].iter().map(|(_, e)| e.len()).min().unwrap_or(0);
        let value_at = |j: usize| value(b0 + j);
        match &mut live[..n_live] {
            [a] => accumulate_values::<1>([a], shared, &value_at),
            [a, b] => accumulate_values::<2>([a, b], shared, &value_at),
            [a, b, c] => accumulate_values::<3>([a, b, c], shared, &value_at),
            [a, b, c, e] => accumulate_values::<4>([a, b, c, e], shared, &value_at),
            _ => {}
        }
        for (o, e) in live[..n_live].iter_mut() {
            if e.len() > shared {
                let rest = |j: usize| value(b0 + shared + j);
                accumulate_values::<1>([&mut (&mut **o, &e[shared..])], e.len() - shared, &rest);
            }
        }
        b0 = b1;
    }
    for (v, o) in out.chunks_exact_mut(d).enumerate().take(count) {
        if let Some(z) = sinks.map(|s| s[v]) {
            let m_new = m[v].max(z);
            let c = if m[v] == f32::NEG_INFINITY { 0.0 } else { exp(m[v] - m_new) };
            l[v] = l[v] * c + exp(z - m_new);
            o.iter_mut().for_each(|x| *x *= c);
        }
        let lv = l[v];
        o.iter_mut().for_each(|x| *x /= lv);
    }
}

/// The largest of the scores, NaNs ignored (as `f32::max` does). The maximum of a set does not
/// depend on the order it is taken in, so sixteen lanes at a time give the sequential fold's value
/// (a zero's sign aside, which no later step can see: `x − (±0)` and `exp(±0)` agree).
#[inline(always)]
fn block_max(p: &[f32]) -> f32 {
    const W: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; W];
    let whole = p.len() / W * W;
    for chunk in p[..whole].chunks_exact(W) {
        for i in 0..W {
            lanes[i] = lanes[i].max(chunk[i]);
        }
    }
    p[whole..].iter().chain(&lanes).fold(f32::NEG_INFINITY, |a, x| a.max(*x))
}

/// For each of `K` vectors (its output `o`, its weights `e`), `o[i] = o[i] + e_j · value(j)[i]`
/// for keys `j` in `0..keys`, in key order. Sixty-four elements of every vector stay in
/// registers across the keys (a vector build loads and stores `o` once a block, not once a key),
/// and the vectors share each value row's load — a GQA group's heads, or a prompt's rows, read
/// the same values — so `4·K` chains of adds run side by side instead of four. Each element sees
/// the same multiplies and adds in the same order as alone.
#[inline(always)]
fn accumulate_values<'a, const K: usize>(mut vectors: [&mut (&mut [f32], &[f32]); K], keys: usize, value: &impl Fn(usize) -> &'a [f32]) {
    const W: usize = 64;
    let Some(d) = vectors.first().map(|(o, _)| o.len()) else { return };
    let whole = d / W * W;
    for c in 0..whole / W {
        let mut a: [[f32; W]; K] = [[0.0; W]; K];
        for (acc, (o, _)) in a.iter_mut().zip(&vectors) {
            acc.copy_from_slice(&o[c * W..(c + 1) * W]);
        }
        for j in 0..keys {
            // A value row is `d` long (the caller's layout): the slice is exactly W long.
            let Ok(x): Result<&[f32; W], _> = value(j)[c * W..(c + 1) * W].try_into() else { unreachable!("a {W}-element slice") };
            // Loaded once into registers for all K vectors (as memory operands of each vector's
            // multiplies it was loaded K times: on Zen 4 the loads, not the arithmetic, bound it).
            let x: [f32; W] = *x;
            for (acc, (_, e)) in a.iter_mut().zip(&vectors) {
                let e = e[j];
                for i in 0..W {
                    acc[i] += e * x[i];
                }
            }
        }
        for (acc, (o, _)) in a.iter().zip(vectors.iter_mut()) {
            o[c * W..(c + 1) * W].copy_from_slice(acc);
        }
    }
    if whole < d {
        for (o, e) in vectors {
            for (j, e) in e[..keys].iter().enumerate() {
                o[whole..].iter_mut().zip(&value(j)[whole..]).for_each(|(o, x)| *o += e * x);
            }
        }
    }
}

/// Grouped-query attention of `n` query rows (`qs`: n × heads·head_dim) at positions
/// `first..first + n`; `keys`/`values` hold positions `0..first + n` (kv_heads·head_dim each). A
/// row at position p sees keys `max(0, p + 1 − window)..=p` (transformers' sliding-window mask).
/// Query head h reads kv head h / (heads / kv_heads); with `sinks` (one logit per query head),
/// head h's softmax also holds the sink `sinks[h]`. `out`: n × heads·head_dim.
///
/// Large enough calls are split over threads — one row's kv heads over the decode step's team
/// (or rayon's pool), a prompt's rows over the pool — which changes no bit: each vector's result
/// depends only on its own query and keys.
#[allow(clippy::too_many_arguments)]
pub fn attend_rows(
    shape: &AttentionShape,
    qs: &[f32],
    first: usize,
    keys: &[f32],
    values: &[f32],
    window: Option<usize>,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let d = shape.head_dim;
    let qd = shape.num_heads * d;
    let n = qs.len() / qd.max(1);
    let kv = shape.num_kv_heads;
    // Multiply-adds of the call (scores and values), an upper bound with a window.
    let work = 2 * n * qd * (first + n);
    let serial = |groups: std::ops::Range<usize>, out: &mut [f32]| attend_rows_serial(shape, qs, first, keys, values, window, sinks, groups, out);
    if n == 1 && kv > 1 {
        let per_group = qd / kv;
        if let Some(team) = crate::team::active().filter(|_| work >= TEAM_MIN_WORK) {
            return crate::team::for_each_chunk_mut(team, out, per_group, |g, o| serial(g..g + 1, o));
        }
        if work >= PARALLEL_MIN_WORK && rayon::current_num_threads() > 1 {
            return crate::team::chunks_mut(out, per_group, true, |g, o| serial(g..g + 1, o));
        }
    } else if n > 1 {
        let team = crate::team::active().filter(|_| work >= TEAM_MIN_WORK);
        if team.is_some() || (work >= PARALLEL_MIN_WORK && rayon::current_num_threads() > 1) {
            // Later rows see more keys: small chunks keep the threads' shares even, and they are
            // taken last rows first, so the chunk that ends the call is the cheapest (taken in
            // row order, the last and dearest one left the other thread waiting).
            let threads = team.map_or_else(rayon::current_num_threads, |t| t.threads());
            let rows = (n / (4 * threads)).max(1);
            let mut pieces: Vec<(usize, &mut [f32])> = out.chunks_mut(rows * qd).enumerate().map(|(c, o)| (c * rows, o)).rev().collect();
            return crate::team::each_mut(&mut pieces, true, |(r0, o)| {
                let (r0, r1) = (*r0, *r0 + o.len() / qd);
                attend_rows_serial(shape, &qs[r0 * qd..r1 * qd], first + r0, keys, values, window, sinks, 0..kv, o);
            });
        }
    }
    serial(0..kv, out)
}

/// Unscaled scores of keys `b0..b1` against the tile's queries `qs` into `p[v][j − b0]`: key `j`
/// is `keys[j·stride..j·stride + len]` (`len` = the queries' length). Canonical dots either way;
/// on AVX-512 sixteen keys share a reduction tree (`x86::dots16_avx512`), on AVX2 eight
/// (`x86::dots8_avx2`).
#[inline(always)]
fn key_block_dots(isa: Isa, keys: &[f32], stride: usize, (b0, b1): (usize, usize), qs: &[&[f32]], p: &mut Scores) {
    let len = qs.first().map_or(0, |q| q.len());
    if b1 <= b0 || len == 0 {
        return;
    }
    // Every key of the block lies inside `keys` before any vector load reads it.
    assert!((b1 - 1) * stride + len <= keys.len(), "a key block past the cache");
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx512 | Isa::Avx2) {
        let width = if isa == Isa::Avx512 { 16 } else { 8 };
        let mut t = [0.0f32; 16];
        let mut j0 = b0;
        while j0 < b1 {
            let count = (b1 - j0).min(width);
            let base = keys[j0 * stride..].as_ptr();
            if isa == Isa::Avx512 {
                // Straight into each vector's row of the block: sixteen lanes from `at`, those
                // past `count` unspecified and never read (a row is read up to its keys' count).
                let at = j0 - b0;
                assert!(at + 16 <= KEY_BLOCK, "a key block is whole sixteens from its start");
                let rows = p.as_mut_ptr().cast::<f32>().wrapping_add(at);
                // SAFETY: AVX-512F is available (`isa`); keys j0..j0 + count, each `len` long at
                // `stride`, are inside `keys` (asserted above); the tile's queries are one length;
                // vector v's sixteen lanes land in p[v][at..at + 16] (asserted inside the row).
                unsafe {
                    match *qs {
                        [a] => x86::dots16_tile_avx512::<1>(base, stride, count, &[a], rows, KEY_BLOCK),
                        [a, b] => x86::dots16_tile_avx512::<2>(base, stride, count, &[a, b], rows, KEY_BLOCK),
                        [a, b, c] => x86::dots16_tile_avx512::<3>(base, stride, count, &[a, b, c], rows, KEY_BLOCK),
                        [a, b, c, e] => x86::dots16_tile_avx512::<4>(base, stride, count, &[a, b, c, e], rows, KEY_BLOCK),
                        _ => {}
                    }
                }
                j0 += count;
                continue;
            }
            for (v, q) in qs.iter().enumerate() {
                // SAFETY: the ISA is available (`isa`); keys j0..j0 + count, each `len` long at
                // `stride`, are inside `keys` (asserted above).
                unsafe {
                    if isa == Isa::Avx512 {
                        x86::dots16_avx512(base, stride, count, q, &mut t)
                    } else {
                        x86::dots8_avx2(base, stride, count, q, (&mut t[..8]).try_into().expect("eight scores"))
                    }
                };
                p[v][j0 - b0..j0 - b0 + count].copy_from_slice(&t[..count]);
            }
            j0 += count;
        }
        return;
    }
    let _ = isa; // read only by the x86 dispatch above
    let mut s = [0.0f32; TILE];
    for j in b0..b1 {
        scores_of(&keys[j * stride..j * stride + len], qs, &mut s);
        for v in 0..qs.len() {
            p[v][j - b0] = s[v];
        }
    }
}

/// One `attend_rows` call of `attend_many`: a sequence's query rows at positions
/// `first..first + n` over its own cache.
pub struct RowsCall<'a> {
    pub qs: &'a [f32],
    pub first: usize,
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub out: &'a mut [f32],
}

/// `attend_rows` for each call (a batch's sequences, each over its own cache), over the pool
/// when there is enough work in all of them together: the same bits as one after another.
pub fn attend_many(shape: &AttentionShape, window: Option<usize>, sinks: Option<&[f32]>, calls: &mut [RowsCall<'_>]) {
    let qd = shape.num_heads * shape.head_dim;
    let work: usize = calls.iter().map(|c| 2 * c.qs.len() * (c.first + c.qs.len() / qd.max(1))).sum();
    let one = |c: &mut RowsCall<'_>| attend_rows(shape, c.qs, c.first, c.keys, c.values, window, sinks, c.out);
    let team = crate::team::active().is_some() && work >= TEAM_MIN_WORK;
    if calls.len() > 1 && (team || (work >= PARALLEL_MIN_WORK && rayon::current_num_threads() > 1)) {
        crate::team::each_mut(calls, true, one);
    } else {
        calls.iter_mut().for_each(one);
    }
}

/// Below this many multiply-adds a call stays on its thread: a rayon fork and join costs ~10 µs,
/// a claim among a step's team about a microsecond.
const PARALLEL_MIN_WORK: usize = 1 << 18;
const TEAM_MIN_WORK: usize = 1 << 14;

/// `attend_rows` on this thread for the kv heads `groups`; `out` holds the rows' outputs for the
/// query heads of those groups only (so a single group of one row is its own contiguous slice).
#[allow(clippy::too_many_arguments)]
fn attend_rows_serial(
    shape: &AttentionShape,
    qs: &[f32],
    first: usize,
    keys: &[f32],
    values: &[f32],
    window: Option<usize>,
    sinks: Option<&[f32]>,
    groups: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let d = shape.head_dim;
    let (stride, qd) = (shape.num_kv_heads * d, shape.num_heads * d);
    let n = qs.len() / qd.max(1);
    let group = shape.num_heads / shape.num_kv_heads;
    // Output row width and the first head held: all heads, or (one row) the groups' heads.
    let (od, h_base) = if groups.len() == shape.num_kv_heads { (qd, 0) } else { (groups.len() * group * d, groups.start * group) };
    let lo_of = |i: usize| window.map_or(0, |w| (first + i + 1).saturating_sub(w));
    // A tile of one row's heads writes straight into `out` (decode allocates nothing); a tile
    // spanning rows (prefill) gathers its results here first.
    let mut gather: Vec<f32> = Vec::new();
    let isa = dot::isa();
    for g in groups {
        // Vectors (row, head) of this kv head, row-major; a tile holds vectors that share a key
        // range start (all of them without a window; one row's heads with one).
        let vectors = (0..n).flat_map(|i| (g * group..(g + 1) * group).map(move |h| (i, h)));
        let mut tile: [(usize, usize); TILE] = [(0, 0); TILE];
        let mut count = 0;
        let mut flush = |tile: &[(usize, usize)]| {
            let lo = lo_of(tile[0].0);
            let mut lasts = [0usize; TILE];
            let mut q: [&[f32]; TILE] = [&[]; TILE];
            let mut tile_sinks = [0.0f32; TILE];
            for (v, (i, h)) in tile.iter().enumerate() {
                lasts[v] = first + i - lo;
                tile_sinks[v] = sinks.map_or(0.0, |s| s[*h]);
                q[v] = &qs[i * qd + h * d..i * qd + (h + 1) * d];
            }
            let k = tile.len();
            let (i0, h0) = tile[0];
            let one_row = tile.iter().all(|(i, _)| *i == i0);
            let score = |b0: usize, b1: usize, p: &mut Scores| {
                key_block_dots(isa, &keys[lo * stride + g * d..], stride, (b0, b1), &q[..k], p);
                for row in p.iter_mut().take(k) {
                    row[..b1 - b0].iter_mut().for_each(|x| *x *= shape.scale);
                }
            };
            let value = |j: usize| &values[(lo + j) * stride + g * d..(lo + j) * stride + (g + 1) * d];
            let tile_sinks = sinks.map(|_| &tile_sinks);
            if one_row {
                // Heads h0.. of one row are contiguous in `out`.
                let at = i0 * od + (h0 - h_base) * d;
                online_tile_on(isa, &lasts[..k], score, value, tile_sinks, &mut out[at..at + k * d]);
            } else {
                gather.resize(TILE * d, 0.0);
                online_tile_on(isa, &lasts[..k], score, value, tile_sinks, &mut gather[..k * d]);
                for (v, (i, h)) in tile.iter().enumerate() {
                    let at = i * od + (h - h_base) * d;
                    out[at..at + d].copy_from_slice(&gather[v * d..(v + 1) * d]);
                }
            }
        };
        for (i, h) in vectors {
            if count == TILE || (count > 0 && lo_of(tile[0].0) != lo_of(i)) {
                flush(&tile[..count]);
                count = 0;
            }
            tile[count] = (i, h);
            count += 1;
        }
        if count > 0 {
            flush(&tile[..count]);
        }
    }
}

/// Absorbed multi-head latent attention of query vectors (rows × heads, row-major; vector `v`
/// at position `first + v / heads`): scores are `q_lat·c_j + q_rot·r_j` over each position's
/// latent `c_j` (`latents`, positions × rank) and rotary key `r_j` (`rots`, positions × rope),
/// scaled; each result is the probability-weighted sum of latents (`out`, vectors × rank), which
/// the caller maps to the head's value with W_UV. Full keys and values are never formed.
#[allow(clippy::too_many_arguments)]
pub fn attend_latent_rows(
    q_lat: &[f32],
    q_rot: &[f32],
    (rank, rope): (usize, usize),
    heads: usize,
    first: usize,
    latents: &[f32],
    rots: &[f32],
    scale: f32,
    out: &mut [f32],
) {
    let vectors = q_lat.len() / rank.max(1);
    let isa = dot::isa();
    // One tile: vectors v0..v0 + k (k = o.len() / rank), written to `o`.
    let tile = |v0: usize, o: &mut [f32]| {
        let k = o.len() / rank.max(1);
        let mut lasts = [0usize; TILE];
        let (mut ql, mut qr): ([&[f32]; TILE], [&[f32]; TILE]) = ([&[]; TILE], [&[]; TILE]);
        for t in 0..k {
            let v = v0 + t;
            lasts[t] = first + v / heads;
            ql[t] = &q_lat[v * rank..(v + 1) * rank];
            qr[t] = &q_rot[v * rope..(v + 1) * rope];
        }
        let mut r: Scores = [[0.0f32; KEY_BLOCK]; TILE];
        online_tile_on(
            isa,
            &lasts[..k],
            |b0, b1, p: &mut Scores| {
                key_block_dots(isa, latents, rank, (b0, b1), &ql[..k], p);
                key_block_dots(isa, rots, rope, (b0, b1), &qr[..k], &mut r);
                for (pv, rv) in p.iter_mut().zip(&r).take(k) {
                    for (x, y) in pv[..b1 - b0].iter_mut().zip(rv) {
                        *x = (*x + y) * scale;
                    }
                }
            },
            |j| &latents[j * rank..(j + 1) * rank],
            None,
            o,
        );
    };
    // Tiles are independent (each vector's result depends on its own query and keys only), so
    // they go over the step's team or the pool when there is enough work: the same bits.
    let out = &mut out[..vectors * rank];
    let work = 2 * vectors * (rank + rope) * (first + vectors / heads.max(1));
    let chunk = TILE * rank.max(1);
    if vectors > TILE {
        if let Some(team) = crate::team::active().filter(|_| work >= TEAM_MIN_WORK) {
            return crate::team::for_each_chunk_mut(team, out, chunk, |c, o| tile(c * TILE, o));
        }
        if work >= PARALLEL_MIN_WORK && rayon::current_num_threads() > 1 {
            return crate::team::chunks_mut(out, chunk, true, |c, o| tile(c * TILE, o));
        }
    }
    out.chunks_mut(chunk).enumerate().for_each(|(c, o)| tile(c * TILE, o));
}

/// `attend_latent_rows` where row `r` (vectors `r·heads..(r+1)·heads`) sees only the positions
/// `selected[r]` (ascending, non-empty): DeepSeek Sparse Attention. The same canonical order over
/// the keys a row sees, so selecting every earlier key gives `attend_latent_rows`' bits.
#[allow(clippy::too_many_arguments)]
pub fn attend_latent_selected(
    q_lat: &[f32],
    q_rot: &[f32],
    (rank, rope): (usize, usize),
    heads: usize,
    selected: &[Vec<usize>],
    latents: &[f32],
    rots: &[f32],
    scale: f32,
    out: &mut [f32],
) {
    for (row, keys) in selected.iter().enumerate() {
        let Some(last) = keys.len().checked_sub(1) else {
            out[row * heads * rank..(row + 1) * heads * rank].iter_mut().for_each(|x| *x = 0.0);
            continue;
        };
        let mut h0 = 0;
        while h0 < heads {
            let k = TILE.min(heads - h0);
            let v0 = row * heads + h0;
            let (mut ql, mut qr): ([&[f32]; TILE], [&[f32]; TILE]) = ([&[]; TILE], [&[]; TILE]);
            for t in 0..k {
                ql[t] = &q_lat[(v0 + t) * rank..(v0 + t + 1) * rank];
                qr[t] = &q_rot[(v0 + t) * rope..(v0 + t + 1) * rope];
            }
            online_tile(
                &[last; TILE][..k],
                |j, s| {
                    let p = keys[j];
                    let mut r = [0.0f32; TILE];
                    scores_of(&latents[p * rank..(p + 1) * rank], &ql[..k], s);
                    scores_of(&rots[p * rope..(p + 1) * rope], &qr[..k], &mut r);
                    for t in 0..TILE {
                        s[t] = (s[t] + r[t]) * scale;
                    }
                },
                |j| &latents[keys[j] * rank..(keys[j] + 1) * rank],
                None,
                &mut out[v0 * rank..(v0 + k) * rank],
            );
            h0 += k;
        }
    }
}

/// One query row's heads (`q`: heads × d) over keys gathered from anywhere (`keys`, each d long,
/// in the order given), each key its own value (DeepSeek-V4's shared key-value head, its window
/// and its compressed entries); `sinks`: one logit per head. The canonical order over the list.
/// `out`: heads × d (zeros for an empty list without sinks).
pub fn attend_gathered(q: &[f32], keys: &[&[f32]], d: usize, scale: f32, sinks: Option<&[f32]>, out: &mut [f32]) {
    let heads = q.len() / d.max(1);
    let Some(last) = keys.len().checked_sub(1) else {
        out.iter_mut().for_each(|x| *x = 0.0);
        return;
    };
    let mut h0 = 0;
    while h0 < heads {
        let k = TILE.min(heads - h0);
        let mut qs: [&[f32]; TILE] = [&[]; TILE];
        let mut tile_sinks = [0.0f32; TILE];
        for t in 0..k {
            qs[t] = &q[(h0 + t) * d..(h0 + t + 1) * d];
            tile_sinks[t] = sinks.map_or(0.0, |s| s[h0 + t]);
        }
        online_tile(
            &[last; TILE][..k],
            |j, s| {
                scores_of(keys[j], &qs[..k], s);
                s.iter_mut().for_each(|x| *x *= scale);
            },
            |j| keys[j],
            sinks.map(|_| &tile_sinks),
            &mut out[h0 * d..(h0 + k) * d],
        );
        h0 += k;
    }
}

/// Scores sixteen keys at a time: each key's 64 lanes as `dot.rs` accumulates them, then the
/// canonical tree (lane l + lane l + s for s = 32, 16, 8, 4, 2, 1) taken for sixteen keys at once by
/// shuffles that pair lane l with lane l + s — the same additions, in the same operand order, as
/// sixteen separate reductions, for a quarter of the instructions.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `out[j] = dot(key_j, q)` (bit for bit `dots` of `WeightRow::F32(key_j)` and `q`) for the
    /// `count ≤ 16` keys `keys + j·stride`, each `q.len()` long; `out[count..]` is unspecified.
    ///
    /// # Safety
    /// AVX-512F must be available and every key readable for `q.len()` values.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn dots16_avx512(keys: *const f32, stride: usize, count: usize, q: &[f32], out: &mut [f32; 16]) {
        dots16_tile_avx512::<1>(keys, stride, count, &[q], out.as_mut_ptr(), 16);
    }

    /// `dots16_avx512` for `V` query vectors of one length at once: each key chunk is loaded once
    /// for all of them (a GQA group's heads, or a prompt's rows, score the same keys). Each
    /// (key, vector) dot is the same multiply-adds and tree as alone.
    ///
    /// Vector `v`'s sixteen results go to `out + v·out_stride`.
    ///
    /// # Safety
    /// As `dots16_avx512`, every `qs[v]` as long as `qs[0]`, and sixteen floats writable at
    /// `out + v·out_stride` for every `v < V`.
    #[target_feature(enable = "avx512f,fma")]
    #[inline]
    pub(super) unsafe fn dots16_tile_avx512<const V: usize>(keys: *const f32, stride: usize, count: usize, qs: &[&[f32]; V], out: *mut f32, out_stride: usize) {
        let d = qs[0].len();
        let (full, rest) = (d / 64, d % 64);
        // Queries that fit in sixteen registers stay there across the keys (loaded per key as
        // memory operands, a tile read three times the bytes of its keys: on Zen 4 the loads
        // bound it). The same multiply-adds in the same order.
        if rest == 0 && V * full <= 4 {
            match full {
                1 => return dots16_tile_held::<V, 1>(keys, stride, count, qs, out, out_stride),
                2 => return dots16_tile_held::<V, 2>(keys, stride, count, qs, out, out_stride),
                4 => return dots16_tile_held::<V, 4>(keys, stride, count, qs, out, out_stride),
                _ => {}
            }
        }
        let count = count.min(16);
        let mut c = [[std::mem::MaybeUninit::<__m512>::uninit(); 16]; V];
        zero_past(&mut c, count);
        for j in 0..count {
            let k = keys.add(j * stride);
            let mut acc = [[_mm512_setzero_ps(); 4]; V];
            for ch in 0..full {
                for r in 0..4 {
                    let o = ch * 64 + r * 16;
                    let kv = _mm512_loadu_ps(k.add(o));
                    for (a, q) in acc.iter_mut().zip(qs) {
                        a[r] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(q.as_ptr().add(o)), a[r]);
                    }
                }
            }
            // The zero-padded last chunk: lanes past the row add fma(0, 0, acc) = acc (an
            // accumulator that starts at +0 is never −0).
            for r in 0..4 {
                let first = 16 * r;
                if first >= rest {
                    break;
                }
                let m: __mmask16 = if rest - first >= 16 { 0xffff } else { (1u16 << (rest - first)) - 1 };
                let o = full * 64 + first;
                let kv = _mm512_maskz_loadu_ps(m, k.add(o));
                for (a, q) in acc.iter_mut().zip(qs) {
                    a[r] = _mm512_fmadd_ps(kv, _mm512_maskz_loadu_ps(m, q.as_ptr().add(o)), a[r]);
                }
            }
            for (cv, a) in c.iter_mut().zip(&acc) {
                cv[j].write(fold_chunks(a));
            }
        }
        store_trees(&c, out, out_stride);
    }

    /// `dots16_tile_avx512` for vectors of exactly `F` chunks of 64 (`V·F ≤ 4`), the queries held
    /// in registers.
    ///
    /// # Safety
    /// As `dots16_tile_avx512`, with every `qs[v]` `64·F` long.
    #[target_feature(enable = "avx512f,fma")]
    #[inline]
    unsafe fn dots16_tile_held<const V: usize, const F: usize>(
        keys: *const f32,
        stride: usize,
        count: usize,
        qs: &[&[f32]; V],
        out: *mut f32,
        out_stride: usize,
    ) {
        let mut q = [[[_mm512_setzero_ps(); 4]; F]; V];
        for (qv, src) in q.iter_mut().zip(qs) {
            assert_eq!(src.len(), 64 * F, "a held query is whole chunks of 64");
            for (ch, chunk) in qv.iter_mut().enumerate() {
                for (r, x) in chunk.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(src.as_ptr().add(ch * 64 + r * 16));
                }
            }
        }
        let count = count.min(16);
        let mut c = [[std::mem::MaybeUninit::<__m512>::uninit(); 16]; V];
        zero_past(&mut c, count);
        for j in 0..count {
            let k = keys.add(j * stride);
            let mut acc = [[_mm512_setzero_ps(); 4]; V];
            for ch in 0..F {
                for r in 0..4 {
                    let kv = _mm512_loadu_ps(k.add(ch * 64 + r * 16));
                    for (a, qv) in acc.iter_mut().zip(&q) {
                        a[r] = _mm512_fmadd_ps(kv, qv[ch][r], a[r]);
                    }
                }
            }
            for (cv, a) in c.iter_mut().zip(&acc) {
                cv[j].write(fold_chunks(a));
            }
        }
        store_trees(&c, out, out_stride);
    }

    /// Zeroes the partial sums of keys `count..16` for each of `V` vectors (the others are
    /// written before they are read: clearing them all cost a 1–4 KB memset per sixteen keys).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn zero_past<const V: usize>(c: &mut [[std::mem::MaybeUninit<__m512>; 16]; V], count: usize) {
        for cv in c.iter_mut() {
            for x in &mut cv[count..] {
                x.write(_mm512_setzero_ps());
            }
        }
    }

    /// A key's 64 lanes folded to 16 by the tree's s = 32 (lanes 0–15 with 32–47, 16–31 with
    /// 48–63), then s = 16.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn fold_chunks(a: &[__m512; 4]) -> __m512 {
        _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]))
    }

    /// Each vector's sixteen dots (the rest of the tree) to `out + v·out_stride`.
    ///
    /// # Safety
    /// Every key's partial sums written (`zero_past`, then keys `0..count`), and sixteen
    /// floats writable at every `out + v·out_stride`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store_trees<const V: usize>(c: &[[std::mem::MaybeUninit<__m512>; 16]; V], out: *mut f32, out_stride: usize) {
        for (v, cv) in c.iter().enumerate() {
            // SAFETY: every element written (the caller's contract); MaybeUninit<T> has T's layout.
            let cv: &[__m512; 16] = &*(cv as *const [std::mem::MaybeUninit<__m512>; 16]).cast::<[__m512; 16]>();
            _mm512_storeu_ps(out.add(v * out_stride), tree16(cv));
        }
    }

    /// The canonical tree's s = 8, 4, 2, 1 over sixteen keys' 16-lane partial sums: lane `j` of
    /// the result is key `j`'s dot.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tree16(c: &[__m512; 16]) -> __m512 {
        // s = 8: keys 2p and 2p + 1 → lanes 0–7 and 8–15 of d[p].
        let mut d8 = [_mm512_setzero_ps(); 8];
        for (p, x) in d8.iter_mut().enumerate() {
            let (a, b) = (c[2 * p], c[2 * p + 1]);
            *x = _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(a, b), _mm512_shuffle_f32x4::<0xEE>(a, b));
        }
        // s = 4: keys 4q..4q + 4 → 128-bit block i of e[q] is key 4q + i.
        let mut e4 = [_mm512_setzero_ps(); 4];
        for (qi, x) in e4.iter_mut().enumerate() {
            let (a, b) = (d8[2 * qi], d8[2 * qi + 1]);
            *x = _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(a, b), _mm512_shuffle_f32x4::<0xDD>(a, b));
        }
        // s = 2: block i of f[0] holds keys i and 4 + i (two lanes each), of f[1] keys 8 + i, 12 + i.
        let f0 = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(e4[0], e4[1]), _mm512_shuffle_ps::<0xEE>(e4[0], e4[1]));
        let f1 = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(e4[2], e4[3]), _mm512_shuffle_ps::<0xEE>(e4[2], e4[3]));
        // s = 1: lane 4i + t holds key i + 4t.
        let g = _mm512_add_ps(_mm512_shuffle_ps::<0x88>(f0, f1), _mm512_shuffle_ps::<0xDD>(f0, f1));
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, g)
    }

    /// `dots16_avx512` for 256-bit registers and `count ≤ 8` keys: each key's 64 lanes in eight
    /// registers as `dot.rs`'s AVX2 path holds them, the tree's s = 32, 16, 8 per key, then 4, 2, 1
    /// for eight keys at once.
    ///
    /// # Safety
    /// AVX2 and FMA must be available and every key readable for `q.len()` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dots8_avx2(keys: *const f32, stride: usize, count: usize, q: &[f32], out: &mut [f32; 8]) {
        let d = q.len();
        let (full, rest) = (d / 64, d % 64);
        let mut c = [_mm256_setzero_ps(); 8];
        for (j, cj) in c.iter_mut().enumerate().take(count.min(8)) {
            let k = keys.add(j * stride);
            let mut acc = [_mm256_setzero_ps(); 8];
            for ch in 0..full {
                for (r, a) in acc.iter_mut().enumerate() {
                    let o = ch * 64 + r * 8;
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(k.add(o)), _mm256_loadu_ps(q.as_ptr().add(o)), *a);
                }
            }
            // The zero-padded last chunk, as in `dots16_avx512` (masked lanes load as 0).
            for (r, a) in acc.iter_mut().enumerate() {
                let first = 8 * r;
                if first >= rest {
                    break;
                }
                let live = (rest - first).min(8) as i32;
                let m = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                let o = full * 64 + first;
                *a = _mm256_fmadd_ps(_mm256_maskload_ps(k.add(o), m), _mm256_maskload_ps(q.as_ptr().add(o), m), *a);
            }
            // s = 32 (register r with r + 4), s = 16 (r with r + 2), s = 8.
            let b = [_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[2], acc[6]), _mm256_add_ps(acc[3], acc[7])];
            *cj = _mm256_add_ps(_mm256_add_ps(b[0], b[2]), _mm256_add_ps(b[1], b[3]));
        }
        // s = 4: keys 2p and 2p + 1 → the low and high 128 bits of e[p].
        let mut e = [_mm256_setzero_ps(); 4];
        for (p, x) in e.iter_mut().enumerate() {
            let (a, b) = (c[2 * p], c[2 * p + 1]);
            *x = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a, b), _mm256_permute2f128_ps::<0x31>(a, b));
        }
        // s = 2: the low 128 bits of f0 hold keys 0 and 2 (two lanes each), the high ones 1 and 3;
        // f1 the same for keys 4–7.
        let f0 = _mm256_add_ps(_mm256_shuffle_ps::<0x44>(e[0], e[1]), _mm256_shuffle_ps::<0xEE>(e[0], e[1]));
        let f1 = _mm256_add_ps(_mm256_shuffle_ps::<0x44>(e[2], e[3]), _mm256_shuffle_ps::<0xEE>(e[2], e[3]));
        // s = 1: lanes hold keys 0, 2, 4, 6, 1, 3, 5, 7.
        let g = _mm256_add_ps(_mm256_shuffle_ps::<0x88>(f0, f1), _mm256_shuffle_ps::<0xDD>(f0, f1));
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_permutevar8x32_ps(g, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference;

    fn f(i: usize) -> f32 {
        ((i * 2654435761usize) % 1000) as f32 / 250.0 - 2.0
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn every_isa_gives_the_scalar_tiles_bits() {
        // Head sizes around the vector widths, key counts around a block, vectors that stop at
        // different keys, with and without sinks, and scores far apart (exponentials near 0).
        for d in [1, 7, 16, 64, 129] {
            for lasts in [vec![0], vec![31, 31, 31, 31], vec![40, 5, 77, 32], vec![100, 99]] {
                let keys = lasts.iter().max().map_or(0, |m| m + 1);
                let values: Vec<f32> = (0..keys * d).map(|i| f(i + 31)).collect();
                let scores: Vec<f32> = (0..keys * TILE).map(|i| f(i + 7) * if i % 13 == 0 { 30.0 } else { 2.0 }).collect();
                let score = |j: usize, s: &mut [f32; TILE]| s.copy_from_slice(&scores[j * TILE..(j + 1) * TILE]);
                let value = |j: usize| &values[j * d..(j + 1) * d];
                let sinks = [0.5f32, -3.0, 9.0, f32::NEG_INFINITY];
                for sink in [None, Some(&sinks)] {
                    let mut want = vec![0.0; lasts.len() * d];
                    online_tile_on(Isa::Scalar, &lasts, per_key(score), value, sink, &mut want);
                    // Each vector of the tile as it comes out alone (the tile shares loads, not sums).
                    for (v, last) in lasts.iter().enumerate() {
                        let alone = |j: usize, s: &mut [f32; TILE]| s[0] = scores[j * TILE + v];
                        let sink_alone = sink.map(|s| [s[v]; TILE]);
                        let mut one = vec![0.0; d];
                        online_tile_on(Isa::Scalar, &[*last], per_key(alone), value, sink_alone.as_ref(), &mut one);
                        assert_eq!(bits(&one), bits(&want[v * d..(v + 1) * d]), "d {d} lasts {lasts:?} vector {v} alone");
                    }
                    for isa in Isa::all_available() {
                        let mut got = vec![1.0; lasts.len() * d];
                        online_tile_on(isa, &lasts, per_key(score), value, sink, &mut got);
                        assert_eq!(bits(&got), bits(&want), "{} d {d} lasts {lasts:?} sinks {}", isa.name(), sink.is_some());
                    }
                }
            }
        }
    }

    #[test]
    fn split_over_threads_gives_the_one_thread_bits() {
        // Big enough to split: one decode row (kv heads over the pool, then over a team) and a
        // prompt (rows over the pool, then over a team), with a window and sinks.
        let shape = AttentionShape { num_heads: 8, num_kv_heads: 4, head_dim: 64, scale: 0.125 };
        let (qd, stride) = (8 * 64, 4 * 64);
        let total = 300;
        let q: Vec<f32> = (0..total * qd).map(|i| f(i + 1)).collect();
        let keys: Vec<f32> = (0..total * stride).map(|i| f(i + 2)).collect();
        let values: Vec<f32> = (0..total * stride).map(|i| f(i + 3)).collect();
        let sinks: Vec<f32> = (0..8).map(|h| f(h + 9)).collect();
        for (window, sinks) in [(None, None), (Some(100), Some(sinks.as_slice()))] {
            for n in [1, 120] {
                let first = total - n;
                assert!(2 * n * qd * total >= PARALLEL_MIN_WORK, "the test must reach the split");
                let qs = &q[first * qd..];
                let mut one = vec![0.0; n * qd];
                attend_rows_serial(&shape, qs, first, &keys, &values, window, sinks, 0..4, &mut one);
                let mut split = vec![1.0; n * qd];
                attend_rows(&shape, qs, first, &keys, &values, window, sinks, &mut split);
                assert_eq!(bits(&split), bits(&one), "pool, {n} rows, window {window:?}");
                let _turn = crate::team::test_turn();
                let mut teamed = vec![1.0; n * qd];
                crate::team::with_team(2, || attend_rows(&shape, qs, first, &keys, &values, window, sinks, &mut teamed));
                assert_eq!(bits(&teamed), bits(&one), "team, {n} rows, window {window:?}");
            }
        }
    }

    #[test]
    fn many_sequences_over_the_pool_give_each_ones_own_bits() {
        // Sixteen decode rows and a prompt, each over its own cache: together past the split.
        let shape = AttentionShape { num_heads: 8, num_kv_heads: 2, head_dim: 64, scale: 0.125 };
        let (qd, stride) = (8 * 64, 2 * 64);
        let seqs: Vec<(usize, usize)> = (0..16).map(|i| (40 + 7 * i, 1)).chain([(30, 9)]).collect();
        let data: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = seqs
            .iter()
            .enumerate()
            .map(|(s, (first, n))| {
                let total = first + n;
                let g = |o: usize, len: usize| (0..len).map(|i| f(i * 3 + o + 101 * s)).collect::<Vec<f32>>();
                (g(1, n * qd), g(2, total * stride), g(3, total * stride))
            })
            .collect();
        let work: usize = seqs.iter().map(|(first, n)| 2 * n * qd * (first + n)).sum();
        assert!(work >= PARALLEL_MIN_WORK, "the test must reach the split");
        let mut outs: Vec<Vec<f32>> = seqs.iter().map(|(_, n)| vec![1.0; n * qd]).collect();
        let mut calls: Vec<RowsCall<'_>> =
            seqs.iter().zip(&data).zip(outs.iter_mut()).map(|((&(first, _), (q, k, v)), out)| RowsCall { qs: q, first, keys: k, values: v, out }).collect();
        attend_many(&shape, Some(50), None, &mut calls);
        for ((&(first, n), (q, k, v)), got) in seqs.iter().zip(&data).zip(&outs) {
            let mut want = vec![0.0; n * qd];
            attend_rows_serial(&shape, q, first, k, v, Some(50), None, 0..2, &mut want);
            assert_eq!(bits(got), bits(&want), "sequence at {first}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn sixteen_keys_at_a_time_give_each_keys_canonical_dot() {
        for d in [1, 5, 8, 9, 16, 17, 63, 64, 65, 100, 128, 192, 576] {
            let stride = d + 3;
            // Values spanning magnitudes, so a different order of additions would show.
            let keys: Vec<f32> = (0..16 * stride).map(|i| f(i + 5) * if i % 7 == 0 { 1e4 } else { 1.0 }).collect();
            let q: Vec<f32> = (0..d).map(|i| f(i + 900) * if i % 5 == 0 { 1e-3 } else { 1.0 }).collect();
            let want = |j: usize| crate::dot::dots_with::<1>(Isa::Scalar, &WeightRow::F32(&keys[j * stride..j * stride + d]), [&q])[0];
            for count in [1, 2, 7, 8, 15, 16] {
                if Isa::Avx512.available() {
                    let mut got = [0.0f32; 16];
                    // SAFETY: AVX-512F checked above; every key lies inside `keys`.
                    unsafe { x86::dots16_avx512(keys.as_ptr(), stride, count, &q, &mut got) };
                    for (j, g) in got.iter().enumerate().take(count) {
                        assert_eq!(g.to_bits(), want(j).to_bits(), "avx512 d {d} count {count} key {j}: {g} vs {}", want(j));
                    }
                }
                if Isa::Avx2.available() && count <= 8 {
                    let mut got = [0.0f32; 8];
                    // SAFETY: AVX2 and FMA checked above; every key lies inside `keys`.
                    unsafe { x86::dots8_avx2(keys.as_ptr(), stride, count, &q, &mut got) };
                    for (j, g) in got.iter().enumerate().take(count) {
                        assert_eq!(g.to_bits(), want(j).to_bits(), "avx2 d {d} count {count} key {j}: {g} vs {}", want(j));
                    }
                }
            }
        }
    }

    /// The block scorer on every ISA (sixteen or eight keys a tree, or one) gives each key's
    /// scalar dot, for blocks that start anywhere and end short of a whole group.
    #[test]
    fn key_blocks_on_every_isa_give_the_scalar_scores() {
        // 64, 128 and 256 also take the AVX-512 path that holds the queries in registers.
        for d in [3, 64, 80, 128, 256] {
            let stride = 2 * d + 1;
            let keys: Vec<f32> = (0..(KEY_BLOCK + 40) * stride).map(|i| f(i + 11) * if i % 9 == 0 { 3e3 } else { 1.0 }).collect();
            let qv: Vec<Vec<f32>> = (0..TILE).map(|v| (0..d).map(|i| f(i * 7 + v * 131 + 3)).collect()).collect();
            for tile in 1..=TILE {
                let qs: Vec<&[f32]> = qv[..tile].iter().map(|q| q.as_slice()).collect();
                for (b0, b1) in [(0, KEY_BLOCK), (5, 5 + KEY_BLOCK), (17, 30), (3, 4), (0, 9)] {
                    let mut want: Scores = [[0.0; KEY_BLOCK]; TILE];
                    key_block_dots(Isa::Scalar, &keys, stride, (b0, b1), &qs, &mut want);
                    for (v, q) in qs.iter().enumerate() {
                        for j in b0..b1 {
                            let one = crate::dot::dots_with::<1>(Isa::Scalar, &WeightRow::F32(&keys[j * stride..j * stride + d]), [q])[0];
                            assert_eq!(want[v][j - b0].to_bits(), one.to_bits(), "scalar d {d} key {j}");
                        }
                    }
                    for isa in Isa::all_available() {
                        let mut got: Scores = [[f32::NAN; KEY_BLOCK]; TILE];
                        key_block_dots(isa, &keys, stride, (b0, b1), &qs, &mut got);
                        for v in 0..tile {
                            assert_eq!(bits(&got[v][..b1 - b0]), bits(&want[v][..b1 - b0]), "{} d {d} tile {tile} keys {b0}..{b1}", isa.name());
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn gqa_attention_matches_reference_with_and_without_a_window() {
        // 75 positions: two full key blocks and a partial one; 3 new rows at the end.
        let shape = AttentionShape { num_heads: 6, num_kv_heads: 2, head_dim: 5, scale: 0.4 };
        let (total, n) = (75, 3);
        let first = total - n;
        let q: Vec<f32> = (0..n * 30).map(f).collect();
        let keys: Vec<f32> = (0..total * 10).map(|i| f(i + 77)).collect();
        let values: Vec<f32> = (0..total * 10).map(|i| f(i + 991)).collect();
        for window in [None, Some(40), Some(1)] {
            let mut out = vec![0.0; n * 30];
            attend_rows(&shape, &q, first, &keys, &values, window, None, &mut out);
            for i in 0..n {
                let pos = first + i;
                let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                for h in 0..6 {
                    let kvh = h / 3;
                    let ks: Vec<&[f32]> = (lo..=pos).map(|j| &keys[j * 10 + kvh * 5..j * 10 + kvh * 5 + 5]).collect();
                    let vs: Vec<&[f32]> = (lo..=pos).map(|j| &values[j * 10 + kvh * 5..j * 10 + kvh * 5 + 5]).collect();
                    let want = reference::attend_head(&q[i * 30 + h * 5..i * 30 + h * 5 + 5], &ks, &vs, 0.4);
                    for (a, b) in out[i * 30 + h * 5..i * 30 + h * 5 + 5].iter().zip(want) {
                        assert!((a - b).abs() < 1e-5, "window {window:?} row {i} head {h}: {a} vs {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_prompt_row_attends_exactly_as_the_same_row_in_decode() {
        // Prefill tiles mix rows and heads; decode sees one row. Same bits, any group size.
        for (heads, kv, d) in [(8, 2, 7), (3, 3, 4), (4, 1, 9)] {
            let shape = AttentionShape { num_heads: heads, num_kv_heads: kv, head_dim: d, scale: 0.3 };
            let (qd, stride, n) = (heads * d, kv * d, 70);
            let q: Vec<f32> = (0..n * qd).map(|i| f(i + 5)).collect();
            let keys: Vec<f32> = (0..n * stride).map(|i| f(i + 300)).collect();
            let values: Vec<f32> = (0..n * stride).map(|i| f(i + 7000)).collect();
            for window in [None, Some(33)] {
                let sinks: Vec<f32> = (0..heads).map(|h| f(h + 40)).collect();
                let sinks = (window.is_some()).then_some(sinks.as_slice());
                let mut all = vec![0.0; n * qd];
                attend_rows(&shape, &q, 0, &keys, &values, window, sinks, &mut all);
                for i in 0..n {
                    let mut one = vec![0.0; qd];
                    attend_rows(&shape, &q[i * qd..(i + 1) * qd], i, &keys[..(i + 1) * stride], &values[..(i + 1) * stride], window, sinks, &mut one);
                    assert_eq!(bits(&one), bits(&all[i * qd..(i + 1) * qd]), "{heads}/{kv} heads, window {window:?}, row {i}");
                }
                // And a prefill split in two chunks (chunked prefill) agrees too.
                let mut split = vec![0.0; n * qd];
                let cut = 29;
                attend_rows(&shape, &q[..cut * qd], 0, &keys[..cut * stride], &values[..cut * stride], window, sinks, &mut split[..cut * qd]);
                attend_rows(&shape, &q[cut * qd..], cut, &keys, &values, window, sinks, &mut split[cut * qd..]);
                assert_eq!(bits(&split), bits(&all));
            }
        }
    }

    #[test]
    fn a_sink_takes_its_share_of_the_softmax_and_adds_no_value() {
        // Softmax over [scores…, z] with the sink's column dropped, in f64, as transformers does.
        let shape = AttentionShape { num_heads: 4, num_kv_heads: 2, head_dim: 6, scale: 0.35 };
        let (total, n, d) = (70, 2, 6);
        let first = total - n;
        let q: Vec<f32> = (0..n * 24).map(|i| f(i + 3)).collect();
        let keys: Vec<f32> = (0..total * 12).map(|i| f(i + 17)).collect();
        let values: Vec<f32> = (0..total * 12).map(|i| f(i + 555)).collect();
        // Sinks far below, near and far above the scores.
        let sinks = [-30.0f32, 0.3, 2.5, 40.0];
        for window in [None, Some(9)] {
            let mut out = vec![0.0; n * 24];
            attend_rows(&shape, &q, first, &keys, &values, window, Some(&sinks), &mut out);
            for i in 0..n {
                let pos = first + i;
                let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                for (h, z) in sinks.iter().enumerate() {
                    let kvh = h / 2;
                    let qv = &q[i * 24 + h * d..i * 24 + (h + 1) * d];
                    let s: Vec<f64> = (lo..=pos)
                        .map(|j| keys[j * 12 + kvh * d..j * 12 + (kvh + 1) * d].iter().zip(qv).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * 0.35)
                        .collect();
                    let m = s.iter().fold(*z as f64, |a, b| a.max(*b));
                    let denom = s.iter().map(|x| (x - m).exp()).sum::<f64>() + (*z as f64 - m).exp();
                    for c in 0..d {
                        let want: f64 = (lo..=pos).zip(&s).map(|(j, x)| (x - m).exp() / denom * values[j * 12 + kvh * d + c] as f64).sum();
                        let got = out[i * 24 + h * d + c] as f64;
                        assert!((got - want).abs() < 1e-5, "window {window:?} row {i} head {h} dim {c}: {got} vs {want}");
                    }
                }
            }
        }
        // A sink of −∞ changes nothing.
        let (mut plain, mut neg) = (vec![0.0; n * 24], vec![0.0; n * 24]);
        attend_rows(&shape, &q, first, &keys, &values, None, None, &mut plain);
        attend_rows(&shape, &q, first, &keys, &values, None, Some(&[f32::NEG_INFINITY; 4]), &mut neg);
        assert_eq!(bits(&plain), bits(&neg));
    }

    #[test]
    fn latent_attention_split_over_threads_gives_the_per_key_bits() {
        // Past the split: one decode row of 16 heads and a 20-row prompt chunk over 300 positions;
        // the reference is the selected-keys path with every key, which scores one key at a time.
        let (rank, rope, heads, total) = (64, 16, 16, 300);
        let lat: Vec<f32> = (0..total * rank).map(|i| f(i + 300)).collect();
        let rot: Vec<f32> = (0..total * rope).map(|i| f(i + 900)).collect();
        for n in [1, 20] {
            let first = total - n;
            assert!(2 * n * heads * (rank + rope) * total >= PARALLEL_MIN_WORK, "the test must reach the split");
            let q_lat: Vec<f32> = (0..n * heads * rank).map(|i| f(i + 7)).collect();
            let q_rot: Vec<f32> = (0..n * heads * rope).map(|i| f(i + 40_000)).collect();
            let all: Vec<Vec<usize>> = (0..n).map(|r| (0..=first + r).collect()).collect();
            let mut want = vec![0.0; n * heads * rank];
            attend_latent_selected(&q_lat, &q_rot, (rank, rope), heads, &all, &lat, &rot, 0.3, &mut want);
            let mut pooled = vec![1.0; n * heads * rank];
            attend_latent_rows(&q_lat, &q_rot, (rank, rope), heads, first, &lat, &rot, 0.3, &mut pooled);
            assert_eq!(bits(&pooled), bits(&want), "pool, {n} rows");
            let _turn = crate::team::test_turn();
            let mut teamed = vec![1.0; n * heads * rank];
            crate::team::with_team(2, || attend_latent_rows(&q_lat, &q_rot, (rank, rope), heads, first, &lat, &rot, 0.3, &mut teamed));
            assert_eq!(bits(&teamed), bits(&want), "team, {n} rows");
        }
    }

    #[test]
    fn selected_latent_attention_sees_only_its_keys_and_all_keys_give_the_dense_bits() {
        let (rank, rope, heads, n) = (6, 4, 5, 40);
        let q_lat: Vec<f32> = (0..n * heads * rank).map(|i| f(i + 7)).collect();
        let q_rot: Vec<f32> = (0..n * heads * rope).map(|i| f(i + 40_000)).collect();
        let lat: Vec<f32> = (0..n * rank).map(|i| f(i + 300)).collect();
        let rot: Vec<f32> = (0..n * rope).map(|i| f(i + 900)).collect();
        let mut dense = vec![0.0; n * heads * rank];
        attend_latent_rows(&q_lat, &q_rot, (rank, rope), heads, 0, &lat, &rot, 0.3, &mut dense);
        let all: Vec<Vec<usize>> = (0..n).map(|r| (0..=r).collect()).collect();
        let mut got = vec![0.0; n * heads * rank];
        attend_latent_selected(&q_lat, &q_rot, (rank, rope), heads, &all, &lat, &rot, 0.3, &mut got);
        assert_eq!(bits(&got), bits(&dense));
        // Every third earlier key (and never the row itself): attention over exactly those.
        let some: Vec<Vec<usize>> = (0..n).map(|r| (0..=r).filter(|j| j % 3 == 1 || *j == 0).filter(|j| *j != r || r == 0).collect()).collect();
        attend_latent_selected(&q_lat, &q_rot, (rank, rope), heads, &some, &lat, &rot, 0.3, &mut got);
        for v in 0..n * heads {
            let keys_of_row = &some[v / heads];
            let q: Vec<f32> = q_lat[v * rank..(v + 1) * rank].iter().chain(&q_rot[v * rope..(v + 1) * rope]).copied().collect();
            let keys: Vec<Vec<f32>> =
                keys_of_row.iter().map(|j| lat[j * rank..(j + 1) * rank].iter().chain(&rot[j * rope..(j + 1) * rope]).copied().collect()).collect();
            let ks: Vec<&[f32]> = keys.iter().map(|k| k.as_slice()).collect();
            let vs: Vec<&[f32]> = keys_of_row.iter().map(|j| &lat[j * rank..(j + 1) * rank]).collect();
            let want = reference::attend_head(&q, &ks, &vs, 0.3);
            for (a, b) in got[v * rank..(v + 1) * rank].iter().zip(want) {
                assert!((a - b).abs() < 1e-5, "vector {v}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn latent_attention_equals_attention_over_concatenated_keys_and_is_row_invariant() {
        // q = [q_lat | q_rot], k_j = [c_j | r_j], v_j = c_j: the absorbed form is plain attention.
        let (rank, rope, heads, n) = (6, 4, 5, 40);
        let q_lat: Vec<f32> = (0..n * heads * rank).map(f).collect();
        let q_rot: Vec<f32> = (0..n * heads * rope).map(|i| f(i + 50_000)).collect();
        let lat: Vec<f32> = (0..n * rank).map(|i| f(i + 100)).collect();
        let rot: Vec<f32> = (0..n * rope).map(|i| f(i + 500)).collect();
        let mut out = vec![0.0; n * heads * rank];
        attend_latent_rows(&q_lat, &q_rot, (rank, rope), heads, 0, &lat, &rot, 0.3, &mut out);
        for v in 0..n * heads {
            let row = v / heads;
            let q: Vec<f32> = q_lat[v * rank..(v + 1) * rank].iter().chain(&q_rot[v * rope..(v + 1) * rope]).copied().collect();
            let keys: Vec<Vec<f32>> =
                (0..=row).map(|j| lat[j * rank..(j + 1) * rank].iter().chain(&rot[j * rope..(j + 1) * rope]).copied().collect()).collect();
            let ks: Vec<&[f32]> = keys.iter().map(|k| k.as_slice()).collect();
            let vs: Vec<&[f32]> = (0..=row).map(|j| &lat[j * rank..(j + 1) * rank]).collect();
            let want = reference::attend_head(&q, &ks, &vs, 0.3);
            for (a, b) in out[v * rank..(v + 1) * rank].iter().zip(want) {
                assert!((a - b).abs() < 1e-5, "vector {v}: {a} vs {b}");
            }
            if v % heads == 0 {
                // The row alone (decode) gives the same bits as inside the prompt.
                let mut one = vec![0.0; heads * rank];
                let (a, b) = (v * rank, (v + heads) * rank);
                attend_latent_rows(
                    &q_lat[a..b],
                    &q_rot[v * rope..(v + heads) * rope],
                    (rank, rope),
                    heads,
                    row,
                    &lat[..(row + 1) * rank],
                    &rot[..(row + 1) * rope],
                    0.3,
                    &mut one,
                );
                assert_eq!(bits(&one), bits(&out[a..b]), "row {row}");
            }
        }
    }

    #[test]
    fn gathered_attention_matches_the_softmax_definition_with_sinks() {
        let (heads, d) = (5, 12);
        let q: Vec<f32> = (0..heads * d).map(|i| ((i * 37) % 17) as f32 / 8.0 - 1.0).collect();
        let store: Vec<Vec<f32>> = (0..9).map(|j| (0..d).map(|i| ((i * 13 + j * 7) % 11) as f32 / 5.0 - 1.0).collect()).collect();
        let keys: Vec<&[f32]> = store.iter().map(|k| k.as_slice()).collect();
        let sinks: Vec<f32> = (0..heads).map(|h| h as f32 * 0.4 - 0.5).collect();
        let scale = 0.3;
        let mut out = vec![0.0f32; heads * d];
        attend_gathered(&q, &keys, d, scale, Some(&sinks), &mut out);
        for h in 0..heads {
            let qh = &q[h * d..(h + 1) * d];
            let logits: Vec<f64> = keys.iter().map(|k| k.iter().zip(qh).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>() * f64::from(scale)).collect();
            let m = logits.iter().copied().fold(f64::from(sinks[h]), f64::max);
            let z: f64 = logits.iter().map(|l| (l - m).exp()).sum::<f64>() + (f64::from(sinks[h]) - m).exp();
            for i in 0..d {
                let want: f64 = logits.iter().zip(&keys).map(|(l, k)| (l - m).exp() / z * f64::from(k[i])).sum();
                assert!((f64::from(out[h * d + i]) - want).abs() < 1e-5, "head {h} dim {i}: {} vs {want}", out[h * d + i]);
            }
        }
        // No keys and no sinks: zeros, not NaN.
        attend_gathered(&q, &[], d, scale, None, &mut out);
        assert!(out.iter().all(|x| *x == 0.0));
    }
}
