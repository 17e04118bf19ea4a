//! `PREFIX/NODE/control` (`control.enabled`, off by default): the rollout
//! commands for fleet managers without HTTP, request/response like
//! inference. A command is JSON: `id`, `token` (the one in
//! `control.token_file`), `command` (`status`, `promote`, `rollback`,
//! `rollout`), `model`, for promote and rollout `version`, and for rollout
//! optionally `mode`, `steps` and `gates` as `models rollout` takes them;
//! its reply (to the MQTT 5 Response
//! Topic or the payload's `reply_to`) is `{"id", "result"}` or
//! `{"id", "error": {"code", "message"}}`.

use super::outbox::Reply;
use super::topics::Topics;
use crate::engine::Engine;
use crate::rollout::Asker;
use crate::transport::http::Token;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Publish, PublishProperties};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;

#[derive(Deserialize)]
struct Command {
    #[serde(default)]
    id: String,
    #[serde(default)]
    token: String,
    command: String,
    model: Option<String>,
    version: Option<String>,
    mode: Option<String>,
    steps: Option<String>,
    gates: Option<String>,
    reply_to: Option<String>,
}

pub struct ControlTask {
    pub engine: Arc<Engine>,
    pub topics: Topics,
    pub token: Token,
}

impl ControlTask {
    /// The reply to one command, or `None` when it names nowhere a reply
    /// may go (dropped, like such a request).
    /// `admitted`: false when the node is at its in-flight bound.
    pub async fn handle(self, publish: &Publish, admitted: bool) -> Option<Reply> {
        let props = publish.properties.clone().unwrap_or_default();
        let parsed = serde_json::from_slice::<Command>(&publish.payload);
        let reply_to = parsed.as_ref().ok().and_then(|c| c.reply_to.clone());
        let destination = props.response_topic.clone().or(reply_to)?;
        self.topics.check_reply(&destination).ok()?;
        let (id, answer) = match parsed {
            Err(e) => (
                String::new(),
                Err((
                    "invalid_payload",
                    format!("a control command is JSON with id, token, command, model, version: {e}"),
                )),
            ),
            Ok(command) if !admitted => {
                (command.id, Err(("overloaded", "the node is at mqtt.max_in_flight; retry later".into())))
            }
            Ok(command) => {
                let id = command.id.clone();
                (id, self.run(command).await)
            }
        };
        let body = match answer {
            Ok(result) => json!({"id": id, "result": result}),
            Err((code, message)) => {
                tracing::warn!(id = %id, "control command refused: {message}");
                json!({"id": id, "error": {"code": code, "message": message}})
            }
        };
        let reply_props = PublishProperties {
            correlation_data: props.correlation_data.clone(),
            content_type: Some("application/json".into()),
            ..Default::default()
        };
        let publish = Publish::new(destination, QoS::AtLeastOnce, body.to_string(), Some(reply_props));
        Some(Reply { publish, id })
    }

    async fn run(&self, command: Command) -> Result<Value, (&'static str, String)> {
        if Token::of(&command.token) != self.token {
            return Err((
                "unauthorized",
                "missing or wrong token: send the one in control.token_file".into(),
            ));
        }
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
                match self.engine.rollout_plan(
                    command.version.as_deref(),
                    command.mode.as_deref(),
                    &model,
                    overrides,
                ) {
                    Ok(plan) => rollout.start_rollout(&model, plan, available, by).await.map(|d| json!(d)),
                    Err(e) => Err(e),
                }
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
