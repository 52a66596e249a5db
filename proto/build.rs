//! Compiles `proto/rsrun/v1/*.proto` (the rendezvous service and the remote-launch messages) and the
//! trimmed etcd v3 client API (`proto/etcd/`, client side only) with a vendored `protoc`, so no
//! system install is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure().compile_protos(&["proto/rsrun/v1/rendezvous.proto", "proto/rsrun/v1/launch.proto"], &["proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&["proto/etcd/etcdserverpb/rpc.proto", "proto/etcd/mvccpb/kv.proto"], &["proto"])?;
    Ok(())
}
