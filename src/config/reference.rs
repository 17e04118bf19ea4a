//! `edgeinfer config reference` and docs/CONFIG.md: every key with its
//! type, default, whether a reload applies it and what it does. The
//! fields, types and doc comments come from the config structs themselves
//! (build.rs reads them), the defaults from `Config::default()`, so the
//! reference cannot drift from the code.

use super::{Config, ModelConfig};

mod docs {
    include!(concat!(env!("OUT_DIR"), "/config_docs.rs"));
}

/// Keys a reload does not apply: the services and the cache are built
/// once at start. `NAME` stands for any model; a key covers the keys
/// under it. `lifecycle::needing_restart` compares exactly these.
pub const RESTART_KEYS: [&str; 11] = [
    "node.id",
    "node.state_dir",
    "mqtt",
    "http",
    "cache",
    "limits.max_packet_bytes",
    "limits.max_bytes_in_flight",
    "cloud",
    "runtime.io_threads",
    "feedback",
    "tracing",
];

/// Defaults that depend on the machine, written as words instead of the
/// value this machine would give.
const MACHINE_DEFAULTS: [(&str, &str); 3] = [
    ("node.id", "the host name"),
    ("node.models_dir", "`models`, or `/usr/share/edgeinfer/models` under systemd"),
    ("node.state_dir", "`$STATE_DIRECTORY`, else `state`"),
];

/// One key of the reference.
#[derive(Debug, Clone, PartialEq)]
pub struct Key {
    /// Dotted, `NAME` for a model's name: `models.NAME.threshold`.
    pub key: String,
    pub kind: String,
    pub default: String,
    pub applied_on_reload: bool,
    pub doc: &'static str,
}

/// Whether a reload applies `key` (else it waits for a restart).
pub fn applied_on_reload(key: &str) -> bool {
    !RESTART_KEYS.iter().any(|k| key == *k || key.strip_prefix(k).is_some_and(|rest| rest.starts_with('.')))
}

/// Every key, in the order of the structs' fields.
pub fn keys() -> Vec<Key> {
    let defaults = defaults();
    let mut keys = Vec::new();
    collect("Config", "", Some(&defaults), &mut keys);
    keys
}

/// The config's defaults as TOML, with a default model under `NAME`.
fn defaults() -> toml::Value {
    let mut config = Config::default();
    config.models.insert("NAME".into(), ModelConfig::default());
    let mut defaults = toml::Value::try_from(&config).expect("the config serializes");
    // The rollout keys a deployment writes only when set.
    let rollout = toml::Value::Table(ModelConfig::default().rollout.as_table());
    defaults["models"]["NAME"]["rollout"] = rollout;
    defaults
}

/// `name`'s keys under `prefix`; `defaults` is its table of defaults, if
/// it has one.
fn collect(name: &str, prefix: &str, defaults: Option<&toml::Value>, keys: &mut Vec<Key>) {
    let fields = docs::STRUCTS.iter().find(|(s, _)| *s == name).map(|(_, f)| *f).unwrap_or_default();
    for (field, ty, doc) in fields {
        let key = if prefix.is_empty() { field.to_string() } else { format!("{prefix}.{field}") };
        let value = defaults.and_then(|d| d.get(field));
        if let Some(inner) = map_of(ty).filter(|inner| is_struct(inner)) {
            collect(inner, &format!("{key}.NAME"), value.and_then(|v| v.get("NAME")), keys);
        } else if let Some(inner) = map_of(ty) {
            // A plain value per name (`tracing.model_slow_ms.digits = 10`).
            let (key, kind) = (format!("{key}.NAME"), kind(inner));
            keys.push(Key {
                applied_on_reload: applied_on_reload(&key),
                key,
                kind,
                default: "unset".into(),
                doc,
            });
        } else if is_struct(last_segment(ty)) {
            collect(last_segment(ty), &key, value, keys);
        } else {
            let default = match MACHINE_DEFAULTS.iter().find(|(k, _)| *k == key) {
                Some((_, words)) => words.to_string(),
                None => value.map(show).unwrap_or_else(|| "unset".into()),
            };
            let applied_on_reload = applied_on_reload(&key);
            keys.push(Key { key, kind: kind(ty), default, applied_on_reload, doc });
        }
    }
}

fn is_struct(name: &str) -> bool {
    docs::STRUCTS.iter().any(|(s, _)| *s == name)
}

/// `BTreeMap<String,ModelConfig>` → `ModelConfig`.
fn map_of(ty: &str) -> Option<&str> {
    ty.strip_prefix("BTreeMap<String,")?.strip_suffix('>')
}

fn last_segment(ty: &str) -> &str {
    ty.rsplit("::").next().unwrap_or(ty)
}

/// The type as a user writes it in TOML.
fn kind(ty: &str) -> String {
    if let Some(inner) = ty.strip_prefix("Option<").and_then(|t| t.strip_suffix('>')) {
        return kind(inner);
    }
    if let Some(inner) = ty.strip_prefix("Vec<").and_then(|t| t.strip_suffix('>')) {
        return format!("list of {}s", kind(inner));
    }
    let name = last_segment(ty);
    if let Some((_, words)) = docs::ENUMS.iter().find(|(e, _)| *e == name) {
        let words: Vec<String> = words.iter().map(|w| format!("`{w}`")).collect();
        return format!("one of {}", words.join(", "));
    }
    match name {
        "bool" => "boolean",
        "u8" | "u16" | "u32" | "u64" | "usize" => "integer",
        "f32" | "f64" => "number",
        "String" => "string",
        "PathBuf" => "path",
        "Secret" => "string, secret",
        other => other,
    }
    .into()
}

/// A default as it would be written in the file.
fn show(value: &toml::Value) -> String {
    let text = match value {
        // An f32 default (0.99) reads as the f32 it is, not 0.9900000095367432.
        toml::Value::Float(f) if (*f as f32) as f64 == *f => format!("{}", *f as f32),
        toml::Value::String(s) if s.is_empty() => "\"\"".into(),
        toml::Value::String(s) => s.clone(),
        toml::Value::Array(items) => format!("[{}]", items.iter().map(show).collect::<Vec<_>>().join(", ")),
        other => other.to_string(),
    };
    format!("`{text}`")
}

/// The reference as Markdown: docs/CONFIG.md is exactly this.
pub fn markdown() -> String {
    let mut out = String::from(
        "# Configuration reference\n\n\
         Generated by `edgeinfer config reference` from the config structs' own \
         definitions; a test fails when this file differs from its output.\n\n\
         `--config FILE` (or `EDGEINFER_CONFIG`) reads TOML; every key has a default, and \
         `EDGEINFER_<SECTION>__<KEY>` environment variables override the file \
         (`EDGEINFER_MQTT__URL=mqtts://broker:8883`, `EDGEINFER_MODELS__DIGITS__THRESHOLD=0.9`), \
         read as TOML and as a plain string when they are not valid TOML. \
         `edgeinfer config check FILE` reports every mistake at once; \
         `edgeinfer config print` shows the config in effect, secrets redacted. \
         *Reload* says whether `systemctl reload` (SIGHUP) applies a change or it waits for a restart. \
         `NAME` is a model's name.\n",
    );
    let mut section = String::new();
    for key in keys() {
        let head = match key.key.split('.').collect::<Vec<_>>().as_slice() {
            ["models", _, "rollout", ..] => "models.NAME.rollout".to_string(),
            ["models", ..] => "models.NAME".to_string(),
            [first, second, _] => format!("{first}.{second}"),
            [first, ..] => first.to_string(),
            [] => String::new(),
        };
        if head != section {
            out.push_str(&format!(
                "\n## [{head}]\n\n| key | type | default | reload | what it does |\n| --- | --- | --- | --- | --- |\n"
            ));
            section = head;
        }
        let reload = if key.applied_on_reload { "applies" } else { "restart" };
        out.push_str(&format!(
            "| `{}` | {} | {} | {reload} | {} |\n",
            key.key,
            key.kind,
            key.default,
            key.doc.replace('|', "\\|")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key `Config::default()` serializes, dotted.
    fn serialized_keys(value: &toml::Value, prefix: &str, out: &mut Vec<String>) {
        if let toml::Value::Table(table) = value {
            for (k, v) in table {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                match v {
                    toml::Value::Table(_) => serialized_keys(v, &key, out),
                    _ => out.push(key),
                }
            }
        }
    }

    #[test]
    fn every_key_of_the_config_is_in_the_reference_with_a_description() {
        let keys = keys();
        let named: Vec<&str> = keys.iter().map(|k| k.key.as_str()).collect();
        let mut serialized = Vec::new();
        serialized_keys(&defaults(), "", &mut serialized);
        assert!(serialized.len() > 60, "{serialized:?}");
        for key in &serialized {
            assert!(named.contains(&key.as_str()), "{key} is missing from the reference");
        }
        for key in &keys {
            assert!(key.doc.len() >= 12, "{} has no description: give its field a doc comment", key.key);
        }
        // Keys that are unset by default are there too, with their kind.
        let password = keys.iter().find(|k| k.key == "mqtt.password").unwrap();
        assert_eq!((password.kind.as_str(), password.default.as_str()), ("string, secret", "unset"));
        let threshold = keys.iter().find(|k| k.key == "models.NAME.threshold").unwrap();
        assert_eq!(threshold.default, "`0.99`");
        let mode = keys.iter().find(|k| k.key == "models.NAME.auto_rollout").unwrap();
        assert_eq!(mode.kind, "one of `off`, `canary`, `shadow`");
    }

    #[test]
    fn the_reload_column_follows_the_keys_a_reload_leaves_for_a_restart() {
        assert!(!applied_on_reload("mqtt.url") && !applied_on_reload("cache.redis.url"));
        // A model's TTL is part of its config version, which a reload (or a
        // config rollout) changes.
        assert!(applied_on_reload("models.NAME.cache_ttl_s"));
        assert!(applied_on_reload("models.NAME.threshold") && applied_on_reload("limits.max_rows"));
        assert!(applied_on_reload("node.drain_timeout_s") && !applied_on_reload("node.id"));
        assert!(applied_on_reload("cloudy"), "a key is covered by a prefix only at a dot");
    }

    #[test]
    fn docs_config_md_is_the_reference() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/CONFIG.md");
        let written = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            written == markdown(),
            "docs/CONFIG.md differs from `edgeinfer config reference`: run \
             `cargo run -- config reference > docs/CONFIG.md`"
        );
    }
}
