//! The expert-dispatch contract and its in-process implementation.
//!
//! A `MoeBatch` carries, for one MoE layer, `n` rows of the normalised hidden state and for each
//! row its `top_k` (expert, weight) pairs exactly as the router chose them. The dispatcher adds
//! Σ weight·FFN_expert(row) for each row into fixed-point accumulators (`shimmer_kernels::fixed`),
//! so sums from several dispatchers, formed in any order, merge bit-identically.
//!
//! Each expert is applied once per batch, to every row that selected it (the union of experts).

use rayon::prelude::*;
use shimmer_common::quant::{self, QuantScheme};
use shimmer_common::spec::LayerMlp;
use shimmer_common::{Checkpoint, LoadError, ModelSpec};
use shimmer_kernels::{fixed, Activations, FixedPointOverflow, Matrix};

use crate::accelerator::{AccelJob, Accelerator};
use crate::expert::{Expert, FfnScratch};
use crate::weights::load_expert;

pub struct MoeBatch<'a> {
    pub layer: usize,
    pub hidden: usize,
    /// `n × hidden`, row-major.
    pub rows: &'a [f32],
    pub top_k: usize,
    /// `n × top_k` expert ids.
    pub experts: &'a [u32],
    /// `n × top_k` routing weights, already normalised as the model defines.
    pub weights: &'a [f32],
}

impl MoeBatch<'_> {
    pub fn num_rows(&self) -> usize {
        self.rows.len() / self.hidden
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    #[error("layer {layer} has no routed experts here")]
    NotMoeLayer { layer: usize },
    #[error("layer {layer}: expert {expert} does not exist (the layer has {count})")]
    NoSuchExpert { layer: usize, expert: u32, count: usize },
    /// No copy of a selected expert could be read and verified.
    /// `message` names the file, layer and expert.
    #[error("{message}")]
    Storage { layer: usize, expert: u32, message: String },
    #[error("layer {layer}: {overflow}")]
    Overflow { layer: usize, overflow: FixedPointOverflow },
    /// A worker could not be reached or answered with an error (the message names it).
    #[error("{0}")]
    Remote(String),
}

/// Whoever holds the experts: this process's memory, the tiered store, or workers over QUIC.
/// The contract is compute only: what a dispatcher can report about itself (store counters,
/// cluster links) is read from its concrete type, never through this trait.
pub trait ExpertDispatch: Send + Sync {
    /// Adds each row's weighted expert sum into `acc` (`n × hidden` fixed-point units).
    fn dispatch(&self, batch: &MoeBatch<'_>, acc: &mut [i64]) -> Result<(), DispatchError>;

    /// Whether `prefetch` hints are useful to this dispatcher (the decoder then computes the
    /// next MoE layer's predicted experts).
    fn wants_lookahead(&self) -> bool {
        false
    }

    /// A hint: `layer` will probably select these experts soon. Never blocks on I/O.
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}

    /// Called after each turn (a generation, a scoring): persist what was learned.
    fn end_turn(&self) -> Result<(), String> {
        Ok(())
    }
}

/// Every expert of every MoE layer, in this process's memory.
pub struct InProcessExperts {
    /// Indexed by layer; `None` for dense layers.
    layers: Vec<Option<Vec<Expert>>>,
    /// Where some experts are computed instead of this CPU (a GPU's VRAM tier).
    accelerator: Option<std::sync::Arc<dyn Accelerator>>,
}

impl InProcessExperts {
    /// Loads every routed expert named by the spec's templates, checking each tensor's shape.
    pub fn load(ckpt: &Checkpoint, spec: &ModelSpec) -> Result<Self, LoadError> {
        Self::load_as(ckpt, spec, QuantScheme::Bf16)
    }

    /// Loads the experts and quantises them to `scheme` in memory — for measuring a format's
    /// quality against the original (`shimmer quant-eval`) only: serving never re-quantises
    /// (DESIGN.md §1); formats reach it through a converted container. `Bf16` keeps the
    /// checkpoint's own precision.
    pub fn load_as(ckpt: &Checkpoint, spec: &ModelSpec, scheme: QuantScheme) -> Result<Self, LoadError> {
        Self::load_as_with(ckpt, spec, scheme, None)
    }

    /// `load_as`, with the quantised experts' products on `activations` when given (measuring
    /// what integer activations cost against f32 ones); `None` keeps each format's default.
    pub fn load_as_with(ckpt: &Checkpoint, spec: &ModelSpec, scheme: QuantScheme, activations: Option<Activations>) -> Result<Self, LoadError> {
        let convert_one = |m: Matrix| -> Matrix {
            let widened = || {
                let mut w = vec![0.0f32; m.rows * m.cols];
                for (r, row) in w.chunks_exact_mut(m.cols).enumerate() {
                    m.row_f32(r, row);
                }
                w
            };
            match scheme {
                QuantScheme::Bf16 => m,
                QuantScheme::Int8PerRow => Matrix::from_quant(quant::quantize_int8(&widened(), m.rows, m.cols)),
                QuantScheme::Int4 { group } => Matrix::from_quant(quant::quantize_int4(&widened(), m.rows, m.cols, group)),
                QuantScheme::Mxfp4 => Matrix::from_quant(quant::quantize_mxfp4(&widened(), m.rows, m.cols)),
            }
        };
        let convert = |m: Matrix| -> Matrix {
            let m = convert_one(m);
            match activations {
                Some(a) => m.with_activations(a),
                None => m,
            }
        };
        let mut layers = Vec::with_capacity(spec.num_layers);
        for (l, kind) in spec.layers.iter().enumerate() {
            if *kind != LayerMlp::Moe {
                layers.push(None);
                continue;
            }
            let mut experts = Vec::with_capacity(spec.moe.num_experts);
            for e in 0..spec.moe.num_experts {
                let Expert { gate, up, down, bias, activation } = load_expert(ckpt, spec, l, e)?;
                let mut expert = Expert::new(convert(gate), convert(up), convert(down));
                expert.bias = bias;
                expert.activation = activation;
                experts.push(expert);
            }
            layers.push(Some(experts));
        }
        Ok(InProcessExperts { layers, accelerator: None })
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().flatten().flatten().map(Expert::bytes).sum()
    }

    /// Computes experts on `accelerator` where it can (the same bits; the rest on this CPU).
    pub fn with_accelerator(mut self, accelerator: std::sync::Arc<dyn Accelerator>) -> Self {
        self.accelerator = Some(accelerator);
        self
    }
}

impl ExpertDispatch for InProcessExperts {
    fn dispatch(&self, batch: &MoeBatch<'_>, acc: &mut [i64]) -> Result<(), DispatchError> {
        self.dispatch_owned(batch, acc, &|_, _| true)
    }
}

impl InProcessExperts {
    /// Adds only the contributions of the experts `owns(layer, expert)` accepts — what one node
    /// holding a slice of the experts contributes. Partial sums from any partition of the experts,
    /// merged in any order, equal `dispatch` bit for bit (fixed-point accumulation).
    pub fn dispatch_owned(&self, batch: &MoeBatch<'_>, acc: &mut [i64], owns: &dyn Fn(usize, u32) -> bool) -> Result<(), DispatchError> {
        let layer = batch.layer;
        let experts = self.layers.get(layer).and_then(Option::as_ref).ok_or(DispatchError::NotMoeLayer { layer })?;
        let users = expert_users(batch, experts.len())?;
        let work: Vec<Work<'_>> =
            users.iter().enumerate().filter(|(e, u)| !u.is_empty() && owns(layer, *e as u32)).map(|(e, u)| (e as u32, &experts[e], u.as_slice())).collect();
        apply_experts(batch, &work, self.accelerator.as_deref(), acc)?;
        Ok(())
    }
}

/// A selection another node computes (a cluster worker's share of a batch): skipped here. Its
/// contribution arrives as another node's fixed-point partial sum, which adds to the same bits.
pub const ELSEWHERE: u32 = u32::MAX;

/// The union of a batch's selected experts: for each expert, the (row, weight) pairs that chose
/// it. (Every dispatcher that computes experts — this one, the store — goes through this and
/// `apply_experts`, so a fix reaches them all.)
pub fn expert_users(batch: &MoeBatch<'_>, num_experts: usize) -> Result<Vec<Vec<(usize, f32)>>, DispatchError> {
    let layer = batch.layer;
    let mut users: Vec<Vec<(usize, f32)>> = vec![Vec::new(); num_experts];
    for (slot, (&e, &w)) in batch.experts.iter().zip(batch.weights).enumerate() {
        if e == ELSEWHERE {
            continue;
        }
        let list = users.get_mut(e as usize).ok_or(DispatchError::NoSuchExpert { layer, expert: e, count: num_experts })?;
        list.push((slot / batch.top_k, w));
    }
    Ok(users)
}

/// Below this many multiply-adds a batch's experts run on the calling thread (~50 µs of work at
/// this machine's single-thread rate, about what waking the pool costs).
const SERIAL_MACS: usize = 1 << 20;

/// With a forward step's team awake (`shimmer_kernels::team`), experts are spread over it from
/// this much work (its threads take an expert in well under a microsecond).
const TEAM_MIN_MACS: usize = 1 << 16;

/// One expert's share of a batch: its id, its weights, the (row, weight) pairs that chose it.
pub type Work<'a> = (u32, &'a Expert, &'a [(usize, f32)]);

/// The rows that chose an expert, gathered into one `n × hidden` block.
pub fn gather_rows(batch: &MoeBatch<'_>, rows: &[(usize, f32)]) -> Vec<f32> {
    let h = batch.hidden;
    let mut xs = Vec::with_capacity(rows.len() * h);
    for &(row, _) in rows {
        xs.extend_from_slice(&batch.rows[row * h..(row + 1) * h]);
    }
    xs
}

/// Adds an expert's outputs (`ys`, one row per entry of `rows`) into `acc`, weighted, in fixed point.
pub fn add_weighted(batch: &MoeBatch<'_>, rows: &[(usize, f32)], ys: &[f32], acc: &mut [i64]) -> Result<(), DispatchError> {
    let (h, layer) = (batch.hidden, batch.layer);
    for (&(row, w), y) in rows.iter().zip(ys.chunks_exact(h)) {
        fixed::accumulate_weighted(&mut acc[row * h..(row + 1) * h], y, w).map_err(|overflow| DispatchError::Overflow { layer, overflow })?;
    }
    Ok(())
}

/// Applies each expert to the rows that chose it and adds the weighted outputs into `acc` —
/// on `accelerator` where it computes them, on this CPU otherwise. Their outputs are added
/// afterwards as fixed-point integers, so the order — and which thread, device, dispatcher or
/// node computed which expert — cannot change a bit.
pub fn apply_experts(batch: &MoeBatch<'_>, work: &[Work<'_>], accelerator: Option<&dyn Accelerator>, acc: &mut [i64]) -> Result<(), DispatchError> {
    let Some(accelerator) = accelerator.filter(|_| !work.is_empty()) else {
        return apply_on_cpu(batch, work, acc);
    };
    let gathered: Vec<Vec<f32>> = work.iter().map(|(_, _, rows)| gather_rows(batch, rows)).collect();
    let jobs: Vec<AccelJob<'_>> = work.iter().zip(&gathered).map(|((id, e, _), xs)| AccelJob { expert: *id, weights: Some(*e), rows: xs }).collect();
    let outputs = accelerator.forward(batch.layer, &jobs);
    let mut cpu = Vec::new();
    for (i, w) in work.iter().enumerate() {
        match outputs.get(i).and_then(Option::as_ref) {
            Some(ys) if ys.len() == w.2.len() * batch.hidden => add_weighted(batch, w.2, ys, acc)?,
            _ => cpu.push(*w),
        }
    }
    if cpu.is_empty() {
        return Ok(());
    }
    let started = std::time::Instant::now();
    apply_on_cpu(batch, &cpu, acc)?;
    let byte_rows: usize = cpu.iter().map(|(_, e, rows)| e.bytes() * rows.len()).sum();
    accelerator.cpu_took(byte_rows as u64, started.elapsed());
    Ok(())
}

/// Adds every expert's outputs into `acc` over a team, each task one block of rows and within a
/// row the experts in `work`'s order (integer sums: any order gives the same bits). A prompt's
/// step has tens of rows; adding them on one thread was a serial stretch of every MoE layer.
/// An expert's rows must be in ascending order (as `expert_users` lists them); a `work` whose
/// are not is added on this thread.
fn add_by_row_blocks(
    team: &shimmer_kernels::team::Team,
    batch: &MoeBatch<'_>,
    work: &[Work<'_>],
    outputs: &[Vec<f32>],
    acc: &mut [i64],
) -> Result<(), DispatchError> {
    let h = batch.hidden;
    let n = acc.len() / h.max(1);
    let ascending = work.iter().all(|(_, _, rows)| rows.windows(2).all(|p| p[0].0 <= p[1].0));
    if n < 2 || !ascending {
        for ((_, _, rows), ys) in work.iter().zip(outputs) {
            add_weighted(batch, rows, ys, acc)?;
        }
        return Ok(());
    }
    // A few blocks a thread, so that one slow thread does not hold up the rest.
    let block = n.div_ceil(4 * team.threads()).max(1);
    let first_error: std::sync::Mutex<Option<(usize, DispatchError)>> = std::sync::Mutex::new(None);
    shimmer_kernels::team::for_each_chunk_mut(team, acc, block * h, |c, piece| {
        let (first, end) = (c * block, c * block + piece.len() / h);
        for ((_, _, rows), ys) in work.iter().zip(outputs) {
            let (lo, hi) = (rows.partition_point(|r| r.0 < first), rows.partition_point(|r| r.0 < end));
            for (j, &(row, w)) in rows[lo..hi].iter().enumerate() {
                let y = &ys[(lo + j) * h..(lo + j + 1) * h];
                if let Err(overflow) = fixed::accumulate_weighted(&mut piece[(row - first) * h..(row - first + 1) * h], y, w) {
                    let mut slot = first_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    // The lowest block's error, whichever thread found it first.
                    if slot.as_ref().is_none_or(|(at, _)| c < *at) {
                        *slot = Some((c, DispatchError::Overflow { layer: batch.layer, overflow }));
                    }
                    return;
                }
            }
        }
    });
    match first_error.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// The order a team takes a batch's experts in: most rows first (ties in `work`'s order), so
/// that the last tasks claimed are the shortest and a thread that finishes early waits on a small
/// one, not on an expert with many rows (longest-processing-time-first scheduling). Only the
/// order of the work changes: each output goes to its expert's place, and the sum is fixed-point.
fn largest_first(work: &[Work<'_>]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..work.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(work[i].2.len()));
    order
}

/// `apply_experts` on this CPU.
fn apply_on_cpu(batch: &MoeBatch<'_>, work: &[Work<'_>], acc: &mut [i64]) -> Result<(), DispatchError> {
    let h = batch.hidden;
    // Small work (a decode step of a small model) runs on this thread: waking the pool's threads
    // costs more than it saves. Otherwise experts are spread over the threads, each running its
    // rows as one batched product (weights read once per group of rows), or, a lone expert, its
    // product's rows over the threads. Every way computes each row alike: the same bits.
    let macs: usize = work.iter().map(|(_, e, rows)| 3 * h * e.intermediate() * rows.len()).sum();
    let parallel_inside = work.len() == 1 && macs >= SERIAL_MACS;
    // One expert over the rows that chose it: its outputs, row after row.
    let one = |scratch: &mut FfnScratch, (_, expert, rows): &Work<'_>| -> Vec<f32> {
        let xs = gather_rows(batch, rows);
        let mut ys = vec![0.0f32; rows.len() * h];
        expert.forward_rows(&xs, scratch, &mut ys, parallel_inside);
        ys
    };
    let add = |acc: &mut [i64], rows: &[(usize, f32)], ys: &[f32]| add_weighted(batch, rows, ys, acc);
    // Here: over the step's team if one is active, else on this thread or the pool.
    let run_here = |acc: &mut [i64]| -> Result<(), DispatchError> {
        if let Some(team) = shimmer_kernels::team::active().filter(|_| work.len() > 1 && macs >= TEAM_MIN_MACS) {
            // A forward step's team is awake: its threads take an expert each.
            let outputs: Vec<std::sync::OnceLock<Vec<f32>>> = work.iter().map(|_| std::sync::OnceLock::new()).collect();
            let order = largest_first(work);
            team.run(work.len(), &|i| {
                let i = order[i];
                let _ = outputs[i].set(one(&mut FfnScratch::default(), &work[i]));
            });
            // `run` returns only after every task finished (and raises a task's panic).
            let outputs: Vec<Vec<f32>> = outputs.into_iter().map(|ys| ys.into_inner().expect("every expert's output is set")).collect();
            add_by_row_blocks(team, batch, work, &outputs, acc)?;
        } else if macs < SERIAL_MACS {
            // The sum is fixed-point, so adding each expert as it is done gives the same bits.
            let mut scratch = FfnScratch::default();
            for w in work {
                let ys = one(&mut scratch, w);
                add(acc, w.2, &ys)?;
            }
        } else {
            let outputs: Vec<Vec<f32>> = work.par_iter().map_init(FfnScratch::default, |scratch, w| one(scratch, w)).collect();
            for (w, ys) in work.iter().zip(&outputs) {
                add(acc, w.2, ys)?;
            }
        }
        Ok(())
    };
    if shimmer_kernels::team::active().is_none() && work.len() > 1 && (TEAM_MIN_MACS..SERIAL_MACS).contains(&macs) && shimmer_kernels::team::pool_threads() > 1
    {
        // A one-row step of a small model runs without a team (its products are too small to
        // split), but its experts are worth spreading: a team of their own takes them an expert
        // a thread (its helper waits awake between teams, so forming one makes no system call).
        // The demo's decode step: 0.80–0.93 of the time it took on this thread alone
        // (`docs/benchmarks.md`, "Experts over a team of their own"). Where another thread's
        // team holds the helpers, `with_pool_team` runs this without one: on this thread.
        return shimmer_kernels::team::with_pool_team(|| run_here(acc));
    }
    run_here(acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shimmer_kernels::matrix::WeightData;

    /// One team at a time: a `with_team` while another test's is active runs without one.
    fn team_turn() -> std::sync::MutexGuard<'static, ()> {
        static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
        TURN.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `f` in a pool of one thread: no team forms, every expert runs on this thread.
    fn one_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a one-thread pool").install(f)
    }

    /// One row choosing each of `n` random f32 experts (hidden 64, intermediate 96), the e-th
    /// weighted `w0 + e·dw`.
    struct OneRow {
        experts: Vec<Expert>,
        x: Vec<f32>,
        rows: Vec<[(usize, f32); 1]>,
        ids: Vec<u32>,
        weights: Vec<f32>,
    }

    impl OneRow {
        const HIDDEN: usize = 64;
        const INTER: usize = 96;

        fn new(seed: u64, n: usize, (w0, dw): (f32, f32)) -> Self {
            let (h, inter) = (Self::HIDDEN, Self::INTER);
            let mut s = seed;
            let mut next = || {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            };
            let mut m = |rows: usize, cols: usize| Matrix::new(rows, cols, WeightData::F32((0..rows * cols).map(|_| next()).collect()));
            let experts = (0..n).map(|_| Expert::new(m(inter, h), m(inter, h), m(h, inter))).collect();
            let x = (0..h).map(|i| (i as f32 * 0.37 + seed as f32).sin()).collect();
            let rows: Vec<[(usize, f32); 1]> = (0..n).map(|e| [(0usize, w0 + e as f32 * dw)]).collect();
            let weights = rows.iter().map(|r| r[0].1).collect();
            OneRow { experts, x, rows, ids: (0..n as u32).collect(), weights }
        }

        fn work(&self) -> Vec<Work<'_>> {
            self.experts.iter().zip(&self.rows).enumerate().map(|(i, (e, r))| (i as u32, e, &r[..])).collect()
        }

        fn batch(&self) -> MoeBatch<'_> {
            MoeBatch { layer: 0, hidden: Self::HIDDEN, rows: &self.x, top_k: self.ids.len(), experts: &self.ids, weights: &self.weights }
        }

        fn macs(&self) -> usize {
            3 * Self::HIDDEN * Self::INTER * self.ids.len()
        }
    }

    /// A one-row step without a team (a small model's decode), in a pool of two: its experts go
    /// over a team of their own, with the bits they give on one thread.
    #[test]
    fn a_one_row_steps_experts_over_a_team_of_their_own_are_the_same_bits() {
        let _turn = team_turn();
        let case = OneRow::new(11, 4, (0.1, 0.2));
        let (batch, work) = (case.batch(), case.work());
        assert!((TEAM_MIN_MACS..SERIAL_MACS).contains(&case.macs()), "a team of their own forms");
        let mut alone = vec![0i64; OneRow::HIDDEN];
        one_thread(|| apply_experts(&batch, &work, None, &mut alone)).unwrap();
        let mut two = vec![0i64; OneRow::HIDDEN];
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap()
            .install(|| {
                assert!(shimmer_kernels::team::active().is_none() && shimmer_kernels::team::pool_threads() == 2);
                apply_experts(&batch, &work, None, &mut two)
            })
            .unwrap();
        assert_eq!(two, alone);
    }

    /// Experts spread over a forward step's team add up to the bits they give on one thread.
    #[test]
    fn experts_over_a_team_are_the_same_bits() {
        let _turn = team_turn();
        let case = OneRow::new(5, 8, (0.05, 0.1));
        let (batch, work, h) = (case.batch(), case.work(), OneRow::HIDDEN);
        assert!(case.macs() >= TEAM_MIN_MACS, "the team path is taken");
        let mut alone = vec![0i64; h];
        one_thread(|| apply_experts(&batch, &work, None, &mut alone)).unwrap();
        let teamed = shimmer_kernels::team::with_team(2, || {
            assert!(shimmer_kernels::team::active().is_some());
            let mut acc = vec![0i64; h];
            apply_experts(&batch, &work, None, &mut acc).unwrap();
            acc
        });
        assert_eq!(teamed, alone);
    }

    /// A prompt's rows: the experts' outputs are added over the team a block of rows at a time,
    /// to the bits of one thread adding them expert after expert; an overflow is reported either
    /// way.
    #[test]
    fn many_rows_added_over_a_team_are_the_same_bits() {
        let _turn = team_turn();
        let (h, inter, n_experts, n_rows, top_k) = (32usize, 48usize, 6usize, 37usize, 3usize);
        let mut s = 17u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        };
        let mut m = |rows: usize, cols: usize| Matrix::new(rows, cols, WeightData::F32((0..rows * cols).map(|_| next()).collect()));
        let experts: Vec<Expert> = (0..n_experts).map(|_| Expert::new(m(inter, h), m(inter, h), m(h, inter))).collect();
        let x: Vec<f32> = (0..n_rows * h).map(|i| (i as f32 * 0.29).sin()).collect();
        let ids: Vec<u32> = (0..n_rows * top_k).map(|i| ((i / top_k * 5 + (i % top_k) * 2) % n_experts) as u32).collect();
        let run = |weights: &[f32]| {
            let batch = MoeBatch { layer: 2, hidden: h, rows: &x, top_k, experts: &ids, weights };
            let users = expert_users(&batch, n_experts).unwrap();
            let work: Vec<Work<'_>> = users.iter().enumerate().filter(|(_, u)| !u.is_empty()).map(|(e, u)| (e as u32, &experts[e], u.as_slice())).collect();
            assert!(work.len() > 1 && 3 * h * inter * n_rows * top_k >= TEAM_MIN_MACS, "the team path is taken");
            assert_ne!(largest_first(&work), (0..work.len()).collect::<Vec<_>>(), "the team takes the experts out of their order");
            let mut alone = vec![0i64; n_rows * h];
            let alone_result = one_thread(|| apply_experts(&batch, &work, None, &mut alone)).map(|_| alone);
            let teamed = shimmer_kernels::team::with_team(2, || {
                assert!(shimmer_kernels::team::active().is_some());
                let mut acc = vec![0i64; n_rows * h];
                apply_experts(&batch, &work, None, &mut acc).map(|_| acc)
            });
            (alone_result, teamed)
        };
        let weights: Vec<f32> = (0..n_rows * top_k).map(|i| 0.1 + (i % 7) as f32 * 0.05).collect();
        let (alone, teamed) = run(&weights);
        let alone = alone.unwrap();
        assert!(alone.iter().any(|v| *v != 0));
        assert_eq!(teamed.unwrap(), alone);
        // One weight so large that its row's sum leaves the fixed-point range.
        let mut huge = weights.clone();
        huge[30 * top_k + 1] = 1e12;
        let (alone, teamed) = run(&huge);
        for result in [alone, teamed] {
            match result {
                Err(DispatchError::Overflow { layer: 2, .. }) => {}
                other => panic!("expected an overflow in layer 2, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_team_takes_the_experts_with_most_rows_first() {
        let e = Expert::new(
            Matrix::new(1, 1, WeightData::F32(vec![1.0].into())),
            Matrix::new(1, 1, WeightData::F32(vec![1.0].into())),
            Matrix::new(1, 1, WeightData::F32(vec![1.0].into())),
        );
        let rows: Vec<Vec<(usize, f32)>> = [1usize, 3, 2, 3, 1].iter().map(|&n| (0..n).map(|r| (r, 1.0)).collect()).collect();
        let work: Vec<Work<'_>> = rows.iter().enumerate().map(|(i, r)| (i as u32, &e, r.as_slice())).collect();
        assert_eq!(largest_first(&work), vec![1, 3, 2, 0, 4]);
        assert!(largest_first(&[]).is_empty());
    }

    /// Computes the even-numbered experts (on this CPU, as a device with the CPU's bits would)
    /// and declines the odd ones.
    struct EvenExperts {
        asked: std::sync::Mutex<Vec<u32>>,
    }

    impl Accelerator for EvenExperts {
        fn holds(&self, _: usize, expert: u32) -> bool {
            expert.is_multiple_of(2)
        }
        fn forward(&self, _layer: usize, jobs: &[AccelJob<'_>]) -> Vec<Option<Vec<f32>>> {
            self.asked.lock().unwrap().extend(jobs.iter().map(|j| j.expert));
            jobs.iter()
                .map(|j| {
                    let e = j.weights.filter(|_| j.expert.is_multiple_of(2))?;
                    let mut ys = vec![0.0f32; j.rows.len()];
                    e.forward_rows(j.rows, &mut FfnScratch::default(), &mut ys, false);
                    Some(ys)
                })
                .collect()
        }
    }

    /// Experts an accelerator computes and those it leaves to the CPU add up to the bits of
    /// computing all on the CPU; every expert is offered to it once.
    #[test]
    fn an_accelerator_computing_some_experts_gives_the_same_bits() {
        let (h, inter, n_experts, n_rows, top_k) = (48usize, 40usize, 6usize, 5usize, 3usize);
        let mut s = 11u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        };
        let mut m = |rows: usize, cols: usize| Matrix::new(rows, cols, WeightData::F32((0..rows * cols).map(|_| next()).collect()));
        let experts: Vec<Expert> = (0..n_experts).map(|_| Expert::new(m(inter, h), m(inter, h), m(h, inter))).collect();
        let x: Vec<f32> = (0..n_rows * h).map(|i| (i as f32 * 0.13).cos()).collect();
        let ids: Vec<u32> = (0..n_rows * top_k).map(|i| ((i * 7 + i / top_k) % n_experts) as u32).collect();
        let weights: Vec<f32> = (0..n_rows * top_k).map(|i| 0.1 + (i % 5) as f32 * 0.07).collect();
        let batch = MoeBatch { layer: 3, hidden: h, rows: &x, top_k, experts: &ids, weights: &weights };
        let users = expert_users(&batch, n_experts).unwrap();
        let work: Vec<Work<'_>> = users.iter().enumerate().filter(|(_, u)| !u.is_empty()).map(|(e, u)| (e as u32, &experts[e], u.as_slice())).collect();
        let mut on_cpu = vec![0i64; n_rows * h];
        apply_experts(&batch, &work, None, &mut on_cpu).unwrap();
        let accel = EvenExperts { asked: Default::default() };
        let mut mixed = vec![0i64; n_rows * h];
        apply_experts(&batch, &work, Some(&accel), &mut mixed).unwrap();
        assert_eq!(mixed, on_cpu);
        let mut asked = accel.asked.into_inner().unwrap();
        asked.sort_unstable();
        assert_eq!(asked, work.iter().map(|w| w.0).collect::<Vec<_>>());
        assert!(asked.iter().any(|e| e.is_multiple_of(2)) && asked.iter().any(|e| !e.is_multiple_of(2)), "both kinds occur");
    }
}
