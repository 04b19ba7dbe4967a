//! The producer side of turnstile.
pub mod progress;
pub mod upload;
