//! The operator side of turnstile, beside the consume path (it depends on
//! `turnstile-core`, never the other way):
//! - [`serve`]: `turnstile consume` as run: a replica with its endpoints and dashboard
//! - [`http`]: `/metrics` (Prometheus), `/healthz`, `/readyz`, the dashboard's routes
//! - [`dashboard`]: the dashboard's page, its data and the samplers that feed it
pub mod dashboard;
pub mod http;
pub mod serve;
