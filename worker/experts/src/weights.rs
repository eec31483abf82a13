//! A weight matrix read from a checkpoint in the precision it is stored in — the one place that
//! knows the stored forms: 32/16-bit floats; fp8-e4m3 with block scales, as f32 `<name>_scale_inv`
//! (DeepSeek-V3's checkpoints) or as UE8M0 exponents in `<stem>.scale` (DeepSeek-V4's), served as
//! they are through the fp8 kernels; FP4 (e2m1) packed two to a byte in an int8 tensor with a
//! UE8M0 `<stem>.scale` per 32 values of a row (DeepSeek-V4's routed experts), served as the MXFP4
//! it is; int8 rows with `<name>_shimmer_int8_scale` and int4 groups with
//! `<name>_shimmer_int4_gN_scale`, int6 as int4's nibbles with `<name>_shimmer_int6_hi` and
//! `<name>_shimmer_int6_gN_scale` (a converted container's dense weights).
//!
//! It also reads a routed expert from a checkpoint in the layout its family stores
//! (`ExpertLayout`): separate tensors per expert, gpt-oss's fused, interleaved, biased tensors —
//! as floats or as the MXFP4 blocks and scales OpenAI ships —, or Inkling's stacked tensors as
//! floats, MXFP8 or NVFP4 (both held as fp8 with one f32 scale per row group).
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

/// The groups an int4 dense matrix may have (`shimmer convert --dense-quant int4-gN`).
pub const DENSE_INT4_GROUPS: [usize; 3] = [32, 64, 128];

/// The name of the per-group f16 scales (`rows × ⌈cols/group⌉`) stored beside an int4 dense
/// matrix, which name its group: packed nibbles alone cannot say it.
pub fn int4_scale_name(name: &str, group: usize) -> String {
    format!("{name}_shimmer_int4_g{group}_scale")
}

/// The name of an int6 dense matrix's per-group f16 scales (`rows × ⌈cols/group⌉`), naming its
/// group; the matrix itself holds the low nibbles as int4's does.
pub fn int6_scale_name(name: &str, group: usize) -> String {
    format!("{name}_shimmer_int6_g{group}_scale")
}

/// The name of an int6 dense matrix's top bits (`rows × Int6Matrix::hi_bytes_per_row(cols)`).
pub fn int6_hi_name(name: &str) -> String {
    format!("{name}_shimmer_int6_hi")
}

/// `name` as a `rows × cols` matrix; `fp8_block` is the model's fp8 block side
/// (`ModelSpec::fp8_block`).
pub fn load_matrix(ckpt: &Checkpoint, name: &str, rows: usize, cols: usize, fp8_block: usize) -> Result<Matrix, LoadError> {
    // Loaded once and streamed every token: large ones into huge pages.
    let m = load_matrix_as_stored(ckpt, name, rows, cols, fp8_block)?;
    m.prefer_huge_pages();
    Ok(m)
}

fn load_matrix_as_stored(ckpt: &Checkpoint, name: &str, rows: usize, cols: usize, fp8_block: usize) -> Result<Matrix, LoadError> {
    if let Some(group) = DENSE_INT4_GROUPS.into_iter().find(|g| ckpt.contains(&int6_scale_name(name, *g))) {
        return load_int6(ckpt, name, rows, cols, group);
    }
    if let Some(group) = DENSE_INT4_GROUPS.into_iter().find(|g| ckpt.contains(&int4_scale_name(name, *g))) {
        let raw = ckpt.raw(name)?;
        let bad = |problem: String| LoadError::Tensor { path: raw.file.to_path_buf(), tensor: name.to_string(), problem };
        let bpr = quant::QuantMatrix::bytes_per_row_int4(cols);
        if raw.dtype != StDtype::U8 || raw.shape != [rows, bpr] {
            return Err(bad(format!("int4 dense weight must be U8 {:?} (two values a byte), found {:?} {:?}", [rows, bpr], raw.dtype, raw.shape)));
        }
        let scale_name = int4_scale_name(name, group);
        let sraw = ckpt.raw(&scale_name)?;
        let gpr = quant::QuantMatrix::groups_per_row(cols, group);
        if sraw.dtype == StDtype::F32 {
            return Err(bad(format!("`{scale_name}` holds f32 scales, as shimmer wrote int4 before it stored them as f16: re-run `shimmer convert`")));
        }
        if sraw.dtype != StDtype::F16 || sraw.shape != [rows, gpr] {
            return Err(bad(format!("int4 scales `{scale_name}` must be F16 {:?}, found {:?} {:?}", [rows, gpr], sraw.dtype, sraw.shape)));
        }
        let scales = sraw.bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        let m = quant::QuantMatrix::Int4 { rows, cols, group, packed: raw.bytes.to_vec(), scales };
        quant::validate(&m, name).map_err(|e| bad(e.to_string()))?;
        return Ok(Matrix::from_quant(m));
    }
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

/// An int6 dense matrix: its low nibbles under `name`, its top bits and f16 scales beside it,
/// each checked against the shape before anything is built from it.
fn load_int6(ckpt: &Checkpoint, name: &str, rows: usize, cols: usize, group: usize) -> Result<Matrix, LoadError> {
    let raw = ckpt.raw(name)?;
    let bad = |problem: String| LoadError::Tensor { path: raw.file.to_path_buf(), tensor: name.to_string(), problem };
    let (bpr, hpr, gpr) =
        (quant::QuantMatrix::bytes_per_row_int4(cols), quant::Int6Matrix::hi_bytes_per_row(cols), quant::QuantMatrix::groups_per_row(cols, group));
    if raw.dtype != StDtype::U8 || raw.shape != [rows, bpr] {
        return Err(bad(format!("int6 dense weight must be U8 {:?} (its low nibbles, two a byte), found {:?} {:?}", [rows, bpr], raw.dtype, raw.shape)));
    }
    let hi_name = int6_hi_name(name);
    let hraw = ckpt.raw(&hi_name).map_err(|_| bad(format!("int6 top bits `{hi_name}` are missing")))?;
    if hraw.dtype != StDtype::U8 || hraw.shape != [rows, hpr] {
        return Err(bad(format!("int6 top bits `{hi_name}` must be U8 {:?}, found {:?} {:?}", [rows, hpr], hraw.dtype, hraw.shape)));
    }
    let scale_name = int6_scale_name(name, group);
    let sraw = ckpt.raw(&scale_name)?;
    if sraw.dtype != StDtype::F16 || sraw.shape != [rows, gpr] {
        return Err(bad(format!("int6 scales `{scale_name}` must be F16 {:?}, found {:?} {:?}", [rows, gpr], sraw.dtype, sraw.shape)));
    }
    let scales = sraw.bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    let m = quant::Int6Matrix { rows, cols, group, lo: raw.bytes.to_vec(), hi: hraw.bytes.to_vec(), scales };
    m.validate(name).map_err(|e| bad(e.to_string()))?;
    Ok(Matrix::from_int6(m))
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
/// release stores its routed experts and its shared-expert bank this way — as floats, as MXFP8
/// (Inkling 2) or as NVFP4 (Inkling's ModelOpt release); `StackedForm` says which.
pub fn stacked_interleaved_expert(
    ckpt: &Checkpoint,
    gate_up: &str,
    down: &str,
    n: usize,
    e: usize,
    h: usize,
    i: usize,
) -> Result<(Matrix, Matrix, Matrix), LoadError> {
    let (gate, up) = match StackedForm::of(ckpt, gate_up)? {
        StackedForm::Float => {
            let gu = ckpt.get(gate_up, &[n, 2 * i, h])?;
            (transpose_take(&gu, i, h, |r, c| (e * 2 * i + 2 * r) * h + c), transpose_take(&gu, i, h, |r, c| (e * 2 * i + 2 * r + 1) * h + c))
        }
        form => {
            // Row groups: each row keeps its own scales, so the rows part as they are.
            let gu = form.expert(ckpt, gate_up, n, e, 2 * i, h)?;
            let part = |parity: usize| gu.take_rows(&(0..i).map(|r| 2 * r + parity).collect::<Vec<_>>()).map_err(|p| tensor_error(ckpt, gate_up, p));
            (part(0)?, part(1)?)
        }
    };
    let down = match StackedForm::of(ckpt, down)? {
        StackedForm::Float => {
            let dv = ckpt.get(down, &[n, h, i])?;
            transpose_take(&dv, h, i, |r, c| (e * h + r) * i + c)
        }
        form => form.expert(ckpt, down, n, e, h, i)?,
    };
    Ok((gate, up, down))
}

/// The suffix of an MXFP8 or NVFP4 tensor's group scales (Inkling's releases: `w13_weight_scale`).
pub const GROUP_SCALE_SUFFIX: &str = "_scale";

/// The suffix of an NVFP4 tensor's per-expert second-level scales (ModelOpt's `weight_scale_2`).
pub const NVFP4_SCALE_2_SUFFIX: &str = "_scale_2";

/// Values of an MXFP8 group.
const MXFP8_GROUP: usize = 32;

/// Values of an NVFP4 group.
const NVFP4_GROUP: usize = 16;

/// How a stacked expert tensor is stored, told by its dtype and the scales beside it.
#[derive(Clone, Copy, PartialEq, Debug)]
enum StackedForm {
    /// bf16/f16/f32 values.
    Float,
    /// fp8-e4m3 values with `<name>_scale`: one UE8M0 exponent per 32 values of a row.
    Mxfp8,
    /// e2m1 codes two to a byte (even element in the low nibble) with `<name>_scale`: one
    /// fp8-e4m3 scale per 16 values of a row, and `<name>_scale_2`: one f32 factor per expert.
    Nvfp4,
}

impl StackedForm {
    fn of(ckpt: &Checkpoint, name: &str) -> Result<Self, LoadError> {
        let has_scales = ckpt.contains(&format!("{name}{GROUP_SCALE_SUFFIX}"));
        Ok(match ckpt.raw(name)?.dtype {
            StDtype::F8_E4M3 if has_scales => StackedForm::Mxfp8,
            StDtype::U8 | StDtype::I8 if has_scales => StackedForm::Nvfp4,
            _ => StackedForm::Float,
        })
    }

    /// Expert `e`'s `rows × cols` matrix of the stacked tensor `name`, held as fp8 with one scale
    /// per row group (its values exactly as the format defines them).
    fn expert(self, ckpt: &Checkpoint, name: &str, n: usize, e: usize, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
        match self {
            StackedForm::Float => Ok(transpose_take(&ckpt.get(name, &[n, rows, cols])?, rows, cols, |r, c| (e * rows + r) * cols + c)),
            StackedForm::Mxfp8 => mxfp8_expert(ckpt, name, n, e, rows, cols),
            StackedForm::Nvfp4 => nvfp4_expert(ckpt, name, n, e, rows, cols),
        }
    }
}

/// Expert `e` of a stacked MXFP8 tensor (`n × rows × cols` fp8-e4m3, and `n × rows × ⌈cols/32⌉`
/// UE8M0 exponents in `<name>_scale`, one per 32 values of a row): each value `e4m3 · 2^(s −
/// 127)`, held as the fp8 it is with its exact f32 group scales. An fp8 NaN or the UE8M0 NaN is
/// refused by name.
fn mxfp8_expert(ckpt: &Checkpoint, name: &str, n: usize, e: usize, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
    let raw = ckpt.raw(name)?;
    if raw.shape != [n, rows, cols] {
        return Err(tensor_error(ckpt, name, format!("shape {:?} but the model config needs {:?}", raw.shape, [n, rows, cols])));
    }
    let scale_name = format!("{name}{GROUP_SCALE_SUFFIX}");
    let sraw = ckpt.raw(&scale_name)?;
    let gpr = cols.div_ceil(MXFP8_GROUP);
    if !matches!(sraw.dtype, StDtype::U8 | StDtype::F8_E8M0) || sraw.shape != [n, rows, gpr] {
        return Err(tensor_error(
            ckpt,
            &scale_name,
            format!("{:?} {:?}, but the MXFP8 scales of {:?} values are UE8M0 {:?}", sraw.dtype, sraw.shape, [n, rows, cols], [n, rows, gpr]),
        ));
    }
    let scales = &sraw.bytes[e * rows * gpr..(e + 1) * rows * gpr];
    if let Some(at) = scales.iter().position(|s| *s == 0xff) {
        return Err(tensor_error(ckpt, &scale_name, format!("expert {e}: scale {at} is the UE8M0 NaN (255)")));
    }
    let q = raw.bytes[e * rows * cols..(e + 1) * rows * cols].to_vec();
    let scales = scales.iter().map(|s| quant::e8m0_to_f32(*s)).collect();
    Matrix::from_fp8_tiles(rows, cols, q, scales, 1, MXFP8_GROUP).map_err(|p| tensor_error(ckpt, name, format!("expert {e}: {p}")))
}

/// The e4m3 byte of each e2m1 code: every e2m1 value is an e4m3 value (1 mantissa bit in 3).
const E2M1_AS_E4M3: [u8; 16] = [0x00, 0x30, 0x38, 0x3c, 0x40, 0x44, 0x48, 0x4c, 0x80, 0xb0, 0xb8, 0xbc, 0xc0, 0xc4, 0xc8, 0xcc];

/// Expert `e` of a stacked NVFP4 tensor as ModelOpt writes it: `name` holds e2m1 codes two to a
/// byte, even element in the low nibble (`n × rows × ⌈cols/2⌉`), `<name>_scale` one fp8-e4m3
/// scale per 16 values of a row (`n × rows × ⌈cols/16⌉`) and `<name>_scale_2` one f32 factor per
/// expert (`n` or `n × 1`). Each value is `e2m1 · (e4m3 scale · factor)`, the group's scale
/// rounded once to f32 — held as fp8 (the codes are exact in e4m3) with those f32 group scales,
/// 1.25 bytes a weight. Shapes, dtypes, NaNs and factors that are not finite are refused by name.
fn nvfp4_expert(ckpt: &Checkpoint, name: &str, n: usize, e: usize, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
    let raw = ckpt.raw(name)?;
    let bpr = cols.div_ceil(2);
    if raw.shape != [n, rows, bpr] {
        return Err(tensor_error(
            ckpt,
            name,
            format!("packed NVFP4 of shape {:?}, but {n} experts of {rows}×{cols} values need {:?}", raw.shape, [n, rows, bpr]),
        ));
    }
    let scale_name = format!("{name}{GROUP_SCALE_SUFFIX}");
    let sraw = ckpt.raw(&scale_name)?;
    let gpr = cols.div_ceil(NVFP4_GROUP);
    if sraw.dtype != StDtype::F8_E4M3 || sraw.shape != [n, rows, gpr] {
        return Err(tensor_error(
            ckpt,
            &scale_name,
            format!("{:?} {:?}, but the NVFP4 scales of {:?} values are fp8-e4m3 {:?}", sraw.dtype, sraw.shape, [n, rows, cols], [n, rows, gpr]),
        ));
    }
    let factor_name = format!("{name}{NVFP4_SCALE_2_SUFFIX}");
    if !ckpt.contains(&factor_name) {
        return Err(tensor_error(ckpt, name, format!("NVFP4 weights without their per-expert scales (`{factor_name}`)")));
    }
    let fraw = ckpt.raw(&factor_name)?;
    if fraw.shape != [n] && fraw.shape != [n, 1] {
        return Err(tensor_error(ckpt, &factor_name, format!("shape {:?}, but {n} experts have one factor each ([{n}] or [{n}, 1])", fraw.shape)));
    }
    let factor = ckpt.get(&factor_name, fraw.shape)?.to_f32()[e];
    if !factor.is_finite() {
        return Err(tensor_error(ckpt, &factor_name, format!("expert {e}'s factor is {factor}")));
    }
    let group_scales = &sraw.bytes[e * rows * gpr..(e + 1) * rows * gpr];
    let mut scales = Vec::with_capacity(group_scales.len());
    for (at, s) in group_scales.iter().enumerate() {
        let scale = quant::fp8_e4m3_to_f32(*s) * factor;
        if !scale.is_finite() {
            return Err(tensor_error(
                ckpt,
                &scale_name,
                format!("expert {e}: scale {at} is {} (times the factor {factor}: {scale})", quant::fp8_e4m3_to_f32(*s)),
            ));
        }
        scales.push(scale);
    }
    let packed = &raw.bytes[e * rows * bpr..(e + 1) * rows * bpr];
    let q = (0..rows * cols).map(|k| {
        let (r, c) = (k / cols, k % cols);
        let byte = packed[r * bpr + c / 2];
        E2M1_AS_E4M3[usize::from(if c % 2 == 0 { byte & 0xf } else { byte >> 4 })]
    });
    Matrix::from_fp8_tiles(rows, cols, q.collect(), scales, 1, NVFP4_GROUP).map_err(|p| tensor_error(ckpt, name, format!("expert {e}: {p}")))
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
