//! A checkpoint with only its LM head (the embedding, where the model ties them) quantised and
//! dequantised back to f32 — to measure what a head format costs on its own, before any kernel
//! reads it (`shimmer quant-eval --candidate OUT`; f32 activations, every other tensor as stored).
//!
//!     cargo run --release -p shimmer-common --example head_fake_quant -- MODEL_DIR OUT_DIR FORMAT
//!
//! FORMAT: int8, int4-g32/64/128 or int6-g32/64/128. One `model.safetensors` only (the demo's).

use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use shimmer_common::quant::{dequantize, quantize_int4, quantize_int6, quantize_int8};

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, out, format] = &args[..] else { return Err("usage: head_fake_quant MODEL_DIR OUT_DIR FORMAT".into()) };
    let (model, out) = (Path::new(model), Path::new(out));
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(model.join("config.json")).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let tied = config["tie_word_embeddings"].as_bool().unwrap_or(false);
    let head = if tied { "model.embed_tokens.weight" } else { "lm_head.weight" };
    let bytes = std::fs::read(model.join("model.safetensors")).map_err(|e| e.to_string())?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let view = st.tensor(head).map_err(|e| format!("{head}: {e}"))?;
    let (rows, cols) = match view.shape() {
        [r, c] => (*r, *c),
        s => return Err(format!("{head} has shape {s:?}")),
    };
    let w: Vec<f32> = match view.dtype() {
        Dtype::BF16 => view.data().chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)).collect(),
        Dtype::F32 => view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        d => return Err(format!("{head} is {d:?}")),
    };
    let group = |s: &str| s.parse::<usize>().map_err(|_| format!("bad group in {format}"));
    let back = match format.as_str() {
        "int8" => dequantize(&quantize_int8(&w, rows, cols)),
        f if f.starts_with("int4-g") => dequantize(&quantize_int4(&w, rows, cols, group(&f[6..])?)),
        f if f.starts_with("int6-g") => quantize_int6(&w, rows, cols, group(&f[6..])?).dequantize(),
        f => return Err(format!("unknown format {f}")),
    };
    let err: f64 = w.iter().zip(&back).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / w.len() as f64;
    let var: f64 = w.iter().map(|a| (*a as f64).powi(2)).sum::<f64>() / w.len() as f64;
    eprintln!("{head} {rows}x{cols} as {format}: relative squared error {:.3e}", err / var);
    let head_bytes: Vec<u8> = back.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut tensors: Vec<(String, TensorView<'_>)> = Vec::new();
    for (name, t) in st.tensors() {
        if name == head {
            tensors.push((name, TensorView::new(Dtype::F32, vec![rows, cols], &head_bytes).map_err(|e| e.to_string())?));
        } else {
            tensors.push((name, t));
        }
    }
    std::fs::create_dir_all(out).map_err(|e| e.to_string())?;
    safetensors::serialize_to_file(tensors, None, &out.join("model.safetensors")).map_err(|e| e.to_string())?;
    for entry in std::fs::read_dir(model).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if path.is_file() && name != "model.safetensors" {
            std::fs::copy(&path, out.join(&name)).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}
