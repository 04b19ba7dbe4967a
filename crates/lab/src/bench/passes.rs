//! `turnstile bench passes`: what a deep backlog's waits cost the broker under a consumer
//! timeout, counted by the ladder's own planner ([`Holds::next_hop`], the function a replica
//! publishes and holds by), so that a figure for a wait of hours needs no hours: each message of
//! one seller's backlog `depth` deep waits for its slot, a wait within the replica's hold is
//! held there (one delivery), a longer one goes through the ladder, one delivery per pass.
//! `tests/broker.rs` checks the passes against the real broker for a short timeout.

use std::time::Duration;

use clap::Args;
use turnstile_core::broker::ladder::{Holds, Hop};
use turnstile_core::config::ConsumerTimeout;

#[derive(Args, Debug, Clone)]
pub struct PassesArgs {
    /// How deep the seller's backlog is, in time at its limit (the last message waits this).
    #[arg(long, default_value = "100m", value_parser = turnstile_core::config::duration_arg)]
    pub depth: Duration,
    /// Messages in the backlog (their waits spread evenly over the depth).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub messages: u64,
    /// The replicas' TURNSTILE_HOLD: a wait within it is held in the replica.
    #[arg(long, default_value = "2s", value_parser = turnstile_core::config::duration_arg)]
    pub hold: Duration,
    /// The consumer timeouts to count under (TURNSTILE_CONSUMER_TIMEOUT values).
    #[arg(long, value_delimiter = ',', default_value = "30m,1h,2h,off")]
    pub consumer_timeouts: Vec<ConsumerTimeout>,
}

/// What one consumer timeout costs the backlog, per message.
#[derive(Debug, PartialEq)]
pub struct Passes {
    pub longest_hold: Duration,
    pub deliveries: f64,
    pub publishes: f64,
    pub most_deliveries: u64,
}

/// Counts the broker's deliveries and publishes per message for the backlog under `holds`.
pub fn count(args: &PassesArgs, holds: Holds) -> Passes {
    let (mut deliveries, mut publishes, mut most) = (0u64, 0u64, 0u64);
    let depth_ms = args.depth.as_millis() as u64;
    for i in 0..args.messages {
        let wait_ms = depth_ms * (i + 1) / args.messages;
        let mut taken = 1; // from the work queue
        if wait_ms > args.hold.as_millis() as u64 {
            // Handed on half the hold before its slot, as a replica's workers delay it.
            let due = wait_ms - args.hold.as_millis() as u64 / 2;
            let mut at = 0;
            while let Hop::Level { until_ms, .. } = holds.next_hop(at, due) {
                taken += 1;
                publishes += 1;
                at = until_ms;
            }
        }
        deliveries += taken;
        most = most.max(taken);
    }
    let n = args.messages as f64;
    Passes {
        longest_hold: holds.longest(),
        deliveries: deliveries as f64 / n,
        publishes: publishes as f64 / n,
        most_deliveries: most,
    }
}

pub fn run(args: PassesArgs) {
    println!(
        "one seller's backlog {} s deep, {} messages, TURNSTILE_HOLD {} ms",
        args.depth.as_secs(),
        args.messages,
        args.hold.as_millis()
    );
    println!(
        "{:<28} {:>14} {:>16} {:>16} {:>18}",
        "consumer timeout", "longest hold", "deliveries/msg", "publishes/msg", "most deliveries"
    );
    let before = count(&args, Holds::at_most(Duration::from_secs(1024)));
    println!(
        "{:<28} {:>12} s {:>16.2} {:>16.2} {:>18}",
        "(before: a fixed 1,024 s)",
        before.longest_hold.as_secs(),
        before.deliveries,
        before.publishes,
        before.most_deliveries
    );
    for timeout in &args.consumer_timeouts {
        let passes = count(&args, Holds::under(*timeout));
        println!(
            "{:<28} {:>12} s {:>16.2} {:>16.2} {:>18}",
            timeout.to_string(),
            passes.longest_hold.as_secs(),
            passes.deliveries,
            passes.publishes,
            passes.most_deliveries
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backlog(depth_min: u64) -> PassesArgs {
        PassesArgs {
            depth: Duration::from_secs(depth_min * 60),
            messages: 1_000,
            hold: Duration::from_secs(2),
            consumer_timeouts: Vec::new(),
        }
    }

    #[test]
    fn a_backlog_within_the_longest_hold_costs_two_deliveries_at_most() {
        let passes = count(&backlog(20), Holds::default());
        assert_eq!(passes.most_deliveries, 2);
        assert!(passes.deliveries <= 2.0);
    }

    #[test]
    fn a_raised_timeout_takes_a_100_minute_backlog_to_two_deliveries() {
        let raised = Holds::under("2h".parse().unwrap());
        assert_eq!(count(&backlog(100), raised).most_deliveries, 2);
        let default = count(&backlog(100), Holds::default());
        assert_eq!(
            default.most_deliveries, 6,
            "one pass per 22.5 minutes, and the work queue"
        );
    }
}
