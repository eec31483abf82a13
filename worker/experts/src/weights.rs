//! A weight matrix read from a checkpoint in the precision it is stored in — the one place that
//! knows the stored forms: 32/16-bit floats; fp8-e4m3 with `<name>_scale_inv` block scales
//! (DeepSeek-V3's checkpoints, served as they are through the fp8 kernels); int8 rows with
//! `<name>_shimmer_int8_scale` (a converted container's dense weights).
//!
//! Must never: change a value — each form is served exactly as its format defines it.

use shimmer_common::{quant, Checkpoint, LoadError, StDtype};
use shimmer_kernels::Matrix;

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
        if raw.dtype == StDtype::F8_E4M3 {
            let bad = |problem: String| LoadError::Tensor { path: raw.file.to_path_buf(), tensor: name.to_string(), problem };
            if raw.shape != [rows, cols] {
                return Err(bad(format!("shape {:?} but the model config needs {:?}", raw.shape, [rows, cols])));
            }
            let scales = ckpt.get(&format!("{name}_scale_inv"), &[rows.div_ceil(fp8_block), cols.div_ceil(fp8_block)])?.to_f32();
            return Matrix::from_fp8_blocks(rows, cols, raw.bytes.to_vec(), scales, fp8_block).map_err(bad);
        }
    }
    Ok(Matrix::from_view(&ckpt.get(name, &[rows, cols])?))
}
