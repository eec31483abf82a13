//! The attention KV cache: per layer, keys and values for every position so far
//! (`kv_heads × head_dim` values each), grown on demand up to the model's context.

pub struct KvCache {
    stride: usize,
    capacity: usize,
    len: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl KvCache {
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, capacity: usize) -> Self {
        KvCache { stride: kv_heads * head_dim, capacity, len: 0, keys: vec![Vec::new(); layers], values: vec![Vec::new(); layers] }
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
            k.truncate(self.len * self.stride);
            v.truncate(self.len * self.stride);
        }
    }

    /// Appends `n` positions' keys/values for `layer`; every layer must append the same `n`
    /// before `commit(n)`.
    pub fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) {
        self.keys[layer].truncate(self.len * self.stride);
        self.values[layer].truncate(self.len * self.stride);
        self.keys[layer].extend_from_slice(keys);
        self.values[layer].extend_from_slice(values);
    }

    pub fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Keys and values of `layer` for positions `range` (which may include appended, not yet
    /// committed positions).
    pub fn layer(&self, layer: usize, range: std::ops::Range<usize>) -> (&[f32], &[f32]) {
        let r = range.start * self.stride..range.end * self.stride;
        (&self.keys[layer][r.clone()], &self.values[layer][r])
    }

    pub fn bytes(&self) -> usize {
        self.keys.iter().chain(&self.values).map(|v| v.len() * 4).sum()
    }
}
