//! One rollout per site (`site.rollout`): what each node's owner thread
//! exchanges with the site through its site link (an MQTT connection of its
//! own, `transport::mqtt::site`). The site's deployment of each model is a
//! retained message every node reads and adopts when it is newer (`seq`);
//! the node with the smallest id among those online judges, on the step's
//! figures of every node pooled; every node routes a device by the same
//! hash and step, so a device sees one version across the site.

use super::gates::{Window, WindowWire};
use super::state::Deployment;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// From the site to this node's owner thread.
#[derive(Debug)]
pub enum SiteIn {
    /// The site's deployment of `model` (its retained message).
    State { model: String, deployment: Box<Deployment> },
    /// Another node's figures of `model`'s step.
    Figures { node: String, model: String, figures: Box<StepFigures> },
    /// Whether this node judges the site's rollouts now.
    Judge(bool),
    /// Whether this node reads the site's state: connected, subscribed, and
    /// the retained messages in. Until then it serves stable alone.
    Synced(bool),
}

/// From this node's owner thread to the site.
#[derive(Debug)]
pub enum SiteOut {
    /// A decision taken here: the model's deployment after it.
    State { model: String, deployment: Box<Deployment> },
    /// This node's figures of a running step, once a second.
    Figures { model: String, figures: Box<StepFigures> },
}

/// One node's figures of one step, cumulative since the step began.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepFigures {
    pub step_id: u64,
    pub window: WindowWire,
}

/// Nodes whose figures the judge keeps per model; beyond it a new node's
/// are dropped (a site is a handful of gateways, not thousands).
const MAX_NODES: usize = 64;

/// The latest figures each other node sent, per model.
#[derive(Default)]
pub struct Pooled {
    by_model: HashMap<String, HashMap<String, StepFigures>>,
}

impl Pooled {
    pub fn insert(&mut self, node: String, model: String, figures: StepFigures) {
        let nodes = self.by_model.entry(model).or_default();
        if nodes.len() < MAX_NODES || nodes.contains_key(&node) {
            nodes.insert(node, figures);
        }
    }

    /// `own` (this node's figures, as sent) with the other nodes' figures
    /// of the same step added.
    pub fn pooled(&self, model: &str, step_id: u64, own: &WindowWire) -> Window {
        let mut window = Window::default();
        window.add_wire(own);
        let others = self.by_model.get(model).into_iter().flat_map(|nodes| nodes.values());
        for figures in others.filter(|f| f.step_id == step_id) {
            window.add_wire(&figures.window);
        }
        window
    }

    /// How many other nodes sent figures of `model`'s step `step_id`.
    pub fn nodes(&self, model: &str, step_id: u64) -> usize {
        self.by_model.get(model).map_or(0, |n| n.values().filter(|f| f.step_id == step_id).count())
    }
}

/// Whether `incoming`, the site's deployment, replaces `local`: a newer
/// `seq`, or the same one with other content from a decision taken
/// elsewhere at the same time (the later `at_s`, then the larger history
/// wins, so every node settles on the same one).
pub fn newer(incoming: &Deployment, local: Option<&Deployment>) -> bool {
    let Some(local) = local else { return true };
    let last = |d: &Deployment| d.history.last().map_or(0, |h| h.at_s);
    match incoming.seq.cmp(&local.seq) {
        std::cmp::Ordering::Greater => true,
        std::cmp::Ordering::Less => false,
        std::cmp::Ordering::Equal => {
            incoming != local && (last(incoming), incoming.history.len()) > (last(local), local.history.len())
        }
    }
}

/// The node that judges: the smallest id among the members online.
pub fn judge<'a>(members: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    members.into_iter().min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_deployment_wins_on_every_node_alike() {
        let at = |seq: u64, stable: &str| Deployment { seq, stable: stable.into(), ..Deployment::default() };
        assert!(newer(&at(2, "1"), Some(&at(1, "1"))));
        assert!(!newer(&at(1, "2"), Some(&at(2, "1"))), "an older seq never wins");
        assert!(newer(&at(1, "1"), None));
        assert!(!newer(&at(3, "1"), Some(&at(3, "1"))), "the same: nothing to adopt");
        assert_eq!(judge(["gw-b", "gw-a", "gw-c"]), Some("gw-a"));
        assert_eq!(judge(Vec::<&str>::new()), None);
    }
}
