//! TCP backend: segmented, pipelined ring for large messages, Bruck all-gather + rank-order
//! fold for small ones, direct (all-to-all) reduce-scatter in deterministic mode.

use std::ops::Range;
use std::time::Instant;

use super::dtype::{AlignedBuf, ReduceOp, divide, fold_bytes_raw, fold_into, fold_many};
use super::error::{CommError, Result};
use super::mesh::{Mesh, RecvOp, SendOp};
use super::op::{HEADER_BYTES, OpHeader, OpKind, Traffic, block_range};
use super::{Backend, Ctx};

pub(crate) struct TcpBackend {
    mesh: Mesh,
    scratch: AlignedBuf,
    work: AlignedBuf,
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
    pub(crate) fn new(ctx: &Ctx) -> Result<Self> {
        Ok(TcpBackend {
            mesh: Mesh::connect(ctx)?,
            scratch: AlignedBuf::new(),
            work: AlignedBuf::new(),
        })
    }

    fn ctx(&self) -> &Ctx {
        self.mesh.ctx()
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.ctx().opts.timeout
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

    fn exchange_headers(&mut self, h: &OpHeader, deadline: Instant) -> Result<()> {
        let blobs = self
            .mesh
            .bruck_allgather(h.encode().to_vec(), deadline, h.kind.name())?;
        self.check_blobs(h, &blobs)
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
        let seg = self.ctx().opts.tcp_segment_bytes;
        let dt = h.dtype;
        for s in 0..n - 1 {
            let sb = blocks((r + 2 * n - s - 1) % n);
            let rb = blocks((r + 2 * n - s - 2) % n);
            let (send, acc) = split_pair(buf, sb, rb.clone());
            let scratch = self.scratch.get(rb.len());
            let mut sends = [SendOp::new(next, send)];
            let mut recvs = [RecvOp::new(prev, scratch)];
            self.mesh.run(
                &mut sends,
                &mut recvs,
                seg,
                &mut |_, range, data| fold_into(dt, op, &mut acc[range], data),
                deadline,
                h.kind.name(),
                t,
            )?;
        }
        Ok(())
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
        blob.extend_from_slice(buf);
        let blobs = self.mesh.bruck_allgather(blob, deadline, h.kind.name())?;
        let heads: Vec<Vec<u8>> = blobs
            .iter()
            .map(|b| b[..b.len().min(HEADER_BYTES)].to_vec())
            .collect();
        self.check_blobs(h, &heads)?;
        // Copy into aligned scratch (blob payloads sit at an unaligned offset).
        let len = buf.len();
        let scratch = self.scratch.get(len * n);
        for (j, b) in blobs.iter().enumerate() {
            scratch[j * len..(j + 1) * len].copy_from_slice(&b[HEADER_BYTES..]);
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
        if self.ctx().opts.deterministic && n > 2 {
            // Fold each block in rank order on its owner, then all-gather.
            let mine = blocks(r);
            let mut own = AlignedBuf::new();
            let own_buf = own.get(mine.len());
            self.direct_reduce_scatter(h, buf, own_buf, &blocks, op, deadline, t)?;
            buf[mine].copy_from_slice(own.as_slice());
        } else {
            // With two ranks the ring folds a+b on one rank and b+a on the other: identical bits.
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
        let res = self.ring_reduce_scatter(h, w, &blocks, op, deadline, t);
        if res.is_ok() {
            out.copy_from_slice(&w[blocks(r)]);
        }
        self.work = work;
        res?;
        if op == ReduceOp::Avg {
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
        let seg = self.ctx().opts.tcp_segment_bytes.max(1);
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
        unsafe { fold_bytes_raw(h.dtype, op, out, &srcs, len, avg) }
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
            .run_plain(&mut [], &mut [RecvOp::new(src, buf)], deadline, "recv", t)
    }

    fn abort(&mut self, err: &CommError) {
        self.mesh.abort(err);
    }
}
