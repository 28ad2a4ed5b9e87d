//! The validation context of a config file: its text (to turn byte offsets into lines) and
//! the errors found so far. Every validating function of `file.rs` and `auth.rs` takes one.

use std::ops::Range;

use toml::Spanned;

use super::ConfigError;

type S<T> = Spanned<T>;

/// Validation context: the source (to turn byte offsets into lines) and the errors so far.
pub(crate) struct Cx<'a> {
    pub(super) src: &'a str,
    pub(super) file: &'a str,
    pub(super) errors: Vec<ConfigError>,
}

impl<'a> Cx<'a> {
    pub(super) fn new(src: &'a str, file: &'a str) -> Self {
        Cx {
            src,
            file,
            errors: Vec::new(),
        }
    }

    /// 1-based (line, column in characters) of a byte offset.
    pub(super) fn line_col(&self, offset: usize) -> (usize, usize) {
        let mut offset = offset.min(self.src.len());
        while !self.src.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &self.src[..offset];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        (line, before[line_start..].chars().count() + 1)
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

/// `Some(&value)` of a required field, or an error at the enclosing table.
pub(super) fn required<'v, T>(
    cx: &mut Cx<'_>,
    v: &'v Option<S<T>>,
    table: &Range<usize>,
    field: String,
) -> Option<&'v S<T>> {
    if v.is_none() {
        cx.err(table.clone(), field, "missing (required)");
    }
    v.as_ref()
}

pub(super) fn bool_or(v: &Option<S<bool>>, default: bool) -> bool {
    v.as_ref().map_or(default, |b| *b.get_ref())
}
