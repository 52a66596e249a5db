//! The executor (timers, leases, join deadlines, push notifications) under tokio's paused clock: the
//! service's notion of time advances only when the test lets it, so the timing is exact, not raced.

use std::time::Duration;

use rsrun_rendezvous::proto::{self as pb, rendezvous_server::Rendezvous};
use rsrun_rendezvous::service::{Core, CoreConfig, Service};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Request;

fn join_req(node: &str, min: u32, max: u32, timeout_ms: u64) -> pb::JoinRequest {
    pb::JoinRequest {
        job_id: "job".into(),
        node_id: node.into(),
        addrs: vec!["10.0.0.1".into()],
        local_world_size: 1,
        rank_hint: None,
        config: Some(pb::JobConfig { min_nodes: min, max_nodes: max, last_call_ms: 2_000, lease_ms: 1_000, max_restarts: 0, fixed_ranks: false }),
        timeout_ms,
        master_port: 1234,
        hostname: node.into(),
    }
}

fn service() -> (Service, CancellationToken) {
    let cancel = CancellationToken::new();
    let core = Core::start(CoreConfig::default(), cancel.clone(), &TaskTracker::new()).unwrap();
    (Service::new(core), cancel)
}

#[tokio::test(start_paused = true)]
async fn join_deadline_is_exact_and_names_who_came() {
    let (svc, _cancel) = service();
    let start = Instant::now();
    let err = svc.join(Request::new(join_req("a", 3, 3, 5_000))).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded);
    assert_eq!(start.elapsed(), Duration::from_millis(5_000));
    assert!(err.message().contains("1 of min 3 nodes joined [a (10.0.0.1)]"), "{}", err.message());
}

#[tokio::test(start_paused = true)]
async fn last_call_window_then_round_closes() {
    let (svc, _cancel) = service();
    let svc2 = svc.clone();
    let start = Instant::now();
    let a = tokio::spawn(async move { svc2.join(Request::new(join_req("a", 2, 4, 60_000))).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = svc.join(Request::new(join_req("b", 2, 4, 60_000))).await.unwrap().into_inner();
    // b arrived at 300 ms; min reached; the 2 s last call closes the round at 2.3 s.
    assert_eq!(start.elapsed(), Duration::from_millis(2_300));
    assert_eq!(b.round.unwrap().num_nodes, 2);
    a.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn lease_expiry_is_pushed_to_watchers_on_time() {
    let (svc, _cancel) = service();
    let svc2 = svc.clone();
    let a = tokio::spawn(async move { svc2.join(Request::new(join_req("a", 2, 2, 60_000))).await });
    svc.join(Request::new(join_req("b", 2, 2, 60_000))).await.unwrap();
    a.await.unwrap().unwrap();
    let formed = Instant::now();
    let mut stream = svc.watch(Request::new(pb::WatchRequest { job_id: "job".into(), node_id: "a".into() })).await.unwrap().into_inner();
    use futures::StreamExt;
    let first = stream.next().await.unwrap().unwrap().view.unwrap();
    assert_eq!(first.state, pb::JobState::Running as i32);
    // a keeps alive every 300 ms; b is silent and expires 1 s after its join.
    let svc3 = svc.clone();
    let keeper = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            svc3.keep_alive(Request::new(pb::KeepAliveRequest { job_id: "job".into(), node_id: "a".into() })).await.unwrap();
        }
    });
    let ended = stream.next().await.unwrap().unwrap().view.unwrap();
    assert_eq!(formed.elapsed(), Duration::from_millis(1_000));
    assert_eq!(ended.round, 2);
    assert!(ended.reason.contains("node b lost its lease"), "{}", ended.reason);
    keeper.abort();
}
