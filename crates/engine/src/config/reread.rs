//! A config file read again by difference: a reload (SIGHUP, `ctl reload`) after an edit of a
//! few `[[device]]` tables, by an operator or a tool that writes the file, parses and resolves
//! those tables, not the thousands the edit left as they were (docs/PERFORMANCE.md, *Cost as
//! the array grows*).
//!
//! The rule stays the whole file's: the result is what `Config::from_toml_str` of the new
//! text gives. The bytes that differ from the text last read are widened to whole lines, then
//! to whole `[[device]]` tables; when that part holds nothing else in either text, its tables
//! are parsed alone and the result is validated against the rest by difference
//! (`config::delta`). Anything else goes the whole way: a change outside the devices, a line
//! starting with `[` that is not a `[[device]]` header (another table, or an array's
//! continuation), a multi-line string anywhere (it could hold a line that looks like a
//! header), and every refusal, whose errors must name the places the whole way names. Debug
//! builds check each answer against the whole way.

use std::sync::Arc;

use super::{file, Config, ConfigErrors};

/// A config file's text as last read, and the config it holds (before command-line
/// overrides): what the next read compares with.
#[derive(Debug, Clone)]
pub struct Read {
    text: String,
    file_name: String,
    config: Config,
    /// The `[server]`'s identity seed (a device without a serial or NAA derives them from it).
    seed: String,
    /// Where each `[[device]]` header line of `text` starts: one a device of `config`, in
    /// order.
    heads: Vec<usize>,
    /// Whether `text` holds a multi-line string.
    multi_line: bool,
    /// The `[[device]]` tables parsed, when read by difference.
    by_difference: Option<usize>,
}

impl Read {
    /// The config the text holds.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The text read.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// How many `[[device]]` tables were parsed, if the text was read by difference (an
    /// unchanged text: zero); None if it was read whole.
    pub fn by_difference(&self) -> Option<usize> {
        self.by_difference
    }

    fn whole(text: String, file_name: &str) -> Result<Read, ConfigErrors> {
        let (config, seed) = file::from_toml_str_seeded(&text, file_name)?;
        Ok(Read {
            heads: device_heads(&text),
            multi_line: multi_line(&text),
            by_difference: None,
            text,
            file_name: file_name.to_string(),
            config,
            seed,
        })
    }
}

/// `text` of the file `file_name` read as `Config::from_toml_str` reads it; by difference
/// from `last` where only `[[device]]` tables changed.
pub fn read(text: String, file_name: &str, last: Option<&Read>) -> Result<Read, ConfigErrors> {
    let Some(last) = last.filter(|l| l.file_name == file_name) else {
        return Read::whole(text, file_name);
    };
    if last.text == text {
        return Ok(Read {
            by_difference: Some(0),
            ..last.clone()
        });
    }
    let Some((config, heads, parsed)) = by_difference(&text, last) else {
        return Read::whole(text, file_name);
    };
    #[cfg(debug_assertions)]
    same_as_the_whole(&text, file_name, &config, &heads);
    Ok(Read {
        text,
        file_name: last.file_name.clone(),
        config,
        seed: last.seed.clone(),
        heads,
        multi_line: false,
        by_difference: Some(parsed),
    })
}

/// The config `text` holds, where its `[[device]]` headers start and how many of them were
/// parsed, where it differs from `last.text` only in `[[device]]` tables that load; None where
/// the whole way must say.
fn by_difference(text: &str, last: &Read) -> Option<(Config, Vec<usize>, usize)> {
    let (old, base) = (last.text.as_str(), &last.config);
    if last.multi_line || last.heads.len() != base.devices.len() {
        return None;
    }
    let part = changed_part(old, text)?;
    let (old_part, new_part) = (
        &old[part.start..part.old_end],
        &text[part.start..part.new_end],
    );
    // The rest of the new text is the old one's: no multi-line string there.
    if multi_line(new_part) {
        return None;
    }
    let (old_heads, new_heads) = (device_tables_only(old_part)?, device_tables_only(new_part)?);
    let before = last.heads.partition_point(|&at| at < part.start);
    let after = last.heads.partition_point(|&at| at < part.old_end);
    // The headers the old part holds are the ones recorded there (then every index below is
    // within the devices, whose count the headers' equals, and every later header lies past
    // the part's end).
    if after - before != old_heads.len() {
        return None;
    }
    // The line a device's header is on is its origin's: counted once, when it was read.
    let lines_before = match last.heads.get(before) {
        Some(&at) if at == part.start => origin_line(&base.devices[before], &last.file_name)
            .and_then(|line| usize::try_from(line - 1).ok()),
        _ => None,
    }
    .unwrap_or_else(|| newlines(&old[..part.start]));
    let roots = &base.server.device_roots;
    let new = file::devices_of_part(new_part, &last.file_name, lines_before, &last.seed, roots)?;
    let moved = newlines(new_part) as i64 - newlines(old_part) as i64;
    let mut devices = base.devices[..before].to_vec();
    devices.extend(new.into_iter().map(Arc::new));
    for d in &base.devices[after..] {
        devices.push(moved_by(d, moved, &last.file_name)?);
    }
    let mut edited = Config {
        devices,
        ..base.clone()
    };
    if !super::delta::by_difference(&mut edited, base, &last.file_name) {
        return None;
    }
    let shift = |at: usize| at + part.new_end - part.old_end;
    let mut heads = last.heads[..before].to_vec();
    heads.extend(new_heads.iter().map(|at| at + part.start));
    heads.extend(last.heads[after..].iter().map(|&at| shift(at)));
    Some((edited, heads, new_heads.len()))
}

fn multi_line(text: &str) -> bool {
    text.contains("\"\"\"") || text.contains("'''")
}

/// Where two texts differ, widened to whole `[[device]]` tables: both begin with `..start`
/// and end with what follows `old_end` in the old text and `new_end` in the new one.
#[derive(Debug, PartialEq)]
struct Part {
    start: usize,
    old_end: usize,
    new_end: usize,
}

/// The part of `old` and `new` that differs, from the last `[[device]]` header wholly before
/// the first difference (or the line it is in, if another header comes first and only blank
/// lines and comments come before the next header) to the first header line after the last
/// one (or the end).
fn changed_part(old: &str, new: &str) -> Option<Part> {
    let (a, b) = (old.as_bytes(), new.as_bytes());
    let prefix = common_prefix(a, b);
    // The lines wholly before the first difference are the same in both.
    let whole = a[..prefix]
        .iter()
        .rposition(|&c| c == b'\n')
        .map_or(0, |i| i + 1);
    // Where the device table the difference lies in begins; or, for tables added after
    // another kind (a device appended after the targets), where the difference begins.
    let head = last_device_head(&old[..whole]);
    let start = head.unwrap_or(whole);
    // The common end, taken after those lines only: a table inserted before the header that
    // ends it then leaves that header's line to the end (a byte-wise prefix would take its
    // first bytes, `[[`, and the end would start inside it).
    let room = a.len().min(b.len()) - whole;
    let suffix = common_suffix(&a[a.len() - room..], &b[b.len() - room..]);
    let (tail, new_tail) = (a.len() - suffix, b.len() - suffix);
    let line_start = |t: &[u8], at: usize| at == 0 || t[at - 1] == b'\n';
    // The lines wholly inside the common end are the same in both.
    let from = match line_start(a, tail) && line_start(b, new_tail) {
        true => Some(tail),
        false => a[tail..]
            .iter()
            .position(|&c| c == b'\n')
            .map(|i| tail + i + 1),
    };
    let old_end = match from {
        None => a.len(),
        Some(from) => from + first_head(&old[from..]).unwrap_or(a.len() - from),
    };
    let new_end = b.len() - (a.len() - old_end);
    debug_assert!(start <= whole && whole <= old_end.min(new_end));
    // Lines before the first header belong to the table before: only blank lines and
    // comments may be there.
    let loose = |part: &str| {
        lines(part)
            .take_while(|(_, line)| line_kind(line) == Line::Other)
            .all(|(_, line)| matches!(line.trim().bytes().next(), None | Some(b'#')))
    };
    if head.is_none() && !(loose(&old[start..old_end]) && loose(&new[start..new_end])) {
        return None;
    }
    Some(Part {
        start,
        old_end,
        new_end,
    })
}

/// Bytes compared a block at a time (a block's equality is a `memcmp`): the texts are
/// megabytes at thousands of devices.
const BLOCK: usize = 64;

/// How many bytes `a` and `b` begin with alike.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let blocks = (a.chunks_exact(BLOCK).zip(b.chunks_exact(BLOCK)))
        .take_while(|(x, y)| x == y)
        .count();
    let at = blocks * BLOCK;
    at + (a[at..].iter().zip(&b[at..]))
        .take_while(|(x, y)| x == y)
        .count()
}

/// How many bytes `a` and `b` end with alike.
fn common_suffix(a: &[u8], b: &[u8]) -> usize {
    let blocks = (a.rchunks_exact(BLOCK).zip(b.rchunks_exact(BLOCK)))
        .take_while(|(x, y)| x == y)
        .count();
    let at = blocks * BLOCK;
    let (a, b) = (&a[..a.len() - at], &b[..b.len() - at]);
    at + (a.iter().rev().zip(b.iter().rev()))
        .take_while(|(x, y)| x == y)
        .count()
}

/// What a line of a text without multi-line strings is, as far as where tables begin.
#[derive(Debug, PartialEq)]
enum Line {
    /// `[[device]]` (a comment may follow).
    DeviceHead,
    /// Begins with `[`: another table's header, or an array continued from the line before.
    OtherHead,
    Other,
}

fn line_kind(line: &str) -> Line {
    let line = line.trim_start_matches([' ', '\t']);
    if !line.starts_with('[') {
        return Line::Other;
    }
    match line.strip_prefix("[[device]]") {
        Some(rest) => {
            let rest = rest.trim_start_matches([' ', '\t', '\r', '\n']);
            if rest.is_empty() || rest.starts_with('#') {
                Line::DeviceHead
            } else {
                Line::OtherHead
            }
        }
        None => Line::OtherHead,
    }
}

/// Each line of `text` with the offset it starts at.
fn lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.split_inclusive('\n').scan(0, |at, line| {
        let start = *at;
        *at += line.len();
        Some((start, line))
    })
}

/// The start of the last line of `text` (whole lines) that begins a table: None unless it is
/// a `[[device]]` header. Walks back from the end: only the lines of one table, at most.
fn last_device_head(text: &str) -> Option<usize> {
    let mut end = text.len();
    while end > 0 {
        let start = text[..end - 1].rfind('\n').map_or(0, |i| i + 1);
        match line_kind(&text[start..end]) {
            Line::DeviceHead => return Some(start),
            Line::OtherHead => return None,
            Line::Other => end = start,
        }
    }
    None
}

/// The start of the first line of `text` that begins a table or continues an array.
fn first_head(text: &str) -> Option<usize> {
    lines(text).find_map(|(at, line)| (line_kind(line) != Line::Other).then_some(at))
}

/// Where the `[[device]]` headers of `part` start, if it holds no other header.
fn device_tables_only(part: &str) -> Option<Vec<usize>> {
    let mut heads = Vec::new();
    for (at, line) in lines(part) {
        match line_kind(line) {
            Line::DeviceHead => heads.push(at),
            Line::OtherHead => return None,
            Line::Other => {}
        }
    }
    Some(heads)
}

/// Where the lines of `text` that are `[[device]]` headers start.
fn device_heads(text: &str) -> Vec<usize> {
    text.match_indices("[[device]]")
        .filter_map(|(at, _)| {
            let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
            let end = text[at..].find('\n').map_or(text.len(), |i| at + i + 1);
            let head = text[start..at].trim_matches([' ', '\t']).is_empty()
                && line_kind(&text[start..end]) == Line::DeviceHead;
            head.then_some(start)
        })
        .collect()
}

fn newlines(text: &str) -> usize {
    text.bytes().filter(|&b| b == b'\n').count()
}

/// `d` with the line of its origin (`FILE:LINE`) moved by `by`; None if it has none.
fn moved_by(
    d: &Arc<super::DeviceConfig>,
    by: i64,
    file_name: &str,
) -> Option<Arc<super::DeviceConfig>> {
    if by == 0 {
        return Some(Arc::clone(d));
    }
    let line = origin_line(d, file_name)?.checked_add(by)?;
    let mut moved = super::DeviceConfig::clone(d);
    moved.origin = super::Origin(Some(format!("{file_name}:{line}")));
    Some(Arc::new(moved))
}

/// The line of `d`'s origin (`FILE:LINE`) in `file_name`.
fn origin_line(d: &super::DeviceConfig, file_name: &str) -> Option<i64> {
    let at = d.origin.0.as_deref()?.strip_prefix(file_name)?;
    at.strip_prefix(':')?.parse().ok()
}

/// Debug builds (every test) check a read by difference against the whole way: the same
/// config, each device from the same line.
#[cfg(debug_assertions)]
fn same_as_the_whole(text: &str, file_name: &str, config: &Config, heads: &[usize]) {
    assert_eq!(heads, device_heads(text), "device headers differ");
    let whole = file::from_toml_str(text, file_name);
    assert!(
        whole.as_ref() == Ok(config),
        "a read by difference differs from the whole: {whole:?}"
    );
    if let Ok(whole) = whole {
        let origins = |c: &Config| -> Vec<Option<String>> {
            c.devices.iter().map(|d| d.origin.0.clone()).collect()
        };
        assert_eq!(origins(&whole), origins(config), "origins differ");
    }
}

#[cfg(test)]
mod tests;
