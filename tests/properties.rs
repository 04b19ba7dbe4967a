//! Property tests over what comes from outside: message bodies, turnstile's own headers (which
//! anyone can forge), seller ids in the downstream URL, and the ladder's arithmetic. Run
//! briefly in the suite (a few hundred cases each); no services needed.

use std::time::Duration;

use proptest::prelude::*;
use turnstile_core::broker::ladder::{Holds, Hop, LEVELS, SLACK, UNIT, remaining_wait};
use turnstile_core::config::ConsumerTimeout;
use turnstile_core::config::{Limit, Limits};
use turnstile_core::domain::{Registration, SellerId};
use turnstile_core::downstream::{Downstream, DownstreamArgs};
use turnstile_core::permit::Reservation;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// A seller id as the contract allows it: 1 to 128 characters, no control characters.
fn seller_id() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        any::<char>().prop_filter("no control", |c| !c.is_control()),
        1..=128,
    )
    .prop_map(|chars| chars.into_iter().collect())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn any_body_parses_or_is_refused_without_panicking(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Registration::parse(&body, None);
    }

    #[test]
    fn any_allowed_seller_id_round_trips_and_keeps_its_own_hash_tag(id in seller_id()) {
        let body = serde_json::json!({"seller_id": id, "product": {"a": 1}}).to_string();
        let registration = Registration::parse(body.as_bytes(), None).unwrap();
        prop_assert_eq!(registration.seller_id.as_str(), id.as_str());
        let tag = registration.seller_id.key_tag();
        prop_assert!(!tag.contains('{') && !tag.contains('}'), "{}", tag);
        let header = registration.seller_id.header_value();
        prop_assert!(header.bytes().all(|b| b.is_ascii_graphic()), "{}", header);
    }

    #[test]
    fn any_header_decodes_to_a_well_formed_reservation_or_nothing(text in ".{0,200}") {
        if let Some(r) = Reservation::decode(&text) {
            prop_assert!(r.slot_us >= 0 && r.limits.min_count() >= 1 && r.reserved_at_us >= 0);
            prop_assert!(!r.token.is_empty() && r.token.len() <= 64);
            prop_assert_eq!(Reservation::decode(&r.encode()), Some(r));
        }
    }

    #[test]
    fn a_reservation_survives_its_header(
        slot_us in 0i64..i64::MAX,
        stack in proptest::collection::btree_map(1u64.., 1u32.., 1..=8),
        reserved_at_us in 0i64..i64::MAX, token in "[A-Za-z0-9-]{1,64}",
        cost in proptest::option::of(1u32..=10_000),
    ) {
        let stack: Vec<Limit> = stack
            .into_iter()
            .map(|(window_us, count)| Limit::new(count, Duration::from_micros(window_us)).unwrap())
            .collect();
        let limits = Limits::new(&stack).unwrap();
        let cost = cost.and_then(turnstile_core::domain::Cost::new);
        let r = Reservation { slot_us, limits, reserved_at_us, token, cost };
        prop_assert_eq!(Reservation::decode(&r.encode()), Some(r));
    }

    #[test]
    fn a_seller_id_never_changes_the_downstream_path(id in seller_id()) {
        let downstream = Downstream::new(&DownstreamArgs {
            url: "https://api.test/sellers/{seller_id}/products?x=1".into(),
            token: None,
            timeout: Duration::from_secs(1),
            cost_header: None,
        }).unwrap();
        let seller = SellerId::parse(&id).unwrap();
        match downstream.url_for(&seller) {
            Ok(url) => {
                let url = reqwest::Url::parse(&url).unwrap();
                let segments: Vec<&str> = url.path_segments().unwrap().collect();
                prop_assert_eq!(segments.len(), 3, "{}", url);
                prop_assert_eq!(segments[0], "sellers");
                prop_assert_eq!(segments[2], "products");
                prop_assert_eq!(url.query(), Some("x=1"));
            }
            Err(_) => prop_assert!(id == "." || id == ".."),
        }
    }

    #[test]
    fn every_hop_ends_by_the_due_time_and_the_last_one_less_than_a_unit_early_under_any_consumer_timeout(
        now in 0u64..1 << 50, delay_ms in 0u64..200_000_000,
        timeout_s in proptest::option::of(5u64..200_000),
    ) {
        let holds = Holds::under(ConsumerTimeout::new(timeout_s.map(Duration::from_secs)));
        let longest = holds.longest().as_millis() as u64;
        if let Some(timeout_s) = timeout_s {
            let left = timeout_s * 1000 - longest;
            prop_assert!(left >= (timeout_s * 250).min(600_000), "a quarter of it, or ten minutes, left for the call");
        }
        let due = now + delay_ms;
        let (mut at, mut hops) = (now, 0u64);
        while let Hop::Level { level, until_ms } = holds.next_hop(at, due) {
            prop_assert!(level < LEVELS);
            prop_assert!(until_ms <= due + SLACK.as_millis() as u64);
            prop_assert!(until_ms > at);
            prop_assert!(until_ms - at <= longest);
            at = until_ms;
            hops += 1;
        }
        prop_assert!(due + (SLACK.as_millis() as u64) < at + UNIT.as_millis() as u64);
        prop_assert!(hops <= delay_ms / longest + u64::from(LEVELS));
    }

    #[test]
    fn a_forged_hop_end_never_holds_longer_than_the_level(
        now in 0u64..1 << 50, until in proptest::option::of(any::<u64>()), level in 0..LEVELS,
    ) {
        let wait = UNIT * (1u32 << level);
        prop_assert!(remaining_wait(now, until, wait) <= wait);
    }
}
