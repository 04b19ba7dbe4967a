//! Asking ahead: while every worker is busy calling, a few new messages ask for their permit
//! before a worker is free, so that a worker freed by an answer starts the next call at once
//! instead of first waiting for Redis. Workers bound the downstream calls; a permit's round
//! trip (a millisecond or more on a busy machine) need not hold one. Only where a grant may
//! wait a moment before its call is sent (see `Limiter::grants_may_wait`): under the exact
//! algorithms, whose limits (the global one too) hold a call's place until its answer.
//!
//! What bounds it: at most as many messages ask ahead as there are workers, and only while the
//! calls are answered fast enough that a grant waiting for a worker is called well within
//! [`CALL_ALLOWANCE`] of it (a grant that finds no worker in time is given back unsent, as
//! before). A slow downstream turns it off by itself: its messages queue for a worker first.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::permit::CALL_ALLOWANCE;

/// The typical call above which no message asks ahead: a grant waiting for a worker waits for
/// at most about one call of those in flight to end (as many ask ahead as there are workers),
/// so this keeps that wait within a quarter of [`CALL_ALLOWANCE`].
pub const MOST_TYPICAL_CALL: Duration =
    Duration::from_millis(CALL_ALLOWANCE.as_millis() as u64 / 4);

/// The places to ask ahead and the calls' typical duration that decides whether to.
pub struct AskAhead {
    /// One per message asking ahead (as many as workers).
    pub places: Arc<Semaphore>,
    /// The calls' typical duration: a moving average (weight 1/8 for each new call), µs.
    typical_call_us: AtomicU64,
}

impl AskAhead {
    /// As many places as `workers`.
    pub fn new(workers: usize) -> Self {
        Self {
            places: Arc::new(Semaphore::new(workers)),
            typical_call_us: AtomicU64::new(0),
        }
    }

    /// Notes how long a call took, from its send to its answer.
    pub fn called(&self, took: Duration) {
        let took = took.as_micros().min(u128::from(u64::MAX)) as u64;
        let _ =
            self.typical_call_us
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |typical| {
                    Some(moving_average(typical, took))
                });
    }

    /// The calls' typical duration, from send to answer.
    pub fn typical_call(&self) -> Duration {
        Duration::from_micros(self.typical_call_us.load(Ordering::Relaxed))
    }

    /// Whether messages may ask ahead now: while the typical call is within
    /// [`MOST_TYPICAL_CALL`].
    pub fn allowed(&self) -> bool {
        self.typical_call() <= MOST_TYPICAL_CALL
    }
}

/// The moving average after one more sample (weight 1/8).
fn moving_average(average: u64, sample: u64) -> u64 {
    if sample >= average {
        average + (sample - average) / 8
    } else {
        average - (average - sample) / 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_typical_call_moves_an_eighth_of_the_way_to_each_new_one() {
        assert_eq!(moving_average(0, 800), 100);
        assert_eq!(moving_average(800, 0), 700);
        assert_eq!(moving_average(800, 800), 800);
    }

    #[test]
    fn fast_calls_allow_asking_ahead_and_a_slow_downstream_stops_it_within_a_few_calls() {
        let ahead = AskAhead::new(4);
        assert!(ahead.allowed(), "nothing known yet: fast enough");
        for _ in 0..20 {
            ahead.called(Duration::from_millis(5));
        }
        assert!(ahead.allowed());
        let mut calls = 0;
        while ahead.allowed() {
            ahead.called(Duration::from_secs(3));
            calls += 1;
        }
        assert!(calls <= 2, "{calls} slow calls before it stopped");
        for _ in 0..40 {
            ahead.called(Duration::from_millis(5));
        }
        assert!(ahead.allowed(), "allowed again once calls are fast");
    }
}
