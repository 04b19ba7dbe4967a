//! The `turnstile` binary: parses the command line and runs it (see [`cli`]).

mod cli;

/// mimalloc instead of the system allocator: a replica allocates per message in many tasks
/// across threads, where glibc's malloc spent about a fifth of the process's time (see
/// BENCHMARKS.md, "Allocator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    cli::quiet_when_stdout_closes();
    let cli = cli::parse();
    turnstile_core::telemetry::init();
    match cli::run(cli).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!(
                "turnstile: {}",
                turnstile_core::telemetry::error_chain(&error)
            );
            std::process::ExitCode::FAILURE
        }
    }
}
