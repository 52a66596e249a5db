//! Property test over the request handlers (the fuzz target for request handling): arbitrary
//! requests — any strings, any numbers, missing fields — go straight into the gRPC handlers of one
//! service. Every call must return (never panic, never hang past its small deadline) with a status
//! whose code is one the service documents, and the service must keep answering well-formed calls.

use std::time::Duration;

use proptest::prelude::*;
use rsrun_rendezvous::proto::{self as pb, rendezvous_server::Rendezvous};
use rsrun_rendezvous::service::{Core, CoreConfig, Service};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Code, Request};

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("job".to_string()),
        Just("n0".to_string()),
        "[a-z0-9._:@-]{1,12}",
        ".{0,40}",
        "[a-z]{200,300}",
    ]
}

fn scope() -> impl Strategy<Value = Option<pb::StoreScope>> {
    proptest::option::of((text(), prop_oneof![Just(1u64), any::<u64>()], any::<bool>()).prop_map(|(job_id, round, round_scoped)| pb::StoreScope { job_id, round, round_scoped }))
}

#[derive(Debug, Clone)]
enum Call {
    Join(pb::JoinRequest),
    KeepAlive(pb::KeepAliveRequest),
    Leave(pb::LeaveRequest),
    Report(pb::ReportFailureRequest),
    Finish(pb::FinishRequest),
    Set(pb::StoreSetRequest),
    Get(pb::StoreGetRequest),
    Add(pb::StoreAddRequest),
    Cas(pb::StoreCompareSetRequest),
    MultiSet(pb::StoreMultiSetRequest),
    Barrier(pb::BarrierRequest),
    Publish(pb::PublishUniqueIdRequest),
    GetId(pb::GetUniqueIdRequest),
    Status(pb::StatusRequest),
}

fn call() -> impl Strategy<Value = Call> {
    let small_ms = 0u64..20;
    prop_oneof![
        (text(), text(), proptest::collection::vec(text(), 0..3), any::<u32>(), proptest::option::of(any::<u32>()), proptest::option::of((0u32..4, 0u32..4, any::<u64>(), 0u64..5000, any::<u32>())), small_ms.clone(), any::<u32>())
            .prop_map(|(job_id, node_id, addrs, lws, hint, cfg, timeout_ms, port)| Call::Join(pb::JoinRequest {
                job_id,
                node_id,
                addrs,
                local_world_size: lws % 5,
                rank_hint: hint,
                config: cfg.map(|(min, max, lc, lease, r)| pb::JobConfig { min_nodes: min, max_nodes: max, last_call_ms: lc % 100, lease_ms: lease, max_restarts: r % 3, fixed_ranks: r & 4 != 0 }),
                timeout_ms,
                master_port: port,
                hostname: String::new(),
            })),
        (text(), text()).prop_map(|(job_id, node_id)| Call::KeepAlive(pb::KeepAliveRequest { job_id, node_id })),
        (text(), text(), text()).prop_map(|(job_id, node_id, reason)| Call::Leave(pb::LeaveRequest { job_id, node_id, reason })),
        (text(), any::<u64>(), text(), any::<bool>(), any::<bool>()).prop_map(|(job_id, round, node_id, has, restartable)| Call::Report(pb::ReportFailureRequest {
            job_id,
            round: round % 3,
            node_id,
            failure: has.then(pb::FailureInfo::default),
            restartable,
        })),
        (text(), 0u64..3, text()).prop_map(|(job_id, round, node_id)| Call::Finish(pb::FinishRequest { job_id, round, node_id })),
        (scope(), text(), proptest::collection::vec(any::<u8>(), 0..64), text())
            .prop_map(|(scope, key, value, request_id)| Call::Set(pb::StoreSetRequest { scope, key, value, request_id })),
        (scope(), text(), small_ms.clone()).prop_map(|(scope, key, timeout_ms)| Call::Get(pb::StoreGetRequest { scope, key, timeout_ms })),
        (scope(), text(), any::<i64>(), text()).prop_map(|(scope, key, delta, request_id)| Call::Add(pb::StoreAddRequest { scope, key, delta, request_id })),
        (scope(), text(), proptest::option::of(proptest::collection::vec(any::<u8>(), 0..8)), proptest::collection::vec(any::<u8>(), 0..8), text())
            .prop_map(|(scope, key, expected, desired, request_id)| Call::Cas(pb::StoreCompareSetRequest { scope, key, expected, desired, request_id })),
        (scope(), proptest::collection::vec((text(), proptest::collection::vec(any::<u8>(), 0..8)), 0..4), text()).prop_map(|(scope, kv, request_id)| Call::MultiSet(pb::StoreMultiSetRequest {
            scope,
            entries: kv.into_iter().map(|(key, value)| pb::KeyValue { key, value }).collect(),
            request_id,
        })),
        (scope(), text(), text(), any::<u32>(), small_ms.clone(), text()).prop_map(|(scope, name, member, participants, timeout_ms, request_id)| Call::Barrier(pb::BarrierRequest {
            scope,
            name,
            member,
            participants: participants % 4,
            timeout_ms,
            request_id,
        })),
        (text(), 0u64..3, 0u32..3, proptest::collection::vec(any::<u8>(), 126..130), text(), text()).prop_map(|(job_id, round, rank, unique_id, name, node_id)| Call::Publish(pb::PublishUniqueIdRequest { job_id, round, rank, unique_id, name, node_id })),
        (text(), 0u64..3, text(), small_ms).prop_map(|(job_id, round, name, timeout_ms)| Call::GetId(pb::GetUniqueIdRequest { job_id, round, name, timeout_ms })),
        text().prop_map(|job_id| Call::Status(pb::StatusRequest { job_id })),
    ]
}

async fn dispatch(svc: &Service, c: Call) -> Result<(), tonic::Status> {
    match c {
        Call::Join(r) => svc.join(Request::new(r)).await.map(drop),
        Call::KeepAlive(r) => svc.keep_alive(Request::new(r)).await.map(drop),
        Call::Leave(r) => svc.leave(Request::new(r)).await.map(drop),
        Call::Report(r) => svc.report_failure(Request::new(r)).await.map(drop),
        Call::Finish(r) => svc.finish(Request::new(r)).await.map(drop),
        Call::Set(r) => svc.store_set(Request::new(r)).await.map(drop),
        Call::Get(r) => svc.store_get(Request::new(r)).await.map(drop),
        Call::Add(r) => svc.store_add(Request::new(r)).await.map(drop),
        Call::Cas(r) => svc.store_compare_set(Request::new(r)).await.map(drop),
        Call::MultiSet(r) => svc.store_multi_set(Request::new(r)).await.map(drop),
        Call::Barrier(r) => svc.barrier(Request::new(r)).await.map(drop),
        Call::Publish(r) => svc.publish_unique_id(Request::new(r)).await.map(drop),
        Call::GetId(r) => svc.get_unique_id(Request::new(r)).await.map(drop),
        Call::Status(r) => svc.status(Request::new(r)).await.map(drop),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]
    #[test]
    fn arbitrary_requests_get_documented_statuses(calls in proptest::collection::vec(call(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let cancel = CancellationToken::new();
            let core = Core::start(CoreConfig::default(), cancel.clone(), &TaskTracker::new()).unwrap();
            let svc = Service::new(core);
            for c in calls {
                let r = tokio::time::timeout(Duration::from_secs(5), dispatch(&svc, c.clone())).await;
                let r = r.unwrap_or_else(|_| panic!("call hung past its deadline: {c:?}"));
                if let Err(st) = r {
                    assert!(
                        matches!(st.code(), Code::InvalidArgument | Code::NotFound | Code::FailedPrecondition | Code::AlreadyExists
                            | Code::PermissionDenied | Code::ResourceExhausted | Code::DeadlineExceeded),
                        "unexpected status {st:?} for {c:?}"
                    );
                    assert!(!st.message().is_empty());
                }
            }
            // Still serving.
            svc.status(Request::new(pb::StatusRequest { job_id: String::new() })).await.unwrap();
            cancel.cancel();
        });
    }
}
