//! `turnstile publish`: one registration message per product of a seller's upload, published
//! confirmed, each carrying the upload's `batch_size` (so the consume side tracks the upload as
//! it does any producer's batch). An upload is one trace: every message carries a
//! `traceparent` of the same trace id (printed when publishing starts), each with a span id of
//! its own.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use futures::StreamExt;
use turnstile_core::broker::{BrokerArgs, Publisher};
use turnstile_core::config::{DefaultLimitArgs, LimiterArgs, RedisArgs};
use turnstile_core::fleet;
use turnstile_core::permit::{Admin, RedisConn, Terms};
use turnstile_core::trace::TraceContext;
use turnstile_upload::upload::{Columns, UploadRow, read_upload_with};

use turnstile_core::domain::{BatchId, SellerId};

use super::{Json, batch_value, seller_value};

#[derive(clap::Args, Debug)]
pub struct PublishArgs {
    /// The upload: .xlsx (first sheet), .csv or .jsonl; the first row (or each object's keys)
    /// names the product fields.
    pub file: PathBuf,
    /// The seller whose products these are (1 to 128 characters, no control characters).
    #[arg(long, value_parser = seller_value)]
    pub seller: SellerId,
    /// The upload's batch id [default: file name + digest of its content].
    #[arg(long, value_parser = batch_value)]
    pub batch: Option<BatchId>,
    /// Refuse the whole file if any row is bad (default: report bad rows and skip them).
    #[arg(long)]
    pub strict: bool,
    /// The product field (column) holding each registration's cost: the units of every limit
    /// of the seller it takes, a whole number from 1 to 10000 [default: every registration
    /// costs 1].
    #[arg(long = "cost-column", value_name = "NAME")]
    pub cost_column: Option<String>,
    /// The product field (column) naming each product, its `product_key` (the SKU, say): of one
    /// seller's rows for one product, the newest supersedes the older ones still waiting, so a
    /// corrected upload replaces the rows of an earlier one not registered yet.
    #[arg(long = "product-key-column", value_name = "NAME")]
    pub product_key_column: Option<String>,
    /// The product field (column) holding each row's `version`, a whole number: of two rows of
    /// one product, the higher is the newer (else the later to arrive).
    #[arg(
        long = "version-column",
        value_name = "NAME",
        requires = "product_key_column"
    )]
    pub version_column: Option<String>,
    #[command(flatten)]
    pub json: Json,
    #[command(flatten)]
    pub broker: BrokerArgs,
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Read for the estimate printed at the end only (how long the upload takes at least at
    /// the seller's limit: its override, else the fleet's default; this one only when no
    /// replica is alive).
    #[command(flatten)]
    pub limit: DefaultLimitArgs,
}

/// Runs `turnstile publish`.
pub async fn run(args: PublishArgs) -> anyhow::Result<ExitCode> {
    let (seller, batch) = (args.seller.clone(), args.batch.clone());
    let columns = Columns {
        cost: args.cost_column.as_deref(),
        product_key: args.product_key_column.as_deref(),
        version: args.version_column.as_deref(),
    };
    let upload = read_upload_with(&args.file, &seller, batch.as_ref(), args.strict, columns)?;
    for bad in &upload.bad_rows {
        eprintln!("skipped {bad}");
    }
    let conn = RedisConn::connect(&args.redis).await?;
    let prefix = &args.redis.key_prefix;
    let terms = fleet::tool_terms(&conn, prefix, LimiterArgs::from(args.limit.clone())).await?;
    if let Some(note) = terms.note(prefix) {
        eprintln!("{note}");
    }
    let store = Admin::new(conn, prefix, Terms::from(&terms.limiter));
    let (connection, publisher, topology) = args.broker.open("turnstile publish").await?;
    let queue = topology.work().to_owned();
    let label = format!("publishing {} of {seller}", upload.batch_id.as_str());
    let trace = TraceContext::start();
    if !args.json.json {
        println!(
            "{}: publishing {} products of {seller} (batch {}) as trace-id {}",
            args.file.display(),
            upload.rows.len(),
            upload.batch_id.as_str(),
            trace.trace_id()
        );
    }
    let published = publish_rows(&publisher, &queue, &upload.rows, &trace, label).await;
    let failed_rows: std::collections::HashSet<usize> = upload
        .rows
        .iter()
        .zip(&published)
        .filter(|(_, result)| result.is_err())
        .map(|(row, _)| row.row)
        .collect();
    let failed: Vec<_> = published.into_iter().filter_map(Result::err).collect();
    let sent = upload.rows.len() - failed.len();
    let _ = connection.close(200, "done".into()).await;
    let limit = store.effective_limit(&seller).await?;
    let sent_rows = upload.rows.iter().filter(|r| !failed_rows.contains(&r.row));
    let optimum = limit.optimum_drain_of(sent_rows.map(|r| r.cost.units()));
    let weighed = match &args.cost_column {
        Some(column) => format!(" of {} units ({column})", upload.units()),
        None => String::new(),
    };
    let document = serde_json::json!({
        "file": args.file.display().to_string(),
        "seller": seller.as_str(),
        "batch_id": upload.batch_id.as_str(),
        "trace_id": trace.trace_id().to_string(),
        "queue": queue,
        "products": upload.rows.len(),
        "published": sent,
        "failed": failed.len(),
        "bad_rows": upload.bad_rows.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "units": upload.units(),
        "limit": limit.to_string(),
        "optimum_s": optimum.as_millis() as f64 / 1000.0,
    });
    match args.json.then(document) {
        Some(document) => println!("{}", serde_json::to_string_pretty(&document)?),
        None => println!(
            "{}: published {sent} of {} products{weighed} of {seller} (batch {}) to {queue}; {} bad rows skipped; at {limit} they take at least {:.0}s",
            args.file.display(),
            upload.rows.len(),
            upload.batch_id.as_str(),
            upload.bad_rows.len(),
            optimum.as_secs_f64()
        ),
    }
    if let Some(error) = failed.first() {
        anyhow::bail!(
            "{} products were not published (confirmed): {error:#}",
            failed.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Publishes the rows to `queue`, confirmed, many at once, with a progress bar, each as a span
/// of `trace` (its `traceparent` header); one result per row.
async fn publish_rows(
    publisher: &Publisher,
    queue: &str,
    rows: &[UploadRow],
    trace: &TraceContext,
    label: String,
) -> Vec<anyhow::Result<()>> {
    let bar = indicatif::ProgressBar::new(rows.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({per_sec})")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(label);
    let published = futures::stream::iter(rows)
        .map(|row| {
            let bar = &bar;
            async move {
                let mut headers = lapin::types::FieldTable::default();
                for (name, value) in trace.child().amqp_headers() {
                    headers.insert(name.into(), value);
                }
                let properties = lapin::BasicProperties::default()
                    .with_content_type("application/json".into())
                    .with_message_id(row.message_id.as_str().into())
                    .with_headers(headers);
                publisher
                    .publish("", queue, &row.body, properties)
                    .await
                    .with_context(|| format!("publishing row {}", row.row))?;
                bar.inc(1);
                anyhow::Ok(())
            }
        })
        .buffered(128)
        .collect::<Vec<_>>()
        .await;
    bar.finish_and_clear();
    published
}
