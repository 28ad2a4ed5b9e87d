//! ferrosan.toml(5): the configuration reference, docs/CONFIG.md, as a man page. Made from the
//! Markdown itself (pulldown-cmark reads it, the roff crate writes it), so the page and the
//! reference cannot say different things. Headings become sections, each row of a key table
//! a tagged paragraph (the key, then the other columns by their headers), code blocks stay as
//! they are.

use pulldown_cmark::{Event, HeadingLevel, Options, Parser, Tag, TagEnd};
use roff::{bold, italic, roman, Inline, Roff};

const CONFIG_MD: &str = include_str!("../../../docs/CONFIG.md");

/// The page, in roff.
pub fn page() -> String {
    let mut page = Page::new();
    for event in Parser::new_ext(CONFIG_MD, Options::ENABLE_TABLES) {
        page.event(event);
    }
    page.finish()
}

/// A table being read: its header cells, its body rows, the row and cell being read.
#[derive(Default)]
struct Table {
    header: Vec<String>,
    rows: Vec<Vec<Vec<Inline>>>,
    row: Vec<Vec<Inline>>,
    in_head: bool,
}

struct Page {
    roff: Roff,
    /// The text of the paragraph, item, heading or cell being read.
    inlines: Vec<Inline>,
    bold: usize,
    italic: usize,
    heading: Option<HeadingLevel>,
    code_block: Option<String>,
    table: Option<Table>,
    /// Before the first section: the title's paragraphs go under DESCRIPTION.
    described: bool,
}

impl Page {
    fn new() -> Page {
        let mut roff = Roff::new();
        let version = concat!("ferrosan ", env!("CARGO_PKG_VERSION"));
        roff.control("TH", ["FERROSAN.TOML", "5", "", version, "File Formats"])
            .control("SH", ["NAME"])
            .text([roman(
                "ferrosan.toml - the configuration of the ferrosan storage target",
            )])
            .control("SH", ["SYNOPSIS"])
            .text([italic("/etc/ferrosan/ferrosan.toml")])
            .control("SH", ["DESCRIPTION"]);
        Page {
            roff,
            inlines: Vec::new(),
            bold: 0,
            italic: 0,
            heading: None,
            code_block: None,
            table: None,
            described: false,
        }
    }

    fn event(&mut self, event: Event<'_>) {
        match event {
            Event::Start(tag) => self.start(tag),
            Event::End(tag) => self.end(tag),
            Event::Text(text) => match &mut self.code_block {
                Some(code) => code.push_str(&text),
                None => self.push(&text),
            },
            Event::Code(code) => self.inlines.push(bold(code.to_string())),
            Event::SoftBreak => self.inlines.push(roman(" ")),
            Event::HardBreak => self.inlines.push(roff::line_break()),
            _ => {}
        }
    }

    /// Text in the font the Markdown around it asks for.
    fn push(&mut self, text: &str) {
        self.inlines.push(if self.bold > 0 {
            bold(text)
        } else if self.italic > 0 {
            italic(text)
        } else {
            roman(text)
        });
    }

    fn start(&mut self, tag: Tag<'_>) {
        match tag {
            Tag::Heading { level, .. } => {
                self.inlines.clear();
                self.heading = Some(level);
            }
            Tag::Paragraph => self.inlines.clear(),
            Tag::Strong => self.bold += 1,
            Tag::Emphasis => self.italic += 1,
            Tag::CodeBlock(_) => self.code_block = Some(String::new()),
            Tag::Item => {
                self.flush();
                self.roff.control("IP", ["\\(bu", "2"]);
            }
            Tag::Table(_) => self.table = Some(Table::default()),
            Tag::TableHead => self.table_mut(|t| t.in_head = true),
            Tag::TableCell => self.inlines.clear(),
            _ => {}
        }
    }

    fn end(&mut self, tag: TagEnd) {
        match tag {
            TagEnd::Heading(level) => self.heading_done(level),
            TagEnd::Paragraph | TagEnd::Item => self.flush(),
            TagEnd::Strong => self.bold = self.bold.saturating_sub(1),
            TagEnd::Emphasis => self.italic = self.italic.saturating_sub(1),
            TagEnd::CodeBlock => self.code_block_done(),
            TagEnd::TableCell => {
                let cell = std::mem::take(&mut self.inlines);
                self.table_mut(|t| {
                    if t.in_head {
                        t.header.push(plain(&cell));
                    } else {
                        t.row.push(cell);
                    }
                });
            }
            TagEnd::TableHead => self.table_mut(|t| t.in_head = false),
            TagEnd::TableRow => self.table_mut(|t| {
                let row = std::mem::take(&mut t.row);
                t.rows.push(row);
            }),
            TagEnd::Table => self.table_done(),
            _ => {}
        }
    }

    fn table_mut(&mut self, f: impl FnOnce(&mut Table)) {
        if let Some(t) = &mut self.table {
            f(t);
        }
    }

    /// The paragraph read so far, as one.
    fn flush(&mut self) {
        if self.heading.is_some() || self.table.is_some() {
            return;
        }
        let inlines = std::mem::take(&mut self.inlines);
        if !inlines.is_empty() {
            self.roff.control("PP", []).text(inlines);
        }
    }

    /// The title (H1) names the page; H2 is a section, H3 a subsection.
    fn heading_done(&mut self, level: HeadingLevel) {
        self.heading = None;
        let text = plain(&std::mem::take(&mut self.inlines));
        match level {
            HeadingLevel::H1 => {}
            HeadingLevel::H2 => {
                self.described = true;
                self.roff.control("SH", [text.to_uppercase().as_str()]);
            }
            _ => {
                self.roff.control("SS", [text.as_str()]);
            }
        }
    }

    fn code_block_done(&mut self) {
        let code = self.code_block.take().unwrap_or_default();
        self.roff
            .control("PP", [])
            .control("RS", [])
            .control("nf", []);
        for line in code.lines() {
            self.roff.text([roman(line)]);
        }
        self.roff.control("fi", []).control("RE", []);
    }

    /// Each body row a tagged paragraph: its first cell the tag, each middle cell after its
    /// header's name, the last cell (what the row means) as the text.
    fn table_done(&mut self) {
        let Some(table) = self.table.take() else {
            return;
        };
        for row in table.rows {
            let mut cells = row.into_iter();
            let Some(tag) = cells.next() else {
                continue;
            };
            self.roff.control("TP", []).text(tag);
            let rest: Vec<Vec<Inline>> = cells.collect();
            let last = rest.len().saturating_sub(1);
            let mut text = Vec::new();
            for (i, cell) in rest.into_iter().enumerate() {
                if i < last {
                    let name = table.header.get(i + 1).map_or("", String::as_str);
                    text.push(italic(format!("{name}: ")));
                    text.extend(cell);
                    text.push(roman(". "));
                } else {
                    text.extend(cell);
                }
            }
            self.roff.text(text);
        }
    }

    fn finish(mut self) -> String {
        self.flush();
        self.roff
            .control("SH", ["SEE ALSO"])
            .text([
                bold("ferrosan"),
                roman("(1), "),
                bold("ferrosan-serve"),
                roman("(1), "),
                bold("ferrosan-check-config"),
                roman("(1), "),
                bold("ferrosan-ctl"),
                roman("(1); the reference this page is made from: "),
                italic("/usr/share/doc/ferrosan/docs/CONFIG.md"),
                roman(", with OPERATIONS.md and the guides beside it."),
            ])
            .render()
    }
}

/// The text of inlines without their fonts (headings, header cells).
fn plain(inlines: &[Inline]) -> String {
    let mut out = Roff::new();
    out.text(inlines.to_vec());
    // A heading's text has no control characters of roff's: strip what rendering added.
    out.to_roff()
        .replace("\\fB", "")
        .replace("\\fI", "")
        .replace("\\fR", "")
        .replace("\\-", "-")
        .replace("\\(aq", "'")
        .replace("\\e", "\\")
        .replace("\\&", "")
        .trim()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_has_every_section_and_key_of_the_reference() {
        let page = page();
        assert!(page.contains("\n.TH FERROSAN.TOML 5 "), "{:.300}", page);
        for section in [
            "NAME",
            "SYNOPSIS",
            "DESCRIPTION",
            "\"FILE FORMAT\"",
            "AUTHENTICATION",
            "\"SEE ALSO\"",
        ] {
            assert!(page.contains(&format!(".SH {section}\n")), "{section}");
        }
        assert!(
            page.contains(".SS [server]\n") || page.contains(".SS \"[server]\"\n"),
            "the [server] subsection"
        );
        // A subsection for every ### heading, a tagged paragraph for every table body row.
        let h3 = CONFIG_MD.lines().filter(|l| l.starts_with("### ")).count();
        assert_eq!(page.matches("\n.SS ").count(), h3);
        let rows = CONFIG_MD
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("|---"))
            .count();
        let tables = CONFIG_MD.lines().filter(|l| l.starts_with("|---")).count();
        assert_eq!(
            page.matches("\n.TP\n").count(),
            rows - tables,
            "header rows are not rows"
        );
        // A key in bold, its type and default after their headers' names.
        assert!(page.contains("\\fBworkers\\fR"), "workers");
        assert!(page.contains("\\fItype: \\fR"), "type");
        assert!(page.contains("\\fIdefault: \\fR"), "default");
    }

    #[test]
    fn man_renders_the_page() {
        let Ok(mut man) = std::process::Command::new("man")
            .args(["-l", "-"])
            .env("MANWIDTH", "80")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
        else {
            eprintln!("no man(1) here: rendering not checked");
            return;
        };
        use std::io::Write as _;
        let page = page();
        if let Some(mut stdin) = man.stdin.take() {
            stdin.write_all(page.as_bytes()).unwrap();
        }
        let out = man.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let warnings = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{warnings}");
        // A long path or array in a key's line cannot be hyphenated: typography, not an
        // error of the page. Anything else troff says is.
        let errors: Vec<&str> = warnings
            .lines()
            .filter(|l| !l.contains("cannot adjust line") && !l.contains("cannot break line"))
            .filter(|l| !l.trim().is_empty())
            .collect();
        assert!(errors.is_empty(), "man warned: {errors:?}");
        assert!(
            text.contains("ferrosan.toml - the configuration"),
            "{text:.400}"
        );
        assert!(text.contains("identity_seed"), "a key of [server]");
        assert!(text.contains("max_connections"), "a key of [limits]");
    }
}
