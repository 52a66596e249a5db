//! The rsrun wire contract (protobuf package `rsrun.v1`), and the client side of the etcd v3 API
//! that the highly available rendezvous keeps its log in.
//!
//! Only `rsrun-rendezvous` and `rsrun-worker-runtime` (through the rendezvous client) link this crate;
//! the training engine never does.
#![allow(missing_docs, unreachable_pub, clippy::all)]

/// Generated messages and the `Rendezvous` service (client and server).
pub mod v1 {
    tonic::include_proto!("rsrun.v1");
}

/// etcd's v3 API, trimmed to what the HA rendezvous calls (KV, Watch, Lease, Maintenance.Status,
/// Auth.Authenticate), client side only. Wire-compatible with etcd >= 3.4.
pub mod etcd {
    /// etcd's key-value record and watch event.
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
    /// etcd's services and their messages.
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
}
