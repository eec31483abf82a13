//! A weight matrix read from a checkpoint in the precision it is stored in — the one place that
//! knows the stored forms: 32/16-bit floats; fp8-e4m3 with block scales, as f32 `<name>_scale_inv`
//! (DeepSeek-V3's checkpoints) or as UE8M0 exponents in `<stem>.scale` (DeepSeek-V4's), served as
//! they are through the fp8 kernels; FP4 (e2m1) packed two to a byte in an int8 tensor with a
//! UE8M0 `<stem>.scale` per 32 values of a row (DeepSeek-V4's routed experts), served as the MXFP4
//! it is; int8 rows with `<name>_shimmer_int8_scale` (a converted container's dense weights).
//!
//! It also reads a routed expert from a checkpoint in the layout its family stores
//! (`ExpertLayout`): separate tensors per expert, or gpt-oss's fused, interleaved, biased
//! tensors — as floats or as the MXFP4 blocks and scales OpenAI ships.
//!
//! Must never: change a value — each form is served exactly as its format defines it.

use shimmer_common::checkpoint::DType;
use shimmer_common::quant::{QuantMatrix, MXFP4_GROUP};
use shimmer_common::spec::ExpertLayout;
use shimmer_common::{quant, Checkpoint, LoadError, ModelSpec, StDtype};
use shimmer_kernels::matrix::WeightData;
use shimmer_kernels::Matrix;

use crate::expert::{Expert, ExpertBias};

/// The suffix of the per-row f32 scales stored beside an int8 dense matrix (`shimmer convert
/// --dense-quant int8` writes them; this loader reads them).
pub const INT8_SCALE_SUFFIX: &str = "_shimmer_int8_scale";

/// `name` as a `rows × cols` matrix; `fp8_block` is the model's fp8 block side
/// (`ModelSpec::fp8_block`).
pub fn load_matrix(ckpt: &Checkpoint, name: &str, rows: usize, cols: usize, fp8_block: usize) -> Result<Matrix, LoadError> {
    let int8_scales = format!("{name}{INT8_SCALE_SUFFIX}");
    if ckpt.contains(&int8_scales) {
        let raw = ckpt.raw(name)?;
        let bad = |problem: String| LoadError::Tensor { path: raw.file.to_path_buf(), tensor: name.to_string(), problem };
        if raw.dtype != StDtype::I8 || raw.shape != [rows, cols] {
            return Err(bad(format!("int8 dense weight must be I8 {:?}, found {:?} {:?}", [rows, cols], raw.dtype, raw.shape)));
        }
        let scales = ckpt.get(&int8_scales, &[rows])?.to_f32();
        let m = quant::QuantMatrix::Int8 { rows, cols, q: raw.bytes.iter().map(|b| *b as i8).collect(), scales };
        quant::validate(&m, name).map_err(|e| bad(e.to_string()))?;
        return Ok(Matrix::from_quant(m));
    }
    if ckpt.contains(name) {
        let raw = ckpt.raw(name)?;
        let bad = |problem: String| LoadError::Tensor { path: raw.file.to_path_buf(), tensor: name.to_string(), problem };
        if raw.dtype == StDtype::F8_E4M3 {
            if raw.shape != [rows, cols] {
                return Err(bad(format!("shape {:?} but the model config needs {:?}", raw.shape, [rows, cols])));
            }
            let scales = fp8_block_scales(ckpt, name, rows, cols, fp8_block)?;
            return Matrix::from_fp8_blocks(rows, cols, raw.bytes.to_vec(), scales, fp8_block).map_err(bad);
        }
        if raw.dtype == StDtype::I8 || raw.dtype == StDtype::U8 {
            if let Some(scale_name) = sibling_scale(ckpt, name) {
                return Ok(shipped_mxfp4(packed_fp4(ckpt, name, &scale_name, rows, cols)?));
            }
        }
    }
    Ok(Matrix::from_view(&ckpt.get(name, &[rows, cols])?))
}

/// DeepSeek-V4's name for a weight's scales: `<stem>.scale` beside `<stem>.weight`, if present.
fn sibling_scale(ckpt: &Checkpoint, name: &str) -> Option<String> {
    let scale = format!("{}.scale", name.strip_suffix(".weight")?);
    ckpt.contains(&scale).then_some(scale)
}

/// The f32 block scales (`⌈rows/block⌉ × ⌈cols/block⌉`, what each block's fp8 values are
/// multiplied by) of the fp8 matrix `name`: `<name>_scale_inv` as floats, or `<stem>.scale` as
/// UE8M0 exponents (`2^(e − 127)`, exact in f32) or floats. A missing tensor, a wrong shape, the
/// UE8M0 NaN (255) or a scale that is not finite is refused naming the tensor.
pub fn fp8_block_scales(ckpt: &Checkpoint, name: &str, rows: usize, cols: usize, block: usize) -> Result<Vec<f32>, LoadError> {
    let grid = [rows.div_ceil(block.max(1)), cols.div_ceil(block.max(1))];
    let names = quant::scale_names(name);
    match names.iter().find(|n| ckpt.contains(n)) {
        Some(found) => scales_as_f32(ckpt, found, &grid),
        None => Err(tensor_error(ckpt, name, format!("an fp8 weight without its block scales (`{}`)", names.join("` or `")))),
    }
}

/// `name`'s scales of shape `shape` as f32: UE8M0 exponents or floats.
fn scales_as_f32(ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
    let raw = ckpt.raw(name)?;
    if raw.dtype != StDtype::F8_E8M0 {
        return Ok(ckpt.get(name, shape)?.to_f32());
    }
    if raw.shape != shape {
        return Err(tensor_error(ckpt, name, format!("shape {:?} but the weight it scales needs {shape:?}", raw.shape)));
    }
    if let Some(i) = raw.bytes.iter().position(|b| *b == 0xff) {
        return Err(tensor_error(ckpt, name, format!("scale {i} is the UE8M0 NaN (255)")));
    }
    Ok(raw.bytes.iter().map(|e| quant::e8m0_to_f32(*e)).collect())
}

/// An FP4 matrix as DeepSeek-V4 ships its experts: `name` holds e2m1 codes two to a byte, low
/// nibble first (`rows × ⌈cols/2⌉`, int8), and `scale_name` one UE8M0 exponent per 32 values of a
/// row (`rows × ⌈cols/32⌉`) — exactly shimmer's MXFP4 layout.
fn packed_fp4(ckpt: &Checkpoint, name: &str, scale_name: &str, rows: usize, cols: usize) -> Result<QuantMatrix, LoadError> {
    let raw = ckpt.raw(name)?;
    let want = [rows, QuantMatrix::bytes_per_row_int4(cols)];
    if raw.shape != want {
        return Err(tensor_error(ckpt, name, format!("packed FP4 of shape {:?}, but {rows}×{cols} values need {want:?}", raw.shape)));
    }
    let groups = [rows, QuantMatrix::groups_per_row(cols, MXFP4_GROUP)];
    let sraw = ckpt.raw(scale_name)?;
    if sraw.dtype != StDtype::F8_E8M0 && sraw.dtype != StDtype::U8 {
        return Err(tensor_error(ckpt, scale_name, format!("FP4 scales must be UE8M0 exponents, found {:?}", sraw.dtype)));
    }
    if sraw.shape != groups {
        return Err(tensor_error(ckpt, scale_name, format!("shape {:?} but {rows}×{cols} FP4 values in groups of {MXFP4_GROUP} need {groups:?}", sraw.shape)));
    }
    let m = QuantMatrix::Mxfp4 { rows, cols, packed: raw.bytes.to_vec(), scales: sraw.bytes.to_vec() };
    quant::validate(&m, name)?;
    Ok(m)
}

/// Expert `expert` of MoE layer `layer`, in its stored precision, with the family's biases and
/// activation.
pub fn load_expert(ckpt: &Checkpoint, spec: &ModelSpec, layer: usize, expert: usize) -> Result<Expert, LoadError> {
    let (h, i) = (spec.hidden_size, spec.moe.expert_intermediate_size);
    let names = &spec.expert_names;
    let [g, u, d] = names.expert(layer, expert);
    let e = match names.layout {
        ExpertLayout::Separate => {
            if spec.moe.expert_bias {
                return Err(LoadError::Tensor { path: ckpt.dir().to_path_buf(), tensor: g, problem: "expert biases need the fused layout".into() });
            }
            return Ok(Expert::new(
                load_matrix(ckpt, &g, i, h, spec.fp8_block)?,
                load_matrix(ckpt, &u, i, h, spec.fp8_block)?,
                load_matrix(ckpt, &d, h, i, spec.fp8_block)?,
            )
            .with_form(None, spec.moe.activation));
        }
        ExpertLayout::FusedStacked => {
            let n = spec.moe.num_experts;
            let (gate, up, down) = stacked_expert(ckpt, &g, &d, n, expert, h, i)?;
            Expert::new(gate, up, down).with_form(None, spec.moe.activation)
        }
        ExpertLayout::StackedInterleaved => {
            let (gate, up, down) = stacked_interleaved_expert(ckpt, &g, &d, spec.moe.num_experts, expert, h, i)?;
            Expert::new(gate, up, down).with_form(None, spec.moe.activation)
        }
        ExpertLayout::FusedInterleaved => {
            let n = spec.moe.num_experts;
            let (gate, up) = fused_gate_up(ckpt, &g, n, expert, h, i)?;
            let down = fused_down(ckpt, &d, n, expert, h, i)?;
            let bias = if spec.moe.expert_bias {
                let gu = row_of(&ckpt.get(&format!("{g}_bias"), &[n, 2 * i])?, expert, 2 * i);
                Some(ExpertBias {
                    gate: gu.iter().step_by(2).copied().collect(),
                    up: gu.iter().skip(1).step_by(2).copied().collect(),
                    down: row_of(&ckpt.get(&format!("{d}_bias"), &[n, h])?, expert, h),
                })
            } else {
                None
            };
            Expert::new(gate, up, down).with_form(bias, spec.moe.activation)
        }
    };
    Ok(e)
}

fn tensor_error(ckpt: &Checkpoint, name: &str, problem: String) -> LoadError {
    LoadError::Tensor { path: ckpt.dir().to_path_buf(), tensor: name.to_string(), problem }
}

/// Row `row` (`width` values) of a float tensor, widened to f32 — without widening the rest.
fn row_of(view: &shimmer_common::checkpoint::TensorView<'_>, row: usize, width: usize) -> Vec<f32> {
    let size = if view.dtype == DType::F32 { 4 } else { 2 };
    let shape = [width];
    let one = shimmer_common::checkpoint::TensorView { dtype: view.dtype, shape: &shape, bytes: &view.bytes[row * width * size..(row + 1) * width * size] };
    one.to_f32()
}

/// One expert's `[gate, up]` (`i × h` each) from the fused `name` (`experts × h × 2i`, gate and up
/// interleaved along the last axis), or from its MXFP4 `_blocks`/`_scales` (`experts × 2i × …`).
fn fused_gate_up(ckpt: &Checkpoint, name: &str, n: usize, e: usize, h: usize, i: usize) -> Result<(Matrix, Matrix), LoadError> {
    if !ckpt.contains(name) {
        let both = mxfp4_rows(ckpt, name, n, e, 2 * i, h)?;
        let pick = |parity: usize| {
            let QuantMatrix::Mxfp4 { cols, packed, scales, .. } = &both else { unreachable!("mxfp4_rows returns MXFP4") };
            let (bpr, gpr) = (QuantMatrix::bytes_per_row_int4(*cols), QuantMatrix::groups_per_row(*cols, MXFP4_GROUP));
            let rows = (0..i).map(|j| 2 * j + parity);
            shipped_mxfp4(QuantMatrix::Mxfp4 {
                rows: i,
                cols: *cols,
                packed: rows.clone().flat_map(|r| packed[r * bpr..(r + 1) * bpr].iter().copied()).collect(),
                scales: rows.flat_map(|r| scales[r * gpr..(r + 1) * gpr].iter().copied()).collect(),
            })
        };
        return Ok((pick(0), pick(1)));
    }
    let view = ckpt.get(name, &[n, h, 2 * i])?;
    // Column c of input row k of expert e: element (e, k, c).
    let at = |k: usize, c: usize| (e * h + k) * 2 * i + c;
    let gather = |parity: usize| transpose_take(&view, i, h, |j, k| at(k, 2 * j + parity));
    Ok((gather(0), gather(1)))
}

/// One expert's down projection (`h × i`) from `name` (`experts × i × h`) or its MXFP4 form
/// (`experts × h × …`).
fn fused_down(ckpt: &Checkpoint, name: &str, n: usize, e: usize, h: usize, i: usize) -> Result<Matrix, LoadError> {
    if !ckpt.contains(name) {
        return Ok(shipped_mxfp4(mxfp4_rows(ckpt, name, n, e, h, i)?));
    }
    let view = ckpt.get(name, &[n, i, h])?;
    Ok(transpose_take(&view, h, i, |r, j| (e * i + j) * h + r))
}

/// Expert `e`'s `[gate, up, down]` from stacked tensors: `gate_up` (`n × 2i × h`: its gate rows,
/// then its up rows) and `down` (`n × h × i`), each already `out × in`. Also a stacked shared
/// expert bank's (`n` shared experts, `gate_up` then being its gate and `up` its up tensor).
pub fn stacked_expert(ckpt: &Checkpoint, gate_up: &str, down: &str, n: usize, e: usize, h: usize, i: usize) -> Result<(Matrix, Matrix, Matrix), LoadError> {
    let gu = ckpt.get(gate_up, &[n, 2 * i, h])?;
    let gate = transpose_take(&gu, i, h, |r, c| (e * 2 * i + r) * h + c);
    let up = transpose_take(&gu, i, h, |r, c| (e * 2 * i + i + r) * h + c);
    let dv = ckpt.get(down, &[n, h, i])?;
    let down = transpose_take(&dv, h, i, |r, c| (e * h + r) * i + c);
    Ok((gate, up, down))
}

/// Expert `e`'s `[gate, up, down]` from stacked tensors whose gate and up rows are interleaved:
/// `gate_up` (`n × 2i × h`, row 2j gate j, row 2j + 1 up j) and `down` (`n × h × i`). Inkling's
/// release stores its routed experts and its shared-expert bank this way.
pub fn stacked_interleaved_expert(
    ckpt: &Checkpoint,
    gate_up: &str,
    down: &str,
    n: usize,
    e: usize,
    h: usize,
    i: usize,
) -> Result<(Matrix, Matrix, Matrix), LoadError> {
    let (gate, up) = if is_mxfp8(ckpt, gate_up)? {
        let gu = mxfp8_expert(ckpt, gate_up, n, e, 2 * i, h)?;
        let rows = |parity: usize| (0..i).flat_map(|r| gu[(2 * r + parity) * h..(2 * r + parity + 1) * h].iter().copied()).collect();
        (exact_matrix(i, h, rows(0)), exact_matrix(i, h, rows(1)))
    } else {
        let gu = ckpt.get(gate_up, &[n, 2 * i, h])?;
        (transpose_take(&gu, i, h, |r, c| (e * 2 * i + 2 * r) * h + c), transpose_take(&gu, i, h, |r, c| (e * 2 * i + 2 * r + 1) * h + c))
    };
    let down = if is_mxfp8(ckpt, down)? {
        exact_matrix(h, i, mxfp8_expert(ckpt, down, n, e, h, i)?)
    } else {
        let dv = ckpt.get(down, &[n, h, i])?;
        transpose_take(&dv, h, i, |r, c| (e * h + r) * i + c)
    };
    Ok((gate, up, down))
}

/// The suffix of an MXFP8 tensor's scales (Inkling 2's release: `w13_weight_scale`).
pub const MXFP8_SCALE_SUFFIX: &str = "_scale";

/// Values of an MXFP8 group.
const MXFP8_GROUP: usize = 32;

/// Whether `name` is stored as MXFP8: fp8-e4m3 values with `<name>_scale` beside them.
fn is_mxfp8(ckpt: &Checkpoint, name: &str) -> Result<bool, LoadError> {
    Ok(ckpt.raw(name)?.dtype == StDtype::F8_E4M3 && ckpt.contains(&format!("{name}{MXFP8_SCALE_SUFFIX}")))
}

/// Expert `e`'s `rows × cols` values from a stacked MXFP8 tensor (`n × rows × cols` fp8-e4m3, and
/// `n × rows × ⌈cols/32⌉` UE8M0 exponents in `<name>_scale`, one per 32 values of a row): each
/// value `e4m3 · 2^(s − 127)`, exact in f32. An fp8 NaN or the UE8M0 NaN is refused by name.
fn mxfp8_expert(ckpt: &Checkpoint, name: &str, n: usize, e: usize, rows: usize, cols: usize) -> Result<Vec<f32>, LoadError> {
    let raw = ckpt.raw(name)?;
    if raw.shape != [n, rows, cols] {
        return Err(tensor_error(ckpt, name, format!("shape {:?} but the model config needs {:?}", raw.shape, [n, rows, cols])));
    }
    let scale_name = format!("{name}{MXFP8_SCALE_SUFFIX}");
    let sraw = ckpt.raw(&scale_name)?;
    let gpr = cols.div_ceil(MXFP8_GROUP);
    if !matches!(sraw.dtype, StDtype::U8 | StDtype::F8_E8M0) || sraw.shape != [n, rows, gpr] {
        return Err(tensor_error(
            ckpt,
            &scale_name,
            format!("{:?} {:?}, but the MXFP8 scales of {:?} values are UE8M0 {:?}", sraw.dtype, sraw.shape, [n, rows, cols], [n, rows, gpr]),
        ));
    }
    let q = &raw.bytes[e * rows * cols..(e + 1) * rows * cols];
    let scales = &sraw.bytes[e * rows * gpr..(e + 1) * rows * gpr];
    if let Some(at) = scales.iter().position(|s| *s == 0xff) {
        return Err(tensor_error(ckpt, &scale_name, format!("expert {e}: scale {at} is the UE8M0 NaN (255)")));
    }
    if let Some(at) = q.iter().position(|b| b & 0x7f == 0x7f) {
        return Err(tensor_error(ckpt, name, format!("expert {e}: value {at} is an fp8 NaN")));
    }
    Ok(q.iter().enumerate().map(|(k, b)| quant::fp8_e4m3_to_f32(*b) * quant::e8m0_to_f32(scales[(k / cols) * gpr + (k % cols) / MXFP8_GROUP])).collect())
}

/// Exact values as a matrix: bf16 when every value is one (an e4m3 value times a power of two
/// is, unless it falls below bf16's range), else f32 — never rounded.
fn exact_matrix(rows: usize, cols: usize, values: Vec<f32>) -> Matrix {
    let bf16: Vec<u16> = values.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
    if bf16.iter().zip(&values).all(|(b, v)| half::bf16::from_bits(*b).to_f32().to_bits() == v.to_bits()) {
        Matrix::new(rows, cols, WeightData::Bf16(bf16))
    } else {
        Matrix::from_f32(rows, cols, values)
    }
}

/// Shared expert `e` of a stacked bank (`gate`, `up`: `n × i × h`; `down`: `n × h × i`).
pub fn stacked_shared(ckpt: &Checkpoint, [gate, up, down]: [&str; 3], n: usize, e: usize, h: usize, i: usize) -> Result<(Matrix, Matrix, Matrix), LoadError> {
    let gv = ckpt.get(gate, &[n, i, h])?;
    let uv = ckpt.get(up, &[n, i, h])?;
    let dv = ckpt.get(down, &[n, h, i])?;
    Ok((
        transpose_take(&gv, i, h, |r, c| (e * i + r) * h + c),
        transpose_take(&uv, i, h, |r, c| (e * i + r) * h + c),
        transpose_take(&dv, h, i, |r, c| (e * h + r) * i + c),
    ))
}

/// A `rows × cols` matrix whose element (r, c) is element `index(r, c)` of `view`, kept in the
/// view's precision (a transposition moves values; it never rounds them).
fn transpose_take(view: &shimmer_common::checkpoint::TensorView<'_>, rows: usize, cols: usize, index: impl Fn(usize, usize) -> usize) -> Matrix {
    let word = |x: usize| u16::from_le_bytes([view.bytes[2 * x], view.bytes[2 * x + 1]]);
    let cells = (0..rows).flat_map(|r| (0..cols).map(move |c| (r, c)));
    let data = match view.dtype {
        DType::F32 => WeightData::F32(
            cells
                .map(|(r, c)| index(r, c))
                .map(|x| f32::from_le_bytes([view.bytes[4 * x], view.bytes[4 * x + 1], view.bytes[4 * x + 2], view.bytes[4 * x + 3]]))
                .collect(),
        ),
        DType::Bf16 => WeightData::Bf16(cells.map(|(r, c)| word(index(r, c))).collect()),
        DType::F16 => WeightData::F16(cells.map(|(r, c)| word(index(r, c))).collect()),
    };
    Matrix::new(rows, cols, data)
}

/// A checkpoint's own MXFP4 weights run as the checkpoint defines them: exact products with f32
/// activations (int8 activations are a container's speed choice, `shimmer convert`).
fn shipped_mxfp4(m: QuantMatrix) -> Matrix {
    Matrix::from_quant(m).with_activations(shimmer_kernels::Activations::F32)
}

/// Expert `e`'s `rows × cols` MXFP4 matrix from `<name>_blocks` (`experts × rows × cols/32 × 16`
/// bytes, two e2m1 codes per byte, low nibble first) and `<name>_scales` (`experts × rows ×
/// cols/32` e8m0 bytes): the layout of OpenAI's gpt-oss checkpoints, which is shimmer's MXFP4
/// row layout, so the bytes are taken as they are.
fn mxfp4_rows(ckpt: &Checkpoint, name: &str, n: usize, e: usize, rows: usize, cols: usize) -> Result<QuantMatrix, LoadError> {
    let (blocks_name, scales_name) = (format!("{name}_blocks"), format!("{name}_scales"));
    if !ckpt.contains(&blocks_name) {
        return Err(tensor_error(ckpt, name, "the model needs it (or its MXFP4 `_blocks` and `_scales`) but the checkpoint has neither".into()));
    }
    if !cols.is_multiple_of(MXFP4_GROUP) {
        return Err(tensor_error(ckpt, &blocks_name, format!("MXFP4 rows of {cols} values are not whole blocks of {MXFP4_GROUP}")));
    }
    let groups = cols / MXFP4_GROUP;
    let blocks = ckpt.raw(&blocks_name)?;
    if blocks.dtype != StDtype::U8 || blocks.shape != [n, rows, groups, MXFP4_GROUP / 2] {
        return Err(tensor_error(
            ckpt,
            &blocks_name,
            format!("expected U8 {:?}, found {:?} {:?}", [n, rows, groups, MXFP4_GROUP / 2], blocks.dtype, blocks.shape),
        ));
    }
    let scales = ckpt.raw(&scales_name)?;
    if scales.dtype != StDtype::U8 || scales.shape != [n, rows, groups] {
        return Err(tensor_error(ckpt, &scales_name, format!("expected U8 {:?}, found {:?} {:?}", [n, rows, groups], scales.dtype, scales.shape)));
    }
    let (per_block, per_scale) = (rows * cols / 2, rows * groups);
    let m = QuantMatrix::Mxfp4 {
        rows,
        cols,
        packed: blocks.bytes[e * per_block..(e + 1) * per_block].to_vec(),
        scales: scales.bytes[e * per_scale..(e + 1) * per_scale].to_vec(),
    };
    quant::validate(&m, &blocks_name)?;
    Ok(m)
}
