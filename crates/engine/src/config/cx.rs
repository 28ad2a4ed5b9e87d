//! The validation context of a config file: its text (to turn byte offsets into lines) and
//! the errors found so far. Every validating function of `file.rs` and `auth.rs` takes one.

use std::cell::OnceCell;
use std::ops::Range;

use toml::Spanned;

use super::ConfigError;

type S<T> = Spanned<T>;

/// Validation context: the source (to turn byte offsets into lines) and the errors so far.
pub(crate) struct Cx<'a> {
    pub(super) src: &'a str,
    pub(super) file: &'a str,
    pub(super) errors: Vec<ConfigError>,
    /// Where each line of `src` starts, made at the first offset asked about.
    lines: OnceCell<LineIndex>,
    /// No text: the spans are [`Pos`]itions of a raw config made in memory.
    positions: bool,
    /// Lines of the file before `src` (a part of it, read alone: `config::reread`).
    lines_before: usize,
}

impl<'a> Cx<'a> {
    pub(super) fn new(src: &'a str, file: &'a str) -> Self {
        Cx {
            src,
            file,
            errors: Vec::new(),
            lines: OnceCell::new(),
            positions: false,
            lines_before: 0,
        }
    }

    /// A context for `src`, the part of a file that follows its first `lines_before` lines:
    /// lines are the file's.
    pub(super) fn part(src: &'a str, file: &'a str, lines_before: usize) -> Self {
        Cx {
            lines_before,
            ..Cx::new(src, file)
        }
    }

    /// A context for a raw config made in memory ([`Pos`]): an error's line is 1 and its
    /// column the position of its value, so that errors sort as they would in the text.
    pub(super) fn without_text(file: &'a str) -> Self {
        Cx {
            positions: true,
            ..Cx::new("", file)
        }
    }

    /// 1-based (line, column in characters) of a byte offset.
    pub(super) fn line_col(&self, offset: usize) -> (usize, usize) {
        if self.positions {
            return (1, offset + 1);
        }
        let (line, column) = self
            .lines
            .get_or_init(|| LineIndex::new(self.src))
            .line_col(self.src, offset);
        (line + self.lines_before, column)
    }

    pub(crate) fn err(
        &mut self,
        span: Range<usize>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) {
        let (line, column) = self.line_col(span.start);
        self.errors.push(ConfigError {
            file: self.file.to_string(),
            line,
            column,
            field: field.into(),
            message: message.into(),
        });
    }

    /// The value if it lies in `min..=max`, else an error naming the range.
    pub(crate) fn int_in(&mut self, v: &S<i64>, min: i64, max: i64, field: &str) -> Option<i64> {
        let x = *v.get_ref();
        if (min..=max).contains(&x) {
            Some(x)
        } else {
            self.err(
                v.span(),
                field,
                format!("must be in {min}..={max}, got {x}"),
            );
            None
        }
    }
}

/// The byte offset at which each line of a text starts, to turn an offset into its line and
/// column in O(log lines + the column) rather than by counting from the start of the text
/// (every device's origin asks for its line: that made loading a file quadratic).
pub(super) struct LineIndex {
    /// The first is 0; then one past each `\n`, in increasing order.
    starts: Vec<usize>,
}

impl LineIndex {
    pub(super) fn new(src: &str) -> LineIndex {
        let newlines = src.bytes().enumerate().filter(|&(_, b)| b == b'\n');
        let starts = std::iter::once(0).chain(newlines.map(|(i, _)| i + 1));
        LineIndex {
            starts: starts.collect(),
        }
    }

    /// 1-based (line, column in characters) of a byte offset of `src`, the text the index was
    /// made of. An offset past the end is the end; one inside a character is that character.
    pub(super) fn line_col(&self, src: &str, offset: usize) -> (usize, usize) {
        let mut offset = offset.min(src.len());
        while !src.is_char_boundary(offset) {
            offset -= 1;
        }
        // The lines starting at or before `offset`: the first always does.
        let line = self.starts.partition_point(|&start| start <= offset);
        let line_start = self.starts[line - 1];
        (line, src[line_start..offset].chars().count() + 1)
    }
}

/// Spans for a raw config made in memory from a [`super::Config`], without its text: each
/// value (and each table, before its values) takes the next position, in the order
/// `Config::to_toml` writes them, so that errors come in the order they would in the text.
#[derive(Default)]
pub(super) struct Pos(usize);

impl Pos {
    pub(super) fn next(&mut self) -> Range<usize> {
        self.0 += 1;
        self.0..self.0 + 1
    }

    /// `value` at the next position.
    pub(super) fn s<T>(&mut self, value: T) -> S<T> {
        Spanned::new(self.next(), value)
    }

    /// A list at the next position, each item after it at its own; None if an item is.
    pub(super) fn list<I, T>(
        &mut self,
        items: I,
        mut each: impl FnMut(&mut Pos, I::Item) -> Option<T>,
    ) -> Option<S<Vec<S<T>>>>
    where
        I: IntoIterator,
    {
        let at = self.next();
        let mut list = Vec::new();
        for item in items {
            let here = self.next();
            list.push(Spanned::new(here, each(self, item)?));
        }
        Some(Spanned::new(at, list))
    }
}

/// A TOML integer: None for a number beyond it (the text would not parse).
pub(super) fn int(n: impl TryInto<i64>) -> Option<i64> {
    n.try_into().ok()
}

/// `Some(&value)` of a required field, or an error at the enclosing table.
pub(super) fn required<'v, T>(
    cx: &mut Cx<'_>,
    v: &'v Option<S<T>>,
    table: &Range<usize>,
    field: String,
) -> Option<&'v S<T>> {
    required_with(cx, v, table, || field)
}

/// [`required`], the field named only for the error (for the fields of every device and
/// LUN, which are thousands).
pub(super) fn required_with<'v, T>(
    cx: &mut Cx<'_>,
    v: &'v Option<S<T>>,
    table: &Range<usize>,
    field: impl FnOnce() -> String,
) -> Option<&'v S<T>> {
    if v.is_none() {
        cx.err(table.clone(), field(), "missing (required)");
    }
    v.as_ref()
}

pub(super) fn bool_or(v: &Option<S<bool>>, default: bool) -> bool {
    v.as_ref().map_or(default, |b| *b.get_ref())
}

#[cfg(test)]
mod tests {
    use super::LineIndex;

    /// What the index replaces: counting from the start of the text.
    fn counted(src: &str, offset: usize) -> (usize, usize) {
        let mut offset = offset.min(src.len());
        while !src.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &src[..offset];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        (line, before[line_start..].chars().count() + 1)
    }

    #[test]
    fn every_offset_has_the_line_and_column_counting_gives() {
        for src in [
            "",
            "\n",
            "\n\n",
            "a",
            "a = 1\nb = 2\n",
            "a = 1\r\nb = \"é日本\"\n\nc = [\n  1,\n]",
            "no newline at the end",
            "\u{1F600}\n\u{1F600}x",
        ] {
            let index = LineIndex::new(src);
            for offset in 0..=src.len() + 2 {
                assert_eq!(
                    index.line_col(src, offset),
                    counted(src, offset),
                    "{src:?} at {offset}"
                );
            }
        }
    }

    #[test]
    fn lines_and_columns_are_one_based() {
        let src = "ab\ncd\n";
        let index = LineIndex::new(src);
        assert_eq!(index.line_col(src, 0), (1, 1));
        assert_eq!(index.line_col(src, 2), (1, 3), "the newline ends line 1");
        assert_eq!(index.line_col(src, 3), (2, 1));
        assert_eq!(
            index.line_col(src, 6),
            (3, 1),
            "the end, after the last newline"
        );
        assert_eq!(index.line_col(src, 99), (3, 1), "past the end is the end");
    }
}
