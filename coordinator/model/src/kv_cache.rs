//! The attention KV cache: per layer, a key slot and a value slot for every position so far,
//! grown on demand up to the model's context. GQA stores `kv_heads × head_dim` in each; MLA stores
//! the compressed latent in the key slot and the shared rotary key in the value slot.

#[derive(Clone)]
pub struct KvCache {
    k_width: usize,
    v_width: usize,
    capacity: usize,
    len: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl KvCache {
    /// `k_width`/`v_width`: values per position in each layer's key and value slot.
    pub fn new(layers: usize, k_width: usize, v_width: usize, capacity: usize) -> Self {
        KvCache { k_width, v_width, capacity, len: 0, keys: vec![Vec::new(); layers], values: vec![Vec::new(); layers] }
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

    /// Forgets every position from `len` on (a chat turn that diverged, `/reset`).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        for (k, v) in self.keys.iter_mut().zip(&mut self.values) {
            k.truncate(self.len * self.k_width);
            v.truncate(self.len * self.v_width);
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

    pub fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Keys and values of `layer` for positions `range` (which may include appended, not yet
    /// committed positions).
    pub fn layer(&self, layer: usize, range: std::ops::Range<usize>) -> (&[f32], &[f32]) {
        (&self.keys[layer][range.start * self.k_width..range.end * self.k_width], &self.values[layer][range.start * self.v_width..range.end * self.v_width])
    }

    /// Every layer's key and value slots for the positions held, for saving a session.
    pub fn layers(&self) -> impl Iterator<Item = (&[f32], &[f32])> {
        self.keys.iter().zip(&self.values).map(|(k, v)| (&k[..self.len * self.k_width], &v[..self.len * self.v_width]))
    }

    /// Gives back the room the slots grew into beyond the positions held (a cache kept for reuse
    /// should hold only what it counts).
    pub fn shrink_to_fit(&mut self) {
        self.keys.iter_mut().chain(&mut self.values).for_each(|v| v.shrink_to_fit());
    }

    /// Bytes the slots hold in memory, room to grow included (`bytes` counts the positions).
    pub fn held_bytes(&self) -> usize {
        self.keys.iter().chain(&self.values).map(|v| v.capacity() * 4).sum()
    }

    pub fn bytes(&self) -> usize {
        self.keys.iter().chain(&self.values).map(|v| v.len() * 4).sum()
    }
}
