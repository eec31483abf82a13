//! Expert placement: which workers hold which routed experts, as a file (`shimmer plan` writes
//! it, `--placement` reads it; docs/cluster.md) and as the planner that computes it — a sans-IO
//! function of the model's shape, the workers' RAM, the routing heat and the replica count.
//!
//! The file (JSON, at most 16 MiB): `format` = `shimmer-placement`, `version` = 1, `model` (the
//! model's fingerprint), `epoch`, `workers` (`name`, `addr`, `ram_bytes`), and `layers`: per MoE
//! layer, `layer` and `replicas` — per expert, the ordered list of worker names that hold it (the
//! first is asked first; the next on failure).
//!
//! Must never: accept a file whose replicas name an unknown worker, leave an expert without a
//! holder, or list one worker twice for an expert.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde::{Deserialize, Serialize};

use shimmer_common::LoadError;

pub const FORMAT: &str = "shimmer-placement";
pub const VERSION: u32 = 1;
const MAX_FILE_BYTES: u64 = 16 << 20;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Worker {
    pub name: String,
    pub addr: String,
    /// RAM the worker gives its expert cache.
    pub ram_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerPlacement {
    pub layer: usize,
    /// Per expert, the workers that hold it, in the order they are asked.
    pub replicas: Vec<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    pub format: String,
    pub version: u32,
    pub model: String,
    pub epoch: u64,
    pub workers: Vec<Worker>,
    pub layers: Vec<LayerPlacement>,
}

impl Placement {
    /// Checks the placement against the model: every MoE layer present once, every expert held,
    /// every name a known worker, no worker twice for an expert.
    pub fn validate(&self, fingerprint: &str, moe_layers: &[usize], experts: usize) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!("`format` is {:?}, expected {FORMAT:?}", self.format));
        }
        if self.version != VERSION {
            return Err(format!("version {} (this build reads {VERSION})", self.version));
        }
        if self.model != fingerprint {
            return Err(format!("made for model {} but this model is {fingerprint}", self.model));
        }
        let mut names = HashSet::new();
        for w in &self.workers {
            if w.name.is_empty() || !names.insert(w.name.as_str()) {
                return Err(format!("worker name {:?} is empty or repeated", w.name));
            }
        }
        let want: HashSet<usize> = moe_layers.iter().copied().collect();
        let mut seen = HashSet::new();
        for l in &self.layers {
            if !want.contains(&l.layer) || !seen.insert(l.layer) {
                return Err(format!("layer {} is not a MoE layer of this model, or is listed twice", l.layer));
            }
            if l.replicas.len() != experts {
                return Err(format!("layer {} lists {} experts, the model has {experts}", l.layer, l.replicas.len()));
            }
            for (e, holders) in l.replicas.iter().enumerate() {
                if holders.is_empty() {
                    return Err(format!("layer {} expert {e} has no worker", l.layer));
                }
                let mut once = HashSet::new();
                for h in holders {
                    if !names.contains(h.as_str()) {
                        return Err(format!("layer {} expert {e} names unknown worker {h:?}", l.layer));
                    }
                    if !once.insert(h) {
                        return Err(format!("layer {} expert {e} lists worker {h:?} twice", l.layer));
                    }
                }
            }
        }
        if let Some(missing) = moe_layers.iter().find(|l| !seen.contains(l)) {
            return Err(format!("MoE layer {missing} is missing"));
        }
        Ok(())
    }

    pub fn read(path: &Path) -> Result<Placement, LoadError> {
        let len = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?.len();
        if len > MAX_FILE_BYTES {
            return Err(LoadError::malformed(path, format!("{len} bytes; a placement file is at most {MAX_FILE_BYTES}")));
        }
        let bytes = std::fs::read(path).map_err(|e| LoadError::io(path, e))?;
        Self::parse(&bytes).map_err(|e| LoadError::malformed(path, e))
    }

    /// A placement file's bytes (at most `MAX_FILE_BYTES`).
    pub fn parse(bytes: &[u8]) -> Result<Placement, String> {
        if bytes.len() as u64 > MAX_FILE_BYTES {
            return Err(format!("{} bytes; a placement file is at most {MAX_FILE_BYTES}", bytes.len()));
        }
        serde_json::from_slice(bytes).map_err(|e| format!("not a placement file: {e}"))
    }

    /// The holders of `(layer, expert)`, in order.
    pub fn holders(&self, layer: usize, expert: usize) -> Option<&[String]> {
        self.layers.iter().find(|l| l.layer == layer)?.replicas.get(expert).map(Vec::as_slice)
    }

    /// What worker `name` holds: every (layer, expert) it is listed for, and per MoE layer (in
    /// `moe_layers` order) its experts to pin, first-choice ones before replicas — so a tight RAM
    /// budget keeps the ones it serves first.
    pub fn slice(&self, name: &str, moe_layers: &[usize]) -> Result<Slice, String> {
        if !self.workers.iter().any(|w| w.name == name) {
            return Err(format!("the placement has no worker named {name:?}"));
        }
        let mut assigned = std::collections::HashSet::new();
        let mut pins = Vec::with_capacity(moe_layers.len());
        for &l in moe_layers {
            let lp = self.layers.iter().find(|x| x.layer == l).ok_or_else(|| format!("the placement has no layer {l}"))?;
            let (mut first, mut later) = (Vec::new(), Vec::new());
            for (e, holders) in lp.replicas.iter().enumerate() {
                match holders.iter().position(|h| h == name) {
                    Some(0) => first.push(e as u16),
                    Some(_) => later.push(e as u16),
                    None => continue,
                }
                assigned.insert((l as u32, e as u32));
            }
            first.extend(later);
            pins.push(first);
        }
        Ok(Slice { assigned, pins })
    }
}

/// One worker's part of a placement (`Placement::slice`).
#[derive(Debug, Clone, PartialEq)]
pub struct Slice {
    pub assigned: std::collections::HashSet<(u32, u32)>,
    pub pins: Vec<Vec<u16>>,
}

/// What the planner is given.
pub struct PlanInput<'a> {
    pub model: &'a str,
    pub moe_layers: &'a [usize],
    pub experts: usize,
    pub expert_bytes: u64,
    pub workers: &'a [Worker],
    /// Routing counts per (layer, expert); empty: uniform.
    pub heat: &'a HashMap<(usize, usize), u64>,
    /// Copies of each of the hottest experts (1: no replication).
    pub replicas: usize,
    /// The fraction of each layer's experts, hottest first, that get `replicas` copies (1: all,
    /// so that any `replicas - 1` workers can fail).
    pub replicate_fraction: f64,
    /// Selections per token per MoE layer.
    pub top_k: usize,
}

/// The planner's expectations per worker, per generated token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerForecast {
    pub name: String,
    /// Expected expert computations (selections served) per token.
    pub selections_per_token: f64,
    /// Expected bytes of expert weights read per token (all tiers).
    pub bytes_per_token: f64,
    /// Expected round trips (MoE layers that send it rows) per token.
    pub round_trips_per_token: f64,
    /// Experts it holds, and how many of those fit its RAM budget.
    pub experts_held: usize,
    pub experts_in_ram: usize,
}

/// `shimmer plan`'s default `replicate_fraction`: the hottest tenth.
pub const HOT_FRACTION: f64 = 0.1;

/// Balances expected expert work across workers: experts in order of heat, each copy to the
/// worker with the least expected work so far that does not hold it (ties: more RAM left); of
/// an expert's copies, the one asked first least so far is asked first. The
/// hottest `replicate_fraction` of each layer gets `replicas` copies, whose work is shared among them; a worker's
/// hottest experts are the ones that fill its RAM budget (its store pins by the same heat).
pub fn plan(input: &PlanInput<'_>) -> Result<(Placement, Vec<WorkerForecast>), String> {
    let n = input.workers.len();
    if n == 0 {
        return Err("no workers".into());
    }
    if input.replicas == 0 || input.replicas > n {
        return Err(format!("{} replicas per expert: must be between 1 and the number of workers ({n})", input.replicas));
    }
    if !(input.replicate_fraction > 0.0 && input.replicate_fraction <= 1.0) {
        return Err(format!("a replicated fraction of {} experts: must be in (0, 1]", input.replicate_fraction));
    }
    let uniform = input.heat.is_empty();
    // Per layer, the probability that a token's selection lands on each expert.
    let share = |layer: usize, e: usize| -> f64 {
        if uniform {
            return 1.0 / input.experts as f64;
        }
        let total: u64 = (0..input.experts).map(|x| input.heat.get(&(layer, x)).copied().unwrap_or(0)).sum();
        if total == 0 {
            1.0 / input.experts as f64
        } else {
            input.heat.get(&(layer, e)).copied().unwrap_or(0) as f64 / total as f64
        }
    };
    let mut work = vec![0.0f64; n];
    // Per worker, the share of selections it is asked first for.
    let mut first_work = vec![0.0f64; n];
    let mut used = vec![0u64; n];
    let mut held = vec![0usize; n];
    let mut in_ram = vec![0usize; n];
    let mut layer_hit = vec![vec![0.0f64; input.moe_layers.len()]; n];
    let mut layers = Vec::with_capacity(input.moe_layers.len());
    for (li, &layer) in input.moe_layers.iter().enumerate() {
        let mut order: Vec<usize> = (0..input.experts).collect();
        order.sort_by(|a, b| share(layer, *b).total_cmp(&share(layer, *a)).then(a.cmp(b)));
        let hot = ((input.experts as f64 * input.replicate_fraction).ceil() as usize).min(input.experts);
        let mut replicas = vec![Vec::new(); input.experts];
        for (rank, &e) in order.iter().enumerate() {
            let copies = if rank < hot { input.replicas } else { 1 };
            let p = share(layer, e);
            for _ in 0..copies {
                let pick = (0..n)
                    .filter(|w| !replicas[e].contains(w))
                    .min_by(|a, b| {
                        work[*a]
                            .total_cmp(&work[*b])
                            .then((input.workers[*b].ram_bytes.saturating_sub(used[*b])).cmp(&input.workers[*a].ram_bytes.saturating_sub(used[*a])))
                            .then(a.cmp(b))
                    })
                    .ok_or("not enough workers for the replicas")?;
                replicas[e].push(pick);
                work[pick] += p / copies as f64;
                held[pick] += 1;
                if used[pick] + input.expert_bytes <= input.workers[pick].ram_bytes {
                    used[pick] += input.expert_bytes;
                    in_ram[pick] += 1;
                }
                layer_hit[pick][li] += p / copies as f64;
            }
            // The first holder is asked first (the others on failure): of the copies, the one
            // first-asked least so far leads, so every holder serves its share.
            let lead = (0..replicas[e].len()).min_by(|&a, &b| first_work[replicas[e][a]].total_cmp(&first_work[replicas[e][b]]).then(a.cmp(&b)));
            if let Some(lead) = lead {
                replicas[e].swap(0, lead);
                first_work[replicas[e][0]] += p;
            }
        }
        layers.push(LayerPlacement { layer, replicas: replicas.into_iter().map(|r| r.into_iter().map(|w| input.workers[w].name.clone()).collect()).collect() });
    }
    let placement = Placement { format: FORMAT.into(), version: VERSION, model: input.model.into(), epoch: 1, workers: input.workers.to_vec(), layers };
    // `work[w]` is the share of one selection per layer, summed over layers; a token makes top-k
    // selections per layer. A layer sends the worker rows when any of them lands on it (taking
    // the selections as independent draws).
    let k = input.top_k as f64;
    let forecasts = (0..n)
        .map(|w| WorkerForecast {
            name: input.workers[w].name.clone(),
            selections_per_token: work[w] * k,
            bytes_per_token: work[w] * k * input.expert_bytes as f64,
            round_trips_per_token: layer_hit[w].iter().map(|q| 1.0 - (1.0 - q.min(1.0)).powf(k)).sum(),
            experts_held: held[w],
            experts_in_ram: in_ram[w],
        })
        .collect();
    Ok((placement, forecasts))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workers(n: usize, ram: u64) -> Vec<Worker> {
        (0..n).map(|i| Worker { name: format!("w{i}"), addr: format!("127.0.0.{}:7070", i + 2), ram_bytes: ram }).collect()
    }

    #[test]
    fn uniform_heat_spreads_experts_evenly_and_validates() {
        let ws = workers(3, 1 << 30);
        let heat = HashMap::new();
        let (p, f) = plan(&PlanInput {
            model: "m",
            moe_layers: &[1, 2, 3],
            experts: 12,
            expert_bytes: 1 << 20,
            workers: &ws,
            heat: &heat,
            replicas: 1,
            replicate_fraction: HOT_FRACTION,
            top_k: 2,
        })
        .unwrap();
        p.validate("m", &[1, 2, 3], 12).unwrap();
        assert!(f.iter().all(|w| w.experts_held == 12), "{f:?}");
        let works: Vec<f64> = f.iter().map(|w| w.selections_per_token).collect();
        assert!(works.iter().all(|w| (w - works[0]).abs() < 1e-9));
        // 3 layers × 2 selections spread over 3 workers: 2 each; each layer reaches a worker with
        // probability 1 − (2/3)².
        assert!((works[0] - 2.0).abs() < 1e-9 && (f[0].round_trips_per_token - 3.0 * (1.0 - (2.0f64 / 3.0).powi(2))).abs() < 1e-9, "{f:?}");
    }

    #[test]
    fn a_workers_slice_lists_its_first_choice_experts_before_its_replicas() {
        let ws = workers(2, 1 << 30);
        let owner = |e: usize| if e.is_multiple_of(2) { vec!["w0".to_string(), "w1".to_string()] } else { vec!["w1".to_string()] };
        let p = Placement {
            format: FORMAT.into(),
            version: VERSION,
            model: "m".into(),
            epoch: 3,
            workers: ws,
            layers: vec![LayerPlacement { layer: 4, replicas: (0..4).map(owner).collect() }],
        };
        let w1 = p.slice("w1", &[4]).unwrap();
        assert_eq!(w1.pins, vec![vec![1, 3, 0, 2]], "first choice (1, 3), then replicas (0, 2)");
        assert_eq!(w1.assigned.len(), 4);
        let w0 = p.slice("w0", &[4]).unwrap();
        assert_eq!((w0.pins.clone(), w0.assigned.contains(&(4, 2)), w0.assigned.contains(&(4, 1))), (vec![vec![0, 2]], true, false));
        assert!(p.slice("w7", &[4]).unwrap_err().contains("no worker named"));
        assert!(p.slice("w0", &[5]).unwrap_err().contains("no layer 5"));
    }

    #[test]
    fn hot_experts_are_replicated_and_work_is_balanced_by_heat() {
        let ws = workers(3, 5 << 20);
        // Layer 0: expert 0 takes half the selections, the rest share the other half.
        let mut heat = HashMap::new();
        heat.insert((0, 0), 700);
        for e in 1..10 {
            heat.insert((0, e), 70);
        }
        let (p, f) = plan(&PlanInput {
            model: "m",
            moe_layers: &[0],
            experts: 10,
            expert_bytes: 1 << 20,
            workers: &ws,
            heat: &heat,
            replicas: 2,
            replicate_fraction: HOT_FRACTION,
            top_k: 2,
        })
        .unwrap();
        p.validate("m", &[0], 10).unwrap();
        assert_eq!(p.holders(0, 0).unwrap().len(), 2, "the hottest expert has two holders");
        assert_eq!(p.holders(0, 5).unwrap().len(), 1);
        let works: Vec<f64> = f.iter().map(|w| w.selections_per_token).collect();
        let (lo, hi) = (works.iter().copied().fold(f64::MAX, f64::min), works.iter().copied().fold(0.0, f64::max));
        assert!((hi - lo) / hi < 0.15, "expected work balanced within 15 %: {works:?}");
        // RAM holds 5 experts per worker; nothing beyond is counted as in RAM.
        assert!(f.iter().all(|w| w.experts_in_ram <= 5));
    }

    #[test]
    fn bad_placements_are_refused_with_the_reason() {
        let ws = workers(2, 1 << 30);
        let heat = HashMap::new();
        let (p, _) = plan(&PlanInput {
            model: "m",
            moe_layers: &[0, 1],
            experts: 4,
            expert_bytes: 1,
            workers: &ws,
            heat: &heat,
            replicas: 2,
            replicate_fraction: HOT_FRACTION,
            top_k: 2,
        })
        .unwrap();
        type Damage = Box<dyn Fn(&mut Placement)>;
        let cases: Vec<(Damage, &str)> = vec![
            (Box::new(|p| p.model = "other".into()), "made for model"),
            (Box::new(|p| p.layers[0].replicas[1] = vec!["w9".into()]), "unknown worker"),
            (Box::new(|p| p.layers[0].replicas[1] = vec![]), "no worker"),
            (Box::new(|p| p.layers[0].replicas[1] = vec!["w0".into(), "w0".into()]), "twice"),
            (Box::new(|p| p.layers.pop().map(|_| ()).unwrap_or(())), "missing"),
            (Box::new(|p| p.layers[0].replicas.pop().map(|_| ()).unwrap_or(())), "lists 3 experts"),
            (Box::new(|p| p.version = 2), "version"),
        ];
        for (edit, needle) in cases {
            let mut q = p.clone();
            edit(&mut q);
            let e = q.validate("m", &[0, 1], 4).unwrap_err();
            assert!(e.contains(needle), "{e}");
        }
        assert!(plan(&PlanInput {
            model: "m",
            moe_layers: &[0],
            experts: 4,
            expert_bytes: 1,
            workers: &ws,
            heat: &heat,
            replicas: 3,
            replicate_fraction: HOT_FRACTION,
            top_k: 2
        })
        .is_err());
        assert!(plan(&PlanInput {
            model: "m",
            moe_layers: &[0],
            experts: 4,
            expert_bytes: 1,
            workers: &ws,
            heat: &heat,
            replicas: 2,
            replicate_fraction: 0.0,
            top_k: 2
        })
        .is_err());
        // Every expert replicated: any one worker can fail.
        let (p, _) = plan(&PlanInput {
            model: "m",
            moe_layers: &[0],
            experts: 4,
            expert_bytes: 1,
            workers: &ws,
            heat: &heat,
            replicas: 2,
            replicate_fraction: 1.0,
            top_k: 2,
        })
        .unwrap();
        assert!(p.layers[0].replicas.iter().all(|r| r.len() == 2 && r[0] != r[1]));
    }

    #[test]
    fn with_every_expert_on_two_workers_each_worker_is_asked_first_for_its_share() {
        for n in [2, 3, 4, 5] {
            let ws = workers(n, 1 << 30);
            let (p, _) = plan(&PlanInput {
                model: "m",
                moe_layers: &[1, 2],
                experts: 16,
                expert_bytes: 1,
                workers: &ws,
                heat: &HashMap::new(),
                replicas: 2,
                replicate_fraction: 1.0,
                top_k: 2,
            })
            .unwrap();
            let mut first = HashMap::new();
            for l in &p.layers {
                for r in &l.replicas {
                    *first.entry(r[0].clone()).or_insert(0usize) += 1;
                }
            }
            let (lo, hi) = (first.values().min().copied().unwrap_or(0), first.values().max().copied().unwrap_or(0));
            assert!(first.len() == n && hi - lo <= 2, "{n} workers: first-asked counts {first:?}");
        }
    }
}
