//! PyTorch's TCPStore for every running round: the executor's I/O beside the pure state.
//!
//! Workers started with `TORCHELASTIC_USE_AGENT_STORE=True` use the store at
//! `MASTER_ADDR:MASTER_PORT` as plain clients. The service hosts that store itself, so it outlives
//! whichever rank exits first (torchrun's store lived in rank 0, or in the rank-0 agent), and every
//! round gets a new server on a new port: a restarted attempt never sees the previous attempt's keys,
//! and the previous attempt's stragglers lose their connections (tcpstore.md §5.5).
//!
//! Lifecycle, driven by [`RoundStores::sync`] after every command the executor applies to a job:
//! a job whose round is running has exactly one store, for that round; any other phase (forming,
//! completed, failed, forgotten) has none. Which round runs is decided by `state.rs`; this module only
//! follows it.
//!
//! The protocol has no authentication, so a store listens on one interface: the one the job's nodes
//! reached this service on (the local address of the first join), else the service's own listen
//! address when that names one interface. Never every interface.
//!
//! A service that serves one job (embedded in its launcher) also serves the running round's store
//! on its own port (`shared_port`, see `crate::shared_port`): workers then get that port, as
//! torchrun's get `--master-port`, and a round's own port is only a second way in. The store is
//! then reachable wherever the service listens (launchers bind one address).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use tokio_util::sync::CancellationToken;

use crate::state::{Phase, State};
use crate::tcpstore::{TcpStoreLimits, TcpStoreServer};

/// The running rounds' stores of one service.
#[derive(Debug)]
pub(crate) struct RoundStores {
    limits: TcpStoreLimits,
    /// Used when no join told us the job's interface (a job recovered from the journal).
    fallback: Option<IpAddr>,
    interfaces: HashMap<String, IpAddr>,
    /// Per job: the running round and its store (`None`: it could not be served; not retried, so a
    /// failing bind is tried and logged once per round, not once per command).
    running: HashMap<String, (u64, Option<TcpStoreServer>)>,
    /// The service's own port, when it also serves the running round's store (one job).
    shared_port: Option<u16>,
    cancel: CancellationToken,
}

impl RoundStores {
    pub(crate) fn new(limits: TcpStoreLimits, listen: Option<IpAddr>, shared_port: Option<u16>, cancel: CancellationToken) -> Self {
        let fallback = listen.filter(|ip| !ip.is_unspecified());
        RoundStores { limits, fallback, interfaces: HashMap::new(), running: HashMap::new(), shared_port, cancel }
    }

    /// Records the local address a node of `job` reached the service on (the first one counts,
    /// except that a loopback address gives way to the first other one: a node on the daemon's
    /// own host that joined through `localhost` first made every worker's MASTER_ADDR 127.0.0.1,
    /// which the other hosts' workers cannot reach).
    pub(crate) fn note_interface(&mut self, job: &str, ip: IpAddr) {
        let ip = ip.to_canonical();
        if ip.is_unspecified() {
            return;
        }
        match self.interfaces.get(job) {
            None => {
                self.interfaces.insert(job.to_owned(), ip);
            }
            Some(old) if old.is_loopback() && !ip.is_loopback() => {
                self.interfaces.insert(job.to_owned(), ip);
            }
            Some(_) => {}
        }
    }

    /// Jobs with an interface noted.
    pub(crate) fn n_interfaces(&self) -> usize {
        self.interfaces.len()
    }

    /// Forgets the interface noted for `job` when the job does not exist (a Join that was refused
    /// before it created it): one entry per refused job id would otherwise stay forever.
    pub(crate) fn forget_if_unknown(&mut self, job: &str, state: &State) {
        if state.job(job).is_err() {
            self.interfaces.remove(job);
        }
    }

    /// Brings `job`'s store in line with its phase: started when a round runs, stopped otherwise.
    pub(crate) fn sync(&mut self, job: &str, state: &State) {
        let running_round = state.job(job).ok().and_then(|j| matches!(j.phase, Phase::Running { .. }).then_some(j.round));
        match running_round {
            Some(round) if self.running.get(job).is_some_and(|(r, _)| *r == round) => {}
            Some(round) => {
                // Dropping the old server closes it and every connection of the old round.
                self.running.remove(job);
                let server = match self.interfaces.get(job).copied().or(self.fallback) {
                    None => {
                        tracing::warn!(job, round, "no interface known for this job: its workers host PyTorch's store themselves");
                        None
                    }
                    Some(ip) => match TcpStoreServer::start(SocketAddr::new(ip, 0), self.limits, self.cancel.child_token()) {
                        Ok(server) => {
                            tracing::info!(job, round, addr = %server.local_addr(), "serving PyTorch's store for the round");
                            Some(server)
                        }
                        Err(err) => {
                            tracing::warn!(job, round, %err, "cannot serve PyTorch's store: the job's workers host it themselves");
                            None
                        }
                    },
                };
                self.running.insert(job.to_owned(), (round, server));
            }
            None => {
                if let Some((round, _)) = self.running.remove(job) {
                    tracing::debug!(job, round, "round over: its PyTorch store is closed");
                }
                if state.job(job).is_err() {
                    self.interfaces.remove(job);
                }
            }
        }
    }

    /// Stops every store and forgets the jobs' interfaces (a leader stepping down: the new
    /// leader serves the rounds' stores; jobs removed meanwhile must not leave theirs behind).
    pub(crate) fn clear(&mut self) {
        self.running.clear();
        self.interfaces.clear();
    }

    /// The store serving `round` of `job`, if any: at the service's own port when it shares it.
    pub(crate) fn endpoint(&self, job: &str, round: u64) -> Option<SocketAddr> {
        let own = self.running.get(job).filter(|(r, _)| *r == round).and_then(|(_, s)| s.as_ref()).map(TcpStoreServer::local_addr)?;
        Some(self.shared_port.map_or(own, |port| SocketAddr::new(own.ip(), port)))
    }

    /// Hands a connection that reached the service's shared port to `job`'s running round's store.
    /// Dropped (closed) when no round of it runs or its store could not be served: torch's client
    /// connects again until its own timeout.
    pub(crate) fn adopt(&self, job: &str, stream: std::net::TcpStream) -> bool {
        match self.running.get(job) {
            Some((round, Some(server))) => match server.adopt(stream) {
                Ok(()) => true,
                Err(err) => {
                    tracing::debug!(job, round, %err, "cannot hand a connection to the round's store");
                    false
                }
            },
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first node's address counts, but a loopback one gives way to the first other one (a
    /// node on the daemon's host joined through localhost first); a job's entry goes when the
    /// leader steps down.
    #[test]
    fn a_loopback_interface_gives_way_to_a_reachable_one() {
        let mut s = RoundStores::new(TcpStoreLimits::default(), None, None, CancellationToken::new());
        let (lo, net, other): (IpAddr, IpAddr, IpAddr) =
            ("127.0.0.1".parse().unwrap(), "10.0.0.5".parse().unwrap(), "10.0.0.6".parse().unwrap());
        s.note_interface("j", lo);
        assert_eq!(s.interfaces.get("j"), Some(&lo), "alone on one host, loopback serves");
        s.note_interface("j", net);
        s.note_interface("j", other);
        s.note_interface("j", lo);
        assert_eq!(s.interfaces.get("j"), Some(&net));
        s.note_interface("k", "0.0.0.0".parse().unwrap());
        assert_eq!(s.n_interfaces(), 1);
        s.clear();
        assert_eq!(s.n_interfaces(), 0);
    }
}
