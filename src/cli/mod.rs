//! The `turnstile` command line: one file per command whose body lives here; `demo` and
//! `bench` run the lab's ([`turnstile_lab`]). The only place that knows every part.
//! - [`consume`]: one replica with its endpoints (`turnstile_ops::serve`)
//! - [`mock_api`]: the lab's strict stand-in for the registration API
//! - [`publish`], [`status`]: the producer side (`turnstile_upload`)
//! - [`limits`], [`dead_letters`]: operator commands on Redis and the broker

mod completions;
mod consume;
mod dead_letters;
mod limits;
mod mock_api;
mod publish;
mod status;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use turnstile_core::broker::{AmqpArgs, QueueArgs};
use turnstile_core::config::RedisArgs;
use turnstile_core::domain::{BatchId, SellerId};
use turnstile_lab::{bench, demo};
use turnstile_ops::serve::ServeArgs;

#[derive(Parser, Debug)]
#[command(
    name = "turnstile",
    version,
    about = "Per-seller rate-limited registration consumer",
    subcommand_precedence_over_arg = true,
    after_help = "The connection flags go before or after the command, e.g. `turnstile --key-prefix p limits get --seller S` or `turnstile limits get --seller S --key-prefix p`; each command lists those it uses. Every setting is also read from its TURNSTILE_* environment variable (docs/configuration.md)."
)]
pub struct Cli {
    #[command(flatten)]
    pub connection: Connection,
    #[command(subcommand)]
    pub command: Command,
}

/// The connection flags as the top level takes them, before the subcommand: the groups that
/// declare them ([`AmqpArgs`], [`QueueArgs`], [`RedisArgs`]), which each command that uses one
/// flattens too. They are `global` there, and clap hands a command's the value given here;
/// here they are not (see [`command`]), so a command that uses none of them does not list them.
#[derive(clap::Args, Debug)]
#[command(next_help_heading = "Connection")]
pub struct Connection {
    #[command(flatten)]
    pub amqp: AmqpArgs,
    #[command(flatten)]
    pub queue: QueueArgs,
    #[command(flatten)]
    pub redis: RedisArgs,
}

/// The ids of the connection flags (see [`Connection`]).
const CONNECTION: [&str; 5] = [
    "amqp_url",
    "queue",
    "redis_url",
    "redis_cluster",
    "key_prefix",
];

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run one consumer replica (many may share the queue).
    #[command(
        after_help = "Also read from the environment: TURNSTILE_LOG_FORMAT (`json` for one JSON object per line; default text) and RUST_LOG (the log filter; default `info,lapin=off`, and `lapin=off` is added to a RUST_LOG that names no lapin target); colours only on a terminal, and never with NO_COLOR set."
    )]
    Consume(Box<ServeArgs>),
    /// A strict stand-in for the registration API (for demos, tests and benchmarks).
    MockApi(turnstile_lab::mock_api::MockArgs),
    /// Publish a seller's upload (.xlsx, .csv or .jsonl): one registration message per product.
    Publish(Box<publish::PublishArgs>),
    /// How far each upload is: registered, waiting, dead-lettered, and when it will be done.
    Status(Box<status::StatusArgs>),
    /// Everything on the local RabbitMQ and Redis: mock API, replicas, uploads, live progress.
    Demo(Box<demo::DemoArgs>),
    /// Inspect dead letters, or move chosen ones back to the work queue.
    DeadLetters(Box<dead_letters::DeadLettersArgs>),
    /// Show or change sellers' limits, weights and pauses (stored in Redis, effective on every
    /// replica at once).
    Limits(Box<limits::LimitsArgs>),
    /// Measurements that print figures next to a baseline measured in the same run.
    #[command(subcommand_precedence_over_arg = true)]
    Bench {
        #[command(subcommand)]
        which: bench::BenchCommand,
    },
    /// Print a shell completion script to stdout, e.g. `turnstile completions bash >
    /// /etc/bash_completion.d/turnstile`.
    Completions(completions::CompletionsArgs),
}

/// The command line's definition: [`Cli`]'s, with the connection flags of the top level not
/// `global` (each command that uses one has its own, `global`, which takes the value given
/// before the subcommand).
pub fn command() -> clap::Command {
    CONNECTION.iter().fold(Cli::command(), |cmd, id| {
        cmd.mut_arg(*id, |a| a.global(false))
    })
}

/// Parses the process's command line (exits with the usage error on a bad one, which names
/// the variable when the bad value came from the environment).
pub fn parse() -> Cli {
    let mut cmd = command();
    let argv: Vec<OsString> = std::env::args_os().collect();
    let matches = cmd
        .try_get_matches_from_mut(&argv)
        .unwrap_or_else(|e| naming_the_variable(e, &cmd, &argv, |v| std::env::var_os(v)).exit());
    if let Err(error) = check_connection_flags(&mut cmd, &matches) {
        error.exit();
    }
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut cmd).exit())
}

/// `error` with the flag it names (`--workers`) shown as its variable and flag
/// (`TURNSTILE_WORKERS (--workers)`) when the bad value came from the variable: the variable
/// (as `env` reads it) holds the bad value, and `argv` gives the flag no such value.
fn naming_the_variable(
    mut error: clap::Error,
    cmd: &clap::Command,
    argv: &[OsString],
    env: impl Fn(&str) -> Option<OsString>,
) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(
        error.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        return error;
    }
    let (Some(ContextValue::String(shown)), Some(ContextValue::String(value))) = (
        error.get(ContextKind::InvalidArg),
        error.get(ContextKind::InvalidValue),
    ) else {
        return error;
    };
    let Some(long) = shown
        .strip_prefix("--")
        .and_then(|s| s.split([' ', '=']).next())
    else {
        return error;
    };
    let inline = format!("--{long}={value}");
    let given = |token: &OsString| token.to_str().is_some_and(|t| t == value || t == inline);
    if argv.iter().skip(1).any(given) {
        return error;
    }
    let variable = every_argument(cmd)
        .filter(|a| a.get_long() == Some(long))
        .filter_map(|a| a.get_env()?.to_str())
        .find(|v| env(v).is_some_and(|set| set.to_str() == Some(value.as_str())));
    let Some(variable) = variable.map(str::to_owned) else {
        return error;
    };
    error.insert(
        ContextKind::InvalidArg,
        ContextValue::String(format!("{variable} (--{long})")),
    );
    error
}

/// Every argument of `cmd` and of each of its subcommands, however deep.
fn every_argument(cmd: &clap::Command) -> Box<dyn Iterator<Item = &clap::Arg> + '_> {
    Box::new(
        cmd.get_arguments()
            .chain(cmd.get_subcommands().flat_map(every_argument)),
    )
}

/// Refuses a connection flag given before a command that does not use it (it would be
/// ignored).
fn check_connection_flags(
    cmd: &mut clap::Command,
    matches: &ArgMatches,
) -> Result<(), clap::Error> {
    cmd.build();
    let (mut leaf, mut at, mut path) = (&*cmd, matches, vec!["turnstile".to_owned()]);
    while let Some((name, sub)) = at.subcommand() {
        let Some(next) = leaf.find_subcommand(name) else {
            break;
        };
        (leaf, at) = (next, sub);
        path.push(name.to_owned());
    }
    for id in CONNECTION {
        let given = matches.value_source(id) == Some(ValueSource::CommandLine);
        if given && !leaf.get_arguments().any(|a| a.get_id() == id) {
            let flag = cmd
                .get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_long())
                .unwrap_or(id);
            return Err(cmd.error(
                clap::error::ErrorKind::UnknownArgument,
                format!("`{}` does not use --{flag}", path.join(" ")),
            ));
        }
    }
    Ok(())
}

/// Ends the process quietly, with exit code 0, when a print finds stdout closed by its reader
/// (`turnstile status | head -1`): the reader asked for no more, which is no failure to report.
/// Any other panic is reported as before.
pub fn quiet_when_stdout_closes() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if is_closed_stdout(info.payload()) {
            std::process::exit(0);
        }
        report(info);
    }));
}

/// Whether a panic's payload is the one `print!` and `println!` raise when stdout's reader has
/// gone ("failed printing to stdout: Broken pipe (os error 32)").
fn is_closed_stdout(payload: &(dyn std::any::Any + Send)) -> bool {
    let text = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied());
    text.is_some_and(|t| {
        t.starts_with("failed printing to stdout") && t.to_ascii_lowercase().contains("broken pipe")
    })
}

/// Runs a parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Consume(args) => consume::run(*args).await,
        Command::MockApi(args) => mock_api::run(args).await,
        Command::Publish(args) => publish::run(*args).await,
        Command::Status(args) => status::run(*args).await,
        Command::Demo(args) => demo::run(*args).await,
        Command::DeadLetters(args) => dead_letters::run(*args).await,
        Command::Limits(args) => limits::run(*args).await,
        Command::Bench { which } => bench::run(which).await,
        Command::Completions(args) => completions::run(args, &mut command()),
    }
}

/// `--seller`, parsed by clap (a bad one is a usage error).
fn seller_value(s: &str) -> Result<SellerId, String> {
    SellerId::parse(s).map_err(|e| e.to_string())
}

/// `--batch`, parsed by clap (a bad one is a usage error).
fn batch_value(s: &str) -> Result<BatchId, String> {
    BatchId::parse(s).map_err(|e| e.to_string())
}

/// `--operator`, on every command that changes something: who, for the audit trail.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct Operator {
    /// Who acts, for the audit trail (Recent actions on the console): else the login name
    /// (`USER`).
    #[arg(long = "operator", env = "TURNSTILE_OPERATOR", global = true)]
    pub name: Option<String>,
}

impl Operator {
    /// The name the audit trail records (see `turnstile_ops::audit::operator_name`).
    pub fn name(&self) -> String {
        turnstile_ops::audit::operator_name(self.name.as_deref())
    }
}

/// `--json`, on every command a script calls: one JSON document on stdout instead of text.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct Json {
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    pub json: bool,
}

impl Json {
    /// `document` when `--json` is given.
    pub fn then<T>(self, document: T) -> Option<T> {
        self.json.then_some(document)
    }
}

/// A token cancelled on SIGTERM or SIGINT (Ctrl-C); the only place signals are read.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    // Registered here, before anything else runs: a SIGTERM in the first instant is then a
    // shutdown too, not the default action (exit at once).
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        // Cancel before logging: a log line cannot fail the shutdown (stderr may be closed).
        cancel.cancel();
        tracing::info!("shutdown signal received");
    });
    token
}

#[cfg(test)]
mod tests;
