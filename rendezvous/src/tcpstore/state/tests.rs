use super::*;
use crate::tcpstore::replies::ReplyQueue;

const A: ConnId = ConnId(1);
const B: ConnId = ConnId(2);

fn k(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

fn store() -> StoreState {
    StoreState::new(1 << 20)
}

fn ok(s: &mut StoreState, conn: ConnId, req: Request) -> Applied {
    let a = s.apply(conn, req).unwrap();
    check_invariants(s);
    a
}

/// The reply bytes of a request that answers at once.
fn bytes(s: &mut StoreState, conn: ConnId, req: Request) -> Vec<u8> {
    match ok(s, conn, req).reply {
        Reply::Bytes(b) => b,
        other => panic!("expected bytes, got {other:?}"),
    }
}

fn pending(s: &mut StoreState, conn: ConnId, req: Request) -> WaitId {
    match ok(s, conn, req).reply {
        Reply::Pending(id) => id,
        other => panic!("expected a pending wait, got {other:?}"),
    }
}

fn blob(v: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    proto::put_bytes(&mut out, v);
    out
}

fn set(key: &str, value: &str) -> Request {
    Request::Set { key: k(key), value: k(value) }
}

fn wait(keys: &[&str]) -> Request {
    Request::Wait { keys: keys.iter().map(|s| k(s)).collect() }
}

/// Byte accounting and waiter bookkeeping agree with the data.
fn check_invariants(s: &StoreState) {
    let kv: usize = s.kv.iter().map(|(k, v)| k.len() + v.len()).sum();
    let q: usize = s.queues.iter().map(|(k, q)| k.len() + q.iter().map(Vec::len).sum::<usize>()).sum();
    assert_eq!(s.n_bytes, kv + q, "byte accounting");
    assert!(s.queues.values().all(|q| !q.is_empty()), "an empty queue was kept");
    for (key, set) in &s.key_waiters {
        assert!(!set.is_empty());
        assert!(!s.kv.contains_key(key), "a waiter is registered on a present key");
        for id in set {
            assert!(matches!(s.waits.get(id), Some(PendingWait::Keys { .. })), "dangling key waiter {id:?}");
        }
    }
    for set in s.barrier_waiters.values() {
        assert!(!set.is_empty());
        assert!(set.iter().all(|id| matches!(s.waits.get(id), Some(PendingWait::Barrier { .. }))));
    }
    for (id, w) in &s.waits {
        assert!(s.conn_waits.get(&id.conn).is_some_and(|c| c.contains(id)), "wait {id:?} not listed for its connection");
        if let PendingWait::Keys { remaining, keys } = w {
            let registered = keys.iter().filter(|k| s.key_waiters.get(*k).is_some_and(|set| set.contains(id))).count();
            assert_eq!(*remaining, registered, "remaining count of {id:?}");
            assert!(*remaining > 0);
        }
    }
    let listed: usize = s.conn_waits.values().map(BTreeSet::len).sum();
    assert_eq!(listed, s.waits.len());
    // Every pending wait's bookkeeping is charged to its connection, and the total is their sum.
    let mut charged: HashMap<ConnId, usize> = HashMap::new();
    for (id, w) in &s.waits {
        *charged.entry(id.conn).or_default() += match w {
            PendingWait::Keys { keys, .. } => wait_cost(keys),
            PendingWait::Barrier { key } => wait_cost(std::slice::from_ref(key)),
        };
    }
    assert_eq!(charged, s.conn_wait_bytes, "wait bytes per connection");
    // Remembered queue wake-ups: counted per queue and per connection's bytes.
    let mut per_queue: HashMap<Key, usize> = HashMap::new();
    for keys in s.queue_woken.values() {
        assert!(!keys.is_empty(), "an empty wake-up list was kept");
        for key in keys {
            *per_queue.entry(key.clone()).or_default() += 1;
        }
    }
    assert_eq!(per_queue, s.woken_per_queue, "wake-ups per queue");
    let bytes: HashMap<ConnId, usize> = s.queue_woken.iter().map(|(c, ks)| (*c, ks.iter().map(Vec::len).sum())).collect();
    assert_eq!(bytes, s.woken_bytes, "wake-up bytes per connection");
    assert_eq!(s.total_wait_bytes, s.conn_wait_bytes.values().sum::<usize>(), "wait bytes in all");
}

#[test]
fn reference_byte_examples() {
    // tcpstore.md §3, "Byte examples".
    let mut s = store();
    assert_eq!(bytes(&mut s, A, Request::Ping { nonce: 0xAABB_CCDD }), [0xdd, 0xcc, 0xbb, 0xaa]);
    assert_eq!(ok(&mut s, A, set("/k", "abc")).reply, Reply::None);
    assert_eq!(bytes(&mut s, A, Request::Get { key: k("/k") }), blob(b"abc"));
    assert_eq!(bytes(&mut s, A, Request::Add { key: k("/ctr"), delta: 5 }), 5i64.to_le_bytes());
    assert_eq!(bytes(&mut s, A, Request::Add { key: k("/ctr"), delta: -7 }), [0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
    assert_eq!(bytes(&mut s, A, Request::Get { key: k("/ctr") }), blob(b"-2"));
    assert_eq!(bytes(&mut s, A, Request::Check { keys: vec![k("/k"), k("/nope")] }), [NOT_READY]);
    ok(&mut s, A, Request::MultiSet { pairs: vec![(k("m1"), k("x")), (k("m2"), k("y"))] });
    assert_eq!(bytes(&mut s, A, Request::MultiGet { keys: vec![k("m1"), k("m2")] }), [blob(b"x"), blob(b"y")].concat());
    ok(&mut s, A, Request::QueuePush { key: k("/q"), value: k("q1") });
    assert_eq!(bytes(&mut s, A, Request::QueuePop { key: k("/q") }), [&1i64.to_le_bytes()[..], &blob(b"q1")].concat());
    assert_eq!(bytes(&mut s, A, Request::QueuePop { key: k("/q") }), 0i64.to_le_bytes());
    assert_eq!(bytes(&mut s, A, Request::CancelWait), [WAIT_CANCELED]);
}

#[test]
fn get_and_multi_get_of_missing_keys_are_empty() {
    let mut s = store();
    assert_eq!(bytes(&mut s, A, Request::Get { key: k("/nope") }), blob(b""));
    ok(&mut s, A, set("a", "1"));
    assert_eq!(bytes(&mut s, A, Request::MultiGet { keys: vec![k("a"), k("nope")] }), [blob(b"1"), blob(b"")].concat());
}

#[test]
fn compare_set_follows_torch_including_the_missing_key_reply() {
    let mut s = store();
    let cas = |key: &str, e: &str, d: &str| Request::CompareSet { key: k(key), expected: k(e), desired: k(d) };
    // Missing key, non-empty expected: echoes `expected` and stores nothing.
    assert_eq!(bytes(&mut s, A, cas("/c", "old", "new")), blob(b"old"));
    assert_eq!(bytes(&mut s, A, Request::GetNumKeys), 0i64.to_le_bytes());
    // Missing key, empty expected: creates.
    assert_eq!(bytes(&mut s, A, cas("/c", "", "new")), blob(b"new"));
    // Present key, wrong expected: the current value.
    assert_eq!(bytes(&mut s, A, cas("/c", "zzz", "other")), blob(b"new"));
    // Present key, right expected: swapped.
    assert_eq!(bytes(&mut s, A, cas("/c", "new", "newer")), blob(b"newer"));
    assert_eq!(bytes(&mut s, A, Request::Get { key: k("/c") }), blob(b"newer"));
}

#[test]
fn add_parses_like_stoll_and_refuses_non_numbers() {
    let mut s = store();
    ok(&mut s, A, set("/n", " 12abc"));
    assert_eq!(bytes(&mut s, A, Request::Add { key: k("/n"), delta: 1 }), 13i64.to_le_bytes());
    assert_eq!(bytes(&mut s, A, Request::Get { key: k("/n") }), blob(b"13"));
    // test_store.py: add 1 + 2 + 3 → "6".
    for d in [1, 2, 3] {
        ok(&mut s, A, Request::Add { key: k("key"), delta: d });
    }
    assert_eq!(bytes(&mut s, A, Request::Get { key: k("key") }), blob(b"6"));
    ok(&mut s, A, set("/p", "potato"));
    let err = s.apply(A, Request::Add { key: k("/p"), delta: 1 }).unwrap_err();
    assert_eq!(err, RdzvError::TcpStoreNotANumber { key: "/p".into(), value: "potato".into() });
    assert_eq!(bytes(&mut s, A, Request::Get { key: k("/p") }), blob(b"potato"), "a failed ADD changes nothing");
    ok(&mut s, A, set("/max", &i64::MAX.to_string()));
    assert!(matches!(s.apply(A, Request::Add { key: k("/max"), delta: 1 }), Err(RdzvError::TcpStoreNotANumber { .. })));
    check_invariants(&s);
}

#[test]
fn stoll_matches_cpp() {
    assert_eq!(stoll(b" 12abc"), Some(12));
    assert_eq!(stoll(b"\t\n-5"), Some(-5));
    assert_eq!(stoll(b"+7x"), Some(7));
    assert_eq!(stoll(b"007"), Some(7));
    assert_eq!(stoll(b"-9223372036854775808"), Some(i64::MIN));
    assert_eq!(stoll(b"9223372036854775807"), Some(i64::MAX));
    assert_eq!(stoll(b"9223372036854775808"), None);
    for bad in [&b""[..], b"potato", b"-", b"+", b" ", b"- 1", b"abc12"] {
        assert_eq!(stoll(bad), None, "{:?}", String::from_utf8_lossy(bad));
    }
}

#[test]
fn check_and_wait_of_no_keys_are_ready_at_once() {
    let mut s = store();
    assert_eq!(bytes(&mut s, A, Request::Check { keys: vec![] }), [READY]);
    assert_eq!(bytes(&mut s, A, Request::Wait { keys: vec![] }), [STOP_WAITING]);
}

#[test]
fn a_wait_is_woken_by_writes_of_its_key_from_another_connection() {
    for write in [
        set("/x", "v"),
        Request::Add { key: k("/x"), delta: 1 },
        Request::Append { key: k("/x"), value: k("a") },
        Request::MultiSet { pairs: vec![(k("/y"), k("1")), (k("/x"), k("2"))] },
        Request::CompareSet { key: k("/x"), expected: k(""), desired: k("v") },
        Request::Barrier { key: k("/x"), world_size: 5 },
    ] {
        let mut s = store();
        let id = pending(&mut s, A, wait(&["/x"]));
        assert_eq!(id.conn(), A);
        let applied = ok(&mut s, B, write.clone());
        assert_eq!(applied.woken, vec![id], "{write:?}");
        assert_eq!(s.stats().n_waits, usize::from(matches!(write, Request::Barrier { .. })));
    }
}

#[test]
fn a_failed_compare_set_or_a_delete_wakes_nobody() {
    let mut s = store();
    let id = pending(&mut s, A, wait(&["/x"]));
    assert!(ok(&mut s, B, Request::CompareSet { key: k("/x"), expected: k("nonempty"), desired: k("new") }).woken.is_empty());
    assert!(ok(&mut s, B, Request::DeleteKey { key: k("/x") }).woken.is_empty());
    assert!(ok(&mut s, B, Request::Get { key: k("/x") }).woken.is_empty());
    assert_eq!(ok(&mut s, B, set("/x", "v")).woken, vec![id]);
}

#[test]
fn a_multi_key_wait_needs_every_key() {
    let mut s = store();
    ok(&mut s, B, set("/present", "1"));
    let id = pending(&mut s, A, wait(&["/a", "/present", "/b", "/a"]));
    assert!(ok(&mut s, B, set("/a", "1")).woken.is_empty());
    assert!(ok(&mut s, B, set("/a", "2")).woken.is_empty(), "a second write of the same key does not count twice");
    assert_eq!(ok(&mut s, B, set("/b", "1")).woken, vec![id]);
    assert_eq!(s.stats().n_waits, 0);
}

#[test]
fn two_pushes_to_one_queue_do_not_complete_a_wait_that_also_needs_another_key() {
    // The libuv bug (tcpstore.md §4.6) must not be copied.
    let mut s = store();
    let id = pending(&mut s, A, wait(&["q", "r"]));
    assert!(ok(&mut s, B, Request::QueuePush { key: k("q"), value: k("1") }).woken.is_empty());
    assert!(ok(&mut s, B, Request::QueuePush { key: k("q"), value: k("2") }).woken.is_empty());
    assert_eq!(ok(&mut s, B, set("r", "x")).woken, vec![id]);
}

/// A push goes to the oldest wait it completes: a blocked pop behind an older wait that also needs
/// another key is woken (torch's server wakes it too), and the older wait still counts the queue.
#[test]
fn a_queue_push_wakes_the_oldest_wait_it_completes() {
    let mut s = store();
    let both = pending(&mut s, A, wait(&["q", "r"]));
    let pop = pending(&mut s, B, wait(&["q"]));
    assert_eq!(ok(&mut s, ConnId(3), Request::QueuePush { key: k("q"), value: k("1") }).woken, vec![pop]);
    assert_eq!(ok(&mut s, ConnId(3), Request::QueuePush { key: k("q"), value: k("2") }).woken, vec![]);
    assert_eq!(ok(&mut s, ConnId(3), set("r", "x")).woken, vec![both]);
}

#[test]
fn a_queue_push_wakes_one_waiter_the_oldest() {
    let mut s = store();
    let first = pending(&mut s, A, wait(&["q"]));
    let second = pending(&mut s, B, wait(&["q"]));
    assert_eq!(ok(&mut s, ConnId(3), Request::QueuePush { key: k("q"), value: k("1") }).woken, vec![first]);
    // A non-empty queue counts as present for CHECK and WAIT.
    assert_eq!(bytes(&mut s, ConnId(3), Request::Check { keys: vec![k("q")] }), [READY]);
    assert_eq!(bytes(&mut s, ConnId(3), wait(&["q"])), [STOP_WAITING]);
    assert_eq!(ok(&mut s, ConnId(3), Request::QueuePush { key: k("q"), value: k("2") }).woken, vec![second]);
    assert_eq!(bytes(&mut s, A, Request::QueueLen { key: k("q") }), 2i64.to_le_bytes());
    // Queues are not keys.
    assert_eq!(bytes(&mut s, A, Request::GetNumKeys), 0i64.to_le_bytes());
    assert_eq!(bytes(&mut s, A, Request::QueuePop { key: k("q") }), [&2i64.to_le_bytes()[..], &blob(b"1")].concat());
}

/// A connection woken for a queue item that goes away before popping it hands the item's wake-up
/// to the next waiter (it would otherwise wait for the next push); one that popped hands nothing.
#[test]
fn a_connection_that_leaves_before_its_pop_hands_the_wake_up_on() {
    let mut s = store();
    let first = pending(&mut s, A, wait(&["q"]));
    let second = pending(&mut s, B, wait(&["q"]));
    assert_eq!(ok(&mut s, ConnId(3), Request::QueuePush { key: k("q"), value: k("1") }).woken, vec![first]);
    assert_eq!(s.disconnect(A), vec![second]);
    // B pops, then goes: nothing left to hand on.
    assert_eq!(bytes(&mut s, B, Request::QueuePop { key: k("q") }), [&1i64.to_le_bytes()[..], &blob(b"1")].concat());
    let third = pending(&mut s, ConnId(4), wait(&["q"]));
    assert!(s.disconnect(B).is_empty());
    // An item already popped by someone else is not handed on either.
    let fourth = pending(&mut s, ConnId(5), wait(&["q"]));
    assert_eq!(ok(&mut s, ConnId(3), Request::QueuePush { key: k("q"), value: k("2") }).woken, vec![third]);
    ok(&mut s, ConnId(3), Request::QueuePop { key: k("q") });
    assert!(s.disconnect(ConnId(4)).is_empty());
    assert_eq!(s.stats().n_waits, 1, "{fourth:?} still waits");
    // One item, two woken for it in turn (the first went away): when the first's item was taken
    // by a client that did not wait, the second's own wake-up is not handed on again.
    let mut s = store();
    let a = pending(&mut s, A, wait(&["q"]));
    let b = pending(&mut s, B, wait(&["q"]));
    let _c = pending(&mut s, ConnId(6), wait(&["q"]));
    assert_eq!(ok(&mut s, ConnId(3), Request::QueuePush { key: k("q"), value: k("1") }).woken, vec![a]);
    assert_eq!(ok(&mut s, ConnId(3), Request::QueuePush { key: k("q"), value: k("2") }).woken, vec![b]);
    ok(&mut s, ConnId(7), Request::QueuePop { key: k("q") });
    assert!(s.disconnect(A).is_empty(), "one item left, and B is on its way to it");
    // A woken connection whose next request is neither its pop nor a look at that queue is not
    // on its way: the wake-up goes on at once (and its entry does not hold back anyone's later).
    let mut s = store();
    let a = pending(&mut s, A, wait(&["q"]));
    let b = pending(&mut s, B, wait(&["q"]));
    assert_eq!(ok(&mut s, ConnId(3), Request::QueuePush { key: k("q"), value: k("1") }).woken, vec![a]);
    assert_eq!(ok(&mut s, A, Request::Check { keys: vec![k("other")] }).woken, vec![b]);
    assert!(s.disconnect(A).is_empty());
}

/// torch's blocking queue_pop WAITs on the queue before it pops: a connection woken for an item
/// (by a plain wait) that then calls queue_pop, or looks at the queue first, keeps its wake-up,
/// and nobody else is woken to find the queue empty (QueueEmptyError in torch).
#[test]
fn a_woken_connection_that_waits_on_its_queue_before_popping_keeps_its_wake_up() {
    let mut s = store();
    let a = pending(&mut s, A, wait(&["q"]));
    let b = pending(&mut s, B, wait(&["q"]));
    assert_eq!(ok(&mut s, ConnId(3), Request::QueuePush { key: k("q"), value: k("1") }).woken, vec![a]);
    for look in [wait(&["q"]), Request::Check { keys: vec![k("q")] }, Request::QueueLen { key: k("q") }] {
        assert!(ok(&mut s, A, look).woken.is_empty(), "B was woken for A's item");
    }
    assert_eq!(bytes(&mut s, A, Request::QueuePop { key: k("q") }), [&1i64.to_le_bytes()[..], &blob(b"1")].concat());
    assert!(s.disconnect(A).is_empty());
    assert_eq!(s.stats().n_waits, 1, "{b:?} waits for the next push");
}

/// A request that fails (and closes its connection) does not spend the wake-up it would have
/// handed on: the connection's going away hands it on, and the next waiter is woken.
#[test]
fn a_failing_request_keeps_the_wake_up_for_the_disconnect_to_hand_on() {
    let mut s = store();
    ok(&mut s, ConnId(3), set("/k", "potato"));
    let a = pending(&mut s, A, wait(&["q"]));
    let b = pending(&mut s, B, wait(&["q"]));
    assert_eq!(ok(&mut s, ConnId(3), Request::QueuePush { key: k("q"), value: k("1") }).woken, vec![a]);
    assert!(s.apply(A, Request::Add { key: k("/k"), delta: 1 }).is_err());
    check_invariants(&s);
    assert_eq!(s.stats().n_waits, 1, "B's wait was completed and its wake-up dropped");
    assert_eq!(s.disconnect(A), vec![b]);
    check_invariants(&s);
}

/// The wake-ups a connection is remembered for hold at most their byte cap of queue names (the
/// oldest dropped), and a hand-on counts those on their way per queue, not by scanning.
#[test]
fn remembered_wake_ups_are_bounded_in_bytes() {
    let mut s = StoreState::new(1 << 30);
    let name = |i: usize| format!("{i:04}{}", "q".repeat(4096));
    for i in 0..64 {
        pending(&mut s, A, wait(&[&name(i)]));
        ok(&mut s, ConnId(3), Request::QueuePush { key: k(&name(i)), value: k("x") });
    }
    let held = s.woken_bytes[&A];
    assert!(held <= MAX_QUEUE_WAKE_BYTES_PER_CONN, "{held} bytes of remembered wake-ups");
    assert!(s.queue_woken[&A].len() < 64 && s.queue_woken[&A].back() == Some(&k(&name(63))));
    check_invariants(&s);
}

#[test]
fn cancel_wait_drops_the_connections_waits_and_always_answers() {
    let mut s = store();
    let a = pending(&mut s, A, wait(&["/x", "/y"]));
    let b = pending(&mut s, B, wait(&["/x"]));
    let cancel = ok(&mut s, A, Request::CancelWait);
    assert_eq!(cancel.reply, Reply::Bytes(vec![WAIT_CANCELED]));
    assert_eq!(cancel.cancelled, vec![a]);
    // A's cancelled wait is never woken; B's still is.
    assert_eq!(ok(&mut s, ConnId(3), set("/x", "1")).woken, vec![b]);
    assert!(ok(&mut s, ConnId(3), set("/y", "1")).woken.is_empty());
    // Nothing pending: still 01.
    let again = ok(&mut s, A, Request::CancelWait);
    assert_eq!((again.reply, again.cancelled), (Reply::Bytes(vec![WAIT_CANCELED]), vec![]));
}

#[test]
fn a_woken_wait_cannot_be_cancelled_and_a_disconnect_leaves_nothing_behind() {
    let mut s = store();
    let a = pending(&mut s, A, wait(&["/x"]));
    assert_eq!(ok(&mut s, B, set("/x", "1")).woken, vec![a]);
    assert!(ok(&mut s, A, Request::CancelWait).cancelled.is_empty());
    pending(&mut s, A, wait(&["/p", "/q"]));
    pending(&mut s, A, Request::Barrier { key: k("/bar"), world_size: 3 });
    s.disconnect(A);
    check_invariants(&s);
    assert_eq!(s.stats().n_waits, 0);
    assert!(s.key_waiters.is_empty() && s.barrier_waiters.is_empty() && s.conn_waits.is_empty());
}

#[test]
fn barrier_completes_on_the_last_arrival_and_a_reused_key_passes_at_once() {
    let mut s = store();
    let a = pending(&mut s, A, Request::Barrier { key: k("/bar"), world_size: 2 });
    let last = ok(&mut s, B, Request::Barrier { key: k("/bar"), world_size: 2 });
    assert_eq!((last.reply, last.woken), (Reply::Bytes(vec![STOP_WAITING]), vec![a]));
    assert_eq!(bytes(&mut s, A, Request::Get { key: k("/bar") }), blob(b"2"));
    // The counter never resets.
    assert_eq!(bytes(&mut s, A, Request::Barrier { key: k("/bar"), world_size: 2 }), [STOP_WAITING]);
    assert_eq!(bytes(&mut s, A, Request::Get { key: k("/bar") }), blob(b"3"));
    // Other writes of the counter do not release barrier waiters.
    let c = pending(&mut s, A, Request::Barrier { key: k("/b2"), world_size: 3 });
    assert!(ok(&mut s, B, set("/b2", "1")).woken.is_empty());
    assert!(ok(&mut s, B, Request::Add { key: k("/b2"), delta: 5 }).woken.is_empty());
    assert_eq!(ok(&mut s, B, Request::Barrier { key: k("/b2"), world_size: 3 }).woken, vec![c]);
    // A non-numeric counter closes the caller's connection, as ADD does.
    ok(&mut s, B, set("/b3", "x"));
    assert!(s.apply(B, Request::Barrier { key: k("/b3"), world_size: 2 }).is_err());
}

#[test]
fn list_keys_and_num_keys_include_init() {
    let mut s = store();
    ok(&mut s, A, Request::Add { key: k("init/"), delta: 1 });
    ok(&mut s, A, set("/a", "1"));
    let reply = bytes(&mut s, A, Request::ListKeys);
    assert_eq!(&reply[..8], 2i64.to_le_bytes());
    let mut keys = Vec::new();
    let mut rest = &reply[8..];
    while !rest.is_empty() {
        let n = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
        keys.push(rest[8..8 + n].to_vec());
        rest = &rest[8 + n..];
    }
    keys.sort();
    assert_eq!(keys, vec![k("/a"), k("init/")]);
    assert_eq!(bytes(&mut s, A, Request::GetNumKeys), 2i64.to_le_bytes());
    assert_eq!(bytes(&mut s, A, Request::DeleteKey { key: k("/a") }), 1i64.to_le_bytes());
    assert_eq!(bytes(&mut s, A, Request::DeleteKey { key: k("/a") }), 0i64.to_le_bytes());
}

#[test]
fn the_total_byte_cap_refuses_writes_without_changing_anything() {
    let mut s = StoreState::new(10);
    ok(&mut s, A, set("k", "123456789"));
    assert_eq!(s.stats().n_bytes, 10);
    let over = s.apply(A, set("j", "")).unwrap_err();
    assert_eq!(over, RdzvError::TcpStoreLimit { limit: "store size", value: 11, max: 10 });
    assert!(s.apply(A, Request::Append { key: k("k"), value: k("x") }).is_err());
    assert!(s.apply(A, Request::QueuePush { key: k("q"), value: k("") }).is_err());
    // Overwriting with something no larger fits.
    ok(&mut s, A, set("k", "abcdefghi"));
    ok(&mut s, A, Request::DeleteKey { key: k("k") });
    assert_eq!(s.stats().n_bytes, 0);
    ok(&mut s, A, Request::QueuePush { key: k("q"), value: k("123") });
    assert_eq!(s.stats().n_bytes, 4);
    ok(&mut s, A, Request::QueuePop { key: k("q") });
    assert_eq!(s.stats().n_bytes, 0);
}

/// Pending waits of all connections together are held under the store's cap, BARRIERs
/// included; a refused BARRIER does not move its counter.
#[test]
fn pending_waits_of_all_connections_are_capped_together() {
    let mut s = StoreState::new(300);
    // Each WAIT on one missing key of 3 bytes costs 2 * 3 + 96 = 102 bytes.
    pending(&mut s, A, wait(&["/k1"]));
    pending(&mut s, B, wait(&["/k2"]));
    let over = s.apply(ConnId(3), wait(&["/k3"])).unwrap_err();
    assert_eq!(over, RdzvError::TcpStoreLimit { limit: "pending WAIT keys size of all connections", value: 306, max: 300 });
    let over = s.apply(ConnId(3), Request::Barrier { key: k("/b1"), world_size: 2 }).unwrap_err();
    assert!(matches!(over, RdzvError::TcpStoreLimit { .. }), "{over:?}");
    assert!(!s.kv.contains_key(&k("/b1")), "a refused BARRIER counted its arrival");
    check_invariants(&s);
    // A connection that goes away frees its share.
    s.disconnect(A);
    pending(&mut s, ConnId(3), Request::Barrier { key: k("/b1"), world_size: 2 });
    check_invariants(&s);
    assert_eq!(s.total_wait_bytes, 204);
}

/// A MULTI_SET past the cap writes nothing: before, its first pairs were written (and completed
/// other connections' waits, whose wake-ups the refusal dropped, so they hung). A batch that
/// only passes the cap on the way (a key written big, then small) fits.
#[test]
fn a_multi_set_past_the_cap_writes_nothing_and_wakes_nobody() {
    let mut s = StoreState::new(200);
    let w = pending(&mut s, B, wait(&["/x"]));
    let over = s.apply(A, Request::MultiSet { pairs: vec![(k("/x"), k("1")), (k("/y"), vec![7; 198])] }).unwrap_err();
    assert_eq!(over, RdzvError::TcpStoreLimit { limit: "store size", value: 203, max: 200 });
    check_invariants(&s);
    assert_eq!(s.stats().n_bytes, 0);
    assert!(s.waits.contains_key(&w), "the wait on /x was completed by a refused batch");
    let a = ok(&mut s, A, Request::MultiSet { pairs: vec![(k("/x"), vec![7; 199]), (k("/x"), k("1"))] });
    assert_eq!(a.woken, vec![w]);
    assert_eq!(s.stats().n_bytes, 3);
}

/// One small request cannot make the store build a reply past its cap: a MULTI_GET naming a
/// big value many times, a LIST_KEYS of many keys, an APPEND that grows a value past it.
#[test]
fn replies_and_appended_values_stay_under_the_reply_cap() {
    let limits = TcpStoreLimits { max_request_bytes: 100, ..TcpStoreLimits::default() };
    let mut s = StoreState::with_limits(&limits);
    ok(&mut s, A, set("k", &"x".repeat(40)));
    // Two copies (2 × (8 + 40) = 96 bytes) fit; three do not.
    assert_eq!(bytes(&mut s, A, Request::MultiGet { keys: vec![k("k"), k("k")] }).len(), 96);
    let e = s.apply(A, Request::MultiGet { keys: vec![k("k"); 3] }).unwrap_err();
    assert_eq!(e, RdzvError::TcpStoreLimit { limit: "MULTI_GET reply size", value: 144, max: 100 });
    // 40 + 60 = 100 bytes may be appended; one more byte may not, and the value is unchanged.
    ok(&mut s, A, Request::Append { key: k("k"), value: vec![b'y'; 60] });
    let e = s.apply(A, Request::Append { key: k("k"), value: k("z") }).unwrap_err();
    assert_eq!(e, RdzvError::TcpStoreLimit { limit: "appended value size", value: 101, max: 100 });
    assert_eq!(bytes(&mut s, A, Request::Get { key: k("k") }).len(), 8 + 100);
    // LIST_KEYS: 8 + (8 + 1) per key; the keys of 10 one-byte names are 98 bytes, 11 are 107.
    let mut s = StoreState::with_limits(&limits);
    for i in 0..10u8 {
        ok(&mut s, A, Request::Set { key: vec![b'a' + i], value: Vec::new() });
    }
    assert_eq!(bytes(&mut s, A, Request::ListKeys).len(), 98);
    ok(&mut s, A, set("z", ""));
    let e = s.apply(A, Request::ListKeys).unwrap_err();
    assert_eq!(e, RdzvError::TcpStoreLimit { limit: "LIST_KEYS reply size", value: 107, max: 100 });
}

/// The keys of one connection's pending WAITs are held under a cap: a WAIT that would pass it
/// closes the connection, and what completed, was cancelled or left with its connection is
/// given back.
#[test]
fn pending_wait_keys_are_held_under_a_cap_per_connection() {
    // Requests of at most 4 MiB and 1,024 keys: one WAIT costs at most 8 MiB + 96 KiB, so the
    // cap is its floor, 16 MiB.
    let limits = TcpStoreLimits { max_request_bytes: 4 << 20, max_keys_per_request: 1024, max_total_bytes: 1 << 30, ..TcpStoreLimits::default() };
    let mut s = StoreState::with_limits(&limits);
    assert_eq!(s.max_wait_bytes_per_conn, MAX_WAIT_BYTES_PER_CONN);
    // One key of 1 MiB costs 2 MiB + 96 bytes: seven fit under 16 MiB, the eighth does not.
    let big = |i: u8| vec![i; 1 << 20];
    for i in 0..7 {
        assert!(matches!(ok(&mut s, A, Request::Wait { keys: vec![big(i)] }).reply, Reply::Pending(_)));
    }
    let e = s.apply(A, Request::Wait { keys: vec![big(7)] }).unwrap_err();
    assert!(matches!(e, RdzvError::TcpStoreLimit { limit: "pending WAIT keys size", .. }), "{e:?}");
    // Another connection has a budget of its own.
    assert!(matches!(ok(&mut s, B, Request::Wait { keys: vec![big(7)] }).reply, Reply::Pending(_)));
    // A completed wait gives its share back; so do a cancel and a disconnect.
    ok(&mut s, B, Request::Set { key: big(0), value: Vec::new() });
    assert!(matches!(ok(&mut s, A, Request::Wait { keys: vec![big(8)] }).reply, Reply::Pending(_)));
    ok(&mut s, A, Request::CancelWait);
    for i in 10..17 {
        assert!(matches!(ok(&mut s, A, Request::Wait { keys: vec![big(i)] }).reply, Reply::Pending(_)));
    }
    s.disconnect(A);
    for i in 20..27 {
        assert!(matches!(ok(&mut s, A, Request::Wait { keys: vec![big(i)] }).reply, Reply::Pending(_)));
    }
}

/// Under torch's own limits (128 Ki keys in a 64 MiB request), one WAIT of any request the
/// parser accepts fits a connection's cap: 90,000 missing 50-byte keys (about 17.6 MB of
/// bookkeeping, past a fixed 16 MiB) wait instead of closing the connection.
#[test]
fn one_wait_within_the_request_limits_always_fits_the_cap() {
    let mut s = StoreState::with_limits(&TcpStoreLimits::default());
    let keys: Vec<Key> = (0..90_000).map(|i| format!("{i:050}").into_bytes()).collect();
    assert!(wait_cost(&keys) > MAX_WAIT_BYTES_PER_CONN);
    assert!(matches!(ok(&mut s, A, Request::Wait { keys }).reply, Reply::Pending(_)));
}

#[test]
fn the_reply_queue_orders_a_raced_wake_before_the_cancel_reply() {
    // A waits; B's SET completes the wait (the wake-up is in flight); A's CANCEL_WAIT is applied
    // before A saw the wake-up. A must send 00 then 01.
    let mut s = store();
    let mut q = ReplyQueue::new();
    let id = pending(&mut s, A, wait(&["/x"]));
    q.push(Reply::Pending(id));
    let woken = ok(&mut s, B, set("/x", "1")).woken;
    let cancel = ok(&mut s, A, Request::CancelWait);
    q.cancelled(&cancel.cancelled);
    q.push(cancel.reply);
    let mut out = Vec::new();
    q.take_ready(&mut out);
    assert!(out.is_empty(), "the 01 must wait for the 00 in flight");
    for id in woken {
        q.woken(id);
    }
    q.take_ready(&mut out);
    assert_eq!(out, [STOP_WAITING, WAIT_CANCELED]);
    assert_eq!((q.n_bytes(), q.n_pending()), (0, 0));
}

#[test]
fn the_reply_queue_drops_a_cancelled_wait_and_holds_later_replies_behind_a_pending_one() {
    let mut s = store();
    let mut q = ReplyQueue::new();
    let id = pending(&mut s, A, wait(&["/x"]));
    q.push(Reply::Pending(id));
    // A pipelined GET behind the wait is answered after it.
    q.push(ok(&mut s, A, Request::Get { key: k("/x") }).reply);
    let mut out = Vec::new();
    q.take_ready(&mut out);
    assert!(out.is_empty());
    assert_eq!((q.n_bytes(), q.n_pending()), (8, 1));
    let cancel = ok(&mut s, A, Request::CancelWait);
    q.cancelled(&cancel.cancelled);
    q.push(cancel.reply);
    q.take_ready(&mut out);
    assert_eq!(out, [&blob(b"")[..], &[WAIT_CANCELED]].concat());
    // A later wake-up for the cancelled id (impossible from the core) would be ignored.
    q.woken(id);
    out.clear();
    q.take_ready(&mut out);
    assert!(out.is_empty());
}

#[test]
fn a_pipelined_set_on_the_waiting_connection_wakes_its_own_wait() {
    let mut s = store();
    let id = pending(&mut s, A, wait(&["/x"]));
    assert_eq!(ok(&mut s, A, set("/x", "1")).woken, vec![id]);
}

/// The end of a peer's stream: its waits are dropped (nothing wakes them later), while a queue
/// item it was woken for stays its own until it disconnects (a pop it sent may still be applied).
#[test]
fn cancel_waits_drops_the_waits_and_keeps_the_queue_wake_ups_until_the_disconnect() {
    let mut s = store();
    let x = pending(&mut s, A, wait(&["/x"]));
    let _bar = pending(&mut s, A, Request::Barrier { key: k("/bar"), world_size: 2 });
    let q = pending(&mut s, A, wait(&["q"]));
    let other = pending(&mut s, B, wait(&["q"]));
    assert_eq!(ok(&mut s, ConnId(3), Request::QueuePush { key: k("q"), value: k("1") }).woken, vec![q]);
    let mut dropped = s.cancel_waits(A);
    dropped.sort();
    assert_eq!(dropped.len(), 2, "{dropped:?}");
    assert!(dropped.contains(&x));
    check_invariants(&s);
    assert_eq!(s.stats().n_waits, 1, "B's wait is untouched");
    // A later write wakes nobody of A's.
    assert!(ok(&mut s, B, set("/x", "1")).woken.is_empty());
    // The queue wake-up is handed on only when A disconnects.
    assert_eq!(s.disconnect(A), vec![other]);
    check_invariants(&s);
}

#[test]
fn the_reply_queue_cut_drops_the_first_pending_wait_and_everything_after_it() {
    let mut s = store();
    let mut q = ReplyQueue::new();
    q.push(ok(&mut s, A, Request::Ping { nonce: 1 }).reply);
    let first = pending(&mut s, A, wait(&["/x"]));
    q.push(Reply::Pending(first));
    q.push(ok(&mut s, A, Request::Get { key: k("/x") }).reply);
    let second = pending(&mut s, A, wait(&["/y"]));
    q.push(Reply::Pending(second));
    assert_eq!((q.n_bytes(), q.n_pending()), (4 + 8, 2));
    assert!(q.cut_at_first_pending());
    assert_eq!((q.n_bytes(), q.n_pending()), (4, 0));
    // A wake-up of a cut wait is ignored.
    q.woken(first);
    let mut out = Vec::new();
    q.take_ready(&mut out);
    assert_eq!(out, 1u32.to_le_bytes());
    assert!(q.is_empty());
    assert!(!q.cut_at_first_pending(), "nothing left to cut");
}
