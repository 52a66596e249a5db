//! On-disk formats: `metadata.json` and the shard file header.
//!
//! Shard file (`shard-00003.bin`):
//!
//! ```text
//! 0   magic  b"RSCKPT\0\x01"
//! 8   u32 LE header length H (bytes of JSON)
//! 12  u32 LE CRC-32 of the JSON header
//! 16  JSON header (ShardHeader), zero padding up to `data_start` (a multiple of 4096)
//! data_start  sections, raw little-endian f32, in header order: per unit the master shard,
//!             then each state slot; each section has its own CRC-32 in the header
//! ```

use serde::{Deserialize, Serialize};

use crate::layout::{FlatLayout, ParamInfo, UnitLayout};

/// Shard file magic.
pub(crate) const MAGIC: [u8; 8] = *b"RSCKPT\0\x01";
/// Version of both formats.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes before the JSON header.
pub(crate) const PREFIX: usize = 16;

/// One data section of a shard file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Section {
    pub unit: usize,
    /// 0 = master, 1 + s = state slot s.
    pub tensor: usize,
    /// Absolute byte offset in the file.
    pub offset: u64,
    /// Elements.
    pub len: usize,
    pub crc32: u32,
}

/// The header of a shard file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardHeader {
    pub format_version: u32,
    pub step: u64,
    pub shard_rank: usize,
    pub shard_world: usize,
    pub state_slots: usize,
    pub data_start: u64,
    pub file_size: u64,
    pub sections: Vec<Section>,
}

/// A parameter in the metadata table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamMeta {
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub numel: usize,
}

/// A unit in the metadata table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitMeta {
    pub name: String,
    pub numel: usize,
    pub padded_numel: usize,
    pub shard_len: usize,
    pub params: Vec<ParamMeta>,
}

/// One shard file as recorded by the commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMeta {
    pub name: String,
    pub shard_rank: usize,
    pub size: u64,
    /// CRC-32 of the file's JSON header (which holds every section's CRC-32).
    pub header_crc32: u32,
}

/// `metadata.json`: everything needed to load, reshard or consolidate the checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    pub format_version: u32,
    pub step: u64,
    /// Strategy name ([`crate::layout::Strategy::name`]).
    pub strategy: String,
    /// Ranks in the job that saved.
    pub world: usize,
    /// Shards per unit (the sharding group size; 1 for DDP).
    pub shard_world: usize,
    pub optimizer: String,
    pub state_slots: usize,
    pub loss_scale: Option<f32>,
    /// See [`crate::layout::ShardState::loss_scale_good_steps`] (0 in older checkpoints).
    #[serde(default)]
    pub loss_scale_good_steps: u32,
    /// Samples consumed (the data loader's position).
    pub data_position: u64,
    pub epoch: u64,
    /// RNG state bytes, hex.
    pub rng_state: String,
    pub units: Vec<UnitMeta>,
    pub files: Vec<FileMeta>,
    /// CRC-32 of this metadata as compact JSON with `checksum` left out ([`Metadata::crc`]):
    /// the shard files carry their own CRCs, and a flipped digit of `data_position` here would
    /// otherwise resume at another batch. Absent in older checkpoints (not checked then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<u32>,
}

impl Metadata {
    /// The CRC-32 that [`Metadata::checksum`] holds: over the compact JSON of every other field.
    pub fn crc(&self) -> u32 {
        let bare = Metadata { checksum: None, ..self.clone() };
        // Invariant: a struct of numbers, strings and vectors always encodes.
        crc32fast::hash(&serde_json::to_vec(&bare).unwrap_or_default())
    }

    /// The layout the checkpoint was saved with.
    pub fn layout(&self) -> FlatLayout {
        FlatLayout {
            world: self.shard_world,
            units: self
                .units
                .iter()
                .map(|u| UnitLayout {
                    name: u.name.clone(),
                    params: u
                        .params
                        .iter()
                        .map(|p| ParamInfo {
                            name: p.name.clone(),
                            shape: p.shape.clone(),
                            offset: p.offset,
                            numel: p.numel,
                        })
                        .collect(),
                    numel: u.numel,
                    padded_numel: u.padded_numel,
                    shard_len: u.shard_len,
                })
                .collect(),
        }
    }
}

pub(crate) fn units_meta(layout: &FlatLayout) -> Vec<UnitMeta> {
    layout
        .units
        .iter()
        .map(|u| UnitMeta {
            name: u.name.clone(),
            numel: u.numel,
            padded_numel: u.padded_numel,
            shard_len: u.shard_len,
            params: u
                .params
                .iter()
                .map(|p| ParamMeta {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    offset: p.offset,
                    numel: p.numel,
                })
                .collect(),
        })
        .collect()
}

pub(crate) fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// f32 slice as little-endian bytes.
pub(crate) fn f32_bytes(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        std::borrow::Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// Little-endian bytes to f32 values.
#[cfg(test)]
pub(crate) fn f32_from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
