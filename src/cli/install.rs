//! What an installer puts beside the binary: shell completions and man pages,
//! written from the same clap definitions as `--help`, so they describe the
//! binary they came from. The Debian package (packaging/deb/build.sh) runs
//! both; a tarball install can too.

use anyhow::{Context, Result};
use clap::{Args, CommandFactory};
use std::path::PathBuf;

#[derive(Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Args)]
pub struct ManpagesArgs {
    /// Directory to write the pages into (created if missing).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
}

/// Writes the completion script for `args.shell` to standard output.
pub fn completions(args: CompletionsArgs) -> Result<i32> {
    let mut command = super::Cli::command();
    clap_complete::generate(args.shell, &mut command, "edgeinfer", &mut std::io::stdout());
    Ok(0)
}

/// Writes edgeinfer.1 and a page per subcommand (edgeinfer-models-verify.1,
/// ...) into `args.dir` (clap names a subcommand's page after its full
/// command line), and lists the files on standard output.
pub fn manpages(args: ManpagesArgs) -> Result<i32> {
    let dir = &args.dir;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    clap_mangen::generate_to(super::Cli::command(), dir)
        .with_context(|| format!("writing man pages into {}", dir.display()))?;
    let mut pages: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        // DIR may be a shared man1 directory: name only the pages written here.
        .filter(|path| {
            path.extension().is_some_and(|ext| ext == "1")
                && path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("edgeinfer"))
        })
        .collect();
    pages.sort();
    for page in pages {
        println!("{}", page.display());
    }
    Ok(0)
}
