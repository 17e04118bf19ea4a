//! Which matrix-product kernels each integer layer runs on, chosen by timing
//! the candidates on the layer's own shapes when the model loads. A rule by
//! layer shape was right on the host it was tuned on and wrong on another
//! (issue 38: vww's largest pointwise layer took 193 us on tract-linalg's
//! VNNI kernel and 48 us on ours). The choices are kept under
//! `node.state_dir/kernels/`, one file per model file (its sha256), valid
//! for one CPU signature, so a restart does not measure again.

use super::udot;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tract_onnx::prelude::TractResult;

/// How a layer runs: for a convolution or dense layer, whose product
/// kernels (each of ours by name, and tract-linalg's); for a depthwise one,
/// which layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Kernel {
    /// Our default form: for a convolution the host's first byte tile with
    /// a dot product, else the i16 tile; a depthwise layer channels-last.
    /// What `EDGEINFER_INT8_GEMM=ours` fixes.
    Ours,
    /// Our byte tile of one instruction set (`udot.rs`): convolutions whose
    /// weights' zero points are all 0.
    Bytes(udot::TileKernel),
    /// Our i16 tile of one instruction set (`igemm.rs`).
    I16(super::igemm::TileKernel),
    /// A depthwise layer on one of our kernels (`depthwise.rs`):
    /// channels-last on each instruction set, or planar (NCHW, one channel
    /// at a time, 16 output pixels a step) where a layer has few channels.
    Depthwise(super::depthwise::Kernel),
    /// tract-linalg's, as its dispatch picks for the host.
    Tract,
}

impl Kernel {
    pub fn as_str(self) -> &'static str {
        match self {
            Kernel::Ours => "ours",
            Kernel::Bytes(tile) => tile.id(),
            Kernel::I16(tile) => tile.id(),
            Kernel::Depthwise(form) => form.id(),
            Kernel::Tract => "tract",
        }
    }

    /// Whether it is one of ours (every form but tract-linalg's).
    pub fn is_ours(self) -> bool {
        self != Kernel::Tract
    }
}

impl From<Kernel> for String {
    fn from(kernel: Kernel) -> String {
        kernel.as_str().to_string()
    }
}

impl TryFrom<String> for Kernel {
    type Error = String;

    fn try_from(name: String) -> Result<Kernel, String> {
        match name.as_str() {
            "ours" => Ok(Kernel::Ours),
            "tract" => Ok(Kernel::Tract),
            other => udot::TileKernel::from_id(other)
                .map(Kernel::Bytes)
                .or_else(|| super::igemm::TileKernel::from_id(other).map(Kernel::I16))
                .or_else(|| super::depthwise::Kernel::from_id(other).map(Kernel::Depthwise))
                .ok_or_else(|| format!("kernel {other:?} is not one this build has")),
        }
    }
}

/// One layer's choice and what each candidate took per run at batch 1
/// (none: not measured, because the kernel was fixed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerChoice {
    pub layer: String,
    pub kernel: Kernel,
    /// The chosen kernel's name, as `models profile` shows it.
    pub name: String,
    /// Microseconds per run of each candidate measured.
    pub times: Vec<(Kernel, f64)>,
    /// Read from the cache rather than measured on this load.
    #[serde(skip)]
    pub cached: bool,
}

impl LayerChoice {
    /// The fastest of the others, when they were measured.
    pub fn runner_up(&self) -> Option<(Kernel, f64)> {
        let others = self.times.iter().filter(|(k, _)| *k != self.kernel);
        others.copied().min_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// The chosen kernel's time per run.
    pub fn chosen_us(&self) -> Option<f64> {
        self.times.iter().find(|(k, _)| *k == self.kernel).map(|t| t.1)
    }
}

/// Where a load keeps its choices: `dir/<model sha256>.json`. `reuse:
/// false` measures again and rewrites the file (`models verify`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCache {
    pub dir: PathBuf,
    pub reuse: bool,
}

#[derive(Serialize, Deserialize)]
struct CacheFile {
    signature: String,
    layers: Vec<LayerChoice>,
}

/// The choices made while one model loads.
#[derive(Debug)]
pub struct Chooser {
    /// `EDGEINFER_INT8_GEMM` (to compare), or a host with one candidate.
    fixed: Option<Kernel>,
    signature: String,
    cached: HashMap<String, LayerChoice>,
    file: Option<PathBuf>,
    /// Every layer's choice, in the order the layers were rewritten.
    pub made: Vec<LayerChoice>,
    /// How many layers were timed on this load.
    pub measured: usize,
}

impl Chooser {
    /// Reads the cached choices for the model file with this sha256 when
    /// they were made on a CPU with this host's signature.
    pub fn open(cache: Option<&KernelCache>, model_sha256: &str) -> Chooser {
        Chooser::with_signature(cache, model_sha256, cpu_signature(), fixed())
    }

    fn with_signature(
        cache: Option<&KernelCache>,
        model_sha256: &str,
        signature: String,
        fixed: Option<Kernel>,
    ) -> Chooser {
        let file = cache.map(|c| c.dir.join(format!("{}.json", model_sha256.to_ascii_lowercase())));
        let cached = match (cache, &file) {
            (Some(c), Some(path)) if c.reuse => read_cache(path, &signature),
            _ => HashMap::new(),
        };
        Chooser { fixed, signature, cached, file, made: Vec::new(), measured: 0 }
    }

    /// Builds the layer on one of `candidates` (the first is the default):
    /// the fixed one where it is a candidate (else the default), the cached
    /// choice, or the fastest timed by `run` (one image or row at batch 1).
    pub fn pick<Op>(
        &mut self,
        layer: &str,
        candidates: &[Kernel],
        build: impl Fn(Kernel) -> TractResult<Op>,
        name: impl Fn(&Op) -> String,
        run: impl Fn(&Op) -> TractResult<()>,
    ) -> TractResult<Op> {
        anyhow::ensure!(!candidates.is_empty(), "{layer}: no kernel to choose from");
        // `EDGEINFER_INT8_GEMM=ours`: our forms alone, timed against each
        // other (an x86-64 host then runs as an AVX2-only one would with
        // `EDGEINFER_AVX512=off EDGEINFER_VNNI=off`, tract-linalg keeping
        // its own dispatch); not kept, since tract's were left out.
        let ours: Vec<Kernel> = candidates.iter().copied().filter(|k| k.is_ours()).collect();
        let timed = match self.fixed {
            Some(Kernel::Ours) if ours.len() > 1 => &ours[..],
            Some(fixed) => {
                let kernel = if candidates.contains(&fixed) { fixed } else { candidates[0] };
                let op = build(kernel)?;
                let (name, times) = (name(&op), Vec::new());
                self.made.push(LayerChoice { layer: layer.into(), kernel, name, times, cached: false });
                return Ok(op);
            }
            None => {
                if let Some(choice) = self.cached.get(layer).filter(|c| candidates.contains(&c.kernel)) {
                    let op = build(choice.kernel)?;
                    self.made.push(LayerChoice { cached: true, ..choice.clone() });
                    return Ok(op);
                }
                // Only a measurement of every candidate is kept (`save`).
                self.measured += 1;
                candidates
            }
        };
        let ops = timed.iter().map(|&k| Ok((build(k)?, k))).collect::<TractResult<Vec<_>>>()?;
        let times = time_all(&ops, &run)?;
        let best = (0..ops.len()).min_by(|&a, &b| times[a].total_cmp(&times[b])).unwrap_or(0);
        let times: Vec<(Kernel, f64)> = timed.iter().copied().zip(times).collect();
        let (op, kernel) = ops.into_iter().nth(best).expect("best indexes ops");
        self.made.push(LayerChoice { layer: layer.into(), kernel, name: name(&op), times, cached: false });
        Ok(op)
    }

    /// The fastest byte tile `layer` was measured on (now or at an earlier
    /// start); `None` when none was.
    pub fn fastest_byte_tile(&self, layer: &str) -> Option<udot::TileKernel> {
        let choice = self.made.iter().rev().find(|c| c.layer == layer)?;
        let tiles = choice.times.iter().filter_map(|&(kernel, us)| match kernel {
            Kernel::Bytes(tile) => Some((tile, us)),
            _ => None,
        });
        tiles.min_by(|a, b| a.1.total_cmp(&b.1)).map(|t| t.0)
    }

    /// Writes the choices when this load measured any (atomically: a
    /// crash leaves the old file or the new one). Fixed choices are not
    /// kept: they say nothing about the host.
    pub fn save(&self) -> std::io::Result<()> {
        let Some(path) = &self.file else { return Ok(()) };
        if self.measured == 0 {
            return Ok(());
        }
        let file = CacheFile { signature: self.signature.clone(), layers: self.made.clone() };
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&file).map_err(std::io::Error::other)?)?;
        std::fs::rename(&tmp, path)
    }
}

fn read_cache(path: &Path, signature: &str) -> HashMap<String, LayerChoice> {
    let Ok(bytes) = std::fs::read(path) else { return HashMap::new() };
    match serde_json::from_slice::<CacheFile>(&bytes) {
        Ok(file) if file.signature == signature => {
            file.layers.into_iter().map(|c| (c.layer.clone(), c)).collect()
        }
        Ok(_) => {
            tracing::info!("{}: made on another CPU or build; measuring the kernels again", path.display());
            HashMap::new()
        }
        Err(e) => {
            tracing::warn!("{}: unreadable ({e}); measuring the kernels again", path.display());
            HashMap::new()
        }
    }
}

/// Per-run time of each candidate at batch 1: runs alternate between them
/// (so a noisy moment costs all), the minimum is kept, and each gets at
/// least 3 runs, all together about 2 ms, at most 50: a few ms a layer.
fn time_all<Op>(candidates: &[(Op, Kernel)], run: &impl Fn(&Op) -> TractResult<()>) -> TractResult<Vec<f64>> {
    let mut best = vec![Duration::MAX; candidates.len()];
    let mut spent = Duration::ZERO;
    for (op, _) in candidates {
        run(op)?; // warm-up: first-touch of buffers and caches
    }
    let mut runs = 0;
    while runs < 3 || (spent < Duration::from_millis(2) && runs < 50) {
        for ((op, kernel), best) in candidates.iter().zip(&mut best) {
            let start = Instant::now();
            run(op)?;
            std::thread::sleep(failpoint_delay(*kernel));
            let took = start.elapsed();
            *best = (*best).min(took);
            spent += took;
        }
        runs += 1;
    }
    Ok(best.into_iter().map(|d| d.as_secs_f64() * 1e6).collect())
}

/// Fault injection (`--features failpoints`):
/// `int8_kernel_slow=return(NAMES)` adds 10 ms (more than a debug build's
/// noise on a layer) to each timed run of each
/// kernel NAMES lists, comma-separated (`tract`, an i16 tile's id such as
/// `i16_avx2`, a byte tile's such as `avx512_vnni`, or `ours` for every
/// one of ours), so tests can
/// check that the slower ones lose.
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
fn failpoint_delay(kernel: Kernel) -> Duration {
    fail::fail_point!("int8_kernel_slow", |arg: Option<String>| {
        let names = arg.unwrap_or_default();
        let mut names = names.split(',');
        let slowed =
            names.any(|name| if name == "ours" { kernel.is_ours() } else { name == kernel.as_str() });
        if slowed { Duration::from_millis(10) } else { Duration::ZERO }
    });
    Duration::ZERO
}

/// The kernel every layer runs on without measuring: tract-linalg's on a
/// host with neither AVX2 nor a byte dot product (ours would run portable
/// code), or the one `EDGEINFER_INT8_GEMM` names (`tract`; or `ours`, our
/// forms timed against each other alone), to compare.
fn fixed() -> Option<Kernel> {
    if !super::cpu::avx2() && udot::TileKernel::best().is_none() {
        return Some(Kernel::Tract);
    }
    match std::env::var("EDGEINFER_INT8_GEMM").as_deref() {
        Ok("ours") => Some(Kernel::Ours),
        Ok("tract") => Some(Kernel::Tract),
        _ => None,
    }
}

/// What a measurement depends on: the CPU (vendor, family, model,
/// stepping and feature words from `cpuid`, or the arm64 identification
/// and features) and the kernels each side would run here, which also
/// changes with `EDGEINFER_AVX512`, `EDGEINFER_VNNI` and with a build whose
/// kernels differ.
fn cpu_signature() -> String {
    static SIGNATURE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SIGNATURE
        .get_or_init(|| {
            let tract = super::gemm::Weights::new(&[0; 64 * 64], 64, 64, Some(128))
                .map(|w| w.kernel_name())
                .unwrap_or_default();
            let bytes = super::udot::TileKernel::best().map_or("no byte tile", |k| k.name());
            let ours = super::igemm::TileKernel::best().name();
            format!("{}; ours {ours}, {bytes}; tract {tract}", cpu_identity())
        })
        .clone()
}

#[cfg(target_arch = "x86_64")]
fn cpu_identity() -> String {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // SAFETY: cpuid exists on every x86-64 CPU; leaves past the maximum
    // the CPU reports are not asked.
    let max = __cpuid(0);
    let vendor: Vec<u8> = [max.ebx, max.edx, max.ecx].iter().flat_map(|r| r.to_le_bytes()).collect();
    let one = __cpuid(1);
    let seven = if max.eax >= 7 { __cpuid_count(7, 0) } else { __cpuid(0) };
    let (family, model) = ((one.eax >> 8) & 0xf, (one.eax >> 4) & 0xf);
    let (ext_family, ext_model) = ((one.eax >> 20) & 0xff, (one.eax >> 16) & 0xf);
    format!(
        "x86_64 {} family {} model {} stepping {} features {:08x}{:08x} {:08x}{:08x}{:08x}",
        String::from_utf8_lossy(&vendor),
        family + if family == 0xf { ext_family } else { 0 },
        model | if family == 0x6 || family == 0xf { ext_model << 4 } else { 0 },
        one.eax & 0xf,
        one.ecx,
        one.edx,
        seven.ebx,
        seven.ecx,
        seven.edx
    )
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_identity() -> String {
    // The first processor's identification and features (arm64 Linux).
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let wanted = ["CPU implementer", "CPU variant", "CPU part", "CPU revision", "Features"];
    let fields: Vec<&str> = info
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| wanted.iter().any(|w| l.starts_with(w)))
        .collect();
    format!("{} {}", std::env::consts::ARCH, fields.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake layer whose kernels take the times the test gives.
    fn pick(chooser: &mut Chooser, layer: &str, ours: u64, tract: u64) -> Kernel {
        let took = |k: Kernel| Duration::from_micros(if k == Kernel::Ours { ours } else { tract });
        let run = |&k: &Kernel| {
            std::thread::sleep(took(k));
            Ok(())
        };
        chooser.pick(layer, &[Kernel::Ours, Kernel::Tract], Ok, |k| k.as_str().into(), run).unwrap()
    }

    #[test]
    fn the_faster_kernel_is_chosen_and_the_choice_is_reused_until_the_cpu_changes() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache { dir: dir.path().join("kernels"), reuse: true };
        let open = |signature: &str| Chooser::with_signature(Some(&cache), "AB12", signature.into(), None);

        let mut first = open("cpu A");
        assert_eq!(pick(&mut first, "conv1", 3000, 200), Kernel::Tract);
        assert_eq!(pick(&mut first, "conv2", 200, 3000), Kernel::Ours);
        assert_eq!(first.measured, 2);
        let conv1 = &first.made[0];
        assert!(conv1.chosen_us().unwrap() < conv1.runner_up().unwrap().1, "{conv1:?}");
        assert_eq!(conv1.runner_up().map(|r| r.0), Some(Kernel::Ours));
        first.save().unwrap();
        assert!(dir.path().join("kernels/ab12.json").is_file());

        // Same CPU: the cached choice stands although the times flipped.
        let mut again = open("cpu A");
        assert_eq!(pick(&mut again, "conv1", 200, 3000), Kernel::Tract);
        assert_eq!((again.measured, again.made[0].cached), (0, true));
        // A layer the file does not know is measured.
        assert_eq!(pick(&mut again, "conv3", 3000, 200), Kernel::Tract);
        assert_eq!(again.measured, 1);

        // Another CPU: measured again.
        let mut other = open("cpu B");
        assert_eq!(pick(&mut other, "conv1", 200, 3000), Kernel::Ours);
        assert_eq!(other.measured, 1);

        // `models verify` measures whatever the file says.
        let fresh = KernelCache { reuse: false, ..cache.clone() };
        let mut verify = Chooser::with_signature(Some(&fresh), "AB12", "cpu A".into(), None);
        assert_eq!(pick(&mut verify, "conv1", 200, 3000), Kernel::Ours);
        assert_eq!(verify.measured, 1);
    }

    #[test]
    fn a_fixed_kernel_is_not_measured_nor_saved_and_a_broken_file_is_measured_again() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache { dir: dir.path().to_owned(), reuse: true };
        let mut fixed = Chooser::with_signature(Some(&cache), "cd", "cpu".into(), Some(Kernel::Ours));
        assert_eq!(pick(&mut fixed, "conv1", 3000, 1), Kernel::Ours);
        assert_eq!((fixed.measured, fixed.made[0].chosen_us()), (0, None));
        fixed.save().unwrap();
        assert!(!dir.path().join("cd.json").exists());

        std::fs::write(dir.path().join("cd.json"), b"{ not json").unwrap();
        let mut chooser = Chooser::with_signature(Some(&cache), "cd", "cpu".into(), None);
        assert_eq!(pick(&mut chooser, "conv1", 3000, 1), Kernel::Tract);
        chooser.save().unwrap();
        let reread = Chooser::with_signature(Some(&cache), "cd", "cpu".into(), None);
        assert_eq!(reread.cached["conv1"].kernel, Kernel::Tract);
    }

    #[test]
    fn the_fastest_of_three_wins_and_a_fixed_kernel_that_is_no_candidate_leaves_the_default() {
        // Three forms a layer might have, as the chooser sees them.
        let planar = Kernel::Bytes(udot::TileKernel::Portable);
        let took = |k: Kernel| match k {
            Kernel::Ours => 900,
            Kernel::Tract => 2000,
            _ => 100,
        };
        let run = |&k: &Kernel| {
            std::thread::sleep(Duration::from_micros(took(k)));
            Ok(())
        };
        let all = [Kernel::Ours, planar, Kernel::Tract];
        let mut chooser = Chooser::with_signature(None, "ef", "cpu".into(), None);
        assert_eq!(chooser.pick("dw", &all, Ok, |k| k.as_str().into(), run).unwrap(), planar);
        assert_eq!(chooser.made[0].runner_up().map(|r| r.0), Some(Kernel::Ours));
        assert_eq!(chooser.made[0].times.len(), 3);
        let mut fixed = Chooser::with_signature(None, "ef", "cpu".into(), Some(Kernel::Tract));
        let depthwise = [Kernel::Ours, planar];
        assert_eq!(fixed.pick("dw", &depthwise, Ok, |k| k.as_str().into(), run).unwrap(), Kernel::Ours);
        assert_eq!(fixed.measured, 0);
        // `EDGEINFER_INT8_GEMM=ours`: our forms timed against each other
        // alone, and not kept.
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache { dir: dir.path().to_owned(), reuse: true };
        let mut ours = Chooser::with_signature(Some(&cache), "ef", "cpu".into(), Some(Kernel::Ours));
        assert_eq!(ours.pick("dw", &all, Ok, |k| k.as_str().into(), run).unwrap(), planar);
        assert_eq!(ours.made[0].times.iter().map(|t| t.0).collect::<Vec<_>>(), [Kernel::Ours, planar]);
        ours.save().unwrap();
        assert!(!dir.path().join("ef.json").exists(), "choices made without tract's are not kept");
    }

    #[test]
    fn each_of_our_forms_has_a_name_that_reads_back_and_an_unknown_one_is_refused() {
        let mut kernels = vec![Kernel::Ours, Kernel::Tract];
        kernels.extend(super::super::igemm::TileKernel::available().into_iter().map(Kernel::I16));
        kernels.extend(udot::TileKernel::available().into_iter().map(Kernel::Bytes));
        kernels.push(Kernel::try_from("dw_portable".to_string()).unwrap());
        for kernel in kernels {
            let json = serde_json::to_string(&kernel).unwrap();
            assert_eq!(serde_json::from_str::<Kernel>(&json).unwrap(), kernel, "{json}");
        }
        let unknown = serde_json::from_str::<Kernel>("\"avx1024\"").unwrap_err().to_string();
        assert!(unknown.contains("avx1024"), "{unknown}");
        // A file from before the forms were named: its conv layers said
        // `ours`, no candidate now, so they are measured again.
        let old: LayerChoice = serde_json::from_str(
            r#"{"layer": "conv1", "kernel": "ours", "name": "x", "times": [["ours", 3.0], ["tract", 4.0]]}"#,
        )
        .unwrap();
        assert_eq!(old.runner_up(), Some((Kernel::Tract, 4.0)));
    }

    #[test]
    fn the_signature_names_this_cpu_and_both_kernels() {
        let signature = cpu_signature();
        assert!(signature.starts_with(std::env::consts::ARCH), "{signature}");
        assert!(signature.contains("; ours ") && signature.contains("; tract "), "{signature}");
    }
}
