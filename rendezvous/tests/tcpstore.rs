//! The TCPStore server over real sockets on 127.0.0.1: the byte-level cases of tcpstore.md §6.2,
//! wake-ups across connections, barriers, caps, many connections, shutdown, and the
//! `rsrun-rendezvous tcpstore` subcommand.
//!
//! Reads are bounded by a generous deadline only so that a broken server fails a test instead of
//! hanging it; nothing here asserts how long anything took.

use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rsrun_rendezvous::tcpstore::proto::{Request, VALIDATE_MAGIC};
use rsrun_rendezvous::tcpstore::{TcpStoreClient, TcpStoreLimits, TcpStoreServer, TcpStoreStats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Only a hung test ever reaches this.
const DEADLINE: Duration = Duration::from_secs(60);

async fn start(limits: TcpStoreLimits) -> TcpStoreServer {
    TcpStoreServer::start("127.0.0.1:0".parse().unwrap(), limits, CancellationToken::new()).unwrap()
}

async fn server() -> TcpStoreServer {
    start(TcpStoreLimits::default()).await
}

fn enc(reqs: &[Request]) -> Vec<u8> {
    let mut b = Vec::new();
    for r in reqs {
        r.encode(&mut b);
    }
    b
}

fn k(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

fn blob(v: &[u8]) -> Vec<u8> {
    [&(v.len() as u64).to_le_bytes()[..], v].concat()
}

/// A raw connection that sent nothing yet.
async fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// A raw connection after VALIDATE (which has no reply).
async fn validated(addr: SocketAddr) -> TcpStream {
    let mut s = connect(addr).await;
    s.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c]).await.unwrap();
    s
}

async fn send(s: &mut TcpStream, reqs: &[Request]) {
    s.write_all(&enc(reqs)).await.unwrap();
}

async fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut b = vec![0; n];
    tokio::time::timeout(DEADLINE, s.read_exact(&mut b)).await.expect("no reply").unwrap();
    b
}

/// The server closed the connection, without sending anything (more).
async fn assert_closed(s: &mut TcpStream) {
    let mut b = [0u8; 64];
    match tokio::time::timeout(DEADLINE, s.read(&mut b)).await.expect("the server did not close the connection") {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("expected the connection closed, got {:02x?}", &b[..n]),
    }
}

/// Nothing else is in flight on `s`: a PING is answered by its echo first.
async fn assert_quiet(s: &mut TcpStream) {
    send(s, &[Request::Ping { nonce: 0x5157_4545 }]).await;
    assert_eq!(read_n(s, 4).await, 0x5157_4545u32.to_le_bytes(), "a stray byte came before the PING echo");
}

/// Waits until the server has `n` pending waits (so a wake-up is tested, not an immediate reply).
async fn until_waits(server: &TcpStoreServer, n: usize) {
    until_stats(server, "the wait was never registered", |s| s.n_waits == n).await;
}

/// Waits until the server's counts satisfy `done`; panics with `what` and the counts after
/// [`DEADLINE`].
async fn until_stats(server: &TcpStoreServer, what: &str, done: impl Fn(TcpStoreStats) -> bool) {
    tokio::time::timeout(DEADLINE, async {
        while !done(server.stats()) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: {:?}", server.stats()));
}

#[tokio::test]
async fn handshake_split_byte_by_byte_then_ping_echo() {
    let server = server().await;
    let mut s = connect(server.local_addr()).await;
    let bytes = enc(&[Request::Validate { magic: VALIDATE_MAGIC }, Request::Ping { nonce: 0xaabb_ccdd }]);
    for b in bytes {
        s.write_all(&[b]).await.unwrap();
        tokio::task::yield_now().await;
    }
    assert_eq!(read_n(&mut s, 4).await, [0xdd, 0xcc, 0xbb, 0xaa]);
}

#[tokio::test]
async fn no_validate_or_a_wrong_magic_closes_the_connection() {
    let server = server().await;
    // A GET without VALIDATE.
    let mut s = connect(server.local_addr()).await;
    send(&mut s, &[Request::Get { key: k("/k") }]).await;
    assert_closed(&mut s).await;
    // A wrong magic, even followed by valid requests.
    let mut s = connect(server.local_addr()).await;
    send(&mut s, &[Request::Validate { magic: 0x3C85_F7CF }, Request::Ping { nonce: 1 }]).await;
    assert_closed(&mut s).await;
    // A split VALIDATE with a wrong last byte.
    let mut s = connect(server.local_addr()).await;
    s.write_all(&[0x00, 0xce]).await.unwrap();
    tokio::task::yield_now().await;
    s.write_all(&[0xf7, 0x85, 0x00]).await.unwrap();
    assert_closed(&mut s).await;
    // The server is still fine.
    let mut ok = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    ok.ping(7).await.unwrap();
}

#[tokio::test]
async fn pipelined_set_get_and_two_getnumkeys_in_one_segment() {
    let server = server().await;
    let mut s = validated(server.local_addr()).await;
    // One write: SET then GET; only GET answers.
    send(&mut s, &[Request::Set { key: k("/k"), value: k("abc") }, Request::Get { key: k("/k") }]).await;
    assert_eq!(read_n(&mut s, 11).await, blob(b"abc"));
    send(&mut s, &[Request::GetNumKeys, Request::GetNumKeys]).await;
    assert_eq!(read_n(&mut s, 16).await, [1i64.to_le_bytes(), 1i64.to_le_bytes()].concat());
    // VALIDATE, PING, SET, GET, ADD all in one segment, the way a fast client could send them.
    let mut s = connect(server.local_addr()).await;
    send(
        &mut s,
        &[
            Request::Validate { magic: VALIDATE_MAGIC },
            Request::Ping { nonce: 3 },
            Request::Set { key: k("/n"), value: k("40") },
            Request::Get { key: k("/n") },
            Request::Add { key: k("/n"), delta: 2 },
        ],
    )
    .await;
    assert_eq!(read_n(&mut s, 4 + 10 + 8).await, [&3u32.to_le_bytes()[..], &blob(b"40"), &42i64.to_le_bytes()].concat());
    assert_quiet(&mut s).await;
}

#[tokio::test]
async fn wait_and_check_of_zero_keys_answer_at_once() {
    let server = server().await;
    let mut s = validated(server.local_addr()).await;
    send(&mut s, &[Request::Wait { keys: vec![] }, Request::Check { keys: vec![] }]).await;
    assert_eq!(read_n(&mut s, 2).await, [0x00, 0x00]);
}

#[tokio::test]
async fn cancel_wait_with_nothing_pending_answers_01() {
    let server = server().await;
    let mut s = validated(server.local_addr()).await;
    send(&mut s, &[Request::CancelWait]).await;
    assert_eq!(read_n(&mut s, 1).await, [0x01]);
    assert_quiet(&mut s).await;
}

#[tokio::test]
async fn a_wake_that_races_the_cancel_gives_00_then_01() {
    let server = server().await;
    let mut a = validated(server.local_addr()).await;
    let mut b = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    send(&mut a, &[Request::Wait { keys: vec![k("/x")] }]).await;
    until_waits(&server, 1).await;
    b.set(b"/x", b"1").await.unwrap();
    b.ping(1).await.unwrap(); // The SET was applied: A's wait is complete.
    // A times out on its side and cancels: it gets STOP_WAITING, then WAIT_CANCELED.
    send(&mut a, &[Request::CancelWait]).await;
    assert_eq!(read_n(&mut a, 2).await, [0x00, 0x01]);
    assert_quiet(&mut a).await;
}

#[tokio::test]
async fn a_cancelled_wait_never_sends_stop_waiting_later() {
    let server = server().await;
    let mut a = validated(server.local_addr()).await;
    let mut b = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    send(&mut a, &[Request::Wait { keys: vec![k("/x")] }, Request::CancelWait]).await;
    assert_eq!(read_n(&mut a, 1).await, [0x01]);
    b.set(b"/x", b"1").await.unwrap();
    b.ping(1).await.unwrap();
    assert_quiet(&mut a).await;
    assert_eq!(server.stats().n_waits, 0);
}

#[tokio::test]
async fn a_wait_is_woken_by_a_compare_set_that_creates_the_key_not_by_a_failed_one() {
    let server = server().await;
    let mut a = validated(server.local_addr()).await;
    let mut b = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    send(&mut a, &[Request::Wait { keys: vec![k("x")] }]).await;
    until_waits(&server, 1).await;
    // Failed: the key is missing and `expected` is not empty. The reply echoes `expected`.
    assert_eq!(b.compare_set(b"x", b"nonempty", b"new").await.unwrap(), b"nonempty");
    // Not woken: a cancel gets 01 alone (a wake would have come first).
    send(&mut a, &[Request::CancelWait]).await;
    assert_eq!(read_n(&mut a, 1).await, [0x01]);
    assert_quiet(&mut a).await;
    // Now a CAS that creates the key wakes the wait.
    send(&mut a, &[Request::Wait { keys: vec![k("x")] }]).await;
    until_waits(&server, 1).await;
    assert_eq!(b.compare_set(b"x", b"", b"v").await.unwrap(), b"v");
    assert_eq!(read_n(&mut a, 1).await, [0x00]);
    send(&mut a, &[Request::Get { key: k("x") }]).await;
    assert_eq!(read_n(&mut a, 9).await, blob(b"v"));
}

#[tokio::test]
async fn compare_set_replies_as_torch() {
    let server = server().await;
    let mut c = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    assert_eq!(c.compare_set(b"/c", b"old", b"new").await.unwrap(), b"old");
    assert_eq!(c.num_keys().await.unwrap(), 0);
    assert_eq!(c.compare_set(b"/c", b"", b"new").await.unwrap(), b"new");
    assert_eq!(c.compare_set(b"/c", b"wrong", b"x").await.unwrap(), b"new");
    assert_eq!(c.compare_set(b"/c", b"new", b"newer").await.unwrap(), b"newer");
}

#[tokio::test]
async fn cross_connection_wait_wakes_up() {
    let server = server().await;
    let mut waiter = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    let mut writer = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    let task = tokio::spawn(async move {
        waiter.wait(&[b"/default_pg/0//cpu//0/1", b"/other"]).await.unwrap();
        waiter.get(b"/default_pg/0//cpu//0/1").await.unwrap()
    });
    until_waits(&server, 1).await;
    writer.set(b"/default_pg/0//cpu//0/1", b"addr").await.unwrap();
    writer.add(b"/other", 1).await.unwrap();
    assert_eq!(tokio::time::timeout(DEADLINE, task).await.unwrap().unwrap(), b"addr");
}

#[tokio::test]
async fn get_of_a_missing_key_is_empty() {
    let server = server().await;
    let mut s = validated(server.local_addr()).await;
    send(&mut s, &[Request::Get { key: k("/nope") }, Request::MultiGet { keys: vec![k("/nope"), k("/nope2")] }]).await;
    assert_eq!(read_n(&mut s, 24).await, [0u8; 24]);
}

#[tokio::test]
async fn add_parses_like_stoll_and_closes_on_a_non_number() {
    let server = server().await;
    let mut c = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    c.set(b"/n", b" 12abc").await.unwrap();
    assert_eq!(c.add(b"/n", 1).await.unwrap(), 13);
    assert_eq!(c.get(b"/n").await.unwrap(), b"13");
    assert_eq!(c.add(b"/ctr", 5).await.unwrap(), 5);
    assert_eq!(c.add(b"/ctr", -7).await.unwrap(), -2);
    assert_eq!(c.get(b"/ctr").await.unwrap(), b"-2");
    let mut s = validated(server.local_addr()).await;
    send(&mut s, &[Request::Set { key: k("/p"), value: k("potato") }, Request::Add { key: k("/p"), delta: 1 }]).await;
    assert_closed(&mut s).await;
    assert_eq!(c.get(b"/p").await.unwrap(), b"potato");
}

#[tokio::test]
async fn unknown_commands_close_the_connection() {
    let server = server().await;
    for bad in [19u8, 0x42, 0xff] {
        let mut s = validated(server.local_addr()).await;
        s.write_all(&[bad]).await.unwrap();
        assert_closed(&mut s).await;
    }
}

/// A tracing writer that keeps every line, to check what the server logs.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Captures this thread's events. A second, idle dispatcher is kept alive with it: while only one
/// dispatcher exists, tracing computes a callsite's interest from the default of whichever thread
/// hits it first, and another test's thread (no subscriber) would disable the server's callsites.
fn capture_logs() -> (Captured, (tracing::subscriber::DefaultGuard, tracing::Dispatch)) {
    let captured = Captured::default();
    let w = captured.clone();
    let idle = tracing::Dispatch::new(tracing_subscriber::fmt().with_writer(std::io::sink).finish());
    let subscriber = tracing_subscriber::fmt().with_writer(move || w.clone()).with_ansi(false).finish();
    (captured, (tracing::subscriber::set_default(subscriber), idle))
}

// A current-thread runtime: the server's tasks log on this thread, where the capture is installed.
#[tokio::test(flavor = "current_thread")]
async fn key_and_value_caps_at_8_kib_and_8_mib_close_over_the_limit_and_log_peer_and_limit() {
    let (logs, _guard) = capture_logs();
    let server = server().await;
    let addr = server.local_addr();
    let mut c = TcpStoreClient::connect(addr).await.unwrap();
    // At the caps: accepted.
    let key = vec![b'k'; 8 << 10];
    c.set(&key, b"v").await.unwrap();
    assert_eq!(c.get(&key).await.unwrap(), b"v");
    let value = vec![0x5a; 8 << 20];
    c.set(b"/big", &value).await.unwrap();
    assert_eq!(c.get(b"/big").await.unwrap(), value);
    // One byte over: closed.
    let mut s = validated(addr).await;
    let peer = s.local_addr().unwrap();
    send(&mut s, &[Request::Get { key: vec![b'k'; (8 << 10) + 1] }]).await;
    assert_closed(&mut s).await;
    let mut s2 = validated(addr).await;
    let peer2 = s2.local_addr().unwrap();
    // Only the header and a little of the body: the server refuses on the length.
    let mut head = enc(&[Request::Set { key: k("/big"), value: vec![] }]);
    let len_at = head.len() - 8;
    head[len_at..].copy_from_slice(&((8u64 << 20) + 1).to_le_bytes());
    head.extend_from_slice(&[0; 1024]);
    let _ = s2.write_all(&head).await;
    assert_closed(&mut s2).await;
    // The stored value is untouched, the store still serves.
    assert_eq!(c.get(b"/big").await.unwrap().len(), 8 << 20);
    // Logs: one line per closed connection, naming the peer and the limit.
    let text = logs.text();
    let line = |peer: SocketAddr| text.lines().find(|l| l.contains(&peer.to_string())).map(str::to_owned);
    let l1 = line(peer).unwrap_or_else(|| panic!("no log line for {peer}: {text}"));
    assert!(l1.contains("key size 8193 exceeds the limit of 8192"), "{l1}");
    let l2 = line(peer2).unwrap_or_else(|| panic!("no log line for {peer2}: {text}"));
    assert!(l2.contains(&format!("value size {} exceeds the limit of {}", (8 << 20) + 1, 8 << 20)), "{l2}");
}

#[tokio::test]
async fn request_and_store_size_caps_close_the_connection() {
    // (Keys and values small enough that the largest SET fits a request: the limits are checked.)
    let limits = TcpStoreLimits {
        max_key_bytes: 16,
        max_value_bytes: 950,
        max_request_bytes: 1000,
        max_total_bytes: 2000,
        ..TcpStoreLimits::default()
    };
    let server = start(limits).await;
    let mut c = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    // A MULTI_SET of 2 × 600 bytes is one 1,2xx-byte request: over.
    let mut s = validated(server.local_addr()).await;
    send(&mut s, &[Request::MultiSet { pairs: vec![(k("a"), vec![0; 600]), (k("b"), vec![0; 600])] }]).await;
    assert_closed(&mut s).await;
    assert_eq!(c.num_keys().await.unwrap(), 0);
    // Three 900-byte values: the third passes the store's 2,000 bytes.
    c.set(b"1", &[0; 900]).await.unwrap();
    c.set(b"2", &[0; 900]).await.unwrap();
    assert_eq!(c.num_keys().await.unwrap(), 2); // Both SETs are applied before the next one.
    let mut s = validated(server.local_addr()).await;
    send(&mut s, &[Request::Set { key: k("3"), value: vec![0; 900] }]).await;
    assert_closed(&mut s).await;
    assert_eq!(c.num_keys().await.unwrap(), 2);
    assert_eq!(server.stats().n_bytes, 1802);
}

/// Many small requests with big replies in one write: the server applies them as the peer
/// reads (it holds about 16 MiB for the peer, not 40 GETs of 8 MiB at once) and every reply
/// arrives whole and in order, a PING after them last.
#[tokio::test]
async fn small_requests_with_big_replies_are_applied_as_the_peer_reads() {
    let server = server().await;
    let mut c = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    let value: Vec<u8> = (0..8 << 20).map(|i: u32| (i % 251) as u8).collect();
    c.set(b"/big", &value).await.unwrap();
    // SET has no reply: a GET on the same connection makes sure it was applied.
    assert_eq!(c.get(b"/big").await.unwrap().len(), value.len());
    let mut s = validated(server.local_addr()).await;
    let mut reqs = vec![Request::Get { key: k("/big") }; 40];
    reqs.push(Request::Ping { nonce: 7 });
    send(&mut s, &reqs).await;
    for i in 0..40 {
        let reply = read_n(&mut s, 8 + value.len()).await;
        assert!(reply == blob(&value), "GET {i}: the reply differs");
    }
    assert_eq!(read_n(&mut s, 4).await, 7u32.to_le_bytes());
    assert_eq!(c.get(b"/big").await.unwrap().len(), value.len());
    // The budget (16 MiB) plus the reply that crossed it, not 40 replies.
    let peak = server.stats().peak_held_bytes;
    assert!(peak > 8 << 20 && peak <= (16 << 20) + 2 * (8 + value.len()), "held {peak} bytes at once");
}

/// A connection that never sends its handshake, or stops in the middle of a request, is closed
/// after `stall_timeout`; one that is idle between requests, as torch's clients are for a whole
/// job, is not.
#[tokio::test]
async fn stalled_connections_are_closed_and_idle_ones_are_not() {
    let limits = TcpStoreLimits { stall_timeout: Duration::from_millis(300), ..TcpStoreLimits::default() };
    let server = start(limits).await;
    let mut silent = connect(server.local_addr()).await;
    let mut half = validated(server.local_addr()).await;
    let set = enc(&[Request::Set { key: k("/k"), value: vec![1; 100] }]);
    half.write_all(&set[..set.len() / 2]).await.unwrap();
    let mut idle = validated(server.local_addr()).await;
    let start = Instant::now();
    assert_closed(&mut silent).await;
    assert_closed(&mut half).await;
    assert!(start.elapsed() >= Duration::from_millis(250), "closed after {:?}", start.elapsed());
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_quiet(&mut idle).await;
    assert_eq!(server.stats().n_keys, 0, "the half-sent SET was applied");
}

/// One connection past `max_connections` is closed at once; a place freed is taken again.
#[tokio::test]
async fn connections_past_the_cap_are_closed_at_once() {
    let server = start(TcpStoreLimits { max_connections: 2, ..TcpStoreLimits::default() }).await;
    let mut a = validated(server.local_addr()).await;
    let mut b = validated(server.local_addr()).await;
    assert_quiet(&mut a).await;
    assert_quiet(&mut b).await;
    let mut c = validated(server.local_addr()).await;
    assert_closed(&mut c).await;
    drop(a);
    until_stats(&server, "the closed connection was not counted out", |s| s.n_connections == 1).await;
    let mut d = validated(server.local_addr()).await;
    assert_quiet(&mut d).await;
    assert_quiet(&mut b).await;
}

/// Many connections that each start a large SET and never finish it cannot make the server hold
/// more than `max_buffered_bytes` together: past it, the ones holding the most are closed, and
/// the others, and new clients, are served as before.
#[tokio::test]
async fn unfinished_requests_over_all_connections_are_held_to_the_budget() {
    let limits = TcpStoreLimits { max_buffered_bytes: 1 << 20, ..TcpStoreLimits::default() };
    let server = start(limits).await;
    // Each sends 400 KiB of a 1 MiB value, a little at a time, and stops.
    let set = enc(&[Request::Set { key: k("/big"), value: vec![7; 1 << 20] }]);
    let part = &set[..400 << 10];
    let mut open = Vec::new();
    for i in 0..3 {
        let mut s = validated(server.local_addr()).await;
        s.write_all(part).await.unwrap();
        until_stats(&server, "the partial request was not read", |st| st.buffered_bytes >= (i + 1).min(2) * (390 << 10)).await;
        open.push(s);
    }
    // The third pushed the total past 1 MiB: one connection was closed, two are held.
    until_stats(&server, "no connection was shed", |st| st.shed_connections == 1 && st.n_connections == 2).await;
    let st = server.stats();
    assert!(st.buffered_bytes <= 1 << 20, "{st:?}");
    let mut closed = 0;
    for s in &mut open {
        let mut b = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(200), s.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed += 1,
            Ok(Ok(_)) => panic!("a reply to a request that was never finished"),
            Err(_) => {}
        }
    }
    assert_eq!(closed, 1);
    // A client that finishes what it sends is served.
    let mut c = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    c.set(b"/k", b"v").await.unwrap();
    assert_eq!(c.get(b"/k").await.unwrap(), b"v");
}

/// Limits past their ceilings are refused up front, so the parser's arithmetic cannot overflow.
#[tokio::test]
async fn limits_past_their_ceilings_are_refused() {
    let limits = TcpStoreLimits { max_value_bytes: 1 << 31, ..TcpStoreLimits::default() };
    let e = TcpStoreServer::start("127.0.0.1:0".parse().unwrap(), limits, CancellationToken::new()).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("max_value_bytes") && e.to_string().contains("must be at most 1073741824"), "{e}");
    // A value cap that no request can carry is named with the request cap it passes.
    let limits = TcpStoreLimits { max_value_bytes: 100 << 20, ..TcpStoreLimits::default() };
    let e = TcpStoreServer::start("127.0.0.1:0".parse().unwrap(), limits, CancellationToken::new()).map(|_| ()).unwrap_err();
    assert!(
        e.to_string().contains("max_request_bytes")
            && e.to_string().contains("67108864: a SET of the largest key (8192 bytes) and value (104857600 bytes) takes 104865809"),
        "{e}"
    );
}

#[tokio::test]
async fn barrier_with_two_connections_and_a_reused_key() {
    let server = server().await;
    let mut a = validated(server.local_addr()).await;
    let mut b = validated(server.local_addr()).await;
    send(&mut a, &[Request::Barrier { key: k("/bar"), world_size: 2 }]).await;
    until_waits(&server, 1).await;
    send(&mut b, &[Request::Barrier { key: k("/bar"), world_size: 2 }]).await;
    assert_eq!(read_n(&mut b, 1).await, [0x00]);
    assert_eq!(read_n(&mut a, 1).await, [0x00]);
    // The counter never resets: the same key passes at once, for either connection.
    send(&mut a, &[Request::Barrier { key: k("/bar"), world_size: 2 }]).await;
    assert_eq!(read_n(&mut a, 1).await, [0x00]);
    send(&mut b, &[Request::Get { key: k("/bar") }]).await;
    assert_eq!(read_n(&mut b, 9).await, blob(b"3"));
    assert_quiet(&mut a).await;
    assert_quiet(&mut b).await;
}

#[tokio::test]
async fn list_keys_contains_init_and_num_keys_counts_it() {
    let server = server().await;
    let mut c = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    // What every torch client sends after its handshake when world_size is given.
    assert_eq!(c.add(b"init/", 1).await.unwrap(), 1);
    c.set(b"/a", b"1").await.unwrap();
    let mut keys = c.list_keys().await.unwrap();
    keys.sort();
    assert_eq!(keys, vec![k("/a"), k("init/")]);
    assert_eq!(c.num_keys().await.unwrap(), 2);
}

#[tokio::test]
async fn queue_pop_of_an_empty_queue_is_a_zero_length_and_no_body() {
    let server = server().await;
    let mut s = validated(server.local_addr()).await;
    send(&mut s, &[Request::QueuePop { key: k("/q") }]).await;
    assert_eq!(read_n(&mut s, 8).await, [0u8; 8]);
    assert_quiet(&mut s).await;
    send(&mut s, &[Request::QueuePush { key: k("/q"), value: k("q1") }, Request::QueuePop { key: k("/q") }]).await;
    assert_eq!(read_n(&mut s, 18).await, [&1i64.to_le_bytes()[..], &blob(b"q1")].concat());
    assert_quiet(&mut s).await;
}

#[tokio::test]
async fn a_multi_key_wait_is_not_woken_by_two_pushes_to_one_queue() {
    let server = server().await;
    let mut a = validated(server.local_addr()).await;
    let mut b = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    send(&mut a, &[Request::Wait { keys: vec![k("/q"), k("/r")] }]).await;
    until_waits(&server, 1).await;
    b.send_all(&[Request::QueuePush { key: k("/q"), value: k("1") }, Request::QueuePush { key: k("/q"), value: k("2") }])
        .await
        .unwrap();
    b.send_all(&[Request::QueueLen { key: k("/q") }]).await.unwrap();
    assert_eq!(b.read_i64().await.unwrap(), 2);
    // Still waiting: a cancel gets 01 alone.
    send(&mut a, &[Request::CancelWait]).await;
    assert_eq!(read_n(&mut a, 1).await, [0x01]);
    // With /r written too, it completes.
    send(&mut a, &[Request::Wait { keys: vec![k("/q"), k("/r")] }]).await;
    b.set(b"/r", b"x").await.unwrap();
    assert_eq!(read_n(&mut a, 1).await, [0x00]);
}

#[tokio::test]
async fn a_blocking_queue_pop_is_woken_by_a_push() {
    let server = server().await;
    let mut popper = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    let mut pusher = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    let task = tokio::spawn(async move {
        popper.wait(&[b"/jobs"]).await.unwrap();
        popper.queue_pop(b"/jobs").await.unwrap()
    });
    until_waits(&server, 1).await;
    pusher.send_all(&[Request::QueuePush { key: k("/jobs"), value: k("work") }]).await.unwrap();
    assert_eq!(tokio::time::timeout(DEADLINE, task).await.unwrap().unwrap(), Some(k("work")));
}

#[tokio::test]
async fn each_server_is_its_own_empty_keyspace() {
    let one = server().await;
    let two = server().await;
    let mut c1 = TcpStoreClient::connect(one.local_addr()).await.unwrap();
    let mut c2 = TcpStoreClient::connect(two.local_addr()).await.unwrap();
    c1.set(b"/k", b"1").await.unwrap();
    assert_eq!(c1.num_keys().await.unwrap(), 1);
    assert_eq!(c2.num_keys().await.unwrap(), 0);
    assert!(!c2.check(&[b"/k"]).await.unwrap());
}

fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_concurrent_connections_each_set_and_get() {
    const N: usize = 2000;
    raise_nofile_limit();
    let server = server().await;
    let addr = server.local_addr();
    let all_connected = Arc::new(tokio::sync::Barrier::new(N + 1));
    let mut tasks = Vec::new();
    for i in 0..N {
        let all_connected = all_connected.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = TcpStoreClient::connect(addr).await.unwrap();
            let key = format!("/rank/{i}").into_bytes();
            c.set(&key, i.to_string().as_bytes()).await.unwrap();
            assert_eq!(c.get(&key).await.unwrap(), i.to_string().into_bytes());
            // Hold the connection until every other one is open too, and counted.
            all_connected.wait().await;
            all_connected.wait().await;
            c.ping(i as u32).await.unwrap();
        }));
    }
    tokio::time::timeout(DEADLINE, all_connected.wait()).await.expect("not every connection got through");
    assert_eq!(server.stats().n_connections, N);
    assert_eq!(server.stats().n_keys, N);
    all_connected.wait().await;
    for t in tasks {
        t.await.unwrap();
    }
}

/// A peer that pipelines far more than one read takes, and reads none of its replies until it
/// has sent everything: the server stops reading it while 16 MiB of replies wait, goes on serving
/// others meanwhile, and resumes when the peer reads. Every reply arrives, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_reads_late_gets_every_reply_in_order_and_others_are_served_meanwhile() {
    const N: usize = 40_000;
    let server = server().await;
    let addr = server.local_addr();
    let value = vec![0xa5; 1024];
    let mut s = validated(addr).await;
    send(&mut s, &[Request::Set { key: k("/v"), value: value.clone() }]).await;
    // 40,000 GETs (about 40 MiB of replies, more than the kernel buffers and the 16 MiB cap hold) and a final PING, written by a separate task while
    // nothing is read: the server has to pause this connection.
    let mut reqs = Vec::new();
    for i in 0..N {
        Request::Get { key: k("/v") }.encode(&mut reqs);
        if i % 1000 == 999 {
            Request::Ping { nonce: i as u32 }.encode(&mut reqs);
        }
    }
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        wr.write_all(&reqs).await.unwrap();
        wr
    });
    // The server still serves another connection while this one is stuck.
    let mut other = TcpStoreClient::connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    other.set(b"/other", b"1").await.unwrap();
    assert_eq!(other.get(b"/other").await.unwrap(), b"1");
    let one = blob(&value);
    let mut got = vec![0; one.len()];
    for i in 0..N {
        tokio::time::timeout(DEADLINE, rd.read_exact(&mut got)).await.expect("a reply is missing").unwrap();
        assert!(got == one, "reply {i} differs");
        if i % 1000 == 999 {
            let mut echo = [0; 4];
            tokio::time::timeout(DEADLINE, rd.read_exact(&mut echo)).await.expect("a PING echo is missing").unwrap();
            assert_eq!(echo, (i as u32).to_le_bytes(), "the PING echo after reply {i}");
        }
    }
    let wr = writer.await.unwrap();
    let mut s = rd.reunite(wr).unwrap();
    assert_quiet(&mut s).await;
}

/// Waits until the server holds no connection and no wait.
async fn until_all_closed(server: &TcpStoreServer) {
    until_stats(server, "connections are still open", |s| s.n_connections == 0 && s.n_waits == 0).await;
}

/// A peer that sends a WAIT and closes at once (the request and the end of the stream may come
/// in one readiness event) is closed, its wait with it; many times over.
#[tokio::test]
async fn a_peer_that_waits_and_closes_at_once_is_closed_with_its_wait() {
    let server = server().await;
    for _ in 0..100 {
        let mut s = validated(server.local_addr()).await;
        send(&mut s, &[Request::Wait { keys: vec![k("/never")] }]).await;
        drop(s);
    }
    until_all_closed(&server).await;
}

/// A peer paused for holding too many waits (1024) that goes away is closed at once, its waits
/// with it: the hang-up is reported once, while its reads are paused.
#[tokio::test]
async fn a_paused_peer_that_goes_away_is_closed_with_its_waits() {
    let server = server().await;
    let mut s = validated(server.local_addr()).await;
    let waits: Vec<Request> = (0..1024).map(|i| Request::Wait { keys: vec![k(&format!("/never/{i}"))] }).collect();
    send(&mut s, &waits).await;
    until_waits(&server, 1024).await;
    // More requests behind the pause stay unread (the connection is not read while paused).
    send(&mut s, &[Request::Ping { nonce: 1 }]).await;
    assert_eq!(server.stats().n_connections, 1);
    drop(s);
    until_all_closed(&server).await;
}

/// The server closed the connection cleanly (the end of the stream, not a reset) after
/// everything it sent before.
async fn assert_eof(s: &mut TcpStream) {
    let mut b = [0u8; 64];
    match tokio::time::timeout(DEADLINE, s.read(&mut b)).await.expect("the server did not close the connection") {
        Ok(0) => {}
        Ok(n) => panic!("expected the end of the stream, got {:02x?}", &b[..n]),
        Err(e) => panic!("expected a clean close, got {e}"),
    }
}

/// A client that writes its requests and then shuts down its write side (a script piping a
/// batch, torch's client on some exit paths) still reads the replies.
#[tokio::test]
async fn a_peer_that_shuts_down_its_write_side_still_gets_the_get_reply() {
    let server = server().await;
    let mut s = validated(server.local_addr()).await;
    send(&mut s, &[Request::Set { key: k("/k"), value: k("abc") }, Request::Get { key: k("/k") }]).await;
    s.shutdown().await.unwrap();
    assert_eq!(read_n(&mut s, 11).await, blob(b"abc"));
    assert_eof(&mut s).await;
    until_all_closed(&server).await;
}

/// The end of the stream comes while replies larger than the kernel buffers are being written
/// and requests are still held back (three GETs of 8 MiB pass the 16 MiB the server holds for
/// one peer): every reply arrives, in order, then the end of the stream. (The server used to
/// close at the end of the stream, dropping what it had not written or applied.)
#[tokio::test]
async fn a_half_closed_peer_gets_every_large_and_held_back_reply_in_order() {
    let server = server().await;
    let value: Vec<u8> = (0..8 << 20).map(|i: u32| (i % 251) as u8).collect();
    let mut s = validated(server.local_addr()).await;
    let mut reqs = vec![Request::Set { key: k("/big"), value: value.clone() }];
    for _ in 0..3 {
        reqs.push(Request::Get { key: k("/big") });
    }
    reqs.push(Request::Ping { nonce: 9 });
    send(&mut s, &reqs).await;
    s.shutdown().await.unwrap();
    let one = blob(&value);
    for i in 0..3 {
        let reply = read_n(&mut s, one.len()).await;
        assert!(reply == one, "GET {i}: the reply differs");
    }
    assert_eq!(read_n(&mut s, 4).await, 9u32.to_le_bytes());
    assert_eof(&mut s).await;
    until_all_closed(&server).await;
}

/// A WAIT still pending when its peer shuts down its write side is dropped, as torch's servers
/// drop a client's waits when its stream ends (the peer could no longer cancel it): a key
/// written afterwards does not answer it. The reply queued before the wait arrives; the one
/// behind it does not (it would read as the wait's answer); then a clean close.
#[tokio::test]
async fn a_wait_pending_when_the_peer_shuts_down_its_write_side_is_dropped_and_the_close_is_clean() {
    let server = server().await;
    let mut a = validated(server.local_addr()).await;
    send(&mut a, &[Request::Ping { nonce: 1 }, Request::Wait { keys: vec![k("/late")] }, Request::Ping { nonce: 2 }]).await;
    until_waits(&server, 1).await;
    a.shutdown().await.unwrap();
    until_stats(&server, "the half-closed peer's wait or connection was kept", |st| st.n_waits == 0 && st.n_connections == 0).await;
    let mut b = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    b.set(b"/late", b"1").await.unwrap();
    b.ping(3).await.unwrap();
    assert_eq!(read_n(&mut a, 4).await, 1u32.to_le_bytes());
    assert_eof(&mut a).await;
}

/// A peer that shut down its write side and reads none of its replies is not kept for ever: it
/// is closed once it has taken no byte for `stall_timeout`, not at the end of its stream.
#[tokio::test]
async fn a_half_closed_peer_that_reads_nothing_is_closed_after_stall_timeout() {
    let limits = TcpStoreLimits { stall_timeout: Duration::from_millis(300), ..TcpStoreLimits::default() };
    let server = start(limits).await;
    let mut w = TcpStoreClient::connect(server.local_addr()).await.unwrap();
    w.set(b"/big", &vec![1u8; 8 << 20]).await.unwrap();
    w.ping(1).await.unwrap();
    let mut s = validated(server.local_addr()).await;
    // A round trip first: the server has accepted this connection (two are counted) before the
    // close is waited for.
    send(&mut s, &[Request::Ping { nonce: 9 }]).await;
    assert_eq!(read_n(&mut s, 4).await, 9u32.to_le_bytes());
    // Taken before the requests: the server's clock is the last reply byte the peer took, which
    // is after this, so however long the test is descheduled before `shutdown` (a loaded host),
    // the close cannot come sooner than `stall_timeout` after `start`.
    let start = Instant::now();
    send(&mut s, &[Request::Get { key: k("/big") }, Request::Get { key: k("/big") }]).await;
    s.shutdown().await.unwrap();
    until_stats(&server, "the half-closed peer that reads nothing was kept", |st| st.n_connections == 1).await;
    assert!(start.elapsed() >= Duration::from_millis(250), "closed after {:?}", start.elapsed());
    w.ping(2).await.unwrap();
}

#[tokio::test]
async fn shutdown_closes_every_connection_and_the_listener() {
    // An address of its own on the loopback network: a server of a test running beside this one
    // may take the freed port on 127.0.0.1, which would answer the connect below.
    let server = TcpStoreServer::start("127.0.0.93:0".parse().unwrap(), TcpStoreLimits::default(), CancellationToken::new()).unwrap();
    let addr = server.local_addr();
    let mut idle = validated(addr).await;
    let mut waiting = validated(addr).await;
    send(&mut waiting, &[Request::Wait { keys: vec![k("/never")] }]).await;
    until_waits(&server, 1).await;
    tokio::time::timeout(DEADLINE, server.shutdown()).await.expect("shutdown hung");
    assert_closed(&mut idle).await;
    assert_closed(&mut waiting).await;
    assert!(TcpStream::connect(addr).await.is_err(), "the listener is still open");
}

/// Many times over: a drop right after the connection used to lose the loop's wake-up now and
/// then (the last handle of the waker closed its eventfd, and with it the pending event, before
/// the loop's `epoll_wait` took it), leaving the loop asleep with its sockets open.
#[tokio::test]
async fn cancelling_the_parent_token_or_dropping_the_server_closes_connections() {
    for _ in 0..300 {
        let parent = CancellationToken::new();
        let server = TcpStoreServer::start("127.0.0.1:0".parse().unwrap(), TcpStoreLimits::default(), parent.clone()).unwrap();
        let mut s = validated(server.local_addr()).await;
        parent.cancel();
        assert_closed(&mut s).await;
        let server = self::server().await;
        let mut s = validated(server.local_addr()).await;
        drop(server);
        assert_closed(&mut s).await;
    }
}

/// `rsrun-rendezvous tcpstore`, a real process.
mod subcommand {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    const BIN: &str = env!("CARGO_BIN_EXE_rsrun-rendezvous");

    struct Child(std::process::Child);

    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[tokio::test]
    async fn prints_its_port_first_serves_an_empty_store_and_exits_on_sigterm() {
        for _ in 0..2 {
            let mut child = Child(
                Command::new(BIN)
                    .args(["tcpstore", "--listen", "127.0.0.1:0", "--print-port"])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap(),
            );
            let mut line = String::new();
            BufReader::new(child.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
            let port: u16 = line.trim().parse().unwrap_or_else(|_| panic!("first line is not a port: {line:?}"));
            let mut c = TcpStoreClient::connect(SocketAddr::from(([127, 0, 0, 1], port))).await.unwrap();
            // A new process, a new keyspace: the previous iteration's key is not here.
            assert_eq!(c.num_keys().await.unwrap(), 0);
            c.set(b"/k", b"v").await.unwrap();
            assert_eq!(c.get(b"/k").await.unwrap(), b"v");
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.0.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
            let status = child.0.wait().unwrap();
            assert!(status.success(), "{status}");
        }
    }

    #[test]
    fn prints_the_address_without_print_port() {
        let mut child = Child(
            Command::new(BIN).args(["tcpstore", "--listen", "127.0.0.1:0"]).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap(),
        );
        let mut line = String::new();
        BufReader::new(child.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr: SocketAddr = line.trim().parse().unwrap_or_else(|_| panic!("first line is not an address: {line:?}"));
        assert!(addr.ip().is_loopback() && addr.port() != 0);
    }

    #[test]
    fn refuses_a_non_loopback_address_without_insecure_and_bad_flags() {
        for args in [&["tcpstore", "--listen", "0.0.0.0:0"][..], &["tcpstore", "--listen", "nonsense"], &["tcpstore", "--bogus"]] {
            let out = Command::new(BIN).args(args).output().unwrap();
            assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
            assert!(out.stdout.is_empty(), "{args:?} printed {:?}", String::from_utf8_lossy(&out.stdout));
        }
        let out = Command::new(BIN).args(["tcpstore", "--listen", "0.0.0.0:0"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("no authentication") && err.contains("--insecure"), "{err}");
        let help = Command::new(BIN).args(["tcpstore", "--help"]).output().unwrap();
        let help = String::from_utf8_lossy(&help.stdout);
        assert!(help.contains("no authentication"), "{help}");
        let _ = std::io::stderr().flush();
    }
}

/// Replies that were written and read are no longer held: many clients that each GET a large
/// value, together far past `max_buffered_bytes`, are all served and none is closed.
#[tokio::test]
async fn replies_read_by_their_clients_do_not_count_toward_the_budget() {
    let limits = TcpStoreLimits { max_buffered_bytes: 4 << 20, ..TcpStoreLimits::default() };
    let server = start(limits).await;
    let value = vec![9u8; 1 << 20];
    let mut w = validated(server.local_addr()).await;
    send(&mut w, &[Request::Set { key: k("/cfg"), value: value.clone() }]).await;
    until_stats(&server, "the SET was not applied", |st| st.n_keys == 1).await;
    // Sixteen clients each read the 1 MiB value, one after another: 16 MiB served in all.
    let mut clients = Vec::new();
    for _ in 0..16 {
        let mut c = validated(server.local_addr()).await;
        send(&mut c, &[Request::Get { key: k("/cfg") }]).await;
        assert_eq!(read_n(&mut c, 8 + value.len()).await, blob(&value));
        clients.push(c);
    }
    until_stats(&server, "written replies are still counted", |st| st.buffered_bytes < 1 << 20).await;
    let st = server.stats();
    assert_eq!(st.shed_connections, 0, "{st:?}");
    for c in &mut clients {
        assert_quiet(c).await;
    }
}

/// A GET of the 24 MiB value, a reply bigger than the kernel buffers take, so the server holds
/// most of it until the peer reads: `h` sends it, then this waits until the server holds at
/// least `at_least` bytes, and returns what it holds then (that reply, less what the kernel took).
async fn big_get(server: &TcpStoreServer, h: &mut TcpStream, at_least: usize) -> usize {
    send(h, &[Request::Get { key: k("/big") }]).await;
    until_stats(server, "the GET reply was not built", |st| st.buffered_bytes >= at_least).await;
    server.stats().buffered_bytes
}

/// Reads `want` from `h` 64 KiB at a time with `pause` after each read (10 ms: about 6 MiB/s):
/// slow, but far above what shedding calls draining (64 KiB/s).
fn read_slowly(mut h: TcpStream, want: Vec<u8>, pause: Duration) -> tokio::task::JoinHandle<TcpStream> {
    tokio::spawn(async move {
        let mut got = Vec::with_capacity(want.len());
        let mut chunk = vec![0u8; 64 << 10];
        while got.len() < want.len() {
            let room = chunk.len().min(want.len() - got.len());
            let n = tokio::time::timeout(DEADLINE, h.read(&mut chunk[..room])).await.expect("the reply stopped coming").unwrap();
            assert!(n > 0, "the connection was closed after {} of {} bytes", got.len(), want.len());
            got.extend_from_slice(&chunk[..n]);
            tokio::time::sleep(pause).await;
        }
        assert!(got == want, "the reply differs");
        h
    })
}

/// Reads `s` until the server closes it; returns how many bytes came first.
async fn drain_to_close(s: &mut TcpStream) -> usize {
    let mut b = vec![0u8; 1 << 20];
    let mut got = 0;
    loop {
        match tokio::time::timeout(DEADLINE, s.read(&mut b)).await.expect("the server did not close the connection") {
            Ok(0) | Err(_) => return got,
            Ok(n) => got += n,
        }
    }
}

/// A store of one 24 MiB value under a 25 MiB budget for all connections.
async fn store_of_one_big_value() -> (TcpStoreServer, Vec<u8>) {
    const VALUE: usize = 24 << 20;
    let limits = TcpStoreLimits { max_value_bytes: VALUE, max_buffered_bytes: 25 << 20, ..TcpStoreLimits::default() };
    let server = start(limits).await;
    let value: Vec<u8> = (0..VALUE).map(|i| (i % 251) as u8).collect();
    let mut w = validated(server.local_addr()).await;
    send(&mut w, &[Request::Set { key: k("/big"), value: value.clone() }]).await;
    until_stats(&server, "the SET was not applied", |st| st.n_keys == 1 && st.buffered_bytes == 0).await;
    (server, value)
}

/// A rank downloading a large value slowly holds the most, when another peer's unfinished
/// upload pushes the server past `max_buffered_bytes`: the upload is closed, not the download
/// (which the server used to close, as the largest holder).
#[tokio::test]
async fn shedding_spares_a_slow_reader_and_closes_the_stalled_upload_that_passed_the_budget() {
    let (server, value) = store_of_one_big_value().await;
    let addr = server.local_addr();
    let mut h = validated(addr).await;
    big_get(&server, &mut h, 12 << 20).await;
    // About 3 MiB/s: of the 12 MiB or more of the reply the server holds now, it still holds
    // more than 1 MiB for over 3 s, so the 24 MiB upload below holds the server past its 25 MiB
    // budget with it when the upload counts as stalled (a drain window, 1 s, after its last
    // byte: bytes a peer sends of a request count as moving, as replies it takes do).
    let reader = read_slowly(h, blob(&value), Duration::from_millis(20));
    // An upload that stops one byte short: past the budget with the reply the moment it is
    // read, whatever the reader took by then (and under twice the budget: 24 + 24 MiB).
    let mut g = validated(addr).await;
    let set = enc(&[Request::Set { key: k("/other"), value: vec![7; value.len()] }]);
    let _ = g.write_all(&set[..set.len() - 1]).await;
    until_stats(&server, "no connection was shed", |st| st.shed_connections == 1).await;
    assert_closed(&mut g).await;
    let mut h = tokio::time::timeout(DEADLINE, reader).await.expect("the reader hung").unwrap();
    assert_quiet(&mut h).await;
    let st = server.stats();
    assert_eq!((st.shed_connections, st.n_keys), (1, 1), "{st:?}");
}

/// A peer that asked for a large value and does not read it, and a rank that reads its own:
/// past the budget, the one not reading is closed, though it holds less.
#[tokio::test]
async fn shedding_closes_the_peer_that_does_not_read_its_reply_not_the_one_that_does() {
    let (server, value) = store_of_one_big_value().await;
    let addr = server.local_addr();
    let mut idle = validated(addr).await;
    let idle_held = big_get(&server, &mut idle, 12 << 20).await;
    // Past a drain window without a byte taken.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(server.stats().shed_connections, 0, "alone under the budget");
    // The reader's reply, just built, is the largest holding; the idle peer's is past the budget
    // with it.
    let mut h = validated(addr).await;
    send(&mut h, &[Request::Get { key: k("/big") }]).await;
    let reader = read_slowly(h, blob(&value), Duration::from_millis(10));
    until_stats(&server, "no connection was shed", |st| st.shed_connections == 1).await;
    // The idle peer gets what the kernel had taken, never the rest of its reply.
    let got = drain_to_close(&mut idle).await;
    assert!(got < 8 + value.len() && got + idle_held >= 8 + value.len(), "the idle peer got {got} bytes of its reply");
    let mut h = tokio::time::timeout(DEADLINE, reader).await.expect("the reader hung").unwrap();
    assert_quiet(&mut h).await;
    assert_eq!(server.stats().shed_connections, 1);
}

/// A large SET arriving steadily is the largest holder when a stalled upload and it pass
/// `max_buffered_bytes` together: the stalled one is closed, and the one still sending finishes
/// and is applied (the server used to close it first: it takes no replies, so it never counted
/// as draining).
#[tokio::test]
async fn shedding_spares_an_upload_in_progress_and_closes_the_stalled_one() {
    const VALUE: usize = 10 << 20;
    let limits = TcpStoreLimits { max_value_bytes: VALUE, max_buffered_bytes: 8 << 20, ..TcpStoreLimits::default() };
    let server = start(limits).await;
    let addr = server.local_addr();
    // 3 MiB of a 4 MiB SET, then nothing more.
    let mut stalled = validated(addr).await;
    let partial = enc(&[Request::Set { key: k("/stalled"), value: vec![1; 4 << 20] }]);
    stalled.write_all(&partial[..3 << 20]).await.unwrap();
    until_stats(&server, "the stalled upload was not read", |st| st.buffered_bytes >= (3 << 20) - 64).await;
    // A 10 MiB SET at about 3 MiB/s (64 KiB every 20 ms), then a PING: past the budget with the
    // stalled one once it holds 5 MiB (over a second later: the stalled one no longer counts
    // as moving), and the largest holder from then on; under twice the budget throughout.
    let mut up = validated(addr).await;
    let set = enc(&[Request::Set { key: k("/up"), value: vec![2; VALUE] }, Request::Ping { nonce: 7 }]);
    let uploader = tokio::spawn(async move {
        for chunk in set.chunks(64 << 10) {
            up.write_all(chunk).await.expect("the upload in progress was closed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        up
    });
    until_stats(&server, "no connection was shed", |st| st.shed_connections == 1).await;
    let mut up = tokio::time::timeout(DEADLINE, uploader).await.expect("the upload hung").unwrap();
    assert_eq!(read_n(&mut up, 4).await, 7u32.to_le_bytes(), "the upload in progress was not applied");
    assert_closed(&mut stalled).await;
    let st = server.stats();
    assert_eq!((st.shed_connections, st.n_keys), (1, 1), "{st:?}");
}
