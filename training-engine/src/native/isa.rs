//! Which SIMD level the CPU kernels run at: detected once per process, or forced with
//! `RSRUN_ISA` (`avx512`, `avx2`, `baseline`) to measure or test a lower level on a machine
//! that has a higher one (a level the CPU lacks is never used: it falls back to the best the
//! CPU has, and [`Isa::forced_note`] says so).

use std::sync::OnceLock;

/// The environment variable that forces a SIMD level.
pub const ISA_ENV: &str = "RSRUN_ISA";

/// A SIMD level of x86-64 (baseline elsewhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Scalar/SSE2 code only.
    Baseline,
    /// AVX2 + FMA (x86-64-v3).
    Avx2,
    /// AVX-512F/BW/DQ/VL + FMA (x86-64-v4).
    Avx512,
}

impl Isa {
    /// The best level this CPU supports.
    pub fn detected() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let v3 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma");
            let v4 = v3
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512dq")
                && std::arch::is_x86_feature_detected!("avx512vl");
            if v4 {
                Isa::Avx512
            } else if v3 {
                Isa::Avx2
            } else {
                Isa::Baseline
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Baseline
    }

    /// Lowercase name (`avx512`, `avx2`, `baseline`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Baseline => "baseline",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// f32 lanes of one vector register at this level.
    pub fn f32_lanes(self) -> usize {
        match self {
            Isa::Baseline => 4,
            Isa::Avx2 => 8,
            Isa::Avx512 => 16,
        }
    }

    /// A note when `RSRUN_ISA` asked for something other than what runs (unknown value, or a
    /// level the CPU lacks).
    pub fn forced_note() -> Option<String> {
        state().1.clone()
    }

    /// The error when `RSRUN_ISA` holds no SIMD level at all (`RSRUN_ISA=avx3`): the engine
    /// refuses to start on it (a level the CPU lacks is only a note).
    pub fn env_error() -> Option<String> {
        std::env::var(ISA_ENV).ok()?.parse::<Isa>().err()
    }
}

impl std::str::FromStr for Isa {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "avx512" | "x86-64-v4" | "v4" => Ok(Isa::Avx512),
            "avx2" | "x86-64-v3" | "v3" => Ok(Isa::Avx2),
            "baseline" | "scalar" | "sse2" | "x86-64" => Ok(Isa::Baseline),
            other => Err(format!(
                "{ISA_ENV}={other:?} is not a SIMD level: expected avx512, avx2 or baseline"
            )),
        }
    }
}

fn state() -> &'static (Isa, Option<String>) {
    static STATE: OnceLock<(Isa, Option<String>)> = OnceLock::new();
    STATE.get_or_init(|| {
        let best = Isa::detected();
        match std::env::var(ISA_ENV) {
            Err(_) => (best, None),
            Ok(v) => match v.parse::<Isa>() {
                Err(e) => (best, Some(format!("{e}; using {}", best.name()))),
                Ok(want) if want > best => (
                    best,
                    Some(format!(
                        "{ISA_ENV}={} but this CPU supports at most {}; using {}",
                        want.name(),
                        best.name(),
                        best.name()
                    )),
                ),
                Ok(want) => (want, None),
            },
        }
    })
}

/// The level the kernels run at in this process.
#[inline]
pub fn isa() -> Isa {
    state().0
}

/// Defines `pub(crate) fn $name(args)` that runs `$body` compiled for the process's SIMD level:
/// the body is an `#[inline(always)]` function generic over `const FMA: bool`, instantiated
/// inside `#[target_feature]` functions, so the loops themselves are compiled with AVX-512 or
/// AVX2+FMA (use [`fmadd`] for multiply-adds: a fused instruction at those levels, `a·b + c`
/// at baseline).
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn imp<const FMA: bool>($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v4($($arg: $ty),*) { imp::<true>($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v3($($arg: $ty),*) { imp::<true>($($arg),*) }
                match $crate::native::isa::isa() {
                    // SAFETY: `isa()` only reports levels the CPU supports.
                    $crate::native::isa::Isa::Avx512 => unsafe { v4($($arg),*) },
                    // SAFETY: as above.
                    $crate::native::isa::Isa::Avx2 => unsafe { v3($($arg),*) },
                    $crate::native::isa::Isa::Baseline => imp::<false>($($arg),*),
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            imp::<false>($($arg),*)
        }
    };
}
pub(crate) use simd_fn;

/// `a·b + c`, fused when `FMA` (inside a [`simd_fn`] body).
#[inline(always)]
pub(crate) fn fmadd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_and_order() {
        assert_eq!("AVX2".parse::<Isa>(), Ok(Isa::Avx2));
        assert_eq!("x86-64-v4".parse::<Isa>(), Ok(Isa::Avx512));
        assert_eq!("baseline".parse::<Isa>(), Ok(Isa::Baseline));
        let e = "neon".parse::<Isa>().unwrap_err();
        assert!(e.contains("\"neon\"") && e.contains("avx2"), "{e}");
        assert!(Isa::Avx512 > Isa::Avx2 && Isa::Avx2 > Isa::Baseline);
        assert!(isa() <= Isa::detected());
    }
}
