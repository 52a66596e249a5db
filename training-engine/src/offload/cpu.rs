//! The host tier: optimizer state in page-aligned host buffers, updated in place.

use super::{AlignedBuf, OffloadError, OffloadStats, TierBytes, TileSpec, tile_specs};
use crate::error::{EngineError, EngineResult};
use crate::layout::{OptimStateStore, StateTile};

/// Optimizer state in host memory: per unit, one aligned buffer for the master shard and one
/// per state slot.
///
/// The buffers are allocated apart from the model's compute tier and accounted in
/// [`TierBytes::host`]. New state is zero.
#[derive(Debug)]
pub struct CpuStore {
    unit_lens: Vec<usize>,
    slots: usize,
    tiles: Vec<TileSpec>,
    /// `bufs[unit][0]` is the master shard, `bufs[unit][1 + s]` state slot `s`.
    bufs: Vec<Vec<AlignedBuf>>,
    stats: OffloadStats,
}

impl CpuStore {
    /// A zeroed store for unit shards of `unit_lens` elements with `slots` state slots per
    /// element, updated in tiles of at most `sub_group_elems`.
    ///
    /// # Errors
    /// [`OffloadError::Alloc`] for an impossible size.
    pub fn new(
        unit_lens: &[usize],
        slots: usize,
        sub_group_elems: usize,
    ) -> Result<Self, OffloadError> {
        let bufs = unit_lens
            .iter()
            .map(|&n| (0..=slots).map(|_| AlignedBuf::zeroed(n)).collect())
            .collect::<Result<Vec<Vec<_>>, OffloadError>>()?;
        Ok(CpuStore {
            unit_lens: unit_lens.to_vec(),
            slots,
            tiles: tile_specs(unit_lens, sub_group_elems),
            bufs,
            stats: OffloadStats::default(),
        })
    }

    /// The tiles, in update order.
    pub fn tiles(&self) -> &[TileSpec] {
        &self.tiles
    }

    /// Shard length of each unit.
    pub fn unit_lens(&self) -> &[usize] {
        &self.unit_lens
    }

    /// Direct read access to a unit's master (`tensor == 0`) or state slot `tensor - 1`.
    pub fn tensor(&self, unit: usize, tensor: usize) -> Option<&[f32]> {
        self.bufs.get(unit)?.get(tensor).map(|b| &b[..])
    }

    /// Memory held, per tier.
    pub fn memory(&self) -> TierBytes {
        TierBytes {
            host: self
                .bufs
                .iter()
                .flatten()
                .map(AlignedBuf::capacity_bytes)
                .sum(),
            file: 0,
        }
    }

    /// Counters.
    pub fn stats(&self) -> OffloadStats {
        self.stats
    }
}

/// Checks a unit index, a buffer length and a slot count against a store.
pub(super) fn check_unit(
    unit_lens: &[usize],
    slots: usize,
    unit: usize,
    len: usize,
    got_slots: usize,
) -> EngineResult<()> {
    let Some(&n) = unit_lens.get(unit) else {
        return Err(EngineError::Offload(format!(
            "unit {unit} out of range ({} units)",
            unit_lens.len()
        )));
    };
    if n != len {
        return Err(EngineError::Length {
            what: format!("offload unit {unit} master"),
            expected: n,
            actual: len,
        });
    }
    if got_slots != slots {
        return Err(EngineError::Offload(format!(
            "unit {unit}: store has {slots} state slots, got {got_slots}"
        )));
    }
    Ok(())
}

impl OptimStateStore for CpuStore {
    fn kind(&self) -> &'static str {
        "cpu"
    }

    fn init_unit(&mut self, unit: usize, master: &[f32], slots: usize) -> EngineResult<()> {
        check_unit(&self.unit_lens, self.slots, unit, master.len(), slots)?;
        let bufs = &mut self.bufs[unit];
        bufs[0].copy_from_slice(master);
        for b in &mut bufs[1..] {
            b.fill(0.0);
        }
        Ok(())
    }

    fn update_unit(
        &mut self,
        unit: usize,
        f: &mut dyn FnMut(StateTile<'_>) -> EngineResult<()>,
    ) -> EngineResult<()> {
        if unit >= self.unit_lens.len() {
            return Err(EngineError::Offload(format!(
                "unit {unit} out of range ({} units)",
                self.unit_lens.len()
            )));
        }
        // Tiles are updated in place; a closure error leaves earlier tiles updated (the host
        // tier keeps no second copy; the engine treats a failed step as fatal).
        for t in self.tiles.iter().filter(|t| t.unit == unit) {
            let r = t.range();
            let (master, state) = self.bufs[unit].split_at_mut(1);
            let mut state: Vec<&mut [f32]> = state.iter_mut().map(|b| &mut b[r.clone()]).collect();
            f(StateTile {
                offset: t.start,
                master: &mut master[0][r],
                state: &mut state,
            })?;
        }
        self.stats.unit_updates += 1;
        Ok(())
    }

    fn read_unit(&mut self, unit: usize) -> EngineResult<(Vec<f32>, Vec<Vec<f32>>)> {
        let bufs = self.bufs.get(unit).ok_or_else(|| {
            EngineError::Offload(format!(
                "unit {unit} out of range ({} units)",
                self.unit_lens.len()
            ))
        })?;
        Ok((
            bufs[0].to_vec(),
            bufs[1..].iter().map(|b| b.to_vec()).collect(),
        ))
    }

    fn write_unit(&mut self, unit: usize, master: &[f32], state: &[Vec<f32>]) -> EngineResult<()> {
        check_unit(&self.unit_lens, self.slots, unit, master.len(), state.len())?;
        if let Some(s) = state.iter().find(|s| s.len() != master.len()) {
            return Err(EngineError::Length {
                what: format!("offload unit {unit} state slot"),
                expected: master.len(),
                actual: s.len(),
            });
        }
        let bufs = &mut self.bufs[unit];
        bufs[0].copy_from_slice(master);
        for (b, s) in bufs[1..].iter_mut().zip(state) {
            b.copy_from_slice(s);
        }
        Ok(())
    }

    fn resident_bytes(&self) -> u64 {
        self.memory().host as u64
    }
}
