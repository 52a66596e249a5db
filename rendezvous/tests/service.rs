//! The service over real sockets (127.0.0.1, port 0): membership, store, auth, bad input, durability
//! across `kill -9` of the real daemon binary.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rsrun_rendezvous::RdzvError;
use rsrun_rendezvous::client::{ClientConfig, JobSpec, JoinSpec, RdzvClient};
use rsrun_rendezvous::proto::{self as pb, JobState};
use rsrun_rendezvous::server::{self, EmbeddedServer, ServerConfig};
use tonic::Code;

const WAIT: Duration = Duration::from_secs(20);

fn spec(min: u32, max: u32, lease_ms: u64) -> JobSpec {
    JobSpec { min_nodes: min, max_nodes: max, last_call: Duration::from_millis(200), lease: Duration::from_millis(lease_ms), max_restarts: 1, fixed_ranks: false }
}

fn join_spec(job: &str, node: &str, spec: &JobSpec) -> JoinSpec {
    JoinSpec {
        job_id: job.into(),
        node_id: node.into(),
        addrs: vec!["127.0.0.1".into()],
        local_world_size: 2,
        rank_hint: None,
        config: spec.clone(),
        timeout: WAIT,
        master_port: 29_500,
        hostname: format!("host-{node}"),
    }
}

async fn embedded() -> (EmbeddedServer, RdzvClient) {
    let srv = server::spawn_embedded("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let client = RdzvClient::connect(ClientConfig::new(srv.addr.to_string())).unwrap();
    (srv, client)
}

/// Waits until the watched view satisfies `pred`.
async fn until(rx: &mut tokio::sync::watch::Receiver<Option<pb::JobView>>, pred: impl Fn(&pb::JobView) -> bool) -> pb::JobView {
    tokio::time::timeout(WAIT, async {
        loop {
            if let Some(v) = rx.borrow_and_update().clone() {
                if pred(&v) {
                    return v;
                }
            }
            rx.changed().await.expect("watch ended");
        }
    })
    .await
    .expect("the view never reached the expected state")
}

#[tokio::test]
async fn nodes_form_one_round_with_consistent_assignment() {
    let (_srv, client) = embedded().await;
    let s = spec(4, 4, 5_000);
    let joins = (0..4).map(|i| {
        let c = client.clone();
        let js = join_spec("job", &format!("n{i}"), &s);
        tokio::spawn(async move { c.join(js).await })
    })
    .collect::<Vec<_>>();
    let mut results = Vec::new();
    for j in joins {
        results.push(j.await.unwrap().unwrap());
    }
    let round = results[0].round.clone().unwrap();
    assert_eq!(round.world_size, 8);
    assert_eq!(round.num_nodes, 4);
    let mut ranks: Vec<u32> = results.iter().map(|r| r.node.as_ref().unwrap().node_rank).collect();
    ranks.sort();
    assert_eq!(ranks, vec![0, 1, 2, 3]);
    for r in &results {
        assert_eq!(r.round.as_ref().unwrap(), &round, "every participant gets the same round");
        let n = r.node.as_ref().unwrap();
        assert_eq!(n.rank_offset, n.node_rank * 2);
    }
    let status = client.status(Some("job")).await.unwrap();
    assert_eq!(status.jobs[0].nodes.len(), 4);
    assert_eq!(status.jobs[0].world_size, 8);
}

#[tokio::test]
async fn dead_node_ends_round_survivors_are_pushed_and_reform() {
    let (_srv, client) = embedded().await;
    let s = spec(2, 3, 600);
    let mut handles = Vec::new();
    for n in ["a", "b", "c"] {
        let c = client.clone();
        let js = join_spec("job", n, &s);
        handles.push(tokio::spawn(async move { c.join(js).await }));
    }
    for h in handles {
        h.await.unwrap().unwrap();
    }
    // a and b keep alive; c goes silent (as if kill -9'd).
    let ka = client.spawn_keep_alive("job", "a", Duration::from_millis(150));
    let kb = client.spawn_keep_alive("job", "b", Duration::from_millis(150));
    let mut watch = client.watch("job", "a");
    let v = until(&mut watch, |v| v.round == 2).await;
    assert_eq!(v.state, JobState::Forming as i32);
    assert!(v.reason.contains("node c lost its lease"), "{}", v.reason);
    assert_eq!(v.restart_count, 0, "membership changes are free");
    let (ra, rb) = tokio::join!(client.join(join_spec("job", "a", &s)), client.join(join_spec("job", "b", &s)));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ra.round.as_ref().unwrap().round, 2);
    assert_eq!(ra.round.as_ref().unwrap().num_nodes, 2);
    assert_eq!(rb.round.as_ref().unwrap().world_size, 4);
    drop((ka, kb));
}

#[tokio::test]
async fn late_node_triggers_scale_up() {
    let (_srv, client) = embedded().await;
    let s = spec(1, 2, 5_000);
    let r1 = client.join(join_spec("job", "a", &s)).await.unwrap();
    assert_eq!(r1.round.unwrap().num_nodes, 1);
    let mut watch = client.watch("job", "a");
    let c = client.clone();
    let s2 = s.clone();
    let b = tokio::spawn(async move { c.join(join_spec("job", "b", &s2)).await });
    let v = until(&mut watch, |v| v.round == 2).await;
    assert!(v.reason.contains("scale-up"), "{}", v.reason);
    let ra = client.join(join_spec("job", "a", &s)).await.unwrap();
    let rb = b.await.unwrap().unwrap();
    assert_eq!(ra.round.as_ref().unwrap().num_nodes, 2);
    assert_eq!(ra.node.unwrap().node_rank, 0, "a keeps its rank (sticky)");
    assert_eq!(rb.node.unwrap().node_rank, 1);
}

#[tokio::test]
async fn failure_restart_budget_and_fail_fast() {
    let (_srv, client) = embedded().await;
    let s = spec(2, 2, 5_000);
    let (a, b) = tokio::join!(client.join(join_spec("job", "a", &s)), client.join(join_spec("job", "b", &s)));
    let round = a.unwrap().round.unwrap().round;
    b.unwrap();
    let failure = pb::FailureInfo { rank: 3, local_rank: 1, exit_code: 7, message: "boom".into(), ..Default::default() };
    let r = client.report_failure("job", round, "b", failure.clone(), true).await.unwrap();
    assert_eq!(r.decision, pb::FailureDecision::Restart as i32);
    // Stale reports are fenced.
    let e = client.report_failure("job", round, "a", failure.clone(), true).await.unwrap_err();
    assert!(e.to_string().contains("stale round 1"), "{e}");
    let (a, b) = tokio::join!(client.join(join_spec("job", "a", &s)), client.join(join_spec("job", "b", &s)));
    let ra = a.unwrap().round.unwrap();
    b.unwrap();
    assert_eq!(ra.restart_count, 1);
    let mut watch = client.watch("job", "a");
    // Only a node of the job fails it.
    let e = client.fail_job("job", "stranger", "stale run").await.unwrap_err();
    assert!(e.to_string().contains("only a node of the job can fail it"), "{e}");
    client.fail_job("job", "b", "cuda error").await.unwrap();
    let v = until(&mut watch, |v| v.state == JobState::Failed as i32).await;
    assert!(v.reason.contains("cuda error"));
    let e = client.join(join_spec("job", "z", &s)).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.to_string().contains("has failed"), "{e}");
}

#[tokio::test]
async fn finish_and_exit_barrier() {
    let (_srv, client) = embedded().await;
    let s = spec(2, 2, 5_000);
    let (a, b) = tokio::join!(client.join(join_spec("job", "a", &s)), client.join(join_spec("job", "b", &s)));
    let round = a.unwrap().round.unwrap().round;
    b.unwrap();
    client.finish("job", round, "a").await.unwrap();
    let (_, ended) = client.await_job_end("job", Duration::from_millis(100)).await.unwrap();
    assert!(!ended, "b has not finished");
    let c = client.clone();
    let waiter = tokio::spawn(async move { c.await_job_end("job", WAIT).await });
    client.finish("job", round, "b").await.unwrap();
    let (view, ended) = waiter.await.unwrap().unwrap();
    assert!(ended);
    assert_eq!(view.state, JobState::Completed as i32);
}

#[tokio::test]
async fn store_barrier_and_unique_id() {
    let (_srv, client) = embedded().await;
    let s = spec(1, 1, 5_000);
    let round = client.join(join_spec("job", "a", &s)).await.unwrap().round.unwrap().round;
    let store = client.store("job", round);
    // Blocking get wakes when the key is set.
    let st = store.clone();
    let getter = tokio::spawn(async move { st.get("k", WAIT).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    store.set("k", b"v").await.unwrap();
    assert_eq!(getter.await.unwrap().unwrap(), b"v");
    // "Forever" (Duration::MAX) is a wait like any other: no deadline arithmetic overflows.
    assert_eq!(store.get("k", Duration::MAX).await.unwrap(), b"v");
    assert_eq!(store.multi_get(&["k"], Duration::MAX).await.unwrap(), vec![b"v".to_vec()]);
    store.wait(&["k"], Duration::MAX).await.unwrap();
    assert_eq!(store.try_get("missing").await.unwrap(), None);
    let e = store.get("missing", Duration::from_millis(50)).await.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded);
    assert!(e.to_string().contains("\"missing\" did not appear"), "{e}");
    assert_eq!(store.add("n", 2).await.unwrap(), 2);
    assert_eq!(store.add("n", 3).await.unwrap(), 5);
    assert_eq!(store.compare_set("c", None, b"1").await.unwrap(), (true, Some(b"1".to_vec())));
    assert_eq!(store.compare_set("c", Some(b"0"), b"2").await.unwrap(), (false, Some(b"1".to_vec())));
    store.multi_set(&[("x", b"1"), ("y", b"2")]).await.unwrap();
    assert_eq!(store.multi_get(&["x", "y"], Duration::ZERO).await.unwrap(), vec![b"1".to_vec(), b"2".to_vec()]);
    store.wait(&["x", "y"], WAIT).await.unwrap();
    assert!(store.delete("x").await.unwrap());
    assert_eq!(store.num_keys().await.unwrap(), 4);
    // Barrier of 4 members.
    let mut hs = Vec::new();
    for m in 0..4 {
        let st = store.clone();
        hs.push(tokio::spawn(async move { st.barrier("b", &m.to_string(), 4, WAIT).await }));
    }
    for h in hs {
        assert_eq!(h.await.unwrap().unwrap(), 1);
    }
    // Unique id: others block until rank 0 publishes; write-once; rank 0 only.
    let st = store.clone();
    let waiter = tokio::spawn(async move { st.get_unique_id("", WAIT).await });
    let e = store.publish_unique_id("", "a", 1, &[1; 128]).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    // Claiming rank 0 is not enough: the node must be the round's member that runs it (T9).
    let e = store.publish_unique_id("", "intruder", 0, &[7; 128]).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    assert!(e.to_string().contains("\"intruder\" is not a member of running round"), "{e}");
    store.publish_unique_id("", "a", 0, &[9; 128]).await.unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), vec![9; 128]);
    let e = store.publish_unique_id("", "a", 0, &[8; 128]).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);
}

#[tokio::test]
async fn bad_requests_get_precise_statuses() {
    let (srv, client) = embedded().await;
    let s = spec(1, 1, 5_000);
    // Malformed ids, bad configs.
    let mut js = join_spec("bad job", "a", &s);
    let e = client.join(js.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.to_string().contains("\"bad job\" contains ' '"), "{e}");
    js.job_id = "job".into();
    js.config.min_nodes = 3;
    let e = client.join(js.clone()).await.unwrap_err();
    assert!(e.to_string().contains("min_nodes 3 is greater than max_nodes 1"), "{e}");
    js.config.min_nodes = 1;
    js.local_world_size = 0;
    assert_eq!(client.join(js.clone()).await.unwrap_err().code(), Code::InvalidArgument);
    js.local_world_size = 1;
    js.addrs = vec![];
    assert_eq!(client.join(js).await.unwrap_err().code(), Code::InvalidArgument);
    // Store on a job that does not exist; oversized value; stale round.
    let e = client.store("nojob", 1).set("k", b"v").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let round = client.join(join_spec("job", "a", &s)).await.unwrap().round.unwrap().round;
    let e = client.store("job", round).set("k", &vec![0u8; (1 << 20) + 1]).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(e.to_string().contains("exceeds the limit"), "{e}");
    let e = client.store("job", round + 5).set("k", b"v").await.unwrap_err();
    assert!(e.to_string().contains("stale round 6"), "{e}");
    // A message over the transport limit is refused by the server, which keeps serving.
    let e = client.store("job", round).set("k", &vec![0u8; 8 << 20]).await.unwrap_err();
    assert!(matches!(e.code(), Code::OutOfRange | Code::ResourceExhausted | Code::Internal | Code::Unknown), "{e:?}");
    // Raw requests with missing fields and absurd values.
    let mut raw = pb::rendezvous_client::RendezvousClient::connect(format!("http://{}", srv.addr)).await.unwrap();
    let st = raw.store_set(pb::StoreSetRequest { scope: None, key: "k".into(), value: vec![], request_id: String::new() }).await.unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument);
    let st = raw.join(pb::JoinRequest { job_id: "j2".into(), node_id: "n".into(), config: None, ..Default::default() }).await.unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument);
    let st = raw
        .store_get(pb::StoreGetRequest {
            scope: Some(pb::StoreScope { job_id: "job".into(), round, round_scoped: false }),
            key: "k".into(),
            timeout_ms: u64::MAX,
        })
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument);
    let st = raw
        .barrier(pb::BarrierRequest {
            scope: Some(pb::StoreScope { job_id: "job".into(), round, round_scoped: false }),
            name: "b".into(),
            member: "m".into(),
            participants: 0,
            timeout_ms: 10,
            request_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument);
    // Fuzz-ish: random bytes in every string field never crash the service.
    use rand::Rng;
    let mut rng = rand::rng();
    for _ in 0..300 {
        let junk = |rng: &mut rand::rngs::ThreadRng| -> String { (0..rng.random_range(0..40)).map(|_| rng.random::<char>()).collect() };
        let req = pb::JoinRequest {
            job_id: junk(&mut rng),
            node_id: junk(&mut rng),
            addrs: vec![junk(&mut rng)],
            local_world_size: rng.random(),
            rank_hint: Some(rng.random()),
            config: Some(pb::JobConfig { min_nodes: rng.random(), max_nodes: rng.random(), last_call_ms: rng.random(), lease_ms: rng.random(), max_restarts: rng.random(), fixed_ranks: rng.random() }),
            timeout_ms: rng.random_range(0..50),
            master_port: rng.random(),
            hostname: junk(&mut rng),
        };
        let _ = raw.join(req).await;
        let _ = raw
            .store_add(pb::StoreAddRequest {
                scope: Some(pb::StoreScope { job_id: junk(&mut rng), round: rng.random(), round_scoped: rng.random() }),
                key: junk(&mut rng),
                delta: rng.random(),
                request_id: junk(&mut rng),
            })
            .await;
    }
    // Still healthy.
    client.store("job", round).set("after", b"ok").await.unwrap();
}

fn token_file(dir: &Path, text: &str) -> std::path::PathBuf {
    let p = dir.join("tokens");
    std::fs::write(&p, text).unwrap();
    p
}

#[tokio::test]
async fn tokens_are_required_and_scoped_per_job() {
    let dir = tempfile::tempdir().unwrap();
    let admin = "admin-token-0123456789";
    let team = "team-a-token-0123456789";
    let mut cfg = ServerConfig::in_memory("127.0.0.1:0".parse().unwrap());
    cfg.token_file = Some(token_file(dir.path(), &format!("{admin}\n{team} teamA-*\n")));
    let srv = server::spawn_with(cfg).await.unwrap();
    let connect = |token: Option<&str>| {
        let mut c = ClientConfig::new(srv.addr.to_string());
        c.token = token.map(str::to_string);
        RdzvClient::connect(c).unwrap()
    };
    let s = spec(1, 1, 5_000);
    for bad in [None, Some("wrong-token-0123456789")] {
        let e = connect(bad).join(join_spec("teamA-1", "a", &s)).await.unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    }
    // Nothing changed.
    assert!(connect(Some(admin)).status(None).await.unwrap().jobs.is_empty());
    let team_client = connect(Some(team));
    let round = team_client.join(join_spec("teamA-1", "a", &s)).await.unwrap().round.unwrap().round;
    team_client.store("teamA-1", round).set("k", b"v").await.unwrap();
    // Another job's keys are out of reach of the team token.
    let admin_client = connect(Some(admin));
    let r2 = admin_client.join(join_spec("other", "x", &s)).await.unwrap().round.unwrap().round;
    admin_client.store("other", r2).set("secret", b"s").await.unwrap();
    let e = team_client.store("other", r2).get("secret", Duration::ZERO).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    let e = team_client.store("other", r2).set("secret", b"x").await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    assert_eq!(admin_client.store("other", r2).get("secret", Duration::ZERO).await.unwrap(), b"s");
    // Status shows the team only its own jobs.
    let st = team_client.status(None).await.unwrap();
    assert_eq!(st.jobs.len(), 1);
    assert_eq!(st.jobs[0].view.as_ref().unwrap().job_id, "teamA-1");
}

#[tokio::test]
async fn a_token_with_a_job_quota_starts_no_more_live_jobs_than_it() {
    let dir = tempfile::tempdir().unwrap();
    let team = "team-b-token-0123456789";
    let mut cfg = ServerConfig::in_memory("127.0.0.1:0".parse().unwrap());
    cfg.token_file = Some(token_file(dir.path(), &format!("{team} teamB-* jobs=1\n")));
    let srv = server::spawn_with(cfg).await.unwrap();
    let mut c = ClientConfig::new(srv.addr.to_string());
    c.token = Some(team.into());
    let client = RdzvClient::connect(c).unwrap();
    let s = spec(1, 1, 5_000);
    let round = client.join(join_spec("teamB-1", "a", &s)).await.unwrap().round.unwrap().round;
    let e = client.join(join_spec("teamB-2", "b", &s)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(e.to_string().contains("may hold 1 live jobs at once") && e.to_string().contains("teamB-1"), "{e}");
    // Refused before anything changed: the job does not exist.
    assert_eq!(client.status(None).await.unwrap().jobs.len(), 1);
    // Once the first job has ended and its node left, the second may start.
    client.finish("teamB-1", round, "a").await.unwrap();
    client.leave("teamB-1", "a", "done").await.unwrap();
    client.join(join_spec("teamB-2", "b", &s)).await.unwrap();
}

#[tokio::test]
async fn non_loopback_without_token_is_refused() {
    let cfg = ServerConfig::in_memory("0.0.0.0:0".parse().unwrap());
    let e = server::spawn_with(cfg).await.unwrap_err().to_string();
    assert!(e.contains("not a loopback address and no --token-file"), "{e}");
}

#[tokio::test]
async fn non_loopback_with_a_token_but_no_tls_is_refused_unless_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "0123456789abcdef0123456789abcdef\n").unwrap();
    let mut cfg = ServerConfig::in_memory("0.0.0.0:0".parse().unwrap());
    cfg.token_file = Some(tokens);
    let e = server::spawn_with(cfg.clone()).await.unwrap_err().to_string();
    assert!(e.contains("0.0.0.0:0 is not a loopback address and no --tls-cert/--tls-key") && e.contains("clear text"), "{e}");
    // Accepting the risk, as an embedded service does.
    cfg.insecure = true;
    let server = server::spawn_with(cfg).await.unwrap();
    assert!(server.addr.ip().is_unspecified(), "{}", server.addr);
}

#[tokio::test]
async fn tls_service_accepts_tls_clients_only() {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let dir = tempfile::tempdir().unwrap();
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_string()]).unwrap().signed_by(&leaf_key, &issuer).unwrap();
    let (ca, cert, key) = (dir.path().join("ca.pem"), dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&ca, ca_cert.pem()).unwrap();
    std::fs::write(&cert, leaf.pem()).unwrap();
    std::fs::write(&key, leaf_key.serialize_pem()).unwrap();
    let mut cfg = ServerConfig::in_memory("127.0.0.1:0".parse().unwrap());
    cfg.tls = Some((cert, key));
    let srv = server::spawn_with(cfg).await.unwrap();
    let mut c = ClientConfig::new(format!("localhost:{}", srv.addr.port()));
    c.tls_ca = Some(ca.clone());
    let tls_client = RdzvClient::connect(c).unwrap();
    assert!(tls_client.status(None).await.unwrap().jobs.is_empty());
    // Every failed handshake is told at once, naming what to check, not retried for the call
    // timeout (30 s) as if the daemon were not up yet.
    let at_once = Duration::from_secs(15);
    let mut plain = ClientConfig::new(srv.addr.to_string());
    plain.rpc_timeout = Duration::from_secs(30);
    let e = tokio::time::timeout(at_once, RdzvClient::connect(plain).unwrap().status(None)).await.unwrap().unwrap_err();
    assert!(matches!(e, RdzvError::Tls { .. }) && e.to_string().contains("CA file that signed its certificate"), "{e:?}");
    let other_ca = CertificateParams::new(Vec::<String>::new()).unwrap().self_signed(&KeyPair::generate().unwrap()).unwrap();
    let other = dir.path().join("other-ca.pem");
    std::fs::write(&other, other_ca.pem()).unwrap();
    let mut wrong = ClientConfig::new(format!("localhost:{}", srv.addr.port()));
    (wrong.tls_ca, wrong.rpc_timeout) = (Some(other), Duration::from_secs(30));
    let e = tokio::time::timeout(at_once, RdzvClient::connect(wrong).unwrap().status(None)).await.unwrap().unwrap_err();
    assert!(matches!(e, RdzvError::Tls { .. }) && !e.is_retryable(), "{e:?}");
    assert!(e.to_string().contains("not signed by the CA file given"), "{e}");
    // A TLS client of a plain daemon.
    let (plain_srv, _) = embedded().await;
    let mut to_plain = ClientConfig::new(plain_srv.addr.to_string());
    (to_plain.tls_ca, to_plain.rpc_timeout) = (Some(ca.clone()), Duration::from_secs(30));
    let e = tokio::time::timeout(at_once, RdzvClient::connect(to_plain).unwrap().status(None)).await.unwrap().unwrap_err();
    assert!(e.to_string().contains("does not speak TLS"), "{e}");
    // A CA file without a certificate is refused before anything is sent.
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let mut c = ClientConfig::new(srv.addr.to_string());
    c.tls_ca = Some(junk.clone());
    let e = RdzvClient::connect(c).unwrap_err().to_string();
    assert!(e.contains("junk.pem") && e.contains("holds no PEM certificate"), "{e}");
    // A daemon refuses files that hold no certificate or key, or a key of another certificate,
    // before it binds.
    let other_key = dir.path().join("other-key.pem");
    std::fs::write(&other_key, KeyPair::generate().unwrap().serialize_pem()).unwrap();
    let leaf_cert = dir.path().join("cert.pem");
    for (cert, key, want) in [
        (&junk, &dir.path().join("key.pem"), "--tls-cert"),
        (&leaf_cert, &junk, "--tls-key"),
        (&leaf_cert, &other_key, "KeyMismatch"),
    ] {
        let mut cfg = ServerConfig::in_memory("127.0.0.1:0".parse().unwrap());
        cfg.tls = Some((cert.clone(), key.clone()));
        let e = server::spawn_with(cfg).await.unwrap_err().to_string();
        assert!(e.contains(want), "{want}: {e}");
    }
}

#[tokio::test]
async fn a_blocking_call_to_a_peer_that_never_answers_ends_soon_after_its_wait() {
    // Accepts connections and never speaks: not an rsrun daemon. A join that waits 1 s gives up
    // after its wait plus a few seconds, not after the 30 s call timeout on top.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        while let Ok((c, _)) = listener.accept() {
            held.push(c);
        }
    });
    let mut cfg = ClientConfig::new(addr.to_string());
    cfg.rpc_timeout = Duration::from_secs(30);
    let client = RdzvClient::connect(cfg).unwrap();
    let mut s = join_spec("job", "a", &spec(1, 1, 5_000));
    s.timeout = Duration::from_secs(1);
    let e = tokio::time::timeout(Duration::from_secs(20), client.join(s)).await.unwrap().unwrap_err();
    assert!(matches!(e, RdzvError::Timeout(_) | RdzvError::Unavailable(_)), "{e:?}");
}

#[tokio::test]
async fn a_blocking_call_stops_retrying_an_unreachable_service_when_its_wait_ends() {
    // Nobody listens there: a join that waits 1 s fails after about 1 s, not after the call
    // timeout (30 s) on top.
    let port = std::net::TcpListener::bind("127.0.0.96:0").unwrap().local_addr().unwrap().port();
    let mut cfg = ClientConfig::new(format!("127.0.0.96:{port}"));
    cfg.rpc_timeout = Duration::from_secs(30);
    let client = RdzvClient::connect(cfg).unwrap();
    let mut s = join_spec("job", "a", &spec(1, 1, 5_000));
    s.timeout = Duration::from_secs(1);
    let e = tokio::time::timeout(Duration::from_secs(15), client.join(s)).await.unwrap().unwrap_err();
    assert!(matches!(e, RdzvError::Unavailable(_)) && e.to_string().contains("unreachable after"), "{e:?}");
}

#[tokio::test]
async fn metrics_endpoint_serves_prometheus_text() {
    let mut cfg = ServerConfig::in_memory("127.0.0.1:0".parse().unwrap());
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let cancel = tokio_util::sync::CancellationToken::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let c = cancel.clone();
    let h = tokio::spawn(server::serve(cfg, c, move |b| {
        let _ = tx.send(b);
    }));
    let bound = rx.await.unwrap();
    let client = RdzvClient::connect(ClientConfig::new(bound.addr.to_string())).unwrap();
    client.join(join_spec("job", "a", &spec(1, 1, 5_000))).await.unwrap();
    let m = bound.metrics_addr.unwrap();
    let body = tokio::task::spawn_blocking(move || http_get(m, "/metrics")).await.unwrap();
    assert!(body.contains("rsrun_rendezvous_rpc_duration_seconds_bucket"), "{body}");
    assert!(body.contains("method=\"Join\""), "{body}");
    assert!(body.contains("rsrun_rendezvous_rounds_formed_total 1"), "{body}");
    cancel.cancel();
    h.await.unwrap().unwrap();
}

fn http_get(addr: SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

// ------------------------------------------------------------------------------------------------
// The real daemon binary, killed with SIGKILL and restarted on the same data directory.

struct Daemon {
    child: Child,
    addr: SocketAddr,
}

impl Daemon {
    fn start(listen: &str, data_dir: &Path) -> Daemon {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rsrun-rendezvous"));
        cmd.args(["serve", "--listen", listen, "--data-dir"]).arg(data_dir).env("RSRUN_LOG", "warn");
        Daemon::spawn(cmd)
    }

    /// Starts `cmd` (a `serve` command) and reads the address from its first line.
    fn spawn(mut cmd: Command) -> Daemon {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("unexpected first line {line:?}")).parse().unwrap();
        Daemon { child, addr }
    }

    fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_and_restart_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    // An address of its own on the loopback network: the restart below binds the same port,
    // which a bind to port 0 on 127.0.0.1 by a test running beside this one could take meanwhile.
    let mut daemon = Daemon::start("127.0.0.94:0", dir.path());
    let addr = daemon.addr;
    let mut cfg = ClientConfig::new(addr.to_string());
    cfg.rpc_timeout = Duration::from_secs(30);
    let client = RdzvClient::connect(cfg).unwrap();
    let s = spec(2, 2, 3_000);
    let (a, b) = tokio::join!(client.join(join_spec("job", "a", &s)), client.join(join_spec("job", "b", &s)));
    let (a, b) = (a.unwrap(), b.unwrap());
    let round = a.round.as_ref().unwrap().round;
    let store = client.store("job", round);
    // Writers keep going through the crash; every acknowledged add must survive, none twice.
    let writer = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut acked = 0i64;
            for i in 0..400 {
                store.set(&format!("key{i}"), format!("value{i}").as_bytes()).await.unwrap();
                assert_eq!(store.add("counter", 1).await.unwrap(), acked + 1);
                acked += 1;
            }
            acked
        })
    };
    // A waiter blocked across the crash gets its key after the restart.
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.get("late", Duration::from_secs(30)).await })
    };
    let ka = client.spawn_keep_alive("job", "a", Duration::from_millis(300));
    let kb = client.spawn_keep_alive("job", "b", Duration::from_millis(300));
    tokio::time::sleep(Duration::from_millis(150)).await;
    daemon.kill9();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _daemon = Daemon::start(&addr.to_string(), dir.path());
    let acked = writer.await.unwrap();
    assert_eq!(acked, 400);
    store.set("late", b"here").await.unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), b"here");
    for i in 0..400 {
        assert_eq!(store.get(&format!("key{i}"), Duration::ZERO).await.unwrap(), format!("value{i}").as_bytes());
    }
    assert_eq!(store.get("counter", Duration::ZERO).await.unwrap(), b"400");
    // Membership survived: same round, same assignment, nodes still alive (leases renewed on recovery).
    let mut again = client.join(join_spec("job", "a", &s)).await.unwrap();
    // The round's PyTorch store lived in the killed daemon's memory: the recovered round has a new one.
    let store_port = again.round.as_ref().map_or(0, |r| r.store_port);
    assert_ne!(store_port, 0, "the recovered round serves a PyTorch store");
    if let (Some(r), Some(old)) = (again.round.as_mut(), a.round.as_ref()) {
        r.store_port = old.store_port;
    }
    assert_eq!(again, a);
    let st = client.status(Some("job")).await.unwrap();
    assert_eq!(st.jobs[0].view.as_ref().unwrap().state, JobState::Running as i32);
    assert_eq!(st.jobs[0].nodes.len(), 2);
    assert_eq!(b.round.unwrap().round, round);
    drop((ka, kb));
}

#[tokio::test]
async fn client_reports_unreachable_service_within_its_deadline() {
    // Bind and drop a listener to find a port nobody listens on (on an address of its own, where
    // no other test's server can take the port meanwhile).
    let port = std::net::TcpListener::bind("127.0.0.95:0").unwrap().local_addr().unwrap().port();
    let mut cfg = ClientConfig::new(format!("127.0.0.95:{port}"));
    cfg.rpc_timeout = Duration::from_millis(1500);
    let e = RdzvClient::connect(cfg).unwrap().status(None).await.unwrap_err();
    assert!(matches!(e, RdzvError::Unavailable(_)), "{e:?}");
    assert!(e.to_string().contains("unreachable after"), "{e}");
    for bad in ["nohost", "host:", ":99", "http://"] {
        let e = RdzvClient::connect(ClientConfig::new(bad)).unwrap_err();
        assert!(matches!(e, RdzvError::Connect { .. }), "{bad}: {e:?}");
    }
    for (bad, want) in [("127.0.0.1:99999", "port \"99999\" is not a number in 1..65535"), ("127.0.0.1:0", "port 0")] {
        let e = RdzvClient::connect(ClientConfig::new(bad)).unwrap_err().to_string();
        assert!(e.contains(want), "{bad}: {e}");
    }
}

#[tokio::test]
async fn a_spare_waiting_to_join_is_told_when_the_job_completes() {
    let (_srv, client) = embedded().await;
    let s = spec(1, 1, 5_000);
    let round = client.join(join_spec("job", "a", &s)).await.unwrap().round.unwrap().round;
    let c = client.clone();
    let s2 = s.clone();
    let spare = tokio::spawn(async move { c.join(join_spec("job", "spare", &s2)).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    client.finish("job", round, "a").await.unwrap();
    let e = tokio::time::timeout(Duration::from_secs(5), spare).await.expect("the spare still waits").unwrap().unwrap_err();
    assert!(e.to_string().contains("has completed"), "{e}");
}

/// A MultiGet that names one big key many times cannot make a reply bigger than the job's store
/// may hold (256 MiB): 300 copies of a 1 MiB value are refused, naming the limit.
#[tokio::test]
async fn a_multi_get_reply_is_held_to_the_store_limit() {
    let (_srv, client) = embedded().await;
    let s = spec(1, 1, 5_000);
    let round = client.join(join_spec("job", "a", &s)).await.unwrap().round.unwrap().round;
    let store = client.store("job", round);
    store.set("k", &vec![1u8; 1 << 20]).await.unwrap();
    let keys = vec!["k"; 300];
    let e = store.multi_get(&keys, Duration::ZERO).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(e.to_string().contains("300 keys") && e.to_string().contains("268435456"), "{e}");
    assert_eq!(store.multi_get(&["k", "k"], Duration::ZERO).await.unwrap().len(), 2);
}

/// Every blocking wait of a job (a key, keys, a barrier, a unique id) ends when the job fails,
/// naming the failure, instead of sleeping to its deadline.
#[tokio::test]
async fn waits_end_when_the_job_fails() {
    let (_srv, client) = embedded().await;
    let s = spec(1, 1, 5_000);
    let round = client.join(join_spec("job", "a", &s)).await.unwrap().round.unwrap().round;
    let store = client.store("job", round);
    let round_store = client.store("job", round).round_scoped();
    let (s1, s2, s3, s4, s5) = (store.clone(), store.clone(), store.clone(), store.clone(), round_store.clone());
    let waits = vec![
        tokio::spawn(async move { s1.get("never", WAIT).await.map(drop) }),
        tokio::spawn(async move { s2.wait(&["never"], WAIT).await }),
        tokio::spawn(async move { s3.barrier("b", "0", 2, WAIT).await.map(drop) }),
        tokio::spawn(async move { s4.get_unique_id("", WAIT).await.map(drop) }),
        tokio::spawn(async move { s5.multi_get(&["never"], WAIT).await.map(drop) }),
    ];
    tokio::time::sleep(Duration::from_millis(100)).await;
    client.fail_job("job", "a", "cuda error").await.unwrap();
    for w in waits {
        let e = tokio::time::timeout(Duration::from_secs(5), w).await.expect("a wait outlived the job").unwrap().unwrap_err();
        assert!(e.to_string().contains("has failed") && e.to_string().contains("cuda error"), "{e}");
    }
}

#[tokio::test]
async fn every_running_round_gets_its_own_pytorch_store() {
    use rsrun_rendezvous::tcpstore::TcpStoreClient;
    let (_srv, client) = embedded().await;
    let s = spec(2, 2, 5_000);
    let join_both = |client: RdzvClient| {
        let s = s.clone();
        async move {
            let a = tokio::spawn({
                let c = client.clone();
                let js = join_spec("store-job", "a", &s);
                async move { c.join(js).await.unwrap() }
            });
            let b = client.join(join_spec("store-job", "b", &s)).await.unwrap();
            (a.await.unwrap(), b)
        }
    };
    let (a, b) = join_both(client.clone()).await;
    let (ra, rb) = (a.round.unwrap(), b.round.unwrap());
    assert_eq!((ra.store_addr.as_str(), ra.store_port), (rb.store_addr.as_str(), rb.store_port), "one store per round");
    assert_eq!(ra.store_addr, "127.0.0.1", "the store listens where the nodes reached the service");
    assert_ne!(ra.store_port, 0);
    let first: SocketAddr = format!("{}:{}", ra.store_addr, ra.store_port).parse().unwrap();
    let mut store = TcpStoreClient::connect(first).await.unwrap();
    store.set(b"/k", b"round 1").await.unwrap();
    assert_eq!(store.get(b"/k").await.unwrap(), b"round 1");

    // A failure ends the round: its store closes, and the next round's store is new and empty.
    let failure = pb::FailureInfo { node_id: "a".into(), round: ra.round, rank: 0, exit_code: 1, ..Default::default() };
    client.report_failure("store-job", ra.round, "a", failure, true).await.unwrap();
    let closed = tokio::time::timeout(WAIT, async {
        loop {
            if store.get(b"/k").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(closed.is_ok(), "the ended round's store still answers");
    let (a2, _) = join_both(client.clone()).await;
    let r2 = a2.round.unwrap();
    assert_eq!(r2.round, ra.round + 1);
    assert_ne!(r2.store_port, 0);
    let second: SocketAddr = format!("{}:{}", r2.store_addr, r2.store_port).parse().unwrap();
    assert_ne!(second, first);
    let mut store = TcpStoreClient::connect(second).await.unwrap();
    assert_eq!(store.num_keys().await.unwrap(), 0, "a new round starts with an empty store");
}

/// A service of one job (embedded in its launcher) serves the running round's PyTorch store on its
/// own port too, as torchrun's static backend serves it at `--master-port`: the round announces that
/// port, a store client and the rendezvous's gRPC clients share it, each round's store is new, and a
/// store connection while no round runs is closed.
#[tokio::test]
async fn a_one_job_service_serves_the_round_store_on_its_own_port() {
    use rsrun_rendezvous::tcpstore::TcpStoreClient;
    let mut config = ServerConfig::in_memory("127.0.0.1:0".parse().unwrap());
    config.only_job = Some("solo".into());
    let srv = server::spawn_with(config).await.unwrap();
    let client = RdzvClient::connect(ClientConfig::new(srv.addr.to_string())).unwrap();

    // No round yet: a store connection is closed before the handshake's ping is answered.
    let early = tokio::time::timeout(WAIT, TcpStoreClient::connect(srv.addr)).await.expect("the early store connection hung");
    assert!(early.is_err(), "a store connection before any round was answered");

    let s = spec(1, 1, 5_000);
    let r1 = client.join(join_spec("solo", "a", &s)).await.unwrap().round.unwrap();
    assert_eq!((r1.store_addr.as_str(), r1.store_port), ("127.0.0.1", u32::from(srv.addr.port())), "the round's store is announced at the service's port");
    let mut store = TcpStoreClient::connect(srv.addr).await.unwrap();
    store.ping(42).await.unwrap();
    store.set(b"/k", b"round 1").await.unwrap();
    assert_eq!(store.get(b"/k").await.unwrap(), b"round 1");
    // gRPC on the same port, while the store connection is open.
    assert_eq!(client.store("solo", r1.round).add("n", 2).await.unwrap(), 2);

    // The round ends: its store connections close; the next round's store is new and empty.
    let failure = pb::FailureInfo { node_id: "a".into(), round: r1.round, rank: 0, exit_code: 1, ..Default::default() };
    client.report_failure("solo", r1.round, "a", failure, true).await.unwrap();
    let closed = tokio::time::timeout(WAIT, async {
        while store.get(b"/k").await.is_ok() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(closed.is_ok(), "the ended round's store still answers on the shared port");
    let r2 = client.join(join_spec("solo", "a", &s)).await.unwrap().round.unwrap();
    assert_eq!(r2.round, r1.round + 1);
    assert_eq!(r2.store_port, u32::from(srv.addr.port()));
    let mut store = TcpStoreClient::connect(srv.addr).await.unwrap();
    assert_eq!(store.num_keys().await.unwrap(), 0, "a new round starts with an empty store");
}

/// A durable service stopped with `shutdown` lets go of its data directory before `shutdown`
/// returns, with everything it acknowledged written: a service started right after in the same
/// process on the same directory starts (the journal's lock is free) and has the state.
#[tokio::test]
async fn a_durable_service_restarts_in_process_on_its_directory_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(1, 1, 60_000);
    let mut round = 0;
    for i in 0..10i64 {
        let mut config = ServerConfig::in_memory("127.0.0.1:0".parse().unwrap());
        config.data_dir = Some(dir.path().to_path_buf());
        let srv = server::spawn_with(config).await.unwrap_or_else(|e| panic!("start {i}: {e}"));
        let client = RdzvClient::connect(ClientConfig::new(srv.addr.to_string())).unwrap();
        if i == 0 {
            round = client.join(join_spec("job", "a", &s)).await.unwrap().round.unwrap().round;
        }
        assert_eq!(client.store("job", round).add("starts", 1).await.unwrap(), i + 1, "start {i}");
        tokio::time::timeout(WAIT, srv.shutdown()).await.expect("shutdown hung").unwrap();
    }
}

/// Joins refused before they created their job (here: no job config) leave no address noted for
/// the job behind: one entry per refused job id used to stay forever.
#[tokio::test]
async fn refused_joins_leave_no_interface_behind() {
    use rsrun_rendezvous::proto::rendezvous_server::Rendezvous as _;
    use rsrun_rendezvous::service::{Core, CoreConfig, Service};
    let cfg = CoreConfig { tcpstore: Some(rsrun_rendezvous::tcpstore::TcpStoreLimits::default()), ..CoreConfig::default() };
    let core = Core::start(cfg, tokio_util::sync::CancellationToken::new(), &tokio_util::task::TaskTracker::new()).unwrap();
    let service = Service::new(core.clone());
    let local: SocketAddr = "127.0.0.1:29400".parse().unwrap();
    let join = |job: String, config: Option<pb::JobConfig>| {
        let mut req = tonic::Request::new(pb::JoinRequest {
            job_id: job,
            node_id: "n".into(),
            addrs: vec!["127.0.0.1".into()],
            local_world_size: 1,
            config,
            timeout_ms: 1_000,
            master_port: 1,
            hostname: "h".into(),
            ..Default::default()
        });
        req.extensions_mut().insert(tonic::transport::server::TcpConnectInfo { local_addr: Some(local), remote_addr: Some(local) });
        req
    };
    for i in 0..50 {
        let e = service.join(join(format!("refused-{i}"), None)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    }
    assert_eq!(core.noted_interfaces(), 0);
    // A join that creates its job keeps the address its round's store listens on.
    let config = pb::JobConfig { min_nodes: 1, max_nodes: 1, last_call_ms: 0, lease_ms: 5_000, max_restarts: 0, fixed_ranks: false };
    service.join(join("kept".into(), Some(config))).await.unwrap();
    assert_eq!(core.noted_interfaces(), 1);
}

/// A daemon that accepts connections and never answers (a frozen process) costs a call of a client
/// that lists several daemons one attempt's slack, not the whole call: the next daemon answers.
#[tokio::test]
async fn a_hung_daemon_in_the_list_leaves_time_to_ask_the_next() {
    let srv = server::spawn_embedded("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hung_addr = hung.local_addr().unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = hung.accept().await {
            held.push(sock);
        }
    });
    let mut cfg = ClientConfig::new(format!("{hung_addr},{}", srv.addr));
    cfg.rpc_timeout = Duration::from_secs(6);
    let client = RdzvClient::connect(cfg).unwrap();
    // One attempt at the hung daemon (2 s: a third of the call timeout, at least 2 s), then the
    // next; an attempt that took the whole call timeout failed the call.
    let status = client.status(None).await;
    assert!(status.is_ok(), "{status:?}");
    assert_eq!(client.current_endpoint(), srv.addr.to_string());
    holder.abort();
    let _ = srv.shutdown().await;
}

/// A proxy to `upstream` that loses the reply to the first call made through it: it forwards the
/// call, and when the reply begins (the server's first HEADERS frame on a stream), it says so on
/// `seen`, waits for `go`, and closes the connection instead of forwarding the reply. The server
/// has applied the call by then; the client sees a broken connection and retries. Later
/// connections pass through.
async fn losing_the_first_reply(upstream: SocketAddr) -> (SocketAddr, tokio::sync::oneshot::Receiver<()>, tokio::sync::oneshot::Sender<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let mut first = Some((seen_tx, go_rx));
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(upstream).await else { continue };
            let lose = first.take();
            tokio::spawn(async move {
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                let up = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                });
                let Some((seen, go)) = lose else {
                    let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
                    return;
                };
                // HTTP/2 frames: a 9-byte header (24-bit length, type, flags, 31-bit stream id),
                // then the payload. Type 1 is HEADERS; a reply's opens its stream's answer.
                let mut head = [0u8; 9];
                loop {
                    if from_server.read_exact(&mut head).await.is_err() {
                        break;
                    }
                    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
                    let mut payload = vec![0u8; len];
                    if from_server.read_exact(&mut payload).await.is_err() {
                        break;
                    }
                    if head[3] == 1 && stream != 0 {
                        let _ = seen.send(());
                        let _ = go.await;
                        break;
                    }
                    if to_client.write_all(&head).await.is_err() || to_client.write_all(&payload).await.is_err() {
                        break;
                    }
                }
                // Both directions closed: the reply is lost with the connection.
                up.abort();
                let _ = to_client.shutdown().await;
            });
        }
    });
    (addr, seen_rx, go_tx)
}

/// A store write whose reply was lost (the daemon applied it, the connection broke before the
/// answer arrived) is retried by the client with the same request id and answered from the
/// daemon's memory: a retried set does not overwrite what another client wrote in between, a
/// retried multi-set neither, and a retried delete answers "deleted", not "not found".
#[tokio::test]
async fn a_store_write_whose_reply_was_lost_is_not_applied_again_by_its_retry() {
    let (srv, client) = embedded().await;
    let s = spec(1, 1, 60_000);
    let round = client.join(join_spec("job", "a", &s)).await.unwrap().round.unwrap().round;
    let store = client.store("job", round);
    let lossy = |proxy: SocketAddr| RdzvClient::connect(ClientConfig::new(proxy.to_string())).unwrap().store("job", round);

    let (proxy, seen, go) = losing_the_first_reply(srv.addr).await;
    let st = lossy(proxy);
    let set = tokio::spawn(async move { st.set("k", b"first").await });
    tokio::time::timeout(WAIT, seen).await.unwrap().unwrap();
    store.set("k", b"second").await.unwrap();
    go.send(()).unwrap();
    tokio::time::timeout(WAIT, set).await.unwrap().unwrap().unwrap();
    assert_eq!(store.get("k", Duration::ZERO).await.unwrap(), b"second", "the retried set overwrote a later write");

    let (proxy, seen, go) = losing_the_first_reply(srv.addr).await;
    let st = lossy(proxy);
    let multi = tokio::spawn(async move { st.multi_set(&[("m", &b"first"[..]), ("k", &b"first"[..])]).await });
    tokio::time::timeout(WAIT, seen).await.unwrap().unwrap();
    store.set("m", b"second").await.unwrap();
    go.send(()).unwrap();
    tokio::time::timeout(WAIT, multi).await.unwrap().unwrap().unwrap();
    assert_eq!(store.get("m", Duration::ZERO).await.unwrap(), b"second", "the retried multi-set overwrote a later write");
    assert_eq!(store.get("k", Duration::ZERO).await.unwrap(), b"first");

    let (proxy, seen, go) = losing_the_first_reply(srv.addr).await;
    let st = lossy(proxy);
    let delete = tokio::spawn(async move { st.delete("k").await });
    tokio::time::timeout(WAIT, seen).await.unwrap().unwrap();
    go.send(()).unwrap();
    assert!(tokio::time::timeout(WAIT, delete).await.unwrap().unwrap().unwrap(), "the retried delete answered \"not found\"");
    assert_eq!(store.try_get("k").await.unwrap(), None);
    let _ = srv.shutdown().await;
}

/// CPU time (user + system, in clock ticks) a process has used, from /proc/PID/stat.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command (which may hold spaces) start after its closing parenthesis.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the command.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Out of file descriptors, the daemon cannot accept the connections waiting in its listen
/// queue: it must wait between tries instead of retrying at once (tonic's loop over a listener
/// retries at once: one core busy for as long as the shortage lasts), and serve again once
/// descriptors are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_out_of_file_descriptors_waits_instead_of_spinning_and_recovers() {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rsrun-rendezvous"));
    cmd.args(["serve", "--listen", "127.0.0.1:0"]).env("RSRUN_LOG", "error");
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            use nix::sys::resource::{Resource, setrlimit};
            // Soft and hard: the daemon raises its soft limit to the hard one.
            setrlimit(Resource::RLIMIT_NOFILE, 48, 48).map_err(std::io::Error::from)
        });
    }
    let daemon = Daemon::spawn(cmd);
    // More connections than descriptors: the kernel completes them all (they wait in the listen
    // queue), the daemon takes what its limit allows.
    let held: Vec<std::net::TcpStream> = (0..80).map(|_| std::net::TcpStream::connect(daemon.addr).unwrap()).collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = daemon.child.id();
    let before = cpu_ticks(pid);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let used = cpu_ticks(pid) - before;
    // /proc counts in USER_HZ, 100 on Linux whatever the kernel's own tick rate.
    let ticks_per_s = 100;
    // Spinning, it ran the whole 2 s (200 ticks at 100 Hz); waiting 50 ms between tries, ~0.
    assert!(used < ticks_per_s / 2, "the daemon used {used} ticks of CPU in 2 s while out of descriptors (spinning?)");
    drop(held);
    let mut cfg = ClientConfig::new(daemon.addr.to_string());
    cfg.rpc_timeout = Duration::from_secs(10);
    let client = RdzvClient::connect(cfg).unwrap();
    let s = spec(1, 1, 3_000);
    let joined = client.join(join_spec("job", "a", &s)).await.unwrap();
    assert!(joined.round.is_some());
}
