//! The TCPStore wire format (torch ≥ 2.2, numbered as in 2.12 – 2.15): an incremental request
//! parser and the encoders for requests and replies.
//!
//! A request is `u8 command` followed by its fields. Integers are native-endian, which is
//! little-endian on every platform torch ships; strings and values are `u64 length ‖ bytes`. There
//! is no request id and no length header, so the parser follows each command's layout field by
//! field. It keeps its progress between calls: bytes may arrive one at a time, several requests may
//! arrive in one read, and nothing is re-parsed.

use crate::RdzvError;

/// VALIDATE's magic number (`0x3C85F7CE`, bytes `ce f7 85 3c` on the wire).
pub const VALIDATE_MAGIC: u32 = 0x3C85_F7CE;
/// WAIT / BARRIER reply: the wait is over (`WaitResponseType::STOP_WAITING`).
pub const STOP_WAITING: u8 = 0;
/// CANCEL_WAIT reply (`WaitResponseType::WAIT_CANCELED`).
pub const WAIT_CANCELED: u8 = 1;
/// CHECK reply: every key exists (`CheckResponseType::READY`).
pub const READY: u8 = 0;
/// CHECK reply: some key is missing (`CheckResponseType::NOT_READY`).
pub const NOT_READY: u8 = 1;

/// The command byte (`QueryType`), 2.15 numbering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Command {
    /// `u32 magic`; no reply; must open every connection.
    Validate = 0,
    /// `str key, bytes value`; no reply.
    Set = 1,
    /// `str key, bytes expected, bytes desired` → `bytes`.
    CompareSet = 2,
    /// `str key` → `bytes` (empty when missing).
    Get = 3,
    /// `str key, i64 delta` → `i64`.
    Add = 4,
    /// `u64 n, n × str` → `u8` READY / NOT_READY.
    Check = 5,
    /// `u64 n, n × str` → `u8` STOP_WAITING, now or later.
    Wait = 6,
    /// → `i64`.
    GetNumKeys = 7,
    /// `str key` → `i64` 0 / 1.
    DeleteKey = 8,
    /// `str key, bytes data`; no reply.
    Append = 9,
    /// `u64 n, n × str` → `n × bytes`.
    MultiGet = 10,
    /// `u64 n, n × (str, bytes)`; no reply.
    MultiSet = 11,
    /// → `u8` WAIT_CANCELED, always.
    CancelWait = 12,
    /// `u32 nonce` → the same `u32`.
    Ping = 13,
    /// `str key, bytes value`; no reply.
    QueuePush = 14,
    /// `str key` → `i64 len_before` and, when it is positive, `bytes`.
    QueuePop = 15,
    /// `str key` → `i64`.
    QueueLen = 16,
    /// → `i64 n, n × str`.
    ListKeys = 17,
    /// `str key, i64 world_size` → `u8` STOP_WAITING, now or later.
    Barrier = 18,
}

impl Command {
    /// The command for a wire byte, or `None` for an unknown one.
    pub fn from_u8(b: u8) -> Option<Command> {
        use Command::*;
        Some(match b {
            0 => Validate,
            1 => Set,
            2 => CompareSet,
            3 => Get,
            4 => Add,
            5 => Check,
            6 => Wait,
            7 => GetNumKeys,
            8 => DeleteKey,
            9 => Append,
            10 => MultiGet,
            11 => MultiSet,
            12 => CancelWait,
            13 => Ping,
            14 => QueuePush,
            15 => QueuePop,
            16 => QueueLen,
            17 => ListKeys,
            18 => Barrier,
            _ => return None,
        })
    }
}

/// One decoded request. Keys and values are raw bytes: the protocol checks no encoding, and torch's
/// client prepends `/` to user keys (except its `init/` counter), so keys here carry that prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)] // The fields are named after the protocol's; see [`Command`].
pub enum Request {
    Validate { magic: u32 },
    Set { key: Vec<u8>, value: Vec<u8> },
    CompareSet { key: Vec<u8>, expected: Vec<u8>, desired: Vec<u8> },
    Get { key: Vec<u8> },
    Add { key: Vec<u8>, delta: i64 },
    Check { keys: Vec<Vec<u8>> },
    Wait { keys: Vec<Vec<u8>> },
    GetNumKeys,
    DeleteKey { key: Vec<u8> },
    Append { key: Vec<u8>, value: Vec<u8> },
    MultiGet { keys: Vec<Vec<u8>> },
    MultiSet { pairs: Vec<(Vec<u8>, Vec<u8>)> },
    CancelWait,
    Ping { nonce: u32 },
    QueuePush { key: Vec<u8>, value: Vec<u8> },
    QueuePop { key: Vec<u8> },
    QueueLen { key: Vec<u8> },
    ListKeys,
    Barrier { key: Vec<u8>, world_size: i64 },
}

impl Request {
    /// Key and value bytes the request holds (what it costs while it waits to be applied).
    pub fn payload_bytes(&self) -> usize {
        let keys = |k: &[Vec<u8>]| k.iter().map(Vec::len).sum::<usize>();
        match self {
            Request::Validate { .. } | Request::GetNumKeys | Request::CancelWait | Request::Ping { .. } | Request::ListKeys => 0,
            Request::Set { key, value } | Request::Append { key, value } | Request::QueuePush { key, value } => key.len() + value.len(),
            Request::CompareSet { key, expected, desired } => key.len() + expected.len() + desired.len(),
            Request::Get { key }
            | Request::Add { key, .. }
            | Request::DeleteKey { key }
            | Request::QueuePop { key }
            | Request::QueueLen { key }
            | Request::Barrier { key, .. } => key.len(),
            Request::Check { keys: k } | Request::Wait { keys: k } | Request::MultiGet { keys: k } => keys(k),
            Request::MultiSet { pairs } => pairs.iter().map(|(k, v)| k.len() + v.len()).sum(),
        }
    }

    /// The request's command byte.
    pub fn command(&self) -> Command {
        match self {
            Request::Validate { .. } => Command::Validate,
            Request::Set { .. } => Command::Set,
            Request::CompareSet { .. } => Command::CompareSet,
            Request::Get { .. } => Command::Get,
            Request::Add { .. } => Command::Add,
            Request::Check { .. } => Command::Check,
            Request::Wait { .. } => Command::Wait,
            Request::GetNumKeys => Command::GetNumKeys,
            Request::DeleteKey { .. } => Command::DeleteKey,
            Request::Append { .. } => Command::Append,
            Request::MultiGet { .. } => Command::MultiGet,
            Request::MultiSet { .. } => Command::MultiSet,
            Request::CancelWait => Command::CancelWait,
            Request::Ping { .. } => Command::Ping,
            Request::QueuePush { .. } => Command::QueuePush,
            Request::QueuePop { .. } => Command::QueuePop,
            Request::QueueLen { .. } => Command::QueueLen,
            Request::ListKeys => Command::ListKeys,
            Request::Barrier { .. } => Command::Barrier,
        }
    }

    /// Appends the request's wire bytes to `out` (what torch's client sends).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.command() as u8);
        let keys = |out: &mut Vec<u8>, keys: &[Vec<u8>]| {
            put_u64(out, keys.len() as u64);
            for k in keys {
                put_bytes(out, k);
            }
        };
        match self {
            Request::Validate { magic: n } | Request::Ping { nonce: n } => put_u32(out, *n),
            Request::Set { key, value } | Request::Append { key, value } | Request::QueuePush { key, value } => {
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::CompareSet { key, expected, desired } => {
                put_bytes(out, key);
                put_bytes(out, expected);
                put_bytes(out, desired);
            }
            Request::Get { key } | Request::DeleteKey { key } | Request::QueuePop { key } | Request::QueueLen { key } => {
                put_bytes(out, key)
            }
            Request::Add { key, delta: n } | Request::Barrier { key, world_size: n } => {
                put_bytes(out, key);
                put_i64(out, *n);
            }
            Request::Check { keys: k } | Request::Wait { keys: k } | Request::MultiGet { keys: k } => keys(out, k),
            Request::MultiSet { pairs } => {
                put_u64(out, pairs.len() as u64);
                for (k, v) in pairs {
                    put_bytes(out, k);
                    put_bytes(out, v);
                }
            }
            Request::GetNumKeys | Request::CancelWait | Request::ListKeys => {}
        }
    }
}

/// Appends a native-endian `u32`.
pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a native-endian `u64` (lengths and counts).
pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a native-endian `i64` (ADD results, counts in replies).
pub fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends `u64 len ‖ bytes` (a key or a value).
pub fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_u64(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// The parser's caps. Going over any of them is a protocol violation: the server closes the
/// connection (torch's libuv server does the same for keys over 8 KiB and values over 8 MiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseLimits {
    /// Largest key (and queue name), bytes.
    pub max_key_bytes: usize,
    /// Largest value, bytes (SET, APPEND, QUEUE_PUSH, the two values of COMPARE_SET).
    pub max_value_bytes: usize,
    /// Most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET.
    pub max_keys_per_request: usize,
    /// Largest request on the wire, bytes, command byte and headers included.
    pub max_request_bytes: usize,
}

/// What the next field of a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    U32,
    I64,
    /// A `u64` count of keys (or pairs) that follow.
    Count,
    Key,
    Value,
}

#[derive(Debug)]
enum Field {
    Int(u64),
    Blob(Vec<u8>),
}

/// The field after `fields` in a `cmd` request, or `None` when the request is complete.
fn next_kind(cmd: Command, fields: &[Field]) -> Option<Kind> {
    use Command::*;
    let i = fields.len();
    let fixed: &[Kind] = match cmd {
        Validate | Ping => &[Kind::U32],
        Set | Append | QueuePush => &[Kind::Key, Kind::Value],
        CompareSet => &[Kind::Key, Kind::Value, Kind::Value],
        Get | DeleteKey | QueuePop | QueueLen => &[Kind::Key],
        Add | Barrier => &[Kind::Key, Kind::I64],
        GetNumKeys | CancelWait | ListKeys => &[],
        Check | Wait | MultiGet | MultiSet => {
            let n = match fields.first() {
                None => return Some(Kind::Count),
                Some(Field::Int(n)) => *n as usize,
                // Unreachable: field 0 of these commands is always read as a count.
                Some(Field::Blob(_)) => return None,
            };
            let (per, total) = if cmd == MultiSet { (2, 1 + 2 * n) } else { (1, 1 + n) };
            if i >= total {
                return None;
            }
            return Some(if per == 2 && (i - 1) % 2 == 1 { Kind::Value } else { Kind::Key });
        }
    };
    fixed.get(i).copied()
}

/// A request in progress.
#[derive(Debug)]
struct Partial {
    cmd: Command,
    /// The key or value whose body is being read (its header is complete): its length, and the
    /// bytes so far.
    body_len: Option<usize>,
    body: Vec<u8>,
    /// Wire bytes of this request so far, declared bodies included.
    n_bytes: usize,
}

/// The incremental request parser of one connection. The first request must be VALIDATE with the
/// right magic; a connection that opens with any other byte is refused at that byte.
///
/// Its buffers are kept from one request to the next, so a request costs no allocation beyond its
/// keys and values.
#[derive(Debug)]
pub struct RequestParser {
    limits: ParseLimits,
    validated: bool,
    cur: Option<Partial>,
    /// The completed fields of the current request, in wire order.
    fields: Vec<Field>,
    /// Bytes of the integer or length header being read (at most 8).
    scratch: Vec<u8>,
    /// Key and value bytes of the current request received so far (see [`RequestParser::held_bytes`]).
    held: usize,
}

/// Bodies are grown as their bytes arrive, never reserved from the declared length up front, so a
/// peer that announces 8 MiB and sends nothing costs nothing.
const MAX_RESERVE: usize = 64 << 10;

impl RequestParser {
    /// A parser for a new connection (expects VALIDATE first).
    pub fn new(limits: ParseLimits) -> Self {
        RequestParser { limits, validated: false, cur: None, fields: Vec::new(), scratch: Vec::with_capacity(8), held: 0 }
    }

    /// Key and value bytes of the request being read that arrived so far, and the parsed fields'
    /// own size: what a partly sent request costs the server (a declared length costs nothing
    /// until its bytes come).
    pub fn held_bytes(&self) -> usize {
        self.held
    }

    /// True while a request is partly read.
    pub fn is_mid_request(&self) -> bool {
        self.cur.is_some()
    }

    /// Whether the handshake (VALIDATE) has arrived.
    pub fn is_validated(&self) -> bool {
        self.validated
    }

    /// Consumes all of `input` and appends every request it completes to `out`, in order.
    ///
    /// # Errors
    /// A protocol violation ([`RdzvError::TcpStoreProtocol`]) or a cap
    /// ([`RdzvError::TcpStoreLimit`]). The requests completed before the bad byte are in `out`; the
    /// parser must not be used again (the connection is to be closed).
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<Request>) -> Result<(), RdzvError> {
        loop {
            let Some(p) = self.cur.as_mut() else {
                let Some((&b, rest)) = input.split_first() else { return Ok(()) };
                input = rest;
                let cmd = Command::from_u8(b).ok_or_else(|| RdzvError::TcpStoreProtocol(format!("unknown command {b:#04x}")))?;
                if !self.validated && cmd != Command::Validate {
                    return Err(RdzvError::TcpStoreProtocol(format!(
                        "first byte {b:#04x} is not VALIDATE (0x00): not a torch >= 2.2 client"
                    )));
                }
                self.fields.clear();
                self.scratch.clear();
                self.cur = Some(Partial { cmd, body_len: None, body: Vec::new(), n_bytes: 1 });
                continue;
            };
            let Some(kind) = next_kind(p.cmd, &self.fields) else {
                let cmd = p.cmd;
                self.cur = None;
                self.held = 0;
                let req = build(cmd, &mut self.fields)?;
                // A request of many keys leaves a long field list: its capacity is not kept for
                // the connection's lifetime.
                if self.fields.capacity() > 1024 {
                    self.fields = Vec::new();
                }
                if let Request::Validate { magic } = req {
                    if magic != VALIDATE_MAGIC {
                        return Err(RdzvError::TcpStoreProtocol(format!(
                            "VALIDATE magic {magic:#010x}, expected {VALIDATE_MAGIC:#010x}"
                        )));
                    }
                    self.validated = true;
                }
                out.push(req);
                continue;
            };
            if let (Kind::Key | Kind::Value, Some(len)) = (kind, p.body_len) {
                let take = (len - p.body.len()).min(input.len());
                p.body.extend_from_slice(&input[..take]);
                self.held += take;
                input = &input[take..];
                if p.body.len() < len {
                    return Ok(());
                }
                self.fields.push(Field::Blob(std::mem::take(&mut p.body)));
                // A field costs more than its bytes: count the list's entry too.
                self.held += std::mem::size_of::<Field>();
                p.body_len = None;
                continue;
            }
            let want = if kind == Kind::U32 { 4 } else { 8 };
            let take = (want - self.scratch.len()).min(input.len());
            self.scratch.extend_from_slice(&input[..take]);
            input = &input[take..];
            if self.scratch.len() < want {
                return Ok(());
            }
            match kind {
                Kind::Key | Kind::Value => {
                    let len = le_u64(&self.scratch);
                    self.scratch.clear();
                    let (limit, max) = if kind == Kind::Key {
                        ("key size", self.limits.max_key_bytes)
                    } else {
                        ("value size", self.limits.max_value_bytes)
                    };
                    if len > max as u64 {
                        return Err(RdzvError::TcpStoreLimit { limit, value: len, max: max as u64 });
                    }
                    // Invariant: len <= max, a usize.
                    let len = len as usize;
                    p.n_bytes += 8 + len;
                    check_request_size(p.n_bytes, &self.limits)?;
                    p.body = Vec::with_capacity(len.min(MAX_RESERVE));
                    p.body_len = Some(len);
                }
                Kind::U32 => {
                    let v = u32::from_le_bytes([self.scratch[0], self.scratch[1], self.scratch[2], self.scratch[3]]);
                    self.scratch.clear();
                    p.n_bytes += 4;
                    self.fields.push(Field::Int(u64::from(v)));
                    self.held += std::mem::size_of::<Field>();
                }
                Kind::I64 | Kind::Count => {
                    let v = le_u64(&self.scratch);
                    self.scratch.clear();
                    p.n_bytes += 8;
                    if kind == Kind::Count && v > self.limits.max_keys_per_request as u64 {
                        return Err(RdzvError::TcpStoreLimit {
                            limit: "keys per request",
                            value: v,
                            max: self.limits.max_keys_per_request as u64,
                        });
                    }
                    check_request_size(p.n_bytes, &self.limits)?;
                    self.fields.push(Field::Int(v));
                    self.held += std::mem::size_of::<Field>();
                }
            }
        }
    }
}

fn check_request_size(n_bytes: usize, limits: &ParseLimits) -> Result<(), RdzvError> {
    if n_bytes > limits.max_request_bytes {
        return Err(RdzvError::TcpStoreLimit {
            limit: "request size",
            value: n_bytes as u64,
            max: limits.max_request_bytes as u64,
        });
    }
    Ok(())
}

/// Reads 8 little-endian bytes; `b` holds exactly 8 (the caller read that many).
fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// The fields of a complete request, taken in wire order.
struct Fields<'a>(std::vec::Drain<'a, Field>);

impl Fields<'_> {
    fn blob(&mut self) -> Option<Vec<u8>> {
        match self.0.next()? {
            Field::Blob(b) => Some(b),
            Field::Int(_) => None,
        }
    }

    fn int(&mut self) -> Option<u64> {
        match self.0.next()? {
            Field::Int(v) => Some(v),
            Field::Blob(_) => None,
        }
    }

    fn keys(&mut self) -> Option<Vec<Vec<u8>>> {
        let n = self.int()?;
        (0..n).map(|_| self.blob()).collect()
    }
}

/// Turns a complete request's fields into a [`Request`] (emptying `fields`).
fn build(cmd: Command, fields: &mut Vec<Field>) -> Result<Request, RdzvError> {
    let mut f = Fields(fields.drain(..));
    use Command::*;
    let req = (|| {
        Some(match cmd {
            // The u32 fields were widened from 4 bytes, so these casts are exact.
            Validate => Request::Validate { magic: f.int()? as u32 },
            Ping => Request::Ping { nonce: f.int()? as u32 },
            Set => Request::Set { key: f.blob()?, value: f.blob()? },
            Append => Request::Append { key: f.blob()?, value: f.blob()? },
            QueuePush => Request::QueuePush { key: f.blob()?, value: f.blob()? },
            CompareSet => Request::CompareSet { key: f.blob()?, expected: f.blob()?, desired: f.blob()? },
            Get => Request::Get { key: f.blob()? },
            DeleteKey => Request::DeleteKey { key: f.blob()? },
            QueuePop => Request::QueuePop { key: f.blob()? },
            QueueLen => Request::QueueLen { key: f.blob()? },
            Add => Request::Add { key: f.blob()?, delta: f.int()? as i64 },
            Barrier => Request::Barrier { key: f.blob()?, world_size: f.int()? as i64 },
            Check => Request::Check { keys: f.keys()? },
            Wait => Request::Wait { keys: f.keys()? },
            MultiGet => Request::MultiGet { keys: f.keys()? },
            MultiSet => {
                let n = f.int()?;
                Request::MultiSet { pairs: (0..n).map(|_| Some((f.blob()?, f.blob()?))).collect::<Option<_>>()? }
            }
            GetNumKeys => Request::GetNumKeys,
            CancelWait => Request::CancelWait,
            ListKeys => Request::ListKeys,
        })
    })();
    // `next_kind` decided the layout, so a mismatch would be a parser bug: reported, not panicked.
    req.ok_or_else(|| RdzvError::TcpStoreProtocol(format!("internal parser error on command {cmd:?}")))
}

#[cfg(test)]
mod tests;
