//! The native path against candle's autograd on the composed (unfused) reference model:
//! outputs, parameter gradients and input gradients of every unit.

use candle_core::{Device, Tensor, Var};

use super::*;
use crate::model::{Batch, Gpt, GptConfig, SplitMix, UnitModel};

/// ‖a − b‖ / max(‖b‖, tiny).
fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut d, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        d += (f64::from(*x) - f64::from(*y)).powi(2);
        n += f64::from(*y).powi(2);
    }
    (d / n.max(1e-30)).sqrt()
}

struct Case {
    out: Vec<f32>,
    grads: Vec<f32>,
    dx: Vec<f32>,
}

fn split(flat: &[f32], spec: &crate::layout::UnitSpec) -> Vec<Vec<f32>> {
    let mut off = 0;
    spec.params
        .iter()
        .map(|(_, s)| {
            let n: usize = s.iter().product();
            off += n;
            flat[off - n..off].to_vec()
        })
        .collect()
}

fn candle_case(m: &Gpt, unit: usize, flat: &[f32], x: &[f32], batch: &Batch, dy: &[f32]) -> Case {
    let spec = &m.specs()[unit];
    let vars: Vec<Var> = split(flat, spec)
        .iter()
        .zip(&spec.params)
        .map(|(v, (_, s))| Var::from_slice(v, s.as_slice(), &Device::Cpu).unwrap())
        .collect();
    let params: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let (b, t) = batch.inputs.dims2().unwrap();
    let d = m.config().d_model;
    let xv = (!x.is_empty()).then(|| Var::from_slice(x, (b, t, d), &Device::Cpu).unwrap());
    let out = m.forward_unit(unit, &params, xv.as_ref().map(|v| v.as_tensor()), batch).unwrap();
    let dyt = Tensor::from_slice(dy, out.shape(), &Device::Cpu).unwrap();
    let grads = (&out * &dyt).unwrap().sum_all().unwrap().backward().unwrap();
    let mut g = Vec::new();
    for p in &params {
        g.extend(grads.get(p).map_or_else(|| vec![0.0; p.elem_count()], |t| t.flatten_all().unwrap().to_vec1().unwrap()));
    }
    let dx = xv.map_or_else(Vec::new, |v| grads.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap());
    Case {
        out: out.flatten_all().unwrap().to_vec1().unwrap(),
        grads: g,
        dx,
    }
}

fn native_case(m: &Gpt, unit: usize, flat: &[f32], x: &[f32], batch: &Batch, dy: &[f32]) -> Case {
    let spec = &m.specs()[unit];
    let pieces = split(flat, spec);
    let params: Vec<&[f32]> = pieces.iter().map(|v| v.as_slice()).collect();
    let nb = NativeBatch::from_batch(batch).unwrap();
    let mut cache = UnitCache::default();
    let n = m.native().expect("fused GPT is native");
    n.forward(unit, &params, x, &nb, &mut cache).unwrap();
    let out = cache.out.clone();
    let mut grads = vec![0f32; flat.len()];
    let mut dx = Vec::new();
    let mut scratch = Scratch::default();
    n.backward(unit, &params, x, &nb, &mut cache, dy, &mut grads, true, &mut dx, &mut scratch).unwrap();
    // Overwriting (`acc` false) a buffer of garbage gives the same gradients bit for bit, and
    // accumulating onto them doubles them (up to the order of the additions).
    let mut over = vec![f32::NAN; flat.len()];
    n.backward(unit, &params, x, &nb, &mut cache, dy, &mut over, false, &mut dx, &mut scratch).unwrap();
    assert!(over.iter().zip(&grads).all(|(a, b)| a.to_bits() == b.to_bits()), "unit {unit}: overwrite differs from add-to-zero");
    n.backward(unit, &params, x, &nb, &mut cache, dy, &mut over, true, &mut dx, &mut scratch).unwrap();
    let scale = grads.iter().fold(0f32, |m, g| m.max(g.abs()));
    for (i, (a, b)) in over.iter().zip(&grads).enumerate() {
        assert!((a - 2.0 * b).abs() <= 1e-5 * scale, "unit {unit} [{i}]: accumulated {a}, expected {}", 2.0 * b);
    }
    Case { out, grads, dx }
}

fn check_config(cfg: GptConfig, b: usize, t: usize) {
    let native = Gpt::new(cfg);
    let reference = Gpt::new(cfg).with_fused(false);
    let mut rng = SplitMix::new(11);
    let rows: Vec<Vec<u32>> = (0..b)
        .map(|_| (0..=t).map(|_| (rng.next_u64() % cfg.vocab as u64) as u32).collect())
        .collect();
    let batch = Batch::from_rows(&rows).unwrap();
    let n = b * t;
    for unit in 0..cfg.layers + 2 {
        let mut flat = native.init_unit(unit, 5);
        // Perturb LayerNorm weights/biases away from 1/0 so their gradients are exercised.
        for v in flat.iter_mut() {
            *v += 0.05 * rng.normal();
        }
        let x: Vec<f32> = if unit == 0 { Vec::new() } else { (0..n * cfg.d_model).map(|_| rng.normal()).collect() };
        let dy: Vec<f32> = if unit == cfg.layers + 1 { vec![1.0] } else { (0..n * cfg.d_model).map(|_| rng.normal()).collect() };
        let a = native_case(&native, unit, &flat, &x, &batch, &dy);
        let r = candle_case(&reference, unit, &flat, &x, &batch, &dy);
        let tag = format!("{cfg:?} b={b} t={t} unit {unit}");
        assert!(rel(&a.out, &r.out) < 2e-6, "{tag}: output rel err {}", rel(&a.out, &r.out));
        assert!(rel(&a.grads, &r.grads) < 2e-5, "{tag}: param grad rel err {}", rel(&a.grads, &r.grads));
        for (i, (ga, gr)) in split(&a.grads, &native.specs()[unit]).iter().zip(split(&r.grads, &native.specs()[unit])).enumerate() {
            assert!(rel(ga, &gr) < 1e-4, "{tag}: parameter {i} grad rel err {}", rel(ga, &gr));
        }
        assert_eq!(a.dx.len(), r.dx.len(), "{tag}: dx length");
        if !r.dx.is_empty() {
            assert!(rel(&a.dx, &r.dx) < 2e-5, "{tag}: input grad rel err {}", rel(&a.dx, &r.dx));
        }
    }
}

#[test]
fn native_units_match_candle_autograd() {
    // Widths with and without 16-lane tails, a context shorter than the maximum.
    check_config(GptConfig { vocab: 50, d_model: 48, layers: 2, heads: 3, seq: 20 }, 3, 17);
    check_config(GptConfig { vocab: 37, d_model: 40, layers: 1, heads: 5, seq: 9 }, 2, 9);
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let cfg = GptConfig { vocab: 16, d_model: 16, layers: 1, heads: 2, seq: 8 };
    let m = Gpt::new(cfg);
    let n = m.native().unwrap();
    let flat = m.init_unit(0, 1);
    let pieces = split(&flat, &m.specs()[0]);
    let params: Vec<&[f32]> = pieces.iter().map(|v| v.as_slice()).collect();
    let mut cache = UnitCache::default();
    let bad_id = NativeBatch { b: 1, t: 2, inputs: vec![3, 99], targets: vec![1, 2] };
    let e = n.forward(0, &params, &[], &bad_id, &mut cache).unwrap_err();
    assert!(e.to_string().contains("token id 99"), "{e}");
    let too_long = NativeBatch { b: 1, t: 9, inputs: vec![0; 9], targets: vec![0; 9] };
    let e = n.forward(0, &params, &[], &too_long, &mut cache).unwrap_err();
    assert!(e.to_string().contains("context 8"), "{e}");
    let ok = NativeBatch { b: 1, t: 2, inputs: vec![0, 1], targets: vec![1, 2] };
    let e = n.forward(0, &params[..1], &[], &ok, &mut cache).unwrap_err();
    assert!(e.to_string().contains("parameters"), "{e}");
    let e = n.forward(1, &params, &[0.0; 3], &ok, &mut cache).unwrap_err();
    assert!(e.to_string().contains("unit 1"), "{e}");
}
