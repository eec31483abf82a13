//! A conversation saved to disk: its token history, chat messages and KV cache, so a later process
//! continues it with no re-prefill and exactly the tokens an uninterrupted run would give.
//!
//! Layout (little-endian):
//! ```text
//! "SHMSESS\0"                  8-byte magic
//! u32 header_len, header JSON  {version, model_fingerprint, layers, k_width, v_width, cached, history, messages}
//! per layer: cached × k_width f32, then cached × v_width f32
//! u64 xxh3 of everything above (`shimmer_common::checksum`)
//! ```
//! Saving writes a temporary file beside the target, syncs it and renames it over the target, so a
//! crash leaves the old session or the new one, never a mix. Loading checks magic, version,
//! fingerprint, geometry, sizes and checksum, and refuses with a message naming the mismatch.

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};
use shimmer_common::chat_template::Message;
use shimmer_common::LoadError;

use crate::engine::{Engine, Session};

const MAGIC: &[u8; 8] = b"SHMSESS\0";
/// 2: the checksum is xxh3 (1 used FNV-1a).
pub const VERSION: u32 = 2;
const MAX_HEADER: usize = 64 << 20;

/// Session files fail like every other file shimmer reads: the path and the problem.
pub type SessionError = LoadError;

#[derive(Serialize, Deserialize)]
struct Header {
    version: u32,
    model_fingerprint: String,
    layers: usize,
    k_width: usize,
    v_width: usize,
    /// Positions held in the KV cache (the first `cached` ids of the history).
    cached: usize,
    history: Vec<u32>,
    messages: Vec<Message>,
}

/// What a session file restores besides the cache.
pub struct Saved {
    pub session: Session,
    /// Every token of the conversation so far (the cache may hold all but the last).
    pub history: Vec<u32>,
    pub messages: Vec<Message>,
}

fn invalid(path: &Path, problem: impl Into<String>) -> SessionError {
    LoadError::malformed(path, problem)
}

pub fn save(path: &Path, engine: &Engine, session: &Session, history: &[u32], messages: &[Message]) -> Result<(), SessionError> {
    let (k_width, v_width) = session.cache.widths();
    let header = Header {
        version: VERSION,
        model_fingerprint: engine.fingerprint.clone(),
        layers: engine.spec.num_layers,
        k_width,
        v_width,
        cached: session.cache.len(),
        history: history.to_vec(),
        messages: messages.to_vec(),
    };
    let json = serde_json::to_vec(&header).map_err(|e| invalid(path, format!("cannot encode header: {e}")))?;
    let mut buf = Vec::with_capacity(16 + json.len() + session.cache.bytes() + 8);
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&(json.len() as u32).to_le_bytes());
    buf.extend_from_slice(&json);
    for (k, v) in session.cache.layers() {
        for x in k.iter().chain(v) {
            buf.extend_from_slice(&x.to_le_bytes());
        }
    }
    // Recurrent layers (linear attention) hold a state instead of keys and values; sparse
    // attention's indexer layers also hold their indexer keys.
    for layer in 0..engine.spec.num_layers {
        for x in session.cache.state(layer) {
            buf.extend_from_slice(&x.to_le_bytes());
        }
    }
    for layer in 0..engine.spec.num_layers {
        for x in session.cache.aux(layer, 0..session.cache.len()) {
            buf.extend_from_slice(&x.to_le_bytes());
        }
    }
    let sum = shimmer_common::checksum::xxh3(&buf);
    buf.extend_from_slice(&sum.to_le_bytes());

    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| LoadError::io(p, source)
    };
    let result = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(&buf).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Loads `path` for `engine`; `Ok(None)` if the file does not exist yet.
pub fn load(path: &Path, engine: &Engine) -> Result<Option<Saved>, SessionError> {
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(LoadError::io(path, source)),
    };
    // The largest file this model's session can be: a full context of cache and the largest
    // header. Anything longer is refused before it is read.
    let blank = engine.new_session().cache;
    let (k_width, v_width) = blank.widths();
    let state_floats: Vec<usize> = (0..engine.spec.num_layers).map(|l| blank.state_floats(l)).collect();
    let attention_layers = state_floats.iter().filter(|n| **n == 0).count();
    let aux_per_position: usize = (0..engine.spec.num_layers).map(|l| blank.aux_width(l)).sum();
    let most = (attention_layers as u64)
        .saturating_mul(engine.spec.max_position_embeddings as u64)
        .saturating_mul((k_width + v_width) as u64 * 4)
        .saturating_add((aux_per_position as u64).saturating_mul(engine.spec.max_position_embeddings as u64) * 4)
        .saturating_add(state_floats.iter().sum::<usize>() as u64 * 4)
        .saturating_add(20 + MAX_HEADER as u64);
    if len > most {
        return Err(invalid(path, format!("{len} bytes is more than a session of this model can hold ({most} at a full context)")));
    }
    let bytes = std::fs::read(path).map_err(|source| LoadError::io(path, source))?;
    if bytes.len() < 20 || &bytes[..8] != MAGIC {
        return Err(invalid(path, "not a shimmer session file"));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    if shimmer_common::checksum::xxh3(body).to_le_bytes() != sum {
        return Err(invalid(path, "checksum mismatch: the file is damaged or was cut short"));
    }
    let n = u32::from_le_bytes(body[8..12].try_into().unwrap_or_default()) as usize;
    if n > MAX_HEADER || 12 + n > body.len() {
        return Err(invalid(path, "header length is out of range"));
    }
    let header: Header = serde_json::from_slice(&body[12..12 + n]).map_err(|e| invalid(path, format!("bad header: {e}")))?;
    if header.version != VERSION {
        return Err(invalid(path, format!("format version {} (this shimmer reads version {VERSION})", header.version)));
    }
    if header.model_fingerprint != engine.fingerprint {
        return Err(invalid(path, format!("saved for another model (fingerprint {}, this model is {})", header.model_fingerprint, engine.fingerprint)));
    }
    let session = engine.new_session();
    let (k_width, v_width) = session.cache.widths();
    if (header.layers, header.k_width, header.v_width) != (engine.spec.num_layers, k_width, v_width) {
        return Err(invalid(
            path,
            format!(
                "cache geometry {}×({}+{}) does not match this model's {}×({}+{})",
                header.layers, header.k_width, header.v_width, engine.spec.num_layers, k_width, v_width
            ),
        ));
    }
    if header.cached > header.history.len() || header.cached > engine.spec.max_position_embeddings {
        return Err(invalid(path, "cached positions exceed the history or the context"));
    }
    let floats = attention_layers * header.cached * (k_width + v_width) + state_floats.iter().sum::<usize>() + aux_per_position * header.cached;
    let data = &body[12 + n..];
    if data.len() != floats * 4 {
        return Err(invalid(path, format!("{} bytes of cache, expected {}", data.len(), floats * 4)));
    }
    let mut session = session;
    let mut values = data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let c = header.cached;
    for (layer, state) in state_floats.iter().enumerate() {
        if *state > 0 {
            continue;
        }
        let k: Vec<f32> = values.by_ref().take(c * k_width).collect();
        let v: Vec<f32> = values.by_ref().take(c * v_width).collect();
        session.cache.append(layer, &k, &v);
    }
    for (layer, n) in state_floats.iter().enumerate() {
        let s: Vec<f32> = values.by_ref().take(*n).collect();
        if !session.cache.set_state(layer, &s) {
            return Err(invalid(path, format!("layer {layer}'s recurrent state is cut short")));
        }
    }
    for layer in 0..header.layers {
        let a: Vec<f32> = values.by_ref().take(c * session.cache.aux_width(layer)).collect();
        session.cache.append_aux(layer, &a);
    }
    session.cache.commit(c);
    // The restored length is a turn boundary a recurrent state can come back to.
    session.cache.checkpoint();
    session.tokens = header.history[..c].to_vec();
    Ok(Some(Saved { session, history: header.history, messages: header.messages }))
}
