//! Functions that fit a screen (the developers' brief): across the workspace's non-test code,
//! at most `LONG_MAX` functions run over `LINES_MAX` lines. This reads every source file and
//! fails when a change adds one past the bound, naming the longest.

mod tree;

use std::path::Path;

const LINES_MAX: usize = 70;
const LONG_MAX: usize = 20;

/// The non-test lines of a file: up to its `#[cfg(test)] mod`.
fn non_test(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .windows(2)
        .position(|w| w[0].trim() == "#[cfg(test)]" && w[1].trim_start().starts_with("mod "))
        .unwrap_or(lines.len());
    lines[..end].to_vec()
}

/// The indentation of a function's first line when it is one (`fn`, `pub fn`, `async fn`, ...).
fn fn_start(line: &str) -> Option<&str> {
    let code = line.trim_start();
    let indent = &line[..line.len() - code.len()];
    let mut rest = code;
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "async ",
        "const ",
        "unsafe ",
    ] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    rest.starts_with("fn ").then_some(indent)
}

/// Each function with a body in `lines`: (first line, length in lines).
fn functions(lines: &[&str]) -> Vec<(usize, usize)> {
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(indent) = fn_start(line) else {
            continue;
        };
        // A declaration without a body (a trait's) ends in `;` before any `{`.
        let head = lines[i..]
            .iter()
            .map(|l| l.split("//").next().unwrap_or(""));
        let body = head
            .take(30)
            .find(|c| c.contains('{') || c.trim_end().ends_with(';'));
        if !body.is_some_and(|c| c.contains('{')) {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = lines[i..].iter().position(|l| *l == close) {
            found.push((i + 1, end + 1));
        }
    }
    found
}

#[test]
fn functions_fit_a_screen() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let files = tree::sources(&crates, &["tests", "target", "tests.rs"]);
    assert!(files.len() > 100, "only {} source files found", files.len());
    let mut seen = 0;
    let mut long = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (line, len) in functions(&non_test(&text)) {
            seen += 1;
            if len > LINES_MAX {
                long.push((len, format!("{}:{line}", file.display())));
            }
        }
    }
    assert!(seen > 1000, "only {seen} functions seen");
    long.sort_unstable_by(|a, b| b.cmp(a));
    let shown: Vec<String> = long.iter().map(|(n, at)| format!("{n} {at}")).collect();
    assert!(
        long.len() <= LONG_MAX,
        "{} functions over {LINES_MAX} lines (at most {LONG_MAX}); split one:\n{}",
        long.len(),
        shown.join("\n")
    );
}

#[test]
fn the_length_check_measures_bodies_not_declarations() {
    let text = "trait T {\n    fn a(&self)\n        -> u8;\n}\n\npub fn b() {\n    let x = 1;\n}\n";
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(functions(&lines), [(6, 3)]);
    let with_tests = "fn c() {\n}\n#[cfg(test)]\nmod tests {\n    fn d() {\n    }\n}\n";
    assert_eq!(functions(&non_test(with_tests)), [(1, 2)]);
}
