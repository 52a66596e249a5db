//! Training data for the `train` example: a deterministic synthetic corpus that a small byte-level
//! model can actually learn, or any file read as bytes (memory-mapped), and the distributed sampler.
//!
//! # Which samples a rank sees
//!
//! The corpus is cut into windows of `seq_len + 1` bytes (inputs plus the next-byte targets). Every
//! epoch visits every window once, in an order shuffled from `(seed, epoch)`. Global step `k` consumes
//! the next `G = batch × grad_accum × world` windows of that stream. Within a global step, window `j`
//! goes to slot `j / batch`, and slot `s` is (rank `s / grad_accum`, micro-step `s % grad_accum`).
//! So the samples of step `k` depend only on the seed and `G`: one process with `--grad-accum 2` sees
//! in its two micro-steps exactly what two ranks with `--grad-accum 1` see, in the same slot order.
//! The data position saved in checkpoints is the global step.

use std::path::{Path, PathBuf};

/// What to train on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSpec {
    /// The built-in synthetic corpus.
    Synthetic,
    /// A file, read as bytes.
    File(PathBuf),
}

impl std::str::FromStr for DataSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "synthetic" {
            return Ok(DataSpec::Synthetic);
        }
        let p = PathBuf::from(s);
        if !p.is_file() {
            return Err(format!("{s:?} is neither `synthetic` nor a readable file"));
        }
        Ok(DataSpec::File(p))
    }
}

/// The bytes to train on.
pub enum Corpus {
    /// Generated in memory.
    Owned(Vec<u8>),
    /// A memory-mapped file.
    Mapped(memmap2::Mmap),
}

impl std::fmt::Debug for Corpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Corpus({} bytes)", self.bytes().len())
    }
}

/// The most windows one epoch shuffles (u32 indices, 4 bytes each in memory on every rank: 16
/// GiB at most; `train`'s memory check counts them).
pub const MAX_WINDOWS: usize = u32::MAX as usize;

impl Corpus {
    /// Loads the corpus. The synthetic one is `synthetic_bytes` long and generated from `seed`.
    ///
    /// # Errors
    /// The file cannot be opened or mapped, or is too short for one window.
    pub fn load(spec: &DataSpec, seed: u64, synthetic_bytes: usize, seq_len: usize) -> anyhow::Result<Self> {
        let corpus = match spec {
            DataSpec::Synthetic => Corpus::Owned(synthetic(seed, synthetic_bytes)),
            DataSpec::File(path) => Corpus::Mapped(map(path)?),
        };
        // One window: seq_len inputs and the target after the last.
        let need = seq_len + 1;
        let len = corpus.bytes().len();
        if len < need {
            anyhow::bail!("the data has {len} bytes; at least {need} are needed for one window of --seq-len {seq_len}");
        }
        // The sampler shuffles window indices as u32 (4 bytes a window in memory).
        let windows = (len - 1) / seq_len.max(1);
        if windows > MAX_WINDOWS {
            anyhow::bail!(
                "the data has {len} bytes: {windows} windows of --seq-len {seq_len}, more than the {MAX_WINDOWS} one epoch can shuffle; use a longer --seq-len or a smaller file"
            );
        }
        Ok(corpus)
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Corpus::Owned(v) => v,
            Corpus::Mapped(m) => m,
        }
    }
}

fn map(path: &Path) -> anyhow::Result<memmap2::Mmap> {
    use anyhow::Context;
    let file = std::fs::File::open(path).with_context(|| format!("cannot open data file {}", path.display()))?;
    // SAFETY: the file is opened read-only and the map is only read. Another process truncating the
    // file while we train would fault; that is the documented risk of memory-mapped input.
    unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot memory-map data file {}", path.display()))
}

/// splitmix64: a tiny PRNG whose output is fixed forever (unlike library RNGs whose algorithm may
/// change between versions), so data order is reproducible across builds.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        // Lemire's multiply-shift; the tiny bias at n close to 2^64 does not matter here.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

const SUBJECTS: &[&str] = &["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher", "our neighbour"];
const VERBS: &[&str] = &["sees", "likes", "follows", "paints", "finds", "carries", "watches", "helps"];
const OBJECTS: &[&str] = &["the red ball", "a green box", "the tall tree", "a blue car", "the river", "a wooden chair", "the moon", "an apple"];
const PLACES: &[&str] = &["in the park", "at home", "near the sea", "on the hill", "in the city", "by the lake"];

/// A learnable text: simple sentences from a small grammar, plus arithmetic facts (`17+25=42.`), which
/// a byte-level model learns in stages (spelling, then grammar, then some arithmetic), so the loss
/// curve has shape.
pub fn synthetic(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed ^ 0x5EED_DA7A);
    let mut out = Vec::with_capacity(len + 64);
    while out.len() < len {
        let pick = |rng: &mut SplitMix64, words: &[&str]| words[rng.below(words.len() as u64) as usize].to_string();
        let sentence = if rng.below(4) == 0 {
            let (a, b) = (rng.below(50), rng.below(50));
            format!("{a}+{b}={}. ", a + b)
        } else {
            let mut s = format!("{} {} {}", pick(&mut rng, SUBJECTS), pick(&mut rng, VERBS), pick(&mut rng, OBJECTS));
            if rng.below(2) == 0 {
                s.push(' ');
                s.push_str(&pick(&mut rng, PLACES));
            }
            s.push_str(". ");
            s
        };
        out.extend_from_slice(sentence.as_bytes());
    }
    out.truncate(len);
    out
}

/// What a checkpoint must share with the run that resumes it for the data to go on where it
/// stopped (the sampler's seed and the data itself), and what the ranks of one run must share
/// (those and the samples per global step). Saved by `train` as the checkpoint's `rng_state` (a
/// tagged little-endian record), with the samples consumed so far ([`DataIdentity::encode_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataIdentity {
    pub seed: u64,
    /// Samples per global step (batch × grad-accum × ranks).
    pub global_batch: u64,
    /// [`fingerprint`] of the corpus.
    pub data: u64,
}

/// The record of a checkpoint of a run at one global batch throughout (older `train`), and the
/// record the ranks exchange.
const IDENTITY_TAG: &[u8; 8] = b"rsrunDI1";
/// The record of a checkpoint with the samples consumed: resumable at any global batch.
const POSITION_TAG: &[u8; 8] = b"rsrunDI2";

impl DataIdentity {
    /// The record the ranks compare (no position).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = IDENTITY_TAG.to_vec();
        for v in [self.seed, self.global_batch, self.data] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// The record a checkpoint saves: this identity and the `samples` the run consumed up to it
    /// (over every global batch it ran at).
    pub fn encode_at(&self, samples: u64) -> Vec<u8> {
        let mut b = POSITION_TAG.to_vec();
        for v in [self.seed, self.global_batch, self.data, samples] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// What a checkpoint saved: the full record (with or without the samples consumed), or the
    /// seed alone (the 8 bytes older versions of `train` saved); `None` for anything else.
    pub fn decode(b: &[u8]) -> Option<SavedIdentity> {
        let word = |i: usize| b.get(i..i + 8).and_then(|w| w.try_into().ok()).map(u64::from_le_bytes);
        if b.len() == 8 {
            return word(0).map(SavedIdentity::SeedOnly);
        }
        let identity = || Some(DataIdentity { seed: word(8)?, global_batch: word(16)?, data: word(24)? });
        if b.len() == 32 && b.starts_with(IDENTITY_TAG) {
            return Some(SavedIdentity::Full { identity: identity()?, samples: None });
        }
        if b.len() == 40 && b.starts_with(POSITION_TAG) {
            return Some(SavedIdentity::Full { identity: identity()?, samples: Some(word(32)?) });
        }
        None
    }

    /// Why a run with `self` cannot resume from `saved` (each difference named), or `None`. The
    /// global batch may differ (another world size): the run resumes at the samples consumed.
    pub fn mismatch(&self, saved: &SavedIdentity) -> Option<String> {
        const WHOSE: &str = "the checkpoint's";
        let seed = match saved {
            SavedIdentity::SeedOnly(seed) => *seed,
            SavedIdentity::Full { identity, .. } => identity.seed,
        };
        let mut why = Vec::new();
        if seed != self.seed {
            why.push(self.seed_differs(seed, WHOSE));
        }
        if let SavedIdentity::Full { identity, .. } = saved
            && identity.data != self.data
        {
            why.push(self.data_differs(identity.data, WHOSE));
        }
        (!why.is_empty()).then(|| why.join("; "))
    }

    /// Each way `other` (`whose`: "rank 3's") differs from `self`, or `None`; `batch_harm` says
    /// what a different global batch would do.
    pub fn differences(&self, other: &DataIdentity, whose: &str, batch_harm: &str) -> Option<String> {
        let mut why = Vec::new();
        if other.seed != self.seed {
            why.push(self.seed_differs(other.seed, whose));
        }
        if other.global_batch != self.global_batch {
            why.push(format!(
                "a global batch of {} samples ({whose} is {}: {batch_harm}; keep batch × grad-accum × ranks the same)",
                self.global_batch, other.global_batch
            ));
        }
        if other.data != self.data {
            why.push(self.data_differs(other.data, whose));
        }
        (!why.is_empty()).then(|| why.join("; "))
    }

    fn seed_differs(&self, other: u64, whose: &str) -> String {
        format!("--seed {} ({whose} is {other}: another data order)", self.seed)
    }

    fn data_differs(&self, other: u64, whose: &str) -> String {
        format!("other data (fingerprint {:016x}, {whose} is {other:016x}: another --data)", self.data)
    }
}

/// A checkpoint's saved [`DataIdentity`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SavedIdentity {
    /// The seed alone (older checkpoints).
    SeedOnly(u64),
    /// The identity, and the samples consumed (`None`: a checkpoint of a run at one global batch
    /// throughout, older `train`).
    Full { identity: DataIdentity, samples: Option<u64> },
}

impl SavedIdentity {
    /// The samples consumed at the checkpoint's data position `step` (its global steps done):
    /// recorded, or `step` × the one global batch an older checkpoint's run had; `None` where
    /// that batch is unknown (the seed alone: the run must keep it).
    pub fn samples_at(&self, step: u64) -> Option<u64> {
        match self {
            SavedIdentity::SeedOnly(_) => None,
            SavedIdentity::Full { samples: Some(n), .. } => Some(*n),
            SavedIdentity::Full { identity, samples: None } => step.checked_mul(identity.global_batch),
        }
    }

    /// The global batch the checkpoint's run had last, if recorded.
    pub fn global_batch(&self) -> Option<u64> {
        match self {
            SavedIdentity::SeedOnly(_) => None,
            SavedIdentity::Full { identity, .. } => Some(identity.global_batch),
        }
    }
}

/// A 64-bit FNV-1a fingerprint of `bytes`: their length, the first and the last MiB (a full
/// pass over a large corpus would cost seconds at every start).
pub fn fingerprint(bytes: &[u8]) -> u64 {
    const PART: usize = 1 << 20;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: &[u8]| {
        for &x in b {
            h = (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3);
        }
    };
    eat(&(bytes.len() as u64).to_le_bytes());
    eat(&bytes[..bytes.len().min(PART)]);
    eat(&bytes[bytes.len().saturating_sub(PART)..]);
    h
}

/// The distributed sampler (see the module documentation for the rule).
#[derive(Debug, Clone)]
pub struct Sampler {
    seq_len: usize,
    n_windows: u64,
    seed: u64,
    batch: usize,
    grad_accum: usize,
    world: usize,
    /// Where the run started: its first global step and the samples consumed before it (a
    /// resume, maybe from a run at another global batch).
    origin: (u64, u64),
    cached_epoch: Option<(u64, Vec<u32>)>,
}

impl Sampler {
    /// A sampler over `corpus_len` bytes.
    pub fn new(corpus_len: usize, seq_len: usize, seed: u64, batch: usize, grad_accum: usize, world: usize) -> Self {
        // Windows start every seq_len bytes and need seq_len + 1 bytes.
        let n_windows = ((corpus_len - 1) / seq_len) as u64;
        Sampler { seq_len, n_windows, seed, batch, grad_accum, world, origin: (0, 0), cached_epoch: None }
    }

    /// Resumes at global step `step` with `samples` consumed before it (by this global batch or
    /// others): step `step` takes the samples from there on, so none is skipped or seen twice
    /// when the world size changed between the save and the resume.
    pub fn resume_at(&mut self, step: u64, samples: u64) {
        self.origin = (step, samples);
    }

    /// The samples consumed before global step `step` (from the origin on, `global_batch` each).
    pub fn samples_before(&self, step: u64) -> u64 {
        let (first, before) = self.origin;
        before.saturating_add(step.saturating_sub(first).saturating_mul(self.global_batch()))
    }

    /// Windows per epoch.
    pub fn windows_per_epoch(&self) -> u64 {
        self.n_windows
    }

    /// Samples per global step (`batch × grad_accum × world`).
    pub fn global_batch(&self) -> u64 {
        (self.batch * self.grad_accum * self.world) as u64
    }

    /// The epoch global step `step` starts in.
    pub fn epoch_of(&self, step: u64) -> u64 {
        self.samples_before(step) / self.n_windows
    }

    fn window(&mut self, sample: u64) -> u64 {
        let epoch = sample / self.n_windows;
        let pos = (sample % self.n_windows) as usize;
        if self.cached_epoch.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let mut perm: Vec<u32> = (0..self.n_windows as u32).collect();
            let mut rng = SplitMix64::new(self.seed.wrapping_mul(0x100_0000_01B3) ^ epoch);
            for i in (1..perm.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                perm.swap(i, j);
            }
            self.cached_epoch = Some((epoch, perm));
        }
        // Invariant: the cache was filled for this epoch just above.
        self.cached_epoch.as_ref().map(|(_, p)| u64::from(p[pos])).unwrap_or(0)
    }

    /// The window starts (byte offsets) of `rank`'s micro-step `micro` of global step `step`.
    pub fn starts(&mut self, step: u64, rank: usize, micro: usize) -> Vec<usize> {
        let slot = (rank * self.grad_accum + micro) as u64;
        let base = self.samples_before(step).saturating_add(slot * self.batch as u64);
        (0..self.batch as u64).map(|i| self.window(base.saturating_add(i)) as usize * self.seq_len).collect()
    }

    /// Inputs and targets (`batch × seq_len` each, row-major) of one micro-step.
    pub fn batch(&mut self, corpus: &[u8], step: u64, rank: usize, micro: usize) -> (Vec<u32>, Vec<u32>) {
        let t = self.seq_len;
        let mut x = Vec::with_capacity(self.batch * t);
        let mut y = Vec::with_capacity(self.batch * t);
        for start in self.starts(step, rank, micro) {
            let w = &corpus[start..start + t + 1];
            x.extend(w[..t].iter().map(|b| u32::from(*b)));
            y.extend(w[1..].iter().map(|b| u32::from(*b)));
        }
        (x, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_identity_round_trips_and_names_each_difference() {
        let id = DataIdentity { seed: 1, global_batch: 16, data: fingerprint(b"hello world") };
        let saved = DataIdentity::decode(&id.encode()).unwrap();
        assert_eq!(saved, SavedIdentity::Full { identity: id, samples: None });
        assert_eq!(saved.samples_at(5), Some(80), "an older checkpoint's run had one global batch");
        assert_eq!(id.mismatch(&saved), None);
        let at = DataIdentity::decode(&id.encode_at(1234)).unwrap();
        assert_eq!(at, SavedIdentity::Full { identity: id, samples: Some(1234) });
        assert_eq!((at.samples_at(5), at.global_batch()), (Some(1234), Some(16)));
        // Another global batch resumes (at the samples consumed); another seed or data does not.
        let wider = DataIdentity { global_batch: 24, ..id };
        assert_eq!(wider.mismatch(&at), None);
        let other = DataIdentity { seed: 2, global_batch: 32, data: fingerprint(b"hello there") };
        let why = other.mismatch(&saved).unwrap();
        assert!(why.contains("--seed 2") && !why.contains("global batch") && why.contains("other data"), "{why}");
        // Older checkpoints saved the seed alone: only the seed is checked.
        assert_eq!(DataIdentity::decode(&1u64.to_le_bytes()), Some(SavedIdentity::SeedOnly(1)));
        assert_eq!(other.mismatch(&SavedIdentity::SeedOnly(2)), None);
        assert_eq!(DataIdentity::decode(b"junk"), None);
        // Between ranks: named by whose it is.
        let why = id.differences(&other, "rank 3's", "overlap").unwrap();
        assert!(why.contains("--seed 1 (rank 3's is 2") && why.contains("rank 3's is 32: overlap") && why.contains("rank 3's is "), "{why}");
        assert_eq!(id.differences(&id, "rank 1's", "x"), None);
        // The fingerprint sees the length and both ends.
        let big = vec![7u8; 3 << 20];
        let mut end = big.clone();
        *end.last_mut().unwrap() = 8;
        assert_ne!(fingerprint(&big), fingerprint(&end));
        assert_ne!(fingerprint(&big), fingerprint(&big[1..]));
    }

    #[test]
    fn data_with_more_windows_than_an_epoch_shuffles_is_refused() {
        // A sparse file: nothing is read, only its length counts.
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(5 << 30).unwrap();
        let e = Corpus::load(&DataSpec::File(f.path().to_path_buf()), 1, 0, 1).err().unwrap().to_string();
        assert!(e.contains("more than the 4294967295 one epoch can shuffle") && e.contains("--seq-len 1"), "{e}");
    }

    #[test]
    fn synthetic_is_deterministic_text() {
        let a = synthetic(1, 10_000);
        assert_eq!(a, synthetic(1, 10_000));
        assert_ne!(a, synthetic(2, 10_000));
        assert!(std::str::from_utf8(&a).is_ok());
        assert!(String::from_utf8_lossy(&a).contains(". "));
    }

    #[test]
    fn one_process_with_accumulation_sees_what_two_ranks_see() {
        let corpus = synthetic(3, 100_000);
        let mut single = Sampler::new(corpus.len(), 32, 7, 4, 2, 1);
        let mut two = Sampler::new(corpus.len(), 32, 7, 4, 1, 2);
        for step in [0, 1, 17, 500] {
            for slot in 0..2 {
                assert_eq!(single.batch(&corpus, step, 0, slot), two.batch(&corpus, step, slot, 0), "step {step} slot {slot}");
            }
        }
    }

    /// A run resumed at another global batch (another world size) takes the samples from where
    /// the checkpoint stopped: the two runs together see exactly what one run of one sample per
    /// step sees, across an epoch boundary too.
    #[test]
    fn a_resume_at_another_global_batch_continues_the_sample_sequence() {
        let corpus = synthetic(3, 32 * 40 + 1);
        let mut one = Sampler::new(corpus.len(), 32, 5, 1, 1, 1);
        let reference: Vec<usize> = (0..100).flat_map(|s| one.starts(s, 0, 0)).collect();
        // 6 steps at 2 ranks × batch 2 × accum 2 (8 samples), then 4 ranks × batch 3 (12).
        let mut first = Sampler::new(corpus.len(), 32, 5, 2, 2, 2);
        let mut seen = Vec::new();
        for step in 0..6 {
            for rank in 0..2 {
                for micro in 0..2 {
                    seen.extend(first.starts(step, rank, micro));
                }
            }
        }
        let mut second = Sampler::new(corpus.len(), 32, 5, 3, 1, 4);
        second.resume_at(6, first.samples_before(6));
        assert_eq!(second.samples_before(6), 48);
        for step in 6..10 {
            for rank in 0..4 {
                seen.extend(second.starts(step, rank, 0));
            }
        }
        assert_eq!(seen, reference[..96]);
        assert_eq!(second.epoch_of(10), 96 / 40);
    }

    #[test]
    fn every_window_once_per_epoch() {
        let corpus = synthetic(3, 32 * 64 + 1);
        let mut s = Sampler::new(corpus.len(), 32, 9, 2, 1, 2);
        assert_eq!(s.windows_per_epoch(), 64);
        let mut seen = Vec::new();
        for step in 0..16 {
            for rank in 0..2 {
                seen.extend(s.starts(step, rank, 0));
            }
        }
        seen.sort();
        assert_eq!(seen, (0..64).map(|w| w * 32).collect::<Vec<_>>());
        // The next epoch is another order of the same windows.
        let e1: Vec<usize> = s.starts(16, 0, 0);
        assert_eq!(s.epoch_of(16), 1);
        assert!(e1.iter().all(|x| x % 32 == 0));
    }

    #[test]
    fn bad_data_paths_are_rejected() {
        assert!("synthetic".parse::<DataSpec>().is_ok());
        let e = "/no/such/file".parse::<DataSpec>().unwrap_err();
        assert!(e.contains("neither `synthetic` nor a readable file"), "{e}");
    }
}
