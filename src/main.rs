use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = turnstile::cli::Cli::parse();
    turnstile::telemetry::init();
    match turnstile::cli::run(cli).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("turnstile: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
