//! Every `TURNSTILE_*` setting is declared once, in the sources: one `env = "TURNSTILE_…"`
//! per variable, in the settings group that owns it, which every command that reads the
//! variable flattens (or borrows from, as the operator commands do with the limiter's terms).
//! A second declaration could drift from the first: another default, another parser, another
//! help text.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The directories whose Rust sources declare the command line.
const SOURCES: [&str; 5] = [
    "src",
    "crates/core/src",
    "crates/lab/src",
    "crates/ops/src",
    "crates/upload/src",
];

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The variables `source` declares (`env = "TURNSTILE_X"`, spaces around `=` optional), with
/// the line of each.
fn declarations(source: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for (i, _) in source.match_indices("\"TURNSTILE_") {
        let before = source[..i].trim_end();
        let Some(before) = before.strip_suffix('=') else {
            continue;
        };
        if !before.trim_end().ends_with("env") {
            continue;
        }
        let name = &source[i + 1..];
        let name = &name[..name.find('"').unwrap_or(name.len())];
        out.push((name.to_owned(), source[..i].lines().count()));
    }
    out
}

/// Every declaration of the workspace: variable -> where (`file:line`).
fn declared() -> BTreeMap<String, Vec<String>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in SOURCES {
        rust_files(&root.join(dir), &mut files);
    }
    files.sort();
    let mut by_variable: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for file in files {
        let source = std::fs::read_to_string(&file).expect("a readable source");
        let shown = file
            .strip_prefix(root)
            .unwrap_or(&file)
            .display()
            .to_string();
        for (name, line) in declarations(&source) {
            by_variable
                .entry(name)
                .or_default()
                .push(format!("{shown}:{line}"));
        }
    }
    by_variable
}

#[test]
fn the_scan_finds_a_declaration_in_any_spacing() {
    let source = "#[arg(long, env = \"TURNSTILE_A\")]\n#[arg(env=\"TURNSTILE_B\", long)]\n.env(\"TURNSTILE_C\", x)\n/// TURNSTILE_D\n";
    assert_eq!(
        declarations(source),
        [("TURNSTILE_A".to_owned(), 1), ("TURNSTILE_B".to_owned(), 2)]
    );
}

#[test]
fn every_turnstile_variable_is_declared_once() {
    let declared = declared();
    let total: usize = declared.values().map(Vec::len).sum();
    println!(
        "{} TURNSTILE_* variables, {total} declarations",
        declared.len()
    );
    for (name, at) in &declared {
        println!("{name} x{}: {}", at.len(), at.join(", "));
    }
    assert!(
        declared.len() >= 30,
        "the scan found only {} variables: it no longer sees the declarations",
        declared.len()
    );
    let twice: Vec<String> = declared
        .iter()
        .filter(|(_, at)| at.len() > 1)
        .map(|(name, at)| format!("{name} x{}: {}", at.len(), at.join(", ")))
        .collect();
    assert!(
        twice.is_empty(),
        "variables declared more than once (declare each in one settings group and flatten it \
         where a command reads it):\n{}",
        twice.join("\n")
    );
}
