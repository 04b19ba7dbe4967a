//! The process metrics (`process_*`: CPU seconds, resident and virtual memory, open and
//! maximum file descriptors, start time, threads; see
//! `turnstile_core::series::Metric::is_process`), read from `/proc` by `metrics-process` at
//! startup and at each scrape, under the names Prometheus' client libraries give them. Their
//! help texts are the catalogue's (`turnstile_core::series::export_at_zero`).

use std::sync::OnceLock;

use metrics_process::Collector;

/// Reads the process metrics now into the installed recorder.
pub fn collect() {
    static COLLECTOR: OnceLock<Collector> = OnceLock::new();
    COLLECTOR.get_or_init(Collector::default).collect();
}
