//! The executor's log in etcd: key layout, batches, chunked snapshots, the guarded writes of the
//! leader ([`EtcdLog`], a [`LogStore`]) and recovery at a pinned revision ([`recover`]).
//!
//! Key layout under the prefix `P` (`--etcd-prefix`):
//!
//! | key | value | written by |
//! |---|---|---|
//! | `P/meta/format` | the journal format version, created once | the first daemon |
//! | `P/election/<lease:016x>` | [`pb::DaemonPeer`] of the campaigner, attached to its lease | each daemon |
//! | `P/leader` | [`pb::DaemonPeer`] of the leader, `campaign_revision` = its epoch | the leader, guarded |
//! | `P/log/<first_seq:020>` | [`Batch`]: the writer's epoch and framed journal records | the leader, guarded |
//! | `P/snap/<seq:020>/<chunk:06>` | ≤ 512 KiB of a postcard `State` | the leader, guarded |
//! | `P/snap/current` | [`SnapPointer`] | the leader, guarded flip |
//!
//! **Every write of a leader is a Txn whose compares include `create_revision(K) == R`**, `K` its
//! election key and `R` its epoch: a leader whose lease expired (paused, partitioned, slow) commits
//! nothing. Appends also require the slot to be free, so the log is one line and a retried append
//! that already committed is recognised by its bytes.

use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use rsrun_proto::etcd::etcdserverpb as epb;
use rsrun_proto::v1 as pb;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::etcd::{Etcd, EtcdError, created_at, delete_op, get_op, modified_at, prefix_end, put_op, txn_range};
use super::{FenceClock, read_peer};
use crate::RdzvError;
use crate::journal::{self, Entry};
use crate::logstore::LogStore;
use crate::metrics::Metrics;
use crate::state::{Ms, State};
use crate::validate::Limits;

/// Largest batch of records in one log key (etcd refuses requests over 1.5 MiB by default).
pub const MAX_BATCH_BYTES: usize = 1 << 20;
/// Largest snapshot chunk.
pub const CHUNK_BYTES: usize = 512 << 10;
/// A snapshot every this many bytes of log (etcd traffic per snapshot stays small).
pub const COMPACT_EVERY: u64 = 8 << 20;
/// Keys per page when reading the log back.
const PAGE: i64 = 16;

/// The keys under one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Keys under `prefix` (a trailing `/` is ignored).
    pub fn new(prefix: &str) -> Self {
        Keys { prefix: prefix.trim_end_matches('/').to_owned() }
    }

    fn k(&self, rest: &str) -> Vec<u8> {
        format!("{}/{rest}", self.prefix).into_bytes()
    }

    /// Everything of this group.
    pub fn all(&self) -> Vec<u8> {
        self.k("")
    }
    /// The format version.
    pub fn format(&self) -> Vec<u8> {
        self.k("meta/format")
    }
    /// Campaign keys' prefix.
    pub fn election_prefix(&self) -> Vec<u8> {
        self.k("election/")
    }
    /// The campaign key of a lease.
    pub fn election(&self, lease: i64) -> Vec<u8> {
        self.k(&format!("election/{lease:016x}"))
    }
    /// The leader record.
    pub fn leader(&self) -> Vec<u8> {
        self.k("leader")
    }
    /// Log keys' prefix.
    pub fn log_prefix(&self) -> Vec<u8> {
        self.k("log/")
    }
    /// The log key of the batch starting at `first_seq`.
    pub fn log(&self, first_seq: u64) -> Vec<u8> {
        self.k(&format!("log/{first_seq:020}"))
    }
    /// The snapshot pointer.
    pub fn snap_current(&self) -> Vec<u8> {
        self.k("snap/current")
    }
    /// Every chunk of every snapshot sorts from here (`current` sorts after the digits).
    pub fn snap_chunks_start(&self) -> Vec<u8> {
        self.k("snap/")
    }
    /// The chunks of the snapshot at `seq`.
    pub fn snap_prefix(&self, seq: u64) -> Vec<u8> {
        self.k(&format!("snap/{seq:020}/"))
    }
    /// One chunk.
    pub fn snap_chunk(&self, seq: u64, i: u32) -> Vec<u8> {
        self.k(&format!("snap/{seq:020}/{i:06}"))
    }
}

/// The value of a log key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// The writer's epoch (non-decreasing along the log).
    pub epoch: u64,
    /// First and last sequence number of the records.
    pub first_seq: u64,
    /// Last sequence number.
    pub last_seq: u64,
    /// Framed journal records (`journal::encode`).
    pub records: Vec<u8>,
}

impl Batch {
    /// Decodes a log value.
    pub fn decode(bytes: &[u8]) -> Result<Batch, String> {
        postcard::from_bytes(bytes).map_err(|e| format!("undecodable log batch: {e}"))
    }

    /// The entries, checked against the batch's bounds.
    pub fn entries(&self) -> Result<Vec<Entry>, String> {
        let entries = journal::decode_records(&self.records)?;
        let contiguous = entries.iter().enumerate().all(|(i, e)| e.seq == self.first_seq + i as u64);
        if entries.is_empty() || !contiguous || entries.last().map(|e| e.seq) != Some(self.last_seq) {
            return Err(format!("batch {}..={} holds other sequence numbers", self.first_seq, self.last_seq));
        }
        Ok(entries)
    }
}

/// The value of `P/snap/current`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapPointer {
    /// Last sequence number included.
    pub seq: u64,
    /// Time of that entry.
    pub at: Ms,
    /// Number of chunks.
    pub chunks: u32,
    /// Payload length.
    pub len: u64,
    /// CRC-32 of the payload.
    pub crc: u32,
    /// Epoch of the writer.
    pub epoch: u64,
}

fn storage(message: String) -> RdzvError {
    RdzvError::Storage { path: "etcd log".into(), message }
}

/// The state rebuilt from etcd at one revision.
#[derive(Debug)]
pub struct Recovered {
    /// The state.
    pub state: State,
    /// Its last sequence number.
    pub seq: u64,
    /// Time of the last entry.
    pub last_at: Ms,
    /// The revision everything was read at.
    pub revision: i64,
    /// Mod revision of `P/snap/current` (0: none).
    pub snap_mod_revision: i64,
    /// The leader record at that revision, if any.
    pub leader: Option<pb::DaemonPeer>,
    /// Highest epoch seen in the log.
    pub epoch: u64,
}

/// Applies batches (in key order) on top of `state` at `seq`. Batches wholly at or below `seq` are
/// skipped; a gap, an epoch going back or damage is an error.
pub fn apply_batches(state: &mut State, seq: &mut u64, last_at: &mut Ms, epoch: &mut u64, values: &[Vec<u8>]) -> Result<(), String> {
    for v in values {
        let b = Batch::decode(v)?;
        if b.last_seq <= *seq {
            continue;
        }
        if b.first_seq > *seq + 1 {
            return Err(format!("gap in the log: expected sequence {}, the next batch starts at {}", *seq + 1, b.first_seq));
        }
        if b.epoch < *epoch {
            return Err(format!("log batch {}..={} of epoch {} follows epoch {}", b.first_seq, b.last_seq, b.epoch, *epoch));
        }
        *epoch = b.epoch;
        for e in b.entries()? {
            if e.seq <= *seq {
                continue;
            }
            if let Err(err) = state.apply(&e.cmd, e.at, &Limits::unbounded()) {
                tracing::error!(seq = e.seq, error = %err, "log replay diverged");
            }
            *seq = e.seq;
            *last_at = (*last_at).max(e.at);
        }
    }
    Ok(())
}

/// Rebuilds the state from the snapshot and the log at `revision` (0: now), every read pinned at
/// the same revision (a pinned Range is immune to stale reads of a paused member).
///
/// # Errors
/// etcd unreachable, the revision compacted, or a damaged log (gap, checksum, epoch going back).
pub async fn recover(etcd: &Etcd, keys: &Keys, revision: i64) -> Result<Recovered, RecoverError> {
    let (ptr, rev) = etcd.range_all(&keys.snap_current(), &[], revision, 1).await?;
    let (mut state, mut seq, mut last_at, mut epoch, snap_mod) = match ptr.first() {
        None => (State::default(), 0, 0, 0, 0),
        Some(kv) => {
            let p: SnapPointer = postcard::from_bytes(&kv.value).map_err(|e| RecoverError::Damaged(format!("snapshot pointer: {e}")))?;
            let prefix = keys.snap_prefix(p.seq);
            let (chunks, _) = etcd.range_all(&prefix, &prefix_end(&prefix), rev, 4).await?;
            if chunks.len() != p.chunks as usize {
                return Err(RecoverError::Damaged(format!("snapshot {} has {} chunks, its pointer says {}", p.seq, chunks.len(), p.chunks)));
            }
            let payload: Vec<u8> = chunks.into_iter().flat_map(|kv| kv.value).collect();
            if payload.len() as u64 != p.len || crc32fast::hash(&payload) != p.crc {
                return Err(RecoverError::Damaged(format!("snapshot {} fails its length or checksum", p.seq)));
            }
            let mut state: State = postcard::from_bytes(&payload).map_err(|e| RecoverError::Damaged(format!("snapshot {}: {e}", p.seq)))?;
            state.recount();
            (state, p.seq, p.at, p.epoch, kv.mod_revision)
        }
    };
    let values = log_after(etcd, keys, seq, rev).await?;
    apply_batches(&mut state, &mut seq, &mut last_at, &mut epoch, &values).map_err(RecoverError::Damaged)?;
    // (A pointer written before this fix, or by a leader that had appended nothing, says 0.)
    let last_at = last_at.max(state.latest_activity());
    let (leader, _) = etcd.range_all(&keys.leader(), &[], rev, 1).await?;
    let leader = leader.first().and_then(|kv| read_peer(&kv.value));
    Ok(Recovered { state, seq, last_at, revision: rev, snap_mod_revision: snap_mod, leader, epoch })
}

/// The log values that may hold entries after `seq`, read at `revision`, in key order: the batch
/// whose key sorts just before `seq + 1` (it may hold it), then every batch from `seq + 1` on.
pub async fn log_after(etcd: &Etcd, keys: &Keys, seq: u64, revision: i64) -> Result<Vec<Vec<u8>>, EtcdError> {
    let from = keys.log(seq + 1);
    let mut values: Vec<Vec<u8>> = Vec::new();
    if seq > 0 {
        let before = epb::RangeRequest {
            key: keys.log_prefix(),
            range_end: from.clone(),
            revision,
            limit: 1,
            sort_order: epb::range_request::SortOrder::Descend as i32,
            sort_target: epb::range_request::SortTarget::Key as i32,
            ..Default::default()
        };
        values.extend(etcd.range(before).await?.kvs.into_iter().map(|kv| kv.value));
    }
    let (logs, _) = etcd.range_all(&from, &prefix_end(&keys.log_prefix()), revision, PAGE).await?;
    values.extend(logs.into_iter().map(|kv| kv.value));
    Ok(values)
}

/// Why recovery failed.
#[derive(Debug, Clone)]
pub enum RecoverError {
    /// etcd did not answer or compacted the revision: try again.
    Etcd(EtcdError),
    /// The log in etcd is damaged: an operator must look.
    Damaged(String),
}

impl From<EtcdError> for RecoverError {
    fn from(e: EtcdError) -> Self {
        RecoverError::Etcd(e)
    }
}

impl std::fmt::Display for RecoverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecoverError::Etcd(e) => write!(f, "{e}"),
            RecoverError::Damaged(m) => write!(f, "the rsrun log in etcd is damaged: {m}"),
        }
    }
}

/// A snapshot whose chunks are being written.
struct PendingSnapshot {
    pointer: SnapPointer,
    task: tokio::task::JoinHandle<Result<(), RdzvError>>,
    started: Instant,
}

/// Who owns the log for one epoch: what every guarded write compares and writes.
#[derive(Debug, Clone)]
pub struct Owner {
    /// The leader's election key.
    pub election_key: Vec<u8>,
    /// Its creation revision: the fencing token.
    pub epoch: i64,
    /// The leader record written on every confirmation.
    pub leader_value: Vec<u8>,
    /// When the leader must assume its lease lapsed.
    pub fence: Arc<FenceClock>,
}

/// The leader's log in etcd for one epoch.
pub struct EtcdLog {
    etcd: Etcd,
    keys: Keys,
    rt: tokio::runtime::Handle,
    election_key: Vec<u8>,
    epoch: i64,
    leader_value: Vec<u8>,
    fence: Arc<FenceClock>,
    /// Mod revision of `P/snap/current` (the flip compares it).
    snap_mod_revision: i64,
    /// The last sequence number of the snapshot found at takeover (see `LogStore::snapshot_seq`).
    snap_seq: u64,
    pending: Option<PendingSnapshot>,
    /// Time of the last entry appended (stored with a snapshot, so a recovered clock never goes back).
    last_at: Ms,
    snapshot_every: u64,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for EtcdLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLog").field("epoch", &self.epoch).finish()
    }
}

/// What a guarded write's failure branch tells.
enum Refusal {
    /// The election key is gone or another: this writer was deposed.
    Deposed,
    /// The write had committed earlier (an uncertain attempt that did land), at this revision
    /// (the written key's mod revision: the failed Txn's own revision is later).
    AlreadyDone(i64),
    /// The slot holds other bytes.
    Conflict,
}

impl EtcdLog {
    /// The log of `owner`; `snap_mod_revision` is the mod revision of `P/snap/current` it read at
    /// takeover.
    pub fn new(etcd: Etcd, keys: Keys, rt: tokio::runtime::Handle, owner: Owner, snap: TakeoverSnapshot, metrics: Arc<Metrics>) -> Self {
        let TakeoverSnapshot { mod_revision: snap_mod_revision, seq: snap_seq } = snap;
        let Owner { election_key, epoch, leader_value, fence } = owner;
        EtcdLog {
            etcd,
            keys,
            rt,
            election_key,
            epoch,
            leader_value,
            fence,
            snap_mod_revision,
            snap_seq,
            pending: None,
            last_at: 0,
            snapshot_every: COMPACT_EVERY,
            metrics,
        }
    }

    /// Snapshots every `bytes` of log instead of [`COMPACT_EVERY`].
    pub fn with_snapshot_every(mut self, bytes: u64) -> Self {
        self.snapshot_every = bytes.max(1);
        self
    }

    fn deposed(&self, why: &str) -> RdzvError {
        tracing::warn!(epoch = self.epoch, why, "this leader may no longer write the log");
        RdzvError::NotLeader { leader: String::new(), epoch: 0 }
    }

    /// Runs a guarded Txn until it is answered: an uncertain outcome is retried with the same
    /// bytes until the leadership deadline. `judge` reads a failed compare's answers.
    fn guarded(&self, req: epb::TxnRequest, judge: impl Fn(&epb::TxnResponse) -> Refusal) -> Result<i64, RdzvError> {
        let mut pause = Duration::from_millis(20);
        loop {
            if self.fence.fenced() {
                return Err(self.deposed("the election lease may have lapsed before the write was acknowledged"));
            }
            match self.rt.block_on(self.etcd.txn(req.clone())) {
                Ok(r) if r.succeeded => return Ok(r.header.map(|h| h.revision).unwrap_or(0)),
                Ok(r) => match judge(&r) {
                    Refusal::AlreadyDone(revision) => return Ok(revision),
                    Refusal::Deposed => return Err(self.deposed("the election key is gone or belongs to a later campaign")),
                    Refusal::Conflict => {
                        self.metrics.ha_log_conflicts.inc();
                        tracing::error!(epoch = self.epoch, "log conflict: the slot holds bytes this leader did not write");
                        return Err(self.deposed("log conflict"));
                    }
                },
                Err(EtcdError::Uncertain(m)) => {
                    tracing::debug!(error = %m, "uncertain etcd write; retrying the same bytes");
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(250));
                }
                Err(e) => return Err(storage(e.to_string())),
            }
        }
    }

    fn ours(&self, r: &epb::TxnResponse, i: usize) -> bool {
        txn_range(r, i).first().is_some_and(|kv| kv.create_revision == self.epoch)
    }

    /// Why a write of `value` guarded by [election key, slot] failed (the failure branch read both).
    fn judge(&self, r: &epb::TxnResponse, value: &[u8]) -> Refusal {
        if !self.ours(r, 0) {
            Refusal::Deposed
        } else if let Some(kv) = txn_range(r, 1).into_iter().next().filter(|kv| kv.value == value) {
            Refusal::AlreadyDone(kv.mod_revision)
        } else {
            Refusal::Conflict
        }
    }

    fn append_batch(&self, batch: &Batch) -> Result<(), RdzvError> {
        let slot = self.keys.log(batch.first_seq);
        let value = postcard::to_allocvec(batch).map_err(|e| storage(format!("cannot encode a batch: {e}")))?;
        let req = epb::TxnRequest {
            compare: vec![created_at(&self.election_key, self.epoch), created_at(&slot, 0)],
            success: vec![put_op(&slot, value.clone(), 0)],
            failure: vec![get_op(&self.election_key), get_op(&slot)],
        };
        let started = Instant::now();
        self.guarded(req, |r| self.judge(r, &value))?;
        self.metrics.ha_append_seconds.observe(started.elapsed().as_secs_f64());
        self.metrics.ha_append_bytes.inc_by(value.len() as u64);
        Ok(())
    }

    /// Flips the snapshot pointer when its chunks are written.
    fn finish_snapshot(&mut self, wait: bool) -> Result<(), RdzvError> {
        let done = self.pending.as_ref().is_some_and(|p| p.task.is_finished());
        if !done && !wait {
            return Ok(());
        }
        let Some(p) = self.pending.take() else { return Ok(()) };
        match self.rt.block_on(p.task) {
            Ok(Ok(())) => {}
            Ok(Err(e @ RdzvError::NotLeader { .. })) => return Err(e),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, seq = p.pointer.seq, "snapshot chunks not written; the next snapshot tries again");
                return Ok(());
            }
            Err(e) => {
                tracing::warn!(error = %e, "snapshot task failed");
                return Ok(());
            }
        }
        let current = self.keys.snap_current();
        let value = postcard::to_allocvec(&p.pointer).map_err(|e| storage(format!("cannot encode the snapshot pointer: {e}")))?;
        let req = epb::TxnRequest {
            compare: vec![created_at(&self.election_key, self.epoch), modified_at(&current, self.snap_mod_revision)],
            success: vec![
                put_op(&current, value.clone(), 0),
                delete_op(&self.keys.log_prefix(), &self.keys.log(p.pointer.seq + 1)),
                delete_op(&self.keys.snap_chunks_start(), &self.keys.snap_prefix(p.pointer.seq)),
            ],
            failure: vec![get_op(&self.election_key), get_op(&current)],
        };
        let rev = self.guarded(req, |r| self.judge(r, &value))?;
        self.snap_mod_revision = rev;
        self.metrics.ha_snapshot_seconds.observe(p.started.elapsed().as_secs_f64());
        tracing::info!(seq = p.pointer.seq, chunks = p.pointer.chunks, bytes = p.pointer.len, "snapshot written to etcd; older log keys deleted");
        Ok(())
    }
}

impl LogStore for EtcdLog {
    fn append(&mut self, records: &[u8], first_seq: u64, last_seq: u64) -> Result<(), RdzvError> {
        self.finish_snapshot(false)?;
        // Split at record boundaries into batches of at most MAX_BATCH_BYTES (a record is never
        // split; HA limits keep every record well below the bound).
        let mut seq = first_seq;
        let mut start = 0usize;
        let mut at = 0usize;
        let mut batch_first = first_seq;
        let mut last_record = 0usize;
        while at + 8 <= records.len() {
            let len = u32::from_le_bytes(records[at..at + 4].try_into().unwrap_or([0; 4])) as usize + 8;
            last_record = at;
            if at + len > records.len() {
                return Err(storage(format!("records {first_seq}..={last_seq}: a record at offset {at} runs past the end")));
            }
            if at > start && at + len - start > MAX_BATCH_BYTES {
                self.append_batch(&Batch { epoch: self.epoch as u64, first_seq: batch_first, last_seq: seq - 1, records: records[start..at].to_vec() })?;
                start = at;
                batch_first = seq;
            }
            at += len;
            seq += 1;
        }
        if at != records.len() || seq - 1 != last_seq {
            return Err(storage(format!("records {first_seq}..={last_seq} hold {} entries", seq - first_seq)));
        }
        if at > start {
            self.append_batch(&Batch { epoch: self.epoch as u64, first_seq: batch_first, last_seq, records: records[start..].to_vec() })?;
        }
        if let Ok(entries) = journal::decode_records(&records[last_record..])
            && let Some(e) = entries.last()
        {
            self.last_at = e.at;
        }
        Ok(())
    }

    fn compact(&mut self, state: &State, seq: u64) -> Result<(), RdzvError> {
        if self.pending.is_some() {
            // One snapshot at a time; this one's log is covered by the next.
            return self.finish_snapshot(false);
        }
        let payload = journal::encode_state(state)?;
        // A new leader's first snapshot (of its predecessors' backlog) comes before any append of
        // its own: the state's own latest time stands in for the entry time it has not seen.
        let at = self.last_at.max(state.latest_activity());
        let chunks: Vec<Vec<u8>> = payload.chunks(CHUNK_BYTES).map(<[u8]>::to_vec).collect();
        let pointer = SnapPointer {
            seq,
            at,
            chunks: chunks.len() as u32,
            len: payload.len() as u64,
            crc: crc32fast::hash(&payload),
            epoch: self.epoch as u64,
        };
        let (etcd, keys, key, epoch, fence) = (self.etcd.clone(), self.keys.clone(), self.election_key.clone(), self.epoch, self.fence.clone());
        let task = self.rt.spawn(async move {
            for (i, chunk) in chunks.into_iter().enumerate() {
                let slot = keys.snap_chunk(seq, i as u32);
                let req = epb::TxnRequest {
                    compare: vec![created_at(&key, epoch)],
                    success: vec![put_op(&slot, chunk, 0)],
                    failure: vec![get_op(&key)],
                };
                loop {
                    if fence.fenced() {
                        return Err(RdzvError::NotLeader { leader: String::new(), epoch: 0 });
                    }
                    match etcd.txn(req.clone()).await {
                        Ok(r) if r.succeeded => break,
                        Ok(_) => return Err(RdzvError::NotLeader { leader: String::new(), epoch: 0 }),
                        Err(EtcdError::Uncertain(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
                        Err(e) => return Err(storage(e.to_string())),
                    }
                }
            }
            Ok(())
        });
        self.pending = Some(PendingSnapshot { pointer, task, started: Instant::now() });
        Ok(())
    }

    fn confirm(&mut self) -> Result<(), RdzvError> {
        self.finish_snapshot(false)?;
        let leader = self.keys.leader();
        let req = epb::TxnRequest {
            compare: vec![created_at(&self.election_key, self.epoch)],
            success: vec![put_op(&leader, self.leader_value.clone(), 0)],
            failure: vec![get_op(&self.election_key)],
        };
        self.guarded(req, |r| if self.ours(r, 0) { Refusal::AlreadyDone(r.header.map_or(0, |h| h.revision)) } else { Refusal::Deposed }).map(|_| ())
    }

    fn reads_need_confirmation(&self) -> bool {
        true
    }

    fn compact_every(&self) -> u64 {
        self.snapshot_every
    }

    fn snapshot_seq(&self) -> Option<u64> {
        Some(self.snap_seq)
    }
}

/// The snapshot pointer a new leader found at its takeover barrier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TakeoverSnapshot {
    /// The pointer's mod revision (0: none), which the next flip compares.
    pub mod_revision: i64,
    /// The last sequence number the snapshot holds (0: none).
    pub seq: u64,
}

/// The leader record a daemon writes at takeover and on every confirmation.
pub fn leader_value(daemon_id: &str, advertise: &str, epoch: i64) -> Vec<u8> {
    pb::DaemonPeer { daemon_id: daemon_id.to_owned(), advertise: advertise.to_owned(), campaign_revision: epoch as u64 }.encode_to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Command, JobSpec, JoinCmd, Scope};

    fn join(seq: u64) -> Entry {
        let spec = JobSpec { min_nodes: 2, max_nodes: 2, last_call_ms: 0, lease_ms: 1000, max_restarts: 0, fixed_ranks: false };
        let cmd = JoinCmd {
            job: "j".into(),
            node: "a".into(),
            addrs: vec!["127.0.0.1".into()],
            hostname: "h".into(),
            local_world_size: 1,
            rank_hint: None,
            master_port: 1,
            spec,
        };
        Entry { seq, at: 100 + seq, cmd: Command::Join(cmd) }
    }

    fn set(seq: u64, key: &str) -> Entry {
        Entry { seq, at: 100 + seq, cmd: Command::StoreSet { scope: Scope { job: "j".into(), round: 1, round_scoped: false }, key: key.into(), value: b"v".to_vec(), request_id: String::new() } }
    }

    fn batch(epoch: u64, entries: &[Entry]) -> Vec<u8> {
        let mut records = Vec::new();
        for e in entries {
            records.extend(journal::encode(e).unwrap());
        }
        postcard::to_allocvec(&Batch { epoch, first_seq: entries[0].seq, last_seq: entries[entries.len() - 1].seq, records }).unwrap()
    }

    #[test]
    fn keys_sort_as_the_log_needs() {
        let k = Keys::new("/rsrun/");
        assert_eq!(k.log(7), b"/rsrun/log/00000000000000000007".to_vec());
        assert!(k.log(9) < k.log(10));
        // Every chunk sorts before the pointer and after the start of the chunk range.
        assert!(k.snap_chunk(5, 0) < k.snap_current() && k.snap_chunks_start() < k.snap_chunk(5, 0));
        assert!(k.snap_prefix(5) < k.snap_prefix(6) && k.snap_chunk(5, 999_999) < k.snap_prefix(6));
        assert_eq!(prefix_end(b"/rsrun/log/"), b"/rsrun/log0".to_vec());
    }

    #[test]
    fn batches_replay_in_order_skip_what_is_held_and_refuse_gaps_and_older_epochs() {
        let (mut state, mut seq, mut at, mut epoch) = (State::default(), 0, 0, 0);
        let b1 = batch(5, &[join(1), set(2, "b")]);
        let b2 = batch(5, &[set(3, "c")]);
        apply_batches(&mut state, &mut seq, &mut at, &mut epoch, &[b1.clone(), b2.clone(), b1.clone()]).unwrap();
        assert_eq!((seq, at, epoch), (3, 103, 5));
        assert_eq!(state.job("j").unwrap().store.len(), 2);
        let gap = batch(5, &[set(5, "e")]);
        let err = apply_batches(&mut state, &mut seq, &mut at, &mut epoch, &[gap]).unwrap_err();
        assert!(err.contains("expected sequence 4"), "{err}");
        let older = batch(4, &[set(4, "d")]);
        let err = apply_batches(&mut state, &mut seq, &mut at, &mut epoch, &[older]).unwrap_err();
        assert!(err.contains("of epoch 4 follows epoch 5"), "{err}");
        // A batch overlapping what is held applies only its new entries.
        let overlap = batch(6, &[set(3, "c"), set(4, "d")]);
        apply_batches(&mut state, &mut seq, &mut at, &mut epoch, &[overlap]).unwrap();
        assert_eq!(seq, 4);
    }

    #[test]
    fn a_batch_with_wrong_bounds_or_damage_is_refused() {
        let mut b = Batch::decode(&batch(1, &[join(1), set(2, "b")])).unwrap();
        b.last_seq = 3;
        assert!(b.entries().unwrap_err().contains("other sequence numbers"));
        b.last_seq = 2;
        let n = b.records.len();
        b.records[n - 1] ^= 1;
        assert!(b.entries().unwrap_err().contains("checksum"));
    }
}
