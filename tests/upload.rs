//! Reading upload files into registration messages; no broker or Redis needed.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};
use turnstile_core::domain::{BatchId, Registration, SellerId};
use turnstile_upload::upload::{
    Columns, Format, MAX_ROWS, Upload, UploadError, read_upload, read_upload_with,
    read_weighed_upload,
};

/// A file in its own fresh directory under the system temp dir, removed on drop.
struct TempFile {
    dir: PathBuf,
    path: PathBuf,
}

impl TempFile {
    fn new(name: &str, bytes: &[u8]) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "turnstile-upload-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        Self { dir, path }
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(name)
}

fn seller(s: &str) -> SellerId {
    SellerId::parse(s).unwrap()
}

fn batch(s: &str) -> BatchId {
    BatchId::parse(s).unwrap()
}

fn read(path: &Path) -> Upload {
    read_upload(path, &seller("S-1001"), None, false).unwrap()
}

/// Each row's cost, in order.
fn row_costs(upload: &Upload) -> Vec<u32> {
    upload.rows.iter().map(|r| r.cost.units()).collect()
}

/// The upload at `path`, each message weighed by the column `cost_column`.
fn read_weighed(path: &Path, cost_column: &str) -> Upload {
    read_weighed_upload(
        path,
        &seller("S-1001"),
        Some(&batch("b")),
        false,
        Some(cost_column),
    )
    .unwrap()
}

fn read_bytes(name: &str, bytes: &[u8]) -> Result<Upload, UploadError> {
    let file = TempFile::new(name, bytes);
    read_upload(&file.path, &seller("S-1001"), Some(&batch("b")), false)
}

/// The product objects, parsed back from the bodies through the registration parser.
fn products(upload: &Upload) -> Vec<Value> {
    upload
        .rows
        .iter()
        .map(|r| {
            let registration = Registration::parse(&r.body, None).unwrap();
            serde_json::from_str(registration.product.get()).unwrap()
        })
        .collect()
}

fn product_text(upload: &Upload, index: usize) -> String {
    Registration::parse(&upload.rows[index].body, None)
        .unwrap()
        .product
        .get()
        .to_owned()
}

fn bad(upload: &Upload) -> Vec<(usize, String)> {
    upload
        .bad_rows
        .iter()
        .map(|b| (b.row, b.reason.clone()))
        .collect()
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(&format!(": {e}"));
        source = e.source();
    }
    text
}

/// A cell of a test workbook.
#[derive(Clone, Copy)]
enum Cell<'a> {
    Text(&'a str),
    Num(f64),
    Bool(bool),
    /// A number with a style: 1 = date, 2 = date-time, 3 = `[h]:mm:ss` duration, 4 = time.
    Styled(f64, u8),
    Error(&'a str),
    Empty,
    /// Text at an explicit cell reference (e.g. `XFD1048576`), wherever the row is.
    At(&'a str, &'a str),
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// A zip archive of uncompressed entries.
fn zip(entries: &[(&str, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, data) in entries {
        let (name, data) = (name.as_bytes(), data.as_bytes());
        let offset = out.len() as u32;
        let crc = crc32(data);
        let size = data.len() as u32;
        let common = |buf: &mut Vec<u8>| {
            for v in [20u16, 0, 0, 0, 0x21] {
                buf.extend_from_slice(&v.to_le_bytes());
            }
            for v in [crc, size, size] {
                buf.extend_from_slice(&v.to_le_bytes());
            }
            buf.extend_from_slice(&(name.len() as u16).to_le_bytes());
            buf.extend_from_slice(&0u16.to_le_bytes());
        };
        out.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        common(&mut out);
        out.extend_from_slice(name);
        out.extend_from_slice(data);
        central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        central.extend_from_slice(&20u16.to_le_bytes());
        common(&mut central);
        for v in [0u16, 0, 0] {
            central.extend_from_slice(&v.to_le_bytes());
        }
        central.extend_from_slice(&0u32.to_le_bytes());
        central.extend_from_slice(&offset.to_le_bytes());
        central.extend_from_slice(name);
    }
    let central_offset = out.len() as u32;
    out.extend_from_slice(&central);
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    for v in [0u16, 0, entries.len() as u16, entries.len() as u16] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&central_offset.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

const MAIN_NS: &str = "http://schemas.openxmlformats.org/spreadsheetml/2006/main";
const REL_NS: &str = "http://schemas.openxmlformats.org/officeDocument/2006/relationships";

/// A worksheet of a test workbook: its name and its rows, each at its 1-based row number.
type Sheet<'a> = (&'a str, &'a [(u32, &'a [Cell<'a>])]);

/// A minimal .xlsx workbook; `sheets` are (name, rows), each row placed at its 1-based row
/// number and starting at the 0-based column `first_col`.
fn workbook(sheets: &[Sheet], first_col: usize) -> Vec<u8> {
    let mut overrides = String::new();
    let mut sheet_list = String::new();
    let mut rels = String::new();
    let mut entries = Vec::new();
    for (i, (name, rows)) in sheets.iter().enumerate() {
        let n = i + 1;
        overrides.push_str(&format!(
            r#"<Override PartName="/xl/worksheets/sheet{n}.xml" ContentType="application/vnd.openxmlformats-officedocument.spreadsheetml.worksheet+xml"/>"#
        ));
        sheet_list.push_str(&format!(
            r#"<sheet name="{name}" sheetId="{n}" r:id="rId{n}"/>"#
        ));
        rels.push_str(&format!(
            r#"<Relationship Id="rId{n}" Type="{REL_NS}/worksheet" Target="worksheets/sheet{n}.xml"/>"#
        ));
        let mut data = String::new();
        for (r, cells) in rows.iter() {
            data.push_str(&format!(r#"<row r="{r}">"#));
            for (c, cell) in cells.iter().enumerate() {
                let at = format!("{}{r}", letter(first_col + c));
                data.push_str(&match cell {
                    Cell::Text(s) => format!(
                        r#"<c r="{at}" t="inlineStr"><is><t xml:space="preserve">{}</t></is></c>"#,
                        xml_escape(s)
                    ),
                    Cell::Num(v) => format!(r#"<c r="{at}"><v>{v}</v></c>"#),
                    Cell::Bool(b) => format!(r#"<c r="{at}" t="b"><v>{}</v></c>"#, u8::from(*b)),
                    Cell::Styled(v, s) => format!(r#"<c r="{at}" s="{s}"><v>{v}</v></c>"#),
                    Cell::Error(e) => format!(r#"<c r="{at}" t="e"><v>{e}</v></c>"#),
                    Cell::Empty => String::new(),
                    Cell::At(at, s) => format!(
                        r#"<c r="{at}" t="inlineStr"><is><t>{}</t></is></c>"#,
                        xml_escape(s)
                    ),
                });
            }
            data.push_str("</row>");
        }
        entries.push((
            format!("xl/worksheets/sheet{n}.xml"),
            format!(r#"<?xml version="1.0" encoding="UTF-8"?><worksheet xmlns="{MAIN_NS}"><sheetData>{data}</sheetData></worksheet>"#),
        ));
    }
    let mut files: Vec<(String, String)> = vec![
        (
            "[Content_Types].xml".into(),
            format!(
                r#"<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types"><Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/><Default Extension="xml" ContentType="application/xml"/><Override PartName="/xl/workbook.xml" ContentType="application/vnd.openxmlformats-officedocument.spreadsheetml.sheet.main+xml"/><Override PartName="/xl/styles.xml" ContentType="application/vnd.openxmlformats-officedocument.spreadsheetml.styles+xml"/>{overrides}</Types>"#
            ),
        ),
        (
            "_rels/.rels".into(),
            format!(
                r#"<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships"><Relationship Id="rId1" Type="{REL_NS}/officeDocument" Target="xl/workbook.xml"/></Relationships>"#
            ),
        ),
        (
            "xl/workbook.xml".into(),
            format!(
                r#"<?xml version="1.0" encoding="UTF-8"?><workbook xmlns="{MAIN_NS}" xmlns:r="{REL_NS}"><sheets>{sheet_list}</sheets></workbook>"#
            ),
        ),
        (
            "xl/_rels/workbook.xml.rels".into(),
            format!(
                r#"<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">{rels}<Relationship Id="rIdS" Type="{REL_NS}/styles" Target="styles.xml"/></Relationships>"#
            ),
        ),
        (
            "xl/styles.xml".into(),
            format!(
                r#"<?xml version="1.0" encoding="UTF-8"?><styleSheet xmlns="{MAIN_NS}"><numFmts count="1"><numFmt numFmtId="164" formatCode="[h]:mm:ss"/></numFmts><cellXfs count="5"><xf numFmtId="0"/><xf numFmtId="14" applyNumberFormat="1"/><xf numFmtId="22" applyNumberFormat="1"/><xf numFmtId="164" applyNumberFormat="1"/><xf numFmtId="21" applyNumberFormat="1"/></cellXfs></styleSheet>"#
            ),
        ),
    ];
    files.extend(entries);
    let files: Vec<(&str, String)> = files.iter().map(|(n, d)| (n.as_str(), d.clone())).collect();
    zip(&files)
}

fn letter(col: usize) -> char {
    (b'A' + col as u8) as char
}

fn xlsx(rows: &[&[Cell]]) -> Vec<u8> {
    let numbered: Vec<(u32, &[Cell])> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| (i as u32 + 1, *r))
        .collect();
    workbook(&[("Sheet1", &numbered)], 0)
}

#[test]
fn the_xlsx_example_reads_forty_products_with_typed_values() {
    let upload = read(&example("products.xlsx"));
    assert_eq!(upload.format, Format::Xlsx);
    assert_eq!(upload.rows.len(), 40);
    assert!(upload.bad_rows.is_empty(), "{:?}", upload.bad_rows);
    assert_eq!(upload.rows[0].row, 2);
    assert_eq!(upload.rows[39].row, 41);
    assert_eq!(
        product_text(&upload, 0),
        r#"{"sku":"TS-1001","title":"Organic Cotton T-Shirt, White, M","brand":"Northwear","category":"Apparel > T-Shirts","price":19.99,"currency":"EUR","stock":120,"ean":"4006381333931","weight_kg":0.18,"active":true,"available_from":"2024-03-01"}"#
    );
    let products = products(&upload);
    let by_sku = |sku: &str| {
        products
            .iter()
            .find(|p| p["sku"] == sku)
            .unwrap_or_else(|| panic!("{sku} missing"))
    };
    assert_eq!(by_sku("BK-4002")["active"], json!(false));
    assert_eq!(by_sku("BK-4002")["stock"], json!(0));
    assert_eq!(by_sku("CF-7101")["weight_kg"], json!(1));
    assert!(by_sku("CK-6003").get("brand").is_none());
    assert!(by_sku("TE-7001").get("available_from").is_none());
    assert_eq!(by_sku("SB-5002")["title"], json!("Down Sleeping Bag -5 °C"));
}

#[test]
fn the_csv_example_reads_the_same_products_with_every_value_a_string() {
    let csv = read(&example("products.csv"));
    assert_eq!(csv.format, Format::Csv);
    assert_eq!(csv.rows.len(), 40);
    assert!(csv.bad_rows.is_empty(), "{:?}", csv.bad_rows);
    assert_eq!(csv.rows[0].row, 2);
    assert_eq!(
        product_text(&csv, 0),
        r#"{"sku":"TS-1001","title":"Organic Cotton T-Shirt, White, M","brand":"Northwear","category":"Apparel > T-Shirts","price":"19.99","currency":"EUR","stock":"120","ean":"4006381333931","weight_kg":"0.18","active":"true","available_from":"2024-03-01"}"#
    );
    let xlsx = read(&example("products.xlsx"));
    let skus =
        |u: &Upload| -> Vec<Value> { products(u).iter().map(|p| p["sku"].clone()).collect() };
    assert_eq!(skus(&csv), skus(&xlsx));
    let ean = &products(&csv)[16]["ean"];
    assert_eq!(ean, &json!("0885909950805"), "leading zero kept");
}

#[test]
fn the_jsonl_example_forwards_each_line_verbatim() {
    let upload = read(&example("products.jsonl"));
    assert_eq!(upload.format, Format::Jsonl);
    assert_eq!(upload.rows.len(), 5);
    let text = std::fs::read_to_string(example("products.jsonl")).unwrap();
    let first = text.lines().next().unwrap();
    assert_eq!(product_text(&upload, 0), first);
    assert_eq!(upload.rows[0].row, 1);
    assert_eq!(products(&upload)[0]["price"], json!(19.99));
}

#[test]
fn xlsx_cells_keep_numbers_booleans_and_dates_and_drop_empty_cells() {
    use Cell::*;
    let bytes = xlsx(&[
        &[
            Text(" sku "),
            Text("price"),
            Text("stock"),
            Text("active"),
            Text("note"),
            Text("released"),
            Text("updated"),
            Text("prep"),
            Text("opens"),
            Text("big"),
        ],
        &[
            Text("A-1"),
            Num(19.5),
            Num(3.0),
            Bool(true),
            Empty,
            Styled(45352.0, 1),
            Styled(45352.75, 2),
            Styled(1.5 / 24.0, 3),
            Styled(0.375, 4),
            Num(12345678901.0),
        ],
        &[Text("A-2"), Num(-0.25), Num(0.0), Bool(false), Text("   ")],
        &[Empty, Empty, Empty],
        &[Text("A-3"), Text("")],
        &[],
        &[],
    ]);
    let upload = read_bytes("cells.xlsx", &bytes).unwrap();
    assert!(upload.bad_rows.is_empty(), "{:?}", upload.bad_rows);
    assert_eq!(
        product_text(&upload, 0),
        r#"{"sku":"A-1","price":19.5,"stock":3,"active":true,"released":"2024-03-01","updated":"2024-03-01T18:00:00","prep":"PT1H30M","opens":"09:00:00","big":12345678901}"#
    );
    assert_eq!(
        product_text(&upload, 1),
        r#"{"sku":"A-2","price":-0.25,"stock":0,"active":false}"#
    );
    assert_eq!(product_text(&upload, 2), r#"{"sku":"A-3"}"#);
    let rows: Vec<usize> = upload.rows.iter().map(|r| r.row).collect();
    assert_eq!(rows, [2, 3, 5], "the empty row 4 is skipped, not bad");
}

#[test]
fn xlsx_bad_rows_are_reported_with_the_row_numbers_the_seller_sees() {
    use Cell::*;
    let header: &[Cell] = &[Text("sku"), Text("price"), Empty];
    let rows: &[(u32, &[Cell])] = &[
        (3, header),
        (4, &[Text("B-1"), Num(1.0)]),
        (5, &[Text("B-2"), Error("#N/A")]),
        (7, &[Text("B-3"), Num(2.0), Text("stray")]),
        (8, &[Text("B-4"), Num(4.0), Empty]),
    ];
    let bytes = workbook(&[("Products", rows), ("Other", &[(1, &[Text("x")])])], 1);
    let upload = read_bytes("offset.xlsx", &bytes).unwrap();
    let rows: Vec<usize> = upload.rows.iter().map(|r| r.row).collect();
    assert_eq!(rows, [4, 8]);
    assert_eq!(
        bad(&upload),
        [
            (5, "column C holds the error #N/A".to_owned()),
            (7, "column D holds a value but has no header".to_owned()),
        ]
    );
}

#[test]
fn an_xlsx_header_with_an_empty_or_repeated_name_refuses_the_file() {
    use Cell::*;
    let gap = xlsx(&[
        &[Text("sku"), Empty, Text("price")],
        &[Text("A"), Num(1.0), Num(2.0)],
    ]);
    let error = read_bytes("gap.xlsx", &gap).unwrap_err();
    assert!(matches!(error, UploadError::Header { .. }), "{error:?}");
    assert!(
        error.to_string().contains("header column B: is empty"),
        "{error}"
    );

    let repeated = xlsx(&[&[Text("sku"), Text("price"), Text("sku ")], &[Text("A")]]);
    let error = read_bytes("repeated.xlsx", &repeated).unwrap_err();
    assert!(
        error
            .to_string()
            .contains(r#"header column C: repeats "sku" of column A"#),
        "{error}"
    );
}

#[test]
fn broken_or_empty_workbooks_are_refused_with_a_clear_error() {
    let error = read_bytes("none.xlsx", &workbook(&[], 0)).unwrap_err();
    assert!(matches!(error, UploadError::NoSheets { .. }), "{error:?}");
    let error = read_bytes("blank.xlsx", &xlsx(&[])).unwrap_err();
    assert!(matches!(error, UploadError::Empty { .. }), "{error:?}");
    let error = read_bytes("header-only.xlsx", &xlsx(&[&[Cell::Text("sku")]])).unwrap_err();
    assert!(matches!(error, UploadError::NoProducts { .. }), "{error:?}");
    let error = read_bytes("zero.xlsx", b"").unwrap_err();
    assert!(matches!(error, UploadError::Empty { .. }), "{error:?}");
    let error = read_bytes("text.xlsx", b"sku,price\nA,1\n").unwrap_err();
    assert!(matches!(error, UploadError::Xlsx { .. }), "{error:?}");
    assert!(error_chain(&error).contains("text.xlsx: not a readable .xlsx workbook"));
}

#[test]
fn csv_bad_rows_are_reported_with_line_numbers_and_skipped() {
    let text = "\u{feff}sku,title,price\n\
                A-1,Mug,9.90\n\
                A-2,Cup\n\
                \n\
                ,,\n\
                A-3,\"Two\nlines\",3\n\
                A-4,Pen,1,extra\n\
                A-5,  ,\n";
    let upload = read_bytes("bad.csv", text.as_bytes()).unwrap();
    assert_eq!(
        bad(&upload),
        [
            (3, "has 2 cells, the header has 3".to_owned()),
            (8, "has 4 cells, the header has 3".to_owned()),
        ]
    );
    let rows: Vec<usize> = upload.rows.iter().map(|r| r.row).collect();
    assert_eq!(rows, [2, 6, 9]);
    assert_eq!(
        products(&upload),
        [
            json!({"sku": "A-1", "title": "Mug", "price": "9.90"}),
            json!({"sku": "A-3", "title": "Two\nlines", "price": "3"}),
            json!({"sku": "A-5"}),
        ]
    );
}

#[test]
fn csv_with_semicolons_and_non_utf8_cells_is_read_cell_by_cell() {
    let mut bytes = b"sku;title;price\nA-1;\"Tea; green\";4,50\nA-2;Caf".to_vec();
    bytes.extend_from_slice(b"\xe9;3\n");
    let upload = read_bytes("semi.csv", &bytes).unwrap();
    assert_eq!(
        products(&upload),
        [json!({"sku": "A-1", "title": "Tea; green", "price": "4,50"})]
    );
    assert_eq!(
        bad(&upload),
        [(
            3,
            "column 2 is not valid UTF-8 (save the file as CSV UTF-8)".to_owned()
        )]
    );
}

#[test]
fn a_csv_header_with_an_empty_or_repeated_name_refuses_the_file() {
    let error = read_bytes("gap.csv", b"sku,,price\nA,1,2\n").unwrap_err();
    assert!(
        error.to_string().contains("header column 2: is empty"),
        "{error}"
    );
    let error = read_bytes("dup.csv", b"sku,Price,price,Price\nA,1,2,3\n").unwrap_err();
    assert!(
        error
            .to_string()
            .contains(r#"header column 4: repeats "Price" of column 2"#),
        "{error}"
    );
    let trailing = read_bytes("trailing.csv", b"sku,price,\nA,1,\nB,2,x\n").unwrap();
    assert_eq!(products(&trailing), [json!({"sku": "A", "price": "1"})]);
    assert_eq!(
        bad(&trailing),
        [(3, "column 3 holds a value but has no header".to_owned())]
    );
}

#[test]
fn empty_files_headerless_files_and_header_only_files_are_refused() {
    for (name, bytes) in [
        ("empty.csv", &b""[..]),
        ("blank.csv", b"\n \n"),
        ("empty.jsonl", b""),
        ("blank.jsonl", b"\n  \n\r\n"),
    ] {
        let error = read_bytes(name, bytes).unwrap_err();
        assert!(
            matches!(error, UploadError::Empty { .. }),
            "{name}: {error:?}"
        );
        assert!(error.to_string().contains(name), "{error}");
    }
    let error = read_bytes("commas.csv", b",,\nA,1,2\n").unwrap_err();
    assert!(matches!(error, UploadError::NoHeader { .. }), "{error:?}");
    let blank_header = xlsx(&[&[Cell::Text(" ")], &[Cell::Text("A")]]);
    let error = read_bytes("blank-header.xlsx", &blank_header).unwrap_err();
    assert!(matches!(error, UploadError::NoHeader { .. }), "{error:?}");
    let error = read_bytes("header.csv", b"sku,price\n\n,\n").unwrap_err();
    assert!(matches!(error, UploadError::NoProducts { .. }), "{error:?}");
}

#[test]
fn jsonl_lines_that_are_not_objects_are_reported_and_skipped() {
    let text = "{\"sku\": \"J-1\", \"price\": 1.50}\r\n\
                \n\
                [1, 2]\n\
                {\"sku\": \"J-2\"\n\
                \"just a string\"\n\
                {\"sku\": \"J-3\", \"tags\": [\"a\"], \"dims\": {\"w\": 1}}\n\
                {} trailing\n";
    let upload = read_bytes("mixed.ndjson", text.as_bytes()).unwrap();
    assert_eq!(upload.format, Format::Jsonl);
    let rows: Vec<usize> = upload.rows.iter().map(|r| r.row).collect();
    assert_eq!(rows, [1, 6]);
    assert_eq!(product_text(&upload, 0), r#"{"sku": "J-1", "price": 1.50}"#);
    let bad = bad(&upload);
    let bad_rows: Vec<usize> = bad.iter().map(|(row, _)| *row).collect();
    assert_eq!(bad_rows, [3, 4, 5, 7]);
    assert!(bad[0].1.contains("not a JSON object"), "{bad:?}");
    assert!(bad[1].1.starts_with("invalid JSON at column"), "{bad:?}");
    assert!(bad[2].1.contains("not a JSON object"), "{bad:?}");
    assert!(bad[3].1.contains("trailing characters"), "{bad:?}");
}

#[test]
fn strict_refuses_a_file_with_bad_rows_and_lists_them() {
    let file = TempFile::new("strict.csv", b"sku,price\nA,1\nB\nC,3\nD,4,5\n");
    let error = read_upload(&file.path, &seller("S"), None, true).unwrap_err();
    let UploadError::Strict { bad_rows, .. } = &error else {
        panic!("{error:?}");
    };
    assert_eq!(bad_rows.len(), 2);
    let message = error.to_string();
    assert!(message.contains("strict.csv"), "{message}");
    assert!(message.contains("2 bad rows"), "{message}");
    assert!(
        message.contains("row 3: has 1 cell, the header has 2"),
        "{message}"
    );
    assert!(message.contains("row 5: has 3 cells"), "{message}");

    let clean = read_upload(&example("products.csv"), &seller("S"), None, true).unwrap();
    assert_eq!(clean.rows.len(), 40);
}

#[test]
fn strict_lists_only_the_first_ten_bad_rows() {
    let mut text = String::from("sku,price\n");
    for i in 0..25 {
        text.push_str(&format!("only-{i}\n"));
    }
    let file = TempFile::new("many.csv", text.as_bytes());
    let error = read_upload(&file.path, &seller("S"), None, true).unwrap_err();
    let message = error.to_string();
    assert!(message.contains("row 11:"), "{message}");
    assert!(!message.contains("row 12:"), "{message}");
    assert!(message.ends_with("and 15 more"), "{message}");
}

#[test]
fn a_missing_file_is_an_error_naming_the_path() {
    let path = std::env::temp_dir().join("turnstile-upload-does-not-exist/products.csv");
    let error = read_upload(&path, &seller("S"), None, false).unwrap_err();
    let UploadError::Read { source, .. } = &error else {
        panic!("{error:?}");
    };
    assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
    assert!(
        error.to_string().contains(&path.display().to_string()),
        "{error}"
    );
}

#[test]
fn only_xlsx_csv_and_jsonl_extensions_are_accepted_in_any_case() {
    for name in [
        "products.xls",
        "products.txt",
        "products",
        "products.json",
        ".csv",
    ] {
        let file = TempFile::new(name, b"sku\nA\n");
        let error = read_upload(&file.path, &seller("S"), None, false).unwrap_err();
        assert!(
            matches!(error, UploadError::UnsupportedFormat { .. }),
            "{name}"
        );
        let message = error.to_string();
        assert!(message.contains(name), "{message}");
        assert!(
            message.contains(".xlsx") && message.contains(".csv") && message.contains(".jsonl"),
            "{message}"
        );
    }
    let upper = read_bytes("PRODUCTS.CSV", b"sku\nA\n").unwrap();
    assert_eq!(upper.format, Format::Csv);
    assert_eq!(
        Format::from_path(Path::new("a.NDJSON")).unwrap(),
        Format::Jsonl
    );
    assert_eq!(
        Format::from_path(Path::new("a.Xlsx")).unwrap(),
        Format::Xlsx
    );
}

#[test]
fn the_batch_is_derived_from_the_file_name_and_contents_unless_given() {
    let bytes = std::fs::read(example("products.csv")).unwrap();
    let a = TempFile::new("spring-catalog.csv", &bytes);
    let b = TempFile::new("spring-catalog.csv", &bytes);
    let first = read_upload(&a.path, &seller("S"), None, false).unwrap();
    let again = read_upload(&b.path, &seller("S"), None, false).unwrap();
    assert_eq!(first.batch_id, again.batch_id);
    let id = first.batch_id.as_str();
    let digest = id.strip_prefix("spring-catalog-").unwrap();
    assert_eq!(digest.len(), 12);
    assert!(
        digest
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
    );

    let mut edited = bytes.clone();
    edited.extend_from_slice(b"ZZ-1,Extra,,,1,EUR,1,,,true,\n");
    let c = TempFile::new("spring-catalog.csv", &edited);
    let changed = read_upload(&c.path, &seller("S"), None, false).unwrap();
    assert_ne!(changed.batch_id, first.batch_id);

    let given = read_upload(&a.path, &seller("S"), Some(&batch("B-7")), false).unwrap();
    assert_eq!(given.batch_id.as_str(), "B-7");
}

#[test]
fn message_ids_are_stable_across_reads_and_change_with_seller_batch_or_row() {
    let path = example("products.xlsx");
    let ids = |seller_id: &str, batch_id: Option<&str>| -> Vec<String> {
        let b = batch_id.map(batch);
        read_upload(&path, &seller(seller_id), b.as_ref(), false)
            .unwrap()
            .rows
            .iter()
            .map(|r| r.message_id.as_str().to_owned())
            .collect()
    };
    let first = ids("S-1001", None);
    assert_eq!(first, ids("S-1001", None));
    assert!(
        first
            .iter()
            .all(|id| id.len() == 34 && id.starts_with("u-"))
    );
    let mut unique = first.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), first.len());

    let other_seller = ids("S-2002", None);
    let other_batch = ids("S-1001", Some("B-2"));
    for (i, id) in first.iter().enumerate() {
        assert_ne!(id, &other_seller[i]);
        assert_ne!(id, &other_batch[i]);
    }
}

#[test]
fn identical_rows_get_distinct_ids_and_an_edit_changes_only_that_row() {
    let original = read_bytes("same.csv", b"sku,price\nA,1\nA,1\nB,2\n").unwrap();
    let ids: Vec<_> = original.rows.iter().map(|r| r.message_id.clone()).collect();
    assert_ne!(ids[0], ids[1]);
    let edited = read_bytes("same.csv", b"sku,price\nA,1\nA,1\nB,3\n").unwrap();
    let edited_ids: Vec<_> = edited.rows.iter().map(|r| r.message_id.clone()).collect();
    assert_eq!(ids[..2], edited_ids[..2]);
    assert_ne!(ids[2], edited_ids[2]);
}

#[test]
fn every_body_parses_as_a_registration_with_the_same_ids() {
    for name in ["products.xlsx", "products.csv", "products.jsonl"] {
        let upload = read(&example(name));
        for row in &upload.rows {
            let registration = Registration::parse(&row.body, None).unwrap();
            assert_eq!(registration.message_id, row.message_id);
            assert_eq!(registration.seller_id, upload.seller_id);
            assert_eq!(registration.batch_id.as_ref(), Some(&upload.batch_id));
            let body: Value = serde_json::from_slice(&row.body).unwrap();
            assert_eq!(body["message_id"], json!(row.message_id.as_str()));
        }
    }
}

#[test]
fn unusual_seller_and_batch_ids_are_escaped_in_the_body() {
    let file = TempFile::new("t.jsonl", br#"{"sku":"Q"}"#);
    let odd_seller = seller(r#"{"größe": "a\b"}"#);
    let odd_batch = batch("batch \"quoted\" \\ 🙂");
    let upload = read_upload(&file.path, &odd_seller, Some(&odd_batch), false).unwrap();
    let registration = Registration::parse(&upload.rows[0].body, None).unwrap();
    assert_eq!(registration.seller_id, odd_seller);
    assert_eq!(registration.batch_id, Some(odd_batch));
    assert_eq!(registration.product.get(), r#"{"sku":"Q"}"#);
}

#[test]
fn a_product_too_large_for_one_message_is_a_bad_row() {
    let big = "x".repeat(turnstile_core::domain::MAX_BODY_BYTES);
    let text = format!("sku,blob\nA,small\nB,{big}\n");
    let upload = read_bytes("big.csv", text.as_bytes()).unwrap();
    assert_eq!(upload.rows.len(), 1);
    assert_eq!(upload.bad_rows[0].row, 3);
    assert!(upload.bad_rows[0].reason.contains("byte limit"));
}

#[test]
fn files_with_more_than_the_row_limit_are_refused() {
    let mut text = String::from("sku\n");
    for i in 0..MAX_ROWS {
        text.push_str(&format!("S{i}\n"));
    }
    let at_limit = read_bytes("limit.csv", text.as_bytes()).unwrap();
    assert_eq!(at_limit.rows.len(), MAX_ROWS);

    text.push_str("one-too-many\n");
    let error = read_bytes("over.csv", text.as_bytes()).unwrap_err();
    assert!(
        matches!(error, UploadError::TooManyRows { .. }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("more than 100000 rows"),
        "{error}"
    );
}

#[test]
fn a_spreadsheet_bomb_is_refused_before_anything_large_is_allocated() {
    // One far cell: a dense reader would allocate 2^20 rows x 2^14 columns (512 GiB).
    let far = workbook(
        &[(
            "Sheet1",
            &[
                (1, &[Cell::Text("sku")][..]),
                (2, &[Cell::Text("A-1")][..]),
                (1_048_576, &[Cell::At("XFD1048576", "far")][..]),
            ],
        )],
        0,
    );
    let error = read_bytes("bomb.xlsx", &far).unwrap_err();
    assert!(matches!(error, UploadError::TooBig { .. }), "{error:?}");
    assert!(error.to_string().contains("column XFD"), "{error}");
    // A far row in a used column costs nothing either: it is one more product.
    let far_row = workbook(
        &[(
            "Sheet1",
            &[
                (1, &[Cell::Text("sku")][..]),
                (1_048_576, &[Cell::At("A1048576", "last")][..]),
            ],
        )],
        0,
    );
    let upload = read_bytes("far-row.xlsx", &far_row).unwrap();
    assert_eq!(upload.rows.len(), 1);
    assert_eq!(upload.rows[0].row, 1_048_576);
}

#[test]
fn a_file_over_the_size_limit_is_refused_without_reading_it() {
    let file = TempFile::new("huge.csv", b"sku\n");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file.path)
        .unwrap()
        .set_len(turnstile_upload::upload::MAX_FILE_BYTES + 1)
        .unwrap();
    let error = read_upload(&file.path, &seller("S-1001"), None, false).unwrap_err();
    assert!(matches!(error, UploadError::TooBig { .. }), "{error:?}");
    assert!(error.to_string().contains("larger than 64 MiB"), "{error}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..Default::default()
    })]

    /// Whatever a file holds, reading it gives products, bad rows or one clear refusal: never a
    /// panic or an abort.
    #[test]
    fn any_file_is_read_or_refused_without_panicking(
        bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2048),
        ext in proptest::sample::select(vec!["csv", "jsonl", "xlsx"]),
    ) {
        let _ = read_bytes(&format!("fuzz.{ext}"), &bytes);
    }

    /// Workbooks with arbitrary cells at arbitrary places (far ones included).
    #[test]
    fn any_workbook_layout_is_read_or_refused_without_panicking(
        cells in proptest::collection::vec((1u32..1_048_577, 0u32..16_384, "[a-z0-9 ]{0,8}"), 0..12),
    ) {
        let refs: Vec<(u32, String, String)> = cells
            .iter()
            .map(|(r, c, t)| (*r, format!("{}{r}", turnstile_upload::upload::column_letters(*c as usize)), t.clone()))
            .collect();
        let mut rows: Vec<(u32, Vec<Cell>)> = Vec::new();
        let mut sorted: Vec<&(u32, String, String)> = refs.iter().collect();
        sorted.sort_by_key(|(r, at, _)| (*r, at.len(), at.clone()));
        for (r, at, text) in sorted {
            match rows.last_mut() {
                Some((row, cells)) if row == r => cells.push(Cell::At(at, text)),
                _ => rows.push((*r, vec![Cell::At(at, text)])),
            }
        }
        let rows: Vec<(u32, &[Cell])> = rows.iter().map(|(r, c)| (*r, c.as_slice())).collect();
        let _ = read_bytes("layout.xlsx", &workbook(&[("Sheet1", &rows)], 0));
    }
}

#[test]
fn a_cost_column_weighs_each_message_and_a_row_without_a_whole_cost_is_bad() {
    let csv = "sku,images\nA,1\nB,3\nC,\nD,two\nE,0\nF,10001\nG, 7 \nH,2.5\n";
    let file = TempFile::new("weighed.csv", csv.as_bytes());
    let weighed = |column: &str| read_weighed(&file.path, column);
    let upload = weighed("images");
    let costs: Vec<u32> = upload
        .rows
        .iter()
        .map(|r| Registration::parse(&r.body, None).unwrap().cost.units())
        .collect();
    assert_eq!(costs, [1, 3, 7]);
    assert_eq!(row_costs(&upload), costs, "the row's cost is the body's");
    assert_eq!(upload.units(), 11);
    // The field stays in the product, forwarded verbatim.
    assert_eq!(products(&upload)[1], json!({"sku": "B", "images": "3"}));
    let must = "its \"images\" must be a whole number from 1 to 10000";
    assert_eq!(
        bad(&upload),
        [
            (4, "it has no \"images\" (the cost column)".to_owned()),
            (5, must.to_owned()),
            (6, must.to_owned()),
            (7, must.to_owned()),
            (9, must.to_owned()),
        ]
    );
    // Without a cost column every message costs 1 and the body has no `cost`.
    let plain = read_upload(&file.path, &seller("S-1001"), Some(&batch("b")), false).unwrap();
    assert_eq!(plain.rows.len(), 8);
    assert_eq!(plain.units(), 8);
    let body: Value = serde_json::from_slice(&plain.rows[1].body).unwrap();
    assert_eq!(body.get("cost"), None);
    // A column no row has makes every row bad.
    assert_eq!(weighed("weight").rows.len(), 0);
}

#[test]
fn an_xlsx_cost_column_takes_whole_numbers_from_number_cells() {
    let bytes = xlsx(&[
        &[Cell::Text("sku"), Cell::Text("cost")],
        &[Cell::Text("A"), Cell::Num(2.0)],
        &[Cell::Text("B"), Cell::Num(2.5)],
        &[Cell::Text("C"), Cell::Text("4")],
    ]);
    let file = TempFile::new("weighed.xlsx", &bytes);
    let upload = read_weighed(&file.path, "cost");
    assert_eq!(row_costs(&upload), [2, 4]);
    assert_eq!(bad(&upload).len(), 1, "{:?}", bad(&upload));
    assert_eq!(bad(&upload)[0].0, 3);
}

#[test]
fn a_product_key_column_names_each_rows_product_and_a_version_column_orders_them() {
    let csv = "sku,rev,price\nA-1,3,10\n42,4,11\n,5,12\nB-2,x,13\nC-3,,14\nD-4, 7 ,15\n";
    let file = TempFile::new("keyed.csv", csv.as_bytes());
    let read = |key: Option<&str>, version: Option<&str>| {
        let columns = Columns {
            product_key: key,
            version,
            ..Columns::default()
        };
        read_upload_with(
            &file.path,
            &seller("S-1001"),
            Some(&batch("b")),
            false,
            columns,
        )
        .unwrap()
    };
    let keyed = read(Some("sku"), Some("rev"));
    let carried: Vec<(String, Option<i64>)> = keyed
        .rows
        .iter()
        .map(|r| {
            let (key, version) = Registration::parse(&r.body, None)
                .unwrap()
                .product_key
                .unwrap();
            (key.as_str().to_owned(), version.map(|v| v.get()))
        })
        .collect();
    assert_eq!(
        carried,
        [
            ("A-1".to_owned(), Some(3)),
            ("42".to_owned(), Some(4)),
            ("D-4".to_owned(), Some(7))
        ]
    );
    // The fields stay in the product, forwarded verbatim.
    assert_eq!(
        products(&keyed)[0],
        json!({"sku": "A-1", "rev": "3", "price": "10"})
    );
    let must = "its \"rev\" must be a whole number of at most 15 digits";
    assert_eq!(
        bad(&keyed),
        [
            (4, "it has no \"sku\" (the product key column)".to_owned()),
            (5, must.to_owned()),
            (6, "it has no \"rev\" (the version column)".to_owned()),
        ]
    );
    // A product key alone: no version in the body; without either, the body is as before.
    let unversioned = read(Some("sku"), None);
    assert_eq!(unversioned.rows.len(), 5);
    let body: Value = serde_json::from_slice(&unversioned.rows[0].body).unwrap();
    assert_eq!(
        (body["product_key"].as_str(), body.get("version")),
        (Some("A-1"), None)
    );
    let plain = read(None, None);
    let body: Value = serde_json::from_slice(&plain.rows[0].body).unwrap();
    assert_eq!(body.get("product_key"), None);
}
