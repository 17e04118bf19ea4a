//! Every model version found under the models directory. A version that fails
//! to load is refused on its own; the others still serve.

use super::{LoadError, LoadedModel, RuntimeOptions};
use crate::protocol::InferError;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A version that was found but refused, with the reason.
#[derive(Debug)]
pub struct Refused {
    pub dir: PathBuf,
    pub error: LoadError,
}

impl Refused {
    /// `NAME vVERSION: reason`, from the directory's last two names: for
    /// the status, which carries no paths.
    pub fn summary(&self) -> String {
        let mut names = self.dir.iter().rev().map(|n| n.to_string_lossy());
        let version = names.next().unwrap_or_default();
        let name = names.next().unwrap_or_default();
        format!("{name} v{version}: {}", self.error.reason())
    }
}

#[derive(Debug, Default)]
pub struct Registry {
    /// name -> version -> model, versions in serving order (see `VersionKey`).
    models: Versions<Arc<LoadedModel>>,
    /// Shared, so a registry made from another (`with_version`) keeps them.
    pub refused: Vec<Arc<Refused>>,
}

/// Numeric versions sort numerically and after any non-numeric ones, so "10" > "9".
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct VersionKey(Option<u64>, String);

impl VersionKey {
    fn of(v: &str) -> Self {
        VersionKey(v.parse().ok(), v.to_string())
    }
}

/// Model names as they may appear in topics and URLs: no separators, no MQTT
/// wildcards, no `.`/`..` path tricks.
pub fn valid_model_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl Registry {
    /// Loads `dir/NAME/VERSION/model.toml` for every NAME and VERSION.
    /// Directories without a manifest (the producing script's data) are skipped.
    /// Versions load on parallel threads (one per core at most); the outcome
    /// does not depend on the order they finish in.
    pub fn load(dir: &Path, options: &RuntimeOptions) -> Result<Registry, LoadError> {
        let mut version_dirs = Vec::new();
        for name_dir in sorted_dirs(dir)? {
            version_dirs
                .extend(sorted_dirs(&name_dir)?.into_iter().filter(|d| d.join("model.toml").is_file()));
        }
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(version_dirs.len());
        let next = AtomicUsize::new(0);
        let loaded: Mutex<Vec<(usize, Result<LoadedModel, LoadError>)>> = Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(version_dir) = version_dirs.get(i) else { break };
                        let outcome = LoadedModel::load(version_dir, options);
                        loaded.lock().unwrap_or_else(|e| e.into_inner()).push((i, outcome));
                    }
                });
            }
        });
        let mut loaded = loaded.into_inner().unwrap_or_else(|e| e.into_inner());
        loaded.sort_by_key(|(i, _)| *i);
        let mut registry = Registry::default();
        for (i, outcome) in loaded {
            match outcome {
                Ok(model) => registry.insert(Arc::new(model)),
                Err(error) => {
                    registry.refused.push(Arc::new(Refused { dir: version_dirs[i].clone(), error }))
                }
            }
        }
        Ok(registry)
    }

    /// Plans the buckets a deferred load left out, on one thread (each
    /// model's buckets in parallel); requests meanwhile run on the plans
    /// already in service. A bucket that fails its golden vectors stays out
    /// of service, with an error in the log.
    pub fn plan_rest_in_background(&self) {
        let models: Vec<Arc<LoadedModel>> = self.all().cloned().collect();
        let spawned = std::thread::Builder::new().name("planner".into()).spawn(move || {
            for model in models {
                if let Err(e) = model.plan_rest() {
                    tracing::error!("{e}; its larger batches run in chunks on the smaller plans");
                }
            }
        });
        if let Err(e) = spawned {
            tracing::error!("cannot start the planner thread: {e}; batches run on the smallest plans");
        }
    }

    /// This registry with `model` added (loaded since, on its own): the
    /// same versions, and the refusals but the one of `model`'s directory.
    pub fn with_version(&self, model: Arc<LoadedModel>) -> Registry {
        let mut next = Registry::default();
        for loaded in self.all() {
            next.insert(loaded.clone());
        }
        next.refused = self.refused.iter().filter(|r| r.dir != model.dir).cloned().collect();
        next.insert(model);
        next
    }

    pub fn insert(&mut self, model: Arc<LoadedModel>) {
        let (name, version) = (model.name().to_string(), VersionKey::of(model.version()));
        self.models.by_name.entry(name).or_default().insert(version, model);
    }

    /// The version a request names, or the active one.
    pub fn get(&self, name: &str, version: Option<&str>) -> Result<Arc<LoadedModel>, InferError> {
        self.models.get(name, version).cloned()
    }

    /// Active versions, by name.
    pub fn active(&self) -> impl Iterator<Item = &Arc<LoadedModel>> {
        self.models.active()
    }

    /// Every loaded version of every model.
    pub fn all(&self) -> impl Iterator<Item = &Arc<LoadedModel>> {
        self.models.all()
    }

    /// Each model's loaded versions in serving order, the newest last.
    pub fn available(&self) -> BTreeMap<String, Vec<String>> {
        self.models
            .by_name
            .iter()
            .map(|(name, v)| (name.clone(), v.keys().map(|k| k.1.clone()).collect()))
            .collect()
    }

    /// The fingerprints of every loaded version.
    pub fn fingerprints(&self) -> Fingerprints {
        let mut all = Fingerprints::new();
        for m in self.all() {
            let print =
                Fingerprint { sha256: m.manifest.sha256.clone(), manifest_sha256: m.manifest_sha256.clone() };
            all.entry(m.name().to_string()).or_default().insert(m.version().to_string(), print);
        }
        all
    }

    /// The version of each model that serves a request naming none: the
    /// one `stable` pins when it is loaded, else the newest.
    pub fn serving<'a>(
        &'a self,
        stable: impl Fn(&str) -> Option<&'a str> + 'a,
    ) -> impl Iterator<Item = &'a Arc<LoadedModel>> + 'a {
        self.models.by_name.keys().filter_map(move |name| self.models.serving(name, stable(name)).ok())
    }

    /// The version of `name` that serves a request naming none: `stable`
    /// when it is loaded, else the newest.
    pub fn serving_one(&self, name: &str, stable: Option<&str>) -> Result<Arc<LoadedModel>, InferError> {
        self.models.serving(name, stable).cloned()
    }

    pub fn versions(&self, name: &str) -> Vec<String> {
        self.models.by_name.get(name).map(|v| v.keys().map(|k| k.1.clone()).collect()).unwrap_or_default()
    }

    /// Something per loaded version (its inference threads, say), looked up
    /// by name and version exactly as the models are.
    pub fn map<T>(&self, f: impl FnMut(&Arc<LoadedModel>) -> T) -> Versions<T> {
        self.models.map(f)
    }

    /// `map` with a step that can fail: the first error ends it.
    pub fn try_map<T, E>(&self, f: impl FnMut(&Arc<LoadedModel>) -> Result<T, E>) -> Result<Versions<T>, E> {
        self.models.try_map(f)
    }
}

/// Per model name, its versions: the newest is the active one.
#[derive(Debug)]
pub struct Versions<T> {
    by_name: BTreeMap<String, BTreeMap<VersionKey, T>>,
}

impl<T> Default for Versions<T> {
    fn default() -> Self {
        Versions { by_name: BTreeMap::new() }
    }
}

impl<T> Versions<T> {
    /// Version `version` of model `name`, or its active version; the error
    /// names what this node has instead.
    pub fn get(&self, name: &str, version: Option<&str>) -> Result<&T, InferError> {
        if !valid_model_name(name) {
            return Err(InferError::unknown_model(format!(
                "model name {name:?} is not valid: model names use letters, digits, '.', '_' and '-'; \
                 known models: {}",
                self.known()
            )));
        }
        let Some(versions) = self.by_name.get(name) else {
            return Err(InferError::unknown_model(format!(
                "no model {name:?} on this node; known models: {}",
                self.known()
            )));
        };
        match version {
            None => Ok(versions.values().next_back().expect("a listed model has a version")),
            Some(v) => versions.get(&VersionKey::of(v)).ok_or_else(|| {
                InferError::unknown_model(format!(
                    "parameters.model_version {v:?}: model {name} has versions {}",
                    versions.keys().map(|k| k.1.as_str()).collect::<Vec<_>>().join(", ")
                ))
            }),
        }
    }

    /// What answers a request for `name` naming no version: `stable` when
    /// it is loaded (the deployment state's pin), else the newest.
    pub fn serving(&self, name: &str, stable: Option<&str>) -> Result<&T, InferError> {
        match stable.and_then(|v| self.by_name.get(name)?.get(&VersionKey::of(v))) {
            Some(pinned) => Ok(pinned),
            None => self.get(name, None),
        }
    }

    pub fn active(&self) -> impl Iterator<Item = &T> {
        self.by_name.values().filter_map(|v| v.values().next_back())
    }

    pub fn all(&self) -> impl Iterator<Item = &T> {
        self.by_name.values().flat_map(|v| v.values())
    }

    pub fn try_map<U, E>(&self, mut f: impl FnMut(&T) -> Result<U, E>) -> Result<Versions<U>, E> {
        let mut by_name = BTreeMap::new();
        for (name, versions) in &self.by_name {
            let mut mapped = BTreeMap::new();
            for (k, t) in versions {
                mapped.insert(k.clone(), f(t)?);
            }
            by_name.insert(name.clone(), mapped);
        }
        Ok(Versions { by_name })
    }

    pub fn map<U>(&self, mut f: impl FnMut(&T) -> U) -> Versions<U> {
        let by_name = self
            .by_name
            .iter()
            .map(|(name, versions)| (name.clone(), versions.iter().map(|(k, t)| (k.clone(), f(t))).collect()))
            .collect();
        Versions { by_name }
    }

    fn known(&self) -> String {
        if self.by_name.is_empty() {
            "none (check node.models_dir)".into()
        } else {
            self.by_name.keys().cloned().collect::<Vec<_>>().join(", ")
        }
    }
}

/// What identifies a version's files: the model file's sha256 (from its
/// manifest, checked at load) and the manifest's own.
#[derive(Debug, Clone, PartialEq)]
pub struct Fingerprint {
    pub sha256: String,
    pub manifest_sha256: String,
}

/// By model, then version.
pub type Fingerprints = BTreeMap<String, BTreeMap<String, Fingerprint>>;

/// The fingerprints of every version directory, read from the manifests
/// without loading the models (a manifest that does not parse is left out).
pub fn fingerprints_on_disk(dir: &Path) -> Result<Fingerprints, LoadError> {
    let mut all = Fingerprints::new();
    for (name, versions) in versions_on_disk(dir)? {
        for version in versions {
            let version_dir = dir.join(&name).join(&version);
            let Ok(manifest) = super::Manifest::read(&version_dir.join("model.toml")) else { continue };
            let manifest_sha256 = super::runtime::manifest_sha256(&version_dir)?;
            all.entry(name.clone())
                .or_default()
                .insert(version, Fingerprint { sha256: manifest.sha256, manifest_sha256 });
        }
    }
    Ok(all)
}

/// Each model's version directories (those with a `model.toml`) in
/// serving order, without loading them: what a command sees with no node
/// running.
pub fn versions_on_disk(dir: &Path) -> Result<BTreeMap<String, Vec<String>>, LoadError> {
    let mut available = BTreeMap::new();
    for name_dir in sorted_dirs(dir)? {
        let mut versions: Vec<VersionKey> = sorted_dirs(&name_dir)?
            .iter()
            .filter(|d| d.join("model.toml").is_file())
            .filter_map(|d| Some(VersionKey::of(d.file_name()?.to_str()?)))
            .collect();
        versions.sort();
        if let (false, Some(name)) = (versions.is_empty(), name_dir.file_name().and_then(|n| n.to_str())) {
            available.insert(name.to_string(), versions.into_iter().map(|k| k.1).collect());
        }
    }
    Ok(available)
}

fn sorted_dirs(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let entries = std::fs::read_dir(dir).map_err(|source| LoadError::Io { path: dir.to_owned(), source })?;
    let mut dirs: Vec<PathBuf> =
        entries.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    Ok(dirs)
}
