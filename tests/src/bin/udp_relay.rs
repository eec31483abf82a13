//! A user-space UDP (and TCP) relay for the LAN tests and benchmarks: the kernel here has no
//! `netem`, so latency and loss come from this process sitting on a path. It listens on one
//! address and forwards every datagram to another (one upstream socket per client, so replies
//! find their way back), delaying each by a fixed time in each direction and dropping a fraction
//! of them (a seeded generator: runs repeat). While the partition file exists, it drops
//! everything.
//!
//! With `--tcp` it relays TCP connections instead (llama.cpp's RPC backend speaks TCP): each
//! accepted connection gets its own upstream connection, and every chunk read is written on
//! after the delay, in order; there is no loss (TCP would retransmit it), and while the
//! partition file exists nothing is forwarded (a pulled cable: the bytes wait). `--count-file`
//! keeps there the number of round trips seen so far, over every connection: a round trip is a
//! turn of the conversation, the far side answering after the near side spoke, which is how often
//! a request/reply peer waits out the path's delay (a reply sent in several reads is one).
//!
//! Its first line on stderr names the address it listens on, so `--listen 127.0.0.1:0` works.
//!
//! `shimmer-udp-relay --listen ADDR --to ADDR [--tcp] [--count-file PATH] [--delay-ms D] [--loss P] [--seed S] [--partition-file PATH]`
//!
//! Must never: reorder datagrams of one direction, or bytes of a connection (the delay is
//! constant, so a queue keeps order).

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct Options {
    listen: SocketAddr,
    to: SocketAddr,
    delay: Duration,
    loss: f64,
    seed: u64,
    partition: Option<PathBuf>,
    tcp: bool,
    count_file: Option<PathBuf>,
}

fn parse() -> Result<Options, String> {
    let mut args = std::env::args().skip(1);
    let (mut listen, mut to, mut delay, mut loss, mut seed, mut partition, mut tcp) = (None, None, 0.0f64, 0.0f64, 1u64, None, false);
    let mut count_file = None;
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => listen = Some(value()?.parse::<SocketAddr>().map_err(|e| format!("--listen: {e}"))?),
            "--to" => to = Some(value()?.parse::<SocketAddr>().map_err(|e| format!("--to: {e}"))?),
            "--delay-ms" => delay = value()?.parse().map_err(|e| format!("--delay-ms: {e}"))?,
            "--loss" => loss = value()?.parse().map_err(|e| format!("--loss: {e}"))?,
            "--seed" => seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--partition-file" => partition = Some(PathBuf::from(value()?)),
            "--tcp" => tcp = true,
            "--count-file" => count_file = Some(PathBuf::from(value()?)),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if !(0.0..=1.0).contains(&loss) || !(0.0..=10_000.0).contains(&delay) {
        return Err("--loss must be in [0, 1] and --delay-ms in [0, 10000]".into());
    }
    if tcp && loss > 0.0 {
        return Err("--loss applies to UDP only: TCP retransmits what a link loses".into());
    }
    if count_file.is_some() && !tcp {
        return Err("--count-file counts the turns of TCP conversations; it needs --tcp".into());
    }
    Ok(Options {
        listen: listen.ok_or("--listen is required")?,
        to: to.ok_or("--to is required")?,
        delay: Duration::from_secs_f64(delay / 1e3),
        loss,
        seed,
        partition,
        tcp,
        count_file,
    })
}

/// Datagrams waiting out their delay, in arrival order, for one outgoing socket.
struct Delayed {
    queue: Mutex<VecDeque<(Instant, Vec<u8>, SocketAddr)>>,
    ready: Condvar,
}

impl Delayed {
    fn start(out: UdpSocket) -> Arc<Self> {
        let d = Arc::new(Delayed { queue: Mutex::new(VecDeque::new()), ready: Condvar::new() });
        let me = d.clone();
        std::thread::spawn(move || loop {
            let (due, bytes, dest) = {
                let mut q = me.queue.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(front) = q.pop_front() {
                        break front;
                    }
                    q = me.ready.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            let _ = out.send_to(&bytes, dest);
        });
        d
    }

    fn push(&self, due: Instant, bytes: Vec<u8>, dest: SocketAddr) {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).push_back((due, bytes, dest));
        self.ready.notify_one();
    }
}

/// Decides each datagram's fate: dropped by loss or partition, or sent after the delay.
struct Path {
    loss: f64,
    delay: Duration,
    rng: AtomicU64,
    partitioned: Arc<AtomicBool>,
}

impl Path {
    fn keep(&self) -> bool {
        if self.partitioned.load(Ordering::Relaxed) {
            return false;
        }
        if self.loss == 0.0 {
            return true;
        }
        // xorshift64*: one shared, seeded stream.
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng.store(x, Ordering::Relaxed);
        let r = (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64;
        r >= self.loss
    }
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("shimmer-udp-relay: {e}");
            std::process::exit(2);
        }
    };
    let partitioned = Arc::new(AtomicBool::new(false));
    if let Some(p) = o.partition.clone() {
        let flag = partitioned.clone();
        std::thread::spawn(move || loop {
            flag.store(p.exists(), Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(20));
        });
    }
    if o.tcp {
        relay_tcp(&o, partitioned);
    }
    let front = match UdpSocket::bind(o.listen) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("shimmer-udp-relay: cannot listen on {}: {e}", o.listen);
            std::process::exit(1);
        }
    };
    let path = Arc::new(Path { loss: o.loss, delay: o.delay, rng: AtomicU64::new(o.seed.max(1)), partitioned });
    let to_clients = Delayed::start(front.try_clone().expect("clone the listening socket"));
    let mut upstreams: HashMap<SocketAddr, Arc<Delayed>> = HashMap::new();
    let bound = front.local_addr().map_or_else(|_| o.listen.to_string(), |a| a.to_string());
    eprintln!("shimmer-udp-relay: {bound} -> {} (delay {:?} each way, loss {})", o.to, o.delay, o.loss);
    let mut buf = vec![0u8; 65536];
    loop {
        let Ok((n, client)) = front.recv_from(&mut buf) else { continue };
        let arrived = Instant::now();
        let upstream = upstreams.entry(client).or_insert_with(|| {
            let bind: SocketAddr = if o.to.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
            let up = UdpSocket::bind(bind).expect("bind an upstream socket");
            // Replies from the far side go back to this client, through the same delay and loss.
            let (reader, back, path, to) = (up.try_clone().expect("clone the upstream socket"), to_clients.clone(), path.clone(), o.to);
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                loop {
                    let Ok((n, from)) = reader.recv_from(&mut buf) else { continue };
                    if from == to && path.keep() {
                        back.push(Instant::now() + path.delay, buf[..n].to_vec(), client);
                    }
                }
            });
            Delayed::start(up)
        });
        if path.keep() {
            upstream.push(arrived + path.delay, buf[..n].to_vec(), o.to);
        }
    }
}

/// Round trips over every relayed connection, kept in `--count-file` as they happen.
struct TurnCounter {
    round_trips: AtomicU64,
}

impl TurnCounter {
    /// Rewrites `path` (through a temporary name, so a reader never sees half a number) whenever
    /// the count has moved, every 50 ms.
    fn start(path: Option<PathBuf>) -> Arc<Self> {
        let counter = Arc::new(TurnCounter { round_trips: AtomicU64::new(0) });
        if let Some(path) = path {
            let me = counter.clone();
            let tmp = path.with_extension("tmp");
            std::thread::spawn(move || {
                let mut written = None;
                loop {
                    let now = me.round_trips.load(Ordering::Relaxed);
                    if written != Some(now) && std::fs::write(&tmp, format!("{now}\n")).is_ok() && std::fs::rename(&tmp, &path).is_ok() {
                        written = Some(now);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            });
        }
        counter
    }
}

/// Which side of one connection spoke last: a reply read after the near side spoke is a turn.
struct Conversation {
    far_side_spoke_last: AtomicBool,
    counter: Arc<TurnCounter>,
}

impl Conversation {
    fn heard(&self, from_far_side: bool) {
        let before = self.far_side_spoke_last.swap(from_far_side, Ordering::Relaxed);
        if from_far_side && !before {
            self.counter.round_trips.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Relays TCP connections from `o.listen` to `o.to` until killed.
fn relay_tcp(o: &Options, partitioned: Arc<AtomicBool>) -> ! {
    let listener = match std::net::TcpListener::bind(o.listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("shimmer-udp-relay: cannot listen on {} (TCP): {e}", o.listen);
            std::process::exit(1);
        }
    };
    // The address bound, not the one asked for: `--listen 127.0.0.1:0` lets the caller read the
    // port from this line instead of picking a free one that another process may take first.
    let bound = listener.local_addr().map_or_else(|_| o.listen.to_string(), |a| a.to_string());
    eprintln!("shimmer-udp-relay: {bound} -> {} over TCP (delay {:?} each way)", o.to, o.delay);
    let (to, delay) = (o.to, o.delay);
    let counter = TurnCounter::start(o.count_file.clone());
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let (partitioned, counter) = (partitioned.clone(), counter.clone());
        std::thread::spawn(move || {
            let server = match std::net::TcpStream::connect(to) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("shimmer-udp-relay: cannot reach {to} for a client; dropping it: {e}");
                    return;
                }
            };
            for s in [&client, &server] {
                let _ = s.set_nodelay(true);
            }
            let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else { return };
            // Starts as if the far side had spoken, so the first reply counts.
            let talk = Arc::new(Conversation { far_side_spoke_last: AtomicBool::new(true), counter });
            pump(c2, server, delay, partitioned.clone(), (talk.clone(), false));
            pump(s2, client, delay, partitioned, (talk, true));
        });
    }
    std::process::exit(1)
}

/// Copies `from` to `to`, each chunk written `delay` after it was read, in order; at the end of
/// `from`, shuts `to`'s sending side. `side` is the conversation and whether `from` is its far
/// side (the server).
fn pump(mut from: std::net::TcpStream, mut to: std::net::TcpStream, delay: Duration, partitioned: Arc<AtomicBool>, side: (Arc<Conversation>, bool)) {
    use std::io::{Read, Write};
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Option<Vec<u8>>)>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let _ = tx.send((Instant::now() + delay, None));
                    return;
                }
                Ok(n) => {
                    side.0.heard(side.1);
                    if tx.send((Instant::now() + delay, Some(buf[..n].to_vec()))).is_err() {
                        return;
                    }
                }
            }
        }
    });
    std::thread::spawn(move || {
        while let Ok((due, chunk)) = rx.recv() {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            while partitioned.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(10));
            }
            match chunk {
                Some(bytes) if to.write_all(&bytes).is_ok() => {}
                _ => {
                    let _ = to.shutdown(std::net::Shutdown::Write);
                    return;
                }
            }
        }
    });
}
