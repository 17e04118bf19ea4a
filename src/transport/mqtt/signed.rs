//! Signed control commands on `PREFIX/NODE/control`: the wire format the
//! node and its senders (`edgeinfer models ... --via-mqtt`, a fleet
//! manager's own code) share. A command carries an HMAC-SHA256 of its
//! fields under the key in `control.key_file`, never the key itself, so a
//! subscriber to the topic (a broker without topic ACLs lets anyone be one)
//! learns nothing it could sign a command with. The signed string names the
//! topic the command is addressed to, so one signed for a node is refused
//! by every other, and when it was issued, so one overheard is refused once
//! `control.max_skew_s` has passed. docs/ROLLOUTS.md gives the
//! recipe with a worked example; `tests::the_readme_worked_example_verifies`
//! holds the two to each other.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The canonical string's first line: a later format gets another name, so
/// a signature never verifies under a reading it was not made for.
pub const SCHEME: &str = "edgeinfer-control-v1";

/// The shortest key taken, in bytes: HMAC-SHA256's full strength needs 32.
pub const MIN_KEY_BYTES: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("control.key_file = {}: cannot read: {source}", .path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error(
        "control.key_file = {}: the key (the file's first line) is {len} bytes; use at least 32, \
         e.g. `openssl rand -hex 32 > FILE` (64)",
        .path.display()
    )]
    Short { path: PathBuf, len: usize },
}

/// The secret commands are signed with: never logged, never sent.
#[derive(Clone)]
pub struct ControlKey(Arc<[u8]>);

impl std::fmt::Debug for ControlKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ControlKey(<redacted>)")
    }
}

impl ControlKey {
    /// The key in `control.key_file`: its first line without the
    /// whitespace around it, used as the bytes it is (hex from `openssl rand
    /// -hex 32` is 64 bytes of key, not 32 decoded), so a shell script can
    /// sign with `openssl dgst -hmac "$(head -n1 FILE)"`.
    pub fn read(path: &Path) -> Result<ControlKey, KeyError> {
        let text =
            std::fs::read(path).map_err(|source| KeyError::Read { path: path.to_path_buf(), source })?;
        let line = text.split(|&b| b == b'\n').next().unwrap_or_default().trim_ascii();
        ControlKey::new(line).ok_or(KeyError::Short { path: path.to_path_buf(), len: line.len() })
    }

    /// `None` when shorter than `MIN_KEY_BYTES`.
    pub fn new(secret: &[u8]) -> Option<ControlKey> {
        (secret.len() >= MIN_KEY_BYTES).then(|| ControlKey(secret.into()))
    }

    fn mac(&self) -> Hmac<Sha256> {
        Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length")
    }
}

/// A control command as it travels: the fields the node acts on, when it
/// was issued and the signature over both. An absent field and an empty
/// one sign the same, and mean the same (`normalized`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ControlCommand {
    /// Applied once per id (`status` excepted); required for the others.
    #[serde(default)]
    pub id: String,
    /// `status`, `promote`, `rollback` or `rollout`.
    pub command: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gates: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
    /// `rollout` of a config candidate: the file, hex-encoded (a signed
    /// field cannot carry its line breaks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_hex: Option<String>,
    /// Seconds since the Unix epoch when it was signed; 0 when absent.
    #[serde(default)]
    pub issued_at_s: u64,
    /// Lowercase hex of HMAC-SHA256(key, `canonical(topic)`).
    #[serde(default)]
    pub signature: String,
}

/// A field the canonical string cannot carry: its lines are `name=value`,
/// so a value with a line break could pass for other fields.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field} has a line break (CR or LF), which a signed control command cannot carry")]
pub struct Unsignable {
    pub field: &'static str,
}

/// Why the node does not act on a command.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// The command is not one the signature could cover (`invalid_payload`).
    Malformed(String),
    /// Not signed with the node's key for this topic, or out of the window
    /// (`unauthorized`).
    Unauthorized(String),
}

impl ControlCommand {
    /// The exact bytes the signature covers: `SCHEME`, then one line
    /// `name=value` per field in this order, each ending in `\n`, an absent
    /// field with an empty value. `topic` is where the command is published
    /// (`PREFIX/NODE/control`).
    pub fn canonical(&self, topic: &str) -> Result<String, Unsignable> {
        let or_empty = |v: &Option<String>| v.clone().unwrap_or_default();
        let fields = [
            ("topic", topic.to_string()),
            ("id", self.id.clone()),
            ("issued_at_s", self.issued_at_s.to_string()),
            ("command", self.command.clone()),
            ("model", or_empty(&self.model)),
            ("version", or_empty(&self.version)),
            ("mode", or_empty(&self.mode)),
            ("steps", or_empty(&self.steps)),
            ("gates", or_empty(&self.gates)),
            ("reply_to", or_empty(&self.reply_to)),
        ];
        let mut text = format!("{SCHEME}\n");
        // Signed only when present, so a command from before it signs as it did.
        let config = self.config_hex.clone().filter(|c| !c.is_empty()).map(|c| ("config_hex", c));
        for (field, value) in fields.into_iter().chain(config) {
            if value.contains(['\n', '\r']) {
                return Err(Unsignable { field });
            }
            text.push_str(&format!("{field}={value}\n"));
        }
        Ok(text)
    }

    /// The command with `issued_at_s` set to `now_s` and its signature for
    /// `topic`.
    pub fn signed(mut self, key: &ControlKey, topic: &str, now_s: u64) -> Result<ControlCommand, Unsignable> {
        self.issued_at_s = now_s;
        let mut mac = key.mac();
        mac.update(self.canonical(topic)?.as_bytes());
        self.signature = hex::encode(mac.finalize().into_bytes());
        Ok(self)
    }

    /// Acts on nothing: checks that the command was signed with `key` for
    /// `topic` (in constant time) and issued within `max_skew_s` of `now_s`,
    /// either way.
    pub fn verify(&self, key: &ControlKey, topic: &str, now_s: u64, max_skew_s: u64) -> Result<(), Refusal> {
        let canonical = self.canonical(topic).map_err(|e| Refusal::Malformed(e.to_string()))?;
        if self.signature.is_empty() {
            return Err(Refusal::Unauthorized(
                "no signature: sign each command with the key in control.key_file (HMAC-SHA256 over its \
                 fields, docs/ROLLOUTS.md; `edgeinfer models ... --via-mqtt` does); a token \
                 is no longer taken"
                    .into(),
            ));
        }
        let wrong = || {
            Refusal::Unauthorized(format!(
                "wrong signature: sign the canonical string for topic {topic} with the key in \
                 control.key_file (docs/ROLLOUTS.md); a command signed with another key, \
                 for another node, or changed after signing is refused"
            ))
        };
        let signature = hex::decode(&self.signature).map_err(|_| wrong())?;
        let mut mac = key.mac();
        mac.update(canonical.as_bytes());
        mac.verify_slice(&signature).map_err(|_| wrong())?;
        if self.issued_at_s == 0 {
            return Err(Refusal::Unauthorized(
                "no issued_at_s: give the seconds since the Unix epoch when the command was signed".into(),
            ));
        }
        let skew = now_s.abs_diff(self.issued_at_s);
        if skew > max_skew_s {
            let side = if self.issued_at_s > now_s { "ahead of" } else { "behind" };
            return Err(Refusal::Unauthorized(format!(
                "issued_at_s {} is {skew} s {side} this node's clock (control.max_skew_s = {max_skew_s}): \
                 sign each command just before sending it, and keep the clocks of the node and the sender \
                 in sync (NTP)",
                self.issued_at_s
            )));
        }
        Ok(())
    }

    /// Empty optional fields as absent: they signed the same, so they mean
    /// the same (no `version` to promote is the newest, not a version "").
    pub fn normalized(mut self) -> ControlCommand {
        for field in [
            &mut self.model,
            &mut self.version,
            &mut self.mode,
            &mut self.steps,
            &mut self.gates,
            &mut self.reply_to,
        ] {
            if field.as_deref() == Some("") {
                *field = None;
            }
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/ROLLOUTS.md: the worked example's key, command and
    /// signature (also what `openssl dgst -sha256 -hmac` prints for it).
    const README_KEY: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    const README_TOPIC: &str = "edgeinfer/gw-01/control";
    const README_CANONICAL: &str = "edgeinfer-control-v1\ntopic=edgeinfer/gw-01/control\nid=c4\n\
        issued_at_s=1796407244\ncommand=rollback\nmodel=digits\nversion=\nmode=\nsteps=\ngates=\nreply_to=\n";
    const README_SIGNATURE: &str = "74c8ee4db84ee3eeef6f797bf1f68483cabb38c9c6251bc37a3b63edc8815dce";

    fn key() -> ControlKey {
        ControlKey::new(README_KEY.as_bytes()).unwrap()
    }

    fn rollback() -> ControlCommand {
        ControlCommand {
            id: "c4".into(),
            command: "rollback".into(),
            model: Some("digits".into()),
            ..Default::default()
        }
    }

    #[test]
    fn the_readme_worked_example_verifies() {
        let readme =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/ROLLOUTS.md")).unwrap();
        assert!(
            readme.contains(README_KEY) && readme.contains(README_SIGNATURE),
            "docs/ROLLOUTS.md lost the example"
        );
        let json = serde_json::json!({
            "id": "c4", "command": "rollback", "model": "digits",
            "issued_at_s": 1796407244, "signature": README_SIGNATURE,
        });
        let command: ControlCommand = serde_json::from_value(json).unwrap();
        assert_eq!(command.canonical(README_TOPIC).unwrap(), README_CANONICAL);
        assert_eq!(command.verify(&key(), README_TOPIC, 1796407244 + 299, 300), Ok(()));
        let signed = rollback().signed(&key(), README_TOPIC, 1796407244).unwrap();
        assert_eq!(signed.signature, README_SIGNATURE);
    }

    #[test]
    fn finding_2_a_changed_field_another_topic_or_key_or_a_stale_time_is_refused() {
        let now = 1_800_000_000;
        let signed = rollback().signed(&key(), README_TOPIC, now).unwrap();
        assert_eq!(signed.verify(&key(), README_TOPIC, now, 300), Ok(()));
        let unauthorized = |r: Result<(), Refusal>| matches!(r, Err(Refusal::Unauthorized(_)));
        let tampered = ControlCommand { model: Some("kws".into()), ..signed.clone() };
        assert!(unauthorized(tampered.verify(&key(), README_TOPIC, now, 300)));
        let later = ControlCommand { issued_at_s: now + 1, ..signed.clone() };
        assert!(unauthorized(later.verify(&key(), README_TOPIC, now, 300)));
        assert!(unauthorized(signed.verify(&key(), "edgeinfer/gw-02/control", now, 300)));
        let other = ControlKey::new(&[7; 32]).unwrap();
        assert!(unauthorized(signed.verify(&other, README_TOPIC, now, 300)));
        let Err(Refusal::Unauthorized(stale)) = signed.verify(&key(), README_TOPIC, now + 301, 300) else {
            panic!("a command 301 s old verified")
        };
        assert!(stale.contains("301 s behind") && stale.contains("control.max_skew_s = 300"), "{stale}");
        let Err(Refusal::Unauthorized(early)) = signed.verify(&key(), README_TOPIC, now - 400, 300) else {
            panic!("a command 400 s ahead verified")
        };
        assert!(early.contains("400 s ahead of"), "{early}");
        let unsigned = ControlCommand { signature: String::new(), ..signed.clone() };
        assert!(unauthorized(unsigned.verify(&key(), README_TOPIC, now, 300)));
        let junk = ControlCommand { signature: "zz".into(), ..signed };
        assert!(unauthorized(junk.verify(&key(), README_TOPIC, now, 300)));
    }

    #[test]
    fn a_config_candidate_is_signed_only_when_present_and_cannot_be_swapped() {
        let now = 1_800_000_000;
        // A command without one signs as it did before the field existed.
        let plain = rollback().canonical(README_TOPIC).unwrap();
        assert!(!plain.contains("config_hex"), "{plain}");
        let config = Some(hex::encode("threshold = 1.0\n"));
        let rollout = ControlCommand { command: "rollout".into(), config_hex: config, ..rollback() };
        let signed = rollout.signed(&key(), README_TOPIC, now).unwrap();
        assert_eq!(signed.verify(&key(), README_TOPIC, now, 300), Ok(()));
        let unauthorized = |r: Result<(), Refusal>| matches!(r, Err(Refusal::Unauthorized(_)));
        let swapped = ControlCommand { config_hex: Some(hex::encode("threshold = 0.0\n")), ..signed.clone() };
        assert!(unauthorized(swapped.verify(&key(), README_TOPIC, now, 300)));
        let stripped = ControlCommand { config_hex: None, ..signed };
        assert!(unauthorized(stripped.verify(&key(), README_TOPIC, now, 300)));
    }

    #[test]
    fn a_line_break_in_a_field_is_refused_so_no_field_can_pass_for_another() {
        // "digits\nversion=9" would otherwise sign like model digits, version 9.
        let sneaky = ControlCommand { model: Some("digits\nversion=9".into()), ..rollback() };
        assert_eq!(sneaky.canonical(README_TOPIC), Err(Unsignable { field: "model" }));
        assert!(matches!(sneaky.verify(&key(), README_TOPIC, 0, 300), Err(Refusal::Malformed(_))));
    }

    #[test]
    fn the_key_file_holds_at_least_32_bytes_on_its_first_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.key");
        std::fs::write(&path, "short-key\n").unwrap();
        let err = ControlKey::read(&path).unwrap_err().to_string();
        assert!(
            err.contains("control.key_file") && err.contains("9 bytes") && err.contains("at least 32"),
            "{err}"
        );
        std::fs::write(&path, format!("  {README_KEY}  \nignored\n")).unwrap();
        let read = ControlKey::read(&path).unwrap();
        let signed = rollback().signed(&read, README_TOPIC, 1796407244).unwrap();
        assert_eq!(signed.signature, README_SIGNATURE);
        assert_eq!(format!("{read:?}"), "ControlKey(<redacted>)");
        let missing = ControlKey::read(&dir.path().join("nope")).unwrap_err().to_string();
        assert!(missing.contains("cannot read"), "{missing}");
    }

    #[test]
    fn empty_fields_are_absent_fields() {
        let command = ControlCommand { version: Some(String::new()), ..rollback() }.normalized();
        assert_eq!(command.version, None);
    }
}
