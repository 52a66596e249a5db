//! Traffic during faults, a recorder of every call (invoke, completion, ok or failed), and the checks
//! run after every scenario (ha-etcd.md §7.3):
//!
//! - no acknowledged write lost: every acknowledged `set` is read back with its value; the counter
//!   ends at least at the number of acknowledged `add`s and at most at that plus the unacknowledged
//!   ones (which may or may not have landed);
//! - the counter is linearizable as a counter of +1 steps: no two acknowledged `add`s returned the
//!   same value, and none returned more than the final value;
//! - no duplicate `(job, round, rank)` or `(job, round, node)` across every client's observations;
//! - no epoch or round regression seen by any client;
//! - replaying the log in etcd gives the leader's state;
//! - (where the history is complete) no batch was committed by a deposed leader: every log key was
//!   written by the epoch of the latest leader record before it.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rsrun_rendezvous::client::{JobSpec, JoinSpec, RdzvClient};
use rsrun_rendezvous::ha::etcd::{Etcd, etcdserverpb, prefix_end};
use rsrun_rendezvous::ha::read_peer;
use rsrun_rendezvous::ha::log::{Batch, Keys, recover};
use rsrun_rendezvous::proto::{self as pb, JobState};

use crate::harness::HaGroup;

/// One recorded call.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    /// `add(ctr, 1)`: the value it returned, or `None` when it failed (it may still have landed).
    Add { value: Option<i64> },
    /// `set(key, value)` acknowledged (or not).
    Set { key: String, value: String, ok: bool },
    /// A join answered: the assignment.
    Assign { agent: usize, job: String, round: u64, rank: u32, node: String },
    /// The highest epoch a client had seen after a call.
    Epoch { client: usize, epoch: u64 },
}

/// Everything recorded, with completion times.
#[derive(Debug, Default)]
pub(crate) struct History {
    ops: Mutex<Vec<(Instant, Op)>>,
    failures: Mutex<Vec<String>>,
}

impl History {
    fn push(&self, op: Op) {
        self.ops.lock().unwrap().push((Instant::now(), op));
    }

    fn fail(&self, what: String) {
        self.failures.lock().unwrap().push(what);
    }

    /// The recorded calls.
    pub(crate) fn ops(&self) -> Vec<(Instant, Op)> {
        self.ops.lock().unwrap().clone()
    }

    /// Acknowledged calls after `t`.
    pub(crate) fn acked_after(&self, t: Instant) -> usize {
        self.ops()
            .iter()
            .filter(|(at, op)| *at > t && matches!(op, Op::Add { value: Some(_), .. } | Op::Set { ok: true, .. } | Op::Assign { .. }))
            .count()
    }

    /// Acknowledged calls in all.
    pub(crate) fn acked(&self) -> usize {
        self.acked_after(Instant::now() - Duration::from_secs(3600))
    }
}

/// Clients making traffic until stopped: two counters, two setters, and a 3-node job whose node 0
/// leaves after every round (round churn), each on a client of its own.
pub(crate) struct Workload {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    pub(crate) history: Arc<History>,
}

impl Workload {
    pub(crate) fn start(g: &HaGroup, job: &str) -> Workload {
        let stop = Arc::new(AtomicBool::new(false));
        let history = Arc::new(History::default());
        let mut tasks = Vec::new();
        // The store belongs to a job: one node holds it, with a lease longer than any test.
        let holder = g.client();
        let spec = JobSpec { min_nodes: 1, max_nodes: 1, last_call: Duration::ZERO, lease: Duration::from_secs(3600), max_restarts: 0, fixed_ranks: false };
        let joined = g
            .rt
            .block_on(holder.join(JoinSpec {
                job_id: job.to_owned(),
                node_id: "holder".into(),
                addrs: vec!["127.0.0.1".into()],
                local_world_size: 1,
                rank_hint: None,
                config: spec,
                timeout: Duration::from_secs(30),
                master_port: 1,
                hostname: "holder".into(),
            }))
            .expect("the store job forms");
        let round = joined.round.map(|r| r.round).unwrap_or(1);
        for c in 0..2 {
            let (client, stop, h, job) = (g.client(), stop.clone(), history.clone(), job.to_owned());
            tasks.push(g.rt.spawn(async move {
                let store = client.store(&job, round);
                while !stop.load(Ordering::Relaxed) {
                    let r = store.add("ctr", 1).await;
                    if let Err(e) = &r {
                        h.fail(format!("add: {e}"));
                    }
                    h.push(Op::Add { value: r.ok() });
                    h.push(Op::Epoch { client: c, epoch: client.epoch() });
                    tokio::time::sleep(Duration::from_millis(15)).await;
                }
            }));
        }
        for w in 0..2 {
            let (client, stop, h, job) = (g.client(), stop.clone(), history.clone(), job.to_owned());
            tasks.push(g.rt.spawn(async move {
                let store = client.store(&job, round);
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let (key, value) = (format!("k-{w}-{n}"), format!("v-{w}-{n}"));
                    let r = store.set(&key, value.as_bytes()).await;
                    if let Err(e) = &r {
                        h.fail(format!("set: {e}"));
                    }
                    h.push(Op::Set { key, value, ok: r.is_ok() });
                    h.push(Op::Epoch { client: 10 + w, epoch: client.epoch() });
                    tokio::time::sleep(Duration::from_millis(15)).await;
                }
            }));
        }
        let mjob = format!("{job}-m");
        for agent in 0..3usize {
            let (client, stop, h, job) = (g.client(), stop.clone(), history.clone(), mjob.clone());
            tasks.push(g.rt.spawn(async move { member(agent, client, stop, h, job).await }));
        }
        Workload { stop, tasks, history }
    }

    /// Stops the traffic and waits for every call in flight.
    pub(crate) fn stop(self, g: &HaGroup) -> Arc<History> {
        self.stop.store(true, Ordering::Relaxed);
        g.rt.block_on(async {
            for t in self.tasks {
                let _ = tokio::time::timeout(Duration::from_secs(90), t).await;
            }
        });
        self.history
    }
}

/// Returns once the workload is stopped.
async fn stopped(stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn member(agent: usize, client: RdzvClient, stop: Arc<AtomicBool>, h: Arc<History>, job: String) {
    let node = format!("node-{agent}");
    let spec = JobSpec {
        min_nodes: 3,
        max_nodes: 3,
        last_call: Duration::ZERO,
        lease: Duration::from_secs(60),
        max_restarts: 0,
        fixed_ranks: false,
    };
    while !stop.load(Ordering::Relaxed) {
        let join = client.join(JoinSpec {
            job_id: job.clone(),
            node_id: node.clone(),
            addrs: vec!["127.0.0.1".into()],
            local_world_size: 1,
            rank_hint: None,
            config: spec.clone(),
            timeout: Duration::from_secs(30),
            master_port: 1,
            hostname: node.clone(),
        });
        // A join waits for all three agents: once the others stopped, it would sit out its 30 s.
        // Given up at the stop, it records nothing (only acknowledged assignments are checked).
        let joined = tokio::select! {
            r = join => r,
            _ = stopped(&stop) => return,
        };
        h.push(Op::Epoch { client: 20 + agent, epoch: client.epoch() });
        let resp = match joined {
            Ok(r) => r,
            Err(e) => {
                h.fail(format!("join of {node}: {e}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let round = resp.round.as_ref().map(|r| r.round).unwrap_or(0);
        let rank = resp.node.as_ref().map(|n| n.node_rank).unwrap_or(u32::MAX);
        h.push(Op::Assign { agent, job: job.clone(), round, rank, node: node.clone() });
        if agent == 0 {
            // Round churn: leave, so the round ends and everyone joins the next one.
            tokio::time::sleep(Duration::from_millis(200)).await;
            if let Err(e) = client.leave(&job, &node, "churn").await {
                h.fail(format!("leave: {e}"));
            }
        } else {
            // Wait for the round to end (pushed), then join the next one.
            let mut rx = client.watch(&job, &node);
            let _ = tokio::time::timeout(Duration::from_secs(30), async {
                loop {
                    let moved = rx.borrow_and_update().as_ref().is_some_and(|v| v.round > round || v.state != JobState::Running as i32);
                    if moved || stop.load(Ordering::Relaxed) {
                        return;
                    }
                    tokio::select! {
                        r = rx.changed() => if r.is_err() { return },
                        // Agent 0 may have stopped without leaving: nothing else wakes this wait.
                        _ = stopped(&stop) => return,
                    }
                }
            })
            .await;
        }
    }
}

/// Every check of the module doc; panics with what broke. Returns a one-line summary.
pub(crate) fn check(g: &HaGroup, history: &History, complete_history: bool) -> String {
    let ops = history.ops();
    let client = g.client();
    // Acknowledged sets survive.
    let sets: Vec<(String, String)> = ops.iter().filter_map(|(_, o)| match o {
        Op::Set { key, value, ok: true } => Some((key.clone(), value.clone())),
        _ => None,
    }).collect();
    let store_job = g.rt.block_on(async { client.status(None).await }).expect("status after the run");
    let job_id = store_job
        .jobs
        .iter()
        .filter_map(|j| j.view.as_ref().map(|v| v.job_id.clone()))
        .find(|id| !id.ends_with("-m"))
        .expect("the workload's job");
    let round = store_job.jobs.iter().find(|j| j.view.as_ref().is_some_and(|v| v.job_id == job_id)).and_then(|j| j.view.as_ref()).map(|v| v.round).unwrap_or(1);
    let store = client.store(&job_id, round);
    for (k, v) in &sets {
        let got = g.rt.block_on(store.get(k, Duration::ZERO)).unwrap_or_else(|e| panic!("acknowledged set of {k} lost: {e}"));
        assert_eq!(String::from_utf8_lossy(&got), *v, "acknowledged set of {k} lost");
    }
    // The counter.
    let acked: Vec<i64> = ops.iter().filter_map(|(_, o)| if let Op::Add { value: Some(v), .. } = o { Some(*v) } else { None }).collect();
    let unacked = ops.iter().filter(|(_, o)| matches!(o, Op::Add { value: None, .. })).count() as i64;
    let final_value: i64 = g
        .rt
        .block_on(store.get("ctr", Duration::ZERO))
        .map(|b| String::from_utf8_lossy(&b).parse().expect("counter"))
        .unwrap_or(0);
    let mut seen = std::collections::HashSet::new();
    for v in &acked {
        assert!(seen.insert(*v), "two acknowledged adds returned {v}: a lost or duplicated increment");
        assert!(*v <= final_value, "an add returned {v}, above the final counter {final_value}");
    }
    assert!(final_value >= acked.len() as i64, "counter {final_value} < {} acknowledged adds: an acknowledged add was lost", acked.len());
    assert!(final_value <= acked.len() as i64 + unacked, "counter {final_value} > acknowledged {} + unacknowledged {unacked}", acked.len());
    // Assignments.
    let mut by_rank: HashMap<(String, u64, u32), String> = HashMap::new();
    let mut by_node: HashMap<(String, u64, String), u32> = HashMap::new();
    let mut rounds: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
    let mut epochs: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
    for (_, o) in &ops {
        match o {
            Op::Assign { agent, job, round, rank, node } => {
                if let Some(other) = by_rank.insert((job.clone(), *round, *rank), node.clone()) {
                    assert_eq!(&other, node, "rank {rank} of round {round} of {job} went to {other} and {node}");
                }
                if let Some(other) = by_node.insert((job.clone(), *round, node.clone()), *rank) {
                    assert_eq!(other, *rank, "{node} got ranks {other} and {rank} in round {round} of {job}");
                }
                rounds.entry(*agent).or_default().push(*round);
            }
            Op::Epoch { client, epoch } => epochs.entry(*client).or_default().push(*epoch),
            _ => {}
        }
    }
    for (agent, rs) in &rounds {
        assert!(rs.windows(2).all(|w| w[0] <= w[1]), "agent {agent} saw rounds go back: {rs:?}");
    }
    for (c, es) in &epochs {
        assert!(es.windows(2).all(|w| w[0] <= w[1]), "client {c} saw epochs go back: {es:?}");
    }
    // Replay equals live.
    let replay = replay_matches(g);
    let deposed = if complete_history { no_commit_by_a_deposed_leader(g) } else { "history compacted: not checked".into() };
    format!(
        "{} sets, {} adds acked ({} not), counter {final_value}, {} assignments in {} rounds, epochs {:?}; {replay}; {deposed}",
        sets.len(),
        acked.len(),
        unacked,
        by_rank.len(),
        rounds.values().map(|r| r.last().copied().unwrap_or(0)).max().unwrap_or(0),
        epochs.values().filter_map(|e| e.last()).max()
    )
}

fn comparable(s: &pb::JobStatus) -> String {
    let mut s = s.clone();
    for n in &mut s.nodes {
        n.last_heartbeat_unix_ms = 0;
    }
    s.nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    format!("{s:?}")
}

/// The state rebuilt from etcd equals what the leader serves.
fn replay_matches(g: &HaGroup) -> String {
    let client = g.client();
    let etcd = g.etcd_client();
    let keys = Keys::new(&g.prefix);
    for attempt in 0..5 {
        let before = g.rt.block_on(client.status(None)).expect("status");
        let rebuilt = g.rt.block_on(recover(&etcd, &keys, 0)).unwrap_or_else(|e| panic!("cannot replay the etcd log: {e}"));
        let after = g.rt.block_on(client.status(None)).expect("status");
        let live: BTreeMap<String, String> =
            before.jobs.iter().filter_map(|j| Some((j.view.as_ref()?.job_id.clone(), comparable(j)))).collect();
        let live_after: BTreeMap<String, String> =
            after.jobs.iter().filter_map(|j| Some((j.view.as_ref()?.job_id.clone(), comparable(j)))).collect();
        let replayed: BTreeMap<String, String> =
            rebuilt.state.jobs.values().map(|j| (j.id.clone(), comparable(&rebuilt.state.job_status(j)))).collect();
        if live == replayed {
            return format!("replay of {} entries equals the leader's {} jobs", rebuilt.seq, live.len());
        }
        // A timer of the leader may have fired in between: compare again.
        if live != live_after || attempt < 4 {
            std::thread::sleep(Duration::from_millis(300));
            continue;
        }
        panic!("the state replayed from etcd differs from the leader's:\nleader: {live:#?}\nreplay: {replayed:#?}");
    }
    panic!("the leader's state kept changing while checking replay");
}

/// Reads the whole history of the group's keys and checks that every log batch carries the epoch
/// of the leader record written last before it (a deposed leader commits nothing once the next
/// leader's barrier is written).
pub(crate) fn no_commit_by_a_deposed_leader(g: &HaGroup) -> String {
    let etcd: Etcd = g.etcd_client();
    let keys = Keys::new(&g.prefix);
    let (mut leader_epoch, mut batches, mut leaders) = (0u64, 0usize, 0usize);
    g.rt.block_on(async {
        let all = keys.all();
        let (_, now) = etcd.range_all(&keys.format(), &[], 0, 1).await.expect("revision");
        let create = rsrun_proto_watch(&all, 1);
        let mut w = etcd.watch(create).await.expect("watch from revision 1");
        let mut rev = 0;
        while rev < now {
            let r = tokio::time::timeout(Duration::from_secs(10), w.next()).await.expect("history").expect("history");
            if let Some(h) = &r.header
                && r.events.is_empty()
            {
                rev = rev.max(h.revision);
            }
            for ev in r.events {
                let Some(kv) = ev.kv else { continue };
                rev = kv.mod_revision;
                if ev.r#type != 0 {
                    continue;
                }
                if kv.key == keys.leader() {
                    let p = read_peer(&kv.value).expect("leader record");
                    assert!(p.campaign_revision >= leader_epoch, "leader records went back in epoch");
                    leader_epoch = p.campaign_revision;
                    leaders += 1;
                } else if kv.key.starts_with(&keys.log_prefix()) {
                    let b = Batch::decode(&kv.value).expect("batch");
                    assert_eq!(
                        b.epoch, leader_epoch,
                        "log batch {}..={} of epoch {} committed at revision {} after the leader record of epoch {leader_epoch}",
                        b.first_seq, b.last_seq, b.epoch, kv.mod_revision
                    );
                    batches += 1;
                }
            }
            if rev >= now {
                break;
            }
            w.request_progress();
        }
    });
    format!("{batches} batches all by the current leader ({leaders} leader records)")
}

fn rsrun_proto_watch(all: &[u8], from: i64) -> etcdserverpb::WatchCreateRequest {
    etcdserverpb::WatchCreateRequest { key: all.to_vec(), range_end: prefix_end(all), start_revision: from, ..Default::default() }
}
