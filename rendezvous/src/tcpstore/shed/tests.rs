use super::*;

const MIB: usize = 1 << 20;

fn holder(slot: usize, bytes: usize, half_closed: bool, draining: bool) -> Holder {
    Holder { slot, bytes, half_closed, draining, idle: Duration::ZERO }
}

/// A draining holder whose bytes went `idle_ms` without moving [`MIN_DRAIN_BYTES`].
fn moving(slot: usize, bytes: usize, idle_ms: u64) -> Holder {
    Holder { slot, bytes, half_closed: false, draining: true, idle: Duration::from_millis(idle_ms) }
}

#[test]
fn a_draining_download_is_kept_and_the_stalled_upload_that_passed_the_budget_is_closed() {
    // A rank reading an 8 MiB reply (the most held) and a peer that stopped halfway through a
    // 3 MiB request, together past a 9 MiB budget: the one that stopped goes.
    let holders = vec![holder(0, 8 * MIB, false, true), holder(1, 3 * MIB, false, false)];
    assert_eq!(pick(holders, 11 * MIB, 9 * MIB), vec![1]);
}

#[test]
fn draining_connections_are_not_closed_while_the_budget_is_exceeded_less_than_twice() {
    let holders = vec![holder(0, 8 * MIB, false, true), holder(1, 8 * MIB, true, true)];
    assert!(pick(holders, 16 * MIB, 8 * MIB).is_empty());
}

/// Past twice the budget, draining connections are closed too, the slowest first, until the
/// server holds at most twice the budget; the stalled ones still go before any of them.
#[test]
fn past_twice_the_budget_draining_connections_go_too_slowest_first() {
    let holders = vec![
        moving(0, 6 * MIB, 100),
        moving(1, 4 * MIB, 900),
        moving(2, 8 * MIB, 10),
        holder(3, MIB, false, false),
        moving(4, 3 * MIB, 500),
    ];
    // 22 MiB held, 5 allowed, 10 at most: the stalled one (21 left), then the slowest draining
    // ones, 4 MiB idle 900 ms (17 left), 3 MiB idle 500 ms (14 left), 6 MiB idle 100 ms (8 left).
    assert_eq!(pick(holders.clone(), 22 * MIB, 5 * MIB), vec![3, 1, 4, 0]);
    // At exactly twice the budget, only the stalled one.
    assert_eq!(pick(holders.clone(), 22 * MIB, 11 * MIB), vec![3]);
    // Equally slow: the largest, then by slot.
    let even = vec![moving(5, MIB, 300), moving(2, 2 * MIB, 300), moving(1, MIB, 300)];
    assert_eq!(pick(even, 4 * MIB, MIB / 2), vec![2, 1]);
}

/// An upload arriving at full rate moves, though the peer takes no reply (it has none): its
/// meter counts the request bytes it sends, so it is draining, and one that stopped sending is
/// not, once a window passed.
#[test]
fn request_bytes_sent_count_as_movement_and_an_upload_that_stops_does_not_drain() {
    let t0 = Instant::now();
    let mut d = Drain::new(t0);
    // 64 KiB of a large SET arrive every 10 ms: held grows, nothing is taken.
    let mut held = 0;
    for i in 1..=200u32 {
        held += MIN_DRAIN_BYTES;
        let now = t0 + Duration::from_millis(10) * i;
        d.update(now, MIN_DRAIN_BYTES, held);
        assert!(d.draining(now + DRAIN_WINDOW / 2), "step {i}");
        assert!(d.idle(now) < Duration::from_millis(20), "step {i}: idle {:?}", d.idle(now));
    }
    // The upload stops: still held, nothing moves.
    let stop = t0 + Duration::from_millis(2000);
    d.update(stop, 0, held);
    assert!(d.draining(stop));
    assert!(!d.draining(stop + DRAIN_WINDOW), "an upload that stopped drains");
    assert!(d.idle(stop + DRAIN_WINDOW) >= DRAIN_WINDOW);
}

#[test]
fn half_closed_connections_go_first_then_the_largest_until_under_the_budget() {
    let holders = vec![
        holder(0, 5 * MIB, false, false),
        holder(1, MIB, true, false),
        holder(2, 7 * MIB, false, false),
        holder(3, 2 * MIB, false, false),
        holder(4, 9 * MIB, false, true),
    ];
    // 24 MiB held, 12 allowed: the half-closed one (1), then 7 and 5 MiB; 11 MiB left.
    assert_eq!(pick(holders.clone(), 24 * MIB, 12 * MIB), vec![1, 2, 0]);
    // Under the budget: nobody.
    assert!(pick(holders, 12 * MIB, 12 * MIB).is_empty());
}

#[test]
fn equal_holders_are_chosen_by_slot_and_empty_ones_never() {
    let holders = vec![holder(7, MIB, false, false), holder(3, MIB, false, false), holder(5, 0, true, false)];
    assert_eq!(pick(holders, 2 * MIB + 1, MIB), vec![3, 7]);
}

#[test]
fn a_reply_just_built_is_draining_for_one_window() {
    let t0 = Instant::now();
    let mut d = Drain::new(t0);
    assert!(!d.draining(t0), "nothing held: nothing to drain");
    d.update(t0, 0, 8 * MIB);
    assert!(d.draining(t0 + DRAIN_WINDOW / 2));
    assert!(!d.draining(t0 + DRAIN_WINDOW), "not a byte taken in a whole window");
}

#[test]
fn a_peer_that_keeps_taking_stays_draining_and_one_that_trickles_does_not() {
    let t0 = Instant::now();
    let mut d = Drain::new(t0);
    d.update(t0, 0, 8 * MIB);
    // 64 KiB every half window: draining throughout.
    let mut held = 8 * MIB;
    for i in 1..=20u32 {
        let now = t0 + DRAIN_WINDOW / 2 * i;
        held -= MIN_DRAIN_BYTES;
        d.update(now, MIN_DRAIN_BYTES, held);
        assert!(d.draining(now + DRAIN_WINDOW / 2 - Duration::from_millis(1)), "step {i}");
    }
    // Then 1 KiB per half window: less than 64 KiB in a window, no longer draining.
    let t1 = t0 + DRAIN_WINDOW * 10;
    for i in 1..=4u32 {
        held -= 1024;
        d.update(t1 + DRAIN_WINDOW / 2 * i, 1024, held);
    }
    assert!(!d.draining(t1 + DRAIN_WINDOW * 2));
}

#[test]
fn replies_all_taken_end_the_drain_and_the_next_ones_start_a_new_window() {
    let t0 = Instant::now();
    let mut d = Drain::new(t0);
    d.update(t0, 0, 100);
    d.update(t0 + DRAIN_WINDOW * 5, 100, 0);
    assert!(!d.draining(t0 + DRAIN_WINDOW * 5));
    let t1 = t0 + DRAIN_WINDOW * 9;
    d.update(t1, 0, 100);
    assert!(d.draining(t1 + DRAIN_WINDOW / 2));
}
