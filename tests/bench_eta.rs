//! `turnstile bench eta` with a small batch: it prints its readings and a finite error, never a
//! timing threshold.
mod support;

use std::process::Command;

use support::run;

#[test]
fn a_small_batch_prints_its_eta_readings_and_a_finite_error() {
    let (code, out, err) = run(Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["bench", "eta", "--rows", "30", "--limit", "10/1s"])
        .env("RUST_LOG", "error"));
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let headline = out
        .lines()
        .find(|l| l.starts_with("ETA given at"))
        .unwrap_or_else(|| panic!("no headline:\n{out}"));
    let error: f64 = headline
        .rsplit(' ')
        .next()
        .and_then(|e| e.strip_suffix('%'))
        .and_then(|e| e.parse().ok())
        .unwrap_or_else(|| panic!("no error in the headline: {headline}"));
    assert!(error.is_finite(), "{headline}");
    let table = out
        .lines()
        .position(|l| l.trim_start().starts_with("at_s"))
        .unwrap_or_else(|| panic!("no table:\n{out}"));
    assert!(
        out.lines().skip(table + 1).any(|l| !l.trim().is_empty()),
        "a table without readings:\n{out}"
    );
}
