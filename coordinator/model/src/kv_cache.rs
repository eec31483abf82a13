//! The per-sequence state of the mixers: per layer, a key slot and a value slot for every position
//! so far (grown on demand up to the model's context) for attention layers, and a fixed-size
//! recurrent state for linear-attention layers (Gated DeltaNet). GQA stores `kv_heads × head_dim`
//! in each slot; MLA stores the compressed latent in the key slot and the shared rotary key in the
//! value slot.
//!
//! A layer may also keep an auxiliary slot per position (DeepSeek Sparse Attention's indexer
//! keys), truncated and committed with the keys and values.
//!
//! A recurrent state cannot rewind, so it keeps snapshots ("checkpoints") at chosen lengths — the
//! ends of prompts and of generations, that is, turn boundaries — and `truncate` goes back to the
//! longest checkpoint that fits, telling the caller how much it kept.
//!
//! Must never: let a forward pass that failed part-way leave a state advanced past the positions
//! it counts (written state becomes the state only at `commit`), or keep a position whose
//! recurrent state it cannot restore.

use shimmer_kernels::aligned::AlignedVec;

/// Checkpoints kept per sequence (the newest).
pub const MAX_CHECKPOINTS: usize = 4;

#[derive(Clone)]
pub struct KvCache {
    k_width: usize,
    v_width: usize,
    capacity: usize,
    len: usize,
    /// Per layer, on 64-byte boundaries (`AlignedVec`): attention's vector loads of a key or
    /// value slot then each touch one cache line.
    keys: Vec<AlignedVec<f32>>,
    values: Vec<AlignedVec<f32>>,
    /// Per layer: values per position of its auxiliary slot (0: none), and the slot.
    aux_width: Vec<usize>,
    aux: Vec<AlignedVec<f32>>,
    /// Per layer: the recurrent state (empty for attention layers).
    states: Vec<Vec<f32>>,
    /// Per layer: the state a forward pass wrote (when `advanced`), which `commit` swaps in; the
    /// buffer is kept, so a decode step allocates nothing.
    written: Vec<Vec<f32>>,
    advanced: Vec<bool>,
    /// (length, every layer's state at it), oldest first.
    checkpoints: Vec<(usize, Vec<Vec<f32>>)>,
}

impl KvCache {
    /// `k_width`/`v_width`: values per position in each layer's key and value slot.
    pub fn new(layers: usize, k_width: usize, v_width: usize, capacity: usize) -> Self {
        Self::with_states(vec![0; layers], k_width, v_width, capacity)
    }

    /// One entry per layer: the floats of its recurrent state (0 for an attention layer).
    pub fn with_states(state_floats: Vec<usize>, k_width: usize, v_width: usize, capacity: usize) -> Self {
        let layers = state_floats.len();
        KvCache {
            k_width,
            v_width,
            capacity,
            len: 0,
            keys: vec![AlignedVec::new(); layers],
            values: vec![AlignedVec::new(); layers],
            aux_width: vec![0; layers],
            aux: vec![AlignedVec::new(); layers],
            states: state_floats.iter().map(|n| vec![0.0; *n]).collect(),
            written: vec![Vec::new(); layers],
            advanced: vec![false; layers],
            checkpoints: Vec::new(),
        }
    }

    /// Gives layer `layer` an auxiliary slot of `width` values per position.
    pub fn with_aux(mut self, layer: usize, width: usize) -> Self {
        self.aux_width[layer] = width;
        self
    }

    /// Values per position of `layer`'s auxiliary slot (0: it has none).
    pub fn aux_width(&self, layer: usize) -> usize {
        self.aux_width[layer]
    }

    /// Appends `layer`'s auxiliary values for the positions `append` is adding.
    pub fn append_aux(&mut self, layer: usize, values: &[f32]) {
        self.aux[layer].truncate(self.len * self.aux_width[layer]);
        self.aux[layer].extend_from_slice(values);
    }

    /// `layer`'s auxiliary slot for positions `range` (appended, not yet committed, included).
    pub fn aux(&self, layer: usize, range: std::ops::Range<usize>) -> &[f32] {
        let w = self.aux_width[layer];
        &self.aux[layer][range.start * w..range.end * w]
    }

    /// `layer`'s auxiliary slot for the positions appended and not yet committed, to fill in
    /// what is computed after the append (Inkling's MLP output).
    pub fn aux_pending_mut(&mut self, layer: usize) -> &mut [f32] {
        let start = self.len * self.aux_width[layer];
        &mut self.aux[layer][start..]
    }

    /// Values per position per layer, (key slot, value slot).
    pub fn widths(&self) -> (usize, usize) {
        (self.k_width, self.v_width)
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn recurrent(&self) -> bool {
        self.states.iter().any(|s| !s.is_empty())
    }

    /// Forgets every position from `len` on (a chat turn that diverged, `/reset`) and returns the
    /// positions kept: `len` (or fewer held), except that a model with recurrent layers goes back
    /// to its longest checkpoint at or before `len` (the start, if none).
    pub fn truncate(&mut self, len: usize) -> usize {
        let len = len.min(self.len);
        if len < self.len && self.recurrent() {
            self.checkpoints.retain(|(at, _)| *at <= len);
            match self.checkpoints.last() {
                Some((at, states)) => {
                    self.len = *at;
                    self.states.clone_from(states);
                }
                None => {
                    self.len = 0;
                    self.states.iter_mut().for_each(|s| s.iter_mut().for_each(|x| *x = 0.0));
                }
            }
        } else {
            self.len = len;
        }
        for (k, v) in self.keys.iter_mut().zip(&mut self.values) {
            k.truncate(self.len * self.k_width);
            v.truncate(self.len * self.v_width);
        }
        for (a, w) in self.aux.iter_mut().zip(&self.aux_width) {
            a.truncate(self.len * w);
        }
        self.advanced.iter_mut().for_each(|a| *a = false);
        self.len
    }

    /// Remembers the recurrent state at the current length, so that a later `truncate` to here or
    /// beyond keeps it (a no-op for a model without recurrent layers).
    pub fn checkpoint(&mut self) {
        if !self.recurrent() || self.checkpoints.last().is_some_and(|(at, _)| *at == self.len) {
            return;
        }
        self.checkpoints.push((self.len, self.states.clone()));
        if self.checkpoints.len() > MAX_CHECKPOINTS {
            self.checkpoints.remove(0);
        }
    }

    /// Appends `n` positions' keys/values for `layer`; every layer must append the same `n`
    /// before `commit(n)`.
    pub fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) {
        self.keys[layer].truncate(self.len * self.k_width);
        self.values[layer].truncate(self.len * self.v_width);
        self.keys[layer].extend_from_slice(keys);
        self.values[layer].extend_from_slice(values);
    }

    /// `layer`'s recurrent state as of the committed positions, to advance over new ones: what is
    /// written here becomes the state at `commit`.
    pub fn state_to_advance(&mut self, layer: usize) -> &mut [f32] {
        let w = &mut self.written[layer];
        w.clear();
        w.extend_from_slice(&self.states[layer]);
        self.advanced[layer] = true;
        w
    }

    /// Floats of `layer`'s recurrent state (0 for an attention layer, which holds keys and values
    /// instead).
    pub fn state_floats(&self, layer: usize) -> usize {
        self.states[layer].len()
    }

    /// `layer`'s recurrent state at the committed positions.
    pub fn state(&self, layer: usize) -> &[f32] {
        &self.states[layer]
    }

    /// Replaces `layer`'s committed recurrent state (restoring a saved session).
    pub fn set_state(&mut self, layer: usize, state: &[f32]) -> bool {
        if state.len() != self.states[layer].len() {
            return false;
        }
        self.states[layer].copy_from_slice(state);
        true
    }

    pub fn commit(&mut self, n: usize) {
        self.len += n;
        for ((state, written), advanced) in self.states.iter_mut().zip(&mut self.written).zip(&mut self.advanced) {
            if std::mem::take(advanced) {
                std::mem::swap(state, written);
            }
        }
    }

    /// Keys and values of `layer` for positions `range` (which may include appended, not yet
    /// committed positions).
    pub fn layer(&self, layer: usize, range: std::ops::Range<usize>) -> (&[f32], &[f32]) {
        (&self.keys[layer][range.start * self.k_width..range.end * self.k_width], &self.values[layer][range.start * self.v_width..range.end * self.v_width])
    }

    /// Every layer's key and value slots for the positions held, for saving a session (empty for
    /// a recurrent layer, whose state is `state`).
    pub fn layers(&self) -> impl Iterator<Item = (&[f32], &[f32])> {
        self.keys.iter().zip(&self.values).map(|(k, v)| (&k[..k.len().min(self.len * self.k_width)], &v[..v.len().min(self.len * self.v_width)]))
    }

    /// Gives back the room the slots grew into beyond the positions held (a cache kept for reuse
    /// should hold only what it counts).
    pub fn shrink_to_fit(&mut self) {
        self.keys.iter_mut().chain(&mut self.values).chain(&mut self.aux).for_each(|v| v.shrink_to_fit());
    }

    fn state_bytes(&self) -> usize {
        let per_copy: usize = self.states.iter().map(|s| s.len() * 4).sum();
        per_copy * (1 + self.checkpoints.len())
    }

    /// Bytes the slots hold in memory, room to grow included (`bytes` counts the positions).
    pub fn held_bytes(&self) -> usize {
        let scratch: usize = self.written.iter().map(|w| w.capacity() * 4).sum();
        self.keys.iter().chain(&self.values).chain(&self.aux).map(|v| v.capacity() * 4).sum::<usize>() + self.state_bytes() + scratch
    }

    pub fn bytes(&self) -> usize {
        self.keys.iter().chain(&self.values).chain(&self.aux).map(|v| v.len() * 4).sum::<usize>() + self.state_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recurrent_state_goes_back_only_to_a_checkpoint() {
        // Layer 0 attends (KV of width 2), layer 1 is recurrent (3 floats).
        let mut c = KvCache::with_states(vec![0, 3], 2, 2, 100);
        let step = |c: &mut KvCache, n: usize, value: f32| {
            c.append(0, &vec![value; 2 * n], &vec![value; 2 * n]);
            c.state_to_advance(1).iter_mut().for_each(|x| *x += value);
            c.commit(n);
        };
        step(&mut c, 5, 1.0);
        c.checkpoint();
        step(&mut c, 1, 10.0);
        step(&mut c, 1, 100.0);
        assert_eq!(c.state(1), [111.0; 3]);
        // Back to 6: the checkpoint at 5 is the longest that fits.
        assert_eq!(c.truncate(6), 5);
        assert_eq!(c.state(1), [1.0; 3]);
        assert_eq!(c.layer(0, 0..5).0.len(), 10);
        // A pass that wrote a state and never committed leaves nothing behind.
        c.state_to_advance(1).iter_mut().for_each(|x| *x = -1.0);
        c.append(0, &[9.0; 2], &[9.0; 2]);
        step(&mut c, 1, 1000.0);
        assert_eq!(c.state(1), [1001.0; 3]);
        // Before every checkpoint: back to the start, zero state.
        assert_eq!(c.truncate(3), 0);
        assert_eq!(c.state(1), [0.0; 3]);
        // Without recurrent layers, truncation is exact.
        let mut plain = KvCache::new(2, 1, 1, 10);
        for l in 0..2 {
            plain.append(l, &[1.0; 4], &[1.0; 4]);
        }
        plain.commit(4);
        assert_eq!(plain.truncate(3), 3);
    }
}
