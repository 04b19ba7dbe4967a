//! The lab of turnstile.
pub mod bench;
pub mod demo;
pub mod local_redis;
pub mod mock_api;
pub mod rig;
