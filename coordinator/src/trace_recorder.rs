//! `--trace FILE`: records every token's routing (selected experts per MoE layer, and the next
//! layer's lookahead prediction) as the forward pass makes it, in the format of
//! `shimmer_common::trace`. It observes; it cannot change a selection.

use std::path::Path;

use shimmer_common::spec::{LayerMlp, ModelSpec};
use shimmer_common::trace::{TokenRecord, TraceError, TraceHeader, TraceWriter};

use shimmer_model::MoeObserver;

pub struct TraceRecorder {
    writer: TraceWriter,
    /// Model layer index → position among MoE layers.
    position: Vec<Option<usize>>,
    top_k: usize,
    /// The rows of the forward call in progress.
    pending: Vec<TokenRecord>,
    error: Option<TraceError>,
}

impl TraceRecorder {
    pub fn create(path: &Path, spec: &ModelSpec) -> Result<Self, TraceError> {
        let moe: Vec<u32> = spec.layers.iter().enumerate().filter(|(_, l)| **l == LayerMlp::Moe).map(|(i, _)| i as u32).collect();
        let mut position = vec![None; spec.num_layers];
        for (p, l) in moe.iter().enumerate() {
            position[*l as usize] = Some(p);
        }
        let writer = TraceWriter::create(path, TraceHeader { layers: moe, experts: spec.moe.num_experts as u32, top_k: spec.moe.top_k as u32 })?;
        Ok(TraceRecorder { writer, position, top_k: spec.moe.top_k, pending: Vec::new(), error: None })
    }

    /// Writes out what is buffered; reports the first write error, if any.
    pub fn finish(&mut self) -> Result<(), TraceError> {
        self.flush_pending();
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        self.writer.flush()
    }

    fn flush_pending(&mut self) {
        for rec in self.pending.drain(..) {
            if self.error.is_none() {
                if let Err(e) = self.writer.append(&rec) {
                    self.error = Some(e);
                }
            }
        }
    }
}

impl MoeObserver for TraceRecorder {
    fn moe_layer(&mut self, layer: usize, _rows: &[f32], experts: &[u32], _weights: &[f32]) {
        let Some(p) = self.position[layer] else { return };
        let layers = self.writer.header().layers.len();
        let n = experts.len() / self.top_k;
        if p == 0 {
            // A new forward call: the previous one's tokens are complete.
            self.flush_pending();
            self.pending = (0..n).map(|_| TokenRecord { selected: vec![Vec::new(); layers], predicted: vec![Vec::new(); layers] }).collect();
        }
        for (rec, row) in self.pending.iter_mut().zip(experts.chunks_exact(self.top_k)) {
            rec.selected[p] = row.iter().map(|e| *e as u16).collect();
        }
        if p + 1 == layers {
            // The last MoE layer has no lookahead: these tokens are complete. Write them now, so a
            // process that ends abruptly (Ctrl-C at the chat prompt) loses nothing already routed.
            self.flush_pending();
            if let Err(e) = self.writer.flush() {
                self.error.get_or_insert(e);
            }
        }
    }

    fn wants_lookahead(&self) -> bool {
        true
    }

    fn lookahead(&mut self, layer: usize, _next_layer: usize, predicted: &[u32]) {
        let Some(p) = self.position[layer] else { return };
        for (rec, row) in self.pending.iter_mut().zip(predicted.chunks_exact(self.top_k)) {
            rec.predicted[p] = row.iter().map(|e| *e as u16).collect();
        }
    }
}
