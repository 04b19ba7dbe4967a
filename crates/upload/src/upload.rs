//! Reading a seller's upload file (.xlsx, .csv, .jsonl) into product registration messages,
//! ready to publish as they are (`turnstile publish FILE --seller S [--batch B] [--strict]
//! [--cost-column NAME] [--product-key-column NAME [--version-column NAME]]`).
//!
//! # Cost
//!
//! With a cost column, each product's field of that name is its message's `cost`: the units
//! of every limit of the seller its registration takes. The value must be a whole number from
//! 1 to 10,000 (a JSON number, or text of digits as CSV gives it); a row without one, or with
//! another value, is bad. The field stays in the product, which is forwarded verbatim.
//!
//! # Product key and version
//!
//! With a product key column, each product's field of that name is its message's
//! `product_key` (text, or a number written as it is; 1 to 256 characters, no control
//! characters), and with a version column as well, that field is its `version` (a whole number
//! of at most 15 digits, a JSON number or text of digits). Of one seller's messages for one
//! product key, the newest supersedes the older ones still waiting: a corrected upload replaces
//! the rows of an earlier one that are not registered yet. A row without a valid value is bad.
//! Both fields stay in the product.
//!
//! # Formats
//!
//! The format follows the file extension, in any letter case: `.xlsx`, `.csv`, `.jsonl` or
//! `.ndjson`.
//!
//! - **XLSX**: the first worksheet in workbook order (hidden or not). Its first non-empty row
//!   names the product fields; every later row is one product `{field: value}`. Numbers stay
//!   JSON numbers (an integral number such as `3.0` becomes `3`), booleans stay booleans,
//!   dates and times become ISO 8601 strings (`2024-03-01`, `2024-03-01T09:30:00`,
//!   `09:30:00`; durations `PT1H30M`), text becomes a string. A cell holding an error such as
//!   `#N/A` makes its row bad.
//! - **CSV**: UTF-8 (a leading byte order mark is ignored). The delimiter is whichever of `,`
//!   `;` or tab occurs most often outside quotes in the first line (`,` on a tie), so the
//!   semicolon files of European spreadsheet programs read as well. The first line names the
//!   fields. **Every value stays a JSON string**: CSV carries no types, and guessing them
//!   would turn an EAN like `0885909950805` into a number without its leading zero, so the
//!   downstream API gets exactly the text the seller typed. A row with a different number of
//!   cells than the header is bad.
//! - **JSONL**: every non-blank line is one product, a JSON object forwarded verbatim (field
//!   order, spacing and number spelling kept). A line that is not a JSON object is bad.
//!
//! In CSV and XLSX, header names are trimmed of surrounding whitespace; an empty or repeated
//! name refuses the whole file (its column would be ambiguous), except that empty header
//! cells at the right end are ignored, and a row with a value under such a column is bad.
//! Empty and whitespace-only cells are left out of the product; other text is kept verbatim.
//! A row whose cells are all empty is skipped without being reported.
//!
//! # Row numbers
//!
//! [`UploadRow::row`] and [`BadRow::row`] are what the seller sees: the spreadsheet row
//! number in XLSX (header = row 1 when the sheet starts at the top), the line number on which
//! the record starts in CSV (the same as the spreadsheet row unless a quoted cell spans
//! lines), the line number in JSONL.
//!
//! # Identity
//!
//! The batch id is the one given, or `<file stem>-<first 12 hex digits of the SHA-256 of the
//! file bytes>`, so publishing the same file twice gives the same batch. Each row's message
//! id is `u-` followed by the first 32 hex digits of
//! `SHA-256(seller \0 batch \0 row number \0 product JSON)`, where the product JSON is
//! exactly the `product` object sent downstream. Therefore the same file, seller and batch
//! always give the same ids (the downstream `Idempotency-Key` deduplicates a re-publish),
//! two identical rows in one file still get distinct ids, and an edited row gets a new id,
//! so an idempotency key never stands for two different request bodies.
//!
//! # Limits
//!
//! At most [`MAX_ROWS`] non-empty rows below the header (lines in JSONL); a longer file is
//! refused. A product whose message body would exceed [`MAX_BODY_BYTES`] is a bad row.

use std::fmt;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use calamine::{Data, ExcelDateTime, Reader, SheetType, Xlsx};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use turnstile_core::domain::{
    BatchId, BatchSize, Cost, MAX_BODY_BYTES, MessageId, ProductKey, SellerId, Version,
};

/// Most product rows (non-empty rows below the header, or non-blank JSONL lines) in one file.
pub const MAX_ROWS: usize = 100_000;
/// Largest upload file read.
pub const MAX_FILE_BYTES: u64 = 64 * 1024 * 1024;
/// Most columns a spreadsheet row may use (a product has far fewer fields).
pub const MAX_COLUMNS: u32 = 1_024;
/// Largest unpacked size an .xlsx may declare for all its parts together.
pub const MAX_UNPACKED_BYTES: u64 = 512 * 1024 * 1024;

/// Bad rows listed in the message of [`UploadError::Strict`].
const LISTED_BAD_ROWS: usize = 10;

/// Longest file stem kept in a derived batch id (the id itself is limited to 256 characters).
const MAX_STEM_CHARS: usize = 200;

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// A seller's upload file, read into messages ready to publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upload {
    /// The seller every message registers for.
    pub seller_id: SellerId,
    /// The batch: given by the caller or derived from the file name and contents.
    pub batch_id: BatchId,
    /// One message per product, in file order.
    pub rows: Vec<UploadRow>,
    /// Rows that could not become a product, in file order; they are not in `rows`.
    pub bad_rows: Vec<BadRow>,
    /// The format the file was read as.
    pub format: Format,
}

impl Upload {
    /// Units of every limit the upload's registrations take together.
    pub fn units(&self) -> u64 {
        self.rows.iter().map(|r| u64::from(r.cost.units())).sum()
    }
}

/// One product registration message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UploadRow {
    /// 1-based row (XLSX), line where the record starts (CSV) or line (JSONL), as the
    /// seller sees it in the file.
    pub row: usize,
    /// The message's stable identity, also in the body; see the module docs.
    pub message_id: MessageId,
    /// The full message body, UTF-8 JSON:
    /// `{"message_id":…,"seller_id":…,"batch_id":…,"batch_size":N,"product":{…}}` (N: the
    /// upload's good rows), with `"cost":N` before the product when the upload is weighed by a
    /// cost column, and `"product_key"` and `"version"` with those columns.
    pub body: Vec<u8>,
    /// Units of every limit its registration takes (1 without a cost column).
    pub cost: Cost,
}

/// A row that was skipped because it cannot become a product.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadRow {
    /// 1-based row or line number, as in [`UploadRow::row`].
    pub row: usize,
    /// Why the row was skipped, for the seller.
    pub reason: String,
}

impl fmt::Display for BadRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "row {}: {}", self.row, self.reason)
    }
}

/// An upload file format, chosen by file extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// Excel workbook (`.xlsx`); the first worksheet is read.
    Xlsx,
    /// Comma (or semicolon or tab) separated values (`.csv`).
    Csv,
    /// One JSON object per line (`.jsonl` or `.ndjson`).
    Jsonl,
}

impl Format {
    /// The format for `path`'s extension (case-insensitive), or
    /// [`UploadError::UnsupportedFormat`].
    pub fn from_path(path: &Path) -> Result<Self, UploadError> {
        let ext = path
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase());
        match ext.as_deref() {
            Some("xlsx") => Ok(Self::Xlsx),
            Some("csv") => Ok(Self::Csv),
            Some("jsonl" | "ndjson") => Ok(Self::Jsonl),
            _ => Err(UploadError::UnsupportedFormat {
                path: path.to_owned(),
            }),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Xlsx => "xlsx",
            Self::Csv => "csv",
            Self::Jsonl => "jsonl",
        })
    }
}

/// Why an upload file was refused as a whole.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    /// The file is missing or unreadable.
    #[error("cannot read {}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The extension is not one of the supported formats.
    #[error(
        "{}: unsupported file type; use .xlsx, .csv or .jsonl (or .ndjson)",
        .path.display()
    )]
    UnsupportedFormat { path: PathBuf },
    /// The file (or the first worksheet) holds nothing.
    #[error("{} is empty", .path.display())]
    Empty { path: PathBuf },
    /// The first row (the first non-empty row of the worksheet) names no field.
    #[error(
        "{}: the first row is empty; it must name the product fields",
        .path.display()
    )]
    NoHeader { path: PathBuf },
    /// The file is not a workbook calamine can read (corrupt, encrypted, not a zip, …).
    #[error("{}: not a readable .xlsx workbook: {reason}", .path.display())]
    Xlsx { path: PathBuf, reason: String },
    /// The workbook has no worksheet (only chart sheets, or none at all).
    #[error("{}: the workbook has no worksheet", .path.display())]
    NoSheets { path: PathBuf },
    /// The CSV file could not be parsed.
    #[error("{}: unreadable CSV: {reason}", .path.display())]
    Csv { path: PathBuf, reason: String },
    /// A header cell is empty, repeated or unusable, so the fields would be ambiguous.
    #[error("{}: header {column}: {why}; the first row must name each product field once", .path.display())]
    Header {
        path: PathBuf,
        column: String,
        why: String,
    },
    /// There is a header but not a single row below it.
    #[error("{}: no products below the header row", .path.display())]
    NoProducts { path: PathBuf },
    /// Larger than what turnstile reads (file size, columns, declared unpacked size): a bomb
    /// is refused before anything large is allocated.
    #[error("{}: refused: {why}", .path.display())]
    TooBig { path: PathBuf, why: String },
    /// More than [`MAX_ROWS`] rows.
    #[error("{}: more than {limit} rows; split it into smaller files", .path.display())]
    TooManyRows { path: PathBuf, limit: usize },
    /// `strict` was asked for and some rows are bad; `bad_rows` holds all of them.
    #[error(
        "{}: refused (strict): {}: {}",
        .path.display(),
        count(.bad_rows.len(), "bad row"),
        list_bad_rows(.bad_rows)
    )]
    Strict {
        path: PathBuf,
        bad_rows: Vec<BadRow>,
    },
}

fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

fn list_bad_rows(bad: &[BadRow]) -> String {
    let mut text = bad
        .iter()
        .take(LISTED_BAD_ROWS)
        .map(BadRow::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    if bad.len() > LISTED_BAD_ROWS {
        text.push_str(&format!("; and {} more", bad.len() - LISTED_BAD_ROWS));
    }
    text
}

/// Reads the upload at `path` into one registration message per product for `seller`.
///
/// `batch` is the batch id to use; without it one is derived from the file (see the module
/// docs). Bad rows are skipped and listed in [`Upload::bad_rows`]; with `strict`, any bad
/// row refuses the file with [`UploadError::Strict`] instead.
pub fn read_upload(
    path: &Path,
    seller: &SellerId,
    batch: Option<&BatchId>,
    strict: bool,
) -> Result<Upload, UploadError> {
    read_weighed_upload(path, seller, batch, strict, None)
}

/// As [`read_upload`], each message weighed by the product field `cost_column` if given (see
/// the module docs, "Cost").
pub fn read_weighed_upload(
    path: &Path,
    seller: &SellerId,
    batch: Option<&BatchId>,
    strict: bool,
    cost_column: Option<&str>,
) -> Result<Upload, UploadError> {
    let columns = Columns {
        cost: cost_column,
        ..Columns::default()
    };
    read_upload_with(path, seller, batch, strict, columns)
}

/// The product fields (columns) that say more than the product: its cost, and its product key
/// and version (see the module docs).
#[derive(Clone, Copy, Debug, Default)]
pub struct Columns<'a> {
    pub cost: Option<&'a str>,
    pub product_key: Option<&'a str>,
    /// Read only with `product_key`.
    pub version: Option<&'a str>,
}

/// What a row's message carries beside its product.
#[derive(Clone, Debug, Default)]
struct Envelope {
    cost: Option<Cost>,
    product_key: Option<ProductKey>,
    version: Option<Version>,
}

impl Columns<'_> {
    /// What `product`'s fields say for these columns, or why the row is bad.
    fn read(&self, product: &str) -> Result<Envelope, String> {
        let cost = self
            .cost
            .map(|column| cost_of(product, column))
            .transpose()?;
        let Some(key_column) = self.product_key else {
            return Ok(Envelope {
                cost,
                ..Envelope::default()
            });
        };
        let fields: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(product).map_err(|_| "it is not a JSON object".to_owned())?;
        let key = match fields.get(key_column) {
            None => return Err(format!("it has no {key_column:?} (the product key column)")),
            Some(serde_json::Value::String(text)) => text.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            Some(_) => String::new(),
        };
        let product_key = ProductKey::parse(&key).map_err(|_| {
            format!("its {key_column:?} must be 1 to 256 characters without control characters")
        })?;
        let version = match self.version {
            None => None,
            Some(column) => {
                let why = || format!("its {column:?} must be a whole number of at most 15 digits");
                let v = match fields.get(column) {
                    None => return Err(format!("it has no {column:?} (the version column)")),
                    Some(serde_json::Value::Number(n)) => n.as_i64(),
                    Some(serde_json::Value::String(text)) => text.trim().parse::<i64>().ok(),
                    Some(_) => None,
                };
                Some(v.and_then(Version::new).ok_or_else(why)?)
            }
        };
        Ok(Envelope {
            cost,
            product_key: Some(product_key),
            version,
        })
    }
}

/// As [`read_upload`], with what `columns` name read from each product (see the module docs,
/// "Cost" and "Product key and version").
pub fn read_upload_with(
    path: &Path,
    seller: &SellerId,
    batch: Option<&BatchId>,
    strict: bool,
    columns: Columns<'_>,
) -> Result<Upload, UploadError> {
    let format = Format::from_path(path)?;
    let bytes = read_bounded(path)?;
    let batch_id = match batch {
        Some(batch) => batch.clone(),
        None => derived_batch(path, &bytes),
    };
    let parsed = match format {
        Format::Xlsx => read_xlsx(&bytes),
        Format::Csv => read_csv(&bytes),
        Format::Jsonl => read_jsonl(&bytes),
    }
    .map_err(|e| e.at(path))?;

    let mut kept = Vec::with_capacity(parsed.products.len());
    let mut bad_rows = parsed.bad;
    for (row, product) in parsed.products {
        let envelope = match columns.read(&product) {
            Ok(envelope) => envelope,
            Err(reason) => {
                bad_rows.push(BadRow { row, reason });
                continue;
            }
        };
        let message_id = message_id(seller, &batch_id, row, &product);
        // Measured with the largest batch_size it may carry.
        let longest = body(
            &message_id,
            seller,
            &batch_id,
            BatchSize::new(BatchSize::MAX),
            &envelope,
            &product,
        );
        if longest.len() > MAX_BODY_BYTES {
            bad_rows.push(BadRow {
                row,
                reason: format!(
                    "the message would be {} bytes, over the {MAX_BODY_BYTES}-byte limit",
                    longest.len()
                ),
            });
        } else {
            kept.push((row, message_id, envelope, product));
        }
    }
    // Every message says how many the batch has (`batch_size`), so that the consume side knows
    // its total from the first message it sees.
    let size = u32::try_from(kept.len()).ok().and_then(BatchSize::new);
    let rows = kept
        .into_iter()
        .map(|(row, message_id, envelope, product)| UploadRow {
            row,
            body: body(&message_id, seller, &batch_id, size, &envelope, &product),
            message_id,
            cost: envelope.cost.unwrap_or(Cost::ONE),
        })
        .collect();
    bad_rows.sort_by_key(|b| b.row);
    if strict && !bad_rows.is_empty() {
        return Err(UploadError::Strict {
            path: path.to_owned(),
            bad_rows,
        });
    }
    Ok(Upload {
        seller_id: seller.clone(),
        batch_id,
        rows,
        bad_rows,
        format,
    })
}

fn derived_batch(path: &Path, bytes: &[u8]) -> BatchId {
    let stem: String = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
        .chars()
        .map(|c| if c.is_control() { '_' } else { c })
        .take(MAX_STEM_CHARS)
        .collect();
    let stem = if stem.trim().is_empty() {
        "upload"
    } else {
        &stem
    };
    let digest = hex::encode(&Sha256::digest(bytes)[..6]);
    BatchId::parse(&format!("{stem}-{digest}"))
        .expect("a stem without control characters and a digest form a valid batch id")
}

fn message_id(seller: &SellerId, batch: &BatchId, row: usize, product: &str) -> MessageId {
    let mut hash = Sha256::new();
    for part in [
        seller.as_str().as_bytes(),
        b"\0",
        batch.as_str().as_bytes(),
        b"\0",
        row.to_string().as_bytes(),
        b"\0",
        product.as_bytes(),
    ] {
        hash.update(part);
    }
    MessageId::parse(&format!("u-{}", hex::encode(&hash.finalize()[..16])))
        .expect("a hex digest is a valid message id")
}

fn body(
    message_id: &MessageId,
    seller: &SellerId,
    batch: &BatchId,
    size: Option<BatchSize>,
    envelope: &Envelope,
    product: &str,
) -> Vec<u8> {
    let size = size
        .map(|n| format!(r#","batch_size":{}"#, n.get()))
        .unwrap_or_default();
    let cost = envelope
        .cost
        .map(|c| format!(r#","cost":{c}"#))
        .unwrap_or_default();
    let key = envelope
        .product_key
        .as_ref()
        .map(|k| format!(r#","product_key":{}"#, json_string(k.as_str())))
        .unwrap_or_default();
    let version = envelope
        .version
        .map(|v| format!(r#","version":{}"#, v.get()))
        .unwrap_or_default();
    format!(
        r#"{{"message_id":{},"seller_id":{},"batch_id":{}{size}{cost}{key}{version},"product":{product}}}"#,
        json_string(message_id.as_str()),
        json_string(seller.as_str()),
        json_string(batch.as_str()),
    )
    .into_bytes()
}

/// The cost in the product's field `column` (see the module docs, "Cost"), or why not.
fn cost_of(product: &str, column: &str) -> Result<Cost, String> {
    let why = || {
        format!(
            "its {column:?} must be a whole number from 1 to {}",
            Cost::MAX
        )
    };
    let fields: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(product).map_err(|_| why())?;
    let units = match fields.get(column) {
        None => return Err(format!("it has no {column:?} (the cost column)")),
        Some(serde_json::Value::Number(n)) => n.as_u64(),
        Some(serde_json::Value::String(text)) => text.trim().parse::<u64>().ok(),
        Some(_) => None,
    };
    units
        .and_then(|u| u32::try_from(u).ok())
        .and_then(Cost::new)
        .ok_or_else(why)
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string always serializes")
}

/// A file-level failure before the path is known to the error.
enum Refusal {
    Empty,
    /// Beyond a bound that protects memory: what, and the bound.
    TooBig(String),
    NoHeader,
    Xlsx(calamine::XlsxError),
    NoSheets,
    Csv(csv::Error),
    Header {
        column: String,
        why: String,
    },
    NoProducts,
    TooManyRows,
}

impl Refusal {
    fn at(self, path: &Path) -> UploadError {
        let path = path.to_owned();
        match self {
            Self::Empty => UploadError::Empty { path },
            Self::TooBig(why) => UploadError::TooBig { path, why },
            Self::NoHeader => UploadError::NoHeader { path },
            Self::Xlsx(e) => UploadError::Xlsx {
                path,
                reason: e.to_string(),
            },
            Self::NoSheets => UploadError::NoSheets { path },
            Self::Csv(e) => UploadError::Csv {
                path,
                reason: e.to_string(),
            },
            Self::Header { column, why } => UploadError::Header { path, column, why },
            Self::NoProducts => UploadError::NoProducts { path },
            Self::TooManyRows => UploadError::TooManyRows {
                path,
                limit: MAX_ROWS,
            },
        }
    }
}

/// Products (row number, product JSON object text) and bad rows, in file order.
#[derive(Default)]
struct Parsed {
    products: Vec<(usize, String)>,
    bad: Vec<BadRow>,
}

impl Parsed {
    fn product(&mut self, row: usize, json: String) -> Result<(), Refusal> {
        self.products.push((row, json));
        self.check_size()
    }
    fn bad(&mut self, row: usize, reason: String) -> Result<(), Refusal> {
        self.bad.push(BadRow { row, reason });
        self.check_size()
    }
    fn check_size(&self) -> Result<(), Refusal> {
        if self.products.len() + self.bad.len() > MAX_ROWS {
            Err(Refusal::TooManyRows)
        } else {
            Ok(())
        }
    }
    fn non_empty(self) -> Result<Self, Refusal> {
        if self.products.is_empty() && self.bad.is_empty() {
            Err(Refusal::NoProducts)
        } else {
            Ok(self)
        }
    }
}

/// A JSON object's text built field by field, in the order the fields are added.
struct ObjectText(String);

impl ObjectText {
    fn new() -> Self {
        Self(String::from("{"))
    }
    fn push(&mut self, key: &str, value_json: &str) {
        if self.0.len() > 1 {
            self.0.push(',');
        }
        self.0.push_str(&json_string(key));
        self.0.push(':');
        self.0.push_str(value_json);
    }
    fn is_empty(&self) -> bool {
        self.0.len() == 1
    }
    fn finish(mut self) -> String {
        self.0.push('}');
        self.0
    }
}

/// The header's field names. Empty cells at the right end are dropped; an empty or repeated
/// name elsewhere refuses the file. `column` names a 0-based column for the seller.
fn field_names(
    cells: Vec<Option<String>>,
    column: impl Fn(usize) -> String,
) -> Result<Vec<String>, Refusal> {
    let named = cells.iter().rposition(Option::is_some).map_or(0, |i| i + 1);
    if named == 0 {
        return Err(Refusal::NoHeader);
    }
    let mut names: Vec<String> = Vec::with_capacity(named);
    for (i, cell) in cells.into_iter().take(named).enumerate() {
        let Some(name) = cell else {
            return Err(Refusal::Header {
                column: column(i),
                why: "is empty".into(),
            });
        };
        if let Some(first) = names.iter().position(|n| *n == name) {
            return Err(Refusal::Header {
                column: column(i),
                why: format!("repeats {name:?} of {}", column(first)),
            });
        }
        names.push(name);
    }
    Ok(names)
}

/// Reads a file of at most [`MAX_FILE_BYTES`] (checked before reading, and while reading).
fn read_bounded(path: &Path) -> Result<Vec<u8>, UploadError> {
    use std::io::Read;
    let read_error = |source| UploadError::Read {
        path: path.to_owned(),
        source,
    };
    let too_big = || UploadError::TooBig {
        path: path.to_owned(),
        why: format!("the file is larger than {} MiB", MAX_FILE_BYTES >> 20),
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    if file.metadata().map_err(read_error)?.len() > MAX_FILE_BYTES {
        return Err(too_big());
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_big());
    }
    Ok(bytes)
}

/// Refuses a workbook whose parts declare more than [`MAX_UNPACKED_BYTES`] unpacked (a zip
/// bomb), reading only the zip's directory.
fn check_unpacked_size(bytes: &[u8]) -> Result<(), Refusal> {
    let Ok(mut archive) = zip::ZipArchive::new(Cursor::new(bytes)) else {
        return Ok(()); // not a zip: calamine says why
    };
    let mut total: u64 = 0;
    for i in 0..archive.len() {
        if let Ok(part) = archive.by_index_raw(i) {
            total = total.saturating_add(part.size());
        }
    }
    if total > MAX_UNPACKED_BYTES {
        return Err(Refusal::TooBig(format!(
            "the workbook unpacks to {} MiB, over {} MiB",
            total >> 20,
            MAX_UNPACKED_BYTES >> 20
        )));
    }
    Ok(())
}

/// Reads the first worksheet cell by cell (calamine's streaming reader), one row at a time: a
/// far cell (`XFD1048576`) costs nothing, and memory stays bounded by [`MAX_COLUMNS`] cells.
fn read_xlsx(bytes: &[u8]) -> Result<Parsed, Refusal> {
    if bytes.is_empty() {
        return Err(Refusal::Empty);
    }
    check_unpacked_size(bytes)?;
    let mut workbook = Xlsx::new(Cursor::new(bytes)).map_err(Refusal::Xlsx)?;
    let sheet = workbook
        .sheets_metadata()
        .iter()
        .find(|s| s.typ == SheetType::WorkSheet)
        .map(|s| s.name.clone())
        .ok_or(Refusal::NoSheets)?;
    let mut reader = workbook
        .worksheet_cells_reader(&sheet)
        .map_err(Refusal::Xlsx)?;
    let mut rows = SheetRows::default();
    while let Some(cell) = reader.next_cell().map_err(Refusal::Xlsx)? {
        let (row, col) = cell.get_position();
        if col >= MAX_COLUMNS {
            return Err(Refusal::TooBig(format!(
                "a cell in column {} (at most {MAX_COLUMNS} columns are read)",
                column_letters(col as usize)
            )));
        }
        let value = Data::from(cell.get_value().clone());
        if value == Data::Empty {
            continue;
        }
        rows.push(row, col, value)?;
    }
    rows.finish()
}

/// The rows of a worksheet as its cells stream in (in row order): the header, then each
/// product row as soon as it is complete.
#[derive(Default)]
struct SheetRows {
    first_col: Option<u32>,
    /// The header's field names.
    header: Option<Vec<String>>,
    /// The row being read (0-based) and its cells (column, value).
    current: Option<(u32, Vec<(u32, Data)>)>,
    parsed: Parsed,
}

impl SheetRows {
    fn push(&mut self, row: u32, col: u32, value: Data) -> Result<(), Refusal> {
        if self.current.as_ref().is_some_and(|(r, _)| *r != row) {
            self.end_row()?;
        }
        self.current
            .get_or_insert_with(|| (row, Vec::new()))
            .1
            .push((col, value));
        Ok(())
    }

    fn end_row(&mut self) -> Result<(), Refusal> {
        let Some((row, cells)) = self.current.take() else {
            return Ok(());
        };
        let Some(names) = &self.header else {
            // The first non-empty row is the header; its first cell fixes the first column.
            let first_col = cells.iter().map(|(c, _)| *c).min().unwrap_or(0);
            self.first_col = Some(first_col);
            let column = |i: usize| format!("column {}", column_letters(first_col as usize + i));
            let width = cells
                .iter()
                .map(|(c, _)| (c - first_col) as usize + 1)
                .max()
                .unwrap_or(0);
            let mut texts = vec![None; width];
            for (c, value) in &cells {
                let i = (c - first_col) as usize;
                texts[i] = header_text(value).map_err(|why| Refusal::Header {
                    column: column(i),
                    why,
                })?;
            }
            self.header = Some(field_names(texts, column)?);
            return Ok(());
        };
        let first_col = self.first_col.unwrap_or(0);
        let column = |col: u32| format!("column {}", column_letters(col as usize));
        let mut product = ObjectText::new();
        let mut problem = None;
        for (col, cell) in &cells {
            let value = match xlsx_value(cell) {
                Ok(Some(value)) => value,
                Ok(None) => continue,
                Err(why) => {
                    problem.get_or_insert_with(|| format!("{} {why}", column(*col)));
                    continue;
                }
            };
            match col
                .checked_sub(first_col)
                .and_then(|i| names.get(i as usize))
            {
                Some(name) => product.push(name, &value),
                None => {
                    problem.get_or_insert_with(|| {
                        format!("{} holds a value but has no header", column(*col))
                    });
                }
            }
        }
        let row = row as usize + 1;
        match problem {
            Some(reason) => self.parsed.bad(row, reason),
            None if product.is_empty() => Ok(()),
            None => self.parsed.product(row, product.finish()),
        }
    }

    fn finish(mut self) -> Result<Parsed, Refusal> {
        self.end_row()?;
        if self.header.is_none() {
            return Err(Refusal::Empty);
        }
        self.parsed.non_empty()
    }
}

/// Spreadsheet column letters for a 0-based column: 0 → A, 25 → Z, 26 → AA.
pub fn column_letters(mut index: usize) -> String {
    let mut letters = Vec::new();
    loop {
        letters.push(b'A' + (index % 26) as u8);
        if index < 26 {
            break;
        }
        index = index / 26 - 1;
    }
    letters.reverse();
    String::from_utf8(letters).expect("ASCII letters")
}

/// A header cell as a field name: `None` when empty, an error for an error cell.
fn header_text(cell: &Data) -> Result<Option<String>, String> {
    let text = match cell {
        Data::Empty => return Ok(None),
        Data::String(s) | Data::DateTimeIso(s) | Data::DurationIso(s) => s.trim().to_owned(),
        Data::Int(i) => i.to_string(),
        Data::Float(f) => number_json(*f)?,
        Data::Bool(b) => b.to_string(),
        Data::DateTime(dt) => excel_datetime(dt),
        Data::Error(e) => return Err(format!("holds the error {e}")),
    };
    Ok(Some(text).filter(|t| !t.is_empty()))
}

/// A data cell as JSON value text: `None` when empty or whitespace-only.
fn xlsx_value(cell: &Data) -> Result<Option<String>, String> {
    Ok(Some(match cell {
        Data::Empty => return Ok(None),
        Data::String(s) if s.trim().is_empty() => return Ok(None),
        Data::String(s) | Data::DateTimeIso(s) | Data::DurationIso(s) => json_string(s),
        Data::Int(i) => i.to_string(),
        Data::Float(f) => number_json(*f)?,
        Data::Bool(b) => b.to_string(),
        Data::DateTime(dt) => json_string(&excel_datetime(dt)),
        Data::Error(e) => return Err(format!("holds the error {e}")),
    }))
}

/// A number as JSON: integral values within ±2^53 as integers, others in shortest form.
fn number_json(f: f64) -> Result<String, String> {
    const EXACT: f64 = 9_007_199_254_740_992.0;
    if !f.is_finite() {
        Err(format!("holds the non-finite number {f}"))
    } else if f.fract() == 0.0 && f.abs() <= EXACT {
        Ok(format!("{}", f as i64))
    } else {
        Ok(serde_json::to_string(&f).expect("a finite float serializes"))
    }
}

/// An Excel date, time, date-time or duration as ISO 8601 text.
fn excel_datetime(dt: &ExcelDateTime) -> String {
    if dt.is_duration() {
        return iso_duration(dt.as_f64());
    }
    let (y, mo, d, h, mi, s, ms) = dt.to_ymd_hms_milli();
    let time = if ms == 0 {
        format!("{h:02}:{mi:02}:{s:02}")
    } else {
        format!("{h:02}:{mi:02}:{s:02}.{ms:03}")
    };
    let value = dt.as_f64();
    if (0.0..1.0).contains(&value) {
        time
    } else if (h, mi, s, ms) == (0, 0, 0, 0) {
        format!("{y:04}-{mo:02}-{d:02}")
    } else {
        format!("{y:04}-{mo:02}-{d:02}T{time}")
    }
}

/// A duration in days as ISO 8601 (`PT1H30M`, `PT0S`, `-PT2.5S`), to the millisecond.
fn iso_duration(days: f64) -> String {
    let total_ms = (days * 86_400_000.0).round();
    let sign = if total_ms < 0.0 { "-" } else { "" };
    let total_ms = total_ms.abs() as u64;
    let (h, rest) = (total_ms / 3_600_000, total_ms % 3_600_000);
    let (m, rest) = (rest / 60_000, rest % 60_000);
    let (s, ms) = (rest / 1000, rest % 1000);
    let mut text = format!("{sign}PT");
    if h > 0 {
        text.push_str(&format!("{h}H"));
    }
    if m > 0 {
        text.push_str(&format!("{m}M"));
    }
    if ms > 0 {
        let fraction = format!("{ms:03}");
        text.push_str(&format!("{s}.{}S", fraction.trim_end_matches('0')));
    } else if s > 0 || (h == 0 && m == 0) {
        text.push_str(&format!("{s}S"));
    }
    text
}

fn strip_bom(bytes: &[u8]) -> &[u8] {
    bytes.strip_prefix(UTF8_BOM).unwrap_or(bytes)
}

/// The delimiter occurring most often outside quotes in the first non-blank line.
fn sniff_delimiter(bytes: &[u8]) -> u8 {
    let line = bytes
        .split(|&b| b == b'\n')
        .find(|l| !l.trim_ascii().is_empty())
        .unwrap_or_default();
    let mut counts = [(b',', 0usize), (b';', 0), (b'\t', 0)];
    let mut quoted = false;
    for &b in line {
        if b == b'"' {
            quoted = !quoted;
        } else if !quoted && let Some(count) = counts.iter_mut().find(|(d, _)| *d == b) {
            count.1 += 1;
        }
    }
    counts
        .iter()
        .fold(
            (b',', 0),
            |best, &(d, n)| if n > best.1 { (d, n) } else { best },
        )
        .0
}

fn csv_cell(raw: &[u8]) -> Result<Option<&str>, ()> {
    let text = std::str::from_utf8(raw).map_err(|_| ())?;
    Ok(Some(text).filter(|t| !t.trim().is_empty()))
}

fn read_csv(bytes: &[u8]) -> Result<Parsed, Refusal> {
    let bytes = strip_bom(bytes);
    if bytes.trim_ascii().is_empty() {
        return Err(Refusal::Empty);
    }
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .delimiter(sniff_delimiter(bytes))
        .from_reader(bytes);
    let mut records = reader.byte_records();
    let header = match records.next() {
        Some(record) => record.map_err(Refusal::Csv)?,
        None => return Err(Refusal::Empty),
    };
    let mut cells = Vec::with_capacity(header.len());
    for (i, raw) in header.iter().enumerate() {
        let name = csv_cell(raw).map_err(|()| Refusal::Header {
            column: csv_column(i),
            why: "is not valid UTF-8 (save the file as CSV UTF-8)".into(),
        })?;
        cells.push(name.map(|n| n.trim().to_owned()));
    }
    let width = header.len();
    let names = field_names(cells, csv_column)?;

    let mut parsed = Parsed::default();
    let mut line = header.position().map_or(1, |p| p.line() as usize);
    for record in records {
        let record = record.map_err(Refusal::Csv)?;
        line = record.position().map_or(line + 1, |p| p.line() as usize);
        if record.iter().all(|raw| raw.trim_ascii().is_empty()) {
            continue;
        }
        if record.len() != width {
            parsed.bad(
                line,
                format!(
                    "has {}, the header has {width}",
                    count(record.len(), "cell")
                ),
            )?;
            continue;
        }
        match csv_product(&record, &names) {
            Err(reason) => parsed.bad(line, reason)?,
            Ok(product) if product.is_empty() => {}
            Ok(product) => parsed.product(line, product.finish())?,
        }
    }
    parsed.non_empty()
}

/// A CSV column's name in a message: `column 1` for the first.
fn csv_column(i: usize) -> String {
    format!("column {}", i + 1)
}

/// One CSV record as a product, or why the row is bad (the first problem found).
fn csv_product(record: &csv::ByteRecord, names: &[String]) -> Result<ObjectText, String> {
    let mut product = ObjectText::new();
    let mut problem = None;
    for (i, raw) in record.iter().enumerate() {
        match (csv_cell(raw), names.get(i)) {
            (Err(()), _) => {
                problem.get_or_insert_with(|| {
                    format!(
                        "{} is not valid UTF-8 (save the file as CSV UTF-8)",
                        csv_column(i)
                    )
                });
            }
            (Ok(None), _) => {}
            (Ok(Some(text)), Some(name)) => product.push(name, &json_string(text)),
            (Ok(Some(_)), None) => {
                problem.get_or_insert_with(|| {
                    format!("{} holds a value but has no header", csv_column(i))
                });
            }
        }
    }
    match problem {
        Some(reason) => Err(reason),
        None => Ok(product),
    }
}

fn read_jsonl(bytes: &[u8]) -> Result<Parsed, Refusal> {
    let bytes = strip_bom(bytes);
    let mut parsed = Parsed::default();
    for (index, line) in bytes.split(|&b| b == b'\n').enumerate() {
        let line = line.trim_ascii();
        if line.is_empty() {
            continue;
        }
        let row = index + 1;
        match jsonl_product(line) {
            Ok(product) => parsed.product(row, product)?,
            Err(reason) => parsed.bad(row, reason)?,
        }
    }
    if parsed.products.is_empty() && parsed.bad.is_empty() {
        return Err(Refusal::Empty);
    }
    Ok(parsed)
}

fn jsonl_product(line: &[u8]) -> Result<String, String> {
    let text = std::str::from_utf8(line).map_err(|_| "is not valid UTF-8".to_owned())?;
    let raw: &RawValue = serde_json::from_str(text).map_err(|e| {
        let message = e.to_string();
        let message = message
            .rsplit_once(" at line ")
            .map_or(message.as_str(), |(m, _)| m);
        format!("invalid JSON at column {}: {message}", e.column())
    })?;
    if raw.get().starts_with('{') {
        Ok(raw.get().to_owned())
    } else {
        Err("is not a JSON object (each line must be one product object)".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_letters_follow_the_spreadsheet_convention() {
        let letters: Vec<String> = [0, 25, 26, 27, 51, 52, 701, 702]
            .into_iter()
            .map(column_letters)
            .collect();
        assert_eq!(letters, ["A", "Z", "AA", "AB", "AZ", "BA", "ZZ", "AAA"]);
    }

    #[test]
    fn integral_numbers_become_integers_and_others_keep_their_shortest_form() {
        assert_eq!(number_json(3.0).unwrap(), "3");
        assert_eq!(number_json(-0.0).unwrap(), "0");
        assert_eq!(number_json(19.99).unwrap(), "19.99");
        assert_eq!(number_json(1e300).unwrap(), "1e+300");
        assert!(number_json(f64::NAN).is_err());
    }

    #[test]
    fn durations_are_iso_8601() {
        assert_eq!(iso_duration(0.0), "PT0S");
        assert_eq!(iso_duration(1.5 / 24.0), "PT1H30M");
        assert_eq!(iso_duration(26.0 / 24.0), "PT26H");
        assert_eq!(iso_duration(-2.5 / 86_400.0), "-PT2.5S");
    }

    #[test]
    fn the_delimiter_is_sniffed_outside_quotes() {
        assert_eq!(sniff_delimiter(b"a,b,c\n1;2"), b',');
        assert_eq!(sniff_delimiter(b"\n\"a,b,c\";d;e\n"), b';');
        assert_eq!(sniff_delimiter(b"a\tb\n"), b'\t');
        assert_eq!(sniff_delimiter(b"single\n"), b',');
    }
}
