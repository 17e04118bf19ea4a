//! The contract's topic names.

#[derive(Debug, Clone)]
pub struct Topics {
    prefix: String,
    node: String,
    group: String,
    /// `mqtt.reply_prefixes`: where replies may go; empty: anywhere else.
    reply_prefixes: Vec<String>,
}

/// Why a request's reply topic is refused: it gets no publish at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyRefusal {
    /// Empty, too long, or with a wildcard: no broker takes it.
    Invalid,
    /// A `$` topic (`$SYS/...`): the broker's own.
    System,
    /// Under `mqtt.topic_prefix`: the fleet's request, status and stats
    /// topics, which a device must not make a node publish to.
    Reserved,
    /// Outside every `mqtt.reply_prefixes` entry.
    NotAllowed,
}

impl ReplyRefusal {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ReplyRefusal::Invalid => "invalid",
            ReplyRefusal::System => "system",
            ReplyRefusal::Reserved => "reserved",
            ReplyRefusal::NotAllowed => "not_allowed",
        }
    }
}

impl Topics {
    pub fn new(prefix: &str, node: &str, group: &str) -> Topics {
        Topics { prefix: prefix.into(), node: node.into(), group: group.into(), reply_prefixes: Vec::new() }
    }

    /// Replies go only under these topic levels (`devices` admits
    /// `devices/cam-3/replies`).
    pub fn with_reply_prefixes(mut self, prefixes: &[String]) -> Topics {
        self.reply_prefixes = prefixes.iter().map(|p| p.trim_end_matches('/').to_string()).collect();
        self
    }

    /// Whether a reply may be published to `topic`.
    pub fn check_reply(&self, topic: &str) -> Result<(), ReplyRefusal> {
        let under = |prefix: &str| {
            topic.strip_prefix(prefix).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        };
        if !valid_reply_topic(topic) {
            Err(ReplyRefusal::Invalid)
        } else if topic.starts_with('$') {
            Err(ReplyRefusal::System)
        } else if under(&self.prefix) {
            Err(ReplyRefusal::Reserved)
        } else if !self.reply_prefixes.is_empty() && !self.reply_prefixes.iter().any(|p| under(p)) {
            Err(ReplyRefusal::NotAllowed)
        } else {
            Ok(())
        }
    }

    /// Requests addressed to this node.
    pub fn node_requests(&self) -> String {
        format!("{}/{}/infer/+", self.prefix, self.node)
    }

    /// Whether `topic` is a request on this node's own topic
    /// (`PREFIX/NODE/infer/MODEL`), not the share group's.
    pub fn is_node_request(&self, topic: &[u8]) -> bool {
        let rest = topic.strip_prefix(self.prefix.as_bytes()).and_then(|r| r.strip_prefix(b"/"));
        rest.and_then(|r| r.strip_prefix(self.node.as_bytes())).is_some_and(|r| r.starts_with(b"/infer/"))
    }

    /// Requests any node of the share group may take.
    pub fn shared_requests(&self) -> String {
        format!("$share/{}/{}/infer/+", self.group, self.prefix)
    }

    /// One message per rollout decision.
    pub fn events(&self) -> String {
        format!("{}/{}/events", self.prefix, self.node)
    }

    /// Rollout commands, when `control.enabled`.
    pub fn control(&self) -> String {
        format!("{}/{}/control", self.prefix, self.node)
    }

    /// Feedback about this node's answers.
    pub fn feedback(&self) -> String {
        format!("{}/{}/feedback", self.prefix, self.node)
    }

    /// Feedback any node of the site may hold the answer for: every node
    /// subscribes (not as a share group), the one that answered joins it.
    pub fn site_feedback(&self) -> String {
        format!("{}/feedback", self.prefix)
    }

    /// Where feedback on `topic` is addressed, when it is feedback.
    pub fn feedback_of(&self, topic: &[u8]) -> Option<crate::engine::feedback::Addressed> {
        use crate::engine::feedback::Addressed;
        // Asked of every publish: no allocation.
        let rest = topic.strip_prefix(self.prefix.as_bytes())?.strip_prefix(b"/")?;
        if rest == b"feedback" {
            return Some(Addressed::Site);
        }
        let own = rest.strip_prefix(self.node.as_bytes())?.strip_prefix(b"/")?;
        (own == b"feedback").then_some(Addressed::Node)
    }

    pub fn status(&self) -> String {
        format!("{}/{}/status", self.prefix, self.node)
    }

    pub fn stats(&self) -> String {
        format!("{}/{}/stats", self.prefix, self.node)
    }

    /// The model a request topic names: `PREFIX/NODE/infer/MODEL` or
    /// `PREFIX/infer/MODEL` (shared subscriptions deliver the original topic).
    pub fn model_of<'a>(&self, topic: &'a str) -> Option<&'a str> {
        let rest = topic.strip_prefix(self.prefix.as_str())?.strip_prefix('/')?;
        let rest = match rest.strip_prefix(self.node.as_str()).and_then(|r| r.strip_prefix('/')) {
            Some(r) => r,
            None => rest,
        };
        rest.strip_prefix("infer/")
    }
}

/// A topic a reply may be published to: MQTT forbids wildcards in topic
/// names, and a broker disconnects a client that publishes to one, which
/// would cost every other request in flight.
pub fn valid_reply_topic(topic: &str) -> bool {
    !topic.is_empty() && topic.len() <= 65_535 && !topic.contains(['+', '#', '\0'])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_topics_name_the_model() {
        let t = Topics::new("edgeinfer", "gw-01", "edgeinfer");
        assert_eq!(t.model_of("edgeinfer/gw-01/infer/digits"), Some("digits"));
        assert_eq!(t.model_of("edgeinfer/infer/digits-large"), Some("digits-large"));
        assert_eq!(t.model_of("edgeinfer/gw-01/infer/.."), Some(".."));
        assert_eq!(t.model_of("other/gw-01/infer/digits"), None);
        assert_eq!(t.shared_requests(), "$share/edgeinfer/edgeinfer/infer/+");
        assert!(!valid_reply_topic("devices/+/x") && !valid_reply_topic("") && valid_reply_topic("a/b"));
    }

    #[test]
    fn replies_never_go_to_system_or_fleet_topics_and_stay_in_the_allowed_prefixes() {
        let open = Topics::new("edgeinfer", "gw-01", "edgeinfer");
        assert_eq!(open.check_reply("devices/cam-3/replies"), Ok(()));
        assert_eq!(open.check_reply("edgeinfer-bench/x/replies"), Ok(()), "a longer first level is not ours");
        assert_eq!(open.check_reply("$SYS/broker/x"), Err(ReplyRefusal::System));
        assert_eq!(open.check_reply("edgeinfer/gw-01/status"), Err(ReplyRefusal::Reserved));
        assert_eq!(open.check_reply("edgeinfer/infer/digits"), Err(ReplyRefusal::Reserved));
        assert_eq!(open.check_reply("edgeinfer"), Err(ReplyRefusal::Reserved));
        assert_eq!(open.check_reply("devices/#"), Err(ReplyRefusal::Invalid));
        let closed = open.with_reply_prefixes(&["devices/".into(), "plc".into()]);
        assert_eq!(closed.check_reply("devices/cam-3/replies"), Ok(()));
        assert_eq!(closed.check_reply("plc"), Ok(()));
        assert_eq!(closed.check_reply("devicesx/cam"), Err(ReplyRefusal::NotAllowed));
        assert_eq!(closed.check_reply("other/cam"), Err(ReplyRefusal::NotAllowed));
    }
}
