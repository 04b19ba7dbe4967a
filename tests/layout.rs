//! The layout a newcomer reads: no module of a crate reaches itself through others. Every
//! `crate::…` and `super::…` path of a file, and every path into one of its own child modules
//! (`budget::Spend` in `broker/mod.rs`), in `use` lines and in code, is a dependency on the
//! deepest module of that path that is a file. Test-only code is left out, and so is a
//! parent's `pub use` of its children (a facade is not a dependency). A circle of files
//! depending on each other fails the test, naming them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module of a crate, as the path of its file under `src/` (`permit/ask`; `` for lib.rs).
type Module = Vec<String>;

fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

fn module_of(src: &Path, file: &Path) -> Module {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Module = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The text of a file without its comments, its `pub use` lines, the paths of its
/// visibilities (`pub(in crate::permit)` names a scope, not a dependency) and its test-only modules
/// (`#[cfg(test)]` on a `mod … {` block, which runs to the end of the file in this code base).
fn code_of(text: &str) -> String {
    let test_block = text.match_indices("#[cfg(test)]\n").find(|(at, mark)| {
        let next = text[at + mark.len()..].lines().next().unwrap_or("");
        next.contains("mod ") && next.trim_end().ends_with('{')
    });
    let text = test_block.map_or(text, |(at, _)| &text[..at]);
    let mut code = Vec::new();
    let mut in_facade = false;
    for line in text.lines() {
        let line = line.split("//").next().unwrap_or("");
        let trimmed = line.trim_start();
        let re_export = trimmed.starts_with("pub use ")
            || trimmed
                .strip_prefix("pub(")
                .and_then(|rest| rest.split_once(')'))
                .is_some_and(|(_, rest)| rest.starts_with(" use "));
        if re_export {
            in_facade = !trimmed.trim_end().ends_with(';');
            continue;
        }
        if in_facade {
            in_facade = !trimmed.trim_end().ends_with(';');
            continue;
        }
        code.push(line);
    }
    let mut code = code.join("\n");
    while let Some(at) = code.find("pub(in ") {
        let end = code[at..].find(')').map_or(code.len(), |e| at + e + 1);
        code.replace_range(at..end, "pub");
    }
    code
}

/// The child modules a file declares (`mod budget;`, `pub mod ladder;`), test-only ones left out.
fn children_of(text: &str) -> Vec<String> {
    let mut children = Vec::new();
    let mut test_only = false;
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed == "#[cfg(test)]" {
            test_only = true;
            continue;
        }
        let declared = trimmed
            .strip_prefix("pub(crate) mod ")
            .or_else(|| trimmed.strip_prefix("pub mod "))
            .or_else(|| trimmed.strip_prefix("mod "))
            .and_then(|rest| rest.strip_suffix(';'));
        if let (Some(name), false) = (declared, test_only) {
            children.push(name.to_owned());
        }
        if !trimmed.starts_with("#[") {
            test_only = false;
        }
    }
    children
}

/// Every path in `code` that starts with `crate::`, `super::`, `self::` or one of `children`
/// followed by `::`, grouped uses (`crate::a::{b, c::d}`) expanded; a child's path is
/// returned as `self::child::…`.
fn paths_in(code: &str, children: &[String]) -> Vec<Vec<String>> {
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let bytes = code.as_bytes();
    let at = |i: usize| &bytes[i.min(bytes.len())..];
    let mut paths = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let free = i == 0 || !(is_ident(bytes[i - 1]) || bytes[i - 1] == b':');
        let start = ["crate", "super", "self"]
            .into_iter()
            .chain(children.iter().map(String::as_str))
            .find(|p| {
                free && at(i).starts_with(p.as_bytes()) && at(i + p.len()).starts_with(b"::")
            });
        let Some(start) = start else {
            i += 1;
            continue;
        };
        let mut segments = match start {
            "crate" | "super" | "self" => vec![start.to_owned()],
            child => vec!["self".to_owned(), child.to_owned()],
        };
        let mut j = i + start.len();
        loop {
            let from = j;
            while j < bytes.len() && is_ident(bytes[j]) {
                j += 1;
            }
            if j > from {
                segments.push(String::from_utf8_lossy(&bytes[from..j]).into_owned());
            }
            if at(j).starts_with(b"::{") {
                let close = (j..bytes.len())
                    .find(|&k| bytes[k] == b'}')
                    .unwrap_or(bytes.len());
                for item in String::from_utf8_lossy(&bytes[j + 3..close]).split(',') {
                    let item = item.split(" as ").next().unwrap_or("").trim();
                    let mut path = segments.clone();
                    path.extend(
                        item.split("::")
                            .filter(|s| !s.is_empty() && s.bytes().all(is_ident))
                            .map(str::to_owned),
                    );
                    paths.push(path);
                }
                j = close;
                break;
            }
            if at(j).starts_with(b"::") {
                j += 2;
                continue;
            }
            paths.push(segments);
            break;
        }
        i = j.max(i + 1);
    }
    paths
}

/// The modules each module of the crate at `src` depends on.
fn dependencies(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeMap<Module, PathBuf> = files
        .iter()
        .map(|f| (module_of(src, f), f.clone()))
        .collect();
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(file).unwrap();
        let code = code_of(&text);
        let targets = edges.entry(module.clone()).or_default();
        for path in paths_in(&code, &children_of(&text)) {
            let segments: Module = if path[0] == "crate" {
                path[1..].to_vec()
            } else if path[0] == "self" {
                let mut base = module.clone();
                base.extend(path[1..].iter().cloned());
                base
            } else {
                let mut base = module.clone();
                base.pop();
                let mut rest = &path[1..];
                while rest.first().is_some_and(|s| s == "super") {
                    base.pop();
                    rest = &rest[1..];
                }
                base.extend(rest.iter().cloned());
                base
            };
            let deepest = (0..=segments.len())
                .rev()
                .map(|n| segments[..n].to_vec())
                .find(|m| modules.contains_key(m))
                .unwrap_or_default();
            if &deepest != module {
                targets.insert(deepest);
            }
        }
    }
    edges
}

/// The circles among `edges`: strongly connected components of more than one module.
fn circles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    let reaches = |from: &Module| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(m) = stack.pop() {
            for next in edges.get(&m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    stack.push(next.clone());
                }
            }
        }
        seen
    };
    let reach: BTreeMap<&Module, BTreeSet<Module>> =
        edges.keys().map(|m| (m, reaches(m))).collect();
    let mut placed = BTreeSet::new();
    let mut found = Vec::new();
    for (module, from) in &reach {
        if placed.contains(*module) || !from.contains(*module) {
            continue;
        }
        let circle: Vec<Module> = from
            .iter()
            .filter(|other| reach.get(other).is_some_and(|r| r.contains(*module)))
            .cloned()
            .collect();
        placed.extend(circle.iter().cloned());
        if circle.len() > 1 {
            found.push(circle);
        }
    }
    found
}

/// A module as its file reads to a person: `permit/ask`, `lib` for the crate's root.
fn shown(module: &Module) -> String {
    if module.is_empty() {
        "lib".into()
    } else {
        module.join("/")
    }
}

#[test]
fn no_module_reaches_itself_through_others() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut all = Vec::new();
    for krate in std::fs::read_dir(root.join("crates")).unwrap() {
        let src = krate.unwrap().path().join("src");
        let edges = dependencies(&src);
        let found = circles(&edges);
        let name = src.parent().unwrap().file_name().unwrap().to_string_lossy();
        println!("{name}: {} files, {} circles", edges.len(), found.len());
        for circle in found {
            let files: Vec<String> = circle.iter().map(shown).collect();
            let within: Vec<String> = circle
                .iter()
                .flat_map(|from| {
                    edges[from]
                        .iter()
                        .filter(|to| circle.contains(to))
                        .map(move |to| format!("{} -> {}", shown(from), shown(to)))
                })
                .collect();
            all.push(format!(
                "{name}: {} ({})",
                files.join(" <-> "),
                within.join(", ")
            ));
        }
    }
    assert!(all.is_empty(), "modules that import each other: {all:#?}");
}

#[test]
fn a_circle_is_found_and_a_parent_is_reached_through_super() {
    let edges: BTreeMap<Module, BTreeSet<Module>> = [
        (vec!["a".into()], [vec!["b".to_string()]].into()),
        (vec!["b".into()], [vec!["a".to_string()]].into()),
        (vec!["c".into()], [vec!["a".to_string()]].into()),
    ]
    .into();
    assert_eq!(
        circles(&edges),
        vec![vec![vec!["a".to_string()], vec!["b".to_string()]]]
    );
    let paths = paths_in("use super::{x, y::Z};\nlet t = crate::m::n::f();", &[]);
    assert_eq!(
        paths,
        vec![
            vec!["super".to_string(), "x".into()],
            vec!["super".to_string(), "y".into(), "Z".into()],
            vec!["crate".to_string(), "m".into(), "n".into(), "f".into()],
        ]
    );
}

#[test]
fn a_parent_depends_on_the_children_it_uses_but_not_on_those_it_only_re_exports() {
    let text = "mod budget;\npub mod ladder;\n#[cfg(test)]\nmod tests;\n\
                pub(super) use ladder::{Rung,\n    Step};\nfn f() { budget::spend(); a::budget::x(); }\n";
    assert_eq!(
        children_of(text),
        vec!["budget".to_string(), "ladder".into()]
    );
    assert_eq!(
        paths_in(&code_of(text), &children_of(text)),
        vec![vec!["self".to_string(), "budget".into(), "spend".into()]]
    );
}
