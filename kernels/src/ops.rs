//! Row-wise elementwise kernels: RMSNorm, softmax, SiLU gating, rotary embedding.

/// `out = weight ⊙ x / sqrt(mean(x²) + eps)`, as transformers' RMSNorm computes it in f32.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let ms = sum_of_squares(x) / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// Lanes of `sum_of_squares`' order.
const SQUARE_LANES: usize = 16;

/// `Σ x²` in one fixed order, the same on every machine: element `i` into lane `i mod 16` (in
/// element order, a multiply then an add), then the lanes added pairwise, `lane[j] += lane[j + s]`
/// for `s` in 8, 4, 2, 1. A sum element after element was one dependent add per value — a
/// 64-token prompt of the demo spent ~7 % of its time in RMSNorm; with the lanes as a plain array
/// the compiler uses vector registers without changing a step (Rust never fuses the multiply
/// into the add).
pub fn sum_of_squares(x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; SQUARE_LANES];
    let mut chunks = x.chunks_exact(SQUARE_LANES);
    for chunk in &mut chunks {
        for (lane, v) in lanes.iter_mut().zip(chunk) {
            *lane += v * v;
        }
    }
    for (lane, v) in lanes.iter_mut().zip(chunks.remainder()) {
        *lane += v * v;
    }
    let mut width = SQUARE_LANES;
    while width > 1 {
        width /= 2;
        let (low, high) = lanes.split_at_mut(width);
        low.iter_mut().zip(&high[..width]).for_each(|(a, b)| *a += *b);
    }
    lanes[0]
}

/// In-place RMSNorm of each `width`-long chunk of `x` with the same weight (per-head QK-norm).
pub fn rms_norm_chunks(x: &mut [f32], weight: &[f32], eps: f32, scratch: &mut [f32]) {
    if let Some(per) = crate::team::piece_len(x.len(), weight.len(), TEAM_MIN_NORM_FLOATS) {
        // A prompt's heads over the step's team, each piece with a scratch of its own.
        let width = weight.len();
        return crate::team::chunks_mut(x, per, false, |_, piece| {
            let mut own = vec![0.0f32; width];
            norm_chunks_here(piece, weight, eps, &mut own)
        });
    }
    norm_chunks_here(x, weight, eps, scratch)
}

fn norm_chunks_here(x: &mut [f32], weight: &[f32], eps: f32, scratch: &mut [f32]) {
    let width = weight.len();
    for chunk in x.chunks_exact_mut(width) {
        rms_norm(chunk, weight, eps, &mut scratch[..width]);
        chunk.copy_from_slice(&scratch[..width]);
    }
}

/// `rms_norm` of each `weight.len()`-long row of `x` into the same row of `out`: over the step's
/// team when one is active and the rows are many (a prompt's norms ran on one thread while the
/// other waited), each row exactly as alone.
pub fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len().max(1);
    let here = |x: &[f32], out: &mut [f32]| {
        for (xr, or) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
            rms_norm(xr, weight, eps, or);
        }
    };
    if let Some(per) = crate::team::piece_len(x.len(), width, TEAM_MIN_NORM_FLOATS) {
        return crate::team::chunks_mut(out, per, false, |c, piece| here(&x[c * per..c * per + piece.len()], piece));
    }
    here(x, out)
}

/// Floats from which a step's team shares a batch of norms: a 64-token prompt of the demo model
/// (256 wide). A claim among the team costs about a microsecond and a 256-float norm ~0.1 µs;
/// with the bound at 16 rows a 16-sequence batch's decode step ran 5 % slower (in-process
/// alternation, `docs/benchmarks.md`, issue 18).
const TEAM_MIN_NORM_FLOATS: usize = 16384;

pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// SiLU as every device computes it (`gating.rs`: no libm, the same bits everywhere).
pub use crate::gating::silu;

/// `gate = silu(gate) ⊙ up`, in place (SwiGLU), as every device computes it (`gating.rs`).
pub use crate::gating::swiglu_in_place;

/// Rotary embedding, "rotate half" layout: for i < d/2, (x[i], x[i+d/2]) rotates by the angle
/// whose cos/sin are `cos[i]`, `sin[i]`.
pub fn rope_rotate_half(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

/// Rotary embedding, interleaved layout (DeepSeek): pair (x[2i], x[2i+1]) rotates by the angle of
/// `cos[i]`, `sin[i]`. transformers de-interleaves the result; since queries and keys get the same
/// permutation, their dot products — all attention uses — are the same.
pub fn rope_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    for (i, pair) in x.chunks_exact_mut(2).enumerate() {
        let (a, b) = (pair[0], pair[1]);
        pair[0] = a * cos[i] - b * sin[i];
        pair[1] = b * cos[i] + a * sin[i];
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's softplus (β = 1, threshold 20): `x` above 20, else `ln(1 + eˣ)`.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference;

    /// Norms of many rows (and many heads) over a step's team give each row's bits alone.
    #[test]
    fn norms_over_a_team_give_each_rows_bits() {
        let _turn = crate::team::test_turn();
        let width = 48;
        let weight: Vec<f32> = (0..width).map(|i| 0.5 + i as f32 / 64.0).collect();
        // 400 rows of 48 are past `TEAM_MIN_NORM_FLOATS`: the team's pieces.
        const { assert!(400 * 48 >= TEAM_MIN_NORM_FLOATS && 85 * 48 < TEAM_MIN_NORM_FLOATS) };
        for rows in [1usize, 85, 400] {
            let x: Vec<f32> = (0..rows * width).map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 4.0).collect();
            let mut alone = vec![0.0f32; x.len()];
            for (xr, or) in x.chunks_exact(width).zip(alone.chunks_exact_mut(width)) {
                rms_norm(xr, &weight, 1e-6, or);
            }
            let (rows_out, chunks_out) = crate::team::with_team(2, || {
                assert!(crate::team::active().is_some(), "a team while no other is active");
                let mut out = vec![f32::NAN; x.len()];
                rms_norm_rows(&x, &weight, 1e-6, &mut out);
                let mut inplace = x.clone();
                rms_norm_chunks(&mut inplace, &weight, 1e-6, &mut vec![0.0; width]);
                (out, inplace)
            });
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&rows_out), bits(&alone), "{rows} rows");
            assert_eq!(bits(&chunks_out), bits(&alone), "{rows} chunks in place");
        }
    }

    /// `sum_of_squares`' order written out one value at a time: the lanes, then the tree.
    fn sum_of_squares_by_definition(x: &[f32]) -> f32 {
        let mut lanes = [0.0f32; 16];
        for (i, v) in x.iter().enumerate() {
            lanes[i % 16] += v * v;
        }
        for s in [8, 4, 2, 1] {
            for j in 0..s {
                lanes[j] += lanes[j + s];
            }
        }
        lanes[0]
    }

    #[test]
    fn sum_of_squares_keeps_its_order_on_every_length() {
        for n in [0usize, 1, 7, 15, 16, 17, 31, 64, 100, 256, 4099] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 2654435761usize) % 1000) as f32 / 37.0 - 13.0).collect();
            assert_eq!(sum_of_squares(&x).to_bits(), sum_of_squares_by_definition(&x).to_bits(), "length {n}");
            let exact: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum();
            assert!((sum_of_squares(&x) as f64 - exact).abs() <= 1e-5 * exact.max(1.0), "length {n}");
        }
        assert!(sum_of_squares(&[1.0, f32::NAN]).is_nan());
    }

    #[test]
    fn rms_norm_and_softmax_match_reference() {
        let x: Vec<f32> = (0..37).map(|i| ((i * 7919) % 23) as f32 - 11.0).collect();
        let w: Vec<f32> = (0..37).map(|i| 0.5 + i as f32 / 37.0).collect();
        let mut out = vec![0.0; 37];
        rms_norm(&x, &w, 1e-6, &mut out);
        for (a, b) in out.iter().zip(reference::rms_norm(&x, &w, 1e-6)) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        let mut s = x.clone();
        softmax_in_place(&mut s);
        for (a, b) in s.iter().zip(reference::softmax(&x)) {
            assert!((a - b).abs() < 1e-6);
        }
        for v in [-20.0f32, -1.0, 0.0, 0.5, 30.0] {
            assert!((silu(v) - reference::silu(v)).abs() < 1e-6);
        }
    }

    #[test]
    fn interleaved_rope_is_the_split_layout_permuted() {
        let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let (cos, sin) = ([0.6f32, 0.8, -1.0], [0.8f32, 0.6, 0.0]);
        let mut inter = x;
        rope_interleaved(&mut inter, &cos, &sin);
        // The same rotation on the de-interleaved vector [x0 x2 x4 | x1 x3 x5].
        let mut split = [x[0], x[2], x[4], x[1], x[3], x[5]];
        rope_rotate_half(&mut split, &cos, &sin);
        assert_eq!(inter, [split[0], split[3], split[1], split[4], split[2], split[5]]);
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-7 && sigmoid(-100.0) >= 0.0);
    }

    #[test]
    fn rope_is_a_rotation() {
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        let (c, s) = (0.6f32, 0.8f32);
        rope_rotate_half(&mut x, &[c, 1.0], &[s, 0.0]);
        assert!((x[0] - (1.0 * c - 3.0 * s)).abs() < 1e-6);
        assert!((x[2] - (3.0 * c + 1.0 * s)).abs() < 1e-6);
        assert_eq!((x[1], x[3]), (2.0, 4.0));
        let norm: f32 = x.iter().map(|v| v * v).sum();
        assert!((norm - 30.0).abs() < 1e-4);
    }
}
