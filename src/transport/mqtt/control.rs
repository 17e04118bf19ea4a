//! `PREFIX/NODE/control` (`control.enabled`, off by default): the rollout
//! commands for fleet managers without HTTP, request/response like
//! inference. A command is JSON: `id`, `command` (`status`, `promote`,
//! `rollback`, `rollout`), `model`, for promote and rollout `version`, for
//! rollout optionally `mode`, `steps` and `gates` as `models rollout` takes
//! them, `issued_at_s` and `signature` (`signed.rs`: HMAC-SHA256 with the
//! key in `control.key_file`; no secret travels). Its reply (to the MQTT 5
//! Response Topic or the payload's `reply_to`) is `{"id", "result"}` or
//! `{"id", "error": {"code", "message"}}`.

use super::outbox::Reply;
use super::replay::{Answer, ReplayWindow};
use super::signed::{ControlCommand, ControlKey, Refusal};
use super::topics::Topics;
use crate::engine::Engine;
use crate::rollout::Asker;
use crate::telemetry::unix_now;
use rumqttc::v5::mqttbytes::v5::Publish;
use serde_json::json;
use std::sync::Arc;

/// What a node checks a command against: the key it must be signed with
/// and the commands it answered within `control.max_skew_s`.
#[derive(Clone)]
pub struct ControlAuth {
    pub key: ControlKey,
    pub window: Arc<ReplayWindow>,
}

impl ControlAuth {
    pub fn new(key: ControlKey, max_skew_s: u64) -> ControlAuth {
        ControlAuth { key, window: Arc::new(ReplayWindow::new(max_skew_s)) }
    }
}

pub struct ControlTask {
    pub engine: Arc<Engine>,
    pub topics: Topics,
    pub auth: ControlAuth,
}

impl ControlTask {
    /// The reply to one command, or `None` when it names nowhere a reply
    /// may go (dropped, like such a request).
    /// `admitted`: false when the node is at its in-flight bound.
    pub async fn handle(self, publish: &Publish, admitted: bool) -> Option<Reply> {
        let props = publish.properties.clone().unwrap_or_default();
        let parsed = serde_json::from_slice::<ControlCommand>(&publish.payload);
        let reply_to = parsed.as_ref().ok().and_then(|c| c.reply_to.clone());
        let destination = props.response_topic.clone().or(reply_to)?;
        self.topics.check_reply(&destination).ok()?;
        let (id, answer) = match parsed {
            Err(e) => (
                String::new(),
                Err((
                    "invalid_payload",
                    format!(
                        "a control command is JSON with id, command, model, version, mode, steps, gates, \
                         reply_to, issued_at_s and signature: {e}"
                    ),
                )),
            ),
            Ok(command) if !admitted => {
                (command.id, Err(("overloaded", "the node is at mqtt.max_in_flight; retry later".into())))
            }
            Ok(command) => {
                let id = command.id.clone();
                (id, self.checked(command).await)
            }
        };
        let body = match answer {
            Ok(result) => json!({"id": id, "result": result}),
            Err((code, message)) => {
                tracing::warn!(id = %id, "control command refused: {message}");
                json!({"id": id, "error": {"code": code, "message": message}})
            }
        };
        Some(Reply::json(destination, &props, id, &body))
    }

    /// Runs a command signed with the node's key for its topic, within the
    /// window; the same signed command again gets its first answer.
    async fn checked(&self, command: ControlCommand) -> Answer {
        let now_s = unix_now();
        let window = &self.auth.window;
        command.verify(&self.auth.key, &self.topics.control(), now_s, window.max_skew_s()).map_err(
            |refusal| match refusal {
                Refusal::Malformed(message) => ("invalid_payload", message),
                Refusal::Unauthorized(message) => ("unauthorized", message),
            },
        )?;
        let command = command.normalized();
        // Read-only: answered afresh each time.
        if command.command == "status" {
            return self.run(command).await;
        }
        let changes = matches!(command.command.as_str(), "promote" | "rollback" | "rollout");
        if changes && command.id.is_empty() {
            return Err((
                "invalid_payload",
                format!("{} needs an id: the node applies a command once per id", command.command),
            ));
        }
        let signature = command.signature.clone();
        match window.admit(&signature, command.issued_at_s, now_s) {
            Ok(Some(answer)) => {
                tracing::info!(id = %command.id, "control command seen before: answered as then");
                answer
            }
            Ok(None) => {
                let answer = self.run(command).await;
                window.settle(&signature, &answer);
                answer
            }
            Err(_) => Err((
                "overloaded",
                format!(
                    "more than {} control commands within control.max_skew_s ({} s); retry later",
                    super::replay::MAX_REMEMBERED,
                    window.max_skew_s()
                ),
            )),
        }
    }

    async fn run(&self, command: ControlCommand) -> Answer {
        let Some(rollout) = self.engine.rollout() else {
            return Err(("internal", "this process keeps no deployment state".into()));
        };
        let registry = self.engine.registry();
        let available = registry.available();
        // The id makes a redelivered command (the broker resends one whose
        // acknowledgement a restart cut off) a repeat, not a second step.
        let by = Asker {
            by: "control topic".into(),
            command_id: (!command.id.is_empty()).then(|| format!("control:{}", command.id)),
            asked: None,
        };
        let model =
            || command.model.clone().ok_or(("invalid_payload", format!("{} needs model", command.command)));
        let outcome = match command.command.as_str() {
            "status" => self.engine.models_report(command.model.as_deref()).map(|r| json!(r)),
            "promote" => {
                rollout.promote(&model()?, command.version.as_deref(), available, by).await.map(|d| json!(d))
            }
            "rollback" => rollout.rollback(&model()?, available, by).await.map(|d| json!(d)),
            "rollout" => {
                let model = model()?;
                let overrides = (command.steps.as_deref(), command.gates.as_deref());
                let config = match command.config_hex.as_deref().filter(|c| !c.is_empty()).map(hex::decode) {
                    None => None,
                    Some(Ok(bytes)) => match String::from_utf8(bytes) {
                        Ok(text) => Some(text),
                        Err(_) => {
                            return Err(("invalid_payload", "config_hex: the file is not UTF-8 text".into()));
                        }
                    },
                    Some(Err(e)) => {
                        return Err((
                            "invalid_payload",
                            format!("config_hex: {e}; send the file hex-encoded"),
                        ));
                    }
                };
                let asked = (model.as_str(), command.version.as_deref(), config.as_deref());
                // A version dropped in since the last load is loaded first.
                self.engine
                    .start_rollout(asked, command.mode.as_deref(), overrides, by)
                    .await
                    .map(|d| json!(d))
            }
            other => {
                return Err((
                    "invalid_payload",
                    format!("command {other:?}: use status, promote, rollback or rollout"),
                ));
            }
        };
        outcome.map_err(|e| (e.code(), e.to_string()))
    }
}
