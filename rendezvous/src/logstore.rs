//! The seam between the executor and durable storage: the executor's flusher thread hands every
//! batch of framed records (group commit) and every snapshot to a [`LogStore`], in order, and waits
//! for it to say "durable".
//!
//! Two implementations share one entry format ([`journal::encode`] records, postcard snapshots):
//! - the file journal ([`Journal`], `--data-dir`): fsync'd append log plus snapshot compaction;
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

    /// Bytes of log after which the executor queues a snapshot.
    fn compact_every(&self) -> u64;
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
