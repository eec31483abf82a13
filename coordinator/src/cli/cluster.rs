//! `shimmer cluster`: the cluster's admin verbs over the control plane's authenticated gRPC
//! API. Any live member answers; dead addresses in `--join` are skipped.

use super::*;
use shimmer_worker::control::{admin_any, AdminReply, AdminRequest, StatusView};

#[derive(Subcommand)]
pub(super) enum ClusterCommand {
    /// The leader, the term, every member with its Raft role and whether the leader hears it,
    /// and the placements.
    Status(ClusterConn),
    /// The members (the same view as `status`, members only).
    Members(ClusterConn),
    /// Each model's placement epoch.
    Placement(ClusterConn),
    /// Mark NODE draining: the cluster places its models without it (it keeps serving until
    /// then).
    Drain {
        node: String,
        /// Take the mark off: NODE is placed again.
        #[arg(long)]
        undo: bool,
        #[command(flatten)]
        conn: ClusterConn,
    },
    /// Take NODE out of the cluster (a voter first leaves the quorum).
    Remove {
        node: String,
        #[command(flatten)]
        conn: ClusterConn,
    },
    /// Re-plan every placed model by the routing heat the coordinators reported, now (whatever
    /// the threshold and rate limit the leader keeps by itself).
    Rebalance {
        /// Say what it would do (the imbalance now and after), proposing nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        conn: ClusterConn,
    },
    /// Print the cluster's join token, pinning its CA (`SHM1<ca-sha256>::<secret>`).
    Token(ClusterConn),
}

/// How the admin verbs reach the cluster.
#[derive(Args)]
pub(super) struct ClusterConn {
    /// Members to ask (HOST:PORT of their control plane, `mdns`, or `dns:NAME[:PORT]`), in turn
    /// until one answers.
    #[arg(long, value_delimiter = ',', value_name = "HOST:PORT,...", required = true)]
    join: Vec<String>,
    #[command(flatten)]
    auth: super::flags::ClusterAuthArgs,
    /// One JSON object on one line instead of text.
    #[arg(long)]
    json: bool,
}

impl ClusterConn {
    fn ask(&self, req: &AdminRequest) -> Result<AdminReply> {
        let trust = self.auth.control_trust("shimmer cluster asks the members")?;
        shimmer_worker::control::discovery::parse_seeds(&self.join).map_err(|e| anyhow::anyhow!(e))?;
        match admin_any(&self.join, &trust, req)? {
            AdminReply::Error { message } => bail!("{message}"),
            reply => Ok(reply),
        }
    }

    fn status(&self) -> Result<StatusView> {
        match self.ask(&AdminRequest::Status { forwarded: false })? {
            AdminReply::Status { status } => Ok(status),
            other => bail!("unexpected answer: {other:?}"),
        }
    }
}

pub(super) fn cluster(cmd: ClusterCommand) -> Result<ExitCode> {
    match cmd {
        ClusterCommand::Status(c) => {
            let s = c.status()?;
            if c.json {
                println!("{}", serde_json::to_string(&s)?);
            } else {
                println!("cluster {}: leader {}, term {}, commit {}", s.cluster_id, s.leader.as_deref().unwrap_or("(none)"), s.term, s.commit);
                print_members(&s);
                for p in &s.placements {
                    println!("model {}: placement epoch {}", p.model, p.epoch);
                }
            }
        }
        ClusterCommand::Members(c) => {
            let s = c.status()?;
            if c.json {
                println!("{}", serde_json::to_string(&json!({"leader": s.leader, "members": s.members}))?);
            } else {
                print_members(&s);
            }
        }
        ClusterCommand::Placement(c) => {
            let s = c.status()?;
            if c.json {
                println!("{}", serde_json::to_string(&json!({"placements": s.placements}))?);
            } else if s.placements.is_empty() {
                println!("no placements yet");
            } else {
                for p in &s.placements {
                    let mut line = format!("model {}: epoch {} over {}", p.model, p.epoch, p.workers.join(", "));
                    if let Some(prev) = p.previous {
                        line += &format!("; epoch {prev} still answered");
                    }
                    if let Some(next) = p.proposed {
                        line += &format!("; epoch {next} proposed ({} ready)", p.ready);
                    }
                    println!("{line}");
                }
            }
        }
        ClusterCommand::Drain { node, undo, conn } => done(&conn, &AdminRequest::Drain { name: node, draining: !undo })?,
        ClusterCommand::Remove { node, conn } => done(&conn, &AdminRequest::Remove { name: node })?,
        ClusterCommand::Rebalance { dry_run, conn } => match conn.ask(&AdminRequest::Rebalance { dry_run })? {
            AdminReply::Rebalanced { models } if conn.json => println!("{}", serde_json::to_string(&json!({"dry_run": dry_run, "models": models}))?),
            AdminReply::Rebalanced { models } => {
                if models.is_empty() {
                    println!("no placed models");
                }
                for m in &models {
                    let what = match (m.epoch, m.proposed) {
                        (None, _) => "the active placement is already the plan".to_string(),
                        (Some(e), true) => format!("epoch {e} proposed"),
                        (Some(e), false) => format!("would propose epoch {e}"),
                    };
                    println!("model {}: imbalance {:.2} now, {:.2} after: {what}", m.model, m.imbalance_now, m.imbalance_after);
                }
            }
            other => bail!("unexpected answer: {other:?}"),
        },
        ClusterCommand::Token(c) => match c.ask(&AdminRequest::Token)? {
            AdminReply::Token { token } if c.json => println!("{}", serde_json::to_string(&json!({"token": token}))?),
            AdminReply::Token { token } => println!("{token}"),
            other => bail!("unexpected answer: {other:?}"),
        },
    }
    Ok(ExitCode::SUCCESS)
}

fn done(conn: &ClusterConn, req: &AdminRequest) -> Result<()> {
    match conn.ask(req)? {
        AdminReply::Done { message } if conn.json => println!("{}", serde_json::to_string(&json!({"done": message}))?),
        AdminReply::Done { message } => println!("{message}"),
        other => bail!("unexpected answer: {other:?}"),
    }
    Ok(())
}

fn print_members(s: &StatusView) {
    println!("{:<24} {:<12} {:<8} {:<6} ADDRESS", "NAME", "KIND", "ROLE", "UP");
    for m in &s.members {
        let up = match m.up {
            Some(true) => "up",
            Some(false) => "down",
            None => "?",
        };
        println!("{:<24} {:<12} {:<8} {:<6} {}{}", m.name, m.kind, m.role, up, m.addr, if m.draining { " (draining)" } else { "" });
    }
}
