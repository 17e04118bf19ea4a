//! `edgeinfer serve`: load the models, start the node, run it until
//! SIGTERM or SIGINT.

use anyhow::{Context, Result};
use edgeinfer::config::Config;
use edgeinfer::lifecycle::{self, ReloadSource};
use edgeinfer::node::Node;

pub fn run(config: Config, reload: ReloadSource) -> Result<i32> {
    let registry = super::load_models(&config, true, true)?;
    registry.plan_rest_in_background();
    // The blocking pool only runs reloads: a few threads, so the node's
    // task count stays what `lifecycle::tasks_needed` says.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.runtime.io_threads)
        .max_blocking_threads(lifecycle::BLOCKING_THREADS)
        .enable_all()
        .build()?;
    rt.block_on(async {
        // Before anything else, so an early SIGTERM still drains cleanly.
        let signals = lifecycle::signals().context("installing signal handlers")?;
        lifecycle::check_limits(&config, &registry);
        let node = Node::start(config, registry, reload).await?;
        node.run(signals).await;
        Ok(0)
    })
}
