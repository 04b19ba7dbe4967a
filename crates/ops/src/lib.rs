//! The operator side of turnstile, beside the consume path (it depends on
//! `turnstile-core`, never the other way):
//! - [`serve`]: `turnstile consume` as run: a replica with its endpoints and dashboard
//! - [`http`]: `/metrics` (Prometheus), `/healthz`, `/readyz`, the dashboard's routes
//! - [`dashboard`]: the dashboard's page, its data and the samplers that feed it
//! - [`overdue`]: the uploads past their ETA, as one gauge
//! - [`process`]: the process metrics (CPU, memory, file descriptors)
pub mod dashboard;
pub mod http;
pub mod overdue;
pub mod process;
pub mod serve;
