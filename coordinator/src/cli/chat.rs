//! `shimmer chat`: the terminal chat, against a local model or any running OpenAI-compatible
//! server (`--url`; shimmer's or another). One REPL serves both: `/reset` clears the
//! conversation, `/exit` or end of input leaves, Ctrl-C stops an answer (and at the prompt, leaves
//! with 130). A local conversation can be saved after every turn (`--session`); a remote one goes
//! whole with every turn, as the API wants (the server's prefix cache makes that cheap on shimmer).
//!
//! Must never: hide a server's error (it is printed with its status and message); keep a turn
//! that failed (the conversation stays as it was before it).

use std::io::BufReader;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use serde_json::Value;

use super::*;

#[derive(Args)]
pub(super) struct ChatArgs {
    /// A Hugging Face checkpoint directory (default: the bundled demo model).
    #[arg(long, conflicts_with = "url")]
    pub(super) model: Option<PathBuf>,
    /// Chat with a running OpenAI-compatible server instead (e.g. http://127.0.0.1:8080).
    #[arg(long, value_name = "URL")]
    pub(super) url: Option<String>,
    /// The server's API key (also SHIMMER_API_KEY or OPENAI_API_KEY); with --url.
    #[arg(long, requires = "url")]
    pub(super) api_key: Option<String>,
    /// The model to ask the server for (default: the first it lists); with --url.
    #[arg(long, requires = "url")]
    pub(super) model_name: Option<String>,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 256)]
    pub(super) max_tokens: usize,
    #[command(flatten)]
    pub(super) sampling: SamplingArgs,
    /// Resume the conversation saved in FILE, and save it after every turn.
    #[arg(long, value_name = "FILE")]
    pub(super) session: Option<PathBuf>,
    #[command(flatten)]
    pub(super) store: ExpertArgs,
    /// Record every token's expert routing to FILE (see `shimmer trace analyze`).
    #[arg(long, value_name = "FILE")]
    pub(super) trace: Option<PathBuf>,
}

/// One side of a terminal chat.
trait Conversation {
    /// Answers `input` after the turns so far, streaming the text to stdout until `interrupted`;
    /// an error leaves the conversation as it was.
    fn turn(&mut self, input: &str, interrupted: &AtomicBool) -> Result<()>;
    fn reset(&mut self) -> Result<()>;
    /// The chat is over (end of input or `/exit`).
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// The terminal chats' Ctrl-C: while an answer is generating it stops the answer (`interrupted`);
/// at the prompt it leaves (exit code 130), as other terminal chats do. Returns the flags
/// (`interrupted`, `generating`) the REPL sets and reads.
fn chat_interrupt() -> Result<(Arc<AtomicBool>, Arc<AtomicBool>)> {
    let interrupted = Arc::new(AtomicBool::new(false));
    let generating = Arc::new(AtomicBool::new(false));
    let (i, g) = (interrupted.clone(), generating.clone());
    ctrlc::set_handler(move || {
        if g.load(Ordering::SeqCst) {
            i.store(true, Ordering::SeqCst);
        } else {
            println!();
            std::process::exit(130);
        }
    })
    .context("cannot install the Ctrl-C handler")?;
    Ok((interrupted, generating))
}

/// The one REPL: a prompt, a turn per line, `/reset`, `/exit`, end of input.
fn repl(banner: &str, conversation: &mut dyn Conversation) -> Result<ExitCode> {
    let (interrupted, generating) = chat_interrupt()?;
    eprintln!("shimmer chat · {banner} · /reset clears the conversation, Ctrl-C stops an answer, Ctrl-D leaves");
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    let mut line = String::new();
    loop {
        print!("› ");
        stdout.flush()?;
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            println!();
            conversation.finish()?;
            return Ok(ExitCode::SUCCESS);
        }
        let input = line.trim();
        match input {
            "" => continue,
            "/exit" | "/quit" => {
                conversation.finish()?;
                return Ok(ExitCode::SUCCESS);
            }
            "/reset" => {
                conversation.reset()?;
                println!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        interrupted.store(false, Ordering::SeqCst);
        generating.store(true, Ordering::SeqCst);
        let result = conversation.turn(input, &interrupted);
        generating.store(false, Ordering::SeqCst);
        println!();
        if let Err(e) = result {
            eprintln!("error: {e:#} (use /reset to start over)");
        }
    }
}

/// A conversation with a model in this process, saved after every turn with `--session`.
struct Local<'a> {
    engine: &'a Engine,
    opts: GenerateOptions,
    session: crate::engine::Session,
    messages: Vec<Message>,
    save_to: Option<PathBuf>,
}

impl Local<'_> {
    fn save(&self) -> Result<()> {
        if let Some(path) = &self.save_to {
            crate::session_file::save(path, self.engine, &self.session, &self.session.tokens, &self.messages)?;
        }
        Ok(())
    }
}

impl Conversation for Local<'_> {
    fn turn(&mut self, input: &str, interrupted: &AtomicBool) -> Result<()> {
        self.messages.push(Message::new("user", input));
        let generated = self.engine.encode_chat(&self.messages).map_err(anyhow::Error::from).and_then(|ids| {
            Ok(self.engine.generate(&mut self.session, &ids, &self.opts, |piece| {
                print!("{piece}");
                let _ = std::io::stdout().flush();
                !interrupted.load(Ordering::SeqCst)
            })?)
        });
        match generated {
            Ok(gen) => {
                self.messages.push(Message::new("assistant", &gen.text));
                self.save()
            }
            Err(e) => {
                self.messages.pop();
                Err(e)
            }
        }
    }

    fn reset(&mut self) -> Result<()> {
        self.messages.clear();
        self.session = self.engine.new_session();
        self.save()
    }

    fn finish(&mut self) -> Result<()> {
        Ok(self.engine.finish_trace()?)
    }
}

/// A conversation with a running OpenAI-compatible server.
struct Remote {
    url: String,
    api_key: Option<String>,
    model: String,
    max_tokens: usize,
    temperature: f32,
    top_p: f32,
    seed: Option<u64>,
    stop: Vec<String>,
    messages: Vec<Value>,
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).build().into()
}

/// The message of an error response (OpenAI's or Anthropic's shape), or its raw text.
fn error_text(status: u16, body: &str) -> String {
    let msg =
        serde_json::from_str::<Value>(body).ok().and_then(|v| v["error"]["message"].as_str().map(str::to_string)).unwrap_or_else(|| body.trim().to_string());
    format!("the server answered {status}: {msg}")
}

impl Remote {
    fn base(&self) -> String {
        let u = self.url.trim_end_matches('/');
        if u.ends_with("/v1") {
            u.to_string()
        } else {
            format!("{u}/v1")
        }
    }

    fn auth(&self, req: ureq::RequestBuilder<ureq::typestate::WithoutBody>) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
        match &self.api_key {
            Some(k) => req.header("authorization", &format!("Bearer {k}")),
            None => req,
        }
    }

    /// The model to ask for: the one given, or the server's first.
    fn pick_model(&self, given: Option<String>) -> Result<String> {
        if let Some(m) = given {
            return Ok(m);
        }
        let url = format!("{}/models", self.base());
        let resp = self.auth(agent().get(&url)).call().with_context(|| format!("cannot reach {url}"))?;
        let status = resp.status().as_u16();
        let body = resp.into_body().read_to_string().with_context(|| format!("cannot read {url}"))?;
        if status != 200 {
            bail!("{}", error_text(status, &body));
        }
        let v: Value = serde_json::from_str(&body).with_context(|| format!("{url} did not answer JSON"))?;
        v["data"][0]["id"].as_str().map(str::to_string).with_context(|| format!("{url} lists no model"))
    }

    /// Sends the conversation and streams the reply to `out`; returns the reply's text.
    fn send(&self, interrupted: &AtomicBool, out: &mut impl Write) -> Result<String> {
        let url = format!("{}/chat/completions", self.base());
        let mut body = json!({ "model": self.model, "messages": self.messages, "stream": true, "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p });
        if let Some(s) = self.seed {
            body["seed"] = json!(s);
        }
        if !self.stop.is_empty() {
            body["stop"] = json!(self.stop);
        }
        let mut req = agent().post(&url).header("content-type", "application/json");
        if let Some(k) = &self.api_key {
            req = req.header("authorization", &format!("Bearer {k}"));
        }
        let resp = req.send(body.to_string().as_bytes()).with_context(|| format!("cannot reach {url}"))?;
        let status = resp.status().as_u16();
        if status != 200 {
            let text = resp.into_body().read_to_string().unwrap_or_default();
            bail!("{}", error_text(status, &text));
        }
        let reader = BufReader::new(resp.into_body().into_reader());
        let mut reply = String::new();
        for line in reader.lines() {
            if interrupted.load(Ordering::SeqCst) {
                break; // dropping the connection cancels the generation on the server
            }
            let line = line.context("the stream broke")?;
            let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
            if data == "[DONE]" {
                break;
            }
            let v: Value = serde_json::from_str(data).with_context(|| format!("a stream event is not JSON: {data}"))?;
            if let Some(e) = v.get("error") {
                bail!("the server failed mid-answer: {}", e["message"].as_str().unwrap_or("unknown error"));
            }
            if let Some(piece) = v["choices"][0]["delta"]["content"].as_str() {
                write!(out, "{piece}")?;
                out.flush()?;
                reply.push_str(piece);
            }
        }
        Ok(reply)
    }
}

impl Conversation for Remote {
    fn turn(&mut self, input: &str, interrupted: &AtomicBool) -> Result<()> {
        self.messages.push(json!({ "role": "user", "content": input }));
        match self.send(interrupted, &mut std::io::stdout()) {
            Ok(reply) => {
                self.messages.push(json!({ "role": "assistant", "content": reply }));
                Ok(())
            }
            Err(e) => {
                self.messages.pop();
                Err(e)
            }
        }
    }

    fn reset(&mut self) -> Result<()> {
        self.messages.clear();
        Ok(())
    }
}

pub(super) fn chat(a: ChatArgs) -> Result<ExitCode> {
    if let Some(url) = &a.url {
        for (set, flag) in [
            (a.session.is_some(), "--session"),
            (a.trace.is_some(), "--trace"),
            (a.store.store.ram_gb.is_some() || a.store.store.direct_io, "the expert-store flags"),
            (a.store.cluster.placement.is_some(), "--placement"),
        ] {
            if set {
                bail!("{flag} applies to a local model, not to --url");
            }
        }
        let api_key =
            a.api_key.clone().or_else(|| std::env::var("SHIMMER_API_KEY").ok()).or_else(|| std::env::var("OPENAI_API_KEY").ok()).filter(|k| !k.is_empty());
        let p = a.sampling.params(0.7, 0.9);
        let mut remote = Remote {
            url: url.clone(),
            api_key,
            model: String::new(),
            max_tokens: a.max_tokens,
            temperature: p.temperature,
            top_p: p.top_p,
            seed: Some(p.seed),
            stop: a.sampling.stop.clone(),
            messages: Vec::new(),
        };
        remote.model = remote.pick_model(a.model_name.clone())?;
        let banner = format!("{} at {}", remote.model, remote.base());
        return repl(&banner, &mut remote);
    }
    let dir = model_dir(&a.model)?;
    let engine = open(&dir, &a.store, false)?;
    start_trace(&engine, &a.trace)?;
    if engine.chat.template.is_none() {
        bail!("{}: the model has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja)", dir.display());
    }
    let opts = GenerateOptions { max_tokens: a.max_tokens, sampling: a.sampling.params(0.7, 0.9), stop: a.sampling.stop.clone() };
    let (session, messages) = match &a.session {
        Some(path) => match crate::session_file::load(path, &engine)? {
            Some(saved) => {
                eprintln!("(resumed {}: {} messages, {} cached positions)", path.display(), saved.messages.len(), saved.session.cache.len());
                (saved.session, saved.messages)
            }
            None => (engine.new_session(), Vec::new()),
        },
        None => (engine.new_session(), Vec::new()),
    };
    let mut local = Local { engine: &engine, opts, session, messages, save_to: a.session.clone() };
    repl(&dir.display().to_string(), &mut local)
}
