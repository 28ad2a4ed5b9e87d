//! A document's text, rendered a table at a time so a save reuses the text of what it did not
//! change: at thousands of devices, rendering the whole document was most of a save's time.
//!
//! toml_edit writes a document as its root decor, then each table (header and values, not its
//! sub-tables) in the order of `Table::position()`, then the root decor's suffix and the
//! trailing text. A table's part depends only on the table, its key path and whether it is the
//! first part that writes anything (whose header has no blank line before it by default). So
//! the parts of the tables a merge left alone are the text they had, and the others are
//! rendered alone, by toml_edit, in a document of their own. Debug builds check the result
//! against rendering the whole document.

use std::ops::Range;

use toml_edit::{ArrayOfTables, DocumentMut, Item, Key, Table};

use super::Ranked;

/// Where each table's part stands in a rendering: `parts[i]` is the text of the table of
/// position `i` (the merge numbers a document's tables `0..n` in text order).
#[derive(Debug, Default)]
pub struct Layout {
    parts: Vec<Range<usize>>,
    /// The part written first, without the blank line others have: not reusable elsewhere.
    first: Option<usize>,
}

impl Layout {
    /// The text of the table that had position `at` in `text`, the rendering laid out as this,
    /// where it can stand anywhere in a new rendering.
    pub fn part<'t>(&self, text: &'t str, at: usize) -> Option<&'t str> {
        if self.first == Some(at) {
            return None;
        }
        text.get(self.parts.get(at)?.clone())
    }
}

/// A table as the document writes it, in the order of the text.
struct Part<'a> {
    table: &'a Table,
    path: Vec<&'a Key>,
    is_array: bool,
    /// Its text from an earlier rendering, if it is unchanged.
    kept: Option<&'a str>,
}

/// `doc`'s text, as its `Display` writes it, with the part of each table for which `kept`
/// (given the table's position) has text taken from there, and where each part stands.
pub fn render<'a>(
    doc: &'a DocumentMut,
    kept: &dyn Fn(usize) -> Option<&'a str>,
) -> (String, Layout) {
    let whole = || (doc.to_string(), Layout::default());
    let Some(text) = by_parts(doc, kept) else {
        // A decor or key whose text toml_edit holds as a span of a parsed input: not one of a
        // document this daemon rendered; the whole rendering is right, only slower.
        return whole();
    };
    if cfg!(debug_assertions) {
        assert_eq!(
            text.0,
            doc.to_string(),
            "a rendering by parts is the whole's"
        );
    }
    text
}

fn by_parts<'a>(
    doc: &'a DocumentMut,
    kept: &dyn Fn(usize) -> Option<&'a str>,
) -> Option<(String, Layout)> {
    let root = doc.as_table();
    let decor = root.decor();
    fn raw(r: Option<&toml_edit::RawString>) -> Option<&str> {
        r.map_or(Some(""), |r| r.as_str())
    }
    let (prefix, suffix) = (raw(decor.prefix())?, raw(decor.suffix())?);
    let trailing = doc.trailing().as_str()?;
    let mut parts = Vec::new();
    let mut last = 0;
    visit(
        root,
        &mut Vec::new(),
        false,
        &mut |table, path, is_array| {
            last = table.at().unwrap_or(last);
            let kept = table.at().and_then(kept);
            parts.push((
                last,
                Part {
                    table,
                    path: path.to_vec(),
                    is_array,
                    kept,
                },
            ));
        },
    );
    parts.sort_by_key(|(at, _)| *at); // stable, as toml_edit's
    let mut text =
        String::with_capacity(parts.iter().map(|(_, p)| p.kept.map_or(64, str::len)).sum());
    text.push_str(prefix);
    let mut layout = Layout {
        parts: Vec::with_capacity(parts.len()),
        first: None,
    };
    for (i, (_, part)) in parts.iter().enumerate() {
        let start = text.len();
        let first = layout.first.is_none();
        match part.kept {
            Some(kept) if !first || kept.is_empty() => text.push_str(kept),
            _ => text.push_str(&render_part(part, first)?),
        }
        if first && text.len() > start {
            layout.first = Some(i);
        }
        layout.parts.push(start..text.len());
    }
    text.push_str(suffix);
    text.push_str(trailing);
    Some((text, layout))
}

/// Calls `f` on each table toml_edit writes a part for, in the order it visits them.
fn visit<'a>(
    table: &'a Table,
    path: &mut Vec<&'a Key>,
    is_array: bool,
    f: &mut dyn FnMut(&'a Table, &[&'a Key], bool),
) {
    if !table.is_dotted() {
        f(table, path, is_array);
    }
    for (name, item) in table.iter() {
        // A value has no part of its own: its key is looked up only for a table's path.
        if !(item.is_table() || item.is_array_of_tables()) {
            continue;
        }
        let Some(key) = table.key(name) else { continue };
        path.push(key);
        match item {
            Item::Table(t) => visit(t, path, false, f),
            Item::ArrayOfTables(list) => list.iter().for_each(|t| visit(t, path, true, f)),
            _ => {}
        }
        path.pop();
    }
}

/// What a document written first holds before the part rendered: a part is rendered after
/// it when it is not the first, then taken off.
const BEFORE: &str = "_ = 0\n";

/// The part of one table, rendered by toml_edit in a document holding the table alone (its
/// values and dotted tables, under its key path); `first`: as the first part written.
fn render_part(part: &Part<'_>, first: bool) -> Option<String> {
    let mut own = values_of(part.table)?;
    own.set_at(1);
    let Some((&last, above)) = part.path.split_last() else {
        // The root: its values alone; the document's decor is written around all parts.
        own.decor_mut().clear();
        return Some(DocumentMut::from(own).to_string());
    };
    let mut item = match part.is_array {
        true => Item::ArrayOfTables(ArrayOfTables::from_iter([own])),
        false => Item::Table(own),
    };
    let mut key = last;
    for &parent in above.iter().rev() {
        let mut table = Table::new();
        table.set_implicit(true);
        table.insert_formatted(key, item);
        (item, key) = (Item::Table(table), parent);
    }
    let mut doc = DocumentMut::new();
    if !first {
        doc.insert("_", toml_edit::value(0));
    }
    doc.insert_formatted(key, item);
    let text = doc.to_string();
    match first {
        true => Some(text),
        false => text.strip_prefix(BEFORE).map(str::to_string),
    }
}

/// A copy of `table` with what its part writes: its values and its dotted tables (written
/// with the values), not the tables that have headers of their own.
fn values_of(table: &Table) -> Option<Table> {
    let mut own = Table::new();
    own.set_implicit(table.is_implicit());
    own.set_dotted(table.is_dotted());
    *own.decor_mut() = table.decor().clone();
    for (name, item) in table.iter() {
        let key = table.key(name)?;
        match item {
            Item::Value(_) => {
                own.insert_formatted(key, item.clone());
            }
            Item::Table(t) if t.is_dotted() => {
                own.insert_formatted(key, Item::Table(values_of(t)?));
            }
            _ => {}
        }
    }
    Some(own)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parsed, then numbered `0..n` in text order as a merge leaves a document.
    fn numbered(text: &str) -> DocumentMut {
        let mut doc: DocumentMut = text.parse().unwrap();
        let mut tables = Vec::new();
        visit(doc.as_table(), &mut Vec::new(), false, &mut |t, _, _| {
            tables.push(t.at().unwrap_or(0));
        });
        let mut ranks: Vec<usize> = (0..tables.len()).collect();
        ranks.sort_by_key(|&i| tables[i]);
        let mut at = vec![0; ranks.len()];
        for (rank, i) in ranks.into_iter().enumerate() {
            at[i] = rank;
        }
        let mut at = at.into_iter();
        super::super::each_table(doc.as_table_mut(), &mut |t| t.set_at(at.next().unwrap()));
        doc
    }

    const TRICKY: &str = r#"# head comment
top = 1   # a root value
"quoted key" = 'x'
dotted.a = 1

[ server ]   # a spaced header
workers = 2
limits.max = 3
[server.sub]
x = 1

# an implicit parent's child
[a.b.c]
y = "z"

[[device]]
name = "v1"   # one
size = "1M"
[[device]]
name = 'v2'
[device.extra]
k = 0x10
[["target"]]
iqn = "t"
  [["target".group]]
  name = "g"
  luns = [ { lun = 0, device = "v1" },
           { lun = 1, device = "v2" } ]
# trailing comment
"#;

    #[test]
    fn rendering_by_parts_is_the_whole_rendering() {
        for text in [
            TRICKY,
            "",
            "# only a comment\n",
            "[t]\n",
            "a = 1\n",
            "[[x]]\n[[x]]\n",
        ] {
            let doc = numbered(text);
            let (parts, layout) = by_parts(&doc, &|_| None).unwrap();
            assert_eq!(parts, doc.to_string(), "{text}");
            assert_eq!(parts, text);
            // Every part taken from the first rendering gives it again.
            let again = by_parts(&doc, &|at| layout.part(&parts, at)).unwrap().0;
            assert_eq!(again, parts);
        }
        // Without the root's values the first part is a header, with no blank line before it.
        let text = TRICKY.replace(
            "top = 1   # a root value\n\"quoted key\" = 'x'\ndotted.a = 1\n",
            "",
        );
        let doc = numbered(&text);
        assert_eq!(by_parts(&doc, &|_| None).unwrap().0, text);
    }

    #[test]
    fn a_kept_part_is_taken_as_it_was_and_the_first_one_rendered_again() {
        let doc = numbered(TRICKY);
        let (text, layout) = by_parts(&doc, &|_| None).unwrap();
        let mut edited = numbered(TRICKY);
        edited["device"][1]["name"] = toml_edit::value("renamed");
        edited["top"] = toml_edit::value(2);
        // Every part taken from before: the edits are not rendered, so not seen.
        let kept = by_parts(&edited, &|at| layout.part(&text, at)).unwrap().0;
        assert!(
            kept.contains("name = 'v2'") && !kept.contains("renamed"),
            "{kept}"
        );
        // The first part (the root's values) is rendered again, even where it is kept.
        assert!(kept.contains("top = 2"), "{kept}");
        assert_eq!(layout.first, Some(0));
        assert!(layout.part(&text, 0).is_none());
    }
}
