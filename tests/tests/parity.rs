//! Oracle parity: shimmer's CPU forward pass against what Hugging Face transformers computed on the
//! same committed checkpoints (tests/oracle/make_fixtures.py).
//!
//! Tolerance: both sides compute in f32 from identical (bf16/f16/f32-stored) weights. They differ
//! only in summation order (torch's blocked, vectorised reductions vs our fixed eight-lane dots),
//! in libm's exp/cos/sin, and in the expert sum (ours is exact to 2⁻³² in fixed point, torch's
//! is sequential f32). Each of these is a few ulp per operation; through a few layers on logits
//! of magnitude ~1–10 they stay below ~1e-4, measured at under 7e-5 (OLMoE, Mixtral) and 1e-5 (Qwen3-MoE). `LOGIT_TOLERANCE` = 5e-4
//! leaves room for other CPUs' rounding, while one dropped detail (a missing norm weight,
//! renormalisation, clip, window) moves logits by 1e-2 or more — the tests below would fail.
//!
//! Models with a recurrent state (Gated DeltaNet) carry rounding from token to token: their f32
//! logits sit ~5e-4–1e-3 from the exact ones, transformers' as well as ours. Their oracle is
//! computed in float64, and the tolerance is twice what transformers' own f32 evaluations miss it
//! by (`reference_f32_error`, recorded with the fixture) when that is larger than
//! `LOGIT_TOLERANCE`: shimmer's f32 must be about as close to the exact answer as transformers'
//! (measured: Qwen3-Next 0.9e-3 theirs vs ours in `docs/families.md`).

use shimmer_common::chat_template::Message;
use shimmer_coordinator::engine::{Engine, GenerateOptions};
use shimmer_coordinator::sampling::SamplingParams;
use shimmer_tests::{fixture, fixtures, oracle, oracle_logits};

const LOGIT_TOLERANCE: f32 = 5e-4;

fn tolerance(o: &shimmer_tests::Oracle) -> f32 {
    LOGIT_TOLERANCE.max(2.0 * o.reference_f32_error.unwrap_or(0.0))
}

fn engine(name: &str) -> Engine {
    Engine::load(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn teacher_forced_logits_and_argmax_match_transformers() {
    for name in fixtures() {
        let engine = engine(name);
        let o = oracle(name);
        let mut worst = 0.0f32;
        for (i, p) in o.prompts.iter().enumerate() {
            let ids: Vec<u32> = p.ids.iter().chain(&p.greedy).copied().collect();
            let (want, vocab) = oracle_logits(name, i);
            assert_eq!(vocab, engine.spec.vocab_size);
            let got = engine.logits_all(&ids).unwrap();
            assert_eq!(got.len(), want.len());
            for (pos, (g, w)) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)).enumerate() {
                for (a, b) in g.iter().zip(w) {
                    worst = worst.max((a - b).abs());
                }
                let argmax = shimmer_coordinator::sampling::argmax(g) as u32;
                if p.margin[pos] >= o.near_tie {
                    assert_eq!(argmax, p.argmax[pos], "{name} prompt {i} position {pos}: argmax (oracle margin {})", p.margin[pos]);
                }
            }
        }
        let tolerance = tolerance(&o);
        eprintln!("{name}: largest |logit - oracle| = {worst:e} (tolerance {tolerance:e})");
        assert!(worst <= tolerance, "{name}: largest logit difference {worst} > {tolerance}");
    }
}

#[test]
fn greedy_continuations_match_transformers() {
    for name in fixtures() {
        let engine = engine(name);
        for (i, p) in oracle(name).prompts.iter().enumerate() {
            assert!(p.greedy.len() >= 32);
            let opts = GenerateOptions { max_tokens: p.greedy.len(), sampling: SamplingParams::default(), stop: vec![] };
            let mut session = engine.new_session();
            let mut streamed = String::new();
            let gen = engine
                .generate(&mut session, &p.ids, &opts, |t| {
                    streamed.push_str(t);
                    true
                })
                .unwrap();
            assert_eq!(gen.output_ids, p.greedy, "{name} prompt {i}");
            // The final text is the decode of the output ids, as transformers decodes them.
            assert_eq!(gen.text, p.greedy_text, "{name} prompt {i}: text");
            assert_eq!(streamed, gen.text, "{name} prompt {i}: streamed pieces add up to the text");
        }
    }
}

#[test]
fn scores_match_transformers_logprobs() {
    for name in fixtures() {
        let engine = engine(name);
        let o = oracle(name);
        let p = &o.prompts[0];
        let ids: Vec<u32> = p.ids.iter().chain(&p.greedy).copied().collect();
        let s = engine.score(&ids).unwrap();
        assert_eq!(s.argmax.len(), ids.len());
        assert_eq!(s.logprobs.len(), ids.len() - 1);
        for (pos, (a, b)) in s.logprobs.iter().zip(&p.logprobs).enumerate() {
            assert!((a - b).abs() <= 2.0 * tolerance(&o), "{name} position {pos}: logprob {a} vs {b}");
        }
    }
}

#[test]
fn prompts_tokenize_and_decode_like_transformers() {
    for name in fixtures() {
        let engine = engine(name);
        let o = oracle(name);
        for p in &o.prompts {
            assert_eq!(engine.encode_prompt(&p.text).unwrap(), p.ids, "{name}: {:?}", p.text);
        }
        for t in &o.tokenizer {
            assert_eq!(engine.tokenizer.encode(&t.text, true).unwrap(), t.ids, "{name}: {:?}", t.text);
            assert_eq!(engine.tokenizer.encode(&t.text, false).unwrap(), t.ids_no_special, "{name}: {:?}", t.text);
            assert_eq!(engine.tokenizer.decode(&t.ids, false).unwrap(), t.decoded, "{name}: {:?}", t.text);
            assert_eq!(engine.tokenizer.decode(&t.ids, true).unwrap(), t.decoded_skip_special, "{name}: {:?}", t.text);
        }
    }
}

#[test]
fn chat_templates_render_like_transformers() {
    for name in fixtures() {
        let engine = engine(name);
        let o = oracle(name);
        assert!(!o.chat.is_empty());
        for c in &o.chat {
            let text = engine.chat.render(&c.messages, c.add_generation_prompt).unwrap();
            assert_eq!(text, c.text, "{name}: add_generation_prompt={}", c.add_generation_prompt);
            assert_eq!(engine.tokenizer.encode(&text, false).unwrap(), c.ids, "{name}: chat ids");
            if c.add_generation_prompt {
                assert_eq!(engine.encode_chat(&c.messages).unwrap(), c.ids);
            }
        }
        if let Some(err) = &o.chat_error {
            let msgs: Vec<Message> = err.messages.clone();
            let e = engine.chat.render(&msgs, true).unwrap_err().to_string();
            assert!(e.contains(&err.message), "{name}: `{e}` should carry the template's own message `{}`", err.message);
        }
    }
}

#[test]
fn stop_ids_come_from_config_and_generation_config() {
    for name in fixtures() {
        let engine = engine(name);
        let mut got = engine.eos_ids.clone();
        got.sort();
        assert_eq!(got, oracle(name).eos_ids, "{name}");
    }
}
