//! What every script call shares: where its keys and arguments are written ([`Call`]), a
//! call's route and adaptive keys, the header's constants, and how an answer is read.

use crate::config::Limits;
use crate::permit::batch::Operation;
use crate::permit::error::PermitError;

/// Something a script's keys and arguments are written into, in order.
pub(in crate::permit) trait Call {
    fn key(&mut self, key: String) -> &mut Self;
    fn arg<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self;
}

impl Call for Operation {
    fn key(&mut self, key: String) -> &mut Self {
        Operation::key(self, key)
    }
    fn arg<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        Operation::arg(self, arg)
    }
}

impl Call for redis::ScriptInvocation<'_> {
    fn key(&mut self, key: String) -> &mut Self {
        redis::ScriptInvocation::key(self, key)
    }
    fn arg<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        redis::ScriptInvocation::arg(self, arg)
    }
}

/// `script`'s invocation, its keys and arguments laid out by `write` (a typed call's).
pub(in crate::permit) fn invoke(
    script: &'static redis::Script,
    write: impl FnOnce(&mut redis::ScriptInvocation<'static>),
) -> redis::ScriptInvocation<'static> {
    let mut invocation = script.prepare_invoke();
    write(&mut invocation);
    invocation
}

/// The batch's operation `name`, its keys and arguments laid out by `write` (a typed call's).
pub(in crate::permit) fn operate(
    name: &'static str,
    write: impl FnOnce(&mut Operation),
) -> Operation {
    let mut operation = Operation::new(name);
    write(&mut operation);
    operation
}

/// A call on a route (see `lua/include/routes.lua`): the route's two keys for the seller,
/// written after a script's own keys, and the route's stack from the routes file, written after
/// its own arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::permit) struct OnRoute {
    /// The seller's log of the route's units.
    pub log: String,
    /// The seller's override of the route's stack.
    pub limit: String,
    /// The route's stack: COUNTS and WINDOWS in µs.
    pub counts: String,
    pub windows: String,
}

impl OnRoute {
    /// The route's keys, last of a script's keys.
    pub fn keys<C: Call>(route: Option<&Self>, to: &mut C) {
        if let Some(route) = route {
            to.key(route.log.clone()).key(route.limit.clone());
        }
    }

    /// The route's stack, last of a script's arguments.
    pub fn args<C: Call>(route: Option<&Self>, to: &mut C) {
        if let Some(route) = route {
            to.arg(&route.counts).arg(&route.windows);
        }
    }
}

/// The seller's keys of adaptive limits a call reads (`lua/learn.lua`'s state, the accepted
/// log and the limit override), where a script takes them together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::permit) struct AdaptiveKeys {
    pub learned: String,
    pub accepted: String,
    pub limit: String,
}

/// A script's answer (a list), read by position; anything missing or of another type is the
/// script's bad answer.
pub(in crate::permit) struct Answer<'a> {
    pub(in crate::permit) values: &'a [redis::Value],
    pub(in crate::permit) script: &'static str,
}

impl Answer<'_> {
    pub(in crate::permit) fn bad(&self) -> PermitError {
        PermitError::Answer(self.script)
    }
    pub(in crate::permit) fn get<T: redis::FromRedisValue>(
        &self,
        i: usize,
    ) -> Result<T, PermitError> {
        self.values
            .get(i)
            .and_then(|v| redis::from_redis_value_ref(v).ok())
            .ok_or_else(|| self.bad())
    }
    pub(in crate::permit) fn int(&self, i: usize) -> Result<i64, PermitError> {
        self.get(i)
    }
    pub(in crate::permit) fn text(&self, i: usize) -> Result<String, PermitError> {
        self.get(i)
    }
    /// A count at `i` (a negative one reads as 0).
    pub(in crate::permit) fn count(&self, i: usize) -> Result<u64, PermitError> {
        Ok(self.int(i)?.max(0) as u64)
    }
    /// The stack at `i` (counts) and `i + 1` (windows).
    pub(in crate::permit) fn limits(&self, i: usize) -> Result<Limits, PermitError> {
        Limits::from_args(&self.text(i)?, &self.text(i + 1)?).ok_or_else(|| self.bad())
    }
}

#[cfg(test)]
pub(in crate::permit) mod header {
    //! Reading a script's header (`-- KEYS[n] ...`, `-- ARGV[n] ...`) to check a typed call
    //! against it.

    use super::Call;

    /// What a call wrote: its keys and its arguments (as text).
    #[derive(Default, Debug)]
    pub struct Written {
        pub keys: Vec<String>,
        pub args: Vec<String>,
    }

    impl Call for Written {
        fn key(&mut self, key: String) -> &mut Self {
            self.keys.push(key);
            self
        }
        fn arg<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self {
            self.args.extend(
                arg.to_redis_args()
                    .into_iter()
                    .map(|a| String::from_utf8(a).unwrap()),
            );
            self
        }
    }

    /// The header's lines for `what` (`KEYS` or `ARGV`), by index (1-based, as in Lua): the
    /// text after `-- KEYS[n]`. Every index from 1 to the last must be listed once; a line
    /// whose position moves with an option (`KEYS[6] (KEYS[3] without ADAPTIVE)`) is listed
    /// at its position with every option given (the larger). Ranges (`KEYS[3…]`) are not read.
    pub fn lines(source: &str, what: &str) -> Vec<String> {
        let prefix = format!("-- {what}[");
        let mut found: Vec<(usize, String)> = source
            .lines()
            .filter_map(|line| {
                let rest = line.strip_prefix(&prefix)?;
                let (n, text) = rest.split_once(']')?;
                let n: usize = n.parse().ok()?;
                let text = text.trim();
                // `KEYS[6] (KEYS[3] without ADAPTIVE)`: its index with every option given.
                let other = text
                    .strip_prefix(&format!("({what}["))
                    .and_then(|t| t.split_once(']'))
                    .and_then(|(m, _)| m.parse::<usize>().ok())
                    .unwrap_or(0);
                Some((n.max(other), text.to_owned()))
            })
            .collect();
        found.sort_by_key(|(n, _)| *n);
        for (i, (n, _)) in found.iter().enumerate() {
            assert_eq!(*n, i + 1, "{what}[{n}] listed out of order or twice");
        }
        found.into_iter().map(|(_, text)| text).collect()
    }

    /// Checks what a call wrote (`written`, its keys or its arguments) against the header's
    /// `what` lines: position by position, the value written and a phrase of the line that
    /// names it. `expected` lists every position the call writes, in order.
    pub fn check(source: &str, what: &str, written: &[String], expected: &[(&str, &str)]) {
        let lines = lines(source, what);
        let got: Vec<&str> = written.iter().map(String::as_str).collect();
        let want: Vec<&str> = expected.iter().map(|(value, _)| *value).collect();
        assert_eq!(got, want, "{what} written");
        assert!(
            written.len() <= lines.len(),
            "{what}: {} written, the header lists {}",
            written.len(),
            lines.len()
        );
        for (i, (_, phrase)) in expected.iter().enumerate() {
            assert!(
                lines[i].contains(phrase),
                "{what}[{}] is `{}`, expected it to name `{phrase}`",
                i + 1,
                lines[i]
            );
        }
    }
}
