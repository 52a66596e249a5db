//! The rsrun wire contract (protobuf package `rsrun.v1`).
//!
//! Only `rsrun-rendezvous` and `rsrun-worker-runtime` (through the rendezvous client) link this crate;
//! the training engine never does.
#![allow(missing_docs, unreachable_pub, clippy::all)]

/// Generated messages and the `Rendezvous` service (client and server).
pub mod v1 {
    tonic::include_proto!("rsrun.v1");
}
