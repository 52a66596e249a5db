//! Hierarchical backend: shared memory inside each host, TCP between one leader per host.
//!
//! all_reduce = intra-host reduce to the leader (shm) → all_reduce among leaders (TCP) →
//! intra-host broadcast (shm); broadcast and barrier are staged the same way. all_gather,
//! reduce_scatter, reduce and send/recv use a flat TCP mesh over all ranks. In deterministic
//! mode all_reduce also uses the flat TCP algorithm, so the fold order is rank order.

use std::time::Instant;

use super::dtype::{ReduceOp, divide, premultiplies_avg};
use super::error::{CommError, Result};
use super::op::{OpHeader, OpKind, Traffic};
use super::shm::ShmBackend;
use super::tcp::TcpBackend;
use super::{Backend, Ctx};

pub(crate) struct HierBackend {
    ctx: Ctx,
    /// Group rank → host index (hosts numbered in order of their first rank).
    host_of: Vec<usize>,
    /// Group ranks on each host, ascending; element 0 is the host's leader.
    members: Vec<Vec<usize>>,
    local: Option<ShmBackend>,
    leaders: Option<TcpBackend>,
    flat: TcpBackend,
}

impl HierBackend {
    /// Sets up the host's shared memory, the leaders' mesh and the flat mesh, all by `deadline`
    /// (the bootstrap's: one timeout for the whole setup, not one per part).
    pub(crate) fn new(ctx: &Ctx, host_of: Vec<usize>, deadline: Instant) -> Result<Self> {
        let n_hosts = host_of.iter().copied().max().map_or(0, |m| m + 1);
        let mut members = vec![Vec::new(); n_hosts];
        for (r, h) in host_of.iter().enumerate() {
            members[*h].push(r);
        }
        let my_host = host_of[ctx.rank];
        let local = if members[my_host].len() > 1 {
            let sub = ctx.sub(
                &members[my_host],
                format!("{}/hier/host{my_host}", ctx.prefix),
            )?;
            Some(ShmBackend::new(&sub, false, deadline)?)
        } else {
            None
        };
        let leader_ranks: Vec<usize> = members.iter().map(|m| m[0]).collect();
        let leaders = if n_hosts > 1 && leader_ranks.contains(&ctx.rank) {
            let sub = ctx.sub(&leader_ranks, format!("{}/hier/leaders", ctx.prefix))?;
            Some(TcpBackend::new(&sub, deadline)?)
        } else {
            None
        };
        let mut flat_ctx = ctx.clone();
        flat_ctx.prefix = format!("{}/hier/flat", ctx.prefix);
        let flat = TcpBackend::new(&flat_ctx, deadline)?;
        Ok(HierBackend {
            ctx: ctx.clone(),
            host_of,
            members,
            local,
            leaders,
            flat,
        })
    }

    fn my_host(&self) -> usize {
        self.host_of[self.ctx.rank]
    }
}

/// The header a stage compares: the stage's kind, with the caller's reduce op and global root
/// (the stage's own op and root travel as arguments). So every stage a rank shares with others
/// checks what the caller asked for: an Avg against a Sum, or broadcasts from different roots,
/// are a mismatch even where the stage would sum, or broadcast from local rank 0, alike.
fn sub_header(h: &OpHeader, kind: OpKind) -> OpHeader {
    OpHeader { kind, ..*h }
}

impl Backend for HierBackend {
    fn name(&self) -> &'static str {
        "hierarchical"
    }

    fn all_reduce(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        op: ReduceOp,
        t: &mut Traffic,
    ) -> Result<()> {
        if self.ctx.opts.deterministic {
            return self.flat.all_reduce(h, buf, op, t);
        }
        // Avg must divide by the whole group: sum in the stages, divide once at the end; for
        // f16, whose partial sums overflow where the mean does not, divide each input first.
        let pre = op == ReduceOp::Avg && premultiplies_avg(h.dtype);
        if pre {
            divide(h.dtype, buf, self.ctx.world)?;
        }
        let stage_op = if op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        };
        if let Some(l) = &mut self.local {
            l.reduce(
                &sub_header(h, OpKind::Reduce),
                buf,
                stage_op,
                0,
                t,
            )?;
        }
        if let Some(x) = &mut self.leaders {
            x.all_reduce(
                &sub_header(h, OpKind::AllReduce),
                buf,
                stage_op,
                t,
            )?;
        }
        if let Some(l) = &mut self.local {
            l.broadcast(&sub_header(h, OpKind::Broadcast), buf, 0, t)?;
        }
        if op == ReduceOp::Avg && !pre {
            divide(h.dtype, buf, self.ctx.world)?;
        }
        Ok(())
    }

    fn broadcast(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        root: usize,
        t: &mut Traffic,
    ) -> Result<()> {
        let root_host = self.host_of[root];
        let my_host = self.my_host();
        if my_host == root_host
            && let Some(l) = &mut self.local
        {
            let local_root = self.members[my_host]
                .iter()
                .position(|r| *r == root)
                .unwrap_or(0);
            l.broadcast(
                &sub_header(h, OpKind::Broadcast),
                buf,
                local_root,
                t,
            )?;
        }
        if let Some(x) = &mut self.leaders {
            x.broadcast(
                &sub_header(h, OpKind::Broadcast),
                buf,
                root_host,
                t,
            )?;
        }
        if my_host != root_host
            && let Some(l) = &mut self.local
        {
            l.broadcast(&sub_header(h, OpKind::Broadcast), buf, 0, t)?;
        }
        Ok(())
    }

    fn reduce(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        op: ReduceOp,
        root: usize,
        t: &mut Traffic,
    ) -> Result<()> {
        self.flat.reduce(h, buf, op, root, t)
    }

    fn all_gather(
        &mut self,
        h: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        t: &mut Traffic,
    ) -> Result<()> {
        self.flat.all_gather(h, input, out, t)
    }

    fn reduce_scatter(
        &mut self,
        h: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        op: ReduceOp,
        t: &mut Traffic,
    ) -> Result<()> {
        self.flat.reduce_scatter(h, input, out, op, t)
    }

    fn barrier(&mut self, h: &OpHeader, t: &mut Traffic) -> Result<()> {
        if let Some(l) = &mut self.local {
            l.barrier(h, t)?;
        }
        if let Some(x) = &mut self.leaders {
            x.barrier(h, t)?;
        }
        if let Some(l) = &mut self.local {
            l.barrier(h, t)?;
        }
        Ok(())
    }

    fn send(&mut self, h: &OpHeader, buf: &[u8], dst: usize, t: &mut Traffic) -> Result<()> {
        self.flat.send(h, buf, dst, t)
    }

    fn recv(&mut self, h: &OpHeader, buf: &mut [u8], src: usize, t: &mut Traffic) -> Result<()> {
        self.flat.recv(h, buf, src, t)
    }

    fn set_op_deadline(&mut self, deadline: Option<Instant>) {
        if let Some(l) = &mut self.local {
            l.set_op_deadline(deadline);
        }
        if let Some(x) = &mut self.leaders {
            x.set_op_deadline(deadline);
        }
        self.flat.set_op_deadline(deadline);
    }

    fn abort(&mut self, err: &CommError) {
        if let Some(l) = &mut self.local {
            l.abort(err);
        }
        if let Some(x) = &mut self.leaders {
            x.abort(err);
        }
        self.flat.abort(err);
    }
}
