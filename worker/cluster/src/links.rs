//! Each worker's health as the coordinator judges it, and when to try it again: a state machine
//! that takes events (a dial succeeded or failed, a connection was lost, a request went
//! unanswered) and the time they happened, and answers whether the worker may be sent work now.
//!
//! A worker that fails is down for a backoff (1 s, doubling to 30 s) and then redialled in the
//! background; the forward pass never waits for that. A dial that succeeds makes it up again.
//!
//! Must never: read a clock (time comes in as `now`), or hold a connection (the driver does; this
//! only knows whether it has one).

use std::time::{Duration, Instant};

use crate::status::WorkerStatus;
use crate::telemetry::LinkCounters;

pub const BACKOFF_START: Duration = Duration::from_secs(1);
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Usable when connected.
    Up,
    /// Not to be sent work before `until`; the next failure doubles `backoff`.
    Down { until: Instant, backoff: Duration },
}

/// One worker of the placement.
#[derive(Debug, Clone)]
pub struct Link {
    pub addr: String,
    pub health: Health,
    /// The driver holds a live, authenticated connection to it.
    pub connected: bool,
    /// A background dial is under way.
    pub redialing: bool,
    /// What it last said about itself.
    pub status: Option<WorkerStatus>,
    pub counters: LinkCounters,
    /// Served in this process (a node that is both coordinator and worker): never dialled, always up.
    pub local: bool,
}

impl Link {
    pub fn new(addr: String) -> Self {
        Link { addr, health: Health::Up, connected: false, redialing: false, status: None, counters: LinkCounters::default(), local: false }
    }

    pub fn is_up(&self) -> bool {
        self.local || (self.connected && self.health == Health::Up)
    }

    /// The backoff after one more failure.
    fn next_backoff(&self) -> Duration {
        match self.health {
            Health::Down { backoff, .. } => (backoff * 2).min(BACKOFF_MAX),
            Health::Up => BACKOFF_START,
        }
    }

    /// It failed a request, or answered nothing in time: down, the backoff doubled.
    pub fn mark_down(&mut self, now: Instant) {
        let backoff = self.next_backoff();
        self.health = Health::Down { until: now + backoff, backoff };
        self.connected = false;
    }

    /// Its connection closed: down for the first backoff (unless already down).
    pub fn connection_lost(&mut self, now: Instant) {
        self.connected = false;
        if self.health == Health::Up {
            self.health = Health::Down { until: now + BACKOFF_START, backoff: BACKOFF_START };
        }
    }

    pub fn dial_succeeded(&mut self, status: Option<WorkerStatus>) {
        self.redialing = false;
        self.connected = true;
        self.health = Health::Up;
        if status.is_some() {
            self.status = status;
        }
    }

    pub fn dial_failed(&mut self, now: Instant) {
        self.redialing = false;
        self.mark_down(now);
    }

    /// Whether the backoff has passed (or it was never down).
    pub fn may_retry(&self, now: Instant) -> bool {
        match self.health {
            Health::Down { until, .. } => now >= until,
            Health::Up => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_and_a_dial_resets_it() {
        let t0 = Instant::now();
        let mut l = Link::new("127.0.0.2:7070".into());
        l.dial_succeeded(None);
        assert!(l.is_up());
        l.mark_down(t0);
        assert_eq!(l.health, Health::Down { until: t0 + BACKOFF_START, backoff: BACKOFF_START });
        assert!(!l.may_retry(t0 + Duration::from_millis(999)) && l.may_retry(t0 + BACKOFF_START));
        let mut backoff = BACKOFF_START;
        for _ in 0..10 {
            l.dial_failed(t0);
            backoff = (backoff * 2).min(BACKOFF_MAX);
            assert_eq!(l.health, Health::Down { until: t0 + backoff, backoff });
        }
        assert_eq!(backoff, BACKOFF_MAX);
        l.dial_succeeded(None);
        assert!(l.is_up());
        l.connection_lost(t0);
        assert_eq!(l.health, Health::Down { until: t0 + BACKOFF_START, backoff: BACKOFF_START }, "a lost connection starts at the first backoff");
    }
}
