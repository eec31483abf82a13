//! The flags several verbs share, one definition each: how the routed experts are held (the
//! store), how a cluster is reached (placement, credentials, timeouts), and sampling.

use std::path::Path;

use super::*;

/// How the routed experts are held (docs/expert-store.md).
#[derive(Args, Clone)]
pub(super) struct StoreArgs {
    /// RAM for the expert cache in GB (a float), or `auto` (what the machine can spare). Without
    /// it an unconverted checkpoint's experts all stay in memory and a container uses `auto`.
    #[arg(long, value_name = "GB|auto")]
    pub(super) ram_gb: Option<String>,
    /// Read experts with O_DIRECT (past the page cache); needs a converted container.
    #[arg(long)]
    pub(super) direct_io: bool,
    /// A second copy of the container (another drive): reads are spread over both, and a bad
    /// read or checksum on one is served from the other.
    #[arg(long, value_name = "DIR")]
    pub(super) mirror: Option<PathBuf>,
    /// Turn off one-layer-ahead prefetch (and warming the learned pins at start).
    #[arg(long)]
    pub(super) no_prefetch: bool,
    /// Expert reads in flight at once (default: the model's tune file, else 16).
    #[arg(long)]
    pub(super) io_depth: Option<usize>,
    /// How expert reads reach the disk: auto (io_uring where the kernel offers it and the model
    /// is a container, else threads), uring, or threads.
    #[arg(long, default_value = "auto")]
    pub(super) io_engine: String,
    /// Compute threads (default: the model's tune file, else one per core).
    #[arg(long)]
    pub(super) threads: Option<usize>,
    /// Where routing heat is learned and kept (default: shimmer-usage.json beside the model).
    #[arg(long, value_name = "FILE", conflicts_with = "no_usage")]
    pub(super) usage: Option<PathBuf>,
    /// Neither read nor write routing heat.
    #[arg(long)]
    pub(super) no_usage: bool,
    /// Compute experts on GPUs from their memory (the VRAM tier above RAM): `auto` uses GPUs
    /// when this binary has a backend for them (cargo features `cuda`, `vulkan`), `vulkan`
    /// insists (and also accepts drivers that run on the CPU, such as lavapipe), `none` never.
    /// Every device of the backend is used (all CUDA devices the driver shows, or every Vulkan
    /// device of the best kind present), each holding its share of every layer's experts.
    #[arg(long, value_name = "auto|cuda|vulkan|none", default_value = "auto")]
    pub(super) gpu: shimmer_gpu::GpuChoice,
    /// GPU memory for experts in GB on each device (default: 90 % of each device's).
    #[arg(long, value_name = "GB")]
    pub(super) vram_gb: Option<f64>,
}

/// How the routed experts are reached on a cluster (docs/cluster.md).
#[derive(Args, Clone)]
pub(super) struct ClusterArgs {
    /// Reach the routed experts on workers placed by this file (`shimmer plan`; docs/cluster.md).
    #[arg(long, value_name = "FILE")]
    pub(super) placement: Option<PathBuf>,
    /// The workers' addresses; when given, they must be the placement's.
    #[arg(long, value_delimiter = ',', requires = "placement")]
    pub(super) workers: Vec<String>,
    /// Use the cluster's placement, asked of any of these members (HOST:PORT of their control
    /// plane, `mdns` for the members on this LAN, `dns:NAME[:PORT]` for every address a name
    /// resolves to, `dns:_SERVICE._PROTO.NAME` for the targets of SRV records); with
    /// --data-dir, join the cluster through them.
    #[arg(long, value_delimiter = ',', value_name = "HOST:PORT,...", conflicts_with = "placement")]
    pub(super) join: Vec<String>,
    #[command(flatten)]
    pub(super) auth: ClusterAuthArgs,
    /// Seconds to wait for a worker's answer to one layer's request before failing over.
    #[arg(long, default_value_t = 30.0)]
    pub(super) worker_timeout_s: f64,
    /// Seconds to wait for a worker's connection (at start, and when retrying a down one).
    #[arg(long, default_value_t = 3.0)]
    pub(super) connect_timeout_s: f64,
    /// A member coordinator reports its routing counts to the cluster this often (seconds).
    #[arg(long, default_value_t = 30.0)]
    pub(super) report_heat_every_s: f64,
    /// This node is also the placement's worker NAME: its experts are computed here (from this
    /// machine's disk, under the store flags) instead of over the network.
    #[arg(long, value_name = "NAME", requires = "placement")]
    pub(super) hold: Option<String>,
}

/// Where the routed experts are: this machine's store, or a cluster's workers.
#[derive(Args, Clone)]
pub(super) struct ExpertArgs {
    #[command(flatten)]
    pub(super) store: StoreArgs,
    #[command(flatten)]
    pub(super) cluster: ClusterArgs,
}

/// How cluster nodes know each other (docs/cluster.md): a join token, operator certificates, or both.
#[derive(Args, Clone, Default)]
pub(super) struct ClusterAuthArgs {
    /// The cluster's join token (also SHIMMER_JOIN_TOKEN).
    #[arg(long)]
    pub(super) join_token: Option<String>,
    /// This node's certificate chain (PEM), for operator-managed mutual TLS.
    #[arg(long, value_name = "PEM", requires_all = ["tls_key", "tls_ca"])]
    pub(super) tls_cert: Option<PathBuf>,
    /// This node's private key (PEM).
    #[arg(long, value_name = "PEM", requires_all = ["tls_cert", "tls_ca"])]
    pub(super) tls_key: Option<PathBuf>,
    /// The CA certificate(s) peers' certificates must chain to (PEM).
    #[arg(long, value_name = "PEM", requires_all = ["tls_cert", "tls_key"])]
    pub(super) tls_ca: Option<PathBuf>,
}

impl ClusterAuthArgs {
    pub(super) fn given(&self) -> bool {
        self.join_token.is_some() || self.tls_cert.is_some()
    }

    /// The token from the flag or SHIMMER_JOIN_TOKEN, and the certificates if given.
    pub(super) fn credentials(&self) -> Result<shimmer_worker::transport::Credentials> {
        use shimmer_worker::transport::{Credentials, JoinToken, OperatorCerts};
        let token = match self.join_token.clone().or_else(|| std::env::var("SHIMMER_JOIN_TOKEN").ok()).filter(|t| !t.is_empty()) {
            Some(t) => Some(JoinToken::new(&t).context("--join-token")?),
            None => None,
        };
        let certs = match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(c), Some(k), Some(ca)) => Some(OperatorCerts::load(c, k, ca)?),
            _ => None,
        };
        Credentials::new(token, certs).context("give --join-token (or SHIMMER_JOIN_TOKEN), or --tls-cert, --tls-key and --tls-ca")
    }

    /// How this node proves itself on the control plane: the token (flag or SHIMMER_JOIN_TOKEN)
    /// and/or the operator certificates; `what` says why one is needed.
    pub(super) fn control_trust(&self, what: &str) -> Result<shimmer_worker::control::ControlTrust> {
        let token = match self.join_token.clone().or_else(|| std::env::var("SHIMMER_JOIN_TOKEN").ok()).filter(|t| !t.is_empty()) {
            Some(t) => Some(shimmer_control::ClusterToken::parse(&t).context("--join-token")?),
            None => None,
        };
        let certs = match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(c), Some(k), Some(ca)) => Some(std::sync::Arc::new(shimmer_worker::transport::OperatorCerts::load(c, k, ca)?)),
            _ => None,
        };
        if token.is_none() && certs.is_none() {
            bail!("{what}: give the cluster's --join-token (or SHIMMER_JOIN_TOKEN), or operator certificates (--tls-cert, --tls-key, --tls-ca)");
        }
        Ok(shimmer_worker::control::ControlTrust::new(token, certs)?)
    }
}

impl StoreArgs {
    /// The store's options for the model in `dir`: each flag given wins, then what `shimmer
    /// tune` wrote beside the model (`shimmer-tune.json`), then the defaults. Also sizes the
    /// compute thread pool (once per process).
    pub(super) fn options(&self, dir: &Path) -> Result<ExpertOptions> {
        let tuned = crate::tune_file::TuneFile::read_beside(dir).map_err(anyhow::Error::msg)?;
        let ram = match (&self.ram_gb, &tuned) {
            (Some(s), _) => Some(RamBudget::parse(s).map_err(|e| anyhow::anyhow!("--ram-gb: {e}"))?),
            (None, Some(t)) => t.ram_gb.map(RamBudget::Gb),
            (None, None) => None,
        };
        let io_depth = self.io_depth.or(tuned.as_ref().and_then(|t| t.io_depth)).unwrap_or(shimmer_store::DEFAULT_IO_DEPTH);
        if io_depth == 0 || io_depth > 256 {
            bail!("--io-depth must be between 1 and 256");
        }
        if let Some(t) = self.threads.or(tuned.as_ref().and_then(|t| t.threads)) {
            if t == 0 || t > crate::tune_file::MAX_THREADS {
                bail!("--threads must be between 1 and {}", crate::tune_file::MAX_THREADS);
            }
            // The pool is the process's; a second verb in one process (tests) keeps the first's.
            let _ = rayon::ThreadPoolBuilder::new().num_threads(t).build_global();
        }
        let usage = match (&self.usage, self.no_usage) {
            (_, true) => UsageFile::Off,
            (Some(p), false) => UsageFile::File(p.clone()),
            (None, false) => UsageFile::BesideModel,
        };
        Ok(ExpertOptions {
            ram,
            direct_io: self.direct_io,
            mirror: self.mirror.clone(),
            prefetch: !self.no_prefetch,
            io_depth,
            io_engine: self.io_engine.parse().map_err(|e: String| anyhow::anyhow!("--io-engine: {e}"))?,
            usage,
            assigned: None,
            vram: self.vram_tier()?,
        })
    }

    /// The VRAM tier `--gpu` and `--vram-gb` ask for, opened once per process (verbs that open
    /// a model twice share it); `None` when there is no GPU to use.
    fn vram_tier(&self) -> Result<Option<std::sync::Arc<shimmer_gpu::VramTier>>> {
        static TIER: std::sync::Mutex<Option<std::sync::Arc<shimmer_gpu::VramTier>>> = std::sync::Mutex::new(None);
        let budget = match self.vram_gb {
            None => None,
            Some(gb) if gb > 0.0 && gb <= 1e6 => Some((gb * 1e9) as u64),
            Some(gb) => bail!("--vram-gb must be a size in (0, 1e6] GB, got {gb}"),
        };
        if self.gpu == shimmer_gpu::GpuChoice::None {
            return Ok(None);
        }
        let mut held = TIER.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = held.as_ref() {
            return Ok(Some(t.clone()));
        }
        let tier = shimmer_gpu::tier(self.gpu, budget).map_err(|e| anyhow::anyhow!("--gpu {}: {e}", self.gpu))?;
        *held = tier.clone();
        Ok(tier)
    }
}

#[derive(Args)]
pub(super) struct SamplingArgs {
    /// Softmax temperature; 0 is greedy.
    #[arg(long)]
    pub(super) temperature: Option<f32>,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches P.
    #[arg(long)]
    pub(super) top_p: Option<f32>,
    /// Keep only the K most likely tokens (0: all).
    #[arg(long)]
    pub(super) top_k: Option<usize>,
    /// Drop tokens less likely than P times the most likely one.
    #[arg(long)]
    pub(super) min_p: Option<f32>,
    /// Penalise tokens already in the context (1.0: off).
    #[arg(long)]
    pub(super) repetition_penalty: Option<f32>,
    /// Seed for sampling; the same seed gives the same output.
    #[arg(long, default_value_t = 0)]
    pub(super) seed: u64,
    /// Stop when the output contains this string (repeatable); it is not printed.
    #[arg(long)]
    pub(super) stop: Vec<String>,
}

impl SamplingArgs {
    pub(super) fn params(&self, default_temperature: f32, default_top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(default_temperature),
            top_p: self.top_p.unwrap_or(default_top_p),
            top_k: self.top_k.unwrap_or(0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            seed: self.seed,
        }
    }
}

/// Membership of the cluster's control plane (Raft; docs/cluster.md).
#[derive(Args, Clone)]
pub(super) struct MemberArgs {
    /// Be a member of the cluster's control plane, keeping its Raft log and the cluster CA in
    /// DIR; restarted on it, the node resumes where it was.
    #[arg(long, value_name = "DIR")]
    pub(super) data_dir: Option<PathBuf>,
    /// Start a new cluster with this node as its first member (with a new --data-dir).
    #[arg(long, requires = "data_dir", conflicts_with = "join")]
    pub(super) bootstrap: bool,
    /// Start a new cluster if this node's host (--advertise, else --listen's) is HOST and no
    /// --join seed answers within 5 s; every other node joins. One set of flags for every pod
    /// of a StatefulSet: `--bootstrap-on NAME-0.SERVICE.NAMESPACE.svc.cluster.local`.
    #[arg(long, value_name = "HOST", requires = "data_dir", conflicts_with = "bootstrap")]
    pub(super) bootstrap_on: Option<String>,
    /// The control plane's TCP address (default: the host and port of --listen).
    #[arg(long, value_name = "HOST:PORT", requires = "data_dir")]
    pub(super) control_listen: Option<String>,
    /// The host (name or IP) other nodes reach this one at, when it listens on every interface
    /// (default: this machine's address on its default route).
    #[arg(long, value_name = "HOST", requires = "data_dir")]
    pub(super) advertise: Option<String>,
    /// Do not advertise this member on mDNS (`--join mdns` on the LAN then does not find it).
    #[arg(long, requires = "data_dir")]
    pub(super) no_mdns: bool,
    /// Voters wanted in the control plane; further members are learners.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=7))]
    pub(super) max_voters: u16,
    /// Seconds a voter may be gone before a learner replaces it.
    #[arg(long, default_value_t = 30.0)]
    pub(super) replace_voter_after_s: f64,
    /// Copies of every expert the cluster's placements make (fewer with fewer workers).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub(super) replicas: u16,
    /// As leader, rebalance a model by its routing heat when that lowers the busiest worker's
    /// share over the mean by at least this much.
    #[arg(long, default_value_t = 0.15)]
    pub(super) rebalance_gain: f64,
    /// As leader, rebalance a model at most this often (seconds).
    #[arg(long, default_value_t = 300.0)]
    pub(super) rebalance_every_s: f64,
}

impl MemberArgs {
    /// How this member proves itself on the control plane: the join token and/or operator
    /// certificates.
    pub(super) fn trust(&self, auth: &ClusterAuthArgs) -> Result<shimmer_worker::control::ControlTrust> {
        auth.control_trust("--data-dir makes this node a cluster member")
    }

    /// `addr` (HOST:PORT) as other nodes reach it: as given, unless its host means every
    /// interface — then --advertise, else this machine's address on its default route. Also a
    /// member's default name.
    pub(super) fn reachable(&self, addr: &str) -> Result<String> {
        let (host, port) = addr.rsplit_once(':').with_context(|| format!("`{addr}` is not HOST:PORT"))?;
        if port == "0" {
            bail!("a cluster member needs a fixed port, not {addr}");
        }
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let everywhere = bare.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified());
        if !everywhere {
            return Ok(addr.to_string());
        }
        let host = match &self.advertise {
            Some(h) => h.clone(),
            None => default_route_ip().with_context(|| format!("{addr} listens on every interface: say how others reach this node with --advertise HOST"))?,
        };
        let joined = if host.contains(':') && !host.starts_with('[') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
        shimmer_control::state::check_host_port(&joined).map_err(|e| anyhow::anyhow!("--advertise {host}: {e}"))?;
        Ok(joined)
    }

    /// The control plane's address as others reach it.
    pub(super) fn control_addr(&self, listen: &str) -> Result<String> {
        self.reachable(self.control_listen.as_deref().unwrap_or(listen))
    }

    pub(super) fn start(
        &self,
        me: shimmer_control::Member,
        listen: &str,
        join: &[String],
        trust: shimmer_worker::control::ControlTrust,
    ) -> Result<shimmer_worker::control::ControlPlane> {
        use shimmer_worker::control::{ControlOptions, ControlPlane, Start};
        let Some(dir) = &self.data_dir else { bail!("no --data-dir") };
        if !(self.replace_voter_after_s > 0.0 && self.replace_voter_after_s <= 86_400.0) {
            bail!("--replace-voter-after-s must be in (0, 86400], got {}", self.replace_voter_after_s);
        }
        let initialized = dir.join(shimmer_control::log_store::FILE_NAME).exists();
        let named = self.bootstrap_on.as_deref().is_some_and(|host| same_host(host, &me.control_addr));
        let start = match (self.bootstrap, named, join.is_empty()) {
            (true, _, _) | (false, true, true) => Start::Bootstrap,
            (false, true, false) => Start::JoinOrBootstrap(join.to_vec()),
            (false, false, false) => Start::Join(join.to_vec()),
            (false, false, true) if initialized => Start::Join(Vec::new()),
            (false, false, true) => match &self.bootstrap_on {
                Some(host) => bail!(
                    "{} holds no cluster yet and this node ({}) is not --bootstrap-on {host}: give --join HOST:PORT (the members to join)",
                    dir.display(),
                    me.control_addr
                ),
                None => bail!("{} holds no cluster yet: give --bootstrap (a new cluster) or --join HOST:PORT (an existing one)", dir.display()),
            },
        };
        shimmer_worker::control::discovery::parse_seeds(join).map_err(|e| anyhow::anyhow!(e))?;
        if !(self.rebalance_gain > 0.0 && self.rebalance_gain.is_finite()) {
            bail!("--rebalance-gain must be a positive number, got {}", self.rebalance_gain);
        }
        if !(self.rebalance_every_s >= 1.0 && self.rebalance_every_s <= 86_400.0 * 30.0) {
            bail!("--rebalance-every-s must be in [1, 2592000], got {}", self.rebalance_every_s);
        }
        let node = shimmer_control::NodeConfig {
            max_voters: usize::from(self.max_voters),
            replace_after_ms: (self.replace_voter_after_s * 1000.0) as u64,
            replicas: usize::from(self.replicas),
            rebalance_gain: self.rebalance_gain,
            rebalance_every_ms: (self.rebalance_every_s * 1000.0) as u64,
            ..shimmer_control::NodeConfig::default()
        };
        let control_listen = self.control_listen.clone().unwrap_or_else(|| listen.to_string());
        let cp = ControlPlane::start(ControlOptions { data_dir: dir.clone(), listen: control_listen, member: me, start, trust, node, mdns: !self.no_mdns })
            .with_context(|| format!("cannot start the control plane (--data-dir {})", dir.display()))?;
        // Tests and scripts wait for this line.
        eprintln!("shimmer: control plane on {} (TCP), member {} of cluster {}", cp.local_addr, cp.name, cp.cluster_id);
        Ok(cp)
    }
}

/// Whether `host` is the host of `addr` (HOST:PORT): names compare without case or a trailing
/// dot, IPv6 without brackets.
fn same_host(host: &str, addr: &str) -> bool {
    let bare = |h: &str| h.trim_start_matches('[').trim_end_matches(']').trim_end_matches('.').to_ascii_lowercase();
    let addr_host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    !host.is_empty() && bare(host) == bare(addr_host)
}

/// This machine's address on its default route (no packet is sent: a UDP socket is only
/// connected, which makes the kernel pick the source address).
fn default_route_ip() -> Result<String> {
    let sock = std::net::UdpSocket::bind("0.0.0.0:0")?;
    sock.connect("192.0.2.1:9")?;
    let ip = sock.local_addr()?.ip();
    if ip.is_unspecified() || ip.is_loopback() {
        bail!("this machine has no address on a default route");
    }
    Ok(ip.to_string())
}

#[cfg(test)]
mod tests {
    use super::same_host;

    #[test]
    fn bootstrap_on_names_a_host_as_dns_and_ipv6_spell_it() {
        assert!(same_host("shimmer-worker-0.shimmer-worker.default.svc.cluster.local", "shimmer-worker-0.shimmer-worker.default.svc.cluster.local:7070"));
        assert!(same_host("Shimmer-Worker-0.example.", "shimmer-worker-0.example:7070"));
        assert!(same_host("::1", "[::1]:7070"));
        assert!(!same_host("shimmer-worker-0", "shimmer-worker-1:7070"));
        assert!(!same_host("shimmer-worker-0", "shimmer-worker-0.svc:7070"));
        assert!(!same_host("", ":7070"));
    }
}
