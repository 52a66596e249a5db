use super::*;

fn limits() -> ParseLimits {
    ParseLimits { max_key_bytes: 8 << 10, max_value_bytes: 8 << 20, max_keys_per_request: 128 << 10, max_request_bytes: 64 << 20 }
}

fn k(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

/// One request of every command (after the handshake), with empty and non-empty fields.
fn every_request() -> Vec<Request> {
    vec![
        Request::Validate { magic: VALIDATE_MAGIC },
        Request::Ping { nonce: 0xAABB_CCDD },
        Request::Set { key: k("/k"), value: k("abc") },
        Request::Set { key: k(""), value: k("") },
        Request::CompareSet { key: k("/k"), expected: k(""), desired: k("new") },
        Request::Get { key: k("/k") },
        Request::Add { key: k("/ctr"), delta: -7 },
        Request::Check { keys: vec![k("/k"), k("/nope")] },
        Request::Check { keys: vec![] },
        Request::Wait { keys: vec![k("/a")] },
        Request::Wait { keys: vec![] },
        Request::GetNumKeys,
        Request::DeleteKey { key: k("/k") },
        Request::Append { key: k("/k"), value: k("tail") },
        Request::MultiGet { keys: vec![k("m1"), k("m2")] },
        Request::MultiSet { pairs: vec![(k("a"), k("1")), (k("b"), k(""))] },
        Request::MultiSet { pairs: vec![] },
        Request::CancelWait,
        Request::QueuePush { key: k("/q"), value: k("q1") },
        Request::QueuePop { key: k("/q") },
        Request::QueueLen { key: k("/q") },
        Request::ListKeys,
        Request::Barrier { key: k("/b"), world_size: 2 },
    ]
}

fn encode_all(reqs: &[Request]) -> Vec<u8> {
    let mut buf = Vec::new();
    for r in reqs {
        r.encode(&mut buf);
    }
    buf
}

fn parse_chunks(chunks: &[&[u8]]) -> Result<Vec<Request>, RdzvError> {
    let mut p = RequestParser::new(limits());
    let mut out = Vec::new();
    for c in chunks {
        p.feed(c, &mut out)?;
    }
    assert!(!p.is_mid_request(), "the parser is still inside a request after the last byte");
    Ok(out)
}

#[test]
fn byte_examples_of_the_reference_encode_as_documented() {
    // tcpstore.md §3, "Byte examples".
    let mut b = Vec::new();
    Request::Validate { magic: VALIDATE_MAGIC }.encode(&mut b);
    assert_eq!(b, [0x00, 0xce, 0xf7, 0x85, 0x3c]);
    b.clear();
    Request::Set { key: k("/k"), value: k("abc") }.encode(&mut b);
    assert_eq!(b, [&[1u8, 2, 0, 0, 0, 0, 0, 0, 0][..], b"/k", &[3, 0, 0, 0, 0, 0, 0, 0], b"abc"].concat());
    b.clear();
    Request::Add { key: k("/ctr"), delta: 5 }.encode(&mut b);
    assert_eq!(b, [&[4u8, 4, 0, 0, 0, 0, 0, 0, 0][..], b"/ctr", &[5, 0, 0, 0, 0, 0, 0, 0]].concat());
    b.clear();
    Request::Ping { nonce: 0xAABB_CCDD }.encode(&mut b);
    assert_eq!(b, [0x0d, 0xdd, 0xcc, 0xbb, 0xaa]);
}

#[test]
fn a_pipelined_buffer_parses_the_same_split_at_every_byte_boundary() {
    let reqs = every_request();
    let buf = encode_all(&reqs);
    assert_eq!(parse_chunks(&[&buf]).unwrap(), reqs);
    for cut in 0..=buf.len() {
        let (a, b) = buf.split_at(cut);
        assert_eq!(parse_chunks(&[a, b]).unwrap(), reqs, "split at byte {cut}");
    }
    // Two cuts, so that every field is also split in three.
    for cut1 in (0..buf.len()).step_by(3) {
        for cut2 in (cut1..=buf.len()).step_by(5) {
            assert_eq!(parse_chunks(&[&buf[..cut1], &buf[cut1..cut2], &buf[cut2..]]).unwrap(), reqs, "cuts {cut1} {cut2}");
        }
    }
}

#[test]
fn one_byte_at_a_time_parses_every_request_exactly_when_its_last_byte_arrives() {
    let reqs = every_request();
    let mut p = RequestParser::new(limits());
    let mut out = Vec::new();
    let mut ends = Vec::new();
    let mut pos = 0;
    for r in &reqs {
        let mut b = Vec::new();
        r.encode(&mut b);
        pos += b.len();
        ends.push(pos);
    }
    let buf = encode_all(&reqs);
    for (i, byte) in buf.iter().enumerate() {
        let before = out.len();
        p.feed(std::slice::from_ref(byte), &mut out).unwrap();
        if out.len() > before {
            assert_eq!(out.len(), before + 1);
            assert_eq!(ends[before], i + 1, "request {before} completed at the wrong byte");
        }
    }
    assert_eq!(out, reqs);
}

#[test]
fn an_empty_feed_changes_nothing() {
    let mut p = RequestParser::new(limits());
    let mut out = Vec::new();
    p.feed(&[], &mut out).unwrap();
    p.feed(&[0x00, 0xce], &mut out).unwrap();
    p.feed(&[], &mut out).unwrap();
    p.feed(&[0xf7, 0x85, 0x3c], &mut out).unwrap();
    assert_eq!(out, vec![Request::Validate { magic: VALIDATE_MAGIC }]);
}

#[test]
fn a_connection_must_open_with_validate() {
    // A torch 2.1 client's first byte (ADD under 2.1's numbering), refused at once.
    let mut p = RequestParser::new(limits());
    let err = p.feed(&[0x03], &mut Vec::new()).unwrap_err();
    assert!(matches!(err, RdzvError::TcpStoreProtocol(ref m) if m.contains("not VALIDATE")), "{err}");
    // A GET without VALIDATE.
    let mut b = Vec::new();
    Request::Get { key: k("/k") }.encode(&mut b);
    assert!(parse_chunks(&[&b]).is_err());
}

#[test]
fn a_wrong_magic_is_refused_after_its_fourth_byte() {
    let mut p = RequestParser::new(limits());
    let mut out = Vec::new();
    p.feed(&[0x00, 0xce, 0xf7, 0x85], &mut out).unwrap();
    let err = p.feed(&[0x3d], &mut out).unwrap_err();
    assert!(matches!(err, RdzvError::TcpStoreProtocol(ref m) if m.contains("0x3d85f7ce")), "{err}");
    assert!(out.is_empty());
}

#[test]
fn unknown_commands_are_refused_and_earlier_requests_kept() {
    for bad in [19u8, 0x42, 0xff] {
        let mut buf = encode_all(&[Request::Validate { magic: VALIDATE_MAGIC }, Request::GetNumKeys]);
        buf.push(bad);
        let mut p = RequestParser::new(limits());
        let mut out = Vec::new();
        let err = p.feed(&buf, &mut out).unwrap_err();
        assert_eq!(err, RdzvError::TcpStoreProtocol(format!("unknown command {bad:#04x}")));
        assert_eq!(out, vec![Request::Validate { magic: VALIDATE_MAGIC }, Request::GetNumKeys]);
    }
}

fn parse_one(limits: ParseLimits, req: &Request) -> Result<Vec<Request>, RdzvError> {
    let buf = encode_all(&[Request::Validate { magic: VALIDATE_MAGIC }, req.clone()]);
    let mut p = RequestParser::new(limits);
    let mut out = Vec::new();
    p.feed(&buf, &mut out)?;
    Ok(out)
}

#[test]
fn key_and_value_caps_are_inclusive_and_checked_on_the_length_header() {
    let l = limits();
    let at_key = Request::Set { key: vec![b'k'; 8 << 10], value: vec![] };
    assert_eq!(parse_one(l, &at_key).unwrap().len(), 2);
    let over_key = Request::Get { key: vec![b'k'; (8 << 10) + 1] };
    assert_eq!(
        parse_one(l, &over_key).unwrap_err(),
        RdzvError::TcpStoreLimit { limit: "key size", value: 8193, max: 8192 }
    );
    let at_value = Request::Set { key: k("/v"), value: vec![7; 8 << 20] };
    assert_eq!(parse_one(l, &at_value).unwrap().len(), 2);
    let over_value = Request::CompareSet { key: k("/v"), expected: vec![], desired: vec![7; (8 << 20) + 1] };
    assert_eq!(
        parse_one(l, &over_value).unwrap_err(),
        RdzvError::TcpStoreLimit { limit: "value size", value: (8 << 20) + 1, max: 8 << 20 }
    );
    // Only the header is needed to refuse: a declared 2^63-byte value, nothing after it.
    let mut p = RequestParser::new(l);
    let mut out = Vec::new();
    let mut b = encode_all(&[Request::Validate { magic: VALIDATE_MAGIC }]);
    b.extend_from_slice(&[1, 1, 0, 0, 0, 0, 0, 0, 0, b'k']);
    b.extend_from_slice(&(1u64 << 63).to_le_bytes());
    assert!(matches!(p.feed(&b, &mut out), Err(RdzvError::TcpStoreLimit { limit: "value size", .. })));
}

#[test]
fn key_count_and_request_size_caps() {
    let l = ParseLimits { max_keys_per_request: 3, max_request_bytes: 100, ..limits() };
    let keys = |n: usize| (0..n).map(|i| vec![b'k', i as u8]).collect::<Vec<_>>();
    assert!(parse_one(l, &Request::Wait { keys: keys(3) }).is_ok());
    assert_eq!(
        parse_one(l, &Request::MultiGet { keys: keys(4) }).unwrap_err(),
        RdzvError::TcpStoreLimit { limit: "keys per request", value: 4, max: 3 }
    );
    // MULTI_SET counts pairs.
    let pairs = |n: usize| keys(n).into_iter().map(|k| (k, vec![])).collect::<Vec<_>>();
    assert!(parse_one(l, &Request::MultiSet { pairs: pairs(3) }).is_ok());
    assert!(parse_one(l, &Request::MultiSet { pairs: pairs(4) }).is_err());
    // 1 + 8 + 2 + 8 + 81 = 100 bytes: at the cap; one more value byte is over it.
    let at = Request::Set { key: k("/k"), value: vec![0; 81] };
    let mut b = Vec::new();
    at.encode(&mut b);
    assert_eq!(b.len(), 100);
    assert!(parse_one(l, &at).is_ok());
    assert_eq!(
        parse_one(l, &Request::Set { key: k("/k"), value: vec![0; 82] }).unwrap_err(),
        RdzvError::TcpStoreLimit { limit: "request size", value: 101, max: 100 }
    );
}

#[test]
fn negative_and_extreme_integers_round_trip() {
    let reqs = vec![
        Request::Validate { magic: VALIDATE_MAGIC },
        Request::Add { key: k("a"), delta: i64::MIN },
        Request::Add { key: k("a"), delta: i64::MAX },
        Request::Barrier { key: k("b"), world_size: -1 },
        Request::Ping { nonce: u32::MAX },
    ];
    assert_eq!(parse_chunks(&[&encode_all(&reqs)]).unwrap(), reqs);
}

#[test]
fn a_second_validate_is_checked_too() {
    let mut p = RequestParser::new(limits());
    let mut out = Vec::new();
    let mut buf = encode_all(&[Request::Validate { magic: VALIDATE_MAGIC }, Request::Validate { magic: VALIDATE_MAGIC }]);
    p.feed(&buf, &mut out).unwrap();
    assert_eq!(out.len(), 2);
    buf.clear();
    Request::Validate { magic: 1 }.encode(&mut buf);
    assert!(p.feed(&buf, &mut out).is_err());
}
