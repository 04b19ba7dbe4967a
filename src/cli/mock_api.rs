//! `turnstile mock-api`: the lab's strict stand-in for the registration API, until SIGTERM or
//! Ctrl-C.

use std::process::ExitCode;

use turnstile_lab::mock_api::{MockArgs, MockServer};

/// Runs `turnstile mock-api`.
pub async fn run(args: MockArgs) -> anyhow::Result<ExitCode> {
    let server = MockServer::start(args, super::shutdown_on_signal()).await?;
    println!("mock registration API on {}", server.url());
    server.wait().await?;
    Ok(ExitCode::SUCCESS)
}
