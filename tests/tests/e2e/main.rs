//! End-to-end tests: real `rsrun` processes, real workers, real rendezvous daemons on loopback.
//!
//! `cargo test --workspace` (or `cargo test -p rsrun-tests`) is all it takes: the first test that
//! needs a binary builds the workspace's binaries (see `rsrun_tests::bin`).

mod cli;
mod env;
mod exits;
mod gpu;
mod k8s;
mod logs;
mod multinode;
mod netns;
mod rdzv_faults;
mod remote;
mod restarts;
mod signals;
mod slurm;
mod static_rdzv;
mod torch;
mod train;
