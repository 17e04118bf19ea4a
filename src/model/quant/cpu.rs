//! What the host's CPU can run, asked once per call site: the bottom of the
//! integer ops, below the numbers (`requant`), the packing (`patches`), the
//! kernels (`igemm`, `gemm`, `transpose`) and the ops on top of them.

/// Whether this host runs the AVX2 kernel (else the portable one).
pub fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this host has AVX-512 F and BW (and whether VNNI too), unless
/// `EDGEINFER_AVX512=off` asks for the AVX2 kernels (to compare, or on a
/// host that down-clocks under 512-bit work). Found once per process: the
/// kernels ask per image and per tile, and reading the environment costs
/// more than a small tile.
#[cfg(target_arch = "x86_64")]
pub fn avx512() -> Option<Avx512> {
    static FOUND: std::sync::OnceLock<Option<Avx512>> = std::sync::OnceLock::new();
    *FOUND.get_or_init(|| {
        let usable = std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::env::var("EDGEINFER_AVX512").as_deref() != Ok("off");
        usable.then(|| Avx512 { vnni: std::is_x86_feature_detected!("avx512vnni") && vnni() })
    })
}

/// Whether our kernels may use the dot-product instructions (AVX-512 VNNI,
/// AVX-VNNI), unless `EDGEINFER_VNNI=off` asks for the plain AVX2 (or
/// AVX-512) kernels: with `EDGEINFER_AVX512=off` as well, this host runs
/// our kernels as an AVX2-only one (Zen 2 and 3, Skylake) would, to
/// measure that path. tract-linalg's kernels keep their own dispatch.
#[cfg(target_arch = "x86_64")]
pub fn vnni() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("EDGEINFER_VNNI").as_deref() != Ok("off"))
}

#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx512 {
    pub vnni: bool,
}
