//! `shimmer chat --url URL`: the terminal chat against any OpenAI-compatible server (shimmer's
//! or another), streaming its answers. The conversation lives here and goes whole with every
//! turn, as the API wants; the server's prefix cache makes that cheap on shimmer.
//!
//! Must never: hide a server's error (it is printed with its status and message), or keep a
//! reply the server did not finish when the user stops it (the partial text is kept as said).

use std::io::{BufRead, BufReader, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

pub struct RemoteChat {
    pub url: String,
    pub api_key: Option<String>,
    pub model: Option<String>,
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
}

/// The terminal chats' Ctrl-C: while an answer is generating it stops the answer (`interrupted`);
/// at the prompt it leaves (exit code 130), as other terminal chats do. Returns the flags
/// (`interrupted`, `generating`) the chat loop sets and reads.
pub(crate) fn chat_interrupt() -> Result<(Arc<AtomicBool>, Arc<AtomicBool>)> {
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

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).build().into()
}

/// The message of an error response (OpenAI's or Anthropic's shape), or its raw text.
fn error_text(status: u16, body: &str) -> String {
    let msg =
        serde_json::from_str::<Value>(body).ok().and_then(|v| v["error"]["message"].as_str().map(str::to_string)).unwrap_or_else(|| body.trim().to_string());
    format!("the server answered {status}: {msg}")
}

impl RemoteChat {
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
    fn model(&self) -> Result<String> {
        if let Some(m) = &self.model {
            return Ok(m.clone());
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
    fn turn(&self, model: &str, messages: &[Value], interrupted: &AtomicBool, out: &mut impl Write) -> Result<String> {
        let url = format!("{}/chat/completions", self.base());
        let mut body = json!({ "model": model, "messages": messages, "stream": true, "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p });
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

    pub fn run(&self) -> Result<()> {
        let model = self.model()?;
        let (interrupted, generating) = chat_interrupt()?;
        eprintln!("shimmer chat · {model} at {} · /reset clears the conversation, Ctrl-C stops an answer, Ctrl-D leaves", self.base());
        let mut messages: Vec<Value> = Vec::new();
        let stdin = std::io::stdin();
        let mut stdout = std::io::stdout();
        let mut line = String::new();
        loop {
            print!("› ");
            stdout.flush()?;
            line.clear();
            if stdin.lock().read_line(&mut line)? == 0 {
                println!();
                return Ok(());
            }
            let input = line.trim();
            match input {
                "" => continue,
                "/exit" | "/quit" => return Ok(()),
                "/reset" => {
                    messages.clear();
                    println!("(conversation cleared)");
                    continue;
                }
                _ => {}
            }
            messages.push(json!({ "role": "user", "content": input }));
            interrupted.store(false, Ordering::SeqCst);
            generating.store(true, Ordering::SeqCst);
            let result = self.turn(&model, &messages, &interrupted, &mut stdout);
            generating.store(false, Ordering::SeqCst);
            println!();
            match result {
                Ok(reply) => messages.push(json!({ "role": "assistant", "content": reply })),
                Err(e) => {
                    messages.pop();
                    eprintln!("error: {e:#}");
                }
            }
        }
    }
}
