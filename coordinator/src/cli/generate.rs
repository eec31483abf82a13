//! `shimmer generate`: a continuation of a prompt, streamed (or one JSON object).

use super::*;

#[derive(Args)]
pub(super) struct GenerateArgs {
    /// A Hugging Face checkpoint directory (default: the bundled demo model).
    #[arg(long)]
    pub(super) model: Option<PathBuf>,
    /// The prompt text.
    #[arg(long, required_unless_present = "prompt_ids", conflicts_with = "prompt_ids")]
    pub(super) prompt: Option<String>,
    /// The prompt as token ids, used exactly as given: 1,2,3
    #[arg(long, value_delimiter = ',')]
    pub(super) prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt as one user message with the model's chat template.
    #[arg(long, conflicts_with = "prompt_ids")]
    pub(super) chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub(super) max_tokens: usize,
    #[command(flatten)]
    pub(super) sampling: SamplingArgs,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub(super) json: bool,
    /// Continue the conversation saved in FILE (token history and KV cache), and save it back.
    #[arg(long, value_name = "FILE")]
    pub(super) session: Option<PathBuf>,
    #[command(flatten)]
    pub(super) store: ExpertArgs,
    /// Record every token's expert routing to FILE (see `shimmer trace analyze`).
    #[arg(long, value_name = "FILE")]
    pub(super) trace: Option<PathBuf>,
}

pub(super) fn generate(a: GenerateArgs) -> Result<ExitCode> {
    let engine = open(&model_dir(&a.model)?, &a.store, a.json)?;
    start_trace(&engine, &a.trace)?;
    let saved = match &a.session {
        Some(path) => crate::session_file::load(path, &engine)?,
        None => None,
    };
    let (mut session, mut history, mut messages) = match saved {
        Some(s) => (s.session, s.history, s.messages),
        None => (engine.new_session(), Vec::new(), Vec::new()),
    };
    // With a session, the prompt continues the saved conversation: plain prompts are appended to
    // its token history, chat prompts become its next user message.
    let prompt_ids = match (&a.prompt, &a.prompt_ids) {
        (_, Some(ids)) => history.iter().chain(ids).copied().collect(),
        (Some(text), None) if a.chat => {
            messages.push(Message::new("user", text));
            engine.encode_chat(&messages)?
        }
        (Some(text), None) => {
            // Tokenizer special tokens (a BOS) only start a conversation, never continue one.
            let ids = engine.tokenizer.encode(text, history.is_empty())?;
            history.iter().chain(&ids).copied().collect()
        }
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let opts = GenerateOptions { max_tokens: a.max_tokens, sampling: a.sampling.params(0.0, 1.0), stop: a.sampling.stop.clone() };
    if let Some(path) = &a.session {
        let reused = session.tokens.iter().zip(&prompt_ids).take_while(|(x, y)| x == y).count();
        eprintln!("shimmer: session {}: {reused} cached positions reused, {} to prefill", path.display(), prompt_ids.len().saturating_sub(reused));
    }
    // Generation runs on a compute thread: the handle (not a lock, which cannot move there).
    let mut stdout = std::io::stdout();
    let json_mode = a.json;
    let gen = engine.generate(&mut session, &prompt_ids, &opts, |piece| {
        if !json_mode {
            // A closed stdout (e.g. `| head`) ends generation instead of failing it.
            return stdout.write_all(piece.as_bytes()).and_then(|_| stdout.flush()).is_ok();
        }
        true
    })?;
    if let Some(path) = &a.session {
        history = prompt_ids.iter().chain(&gen.output_ids).copied().collect();
        if a.chat {
            messages.push(Message::new("assistant", &gen.text));
        }
        crate::session_file::save(path, &engine, &session, &history, &messages)?;
    }
    engine.finish_trace()?;
    let decode_tok_s = if gen.decode_ms > 0.0 { gen.decode_tokens as f64 / (gen.decode_ms / 1e3) } else { 0.0 };
    if a.json {
        let out = json!({
            "prompt_ids": prompt_ids,
            "output_ids": gen.output_ids,
            "text": gen.text,
            "finish_reason": gen.finish_reason.as_str(),
            "timings": {"load_ms": round2(engine.load_ms), "prefill_ms": round2(gen.prefill_ms), "decode_ms": round2(gen.decode_ms), "decode_tokens": gen.decode_tokens, "decode_tok_s": round2(decode_tok_s), "store": store_json(&engine), "cluster": engine.cluster_telemetry()},
        });
        writeln!(stdout, "{out}")?;
    } else {
        let _ = writeln!(stdout);
        eprintln!(
            "[{} tokens, {}; load {:.0} ms, prefill {:.1} ms, decode {:.1} tok/s]",
            gen.output_ids.len(),
            gen.finish_reason.as_str(),
            engine.load_ms,
            gen.prefill_ms,
            decode_tok_s
        );
        store_summary(&engine);
    }
    Ok(ExitCode::SUCCESS)
}
