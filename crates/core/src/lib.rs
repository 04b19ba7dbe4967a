//! The consume path of turnstile.
pub mod broker;
pub mod config;
pub mod domain;
pub mod downstream;
pub mod permit;
pub mod replica;
pub mod telemetry;
pub mod worker;
