//! The operator side of turnstile, beside the consume path (it depends on
//! `turnstile-core`, never the other way):
//! - [`serve`]: `turnstile consume` as run: a replica with its endpoints and dashboard (the
//!   composition root of both sides)
//! - [`endpoints`]: what every endpoint shares (state, JSON answers, the token check)
//! - [`ids`]: the ids a request names, parsed as a message body's are
//! - [`http`]: `/metrics` (Prometheus), `/healthz`, `/readyz`, the dashboard's routes
//! - [`dashboard`]: the dashboard's page, its data and the samplers that feed it
//! - [`actions`]: what an operator does from the page (pause, resume, limits, replays) and how
//!   those requests are checked
//! - [`lookup`]: finding a seller, a batch or a message; browsing dead letters
//! - [`audit`]: the audit trail of those actions
//! - [`broker_link`]: the operator side's own broker connection (queue depths, dead letters)
//! - [`health`]: the broker's and Redis's health as the operator side finds them
//! - [`overdue`]: the uploads past their ETA, as one gauge
//! - [`process`]: the process metrics (CPU, memory, file descriptors)
pub mod actions;
pub mod audit;
pub mod broker_link;
pub mod dashboard;
pub mod endpoints;
pub mod health;
pub mod http;
pub mod ids;
pub mod lookup;
pub mod overdue;
pub mod process;
pub mod serve;
