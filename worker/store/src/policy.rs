//! Expert-cache policies, sans-IO (DESIGN.md §2): a policy is told each demand access and each
//! lookahead hint, in order, and decides what stays resident. It never reads a file and never
//! sees a clock; the store's I/O shell carries out its decisions. Replaying routing traces through
//! these policies measures them against Belady's optimum (`belady_hits`).

use std::collections::{BTreeSet, HashMap};

/// (MoE layer position, expert).
pub type Key = (u16, u16);

pub trait CachePolicy {
    fn name(&self) -> String;
    /// A demand access; returns whether `key` was resident. A miss makes it resident.
    fn access(&mut self, key: Key) -> bool;
    /// A hint that `key` is likely needed soon; returns whether the policy loaded it (a prefetch
    /// read). Hints never evict a pinned expert.
    fn hint(&mut self, _key: Key) -> bool {
        false
    }
    fn is_resident(&self, key: Key) -> bool;
}

/// The order in which one batch's accesses to a layer reach the policy: experts already resident
/// first (refreshed before anything is evicted), then the misses. Without it, a miss early in the
/// batch could evict an expert the same batch is about to use. The store and the trace replay
/// both use it, so the replay measures the policy as shipped.
pub fn batch_order(policy: &dyn CachePolicy, keys: &mut [Key]) {
    keys.sort_by_key(|k| !policy.is_resident(*k));
}

/// Per-layer LRU over a fixed number of slots per layer, with an optional pinned set per layer
/// (reserved slots of that layer's budget: a pinned expert is read on its first use and never
/// evicted after, so the replay starts from a cold cache like every other policy) and optional
/// prefetch on hints.
pub struct LayerLru {
    slots_per_layer: usize,
    /// Per layer: unpinned residents with their last-use tick.
    resident: Vec<Vec<(u16, u64)>>,
    pinned: Vec<Vec<u16>>,
    pins_loaded: std::collections::HashSet<Key>,
    prefetch: bool,
    prefetch_min_free: usize,
    /// Prefetched experts not yet used by a demand access.
    prefetched: std::collections::HashSet<Key>,
    /// Per layer: prefetches issued and used (halved together as they grow, so recent behaviour
    /// counts most), and hints seen while prefetch was held back (every 4th is let through).
    prefetch_issued: Vec<f64>,
    prefetch_used: Vec<f64>,
    held_back: Vec<u32>,
    tick: u64,
    label: String,
}

/// Below this share of prefetches used, a layer's hints are mostly held back: a wasted prefetch
/// costs a read and evicts an expert that may have been needed.
pub const PREFETCH_MIN_USEFUL: f64 = 0.5;
/// Prefetches a layer issues before its usefulness is judged.
const PREFETCH_WARMUP: f64 = 16.0;

impl LayerLru {
    pub fn new(layers: usize, slots_per_layer: usize) -> Self {
        LayerLru {
            slots_per_layer,
            resident: vec![Vec::new(); layers],
            pinned: vec![Vec::new(); layers],
            pins_loaded: Default::default(),
            prefetch: false,
            prefetch_min_free: 1,
            prefetched: Default::default(),
            prefetch_issued: vec![0.0; layers],
            prefetch_used: vec![0.0; layers],
            held_back: vec![0; layers],
            tick: 0,
            label: "LRU".into(),
        }
    }

    /// Pins the given experts per layer (at most the layer's slots).
    pub fn with_pins(mut self, pinned: Vec<Vec<u16>>) -> Self {
        self.pinned = pinned
            .into_iter()
            .map(|mut p| {
                p.truncate(self.slots_per_layer);
                p
            })
            .collect();
        self.label = format!("{}+pins", self.label);
        self
    }

    /// Prefetch on hints, in layers with at least `min_free_slots` unpinned slots: with fewer
    /// than one token's selections (top-k), a prefetched expert is evicted by the very demand
    /// accesses it was meant to serve, so hints there would only add reads.
    pub fn with_prefetch(mut self, min_free_slots: usize) -> Self {
        self.prefetch = true;
        self.prefetch_min_free = min_free_slots;
        self.label = format!("{}+prefetch", self.label);
        self
    }

    fn free_slots(&self, layer: usize) -> usize {
        self.slots_per_layer - self.pinned[layer].len()
    }

    fn touch_or_load(&mut self, key: Key) -> bool {
        self.decide(key).hit
    }

    /// A demand access with the full decision: whether it hit, and which key (if any) it evicted
    /// to make room. A miss with no unpinned slot in the layer is not made resident (`kept` false):
    /// the expert is used once and dropped.
    pub fn decide(&mut self, (layer, e): Key) -> Decision {
        self.tick += 1;
        let l = layer as usize;
        if self.prefetched.remove(&(layer, e)) {
            self.prefetch_used[l] += 1.0;
        }
        if self.pinned[l].contains(&e) {
            let hit = !self.pins_loaded.insert((layer, e));
            return Decision { hit, kept: true, evicted: None };
        }
        if let Some(slot) = self.resident[l].iter_mut().find(|(x, _)| *x == e) {
            slot.1 = self.tick;
            return Decision { hit: true, kept: true, evicted: None };
        }
        if self.free_slots(l) == 0 {
            return Decision { hit: false, kept: false, evicted: None };
        }
        let mut evicted = None;
        if self.resident[l].len() >= self.free_slots(l) {
            let oldest = self.resident[l].iter().enumerate().min_by_key(|(_, (_, t))| *t).map(|(i, _)| i).unwrap_or(0);
            let victim = (layer, self.resident[l].swap_remove(oldest).0);
            self.prefetched.remove(&victim);
            evicted = Some(victim);
        }
        self.resident[l].push((e, self.tick));
        Decision { hit: false, kept: true, evicted }
    }

    /// A lookahead hint with the full decision: `Some` when the policy wants the expert read now
    /// (prefetch on, not resident, a slot available), with what that evicts.
    pub fn decide_hint(&mut self, key: Key) -> Option<Decision> {
        let l = key.0 as usize;
        if !self.prefetch || self.free_slots(l) < self.prefetch_min_free.max(1) {
            return None;
        }
        if self.is_resident(key) {
            // A hinted resident expert is refreshed (it is about to be used), never re-read.
            self.tick += 1;
            if let Some(slot) = self.resident[l].iter_mut().find(|(x, _)| *x == key.1) {
                slot.1 = self.tick;
            }
            return None;
        }
        // Adaptive: a layer whose prefetches mostly go unused stops prefetching, but lets every
        // 8th hint through so that it notices when predictions improve.
        let (issued, used) = (self.prefetch_issued[l], self.prefetch_used[l]);
        if issued >= PREFETCH_WARMUP && used < PREFETCH_MIN_USEFUL * issued {
            self.held_back[l] += 1;
            if !self.held_back[l].is_multiple_of(4) {
                return None;
            }
        }
        let d = self.decide(key);
        if d.hit || !d.kept {
            return None;
        }
        self.prefetched.insert(key);
        self.prefetch_issued[l] += 1.0;
        if self.prefetch_issued[l] >= 64.0 {
            self.prefetch_issued[l] /= 2.0;
            self.prefetch_used[l] /= 2.0;
        }
        Some(d)
    }

    pub fn is_resident(&self, (layer, e): Key) -> bool {
        let l = layer as usize;
        self.pins_loaded.contains(&(layer, e)) || self.resident.get(l).is_some_and(|r| r.iter().any(|(x, _)| *x == e))
    }

    /// Drops `key` (its read failed): the next access is a miss again.
    pub fn forget(&mut self, (layer, e): Key) {
        self.pins_loaded.remove(&(layer, e));
        self.prefetched.remove(&(layer, e));
        if let Some(r) = self.resident.get_mut(layer as usize) {
            r.retain(|(x, _)| *x != e);
        }
    }

    pub fn pinned(&self) -> &[Vec<u16>] {
        &self.pinned
    }
}

/// What the policy decided about one access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub hit: bool,
    /// The expert stays resident after this access.
    pub kept: bool,
    pub evicted: Option<Key>,
}

impl CachePolicy for LayerLru {
    fn name(&self) -> String {
        self.label.clone()
    }
    fn access(&mut self, key: Key) -> bool {
        self.touch_or_load(key)
    }
    fn hint(&mut self, key: Key) -> bool {
        self.decide_hint(key).is_some()
    }
    fn is_resident(&self, key: Key) -> bool {
        LayerLru::is_resident(self, key)
    }
}

/// Per-layer LFU: evicts the resident expert used least often so far (ties: least recently).
pub struct LayerLfu {
    slots_per_layer: usize,
    resident: Vec<Vec<u16>>,
    counts: HashMap<Key, (u64, u64)>,
    tick: u64,
}

impl LayerLfu {
    pub fn new(layers: usize, slots_per_layer: usize) -> Self {
        LayerLfu { slots_per_layer, resident: vec![Vec::new(); layers], counts: HashMap::new(), tick: 0 }
    }
}

impl CachePolicy for LayerLfu {
    fn name(&self) -> String {
        "LFU".into()
    }
    fn is_resident(&self, (layer, e): Key) -> bool {
        self.resident.get(layer as usize).is_some_and(|r| r.contains(&e))
    }
    fn access(&mut self, (layer, e): Key) -> bool {
        self.tick += 1;
        let c = self.counts.entry((layer, e)).or_insert((0, 0));
        c.0 += 1;
        c.1 = self.tick;
        let l = layer as usize;
        if self.resident[l].contains(&e) {
            return true;
        }
        if self.slots_per_layer == 0 {
            return false;
        }
        if self.resident[l].len() >= self.slots_per_layer {
            let counts = &self.counts;
            let victim =
                self.resident[l].iter().enumerate().min_by_key(|(_, x)| counts.get(&(layer, **x)).copied().unwrap_or((0, 0))).map(|(i, _)| i).unwrap_or(0);
            self.resident[l].swap_remove(victim);
        }
        self.resident[l].push(e);
        false
    }
}

/// Demand hits of Belady's optimal policy (evict the resident key whose next use is furthest)
/// with `capacity` keys shared by all layers, over `accesses` in order.
pub fn belady_hits(accesses: &[Key], capacity: usize) -> usize {
    belady(accesses, capacity).iter().filter(|h| **h).count()
}

/// Belady's optimal policy: for each access, whether it hit.
pub fn belady(accesses: &[Key], capacity: usize) -> Vec<bool> {
    let mut hit = vec![false; accesses.len()];
    if capacity == 0 {
        return hit;
    }
    // next[i]: index of the next access to the same key after i (usize::MAX if none).
    let mut next = vec![usize::MAX; accesses.len()];
    let mut last: HashMap<Key, usize> = HashMap::new();
    for (i, k) in accesses.iter().enumerate().rev() {
        if let Some(j) = last.insert(*k, i) {
            next[i] = j;
        }
    }
    let mut by_next: BTreeSet<(usize, Key)> = BTreeSet::new();
    let mut resident: HashMap<Key, usize> = HashMap::new();
    for (i, k) in accesses.iter().enumerate() {
        if let Some(n) = resident.remove(k) {
            hit[i] = true;
            by_next.remove(&(n, *k));
        } else if resident.len() >= capacity {
            if let Some(&(n, victim)) = by_next.iter().next_back() {
                by_next.remove(&(n, victim));
                resident.remove(&victim);
            }
        }
        resident.insert(*k, next[i]);
        by_next.insert((next[i], *k));
    }
    hit
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replay(p: &mut dyn CachePolicy, keys: &[Key]) -> usize {
        keys.iter().filter(|k| p.access(**k)).count()
    }

    #[test]
    fn lru_evicts_the_least_recently_used_per_layer() {
        let mut p = LayerLru::new(2, 2);
        let seq = [(0, 1), (0, 2), (0, 1), (0, 3), (0, 2), (1, 5), (0, 1)];
        // 1 m, 2 m, 1 h, 3 m (evicts 2), 2 m (evicts 1), layer 1 separate, 1 m.
        let hits: Vec<bool> = seq.iter().map(|k| p.access(*k)).collect();
        assert_eq!(hits, [false, false, true, false, false, false, false]);
    }

    #[test]
    fn pins_stay_and_prefetch_turns_misses_into_hits() {
        let mut p = LayerLru::new(1, 2).with_pins(vec![vec![9]]);
        assert!(!p.access((0, 9)), "a pin is read on first use");
        assert!(p.access((0, 9)));
        assert!(!p.access((0, 1)));
        assert!(!p.access((0, 2))); // evicts 1, never 9
        assert!(p.access((0, 9)));
        let mut q = LayerLru::new(1, 2).with_prefetch(1);
        assert!(q.hint((0, 4)));
        assert!(q.access((0, 4)));
        assert!(!q.hint((0, 4)), "already resident: no read");
        let mut small = LayerLru::new(1, 2).with_prefetch(4);
        assert!(!small.hint((0, 4)), "fewer slots than a token's selections: no prefetch");
    }

    #[test]
    fn prefetch_that_goes_unused_is_held_back_and_resumes_when_useful() {
        let mut p = LayerLru::new(1, 8).with_prefetch(1);
        // Hints that are never used: after the warm-up, at most one hint in four reads.
        let mut reads = 0;
        for i in 0..400u16 {
            reads += p.hint((0, 100 + i % 50)) as usize;
            p.access((0, i % 3));
        }
        assert!(reads <= 16 + 400 / 4, "{reads} prefetch reads for useless hints");
        // Hints that are then used: prefetch comes back.
        let mut late_reads = 0;
        for i in 0..400u16 {
            let k = (0, 200 + i % 40);
            let read = p.hint(k);
            if i >= 300 {
                late_reads += read as usize;
            }
            p.access(k);
        }
        assert!(late_reads > 90, "useful prefetch was not resumed ({late_reads} of the last 100 hints)");
    }

    #[test]
    fn decisions_name_the_evicted_expert_and_zero_slot_layers_stream() {
        let mut p = LayerLru::new(2, 2);
        assert_eq!(p.decide((0, 1)), Decision { hit: false, kept: true, evicted: None });
        p.decide((0, 2));
        p.decide((0, 1));
        assert_eq!(p.decide((0, 3)), Decision { hit: false, kept: true, evicted: Some((0, 2)) });
        assert!(p.is_resident((0, 1)) && p.is_resident((0, 3)) && !p.is_resident((0, 2)));
        p.forget((0, 3));
        assert!(!p.decide((0, 3)).hit);
        let mut none = LayerLru::new(1, 0);
        assert_eq!(none.decide((0, 5)), Decision { hit: false, kept: false, evicted: None });
        assert!(!none.decide((0, 5)).hit, "nothing is ever kept with no slots");
    }

    #[test]
    fn lfu_keeps_the_frequent() {
        let mut p = LayerLfu::new(1, 2);
        let seq = [(0, 1), (0, 1), (0, 2), (0, 3), (0, 1), (0, 2)];
        // 1 m, 1 h, 2 m, 3 m (evicts 2: count 1, older than 3? 3 not resident yet; evicts 2), 1 h, 2 m.
        assert_eq!(replay(&mut p, &seq), 2);
    }

    #[test]
    fn belady_is_optimal_on_a_textbook_sequence_and_bounds_the_others() {
        // Classic page reference string with 3 frames: OPT has 9 faults in 20 references.
        let refs = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1];
        let keys: Vec<Key> = refs.iter().map(|r| (0u16, *r as u16)).collect();
        assert_eq!(keys.len() - belady_hits(&keys, 3), 9);
        let mut lru = LayerLru::new(1, 3);
        assert_eq!(keys.len() - replay(&mut lru, &keys), 12); // LRU: 12 faults
                                                              // On any sequence, no policy beats Belady at the same capacity.
        let mut s = 7u64;
        let keys: Vec<Key> = (0..3000)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                ((s >> 60) as u16 % 3, ((s >> 40) % 16) as u16)
            })
            .collect();
        let opt = belady_hits(&keys, 12);
        assert!(replay(&mut LayerLru::new(3, 4), &keys) <= opt);
        assert!(replay(&mut LayerLfu::new(3, 4), &keys) <= opt);
    }
}
