#![no_main]
//! Placement file bytes → a placement checked against a model (`validate`), then each worker's
//! slice: any input ends in Ok or an error naming the problem; a validated placement gives every
//! expert a holder and every worker a slice.
use libfuzzer_sys::fuzz_target;
use shimmer_cluster::placement::Placement;

fuzz_target!(|data: &[u8]| {
    let Ok(p) = Placement::parse(data) else { return };
    let moe = [1usize, 2];
    if p.validate(&p.model.clone(), &moe, 4).is_err() {
        return;
    }
    for l in moe {
        for e in 0..4 {
            assert!(p.holders(l, e).is_some_and(|h| !h.is_empty()), "validated, yet layer {l} expert {e} has no holder");
        }
    }
    for w in &p.workers {
        let s = p.slice(&w.name, &moe).expect("a validated placement slices for each of its workers");
        assert!(s.pins.iter().flatten().all(|e| *e < 4));
    }
});
