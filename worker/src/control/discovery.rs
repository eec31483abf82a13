//! How a node finds the cluster's members: `--join` takes HOST:PORT addresses, `mdns` (members
//! on this LAN, found by multicast DNS as `_shimmer._udp.local.`), `dns:NAME[:PORT]` (every
//! address the name resolves to — a Kubernetes headless service lists its pods so) and
//! `dns:_SERVICE._PROTO.NAME` (an SRV name: every target it lists, on the target's own port — a
//! headless service's named port). A member advertises itself on mDNS unless told not to.
//!
//! Must never: trust what it finds (every address found is only a place to try: the join token
//! is proven on every connection before anything is said), or fail a node because multicast is
//! unavailable (discovery then finds nothing, and says so).

use std::collections::BTreeSet;
use std::net::{IpAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The DNS-SD service type members advertise.
pub const MDNS_SERVICE: &str = "_shimmer._udp.local.";
/// The control port `dns:NAME` means without one.
pub const DEFAULT_PORT: u16 = 7070;
/// How long `mdns` listens for members.
pub const MDNS_BROWSE: Duration = Duration::from_secs(3);
/// Bound on addresses taken from one discovery source.
const MAX_FOUND: usize = 256;

/// One `--join` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seed {
    Addr(String),
    Mdns,
    Dns {
        name: String,
        port: u16,
    },
    /// An SRV name (`_control._tcp.shimmer.default.svc.cluster.local`): its targets and ports.
    Srv {
        name: String,
    },
}

impl Seed {
    /// Whether addresses from it were found rather than given (a refusal from one is not the
    /// user's mistake: another cluster may share the LAN or the name).
    pub fn discovered(&self) -> bool {
        !matches!(self, Seed::Addr(_))
    }
}

/// Parses `--join` entries: `HOST:PORT`, `mdns`, `dns:NAME`, `dns:NAME:PORT` or `dns:_SRV-NAME`.
pub fn parse_seeds(list: &[String]) -> Result<Vec<Seed>, String> {
    list.iter()
        .map(|s| {
            let s = s.trim();
            if s == "mdns" {
                return Ok(Seed::Mdns);
            }
            if let Some(rest) = s.strip_prefix("dns:") {
                if rest.starts_with('_') {
                    if rest.len() > 253 || rest.contains(':') || !rest.trim_end_matches('.').contains('.') {
                        return Err(format!("--join {s}: an SRV name is _SERVICE._PROTO.NAME (at most 253 bytes), its records carry the ports"));
                    }
                    return Ok(Seed::Srv { name: rest.to_string() });
                }
                let (name, port) = match rest.rsplit_once(':') {
                    Some((n, p)) => (n, p.parse::<u16>().map_err(|_| format!("--join {s}: `{p}` is not a port number"))?),
                    None => (rest, DEFAULT_PORT),
                };
                if name.is_empty() || name.len() > 253 || port == 0 {
                    return Err(format!("--join {s}: dns:NAME[:PORT] needs a name of 1 to 253 bytes and a port"));
                }
                return Ok(Seed::Dns { name: name.to_string(), port });
            }
            shimmer_control::state::check_host_port(s).map_err(|e| format!("--join {s}: {e} (or `mdns`, or `dns:NAME[:PORT]`)"))?;
            Ok(Seed::Addr(s.to_string()))
        })
        .collect()
}

/// The addresses the seeds stand for now, each with whether it was discovered; and why a
/// discovery source found nothing.
pub fn resolve(seeds: &[Seed]) -> (Vec<(String, bool)>, Vec<String>) {
    let mut found: Vec<(String, bool)> = Vec::new();
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for seed in seeds {
        let addrs = match seed {
            Seed::Addr(a) => vec![a.clone()],
            Seed::Dns { name, port } => match (name.as_str(), *port).to_socket_addrs() {
                Ok(it) => it.take(MAX_FOUND).map(|a| a.to_string()).collect(),
                Err(e) => {
                    problems.push(format!("dns:{name}: {e}"));
                    Vec::new()
                }
            },
            Seed::Srv { name } => match lookup_srv(name) {
                Ok(addrs) if addrs.is_empty() => {
                    problems.push(format!("dns:{name}: the SRV records list no target with an address"));
                    addrs
                }
                Ok(addrs) => addrs,
                Err(e) => {
                    problems.push(format!("dns:{name}: {e}"));
                    Vec::new()
                }
            },
            Seed::Mdns => match browse_mdns(MDNS_BROWSE) {
                Ok(addrs) if addrs.is_empty() => {
                    problems.push(format!("mdns: no member answered on this LAN within {} s", MDNS_BROWSE.as_secs()));
                    addrs
                }
                Ok(addrs) => addrs,
                Err(e) => {
                    problems.push(format!("mdns: {e}"));
                    Vec::new()
                }
            },
        };
        for a in addrs {
            if seen.insert(a.clone()) {
                found.push((a, seed.discovered()));
            }
        }
    }
    (found, problems)
}

/// Bound on one SRV lookup with its targets' addresses (the resolver retries within it).
const SRV_WITHIN: Duration = Duration::from_secs(10);

/// The addresses an SRV name's records point at: each target resolved (A/AAAA) with the record's
/// port, in the records' priority order. Asked of the system's resolver (`/etc/resolv.conf`:
/// its nameservers, search domains and `ndots`, as a Kubernetes pod has them) on a runtime of
/// its own, so it may be called from any thread.
fn lookup_srv(name: &str) -> Result<Vec<String>, String> {
    let name = name.to_string();
    let thread = std::thread::Builder::new().name("dns-srv".into()).spawn(move || -> Result<Vec<String>, String> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| format!("no runtime for DNS: {e}"))?;
        rt.block_on(async {
            let resolver =
                hickory_resolver::TokioAsyncResolver::tokio_from_system_conf().map_err(|e| format!("cannot read the system's DNS configuration: {e}"))?;
            let lookup = async {
                let srv = resolver.srv_lookup(name.as_str()).await.map_err(|e| e.to_string())?;
                let mut records: Vec<(u16, u16, String, u16)> =
                    srv.iter().take(MAX_FOUND).map(|r| (r.priority(), u16::MAX - r.weight(), r.target().to_utf8(), r.port())).collect();
                records.sort();
                let mut found = Vec::new();
                for (_, _, target, port) in records {
                    match resolver.lookup_ip(target.as_str()).await {
                        Ok(ips) => found.extend(ips.iter().take(MAX_FOUND).map(|ip| host_port(ip, port))),
                        Err(e) => tracing::warn!("dns:{name}: target {target}: {e}"),
                    }
                }
                found.truncate(MAX_FOUND);
                Ok::<_, String>(found)
            };
            tokio::time::timeout(SRV_WITHIN, lookup).await.map_err(|_| format!("no answer within {} s", SRV_WITHIN.as_secs()))?
        })
    });
    thread.map_err(|e| format!("no thread for DNS: {e}"))?.join().map_err(|_| "the DNS lookup failed".to_string())?
}

/// Members' control addresses heard on mDNS within `within`.
fn browse_mdns(within: Duration) -> Result<Vec<String>, String> {
    let daemon = mdns_sd::ServiceDaemon::new().map_err(|e| format!("cannot start mDNS: {e}"))?;
    let events = daemon.browse(MDNS_SERVICE).map_err(|e| format!("cannot browse {MDNS_SERVICE}: {e}"))?;
    let deadline = Instant::now() + within;
    let mut found = BTreeSet::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match events.recv_timeout(left) {
            Ok(mdns_sd::ServiceEvent::ServiceResolved(info)) => {
                let port = info.get_port();
                for ip in info.get_addresses() {
                    if found.len() < MAX_FOUND {
                        found.insert(host_port(*ip, port));
                    }
                }
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let _ = daemon.shutdown();
    Ok(found.into_iter().collect())
}

fn host_port(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{v4}:{port}"),
        IpAddr::V6(v6) => format!("[{v6}]:{port}"),
    }
}

/// A member's advertisement on mDNS, withdrawn when dropped.
pub struct MdnsAdvert {
    daemon: mdns_sd::ServiceDaemon,
}

impl MdnsAdvert {
    /// Advertises the member `name` of cluster `cluster_id` at `control_addr` (an IP address and
    /// port; a hostname there is resolved first).
    pub fn start(name: &str, cluster_id: &str, control_addr: &str) -> Result<MdnsAdvert, String> {
        let addr = control_addr
            .to_socket_addrs()
            .map_err(|e| format!("{control_addr}: {e}"))?
            .next()
            .ok_or_else(|| format!("{control_addr} resolves to no address"))?;
        if addr.ip().is_unspecified() {
            return Err(format!("{control_addr} is every interface, not an address others can reach"));
        }
        let daemon = mdns_sd::ServiceDaemon::new().map_err(|e| format!("cannot start mDNS: {e}"))?;
        // Instance and host names are DNS labels: the member's id, not its name (which may
        // hold ':' and '.'); the name travels in the TXT record.
        let label = format!("shimmer-{:016x}", shimmer_control::state::node_id(name));
        let properties = [("name", name), ("cluster", cluster_id)];
        let info = mdns_sd::ServiceInfo::new(MDNS_SERVICE, &label, &format!("{label}.local."), addr.ip(), addr.port(), &properties[..])
            .map_err(|e| format!("cannot describe this member for mDNS: {e}"))?;
        if addr.ip().is_loopback() {
            // A loopback address is only reachable here; advertise it there (tests, one box).
            let _ = daemon.enable_interface(mdns_sd::IfKind::LoopbackV4);
        }
        daemon.register(info).map_err(|e| format!("cannot advertise on mDNS: {e}"))?;
        Ok(MdnsAdvert { daemon })
    }
}

impl Drop for MdnsAdvert {
    fn drop(&mut self) {
        let _ = self.daemon.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_parse_addresses_mdns_and_dns_names_and_refuse_the_rest() {
        let s = |v: &[&str]| parse_seeds(&v.iter().map(|x| x.to_string()).collect::<Vec<_>>());
        assert_eq!(
            s(&["10.0.0.1:7070", "mdns", "dns:shimmer-headless", "dns:w.example:7171"]).unwrap(),
            vec![
                Seed::Addr("10.0.0.1:7070".into()),
                Seed::Mdns,
                Seed::Dns { name: "shimmer-headless".into(), port: DEFAULT_PORT },
                Seed::Dns { name: "w.example".into(), port: 7171 }
            ]
        );
        assert!(s(&["no-port"]).unwrap_err().contains("mdns"));
        assert!(s(&["dns:"]).is_err());
        assert!(s(&["dns:x:notaport"]).unwrap_err().contains("not a port"));
        assert_eq!(s(&["dns:_control._tcp.shimmer.default.svc"]).unwrap(), vec![Seed::Srv { name: "_control._tcp.shimmer.default.svc".into() }]);
        assert!(s(&["dns:_control._tcp.shimmer:7070"]).unwrap_err().contains("SRV"), "an SRV record carries its port");
        assert!(s(&["dns:_control"]).unwrap_err().contains("SRV"));
    }

    #[test]
    fn a_dns_name_stands_for_every_address_it_resolves_to_and_a_bad_one_says_why() {
        let (found, problems) = resolve(&[Seed::Dns { name: "localhost".into(), port: 7070 }, Seed::Addr("10.0.0.1:1".into())]);
        assert!(found.iter().any(|(a, d)| (a == "127.0.0.1:7070" || a == "[::1]:7070") && *d), "{found:?}");
        assert!(found.contains(&("10.0.0.1:1".to_string(), false)));
        assert!(problems.is_empty(), "{problems:?}");
        let (found, problems) = resolve(&[Seed::Dns { name: "no-such-host.invalid".into(), port: 1 }]);
        assert!(found.is_empty() && problems[0].contains("no-such-host.invalid"), "{problems:?}");
        // `.invalid` never resolves (RFC 6761): the SRV lookup says why, naming the name. (SRV
        // records that do resolve are checked against a real DNS server, dnsmasq, in
        // `scripts/lan.sh check`.)
        let (found, problems) = resolve(&[Seed::Srv { name: "_control._tcp.no-such-service.invalid".into() }]);
        assert!(found.is_empty() && problems[0].starts_with("dns:_control._tcp.no-such-service.invalid: "), "{problems:?}");
    }
}
