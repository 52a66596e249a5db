//! The rendezvous state machine: pure functions of (state, command, time).
//!
//! Nothing here does I/O, reads a clock or draws random numbers. The executor ([`crate::service`])
//! stamps each [`Command`] with the time, applies it under a lock, journals it, and wakes waiters.
//! Replaying the journal's commands with their recorded times rebuilds the same state, which is what
//! makes the service durable across `kill -9`.
//!
//! # Job lifecycle ([`Phase`])
//!
//! ```text
//!             join (max reached) / last call over / every expected node back
//!   Forming(r) ────────────────────────────────────────────────────────────▶ Running(r)
//!      ▲                                                                        │
//!      │  member left or lease expired · worker failure within budget ·         │
//!      └──── new node arrived below max (scale-up) ◀────────────────────────────┤
//!                                                                               │
//!   Completed ◀── every member finished                                         │
//!   Failed    ◀── failure over budget · not restartable · FailJob ◀─────────────┘ (also from Forming)
//! ```
//!
//! A round ends by moving to `Forming(r + 1)`: its surviving members become *rejoining* and must call
//! `Join` again; nodes that waited are joined at once. A forming round closes when `max_nodes` have
//! joined, when at least `min_nodes` joined and the last-call window passed, or (after a round ended)
//! as soon as every surviving member is back and at least `min_nodes` joined — so restarts do not sit
//! out a last-call window.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rsrun_proto::v1 as pb;
use serde::{Deserialize, Serialize};

use crate::RdzvError;
use crate::validate::{self, Limits};

/// Milliseconds since the Unix epoch.
pub type Ms = u64;

/// How many failures a job remembers (oldest dropped first).
const MAX_FAILURES: usize = 64;
/// How many request ids a job remembers for de-duplicating retried calls, at least (see
/// `Job::dedup_window`).
const MAX_DEDUP: usize = 8192;
/// A remembered answer younger than this (state time) is kept even when the window is over its
/// count (up to [`MAX_DEDUP_WINDOW`]): a retry arrives within the client's retry horizon, and a
/// count alone forgot ids within a second in a busy job (every set, multi-set, delete and failed
/// compare-set with an id takes a slot), so a retry re-applied its write over a newer one. The
/// longest store write of the client (`client::StoreClient`, no wait) retries for its call
/// timeout and takes an answer until twice that: 60 s at the launcher's largest call timeout
/// (30 s); this is twice that. (Blocking calls with ids, barrier arrivals, are covered by the
/// count: twice the world.)
const DEDUP_MIN_AGE_MS: Ms = 120_000;
/// The most answers a job's dedup window keeps however young they are and however large the world
/// its nodes declare (twice a 131,072-rank world): the window is held in memory and in every
/// snapshot, outside the store's byte caps.
const MAX_DEDUP_WINDOW: usize = 1 << 18;
/// Shortest and longest lease a job may ask for.
const LEASE_RANGE_MS: (u64, u64) = (100, 3_600_000);
/// Longest last-call window.
const MAX_LAST_CALL_MS: u64 = 24 * 3_600_000;
/// Most restarts a job may budget.
const MAX_RESTARTS: u32 = 1_000_000;
/// Most participants of one barrier.
const MAX_BARRIER_PARTICIPANTS: u32 = 1_000_000;
/// Most barriers one job may hold.
const MAX_BARRIERS: usize = 10_000;
/// Most unique-id names per round.
const MAX_UNIQUE_IDS: usize = 1_024;

/// A job's membership configuration, fixed by its first joiner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    /// Fewest nodes a round may have.
    pub min_nodes: u32,
    /// Most nodes a round may have.
    pub max_nodes: u32,
    /// Wait after `min_nodes` joined, for more.
    pub last_call_ms: u64,
    /// A node not renewed for this long is dead.
    pub lease_ms: u64,
    /// Global restart budget for worker failures.
    pub max_restarts: u32,
    /// Node ranks are fixed (torchrun's static backend): every node names its rank as `rank_hint`,
    /// in `0..max_nodes`, and two live nodes naming the same rank fail the job.
    pub fixed_ranks: bool,
}

impl JobSpec {
    /// Checks the spec against the limits.
    pub fn validate(&self, limits: &Limits) -> Result<(), RdzvError> {
        if self.min_nodes == 0 {
            return Err(RdzvError::invalid("config.min_nodes", "0; at least 1 node is required"));
        }
        if self.min_nodes > self.max_nodes {
            return Err(RdzvError::invalid(
                "config.max_nodes",
                format!("min_nodes {} is greater than max_nodes {}", self.min_nodes, self.max_nodes),
            ));
        }
        if self.max_nodes > limits.max_nodes_per_job {
            return Err(RdzvError::invalid(
                "config.max_nodes",
                format!("{} exceeds the service limit of {} nodes per job", self.max_nodes, limits.max_nodes_per_job),
            ));
        }
        if !(LEASE_RANGE_MS.0..=LEASE_RANGE_MS.1).contains(&self.lease_ms) {
            return Err(RdzvError::invalid(
                "config.lease_ms",
                format!("{} ms; expected {} to {} ms", self.lease_ms, LEASE_RANGE_MS.0, LEASE_RANGE_MS.1),
            ));
        }
        if self.last_call_ms > MAX_LAST_CALL_MS {
            return Err(RdzvError::invalid(
                "config.last_call_ms",
                format!("{} ms; at most {MAX_LAST_CALL_MS} ms", self.last_call_ms),
            ));
        }
        if self.fixed_ranks && self.min_nodes != self.max_nodes {
            return Err(RdzvError::invalid(
                "config.fixed_ranks",
                format!("with nnodes {}:{}; fixed node ranks need a fixed node count", self.min_nodes, self.max_nodes),
            ));
        }
        if self.max_restarts > MAX_RESTARTS {
            return Err(RdzvError::invalid(
                "config.max_restarts",
                format!("{}; at most {MAX_RESTARTS}", self.max_restarts),
            ));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "nnodes {}:{}, max_restarts {}, last_call {} ms, lease {} ms{}",
            self.min_nodes,
            self.max_nodes,
            self.max_restarts,
            self.last_call_ms,
            self.lease_ms,
            if self.fixed_ranks { ", fixed node ranks" } else { "" }
        )
    }
}

/// A node (one launcher) known to a job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Node {
    /// Node id, unique within the job.
    pub id: String,
    /// Host name, for people.
    pub hostname: String,
    /// Addresses others can reach it at, preferred first.
    pub addrs: Vec<String>,
    /// Workers it runs.
    pub local_world_size: u32,
    /// Preferred node rank.
    pub rank_hint: Option<u32>,
    /// Port it reserved for MASTER_PORT.
    pub master_port: u32,
    /// When its lease runs out unless renewed.
    pub lease_expires: Ms,
    /// Last join or keep-alive.
    pub last_heartbeat: Ms,
    /// Its node rank in the last round it took part in (sticky ranks).
    pub last_rank: Option<u32>,
}

/// A participant of a running round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Node rank (GROUP_RANK).
    pub node_rank: u32,
    /// Workers on the node.
    pub local_world_size: u32,
    /// Global rank of its local rank 0.
    pub rank_offset: u32,
}

/// Where a job is in its lifecycle; transitions are drawn in the module documentation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Phase {
    /// Nodes are joining the job's current round.
    Forming {
        /// Nodes that joined this round.
        joined: BTreeSet<String>,
        /// Members of the previous round that are alive but have not joined again yet.
        rejoining: BTreeSet<String>,
        /// Set when `min_nodes` joined: the round closes at this time at the latest.
        last_call_deadline: Option<Ms>,
        /// True when the round follows an ended one: it closes once every rejoining node is back.
        early_close: bool,
    },
    /// The round is formed and its workers run.
    Running {
        /// Participants by node id.
        members: BTreeMap<String, Member>,
        /// Members whose workers all succeeded.
        finished: BTreeSet<String>,
        /// Total workers.
        world_size: u32,
        /// Address of the group-rank-0 node.
        master_addr: String,
        /// Port reserved by the group-rank-0 node.
        master_port: u32,
    },
    /// Every member finished.
    Completed {
        /// When.
        at: Ms,
    },
    /// The job failed; `Job::reason` says why.
    Failed {
        /// When.
        at: Ms,
    },
}

/// A worker or node failure, as reported by a launcher.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// Reporting node.
    pub node_id: String,
    /// Round it happened in.
    pub round: u64,
    /// Global rank, -1 when not a worker's.
    pub rank: i32,
    /// Local rank, -1 when not a worker's.
    pub local_rank: i32,
    /// Exit code.
    pub exit_code: i32,
    /// Signal number, 0 when none.
    pub signal: i32,
    /// What happened.
    pub message: String,
    /// When (reporter's clock).
    pub time_unix_ms: u64,
    /// Reporter's host name.
    pub hostname: String,
}

impl Failure {
    /// From the wire, with text cut to size.
    pub fn from_pb(f: &pb::FailureInfo) -> Self {
        Failure {
            node_id: validate::text(&f.node_id),
            round: f.round,
            rank: f.rank,
            local_rank: f.local_rank,
            exit_code: f.exit_code,
            signal: f.signal,
            message: validate::text(&f.message),
            time_unix_ms: f.time_unix_ms,
            hostname: validate::text(&f.hostname),
        }
    }

    /// To the wire.
    pub fn to_pb(&self) -> pb::FailureInfo {
        pb::FailureInfo {
            node_id: self.node_id.clone(),
            round: self.round,
            rank: self.rank,
            local_rank: self.local_rank,
            exit_code: self.exit_code,
            signal: self.signal,
            message: self.message.clone(),
            time_unix_ms: self.time_unix_ms,
            hostname: self.hostname.clone(),
        }
    }

    fn describe(&self) -> String {
        let what = if self.signal != 0 {
            format!("signal {}", self.signal)
        } else {
            format!("exit code {}", self.exit_code)
        };
        if self.rank >= 0 {
            format!("rank {} on node {} failed with {what}", self.rank, self.node_id)
        } else {
            format!("node {} failed: {}", self.node_id, self.message)
        }
    }
}

/// A reusable barrier.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Barrier {
    /// Completed generations.
    pub generation: u64,
    /// Members that arrived in the current generation.
    pub arrived: BTreeSet<String>,
    /// Participants, fixed by the first arrival of a generation.
    pub participants: u32,
}

/// What a job remembers of a call that carried a request id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remembered {
    /// Its answer.
    pub answer: Dedup,
    /// [`Command::fingerprint`] of the call: a retry repeats it; another call under the same id
    /// is refused instead of answered with this call's answer.
    pub fingerprint: u64,
    /// When it was applied (state time): it is kept at least `DEDUP_MIN_AGE_MS` (2 minutes)
    /// past it (see `Job::remember`).
    pub at: Ms,
}

/// A remembered answer to a call that carried a request id.
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Dedup {
    /// `StoreAdd`'s result.
    Add(i64),
    /// `StoreCompareSet`'s result (a retry reads the current value again: values are not kept
    /// twice, so the cache stays small).
    Cas { swapped: bool },
    /// `Barrier`'s arrival generation.
    Barrier(u64),
    /// `StoreSet` or `StoreMultiSet` was applied (both answer nothing). A retry is not applied
    /// again: it would overwrite what another client wrote since.
    Set,
    /// `StoreDelete`'s result: whether the key existed. A retry answers it again instead of
    /// "not found" (or deleting a key another client wrote since).
    Delete(bool),
}

/// One job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    /// Job (run) id.
    pub id: String,
    /// Membership configuration.
    pub spec: JobSpec,
    /// Creation time.
    pub created: Ms,
    /// Last change, for forgetting abandoned jobs.
    pub last_activity: Ms,
    /// Current round (the forming one while forming). Starts at 1.
    pub round: u64,
    /// Lifecycle.
    pub phase: Phase,
    /// Every live node of the job.
    pub nodes: BTreeMap<String, Node>,
    /// Nodes that wait for the next round (arrived while one ran, or beyond `max_nodes`).
    pub waiting: BTreeSet<String>,
    /// Failure restarts consumed.
    pub restart_count: u32,
    /// Why the last round ended, or why the job ended.
    pub reason: String,
    /// The first failure of the round the job failed in (or last restarted for).
    pub root_cause: Option<Failure>,
    /// Recent failures, oldest first.
    pub failures: VecDeque<Failure>,
    /// Job-scoped keys.
    pub store: BTreeMap<String, Vec<u8>>,
    /// Keys of the current round; dropped when it ends.
    pub round_store: BTreeMap<String, Vec<u8>>,
    /// Bytes of keys plus values in both stores.
    pub store_bytes: usize,
    /// Barriers by (round scoped, name).
    pub barriers: BTreeMap<(bool, String), Barrier>,
    /// NCCL unique ids of the current round, by name.
    pub unique_ids: BTreeMap<String, Vec<u8>>,
    /// Answers to recent calls that carried a request id, with what identifies each call and
    /// when it was applied.
    pub dedup: BTreeMap<String, Remembered>,
    /// Insertion order of `dedup`, for eviction.
    pub dedup_order: VecDeque<String>,
}

/// Every job.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct State {
    /// Jobs by id.
    pub jobs: BTreeMap<String, Job>,
    /// The last round of each job the service forgot (tombstones): a job created again under
    /// the same id goes on counting from there, so a launcher or worker of the forgotten run
    /// that still holds a round number is fenced off as stale instead of matching the new
    /// run's round 1, 2, ... At most [`MAX_RETIRED`]; the oldest go first.
    pub retired: BTreeMap<String, Retired>,
    /// Records over all jobs, for the service-wide caps. Derived, not encoded: a decoded state
    /// gets it from [`State::recount`].
    #[serde(skip)]
    pub totals: Totals,
}

/// What all jobs hold together, for the caps of [`Limits`] over the whole service.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Store bytes (keys plus values).
    pub store_bytes: usize,
    /// Node records (members, waiting nodes and spares).
    pub nodes: usize,
    /// Barrier arrivals of the current generations.
    pub barrier_arrivals: usize,
}

impl Totals {
    fn replace(self, before: Totals, after: Totals) -> Totals {
        let f = |t: usize, b: usize, a: usize| t.saturating_sub(b).saturating_add(a);
        Totals {
            store_bytes: f(self.store_bytes, before.store_bytes, after.store_bytes),
            nodes: f(self.nodes, before.nodes, after.nodes),
            barrier_arrivals: f(self.barrier_arrivals, before.barrier_arrivals, after.barrier_arrivals),
        }
    }
}

/// What is kept of a forgotten job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retired {
    /// Its last round.
    pub round: u64,
    /// When it was forgotten.
    pub at: Ms,
}

/// Most tombstones of forgotten jobs kept. A fixed number, not a [`Limits`] field: journal
/// replay runs under unbounded limits and must evict exactly what the live service evicted.
pub const MAX_RETIRED: usize = 65_536;

/// Addresses the store of a job: job-wide or the current round's namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scope {
    /// Job id.
    pub job: String,
    /// The caller's round.
    pub round: u64,
    /// Round namespace instead of the job's.
    pub round_scoped: bool,
}

impl Scope {
    /// From the wire.
    pub fn from_pb(scope: Option<&pb::StoreScope>) -> Result<Self, RdzvError> {
        let s = scope.ok_or_else(|| RdzvError::invalid("scope", "missing; job_id and round are required"))?;
        validate::id("scope.job_id", &s.job_id)?;
        Ok(Scope { job: s.job_id.clone(), round: s.round, round_scoped: s.round_scoped })
    }

    fn tag(&self) -> String {
        if self.round_scoped { format!("r{}", self.round) } else { "j".to_string() }
    }

    /// The wake-up topic of a key in this scope.
    pub fn key_topic(&self, key: &str) -> String {
        format!("k/{}/{key}", self.tag())
    }

    /// The wake-up topic of a barrier in this scope.
    pub fn barrier_topic(&self, name: &str) -> String {
        format!("b/{}/{name}", self.tag())
    }
}

/// The wake-up topic of a unique id.
pub fn unique_id_topic(round: u64, name: &str) -> String {
    format!("u/{round}/{name}")
}

/// A join, as journaled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinCmd {
    /// Job id.
    pub job: String,
    /// Node id.
    pub node: String,
    /// Advertised addresses.
    pub addrs: Vec<String>,
    /// Host name.
    pub hostname: String,
    /// Workers on the node.
    pub local_world_size: u32,
    /// Preferred node rank.
    pub rank_hint: Option<u32>,
    /// Reserved port.
    pub master_port: u32,
    /// The job configuration the node expects.
    pub spec: JobSpec,
}

/// Every change to the state. Each is journaled with the time it was applied at.
///
/// Fields carry the request's values after validation; they are named as in the protobuf requests.
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// A node joins the next round.
    Join(JoinCmd),
    /// A node renews its lease (not journaled: leases restart in full after recovery).
    KeepAlive { job: String, node: String },
    /// A node leaves.
    Leave { job: String, node: String, reason: String },
    /// A worker failed on a node.
    ReportFailure { job: String, round: u64, node: String, failure: Failure, restartable: bool },
    /// Fail the job now.
    FailJob { job: String, node: String, reason: String },
    /// A node's workers all succeeded.
    Finish { job: String, round: u64, node: String },
    /// Store set.
    StoreSet { scope: Scope, key: String, value: Vec<u8>, request_id: String },
    /// Store atomic add.
    StoreAdd { scope: Scope, key: String, delta: i64, request_id: String },
    /// Store compare-and-set.
    StoreCas { scope: Scope, key: String, expected: Option<Vec<u8>>, desired: Vec<u8>, request_id: String },
    /// Store delete.
    StoreDelete { scope: Scope, key: String, request_id: String },
    /// Store multi-set.
    StoreMultiSet { scope: Scope, entries: Vec<(String, Vec<u8>)>, request_id: String },
    /// Arrival at a barrier.
    BarrierArrive { scope: Scope, name: String, member: String, participants: u32, request_id: String },
    /// Rank 0 publishes the round's NCCL unique id.
    PublishUniqueId { job: String, round: u64, rank: u32, name: String, id: Vec<u8> },
    /// Time: a node's lease ran out.
    ExpireNode { job: String, node: String },
    /// Time: the last-call window of a forming round passed.
    CloseRound { job: String },
    /// Time: a job is forgotten.
    RemoveJob { job: String },
}

impl Command {
    /// True for the commands that change no node and no barrier (the store writes, keep-alives,
    /// unique ids): counting their job's barrier arrivals would be wasted work.
    fn leaves_members_alone(&self) -> bool {
        matches!(
            self,
            Command::StoreSet { .. }
                | Command::StoreAdd { .. }
                | Command::StoreCas { .. }
                | Command::StoreDelete { .. }
                | Command::StoreMultiSet { .. }
                | Command::KeepAlive { .. }
                | Command::PublishUniqueId { .. }
        )
    }

    /// The job the command is about.
    pub fn job(&self) -> &str {
        match self {
            Command::Join(j) => &j.job,
            Command::KeepAlive { job, .. }
            | Command::Leave { job, .. }
            | Command::ReportFailure { job, .. }
            | Command::FailJob { job, .. }
            | Command::Finish { job, .. }
            | Command::PublishUniqueId { job, .. }
            | Command::ExpireNode { job, .. }
            | Command::CloseRound { job }
            | Command::RemoveJob { job } => job,
            Command::StoreSet { scope, .. }
            | Command::StoreAdd { scope, .. }
            | Command::StoreCas { scope, .. }
            | Command::StoreDelete { scope, .. }
            | Command::StoreMultiSet { scope, .. }
            | Command::BarrierArrive { scope, .. } => &scope.job,
        }
    }

    /// False for commands whose effect need not survive a restart.
    pub fn is_durable(&self) -> bool {
        !matches!(self, Command::KeepAlive { .. })
    }

    /// The request id the command carries (empty: none, or a command that carries none).
    pub fn request_id(&self) -> &str {
        match self {
            Command::StoreSet { request_id, .. }
            | Command::StoreAdd { request_id, .. }
            | Command::StoreCas { request_id, .. }
            | Command::StoreDelete { request_id, .. }
            | Command::StoreMultiSet { request_id, .. }
            | Command::BarrierArrive { request_id, .. } => request_id,
            _ => "",
        }
    }

    /// What identifies the request a request id was drawn for: a stable 64-bit hash of the
    /// command's kind, its namespace (job-wide or the round's), its keys (or barrier name and
    /// member) and its values (their length and CRC-32). A retry repeats it; a different request
    /// under the same id does not. Stable across processes and versions (FNV-1a, not std's
    /// randomly seeded hasher): it is kept in snapshots and rebuilt by replay. 0 for a command
    /// without a request id (nothing is remembered for it, so nothing is hashed).
    pub fn fingerprint(&self) -> u64 {
        if self.request_id().is_empty() {
            return 0;
        }
        let h = match self {
            Command::StoreSet { scope, key, value, .. } => {
                let mut h = Fnv::new(1, scope);
                h.field(key.as_bytes());
                h.value(value);
                h
            }
            Command::StoreMultiSet { scope, entries, .. } => {
                let mut h = Fnv::new(2, scope);
                h.bytes(&(entries.len() as u64).to_le_bytes());
                for (k, v) in entries {
                    h.field(k.as_bytes());
                    h.value(v);
                }
                h
            }
            Command::StoreAdd { scope, key, delta, .. } => {
                let mut h = Fnv::new(3, scope);
                h.field(key.as_bytes());
                h.bytes(&delta.to_le_bytes());
                h
            }
            Command::StoreCas { scope, key, expected, desired, .. } => {
                let mut h = Fnv::new(4, scope);
                h.field(key.as_bytes());
                match expected {
                    Some(e) => {
                        h.bytes(&[1]);
                        h.value(e);
                    }
                    None => h.bytes(&[0]),
                }
                h.value(desired);
                h
            }
            Command::StoreDelete { scope, key, .. } => {
                let mut h = Fnv::new(5, scope);
                h.field(key.as_bytes());
                h
            }
            Command::BarrierArrive { scope, name, member, participants, .. } => {
                let mut h = Fnv::new(6, scope);
                h.field(name.as_bytes());
                h.field(member.as_bytes());
                h.bytes(&participants.to_le_bytes());
                h
            }
            _ => return 0,
        };
        h.0
    }
}

/// 64-bit FNV-1a, written out: a hash whose value does not change between processes, builds or
/// versions (see [`Command::fingerprint`]).
struct Fnv(u64);

impl Fnv {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    /// A hash of a command of kind `kind` in `scope`'s namespace.
    fn new(kind: u8, scope: &Scope) -> Self {
        let mut h = Fnv(Self::OFFSET);
        h.bytes(&[kind, u8::from(scope.round_scoped)]);
        h
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }

    /// A field of any length, preceded by its length (so that two fields never read as others).
    fn field(&mut self, bytes: &[u8]) {
        self.bytes(&(bytes.len() as u64).to_le_bytes());
        self.bytes(bytes);
    }

    /// A value: its length and CRC-32 (values may be megabytes; CRC-32 is hardware-assisted).
    fn value(&mut self, value: &[u8]) {
        self.bytes(&(value.len() as u64).to_le_bytes());
        self.bytes(&crc32fast::hash(value).to_le_bytes());
    }
}

/// What a command answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing to return.
    Done,
    /// A join was recorded; the node waits for its round (use [`State::assignment`]).
    Joined,
    /// A failure report's decision.
    Decision(pb::FailureDecision),
    /// `StoreAdd`'s new value.
    Added(i64),
    /// `StoreCompareSet`'s result: whether it swapped, and the value after the call.
    #[allow(missing_docs)]
    Cas { swapped: bool, current: Option<Vec<u8>> },
    /// `StoreDelete`: whether the key existed.
    Deleted(bool),
    /// Barrier arrival: the generation arrived in (released once `generation` grows past it).
    Arrived(u64),
}

/// What a command changed, for waking waiters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Effects {
    /// The state changed (journal it when durable).
    pub changed: bool,
    /// Store, barrier and unique-id topics that changed.
    pub topics: Vec<String>,
}

impl Effects {
    fn changed() -> Self {
        Effects { changed: true, topics: Vec::new() }
    }
    fn topic(topic: String) -> Self {
        Effects { changed: true, topics: vec![topic] }
    }
}

/// `host (addr, node id)` for messages that must tell nodes apart (several may share a host).
fn node_label(hostname: &str, addrs: &[String], id: &str) -> String {
    let name = if hostname.is_empty() { id } else { hostname };
    match addrs.first() {
        Some(a) if a != name => format!("{name} ({a}, node {id})"),
        _ => format!("{name} (node {id})"),
    }
}

/// Assigns node ranks `0..n` to the participants of a round.
///
/// In order: a node's rank hint when in range and free (conflicts go to the smaller node id); then its
/// rank in the previous round when still in range and free (sticky ranks); then the free ranks in
/// ascending order to the remaining nodes sorted by id. The result depends only on the set of nodes,
/// their hints and their previous ranks — never on arrival order.
pub fn assign_ranks<'a>(nodes: impl IntoIterator<Item = &'a Node>) -> Vec<(String, u32)> {
    let mut nodes: Vec<&Node> = nodes.into_iter().collect();
    nodes.sort_by(|a, b| a.id.cmp(&b.id));
    let n = nodes.len();
    let mut slot: Vec<Option<usize>> = vec![None; n];
    let mut assigned: Vec<Option<u32>> = vec![None; n];
    for pass in 0..2 {
        for (i, node) in nodes.iter().enumerate() {
            if assigned[i].is_some() {
                continue;
            }
            let want = if pass == 0 { node.rank_hint } else { node.last_rank };
            if let Some(r) = want.filter(|r| (*r as usize) < n) {
                if slot[r as usize].is_none() {
                    slot[r as usize] = Some(i);
                    assigned[i] = Some(r);
                }
            }
        }
    }
    let mut free = (0..n).filter(|r| slot[*r].is_none());
    for a in assigned.iter_mut() {
        if a.is_none() {
            // Invariant: there are exactly as many free slots as unassigned nodes.
            *a = free.next().map(|r| r as u32);
        }
    }
    let mut out: Vec<(String, u32)> =
        nodes.iter().zip(assigned).map(|(node, r)| (node.id.clone(), r.unwrap_or(0))).collect();
    out.sort_by_key(|(_, r)| *r);
    out
}

impl Job {
    fn new(id: String, spec: JobSpec, now: Ms) -> Self {
        Job {
            id,
            spec,
            created: now,
            last_activity: now,
            round: 1,
            phase: Phase::Forming {
                joined: BTreeSet::new(),
                rejoining: BTreeSet::new(),
                last_call_deadline: None,
                early_close: false,
            },
            nodes: BTreeMap::new(),
            waiting: BTreeSet::new(),
            restart_count: 0,
            reason: String::new(),
            root_cause: None,
            failures: VecDeque::new(),
            store: BTreeMap::new(),
            round_store: BTreeMap::new(),
            store_bytes: 0,
            barriers: BTreeMap::new(),
            unique_ids: BTreeMap::new(),
            dedup: BTreeMap::new(),
            dedup_order: VecDeque::new(),
        }
    }

    /// What the job holds toward the service-wide caps; barrier arrivals only when `barriers`
    /// (counting them walks every barrier).
    fn totals(&self, barriers: bool) -> Totals {
        Totals {
            store_bytes: self.store_bytes,
            nodes: self.nodes.len(),
            barrier_arrivals: if barriers { self.barrier_arrivals() } else { 0 },
        }
    }

    /// Arrivals waiting at all of the job's barriers (walks every barrier).
    fn barrier_arrivals(&self) -> usize {
        self.barriers.values().map(|b| b.arrived.len()).sum()
    }

    /// Completed or failed.
    pub fn is_terminal(&self) -> bool {
        matches!(self.phase, Phase::Completed { .. } | Phase::Failed { .. })
    }

    /// Ended, and every node has left: a join under its id starts it over (a re-run with the same
    /// --rdzv-id), like a job that does not exist.
    pub fn starts_over_on_join(&self) -> bool {
        self.is_terminal() && self.nodes.is_empty()
    }

    /// The error a completed or failed job answers with (`None` while it runs).
    pub fn ended_error(&self) -> Option<RdzvError> {
        let state = match self.phase {
            Phase::Completed { .. } => "completed",
            Phase::Failed { .. } => "failed",
            _ => return None,
        };
        Some(RdzvError::JobEnded { job: self.id.clone(), state, reason: self.reason.clone() })
    }

    /// The node whose report failed the job refines its root cause: a launcher reports its first
    /// failure at once (so that it, not a peer whose workers fail in the cascade, is the job's root
    /// cause) and again once its workers are stopped, with the error file, the stderr tail and the
    /// local root cause by torchrun's error-file rule. `Some(changed)` when `failure` is that
    /// refinement (the job failed in `round`, whose root cause is `node`'s); `None` otherwise.
    fn refine_root_cause(&mut self, round: u64, node: &str, failure: &Failure) -> Option<bool> {
        if !matches!(self.phase, Phase::Failed { .. }) || round != self.round {
            return None;
        }
        // A worker's failure only: a job failed by FailJob keeps that node's reason.
        let root = self.root_cause.as_mut().filter(|r| r.round == round && r.node_id == node && r.rank >= 0)?;
        let mut refined = failure.clone();
        refined.round = round;
        refined.node_id = node.to_owned();
        if *root == refined {
            return Some(false);
        }
        let (before, after) = (root.describe(), refined.describe());
        if before != after {
            self.reason = self.reason.replacen(&before, &after, 1);
        }
        if let Some(f) = self.failures.iter_mut().rev().find(|f| **f == *root) {
            *f = refined.clone();
        }
        *root = refined;
        Some(true)
    }

    fn check_round(&self, round: u64) -> Result<(), RdzvError> {
        if round != self.round {
            return Err(RdzvError::StaleRound { job: self.id.clone(), given: round, current: self.round });
        }
        Ok(())
    }

    /// The wire view of the job.
    pub fn view(&self) -> pb::JobView {
        let (state, joined_count) = match &self.phase {
            Phase::Forming { joined, .. } => (pb::JobState::Forming, joined.len() as u32),
            Phase::Running { .. } => (pb::JobState::Running, 0),
            Phase::Completed { .. } => (pb::JobState::Completed, 0),
            Phase::Failed { .. } => (pb::JobState::Failed, 0),
        };
        pb::JobView {
            job_id: self.id.clone(),
            state: state as i32,
            round: self.round,
            nodes_waiting: self.waiting.len() as u32,
            reason: self.reason.clone(),
            restart_count: self.restart_count,
            max_restarts: self.spec.max_restarts,
            joined_count,
            min_nodes: self.spec.min_nodes,
            max_nodes: self.spec.max_nodes,
            root_cause: self.root_cause.as_ref().map(Failure::to_pb),
        }
    }

    /// Whether `node` survived an ended round and has not joined the next one: a pending Join
    /// that saw the round only after it ended (it formed and ended between two looks) must
    /// join again, or it waits for a round that cannot form without it.
    pub fn awaits_rejoin(&self, node: &str) -> bool {
        matches!(&self.phase, Phase::Forming { rejoining, .. } if rejoining.contains(node))
    }

    /// The round assignment of `node` if it takes part in the running round.
    pub fn assignment(&self, node: &str) -> Option<pb::JoinResponse> {
        let Phase::Running { members, world_size, master_addr, master_port, .. } = &self.phase else {
            return None;
        };
        let m = members.get(node)?;
        let n = self.nodes.get(node);
        Some(pb::JoinResponse {
            round: Some(pb::RoundInfo {
                round: self.round,
                world_size: *world_size,
                num_nodes: members.len() as u32,
                master_addr: master_addr.clone(),
                master_port: *master_port,
                restart_count: self.restart_count,
                max_restarts: self.spec.max_restarts,
                // The executor fills in the TCPStore it hosts (I/O, not state).
                store_addr: String::new(),
                store_port: 0,
            }),
            node: Some(pb::NodeAssignment {
                node_id: node.to_string(),
                node_rank: m.node_rank,
                local_world_size: m.local_world_size,
                rank_offset: m.rank_offset,
                addrs: n.map(|n| n.addrs.clone()).unwrap_or_default(),
                hostname: n.map(|n| n.hostname.clone()).unwrap_or_default(),
            }),
        })
    }

    /// Remembers the answer to the call `request_id` named (fingerprint `fingerprint`), applied
    /// at `now`. Past the window's count ([`Job::dedup_window`]) the oldest answers are forgotten,
    /// but only those older than `DEDUP_MIN_AGE_MS`, so a retry within the client's horizon still
    /// finds its answer however busy the job; past [`MAX_DEDUP_WINDOW`] the oldest go whatever
    /// their age (a bound on memory and snapshots). Deterministic in the command times, so
    /// replay forgets exactly what the live service forgot.
    fn remember(&mut self, request_id: &str, fingerprint: u64, answer: Dedup, now: Ms) {
        if request_id.is_empty() {
            return;
        }
        let entry = Remembered { answer, fingerprint, at: now };
        if self.dedup.insert(request_id.to_string(), entry).is_none() {
            self.dedup_order.push_back(request_id.to_string());
        }
        if self.dedup_order.len() <= MAX_DEDUP {
            return;
        }
        let window = self.dedup_window();
        while self.dedup_order.len() > window {
            let Some(oldest) = self.dedup_order.front() else { break };
            let young = self.dedup.get(oldest).is_some_and(|r| now.saturating_sub(r.at) < DEDUP_MIN_AGE_MS);
            if young && self.dedup_order.len() <= MAX_DEDUP_WINDOW {
                break;
            }
            if let Some(old) = self.dedup_order.pop_front() {
                self.dedup.remove(&old);
            }
        }
    }

    /// How many answers `dedup` keeps once they are older than `DEDUP_MIN_AGE_MS`: [`MAX_DEDUP`],
    /// or twice the running round's world when that is more (every rank may have a call in
    /// flight at once). Every rank of a 10,000-rank job arrives at a barrier with a request id of
    /// its own: a window of 8,192 had forgotten the first arrivals' ids by the time they retried
    /// (a service restart mid-barrier), and their retries arrived a second time, at the next
    /// generation. Bounded by the world the nodes declared (not by a barrier's participant count,
    /// which any caller names). Younger answers are kept past it, up to [`MAX_DEDUP_WINDOW`].
    fn dedup_window(&self) -> usize {
        let world = match &self.phase {
            Phase::Running { world_size, .. } => *world_size as usize,
            _ => 0,
        };
        MAX_DEDUP.max(world.saturating_mul(2)).min(MAX_DEDUP_WINDOW)
    }

    /// The remembered answer to the call `request_id` named, when `fingerprint` says this call
    /// repeats it (a retry); `None` for a new id (or none).
    ///
    /// # Errors
    /// The id was used for a different call (another kind, namespace, key or value): answering
    /// that call's answer, or applying this one and forgetting that one's, would both be wrong.
    fn recall(&self, request_id: &str, fingerprint: u64) -> Result<Option<Dedup>, RdzvError> {
        Ok(self.recalled(request_id, fingerprint)?.cloned())
    }

    /// [`Job::recall`] without the copy.
    fn recalled(&self, request_id: &str, fingerprint: u64) -> Result<Option<&Dedup>, RdzvError> {
        if request_id.is_empty() {
            return Ok(None);
        }
        match self.dedup.get(request_id) {
            None => Ok(None),
            Some(r) if r.fingerprint == fingerprint => Ok(Some(&r.answer)),
            Some(_) => Err(reused_request_id(request_id)),
        }
    }

    fn num_keys(&self) -> usize {
        self.store.len() + self.round_store.len()
    }

    /// Closes the forming round if its conditions hold. Returns true if it closed.
    fn maybe_close(&mut self, now: Ms) -> bool {
        let Phase::Forming { joined, rejoining, last_call_deadline, early_close } = &mut self.phase else {
            return false;
        };
        // Spares fill the places that removed nodes left (a survivor whose lease ran out while
        // the round formed): waiting for it, they were stranded while the round stayed below
        // min, or closed without them.
        let max = self.spec.max_nodes as usize;
        fill_from(&mut self.waiting, joined, max.saturating_sub(rejoining.len()));
        let n = joined.len() as u32;
        if n < self.spec.min_nodes {
            *last_call_deadline = None;
            return false;
        }
        // After an ended round, the survivors still tearing their workers down are waited for
        // up to one lease past the last call (a dead one is dropped by its lease first): closed
        // without them at the last call, each came back to a running round, whose scale-up ended
        // it again, round after round while teardown took longer than the last call.
        let survivors = if *early_close && !rejoining.is_empty() { self.spec.lease_ms } else { 0 };
        let deadline = *last_call_deadline.get_or_insert(now.saturating_add(self.spec.last_call_ms).saturating_add(survivors));
        let close = n >= self.spec.max_nodes || now >= deadline || (*early_close && rejoining.is_empty());
        if !close {
            return false;
        }
        // Closing without the survivors not back yet: spares take their places.
        fill_from(&mut self.waiting, joined, max);
        let joined = std::mem::take(joined);
        let ranks = assign_ranks(joined.iter().filter_map(|id| self.nodes.get(id)));
        let mut members = BTreeMap::new();
        let mut offset: u32 = 0;
        let mut master = (String::new(), 0);
        for (id, rank) in ranks {
            // Invariant: `joined` only holds ids present in `nodes` (removal takes them out of both).
            let Some(node) = self.nodes.get_mut(&id) else { continue };
            node.last_rank = Some(rank);
            if rank == 0 {
                let addr = node.addrs.first().cloned().unwrap_or_else(|| node.hostname.clone());
                master = (addr, node.master_port);
            }
            members.insert(id, Member { node_rank: rank, local_world_size: node.local_world_size, rank_offset: offset });
            offset = offset.saturating_add(node.local_world_size);
        }
        self.phase = Phase::Running {
            members,
            finished: BTreeSet::new(),
            world_size: offset,
            master_addr: master.0,
            master_port: master.1,
        };
        true
    }

    /// Ends the running round: `Forming(round + 1)`. Waiters on the old round notice through the job
    /// view, whose round moves.
    fn end_round(&mut self, reason: String, now: Ms) {
        let mut previous: BTreeSet<String> = match &mut self.phase {
            Phase::Running { members, .. } => members.keys().cloned().collect(),
            Phase::Forming { joined, rejoining, .. } => {
                let mut all = std::mem::take(joined);
                all.append(rejoining);
                all
            }
            Phase::Completed { .. } | Phase::Failed { .. } => return,
        };
        previous.retain(|id| self.nodes.contains_key(id));
        self.round += 1;
        self.reason = reason;
        for (k, v) in std::mem::take(&mut self.round_store) {
            self.store_bytes = self.store_bytes.saturating_sub(k.len() + v.len());
        }
        self.unique_ids.clear();
        self.barriers.retain(|(round_scoped, _), _| !round_scoped);
        // A job-wide barrier keeps its generation, but the arrivals of the round that ended are
        // void: its workers are gone, and the next round's must all arrive again (else one rank
        // of the new round would be let through on a dead one's arrival).
        for b in self.barriers.values_mut() {
            b.arrived.clear();
        }
        // Spares fill only the places the survivors leave (`maybe_close` moves them): taking
        // them first put survivors out of the next round (and their sticky ranks with them).
        self.phase = Phase::Forming { joined: BTreeSet::new(), rejoining: previous, last_call_deadline: None, early_close: true };
        self.maybe_close(now);
    }

    fn fail(&mut self, reason: String, now: Ms) {
        if self.is_terminal() {
            return;
        }
        self.reason = reason;
        self.phase = Phase::Failed { at: now };
    }

    fn remove_node(&mut self, node: &str, reason: String, now: Ms) -> Result<Effects, RdzvError> {
        if self.nodes.remove(node).is_none() {
            return Err(RdzvError::NotMember {
                job: self.id.clone(),
                node: node.to_string(),
                reason: "it never joined, already left, or its lease expired".into(),
            });
        }
        self.waiting.remove(node);
        let end = match &mut self.phase {
            Phase::Forming { joined, rejoining, .. } => {
                joined.remove(node);
                rejoining.remove(node);
                false
            }
            Phase::Running { members, finished, .. } => members.contains_key(node) && !finished.contains(node),
            Phase::Completed { .. } | Phase::Failed { .. } => false,
        };
        if end {
            self.end_round(reason, now);
        } else {
            self.maybe_close(now);
        }
        Ok(Effects::changed())
    }

    /// Whether `node` may fail the job: only a node of it (a straggler of an earlier run under the
    /// same job id, or anyone else, cannot end this one). Checked before the journaled command,
    /// which an older journal replays without it.
    ///
    /// # Errors
    /// `node` is not a node of the job.
    pub fn check_may_fail(&self, node: &str) -> Result<(), RdzvError> {
        if self.nodes.contains_key(node) {
            return Ok(());
        }
        Err(RdzvError::NotMember { job: self.id.clone(), node: node.to_owned(), reason: "only a node of the job can fail it".into() })
    }

    /// Whether `node` may publish round `round`'s unique id: it runs global rank 0 there, in the
    /// running round (while a round forms nobody holds rank 0 yet).
    ///
    /// # Errors
    /// A stale round, one still forming; a node that is not a member of the running round, or does
    /// not hold rank 0.
    pub fn check_rank0_node(&self, round: u64, node: &str) -> Result<(), RdzvError> {
        self.check_round(round)?;
        // While the round forms nobody holds rank 0 yet: a check passed then would let whoever
        // asked first publish once the round runs (the write-once id is decided by then).
        let Phase::Running { members, .. } = &self.phase else {
            return Err(RdzvError::FailedPrecondition(format!(
                "round {round} of job {:?} is still forming: the node of global rank 0 publishes its unique id once it runs",
                self.id
            )));
        };
        match members.get(node) {
            Some(m) if m.rank_offset == 0 => Ok(()),
            Some(m) => Err(RdzvError::PermissionDenied(format!(
                "only the node of global rank 0 publishes the unique id of round {round}; node {node:?} runs ranks from {}",
                m.rank_offset
            ))),
            None => Err(RdzvError::PermissionDenied(format!(
                "node {node:?} is not a member of running round {round} of job {:?}: it cannot publish its unique id",
                self.id
            ))),
        }
    }

    fn store_map(&mut self, round_scoped: bool) -> &mut BTreeMap<String, Vec<u8>> {
        if round_scoped { &mut self.round_store } else { &mut self.store }
    }

    fn check_write(&self, scope: &Scope) -> Result<(), RdzvError> {
        if let Some(e) = self.ended_error() {
            return Err(e);
        }
        self.check_round(scope.round)
    }

    /// Sets a key without checking limits (the caller checked the final sizes).
    fn put_unchecked(&mut self, round_scoped: bool, key: String, value: Vec<u8>) {
        let added = key.len() + value.len();
        let removed = self.store_map(round_scoped).get(&key).map(|v| key.len() + v.len()).unwrap_or(0);
        self.store_bytes = self.store_bytes.saturating_sub(removed) + added;
        self.store_map(round_scoped).insert(key, value);
    }

    /// Sets a key, enforcing the per-job limits.
    fn put(&mut self, limits: &Limits, round_scoped: bool, key: String, value: Vec<u8>) -> Result<(), RdzvError> {
        let old = self.store_map(round_scoped).get(&key).map(|v| v.len());
        let added = key.len() + value.len();
        let removed = old.map(|len| key.len() + len).unwrap_or(0);
        if old.is_none() && self.num_keys() >= limits.max_keys_per_job {
            return Err(RdzvError::ResourceExhausted(format!(
                "job {:?} holds {} keys, the limit is {}",
                self.id,
                self.num_keys(),
                limits.max_keys_per_job
            )));
        }
        let bytes = self.store_bytes.saturating_sub(removed) + added;
        if bytes > limits.max_store_bytes_per_job {
            return Err(RdzvError::ResourceExhausted(format!(
                "job {:?} store would hold {bytes} bytes, the limit is {}",
                self.id, limits.max_store_bytes_per_job
            )));
        }
        self.store_bytes = bytes;
        self.store_map(round_scoped).insert(key, value);
        Ok(())
    }

    /// Reads a key (no fencing for job-scoped reads; round-scoped reads need the current round).
    pub fn get(&self, scope: &Scope, key: &str) -> Result<Option<&Vec<u8>>, RdzvError> {
        if scope.round_scoped {
            self.check_round(scope.round)?;
            Ok(self.round_store.get(key))
        } else {
            Ok(self.store.get(key))
        }
    }

    /// Keys in the scope.
    pub fn scope_len(&self, scope: &Scope) -> Result<usize, RdzvError> {
        if scope.round_scoped {
            self.check_round(scope.round)?;
            Ok(self.round_store.len())
        } else {
            Ok(self.store.len())
        }
    }

    /// The generation of a barrier (0 when it never released).
    pub fn barrier_generation(&self, scope: &Scope, name: &str) -> Result<u64, RdzvError> {
        if scope.round_scoped {
            self.check_round(scope.round)?;
        }
        Ok(self.barriers.get(&(scope.round_scoped, name.to_string())).map(|b| b.generation).unwrap_or(0))
    }
}

/// A request id that answered a different request (see [`Command::fingerprint`]).
fn reused_request_id(request_id: &str) -> RdzvError {
    RdzvError::invalid(
        "request_id",
        format!("request id {request_id:?} was already used for a different request; draw a new id for each call"),
    )
}

/// A join without a node rank in `0..max_nodes` to a job with fixed node ranks.
fn fixed_rank_error(j: &JoinCmd, max_nodes: u32) -> RdzvError {
    RdzvError::invalid(
        "rank_hint",
        format!("{:?}; job {:?} has fixed node ranks: every node names its rank in 0..{max_nodes}", j.rank_hint, j.job),
    )
}

impl State {
    /// The job, or `JobNotFound`.
    pub fn job(&self, id: &str) -> Result<&Job, RdzvError> {
        self.jobs.get(id).ok_or_else(|| RdzvError::JobNotFound { job: id.to_string() })
    }

    fn job_mut(&mut self, id: &str) -> Result<&mut Job, RdzvError> {
        self.jobs.get_mut(id).ok_or_else(|| RdzvError::JobNotFound { job: id.to_string() })
    }

    /// Applies one command at time `now`. On error nothing changed.
    pub fn apply(&mut self, cmd: &Command, now: Ms, limits: &Limits) -> Result<(Outcome, Effects), RdzvError> {
        // A command changes only its own job: the totals move by that job's difference.
        let barriers = !cmd.leaves_members_alone();
        let before = self.jobs.get(cmd.job()).map_or_else(Totals::default, |j| j.totals(barriers));
        let result = self.apply_inner(cmd, now, limits);
        if let Ok((_, effects)) = &result {
            let after = self.jobs.get(cmd.job()).map_or_else(Totals::default, |j| j.totals(barriers));
            self.totals = self.totals.replace(before, after);
            if effects.changed {
                if let Some(job) = self.jobs.get_mut(cmd.job()) {
                    job.last_activity = now;
                }
            }
        }
        result
    }

    /// The answer the job of `cmd` remembers for `cmd`'s request id, when `cmd` repeats the call
    /// that id was first used for (same [`Command::fingerprint`]): applying `cmd` then answers
    /// from memory and changes nothing. Pure; the executor asks it before its own admission caps
    /// (the service-wide store cap, the unwritten-log bound), which a retry of a write applied
    /// before them, whose answer was lost, must not be refused for: it grows nothing.
    pub fn remembered(&self, cmd: &Command) -> Option<&Dedup> {
        let id = cmd.request_id();
        if id.is_empty() {
            return None;
        }
        // A reused id is no repeat: applying it reports the reuse.
        self.jobs.get(cmd.job())?.recalled(id, cmd.fingerprint()).ok().flatten()
    }

    /// The latest time any job changed (0 for none): a lower bound of the time of the last
    /// entry applied to this state, which a snapshot keeps when its log is gone.
    pub fn latest_activity(&self) -> Ms {
        self.jobs.values().map(|j| j.last_activity).max().unwrap_or(0)
    }

    /// Rebuilds [`State::totals`] from the jobs (after a state was decoded).
    pub fn recount(&mut self) {
        self.totals = self.jobs.values().fold(Totals::default(), |t, j| t.replace(Totals::default(), j.totals(true)));
    }

    /// Keeps a forgotten job's last round, evicting the oldest tombstone past [`MAX_RETIRED`].
    fn retire(&mut self, job: &str, round: u64, now: Ms) {
        self.retired.insert(job.to_string(), Retired { round, at: now });
        while self.retired.len() > MAX_RETIRED {
            let oldest = self.retired.iter().min_by_key(|(id, r)| (r.at, *id)).map(|(id, _)| id.clone());
            match oldest {
                Some(id) => self.retired.remove(&id),
                None => break,
            };
        }
    }

    fn apply_inner(&mut self, cmd: &Command, now: Ms, limits: &Limits) -> Result<(Outcome, Effects), RdzvError> {
        match cmd {
            Command::Join(j) => self.join(j, now, limits),
            Command::KeepAlive { job, node } => {
                let job = self.job_mut(job)?;
                let lease = job.spec.lease_ms;
                let n = job.nodes.get_mut(node).ok_or_else(|| RdzvError::NotMember {
                    job: job.id.clone(),
                    node: node.clone(),
                    reason: "it never joined, left, or its lease expired; join again".into(),
                })?;
                n.last_heartbeat = now;
                n.lease_expires = now.saturating_add(lease);
                Ok((Outcome::Done, Effects { changed: false, topics: Vec::new() }))
            }
            Command::Leave { job, node, reason } => {
                let job = self.job_mut(job)?;
                let why = if reason.is_empty() { format!("node {node} left") } else { format!("node {node} left: {reason}") };
                let effects = job.remove_node(node, why, now)?;
                Ok((Outcome::Done, effects))
            }
            Command::ExpireNode { job, node } => {
                let job = self.job_mut(job)?;
                let lease = job.spec.lease_ms;
                let effects = job.remove_node(node, format!("node {node} lost its lease (no keep-alive for {lease} ms)"), now)?;
                Ok((Outcome::Done, effects))
            }
            Command::CloseRound { job } => {
                let job = self.job_mut(job)?;
                let closed = job.maybe_close(now);
                Ok((Outcome::Done, Effects { changed: closed, topics: Vec::new() }))
            }
            Command::RemoveJob { job } => {
                let removed = self.jobs.remove(job).ok_or_else(|| RdzvError::JobNotFound { job: job.clone() })?;
                self.retire(job, removed.round, now);
                Ok((Outcome::Done, Effects::changed()))
            }
            Command::ReportFailure { job, round, node, failure, restartable } => {
                let job = self.job_mut(job)?;
                if let Some(changed) = job.refine_root_cause(*round, node, failure) {
                    return Ok((Outcome::Decision(pb::FailureDecision::Failed), Effects { changed, topics: Vec::new() }));
                }
                if let Some(e) = job.ended_error() {
                    return Err(e);
                }
                job.check_round(*round)?;
                let is_member = matches!(&job.phase, Phase::Running { members, .. } if members.contains_key(node));
                if !is_member {
                    return Err(RdzvError::NotMember {
                        job: job.id.clone(),
                        node: node.clone(),
                        reason: format!("it is not a participant of running round {round}"),
                    });
                }
                let mut failure = failure.clone();
                failure.round = *round;
                failure.node_id = node.clone();
                if job.root_cause.as_ref().is_none_or(|r| r.round != *round) {
                    job.root_cause = Some(failure.clone());
                }
                job.failures.push_back(failure.clone());
                if job.failures.len() > MAX_FAILURES {
                    job.failures.pop_front();
                }
                let what = failure.describe();
                if !restartable {
                    job.fail(format!("{what} (not restartable)"), now);
                    return Ok((Outcome::Decision(pb::FailureDecision::Failed), Effects::changed()));
                }
                if job.restart_count >= job.spec.max_restarts {
                    job.fail(
                        format!("{what}; restart budget exhausted ({} of {} used)", job.restart_count, job.spec.max_restarts),
                        now,
                    );
                    return Ok((Outcome::Decision(pb::FailureDecision::Failed), Effects::changed()));
                }
                job.restart_count += 1;
                let reason = format!("{what}; restart {} of {}", job.restart_count, job.spec.max_restarts);
                job.end_round(reason, now);
                Ok((Outcome::Decision(pb::FailureDecision::Restart), Effects::changed()))
            }
            Command::FailJob { job, node, reason } => {
                let job = self.job_mut(job)?;
                if let Some(e) = job.ended_error() {
                    return Err(e);
                }
                let why = if reason.is_empty() { format!("failed by node {node}") } else { format!("failed by node {node}: {reason}") };
                if job.root_cause.as_ref().is_none_or(|r| r.round != job.round) {
                    job.root_cause = Some(Failure {
                        node_id: node.clone(),
                        round: job.round,
                        rank: -1,
                        local_rank: -1,
                        exit_code: 0,
                        signal: 0,
                        message: reason.clone(),
                        time_unix_ms: now,
                        hostname: job.nodes.get(node).map(|n| n.hostname.clone()).unwrap_or_default(),
                    });
                }
                job.fail(why, now);
                Ok((Outcome::Done, Effects::changed()))
            }
            Command::Finish { job, round, node } => {
                let job = self.job_mut(job)?;
                if let Some(e) = job.ended_error() {
                    // Finishing twice (a retry after completion) is not an error.
                    if matches!(job.phase, Phase::Completed { .. }) {
                        return Ok((Outcome::Done, Effects::default()));
                    }
                    return Err(e);
                }
                job.check_round(*round)?;
                let Phase::Running { members, finished, .. } = &mut job.phase else {
                    return Err(RdzvError::FailedPrecondition(format!("round {round} of job {:?} is not running", job.id)));
                };
                if !members.contains_key(node) {
                    return Err(RdzvError::NotMember {
                        job: job.id.clone(),
                        node: node.clone(),
                        reason: format!("it is not a participant of round {round}"),
                    });
                }
                if !finished.insert(node.clone()) {
                    // A retried finish: already recorded.
                    return Ok((Outcome::Done, Effects::default()));
                }
                if finished.len() == members.len() {
                    let n = members.len();
                    job.reason = format!("all {n} nodes finished");
                    job.phase = Phase::Completed { at: now };
                }
                Ok((Outcome::Done, Effects::changed()))
            }
            Command::StoreSet { scope, key, value, request_id } => {
                let job = self.job_mut(&scope.job)?;
                job.check_write(scope)?;
                let fingerprint = cmd.fingerprint();
                match job.recall(request_id, fingerprint)? {
                    Some(Dedup::Set) => return Ok((Outcome::Done, Effects::default())),
                    Some(_) => return Err(reused_request_id(request_id)),
                    None => {}
                }
                job.put(limits, scope.round_scoped, key.clone(), value.clone())?;
                job.remember(request_id, fingerprint, Dedup::Set, now);
                Ok((Outcome::Done, Effects::topic(scope.key_topic(key))))
            }
            Command::StoreMultiSet { scope, entries, request_id } => {
                let job = self.job_mut(&scope.job)?;
                job.check_write(scope)?;
                let fingerprint = cmd.fingerprint();
                match job.recall(request_id, fingerprint)? {
                    Some(Dedup::Set) => return Ok((Outcome::Done, Effects::default())),
                    Some(_) => return Err(reused_request_id(request_id)),
                    None => {}
                }
                // All or nothing: check the limits against the final sizes first, then apply.
                let mut finals: BTreeMap<&String, usize> = BTreeMap::new();
                for (k, v) in entries {
                    finals.insert(k, v.len());
                }
                let (mut new_keys, mut bytes) = (0usize, job.store_bytes as i128);
                {
                    let map = job.store_map(scope.round_scoped);
                    for (k, len) in &finals {
                        match map.get(*k) {
                            Some(old) => bytes += *len as i128 - old.len() as i128,
                            None => {
                                new_keys += 1;
                                bytes += (k.len() + len) as i128;
                            }
                        }
                    }
                }
                if job.num_keys() + new_keys > limits.max_keys_per_job {
                    return Err(RdzvError::ResourceExhausted(format!(
                        "job {:?} would hold {} keys, the limit is {}",
                        job.id,
                        job.num_keys() + new_keys,
                        limits.max_keys_per_job
                    )));
                }
                if bytes > limits.max_store_bytes_per_job as i128 {
                    return Err(RdzvError::ResourceExhausted(format!(
                        "job {:?} store would hold {bytes} bytes, the limit is {}",
                        job.id, limits.max_store_bytes_per_job
                    )));
                }
                for (k, v) in entries {
                    job.put_unchecked(scope.round_scoped, k.clone(), v.clone());
                }
                job.remember(request_id, fingerprint, Dedup::Set, now);
                let topics = entries.iter().map(|(k, _)| scope.key_topic(k)).collect();
                Ok((Outcome::Done, Effects { changed: true, topics }))
            }
            Command::StoreAdd { scope, key, delta, request_id } => {
                let job = self.job_mut(&scope.job)?;
                job.check_write(scope)?;
                let fingerprint = cmd.fingerprint();
                match job.recall(request_id, fingerprint)? {
                    Some(Dedup::Add(v)) => return Ok((Outcome::Added(v), Effects::default())),
                    Some(_) => return Err(reused_request_id(request_id)),
                    None => {}
                }
                let current = match job.store_map(scope.round_scoped).get(key) {
                    None => 0,
                    Some(bytes) => std::str::from_utf8(bytes)
                        .ok()
                        .and_then(|s| s.parse::<i64>().ok())
                        .ok_or_else(|| RdzvError::invalid("key", format!("{key:?} holds a value that is not a decimal integer; add needs one")))?,
                };
                let value = current.checked_add(*delta).ok_or_else(|| {
                    RdzvError::invalid("delta", format!("{current} + {delta} overflows a 64-bit integer"))
                })?;
                job.put(limits, scope.round_scoped, key.clone(), value.to_string().into_bytes())?;
                job.remember(request_id, fingerprint, Dedup::Add(value), now);
                Ok((Outcome::Added(value), Effects::topic(scope.key_topic(key))))
            }
            Command::StoreCas { scope, key, expected, desired, request_id } => {
                let job = self.job_mut(&scope.job)?;
                job.check_write(scope)?;
                let fingerprint = cmd.fingerprint();
                match job.recall(request_id, fingerprint)? {
                    Some(Dedup::Cas { swapped }) => {
                        let current = job.store_map(scope.round_scoped).get(key).cloned();
                        return Ok((Outcome::Cas { swapped, current }, Effects::default()));
                    }
                    Some(_) => return Err(reused_request_id(request_id)),
                    None => {}
                }
                let current = job.store_map(scope.round_scoped).get(key).cloned();
                let (swapped, after) = if current == *expected {
                    job.put(limits, scope.round_scoped, key.clone(), desired.clone())?;
                    (true, Some(desired.clone()))
                } else {
                    (false, current)
                };
                job.remember(request_id, fingerprint, Dedup::Cas { swapped }, now);
                // A failed swap changes nothing but the dedup record (none without a request id):
                // a CAS spin loop must not run at the journal's fsync rate.
                let effects = if swapped {
                    Effects::topic(scope.key_topic(key))
                } else {
                    Effects { changed: !request_id.is_empty(), topics: Vec::new() }
                };
                Ok((Outcome::Cas { swapped, current: after }, effects))
            }
            Command::StoreDelete { scope, key, request_id } => {
                let job = self.job_mut(&scope.job)?;
                job.check_write(scope)?;
                let fingerprint = cmd.fingerprint();
                match job.recall(request_id, fingerprint)? {
                    Some(Dedup::Delete(existed)) => return Ok((Outcome::Deleted(existed), Effects::default())),
                    Some(_) => return Err(reused_request_id(request_id)),
                    None => {}
                }
                let removed = job.store_map(scope.round_scoped).remove(key);
                let existed = removed.is_some();
                if let Some(v) = removed {
                    job.store_bytes = job.store_bytes.saturating_sub(key.len() + v.len());
                }
                job.remember(request_id, fingerprint, Dedup::Delete(existed), now);
                // Deleting a key that is not there changes nothing but the dedup record (none
                // without a request id), which must be journaled like any change: a retry after
                // a restart answers from it too.
                let effects = if existed {
                    Effects::topic(scope.key_topic(key))
                } else {
                    Effects { changed: !request_id.is_empty(), topics: Vec::new() }
                };
                Ok((Outcome::Deleted(existed), effects))
            }
            Command::BarrierArrive { scope, name, member, participants, request_id } => {
                let total_arrivals = self.totals.barrier_arrivals;
                let job = self.job_mut(&scope.job)?;
                job.check_write(scope)?;
                let fingerprint = cmd.fingerprint();
                match job.recall(request_id, fingerprint)? {
                    Some(Dedup::Barrier(g)) => return Ok((Outcome::Arrived(g), Effects::default())),
                    Some(_) => return Err(reused_request_id(request_id)),
                    None => {}
                }
                if *participants == 0 || *participants > MAX_BARRIER_PARTICIPANTS {
                    return Err(RdzvError::invalid(
                        "participants",
                        format!("{participants}; expected 1 to {MAX_BARRIER_PARTICIPANTS}"),
                    ));
                }
                let bkey = (scope.round_scoped, name.clone());
                if !job.barriers.contains_key(&bkey) && job.barriers.len() >= MAX_BARRIERS {
                    return Err(RdzvError::ResourceExhausted(format!(
                        "job {:?} holds {} barriers, the limit is {MAX_BARRIERS}",
                        job.id,
                        job.barriers.len()
                    )));
                }
                // Arrivals over all of the job's barriers are held to one barrier's most, so
                // 10,000 barriers cannot each hold a million names.
                let new_member = !job.barriers.get(&bkey).is_some_and(|b| b.arrived.contains(member));
                if new_member {
                    if total_arrivals >= limits.max_total_barrier_arrivals {
                        return Err(RdzvError::ResourceExhausted(format!(
                            "the service holds {total_arrivals} barrier arrivals over all jobs, the limit is {}",
                            limits.max_total_barrier_arrivals
                        )));
                    }
                    let held = job.barrier_arrivals();
                    if held >= MAX_BARRIER_PARTICIPANTS as usize {
                        return Err(RdzvError::ResourceExhausted(format!(
                            "job {:?} holds {held} barrier arrivals, the limit is {MAX_BARRIER_PARTICIPANTS}",
                            job.id
                        )));
                    }
                }
                let barrier = job.barriers.entry(bkey).or_default();
                if barrier.arrived.is_empty() {
                    barrier.participants = *participants;
                } else if barrier.participants != *participants {
                    return Err(RdzvError::invalid(
                        "participants",
                        format!(
                            "barrier {name:?} is waiting for {} participants, this call says {participants}",
                            barrier.participants
                        ),
                    ));
                }
                let generation = barrier.generation;
                let arrived_now = barrier.arrived.insert(member.clone());
                let released = barrier.arrived.len() as u32 >= barrier.participants;
                if released {
                    barrier.generation += 1;
                    barrier.arrived.clear();
                }
                job.remember(request_id, fingerprint, Dedup::Barrier(generation), now);
                // A repeated arrival without a request id changes nothing: nothing to journal.
                let effects = if released {
                    Effects::topic(scope.barrier_topic(name))
                } else {
                    Effects { changed: arrived_now || !request_id.is_empty(), topics: Vec::new() }
                };
                Ok((Outcome::Arrived(generation), effects))
            }
            Command::PublishUniqueId { job, round, rank, name, id } => {
                let job = self.job_mut(job)?;
                if let Some(e) = job.ended_error() {
                    return Err(e);
                }
                job.check_round(*round)?;
                if !matches!(job.phase, Phase::Running { .. }) {
                    return Err(RdzvError::FailedPrecondition(format!(
                        "round {round} of job {:?} is not running; the unique id is published after the round forms",
                        job.id
                    )));
                }
                if *rank != 0 {
                    return Err(RdzvError::PermissionDenied(format!(
                        "only global rank 0 may publish the unique id of round {round}; the caller is rank {rank}"
                    )));
                }
                if id.len() != validate::UNIQUE_ID_LEN {
                    return Err(RdzvError::invalid(
                        "unique_id",
                        format!("{} bytes; an NCCL unique id is exactly {} bytes", id.len(), validate::UNIQUE_ID_LEN),
                    ));
                }
                match job.unique_ids.get(name) {
                    // A retry of the same publication is not a second write.
                    Some(existing) if existing == id => Ok((Outcome::Done, Effects::default())),
                    Some(_) => Err(RdzvError::AlreadyExists(format!(
                        "the unique id {name:?} of round {round} was already published and is write-once"
                    ))),
                    None if job.unique_ids.len() >= MAX_UNIQUE_IDS => Err(RdzvError::ResourceExhausted(format!(
                        "round {round} of job {:?} holds {MAX_UNIQUE_IDS} unique ids, the limit",
                        job.id
                    ))),
                    None => {
                        job.unique_ids.insert(name.clone(), id.clone());
                        Ok((Outcome::Done, Effects::topic(unique_id_topic(*round, name))))
                    }
                }
            }
        }
    }

    fn join(&mut self, j: &JoinCmd, now: Ms, limits: &Limits) -> Result<(Outcome, Effects), RdzvError> {
        j.spec.validate(limits)?;
        if j.local_world_size == 0 || j.local_world_size > validate::MAX_LOCAL_WORLD_SIZE {
            return Err(RdzvError::invalid(
                "local_world_size",
                format!("{}; expected 1 to {}", j.local_world_size, validate::MAX_LOCAL_WORLD_SIZE),
            ));
        }
        if j.addrs.is_empty() {
            return Err(RdzvError::invalid("addrs", "no address given; at least one is required"));
        }
        if j.master_port > u32::from(u16::MAX) {
            return Err(RdzvError::invalid("master_port", format!("{}; expected 0 to 65535", j.master_port)));
        }
        // Everything that can refuse the join is checked before the job is created or started
        // over: a refused command changes nothing (it is not journaled, so a change would not
        // survive a restart, and a job created by it would hold its spec against every later join).
        let fresh = self.jobs.get(&j.job).is_none_or(Job::starts_over_on_join);
        if fresh && j.spec.fixed_ranks && j.rank_hint.is_none_or(|r| r >= j.spec.max_nodes) {
            return Err(fixed_rank_error(j, j.spec.max_nodes));
        }
        // A job started over has no nodes, so whether this node adds a record is known now.
        let known = self.jobs.get(&j.job).is_some_and(|job| job.nodes.contains_key(&j.node));
        if !known && self.totals.nodes >= limits.max_total_nodes {
            return Err(RdzvError::ResourceExhausted(format!(
                "the service holds {} nodes over all jobs, the limit is {}",
                self.totals.nodes, limits.max_total_nodes
            )));
        }
        if !self.jobs.contains_key(&j.job) {
            if self.jobs.len() >= limits.max_jobs {
                return Err(RdzvError::ResourceExhausted(format!(
                    "the service holds {} jobs, the limit is {}",
                    self.jobs.len(),
                    limits.max_jobs
                )));
            }
            let mut job = Job::new(j.job.clone(), j.spec.clone(), now);
            // A job the service forgot goes on from its last round (see `State::retired`).
            if let Some(r) = self.retired.remove(&j.job) {
                job.round = r.round.saturating_add(1);
            }
            self.jobs.insert(j.job.clone(), job);
        }
        let job = self.job_mut(&j.job)?;
        // A job that ended and that every node has left starts over when its id is used again (a
        // re-run with the same --rdzv-id). Rounds keep counting up, so fencing stays monotonic
        // (past the job's removal too: `State::retired`).
        if job.starts_over_on_join() {
            let next_round = job.round + 1;
            *job = Job::new(j.job.clone(), j.spec.clone(), now);
            job.round = next_round;
        }
        if let Some(e) = job.ended_error() {
            return Err(e);
        }
        if job.spec != j.spec {
            return Err(RdzvError::FailedPrecondition(format!(
                "job {:?} was created with {}; node {:?} asks for {}",
                job.id,
                job.spec.describe(),
                j.node,
                j.spec.describe()
            )));
        }
        let lease_expires = now.saturating_add(job.spec.lease_ms);
        // A node already placed (a retried join) keeps its place.
        let placed = job.waiting.contains(&j.node)
            || match &job.phase {
                Phase::Forming { joined, .. } => joined.contains(&j.node),
                Phase::Running { members, .. } => members.contains_key(&j.node),
                _ => false,
            };
        if !known && job.nodes.len() as u64 >= 2 * u64::from(job.spec.max_nodes) {
            return Err(RdzvError::ResourceExhausted(format!(
                "job {:?} already has {} nodes (max_nodes {} plus as many spares)",
                job.id,
                job.nodes.len(),
                job.spec.max_nodes
            )));
        }
        // Fixed node ranks (static backend): a rank out of range is bad input; a rank another live
        // node holds fails the job, naming both, so that no worker of it ever starts.
        let mut duplicate = None;
        // A known node (rejoining after a round ended) is checked too, against the others: a
        // rejoin with another rank (or none) would otherwise take any free one.
        if job.spec.fixed_ranks && !placed {
            let Some(want) = j.rank_hint.filter(|r| *r < job.spec.max_nodes) else {
                return Err(fixed_rank_error(j, job.spec.max_nodes));
            };
            if let Some(holder) = job.nodes.values().find(|n| n.id != j.node && n.rank_hint == Some(want)) {
                duplicate = Some(format!(
                    "duplicate node rank {want}: {} and {} were both started with --node-rank {want}; give each of the {} nodes a distinct --node-rank in 0..{}",
                    node_label(&holder.hostname, &holder.addrs, &holder.id),
                    node_label(&j.hostname, &j.addrs, &j.node),
                    job.spec.max_nodes,
                    job.spec.max_nodes
                ));
            }
        }
        let last_rank = job.nodes.get(&j.node).and_then(|n| n.last_rank);
        let node = Node {
            id: j.node.clone(),
            hostname: j.hostname.clone(),
            addrs: j.addrs.clone(),
            local_world_size: j.local_world_size,
            rank_hint: j.rank_hint,
            master_port: j.master_port,
            lease_expires,
            last_heartbeat: now,
            last_rank,
        };
        if placed {
            if let Some(n) = job.nodes.get_mut(&j.node) {
                n.lease_expires = lease_expires;
                n.last_heartbeat = now;
            }
            return Ok((Outcome::Joined, Effects::default()));
        }
        job.nodes.insert(j.node.clone(), node);
        if let Some(reason) = duplicate {
            job.fail(reason, now);
            return Ok((Outcome::Joined, Effects::changed()));
        }
        let max = job.spec.max_nodes as usize;
        match &mut job.phase {
            Phase::Forming { joined, rejoining, .. } => {
                // A survivor of the ended round has its place; a newcomer only one no survivor
                // is coming back to (else it put that survivor out, with its sticky rank).
                let survivor = rejoining.remove(&j.node);
                if joined.len() + if survivor { 0 } else { rejoining.len() } < max {
                    joined.insert(j.node.clone());
                } else {
                    job.waiting.insert(j.node.clone());
                }
                job.maybe_close(now);
            }
            Phase::Running { members, finished, .. } => {
                let scale_up = finished.is_empty() && members.len() < max;
                job.waiting.insert(j.node.clone());
                if scale_up {
                    job.end_round(format!("scale-up: node {} arrived", j.node), now);
                }
            }
            Phase::Completed { .. } | Phase::Failed { .. } => {}
        }
        Ok((Outcome::Joined, Effects::changed()))
    }

    /// The commands time makes due at `now`: expired leases, passed last calls, forgotten jobs.
    pub fn due(&self, now: Ms, limits: &Limits) -> Vec<Command> {
        let mut out = Vec::new();
        for job in self.jobs.values() {
            let forget_at = match job.phase {
                Phase::Completed { at } | Phase::Failed { at } => Some(at.saturating_add(limits.retention_ms)),
                _ if job.nodes.is_empty() => Some(job.last_activity.saturating_add(limits.retention_ms)),
                _ => None,
            };
            if forget_at.is_some_and(|t| t <= now) {
                out.push(Command::RemoveJob { job: job.id.clone() });
                continue;
            }
            for node in job.nodes.values() {
                if node.lease_expires <= now {
                    out.push(Command::ExpireNode { job: job.id.clone(), node: node.id.clone() });
                }
            }
            if let Phase::Forming { last_call_deadline: Some(d), .. } = job.phase {
                if d <= now {
                    out.push(Command::CloseRound { job: job.id.clone() });
                }
            }
        }
        out
    }

    /// The earliest time at which [`State::due`] may return something.
    pub fn next_deadline(&self, limits: &Limits) -> Option<Ms> {
        let mut next: Option<Ms> = None;
        let mut consider = |t: Ms| next = Some(next.map_or(t, |n| n.min(t)));
        for job in self.jobs.values() {
            match job.phase {
                Phase::Completed { at } | Phase::Failed { at } => consider(at.saturating_add(limits.retention_ms)),
                _ if job.nodes.is_empty() => consider(job.last_activity.saturating_add(limits.retention_ms)),
                _ => {}
            }
            for node in job.nodes.values() {
                consider(node.lease_expires);
            }
            if let Phase::Forming { last_call_deadline: Some(d), .. } = job.phase {
                consider(d);
            }
        }
        next
    }

    /// Gives every node a full lease from `now`. Used after recovery, when leases could not be renewed
    /// while the service was down.
    pub fn renew_all_leases(&mut self, now: Ms) {
        for job in self.jobs.values_mut() {
            let lease = job.spec.lease_ms;
            for node in job.nodes.values_mut() {
                node.lease_expires = now.saturating_add(lease);
            }
        }
    }

    /// The assignment of `node` in the job's running round, if it has one.
    pub fn assignment(&self, job: &str, node: &str) -> Result<Option<pb::JoinResponse>, RdzvError> {
        let job = self.job(job)?;
        Ok(job.assignment(node))
    }

    /// The operator view of one job.
    pub fn job_status(&self, job: &Job) -> pb::JobStatus {
        let (members, finished, world_size) = match &job.phase {
            Phase::Running { members, finished, world_size, .. } => (Some(members), Some(finished), *world_size),
            _ => (None, None, 0),
        };
        let nodes = job
            .nodes
            .values()
            .map(|n| {
                let member = members.and_then(|m| m.get(&n.id));
                let state = match (&job.phase, member) {
                    (_, Some(_)) if finished.is_some_and(|f| f.contains(&n.id)) => pb::NodeState::Finished,
                    (_, Some(_)) => pb::NodeState::Running,
                    _ if job.waiting.contains(&n.id) => pb::NodeState::Waiting,
                    (Phase::Forming { joined, .. }, _) if joined.contains(&n.id) => pb::NodeState::Joined,
                    _ => pb::NodeState::Rejoining,
                };
                pb::NodeStatus {
                    node_id: n.id.clone(),
                    hostname: n.hostname.clone(),
                    addrs: n.addrs.clone(),
                    state: state as i32,
                    node_rank: member.map(|m| m.node_rank as i32).unwrap_or(-1),
                    local_world_size: n.local_world_size,
                    rank_offset: member.map(|m| m.rank_offset as i32).unwrap_or(-1),
                    last_heartbeat_unix_ms: n.last_heartbeat,
                    rank_hint: n.rank_hint,
                }
            })
            .collect();
        pb::JobStatus {
            view: Some(job.view()),
            nodes,
            world_size,
            num_keys: job.num_keys() as u64,
            store_bytes: job.store_bytes as u64,
            created_unix_ms: job.created,
        }
    }
}

/// Moves spares from `waiting` (smallest ids first) into `joined` until it holds `up_to`.
fn fill_from(waiting: &mut BTreeSet<String>, joined: &mut BTreeSet<String>, up_to: usize) {
    while joined.len() < up_to {
        let Some(id) = waiting.pop_first() else { break };
        joined.insert(id);
    }
}

#[cfg(test)]
mod tests;
