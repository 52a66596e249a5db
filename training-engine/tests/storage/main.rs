//! Storage tests: NVMe/CPU offload and checkpoints with real files, a real tmpfs for ENOSPC
//! (when mounting is permitted), and child processes killed mid-save.

mod crash;
mod enospc;
mod rss;
mod support;
