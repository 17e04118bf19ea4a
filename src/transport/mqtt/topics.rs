//! The contract's topic names.

#[derive(Debug, Clone)]
pub struct Topics {
    prefix: String,
    node: String,
    group: String,
}

impl Topics {
    pub fn new(prefix: &str, node: &str, group: &str) -> Topics {
        Topics { prefix: prefix.into(), node: node.into(), group: group.into() }
    }

    /// Requests addressed to this node.
    pub fn node_requests(&self) -> String {
        format!("{}/{}/infer/+", self.prefix, self.node)
    }

    /// Requests any node of the share group may take.
    pub fn shared_requests(&self) -> String {
        format!("$share/{}/{}/infer/+", self.group, self.prefix)
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
}
