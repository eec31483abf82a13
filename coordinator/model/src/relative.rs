//! Inkling's attention (`RelativeSpec`): no rotary. Each query adds to its logit for a key `d`
//! positions back a bias from a learned profile per distance (`rel_extent` of them), mixed by the
//! query's own `d_rel` states per head; keys and values pass a short causal convolution with a
//! residual first, and the attention's output another one after `o_proj`. Sliding and full
//! layers have their own head shapes; full layers may scale queries and biases up
//! logarithmically with position. The MLP's output passes a convolution of the same kind
//! (`mlp_conv`, run by the decoder through this module, which owns the cache rows).
//!
//! Per position the cache's auxiliary slot holds what the convolutions and attention read later:
//! the raw key and value projections, the convolved (and normed) key and value, the raw attention
//! output and the raw MLP output. A cache cut at any length holds exactly what its positions
//! make: nothing here is recurrent.
//!
//! Must never: let a query see a key after its own position or outside its window, or a
//! convolution read a position after the one it computes.

use shimmer_common::spec::{HeadShape, RelativeSpec};
use shimmer_common::{Checkpoint, LoadError, ModelSpec};
use shimmer_kernels::{ops, Matrix};

use crate::decoder::{matrix, name, vector, SegmentRows};

pub(crate) struct Relative {
    shape: HeadShape,
    window: Option<usize>,
    rel_extent: usize,
    d_rel: usize,
    log_scaling: Option<(f32, f32)>,
    q: Matrix,
    k: Matrix,
    v: Matrix,
    r: Matrix,
    o: Matrix,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    /// Depthwise convolutions, `channels × kernel` each.
    k_conv: Vec<f32>,
    v_conv: Vec<f32>,
    attn_conv: Vec<f32>,
    mlp_conv: Vec<f32>,
    kernel: usize,
    /// `d_rel × rel_extent`: bias profile r at distance d.
    rel_proj: Vec<f32>,
    /// Inkling 2's parts.
    v2: Option<Box<V2>>,
}

/// What an Inkling 2 layer adds.
struct V2 {
    /// Learned scales before the L2 clips: `heads × head_dim` and `heads × d_rel`.
    q_scale: Vec<f32>,
    rel_scale: Vec<f32>,
    qk_clip: f32,
    rel_clip: f32,
    /// Per-token sink logits (`heads × hidden`) and the output gate (`heads·d × hidden`).
    sink: Matrix,
    gate: Matrix,
    /// Full layers: key and value convolutions whose taps add a per-token part
    /// (`static`: `kernel × channels`, tap 0 the current position; `proj`: `kv_heads·kernel ×
    /// hidden` from the key's or value's input), and the k and v input norms.
    dynamic: Option<[(Vec<f32>, Matrix); 2]>,
    kv_input_norms: Option<[Vec<f32>; 2]>,
}

/// `x · min(1, threshold / (‖x‖ + 1e-6))` per head of `x` (`d` long), after multiplying by the
/// head's `scale` when given.
fn l2_clip(x: &mut [f32], d: usize, scale: Option<&[f32]>, threshold: f32) {
    for (h, head) in x.chunks_exact_mut(d).enumerate() {
        if let Some(s) = scale {
            head.iter_mut().zip(&s[h * d..(h + 1) * d]).for_each(|(v, s)| *v *= s);
        }
        let norm = ops::sum_of_squares(head).sqrt();
        let factor = (threshold / (norm + 1e-6)).min(1.0);
        head.iter_mut().for_each(|v| *v *= factor);
    }
}

/// Offsets of a position's auxiliary row.
struct Layout {
    kvd: usize,
    hidden: usize,
}

impl Layout {
    fn k_raw(&self) -> usize {
        0
    }
    fn v_raw(&self) -> usize {
        self.kvd
    }
    fn k(&self) -> usize {
        2 * self.kvd
    }
    fn v(&self) -> usize {
        3 * self.kvd
    }
    fn attn_raw(&self) -> usize {
        4 * self.kvd
    }
    fn mlp_raw(&self) -> usize {
        4 * self.kvd + self.hidden
    }
    fn width(&self) -> usize {
        4 * self.kvd + 2 * self.hidden
    }
}

/// One position's output of a depthwise causal convolution with a residual: channel c is
/// `Σ_j w[c][j] · x(p − (K−1) + j)[c] + x(p)[c]`, positions before 0 counting as zeros.
fn short_conv<'a>(weights: &[f32], kernel: usize, p: usize, x: impl Fn(usize) -> &'a [f32], out: &mut [f32]) {
    let current = x(p);
    for (c, o) in out.iter_mut().enumerate() {
        let mut sum = 0.0f32;
        for j in 0..kernel {
            if let Some(q) = (p + j).checked_sub(kernel - 1) {
                sum += weights[c * kernel + j] * x(q)[c];
            }
        }
        *o = sum + current[c];
    }
}

impl Relative {
    /// Layer `l` of an Inkling model, or of an Inkling 2 one (`rs.v2`).
    pub fn load(ckpt: &Checkpoint, spec: &ModelSpec, rs: &RelativeSpec, l: usize) -> Result<Self, LoadError> {
        let h = spec.hidden_size;
        let n = &rs.names;
        let sliding = rs.sliding_layers[l];
        let shape = if sliding { rs.sliding } else { rs.full };
        let (d, qd, kvd) = (shape.head_dim, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim);
        let rel_extent = if sliding { rs.window } else { rs.rel_extent };
        let k = rs.conv_kernel;
        let conv = |template: &str, channels: usize| -> Result<Vec<f32>, LoadError> { Ok(ckpt.get(&name(template, l), &[channels, 1, k])?.to_f32()) };
        // Inkling norms q and k per head; Inkling 2 clips them instead, and its full layers
        // convolve keys and values with per-token taps and norm their own k and v inputs.
        let (q_norm, k_norm) = match &rs.v2 {
            None => (vector(ckpt, &name(n.q_norm, l), d)?, vector(ckpt, &name(n.k_norm, l), d)?),
            Some(_) => (Vec::new(), Vec::new()),
        };
        let (k_conv, v_conv, dynamic, kv_input_norms) = match &rs.v2 {
            Some(v2) if !sliding => {
                let m = &v2.names;
                let dynamic = |stat: &str, proj: &str| -> Result<(Vec<f32>, Matrix), LoadError> {
                    Ok((ckpt.get(&name(stat, l), &[k, kvd])?.to_f32(), matrix(ckpt, spec, &name(proj, l), shape.kv_heads * k, h)?))
                };
                let norms = [vector(ckpt, &name(m.k_input_norm, l), h)?, vector(ckpt, &name(m.v_input_norm, l), h)?];
                (Vec::new(), Vec::new(), Some([dynamic(m.k_static, m.k_dynamic)?, dynamic(m.v_static, m.v_dynamic)?]), Some(norms))
            }
            _ => (conv(n.k_conv, kvd)?, conv(n.v_conv, kvd)?, None, None),
        };
        let v2 = match &rs.v2 {
            Some(v2) => {
                let m = &v2.names;
                Some(Box::new(V2 {
                    q_scale: ckpt.get(&name(m.q_scale, l), &[shape.heads, d])?.to_f32(),
                    rel_scale: ckpt.get(&name(m.rel_scale, l), &[shape.heads, rs.d_rel])?.to_f32(),
                    qk_clip: v2.qk_clip,
                    rel_clip: v2.rel_clip,
                    sink: matrix(ckpt, spec, &name(m.sink, l), shape.heads, h)?,
                    gate: matrix(ckpt, spec, &name(m.gate, l), qd, h)?,
                    dynamic,
                    kv_input_norms,
                }))
            }
            None => None,
        };
        Ok(Relative {
            shape,
            window: sliding.then_some(rs.window),
            rel_extent,
            d_rel: rs.d_rel,
            log_scaling: if sliding { None } else { rs.log_scaling },
            q: matrix(ckpt, spec, &name(n.q, l), qd, h)?,
            k: matrix(ckpt, spec, &name(n.k, l), kvd, h)?,
            v: matrix(ckpt, spec, &name(n.v, l), kvd, h)?,
            r: matrix(ckpt, spec, &name(n.r, l), shape.heads * rs.d_rel, h)?,
            o: matrix(ckpt, spec, &name(n.o, l), h, qd)?,
            q_norm,
            k_norm,
            k_conv,
            v_conv,
            attn_conv: conv(n.attn_conv, h)?,
            mlp_conv: conv(n.mlp_conv, h)?,
            kernel: k,
            rel_proj: ckpt.get(&name(n.rel_proj, l), &[rs.d_rel, rel_extent])?.to_f32(),
            v2,
        })
    }

    /// Whether this layer reads separate q, k and v inputs (an Inkling 2 full layer).
    pub fn takes_three_inputs(&self) -> bool {
        self.v2.as_ref().is_some_and(|v| v.kv_input_norms.is_some())
    }

    pub fn bytes(&self) -> usize {
        self.q.bytes() + self.k.bytes() + self.v.bytes() + self.r.bytes() + self.o.bytes() + self.v2.as_ref().map_or(0, |v| v.sink.bytes() + v.gate.bytes())
    }

    fn layout(&self, hidden: usize) -> Layout {
        Layout { kvd: self.shape.kv_heads * self.shape.head_dim, hidden }
    }

    /// Values per position of layer `l`'s auxiliary slot.
    pub fn aux_width(spec: &ModelSpec, rs: &RelativeSpec, l: usize) -> usize {
        let shape = if rs.sliding_layers[l] { rs.sliding } else { rs.full };
        Layout { kvd: shape.kv_heads * shape.head_dim, hidden: spec.hidden_size }.width()
    }

    pub fn forward(&self, spec: &ModelSpec, l: usize, x: &[f32], segments: &mut [SegmentRows<'_>], out: &mut [f32]) {
        let hidden = spec.hidden_size;
        let eps = spec.rms_norm_eps;
        let HeadShape { heads, kv_heads, head_dim: d } = self.shape;
        let (qd, kvd) = (heads * d, kv_heads * d);
        let n = x.len() / hidden;
        let lay = self.layout(hidden);
        let w = lay.width();
        let (mut q, mut k_raw, mut v_raw, mut rel) = (vec![0.0f32; n * qd], vec![0.0f32; n * kvd], vec![0.0f32; n * kvd], vec![0.0f32; n * heads * self.d_rel]);
        self.q.matmul(x, &mut q);
        self.k.matmul(x, &mut k_raw);
        self.v.matmul(x, &mut v_raw);
        self.r.matmul(x, &mut rel);
        let mut scratch = vec![0.0f32; d];
        for head in q.chunks_exact_mut(d) {
            ops::rms_norm(head, &self.q_norm, eps, &mut scratch);
            head.copy_from_slice(&scratch);
        }
        let mut attn = vec![0.0f32; n * qd];
        // q and k are RMS-normed per head, hence 1/d rather than 1/√d.
        let scaling = 1.0 / d as f32;
        for seg in segments.iter_mut() {
            let (rows, start) = (seg.rows.clone(), seg.start);
            let len = rows.len();
            // The new positions' rows: raw projections first, then their convolutions (which
            // read the earlier positions' raw projections from the cache).
            let mut aux = raw_rows(&lay, &k_raw, &v_raw, rows.clone());
            let earlier = seg.cache.aux(l, 0..start);
            let mut convolved = vec![0.0f32; kvd];
            for i in 0..len {
                let p = start + i;
                for (raw, conv, dst) in [(lay.k_raw(), &self.k_conv, lay.k()), (lay.v_raw(), &self.v_conv, lay.v())] {
                    let at = |q: usize| -> &[f32] {
                        if q < start {
                            &earlier[q * w + raw..q * w + raw + kvd]
                        } else {
                            &aux[(q - start) * w + raw..(q - start) * w + raw + kvd]
                        }
                    };
                    short_conv(conv, self.kernel, p, at, &mut convolved);
                    aux[i * w + dst..i * w + dst + kvd].copy_from_slice(&convolved);
                }
                for head in aux[i * w + lay.k()..i * w + lay.k() + kvd].chunks_exact_mut(d) {
                    ops::rms_norm(head, &self.k_norm, eps, &mut scratch);
                    head.copy_from_slice(&scratch);
                }
            }
            seg.cache.append_aux(l, &aux);
            let all = seg.cache.aux(l, 0..start + len);
            for i in 0..len {
                let (row, p) = (rows.start + i, start + i);
                let tau = self.tau(p);
                q[row * qd..(row + 1) * qd].iter_mut().for_each(|v| *v *= tau);
                let states = &rel[row * heads * self.d_rel..(row + 1) * heads * self.d_rel];
                self.attend_row(all, &lay, p, &q[row * qd..(row + 1) * qd], states, tau, scaling, None, &mut attn[row * qd..(row + 1) * qd]);
            }
        }
        let mut projected = vec![0.0f32; n * hidden];
        self.o.matmul(&attn, &mut projected);
        self.convolve_output(l, hidden, lay.attn_raw(), &self.attn_conv, &projected, segments, out);
    }

    /// An Inkling 2 layer: `xq` the query input (normed by the caller), `xk`/`xv` the raw key and
    /// value inputs of a full layer (normed here; a sliding layer uses `xq` for all three).
    pub fn forward_v2(&self, spec: &ModelSpec, l: usize, xq: &[f32], kv_inputs: Option<(&[f32], &[f32])>, segments: &mut [SegmentRows<'_>], out: &mut [f32]) {
        let Some(v2) = &self.v2 else { return self.forward(spec, l, xq, segments, out) };
        let hidden = spec.hidden_size;
        let eps = spec.rms_norm_eps;
        let HeadShape { heads, kv_heads, head_dim: d } = self.shape;
        let (qd, kvd, k) = (heads * d, kv_heads * d, self.kernel);
        let n = xq.len() / hidden;
        let lay = self.layout(hidden);
        let w = lay.width();
        let (xk, xv): (Vec<f32>, Vec<f32>) = match (kv_inputs, &v2.kv_input_norms) {
            (Some((xk, xv)), Some([kn, vn])) => {
                let norm = |x: &[f32], wt: &[f32]| -> Vec<f32> {
                    let mut o = vec![0.0f32; x.len()];
                    for (r, orow) in x.chunks_exact(hidden).zip(o.chunks_exact_mut(hidden)) {
                        ops::rms_norm(r, wt, eps, orow);
                    }
                    o
                };
                (norm(xk, kn), norm(xv, vn))
            }
            _ => (xq.to_vec(), xq.to_vec()),
        };
        let (mut q, mut k_raw, mut v_raw, mut rel) = (vec![0.0f32; n * qd], vec![0.0f32; n * kvd], vec![0.0f32; n * kvd], vec![0.0f32; n * heads * self.d_rel]);
        self.q.matmul(xq, &mut q);
        self.k.matmul(&xk, &mut k_raw);
        self.v.matmul(&xv, &mut v_raw);
        self.r.matmul(xq, &mut rel);
        let (mut sinks, mut gate) = (vec![0.0f32; n * heads], vec![0.0f32; n * qd]);
        v2.sink.matmul(xq, &mut sinks);
        v2.gate.matmul(xq, &mut gate);
        let mut taps: [Vec<f32>; 2] = [Vec::new(), Vec::new()];
        if let Some(dynamic) = &v2.dynamic {
            for ((_, proj), (x, t)) in dynamic.iter().zip([&xk, &xv].into_iter().zip(taps.iter_mut())) {
                *t = vec![0.0f32; n * kv_heads * k];
                proj.matmul(x, t);
            }
        }
        let mut attn = vec![0.0f32; n * qd];
        let scaling = (d as f32).powf(-0.5);
        let static_div = ((k + 1) as f64).sqrt() as f32;
        let dynamic_div = ((2 * k + 1) as f64).sqrt() as f32;
        for seg in segments.iter_mut() {
            let (rows, start) = (seg.rows.clone(), seg.start);
            let len = rows.len();
            let mut aux = raw_rows(&lay, &k_raw, &v_raw, rows.clone());
            let earlier = seg.cache.aux(l, 0..start);
            let mut convolved = vec![0.0f32; kvd];
            for i in 0..len {
                let p = start + i;
                for (which, (raw, dst)) in [(lay.k_raw(), lay.k()), (lay.v_raw(), lay.v())].into_iter().enumerate() {
                    let at = |q: usize| -> &[f32] {
                        if q < start {
                            &earlier[q * w + raw..q * w + raw + kvd]
                        } else {
                            &aux[(q - start) * w + raw..(q - start) * w + raw + kvd]
                        }
                    };
                    match &v2.dynamic {
                        None => {
                            let conv = if which == 0 { &self.k_conv } else { &self.v_conv };
                            short_conv(conv, k, p, at, &mut convolved);
                            convolved.iter_mut().for_each(|v| *v /= static_div);
                        }
                        Some(dynamic) => {
                            let stat = &dynamic[which].0;
                            let dynw = &taps[which][(rows.start + i) * kv_heads * k..(rows.start + i + 1) * kv_heads * k];
                            let current = at(p);
                            for (c, o) in convolved.iter_mut().enumerate() {
                                let g = c / d;
                                let mut sum = 0.0f32;
                                for lag in 0..k.min(p + 1) {
                                    sum += at(p - lag)[c] * (stat[lag * kvd + c] + dynw[g * k + lag]);
                                }
                                *o = (sum + current[c]) / dynamic_div;
                            }
                        }
                    }
                    aux[i * w + dst..i * w + dst + kvd].copy_from_slice(&convolved);
                }
                l2_clip(&mut aux[i * w + lay.k()..i * w + lay.k() + kvd], d, None, v2.qk_clip);
                for head in aux[i * w + lay.v()..i * w + lay.v() + kvd].chunks_exact_mut(d) {
                    let mean = ops::sum_of_squares(head) / d as f32;
                    let r = 1.0 / (mean + eps).sqrt();
                    head.iter_mut().for_each(|v| *v *= r);
                }
            }
            seg.cache.append_aux(l, &aux);
            let all = seg.cache.aux(l, 0..start + len);
            for i in 0..len {
                let (row, p) = (rows.start + i, start + i);
                let tau = self.tau(p);
                let qrow = &mut q[row * qd..(row + 1) * qd];
                l2_clip(qrow, d, Some(&v2.q_scale), v2.qk_clip);
                qrow.iter_mut().for_each(|v| *v *= tau);
                let rrow = &mut rel[row * heads * self.d_rel..(row + 1) * heads * self.d_rel];
                l2_clip(rrow, self.d_rel, Some(&v2.rel_scale), v2.rel_clip);
                rrow.iter_mut().for_each(|v| *v *= tau);
                let (qrow, states) = (&q[row * qd..(row + 1) * qd], &rel[row * heads * self.d_rel..(row + 1) * heads * self.d_rel]);
                let sink = &sinks[row * heads..(row + 1) * heads];
                self.attend_row(all, &lay, p, qrow, states, 1.0, scaling, Some(sink), &mut attn[row * qd..(row + 1) * qd]);
            }
        }
        attn.iter_mut().zip(&gate).for_each(|(a, g)| *a *= ops::sigmoid(*g));
        let mut projected = vec![0.0f32; n * hidden];
        self.o.matmul(&attn, &mut projected);
        self.convolve_output(l, hidden, lay.attn_raw(), &self.attn_conv, &projected, segments, out);
        out.iter_mut().for_each(|v| *v /= static_div);
    }

    /// Full layers' logarithmic scale at position `p` (1 elsewhere).
    fn tau(&self, p: usize) -> f32 {
        match self.log_scaling {
            Some((floor, alpha)) => 1.0 + alpha * ((p + 1) as f32 / floor).max(1.0).ln(),
            None => 1.0,
        }
    }

    /// One query row's heads over its window (`all`: the auxiliary rows up to `p`): logits
    /// `q·k·scaling + bias_scale · (states · profile at the distance)`, with a per-head sink if
    /// given, softmax, the values' weighted sum.
    #[allow(clippy::too_many_arguments)]
    fn attend_row(
        &self,
        all: &[f32],
        lay: &Layout,
        p: usize,
        q: &[f32],
        states: &[f32],
        bias_scale: f32,
        scaling: f32,
        sinks: Option<&[f32]>,
        out: &mut [f32],
    ) {
        let HeadShape { heads, kv_heads, head_dim: d } = self.shape;
        let (w, group) = (lay.width(), heads / kv_heads);
        let lo = self.window.map_or(0, |win| (p + 1).saturating_sub(win));
        let mut logits = Vec::with_capacity(p + 2 - lo);
        for hq in 0..heads {
            let g = hq / group;
            let qh = &q[hq * d..(hq + 1) * d];
            let st = &states[hq * self.d_rel..(hq + 1) * self.d_rel];
            logits.clear();
            for j in lo..=p {
                let key = &all[j * w + lay.k() + g * d..j * w + lay.k() + (g + 1) * d];
                let dot: f32 = qh.iter().zip(key).map(|(a, b)| a * b).sum();
                let distance = p - j;
                let bias = if distance < self.rel_extent {
                    st.iter().enumerate().map(|(r, s)| s * self.rel_proj[r * self.rel_extent + distance]).sum::<f32>() * bias_scale
                } else {
                    0.0
                };
                logits.push(dot * scaling + bias);
            }
            // A sink joins the softmax with no value.
            if let Some(s) = sinks {
                logits.push(s[hq]);
            }
            ops::softmax_in_place(&mut logits);
            let o = &mut out[hq * d..(hq + 1) * d];
            o.fill(0.0);
            for (pj, j) in logits.iter().zip(lo..=p) {
                let value = &all[j * w + lay.v() + g * d..j * w + lay.v() + (g + 1) * d];
                o.iter_mut().zip(value).for_each(|(a, v)| *a += pj * v);
            }
        }
    }

    /// The MLP's output through its convolution (the layer's `mlp_conv`), in place.
    pub fn convolve_mlp(&self, l: usize, hidden: usize, segments: &mut [SegmentRows<'_>], y: &mut [f32]) {
        let raw = y.to_vec();
        let lay = self.layout(hidden);
        self.convolve_output(l, hidden, lay.mlp_raw(), &self.mlp_conv, &raw, segments, y);
        if self.v2.is_some() {
            // Inkling 2 scales its convolutions' outputs down by √(K + 1).
            let div = ((self.kernel + 1) as f64).sqrt() as f32;
            y.iter_mut().for_each(|v| *v /= div);
        }
    }

    /// `out` = the convolution of `raw` (every row of every segment), the raw rows kept in the
    /// positions' auxiliary rows at `offset` for later positions to read.
    #[allow(clippy::too_many_arguments)]
    fn convolve_output(&self, l: usize, hidden: usize, offset: usize, conv: &[f32], raw: &[f32], segments: &mut [SegmentRows<'_>], out: &mut [f32]) {
        let w = seg_width(segments, l);
        for seg in segments.iter_mut() {
            let (rows, start) = (seg.rows.clone(), seg.start);
            {
                let pending = seg.cache.aux_pending_mut(l);
                for (i, row) in rows.clone().enumerate() {
                    pending[i * w + offset..i * w + offset + hidden].copy_from_slice(&raw[row * hidden..(row + 1) * hidden]);
                }
            }
            let all = seg.cache.aux(l, 0..start + rows.len());
            for (i, row) in rows.clone().enumerate() {
                let at = |q: usize| -> &[f32] { &all[q * w + offset..q * w + offset + hidden] };
                short_conv(conv, self.kernel, start + i, at, &mut out[row * hidden..(row + 1) * hidden]);
            }
        }
    }
}

/// A segment's new auxiliary rows holding their raw key and value projections (the rest filled
/// in after).
fn raw_rows(lay: &Layout, k_raw: &[f32], v_raw: &[f32], rows: std::ops::Range<usize>) -> Vec<f32> {
    let (w, kvd) = (lay.width(), lay.kvd);
    let mut aux = vec![0.0f32; rows.len() * w];
    for (i, row) in aux.chunks_exact_mut(w).enumerate() {
        let r = rows.start + i;
        row[lay.k_raw()..lay.k_raw() + kvd].copy_from_slice(&k_raw[r * kvd..(r + 1) * kvd]);
        row[lay.v_raw()..lay.v_raw() + kvd].copy_from_slice(&v_raw[r * kvd..(r + 1) * kvd]);
    }
    aux
}

fn seg_width(segments: &[SegmentRows<'_>], l: usize) -> usize {
    segments.first().map_or(0, |s| s.cache.aux_width(l))
}
