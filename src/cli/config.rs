//! `edgeinfer config check|print|reference`: the config as `serve` reads
//! it, before a node is started with it.

use anyhow::Result;
use clap::Subcommand;
use edgeinfer::config::{self, Config};
use edgeinfer::lifecycle::ReloadSource;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Check a config file the way `serve` reads it (with the
    /// EDGEINFER_<SECTION>__<KEY> environment overrides) and report every
    /// mistake at once, each with the key, the bad value and what is
    /// allowed. Exits 0 when the config is valid, 1 when it is not. Files
    /// the config names (keys, certificates) are checked by `serve` when it
    /// starts.
    Check {
        /// The config file; default: --config's (without one: the
        /// defaults and the environment).
        file: Option<PathBuf>,
    },
    /// Print the config in effect as TOML: the file, the environment
    /// overrides and every default, secrets shown as "<redacted>".
    Print,
    /// Print the reference of every key (Markdown: type, default, whether a
    /// reload applies it, what it does), generated from the code;
    /// docs/CONFIG.md is this output.
    Reference,
}

pub fn run(source: &ReloadSource, command: ConfigCommand) -> Result<i32> {
    match command {
        ConfigCommand::Check { file } => Ok(check(file.or_else(|| source.config_file.clone()), source)),
        ConfigCommand::Print => {
            let config = source.load()?;
            let mut shown = toml::Value::try_from(&config)?;
            // Every default, the rollout keys a deployment writes only when
            // set included.
            for (name, model) in &config.models {
                shown["models"][name.as_str()]["rollout"] = toml::Value::Table(model.rollout.as_table());
            }
            print!("{}", toml::to_string(&shown)?);
            Ok(0)
        }
        ConfigCommand::Reference => {
            print!("{}", config::reference::markdown());
            Ok(0)
        }
    }
}

fn check(file: Option<PathBuf>, source: &ReloadSource) -> i32 {
    let name = file.as_ref().map(|f| f.display().to_string()).unwrap_or_else(|| "(defaults)".into());
    let source = ReloadSource { config_file: file, models_dir: source.models_dir.clone() };
    match source.load() {
        Ok(config) => {
            println!("{name}: ok ({})", summary(&config));
            0
        }
        Err(e) => {
            let problems = e.problems();
            let s = if problems.len() == 1 { "" } else { "s" };
            println!("{name}: {} mistake{s}", problems.len());
            for (key, message) in problems {
                match key.is_empty() {
                    true => println!("  {message}"),
                    false => println!("  {key}: {message}"),
                }
            }
            1
        }
    }
}

/// What the node would do with it, in a line.
fn summary(config: &Config) -> String {
    let broker = if config.mqtt.embedded_broker { "embedded broker on" } else { "broker" };
    let cache = if config.cache.enabled { "cache on" } else { "cache off" };
    let cloud = if config.cloud.enabled { "cloud tier on" } else { "cloud tier off" };
    format!(
        "node {}, {broker} {}, {cache}, {cloud}, {} model section{}",
        config.node.id,
        config.mqtt.url,
        config.models.len(),
        if config.models.len() == 1 { "" } else { "s" }
    )
}
