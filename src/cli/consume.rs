//! `turnstile consume`: one replica with its HTTP endpoints, until SIGTERM or Ctrl-C.

use std::process::ExitCode;

use turnstile_ops::serve::{ServeArgs, Served};

/// Runs `turnstile consume`.
pub async fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let replica = Served::start(args, super::shutdown_on_signal()).await?;
    replica.wait().await?;
    Ok(ExitCode::SUCCESS)
}
