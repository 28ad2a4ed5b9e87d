//! A table as `top` shows it: filtered, sorted, and fitted to the terminal's width. Names
//! are shortened from the front (an IQN's or an address's distinctive end stays), then the
//! columns that say least are left out, rank by rank; whatever room is left goes back to
//! the names.

use super::{Sort, View};

/// A column: its header, whether it holds a name that may be shortened to fit, and when it
/// is left out as the width shrinks (0: never; 1 first, then 2, ...).
#[derive(Clone, Copy)]
pub(super) struct Column {
    pub header: &'static str,
    pub name: bool,
    pub drop: u8,
}

pub(super) const fn col(header: &'static str) -> Column {
    Column {
        header,
        name: false,
        drop: 0,
    }
}

/// A number that may be left out, with its rank.
pub(super) const fn col_drop(header: &'static str, drop: u8) -> Column {
    Column {
        header,
        name: false,
        drop,
    }
}

pub(super) const fn name_col(header: &'static str) -> Column {
    Column {
        header,
        name: true,
        drop: 0,
    }
}

/// A name that may be left out, with its rank.
pub(super) const fn name_col_drop(header: &'static str, drop: u8) -> Column {
    Column {
        header,
        name: true,
        drop,
    }
}

/// A table before the view is applied: its columns, rows and the row of their totals.
#[derive(Default)]
pub(super) struct Table {
    pub columns: Vec<Column>,
    pub rows: Vec<Row>,
    /// Shown last, whatever the sort and the filter.
    pub total: Option<Row>,
}

/// One row: its cells and what it sorts by.
pub(super) struct Row {
    pub cells: Vec<String>,
    pub iops: f64,
    pub mb: f64,
    /// The p99 latency in ms over the window (0 without commands).
    pub p99: f64,
    /// Reads and writes in flight on average over the window.
    pub qd: f64,
    pub name: String,
}

/// What to do, in order, until a table fits: shorten the names to at most this many
/// characters, or leave out the columns of this rank.
#[derive(Clone, Copy)]
enum Step {
    Cap(usize),
    Drop(u8),
}

const STEPS: [Step; 12] = [
    Step::Cap(32),
    Step::Cap(24),
    Step::Cap(18),
    Step::Drop(1),
    Step::Cap(14),
    Step::Drop(2),
    Step::Cap(12),
    Step::Drop(3),
    Step::Drop(4),
    Step::Cap(10),
    Step::Drop(5),
    Step::Drop(6),
];

/// The header and cells of `table` as `view` shows it.
pub(super) fn shown(table: &Table, view: &View) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let mut rows = ordered(table, view);
    rows.extend(&table.total);
    let (keep, cap) = fitted(&table.columns, &rows, view.width);
    let header = table
        .columns
        .iter()
        .zip(&keep)
        .filter(|(_, k)| **k)
        .map(|(c, _)| c.header)
        .collect();
    let cells = rows
        .iter()
        .map(|r| {
            r.cells
                .iter()
                .zip(&table.columns)
                .zip(&keep)
                .filter(|(_, k)| **k)
                .map(|((c, column), _)| if column.name { fit(c, cap) } else { c.clone() })
                .collect()
        })
        .collect();
    (header, cells)
}

/// The rows the filter lets through, in the view's order.
fn ordered<'a>(table: &'a Table, view: &View) -> Vec<&'a Row> {
    let needle = view.filter.to_lowercase();
    let mut rows: Vec<&Row> = table
        .rows
        .iter()
        .filter(|r| needle.is_empty() || r.cells.iter().any(|c| c.to_lowercase().contains(&needle)))
        .collect();
    match view.sort {
        Sort::Iops => rows.sort_by(|a, b| b.iops.total_cmp(&a.iops)),
        Sort::Latency => rows.sort_by(|a, b| b.p99.total_cmp(&a.p99)),
        Sort::Mb => rows.sort_by(|a, b| b.mb.total_cmp(&a.mb)),
        Sort::Qd => rows.sort_by(|a, b| b.qd.total_cmp(&a.qd)),
        Sort::Name => rows.sort_by(|a, b| a.name.cmp(&b.name)),
    }
    rows
}

/// Which columns stay and how long names may be, for `width` (None: everything whole).
fn fitted(columns: &[Column], rows: &[&Row], width: Option<usize>) -> (Vec<bool>, usize) {
    let mut keep = vec![true; columns.len()];
    let mut cap = usize::MAX;
    let Some(width) = width else {
        return (keep, cap);
    };
    let fits = |keep: &[bool], cap: usize| line_width(columns, rows, keep, cap) <= width;
    for step in STEPS {
        if fits(&keep, cap) {
            break;
        }
        match step {
            Step::Cap(c) => cap = cap.min(c),
            Step::Drop(rank) => {
                for (k, c) in keep.iter_mut().zip(columns) {
                    *k &= c.drop != rank;
                }
            }
        }
    }
    // The room left goes back to the names.
    let longest = rows
        .iter()
        .flat_map(|r| r.cells.iter().zip(columns).zip(&keep))
        .filter(|((_, c), k)| c.name && **k)
        .map(|((s, _), _)| s.chars().count())
        .max()
        .unwrap_or(0);
    if let Some(c) = (cap.saturating_add(1)..=longest)
        .rev()
        .find(|&c| fits(&keep, c))
    {
        cap = c;
    }
    (keep, cap)
}

/// The characters a line takes with these columns and names capped at `cap` (two between
/// columns).
fn line_width(columns: &[Column], rows: &[&Row], keep: &[bool], cap: usize) -> usize {
    columns
        .iter()
        .enumerate()
        .filter(|(i, _)| keep[*i])
        .map(|(i, c)| {
            let widest = rows
                .iter()
                .filter_map(|r| r.cells.get(i))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0);
            let widest = if c.name { widest.min(cap) } else { widest };
            widest.max(c.header.len()) + 2
        })
        .sum()
}

/// `s` in at most `width` characters: its end kept (an IQN's distinctive part), "…" before.
pub(super) fn fit(s: &str, width: usize) -> String {
    let n = s.chars().count();
    if n <= width || width == 0 {
        return s.to_string();
    }
    let tail: String = s.chars().skip(n - (width - 1)).collect();
    format!("…{tail}")
}
