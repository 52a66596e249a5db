//! A real job through a highly available group: two `rsrun` nodes (two workers each) list both
//! daemons; the leader daemon is `kill -9`'d in the middle of the job; the standby takes over and
//! the job finishes with every rank run exactly once (no worker restart).

use std::process::Output;
use std::time::{Duration, Instant};

use rsrun_tests::{KillOnDrop, RUN_DEADLINE, bin, code, rsrun, text};

use crate::harness::HaGroup;

fn node(dir: &std::path::Path, endpoints: &str, job: &str) -> KillOnDrop {
    let mut cmd = rsrun(dir);
    cmd.args(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", endpoints, "--rdzv-id", job])
        .args(["--rdzv-conf", "last_call_timeout=0.5,keep_alive_interval=0.5,keep_alive_max_attempt=20,join_timeout=60"])
        .arg(bin("hello"))
        .args(["--steps", "40", "--step-ms", "100"]);
    KillOnDrop::spawn(&mut cmd)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn a_job_rides_through_the_loss_of_the_leader_daemon() {
    let Some(mut g) = HaGroup::start("a_job_rides_through_the_loss_of_the_leader_daemon", 2, 2) else { return };
    let dir = tempfile::tempdir().unwrap();
    let eps = g.endpoints();
    let a = node(dir.path(), &eps, "ha-e2e");
    let b = node(dir.path(), &eps, "ha-e2e");
    // Let the round form and the workers start (they use the store and the unique-id exchange
    // through the group), then take the leader away for good.
    let client = g.client();
    let start = Instant::now();
    loop {
        let running = g.rt.block_on(client.status(Some("ha-e2e"))).ok().is_some_and(|s| s.jobs.iter().any(|j| j.world_size == 4));
        if running {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the job did not start\n{}", g.logs());
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(800));
    let old = g.wait_leader(Duration::from_secs(10));
    let t = Instant::now();
    g.kill9(old);
    let new = g.wait_new_leader(old, Duration::from_secs(20));
    eprintln!("leader d{old} killed; d{new} leads after {:.2?}", t.elapsed());
    let ta = std::thread::spawn(move || a.output_within(RUN_DEADLINE));
    let ob = b.output_within(RUN_DEADLINE);
    let oa = ta.join().unwrap();
    assert_eq!(code(&oa.status), 0, "{}", text(&oa));
    assert_eq!(code(&ob.status), 0, "{}", text(&ob));
    let all = stdout(&oa) + &stdout(&ob);
    for rank in 0..4 {
        assert_eq!(all.matches(&format!("rank {rank} done")).count(), 1, "rank {rank} ran more or less than once:\n{all}");
    }
    assert!(!all.contains("restart 1"), "workers were restarted:\n{all}");
    // The job completed in the new leader's state.
    let st = g.rt.block_on(client.status(Some("ha-e2e"))).expect("status");
    let view = st.jobs[0].view.clone().expect("view");
    assert_eq!(view.state, rsrun_rendezvous::proto::JobState::Completed as i32, "{view:?}");
}
