//! `turnstile completions`: the shell completion script of this command line, on stdout.

use std::process::ExitCode;

/// `turnstile completions`: which shell's script to print.
#[derive(clap::Args, Debug)]
pub struct CompletionsArgs {
    /// The shell to complete in.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// Runs `turnstile completions` for `cmd` (the whole command line).
pub fn run(args: CompletionsArgs, cmd: &mut clap::Command) -> anyhow::Result<ExitCode> {
    let mut out = Vec::new();
    script(args.shell, cmd, &mut out);
    use std::io::Write;
    match std::io::stdout().lock().write_all(&out) {
        Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => Err(error.into()),
        _ => Ok(ExitCode::SUCCESS),
    }
}

/// The completion script of `cmd` for `shell`.
pub fn script(shell: clap_complete::Shell, cmd: &mut clap::Command, out: &mut Vec<u8>) {
    clap_complete::generate(shell, cmd, "turnstile", out);
}
