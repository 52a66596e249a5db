//! Which connections the server closes when it holds more than
//! [`max_buffered_bytes`](super::TcpStoreLimits::max_buffered_bytes) for all of them together:
//! pure decisions over numbers the event loop gathers, no I/O (the clock is passed in).
//!
//! A connection whose peer takes its replies at a reasonable rate is never chosen, however much
//! it holds: a rank downloading a large value over a slow link is doing what it should, and what
//! it holds shrinks as it reads (each connection alone is held to about `max_request_bytes` and
//! 16 MiB of replies). The ones chosen are those that hold bytes nobody moves: replies their peer
//! does not read, requests their peer does not finish. Among them, connections whose peer already
//! ended its stream go first (they only have replies left, and are on their way out), then the
//! largest. So the budget can stay exceeded while only draining connections hold it, until they
//! have read.

use std::time::{Duration, Instant};

/// How long a peer may take its replies before it counts as not draining (see [`Drain`]).
pub(super) const DRAIN_WINDOW: Duration = Duration::from_secs(1);
/// Bytes a peer must take within each [`DRAIN_WINDOW`] to count as draining: 64 KiB/s, far below
/// what any rank reads at, far above what a peer that stopped reading (its kernel buffers full)
/// takes.
pub(super) const MIN_DRAIN_BYTES: usize = 64 << 10;

/// Whether a connection's peer takes the replies held for it at a reasonable rate: at least
/// [`MIN_DRAIN_BYTES`] in every [`DRAIN_WINDOW`] while any are held, the first window counted
/// from when replies began to be held (so a reply just built is draining until the peer had the
/// time to read some).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Drain {
    /// Replies were held at the last update.
    holding: bool,
    /// When replies began to be held, or when the peer last took [`MIN_DRAIN_BYTES`].
    since: Instant,
    /// Bytes the peer took since `since`.
    taken: usize,
}

impl Drain {
    /// A connection that holds no replies yet.
    pub(super) fn new(now: Instant) -> Self {
        Drain { holding: false, since: now, taken: 0 }
    }

    /// The peer took `taken` more bytes, and `held` reply bytes are still held for it.
    pub(super) fn update(&mut self, now: Instant, taken: usize, held: usize) {
        if held == 0 {
            *self = Drain::new(now);
            return;
        }
        if !self.holding {
            // Replies began to be held: a full window to take the first of them.
            *self = Drain { holding: true, since: now, taken: 0 };
        }
        self.taken = self.taken.saturating_add(taken);
        if self.taken >= MIN_DRAIN_BYTES {
            self.since = now;
            self.taken = 0;
        }
    }

    /// Replies are held and the peer takes them at a reasonable rate. A connection that holds
    /// no replies is not draining anything (what it holds, if anything, is requests).
    pub(super) fn draining(&self, now: Instant) -> bool {
        self.holding && now.saturating_duration_since(self.since) < DRAIN_WINDOW
    }
}

/// One open connection (not already being closed) as shedding sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Holder {
    /// The connection's slot in the event loop.
    pub(super) slot: usize,
    /// What it counts for in the server's total: unfinished and held-back requests, unread
    /// replies.
    pub(super) bytes: usize,
    /// Its peer ended its stream: it only has replies left to take, and closes after them.
    pub(super) half_closed: bool,
    /// Its peer takes its replies at a reasonable rate ([`Drain::draining`]).
    pub(super) draining: bool,
}

/// The connections to close, in order, so that the others hold at most `max` of the `total`
/// bytes (`total` already leaves out what connections being closed hold): never a draining one;
/// half-closed ones first, then the largest (the slot breaks ties, so the choice is the same for
/// the same input). The result may leave more than `max` held, when the rest are draining.
pub(super) fn pick(mut holders: Vec<Holder>, total: usize, max: usize) -> Vec<usize> {
    holders.retain(|h| !h.draining && h.bytes > 0);
    holders.sort_unstable_by(|a, b| b.half_closed.cmp(&a.half_closed).then(b.bytes.cmp(&a.bytes)).then(a.slot.cmp(&b.slot)));
    let mut left = total;
    let mut chosen = Vec::new();
    for h in holders {
        if left <= max {
            break;
        }
        chosen.push(h.slot);
        left = left.saturating_sub(h.bytes);
    }
    chosen
}

#[cfg(test)]
mod tests;
