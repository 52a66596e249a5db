//! Checkpoints through the engine: [`Engine::shard_state`] / [`Engine::load_shard_state`]
//! (this rank's view, see [`ShardState`]) and the collective [`Engine::save_checkpoint`] /
//! [`Engine::load_checkpoint`] over the engine's process group.
//!
//! The saved state is always the fp32 master shard and the optimizer state of the rank's range
//! in the sharding group's layout (DDP: a group of 1, every rank holds the full copy and rank 0
//! writes it), whatever the precision or offload tier. Loading reshards to the current world
//! and strategy (`checkpoint::load`), then re-derives the compute copies: DDP and ZeRO-3 from
//! the rank's own range, ZeRO-1/2 by all-gathering the updated ranges (collective).
//!
//! Every collective step agrees on success first (a max-reduction of an error flag), so an
//! error on one rank (a corrupt shard only it reads, a full disk) fails the call on every rank
//! instead of leaving the others waiting in a collective.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use super::Engine;
use crate::checkpoint::{self, LoadTarget, METADATA, Progress, ShardInfo, ShardLoad, UnitState};
use crate::comm::ReduceOp;
use crate::error::{EngineError, EngineResult};
use crate::layout::ShardState;
use crate::model::UnitModel;

/// The least time a checkpoint's agreement waits for the other ranks (see `Engine::agree`).
const CHECKPOINT_AGREE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);

impl<M: UnitModel> Engine<M> {
    /// This rank's checkpoint view: fp32 master shard and optimizer state over its owned range
    /// in the sharding group's layout, the step, the optimizer name and the f16 loss scale.
    ///
    /// # Errors
    /// Offload-tier I/O or tensor failures.
    pub fn shard_state(&self) -> EngineResult<ShardState> {
        // A state a failed step left part-way must not become a checkpoint.
        self.check_usable()?;
        let mut master = Vec::with_capacity(self.units.len());
        let mut state = Vec::with_capacity(self.units.len());
        for ui in 0..self.units.len() {
            let (m, s) = self.master_and_state(ui)?;
            master.push(m);
            state.push(s);
        }
        let info = self.shard_info();
        Ok(ShardState {
            strategy: info.strategy,
            world: info.world,
            rank: self.rank,
            shard_rank: info.shard_rank,
            layout: info.layout.clone(),
            step: info.step,
            optimizer: info.optimizer.to_string(),
            master,
            state,
            loss_scale: info.loss_scale,
            loss_scale_good_steps: info.loss_scale_good_steps,
        })
    }

    /// Everything this rank's checkpoint view records but its tensors (see [`ShardInfo`]).
    fn shard_info(&self) -> ShardInfo<'_> {
        let optimizer = self.cfg.optimizer.as_tile();
        ShardInfo {
            strategy: self.cfg.strategy,
            world: self.world,
            shard_rank: self.shard_rank,
            layout: &self.layout,
            step: self.step,
            optimizer: optimizer.name(),
            state_slots: optimizer.state_slots(),
            loss_scale: self.loss_scale(),
            loss_scale_good_steps: self.scaler.as_ref().map_or(0, |sc| sc.good_steps),
        }
    }

    /// Sets the master, optimizer state and step from `s` (this rank's shard in this engine's
    /// layout, e.g. from `checkpoint::load`) and re-derives the compute parameters. Under
    /// ZeRO-1/2 the updated ranges are all-gathered, so every rank must call it.
    ///
    /// # Errors
    /// A state for another model, sharding, shard rank or optimizer ([`EngineError::Layout`],
    /// [`EngineError::Checkpoint`], [`EngineError::Length`]); tier or collective failures.
    pub fn load_shard_state(&mut self, s: ShardState) -> EngineResult<()> {
        self.check_usable()?;
        // Agreed like a checkpoint load: a rank that refuses must not leave the others waiting
        // in the gather.
        let checked = self.check_shard_state(&s);
        self.agree(checked, "shard state check")?;
        // Shards of different steps would install without complaint: DDP replicas from
        // different weights, ZeRO shards with different bias corrections.
        self.agree_on_resume_point(None, s.step, 0)?;
        let ShardState { master, state, step, loss_scale, loss_scale_good_steps, .. } = s;
        let installed =
            self.install_units(master.into_iter().zip(state).enumerate().map(Ok), step, loss_scale, loss_scale_good_steps);
        let r = self.agree(installed, "shard state install").and_then(|()| self.gather_installed_params());
        self.broken_by(r, "loading a shard state")
    }

    /// Marks the engine unusable when `r` failed: an install or gather that failed part-way left
    /// it part old state, part new.
    fn broken_by(&mut self, r: EngineResult<()>, what: &str) -> EngineResult<()> {
        if let Err(e) = &r {
            self.broken = Some(format!("{what} failed part-way ({e}); the model holds part of the old state and part of the new"));
        }
        r
    }

    /// Whether `s` fits this engine (model, shard, optimizer, lengths); changes nothing.
    fn check_shard_state(&self, s: &ShardState) -> EngineResult<()> {
        self.layout.check_same_model(&s.layout)?;
        if let Some(ls) = s.loss_scale
            && !(ls.is_finite() && ls > 0.0)
        {
            return Err(EngineError::Checkpoint(format!("loss scale {ls}: expected a finite number above 0")));
        }
        if s.layout.world != self.layout.world || s.shard_rank != self.shard_rank {
            return Err(EngineError::Layout(format!(
                "state is shard {}/{}, this rank is shard {}/{} (load with this engine's layout)",
                s.shard_rank, s.layout.world, self.shard_rank, self.layout.world
            )));
        }
        let opt = self.cfg.optimizer.as_tile();
        if s.optimizer != opt.name() {
            return Err(EngineError::Checkpoint(format!(
                "state of optimizer {:?}, engine runs {:?}",
                s.optimizer,
                opt.name()
            )));
        }
        let slots = opt.state_slots();
        if s.master.len() != self.units.len() || s.state.len() != self.units.len() {
            return Err(EngineError::Length {
                what: "units in the shard state".into(),
                expected: self.units.len(),
                actual: s.master.len().min(s.state.len()),
            });
        }
        for (ui, ul) in self.layout.units.iter().enumerate() {
            if s.state[ui].len() != slots {
                return Err(EngineError::Checkpoint(format!(
                    "unit {:?} has {} optimizer state slots, {} needs {slots}",
                    ul.name,
                    s.state[ui].len(),
                    opt.name()
                )));
            }
            for (what, v) in std::iter::once(("master", &s.master[ui]))
                .chain(s.state[ui].iter().map(|v| ("state slot", v)))
            {
                if v.len() != ul.shard_len {
                    return Err(EngineError::Length {
                        what: format!("{what} of unit {}", ul.name),
                        expected: ul.shard_len,
                        actual: v.len(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Installs a checked state in this rank's tiers, unit by unit as `units` yields them (a
    /// whole [`ShardState`], or a checkpoint read a batch at a time), then its step and loss
    /// scale; without a collective. A failure here (an offload tier's ENOSPC or EIO, a read)
    /// leaves the units before the failing one loaded.
    fn install_units(
        &mut self,
        units: impl Iterator<Item = EngineResult<(usize, UnitState)>>,
        step: u64,
        loss_scale: Option<f32>,
        good_steps: u32,
    ) -> EngineResult<()> {
        for ui in 0..self.units.len() {
            self.free_unit(ui)?;
        }
        for unit in units {
            let (ui, (master, state)) = unit?;
            self.set_master_and_state(ui, master, state)?;
        }
        self.step = step;
        if let (Some(sc), Some(ls)) = (self.scaler.as_mut(), loss_scale) {
            // A scale saved below the floor (by a version without one) starts at the floor.
            sc.scale = ls.max(sc.min_scale);
            sc.good_steps = good_steps;
        }
        Ok(())
    }

    /// The collective part of [`Engine::load_shard_state`]: under ZeRO-1/2 every rank's updated
    /// range of the parameters is all-gathered.
    fn gather_installed_params(&mut self) -> EngineResult<()> {
        if matches!(self.cfg.strategy.zero_stage(), 1 | 2) {
            for ui in 0..self.units.len() {
                self.all_gather_params(ui)?;
            }
        }
        Ok(())
    }

    /// Agrees on the outcome of a local action across all ranks (a collective).
    fn agree(&self, local: EngineResult<()>, what: &str) -> EngineResult<()> {
        // The other ranks wait here while a writer reads its state back from a tier and writes
        // it (gigabytes, maybe to NFS), and rank 0 prunes: past the ordinary op deadline, which
        // failed the group at every save of a big model. A rank that dies is still seen at once.
        let timeout = self.pg.op_timeout().max(CHECKPOINT_AGREE_TIMEOUT);
        if self.pg.with_op_timeout(timeout, || self.on_any_rank(local.is_err()))? {
            local?;
            return Err(EngineError::Checkpoint(format!("{what} failed on another rank")));
        }
        Ok(())
    }

    /// Saves a sharded checkpoint of the current step under `root` (collective: every rank
    /// calls it). Runs `begin_save` (rank 0) → barrier → `save_shard` (writers) → barrier →
    /// `commit` (rank 0, keeping the newest `keep_last` checkpoints, 0 = all) → barrier, and
    /// returns the committed directory `root/step-N`.
    ///
    /// # Errors
    /// On every rank if any rank failed: I/O errors naming the path, tier failures.
    pub fn save_checkpoint(
        &self,
        root: &Path,
        progress: &Progress,
        keep_last: usize,
    ) -> EngineResult<PathBuf> {
        let _span = tracing::info_span!("save_checkpoint", rank = self.rank, step = self.step).entered();
        self.check_usable()?;
        // Only the ranks that write (the first replica of the sharding group, rank 0 among them)
        // read their state out of the tiers, and one unit at a time, straight into the file:
        // under DDP every other rank would copy the whole master and optimizer state (12 bytes
        // a parameter) for nothing, and a writer holding a second copy of it all would need
        // twice the memory its training does (or, offloaded, all it had offloaded).
        let writer = match &self.rep_pg {
            // Hybrid: the ranks of the first host (replica 0 of every shard rank), wherever
            // the job placed them (round-robin placement puts ranks 0, 2, 4, ... on host 0).
            Some(rep) => rep.rank() == 0,
            None => self.rank == self.shard_rank,
        };
        let info = self.shard_info();
        let begun = if self.rank == 0 {
            checkpoint::begin_save(root, self.step).map(drop).map_err(Into::into)
        } else {
            Ok(())
        };
        self.agree(begun, "checkpoint begin")?;
        let written = if writer {
            checkpoint::write_shard_with(root, &info, |ui| {
                let (master, state) = self.master_and_state(ui)?;
                Ok::<_, EngineError>((Cow::Owned(master), state.into_iter().map(Cow::Owned).collect()))
            })
            .map(drop)
        } else {
            Ok(())
        };
        self.agree(written, "checkpoint shard write")?;
        let committed = if self.rank == 0 {
            checkpoint::commit_info(root, &info, progress, keep_last).map(drop).map_err(Into::into)
        } else {
            Ok(())
        };
        self.agree(committed, "checkpoint commit")?;
        Ok(root.join(checkpoint::step_dir_name(self.step)))
    }

    /// Loads a checkpoint into this engine (collective): `path` is a checkpoint directory
    /// (with `metadata.json`) or a root whose latest committed checkpoint is taken. The state is
    /// resharded to this engine's world, strategy and sharding group. Returns the directory
    /// loaded and the saved training progress (data position, epoch, RNG state).
    ///
    /// # Errors
    /// On every rank if any rank failed: no checkpoint, a corrupt or mismatching one (the error
    /// names the file), I/O errors.
    pub fn load_checkpoint(&mut self, path: &Path) -> EngineResult<(PathBuf, Progress)> {
        let _span = tracing::info_span!("load_checkpoint", rank = self.rank).entered();
        self.check_usable()?;
        let dir = if path.join(METADATA).is_file() {
            Ok(path.to_path_buf())
        } else {
            checkpoint::latest(path).map_err(EngineError::from)
        };
        let optimizer = self.cfg.optimizer.as_tile();
        // (A copy of the layout's table: the install below changes the engine meanwhile.)
        let layout = self.layout.clone();
        let target = LoadTarget {
            layout: &layout,
            strategy: self.cfg.strategy,
            world: self.world,
            rank: self.rank,
            shard_rank: self.shard_rank,
            optimizer: optimizer.name(),
        };
        // The shard is read a batch of units at a time (`LOAD_BATCH_BYTES`), never all of it at
        // once: a rank's master and optimizer state can fill most of its memory. Everything that
        // can refuse the checkpoint is still agreed on before anything changes: a load refused
        // on any rank (none there, damaged, another model, ranks that read different steps)
        // leaves every rank's engine as it was, so a script may start fresh. A shard of one
        // batch is read once and kept for the install; a bigger one is read through first to
        // check every section's CRC (keeping nothing), and again to install.
        let opened = dir.and_then(|dir| {
            let l = ShardLoad::open(&dir, &target)?;
            if l.state_slots() != optimizer.state_slots() {
                return Err(EngineError::Checkpoint(format!(
                    "{}: {} optimizer state slots, {} needs {}",
                    dir.display(),
                    l.state_slots(),
                    optimizer.name(),
                    optimizer.state_slots()
                )));
            }
            let batches = l.batches();
            let first = match &batches[..] {
                [] => None,
                [only] => Some(l.read_units(only.clone())?),
                all => {
                    for b in all {
                        l.read_units(b.clone())?;
                    }
                    None
                }
            };
            Ok((dir, l, batches, first))
        });
        self.agree(opened.as_ref().map(drop).map_err(Clone::clone), "checkpoint load")?;
        let (dir, l, batches, mut first) = opened?;
        let progress = l.progress().clone();
        self.agree_on_resume_point(Some(&dir), l.step(), progress.data_position)?;
        // Installing the shard writes the offload tiers (ENOSPC, EIO): a rank that failed there
        // must not leave the others in the gather, and after it no rank's model is whole.
        let units = batches.into_iter().flat_map(|b| {
            let read = match first.take() {
                Some(units) => Ok(units),
                None => l.read_units(b.clone()),
            };
            match read {
                Ok(units) => b.zip(units).map(Ok).collect::<Vec<_>>(),
                Err(e) => vec![Err(e.into())],
            }
        });
        let installed = self.install_units(units, l.step(), l.loss_scale(), l.loss_scale_good_steps());
        let r = self.agree(installed, "checkpoint install").and_then(|()| self.gather_installed_params());
        self.broken_by(r, &format!("loading {}", dir.display()))?;
        Ok((dir, progress))
    }

    /// Every rank must have loaded the same step and data position: ranks that each take the
    /// latest checkpoint of a directory on node-local disks can load different ones, and then
    /// DDP's replicas train from different weights, ZeRO mixes shards of two steps, and the loops
    /// start at different steps so the collectives no longer pair. Collective; the error is the
    /// same on every rank.
    ///
    /// `dir` is the checkpoint loaded, `None` for a shard state handed to
    /// [`Engine::load_shard_state`] (no data position: only the steps must match).
    fn agree_on_resume_point(&self, dir: Option<&Path>, step: u64, data_position: u64) -> EngineResult<()> {
        if self.world == 1 {
            return Ok(());
        }
        // Saturated to fit an i64 (and so does their negation); a checkpoint's step is at most
        // `checkpoint::MAX_STEP` anyway.
        let as_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let (step, position) = (as_i64(step), as_i64(data_position));
        // One all-reduce gives both extremes: the maximum of v and of −v.
        let mut v = [step, position, -step, -position];
        self.pg.all_reduce(&mut v, ReduceOp::Max)?;
        let (steps, positions) = ((-v[2], v[0]), (-v[3], v[1]));
        let Some(dir) = dir else {
            if steps.0 != steps.1 {
                return Err(EngineError::Checkpoint(format!(
                    "the ranks' shard states are of different steps: this rank's is of step {step}, and the ranks' \
                     range over {}..={}; every rank must load its shard of the same state",
                    steps.0, steps.1
                )));
            }
            return Ok(());
        };
        if steps.0 != steps.1 || positions.0 != positions.1 {
            return Err(EngineError::Checkpoint(format!(
                "the ranks loaded different checkpoints: this rank loaded {} (step {step}, data position {position}), and \
                 the ranks' steps range over {}..={} and their data positions over {}..={}; every rank must read the same \
                 checkpoint directory (a shared filesystem, not node-local disks)",
                dir.display(),
                steps.0,
                steps.1,
                positions.0,
                positions.1
            )));
        }
        Ok(())
    }
}
