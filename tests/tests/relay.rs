//! The LAN tests' relay (`shimmer-udp-relay`) in its TCP mode, the one a TCP peer (llama.cpp's
//! RPC backend) is measured through: bytes arrive whole and in order, each direction at least
//! the delay late, held while the partition file exists and delivered once it is gone; loss is
//! refused for TCP.

use std::io::{BufRead, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running relay, killed when dropped, and everything it has said on stderr.
struct Relay {
    child: std::process::Child,
    listen: String,
    said: Arc<Mutex<String>>,
}

impl Relay {
    /// Starts the relay listening on a port the kernel picks (`--listen 127.0.0.1:0`), read back
    /// from its first line: a port picked here and freed before the relay binds it could be
    /// taken by another process in between.
    fn start(args: &[&str]) -> Relay {
        let mut child = relay(&[&["--listen", "127.0.0.1:0"], args].concat()).spawn().unwrap();
        let said = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let (stderr, log) = (child.stderr.take().unwrap(), said.clone());
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line.clone());
                log.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let first = rx.recv_timeout(Duration::from_secs(10)).expect("the relay said nothing within 10 s");
        let listen = first
            .strip_prefix("shimmer-udp-relay: ")
            .and_then(|rest| rest.split(' ').next())
            .unwrap_or_else(|| panic!("the relay's first line names no address: {first}"))
            .to_string();
        Relay { child, listen, said }
    }

    fn said(&self) -> String {
        self.said.lock().unwrap().clone()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn relay(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_shimmer-udp-relay"));
    c.args(args).stdout(Stdio::null()).stderr(Stdio::piped());
    c
}

/// A server on a free port that hands every connection to `serve` on a thread of its own.
fn server(serve: fn(TcpStream)) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || serve(conn));
        }
    });
    addr
}

/// An echo server: every connection gets back what it sends.
fn echo_server() -> String {
    server(|mut conn| {
        let mut buf = vec![0u8; 65536];
        while let Ok(n) = conn.read(&mut buf) {
            if n == 0 || conn.write_all(&buf[..n]).is_err() {
                return;
            }
        }
    })
}

/// A request/reply server: each newline-ended request is answered, in two writes, with its
/// length.
fn line_server() -> String {
    server(|mut conn| {
        let _ = conn.set_nodelay(true);
        let (mut line, mut byte) = (0usize, [0u8; 1]);
        while conn.read_exact(&mut byte).is_ok() {
            line += 1;
            if byte[0] == b'\n' {
                let ok = conn.write_all(b"length ").is_ok() && {
                    std::thread::sleep(Duration::from_millis(5));
                    conn.write_all(format!("{line}\n").as_bytes()).is_ok()
                };
                if !ok {
                    return;
                }
                line = 0;
            }
        }
    })
}

/// A connection to the relay, which listens from the moment it names its address.
fn connect(addr: &str) -> TcpStream {
    TcpStream::connect(addr).unwrap_or_else(|e| panic!("cannot connect to the relay on {addr}: {e}"))
}

#[test]
fn tcp_through_the_relay_arrives_whole_in_order_late_by_the_delay_and_waits_out_a_partition() {
    let tmp = tempfile::tempdir().unwrap();
    let partition = tmp.path().join("partition");
    let upstream = echo_server();
    let relay = Relay::start(&["--tcp", "--to", &upstream, "--delay-ms", "40", "--partition-file", partition.to_str().unwrap()]);
    let mut s = connect(&relay.listen);
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // 1 MiB of a counting pattern, written by one thread while this one reads the echo.
    let sent: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    let t0 = Instant::now();
    let writer = {
        let (mut w, sent) = (s.try_clone().unwrap(), sent.clone());
        std::thread::spawn(move || w.write_all(&sent).unwrap())
    };
    let mut got = vec![0u8; sent.len()];
    s.read_exact(&mut got).unwrap();
    let took = t0.elapsed();
    writer.join().unwrap();
    assert!(got == sent, "the echo differs from what was sent");
    assert!(took >= Duration::from_millis(80), "a round trip through a 40 ms relay took {took:?}");
    // Partitioned, bytes wait; healed, they arrive.
    std::fs::write(&partition, b"").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    s.write_all(b"held").unwrap();
    s.set_read_timeout(Some(Duration::from_millis(400))).unwrap();
    let mut four = [0u8; 4];
    assert!(s.read_exact(&mut four).is_err(), "bytes crossed a partition");
    std::fs::remove_file(&partition).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.read_exact(&mut four).unwrap();
    assert_eq!(&four, b"held");
}

#[test]
fn loss_on_tcp_is_refused_with_a_reason() {
    let out =
        shimmer_tests::output_within(&mut relay(&["--tcp", "--listen", "127.0.0.1:1", "--to", "127.0.0.1:2", "--loss", "0.1"]), shimmer_tests::COMMAND_LIMIT);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--loss applies to UDP only"), "{err}");
}

#[test]
fn the_count_file_holds_the_round_trips_of_every_connection() {
    let tmp = tempfile::tempdir().unwrap();
    let count_file = tmp.path().join("round-trips");
    let upstream = line_server();
    let relay = Relay::start(&["--tcp", "--to", &upstream, "--count-file", count_file.to_str().unwrap()]);
    let listen = relay.listen.clone();
    // 5 exchanges on one connection and 3 on another; a request sent as two writes, and a reply
    // written in two, are still one.
    for (exchanges, conn) in [(5, connect(&listen)), (3, connect(&listen))] {
        let mut conn = conn;
        conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        for i in 0..exchanges {
            let said = || relay.said();
            conn.write_all(format!("request {i} ").as_bytes()).unwrap_or_else(|e| panic!("{e}; the relay said:\n{}", said()));
            std::thread::sleep(Duration::from_millis(5));
            conn.write_all(b"second half\n").unwrap_or_else(|e| panic!("{e}; the relay said:\n{}", said()));
            let want = format!("length {}\n", format!("request {i} second half\n").len());
            let mut got = vec![0u8; want.len()];
            conn.read_exact(&mut got).unwrap_or_else(|e| panic!("{e}; the relay said:\n{}", said()));
            assert_eq!(got, want.as_bytes());
        }
    }
    let read = || std::fs::read_to_string(&count_file).ok().and_then(|s| s.trim().parse::<u64>().ok());
    let until = Instant::now() + Duration::from_secs(10);
    while read() != Some(8) {
        assert!(Instant::now() < until, "the count file says {:?}, not 8 round trips", read());
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(read(), Some(8), "the count moved with nothing sent");
}

#[test]
fn counting_needs_tcp() {
    let out =
        shimmer_tests::output_within(&mut relay(&["--listen", "127.0.0.1:1", "--to", "127.0.0.1:2", "--count-file", "/tmp/x"]), shimmer_tests::COMMAND_LIMIT);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("needs --tcp"), "{err}");
}
