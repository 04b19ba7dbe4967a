//! What Redis has executed, from `INFO commandstats` on every node: scripts called and commands
//! run, per message of a bench run.

use anyhow::Context;
use turnstile_core::permit::RedisConn;

/// What Redis has executed so far, summed over every node: scripts called (EVALSHA, EVAL) and
/// all commands (the commands scripts run inside Redis included).
pub struct CommandCalls {
    pub scripts: u64,
    pub total: u64,
    /// Nodes asked (each INFO call itself counts one command on its node).
    pub nodes: u64,
    /// Per command: (calls, µs spent), summed over the nodes.
    pub by_command: std::collections::BTreeMap<String, (u64, u64)>,
}

/// Where Redis's time went, per message, for one command (INFO commandstats). A script's time
/// includes the commands it ran, which are also counted under their own names.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CommandTime {
    pub command: String,
    pub calls_per_message: f64,
    pub us_per_message: f64,
}

pub async fn command_calls(redis: &RedisConn) -> anyhow::Result<CommandCalls> {
    let mut conn = redis.clone();
    let infos: Vec<String> = match redis {
        RedisConn::Single(_) => vec![
            redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut conn)
                .await?,
        ],
        RedisConn::Cluster(_) => {
            let by_node: std::collections::HashMap<String, String> = redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut conn)
                .await
                .context("INFO commandstats on every node")?;
            by_node.into_values().collect()
        }
    };
    let mut calls = CommandCalls {
        scripts: 0,
        total: 0,
        nodes: infos.len() as u64,
        by_command: Default::default(),
    };
    for info in &infos {
        for line in info.lines() {
            let Some((name, rest)) = line
                .strip_prefix("cmdstat_")
                .and_then(|l| l.split_once(':'))
            else {
                continue;
            };
            let field = |name: &str| -> u64 {
                rest.split(',')
                    .find_map(|f| f.strip_prefix(name))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            let (n, usec) = (field("calls="), field("usec="));
            let entry = calls.by_command.entry(name.to_owned()).or_default();
            *entry = (entry.0 + n, entry.1 + usec);
            calls.total += n;
            if name.starts_with("eval") {
                calls.scripts += n;
            }
        }
    }
    Ok(calls)
}

impl CommandCalls {
    /// Per message of `messages`, since `before`: each command's calls and µs, most time first
    /// (the `info` asked for these counts left out).
    pub fn time_per_message_since(&self, before: &CommandCalls, messages: u64) -> Vec<CommandTime> {
        let n = messages.max(1) as f64;
        let mut times: Vec<CommandTime> = self
            .by_command
            .iter()
            .filter(|(name, _)| name.as_str() != "info")
            .filter_map(|(name, &(calls, usec))| {
                let (calls_before, usec_before) =
                    before.by_command.get(name).copied().unwrap_or_default();
                let calls = calls.saturating_sub(calls_before);
                (calls > 0).then(|| CommandTime {
                    command: name.clone(),
                    calls_per_message: calls as f64 / n,
                    us_per_message: usec.saturating_sub(usec_before) as f64 / n,
                })
            })
            .collect();
        times.sort_by(|a, b| b.us_per_message.total_cmp(&a.us_per_message));
        times
    }

    /// Per message of `messages`, since `before`: (scripts called, commands executed, the
    /// commands inside scripts included; each INFO asked for these counts left out).
    pub fn per_message_since(&self, before: &CommandCalls, messages: u64) -> (f64, f64) {
        let n = messages.max(1) as f64;
        let scripts = self.scripts.saturating_sub(before.scripts);
        let commands = self.total.saturating_sub(before.total + before.nodes);
        (scripts as f64 / n, commands as f64 / n)
    }
}

/// Redis's time in scripts per `unit` (µs: the scripts', the commands they ran, the rest Lua and
/// calls), then the twelve commands that took most, as `command calls/µs`.
pub fn print_time(name: &str, unit: &str, times: &[CommandTime]) {
    let scripts: f64 = times
        .iter()
        .filter(|t| t.command.starts_with("eval"))
        .map(|t| t.us_per_message)
        .sum();
    let inside: f64 = times
        .iter()
        .filter(|t| !t.command.starts_with("eval"))
        .map(|t| t.us_per_message)
        .sum();
    println!(
        "{name}: Redis µs per {unit} in scripts {scripts:.1} (their commands {inside:.1}, the rest Lua and calls); by command (calls, µs):"
    );
    let top: Vec<String> = times
        .iter()
        .take(12)
        .map(|t| {
            format!(
                "{} {:.2}/{:.1}",
                t.command, t.calls_per_message, t.us_per_message
            )
        })
        .collect();
    println!("  {}", top.join(", "));
}
