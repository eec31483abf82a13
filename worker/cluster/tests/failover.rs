//! The dispatch and failover state machine driven by simulated workers and a fake clock
//! (raft-rs's simulated network, quinn-proto's `Pair`): hundreds of seeded schedules in which
//! workers die, answer late, answer garbage or under another model or epoch, answer `Moved`
//! after a re-plan, or come back. No sockets, no threads, no real sleeps.
//!
//! Every layer of every schedule checks DESIGN.md §1's cluster rule: the merged sums are the
//! single box's bit for bit (so no selection was served twice or skipped, and no answer from
//! another model or epoch was added — every bad answer carries wrong sums that would show), or the
//! layer fails naming an expert whose every possible server is dead, stale or misbehaved.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use shimmer_cluster::placement::{LayerPlacement, Placement, Worker, FORMAT, VERSION};
use shimmer_cluster::wire::ErrorCode;
use shimmer_cluster::{Action, Answer, Assignment, Cluster, Exchange, Step, WorkerStatus};

const MODEL: u64 = 0x5eed_0000_0000_0001;
const TIMEOUT: Duration = Duration::from_millis(500);
const CONNECT: Duration = Duration::from_millis(300);
const HIDDEN: usize = 4;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // SplitMix64.
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What one selection adds to its row: distinct, non-zero, and a function of the selection only
/// (as an expert's output is of its row and weight), never of who computes it.
fn contribution(seed: u64, layer: usize, slot: usize, j: usize) -> i64 {
    let mut r = Rng(seed ^ ((layer as u64) << 40) ^ ((slot as u64) << 16) ^ j as u64);
    (r.next() % (1 << 40)) as i64 - (1 << 39) + 1
}

/// How a worker answers one request.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Misbehaviour {
    None,
    Late,
    Garbage,
    OtherModel,
    OtherEpoch,
    WrongSize,
    WrongId,
    Refuse,
}

struct SimWorker {
    alive: bool,
    /// When a dead worker comes back (a dial after this succeeds).
    back_at: Option<Instant>,
    /// The placement epoch it serves.
    epoch: u64,
    loads_unassigned: bool,
    /// Percent of requests it misbehaves on, and how.
    flaky: u64,
}

struct Sim {
    seed: u64,
    rng: Rng,
    now: Instant,
    cluster: Cluster,
    workers: BTreeMap<String, SimWorker>,
    /// The placement a reload would find (after a re-plan), if any.
    newer: Option<Placement>,
    layers: Vec<usize>,
    experts: usize,
    top_k: usize,
    /// Checks that ran, by outcome.
    served: usize,
    failed: usize,
    reloads: usize,
    redials: usize,
    /// The experts of the layer being served (what `respond` checks a slice against).
    batch_experts: Vec<u32>,
}

fn placement(names: &[String], layers: &[usize], experts: usize, replicas: usize, epoch: u64, shift: usize) -> Placement {
    Placement {
        format: FORMAT.into(),
        version: VERSION,
        model: "sim".into(),
        epoch,
        workers: names.iter().enumerate().map(|(i, n)| Worker { name: n.clone(), addr: format!("127.0.0.{}:7070", i + 2), ram_bytes: 1 << 30 }).collect(),
        layers: layers
            .iter()
            .map(|&layer| LayerPlacement {
                layer,
                replicas: (0..experts).map(|e| (0..replicas).map(|r| names[(e + layer + r + shift) % names.len()].clone()).collect()).collect(),
            })
            .collect(),
    }
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut rng = Rng(seed);
        let n = 2 + rng.below(4) as usize;
        let names: Vec<String> = (0..n).map(|i| format!("w{i}")).collect();
        let layers: Vec<usize> = (1..=1 + rng.below(3) as usize).collect();
        let experts = 4 + rng.below(8) as usize;
        let replicas = 1 + rng.below(n.min(3) as u64) as usize;
        let p = placement(&names, &layers, experts, replicas, 1, 0);
        let with_local = rng.chance(20);
        let local = with_local.then(|| names[rng.below(n as u64) as usize].clone());
        let mut cluster = Cluster::new(p, MODEL, local.clone()).unwrap();
        cluster.can_reload = true;
        let now = Instant::now();
        let mut workers = BTreeMap::new();
        for name in &names {
            let w = SimWorker {
                alive: Some(name) == local.as_ref() || !rng.chance(15),
                back_at: None,
                epoch: 1,
                loads_unassigned: Some(name) == local.as_ref() || rng.chance(60),
                flaky: if rng.chance(40) { 5 + rng.below(30) } else { 0 },
            };
            workers.insert(name.clone(), w);
        }
        let top_k = 1 + rng.below(3.min(experts as u64)) as usize;
        let mut sim = Sim {
            seed,
            rng,
            now,
            cluster,
            workers,
            newer: None,
            layers,
            experts,
            top_k,
            served: 0,
            failed: 0,
            reloads: 0,
            redials: 0,
            batch_experts: Vec::new(),
        };
        // The driver's first dials.
        for (name, _) in sim.cluster.unconnected() {
            let result = sim.dial(&name);
            sim.cluster.dial_result(&name, result, sim.now);
        }
        sim
    }

    fn status(&self, name: &str) -> WorkerStatus {
        let w = &self.workers[name];
        WorkerStatus { name: name.into(), epoch: w.epoch, loads_unassigned: w.loads_unassigned, ..WorkerStatus::default() }
    }

    fn dial(&mut self, name: &str) -> Result<Option<WorkerStatus>, ()> {
        let now = self.now;
        let w = self.workers.get_mut(name).unwrap();
        if !w.alive && w.back_at.is_some_and(|t| now >= t) {
            w.alive = true;
            w.back_at = None;
        }
        if w.alive {
            Ok(Some(self.status(name)))
        } else {
            Err(())
        }
    }

    /// Background actions run at once (their results land before the next step).
    fn run_actions(&mut self) {
        while let Some(action) = self.cluster.poll_action() {
            match action {
                Action::Dial { worker, .. } => {
                    self.redials += 1;
                    let r = self.dial(&worker);
                    self.cluster.dial_result(&worker, r, self.now);
                }
                Action::Close { .. } => {}
            }
        }
    }

    /// Between layers: workers die and come back, a re-plan moves some workers to epoch 2.
    fn weather(&mut self) {
        let names: Vec<String> = self.workers.keys().cloned().collect();
        let local = self.cluster.local().map(str::to_string);
        for name in &names {
            if Some(name) == local.as_ref() {
                continue;
            }
            let roll = self.rng.below(100);
            let now = self.now;
            let w = self.workers.get_mut(name).unwrap();
            if w.alive && roll < 8 {
                w.alive = false;
                w.back_at = (roll < 5).then(|| now + Duration::from_millis(200 + roll * 700));
            }
        }
        if self.newer.is_none() && self.rng.chance(4) {
            let names: Vec<String> = self.cluster.placement().workers.iter().map(|w| w.name.clone()).collect();
            let replicas = self.cluster.placement().layers[0].replicas[0].len();
            let p = placement(&names, &self.layers, self.experts, replicas, 2, 1);
            // Some workers restart on the new plan now, the others later.
            for name in &names {
                if Some(name) != local.as_ref() && self.rng.chance(60) {
                    self.workers.get_mut(name).unwrap().epoch = 2;
                }
            }
            self.newer = Some(p);
        }
        self.now += Duration::from_millis(self.rng.below(400));
    }

    /// What the assigned worker answers to the request `a` for `layer`; `bad` records workers
    /// that failed this layer.
    fn respond(&mut self, a: &Assignment, layer: usize, rows: usize, bad: &mut BTreeSet<String>) -> (Answer<'static>, Duration) {
        let (name, request_id, epoch, slots) = (a.worker.as_str(), a.request_id, a.epoch, &a.slots[..]);
        let local = self.cluster.local() == Some(name);
        let holders_of = |p: &Placement, e: u32| p.holders(layer, e as usize).map(<[String]>::to_vec).unwrap_or_default();
        let experts = self.batch_experts.clone();
        let (alive, w_epoch, loads, flaky) = {
            let w = &self.workers[name];
            (w.alive, w.epoch, w.loads_unassigned, w.flaky)
        };
        if !alive {
            bad.insert(name.into());
            return (Answer::Lost("connection lost".into()), Duration::from_millis(1));
        }
        if !local && epoch != w_epoch {
            bad.insert(name.into());
            return (Answer::Refused { code: Some(ErrorCode::Moved), message: format!("epoch {epoch} is not {w_epoch}") }, Duration::from_millis(2));
        }
        if !loads && slots.iter().any(|&s| !holders_of(self.cluster.placement(), experts[s]).iter().any(|h| h == name)) {
            bad.insert(name.into());
            return (Answer::Refused { code: Some(ErrorCode::Unavailable), message: "serves only its slice".into() }, Duration::from_millis(2));
        }
        let how = if !local && self.rng.chance(flaky) {
            [
                Misbehaviour::Late,
                Misbehaviour::Garbage,
                Misbehaviour::OtherModel,
                Misbehaviour::OtherEpoch,
                Misbehaviour::WrongSize,
                Misbehaviour::WrongId,
                Misbehaviour::Refuse,
            ][self.rng.below(7) as usize]
        } else {
            Misbehaviour::None
        };
        let mut sums = vec![0i64; rows * HIDDEN];
        for &s in slots {
            let row = s / self.top_k;
            for j in 0..HIDDEN {
                sums[row * HIDDEN + j] += contribution(self.seed, layer, s, j);
            }
        }
        let (mut id, mut model, mut ep) = (request_id, MODEL, epoch);
        match how {
            Misbehaviour::None => {}
            Misbehaviour::Late => {
                bad.insert(name.into());
                return (Answer::Lost(format!("no answer within {TIMEOUT:?}")), TIMEOUT);
            }
            Misbehaviour::Refuse => {
                bad.insert(name.into());
                return (Answer::Refused { code: Some(ErrorCode::Internal), message: "disk on fire".into() }, Duration::from_millis(2));
            }
            Misbehaviour::Garbage => {
                bad.insert(name.into());
                return (Answer::Lost("answered with garbage".into()), Duration::from_millis(2));
            }
            other => {
                bad.insert(name.into());
                // Wrong sums too: if they were ever added, the total would show it.
                sums.iter_mut().for_each(|v| *v += 1);
                match other {
                    Misbehaviour::OtherModel => model ^= 1,
                    Misbehaviour::OtherEpoch => ep += 1,
                    Misbehaviour::WrongSize => {
                        sums.pop();
                    }
                    _ => id += 1_000_000,
                }
            }
        }
        let sums: &'static [i64] = Box::leak(sums.into_boxed_slice());
        (Answer::Sums { request_id: id, model, epoch: ep, layer: layer as u32, sums }, Duration::from_millis(1 + self.rng.below(5)))
    }
}

impl Sim {
    fn run_layer(&mut self, layer: usize, rows: usize) {
        let slots = rows * self.top_k;
        let experts: Vec<u32> = (0..slots).map(|_| self.rng.below(self.experts as u64) as u32).collect();
        self.batch_experts = experts.clone();
        let want: Vec<i64> =
            (0..rows * HIDDEN).map(|i| (0..self.top_k).map(|k| contribution(self.seed, layer, (i / HIDDEN) * self.top_k + k, i % HIDDEN)).sum()).collect();
        let mut d = self.cluster.begin(layer, &experts, rows, rows * HIDDEN);
        let mut bad = BTreeSet::new();
        let mut steps = 0;
        loop {
            steps += 1;
            assert!(steps < 1000, "seed {}: the layer never ended", self.seed);
            let step = d.next(&mut self.cluster, self.now);
            if std::env::var("SIM_DEBUG").ok() == Some(self.seed.to_string()) {
                eprintln!(
                    "{:?} {step:?} links {:?}",
                    self.now,
                    self.workers.iter().map(|(n, w)| (n.clone(), w.alive, w.epoch, self.cluster.link(n).map(|l| (l.is_up(), l.health)))).collect::<Vec<_>>()
                );
            }
            self.run_actions();
            match step {
                Step::Send(assignments) => {
                    let mut longest = Duration::ZERO;
                    // Every slot at most once per round.
                    let mut seen = BTreeSet::new();
                    for a in &assignments {
                        for s in &a.slots {
                            assert!(seen.insert(*s), "seed {}: slot {s} sent twice in one round", self.seed);
                        }
                    }
                    for a in assignments {
                        let (answer, took) = self.respond(&a, layer, rows, &mut bad);
                        longest = longest.max(took);
                        d.answer(&mut self.cluster, a.request_id, answer, Exchange { sent: 100, received: 100, took }).unwrap();
                    }
                    self.now += longest;
                }
                Step::RedialNow(targets) => {
                    for (name, _) in targets {
                        let r = self.dial(&name);
                        self.cluster.dial_result(&name, r, self.now);
                    }
                    self.now += CONNECT;
                }
                Step::Reload => {
                    self.reloads += 1;
                    let adopted = match self.newer.clone() {
                        Some(p) if p.epoch > self.cluster.placement().epoch => {
                            let fresh = self.cluster.set_placement(p).unwrap();
                            assert!(fresh.is_empty(), "the sim's re-plans keep the workers");
                            true
                        }
                        _ => false,
                    };
                    d.reloaded(adopted);
                }
                Step::Done => {
                    assert_eq!(d.sums(), &want[..], "seed {}: layer {layer}: the merged sums are not the single box's", self.seed);
                    self.served += 1;
                    return;
                }
                Step::Failed(message) => {
                    // It names a selected expert of this layer …
                    let named = experts.iter().find(|e| message.contains(&format!("layer {layer} expert {e}:")));
                    let Some(&e) = named else { panic!("seed {}: a failure that names no selected expert: {message}", self.seed) };
                    // … whose every possible server is dead, on another epoch, or misbehaved.
                    let p = self.cluster.placement();
                    let holders = p.holders(layer, e as usize).unwrap().to_vec();
                    let volunteers = self.cluster.volunteers(&holders);
                    for w in holders.iter().chain(&volunteers) {
                        let sw = &self.workers[w];
                        let could = sw.alive && (sw.epoch == p.epoch || self.cluster.local() == Some(w.as_str())) && !bad.contains(w);
                        assert!(!could, "seed {}: layer {layer} expert {e} failed although {w} could serve it: {message}", self.seed);
                    }
                    self.failed += 1;
                    return;
                }
            }
        }
    }
}

#[test]
fn seeded_schedules_of_dying_late_stale_and_returning_workers_give_the_single_box_sums_or_name_the_expert() {
    let (mut served, mut failed, mut reloads, mut redials) = (0, 0, 0, 0);
    for seed in 0..400u64 {
        let mut sim = Sim::new(seed);
        for _token in 0..12 {
            for layer in sim.layers.clone() {
                let rows = 1 + sim.rng.below(4) as usize;
                sim.run_layer(layer, rows);
            }
            sim.weather();
        }
        served += sim.served;
        failed += sim.failed;
        reloads += sim.reloads;
        redials += sim.redials;
    }
    // The schedules reach every path: served layers, failed ones, re-plans and redials.
    assert!(served > 5000 && failed > 50 && reloads > 20 && redials > 100, "served {served}, failed {failed}, reloads {reloads}, redials {redials}");
}

#[test]
fn with_every_worker_up_each_selection_goes_to_its_first_holder_in_one_round() {
    let names: Vec<String> = (0..3).map(|i| format!("w{i}")).collect();
    let p = placement(&names, &[1], 6, 2, 1, 0);
    let mut c = Cluster::new(p.clone(), MODEL, None).unwrap();
    let now = Instant::now();
    for n in &names {
        c.dial_result(n, Ok(None), now);
    }
    let experts = [0u32, 3, 5, 1];
    let mut d = c.begin(1, &experts, 2, 2 * HIDDEN);
    let Step::Send(assignments) = d.next(&mut c, now) else { panic!("expected a send") };
    for a in &assignments {
        for &s in &a.slots {
            assert_eq!(p.holders(1, experts[s] as usize).unwrap()[0], a.worker, "slot {s}");
        }
        let sums = vec![1i64; 2 * HIDDEN];
        d.answer(&mut c, a.request_id, Answer::Sums { request_id: a.request_id, model: MODEL, epoch: 1, layer: 1, sums: &sums }, Exchange::default()).unwrap();
    }
    assert_eq!(d.next(&mut c, now), Step::Done);
    assert_eq!(d.sums(), &vec![assignments.len() as i64; 2 * HIDDEN][..]);
    assert_eq!(c.telemetry(&|_| None).failovers, 0);
}

#[test]
fn a_down_worker_waits_out_its_backoff_then_is_redialled_in_the_background() {
    let names: Vec<String> = (0..2).map(|i| format!("w{i}")).collect();
    let p = placement(&names, &[1], 2, 2, 1, 0);
    let mut c = Cluster::new(p, MODEL, None).unwrap();
    let t0 = Instant::now();
    c.dial_result("w0", Ok(None), t0);
    c.dial_result("w1", Ok(None), t0);
    c.mark_down("w0", t0);
    assert_eq!(c.poll_action(), Some(Action::Close { worker: "w0".into() }));
    assert!(!c.usable("w0", t0 + Duration::from_millis(999)));
    assert_eq!(c.poll_action(), None, "no redial before the backoff has passed");
    assert!(!c.usable("w0", t0 + Duration::from_secs(1)), "redialled, not yet usable");
    assert_eq!(c.poll_action(), Some(Action::Dial { worker: "w0".into(), addr: "127.0.0.2:7070".into() }));
    assert!(!c.usable("w0", t0 + Duration::from_secs(1)));
    assert_eq!(c.poll_action(), None, "one redial at a time");
    c.dial_result("w0", Ok(None), t0 + Duration::from_secs(1));
    assert!(c.usable("w0", t0 + Duration::from_secs(1)));
}
