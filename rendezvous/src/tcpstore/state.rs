//! The pure core of the TCPStore server: one keyspace, its queues, and the pending WAITs and
//! BARRIERs. No I/O, no clock: [`StoreState::apply`] takes a connection's request and returns its
//! reply plus the pending waits of any connection that the request completed.
//!
//! Semantics follow torch 2.15 (tcpstore.md §3, §4) except for the defects listed in its §7:
//!
//! - a wait is woken only by a real change: SET, ADD, APPEND, MULTI_SET, a COMPARE_SET that stores
//!   (never a failed one), BARRIER (it writes its counter); a QUEUE_PUSH wakes one wait on that name;
//! - a multi-key wait tracks each of its keys: it completes when every key it waited for has been
//!   written (or pushed to) once since it was registered, so two pushes to one queue do not complete
//!   a wait that also needs another key;
//! - a wait is completed, cancelled (CANCEL_WAIT, disconnect) or pending, never two of these, so a
//!   connection gets at most one STOP_WAITING per WAIT and never after its WAIT_CANCELED;
//! - DELETE_KEY neither wakes nor cancels waits (as torch);
//! - BARRIER waiters are woken by the BARRIER call that reaches the count, not by other writes to
//!   the counter key.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

use crate::RdzvError;
use crate::tcpstore::TcpStoreLimits;
use crate::tcpstore::proto::{self, NOT_READY, READY, Request, STOP_WAITING, WAIT_CANCELED};

/// A key or queue name: raw bytes.
pub type Key = Vec<u8>;

/// A connection, as the I/O layer numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// One pending WAIT or BARRIER. Ids order by registration (queue pushes wake the oldest wait).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WaitId {
    seq: u64,
    conn: ConnId,
}

impl WaitId {
    /// The connection that waits.
    pub fn conn(self) -> ConnId {
        self.conn
    }
}

/// What the requesting connection gets back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Nothing (SET, APPEND, MULTI_SET, QUEUE_PUSH, VALIDATE).
    None,
    /// These bytes, now.
    Bytes(Vec<u8>),
    /// A STOP_WAITING later, when the wait completes (unless it is cancelled first).
    Pending(WaitId),
}

/// The effects of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// For the requesting connection.
    pub reply: Reply,
    /// Pending waits (of any connection) that this request completed: each gets one STOP_WAITING.
    pub woken: Vec<WaitId>,
    /// The requesting connection's waits that this request (CANCEL_WAIT) removed: they get nothing.
    pub cancelled: Vec<WaitId>,
}

#[derive(Debug)]
enum PendingWait {
    /// A WAIT on `keys` (distinct, each missing when registered); `remaining` of them not yet written.
    Keys { remaining: usize, keys: Vec<Key> },
    /// A BARRIER on `key`.
    Barrier { key: Key },
}

/// Numbers for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// Keys in the key-value namespace (what GETNUMKEYS answers).
    pub n_keys: usize,
    /// Non-empty queues.
    pub n_queues: usize,
    /// Bytes held: keys plus values, queue names plus items.
    pub n_bytes: usize,
    /// Pending WAITs and BARRIERs.
    pub n_waits: usize,
}

/// One TCPStore keyspace and its waiters.
#[derive(Debug)]
pub struct StoreState {
    /// Cap on `n_bytes`; a write that would pass it is refused (and its connection closed).
    max_total_bytes: usize,
    /// Cap on one reply (a MULTI_GET, a LIST_KEYS) and on a value APPEND grows, so one small
    /// request cannot make the server build a reply of any size.
    max_reply_bytes: usize,
    kv: HashMap<Key, Vec<u8>>,
    /// FIFO queues, a namespace apart from `kv`; empty queues are removed.
    queues: HashMap<Key, VecDeque<Vec<u8>>>,
    /// Keys plus values, queue names plus items.
    n_bytes: usize,
    /// WAITs registered on a key that was missing; a write of the key completes that part of each.
    key_waiters: HashMap<Key, BTreeSet<WaitId>>,
    /// BARRIERs waiting on a counter key.
    barrier_waiters: HashMap<Key, BTreeSet<WaitId>>,
    waits: HashMap<WaitId, PendingWait>,
    conn_waits: HashMap<ConnId, BTreeSet<WaitId>>,
    /// Memory the keys of each connection's pending WAITs take (see [`wait_cost`]), held under
    /// [`MAX_WAIT_BYTES_PER_CONN`].
    conn_wait_bytes: HashMap<ConnId, usize>,
    /// The sum of `conn_wait_bytes`, held under the store's own cap (`max_total_bytes`): many
    /// connections each under their own cap could otherwise hold any amount together.
    total_wait_bytes: usize,
    /// Queues whose push woke a wait of the connection that has not popped from them since:
    /// a connection that goes away before its pop hands its item's wake-up to another waiter
    /// (one item is one wake-up, so no one else was woken for it). At most
    /// [`MAX_QUEUE_WAKES_PER_CONN`] each, the oldest dropped.
    queue_woken: HashMap<ConnId, VecDeque<Key>>,
    /// How many entries of `queue_woken` name each queue (connections on their way to an item).
    woken_per_queue: HashMap<Key, usize>,
    /// Bytes of keys in each connection's `queue_woken` entries, held under
    /// [`MAX_QUEUE_WAKE_BYTES_PER_CONN`].
    woken_bytes: HashMap<ConnId, usize>,
    /// The most the keys of one connection's pending WAITs may take (see
    /// [`StoreState::with_limits`]).
    max_wait_bytes_per_conn: usize,
    next_seq: u64,
}

/// Most queue wake-ups one connection is remembered for (see `StoreState::queue_woken`).
const MAX_QUEUE_WAKES_PER_CONN: usize = 1024;

/// Most bytes of queue names one connection's remembered wake-ups hold (the oldest dropped
/// past it): they are held after the waits themselves, whose charge is released.
const MAX_QUEUE_WAKE_BYTES_PER_CONN: usize = 256 << 10;

/// The least memory the keys of one connection's pending WAITs may take: a WAIT names up to
/// 128 Ki keys in a 64 MiB request, and each missing key is kept twice over (the wait's list and
/// the key's waiter set), so without a cap 1024 pending WAITs could hold tens of GiB. The cap is
/// this or what one WAIT of the most keys and bytes the limits allow costs, whichever is more.
pub const MAX_WAIT_BYTES_PER_CONN: usize = 16 << 20;

/// What the bookkeeping of a WAIT on `keys` costs: each key twice and about a hundred bytes of
/// map and set entries.
fn wait_cost(keys: &[Key]) -> usize {
    keys.iter().map(|k| 2 * k.len() + 96).sum()
}

impl StoreState {
    /// An empty keyspace holding at most `max_total_bytes` of keys and values, with the default
    /// cap on one reply (`TcpStoreLimits::max_request_bytes`).
    pub fn new(max_total_bytes: usize) -> Self {
        StoreState { max_total_bytes, ..Self::with_limits(&TcpStoreLimits::default()) }
    }

    /// An empty keyspace under `limits`: at most `max_total_bytes` held, and no reply (nor
    /// appended value) larger than `max_request_bytes`.
    pub fn with_limits(limits: &TcpStoreLimits) -> Self {
        // One WAIT within the parser's limits always fits a connection's charge: its keys' bytes
        // twice over, and the bookkeeping of as many keys as one request names.
        let one_wait = limits
            .max_request_bytes
            .saturating_mul(2)
            .saturating_add(limits.max_keys_per_request.saturating_mul(96));
        StoreState {
            max_total_bytes: limits.max_total_bytes,
            max_reply_bytes: limits.max_request_bytes,
            max_wait_bytes_per_conn: one_wait.max(MAX_WAIT_BYTES_PER_CONN),
            woken_per_queue: HashMap::new(),
            woken_bytes: HashMap::new(),
            kv: HashMap::new(),
            queues: HashMap::new(),
            n_bytes: 0,
            key_waiters: HashMap::new(),
            barrier_waiters: HashMap::new(),
            waits: HashMap::new(),
            conn_waits: HashMap::new(),
            conn_wait_bytes: HashMap::new(),
            total_wait_bytes: 0,
            queue_woken: HashMap::new(),
            next_seq: 0,
        }
    }

    /// Counts for metrics.
    pub fn stats(&self) -> StoreStats {
        StoreStats { n_keys: self.kv.len(), n_queues: self.queues.len(), n_bytes: self.n_bytes, n_waits: self.waits.len() }
    }

    /// Applies one request of connection `conn`.
    ///
    /// # Errors
    /// The request must close its connection: ADD or BARRIER on a value that is not a 64-bit
    /// integer (or that would overflow), or a write past the keyspace's byte cap. The state is
    /// unchanged by the failing request (a MULTI_SET keeps the pairs before the failing one, as n
    /// SETs would).
    pub fn apply(&mut self, conn: ConnId, req: Request) -> Result<Applied, RdzvError> {
        // A woken connection's next request is its pop, or a look at that queue first (torch's
        // blocking queue_pop WAITs on it, then pops; a client may CHECK or QUEUE_LEN first): any
        // other request means it is not on its way to the item, whose wake-up goes on, once
        // the request succeeded (one that fails closes the connection, which hands it on then).
        let handed = self.not_on_their_way(conn, &req);
        match self.apply_request(conn, req) {
            Ok(mut applied) => {
                self.hand_on(handed, &mut applied.woken);
                Ok(applied)
            }
            Err(e) => {
                for key in handed {
                    self.note_woken(conn, key);
                }
                Err(e)
            }
        }
    }

    /// Takes `conn`'s remembered queue wake-ups that request `req` shows it is not on its way
    /// to (see [`StoreState::apply`]).
    fn not_on_their_way(&mut self, conn: ConnId, req: &Request) -> Vec<Key> {
        let looks_at = |key: &Key| match req {
            Request::QueuePop { key: k } | Request::QueueLen { key: k } => k == key,
            Request::Wait { keys } | Request::Check { keys } => keys.contains(key),
            _ => false,
        };
        let Some(wakes) = self.queue_woken.get(&conn) else { return Vec::new() };
        if wakes.iter().all(looks_at) {
            return Vec::new();
        }
        let (kept, handed): (Vec<Key>, Vec<Key>) = self.take_woken(conn).into_iter().partition(looks_at);
        for key in kept {
            self.note_woken(conn, key);
        }
        handed
    }

    /// Remembers that a push woke `conn` for an item of queue `key`.
    fn note_woken(&mut self, conn: ConnId, key: Key) {
        let bytes = self.woken_bytes.entry(conn).or_default();
        *bytes += key.len();
        *self.woken_per_queue.entry(key.clone()).or_default() += 1;
        let wakes = self.queue_woken.entry(conn).or_default();
        wakes.push_back(key);
        while wakes.len() > MAX_QUEUE_WAKES_PER_CONN || (*bytes > MAX_QUEUE_WAKE_BYTES_PER_CONN && wakes.len() > 1) {
            let Some(old) = wakes.pop_front() else { break };
            *bytes -= old.len();
            uncount(&mut self.woken_per_queue, &old);
        }
    }

    /// Forgets every wake-up remembered for `conn`, returning them.
    fn take_woken(&mut self, conn: ConnId) -> VecDeque<Key> {
        self.woken_bytes.remove(&conn);
        let keys = self.queue_woken.remove(&conn).unwrap_or_default();
        for key in &keys {
            uncount(&mut self.woken_per_queue, key);
        }
        keys
    }

    /// [`StoreState::apply`] without the hand-on of wake-ups.
    fn apply_request(&mut self, conn: ConnId, req: Request) -> Result<Applied, RdzvError> {
        let mut woken = Vec::new();
        let reply = match req {
            Request::Validate { .. } => Reply::None,
            Request::Ping { nonce } => Reply::Bytes(nonce.to_le_bytes().to_vec()),
            Request::Set { key, value } => {
                self.write(key, value, &mut woken)?;
                Reply::None
            }
            Request::CompareSet { key, expected, desired } => {
                let current = match self.kv.get(&key) {
                    None if expected.is_empty() => {
                        self.write(key, desired.clone(), &mut woken)?;
                        desired
                    }
                    // torch answers `expected` for a missing key (tcpstore.md §4.3); clients rely on it.
                    None => expected,
                    Some(cur) if *cur == expected => {
                        self.write(key, desired.clone(), &mut woken)?;
                        desired
                    }
                    Some(cur) => cur.clone(),
                };
                Reply::Bytes(bytes_reply(&current))
            }
            Request::Get { key } => Reply::Bytes(bytes_reply(self.kv.get(&key).map_or(&[][..], |v| v))),
            Request::Add { key, delta } => {
                let old = match self.kv.get(&key) {
                    None => 0,
                    Some(v) => stoll(v).ok_or_else(|| not_a_number(&key, v))?,
                };
                let new = old
                    .checked_add(delta)
                    .ok_or_else(|| not_a_number(&key, format!("{old} + {delta}").as_bytes()))?;
                self.write(key, new.to_string().into_bytes(), &mut woken)?;
                Reply::Bytes(new.to_le_bytes().to_vec())
            }
            Request::Check { keys } => Reply::Bytes(vec![if keys.iter().all(|k| self.present(k)) { READY } else { NOT_READY }]),
            Request::Wait { keys } => self.wait(conn, keys)?,
            Request::GetNumKeys => Reply::Bytes((self.kv.len() as i64).to_le_bytes().to_vec()),
            Request::DeleteKey { key } => {
                let deleted = match self.kv.remove(&key) {
                    Some(v) => {
                        self.n_bytes -= key.len() + v.len();
                        1i64
                    }
                    None => 0,
                };
                Reply::Bytes(deleted.to_le_bytes().to_vec())
            }
            Request::Append { key, value } => {
                match self.kv.get_mut(&key) {
                    // A present key has no waiters (waits register only on missing keys).
                    Some(v) => {
                        let new_len = v.len() + value.len();
                        if new_len > self.max_reply_bytes {
                            return Err(reply_exceeded("appended value size", new_len, self.max_reply_bytes));
                        }
                        let new_total = self.n_bytes + value.len();
                        if new_total > self.max_total_bytes {
                            return Err(total_exceeded(new_total, self.max_total_bytes));
                        }
                        self.n_bytes = new_total;
                        v.extend_from_slice(&value);
                    }
                    None => self.write(key, value, &mut woken)?,
                }
                Reply::None
            }
            Request::MultiGet { keys } => {
                let size: usize = keys.iter().map(|k| 8 + self.kv.get(k).map_or(0, Vec::len)).sum();
                if size > self.max_reply_bytes {
                    return Err(reply_exceeded("MULTI_GET reply size", size, self.max_reply_bytes));
                }
                let mut out = Vec::with_capacity(size);
                for k in &keys {
                    proto::put_bytes(&mut out, self.kv.get(k).map_or(&[][..], |v| v));
                }
                Reply::Bytes(out)
            }
            Request::MultiSet { pairs } => {
                // All or nothing: the store's cap is checked for the whole batch first (its last
                // value of each key). A batch refused half-way had already completed other
                // connections' waits, whose wake-ups the refusal dropped: they hung.
                let mut last: HashMap<&Key, usize> = HashMap::new();
                for (k, v) in &pairs {
                    last.insert(k, v.len());
                }
                let total = last.iter().fold(self.n_bytes, |t, (k, len)| {
                    t - self.kv.get(*k).map_or(0, |v| k.len() + v.len()) + k.len() + len
                });
                self.check_total(total)?;
                for (k, v) in pairs {
                    self.write_within_checked(k, v, &mut woken);
                }
                Reply::None
            }
            Request::CancelWait => {
                let cancelled = self.drop_waits(conn);
                return Ok(Applied { reply: Reply::Bytes(vec![WAIT_CANCELED]), woken, cancelled });
            }
            Request::QueuePush { key, value } => {
                self.push(key, value, &mut woken)?;
                Reply::None
            }
            Request::QueuePop { key } => {
                if let Some(wakes) = self.queue_woken.get_mut(&conn)
                    && let Some(i) = wakes.iter().position(|k| *k == key)
                {
                    wakes.remove(i);
                    if wakes.is_empty() {
                        self.queue_woken.remove(&conn);
                    }
                    if let Some(bytes) = self.woken_bytes.get_mut(&conn) {
                        *bytes -= key.len();
                        if !self.queue_woken.contains_key(&conn) {
                            self.woken_bytes.remove(&conn);
                        }
                    }
                    uncount(&mut self.woken_per_queue, &key);
                }
                let mut out = Vec::new();
                match self.queues.get_mut(&key) {
                    None => proto::put_i64(&mut out, 0),
                    Some(q) => {
                        proto::put_i64(&mut out, q.len() as i64);
                        if let Some(item) = q.pop_front() {
                            self.n_bytes -= item.len();
                            proto::put_bytes(&mut out, &item);
                        }
                        if q.is_empty() {
                            self.queues.remove(&key);
                            self.n_bytes -= key.len();
                        }
                    }
                }
                Reply::Bytes(out)
            }
            Request::QueueLen { key } => Reply::Bytes((self.queues.get(&key).map_or(0, VecDeque::len) as i64).to_le_bytes().to_vec()),
            Request::ListKeys => {
                let size: usize = 8 + self.kv.keys().map(|k| 8 + k.len()).sum::<usize>();
                if size > self.max_reply_bytes {
                    return Err(reply_exceeded("LIST_KEYS reply size", size, self.max_reply_bytes));
                }
                let mut out = Vec::with_capacity(size);
                proto::put_i64(&mut out, self.kv.len() as i64);
                for k in self.kv.keys() {
                    proto::put_bytes(&mut out, k);
                }
                Reply::Bytes(out)
            }
            Request::Barrier { key, world_size } => {
                let count = match self.kv.get(&key) {
                    None => 1,
                    Some(v) => stoll(v)
                        .and_then(|c| c.checked_add(1))
                        .ok_or_else(|| not_a_number(&key, v))?,
                };
                // A wait that will stay pending is charged before the counter moves: a refusal
                // changes nothing.
                let waits = count < world_size;
                if waits {
                    self.charge_wait_bytes(conn, wait_cost(std::slice::from_ref(&key)))?;
                }
                if let Err(e) = self.write(key.clone(), count.to_string().into_bytes(), &mut woken) {
                    if waits {
                        self.release_wait_bytes(conn, std::slice::from_ref(&key));
                    }
                    return Err(e);
                }
                if !waits {
                    if let Some(set) = self.barrier_waiters.remove(&key) {
                        for id in set {
                            self.finish(id);
                            woken.push(id);
                        }
                    }
                    Reply::Bytes(vec![STOP_WAITING])
                } else {
                    let id = self.register(conn, PendingWait::Barrier { key: key.clone() });
                    self.barrier_waiters.entry(key).or_default().insert(id);
                    Reply::Pending(id)
                }
            }
        };
        Ok(Applied { reply, woken, cancelled: Vec::new() })
    }

    /// Forgets a connection that went away: its pending waits are dropped without reply. An item
    /// whose push woke this connection, which never popped it, wakes another waiter of its queue
    /// (returned), instead of waiting in the queue for the next push.
    pub fn disconnect(&mut self, conn: ConnId) -> Vec<WaitId> {
        self.drop_waits(conn);
        let mut woken = Vec::new();
        let keys = self.take_woken(conn);
        self.hand_on(keys, &mut woken);
        woken
    }

    /// Drops `conn`'s pending waits without reply (returned), for a connection whose peer ended
    /// its stream and still has replies to take: the peer can no longer cancel them, the server
    /// has no deadline for them, and torch's servers drop a client's waits when its stream ends
    /// (tcpstore.md §4.2: `clearSocketWaitState`). Queue items it was woken for stay its own
    /// until [`StoreState::disconnect`] (a pop it sent may still be applied).
    pub fn cancel_waits(&mut self, conn: ConnId) -> Vec<WaitId> {
        self.drop_waits(conn)
    }

    /// Wakes another waiter for each queue in `keys` whose wake-up a connection will not use, if
    /// an item is left that no woken connection is on its way to (a client that was not waiting
    /// may have popped it meanwhile).
    fn hand_on(&mut self, keys: impl IntoIterator<Item = Key>, woken: &mut Vec<WaitId>) {
        for key in keys {
            let items = self.queues.get(&key).map_or(0, VecDeque::len);
            let on_their_way = self.woken_per_queue.get(&key).copied().unwrap_or(0);
            if items > on_their_way {
                self.wake_one(&key, woken);
            }
        }
    }

    /// A key counts as present for CHECK and WAIT if it is in the key-value namespace or names a
    /// non-empty queue (as in torch's libuv server).
    fn present(&self, key: &[u8]) -> bool {
        self.kv.contains_key(key) || self.queues.contains_key(key)
    }

    fn wait(&mut self, conn: ConnId, keys: Vec<Key>) -> Result<Reply, RdzvError> {
        let mut seen = HashSet::new();
        let missing: Vec<Key> = keys.into_iter().filter(|k| !self.present(k) && seen.insert(k.clone())).collect();
        if missing.is_empty() {
            return Ok(Reply::Bytes(vec![STOP_WAITING]));
        }
        self.charge_wait_bytes(conn, wait_cost(&missing))?;
        let id = self.register(conn, PendingWait::Keys { remaining: missing.len(), keys: Vec::new() });
        for k in &missing {
            self.key_waiters.entry(k.clone()).or_default().insert(id);
        }
        if let Some(PendingWait::Keys { keys, .. }) = self.waits.get_mut(&id) {
            *keys = missing;
        }
        Ok(Reply::Pending(id))
    }

    /// Counts `cost` more bytes of `conn`'s pending waits, within the connection's cap and the
    /// store's.
    fn charge_wait_bytes(&mut self, conn: ConnId, cost: usize) -> Result<(), RdzvError> {
        let held = self.conn_wait_bytes.get(&conn).copied().unwrap_or(0) + cost;
        if held > self.max_wait_bytes_per_conn {
            return Err(RdzvError::TcpStoreLimit {
                limit: "pending WAIT keys size",
                value: held as u64,
                max: self.max_wait_bytes_per_conn as u64,
            });
        }
        let total = self.total_wait_bytes + cost;
        if total > self.max_total_bytes {
            return Err(RdzvError::TcpStoreLimit {
                limit: "pending WAIT keys size of all connections",
                value: total as u64,
                max: self.max_total_bytes as u64,
            });
        }
        self.conn_wait_bytes.insert(conn, held);
        self.total_wait_bytes = total;
        Ok(())
    }

    /// `conn`'s pending WAITs no longer hold `keys`.
    fn release_wait_bytes(&mut self, conn: ConnId, keys: &[Key]) {
        let cost = wait_cost(keys);
        if let Some(held) = self.conn_wait_bytes.get_mut(&conn) {
            let freed = cost.min(*held);
            *held -= freed;
            self.total_wait_bytes = self.total_wait_bytes.saturating_sub(freed);
            if *held == 0 {
                self.conn_wait_bytes.remove(&conn);
            }
        }
    }

    fn register(&mut self, conn: ConnId, wait: PendingWait) -> WaitId {
        let id = WaitId { seq: self.next_seq, conn };
        self.next_seq += 1;
        self.waits.insert(id, wait);
        self.conn_waits.entry(conn).or_default().insert(id);
        id
    }

    /// Removes a wait that completed (it is in no waiter set any more).
    fn finish(&mut self, id: WaitId) {
        match self.waits.remove(&id) {
            Some(PendingWait::Keys { keys, .. }) => self.release_wait_bytes(id.conn, &keys),
            Some(PendingWait::Barrier { key }) => self.release_wait_bytes(id.conn, std::slice::from_ref(&key)),
            None => {}
        }
        if let Some(set) = self.conn_waits.get_mut(&id.conn) {
            set.remove(&id);
            if set.is_empty() {
                self.conn_waits.remove(&id.conn);
            }
        }
    }

    /// Removes every pending wait of `conn` and returns them.
    fn drop_waits(&mut self, conn: ConnId) -> Vec<WaitId> {
        let Some(ids) = self.conn_waits.remove(&conn) else { return Vec::new() };
        for id in &ids {
            match self.waits.remove(id) {
                Some(PendingWait::Keys { keys, .. }) => {
                    for k in &keys {
                        remove_waiter(&mut self.key_waiters, k, id);
                    }
                    self.release_wait_bytes(conn, &keys);
                }
                Some(PendingWait::Barrier { key }) => {
                    remove_waiter(&mut self.barrier_waiters, &key, id);
                    self.release_wait_bytes(conn, std::slice::from_ref(&key));
                }
                None => {}
            }
        }
        ids.into_iter().collect()
    }

    /// Stores `key = value` and completes the waits that were waiting for `key`.
    fn write(&mut self, key: Key, value: Vec<u8>, woken: &mut Vec<WaitId>) -> Result<(), RdzvError> {
        let old = self.kv.get(&key).map_or(0, |v| key.len() + v.len());
        self.check_total(self.n_bytes - old + key.len() + value.len())?;
        self.write_within_checked(key, value, woken);
        Ok(())
    }

    /// [`StoreState::write`] once the caller checked the store's cap (for a whole batch).
    fn write_within_checked(&mut self, key: Key, value: Vec<u8>, woken: &mut Vec<WaitId>) {
        let old = self.kv.get(&key).map_or(0, |v| key.len() + v.len());
        self.n_bytes = self.n_bytes - old + key.len() + value.len();
        if let Some(set) = self.key_waiters.remove(&key) {
            for id in set {
                self.key_written(id, woken);
            }
        }
        self.kv.insert(key, value);
    }

    /// Appends to queue `key` and completes that part of one wait on `key`: the oldest that this
    /// push completes (a blocked pop waits on the queue alone), else the oldest. One item is one
    /// wake-up: a second waiter woken for it would find the queue empty again.
    fn push(&mut self, key: Key, value: Vec<u8>, woken: &mut Vec<WaitId>) -> Result<(), RdzvError> {
        let new_queue = !self.queues.contains_key(&key);
        let new_total = self.n_bytes + value.len() + if new_queue { key.len() } else { 0 };
        self.check_total(new_total)?;
        self.n_bytes = new_total;
        self.wake_one(&key, woken);
        self.queues.entry(key).or_default().push_back(value);
        Ok(())
    }

    /// Completes that part of one wait on queue `key`: the oldest that it completes, else the
    /// oldest. A wait it completes is remembered for its connection until that one pops.
    fn wake_one(&mut self, key: &Key, woken: &mut Vec<WaitId>) {
        let Some(set) = self.key_waiters.get_mut(key) else { return };
        let waits = &self.waits;
        let completes = set.iter().copied().find(|id| matches!(waits.get(id), Some(PendingWait::Keys { remaining: 1, .. })));
        let chosen = completes.or_else(|| set.first().copied());
        if let Some(id) = chosen {
            set.remove(&id);
        }
        if set.is_empty() {
            self.key_waiters.remove(key);
        }
        if let Some(id) = chosen {
            self.key_written(id, woken);
            if woken.last() == Some(&id) {
                self.note_woken(id.conn(), key.clone());
            }
        }
    }

    /// One of `id`'s keys was written (and `id` already left that key's waiter set).
    fn key_written(&mut self, id: WaitId, woken: &mut Vec<WaitId>) {
        if let Some(PendingWait::Keys { remaining, .. }) = self.waits.get_mut(&id) {
            *remaining -= 1;
            if *remaining == 0 {
                self.finish(id);
                woken.push(id);
            }
        }
    }

    fn check_total(&self, new_total: usize) -> Result<(), RdzvError> {
        if new_total > self.max_total_bytes {
            return Err(total_exceeded(new_total, self.max_total_bytes));
        }
        Ok(())
    }
}

/// A reply (or an appended value) past the store's reply cap: `limit` names the request.
fn reply_exceeded(limit: &'static str, size: usize, max: usize) -> RdzvError {
    RdzvError::TcpStoreLimit { limit, value: size as u64, max: max as u64 }
}

fn total_exceeded(new_total: usize, max: usize) -> RdzvError {
    RdzvError::TcpStoreLimit { limit: "store size", value: new_total as u64, max: max as u64 }
}

/// One count less for `key` (the entry removed at zero).
fn uncount(map: &mut HashMap<Key, usize>, key: &[u8]) {
    if let Some(n) = map.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            map.remove(key);
        }
    }
}

fn remove_waiter(map: &mut HashMap<Key, BTreeSet<WaitId>>, key: &[u8], id: &WaitId) {
    if let Some(set) = map.get_mut(key) {
        set.remove(id);
        if set.is_empty() {
            map.remove(key);
        }
    }
}

fn bytes_reply(v: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + v.len());
    proto::put_bytes(&mut out, v);
    out
}

/// At most this many bytes of a key or value go into an error message.
const SHOWN_BYTES: usize = 64;

fn shown(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(&b[..b.len().min(SHOWN_BYTES)]).into_owned();
    if b.len() > SHOWN_BYTES { format!("{s}...") } else { s }
}

fn not_a_number(key: &[u8], value: &[u8]) -> RdzvError {
    RdzvError::TcpStoreNotANumber { key: shown(key), value: shown(value) }
}

/// C++ `std::stoll(s, nullptr, 10)` on raw bytes: skips leading whitespace, takes an optional sign
/// and at least one digit, ignores whatever follows the digits (`" 12abc"` is 12). `None` where
/// `stoll` throws: no digits, or out of the `i64` range.
pub fn stoll(b: &[u8]) -> Option<i64> {
    let mut i = 0;
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r') {
        i += 1;
    }
    let negative = match b.get(i) {
        Some(b'-') => {
            i += 1;
            true
        }
        Some(b'+') => {
            i += 1;
            false
        }
        _ => false,
    };
    let start = i;
    // Accumulate negatively so that i64::MIN parses.
    let mut v: i64 = 0;
    while let Some(d) = b.get(i).filter(|d| d.is_ascii_digit()) {
        v = v.checked_mul(10)?.checked_sub(i64::from(d - b'0'))?;
        i += 1;
    }
    if i == start {
        return None;
    }
    if negative { Some(v) } else { v.checked_neg() }
}

#[cfg(test)]
mod tests;
