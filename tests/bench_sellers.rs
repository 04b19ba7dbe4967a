//! `turnstile bench sellers` with a couple of hundred sellers: the structural facts it reports,
//! never a speed or a size threshold.
mod support;

use std::process::Command;

use serde_json::Value;
use support::run;

fn number(value: &Value, what: &str) -> f64 {
    value
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {value}"))
}

#[test]
fn sellers_cost_memory_their_limiter_keys_are_gone_once_idle_and_a_replica_serves_them_all() {
    let (code, out, err) = run(Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "bench",
            "sellers",
            "--sellers",
            "200",
            "--idle-limit",
            "5/1s",
            "--messages-per-seller",
            "3",
            "--replica-sellers",
            "40",
            "--warmup-sellers",
            "10",
            "--json",
        ])
        .env("RUST_LOG", "error"));
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let summary: Value = serde_json::from_str(out.lines().last().expect("a JSON summary line"))
        .unwrap_or_else(|e| panic!("the last line is a JSON summary ({e}):\n{out}"));

    assert!(number(&summary["baseline_set_bytes"], "baseline") > 0.0);
    let algorithms = summary["algorithms"].as_array().expect("algorithms");
    assert_eq!(algorithms.len(), 4, "{summary}");
    for a in algorithms {
        let name = &a["algorithm"];
        assert!(
            number(&a["bytes_per_seller"], "bytes/seller") > 0.0,
            "{name}: {a}"
        );
        assert!(
            number(&a["state_key_memory_usage"], "MEMORY USAGE") > 0.0,
            "{name}: {a}"
        );
        assert!(
            number(&a["keys_before_idle"], "keys before") > 0.0,
            "{name}: {a}"
        );
        assert_eq!(
            a["keys_after_idle"], 0,
            "{name}: a limiter key outlived idleness"
        );
    }

    let completion = &summary["completion"];
    assert!(number(&completion["bytes_per_record"], "bytes/record") > 0.0);
    assert_eq!(completion["records"], 600, "{completion}");
    assert_eq!(
        completion["records_after_idle"], 600,
        "completion records are kept for the done TTL: {completion}"
    );

    let replica = &summary["replica"];
    assert_eq!(replica["messages"], 80, "{replica}");
    assert_eq!(replica["registered"], 80, "{replica}");
    assert_eq!(replica["duplicates"], 0, "{replica}");
    assert_eq!(replica["violations"], 0, "{replica}");
}
