//! The `edgeinfer` command line: parse the arguments, load the config and
//! hand over to the command. Each command lives in `src/cli/`; the serving
//! node is the library's `node` module.

mod cli;

use clap::Parser;
use cli::{Cli, Command};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    // Test builds only: reads the fail points to arm from FAILPOINTS.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let cli = Cli::parse();
    cli::init_logging(&cli.log, cli.log_format == "json");
    match dispatch(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}

/// Runs the command; its exit code, or the error to print.
fn dispatch(cli: Cli) -> anyhow::Result<i32> {
    let reload = cli.reload_source();
    // Loaded per command: `config check` reports a config that does not load.
    let config = || reload.load();
    match cli.command {
        Command::Serve => cli::serve::run(config()?, reload.clone()),
        Command::Infer(args) => cli::infer::run(&config()?, args),
        Command::Bench(args) => cli::bench::run(&config()?, args),
        Command::Models { command } => cli::models::run(&config()?, command),
        Command::Cache { command } => cli::cache::run(&config()?, command),
        Command::Config { command } => cli::config::run(&reload, command),
        Command::Doctor(args) => cli::doctor::run(&reload, args),
        Command::Completions(args) => cli::install::completions(args),
        Command::Manpages(args) => cli::install::manpages(args),
    }
}
