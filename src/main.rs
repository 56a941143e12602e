//! The `targetlease` binary: parses the command line and runs the subcommand ([`targetlease::cli`]).

use std::process::ExitCode;

use clap::Parser;
use targetlease::cli::Cli;

#[tokio::main]
async fn main() -> ExitCode {
    Cli::parse().run().await
}
