//! The seam between the executor and durable storage: the executor's flusher thread hands every
//! batch of framed records (group commit) and every snapshot to a [`LogStore`], in order, and waits
//! for it to say "durable".
//!
//! Two implementations share one entry format ([`journal::encode`] records, postcard snapshots):
//! - the file journal ([`Journal`], `--data-dir`): fsync'd append log (each append one batch frame,
//!   replayed whole or not at all) plus snapshot compaction;
//! - the etcd log ([`crate::ha::log::EtcdLog`], `--etcd-endpoints`): every write is a Txn guarded by
//!   the leader's fencing token, so a deposed leader commits nothing.
//!
//! Recovery is each implementation's own (a directory is opened and replayed; etcd is read at a
//! pinned revision by the HA node), because it happens before there is a flusher.
//!
//! [`journal::encode`]: crate::journal::encode

use crate::RdzvError;
use crate::journal::Journal;
use crate::state::State;

/// Durable storage of the executor's log.
pub trait LogStore: Send + 'static {
    /// Makes the framed records of sequence numbers `first_seq..=last_seq` durable, in order after
    /// everything appended before. An error leaves nothing half-applied that a retry of the same
    /// bytes would break; [`RdzvError::NotLeader`] means this writer may never write again.
    fn append(&mut self, records: &[u8], first_seq: u64, last_seq: u64) -> Result<(), RdzvError>;

    /// Replaces everything up to `seq` (all of it already appended) by a snapshot of `state`.
    fn compact(&mut self, state: &State, seq: u64) -> Result<(), RdzvError>;

    /// Proves that this writer still owns the log at a moment after the call began (the HA leader's
    /// guarded write; reads wait for one). The file journal is always its own.
    fn confirm(&mut self) -> Result<(), RdzvError> {
        Ok(())
    }

    /// Whether reads must wait for a [`LogStore::confirm`] that began after them.
    fn reads_need_confirmation(&self) -> bool {
        false
    }

    /// Bytes of log after which the executor queues a snapshot (at least: the executor waits for
    /// as many log bytes as the state holds store bytes, so that a large state is not rewritten
    /// whole for every few MiB of log).
    fn compact_every(&self) -> u64;

    /// The last sequence number the store's latest snapshot holds, when entries after it may be
    /// in the log already (a new HA leader's predecessors wrote them). A leader whose state is
    /// past it snapshots at once: the bytes it counts towards [`LogStore::compact_every`] are
    /// only its own, and leaders that change more often than that would never snapshot, leaving
    /// the log to grow for good. `None`: nothing before this writer (the file journal compacts
    /// when it opens).
    fn snapshot_seq(&self) -> Option<u64> {
        None
    }
}

/// The file journal of `--data-dir`.
pub type FileJournal = Journal;

impl LogStore for Journal {
    fn append(&mut self, records: &[u8], _first_seq: u64, _last_seq: u64) -> Result<(), RdzvError> {
        Journal::append(self, records)
    }

    fn compact(&mut self, state: &State, seq: u64) -> Result<(), RdzvError> {
        Journal::compact(self, state, seq)
    }

    fn compact_every(&self) -> u64 {
        64 << 20
    }
}
