//! Highly available rendezvous with real etcd (Debian's `etcd-server`, installed by `.ci/run`):
//! fault scenarios under traffic with a history checked after each (`history.rs`), and an
//! end-to-end job that rides through the loss of the leader daemon (`e2e.rs`).
//!
//! Without etcd the tests say so and skip; with `CI` set they fail instead.

mod e2e;
mod harness;
mod history;
mod scenarios;
