//! The chat-template sandbox: a child process (`shimmer render-sandbox`, started on first use)
//! that renders templates under an address-space limit and a deadline.
//!
//! A chat template is code from the checkpoint. minijinja's fuel (with the print budget the
//! vendored copy adds) bounds the instructions, the values and the printing of one render in any
//! process; the sandbox is the second wall, for whatever the fuel's accounting misses (as it once
//! missed materialized list concatenations and values printed many times over). The binary
//! renders in a process of its own: a render that needs more than its memory
//! (`DEFAULT_MEMORY_MIB`, or `SHIMMER_RENDER_MEMORY_MIB`) or `RENDER_DEADLINE` ends that
//! process, the request gets an error saying so, and the next render starts a new one — the
//! server and every other request go on.
//!
//! Owns: the protocol (one length-prefixed JSON `RenderJob` in, one `Reply` out), the child's
//! lifetime, and the choice to sandbox (`enable`, which the binary calls at start; library
//! users and unit tests render in-process).
//!
//! Must never: give one child two renders at once; wait on it without a deadline; let a
//! reply longer than `MAX_MESSAGE_BYTES` be allocated.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use shimmer_common::chat_template::RenderJob;

/// The sandbox's address space in MiB: far more than any real template needs (a few MiB), and
/// far less than a machine that serves a model has.
pub const DEFAULT_MEMORY_MIB: u64 = 512;
/// The environment variable that sets it, within `MEMORY_MIB_RANGE`.
pub const MEMORY_ENV: &str = "SHIMMER_RENDER_MEMORY_MIB";
/// What `MEMORY_ENV` may say: below 64 MiB the binary itself may not start.
pub const MEMORY_MIB_RANGE: std::ops::RangeInclusive<u64> = 64..=65_536;
/// How long one render may take.
pub const RENDER_DEADLINE: Duration = Duration::from_secs(20);
/// The most one request or reply may be (a conversation as large as a body may be, rendered).
const MAX_MESSAGE_BYTES: usize = 256 << 20;
/// The hidden subcommand that runs the sandbox.
pub const SUBCOMMAND: &str = "render-sandbox";

#[derive(Serialize, Deserialize)]
enum Reply {
    Text(String),
    Error(String),
}

struct Sandbox {
    exe: PathBuf,
    memory_mib: u64,
    /// Children between renders. A render takes one (or starts one), so a slow render holds up
    /// no other; at most `KEEP_IDLE` are kept.
    idle: Mutex<Vec<Running>>,
}

const KEEP_IDLE: usize = 4;

struct Running {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
}

impl Running {
    fn stop(mut self) -> Option<std::process::ExitStatus> {
        let _ = self.child.kill();
        self.child.wait().ok()
    }
}

static SANDBOX: OnceLock<Sandbox> = OnceLock::new();

/// Renders every later chat template in a sandbox process running `exe` (the binary itself),
/// with the memory `MEMORY_ENV` gives (or `DEFAULT_MEMORY_MIB`); a value it cannot take is an
/// error naming it.
pub fn enable(exe: PathBuf) -> Result<(), String> {
    let memory_mib = match std::env::var(MEMORY_ENV) {
        Err(std::env::VarError::NotPresent) => DEFAULT_MEMORY_MIB,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(mib) if MEMORY_MIB_RANGE.contains(&mib) => mib,
            _ => return Err(format!("{MEMORY_ENV}={v:?}: not a whole number of MiB from {} to {}", MEMORY_MIB_RANGE.start(), MEMORY_MIB_RANGE.end())),
        },
        Err(std::env::VarError::NotUnicode(_)) => return Err(format!("{MEMORY_ENV} is not UTF-8")),
    };
    let _ = SANDBOX.set(Sandbox { exe, memory_mib, idle: Mutex::new(Vec::new()) });
    Ok(())
}

/// Renders `job`: in the sandbox once `enable`d, else in this process.
pub fn render(job: &RenderJob) -> Result<String, String> {
    match SANDBOX.get() {
        Some(s) => s.render(job),
        None => job.run(),
    }
}

impl Sandbox {
    fn render(&self, job: &RenderJob) -> Result<String, String> {
        let request = serde_json::to_vec(job).map_err(|e| format!("cannot send the render: {e}"))?;
        if request.len() > MAX_MESSAGE_BYTES {
            return Err(format!("the conversation is {} bytes, over the {MAX_MESSAGE_BYTES} a render takes", request.len()));
        }
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut running = match idle {
            Some(r) => r,
            None => self.start()?,
        };
        match exchange(&mut running, &request) {
            Ok(reply) => {
                let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                if idle.len() < KEEP_IDLE {
                    idle.push(running);
                } else {
                    drop(idle);
                    running.stop();
                }
                match reply {
                    Reply::Text(t) => Ok(t),
                    Reply::Error(e) => Err(e),
                }
            }
            Err(timed_out) => {
                // This child is done whatever happened; the next render starts another.
                let status = running.stop();
                use std::os::unix::process::ExitStatusExt;
                Err(match status.and_then(|s| s.signal()) {
                    _ if timed_out => format!("rendering took longer than {} s and was stopped", RENDER_DEADLINE.as_secs()),
                    // An allocation over the limit aborts it.
                    Some(libc::SIGABRT) => format!("rendering needed more than the {} MiB a render may use and was stopped", self.memory_mib),
                    _ => format!("the render sandbox stopped unexpectedly ({})", status.map_or("no status".into(), |s| s.to_string())),
                })
            }
        }
    }

    fn start(&self) -> Result<Running, String> {
        let mut child = Command::new(&self.exe)
            .arg(SUBCOMMAND)
            .arg(self.memory_mib.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start the render sandbox ({}): {e}", self.exe.display()))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            return Err("the render sandbox has no pipes".into());
        };
        Ok(Running { child, stdin, stdout })
    }
}

/// One request and its reply, with a watchdog that kills the child at the deadline (which ends
/// the read with an error). `Err(timed_out)` when there is no reply.
fn exchange(r: &mut Running, request: &[u8]) -> Result<Reply, bool> {
    let pid = r.child.id();
    let (done, watch) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if watch.recv_timeout(RENDER_DEADLINE) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
            // SAFETY: kill(2) on the child's pid, which is not reaped yet (the caller holds it).
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
            return true;
        }
        false
    });
    let io = (|| -> std::io::Result<Vec<u8>> {
        r.stdin.write_all(&(request.len() as u32).to_le_bytes())?;
        r.stdin.write_all(request)?;
        r.stdin.flush()?;
        read_frame(&mut r.stdout)
    })();
    let _ = done.send(());
    let timed_out = watchdog.join().unwrap_or(false);
    let bytes = io.map_err(|_| timed_out)?;
    serde_json::from_slice(&bytes).map_err(|_| false)
}

fn read_frame(from: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    from.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(std::io::Error::other(format!("a frame of {len} bytes")));
    }
    let mut bytes = vec![0u8; len];
    from.read_exact(&mut bytes)?;
    Ok(bytes)
}

/// The sandbox process: limits its own address space, then renders each job it is sent until
/// its input closes.
pub fn serve(memory_mib: u64) -> anyhow::Result<()> {
    anyhow::ensure!(
        MEMORY_MIB_RANGE.contains(&memory_mib),
        "the render sandbox takes {} to {} MiB, not {memory_mib}",
        MEMORY_MIB_RANGE.start(),
        MEMORY_MIB_RANGE.end()
    );
    let bytes = memory_mib << 20;
    let limit = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
    // SAFETY: setrlimit(2) with a valid, initialised struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) } != 0 {
        anyhow::bail!("cannot limit the render sandbox's memory: {}", std::io::Error::last_os_error());
    }
    let (mut input, mut output) = (std::io::stdin().lock(), std::io::stdout().lock());
    loop {
        let request = match read_frame(&mut input) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let reply = match serde_json::from_slice::<RenderJob>(&request) {
            Ok(job) => match job.run() {
                Ok(text) => Reply::Text(text),
                Err(e) => Reply::Error(e),
            },
            Err(e) => Reply::Error(format!("not a render job: {e}")),
        };
        let mut bytes = serde_json::to_vec(&reply)?;
        if bytes.len() > MAX_MESSAGE_BYTES {
            bytes = serde_json::to_vec(&Reply::Error(format!("the rendered prompt is over {MAX_MESSAGE_BYTES} bytes")))?;
        }
        output.write_all(&(bytes.len() as u32).to_le_bytes())?;
        output.write_all(&bytes)?;
        output.flush()?;
    }
}
