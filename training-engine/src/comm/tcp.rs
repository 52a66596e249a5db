//! TCP backend: segmented, pipelined ring for large messages (between two ranks, all_reduce as
//! one pipelined exchange: [`PairAllReduce`]), Bruck all-gather + rank-order fold for small
//! ones, direct (all-to-all) reduce-scatter in deterministic mode.

use std::ops::Range;
use std::time::Instant;

use super::dtype::{AlignedBuf, DType, ReduceOp, divide, fold_bytes_to, fold_into, fold_into_avg, fold_many, premultiplies_avg};
use super::error::{CommError, Result};
use super::mesh::{Duplex, Mesh, RecvOp, SendOp};
use super::op::{HEADER_BYTES, OpHeader, OpKind, Traffic, block_range};
use super::{Backend, Ctx};

/// How many reduce-scatter segments a rank sends ahead of its first all-gather segment in
/// [`PairAllReduce`]. Any lead ≥ 1 cannot deadlock; a longer one lets a folded segment go cold
/// before it is sent back, a shorter one stalls the sender when the peer's data is late.
const PAIR_LEAD: usize = 4;

/// One piece of a [`PairAllReduce`] stream: segment `j` of the reduce-scatter (the receiver's
/// block, to be folded there) or of the all-gather (the sender's folded block).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Piece {
    Rs(usize),
    Ag(usize),
}

/// The order of the pieces a rank sends: `rs` reduce-scatter segments and `ag` all-gather
/// segments, all-gather segment `j` only after reduce-scatter segment `min(j + lead, rs) - 1`.
/// The peer receives exactly this order, so both sides agree on the stream without headers.
/// All-gather segment `j` waits on the peer's reduce-scatter segment `j`, which the peer sends
/// before its own all-gather segment `j + 1 - lead`; with `lead ≥ 1` the waits never form a cycle.
/// A cursor over the order (O(1) state however many segments there are).
#[derive(Clone, Copy, Debug)]
struct PairOrder {
    rs: usize,
    ag: usize,
    lead: usize,
    /// Reduce-scatter and all-gather pieces passed so far.
    i: usize,
    j: usize,
}

impl PairOrder {
    fn new(rs: usize, ag: usize, lead: usize) -> Self {
        PairOrder {
            rs,
            ag,
            lead,
            i: 0,
            j: 0,
        }
    }

    /// The piece at the cursor; `None` at the end.
    fn current(&self) -> Option<Piece> {
        if self.i < self.rs && (self.i < self.j + self.lead || self.j == self.ag) {
            Some(Piece::Rs(self.i))
        } else if self.j < self.ag {
            Some(Piece::Ag(self.j))
        } else {
            None
        }
    }

    fn advance(&mut self) {
        match self.current() {
            Some(Piece::Rs(_)) => self.i += 1,
            Some(Piece::Ag(_)) => self.j += 1,
            None => {}
        }
    }
}

/// Two-rank all_reduce as one pipelined exchange. Rank r owns block r (`own`) and its peer the
/// other (`other`). Each rank streams its copy of the other block to the peer (reduce-scatter),
/// folds the peer's copy of its own block in segment by segment as it arrives (through a slot
/// that stays in cache), and sends each folded segment straight back (all-gather) while it is
/// still in cache, instead of re-reading the whole block from memory after a phase barrier.
/// The received all-gather segments land in `other` in place: a peer only sends all-gather
/// segment `j` after it has received all of our reduce-scatter segment `j`, so those bytes have
/// left `other` by then. Results are bit-identical to the two-phase ring (`a ⊕ b` folded once,
/// on the block's owner).
struct PairAllReduce<'a> {
    buf: &'a mut [u8],
    own: Range<usize>,
    other: Range<usize>,
    seg: usize,
    dt: DType,
    op: ReduceOp,
    slot: &'a mut [u8],
    out: PairOrder,
    inn: PairOrder,
    out_done: usize,
    in_done: usize,
    /// Segments of `own` folded (they are folded in order).
    folded: usize,
}

impl PairAllReduce<'_> {
    fn seg_of(&self, block: &Range<usize>, j: usize) -> Range<usize> {
        let start = block.start + j * self.seg;
        start..start.saturating_add(self.seg).min(block.end)
    }

    /// The bytes of `buf` a piece travelling in the given direction covers.
    fn range(&self, p: Piece, outgoing: bool) -> Range<usize> {
        match (p, outgoing) {
            // We send our copy of the other block, and the peer's folded other block comes back.
            (Piece::Rs(j), true) | (Piece::Ag(j), false) => self.seg_of(&self.other, j),
            // We send our folded block, and the peer's copy of it arrives (into the slot).
            (Piece::Ag(j), true) | (Piece::Rs(j), false) => self.seg_of(&self.own, j),
        }
    }
}

impl Duplex for PairAllReduce<'_> {
    fn outgoing(&self) -> Option<&[u8]> {
        let p = self.out.current()?;
        if let Piece::Ag(j) = p
            && j >= self.folded
        {
            return None;
        }
        let r = self.range(p, true);
        Some(&self.buf[r.start + self.out_done..r.end])
    }

    fn sent(&mut self, n: usize) {
        self.out_done += n;
        if let Some(p) = self.out.current()
            && self.out_done >= self.range(p, true).len()
        {
            self.out.advance();
            self.out_done = 0;
        }
    }

    fn incoming(&mut self) -> Option<&mut [u8]> {
        let p = self.inn.current()?;
        let r = self.range(p, false);
        Some(match p {
            Piece::Rs(_) => &mut self.slot[self.in_done..r.len()],
            Piece::Ag(_) => &mut self.buf[r.start + self.in_done..r.end],
        })
    }

    fn received(&mut self, n: usize) -> Result<()> {
        self.in_done += n;
        let Some(p) = self.inn.current() else {
            return Ok(());
        };
        let r = self.range(p, false);
        if self.in_done < r.len() {
            return Ok(());
        }
        if let Piece::Rs(_) = p {
            let acc = &mut self.buf[r.clone()];
            fold_into_avg(self.dt, self.op, acc, &self.slot[..r.len()], 2)?;
            self.folded += 1;
        }
        self.inn.advance();
        self.in_done = 0;
        Ok(())
    }

    fn finished(&self) -> bool {
        self.out.current().is_none() && self.inn.current().is_none()
    }
}

pub(crate) struct TcpBackend {
    mesh: Mesh,
    scratch: AlignedBuf,
    work: AlignedBuf,
    /// The pipelining segment of the current op: the smallest `tcp_segment_bytes` of all
    /// ranks, settled by the op's header exchange (each host may default to its own).
    segment: usize,
    /// The running op's deadline (see `Backend::set_op_deadline`).
    op_deadline: Option<Instant>,
    /// Point-to-point messages this rank sent and received so far. Every collective carries them
    /// in its header exchange: a send not received before the collective would leave its bytes
    /// on a socket the collective reads raw data from (see [`TcpBackend::check_p2p`]).
    p2p: P2pCounts,
}

/// Point-to-point messages one rank sent and received.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct P2pCounts {
    sent: u64,
    received: u64,
}

/// Bytes of [`P2pCounts`] after the header in every collective's exchanged blob.
const P2P_BYTES: usize = 16;

impl P2pCounts {
    fn encode(self) -> [u8; P2P_BYTES] {
        let mut b = [0u8; P2P_BYTES];
        b[..8].copy_from_slice(&self.sent.to_le_bytes());
        b[8..].copy_from_slice(&self.received.to_le_bytes());
        b
    }

    /// The counts in `blob` (after its header); `None` when it is too short.
    fn decode(blob: &[u8]) -> Option<Self> {
        let b = blob.get(HEADER_BYTES..HEADER_BYTES + P2P_BYTES)?;
        let word = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[r]);
            u64::from_le_bytes(a)
        };
        Some(P2pCounts { sent: word(0..8), received: word(8..16) })
    }
}

/// Whether every point-to-point message sent before a collective was received before it (the
/// same verdict on every rank: each sees every rank's counts). `Err((rank, its counts, sent in
/// all, received in all))` names the first rank with a send unmatched (or a receive, should the
/// counts disagree the other way).
fn p2p_balance(counts: &[P2pCounts]) -> std::result::Result<(), (usize, P2pCounts, u64, u64)> {
    let sent: u64 = counts.iter().map(|c| c.sent).fold(0, u64::wrapping_add);
    let received: u64 = counts.iter().map(|c| c.received).fold(0, u64::wrapping_add);
    if sent == received {
        return Ok(());
    }
    let j = counts
        .iter()
        .position(|c| if sent > received { c.sent > c.received } else { c.received > c.sent })
        .or_else(|| counts.iter().position(|c| *c != P2pCounts::default()))
        .unwrap_or(0);
    Err((j, counts[j], sent, received))
}

/// The default `tcp_segment_bytes` of a host whose L2 cache per core is `l2` bytes: the largest
/// power of two up to an eighth of it, within 64–256 KiB (256 KiB when unknown). The fold slot
/// and the segments in flight then stay in L2: on an AMD EPYC core (512 KiB of L2) 64 KiB
/// segments ran the two-rank all_reduce of 64 MiB 14 % faster than 256 KiB ones, which suit a
/// Xeon's 2 MiB.
pub(crate) fn segment_for_l2(l2: Option<usize>) -> usize {
    const MIN: usize = 64 << 10;
    const MAX: usize = 256 << 10;
    match l2 {
        Some(b) if b >= 8 => (1usize << (b / 8).ilog2()).clamp(MIN, MAX),
        _ => MAX,
    }
}

/// A sysfs cache size (`512K`, `2048K`, `1M`, or bytes) in bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mul) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 1usize << 10),
        b'M' | b'm' => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mul)
}

/// This host's L2 data cache per core, from sysfs (cpu0's level-2 cache that is not an
/// instruction cache); `None` where sysfs does not say.
fn l2_bytes() -> Option<usize> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    (0..8).find_map(|i| {
        let d = dir.join(format!("index{i}"));
        let read = |f: &str| std::fs::read_to_string(d.join(f)).ok();
        if read("level")?.trim() != "2" || read("type")?.trim() == "Instruction" {
            return None;
        }
        parse_cache_size(&read("size")?)
    })
}

/// The default `tcp_segment_bytes` of this host ([`segment_for_l2`] of its L2 size), read once.
pub(crate) fn default_segment_bytes() -> usize {
    static SEG: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SEG.get_or_init(|| segment_for_l2(l2_bytes()))
}

/// The smallest segment the ranks' header blobs carry after the header (`ours` where a blob
/// carries none), at least one byte.
fn agreed_segment(blobs: &[Vec<u8>], ours: usize) -> usize {
    let at = HEADER_BYTES + P2P_BYTES;
    blobs
        .iter()
        .map(|b| match b.get(at..at + 8) {
            Some(t) => {
                let mut a = [0u8; 8];
                a.copy_from_slice(t);
                usize::try_from(u64::from_le_bytes(a)).unwrap_or(usize::MAX)
            }
            None => ours,
        })
        .min()
        .unwrap_or(ours)
        .max(1)
}

/// Splits `buf` into a shared view of `a` and a mutable view of `b` (disjoint ranges).
fn split_pair(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    debug_assert!(a.end <= b.start || b.end <= a.start);
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

fn bytes(r: Range<usize>, esz: usize) -> Range<usize> {
    r.start * esz..r.end * esz
}

impl TcpBackend {
    /// Connects the group's mesh by `deadline` (the bootstrap's).
    pub(crate) fn new(ctx: &Ctx, deadline: Instant) -> Result<Self> {
        Ok(TcpBackend {
            mesh: Mesh::connect(ctx, deadline)?,
            scratch: AlignedBuf::new(),
            work: AlignedBuf::new(),
            segment: ctx.opts.tcp_segment_bytes.max(1),
            op_deadline: None,
            p2p: P2pCounts::default(),
        })
    }

    fn ctx(&self) -> &Ctx {
        self.mesh.ctx()
    }

    /// The pipelining segment for `dt`: the agreed segment (see [`TcpBackend::segment`])
    /// rounded down to whole elements (at least one), so that each segment folds on its own.
    fn segment_bytes(&self, dt: DType) -> usize {
        (self.segment / dt.size()).max(1) * dt.size()
    }

    /// The running op's deadline (it may be longer than the group's timeout: see
    /// `ProcessGroup::with_op_timeout`), else the group's timeout from now.
    fn deadline(&self) -> Instant {
        self.op_deadline.unwrap_or_else(|| Instant::now() + self.ctx().opts.timeout)
    }

    /// Compares every rank's header with ours; the same verdict is reached on every rank.
    pub(crate) fn check_blobs(&self, h: &OpHeader, blobs: &[Vec<u8>]) -> Result<()> {
        let ctx = self.ctx();
        for (j, b) in blobs.iter().enumerate() {
            let theirs = OpHeader::decode(b);
            if theirs != Some(*h) {
                return Err(CommError::Mismatch {
                    rank: ctx.names[ctx.rank],
                    peer: ctx.names[j],
                    ours: h.describe(),
                    theirs: theirs
                        .map_or_else(|| "an unknown operation".to_string(), |t| t.describe()),
                });
            }
        }
        Ok(())
    }

    /// Checks the point-to-point counts every rank sent with its header (see [`p2p_balance`]).
    fn check_p2p(&self, h: &OpHeader, blobs: &[Vec<u8>]) -> Result<()> {
        let ctx = self.ctx();
        let mut counts = Vec::with_capacity(blobs.len());
        for (j, b) in blobs.iter().enumerate() {
            counts.push(P2pCounts::decode(b).ok_or_else(|| {
                self.mesh.peer_error(j, h.kind.name(), format!("sent a blob of {} bytes, without point-to-point counts", b.len()))
            })?);
        }
        p2p_balance(&counts).map_err(|(j, c, sent, received)| CommError::Mismatch {
            rank: ctx.names[ctx.rank],
            peer: ctx.names[j],
            ours: format!(
                "{} with point-to-point messages unmatched ({sent} sent but {received} received over all ranks; every send must be received before the next collective, as with NCCL)",
                h.describe()
            ),
            theirs: format!("it after {} sends and {} receives", c.sent, c.received),
        })
    }

    /// The largest blob a rank sends in [`Mesh::bruck_allgather`]: a header, point-to-point
    /// counts and a segment size, or a header, the counts and a small all-reduce's data (at most
    /// `tcp_small_bytes`, an agreed option, or fewer elements than ranks).
    fn max_blob(&self) -> usize {
        HEADER_BYTES + P2P_BYTES + 8 + self.ctx().opts.tcp_small_bytes.max(8 * self.mesh.world())
    }

    /// Exchanges the op's header with every rank (checked equal) and, after it, this rank's
    /// `tcp_segment_bytes`: the op runs on the smallest, the same on every rank. The two-rank
    /// exchange derives its stream order from the segment, so ranks that disagreed on it
    /// would misread each other's bytes.
    fn exchange_headers(&mut self, h: &OpHeader, deadline: Instant) -> Result<()> {
        let mut blob = h.encode().to_vec();
        blob.extend_from_slice(&self.p2p.encode());
        blob.extend_from_slice(&(self.ctx().opts.tcp_segment_bytes as u64).to_le_bytes());
        let blobs = self.mesh.bruck_allgather(blob, self.max_blob(), deadline, h.kind.name())?;
        self.check_blobs(h, &blobs)?;
        self.check_p2p(h, &blobs)?;
        self.segment = agreed_segment(&blobs, self.ctx().opts.tcp_segment_bytes);
        Ok(())
    }

    /// Ring reduce-scatter over `buf` split into the byte ranges `blocks(j)`: rank r ends with
    /// the reduction of block r in place (other blocks hold partial sums).
    fn ring_reduce_scatter(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        blocks: &dyn Fn(usize) -> Range<usize>,
        op: ReduceOp,
        deadline: Instant,
        t: &mut Traffic,
    ) -> Result<()> {
        let (r, n) = (self.mesh.rank(), self.mesh.world());
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let dt = h.dtype;
        let seg = self.segment_bytes(dt);
        for s in 0..n - 1 {
            let sb = blocks((r + 2 * n - s - 1) % n);
            let rb = blocks((r + 2 * n - s - 2) % n);
            let (send, acc) = split_pair(buf, sb, rb.clone());
            // The peer's block arrives one segment at a time through a cache-resident slot
            // and is folded into `acc` as each segment completes.
            let total = rb.len();
            let slot = self.scratch.get(seg.min(total));
            let mut sends = [SendOp::new(next, send)];
            let mut recvs = [RecvOp::ring(prev, slot, total)];
            self.mesh.run(
                &mut sends,
                &mut recvs,
                seg,
                // Between two ranks this one fold is the whole reduction: an average is taken
                // in it (summed in f32 for 16-bit floats, rounded once), as the pair all_reduce
                // and the shared-memory backend take it.
                &mut |_, range, data| {
                    if n == 2 {
                        fold_into_avg(dt, op, &mut acc[range], data, 2)
                    } else {
                        fold_into(dt, op, &mut acc[range], data)
                    }
                },
                deadline,
                h.kind.name(),
                t,
            )?;
        }
        Ok(())
    }

    /// Two-rank all_reduce through [`PairAllReduce`]: this rank owns the byte range `own` of
    /// `buf`, its peer `other`.
    fn pair_all_reduce(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        (own, other): (Range<usize>, Range<usize>),
        op: ReduceOp,
        deadline: Instant,
        t: &mut Traffic,
    ) -> Result<()> {
        let peer = 1 - self.mesh.rank();
        let seg = self.segment_bytes(h.dtype);
        let (m_own, m_other) = (own.len().div_ceil(seg), other.len().div_ceil(seg));
        let slot = self.scratch.get(seg.min(own.len()));
        let mut x = PairAllReduce {
            buf,
            own,
            other,
            seg,
            dt: h.dtype,
            op,
            slot,
            // We send reduce-scatter segments of the other block and all-gather segments of
            // ours; the peer the reverse, and that is the order we receive in.
            out: PairOrder::new(m_other, m_own, PAIR_LEAD),
            inn: PairOrder::new(m_own, m_other, PAIR_LEAD),
            out_done: 0,
            in_done: 0,
            folded: 0,
        };
        self.mesh.duplex(peer, &mut x, deadline, h.kind.name(), t)
    }

    /// Ring all-gather: rank r holds block r of `buf`; afterwards every block is filled.
    fn ring_all_gather(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        blocks: &dyn Fn(usize) -> Range<usize>,
        deadline: Instant,
        t: &mut Traffic,
    ) -> Result<()> {
        let (r, n) = (self.mesh.rank(), self.mesh.world());
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        for s in 0..n - 1 {
            let sb = blocks((r + n - s) % n);
            let rb = blocks((r + 2 * n - s - 1) % n);
            let (send, recv) = split_pair(buf, sb, rb);
            let mut sends = [SendOp::new(next, send)];
            let mut recvs = [RecvOp::new(prev, recv)];
            self.mesh
                .run_plain(&mut sends, &mut recvs, deadline, h.kind.name(), t)?;
        }
        Ok(())
    }

    /// Direct reduce-scatter: every rank sends block j of `input` to rank j and folds the N
    /// contributions to its own block in rank order 0..N-1 into `out` (deterministic).
    #[allow(clippy::too_many_arguments)]
    fn direct_reduce_scatter(
        &mut self,
        h: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        blocks: &dyn Fn(usize) -> Range<usize>,
        op: ReduceOp,
        deadline: Instant,
        t: &mut Traffic,
    ) -> Result<()> {
        let (r, n) = (self.mesh.rank(), self.mesh.world());
        let mine = blocks(r);
        let len = mine.len();
        let scratch = self.scratch.get(len * n);
        scratch[r * len..(r + 1) * len].copy_from_slice(&input[mine]);
        {
            let mut sends: Vec<SendOp<'_>> = (1..n)
                .map(|k| (r + k) % n)
                .map(|j| SendOp::new(j, &input[blocks(j)]))
                .collect();
            let mut pieces: Vec<&mut [u8]> = scratch.chunks_mut(len.max(1)).collect();
            pieces.truncate(n);
            let mut recvs: Vec<RecvOp<'_>> = Vec::new();
            for (j, p) in pieces.into_iter().enumerate() {
                if j != r {
                    recvs.push(RecvOp::new(j, &mut p[..len]));
                }
            }
            if len == 0 {
                recvs.clear();
            }
            self.mesh
                .run_plain(&mut sends, &mut recvs, deadline, h.kind.name(), t)?;
        }
        let srcs: Vec<&[u8]> = (0..n)
            .map(|j| &self.scratch.as_slice()[j * len..(j + 1) * len])
            .collect();
        let avg = (op == ReduceOp::Avg).then_some(n);
        fold_many(h.dtype, op, out, &srcs, avg)
    }

    /// Small all-reduce: Bruck all-gather of (header, data) then a rank-order fold on every rank.
    fn small_all_reduce(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        op: ReduceOp,
        deadline: Instant,
        t: &mut Traffic,
    ) -> Result<()> {
        let n = self.mesh.world();
        let mut blob = h.encode().to_vec();
        blob.extend_from_slice(&self.p2p.encode());
        blob.extend_from_slice(buf);
        let blobs = self.mesh.bruck_allgather(blob, self.max_blob(), deadline, h.kind.name())?;
        let heads: Vec<Vec<u8>> = blobs
            .iter()
            .map(|b| b[..b.len().min(HEADER_BYTES)].to_vec())
            .collect();
        self.check_blobs(h, &heads)?;
        self.check_p2p(h, &blobs)?;
        // Copy into aligned scratch (blob payloads sit at an unaligned offset).
        let len = buf.len();
        let at = HEADER_BYTES + P2P_BYTES;
        // Equal headers mean equal lengths, unless a peer's bytes lie about them.
        if let Some((j, b)) = blobs.iter().enumerate().find(|(_, b)| b.len() != at + len) {
            return Err(self.mesh.peer_error(j, h.kind.name(), format!("sent {} bytes of data for {len}", b.len().saturating_sub(at))));
        }
        let scratch = self.scratch.get(len * n);
        for (j, b) in blobs.iter().enumerate() {
            scratch[j * len..(j + 1) * len].copy_from_slice(&b[at..]);
        }
        let srcs: Vec<&[u8]> = (0..n)
            .map(|j| &self.scratch.as_slice()[j * len..(j + 1) * len])
            .collect();
        let avg = (op == ReduceOp::Avg).then_some(n);
        fold_many(h.dtype, op, buf, &srcs, avg)?;
        t.sent += ((n - 1) * len) as u64;
        t.recv += ((n - 1) * len) as u64;
        Ok(())
    }
}

impl Backend for TcpBackend {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn all_reduce(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        op: ReduceOp,
        t: &mut Traffic,
    ) -> Result<()> {
        let deadline = self.deadline();
        let n = self.mesh.world();
        let esz = h.dtype.size();
        let count = buf.len() / esz;
        if buf.len() <= self.ctx().opts.tcp_small_bytes || count < n {
            return self.small_all_reduce(h, buf, op, deadline, t);
        }
        self.exchange_headers(h, deadline)?;
        let r = self.mesh.rank();
        let blocks = move |j: usize| bytes(block_range(count, n, j), esz);
        if n == 2 {
            // Each block is folded once, on its owner, as a ⊕ b or b ⊕ a: the same bits as a
            // rank-order fold (the ops are commutative), so deterministic mode takes it too.
            return self.pair_all_reduce(h, buf, (blocks(r), blocks(1 - r)), op, deadline, t);
        }
        if self.ctx().opts.deterministic {
            // Fold each block in rank order on its owner, then all-gather.
            let mine = blocks(r);
            let mut own = AlignedBuf::new();
            let own_buf = own.get(mine.len());
            self.direct_reduce_scatter(h, buf, own_buf, &blocks, op, deadline, t)?;
            buf[mine].copy_from_slice(own.as_slice());
        } else if op == ReduceOp::Avg && premultiplies_avg(h.dtype) {
            divide(h.dtype, buf, n)?;
            self.ring_reduce_scatter(h, buf, &blocks, ReduceOp::Sum, deadline, t)?;
        } else {
            self.ring_reduce_scatter(h, buf, &blocks, op, deadline, t)?;
            if op == ReduceOp::Avg {
                divide(h.dtype, &mut buf[blocks(r)], n)?;
            }
        }
        self.ring_all_gather(h, buf, &blocks, deadline, t)
    }

    fn reduce_scatter(
        &mut self,
        h: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        op: ReduceOp,
        t: &mut Traffic,
    ) -> Result<()> {
        let deadline = self.deadline();
        self.exchange_headers(h, deadline)?;
        let (r, n) = (self.mesh.rank(), self.mesh.world());
        let s = out.len();
        let blocks = move |j: usize| j * s..(j + 1) * s;
        if self.ctx().opts.deterministic && n > 2 {
            return self.direct_reduce_scatter(h, input, out, &blocks, op, deadline, t);
        }
        let mut work = std::mem::replace(&mut self.work, AlignedBuf::new());
        let w = work.get(input.len());
        w.copy_from_slice(input);
        // (Two ranks average in their one fold: see `ring_reduce_scatter`.)
        let pre = op == ReduceOp::Avg && premultiplies_avg(h.dtype) && n > 2;
        let res = if pre {
            divide(h.dtype, w, n).and_then(|()| self.ring_reduce_scatter(h, w, &blocks, ReduceOp::Sum, deadline, t))
        } else {
            self.ring_reduce_scatter(h, w, &blocks, op, deadline, t)
        };
        if res.is_ok() {
            out.copy_from_slice(&w[blocks(r)]);
        }
        self.work = work;
        res?;
        if op == ReduceOp::Avg && !pre && n > 2 {
            divide(h.dtype, out, n)?;
        }
        Ok(())
    }

    fn all_gather(
        &mut self,
        h: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        t: &mut Traffic,
    ) -> Result<()> {
        let deadline = self.deadline();
        self.exchange_headers(h, deadline)?;
        let r = self.mesh.rank();
        let s = input.len();
        out[r * s..(r + 1) * s].copy_from_slice(input);
        self.ring_all_gather(h, out, &move |j| j * s..(j + 1) * s, deadline, t)
    }

    fn broadcast(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        root: usize,
        t: &mut Traffic,
    ) -> Result<()> {
        let deadline = self.deadline();
        self.exchange_headers(h, deadline)?;
        let (r, n) = (self.mesh.rank(), self.mesh.world());
        // Pipelined chain root -> root+1 -> ... in segments.
        let pos = (r + n - root) % n;
        let prev = (pos > 0).then(|| (r + n - 1) % n);
        let next = (pos + 1 < n).then(|| (r + 1) % n);
        let seg = self.segment;
        let blen = buf.len();
        let nseg = blen.div_ceil(seg);
        let segr = move |i: usize| i * seg..((i + 1) * seg).min(blen);
        match (prev, next) {
            (None, Some(nx)) => {
                let mut sends = [SendOp::new(nx, buf)];
                self.mesh
                    .run_plain(&mut sends, &mut [], deadline, "broadcast", t)
            }
            (Some(pv), None) => {
                let mut recvs = [RecvOp::new(pv, buf)];
                self.mesh
                    .run_plain(&mut [], &mut recvs, deadline, "broadcast", t)
            }
            (Some(pv), Some(nx)) => {
                for i in 0..=nseg {
                    if i == 0 {
                        let mut recvs = [RecvOp::new(pv, &mut buf[segr(0)])];
                        self.mesh
                            .run_plain(&mut [], &mut recvs, deadline, "broadcast", t)?;
                    } else if i == nseg {
                        let mut sends = [SendOp::new(nx, &buf[segr(i - 1)])];
                        self.mesh
                            .run_plain(&mut sends, &mut [], deadline, "broadcast", t)?;
                    } else {
                        let (send, recv) = split_pair(buf, segr(i - 1), segr(i));
                        let mut sends = [SendOp::new(nx, send)];
                        let mut recvs = [RecvOp::new(pv, recv)];
                        self.mesh
                            .run_plain(&mut sends, &mut recvs, deadline, "broadcast", t)?;
                    }
                }
                Ok(())
            }
            (None, None) => Ok(()),
        }
    }

    fn reduce(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        op: ReduceOp,
        root: usize,
        t: &mut Traffic,
    ) -> Result<()> {
        let deadline = self.deadline();
        self.exchange_headers(h, deadline)?;
        let (r, n) = (self.mesh.rank(), self.mesh.world());
        let len = buf.len();
        if r != root {
            let mut sends = [SendOp::new(root, buf)];
            return self
                .mesh
                .run_plain(&mut sends, &mut [], deadline, "reduce", t);
        }
        // The root receives every contribution and folds in rank order 0..N-1.
        let scratch = self.scratch.get(len * n);
        {
            let mut recvs: Vec<RecvOp<'_>> = Vec::new();
            for (j, p) in scratch.chunks_mut(len.max(1)).take(n).enumerate() {
                if j != r && len > 0 {
                    recvs.push(RecvOp::new(j, p));
                }
            }
            self.mesh
                .run_plain(&mut [], &mut recvs, deadline, "reduce", t)?;
        }
        let base = self.scratch.as_slice().as_ptr();
        let out = buf.as_mut_ptr();
        let srcs: Vec<*const u8> = (0..n)
            .map(|j| {
                if j == r {
                    out as *const u8
                } else {
                    base.wrapping_add(j * len)
                }
            })
            .collect();
        let avg = (op == ReduceOp::Avg).then_some(n);
        // SAFETY: `out` is `buf` (exclusively borrowed, `len` bytes) and appears once among the
        // sources, as an exact alias; the other sources are disjoint pieces of the scratch buffer.
        unsafe { fold_bytes_to(h.dtype, op, out, &srcs, len, avg, false) }
    }

    fn barrier(&mut self, h: &OpHeader, _t: &mut Traffic) -> Result<()> {
        let deadline = self.deadline();
        self.exchange_headers(h, deadline)
    }

    fn send(&mut self, h: &OpHeader, buf: &[u8], dst: usize, t: &mut Traffic) -> Result<()> {
        let deadline = self.deadline();
        let head = h.encode();
        let mut sends = [SendOp::new(dst, &head), SendOp::new(dst, buf)];
        let mut ctrl = Traffic::default();
        self.mesh
            .run_plain(&mut sends, &mut [], deadline, "send", &mut ctrl)?;
        t.sent += buf.len() as u64;
        self.p2p.sent += 1;
        Ok(())
    }

    fn recv(&mut self, h: &OpHeader, buf: &mut [u8], src: usize, t: &mut Traffic) -> Result<()> {
        let deadline = self.deadline();
        let mut head = [0u8; HEADER_BYTES];
        let mut ctrl = Traffic::default();
        self.mesh.run_plain(
            &mut [],
            &mut [RecvOp::new(src, &mut head)],
            deadline,
            "recv",
            &mut ctrl,
        )?;
        let theirs = OpHeader::decode(&head);
        let mut expect = *h;
        expect.kind = OpKind::Send;
        if theirs != Some(expect) {
            let ctx = self.ctx();
            return Err(CommError::Mismatch {
                rank: ctx.names[ctx.rank],
                peer: ctx.names[src],
                ours: h.describe(),
                theirs: theirs.map_or_else(|| "an unknown operation".to_string(), |t| t.describe()),
            });
        }
        self.mesh
            .run_plain(&mut [], &mut [RecvOp::new(src, buf)], deadline, "recv", t)?;
        self.p2p.received += 1;
        Ok(())
    }

    fn set_op_deadline(&mut self, deadline: Option<Instant>) {
        self.op_deadline = deadline;
    }

    fn abort(&mut self, err: &CommError) {
        self.mesh.abort(err);
    }
}

#[cfg(test)]
mod tests {
    use super::{
        HEADER_BYTES, P2P_BYTES, P2pCounts, PairOrder, Piece, agreed_segment, default_segment_bytes,
        p2p_balance, parse_cache_size, segment_for_l2,
    };

    #[test]
    fn unmatched_point_to_point_messages_are_found_from_the_counts() {
        let c = |sent, received| P2pCounts { sent, received };
        assert_eq!(p2p_balance(&[c(0, 0), c(0, 0), c(0, 0)]), Ok(()));
        // Rank 0 sent 2, rank 2 received both: matched, whoever holds which count.
        assert_eq!(p2p_balance(&[c(2, 0), c(0, 0), c(0, 2)]), Ok(()));
        // Rank 0 sent one more than was received: rank 0 is named.
        assert_eq!(p2p_balance(&[c(3, 0), c(0, 1), c(0, 1)]), Err((0, c(3, 0), 3, 2)));
        // A receive more than was sent (bytes that were not a send): the receiver is named.
        assert_eq!(p2p_balance(&[c(1, 0), c(0, 0), c(0, 2)]), Err((2, c(0, 2), 1, 2)));
        let mut blob = vec![0u8; HEADER_BYTES];
        blob.extend_from_slice(&c(5, 7).encode());
        assert_eq!(P2pCounts::decode(&blob), Some(c(5, 7)));
        assert_eq!(P2pCounts::decode(&blob[..HEADER_BYTES + P2P_BYTES - 1]), None);
    }

    /// The whole order a [`PairOrder`] walks.
    fn pair_schedule(rs: usize, ag: usize, lead: usize) -> Vec<Piece> {
        let mut o = PairOrder::new(rs, ag, lead);
        let mut out = Vec::new();
        while let Some(p) = o.current() {
            out.push(p);
            o.advance();
        }
        out
    }

    /// Plays two ranks' [`PairOrder`] streams against each other with unbounded buffering
    /// (a rank's reads never wait on anything, so buffering only delays): a rank may send
    /// all-gather segment `j` once it has folded segment `j` of its block, which needs the peer's
    /// reduce-scatter segment `j`. Returns whether both streams ran to the end.
    fn completes(blocks: [usize; 2], lead: usize) -> bool {
        // Rank r sends reduce-scatter segments of the peer's block and all-gather ones of its own.
        let out = [
            pair_schedule(blocks[1], blocks[0], lead),
            pair_schedule(blocks[0], blocks[1], lead),
        ];
        let mut sent = [0usize; 2];
        let mut folded = [0usize; 2];
        loop {
            let mut moved = false;
            for r in 0..2 {
                if let Some(&p) = out[r].get(sent[r]) {
                    let ready = match p {
                        Piece::Rs(_) => true,
                        Piece::Ag(j) => j < folded[r],
                    };
                    if ready {
                        if let Piece::Rs(j) = p {
                            // The peer folds its segment j on arrival, in order.
                            assert_eq!(j, folded[1 - r], "reduce-scatter out of order");
                            folded[1 - r] += 1;
                        }
                        sent[r] += 1;
                        moved = true;
                    }
                }
            }
            if !moved {
                return sent[0] == out[0].len() && sent[1] == out[1].len();
            }
        }
    }

    #[test]
    fn segment_follows_the_l2_size() {
        assert_eq!(segment_for_l2(Some(512 << 10)), 64 << 10);
        assert_eq!(segment_for_l2(Some(1 << 20)), 128 << 10);
        assert_eq!(segment_for_l2(Some(1280 << 10)), 128 << 10);
        assert_eq!(segment_for_l2(Some(2 << 20)), 256 << 10);
        assert_eq!(segment_for_l2(Some(32 << 20)), 256 << 10);
        assert_eq!(segment_for_l2(Some(256 << 10)), 64 << 10);
        assert_eq!(segment_for_l2(Some(0)), 256 << 10);
        assert_eq!(segment_for_l2(None), 256 << 10);
        assert_eq!(parse_cache_size("512K\n"), Some(512 << 10));
        assert_eq!(parse_cache_size("2048K"), Some(2 << 20));
        assert_eq!(parse_cache_size("1M"), Some(1 << 20));
        assert_eq!(parse_cache_size("65536"), Some(65536));
        assert_eq!(parse_cache_size("big"), None);
        assert_eq!(parse_cache_size(""), None);
        let d = default_segment_bytes();
        assert!(
            d.is_power_of_two() && (64 << 10..=256 << 10).contains(&d),
            "{d}"
        );
    }

    #[test]
    fn agreed_segment_is_the_smallest() {
        let blob = |seg: Option<u64>| {
            let mut b = vec![0u8; HEADER_BYTES + P2P_BYTES];
            if let Some(s) = seg {
                b.extend_from_slice(&s.to_le_bytes());
            }
            b
        };
        assert_eq!(
            agreed_segment(&[blob(Some(65536)), blob(Some(262144))], 262144),
            65536
        );
        assert_eq!(agreed_segment(&[blob(Some(0)), blob(Some(100))], 100), 1);
        assert_eq!(agreed_segment(&[blob(None), blob(Some(100))], 7), 7);
    }

    #[test]
    fn schedule_holds_every_segment_once_in_order() {
        for rs in 0..7 {
            for ag in 0..7 {
                for lead in 1..5 {
                    let s = pair_schedule(rs, ag, lead);
                    let r: Vec<_> = s
                        .iter()
                        .filter_map(|p| match p {
                            Piece::Rs(j) => Some(*j),
                            Piece::Ag(_) => None,
                        })
                        .collect();
                    let a: Vec<_> = s
                        .iter()
                        .filter_map(|p| match p {
                            Piece::Ag(j) => Some(*j),
                            Piece::Rs(_) => None,
                        })
                        .collect();
                    assert_eq!(r, (0..rs).collect::<Vec<_>>());
                    assert_eq!(a, (0..ag).collect::<Vec<_>>());
                    // The lead: all-gather j goes after reduce-scatter min(j + lead, rs) - 1.
                    for (pos, p) in s.iter().enumerate() {
                        if let Piece::Ag(j) = p {
                            let need = (j + lead).min(rs);
                            let rs_before = s[..pos]
                                .iter()
                                .filter(|q| matches!(q, Piece::Rs(_)))
                                .count();
                            assert!(rs_before >= need, "{rs} {ag} {lead}: {s:?}");
                        }
                    }
                }
            }
        }
        assert_eq!(
            pair_schedule(3, 3, 1),
            [
                Piece::Rs(0),
                Piece::Ag(0),
                Piece::Rs(1),
                Piece::Ag(1),
                Piece::Rs(2),
                Piece::Ag(2)
            ]
        );
    }

    #[test]
    fn schedules_never_deadlock_with_a_lead() {
        for b0 in 0..9 {
            for b1 in 0..9 {
                for lead in 1..6 {
                    assert!(completes([b0, b1], lead), "blocks {b0}/{b1} lead {lead}");
                }
            }
        }
        // Without a lead both ranks wait for each other's first segment: the check can fail.
        assert!(!completes([3, 3], 0));
    }
}
