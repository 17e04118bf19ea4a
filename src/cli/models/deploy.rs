//! `edgeinfer models status|promote|rollback|rollout`: which version of a model
//! serves, through the running node's admin routes, or on the deployment
//! state file when no node runs (the node reads it at start), or as signed
//! commands on a node's control topic (`--via-mqtt`).

use anyhow::Result;
use clap::Args;
use edgeinfer::admin::{self, Change, Source, ViaMqtt};
use edgeinfer::config::Config;
use edgeinfer::rollout::{Decision, ModelReport};

#[derive(Args)]
pub struct Target {
    /// The node's HTTP address; default: http://<http.listen>.
    #[arg(long, conflicts_with = "via_mqtt")]
    pub url: Option<String>,
    /// Send it over MQTT instead of HTTP: a command signed with the key in
    /// control.key_file of --config (HMAC-SHA256; the key never travels),
    /// published on the node's PREFIX/NODE/control through the broker at
    /// mqtt.url (with mqtt.username, the password and TLS of --config). The
    /// node needs control.enabled and the same key; its answer is waited
    /// for 10 s.
    #[arg(long)]
    pub via_mqtt: bool,
    /// With --via-mqtt: the node's id (NODE in its topics); default node.id.
    #[arg(long, requires = "via_mqtt", value_name = "ID")]
    pub node: Option<String>,
    /// With --via-mqtt: the command's id; default a new one. After an
    /// `overloaded` answer, send the command again with the same id: the
    /// node applies it once.
    #[arg(long, requires = "via_mqtt", value_name = "ID")]
    pub id: Option<String>,
    /// With --via-mqtt: the topic the node answers on, one the broker lets
    /// this client subscribe to and the node's mqtt.reply_prefixes admit;
    /// default REPLY_PREFIX/CLIENT_ID/replies, REPLY_PREFIX the first of
    /// mqtt.reply_prefixes, else edgeinfer-ctl.
    #[arg(long, requires = "via_mqtt", value_name = "TOPIC")]
    pub reply_topic: Option<String>,
    /// Print the answer as JSON.
    #[arg(long)]
    pub json: bool,
}

impl Target {
    fn via_mqtt(&self) -> Option<ViaMqtt> {
        self.via_mqtt.then(|| ViaMqtt {
            node: self.node.clone(),
            id: self.id.clone(),
            reply_topic: self.reply_topic.clone(),
        })
    }
}

/// The deployments `target` names (the running node over HTTP or, with
/// `--via-mqtt`, its control topic; else the state on disk), of every
/// model or of `model`, and where they came from.
pub fn reports(config: &Config, target: &Target, model: Option<&str>) -> Result<(Vec<ModelReport>, Source)> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    Ok(match target.via_mqtt() {
        Some(via) => rt.block_on(admin::models_status_via_mqtt(config, &via, model))?,
        None => rt.block_on(admin::models_status(config, target.url.as_deref(), model))?,
    })
}

pub fn status(config: &Config, model: Option<String>, target: Target) -> Result<i32> {
    let (report, source) = reports(config, &target, model.as_deref())?;
    if target.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(0);
    }
    println!("deployments of the {source}");
    println!("{:<16} {:<8} {:<8} {:<9} VERSIONS", "MODEL", "SERVING", "STABLE", "ROLLBACK");
    for m in &report {
        print_model(m);
    }
    Ok(0)
}

fn print_model(m: &ModelReport) {
    let or_dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    let stable = m.stable.clone().unwrap_or_else(|| "newest".into());
    println!(
        "{:<16} {:<8} {:<8} {:<9} {}",
        m.model,
        m.serving,
        stable,
        or_dash(&m.previous),
        m.versions.join(", ")
    );
    for r in &m.records {
        let short =
            |h: &Option<String>| h.as_deref().map_or("-".into(), |h| h[..h.len().min(12)].to_string());
        let deployed = match (&r.deployed_at_s, &r.deployed_by) {
            (Some(at), Some(by)) => format!("deployed at {at} by {by}"),
            _ => "never made stable".into(),
        };
        println!(
            "    v{:<6} model {}  manifest {}  {deployed}",
            r.version,
            short(&r.sha256),
            short(&r.manifest_sha256)
        );
    }
    if let Some(config) = &m.config {
        println!("    config {} ({})", config.version, config.source);
    }
    if let Some(c) = &m.candidate {
        let held = c.held.as_deref().map_or(String::new(), |why| format!("; held: {why}"));
        println!(
            "    rollout: {} {}, {}% of devices, step {} since {} (by {}){held}",
            c.describe(),
            c.mode.as_str(),
            c.share(),
            c.step + 1,
            c.step_started_s,
            c.by
        );
    }
    if let Some(t) = &m.trial {
        let p99 = |v: Option<f64>| v.map_or("-".into(), |ms| format!("{ms:.2} ms"));
        for (name, f) in [("stable", &t.stable), ("candidate", &t.candidate)] {
            println!("      {name:<9} {} answers, {} errors, p99 {}", f.answers, f.errors, p99(f.p99_ms));
        }
        for g in &t.gates {
            let figure = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.4}"));
            println!(
                "      gate {:<10} {:<12} candidate {} stable {} ({} of {} samples; allowed {})",
                g.gate,
                g.result.as_str(),
                figure(g.candidate),
                figure(g.stable),
                g.samples,
                g.needed,
                g.limit
            );
        }
    }
    for q in &m.field_quality {
        let accuracy = q.accuracy().map_or("-".into(), |a| format!("{a:.4}"));
        let mean = q.mean_outcome().map_or("-".into(), |o| format!("{o:.4}"));
        let config = q.config.as_deref().map_or(String::new(), |c| format!(" config {c}"));
        println!(
            "    field v{}{config}: {} answers; accuracy {accuracy} ({} labels), mean outcome {mean} ({} outcomes)",
            q.version, q.answers, q.figures.labels, q.figures.outcomes
        );
    }
    for d in m.history.iter().rev().take(5) {
        println!("    {}", describe(d));
    }
}

fn describe(d: &Decision) -> String {
    let action = d.action.as_str();
    let (from, to) = match &d.config {
        // A config change: the model version stays; the config moves.
        Some(c) => {
            let name = |v: &Option<String>| format!("config {}", v.as_deref().unwrap_or("of the node"));
            (name(&c.from), name(&c.to))
        }
        None => (format!("v{}", d.from), format!("v{}", d.version)),
    };
    format!("{} {from} -> {to}: {action} at {} by {} ({})", d.model, d.at_s, d.by, d.reason)
}

pub fn change(config: &Config, change: Change, target: Target) -> Result<i32> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (decision, source) = match target.via_mqtt() {
        Some(via) => rt.block_on(admin::models_change_via_mqtt(config, &via, &change))?,
        None => rt.block_on(admin::models_change(config, target.url.as_deref(), &change))?,
    };
    if target.json {
        println!("{}", serde_json::to_string_pretty(&decision)?);
    } else {
        println!("{} (the {source})", describe(&decision));
    }
    Ok(0)
}
