use super::*;

/// Hand-checked AdamW step: p=1, g=0.5, lr=0.1, wd=0.01, step 1:
/// p·(1−0.001)=0.999; m=0.05; v=0.00025; m̂=0.5, v̂=0.25 → update = 0.1·0.5/(0.5+1e-8) ≈ 0.1;
/// p = 0.999 − 0.1 = 0.899 (torch.optim.AdamW gives 0.8990000 in f32).
#[test]
fn adamw_first_step_by_hand() {
    let opt = AdamW { lr: 0.1, ..AdamW::default() };
    let mut p = [1.0f32];
    let (mut m, mut v) = ([0f32], [0f32]);
    let sp = StepParams { step: 1, lr: 0.1, grad_scale: 1.0 };
    opt.step_tile(&sp, &mut p, &[0.5], &mut [&mut m, &mut v]);
    assert!((p[0] - 0.899).abs() < 1e-6, "{}", p[0]);
    assert!((m[0] - 0.05).abs() < 1e-8 && (v[0] - 0.00025).abs() < 1e-9);
}

#[test]
fn tiles_are_bitwise_equal_to_whole() {
    let opt = AdamW::default();
    let g: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
    let p0: Vec<f32> = (0..100).map(|i| (i as f32 * 0.11).cos()).collect();
    let sp = StepParams { step: 3, lr: 1e-3, grad_scale: 0.5 };
    let (mut a, mut am, mut av) = (p0.clone(), vec![0.1f32; 100], vec![0.2f32; 100]);
    opt.step_tile(&sp, &mut a, &g, &mut [&mut am, &mut av]);
    let (mut b, mut bm, mut bv) = (p0, vec![0.1f32; 100], vec![0.2f32; 100]);
    for r in [0..7, 7..64, 64..100] {
        opt.step_tile(&sp, &mut b[r.clone()], &g[r.clone()], &mut [&mut bm[r.clone()], &mut bv[r]]);
    }
    assert_eq!(a, b);
}

#[test]
fn sgd_momentum_and_schedule() {
    let opt = Sgd { lr: 0.1, momentum: 0.9, weight_decay: 0.0 };
    let mut p = [1.0f32];
    let mut b = [0f32];
    for step in 1..=2 {
        let sp = StepParams { step, lr: 0.1, grad_scale: 1.0 };
        opt.step_tile(&sp, &mut p, &[1.0], &mut [&mut b]);
    }
    // b1 = 1, p = 0.9; b2 = 1.9, p = 0.71.
    assert!((p[0] - 0.71).abs() < 1e-6);
    let s = Schedule { warmup_steps: 10, total_steps: 110, min_lr_ratio: 0.1 };
    assert_eq!(s.lr(1.0, 5), 0.5);
    assert!((s.lr(1.0, 60) - 0.55).abs() < 1e-12);
    assert!((s.lr(1.0, 500) - 0.1).abs() < 1e-12);
}
