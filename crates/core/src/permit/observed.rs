//! What the permit metrics count of decisions (labels: the algorithm, never the seller).

use crate::config::Algorithm;
use crate::permit::decision::Decision;

/// The `verdict` label values of `turnstile_shadow_verdicts_total`.
pub const SHADOW_VERDICTS: [&str; 3] = ["agree", "stricter", "looser"];

/// A grant that leaves at least this much of the limit taken (thousandths) is near the limit
/// (as envoy's ratelimit counts `near_limit`: 80%).
pub const NEAR_LIMIT_PERMILLE: u32 = 800;

/// Counts a decision in the permit metrics (label: the algorithm; never the seller). A grant
/// that leaves the limit at least [`NEAR_LIMIT_PERMILLE`] taken is `near_limit`; a wait told by
/// an acquire is `over_limit` (the limit had no room), a wait told by a redeem is only `denied`
/// (the caller came back before its reserved slot).
pub(in crate::permit) fn observe(algorithm: Algorithm, decision: &Decision, acquired: bool) {
    let algorithm = algorithm.name();
    match decision {
        Decision::Granted { used_permille, .. } => {
            metrics::counter!("turnstile_permits_granted_total", "algorithm" => algorithm)
                .increment(1);
            if *used_permille >= NEAR_LIMIT_PERMILLE {
                metrics::counter!("turnstile_permits_near_limit_total", "algorithm" => algorithm)
                    .increment(1);
            }
        }
        Decision::Wait { .. } => {
            metrics::counter!("turnstile_permits_denied_total", "algorithm" => algorithm)
                .increment(1);
            if acquired {
                metrics::counter!("turnstile_permits_over_limit_total", "algorithm" => algorithm)
                    .increment(1);
            }
        }
        Decision::Deferred { .. } | Decision::AlreadyDone | Decision::TooCostly { .. } => {}
    }
}

/// Counts a shadow limit's verdict on a decision (see `judge_shadow` in `lua/include/shadow.lua`):
/// `agree`, `stricter` or `looser`; nothing without a shadow limit.
pub(in crate::permit) fn count_verdict(verdict: &str) {
    let Some(&verdict) = SHADOW_VERDICTS.iter().find(|&&v| v == verdict) else {
        return;
    };
    metrics::counter!("turnstile_shadow_verdicts_total", "verdict" => verdict).increment(1);
}
