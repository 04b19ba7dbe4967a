//! Permits: the shared, atomic per-seller limiter in Redis (Lua), used by every replica.
//!
//! There is one way in: a caller builds an [`Ask`] (seller, message, cost, the slot it holds,
//! its rank, its route) and asks [`Limiter::ask`]; a grant ([`Grant`]) is handed back once
//! after the call ([`Limiter::answered`], then [`Limiter::finish`], or [`Limiter::unsent`]).
//! The worker, the tests and the lab all go through that seam. A permit is granted now, or the
//! caller is told when to come back; a reserving caller (the consumer) then also *holds* that
//! future slot ([`Reservation`]), so a deep backlog is scheduled one slot after another instead
//! of every waiting caller coming back at once and being denied again.
//!
//! The modules, by stage of a permit's life:
//! - `limiter`: the seam ([`Limiter`], [`Ask`], [`Asked`], [`Grant`], [`Ended`]) and the
//!   uploads' side a worker needs ([`Progress`]);
//! - `decision`: the vocabulary of a decision, pure: [`Rank`], [`Reservation`], [`Decision`],
//!   [`Forfeit`], the units a call asks ([`charged_cost`]);
//! - `ask`: one attempt, as `Limiter::ask` makes it: redeem the slot held (`lua/redeem.lua`) or
//!   ask the algorithm's script (`lua/<algorithm>.lua`), reserving when it must wait;
//! - `pool`: the permit pool in front of the seller's script (`TURNSTILE_PERMIT_BLOCK`), with
//!   [`block`] keeping its bookkeeping;
//! - `beyond`: what a seller's grant still needs, a lease of its calls in flight
//!   (`lua/lease.lua`) and the global limit's units (`lua/global.lua`); a refusal gives the
//!   grant back (`lua/release.lua`);
//! - `finish`: after the call, its end, a registration's completion record
//!   (`lua/complete.lua`), what adaptive limits learn (`lua/learn.lua`), a reported cost;
//! - `store`: [`PermitStore`], the connection, the terms in force ([`applied`]) and Redis's
//!   clock; `batch` sends the hot operations several to a call (`lua/batch.lua`), `calls`
//!   holds one type per script (its KEYS and ARGV by name, its answer read), [`scripts`] puts
//!   the scripts together, [`keys`] builds every key, `conn` is the connection and [`server`]
//!   reads whether Redis may evict; below the scripts' types, what they read and answer:
//!   `terms` ([`Terms`], a seller's terms as the scripts take them), `usage` ([`Usage`], how
//!   much of a seller's limits is taken) and `completion` (a completion record's states and
//!   the one list of their transitions, written into `lua/complete.lua`);
//! - `supersession`: superseded rows, which message of a seller's product is the latest
//!   (`lua/supersede.lua`), asked by messages that carry a `product_key` only;
//! - beside the store, not on the hot path: [`Admin`] (sellers' terms as operators set and
//!   read them, `admin`), [`Records`] (uploads' progress, dead letters by reason, the
//!   dashboard's shared state, `records`) and the fleet's [`Registry`] (`registry`).
//!
//! This module owns the Redis keyspace: nothing outside it talks to Redis about turnstile's
//! keys but through these types.

mod admin;
pub mod applied;
mod ask;
mod batch;
mod beyond;
pub mod block;
mod calls;
mod completion;
mod conn;
mod dead;
mod decision;
mod error;
mod finish;
pub mod keys;
mod limiter;
mod observed;
mod outcome;
mod pool;
mod records;
mod registry;
pub mod scripts;
pub mod server;
mod store;
mod supersession;
mod terms;
mod usage;

pub use admin::{
    Admin, Change, LONGEST_PAUSE, Learned, MAX_SHADOW_COUNT, MAX_WEIGHT, PauseSpanError, Quota,
    Rescheduled, pause_span,
};
pub use applied::Applied;
pub use conn::{
    RedisClient, RedisConn, delete_prefix, keys_matching, memory_of_prefix, memory_usage,
    round_trips,
};
pub use keys::Keyspace;
pub use limiter::{
    Ask, Asked, CLAIM_ASKING, CLAIM_MARGIN, CallClaim, Ended, Finished, Grant, Limiter, Progress,
};
pub use records::{BatchSeen, HISTORY_HOURS, History, Orphan, Records, RetryDue, UploadProgress};
pub use registry::{Registered, Registry, Roll, fleet_calls};
pub use supersession::{ProductMessage, SupersedeStep, Supersession};
pub use terms::Terms;
pub use usage::{Accepted, GlobalShare, GlobalUsage, LimitUsage, Shadow, Usage, binding_of};

pub use beyond::{GLOBAL_OUTCOMES, LEASE_OUTCOMES};
pub use dead::DeadLetterBook;
pub use decision::{
    AGING, CALL_ALLOWANCE, CHARGE_MEMORY, Decision, Deferral, Forfeit, GIVE_WAY_REACH,
    GIVE_WAY_STEPS_PER_SECOND, GIVE_WAY_STEPS_SAVED, Rank, Reservation, SLOW_LINK_LATENESS,
};
pub use error::PermitError;
pub use observed::{NEAR_LIMIT_PERMILLE, SHADOW_VERDICTS};
pub use outcome::{BatchEvent, Completion, InBatch, Recorded, Why};
pub use store::{PermitStore, RESCHEDULE_POLL, record_delay, watch_reschedules};

#[cfg(test)]
mod tests {
    use super::decision::{Reservation, charged_cost, parse_charge};
    use super::error::PermitError;
    use super::finish::learned_ratio;
    use crate::domain::Cost;

    fn cost(units: u32) -> Cost {
        Cost::new(units).unwrap()
    }

    #[test]
    fn a_call_asks_the_charge_learned_when_higher_within_the_smallest_count() {
        assert_eq!(charged_cost(cost(1), None, 10), cost(1));
        assert_eq!(charged_cost(cost(1), Some(4), 10), cost(4));
        assert_eq!(charged_cost(cost(5), Some(4), 10), cost(5));
        // Capped at the smallest COUNT, never below the message's own cost.
        assert_eq!(charged_cost(cost(1), Some(40), 10), cost(10));
        assert_eq!(charged_cost(cost(12), Some(40), 10), cost(12));
        assert_eq!(charged_cost(cost(1), Some(0), 10), cost(1));
        assert_eq!(
            charged_cost(cost(1), Some(u32::MAX), u32::MAX),
            cost(10_000)
        );
    }

    #[test]
    fn a_learned_charge_is_read_as_untrusted() {
        assert_eq!(parse_charge(Some(b"4")), Some(4));
        assert_eq!(parse_charge(Some(b"10000")), Some(10_000));
        for bad in [
            &b""[..],
            b"0",
            b"10001",
            b"04",
            b"+4",
            b" 4",
            b"4.0",
            b"-1",
            b"\xff",
        ] {
            assert_eq!(parse_charge(Some(bad)), None, "{bad:?}");
        }
        assert_eq!(parse_charge(None), None);
    }

    #[test]
    fn a_reservation_names_its_units_only_when_they_are_not_its_messages_cost() {
        let plain = Reservation::decode("5/10/1000000/4/tok-1").unwrap();
        assert_eq!(plain.cost, None);
        assert_eq!(plain.encode(), "5/10/1000000/4/tok-1");
        let charged = Reservation {
            cost: Some(cost(4)),
            ..plain
        };
        assert_eq!(charged.encode(), "5/10/1000000/4/tok-1/4");
        assert_eq!(Reservation::decode(&charged.encode()), Some(charged));
        for bad in ["0", "10001", "04", "x", "", "4/4"] {
            let header = format!("5/10/1000000/4/tok-1/{bad}");
            assert_eq!(Reservation::decode(&header), None, "{header}");
        }
    }

    /// The error Redis answers with `line` (a RESP error line, without `-` and CRLF).
    fn server_error(line: &str) -> PermitError {
        let value = redis::parse_redis_value(format!("-{line}\r\n").as_bytes()).unwrap();
        PermitError::Redis(value.extract_error().unwrap_err())
    }

    #[test]
    fn only_a_scripts_own_refusal_is_final_every_server_error_is_waited_out() {
        let refusal = "ERR turnstile: COST must be at most 10000 script: 1f2e, on @user_script:9.";
        assert!(!server_error(refusal).is_transient());
        assert!(
            !PermitError::Refused("ERR turnstile: TOKEN must be 1 to 64".into()).is_transient()
        );
        assert!(!PermitError::Answer("redeem").is_transient());
        for line in [
            "OOM command not allowed when used memory > 'maxmemory'.",
            "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
            "READONLY You can't write against a read only replica.",
            "BUSY Redis is busy running a script.",
            "LOADING Redis is loading the dataset in memory",
            "NOREPLICAS Not enough good replicas to write.",
            "CLUSTERDOWN The cluster is down",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "MASTERDOWN Link with MASTER is down",
            "ERR Error running script (call to f_1): @user_script:1: Unknown Redis command",
        ] {
            assert!(server_error(line).is_transient(), "{line}");
            // The same error caught inside a batch (see lua/batch.lua).
            assert!(PermitError::Refused(line.into()).is_transient(), "{line}");
        }
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(PermitError::Redis(io.into()).is_transient());
    }

    #[test]
    fn the_learned_ratio_is_the_lowest_of_the_stack() {
        assert_eq!(learned_ratio("5", "20"), 0.25);
        assert_eq!(learned_ratio("6,20", "6,40"), 0.5);
        assert_eq!(learned_ratio("20", "20"), 1.0);
        assert_eq!(learned_ratio("", "20"), 1.0);
    }
}
