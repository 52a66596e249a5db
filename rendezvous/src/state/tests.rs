//! State-machine tests. Time is a plain number here: every test controls it exactly.

use super::*;
use proptest::prelude::*;

const LEASE: u64 = 1_000;
const LAST_CALL: u64 = 500;

fn spec(min: u32, max: u32, restarts: u32) -> JobSpec {
    JobSpec { min_nodes: min, max_nodes: max, last_call_ms: LAST_CALL, lease_ms: LEASE, max_restarts: restarts, fixed_ranks: false }
}

fn join_cmd(node: &str, lws: u32, hint: Option<u32>, spec: &JobSpec) -> Command {
    Command::Join(JoinCmd {
        job: "job".into(),
        node: node.into(),
        addrs: vec![format!("10.0.0.{}", node.len())],
        hostname: format!("host-{node}"),
        local_world_size: lws,
        rank_hint: hint,
        master_port: 29500,
        spec: spec.clone(),
    })
}

struct World {
    state: State,
    limits: Limits,
    spec: JobSpec,
    now: Ms,
}

impl World {
    fn new(min: u32, max: u32, restarts: u32) -> Self {
        World { state: State::default(), limits: Limits::default(), spec: spec(min, max, restarts), now: 1_000_000 }
    }

    fn apply(&mut self, cmd: Command) -> Result<Outcome, RdzvError> {
        self.state.apply(&cmd, self.now, &self.limits).map(|(o, _)| o)
    }

    fn join(&mut self, node: &str) -> Result<Outcome, RdzvError> {
        self.join_with(node, 1, None)
    }

    fn join_with(&mut self, node: &str, lws: u32, hint: Option<u32>) -> Result<Outcome, RdzvError> {
        let cmd = join_cmd(node, lws, hint, &self.spec);
        self.apply(cmd)
    }

    /// Advances time and applies whatever became due, as the executor does.
    fn advance(&mut self, ms: u64) {
        let end = self.now + ms;
        loop {
            let next = self.state.next_deadline(&self.limits).filter(|d| *d <= end);
            let Some(next) = next else { break };
            self.now = self.now.max(next);
            for cmd in self.state.due(self.now, &self.limits) {
                let _ = self.apply(cmd);
            }
        }
        self.now = end;
    }

    fn keep_alive(&mut self, nodes: &[&str]) {
        for n in nodes {
            self.apply(Command::KeepAlive { job: "job".into(), node: (*n).into() }).unwrap();
        }
    }

    fn job(&self) -> &Job {
        self.state.job("job").unwrap()
    }

    fn ranks(&self) -> Vec<(String, u32)> {
        match &self.job().phase {
            Phase::Running { members, .. } => {
                let mut v: Vec<_> = members.iter().map(|(id, m)| (id.clone(), m.node_rank)).collect();
                v.sort_by_key(|(_, r)| *r);
                v
            }
            p => panic!("not running: {p:?}"),
        }
    }

    fn state_name(&self) -> pb::JobState {
        pb::JobState::try_from(self.job().view().state).unwrap()
    }
}

fn scope(round: u64) -> Scope {
    Scope { job: "job".into(), round, round_scoped: false }
}

#[test]
fn closes_at_max_immediately() {
    let mut w = World::new(2, 3, 0);
    w.join("a").unwrap();
    w.join("b").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Forming);
    w.join("c").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Running);
    assert_eq!(w.ranks().len(), 3);
    let a = w.state.assignment("job", "a").unwrap().unwrap();
    assert_eq!(a.round.as_ref().unwrap().round, 1);
    assert_eq!(a.round.as_ref().unwrap().world_size, 3);
}

#[test]
fn last_call_waits_after_min_then_closes() {
    let mut w = World::new(2, 4, 0);
    w.join("a").unwrap();
    for _ in 0..10 {
        w.advance(LEASE - 1); // below min: nothing happens, however long
        w.keep_alive(&["a"]);
    }
    assert_eq!(w.state_name(), pb::JobState::Forming);
    w.join("b").unwrap();
    w.advance(LAST_CALL - 1);
    assert_eq!(w.state_name(), pb::JobState::Forming, "closed before the last call ended");
    w.join("c").unwrap(); // arrives during last call and gets in
    w.advance(1);
    assert_eq!(w.state_name(), pb::JobState::Running);
    assert_eq!(w.ranks().len(), 3);
}

#[test]
fn below_min_never_closes_and_last_call_resets_when_a_node_leaves() {
    let mut w = World::new(2, 4, 0);
    w.join("a").unwrap();
    w.join("b").unwrap();
    w.advance(LAST_CALL / 2);
    w.apply(Command::Leave { job: "job".into(), node: "b".into(), reason: String::new() }).unwrap();
    w.advance(LAST_CALL);
    assert_eq!(w.state_name(), pb::JobState::Forming);
    assert_eq!(w.job().view().joined_count, 1);
}

#[test]
fn lease_expiry_ends_round_and_survivors_reform_without_last_call() {
    let mut w = World::new(1, 3, 0);
    for n in ["a", "b", "c"] {
        w.join(n).unwrap();
    }
    assert_eq!(w.state_name(), pb::JobState::Running);
    let before = w.ranks();
    w.advance(LEASE / 2);
    w.keep_alive(&["a", "b"]);
    w.advance(LEASE / 2); // c expires now
    assert_eq!(w.state_name(), pb::JobState::Forming);
    assert_eq!(w.job().round, 2);
    assert!(w.job().reason.contains("node c lost its lease"), "{}", w.job().reason);
    // Restarts are free for membership changes.
    assert_eq!(w.job().restart_count, 0);
    w.join("a").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Forming, "must wait for b, an expected survivor");
    w.join("b").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Running, "every survivor is back: no last-call wait");
    // Sticky: a and b keep their ranks where possible.
    let after = w.ranks();
    for (id, r) in &after {
        let old = before.iter().find(|(i, _)| i == id).unwrap().1;
        if old < 2 {
            assert_eq!(*r, old, "{id} moved from {old} to {r}");
        }
    }
}

/// A failure report of `node` for `round`, as a launcher sends it.
fn report(node: &str, round: u64) -> Command {
    let failure = Failure {
        node_id: node.into(),
        round,
        rank: 0,
        local_rank: 0,
        exit_code: 1,
        signal: 0,
        message: "worker exited 1".into(),
        time_unix_ms: 5,
        hostname: format!("host-{node}"),
    };
    Command::ReportFailure { job: "job".into(), round, node: node.into(), failure, restartable: true }
}

/// Spares take only the places survivors leave: after a failure, the survivors are in the next
/// round with their ranks, and the spare keeps waiting.
#[test]
fn spares_do_not_displace_survivors() {
    let mut w = World::new(1, 2, 3);
    w.join("a").unwrap();
    w.join("b").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Running);
    w.join("c").unwrap();
    assert_eq!(w.job().view().nodes_waiting, 1);
    w.apply(report("a", 1)).unwrap();
    assert_eq!(w.job().round, 2);
    w.join("a").unwrap();
    w.join("b").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Running);
    assert_eq!(w.ranks(), vec![("a".to_string(), 0), ("b".to_string(), 1)]);
    assert_eq!(w.job().view().nodes_waiting, 1, "c is still the spare");
}

/// A survivor that dies while the next round forms (its peer's workers failed first, and its
/// lease ran out later) leaves a place for the spare: the round forms with it, instead of
/// staying below min with the spare stranded.
#[test]
fn a_spare_takes_the_place_of_a_survivor_that_dies_while_the_round_forms() {
    let mut w = World::new(2, 2, 3);
    w.join("a").unwrap();
    w.join("b").unwrap();
    w.join("c").unwrap();
    assert_eq!(w.job().view().nodes_waiting, 1);
    w.apply(report("a", 1)).unwrap();
    assert_eq!(w.job().round, 2);
    w.join("a").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Forming, "b is an expected survivor");
    // b's host is gone: its lease runs out (a and c keep theirs).
    for _ in 0..3 {
        w.advance(LEASE / 2);
        w.keep_alive(&["a", "c"]);
    }
    assert!(!w.job().nodes.contains_key("b"));
    assert_eq!(w.state_name(), pb::JobState::Running, "the spare was stranded");
    assert_eq!(w.ranks(), vec![("a".to_string(), 0), ("c".to_string(), 1)]);
    assert_eq!(w.job().view().nodes_waiting, 0);
}

/// A newcomer that joins while a round forms after a failure waits as a spare while every place
/// is a survivor's: it does not put a survivor (and its sticky rank) out of the round.
#[test]
fn a_newcomer_does_not_take_a_place_a_survivor_comes_back_to() {
    let mut w = World::new(1, 2, 3);
    w.join("a").unwrap();
    w.join("b").unwrap();
    w.apply(report("a", 1)).unwrap();
    w.join("d").unwrap();
    assert_eq!(w.job().view().nodes_waiting, 1, "d took a survivor's place");
    w.join("a").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Forming, "b is an expected survivor");
    w.join("b").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Running);
    assert_eq!(w.ranks(), vec![("a".to_string(), 0), ("b".to_string(), 1)]);
    assert_eq!(w.job().view().nodes_waiting, 1, "d is the spare");
}

/// After a round ends, a survivor still tearing its workers down is waited for past the last
/// call, up to a lease (closing without it made its return a scale-up that ended the round
/// again, round after round while teardown took longer than the last call).
#[test]
fn a_slow_survivor_is_waited_for_past_the_last_call() {
    let mut w = World::new(1, 2, 1);
    w.join("a").unwrap();
    w.join("b").unwrap();
    w.apply(report("b", 1)).unwrap();
    w.join("b").unwrap();
    w.advance(LAST_CALL + 1);
    w.keep_alive(&["a", "b"]);
    assert_eq!(w.state_name(), pb::JobState::Forming, "a, a survivor, is still tearing down");
    w.join("a").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Running);
    assert_eq!(w.job().round, 2);
    assert_eq!(w.ranks(), vec![("a".to_string(), 0), ("b".to_string(), 1)]);
}

#[test]
fn survivor_below_min_waits_for_replacement() {
    let mut w = World::new(2, 2, 0);
    w.join("a").unwrap();
    w.join("b").unwrap();
    w.apply(Command::Leave { job: "job".into(), node: "b".into(), reason: "preempted".into() }).unwrap();
    assert!(w.job().reason.contains("node b left: preempted"));
    w.join("a").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Forming);
    w.join("z").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Running);
    assert_eq!(w.job().round, 2);
}

#[test]
fn late_joiner_triggers_scale_up_and_spare_waits_at_max() {
    let mut w = World::new(1, 2, 0);
    w.join("a").unwrap();
    w.advance(LAST_CALL);
    assert_eq!(w.state_name(), pb::JobState::Running);
    assert_eq!(w.job().round, 1);
    w.join("b").unwrap();
    // Round 1 ended for the scale-up; b is already in round 2, a must re-join.
    assert_eq!(w.job().round, 2);
    assert!(w.job().reason.contains("scale-up"));
    assert_eq!(w.state_name(), pb::JobState::Forming);
    w.join("a").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Running);
    assert_eq!(w.ranks(), vec![("a".to_string(), 0), ("b".to_string(), 1)]);
    // At max, a third node is a spare: no restart.
    w.join("c").unwrap();
    assert_eq!(w.job().round, 2);
    assert_eq!(w.job().view().nodes_waiting, 1);
    assert_eq!(w.state_name(), pb::JobState::Running);
    // When b dies, c takes its place in round 3.
    w.apply(Command::Leave { job: "job".into(), node: "b".into(), reason: String::new() }).unwrap();
    assert_eq!(w.job().round, 3);
    w.join("a").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Running);
    assert_eq!(w.ranks(), vec![("a".to_string(), 0), ("c".to_string(), 1)]);
}

#[test]
fn hints_are_honoured_and_conflicts_go_to_smaller_id() {
    let mut w = World::new(3, 3, 0);
    w.join_with("n1", 1, Some(2)).unwrap();
    w.join_with("n0", 1, Some(2)).unwrap();
    w.join_with("n2", 1, Some(7)).unwrap(); // out of range: ignored
    assert_eq!(
        w.ranks(),
        vec![("n1".to_string(), 0), ("n2".to_string(), 1), ("n0".to_string(), 2)],
    );
}

#[test]
fn fixed_ranks_are_kept_and_a_duplicate_fails_the_job_naming_both() {
    let mut w = World::new(3, 3, 2);
    w.spec.fixed_ranks = true;
    w.join_with("b", 1, Some(2)).unwrap();
    w.join_with("a", 1, Some(1)).unwrap();
    w.join_with("c", 1, Some(0)).unwrap();
    // Ranks as named, not by node id.
    assert_eq!(w.ranks(), vec![("c".to_string(), 0), ("a".to_string(), 1), ("b".to_string(), 2)]);

    let mut w = World::new(3, 3, 2);
    w.spec.fixed_ranks = true;
    w.join_with("n0", 1, Some(0)).unwrap();
    w.join_with("n1", 1, Some(1)).unwrap();
    // A retried join of the same node is not a duplicate.
    w.join_with("n1", 1, Some(1)).unwrap();
    assert!(matches!(w.job().phase, Phase::Forming { .. }));
    w.join_with("other", 1, Some(1)).unwrap();
    assert!(matches!(w.job().phase, Phase::Failed { .. }), "{:?}", w.job().phase);
    let reason = &w.job().reason;
    assert!(reason.contains("duplicate node rank 1") && reason.contains("host-n1") && reason.contains("host-other"), "{reason}");
    // Every node is refused with the reason from now on.
    let e = w.join_with("n2", 1, Some(2)).unwrap_err().to_string();
    assert!(e.contains("duplicate node rank 1"), "{e}");
}

#[test]
fn fixed_ranks_need_a_rank_in_range_and_a_fixed_node_count() {
    let mut w = World::new(2, 2, 0);
    w.spec.fixed_ranks = true;
    for hint in [None, Some(2)] {
        let e = w.join_with("n0", 1, hint).unwrap_err().to_string();
        assert!(e.contains("rank_hint") && e.contains("0..2"), "{e}");
        // Refused, the join changed nothing: no job was created for it (a journal replay would not
        // have it, and its spec would be held against the next join).
        assert!(w.state.jobs.is_empty(), "a refused join created its job");
    }
    // Nor does a refused join start over a job that ended.
    w.join_with("n0", 1, Some(0)).unwrap();
    w.join_with("n1", 1, Some(1)).unwrap();
    w.apply(Command::FailJob { job: "job".into(), node: "n0".into(), reason: "boom".into() }).unwrap();
    for n in ["n0", "n1"] {
        w.apply(Command::Leave { job: "job".into(), node: n.into(), reason: String::new() }).unwrap();
    }
    let before = format!("{:?}", w.state.jobs["job"].phase);
    assert!(w.join_with("n2", 1, None).is_err());
    assert_eq!(format!("{:?}", w.state.jobs["job"].phase), before);
    let mut w = World::new(1, 2, 0);
    w.spec.fixed_ranks = true;
    let e = w.join_with("n0", 1, Some(0)).unwrap_err().to_string();
    assert!(e.contains("fixed_ranks") && e.contains("1:2"), "{e}");
}

#[test]
fn ranks_do_not_depend_on_arrival_order() {
    let mut a = World::new(3, 3, 0);
    let mut b = World::new(3, 3, 0);
    for n in ["x", "y", "z"] {
        a.join(n).unwrap();
    }
    for n in ["z", "x", "y"] {
        b.join(n).unwrap();
    }
    assert_eq!(a.ranks(), b.ranks());
}

#[test]
fn heterogeneous_worker_counts_give_offsets_and_world_size() {
    let mut w = World::new(3, 3, 0);
    w.join_with("a", 4, Some(0)).unwrap();
    w.join_with("b", 2, Some(1)).unwrap();
    w.join_with("c", 3, Some(2)).unwrap();
    let ra = w.state.assignment("job", "a").unwrap().unwrap();
    let rb = w.state.assignment("job", "b").unwrap().unwrap();
    let rc = w.state.assignment("job", "c").unwrap().unwrap();
    assert_eq!(ra.round.as_ref().unwrap().world_size, 9);
    assert_eq!(ra.round.as_ref().unwrap().num_nodes, 3);
    assert_eq!(ra.node.as_ref().unwrap().rank_offset, 0);
    assert_eq!(rb.node.as_ref().unwrap().rank_offset, 4);
    assert_eq!(rc.node.as_ref().unwrap().rank_offset, 6);
    // Master is the group-rank-0 node's first address and reserved port.
    assert_eq!(ra.round.as_ref().unwrap().master_addr, "10.0.0.1");
    assert_eq!(ra.round.as_ref().unwrap().master_port, 29500);
}

#[test]
fn failure_restarts_within_global_budget_then_fails() {
    let mut w = World::new(2, 2, 1);
    w.join("a").unwrap();
    w.join("b").unwrap();
    let failure = Failure {
        node_id: "b".into(),
        round: 1,
        rank: 1,
        local_rank: 0,
        exit_code: 7,
        signal: 0,
        message: "boom".into(),
        time_unix_ms: 5,
        hostname: "host-b".into(),
    };
    let out = w
        .apply(Command::ReportFailure { job: "job".into(), round: 1, node: "b".into(), failure: failure.clone(), restartable: true })
        .unwrap();
    assert_eq!(out, Outcome::Decision(pb::FailureDecision::Restart));
    assert_eq!(w.job().restart_count, 1);
    assert_eq!(w.job().round, 2);
    // The peer's report for the ended round is fenced off and costs nothing.
    let err = w
        .apply(Command::ReportFailure { job: "job".into(), round: 1, node: "a".into(), failure: failure.clone(), restartable: true })
        .unwrap_err();
    assert!(matches!(err, RdzvError::StaleRound { given: 1, current: 2, .. }), "{err}");
    w.join("a").unwrap();
    w.join("b").unwrap();
    assert_eq!(w.state.assignment("job", "a").unwrap().unwrap().round.unwrap().restart_count, 1);
    let out = w
        .apply(Command::ReportFailure { job: "job".into(), round: 2, node: "a".into(), failure, restartable: true })
        .unwrap();
    assert_eq!(out, Outcome::Decision(pb::FailureDecision::Failed));
    assert_eq!(w.state_name(), pb::JobState::Failed);
    let view = w.job().view();
    assert!(view.reason.contains("restart budget exhausted (1 of 1 used)"), "{}", view.reason);
    assert_eq!(view.root_cause.unwrap().node_id, "a");
    // A failed job refuses joins with its reason.
    let err = w.join("c").unwrap_err().to_string();
    assert!(err.contains("has failed") && err.contains("rank 1 on node a failed with exit code 7"), "{err}");
}

#[test]
fn not_restartable_failure_fails_at_once() {
    let mut w = World::new(1, 1, 5);
    w.join("a").unwrap();
    let f = Failure { node_id: "a".into(), round: 1, rank: 0, local_rank: 0, exit_code: 1, signal: 0, message: String::new(), time_unix_ms: 0, hostname: String::new() };
    let out = w
        .apply(Command::ReportFailure { job: "job".into(), round: 1, node: "a".into(), failure: f, restartable: false })
        .unwrap();
    assert_eq!(out, Outcome::Decision(pb::FailureDecision::Failed));
}

/// The node whose first report failed the job refines its root cause (the full report once its
/// workers are stopped); the job's reason follows; a peer's report after the failure changes nothing.
#[test]
fn the_root_cause_node_refines_its_report_and_no_other_node_can() {
    let mut w = World::new(2, 2, 0);
    w.join("a").unwrap();
    w.join("b").unwrap();
    let early = Failure { node_id: "a".into(), round: 1, rank: 3, local_rank: 1, exit_code: 7, signal: 0, message: String::new(), time_unix_ms: 100, hostname: "host-a".into() };
    let out = w.apply(Command::ReportFailure { job: "job".into(), round: 1, node: "a".into(), failure: early.clone(), restartable: true }).unwrap();
    assert_eq!(out, Outcome::Decision(pb::FailureDecision::Failed));
    // The peer's cascade failure comes second: refused with the job's end, the root stays a's.
    let peer = Failure { node_id: "b".into(), rank: 0, local_rank: 0, exit_code: 9, time_unix_ms: 90, ..early.clone() };
    let err = w.apply(Command::ReportFailure { job: "job".into(), round: 1, node: "b".into(), failure: peer, restartable: true }).unwrap_err();
    assert!(matches!(err, RdzvError::JobEnded { .. }), "{err}");
    assert_eq!(w.job().root_cause.as_ref().unwrap().rank, 3);
    // a's full report: the error-file rule picked its other rank, with the traceback.
    let full = Failure { rank: 2, local_rank: 0, exit_code: 3, message: "ValueError: bad shard".into(), time_unix_ms: 99, ..early.clone() };
    let out = w.apply(Command::ReportFailure { job: "job".into(), round: 1, node: "a".into(), failure: full.clone(), restartable: true }).unwrap();
    assert_eq!(out, Outcome::Decision(pb::FailureDecision::Failed));
    let view = w.job().view();
    let root = view.root_cause.unwrap();
    assert_eq!((root.rank, root.exit_code, root.message.as_str()), (2, 3, "ValueError: bad shard"));
    assert!(view.reason.contains("rank 2 on node a failed with exit code 3"), "{}", view.reason);
    assert!(!view.reason.contains("rank 3"), "{}", view.reason);
    assert_eq!(w.job().failures.iter().filter(|f| f.node_id == "a").count(), 1, "the early report was replaced, not kept beside");
    // The same report again is answered alike and changes nothing.
    let out = w.apply(Command::ReportFailure { job: "job".into(), round: 1, node: "a".into(), failure: full, restartable: true }).unwrap();
    assert_eq!(out, Outcome::Decision(pb::FailureDecision::Failed));
}

#[test]
fn fail_job_is_fail_fast_from_any_node() {
    let mut w = World::new(2, 2, 3);
    w.join("a").unwrap();
    w.join("b").unwrap();
    // A node that is not the job's (a straggler of an earlier run under the same id) cannot.
    let e = w.job().check_may_fail("old").unwrap_err();
    assert!(e.to_string().contains("only a node of the job can fail it"), "{e}");
    w.job().check_may_fail("b").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Running);
    w.apply(Command::FailJob { job: "job".into(), node: "b".into(), reason: "out of memory".into() }).unwrap();
    assert_eq!(w.state_name(), pb::JobState::Failed);
    assert!(w.job().reason.contains("out of memory"));
    // A worker failure that node reports afterwards does not replace the reason it failed the
    // job with: only a worker's failure is refined.
    let f = Failure { node_id: "b".into(), round: 1, rank: 1, local_rank: 0, exit_code: 1, signal: 0, message: String::new(), time_unix_ms: 0, hostname: String::new() };
    let e = w.apply(Command::ReportFailure { job: "job".into(), round: 1, node: "b".into(), failure: f, restartable: true }).unwrap_err();
    assert!(matches!(e, RdzvError::JobEnded { .. }), "{e}");
    assert!(w.job().reason.contains("out of memory"));
}

#[test]
fn finish_completes_when_every_member_finished_even_after_leave() {
    let mut w = World::new(2, 2, 0);
    w.join("a").unwrap();
    w.join("b").unwrap();
    w.apply(Command::Finish { job: "job".into(), round: 1, node: "a".into() }).unwrap();
    // a leaves after finishing: the round does not end.
    w.apply(Command::Leave { job: "job".into(), node: "a".into(), reason: String::new() }).unwrap();
    assert_eq!(w.state_name(), pb::JobState::Running);
    // A newcomer while nodes finish does not restart anybody.
    w.join("late").unwrap();
    assert_eq!(w.job().round, 1);
    w.apply(Command::Finish { job: "job".into(), round: 1, node: "b".into() }).unwrap();
    assert_eq!(w.state_name(), pb::JobState::Completed);
    let err = w.join("other").unwrap_err().to_string();
    assert!(err.contains("has completed"), "{err}");
    // Completed jobs are forgotten after the retention time.
    w.advance(w.limits.retention_ms + 1);
    assert!(w.state.jobs.is_empty());
}

#[test]
fn an_ended_job_that_everyone_left_starts_over_under_the_same_id() {
    let mut w = World::new(1, 1, 0);
    w.join("a").unwrap();
    w.apply(Command::Finish { job: "job".into(), round: 1, node: "a".into() }).unwrap();
    assert_eq!(w.state_name(), pb::JobState::Completed);
    w.apply(Command::Leave { job: "job".into(), node: "a".into(), reason: String::new() }).unwrap();
    w.join("a").unwrap();
    assert_eq!(w.state_name(), pb::JobState::Running);
    assert_eq!(w.job().round, 2, "rounds keep counting so old writers stay fenced off");
    assert_eq!(w.job().restart_count, 0);
}

#[test]
fn stale_round_writes_are_fenced() {
    let mut w = World::new(1, 1, 0);
    w.join("a").unwrap();
    w.apply(Command::StoreSet { scope: scope(1), key: "k".into(), value: b"v".to_vec(), request_id: String::new() }).unwrap();
    w.apply(Command::Leave { job: "job".into(), node: "a".into(), reason: String::new() }).unwrap();
    let err = w.apply(Command::StoreSet { scope: scope(1), key: "k".into(), value: b"w".to_vec(), request_id: String::new() }).unwrap_err();
    assert!(matches!(err, RdzvError::StaleRound { given: 1, current: 2, .. }));
    // Job-scoped data survives the round change; reads are not fenced.
    assert_eq!(w.job().get(&scope(1), "k").unwrap(), Some(&b"v".to_vec()));
}

#[test]
fn round_scoped_keys_and_unique_ids_are_dropped_with_the_round() {
    let mut w = World::new(1, 2, 1);
    w.join("a").unwrap();
    w.advance(LAST_CALL);
    let rs = Scope { job: "job".into(), round: 1, round_scoped: true };
    w.apply(Command::StoreSet { scope: rs.clone(), key: "k".into(), value: b"v".to_vec(), request_id: String::new() }).unwrap();
    w.apply(Command::PublishUniqueId { job: "job".into(), round: 1, rank: 0, name: String::new(), id: vec![7; 128] }).unwrap();
    assert_eq!(w.job().store_bytes, 2);
    w.join("b").unwrap(); // scale-up ends round 1
    assert_eq!(w.job().round_store.len(), 0);
    assert_eq!(w.job().store_bytes, 0);
    assert!(w.job().unique_ids.is_empty());
    assert!(w.job().get(&rs, "k").is_err());
}

#[test]
fn unique_id_is_write_once_and_rank_zero_only() {
    let mut w = World::new(1, 1, 0);
    w.join("a").unwrap();
    let publish = |rank, byte, len| Command::PublishUniqueId { job: "job".into(), round: 1, rank, name: String::new(), id: vec![byte; len] };
    let err = w.apply(publish(3, 1, 128)).unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied);
    let err = w.apply(publish(0, 1, 127)).unwrap_err();
    assert!(err.to_string().contains("127 bytes"), "{err}");
    w.apply(publish(0, 1, 128)).unwrap();
    w.apply(publish(0, 1, 128)).unwrap(); // idempotent retry
    let err = w.apply(publish(0, 2, 128)).unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists);
    let err = w
        .apply(Command::PublishUniqueId { job: "job".into(), round: 9, rank: 0, name: String::new(), id: vec![1; 128] })
        .unwrap_err();
    assert!(matches!(err, RdzvError::StaleRound { .. }));
}

#[test]
fn store_ops_add_cas_delete_and_dedup() {
    let mut w = World::new(1, 1, 0);
    w.join("a").unwrap();
    let add = |d, id: &str| Command::StoreAdd { scope: scope(1), key: "n".into(), delta: d, request_id: id.into() };
    assert_eq!(w.apply(add(5, "r1")).unwrap(), Outcome::Added(5));
    assert_eq!(w.apply(add(5, "r1")).unwrap(), Outcome::Added(5), "a retried add is not applied twice");
    assert_eq!(w.apply(add(-2, "")).unwrap(), Outcome::Added(3));
    assert_eq!(w.apply(add(i64::MAX, "")).unwrap_err().code(), tonic::Code::InvalidArgument);
    w.apply(Command::StoreSet { scope: scope(1), key: "s".into(), value: b"text".to_vec(), request_id: String::new() }).unwrap();
    let err = w.apply(Command::StoreAdd { scope: scope(1), key: "s".into(), delta: 1, request_id: String::new() }).unwrap_err();
    assert!(err.to_string().contains("not a decimal integer"));
    let cas = |exp: Option<&[u8]>, des: &[u8], id: &str| Command::StoreCas {
        scope: scope(1),
        key: "c".into(),
        expected: exp.map(<[u8]>::to_vec),
        desired: des.to_vec(),
        request_id: id.into(),
    };
    assert_eq!(w.apply(cas(None, b"1", "c1")).unwrap(), Outcome::Cas { swapped: true, current: Some(b"1".to_vec()) });
    assert_eq!(w.apply(cas(None, b"1", "c1")).unwrap(), Outcome::Cas { swapped: true, current: Some(b"1".to_vec()) });
    assert_eq!(w.apply(cas(None, b"2", "")).unwrap(), Outcome::Cas { swapped: false, current: Some(b"1".to_vec()) });
    assert_eq!(w.apply(cas(Some(b"1"), b"2", "")).unwrap(), Outcome::Cas { swapped: true, current: Some(b"2".to_vec()) });
    assert_eq!(w.apply(Command::StoreDelete { scope: scope(1), key: "c".into(), request_id: String::new() }).unwrap(), Outcome::Deleted(true));
    assert_eq!(w.apply(Command::StoreDelete { scope: scope(1), key: "c".into(), request_id: String::new() }).unwrap(), Outcome::Deleted(false));
}

/// A set whose first attempt was applied (its answer lost) and is retried with the same request
/// id after another client's set is answered from memory: it does not overwrite the other
/// client's value. The same for a multi-set.
#[test]
fn a_retried_set_does_not_overwrite_a_later_write() {
    let mut w = World::new(1, 1, 0);
    w.join("a").unwrap();
    let set = |v: &[u8], id: &str| Command::StoreSet { scope: scope(1), key: "k".into(), value: v.to_vec(), request_id: id.into() };
    let get = |w: &World, k: &str| w.job().get(&scope(1), k).unwrap().cloned();
    assert_eq!(w.apply(set(b"first", "s1")).unwrap(), Outcome::Done);
    assert_eq!(w.apply(set(b"second", "s2")).unwrap(), Outcome::Done);
    let (outcome, effects) = w.state.apply(&set(b"first", "s1"), w.now, &w.limits).unwrap();
    assert_eq!(outcome, Outcome::Done, "the first attempt's answer");
    assert_eq!(effects, Effects::default(), "a replayed answer changes nothing: nothing to journal, no waiter to wake");
    assert_eq!(get(&w, "k"), Some(b"second".to_vec()), "the retry overwrote the later write");
    // Without a request id every call is applied.
    w.apply(set(b"first", "")).unwrap();
    assert_eq!(get(&w, "k"), Some(b"first".to_vec()));
    let multi = |v: &[u8], id: &str| Command::StoreMultiSet {
        scope: scope(1),
        entries: vec![("k".to_string(), v.to_vec()), ("m".to_string(), v.to_vec())],
        request_id: id.into(),
    };
    assert_eq!(w.apply(multi(b"1", "m1")).unwrap(), Outcome::Done);
    w.apply(set(b"2", "s3")).unwrap();
    assert_eq!(w.apply(multi(b"1", "m1")).unwrap(), Outcome::Done);
    assert_eq!((get(&w, "k"), get(&w, "m")), (Some(b"2".to_vec()), Some(b"1".to_vec())), "the retried multi-set was applied again");
}

/// A delete retried with the same request id answers its first attempt's result: "deleted" for
/// one that succeeded (not "not found"), and it does not delete a key another client wrote since
/// a first attempt that found nothing.
#[test]
fn a_retried_delete_answers_its_first_result() {
    let mut w = World::new(1, 1, 0);
    w.join("a").unwrap();
    let set = |k: &str| Command::StoreSet { scope: scope(1), key: k.into(), value: b"v".to_vec(), request_id: String::new() };
    let del = |k: &str, id: &str| Command::StoreDelete { scope: scope(1), key: k.into(), request_id: id.into() };
    w.apply(set("k")).unwrap();
    assert_eq!(w.apply(del("k", "d1")).unwrap(), Outcome::Deleted(true));
    let (outcome, effects) = w.state.apply(&del("k", "d1"), w.now, &w.limits).unwrap();
    assert_eq!(outcome, Outcome::Deleted(true), "the retry answers the first attempt's result, not \"not found\"");
    assert_eq!(effects, Effects::default());
    assert_eq!(w.apply(del("k", "d2")).unwrap(), Outcome::Deleted(false), "a new delete finds nothing");
    // A delete that found nothing, retried after another client wrote the key: the key stays.
    let (_, effects) = w.state.apply(&del("gone", "d3"), w.now, &w.limits).unwrap();
    assert!(effects.changed, "the answer to remember is a change (journaled, replicated)");
    w.apply(set("gone")).unwrap();
    assert_eq!(w.apply(del("gone", "d3")).unwrap(), Outcome::Deleted(false));
    assert_eq!(w.job().get(&scope(1), "gone").unwrap(), Some(&b"v".to_vec()));
    // Without a request id, a delete that finds nothing changes nothing.
    let (_, effects) = w.state.apply(&del("absent", ""), w.now, &w.limits).unwrap();
    assert_eq!(effects, Effects::default());
}

/// An add retried with the same request id after another client's add is applied once and
/// answers its first result.
#[test]
fn a_retried_add_is_applied_once() {
    let mut w = World::new(1, 1, 0);
    w.join("a").unwrap();
    let add = |d, id: &str| Command::StoreAdd { scope: scope(1), key: "n".into(), delta: d, request_id: id.into() };
    assert_eq!(w.apply(add(5, "a1")).unwrap(), Outcome::Added(5));
    assert_eq!(w.apply(add(2, "a2")).unwrap(), Outcome::Added(7));
    assert_eq!(w.apply(add(5, "a1")).unwrap(), Outcome::Added(5), "the first attempt's answer");
    assert_eq!(w.apply(add(2, "a2")).unwrap(), Outcome::Added(7));
    assert_eq!(w.job().get(&scope(1), "n").unwrap(), Some(&b"7".to_vec()), "each add applied once");
}

/// The remembered answers of sets and deletes are rebuilt by replaying the journal and kept by
/// a snapshot (on disk, and the HA log's), so a retry that reaches a restarted daemon or a new
/// leader is answered from them too.
#[test]
fn store_answers_survive_journal_replay_and_snapshots() {
    let mut w = World::new(1, 1, 0);
    let set = |k: &str, v: &[u8], id: &str| Command::StoreSet { scope: scope(1), key: k.into(), value: v.to_vec(), request_id: id.into() };
    let del = |k: &str, id: &str| Command::StoreDelete { scope: scope(1), key: k.into(), request_id: id.into() };
    let mut journal = Vec::new();
    for cmd in [join_cmd("a", 1, None, &w.spec), set("k", b"first", "s1"), set("k", b"second", ""), del("gone", "d1")] {
        let (_, effects) = w.state.apply(&cmd, w.now, &w.limits).unwrap();
        assert!(effects.changed && cmd.is_durable(), "{cmd:?} is journaled");
        journal.push(cmd);
    }
    let mut replayed = State::default();
    for cmd in &journal {
        replayed.apply(cmd, w.now, &w.limits).unwrap();
    }
    let mut snapshot: State = postcard::from_bytes(&postcard::to_allocvec(&w.state).unwrap()).unwrap();
    snapshot.recount();
    for mut s in [replayed, snapshot] {
        s.apply(&set("gone", b"new", ""), w.now, &w.limits).unwrap();
        assert_eq!(s.apply(&set("k", b"first", "s1"), w.now, &w.limits).unwrap().0, Outcome::Done);
        assert_eq!(s.apply(&del("gone", "d1"), w.now, &w.limits).unwrap().0, Outcome::Deleted(false));
        let job = s.job("job").unwrap();
        assert_eq!(job.get(&scope(1), "k").unwrap(), Some(&b"second".to_vec()));
        assert_eq!(job.get(&scope(1), "gone").unwrap(), Some(&b"new".to_vec()));
    }
}

/// A busy job passes the window's count of ids within a second: a retry a second later still
/// finds its answer (the count alone had forgotten it, and the retry overwrote a newer value).
/// Once older than the minimum age, the oldest answers go again as the count says.
#[test]
fn a_retry_a_second_later_is_remembered_however_many_ids_came_between() {
    let mut w = World::new(1, 1, 0);
    w.join("a").unwrap();
    let set = |k: &str, v: &[u8], id: &str| Command::StoreSet { scope: scope(1), key: k.into(), value: v.to_vec(), request_id: id.into() };
    w.apply(set("k", b"first", "s0")).unwrap();
    for i in 0..MAX_DEDUP + 100 {
        w.apply(set("busy", b"x", &format!("b{i}"))).unwrap();
    }
    w.now += 1_000;
    w.apply(set("k", b"second", "")).unwrap();
    assert_eq!(w.apply(set("k", b"first", "s0")).unwrap(), Outcome::Done);
    assert_eq!(w.job().get(&scope(1), "k").unwrap(), Some(&b"second".to_vec()), "the retry was applied again");
    assert_eq!(w.job().dedup.len(), MAX_DEDUP + 101);
    assert_eq!(w.job().dedup["s0"].at, w.now - 1_000, "the time it was applied at");
    // Past the minimum age, the next id forgets the oldest down to the window's count.
    w.now += DEDUP_MIN_AGE_MS;
    w.apply(set("busy", b"x", "late")).unwrap();
    let job = w.job();
    assert_eq!((job.dedup.len(), job.dedup_order.len()), (MAX_DEDUP, MAX_DEDUP));
    assert!(!job.dedup.contains_key("s0") && job.dedup.contains_key("late"));
}

/// However young, a job keeps at most the hard cap of answers (memory and snapshots), the
/// oldest going first.
#[test]
fn the_dedup_window_never_passes_its_hard_cap() {
    let mut w = World::new(1, 1, 0);
    w.join("a").unwrap();
    let now = w.now;
    let job = w.state.jobs.get_mut("job").unwrap();
    for i in 0..MAX_DEDUP_WINDOW + 10 {
        job.remember(&format!("r{i}"), 1, Dedup::Set, now);
    }
    assert_eq!((job.dedup.len(), job.dedup_order.len()), (MAX_DEDUP_WINDOW, MAX_DEDUP_WINDOW));
    assert!(!job.dedup.contains_key("r9") && job.dedup.contains_key("r10"));
}

/// A request id answers only the request it was drawn for: the same id on another call (another
/// kind, key or value) is refused as invalid, naming the id, and changes nothing, instead of
/// being answered with the first call's answer.
#[test]
fn a_request_id_reused_for_a_different_request_is_refused() {
    let mut w = World::new(1, 1, 0);
    w.join("a").unwrap();
    let set = |k: &str, v: &[u8], id: &str| Command::StoreSet { scope: scope(1), key: k.into(), value: v.to_vec(), request_id: id.into() };
    let del = |k: &str, id: &str| Command::StoreDelete { scope: scope(1), key: k.into(), request_id: id.into() };
    let add = |k: &str, d: i64, id: &str| Command::StoreAdd { scope: scope(1), key: k.into(), delta: d, request_id: id.into() };
    w.apply(set("k", b"v", "id1")).unwrap();
    for other in [set("k", b"w", "id1"), set("other", b"v", "id1"), del("k", "id1"), add("k", 1, "id1")] {
        let err = w.apply(other.clone()).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{other:?}: {err}");
        let msg = err.to_string();
        assert!(msg.contains("\"id1\"") && msg.contains("was already used for a different request"), "{msg}");
        assert_eq!(w.state.remembered(&other), None);
    }
    assert_eq!(w.job().get(&scope(1), "k").unwrap(), Some(&b"v".to_vec()));
    assert!(w.job().get(&scope(1), "other").unwrap().is_none());
    // The same call again is a retry; a round-scoped call is another call.
    assert_eq!(w.state.remembered(&set("k", b"v", "id1")), Some(&Dedup::Set));
    assert_eq!(w.apply(set("k", b"v", "id1")).unwrap(), Outcome::Done);
    let round = Command::StoreSet { scope: Scope { round_scoped: true, ..scope(1) }, key: "k".into(), value: b"v".to_vec(), request_id: "id1".into() };
    assert_eq!(w.apply(round).unwrap_err().code(), tonic::Code::InvalidArgument);
    // Adds, deletes and barrier arrivals are tied to their calls too.
    assert_eq!(w.apply(add("n", 2, "a1")).unwrap(), Outcome::Added(2));
    assert_eq!(w.apply(add("n", 3, "a1")).unwrap_err().code(), tonic::Code::InvalidArgument);
    assert_eq!(w.apply(add("n", 2, "a1")).unwrap(), Outcome::Added(2));
    assert_eq!(w.apply(del("k", "d1")).unwrap(), Outcome::Deleted(true));
    assert_eq!(w.apply(del("n", "d1")).unwrap_err().code(), tonic::Code::InvalidArgument);
    assert_eq!(w.job().get(&scope(1), "n").unwrap(), Some(&b"2".to_vec()));
    let arrive = |m: &str, id: &str| Command::BarrierArrive { scope: scope(1), name: "b".into(), member: m.into(), participants: 2, request_id: id.into() };
    assert_eq!(w.apply(arrive("0", "x0")).unwrap(), Outcome::Arrived(0));
    assert_eq!(w.apply(arrive("1", "x0")).unwrap_err().code(), tonic::Code::InvalidArgument);
    assert_eq!(w.job().barrier_generation(&scope(1), "b").unwrap(), 0, "the refused arrival released the barrier");
}

/// The fingerprint is a fixed function of the call (it is kept in snapshots and rebuilt by
/// replay, so it must not change between processes): the same call hashes the same, the parts
/// that tell calls apart change it, the request id and the round do not.
#[test]
fn the_fingerprint_is_stable_and_tells_calls_apart() {
    let set = |round: u64, k: &str, v: &[u8], id: &str| Command::StoreSet { scope: scope(round), key: k.into(), value: v.to_vec(), request_id: id.into() };
    let a = set(1, "k", b"v", "r").fingerprint();
    assert_eq!(a, set(1, "k", b"v", "r").fingerprint());
    assert_eq!(a, set(2, "k", b"v", "other id").fingerprint());
    assert_ne!(a, set(1, "k", b"w", "r").fingerprint());
    assert_ne!(a, set(1, "kv", b"", "r").fingerprint(), "key and value run together");
    assert_eq!(set(1, "k", b"v", "").fingerprint(), 0, "no id, nothing hashed");
    let multi = Command::StoreMultiSet { scope: scope(1), entries: vec![("k".into(), b"v".to_vec())], request_id: "r".into() };
    assert_ne!(a, multi.fingerprint());
    // FNV-1a 64 of nothing but the kind and namespace bytes of a delete of "" (5, 0), then the
    // key's length (8 zero bytes): pinned, so a change of the hash is a format change.
    let del = Command::StoreDelete { scope: scope(1), key: String::new(), request_id: "r".into() };
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in [5u8, 0, 0, 0, 0, 0, 0, 0, 0, 0] {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    assert_eq!(del.fingerprint(), h);
}

/// A remembered answer is found by the pure lookup the executor asks before its caps, only for
/// a call that repeats the one its id was drawn for.
#[test]
fn remembered_finds_only_a_repeated_call() {
    let mut w = World::new(1, 1, 0);
    w.join("a").unwrap();
    let add = |d: i64, id: &str| Command::StoreAdd { scope: scope(1), key: "n".into(), delta: d, request_id: id.into() };
    assert_eq!(w.state.remembered(&add(1, "a1")), None, "nothing applied yet");
    w.apply(add(1, "a1")).unwrap();
    assert_eq!(w.state.remembered(&add(1, "a1")), Some(&Dedup::Add(1)));
    assert_eq!(w.state.remembered(&add(1, "a2")), None);
    assert_eq!(w.state.remembered(&add(1, "")), None);
    assert_eq!(w.state.remembered(&add(2, "a1")), None, "another call under the same id");
    let other_job = Command::StoreAdd { scope: Scope { job: "nope".into(), ..scope(1) }, key: "n".into(), delta: 1, request_id: "a1".into() };
    assert_eq!(w.state.remembered(&other_job), None);
}

#[test]
fn store_limits_are_enforced_and_multiset_is_atomic() {
    let mut w = World::new(1, 1, 0);
    w.limits.max_keys_per_job = 2;
    w.join("a").unwrap();
    let entries = vec![("a".to_string(), b"1".to_vec()), ("b".to_string(), b"2".to_vec()), ("c".to_string(), b"3".to_vec())];
    let err = w.apply(Command::StoreMultiSet { scope: scope(1), entries, request_id: String::new() }).unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert_eq!(w.job().store.len(), 0, "a failed multi-set writes nothing");
    w.limits.max_store_bytes_per_job = 5;
    let err = w.apply(Command::StoreSet { scope: scope(1), key: "k".into(), value: vec![0; 5], request_id: String::new() }).unwrap_err();
    assert!(err.to_string().contains("would hold 6 bytes"), "{err}");
}

#[test]
fn barrier_releases_once_per_generation() {
    let mut w = World::new(1, 1, 0);
    w.join("a").unwrap();
    let arrive = |m: &str, p, id: &str| Command::BarrierArrive {
        scope: scope(1),
        name: "b".into(),
        member: m.into(),
        participants: p,
        request_id: id.into(),
    };
    assert_eq!(w.apply(arrive("0", 3, "x0")).unwrap(), Outcome::Arrived(0));
    assert_eq!(w.apply(arrive("0", 3, "x0b")).unwrap(), Outcome::Arrived(0), "same member twice counts once");
    assert_eq!(w.apply(arrive("1", 4, "")).unwrap_err().code(), tonic::Code::InvalidArgument);
    assert_eq!(w.apply(arrive("1", 3, "x1")).unwrap(), Outcome::Arrived(0));
    assert_eq!(w.job().barrier_generation(&scope(1), "b").unwrap(), 0);
    assert_eq!(w.apply(arrive("2", 3, "x2")).unwrap(), Outcome::Arrived(0));
    assert_eq!(w.job().barrier_generation(&scope(1), "b").unwrap(), 1);
    // A retried arrival after release is answered from memory, not counted in generation 1.
    assert_eq!(w.apply(arrive("2", 3, "x2")).unwrap(), Outcome::Arrived(0));
    assert!(w.job().barriers.values().all(|b| b.arrived.is_empty()));
}

/// Every arrival of a barrier wider than the base dedup window is still remembered when the
/// barrier releases: the first of 10,000 ranks retrying its arrival (a service restart mid-barrier)
/// is answered from memory, not counted again at the next generation.
#[test]
fn a_wide_barriers_first_arrivals_are_remembered_past_the_base_window() {
    // A 10,000-rank round: three nodes of 4,000, 4,000 and 2,000 workers.
    let mut w = World::new(3, 3, 0);
    w.join_with("a", 4000, None).unwrap();
    w.join_with("b", 4000, None).unwrap();
    w.join_with("c", 2000, None).unwrap();
    w.advance(LAST_CALL + 1);
    assert_eq!(w.state_name(), pb::JobState::Running);
    let n = 10_000u32;
    let arrive = |m: u32| Command::BarrierArrive {
        scope: scope(1),
        name: "wide".into(),
        member: m.to_string(),
        participants: n,
        request_id: format!("r{m}"),
    };
    for m in 0..n {
        assert_eq!(w.apply(arrive(m)).unwrap(), Outcome::Arrived(0));
    }
    assert_eq!(w.job().barrier_generation(&scope(1), "wide").unwrap(), 1);
    for m in [0, 1, n / 2] {
        assert_eq!(w.apply(arrive(m)).unwrap(), Outcome::Arrived(0), "member {m}'s retry");
    }
    assert!(w.job().barriers.values().all(|b| b.arrived.is_empty()), "a retry arrived at generation 1");
}

/// A job-wide barrier outlives a restart, but not the arrivals of the round that ended: the new
/// round's ranks must all arrive again.
#[test]
fn a_restart_voids_the_arrivals_at_a_job_wide_barrier() {
    let mut w = World::new(1, 1, 1);
    w.join("a").unwrap();
    let arrive = |round, m: &str| Command::BarrierArrive {
        scope: scope(round),
        name: "b".into(),
        member: m.into(),
        participants: 2,
        request_id: String::new(),
    };
    w.apply(arrive(1, "0")).unwrap();
    let failure = Failure {
        node_id: "a".into(),
        round: 1,
        rank: 0,
        local_rank: 0,
        exit_code: 1,
        signal: 0,
        message: "boom".into(),
        time_unix_ms: 5,
        hostname: "host-a".into(),
    };
    w.apply(Command::ReportFailure { job: "job".into(), round: 1, node: "a".into(), failure, restartable: true }).unwrap();
    w.join("a").unwrap();
    assert_eq!(w.job().round, 2);
    w.apply(arrive(2, "1")).unwrap();
    assert_eq!(w.job().barrier_generation(&scope(2), "b").unwrap(), 0, "released on an arrival of the round that ended");
    w.apply(arrive(2, "0")).unwrap();
    assert_eq!(w.job().barrier_generation(&scope(2), "b").unwrap(), 1);
}

#[test]
fn spec_mismatch_and_bad_specs_are_rejected() {
    let mut w = World::new(2, 2, 0);
    w.join("a").unwrap();
    w.spec.max_restarts = 3;
    let err = w.join("b").unwrap_err().to_string();
    assert!(err.contains("was created with nnodes 2:2, max_restarts 0"), "{err}");
    let mut w = World::new(3, 2, 0);
    let err = w.join("a").unwrap_err().to_string();
    assert_eq!(err, "invalid config.max_nodes: min_nodes 3 is greater than max_nodes 2");
    let mut w = World::new(0, 2, 0);
    assert!(w.join("a").unwrap_err().to_string().contains("min_nodes"));
    let mut w = World::new(1, 1, 0);
    assert!(w.join_with("a", 0, None).unwrap_err().to_string().contains("local_world_size"));
}

#[test]
fn keep_alive_of_an_expired_node_says_join_again() {
    let mut w = World::new(1, 2, 0);
    w.join("a").unwrap();
    w.advance(LEASE);
    let err = w.apply(Command::KeepAlive { job: "job".into(), node: "a".into() }).unwrap_err();
    assert!(err.to_string().contains("join again"), "{err}");
}

#[test]
fn retried_join_is_idempotent() {
    let mut w = World::new(2, 2, 0);
    w.join("a").unwrap();
    w.join("a").unwrap();
    assert_eq!(w.job().view().joined_count, 1);
    w.join("b").unwrap();
    w.join("b").unwrap();
    assert_eq!(w.job().round, 1);
    assert_eq!(w.state_name(), pb::JobState::Running);
}

#[test]
fn abandoned_jobs_are_forgotten() {
    let mut w = World::new(2, 2, 0);
    w.join("a").unwrap();
    w.advance(LEASE); // a expires; job has no nodes
    assert_eq!(w.job().nodes.len(), 0);
    w.advance(w.limits.retention_ms);
    assert!(w.state.jobs.is_empty());
}

#[test]
fn a_forgotten_job_created_again_fences_off_its_old_rounds() {
    let mut w = World::new(1, 1, 1);
    w.join("a").unwrap();
    w.apply(report("a", 1)).unwrap();
    w.join("a").unwrap();
    assert_eq!(w.job().round, 2);
    // The node vanishes (its round ends); the job is forgotten once it has had no node for the
    // retention time.
    w.advance(LEASE);
    let old_round = w.job().round;
    assert!(old_round >= 2);
    w.advance(w.limits.retention_ms);
    assert!(w.state.jobs.is_empty());
    assert_eq!(w.state.retired.get("job").map(|r| r.round), Some(old_round));
    // The same id again: a new run, counting on from the forgotten one's last round.
    w.join("b").unwrap();
    assert_eq!(w.job().round, old_round + 1);
    assert!(w.state.retired.is_empty(), "the tombstone is used up");
    // A writer of the forgotten run still holding its round is stale, not a member of round 1.
    let err = w.apply(Command::StoreSet { scope: scope(old_round), key: "k".into(), value: b"v".to_vec(), request_id: String::new() }).unwrap_err();
    assert!(matches!(err, RdzvError::StaleRound { .. }), "{err}");
    w.apply(Command::StoreSet { scope: scope(old_round + 1), key: "k".into(), value: b"v".to_vec(), request_id: String::new() }).unwrap();
}

/// The caps over all jobs: one client cannot fill the service with nodes or barrier arrivals
/// spread over many jobs, each under its own job's cap.
#[test]
fn service_wide_caps_hold_nodes_and_barrier_arrivals_over_all_jobs() {
    let mut w = World::new(1, 4, 0);
    w.limits.max_total_nodes = 3;
    w.limits.max_total_barrier_arrivals = 2;
    let join = |w: &mut World, job: &str, node: &str| {
        let Command::Join(mut j) = join_cmd(node, 1, None, &w.spec) else { unreachable!() };
        j.job = job.into();
        w.apply(Command::Join(j))
    };
    join(&mut w, "j1", "a").unwrap();
    join(&mut w, "j1", "b").unwrap();
    join(&mut w, "j2", "a").unwrap();
    assert_eq!(w.state.totals.nodes, 3);
    let err = join(&mut w, "j3", "a").unwrap_err();
    assert!(matches!(err, RdzvError::ResourceExhausted(_)) && err.to_string().contains("3 nodes over all jobs"), "{err}");
    // A refused join changes nothing (it is not journaled): no empty job, no tombstone used up.
    assert!(!w.state.jobs.contains_key("j3"), "a refused join left a job behind");
    w.state.retire("j4", 9, w.now);
    assert!(join(&mut w, "j4", "a").is_err());
    assert!(!w.state.jobs.contains_key("j4") && w.state.retired.contains_key("j4"));
    // A retried join of a known node is no new record.
    join(&mut w, "j1", "a").unwrap();
    let arrive = |job: &str, member: &str| Command::BarrierArrive {
        scope: Scope { job: job.into(), round: 1, round_scoped: false },
        name: "b".into(),
        member: member.into(),
        participants: 8,
        request_id: String::new(),
    };
    w.apply(arrive("j1", "x")).unwrap();
    w.apply(arrive("j2", "y")).unwrap();
    let err = w.apply(arrive("j1", "z")).unwrap_err();
    assert!(err.to_string().contains("2 barrier arrivals over all jobs"), "{err}");
    // Leaving frees a place.
    w.apply(Command::Leave { job: "j2".into(), node: "a".into(), reason: String::new() }).unwrap();
    assert_eq!(w.state.totals.nodes, 2);
    join(&mut w, "j3", "a").unwrap();
    let mut recounted = w.state.clone();
    recounted.recount();
    assert_eq!(recounted.totals, w.state.totals);
}

#[test]
fn tombstones_of_forgotten_jobs_are_capped_oldest_first() {
    let mut state = State::default();
    for i in 0..MAX_RETIRED + 2 {
        state.retire(&format!("j{i}"), 3, i as Ms);
    }
    assert_eq!(state.retired.len(), MAX_RETIRED);
    assert!(!state.retired.contains_key("j0") && !state.retired.contains_key("j1"));
    assert!(state.retired.contains_key("j2") && state.retired.contains_key(&format!("j{}", MAX_RETIRED + 1)));
}

// ------------------------------------------------------------------------------------------------
// Property test: arbitrary sequences of commands from several nodes keep the invariants.

#[derive(Debug, Clone)]
enum Step {
    Join(u8, u8, Option<u8>),
    Leave(u8),
    KeepAlive(u8),
    Fail(u8, bool),
    Finish(u8),
    /// Node, value byte, request id (a few, so that some repeat).
    Set(u8, u8, Option<u8>),
    /// Node whose key is deleted, request id.
    Delete(u8, Option<u8>),
    Arrive(u8),
    Publish(u8),
    Advance(u16),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u8..6, 1u8..4, proptest::option::of(0u8..6)).prop_map(|(n, l, h)| Step::Join(n, l, h)),
        (0u8..6).prop_map(Step::Leave),
        (0u8..6).prop_map(Step::KeepAlive),
        (0u8..6, any::<bool>()).prop_map(|(n, r)| Step::Fail(n, r)),
        (0u8..6).prop_map(Step::Finish),
        (0u8..6, any::<u8>(), proptest::option::of(0u8..4)).prop_map(|(n, v, id)| Step::Set(n, v, id)),
        (0u8..6, proptest::option::of(0u8..4)).prop_map(|(n, id)| Step::Delete(n, id)),
        (0u8..6).prop_map(Step::Arrive),
        (0u8..3).prop_map(Step::Publish),
        (0u16..1500).prop_map(Step::Advance),
    ]
}

fn check_invariants(state: &State) {
    let mut recounted = state.clone();
    recounted.recount();
    assert_eq!(state.totals, recounted.totals, "the running totals match a recount");
    for job in state.jobs.values() {
        match &job.phase {
            Phase::Running { members, world_size, finished, .. } => {
                let mut ranks: Vec<u32> = members.values().map(|m| m.node_rank).collect();
                ranks.sort();
                assert_eq!(ranks, (0..members.len() as u32).collect::<Vec<_>>(), "ranks unique and dense");
                assert!(members.len() as u32 >= job.spec.min_nodes && members.len() as u32 <= job.spec.max_nodes);
                let sum: u32 = members.values().map(|m| m.local_world_size).sum();
                assert_eq!(sum, *world_size);
                let mut by_rank: Vec<&Member> = members.values().collect();
                by_rank.sort_by_key(|m| m.node_rank);
                let mut off = 0;
                for m in by_rank {
                    assert_eq!(m.rank_offset, off);
                    off += m.local_world_size;
                }
                assert!(finished.iter().all(|f| members.contains_key(f)));
                for id in members.keys() {
                    assert!(!job.waiting.contains(id), "a member is not also waiting");
                }
            }
            Phase::Forming { joined, rejoining, .. } => {
                assert!(joined.len() as u32 <= job.spec.max_nodes);
                assert!(joined.iter().all(|id| job.nodes.contains_key(id)));
                assert!(rejoining.iter().all(|id| job.nodes.contains_key(id)));
                assert!(joined.is_disjoint(rejoining));
                assert!(joined.is_disjoint(&job.waiting));
            }
            _ => {}
        }
        assert!(job.waiting.iter().all(|id| job.nodes.contains_key(id)));
        assert!(job.restart_count <= job.spec.max_restarts);
        let bytes: usize = job.store.iter().chain(job.round_store.iter()).map(|(k, v)| k.len() + v.len()).sum();
        assert_eq!(bytes, job.store_bytes);
        for b in job.barriers.values() {
            assert!((b.arrived.len() as u32) < b.participants.max(1));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]
    #[test]
    fn random_sequences_keep_invariants_and_replay_identically(steps in proptest::collection::vec(step(), 1..80)) {
        let mut w = World::new(2, 4, 2);
        let mut journal: Vec<(Command, Ms)> = Vec::new();
        for s in steps {
            let node = |n: u8| format!("n{n}");
            let request_id = |id: Option<u8>| id.map(|i| format!("r{i}")).unwrap_or_default();
            let round = w.state.jobs.get("job").map(|j| j.round).unwrap_or(1);
            let cmd = match s {
                Step::Join(n, l, h) => join_cmd(&node(n), l as u32, h.map(u32::from), &w.spec),
                Step::Leave(n) => Command::Leave { job: "job".into(), node: node(n), reason: String::new() },
                Step::KeepAlive(n) => Command::KeepAlive { job: "job".into(), node: node(n) },
                Step::Fail(n, r) => Command::ReportFailure {
                    job: "job".into(), round, node: node(n), restartable: r,
                    failure: Failure { node_id: node(n), round, rank: 0, local_rank: 0, exit_code: 1, signal: 0, message: String::new(), time_unix_ms: 0, hostname: String::new() },
                },
                Step::Finish(n) => Command::Finish { job: "job".into(), round, node: node(n) },
                Step::Set(n, v, id) => Command::StoreSet { scope: scope(round), key: node(n), value: vec![v; v as usize % 7], request_id: request_id(id) },
                Step::Delete(n, id) => Command::StoreDelete { scope: scope(round), key: node(n), request_id: request_id(id) },
                Step::Arrive(n) => Command::BarrierArrive { scope: scope(round), name: "b".into(), member: node(n), participants: 3, request_id: String::new() },
                Step::Publish(r) => Command::PublishUniqueId { job: "job".into(), round, rank: r as u32, name: String::new(), id: vec![r; 128] },
                Step::Advance(ms) => {
                    let end = w.now + u64::from(ms);
                    loop {
                        let Some(next) = w.state.next_deadline(&w.limits).filter(|d| *d <= end) else { break };
                        w.now = w.now.max(next);
                        for cmd in w.state.due(w.now, &w.limits) {
                            if w.state.apply(&cmd, w.now, &w.limits).is_ok_and(|(_, e)| e.changed) {
                                journal.push((cmd, w.now));
                            }
                        }
                        check_invariants(&w.state);
                    }
                    w.now = end;
                    continue;
                }
            };
            if let Ok((_, effects)) = w.state.apply(&cmd, w.now, &w.limits) {
                if effects.changed && cmd.is_durable() {
                    journal.push((cmd, w.now));
                }
            }
            check_invariants(&w.state);
        }
        // Replaying the journal (without keep-alives) rebuilds the same membership and store.
        let mut replayed = State::default();
        for (cmd, at) in &journal {
            replayed.apply(cmd, *at, &w.limits).unwrap();
        }
        let a = postcard::to_allocvec(&strip_leases(w.state.clone())).unwrap();
        let b = postcard::to_allocvec(&strip_leases(replayed)).unwrap();
        prop_assert_eq!(a, b);
    }
}

fn strip_leases(mut s: State) -> State {
    for job in s.jobs.values_mut() {
        for n in job.nodes.values_mut() {
            n.lease_expires = 0;
            n.last_heartbeat = 0;
        }
    }
    s
}
