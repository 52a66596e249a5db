//! Reply ordering for one connection: replies leave strictly in request order, and a pending WAIT
//! or BARRIER holds back what was answered after it until it completes or is cancelled.
//!
//! torch's client sends nothing but CANCEL_WAIT while it waits, and accepts either `01` or `00 01`
//! for it (the wake-up raced the cancel). The queue gives exactly that: a wait the core completed
//! before the cancel keeps its slot and turns into `00` when the wake-up arrives, and the `01` queued
//! behind it waits for it. A wait the cancel removed loses its slot and never produces a byte.

use std::collections::VecDeque;

use crate::tcpstore::proto::STOP_WAITING;
use crate::tcpstore::state::{Reply, WaitId};

#[derive(Debug)]
enum Slot {
    Ready(Vec<u8>),
    Pending(WaitId),
}

/// The replies of one connection not yet handed to the socket.
#[derive(Debug, Default)]
pub struct ReplyQueue {
    slots: VecDeque<Slot>,
    /// Bytes in `Ready` slots.
    n_bytes: usize,
    /// `Pending` slots.
    n_pending: usize,
}

impl ReplyQueue {
    /// An empty queue.
    pub fn new() -> Self {
        ReplyQueue::default()
    }

    /// Queues the reply to the connection's latest request.
    pub fn push(&mut self, reply: Reply) {
        match reply {
            Reply::None => {}
            Reply::Bytes(b) => {
                self.n_bytes += b.len();
                match self.slots.back_mut() {
                    Some(Slot::Ready(last)) => last.extend_from_slice(&b),
                    _ => self.slots.push_back(Slot::Ready(b)),
                }
            }
            Reply::Pending(id) => {
                self.n_pending += 1;
                self.slots.push_back(Slot::Pending(id));
            }
        }
    }

    /// The wait `id` completed: its slot becomes a STOP_WAITING. Unknown ids are ignored.
    pub fn woken(&mut self, id: WaitId) {
        if let Some(slot) = self.slots.iter_mut().find(|s| matches!(s, Slot::Pending(p) if *p == id)) {
            *slot = Slot::Ready(vec![STOP_WAITING]);
            self.n_pending -= 1;
            self.n_bytes += 1;
        }
    }

    /// The waits `ids` were cancelled: their slots go away without a byte.
    pub fn cancelled(&mut self, ids: &[WaitId]) {
        if ids.is_empty() {
            return;
        }
        let before = self.slots.len();
        self.slots.retain(|s| !matches!(s, Slot::Pending(p) if ids.contains(p)));
        self.n_pending -= before - self.slots.len();
    }

    /// Drops the first pending wait and everything queued after it; true if there was one. For
    /// a connection whose peer ended its stream: its waits are dropped (it can no longer cancel
    /// them), and a reply sent in place of a wait's would be read as that wait's answer.
    pub fn cut_at_first_pending(&mut self) -> bool {
        let Some(at) = self.slots.iter().position(|s| matches!(s, Slot::Pending(_))) else { return false };
        for slot in self.slots.drain(at..) {
            match slot {
                Slot::Ready(b) => self.n_bytes -= b.len(),
                Slot::Pending(_) => self.n_pending -= 1,
            }
        }
        true
    }

    /// Nothing is queued: no reply waiting to be taken, no pending wait.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Moves the replies that may leave now (everything before the first pending wait) to `out`.
    pub fn take_ready(&mut self, out: &mut Vec<u8>) {
        while let Some(Slot::Ready(_)) = self.slots.front() {
            if let Some(Slot::Ready(b)) = self.slots.pop_front() {
                self.n_bytes -= b.len();
                // A large reply moves in whole; small ones are copied into `out`'s kept capacity.
                if out.is_empty() && b.len() > out.capacity() {
                    *out = b;
                } else {
                    out.extend_from_slice(&b);
                }
            }
        }
    }

    /// Bytes held back behind pending waits (or not yet taken).
    pub fn n_bytes(&self) -> usize {
        self.n_bytes
    }

    /// Pending waits of this connection.
    pub fn n_pending(&self) -> usize {
        self.n_pending
    }
}
