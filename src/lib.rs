//! turnstile: a horizontally scaled RabbitMQ consumer that calls a per-seller rate-limited
//! registration API, never exceeding any seller's limit across replicas, never losing a message
//! and never letting one busy seller hold up the others.
//!
//! Module map (one module per outside system; only `cli` knows them all):
//! - [`config`]: settings, limits and algorithms, parsed once with clear errors
//! - [`domain`]: sellers, message ids, registrations (parse, don't validate)
//! - [`permit`]: the Redis/Lua limiter shared by every replica
//! - [`telemetry`]: tracing setup
//! - [`http`], [`dashboard`]: what operators see: metrics, health, the live dashboard
//! - [`bench`]: measurements that print figures
//! - [`cli`]: the `turnstile` command line

pub mod bench;
pub mod broker;
pub mod cli;
pub mod config;
pub mod dashboard;
pub mod demo;
pub mod domain;
pub mod downstream;
pub mod http;
pub mod local_redis;
pub mod mock_api;
pub mod permit;
pub mod progress;
pub mod replica;
pub mod rig;
pub mod telemetry;
pub mod upload;
pub mod worker;
