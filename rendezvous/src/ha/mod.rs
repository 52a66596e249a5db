//! Highly available rendezvous: N daemons over one etcd cluster, one leader, the rest standbys
//! (`rsrun-rendezvous serve --etcd-endpoints ...`).
//!
//! The pure state machine is unchanged. The leader's executor ([`crate::service::Core`]) appends
//! its journal records to etcd instead of a file ([`log::EtcdLog`]), each batch one Txn guarded by
//! the leader's fencing token, so a deposed leader (paused, partitioned, slow) commits nothing.
//! Standbys keep a warm replica from an etcd watch of the log and refuse calls with UNAVAILABLE
//! plus a hint naming the leader. The election ([`election`]) is etcd's recipe: a key per daemon
//! attached to its lease; the lowest creation revision leads and that revision is its epoch.
//!
//! One daemon's life, as [`run`] drives it (one *session* per lease):
//!
//! ```text
//!   grant lease ─▶ register campaign key (R) ─▶ standby: rebuild the replica at a pinned revision,
//!        ▲                                      follow the log by watch, wait for the key below R
//!        │                                                        │ lowest key
//!        │                                                        ▼
//!        │          takeover: guarded write of P/leader (revision H), catch the replica up to H
//!        │          with pinned reads, full leases for every node, serve as leader of epoch R
//!        │                                                        │
//!        └──── lease lost · fencing point passed · a log write refused (deposed) ◀┘
//!              (step down at once: every waiter fails, the replica is rebuilt from etcd)
//! ```
//!
//! The fencing point is the lease's local deadline: the send time of the last acknowledged grant
//! or keep-alive, plus the TTL, less max(0.5 s, TTL/10) ([`election::LeaseTimer`]). The executor
//! holds it too ([`FenceClock`] as its [`LeaderLease`]) and checks it when each answer goes out,
//! so a leader that stalled or lost etcd answers nothing past it, whether or not this node's
//! tasks have run since; a log write is refused by etcd itself (the fencing compare) once the
//! lease expired there.
//!
//! SIGTERM: the leader stops answering, then revokes its lease, so the next standby takes over in
//! well under a second.

pub mod election;
pub mod etcd;
pub mod log;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message;
use rsrun_proto::etcd::etcdserverpb as epb;
use rsrun_proto::v1 as pb;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use self::election::{Decision, LeaseTimer, decide};
use self::etcd::{Etcd, EtcdConfig, EtcdError, WatchStream, created_at, get_op, prefix_end, put_op, txn_range};
use self::log::{Batch, EtcdLog, Keys, Owner, RecoverError, SnapPointer, TakeoverSnapshot, leader_value, recover};
use crate::RdzvError;
use crate::journal::FORMAT_VERSION;
use crate::service::{Core, DaemonIdentity, LeaderLease, PeerSource, Role};

/// Everything an HA daemon needs besides the service's own configuration.
#[derive(Debug, Clone)]
pub struct HaConfig {
    /// How to reach etcd.
    pub etcd: EtcdConfig,
    /// The key prefix of this group of daemons (`--etcd-prefix`).
    pub prefix: String,
    /// Who this daemon is.
    pub identity: DaemonIdentity,
    /// Election lease TTL (`--leader-lease-ttl`, at least 2 s: etcd's minimum).
    pub lease_ttl: Duration,
    /// A snapshot every this many bytes of log (default [`log::COMPACT_EVERY`]; tests lower it).
    pub snapshot_bytes: u64,
}

/// The moment after which this daemon must assume its lease lapsed (shared by the lease keeper,
/// the leader loop and the log writer).
#[derive(Debug, Default)]
pub struct FenceClock {
    fence_at: Mutex<Option<Instant>>,
}

impl FenceClock {
    fn set(&self, at: Option<Instant>) {
        *self.fence_at.lock().unwrap_or_else(|p| p.into_inner()) = at;
    }

    fn at(&self) -> Option<Instant> {
        *self.fence_at.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the fencing point passed (or there is no live lease).
    pub fn fenced(&self) -> bool {
        self.at().is_none_or(|f| Instant::now() >= f)
    }
}

/// The executor answers as leader only before the fencing point.
impl LeaderLease for FenceClock {
    fn answer_until(&self) -> Option<Instant> {
        self.at()
    }
}

/// Decodes a campaign or leader record (`P/election/*`, `P/leader`).
pub fn read_peer(bytes: &[u8]) -> Option<pb::DaemonPeer> {
    pb::DaemonPeer::decode(bytes).ok()
}

/// The campaigning daemons, read from etcd when `status` asks.
#[derive(Debug)]
struct Peers {
    etcd: Etcd,
    keys: Keys,
    /// The last list read (answered when etcd is slow: `status` must answer regardless).
    cached: Mutex<Vec<pb::DaemonPeer>>,
}

impl Peers {
    async fn read(&self) -> Result<Vec<pb::DaemonPeer>, EtcdError> {
        let p = self.keys.election_prefix();
        let (mut kvs, _) = self.etcd.range_all(&p, &prefix_end(&p), 0, 1000).await?;
        kvs.sort_by_key(|kv| kv.create_revision);
        Ok(kvs
            .iter()
            .filter_map(|kv| {
                read_peer(&kv.value).map(|mut peer| {
                    peer.campaign_revision = kv.create_revision as u64;
                    peer
                })
            })
            .collect())
    }
}

impl PeerSource for Peers {
    fn peers(&self) -> futures::future::BoxFuture<'_, Vec<pb::DaemonPeer>> {
        Box::pin(async move {
            match tokio::time::timeout(Duration::from_millis(300), self.read()).await {
                Ok(Ok(list)) => {
                    *self.cached.lock().unwrap_or_else(|p| p.into_inner()) = list.clone();
                    list
                }
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "cannot list the campaigning daemons; answering the last list");
                    self.cached.lock().unwrap_or_else(|p| p.into_inner()).clone()
                }
                Err(_) => self.cached.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            }
        })
    }
}

/// Checks (or, in an empty prefix, writes) the log's format version. Retries while etcd does not
/// answer, up to `deadline`.
///
/// # Errors
/// etcd unreachable until the deadline, or a prefix written by another format.
pub async fn prepare(etcd: &Etcd, prefix: &str, deadline: Duration) -> Result<(), RdzvError> {
    let keys = Keys::new(prefix);
    let key = keys.format();
    let ours = FORMAT_VERSION.to_string().into_bytes();
    let req = epb::TxnRequest { compare: vec![created_at(&key, 0)], success: vec![put_op(&key, ours.clone(), 0)], failure: vec![get_op(&key)] };
    let until = Instant::now() + deadline;
    loop {
        match etcd.txn(req.clone()).await {
            Ok(r) if r.succeeded => return Ok(()),
            Ok(r) => {
                let found = txn_range(&r, 0).first().map(|kv| String::from_utf8_lossy(&kv.value).into_owned()).unwrap_or_default();
                if found.as_bytes() == ours.as_slice() {
                    return Ok(());
                }
                return Err(RdzvError::Storage {
                    path: format!("etcd {}", String::from_utf8_lossy(&key)),
                    message: format!(
                        "the prefix {prefix:?} holds an rsrun log of format {found:?}, this rsrun-rendezvous writes format {FORMAT_VERSION}: let its jobs end under the daemons that wrote it, or use another --etcd-prefix"
                    ),
                });
            }
            Err(EtcdError::Uncertain(m)) if Instant::now() < until => {
                tracing::debug!(error = %m, "etcd not reachable yet");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => {
                return Err(RdzvError::Unavailable(format!("cannot use etcd at {}: {e}", etcd.endpoints().join(","))));
            }
        }
    }
}

/// Starts the HA node of `core`: it campaigns, follows and leads until `cancel`.
pub fn spawn(core: Arc<Core>, cfg: HaConfig, etcd: Etcd, cancel: CancellationToken, tracker: &tokio_util::task::TaskTracker) {
    let keys = Keys::new(&cfg.prefix);
    core.set_peer_source(Arc::new(Peers { etcd: etcd.clone(), keys: keys.clone(), cached: Mutex::new(Vec::new()) }));
    let node = Node { core, cfg, etcd, keys, cancel };
    tracker.spawn(async move { node.run().await });
}

/// Why a session ended.
#[derive(Debug)]
enum End {
    /// The daemon stops.
    Cancelled,
    /// Start a new session (new lease, new key): the lease was lost, leadership was lost, etcd
    /// refused something.
    Restart(String),
}

impl From<EtcdError> for End {
    fn from(e: EtcdError) -> Self {
        End::Restart(e.to_string())
    }
}

impl From<RecoverError> for End {
    fn from(e: RecoverError) -> Self {
        End::Restart(e.to_string())
    }
}

struct Node {
    core: Arc<Core>,
    cfg: HaConfig,
    etcd: Etcd,
    keys: Keys,
    cancel: CancellationToken,
}

/// One lease and its keeper task.
struct Session {
    lease: i64,
    key: Vec<u8>,
    epoch: i64,
    fence: Arc<FenceClock>,
    lost: watch::Receiver<Option<String>>,
    keeper: tokio::task::JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

/// Where the replica stands in etcd's history.
struct Follow {
    /// Revision of the last event (or progress notification) applied.
    revision: i64,
    watch: Option<WatchStream>,
    last_heard: Instant,
}

impl Node {
    async fn run(self) {
        let mut pause = Duration::from_millis(100);
        loop {
            if self.cancel.is_cancelled() {
                break;
            }
            let started = Instant::now();
            match self.session().await {
                End::Cancelled => break,
                End::Restart(why) => {
                    // Never answer from what this daemon held: refuse until a fresh replica.
                    self.core.demote("", 0);
                    tracing::warn!(reason = %why, "HA session ended; campaigning again");
                }
            }
            if started.elapsed() > Duration::from_secs(10) {
                pause = Duration::from_millis(100);
            }
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = self.cancel.cancelled() => break,
            }
            pause = (pause * 2).min(Duration::from_secs(1));
        }
        self.core.demote("", 0);
    }

    /// Grants a lease and registers the campaign key; the keeper renews the lease from then on.
    async fn open_session(&self) -> Result<Session, End> {
        let ttl = self.cfg.lease_ttl.as_secs().max(2) as i64;
        let sent = Instant::now();
        let (lease, granted) = self.retry(|| self.etcd.lease_grant(ttl)).await?;
        let timer = Arc::new(Mutex::new(LeaseTimer::new(Duration::from_secs(granted as u64))));
        let fence = Arc::new(FenceClock::default());
        {
            let mut t = timer.lock().unwrap_or_else(|p| p.into_inner());
            t.acknowledged(sent, granted);
            fence.set(t.fence_at());
        }
        let (lost_tx, lost) = watch::channel(None);
        let keeper = tokio::spawn(keep_lease(self.etcd.clone(), lease, timer, fence.clone(), lost_tx, self.core.clone(), self.cancel.clone()));
        let key = self.keys.election(lease);
        let value = pb::DaemonPeer {
            daemon_id: self.cfg.identity.daemon_id.clone(),
            advertise: self.cfg.identity.advertise.clone(),
            campaign_revision: 0,
        }
        .encode_to_vec();
        let req = epb::TxnRequest { compare: vec![created_at(&key, 0)], success: vec![put_op(&key, value, lease)], failure: vec![get_op(&key)] };
        let mut session = Session { lease, key, epoch: 0, fence, lost, keeper };
        let r = match self.retry(|| self.etcd.txn(req.clone())).await {
            Ok(r) => r,
            Err(end) => {
                // The key may have landed: let the next campaigner in without waiting a TTL.
                let _ = tokio::time::timeout(Duration::from_secs(1), self.etcd.lease_revoke(lease)).await;
                return Err(end);
            }
        };
        session.epoch = if r.succeeded {
            r.header.map(|h| h.revision).unwrap_or(0)
        } else {
            txn_range(&r, 0).first().map(|kv| kv.create_revision).unwrap_or(0)
        };
        tracing::info!(lease = format!("{lease:016x}"), campaign_revision = session.epoch, ttl_s = granted, "campaigning");
        Ok(session)
    }

    /// Sleeps `d`, or ends the session early when the daemon stops.
    async fn nap(&self, d: Duration) -> Result<(), End> {
        tokio::select! {
            _ = tokio::time::sleep(d) => Ok(()),
            _ = self.cancel.cancelled() => Err(End::Cancelled),
        }
    }

    /// Retries an idempotent etcd call while it gets no answer (until cancelled).
    async fn retry<T, F, Fut>(&self, mut f: F) -> Result<T, End>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, EtcdError>>,
    {
        let mut pause = Duration::from_millis(50);
        loop {
            let answer = tokio::select! {
                r = f() => r,
                _ = self.cancel.cancelled() => return Err(End::Cancelled),
            };
            match answer {
                Ok(v) => return Ok(v),
                Err(EtcdError::Uncertain(m)) => {
                    tracing::debug!(error = %m, "etcd did not answer; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = self.cancel.cancelled() => return Err(End::Cancelled),
                    }
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    async fn session(&self) -> End {
        let session = match self.open_session().await {
            Ok(s) => s,
            Err(e) => return e,
        };
        let end = self.follow_and_lead(&session).await;
        // Let the next campaigner in at once (a lease that expires on its own costs a TTL).
        self.core.demote("", 0);
        let _ = tokio::time::timeout(Duration::from_secs(1), self.etcd.lease_revoke(session.lease)).await;
        if matches!(end, End::Cancelled) {
            tracing::info!("left the election");
        }
        end
    }

    async fn follow_and_lead(&self, s: &Session) -> End {
        let mut follow = match self.resync(None).await {
            Ok(f) => f,
            Err(e) => return e,
        };
        // Standby: follow the log until this campaigner's key is the lowest.
        let mut lost = s.lost.clone();
        let mut decide_now = true;
        let mut predecessor: Option<(Vec<u8>, WatchStream)> = None;
        let mut progress = tokio::time::interval(Duration::from_secs(5));
        loop {
            if decide_now {
                decide_now = false;
                let p = self.keys.election_prefix();
                // Every etcd call and pause here also ends at the stop: while etcd is away this
                // loop is all the standby runs, and a stopping daemon waits for it.
                let end = prefix_end(&p);
                let listed = tokio::select! {
                    r = self.etcd.range_all(&p, &end, 0, 1000) => r,
                    _ = self.cancel.cancelled() => return End::Cancelled,
                };
                let (kvs, rev) = match listed {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot list campaigners; retrying");
                        if let Err(end) = self.nap(Duration::from_millis(100)).await {
                            return end;
                        }
                        decide_now = true;
                        continue;
                    }
                };
                let list: Vec<(Vec<u8>, i64)> = kvs.iter().map(|kv| (kv.key.clone(), kv.create_revision)).collect();
                match decide(&s.key, s.epoch, &list) {
                    Decision::Lost => return End::Restart("the campaign key is gone (lease expired)".into()),
                    Decision::Lead => break,
                    // Still the same predecessor (the periodic look below): keep its watch.
                    Decision::WaitFor { key, .. } if predecessor.as_ref().is_some_and(|(k, _)| *k == key) => {}
                    Decision::WaitFor { key, .. } => {
                        let create = epb::WatchCreateRequest { key: key.clone(), start_revision: rev + 1, ..Default::default() };
                        let watched = tokio::select! {
                            r = self.etcd.watch(create) => r,
                            _ = self.cancel.cancelled() => return End::Cancelled,
                        };
                        match watched {
                            Ok(w) => predecessor = Some((key, w)),
                            Err(e) => {
                                tracing::debug!(error = %e, "cannot watch the predecessor; deciding again");
                                if let Err(end) = self.nap(Duration::from_millis(100)).await {
                                    return end;
                                }
                                decide_now = true;
                                continue;
                            }
                        }
                    }
                }
            }
            let pred_event = async {
                match predecessor.as_mut() {
                    Some((_, w)) => w.next().await,
                    None => std::future::pending().await,
                }
            };
            let log_event = async {
                match follow.watch.as_mut() {
                    Some(w) => w.next().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = pred_event => match r {
                    Ok(resp) => {
                        if resp.events.iter().any(|e| e.r#type == rsrun_proto::etcd::mvccpb::event::EventType::Delete as i32) {
                            predecessor = None;
                            decide_now = true;
                        }
                    }
                    Err(_) => {
                        predecessor = None;
                        decide_now = true;
                    }
                },
                r = log_event => {
                    let outcome = match r {
                        Ok(resp) => self.apply_watch(&mut follow, resp),
                        Err(EtcdError::Compacted(m)) => Err(format!("watch history compacted: {m}")),
                        Err(e) => {
                            // Resume where it stopped (a compaction meanwhile shows up on reopen).
                            tracing::debug!(error = %e, "log watch interrupted; resuming");
                            follow.watch = None;
                            Ok(())
                        }
                    };
                    if let Err(why) = outcome {
                        tracing::warn!(reason = %why, "replica resync");
                        follow = match self.resync(Some(follow)).await { Ok(f) => f, Err(e) => return e };
                    }
                    if follow.watch.is_none() {
                        follow = match self.reopen(follow).await { Ok(f) => f, Err(e) => return e };
                    }
                }
                _ = progress.tick() => {
                    if let Some(w) = &follow.watch {
                        w.request_progress();
                    }
                    // The predecessor's delete may never arrive (a stalled stream, a lost
                    // event: ha-etcd.md §3.4): look at the campaigners again now and then.
                    decide_now = true;
                    if follow.last_heard.elapsed() > Duration::from_secs(15) {
                        tracing::warn!("no word from the log watch for 15 s; reopening it");
                        follow.watch = None;
                        follow = match self.reopen(follow).await { Ok(f) => f, Err(e) => return e };
                    }
                }
                _ = lost.changed() => {
                    let why = lost.borrow().clone().unwrap_or_default();
                    return End::Restart(format!("election lease lost: {why}"));
                }
                _ = self.cancel.cancelled() => return End::Cancelled,
            }
        }
        drop(predecessor);
        drop(follow.watch.take());
        // The takeover's etcd calls retry while etcd is unsure; a stop ends them (the future is
        // dropped at an await, so before `promote`, which runs last and without awaiting).
        let took_over = tokio::select! {
            r = self.take_over(s, &follow) => r,
            _ = self.cancel.cancelled() => Err(End::Cancelled),
        };
        if let Err(e) = took_over {
            return e;
        }
        // Leader until the lease may lapse, a write is refused, or the daemon stops.
        loop {
            let fence_at = s.fence.at().unwrap_or_else(Instant::now);
            tokio::select! {
                _ = tokio::time::sleep_until(fence_at) => {
                    if s.fence.fenced() {
                        self.core.demote("", 0);
                        tracing::warn!("self-fenced: the election lease was not renewed in time");
                        return End::Restart("the election lease was not renewed before its fencing point".into());
                    }
                }
                // A log write refused, or the executor stepped down by itself (an answer or its
                // timer found the fencing point passed before this loop woke).
                e = self.core.deposed() => {
                    self.core.demote("", 0);
                    return End::Restart(format!("deposed: {e}"));
                }
                _ = lost.changed() => {
                    self.core.demote("", 0);
                    let why = lost.borrow().clone().unwrap_or_default();
                    return End::Restart(format!("election lease lost: {why}"));
                }
                _ = self.cancel.cancelled() => {
                    self.core.demote("", 0);
                    return End::Cancelled;
                }
            }
        }
    }

    /// The barrier write, the catch-up at its revision, and promotion.
    async fn take_over(&self, s: &Session, follow: &Follow) -> Result<(), End> {
        let me = &self.cfg.identity;
        let value = leader_value(&me.daemon_id, &me.advertise, s.epoch);
        let barrier = epb::TxnRequest {
            compare: vec![created_at(&s.key, s.epoch)],
            success: vec![put_op(&self.keys.leader(), value.clone(), 0)],
            failure: vec![get_op(&s.key)],
        };
        // Catch up with everything committed before the barrier, read at its revision. A read
        // etcd did not answer (an election of its own, a compaction) is tried again behind a
        // new barrier, up to the fence: one hiccup must not cost a whole campaign.
        // Bounded while the lease lives too: a candidate that cannot catch up (reads that time
        // out, a compaction window shorter than the read) steps aside for the next one.
        let give_up = Instant::now() + self.stuck_limit();
        let (h, snap) = loop {
            if s.fence.fenced() {
                return Err(End::Restart("the lease lapsed before the takeover barrier".into()));
            }
            if Instant::now() >= give_up {
                return Err(End::Restart(format!(
                    "the takeover did not catch up with the log in {} s: letting the next candidate try",
                    self.stuck_limit().as_secs()
                )));
            }
            let h = match self.etcd.txn(barrier.clone()).await {
                Ok(r) if r.succeeded => r.header.map(|h| h.revision).unwrap_or(0),
                Ok(_) => return Err(End::Restart("the campaign key is gone at takeover".into())),
                Err(EtcdError::Uncertain(_)) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            match self.catch_up(h).await {
                Ok(Ok(snap)) => break (h, snap),
                Ok(Err(why)) => return Err(End::Restart(why)),
                Err(RecoverError::Etcd(e @ (EtcdError::Uncertain(_) | EtcdError::Compacted(_)))) => {
                    tracing::debug!(error = %e, barrier_revision = h, "takeover read not answered; again behind a new barrier");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let _ = follow;
        let owner = Owner { election_key: s.key.clone(), epoch: s.epoch, leader_value: value, fence: s.fence.clone() };
        let store = EtcdLog::new(self.etcd.clone(), self.keys.clone(), tokio::runtime::Handle::current(), owner, snap, self.core.metrics.clone())
            .with_snapshot_every(self.cfg.snapshot_bytes);
        if s.fence.fenced() {
            return Err(End::Restart("the lease lapsed during the takeover".into()));
        }
        self.core.promote(s.epoch as u64, Box::new(store), s.fence.clone()).map_err(|e| End::Restart(e.to_string()))?;
        let (seq, _) = self.core.position();
        tracing::info!(epoch = s.epoch, barrier_revision = h, seq, "leading");
        Ok(())
    }

    /// Brings the replica to barrier revision `h`: the log after its position, or the snapshot
    /// and the log after it when the replica is behind the snapshot. The snapshot pointer's mod
    /// revision, or why the replica could not take the state.
    async fn catch_up(&self, h: i64) -> Result<Result<TakeoverSnapshot, String>, RecoverError> {
        let (seq, _) = self.core.position();
        let (ptr, _) = self.etcd.range_all(&self.keys.snap_current(), &[], h, 1).await?;
        let snap: Option<SnapPointer> = ptr.first().and_then(|kv| postcard::from_bytes(&kv.value).ok());
        let snap_mod = ptr.first().map(|kv| kv.mod_revision).unwrap_or(0);
        let caught_up = match &snap {
            Some(p) if p.seq > seq => false,
            _ => {
                let values = log::log_after(&self.etcd, &self.keys, seq, h).await?;
                self.apply_values(&values).is_ok()
            }
        };
        if !caught_up {
            let r = recover(&self.etcd, &self.keys, h).await?;
            if let Err(e) = self.core.replica_reset(r.state, r.seq, r.last_at) {
                return Ok(Err(e.to_string()));
            }
        }
        Ok(Ok(TakeoverSnapshot { mod_revision: snap_mod, seq: snap.as_ref().map_or(0, |p| p.seq) }))
    }

    /// Decodes log values and applies them to the replica.
    fn apply_values(&self, values: &[Vec<u8>]) -> Result<u64, String> {
        let mut seq = self.core.position().0;
        for v in values {
            let b = Batch::decode(v)?;
            if b.last_seq <= seq {
                continue;
            }
            let entries = b.entries()?;
            seq = self.core.replica_apply(&entries).map_err(|e| e.to_string())?;
        }
        Ok(seq)
    }

    /// Applies one watch response to the replica; `Err` asks for a resync.
    fn apply_watch(&self, f: &mut Follow, resp: epb::WatchResponse) -> Result<(), String> {
        f.last_heard = Instant::now();
        // Only events move the replica's revision: etcd 3.4 can send a progress notification with
        // the current revision while an unsynced watcher still has older events to deliver.
        if resp.events.is_empty() {
            return Ok(());
        }
        let log_prefix = self.keys.log_prefix();
        let (current, leader) = (self.keys.snap_current(), self.keys.leader());
        for ev in resp.events {
            let Some(kv) = ev.kv else { continue };
            if kv.mod_revision <= f.revision {
                return Err(format!("the watch went back in time (revision {} after {})", kv.mod_revision, f.revision));
            }
            f.revision = kv.mod_revision;
            if kv.key.starts_with(&log_prefix) {
                let b = Batch::decode(&kv.value)?;
                let seq = self.core.position().0;
                if b.last_seq > seq {
                    self.core.replica_apply(&b.entries()?).map_err(|e| e.to_string())?;
                }
                self.core.metrics.ha_replica_lag_entries.set(b.last_seq.saturating_sub(self.core.position().0) as i64);
            } else if kv.key == current {
                let p: SnapPointer = postcard::from_bytes(&kv.value).map_err(|e| format!("snapshot pointer: {e}"))?;
                if p.seq > self.core.position().0 {
                    return Err(format!("a snapshot at {} replaced log this replica had not seen", p.seq));
                }
            } else if kv.key == leader
                && let Some(peer) = read_peer(&kv.value)
            {
                self.core.set_leader_hint(&peer.advertise, peer.campaign_revision);
                self.core.metrics.ha_epoch.set(peer.campaign_revision as i64);
            }
        }
        Ok(())
    }

    /// How long a takeover, a resync or a watch reopen may keep failing before the session ends
    /// (its campaign key goes, so a daemon that cannot read the log does not hold its place in
    /// the line): three lease TTLs, at least 10 s.
    fn stuck_limit(&self) -> Duration {
        (self.cfg.lease_ttl * 3).max(Duration::from_secs(10))
    }

    /// Rebuilds the replica from etcd (now) and opens the log watch after that revision.
    async fn resync(&self, _old: Option<Follow>) -> Result<Follow, End> {
        let mut pause = Duration::from_millis(50);
        let give_up = Instant::now() + self.stuck_limit();
        let r = loop {
            let recovered = tokio::select! {
                r = recover(&self.etcd, &self.keys, 0) => r,
                _ = self.cancel.cancelled() => return Err(End::Cancelled),
            };
            match recovered {
                Ok(r) => break r,
                Err(RecoverError::Damaged(m)) => {
                    tracing::error!(error = %m, "cannot rebuild the replica: the rsrun log in etcd is damaged");
                    return Err(End::Restart(m));
                }
                Err(RecoverError::Etcd(e @ EtcdError::Refused(_))) => {
                    tracing::error!(error = %e, "cannot rebuild the replica: etcd refuses the read");
                    return Err(End::Restart(e.to_string()));
                }
                Err(RecoverError::Etcd(e)) if Instant::now() >= give_up => {
                    return Err(End::Restart(format!("cannot read the log for {} s: {e}", self.stuck_limit().as_secs())));
                }
                Err(RecoverError::Etcd(e)) => {
                    tracing::debug!(error = %e, "cannot read the log yet; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = self.cancel.cancelled() => return Err(End::Cancelled),
                    }
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
            }
        };
        if let Role::Leader { .. } = self.core.role() {
            return Err(End::Restart("a leader does not resync".into()));
        }
        self.core.replica_reset(r.state, r.seq, r.last_at).map_err(|e| End::Restart(e.to_string()))?;
        if let Some(l) = &r.leader {
            self.core.set_leader_hint(&l.advertise, l.campaign_revision);
        }
        tracing::info!(seq = r.seq, revision = r.revision, "replica rebuilt from etcd");
        self.reopen(Follow { revision: r.revision, watch: None, last_heard: Instant::now() }).await
    }

    /// (Re)opens the log watch after the replica's revision; a compacted start means a resync.
    async fn reopen(&self, mut f: Follow) -> Result<Follow, End> {
        let all = self.keys.all();
        let create = epb::WatchCreateRequest {
            key: all.clone(),
            range_end: prefix_end(&all),
            start_revision: f.revision + 1,
            progress_notify: true,
            filters: vec![epb::watch_create_request::FilterType::Nodelete as i32],
            // Catching up, etcd may send a thousand revisions of 512 KiB snapshot chunks at
            // once: in pieces, none can pass the decoding limit and stall the replica.
            fragment: true,
            ..Default::default()
        };
        let mut pause = Duration::from_millis(50);
        let give_up = Instant::now() + self.stuck_limit();
        loop {
            let watched = tokio::select! {
                r = self.etcd.watch(create.clone()) => r,
                _ = self.cancel.cancelled() => return Err(End::Cancelled),
            };
            match watched {
                Ok(w) => {
                    f.watch = Some(w);
                    f.last_heard = Instant::now();
                    return Ok(f);
                }
                Err(EtcdError::Compacted(m)) => {
                    tracing::warn!(reason = %m, "replica resync: the log watch's history was compacted");
                    return Box::pin(self.resync(Some(f))).await;
                }
                Err(e @ EtcdError::Refused(_)) => return Err(e.into()),
                Err(e) if Instant::now() >= give_up => {
                    return Err(End::Restart(format!("cannot open the log watch for {} s: {e}", self.stuck_limit().as_secs())));
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot open the log watch; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = self.cancel.cancelled() => return Err(End::Cancelled),
                    }
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
            }
        }
    }
}

/// Renews the lease ahead of its fencing point until cancelled; reports a lost lease.
async fn keep_lease(
    etcd: Etcd,
    lease: i64,
    timer: Arc<Mutex<LeaseTimer>>,
    fence: Arc<FenceClock>,
    lost: watch::Sender<Option<String>>,
    core: Arc<Core>,
    cancel: CancellationToken,
) {
    let mut failed = false;
    loop {
        let now = Instant::now();
        let mut next = timer.lock().unwrap_or_else(|p| p.into_inner()).next_renewal(now);
        if failed {
            // After a failed renewal, try again soon (another member may answer), not a third of
            // the way to the fencing point.
            next = next.min(now + Duration::from_millis(150));
        }
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = cancel.cancelled() => return,
        }
        if timer.lock().unwrap_or_else(|p| p.into_inner()).fenced(Instant::now()) {
            let _ = lost.send(Some("not renewed before its fencing point".into()));
            return;
        }
        let sent = Instant::now();
        match etcd.lease_keep_alive(lease).await {
            Ok(ttl) => {
                let mut t = timer.lock().unwrap_or_else(|p| p.into_inner());
                if !t.acknowledged(sent, ttl) {
                    fence.set(None);
                    drop(t);
                    let _ = lost.send(Some("etcd says the lease expired".into()));
                    return;
                }
                fence.set(t.fence_at());
                core.metrics.ha_lease_remaining_seconds.set(t.remaining(Instant::now()).as_secs_f64());
                failed = false;
            }
            Err(e) => {
                tracing::debug!(error = %e, "lease renewal failed; retrying");
                failed = true;
            }
        }
    }
}
