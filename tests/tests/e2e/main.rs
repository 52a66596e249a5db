//! End-to-end tests: real `rsrun` processes, real workers, real rendezvous daemons on loopback.
//!
//! Build the binaries first: `cargo build --workspace && cargo test -p rsrun-tests`.

mod cli;
mod env;
mod exits;
mod logs;
mod multinode;
mod netns;
mod rdzv_faults;
mod remote;
mod restarts;
mod signals;
mod torch;
mod train;
