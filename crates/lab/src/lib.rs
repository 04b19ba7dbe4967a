//! turnstile's lab: what measures and demonstrates the consume path, apart from it (nothing in
//! `turnstile-core`, `turnstile-upload` or `turnstile-ops` depends on this crate).
//! - [`rig`]: the one harness: a strict mock API, N replicas, a queue and key prefix of their
//!   own, a workload, cleanup (used by tests, benchmarks and the demo)
//! - [`bench`]: `turnstile bench ...`, figures beside a baseline measured in the same run
//! - [`demo`]: `turnstile demo`
//! - [`mock_api`]: a strict stand-in for the registration API that counts every violation
//! - [`local_redis`]: a private `redis-server` for fault tests
//! - [`slow_link`]: a TCP proxy adding latency each way, which can also reset (cut) or hang: a
//!   slow, partitioned or hung link to Redis or the broker
pub mod bench;
pub mod demo;
pub mod local_redis;
pub mod mock_api;
pub mod rig;
pub mod slow_link;
