//! Which connections the server closes when it holds more than
//! [`max_buffered_bytes`](super::TcpStoreLimits::max_buffered_bytes) for all of them together:
//! pure decisions over numbers the event loop gathers, no I/O (the clock is passed in).
//!
//! A connection whose bytes move at a reasonable rate is not chosen while the server holds at
//! most twice the budget, however much it holds: a rank downloading a large value over a slow link
//! (its peer takes its replies), or uploading one (a large SET arriving: its peer sends the
//! request it is in the middle of), is doing what it should, and what it holds either shrinks as
//! it reads or becomes a stored value once the request is whole (each connection alone is held to
//! about `max_request_bytes` and 16 MiB of replies). The ones chosen first are those that hold
//! bytes nobody moves, either way: replies their peer does not read, requests their peer does not
//! finish. Among them, connections whose peer already ended its stream go first (they only have
//! replies left, and are on their way out), then the largest. So the budget can stay exceeded
//! while only moving connections hold it, until they have read or sent the rest.
//!
//! A hard ceiling bounds that: past twice `max_buffered_bytes` (many peers each moving a little),
//! moving connections are closed too, the slowest first (the one whose bytes went longest without
//! moving [`MIN_DRAIN_BYTES`]), until the server holds at most twice the budget.

use std::time::{Duration, Instant};

/// How long a connection's bytes may go without moving before it counts as not draining (see
/// [`Drain`]).
pub(super) const DRAIN_WINDOW: Duration = Duration::from_secs(1);
/// Bytes that must move (taken by the peer, or sent by it as part of a request in progress) within
/// each [`DRAIN_WINDOW`] for a connection to count as draining: 64 KiB/s, far below what any rank
/// reads or sends at, far above what a peer that stopped (its kernel buffers full, or its upload
/// abandoned) moves.
pub(super) const MIN_DRAIN_BYTES: usize = 64 << 10;

/// Whether what a connection holds moves at a reasonable rate, either way: its peer takes the
/// replies held for it, or sends the rest of the request it is in the middle of. At least
/// [`MIN_DRAIN_BYTES`] must move in every [`DRAIN_WINDOW`] while anything is held, the first window
/// counted from when bytes began to be held (so a reply just built, or a request just begun, is
/// draining until the peer had the time to move some).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Drain {
    /// Bytes were held at the last update.
    holding: bool,
    /// When bytes began to be held, or when [`MIN_DRAIN_BYTES`] last moved.
    since: Instant,
    /// Bytes moved since `since`.
    moved: usize,
}

impl Drain {
    /// A connection that holds nothing yet.
    pub(super) fn new(now: Instant) -> Self {
        Drain { holding: false, since: now, moved: 0 }
    }

    /// `moved` more bytes moved (replies the peer took, or bytes it sent of a request in
    /// progress), and the connection still holds `held` bytes (requests and replies).
    pub(super) fn update(&mut self, now: Instant, moved: usize, held: usize) {
        if held == 0 {
            *self = Drain::new(now);
            return;
        }
        if !self.holding {
            // Bytes began to be held: a full window to move the first of them.
            *self = Drain { holding: true, since: now, moved: 0 };
        }
        self.moved = self.moved.saturating_add(moved);
        if self.moved >= MIN_DRAIN_BYTES {
            self.since = now;
            self.moved = 0;
        }
    }

    /// Bytes are held and they move at a reasonable rate. A connection that holds nothing is not
    /// draining anything.
    pub(super) fn draining(&self, now: Instant) -> bool {
        self.holding && self.idle(now) < DRAIN_WINDOW
    }

    /// How long the held bytes went without [`MIN_DRAIN_BYTES`] moving (since they began to be
    /// held, at most): the larger, the slower the connection. Zero when nothing is held.
    pub(super) fn idle(&self, now: Instant) -> Duration {
        if self.holding { now.saturating_duration_since(self.since) } else { Duration::ZERO }
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
    /// Its bytes move at a reasonable rate, either way ([`Drain::draining`]).
    pub(super) draining: bool,
    /// How long its bytes went without moving ([`Drain::idle`]): the slowest goes first past the
    /// hard ceiling.
    pub(super) idle: Duration,
}

/// The connections to close, in order, so that the others hold at most `max` of the `total`
/// bytes (`total` already leaves out what connections being closed hold). First the ones that
/// are not draining: half-closed ones first, then the largest (the slot breaks ties, so the choice
/// is the same for the same input). Draining ones are chosen only while more than the hard ceiling,
/// twice `max`, is left, and only until it is not: the slowest first (the longest idle), then the
/// largest, then by slot. The result may leave more than `max` held, when the rest are draining.
pub(super) fn pick(holders: Vec<Holder>, total: usize, max: usize) -> Vec<usize> {
    let ceiling = max.saturating_mul(2);
    let (mut draining, mut stalled): (Vec<Holder>, Vec<Holder>) =
        holders.into_iter().filter(|h| h.bytes > 0).partition(|h| h.draining);
    stalled.sort_unstable_by(|a, b| b.half_closed.cmp(&a.half_closed).then(b.bytes.cmp(&a.bytes)).then(a.slot.cmp(&b.slot)));
    let mut left = total;
    let mut chosen = Vec::new();
    for h in stalled {
        if left <= max {
            break;
        }
        chosen.push(h.slot);
        left = left.saturating_sub(h.bytes);
    }
    if left > ceiling {
        draining.sort_unstable_by(|a, b| b.idle.cmp(&a.idle).then(b.bytes.cmp(&a.bytes)).then(a.slot.cmp(&b.slot)));
        for h in draining {
            if left <= ceiling {
                break;
            }
            chosen.push(h.slot);
            left = left.saturating_sub(h.bytes);
        }
    }
    chosen
}

#[cfg(test)]
mod tests;
