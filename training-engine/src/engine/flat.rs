//! Flat buffers in the reduce / compute dtype (fp32, bf16 or f16): gradient buffers and the
//! 16-bit ZeRO-3 parameter shard, with their (async) collectives.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::comm::{ProcessGroup, ReduceOp, Result as CommResult, SharedBuf, Work};

/// Element type of a [`FlatBuf`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FlatDtype {
    F32,
    Bf16,
    F16,
}

/// A flat buffer of fp32, bf16 or f16 elements.
#[derive(Debug)]
pub(super) enum FlatBuf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
    /// fp32 registered with the data-parallel group (`ProcessGroup::alloc_shared`): DDP's
    /// gradients, all-reduced zero-copy on one host. Anything that would resize it, or a clone,
    /// turns it into a plain `F32`.
    SharedF32(SharedBuf<f32>),
}

impl Clone for FlatBuf {
    fn clone(&self) -> Self {
        match self {
            FlatBuf::F32(v) => FlatBuf::F32(v.clone()),
            FlatBuf::Bf16(v) => FlatBuf::Bf16(v.clone()),
            FlatBuf::F16(v) => FlatBuf::F16(v.clone()),
            FlatBuf::SharedF32(v) => FlatBuf::F32(v.to_vec()),
        }
    }
}

impl Default for FlatBuf {
    fn default() -> Self {
        FlatBuf::F32(Vec::new())
    }
}

macro_rules! each {
    ($b:expr, $v:ident => $e:expr) => {
        match $b {
            FlatBuf::F32($v) => $e,
            FlatBuf::Bf16($v) => $e,
            FlatBuf::F16($v) => $e,
            FlatBuf::SharedF32($v) => $e,
        }
    };
}

impl FlatBuf {
    pub(super) fn zeros(dt: FlatDtype, n: usize) -> Self {
        match dt {
            FlatDtype::F32 => FlatBuf::F32(vec![0f32; n]),
            FlatDtype::Bf16 => FlatBuf::Bf16(vec![bf16::ZERO; n]),
            FlatDtype::F16 => FlatBuf::F16(vec![f16::ZERO; n]),
        }
    }

    /// `v` rounded to `dt`.
    pub(super) fn from_f32(dt: FlatDtype, v: &[f32]) -> Self {
        match dt {
            FlatDtype::F32 => FlatBuf::F32(v.to_vec()),
            FlatDtype::Bf16 => {
                let mut o = vec![bf16::ZERO; v.len()];
                o.convert_from_f32_slice(v);
                FlatBuf::Bf16(o)
            }
            FlatDtype::F16 => {
                let mut o = vec![f16::ZERO; v.len()];
                o.convert_from_f32_slice(v);
                FlatBuf::F16(o)
            }
        }
    }

    /// Overwrites `self[at..at + src.len()]` with `src` rounded to this buffer's dtype.
    ///
    /// # Panics
    /// If the range is out of bounds (a caller's invariant: the tiles of a shard lie in it).
    pub(super) fn set_from_f32(&mut self, at: usize, src: &[f32]) {
        let r = at..at + src.len();
        match self {
            FlatBuf::F32(v) => v[r].copy_from_slice(src),
            FlatBuf::SharedF32(v) => v[r].copy_from_slice(src),
            FlatBuf::Bf16(v) => v[r].convert_from_f32_slice(src),
            FlatBuf::F16(v) => v[r].convert_from_f32_slice(src),
        }
    }

    pub(super) fn dtype(&self) -> FlatDtype {
        match self {
            FlatBuf::F32(_) | FlatBuf::SharedF32(_) => FlatDtype::F32,
            FlatBuf::Bf16(_) => FlatDtype::Bf16,
            FlatBuf::F16(_) => FlatDtype::F16,
        }
    }

    pub(super) fn len(&self) -> usize {
        each!(self, v => v.len())
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn elem_bytes(&self) -> usize {
        match self {
            FlatBuf::F32(_) | FlatBuf::SharedF32(_) => 4,
            FlatBuf::Bf16(_) | FlatBuf::F16(_) => 2,
        }
    }

    pub(super) fn bytes(&self) -> usize {
        self.len() * self.elem_bytes()
    }

    pub(super) fn as_f32_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            FlatBuf::F32(v) => Some(v),
            FlatBuf::SharedF32(v) => Some(v),
            _ => None,
        }
    }

    pub(super) fn as_f32(&self) -> Option<&[f32]> {
        match self {
            FlatBuf::F32(v) => Some(v),
            FlatBuf::SharedF32(v) => Some(v),
            _ => None,
        }
    }

    /// A buffer that can be resized or moved into a plain collective: `SharedF32` becomes `F32`.
    fn plain(self) -> Self {
        match self {
            FlatBuf::SharedF32(v) => FlatBuf::F32(v.to_vec()),
            other => other,
        }
    }

    pub(super) fn fill_zero(&mut self) {
        match self {
            FlatBuf::F32(v) => v.fill(0.0),
            FlatBuf::SharedF32(v) => v.fill(0.0),
            FlatBuf::Bf16(v) => v.fill(bf16::ZERO),
            FlatBuf::F16(v) => v.fill(f16::ZERO),
        }
    }

    pub(super) fn resize(&mut self, n: usize) {
        if matches!(self, FlatBuf::SharedF32(_)) {
            *self = std::mem::take(self).plain();
        }
        match self {
            FlatBuf::SharedF32(_) => unreachable!("made plain above"),
            FlatBuf::F32(v) => v.resize(n, 0.0),
            FlatBuf::Bf16(v) => v.resize(n, bf16::ZERO),
            FlatBuf::F16(v) => v.resize(n, f16::ZERO),
        }
    }

    pub(super) fn truncate(&mut self, n: usize) {
        if matches!(self, FlatBuf::SharedF32(_)) {
            *self = std::mem::take(self).plain();
        }
        match self {
            FlatBuf::F32(v) => v.truncate(n),
            FlatBuf::Bf16(v) => v.truncate(n),
            FlatBuf::F16(v) => v.truncate(n),
            FlatBuf::SharedF32(_) => unreachable!("made plain above"),
        }
    }

    /// `self[at..] += src`, rounded to the buffer's dtype after every addition.
    pub(super) fn add_f32(&mut self, at: usize, src: &[f32]) {
        match self {
            FlatBuf::F32(v) => {
                for (d, x) in v[at..].iter_mut().zip(src) {
                    *d += *x;
                }
            }
            FlatBuf::SharedF32(v) => {
                for (d, x) in v[at..].iter_mut().zip(src) {
                    *d += *x;
                }
            }
            FlatBuf::Bf16(v) => {
                for (d, x) in v[at..].iter_mut().zip(src) {
                    *d = bf16::from_f32(d.to_f32() + *x);
                }
            }
            FlatBuf::F16(v) => {
                for (d, x) in v[at..].iter_mut().zip(src) {
                    *d = f16::from_f32(d.to_f32() + *x);
                }
            }
        }
    }

    /// `self += other` (same dtype and length), rounded as in [`FlatBuf::add_f32`].
    pub(super) fn add(&mut self, other: &FlatBuf) {
        match other {
            FlatBuf::F32(o) => self.add_f32(0, o),
            FlatBuf::SharedF32(o) => self.add_f32(0, o),
            _ => self.add_f32(0, &other.to_f32()),
        }
    }

    /// Upcast to fp32 (exact).
    pub(super) fn to_f32(&self) -> Vec<f32> {
        match self {
            FlatBuf::F32(v) => v.clone(),
            FlatBuf::SharedF32(v) => v.to_vec(),
            FlatBuf::Bf16(v) => v.to_f32_vec(),
            FlatBuf::F16(v) => v.to_f32_vec(),
        }
    }

    /// Upcast to fp32, reusing the buffer when it already is fp32.
    pub(super) fn into_f32(self) -> Vec<f32> {
        match self {
            FlatBuf::F32(v) => v,
            other => other.to_f32(),
        }
    }

    /// Blocking reduce-scatter into `out` (same dtype).
    pub(super) fn reduce_scatter(
        &self,
        g: &ProcessGroup,
        out: &mut FlatBuf,
        op: ReduceOp,
    ) -> CommResult<()> {
        match (self, out) {
            (FlatBuf::F32(i), FlatBuf::F32(o)) => g.reduce_scatter(i, o, op),
            (FlatBuf::SharedF32(i), FlatBuf::F32(o)) => g.reduce_scatter(i, o, op),
            (FlatBuf::Bf16(i), FlatBuf::Bf16(o)) => g.reduce_scatter(i, o, op),
            (FlatBuf::F16(i), FlatBuf::F16(o)) => g.reduce_scatter(i, o, op),
            _ => unreachable!("reduce-scatter between different dtypes"),
        }
    }

    /// Blocking all-reduce in place.
    pub(super) fn all_reduce(&mut self, g: &ProcessGroup, op: ReduceOp) -> CommResult<()> {
        each!(self, v => g.all_reduce(v, op))
    }

    pub(super) fn all_reduce_async(self, g: &ProcessGroup, op: ReduceOp) -> FlatWork {
        match self {
            FlatBuf::F32(v) => FlatWork::F32(g.all_reduce_async(v, op)),
            FlatBuf::Bf16(v) => FlatWork::Bf16(g.all_reduce_async(v, op)),
            FlatBuf::F16(v) => FlatWork::F16(g.all_reduce_async(v, op)),
            FlatBuf::SharedF32(v) => FlatWork::SharedF32(g.all_reduce_async(v, op)),
        }
    }

    /// Async all-gather of `self` into `output` (same dtype).
    pub(super) fn all_gather_async(self, g: &ProcessGroup, output: FlatBuf) -> FlatWork2 {
        match (self.plain(), output.plain()) {
            (FlatBuf::F32(i), FlatBuf::F32(o)) => FlatWork2::F32(g.all_gather_async(i, o)),
            (FlatBuf::Bf16(i), FlatBuf::Bf16(o)) => FlatWork2::Bf16(g.all_gather_async(i, o)),
            (FlatBuf::F16(i), FlatBuf::F16(o)) => FlatWork2::F16(g.all_gather_async(i, o)),
            _ => unreachable!("all-gather between different dtypes"),
        }
    }

    /// Async reduce-scatter of `self` into `output` (same dtype).
    pub(super) fn reduce_scatter_async(self, g: &ProcessGroup, output: FlatBuf, op: ReduceOp) -> FlatWork2 {
        match (self.plain(), output.plain()) {
            (FlatBuf::F32(i), FlatBuf::F32(o)) => FlatWork2::F32(g.reduce_scatter_async(i, o, op)),
            (FlatBuf::Bf16(i), FlatBuf::Bf16(o)) => FlatWork2::Bf16(g.reduce_scatter_async(i, o, op)),
            (FlatBuf::F16(i), FlatBuf::F16(o)) => FlatWork2::F16(g.reduce_scatter_async(i, o, op)),
            _ => unreachable!("reduce-scatter between different dtypes"),
        }
    }
}

/// A pending collective returning one [`FlatBuf`].
pub(super) enum FlatWork {
    F32(Work<Vec<f32>>),
    Bf16(Work<Vec<bf16>>),
    F16(Work<Vec<f16>>),
    SharedF32(Work<SharedBuf<f32>>),
}

impl FlatWork {
    pub(super) fn wait(self) -> CommResult<FlatBuf> {
        Ok(match self {
            FlatWork::F32(w) => FlatBuf::F32(w.wait()?),
            FlatWork::Bf16(w) => FlatBuf::Bf16(w.wait()?),
            FlatWork::F16(w) => FlatBuf::F16(w.wait()?),
            FlatWork::SharedF32(w) => FlatBuf::SharedF32(w.wait()?),
        })
    }
}

/// A pending collective returning `(input, output)`.
pub(super) enum FlatWork2 {
    F32(Work<(Vec<f32>, Vec<f32>)>),
    Bf16(Work<(Vec<bf16>, Vec<bf16>)>),
    F16(Work<(Vec<f16>, Vec<f16>)>),
}

impl FlatWork2 {
    pub(super) fn wait(self) -> CommResult<(FlatBuf, FlatBuf)> {
        Ok(match self {
            FlatWork2::F32(w) => {
                let (i, o) = w.wait()?;
                (FlatBuf::F32(i), FlatBuf::F32(o))
            }
            FlatWork2::Bf16(w) => {
                let (i, o) = w.wait()?;
                (FlatBuf::Bf16(i), FlatBuf::Bf16(o))
            }
            FlatWork2::F16(w) => {
                let (i, o) = w.wait()?;
                (FlatBuf::F16(i), FlatBuf::F16(o))
            }
        })
    }
}
