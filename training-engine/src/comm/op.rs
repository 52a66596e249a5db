//! Operation descriptors (the mismatch-detection header) and traffic counters.

use super::dtype::{DType, ReduceOp};

/// The kinds of operation a process group performs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum OpKind {
    AllReduce = 1,
    Broadcast = 2,
    Reduce = 3,
    AllGather = 4,
    ReduceScatter = 5,
    Barrier = 6,
    Send = 7,
    Recv = 8,
}

impl OpKind {
    /// Every kind, in counter order.
    pub const ALL: [OpKind; 8] = [
        OpKind::AllReduce,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::Barrier,
        OpKind::Send,
        OpKind::Recv,
    ];

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Barrier => "barrier",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
        }
    }

    fn index(self) -> usize {
        self as usize - 1
    }

    fn from_u8(v: u8) -> Option<OpKind> {
        OpKind::ALL.get((v as usize).wrapping_sub(1)).copied()
    }
}

/// What every rank must agree on for one collective. Exchanged (or compared through shared
/// memory) at the start of each collective; any difference is a [`CommError::Mismatch`].
///
/// [`CommError::Mismatch`]: super::CommError::Mismatch
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpHeader {
    /// Collective sequence number within the group (p2p ops use 0).
    pub(crate) seq: u64,
    pub(crate) kind: OpKind,
    pub(crate) dtype: DType,
    /// Reduce op, or 0.
    pub(crate) redop: u8,
    /// Root rank (group rank) for rooted ops, else 0.
    pub(crate) root: u32,
    /// Element count of the op's "full" buffer (all_reduce: len; all_gather: output;
    /// reduce_scatter: input; broadcast/reduce: len).
    pub(crate) count: u64,
}

pub(crate) const HEADER_BYTES: usize = 24;

impl OpHeader {
    pub(crate) fn new(
        kind: OpKind,
        dtype: DType,
        redop: Option<ReduceOp>,
        root: usize,
        count: usize,
    ) -> Self {
        OpHeader {
            seq: 0,
            kind,
            dtype,
            redop: redop.map_or(0, |r| r as u8),
            root: root as u32,
            count: count as u64,
        }
    }

    pub(crate) fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8] = self.kind as u8;
        b[9] = self.dtype as u8;
        b[10] = self.redop;
        b[12..16].copy_from_slice(&self.root.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < HEADER_BYTES {
            return None;
        }
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let mut r = [0u8; 4];
        r.copy_from_slice(&b[12..16]);
        Some(OpHeader {
            seq: u64_at(0),
            kind: OpKind::from_u8(b[8])?,
            dtype: DType::from_u8(b[9])?,
            redop: b[10],
            root: u32::from_le_bytes(r),
            count: u64_at(16),
        })
    }

    /// Packs into two words for the shared-memory control block.
    pub(crate) fn to_words(self) -> [u64; 3] {
        let e = self.encode();
        let w = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&e[i..i + 8]);
            u64::from_le_bytes(a)
        };
        [w(0), w(8), w(16)]
    }

    pub(crate) fn from_words(w: [u64; 3]) -> Option<Self> {
        let mut b = [0u8; HEADER_BYTES];
        for (i, x) in w.iter().enumerate() {
            b[i * 8..i * 8 + 8].copy_from_slice(&x.to_le_bytes());
        }
        Self::decode(&b)
    }

    /// Human-readable form for mismatch errors.
    pub(crate) fn describe(&self) -> String {
        let mut s = format!(
            "{}#{}(dtype={}, count={}",
            self.kind.name(),
            self.seq,
            self.dtype.name(),
            self.count
        );
        if let Some(op) = ReduceOp::from_u8(self.redop) {
            s.push_str(&format!(", op={}", op.name()));
        }
        if matches!(self.kind, OpKind::Broadcast | OpKind::Reduce) {
            s.push_str(&format!(", root={}", self.root));
        }
        s.push(')');
        s
    }
}

/// Counters for one kind of operation on one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpStats {
    /// Completed calls.
    pub calls: u64,
    /// Payload bytes this rank sent (TCP) or published in shared memory for peers to read,
    /// counted once per reading peer. Protocol headers are not counted.
    pub bytes_sent: u64,
    /// Payload bytes this rank received (TCP) or read from peers' shared memory.
    pub bytes_recv: u64,
    /// Calls that ran zero-copy on registered buffers
    /// ([`ProcessGroup::alloc_shared`](super::ProcessGroup::alloc_shared)).
    pub zero_copy: u64,
}

/// Per-op traffic counters of a process group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    ops: [OpStats; 8],
}

impl CommStats {
    /// The counters of one op kind.
    pub fn op(&self, kind: OpKind) -> OpStats {
        self.ops[kind.index()]
    }

    /// Sum over all op kinds.
    pub fn total(&self) -> OpStats {
        let mut t = OpStats::default();
        for o in &self.ops {
            t.calls += o.calls;
            t.bytes_sent += o.bytes_sent;
            t.bytes_recv += o.bytes_recv;
            t.zero_copy += o.zero_copy;
        }
        t
    }

    pub(crate) fn record(&mut self, kind: OpKind, traffic: Traffic) {
        let o = &mut self.ops[kind.index()];
        o.calls += 1;
        o.bytes_sent += traffic.sent;
        o.bytes_recv += traffic.recv;
        o.zero_copy += u64::from(traffic.zero_copy);
    }
}

/// Bytes moved by one operation (filled in by the backend).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Traffic {
    pub(crate) sent: u64,
    pub(crate) recv: u64,
    /// The op ran zero-copy on registered buffers.
    pub(crate) zero_copy: bool,
}

/// Splits `n` elements into `parts` contiguous blocks; block `i` is `[n*i/parts, n*(i+1)/parts)`.
pub(crate) fn block_range(n: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let start = (n as u128 * i as u128 / parts as u128) as usize;
    let end = (n as u128 * (i as u128 + 1) / parts as u128) as usize;
    start..end
}
