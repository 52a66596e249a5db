use super::*;

fn specs() -> Vec<UnitSpec> {
    vec![
        UnitSpec {
            name: "embed".into(),
            params: vec![("tok".into(), vec![5, 2]), ("pos".into(), vec![3])],
        },
        UnitSpec {
            name: "head".into(),
            params: vec![("w".into(), vec![4])],
        },
    ]
}

#[test]
fn padding_and_shards() {
    let l = FlatLayout::new(4, &specs()).unwrap();
    let u = &l.units[0];
    assert_eq!((u.numel, u.padded_numel, u.shard_len, u.padding()), (13, 16, 4, 3));
    assert_eq!(u.params[1].offset, 10);
    assert_eq!(l.shard_range(0, 3), 12..16);
    assert_eq!(u.valid_shard_range(3), 12..13);
    assert_eq!(l.units[1].padded_numel, 4);
    assert_eq!((l.total_numel(), l.total_padded_numel(), l.total_shard_len()), (17, 20, 5));
    // Rank 2 owns elements 8..12: tok[8..10] and pos[0..2].
    let p = u.pieces(2);
    assert_eq!(p.len(), 2);
    assert_eq!((p[0].param, p[0].in_param.clone(), p[0].in_shard.clone()), (0, 8..10, 0..2));
    assert_eq!((p[1].param, p[1].in_param.clone(), p[1].in_shard.clone()), (1, 0..2, 2..4));
    let l1 = l.with_world(1).unwrap();
    assert_eq!(l1.total_padded_numel(), 17);
    l.check_same_model(&l1).unwrap();
    assert_eq!(l.find_param("w"), Some((1, 0)));
}

#[test]
fn strategy_names_round_trip() {
    for s in ["ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-shard-grad-op", "fsdp-no-shard", "hybrid"] {
        let st: Strategy = s.parse().unwrap();
        assert_eq!(st.name(), s);
    }
    assert_eq!("SHARD_GRAD_OP".parse::<Strategy>().unwrap().zero_stage(), 2);
    assert!("zero4".parse::<Strategy>().is_err());
}
