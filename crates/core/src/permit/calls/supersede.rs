//! `lua/supersede.lua`.

use crate::permit::calls::call::{Call, invoke};
use crate::permit::scripts;

/// `lua/supersede.lua`: one step of a product's messages, which says whether the message is
/// still the latest. See the script's header.
pub(in crate::permit) struct Supersede<'a> {
    /// KEYS[1]: the product's record.
    pub record: String,
    /// KEYS[2]: the product's arrivals.
    pub arrivals: String,
    /// ARGV[1]: STEP.
    pub step: &'static str,
    /// ARGV[2]: the message's ID.
    pub message: &'a str,
    /// ARGV[3]: its VERSION ('' for none).
    pub version: Option<i64>,
    /// ARGV[4]: TTL in ms.
    pub ttl_ms: u64,
    /// ARGV[5]: SIGNATURE, what a reservation taken over must match.
    pub signature: &'a str,
    /// ARGV[6]: HELD, the token of the reservation the message holds ('' for none).
    pub held: &'a str,
    /// ARGV[7]: with `reserved`, the RESERVATION as encoded; with `unrevive`, PREVIOUS.
    pub extra: String,
}

impl Supersede<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::supersede(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.record.clone())
            .key(self.arrivals.clone())
            .arg(self.step)
            .arg(self.message)
            .arg(self.version.map_or_else(String::new, |v| v.to_string()))
            .arg(self.ttl_ms.max(1))
            .arg(self.signature)
            .arg(self.held)
            .arg(&self.extra);
    }
}

/// What `lua/supersede.lua` answers: `{VERDICT, BY, RESERVATION}`.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::permit) struct SupersedeAnswer {
    pub superseded: bool,
    pub by: String,
    pub reservation: String,
}

impl redis::FromRedisValue for SupersedeAnswer {
    fn from_redis_value(v: redis::Value) -> Result<Self, redis::ParsingError> {
        let (verdict, by, reservation): (String, String, String) =
            redis::FromRedisValue::from_redis_value(v)?;
        match verdict.as_str() {
            "go" | "superseded" => Ok(Self {
                superseded: verdict == "superseded",
                by,
                reservation,
            }),
            _ => Err(redis::ParsingError::from(format!(
                "supersede answered {verdict:?}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check};
    use super::*;

    #[test]
    fn keys_and_args_follow_the_header() {
        const SOURCE: &str = include_str!("../../../lua/supersede.lua");
        let mut written = Written::default();
        Supersede {
            record: "record".into(),
            arrivals: "arrivals".into(),
            step: "reserved",
            message: "m-1",
            version: Some(-3),
            ttl_ms: 60_000,
            signature: "1|",
            held: "t",
            extra: "1/10/1000000/0/t".into(),
        }
        .write(&mut written);
        check(
            SOURCE,
            "KEYS",
            &written.keys,
            &[
                ("record", "product's record"),
                ("arrivals", "product's arrivals"),
            ],
        );
        check(
            SOURCE,
            "ARGV",
            &written.args,
            &[
                ("reserved", "STEP"),
                ("m-1", "ID"),
                ("-3", "VERSION"),
                ("60000", "TTL"),
                ("1|", "SIGNATURE"),
                ("t", "HELD"),
                ("1/10/1000000/0/t", "RESERVATION"),
            ],
        );
    }
}
