//! `gpu-smoke` up to the hardware boundary: with the `nccl` feature it runs NCCL on a GPU where
//! there is one and otherwise exits 77 naming what is missing; without the feature it says how to
//! build it. Both directly and under rsrun (whose exit code is the worker's).

use rsrun_tests::{bin_with_features, code, rsrun, run, text};

fn gpu_present() -> bool {
    std::path::Path::new("/dev/nvidiactl").exists()
}

#[test]
fn gpu_smoke_runs_or_says_why_not() {
    let dir = tempfile::tempdir().unwrap();
    let smoke = bin_with_features("rsrun-examples", "gpu-smoke", "nccl", dir.path());
    let out = run(std::process::Command::new(&smoke).args(["--mib", "16", "--iters", "3"]).current_dir(dir.path()));
    let t = text(&out);
    if gpu_present() {
        assert_eq!(code(&out.status), 0, "{t}");
        assert!(t.contains("summary: gpu_smoke=pass world=1"), "{t}");
    } else {
        assert_eq!(code(&out.status), 77, "{t}");
        assert!(t.contains("gpu-smoke: skipped:") && t.contains("libcuda"), "{t}");
    }
    // Under rsrun: the unique id goes through the rendezvous; the exit code is the worker's.
    let out = run(rsrun(dir.path()).args(["--standalone", "--nproc-per-node", "1"]).arg(&smoke).args(["--mib", "16", "--iters", "3"]));
    let t = text(&out);
    if gpu_present() {
        assert_eq!(code(&out.status), 0, "{t}");
        assert!(t.contains("unique_id=rendezvous"), "{t}");
    } else {
        assert_eq!(code(&out.status), 77, "{t}");
        assert!(t.contains("skipped:"), "{t}");
    }
}

#[test]
fn gpu_smoke_without_the_feature_says_how_to_build_it() {
    // A copy of its own: the test above builds the featured binary at the same path.
    let dir = tempfile::tempdir().unwrap();
    let smoke = bin_with_features("rsrun-examples", "gpu-smoke", "", dir.path());
    let out = run(&mut std::process::Command::new(&smoke));
    let t = text(&out);
    assert_eq!(code(&out.status), 77, "{t}");
    assert!(t.contains("--features nccl"), "{t}");
}
