//! `PREFIX/NODE/feedback` and `PREFIX/feedback` (`feedback.enabled`, on by
//! default): field feedback about the node's answers (`engine/feedback.rs`).
//! A message that asks for a reply (an MQTT 5 Response Topic, or the
//! payload's `reply_to`) gets one: what became of it, or the error naming
//! the field and the fix; on the site's topic only the node that joined it
//! replies (a message there that joins nowhere gets no reply: send it to
//! `PREFIX/NODE/feedback` for the error).

use super::outbox::Reply;
use super::topics::Topics;
use crate::engine::Engine;
use crate::engine::feedback::{self, Addressed, Joined};
use crate::protocol::{ErrorReply, InferError};
use rumqttc::v5::mqttbytes::v5::Publish;
use std::sync::Arc;

pub struct FeedbackTask {
    pub engine: Arc<Engine>,
    pub topics: Topics,
}

impl FeedbackTask {
    /// The reply to one message, when it asked for one.
    /// `admitted`: false when the node is at its in-flight bound.
    pub async fn handle(self, publish: &Publish, addressed: Addressed, admitted: bool) -> Option<Reply> {
        let props = publish.properties.clone().unwrap_or_default();
        let reply_to = serde_json::from_slice::<serde_json::Value>(&publish.payload)
            .ok()
            .and_then(|v| Some(v.get("reply_to")?.as_str()?.to_string()));
        let taken = match admitted {
            true => self.engine.take_feedback(&publish.payload, addressed).await,
            false => {
                Err((String::new(), InferError::overloaded("the node is at mqtt.max_in_flight; retry later")))
            }
        };
        let destination = props.response_topic.clone().or(reply_to)?;
        self.topics.check_reply(&destination).ok()?;
        let (id, body) = match taken {
            // On the site's topic every node reads the message: only the one
            // that joined it replies, or a device would get one reply a node.
            Ok((_, Joined::Unjoined { .. })) | Err(_) if addressed == Addressed::Site => return None,
            Ok((id, joined)) => {
                let body = feedback::reply_body(&id, &joined);
                (id, body)
            }
            Err((id, err)) => {
                tracing::debug!(id = %id, "feedback refused: {}", err.message);
                let body = serde_json::to_value(ErrorReply::new(id.clone(), &err)).unwrap_or_default();
                (id, body)
            }
        };
        Some(Reply::json(destination, &props, id, &body))
    }
}
