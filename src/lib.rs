//! turnstile: a horizontally scaled RabbitMQ consumer that calls a per-seller rate-limited
//! registration API, never exceeding any seller's limit across replicas, never losing a message
//! and never letting one busy seller hold up the others.
//!
//! Module map, by part (`replica` is the composition root of one replica, `cli` of the binary;
//! README's "Layout" issue tracks making the compiler keep these parts apart):
//! - consume path: [`replica`] (start, run, reconnect, drain), [`worker`] (one delivery -> one
//!   Outcome, settled in one place), [`broker`] (lapin: topology, delay ladder, settling, dead
//!   letters), [`permit`] (the Redis/Lua limiter, every Redis key), [`downstream`] (the
//!   registration call), [`domain`] (sellers, message ids, registrations: parse, don't
//!   validate), [`config`] (limits, algorithms, Redis settings), [`telemetry`] (tracing)
//! - operator side: [`http`] (metrics, health, readiness), [`dashboard`] (its samplers and page)
//! - producer side: [`upload`] (spreadsheets to messages), [`progress`] (uploads' progress)
//! - lab: [`bench`] (figures beside baselines), [`demo`], [`rig`] (one harness for benches and
//!   the demo), [`mock_api`] (a strict stand-in for the API), [`local_redis`] (a private
//!   `redis-server` for fault tests)
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
