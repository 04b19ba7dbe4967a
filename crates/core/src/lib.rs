//! turnstile's consume path: a horizontally scaled RabbitMQ consumer that calls a per-seller
//! rate-limited registration API, never exceeding any seller's limit across replicas, never
//! losing a message and never letting one busy seller hold up the others.
//!
//! This crate knows nothing of the operator side (`turnstile-ops`), the producer side
//! (`turnstile-upload`) or the lab (`turnstile-lab`); they depend on it, never the other way.
//! - [`replica`]: the composition root of one replica: start in stages, consume, reconnect,
//!   drain
//! - [`worker`]: one delivery → one `Outcome`, settled in one place; the decisions apart as
//!   pure functions
//! - [`broker`]: RabbitMQ (lapin): topology, the delay ladder, settling, dead letters, results
//! - [`fleet`]: the replicas' registry in Redis and the strictest live terms every grant
//!   follows
//! - [`links`]: the links to the broker and Redis: when a hung or partitioned one is cut off
//! - [`permit`]: the Redis/Lua limiter shared by every replica (per seller, its calls in
//!   flight, the global limit), and the Redis keyspace
//! - [`downstream`]: the registration call and what its answer means
//! - [`domain`]: sellers, message ids, registrations (parse, don't validate)
//! - [`config`]: limits and stacks, algorithms, the global limit, Redis settings
//! - [`routes`]: the routes file: several endpoints of one provider, each with its own
//!   per-seller stack under the seller's budget
//! - [`telemetry`]: tracing and the replica's readiness flag
//! - [`trace`]: W3C trace context: a message's `traceparent` / `tracestate`, parsed once, and
//!   each downstream call a span of its own in that trace
//! - [`series`]: every metric exported, its help and label values, all at 0 from startup
pub mod broker;
pub mod config;
pub mod domain;
pub mod downstream;
pub mod fleet;
pub mod links;
pub mod permit;
pub mod replica;
pub mod routes;
pub mod series;
pub mod telemetry;
pub mod trace;
pub mod worker;
