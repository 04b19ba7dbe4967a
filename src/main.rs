//! The `turnstile` binary: parses the command line and runs it (see [`cli`]).

mod cli;

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    turnstile_core::telemetry::init();
    match cli::run(cli).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("turnstile: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
