//! turnstile's producer side: what feeds the work queue, beside the consume path (it depends on
//! `turnstile-core`, never the other way).
//! - [`upload`]: a seller's spreadsheet (.xlsx, .csv, .jsonl) read into registration messages,
//!   with capped reads and bad rows reported
//! - [`progress`]: each upload's progress (published, registered, dead-lettered), as the
//!   completion records count it
pub mod progress;
pub mod upload;
