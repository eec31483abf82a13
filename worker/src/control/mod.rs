//! The control plane's driver: one member's `shimmer_control::ControlNode` on its own thread,
//! Raft messages and the admin API over tonic gRPC (`codec`, the generated `Control` service),
//! TLS and the join-token proof on every connection (`tls`), joining and bootstrapping.
//!
//! Must never: decide what the node decides (elections, membership, what is committed); decode a
//! Raft message from a connection that did not prove the token; answer a status read before the
//! node confirmed it with the leader (ReadIndex) or say a peer is up from a follower's view.

pub mod codec;
pub mod discovery;
pub mod follow;
pub mod tls;

#[allow(clippy::all, unreachable_pub, missing_docs)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/shimmer.control.v1.Control.rs"));
}

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use generated::control_client::ControlClient;
use generated::control_server::{Control, ControlServer};
use serde::{Deserialize, Serialize};
use shimmer_control::state::{Command, Member, MemberChange, NodeId, Outcome};
use shimmer_control::{ClusterState, ClusterToken, ControlNode, ModelPlacement, NodeConfig, NodeError, PlacementRecord, RaftLog, RaftMessage, StateRole};
use tokio::sync::{mpsc, oneshot};

pub use tls::{ClusterCa, ControlTrust, TrustError};

/// How long a proposal or read may take before the caller hears "try again".
const COMMIT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a joining node keeps trying the members it was given.
const JOIN_TIMEOUT: Duration = Duration::from_secs(60);
const RPC_TIMEOUT: Duration = Duration::from_secs(5);
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Raft messages queued per peer before new ones are dropped (Raft resends).
const PEER_QUEUE: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error(transparent)]
    Trust(#[from] TrustError),
    #[error("{0}")]
    Join(String),
    #[error("cannot listen on {addr} (TCP, the control plane): {reason}")]
    Listen { addr: String, reason: String },
    #[error("{0}")]
    DataDir(String),
    #[error("{0}")]
    Rpc(String),
}

/// How the node enters the cluster when its data directory is new.
#[derive(Debug, Clone)]
pub enum Start {
    Bootstrap,
    Join(Vec<String>),
    /// Join through the seeds, or start a new cluster when none of them answers within
    /// `ALONE_AFTER`: the node a StatefulSet names to bootstrap (`--bootstrap-on`), which must
    /// not found a second cluster when it comes back without its data while the others run.
    JoinOrBootstrap(Vec<String>),
}

/// How long a `JoinOrBootstrap` node waits for any seed to answer before it starts the cluster.
const ALONE_AFTER: Duration = Duration::from_secs(5);

pub struct ControlOptions {
    pub data_dir: PathBuf,
    /// The TCP address to listen on.
    pub listen: String,
    /// This node as the others see it (its name, control address, data address, capacity).
    pub member: Member,
    pub start: Start,
    /// The join token and/or operator certificates members prove each other with.
    pub trust: ControlTrust,
    pub node: NodeConfig,
    /// Advertise this member on mDNS (`_shimmer._udp.local.`), so `--join mdns` finds it.
    pub mdns: bool,
}

/// What this node records about itself beside its log.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct NodeRecord {
    name: String,
    cluster_id: String,
}

/// A member as `cluster status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberView {
    pub name: String,
    /// The `--listen` HOST:PORT as given (the data plane's for a worker).
    pub addr: String,
    pub control_addr: String,
    pub kind: String,
    pub role: String,
    /// What the leader sees from heartbeats; `None` when no leader could be asked.
    pub up: Option<bool>,
    pub draining: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlacementView {
    pub model: String,
    /// The active epoch (0: none yet).
    pub epoch: u64,
    /// The active placement's workers.
    pub workers: Vec<String>,
    /// An epoch being prepared, and how many of its workers are ready.
    pub proposed: Option<u64>,
    pub ready: usize,
    /// The epoch before the active one, while a coordinator may still route by it.
    #[serde(default)]
    pub previous: Option<u64>,
    /// Per member coordinator, the epoch it says it routes by.
    #[serde(default)]
    pub routed: std::collections::BTreeMap<String, u64>,
    /// Routing heat reports merged for the model so far.
    pub heat_reports: u64,
}

/// The answer to `cluster status`: the replicated state as of a ReadIndex read, with the
/// leader's liveness view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusView {
    pub cluster_id: String,
    pub leader: Option<String>,
    pub term: u64,
    pub commit: u64,
    pub applied: u64,
    pub members: Vec<MemberView>,
    pub placements: Vec<PlacementView>,
    /// The member that answered.
    pub answered_by: String,
}

/// What the admin service is asked (JSON in the `Admin` RPC).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AdminRequest {
    Join {
        member: Member,
    },
    Status {
        forwarded: bool,
    },
    Drain {
        name: String,
        draining: bool,
    },
    Remove {
        name: String,
    },
    Token,
    /// A model's active placement, as of a ReadIndex read (for coordinators that are not members).
    Placement {
        model: String,
    },
    /// Re-plan every placed model by its routing heat now (the leader answers).
    Rebalance {
        dry_run: bool,
    },
}

/// What a rebalance did or would do for one model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RebalanceView {
    pub model: String,
    /// The busiest worker's share of first-asked selections over the mean (1.0: even).
    pub imbalance_now: f64,
    pub imbalance_after: f64,
    /// The epoch proposed (or, with --dry-run, that would be); `None`: the plan is the active one.
    pub epoch: Option<u64>,
    pub proposed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum AdminReply {
    Joined { cluster_id: String, ca_cert_der: Vec<u8>, ca_key_pem: String, members: Vec<(String, String)> },
    Status { status: StatusView },
    Done { message: String },
    Token { token: String },
    Placement { record: Option<PlacementRecord> },
    Rebalanced { models: Vec<RebalanceView> },
    Error { message: String },
}

type Reply<T> = oneshot::Sender<Result<T, String>>;

enum Event {
    Raft(RaftMessage, String),
    Propose(Command, Reply<Outcome>),
    Change(MemberChange, Reply<Outcome>),
    Read(Reply<(ClusterState, Liveness)>),
    Rebalance(bool, Reply<Vec<RebalanceView>>),
    Unreachable(NodeId),
    Stop,
}

/// What the node knows beyond the state: its Raft status and the leader's liveness view.
#[derive(Debug, Clone, Default)]
struct Liveness {
    leader: NodeId,
    term: u64,
    commit: u64,
    is_leader: bool,
    up: BTreeMap<NodeId, bool>,
    leader_changes: u64,
    failed_proposals: u64,
}

/// This member's Raft figures, for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RaftMetrics {
    pub term: u64,
    pub is_leader: bool,
    /// The leader's name, when one is known.
    pub leader: Option<String>,
    pub commit: u64,
    pub applied: u64,
    /// Leader changes this member has seen since it started.
    pub leader_changes: u64,
    /// Proposals refused before they were appended (no leader, a change in progress).
    pub failed_proposals: u64,
    pub voters: usize,
    pub learners: usize,
    /// Per model, its active placement epoch.
    pub placements: Vec<(String, u64)>,
}

/// What the service reads without asking the node thread.
#[derive(Default)]
struct Shared {
    state: ClusterState,
    live: Liveness,
    /// Counts applied changes of `state`, so followers of it can poll cheaply.
    version: u64,
}

/// A running member of the control plane.
pub struct ControlPlane {
    events: std_mpsc::Sender<Event>,
    shared: Arc<Mutex<Shared>>,
    rt: Mutex<Option<tokio::runtime::Runtime>>,
    thread: Mutex<Option<std::thread::JoinHandle<Result<(), NodeError>>>>,
    pub local_addr: SocketAddr,
    pub name: String,
    pub cluster_id: String,
    ca: ClusterCa,
    trust: ControlTrust,
    _mdns: Option<discovery::MdnsAdvert>,
}

impl ControlPlane {
    /// Starts this member: resumes from `data_dir` if it holds a log, else bootstraps a new
    /// cluster or joins one through the given members.
    pub fn start(opts: ControlOptions) -> Result<ControlPlane, ControlError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("shimmer-control")
            .enable_all()
            .build()
            .map_err(|e| ControlError::Rpc(format!("cannot start the control plane's runtime: {e}")))?;
        let trust = opts.trust.clone();
        let (log, record) = RaftLog::open(&opts.data_dir).map_err(NodeError::from)?;
        let record: Option<NodeRecord> = match record {
            Some(b) => Some(
                serde_json::from_slice(&b).map_err(|e| ControlError::DataDir(format!("{}: the node record does not decode: {e}", opts.data_dir.display())))?,
            ),
            None => None,
        };
        let me = opts.member.clone();
        let id = me.id();
        let (node, ca, cluster_id) = match (record, &opts.start) {
            (Some(rec), _) => {
                if rec.name != me.name {
                    return Err(ControlError::DataDir(format!(
                        "{} belongs to node {:?}, not {:?}: start it with that name (--listen/--name), or use another --data-dir",
                        opts.data_dir.display(),
                        rec.name,
                        me.name
                    )));
                }
                let ca =
                    ClusterCa::load(&opts.data_dir)?.ok_or_else(|| ControlError::DataDir(format!("{}: the cluster CA is missing", opts.data_dir.display())))?;
                (ControlNode::restart(log, opts.node.clone(), id)?, ca, rec.cluster_id)
            }
            (None, Start::Bootstrap) => bootstrap(&log, &opts, &me)?,
            (None, Start::JoinOrBootstrap(seeds)) if rt.block_on(join(seeds, &me, &trust, Some(ALONE_AFTER)))?.is_none() => {
                tracing::info!("no member answered through {} within {ALONE_AFTER:?}: starting a new cluster", seeds.join(","));
                bootstrap(&log, &opts, &me)?
            }
            (None, Start::Join(seeds) | Start::JoinOrBootstrap(seeds)) => {
                let joined = rt.block_on(join(seeds, &me, &trust, None))?.ok_or_else(|| ControlError::Join("no member answered".into()))?;
                let AdminReply::Joined { cluster_id, ca_cert_der, ca_key_pem, .. } = joined else {
                    return Err(ControlError::Join("unexpected answer to a join".into()));
                };
                let ca = ClusterCa { cert_der: ca_cert_der, key_pem: ca_key_pem };
                if let Some(pin) = trust.token().and_then(|t| t.ca_sha256()) {
                    if ca.sha256() != pin {
                        return Err(ControlError::Join("the cluster's CA is not the one the join token pins".into()));
                    }
                }
                ca.save(&opts.data_dir)?;
                log.set_node_record(&serde_json::to_vec(&NodeRecord { name: me.name.clone(), cluster_id: cluster_id.clone() }).unwrap_or_default())
                    .map_err(NodeError::from)?;
                (ControlNode::restart(log, opts.node.clone(), id)?, ca, cluster_id)
            }
        };
        let listener =
            rt.block_on(tokio::net::TcpListener::bind(&opts.listen)).map_err(|e| ControlError::Listen { addr: opts.listen.clone(), reason: e.to_string() })?;
        let local_addr = listener.local_addr().map_err(|e| ControlError::Listen { addr: opts.listen.clone(), reason: e.to_string() })?;
        let shared = Arc::new(Mutex::new(Shared { state: node.state.clone(), live: Liveness::default(), version: 1 }));
        let (events, rx) = std_mpsc::channel();
        let service = Service {
            events: events.clone(),
            shared: shared.clone(),
            ca: ca.clone(),
            trust: trust.clone(),
            name: me.name.clone(),
            cluster_id: cluster_id.clone(),
        };
        let cluster_id_out = cluster_id.clone();
        let acceptor = tls::acceptor(&ca, &trust)?;
        rt.spawn(serve(listener, acceptor, trust.clone(), service));
        let handle = rt.handle().clone();
        let (thread_events, thread_shared, thread_trust) = (events.clone(), shared.clone(), trust.clone());
        let me_for_thread = me.clone();
        let thread = std::thread::Builder::new()
            .name("shimmer-raft".into())
            .spawn(move || {
                let driver = Driver::new(node, me_for_thread, cluster_id, handle, thread_trust, thread_events, thread_shared);
                driver.run(rx)
            })
            .map_err(|e| ControlError::Rpc(format!("cannot start the Raft thread: {e}")))?;
        let mdns = match opts.mdns {
            true => match discovery::MdnsAdvert::start(&me.name, &cluster_id_out, &me.control_addr) {
                Ok(a) => Some(a),
                Err(e) => {
                    tracing::warn!("not advertised on mDNS (`--join mdns` will not find this member): {e}");
                    None
                }
            },
            false => None,
        };
        Ok(ControlPlane {
            events,
            shared,
            rt: Mutex::new(Some(rt)),
            thread: Mutex::new(Some(thread)),
            local_addr,
            name: me.name,
            cluster_id: cluster_id_out,
            ca,
            trust,
            _mdns: mdns,
        })
    }

    /// The cluster's join token, pinning its CA (none when members trust operator certificates
    /// alone).
    pub fn token(&self) -> Option<String> {
        pinned_token(&self.trust, &self.ca).ok()
    }

    /// The state as this member last applied it (not a linearizable read).
    pub fn state(&self) -> ClusterState {
        lock(&self.shared).state.clone()
    }

    /// A model's placements as this member last applied them, with the state's version.
    pub fn placement(&self, model: &str) -> (u64, Option<ModelPlacement>) {
        let sh = lock(&self.shared);
        (sh.version, sh.state.placements.get(model).cloned())
    }

    /// The cluster as this member last applied it, with its own liveness view (`up` only when
    /// it leads): for displays; `cluster status` reads through the leader instead.
    pub fn local_status(&self) -> StatusView {
        let sh = lock(&self.shared);
        status_view(&sh.state, &sh.live, &self.name)
    }

    pub fn metrics(&self) -> RaftMetrics {
        let sh = lock(&self.shared);
        RaftMetrics {
            term: sh.live.term,
            is_leader: sh.live.is_leader,
            leader: sh.state.members.get(&sh.live.leader).map(|m| m.name.clone()),
            commit: sh.live.commit,
            applied: sh.state.applied,
            leader_changes: sh.live.leader_changes,
            failed_proposals: sh.live.failed_proposals,
            voters: sh.state.voters.len(),
            learners: sh.state.learners.len(),
            placements: sh.state.placements.iter().map(|(m, p)| (m.clone(), p.epoch())).collect(),
        }
    }

    /// Whether this node is in the cluster's membership with a leader known (what `/ready`
    /// asks of a member).
    pub fn is_member_with_leader(&self) -> bool {
        let sh = lock(&self.shared);
        sh.live.leader != 0 && sh.state.members.values().any(|m| m.name == self.name)
    }

    /// How many times the applied state changed (cheap to poll).
    pub fn version(&self) -> u64 {
        lock(&self.shared).version
    }

    /// Proposes a command (a follower's goes to the leader through Raft) and waits until it is
    /// applied or refused. Blocks: call it from a thread of its own, not a runtime's.
    pub fn propose(&self, command: Command) -> Result<Outcome, ControlError> {
        let (tx, rx) = oneshot::channel();
        self.events.send(Event::Propose(command, tx)).map_err(|_| ControlError::Rpc("the control plane stopped".into()))?;
        match rx.blocking_recv() {
            Ok(r) => r.map_err(ControlError::Rpc),
            Err(_) => Err(ControlError::Rpc("the control plane stopped".into())),
        }
    }

    /// Whether this member's thread stopped (its log failed, or it was removed).
    pub fn stopped(&self) -> bool {
        self.thread.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_none_or(|t| t.is_finished())
    }

    /// Stops this member and waits for its Raft thread; its error (a log that could not be
    /// written) if it failed. Later calls find it stopped.
    pub fn stop(&self) -> Result<(), ControlError> {
        let _ = self.events.send(Event::Stop);
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        let result = match thread {
            Some(t) => match t.join() {
                Ok(r) => r.map_err(ControlError::from),
                Err(payload) => Err(ControlError::Rpc(raft_panic_reason(payload.as_ref()))),
            },
            None => Ok(()),
        };
        if let Some(rt) = self.rt.lock().unwrap_or_else(|p| p.into_inner()).take() {
            rt.shutdown_background();
        }
        result
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A new cluster with `me` as its first member: a new CA, a new cluster id.
fn bootstrap(log: &RaftLog, opts: &ControlOptions, me: &Member) -> Result<(ControlNode, ClusterCa, String), ControlError> {
    let ca = ClusterCa::generate()?;
    ca.save(&opts.data_dir)?;
    let cluster_id = tls::random_id();
    let node = ControlNode::bootstrap(log.clone(), opts.node.clone(), me.clone(), cluster_id.clone())?;
    log.set_node_record(&serde_json::to_vec(&NodeRecord { name: me.name.clone(), cluster_id: cluster_id.clone() }).unwrap_or_default())
        .map_err(NodeError::from)?;
    Ok((node, ca, cluster_id))
}

/// Asks the members the seeds stand for (found again each round: members appear), in turn and
/// again until `JOIN_TIMEOUT`, to add this node. With `alone_after`, `None` once that long has
/// passed with nothing at any seed's address answering at all (a refusal or an error reply is an
/// answer: a cluster is there).
async fn join(seeds: &[String], me: &Member, trust: &ControlTrust, alone_after: Option<Duration>) -> Result<Option<AdminReply>, ControlError> {
    if seeds.is_empty() {
        return Err(ControlError::Join("this data directory holds no cluster yet and no member to join was given (--join)".into()));
    }
    let parsed = discovery::parse_seeds(seeds).map_err(ControlError::Join)?;
    let started = Instant::now();
    let deadline = started + JOIN_TIMEOUT;
    let mut errors: BTreeMap<String, String> = BTreeMap::new();
    let mut answered = false;
    loop {
        let (found, problems) = {
            let parsed = parsed.clone();
            // A resolver that died says so in the reason given up with, not as an empty list.
            match tokio::task::spawn_blocking(move || discovery::resolve(&parsed)).await {
                Ok(resolved) => resolved,
                Err(e) => (Vec::new(), vec![format!("resolving the seeds failed: {e}")]),
            }
        };
        for p in problems {
            errors.insert("discovery".into(), p);
        }
        for (addr, discovered) in found.iter().filter(|(a, _)| *a != me.control_addr) {
            let reply = admin(addr, trust, &AdminRequest::Join { member: me.clone() }).await;
            answered |= !matches!(reply, Err(ControlError::Trust(TrustError::Connect { .. })));
            match reply {
                Ok(AdminReply::Error { message }) => {
                    errors.insert(addr.clone(), message);
                }
                Ok(reply) => return Ok(Some(reply)),
                // A wrong token or another cluster's CA at an address the user gave will not get
                // better by waiting; one found on the LAN may be another cluster's.
                Err(e @ ControlError::Trust(TrustError::Refused { .. } | TrustError::WrongCa { .. })) if !discovered => {
                    return Err(ControlError::Join(format!("cannot join: {e}")))
                }
                Err(e) => {
                    errors.insert(addr.clone(), e.to_string());
                }
            }
        }
        if alone_after.is_some_and(|wait| !answered && started.elapsed() >= wait) {
            return Ok(None);
        }
        if Instant::now() >= deadline {
            let why: Vec<String> = errors.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            return Err(ControlError::Join(format!("cannot join through {}: {}", seeds.join(","), why.join("; "))));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn client(addr: &str, trust: &ControlTrust) -> Result<ControlClient<tonic::transport::Channel>, ControlError> {
    let endpoint =
        tonic::transport::Endpoint::from_shared(format!("http://{addr}")).map_err(|e| ControlError::Rpc(format!("{addr}: {e}")))?.connect_timeout(RPC_TIMEOUT);
    let (addr_s, trust) = (addr.to_string(), trust.clone());
    // The first connection is made here so that a refusal is reported as such.
    let first = Arc::new(Mutex::new(Some(tls::dial(&addr_s, &trust).await?)));
    let channel = endpoint
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let (addr, trust, first) = (addr_s.clone(), trust.clone(), first.clone());
            async move {
                let ready = first.lock().unwrap_or_else(|p| p.into_inner()).take();
                let conn = match ready {
                    Some(c) => c,
                    None => tls::dial(&addr, &trust).await.map_err(std::io::Error::other)?,
                };
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(conn))
            }
        }))
        .await
        .map_err(|e| ControlError::Rpc(format!("{addr}: {e}")))?;
    Ok(ControlClient::new(channel).max_decoding_message_size(codec::MAX_MESSAGE_BYTES).max_encoding_message_size(codec::MAX_MESSAGE_BYTES))
}

/// The join token that pins the cluster's CA, from the secret this member has.
fn pinned_token(trust: &ControlTrust, ca: &ClusterCa) -> Result<String, String> {
    let token = trust.token().ok_or("this cluster's members trust operator certificates and were given no join token; there is none to print")?;
    ClusterToken::pinned(token.secret(), &ca.cert_der).map(|t| t.to_token_string()).map_err(|e| e.to_string())
}

/// One admin call to a member.
pub async fn admin(addr: &str, trust: &ControlTrust, req: &AdminRequest) -> Result<AdminReply, ControlError> {
    let mut c = client(addr, trust).await?;
    let body = serde_json::to_vec(req).map_err(|e| ControlError::Rpc(e.to_string()))?;
    let mut request = tonic::Request::new(body);
    // A change may wait for one in progress, and a follower hands it to the leader.
    request.set_timeout(ADMIN_TIMEOUT);
    let reply = c.admin(request).await.map_err(|s| ControlError::Rpc(format!("{addr}: {}", s.message())))?;
    serde_json::from_slice(reply.get_ref()).map_err(|e| ControlError::Rpc(format!("{addr}: not an admin reply: {e}")))
}

/// Asks members in turn (dead ones skipped) until one answers. `addrs` are `--join` entries:
/// HOST:PORT, `mdns` or `dns:NAME[:PORT]`.
pub fn admin_any(addrs: &[String], trust: &ControlTrust, req: &AdminRequest) -> Result<AdminReply, ControlError> {
    let seeds = discovery::parse_seeds(addrs).map_err(ControlError::Rpc)?;
    let (found, problems) = discovery::resolve(&seeds);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| ControlError::Rpc(e.to_string()))?;
    rt.block_on(async {
        let mut errors = problems;
        for (a, discovered) in &found {
            match admin(a, trust, req).await {
                Ok(r) => return Ok(r),
                Err(e @ ControlError::Trust(TrustError::Refused { .. } | TrustError::WrongCa { .. })) if !discovered => return Err(e),
                Err(e) => errors.push(e.to_string()),
            }
        }
        Err(ControlError::Rpc(format!("no member answered: {}", errors.join("; "))))
    })
}

async fn serve(listener: tokio::net::TcpListener, acceptor: tokio_rustls::TlsAcceptor, trust: ControlTrust, service: Service) {
    let (tx, rx) = mpsc::channel::<Result<tls::Authed<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>, std::io::Error>>(64);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, peer)) = listener.accept().await else { continue };
            let _ = tcp.set_nodelay(true);
            let (acceptor, trust, tx) = (acceptor.clone(), trust.clone(), tx.clone());
            tokio::spawn(async move {
                match tls::accept(tcp, &acceptor, &trust).await {
                    Ok(conn) => {
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Err(why) => tracing::warn!(%peer, "control plane: refused a connection: {why}"),
                }
            });
        }
    });
    let incoming = tokio_stream::wrappers::ReceiverStream::new(rx);
    let svc = ControlServer::new(service).max_decoding_message_size(codec::MAX_MESSAGE_BYTES).max_encoding_message_size(codec::MAX_MESSAGE_BYTES);
    if let Err(e) = tonic::transport::Server::builder().add_service(svc).serve_with_incoming(incoming).await {
        tracing::error!("control plane server stopped: {e}");
    }
}

#[derive(Clone)]
struct Service {
    events: std_mpsc::Sender<Event>,
    shared: Arc<Mutex<Shared>>,
    ca: ClusterCa,
    trust: ControlTrust,
    name: String,
    cluster_id: String,
}

impl Service {
    async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Event) -> Result<T, String> {
        let (tx, rx) = oneshot::channel();
        self.events.send(make(tx)).map_err(|_| "this member is stopping".to_string())?;
        match tokio::time::timeout(COMMIT_TIMEOUT + Duration::from_secs(1), rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err("this member is stopping".into()),
            Err(_) => Err("no answer from the Raft node in time; try again".into()),
        }
    }

    async fn status(&self, forwarded: bool) -> Result<StatusView, String> {
        let (state, live) = self.ask(Event::Read).await?;
        if !live.is_leader && !forwarded {
            // Only the leader knows who is up: ask it.
            if let Some(leader) = state.members.get(&live.leader) {
                if let Ok(AdminReply::Status { status }) = admin(&leader.control_addr, &self.trust, &AdminRequest::Status { forwarded: true }).await {
                    return Ok(status);
                }
            }
        }
        Ok(status_view(&state, &live, &self.name))
    }

    /// Membership changes are made by the leader: a follower hands the request on, once a
    /// leader is known (`None`: this node leads).
    async fn on_leader(&self, req: &AdminRequest) -> Option<AdminReply> {
        let deadline = Instant::now() + COMMIT_TIMEOUT;
        loop {
            let (leader, is_leader, addr) = {
                let sh = lock(&self.shared);
                (sh.live.leader, sh.live.is_leader, sh.state.members.get(&sh.live.leader).map(|m| m.control_addr.clone()))
            };
            if is_leader {
                return None;
            }
            if let (true, Some(addr)) = (leader != 0, addr) {
                return Some(
                    admin(&addr, &self.trust, req).await.unwrap_or_else(|e| AdminReply::Error { message: format!("the leader {addr} did not answer: {e}") }),
                );
            }
            if Instant::now() >= deadline {
                return Some(AdminReply::Error { message: "no leader is known; try again".into() });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn handle(&self, req: AdminRequest) -> AdminReply {
        if matches!(req, AdminRequest::Join { .. } | AdminRequest::Remove { .. } | AdminRequest::Rebalance { .. }) {
            if let Some(reply) = self.on_leader(&req).await {
                return reply;
            }
        }
        let result: Result<AdminReply, String> = async {
            match req {
                AdminRequest::Join { member } => {
                    member.validate()?;
                    let known = lock(&self.shared).state.member_named(&member.name).cloned();
                    match known {
                        Some(m) if m == member => {}
                        Some(_) => {
                            let outcome = self.ask(|r| Event::Propose(Command::UpdateMember { member: member.clone() }, r)).await?;
                            check(outcome)?;
                        }
                        None => {
                            let outcome = self.ask(|r| Event::Change(MemberChange::Add { member: member.clone() }, r)).await?;
                            check(outcome)?;
                        }
                    }
                    let st = lock(&self.shared).state.clone();
                    Ok(AdminReply::Joined {
                        cluster_id: st.cluster_id.clone(),
                        ca_cert_der: self.ca.cert_der.clone(),
                        ca_key_pem: self.ca.key_pem.clone(),
                        members: st.members.values().map(|m| (m.name.clone(), m.control_addr.clone())).collect(),
                    })
                }
                AdminRequest::Status { forwarded } => Ok(AdminReply::Status { status: self.status(forwarded).await? }),
                AdminRequest::Drain { name, draining } => {
                    let outcome = self.ask(|r| Event::Propose(Command::SetDraining { name: name.clone(), draining }, r)).await?;
                    check(outcome)?;
                    Ok(AdminReply::Done { message: format!("{name} is {}", if draining { "draining" } else { "no longer draining" }) })
                }
                AdminRequest::Remove { name } => {
                    let st = lock(&self.shared).state.clone();
                    let m = st.member_named(&name).ok_or_else(|| format!("{name} is not a member"))?;
                    if st.voters.contains(&m.id()) {
                        // A voter leaves the quorum first.
                        check(self.ask(|r| Event::Change(MemberChange::Demote { name: name.clone() }, r)).await?)?;
                    }
                    check(self.ask(|r| Event::Change(MemberChange::Remove { name: name.clone() }, r)).await?)?;
                    Ok(AdminReply::Done { message: format!("{name} removed") })
                }
                AdminRequest::Rebalance { dry_run } => Ok(AdminReply::Rebalanced { models: self.ask(|r| Event::Rebalance(dry_run, r)).await? }),
                AdminRequest::Placement { model } => {
                    let (state, _) = self.ask(Event::Read).await?;
                    Ok(AdminReply::Placement { record: state.placements.get(&model).and_then(|p| p.active.clone()) })
                }
                AdminRequest::Token => Ok(AdminReply::Token { token: pinned_token(&self.trust, &self.ca)? }),
            }
        }
        .await;
        result.unwrap_or_else(|message| AdminReply::Error { message })
    }
}

fn check(outcome: Outcome) -> Result<(), String> {
    match outcome {
        Outcome::Applied => Ok(()),
        Outcome::Rejected(why) => Err(why),
    }
}

fn status_view(state: &ClusterState, live: &Liveness, answered_by: &str) -> StatusView {
    let mut members: Vec<&Member> = state.members.values().collect();
    members.sort_by(|a, b| a.name.cmp(&b.name));
    StatusView {
        cluster_id: state.cluster_id.clone(),
        leader: state.members.get(&live.leader).map(|m| m.name.clone()),
        term: live.term,
        commit: live.commit,
        applied: state.applied,
        members: members
            .into_iter()
            .map(|m| MemberView {
                name: m.name.clone(),
                addr: m.data_addr.clone().unwrap_or_else(|| m.control_addr.clone()),
                control_addr: m.control_addr.clone(),
                kind: serde_json::to_value(m.kind).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default(),
                role: state.role(m.id()).unwrap_or("none").to_string(),
                up: if live.is_leader { live.up.get(&m.id()).copied() } else { None },
                draining: m.draining,
            })
            .collect(),
        placements: state
            .placements
            .iter()
            .map(|(model, p)| PlacementView {
                model: model.clone(),
                epoch: p.epoch(),
                workers: p.active.as_ref().map(|a| a.placement.workers.iter().map(|w| w.name.clone()).collect()).unwrap_or_default(),
                proposed: p.proposed.as_ref().map(|r| r.epoch),
                ready: p.ready.len(),
                previous: p.previous,
                routed: p.routed.clone(),
                heat_reports: state.heat.get(model).map_or(0, |h| h.reports),
            })
            .collect(),
        answered_by: answered_by.to_string(),
    }
}

#[tonic::async_trait]
impl Control for Service {
    async fn raft(&self, request: tonic::Request<Vec<u8>>) -> Result<tonic::Response<Vec<u8>>, tonic::Status> {
        let (cluster, from, msg) = shimmer_control::envelope::decode(request.get_ref()).map_err(tonic::Status::invalid_argument)?;
        if cluster != self.cluster_id {
            return Err(tonic::Status::failed_precondition(format!("this node is in cluster {}, not {cluster}", self.cluster_id)));
        }
        self.events.send(Event::Raft(msg, from)).map_err(|_| tonic::Status::unavailable("stopping"))?;
        Ok(tonic::Response::new(Vec::new()))
    }

    async fn admin(&self, request: tonic::Request<Vec<u8>>) -> Result<tonic::Response<Vec<u8>>, tonic::Status> {
        if request.get_ref().len() > shimmer_control::state::MAX_COMMAND_BYTES {
            return Err(tonic::Status::invalid_argument("admin request over the size limit"));
        }
        let req: AdminRequest = serde_json::from_slice(request.get_ref()).map_err(|e| tonic::Status::invalid_argument(format!("not an admin request: {e}")))?;
        let reply = self.handle(req).await;
        Ok(tonic::Response::new(serde_json::to_vec(&reply).unwrap_or_default()))
    }
}

/// The Raft thread: feeds the node events and ticks, carries out its output.
struct Driver {
    node: ControlNode,
    me: Member,
    cluster_id: String,
    rt: tokio::runtime::Handle,
    trust: ControlTrust,
    events: std_mpsc::Sender<Event>,
    shared: Arc<Mutex<Shared>>,
    start: Instant,
    peers: HashMap<NodeId, (String, mpsc::Sender<Vec<u8>>)>,
    addr_hints: HashMap<NodeId, String>,
    proposals: HashMap<u64, (Reply<Outcome>, Instant)>,
    /// Proposals that could not be made yet (no leader, a change in progress), retried each tick.
    waiting: Vec<(Event, Instant)>,
    reads: HashMap<u64, (Reply<(ClusterState, Liveness)>, Instant)>,
    next_read: u64,
    updated_self: bool,
}

impl Driver {
    fn new(
        node: ControlNode,
        me: Member,
        cluster_id: String,
        rt: tokio::runtime::Handle,
        trust: ControlTrust,
        events: std_mpsc::Sender<Event>,
        shared: Arc<Mutex<Shared>>,
    ) -> Driver {
        Driver {
            node,
            me,
            cluster_id,
            rt,
            trust,
            events,
            shared,
            start: Instant::now(),
            peers: HashMap::new(),
            addr_hints: HashMap::new(),
            proposals: HashMap::new(),
            waiting: Vec::new(),
            reads: HashMap::new(),
            next_read: 0,
            updated_self: false,
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn run(mut self, rx: std_mpsc::Receiver<Event>) -> Result<(), NodeError> {
        let tick = Duration::from_millis(self.node.config().tick_ms);
        let mut next_tick = Instant::now() + tick;
        loop {
            let wait = next_tick.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok(Event::Stop) | Err(std_mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
                Ok(ev) => self.handle(ev)?,
                Err(std_mpsc::RecvTimeoutError::Timeout) => {}
            }
            if Instant::now() >= next_tick {
                next_tick += tick;
                let now = self.now();
                let out = self.node.tick(now)?;
                self.carry_out(out);
                self.retry_waiting()?;
                self.expire();
                self.update_self()?;
            }
        }
    }

    fn handle(&mut self, ev: Event) -> Result<(), NodeError> {
        let now = self.now();
        match ev {
            Event::Raft(msg, from_addr) => {
                if !from_addr.is_empty() {
                    self.addr_hints.insert(msg.from, from_addr);
                }
                let out = self.node.step(msg, now)?;
                self.carry_out(out);
            }
            Event::Unreachable(id) => self.node.report_unreachable(id),
            Event::Rebalance(dry_run, reply) => match self.node.rebalance_now(dry_run) {
                Ok((reports, out)) => {
                    let views = reports
                        .into_iter()
                        .map(|r| RebalanceView {
                            model: r.model,
                            imbalance_now: r.imbalance_now,
                            imbalance_after: r.imbalance_after,
                            epoch: r.record.as_ref().map(|x| x.epoch),
                            proposed: !dry_run && r.record.is_some(),
                        })
                        .collect();
                    let _ = reply.send(Ok(views));
                    self.carry_out(out);
                }
                Err(e) => {
                    let _ = reply.send(Err(e.to_string()));
                }
            },
            Event::Read(reply) => {
                self.next_read += 1;
                let id = self.next_read;
                self.reads.insert(id, (reply, Instant::now() + COMMIT_TIMEOUT));
                let out = self.node.read(id, now)?;
                self.carry_out(out);
            }
            ev @ (Event::Propose(..) | Event::Change(..)) => self.try_propose(ev, Instant::now() + COMMIT_TIMEOUT)?,
            Event::Stop => {}
        }
        Ok(())
    }

    fn try_propose(&mut self, ev: Event, deadline: Instant) -> Result<(), NodeError> {
        let (result, reply) = match ev {
            Event::Propose(cmd, reply) => (self.node.propose(cmd.clone()).map_err(|e| (e, Event::Propose(cmd, oneshot::channel().0))), reply),
            Event::Change(change, reply) => {
                (self.node.propose_member_change(change.clone()).map_err(|e| (e, Event::Change(change, oneshot::channel().0))), reply)
            }
            _ => return Ok(()),
        };
        match result {
            Ok((seq, out)) => {
                self.proposals.insert(seq, (reply, deadline));
                self.carry_out(out);
            }
            Err((NodeError::NoLeader | NodeError::ChangeInProgress, again)) => {
                let again = match again {
                    Event::Propose(c, _) => Event::Propose(c, reply),
                    Event::Change(c, _) => Event::Change(c, reply),
                    other => other,
                };
                self.waiting.push((again, deadline));
            }
            Err((e, _)) => {
                let _ = reply.send(Err(e.to_string()));
            }
        }
        Ok(())
    }

    fn retry_waiting(&mut self) -> Result<(), NodeError> {
        for (ev, deadline) in std::mem::take(&mut self.waiting) {
            if Instant::now() >= deadline {
                let reply = match ev {
                    Event::Propose(_, r) | Event::Change(_, r) => Some(r),
                    _ => None,
                };
                if let Some(r) = reply {
                    let _ = r.send(Err("no leader could commit it in time; try again".into()));
                }
                continue;
            }
            self.try_propose(ev, deadline)?;
        }
        Ok(())
    }

    fn expire(&mut self) {
        let now = Instant::now();
        let late: Vec<u64> = self.proposals.iter().filter(|(_, (_, d))| now >= *d).map(|(&s, _)| s).collect();
        for s in late {
            if let Some((r, _)) = self.proposals.remove(&s) {
                let _ = r.send(Err("not committed in time (the leader may have changed); try again".into()));
            }
        }
        let late: Vec<u64> = self.reads.iter().filter(|(_, (_, d))| now >= *d).map(|(&s, _)| s).collect();
        for id in late {
            self.node.cancel_read(id);
            if let Some((r, _)) = self.reads.remove(&id) {
                let _ = r.send(Err("no leader confirmed the read in time; try again".into()));
            }
        }
    }

    /// Once a leader is known, a restarted member says what it is now (addresses, capacity).
    fn update_self(&mut self) -> Result<(), NodeError> {
        if self.updated_self || self.node.status().leader == 0 {
            return Ok(());
        }
        match self.node.state.members.get(&self.me.id()) {
            Some(m) if *m != Member { draining: m.draining, ..self.me.clone() } => {
                let (reply, _) = oneshot::channel();
                self.try_propose(Event::Propose(Command::UpdateMember { member: self.me.clone() }, reply), Instant::now() + COMMIT_TIMEOUT)?;
                self.updated_self = true;
            }
            Some(_) => self.updated_self = true,
            None => {}
        }
        Ok(())
    }

    fn carry_out(&mut self, out: shimmer_control::Output) {
        for (seq, outcome) in out.done {
            if let Some((reply, _)) = self.proposals.remove(&seq) {
                let _ = reply.send(Ok(outcome));
            }
        }
        let st = self.node.status();
        let live = Liveness {
            leader: st.leader,
            term: st.term,
            commit: st.commit,
            is_leader: st.role == StateRole::Leader,
            up: self.node.liveness(),
            leader_changes: self.node.leader_changes,
            failed_proposals: self.node.failed_proposals,
        };
        {
            let mut sh = lock(&self.shared);
            if out.applied {
                sh.state = self.node.state.clone();
                sh.version += 1;
            }
            sh.live = live.clone();
        }
        for id in out.reads {
            if let Some((reply, _)) = self.reads.remove(&id) {
                let _ = reply.send(Ok((self.node.state.clone(), live.clone())));
            }
        }
        let cluster_id = self.cluster_id.clone();
        for msg in out.messages {
            let to = msg.to;
            let addr = self.node.state.members.get(&to).map(|m| m.control_addr.clone()).or_else(|| self.addr_hints.get(&to).cloned());
            let Some(addr) = addr else { continue };
            let bytes = shimmer_control::envelope::encode(&cluster_id, &self.me.control_addr, &msg);
            let sender = match self.peers.get(&to) {
                Some((a, s)) if *a == addr && !s.is_closed() => s.clone(),
                _ => {
                    let s = self.spawn_peer(to, addr.clone());
                    self.peers.insert(to, (addr, s.clone()));
                    s
                }
            };
            // A full queue drops the message: Raft resends what matters.
            let _ = sender.try_send(bytes);
        }
    }

    /// A task that delivers Raft messages to one peer over one gRPC channel, redialling as needed.
    fn spawn_peer(&self, id: NodeId, addr: String) -> mpsc::Sender<Vec<u8>> {
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(PEER_QUEUE);
        let (trust, events) = (self.trust.clone(), self.events.clone());
        self.rt.spawn(async move {
            let mut conn: Option<ControlClient<tonic::transport::Channel>> = None;
            while let Some(bytes) = rx.recv().await {
                if conn.is_none() {
                    match client(&addr, &trust).await {
                        Ok(c) => conn = Some(c),
                        Err(e) => {
                            tracing::debug!(%addr, "control plane: cannot reach a peer: {e}");
                            let _ = events.send(Event::Unreachable(id));
                            // Drop what queued up meanwhile; Raft resends.
                            while rx.try_recv().is_ok() {}
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            continue;
                        }
                    }
                }
                if let Some(c) = conn.as_mut() {
                    let mut request = tonic::Request::new(bytes);
                    request.set_timeout(RPC_TIMEOUT);
                    if let Err(e) = c.raft(request).await {
                        tracing::debug!(%addr, "control plane: a Raft message failed: {}", e.message());
                        conn = None;
                        let _ = events.send(Event::Unreachable(id));
                    }
                }
            }
        });
        tx
    }
}

/// What a panic of the Raft thread said, for the error the node exits with.
fn raft_panic_reason(payload: &(dyn std::any::Any + Send)) -> String {
    let text = payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied()).unwrap_or("no message");
    format!("the Raft thread panicked: {text}")
}
