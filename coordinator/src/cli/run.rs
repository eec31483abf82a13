//! `shimmer run` and `shimmer coordinator`: the HTTP API and dashboard over a local or clustered model.

use super::*;

#[derive(Args)]
pub(super) struct RunArgs {
    /// A checkpoint directory or container (default: the bundled demo model).
    #[arg(long)]
    pub(super) model: Option<PathBuf>,
    /// The address to serve on (default 127.0.0.1; 0.0.0.0 for `coordinator`).
    #[arg(long)]
    pub(super) host: Option<String>,
    #[arg(long, default_value_t = 8080)]
    pub(super) port: u16,
    /// Require this API key (repeatable; also SHIMMER_API_KEY). Without one, no key is needed.
    #[arg(long = "api-key", value_name = "KEY")]
    pub(super) api_keys: Vec<String>,
    /// Require this key (`Authorization: Bearer KEY`) on /metrics (also SHIMMER_METRICS_API_KEY);
    /// the API keys do not open it. Without it /metrics is open, as Prometheus expects.
    #[arg(long, value_name = "KEY")]
    pub(super) metrics_api_key: Option<String>,
    /// Requests that may wait for a batch slot; beyond, 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub(super) max_queue: usize,
    /// Sequences decoded together in one forward pass.
    #[arg(long, default_value_t = 16)]
    pub(super) max_batch: usize,
    /// GB of KV cache kept from finished requests, so a prompt that starts like an earlier one
    /// (the next chat turn) reuses it instead of prefilling again; 0 turns prefix reuse off.
    #[arg(long, default_value_t = 1.0)]
    pub(super) kv_gb: f64,
    /// Seconds a connection may take to send a request's headers — and an idle keep-alive
    /// connection is kept waiting for its next request — before it is closed.
    #[arg(long, default_value_t = 20.0)]
    pub(super) header_timeout_s: f64,
    /// Seconds a client may take to send a request's body once its headers are in (408 beyond).
    #[arg(long, default_value_t = 30.0)]
    pub(super) body_timeout_s: f64,
    /// Connections served at once; more wait in the kernel's accept queue until one closes.
    #[arg(long, default_value_t = 1024)]
    pub(super) max_connections: usize,
    /// The model name clients use (default: the model directory's name; `shimmer-demo` for the demo).
    #[arg(long)]
    pub(super) served_model_name: Option<String>,
    #[command(flatten)]
    pub(super) store: ExpertArgs,
    /// `coordinator` as a cluster member (with --data-dir): its control plane's TCP address,
    /// and its name in the cluster unless --name says otherwise.
    #[arg(long, default_value = "0.0.0.0:7071", requires = "data_dir")]
    pub(super) listen: String,
    /// This coordinator's name in the cluster (default: --listen as given, or as others reach it
    /// when that is every interface).
    #[arg(long, requires = "data_dir")]
    pub(super) name: Option<String>,
    #[command(flatten)]
    pub(super) member: MemberArgs,
}

pub(super) fn run_server(a: RunArgs, coordinator: bool) -> Result<ExitCode> {
    let cluster = &a.store.cluster;
    if coordinator && cluster.placement.is_none() && cluster.join.is_empty() && a.member.data_dir.is_none() {
        bail!("shimmer coordinator needs its cluster: --data-dir D with --bootstrap or --join HOST:PORT (a member), --join HOST:PORT (a client), or --placement FILE (docs/cluster.md)");
    }
    if !coordinator && a.member.data_dir.is_some() {
        bail!("--data-dir makes a node a cluster member: use `shimmer coordinator` (or `shimmer worker`)");
    }
    let host = a.host.clone().unwrap_or_else(|| if coordinator { "0.0.0.0" } else { "127.0.0.1" }.into());
    let dir = model_dir(&a.model)?;
    let control = match &a.member.data_dir {
        Some(_) => {
            let trust = a.member.trust(&cluster.auth)?;
            let control_addr = a.member.control_addr(&a.listen).context("--listen")?;
            let name = match &a.name {
                Some(n) => n.clone(),
                None => a.member.reachable(&a.listen).context("--listen")?,
            };
            let me = shimmer_control::Member {
                name,
                kind: shimmer_control::NodeKind::Coordinator,
                control_addr,
                data_addr: None,
                capacity: shimmer_control::state::Capacity::default(),
                models: Vec::new(),
                draining: false,
            };
            Some(std::sync::Arc::new(a.member.start(me, &a.listen, &cluster.join, trust)?))
        }
        None => None,
    };
    let engine = open_as(&dir, &a.store, false, control.clone())?;
    let mut api_keys = a.api_keys.clone();
    if let Ok(k) = std::env::var("SHIMMER_API_KEY") {
        if !k.is_empty() {
            api_keys.push(k);
        }
    }
    let model_id = match (&a.served_model_name, &a.model) {
        (Some(n), _) => n.clone(),
        (None, None) => "shimmer-demo".into(),
        (None, Some(_)) => {
            std::fs::canonicalize(&dir).ok().and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned())).unwrap_or_else(|| "model".into())
        }
    };
    if a.max_queue == 0 {
        bail!("--max-queue must be at least 1");
    }
    if !(1..=crate::server::MAX_CONNECTIONS_LIMIT).contains(&a.max_connections) {
        bail!("--max-connections must be from 1 to {}, got {}", crate::server::MAX_CONNECTIONS_LIMIT, a.max_connections);
    }
    if !(a.kv_gb >= 0.0 && a.kv_gb.is_finite()) {
        bail!("--kv-gb must be a number of GB >= 0, got {}", a.kv_gb);
    }
    let (header_timeout, body_timeout) =
        (super::seconds_flag("--header-timeout-s", a.header_timeout_s)?, super::seconds_flag("--body-timeout-s", a.body_timeout_s)?);
    let expert_bytes = match engine.store_telemetry() {
        Some(t) => t.expert_bytes,
        None => shimmer_store::expert_bytes_of(&dir, &engine.spec)?,
    };
    crate::server::serve(
        engine,
        crate::server::ServerConfig {
            host,
            port: a.port,
            api_keys,
            metrics_api_key: super::metrics_api_key(&a.metrics_api_key)?,
            max_queue: a.max_queue,
            max_batch: a.max_batch.max(1),
            kv_budget_bytes: (a.kv_gb * 1e9) as usize,
            max_body_bytes: crate::server::MAX_BODY_BYTES,
            max_connections: a.max_connections,
            header_timeout,
            body_timeout,
            model_id,
            expert_bytes,
            control: control.clone(),
        },
    )?;
    if let Some(c) = control {
        c.stop().context("the control plane failed")?;
    }
    Ok(ExitCode::SUCCESS)
}
