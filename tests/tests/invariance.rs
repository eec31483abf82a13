//! DESIGN.md §1 starts here: how a sequence is cut into forward calls (one prefill, token-by-token
//! decode, or any chunking) must not change a single bit of the logits, because every row is
//! computed by the same kernels in the same order and expert sums are fixed-point.

use shimmer_coordinator::Engine;
use shimmer_tests::{fixture, fixtures, oracle};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn chunking_a_sequence_never_changes_its_logits() {
    for name in fixtures() {
        let engine = Engine::load(&fixture(name)).unwrap();
        let o = oracle(name);
        let p = &o.prompts[2];
        let ids: Vec<u32> = p.ids.iter().chain(&p.greedy).copied().collect();
        let vocab = engine.spec.vocab_size;
        let all = engine.logits_all(&ids).unwrap();
        for chunk in [1usize, 3, 7, ids.len()] {
            let mut session = engine.new_session();
            let mut at = 0;
            while at < ids.len() {
                let end = (at + chunk).min(ids.len());
                let last = engine.step(&mut session, &ids[at..end]).unwrap();
                assert_eq!(bits(&last), bits(&all[(end - 1) * vocab..end * vocab]), "{name}: chunk {chunk}, position {}", end - 1);
                at = end;
            }
        }
    }
}

#[test]
fn a_chat_session_reuses_its_cache_without_changing_tokens() {
    use shimmer_coordinator::engine::GenerateOptions;
    use shimmer_coordinator::sampling::SamplingParams;
    let engine = Engine::load(&fixture("qwen3_moe")).unwrap();
    let o = oracle("qwen3_moe");
    let opts = GenerateOptions { max_tokens: 12, sampling: SamplingParams::default(), stop: vec![] };
    // Turn one, then a second prompt that extends the first: the warm session must answer exactly
    // as a cold one does.
    let first = &o.prompts[0].ids;
    let mut warm = engine.new_session();
    let g1 = engine.generate(&mut warm, first, &opts, |_| true).unwrap();
    let mut second: Vec<u32> = first.iter().chain(&g1.output_ids).copied().collect();
    second.extend_from_slice(&o.prompts[1].ids);
    // The first turn's prompt and its sampled tokens are held, except a last one that hit the
    // length limit (sampled, never fed back).
    let held = warm.tokens.len();
    let fed = g1.output_ids.len() - usize::from(g1.finish_reason == shimmer_coordinator::engine::FinishReason::Length);
    assert_eq!(held, first.len() + fed, "the session holds the first turn");
    let g2_warm = engine.generate(&mut warm, &second, &opts, |_| true).unwrap();
    let g2_cold = engine.generate(&mut engine.new_session(), &second, &opts, |_| true).unwrap();
    assert_eq!(g2_warm.output_ids, g2_cold.output_ids);
    assert_eq!(g2_warm.reused_tokens, held, "the second turn computes only what the first did not");
    assert_eq!(g2_cold.reused_tokens, 0);
    // A prompt that diverges early truncates the cache to the shared prefix and still agrees.
    let other = &o.prompts[2].ids;
    let shared = warm.tokens.iter().zip(other).take_while(|(a, b)| a == b).count().min(other.len() - 1);
    let g3_warm = engine.generate(&mut warm, other, &opts, |_| true).unwrap();
    let g3_cold = engine.generate(&mut engine.new_session(), other, &opts, |_| true).unwrap();
    assert_eq!(g3_warm.reused_tokens, shared, "only the shared prefix is reused");
    assert_eq!(g3_warm.output_ids, g3_cold.output_ids);
}

#[test]
fn cancelling_from_the_text_callback_stops_generation() {
    use shimmer_coordinator::engine::{FinishReason, GenerateOptions};
    use shimmer_coordinator::sampling::SamplingParams;
    let engine = Engine::load(&fixture("mixtral")).unwrap();
    let opts = GenerateOptions { max_tokens: 40, sampling: SamplingParams::default(), stop: vec![] };
    let mut pieces = 0;
    let g = engine
        .generate(&mut engine.new_session(), &oracle("mixtral").prompts[0].ids, &opts, |_| {
            pieces += 1;
            pieces < 3
        })
        .unwrap();
    assert_eq!(g.finish_reason, FinishReason::Cancelled);
    assert!(g.output_ids.len() < 40);
}

/// Two "nodes", each owning half of every layer's experts (a skewed, interleaved split), summed
/// in the opposite order to expert ids: the single-box result, bit for bit.
struct TwoNodes(shimmer_experts::InProcessExperts);

impl shimmer_experts::ExpertDispatch for TwoNodes {
    fn dispatch(&self, batch: &shimmer_experts::MoeBatch<'_>, acc: &mut [i64]) -> Result<(), shimmer_experts::DispatchError> {
        let mut b = vec![0i64; acc.len()];
        self.0.dispatch_owned(batch, &mut b, &|layer, e| (e as usize * 7 + layer).is_multiple_of(3))?;
        self.0.dispatch_owned(batch, acc, &|layer, e| !(e as usize * 7 + layer).is_multiple_of(3))?;
        shimmer_kernels::fixed::merge(acc, &b);
        Ok(())
    }
}

#[test]
fn splitting_the_experts_across_nodes_never_changes_a_bit() {
    for dir in [fixture("olmoe"), fixture("deepseek_v3"), fixture("glm4_moe"), std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/demo")] {
        let single = Engine::load(&dir).unwrap();
        let split = shimmer_tests::engine_with_dispatch(&dir, |e| Box::new(TwoNodes(e)));
        let ids: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % 400).collect();
        assert_eq!(bits(&single.logits_all(&ids).unwrap()), bits(&split.logits_all(&ids).unwrap()), "{}", dir.display());
    }
}

#[test]
fn sequences_batched_together_get_the_logits_they_get_alone() {
    // Continuous batching: one forward pass holds a sequence's prompt chunk beside other
    // sequences' single decode tokens and prompt chunks. Each must come out as if alone.
    use shimmer_model::{Logits, Segment};
    for name in fixtures() {
        let engine = Engine::load(&fixture(name)).unwrap();
        let o = oracle(name);
        let seqs: Vec<Vec<u32>> = o.prompts.iter().map(|p| p.ids.iter().chain(&p.greedy).copied().collect()).collect();
        let vocab = engine.spec.vocab_size;
        let alone: Vec<Vec<f32>> = seqs.iter().map(|s| engine.logits_all(s).unwrap()).collect();
        // Each sequence advances by its own chunk size per step (1 = decode-like), all in one pass.
        let mut sessions: Vec<_> = seqs.iter().map(|_| engine.new_session()).collect();
        let mut at = vec![0usize; seqs.len()];
        let chunks = [1usize, 4, 2, 7, 3];
        let mut step = 0;
        while at.iter().zip(&seqs).any(|(a, s)| a < &s.len()) {
            let live: Vec<usize> = (0..seqs.len()).filter(|i| at[*i] < seqs[*i].len()).collect();
            let ends: Vec<usize> = live.iter().map(|i| (at[*i] + chunks[(i + step) % chunks.len()]).min(seqs[*i].len())).collect();
            let mut segments: Vec<Segment<'_>> = Vec::new();
            for ((i, end), session) in live.iter().zip(&ends).zip(sessions.iter_mut().enumerate().filter(|(j, _)| live.contains(j)).map(|(_, s)| s)) {
                segments.push(Segment { tokens: &seqs[*i][at[*i]..*end], cache: &mut session.cache, want: Logits::All });
            }
            let out = engine.forward_batch(&mut segments).unwrap();
            drop(segments);
            for ((i, end), logits) in live.iter().zip(&ends).zip(out) {
                let want = &alone[*i][at[*i] * vocab..*end * vocab];
                assert_eq!(bits(&logits), bits(want), "{name}: sequence {i}, positions {}..{end}, step {step}", at[*i]);
                at[*i] = *end;
            }
            step += 1;
        }
    }
}

/// A second turn that leaves the first one's answer part-way reuses the cached prefix — all of
/// it for attention, back to the prompt's end (its checkpoint) for a recurrent state, which
/// cannot rewind — and answers exactly as a fresh session does.
#[test]
fn a_reused_prefix_answers_as_a_fresh_session_even_where_a_state_must_go_back() {
    use shimmer_coordinator::engine::GenerateOptions;
    use shimmer_coordinator::sampling::SamplingParams;
    for name in fixtures() {
        let engine = Engine::load(&fixture(name)).unwrap();
        let o = shimmer_tests::oracle(name);
        let prompt = &o.prompts[0].ids;
        let opts = GenerateOptions { max_tokens: 8, sampling: SamplingParams::default(), stop: vec![] };
        let mut session = engine.new_session();
        let first = engine.generate(&mut session, prompt, &opts, |_| true).unwrap();
        let mut second: Vec<u32> = prompt.iter().chain(&first.output_ids[..3]).copied().collect();
        second.extend(&o.prompts[1].ids[..4]);
        let reused = engine.generate(&mut session, &second, &opts, |_| true).unwrap();
        let fresh = engine.generate(&mut engine.new_session(), &second, &opts, |_| true).unwrap();
        assert_eq!(reused.output_ids, fresh.output_ids, "{name}");
        let recurrent = engine.spec.attention.mixers.contains(&shimmer_common::spec::Mixer::GatedDeltaNet);
        let want = if recurrent { prompt.len() } else { prompt.len() + 3 };
        assert_eq!(reused.reused_tokens, want, "{name}: positions reused");
    }
}

/// A batch of decode steps wants each sequence's last row, and the head runs once over all of
/// them: with integer products (the demo model as an int4-g32 container with int8 head and
/// layers, as `shimmer convert` makes it) every sequence still gets the logits it gets alone.
#[test]
fn a_batch_of_last_rows_through_an_integer_head_gets_each_sequences_own_logits() {
    use shimmer_model::{Logits, Segment};
    let out = tempfile::tempdir().unwrap();
    let container = demo_int4_container(out.path());
    let engine = Engine::load(&container).unwrap();
    let vocab = engine.spec.vocab_size;
    let seqs: Vec<Vec<u32>> = (0..5u32).map(|s| (0..12u32).map(|i| (i * 131 + s * 977 + 5) % vocab as u32).collect()).collect();
    let alone: Vec<Vec<f32>> = seqs.iter().map(|s| engine.logits_all(s).unwrap()).collect();
    let mut sessions: Vec<_> = seqs.iter().map(|_| engine.new_session()).collect();
    // A prompt chunk of a different length per sequence, then one token a step for all.
    let mut at: Vec<usize> = (0..seqs.len()).map(|i| 2 + i).collect();
    let mut segments: Vec<Segment<'_>> =
        sessions.iter_mut().zip(&seqs).zip(&at).map(|((s, q), a)| Segment { tokens: &q[..*a], cache: &mut s.cache, want: Logits::Last }).collect();
    let first = engine.forward_batch(&mut segments).unwrap();
    drop(segments);
    for (i, logits) in first.iter().enumerate() {
        assert_eq!(bits(logits), bits(&alone[i][(at[i] - 1) * vocab..at[i] * vocab]), "sequence {i}'s prompt");
    }
    while at.iter().all(|a| *a < 12) {
        let mut segments: Vec<Segment<'_>> =
            sessions.iter_mut().zip(&seqs).zip(&at).map(|((s, q), a)| Segment { tokens: &q[*a..*a + 1], cache: &mut s.cache, want: Logits::Last }).collect();
        let out = engine.forward_batch(&mut segments).unwrap();
        drop(segments);
        for (i, logits) in out.iter().enumerate() {
            assert_eq!(logits.len(), vocab);
            assert_eq!(bits(logits), bits(&alone[i][at[i] * vocab..(at[i] + 1) * vocab]), "sequence {i}, position {}", at[i]);
            at[i] += 1;
        }
    }
}

/// A one-row step of a model whose step runs alone (the demo) splits its LM head over a team
/// of its own when the engine has two threads (`Decoder::head_as_team`, the helper woken a
/// layer ahead): its logits are the one-thread engine's, bit for bit, step after step.
#[test]
fn decode_logits_do_not_depend_on_the_engines_thread_count() {
    let out = tempfile::tempdir().unwrap();
    let container = demo_int4_container(out.path());
    let load = |threads: usize| rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(|| Engine::load(&container).unwrap());
    let (one, two) = (load(1), load(2));
    let vocab = one.spec.vocab_size as u32;
    let ids: Vec<u32> = (0..24u32).map(|i| (i * 389 + 17) % vocab).collect();
    let (mut s1, mut s2) = (one.new_session(), two.new_session());
    let (a, b) = (one.step(&mut s1, &ids[..4]).unwrap(), two.step(&mut s2, &ids[..4]).unwrap());
    assert_eq!(bits(&a), bits(&b), "the prompt");
    for (at, id) in ids.iter().enumerate().skip(4) {
        let (a, b) = (one.step(&mut s1, &[*id]).unwrap(), two.step(&mut s2, &[*id]).unwrap());
        assert_eq!(bits(&a), bits(&b), "decode step at position {at}");
    }
}

/// A long prompt in one step on two threads — its norms, routers' choices and expert sums
/// shared over the step's team — gives every row the logits a one-thread engine gives it a token
/// at a time, bit for bit.
#[test]
fn a_long_prompt_over_the_team_gives_every_row_its_one_token_logits() {
    let out = tempfile::tempdir().unwrap();
    let container = demo_int4_container(out.path());
    let load = |threads: usize| rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(|| Engine::load(&container).unwrap());
    let (one, two) = (load(1), load(2));
    let vocab = one.spec.vocab_size;
    // 80 rows: past every team bound of the demo's prompt (32 rows; 64 rows of its 256 wide).
    let ids: Vec<u32> = (0..80u32).map(|i| (i * 389 + 17) % vocab as u32).collect();
    let all = two.logits_all(&ids).unwrap();
    let mut session = one.new_session();
    for (at, id) in ids.iter().enumerate() {
        let row = one.step(&mut session, &[*id]).unwrap();
        assert_eq!(bits(&row), bits(&all[at * vocab..(at + 1) * vocab]), "position {at}");
    }
}

/// The demo model as an int4-g32 container with int8 layers and head (what `shimmer convert`
/// makes by default), under `dir`.
fn demo_int4_container(dir: &std::path::Path) -> std::path::PathBuf {
    use shimmer_store::convert::{convert, ConvertOptions, DenseQuant};
    let demo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/demo");
    let container = dir.join("c");
    let opts = ConvertOptions { expert_quant: shimmer_common::quant::QuantScheme::Int4 { group: 32 }, dense_quant: DenseQuant::Int8, head_quant: None };
    convert(&demo, &container, opts, &mut |_| {}).unwrap();
    container
}
