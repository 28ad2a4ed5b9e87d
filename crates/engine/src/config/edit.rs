//! Saving the running config into the operator's file by editing it, not rewriting it.
//!
//! A three-way merge over `toml_edit` documents: `base` is the config as the file last held it
//! (loaded or saved by the daemon), `running` the config to save, `file` the file's text now.
//! Both configs are rendered by the one serializer ([`Config::to_toml_with_secrets`]), so a key
//! whose rendering is the same in both did not change, and the file keeps whatever it says
//! there (a comment, a size in `G`, a default left out, a `secret_file`). Only keys that
//! changed are written, in the file's own tables; tables of pools, devices, targets, groups,
//! credentials and portal groups are matched by their name, IQN or tag; a new one is added at
//! the end of its list (in the text, right after the list's last element, under its parent)
//! and a removed one taken out. A device or target both configs hold alike is not rendered
//! at all and stays as the file has it (even if the file dropped it meanwhile: a change made on
//! one side only stands), so a save renders what changed, not the whole array. `[server]` is
//! never touched: its keys do not change while the daemon runs, and command-line overrides
//! must not reach the file.

mod render;

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use toml_edit::{ArrayOfTables, DocumentMut, Item, Table};

pub use render::Layout;

use super::Config;

/// Why the running config could not be merged into the file's text.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    #[error("the file no longer parses as TOML ({0}); not saving over it")]
    FileNotToml(toml_edit::TomlError),
    #[error("the running config does not render as TOML: {0}")]
    Render(toml_edit::TomlError),
}

/// The config file as this daemon last loaded or wrote it: the base of the next save's merge.
#[derive(Debug)]
pub struct FileBase {
    /// The config the file holds.
    pub config: Config,
    /// The text this daemon last wrote into the file, and the document it rendered that text
    /// from. A save that finds the file still holding that text edits this document instead of
    /// parsing the file, and what it writes loads as the running config it merged (the one
    /// renderer wrote every part that differs): at thousands of devices the parse and the
    /// load were most of a save's time, and neither grows with the change.
    written: Option<Written>,
}

#[derive(Debug)]
struct Written {
    text: String,
    doc: DocumentMut,
    layout: Layout,
}

/// A merged document's text, and where each of its tables stands in it.
#[derive(Debug)]
pub struct Rendered {
    pub text: String,
    pub layout: Layout,
}

/// The text a document was last rendered to, and its layout: the parts of the tables a merge
/// leaves alone are taken from it.
pub type Kept<'a> = Option<(&'a str, &'a Layout)>;

impl FileBase {
    /// The config a file held when the daemon read it (at start, on a reload).
    pub fn loaded(config: Config) -> FileBase {
        FileBase {
            config,
            written: None,
        }
    }

    /// The file after a save: `config` in `rendered`'s text, rendered from `doc`.
    pub fn written(config: Config, rendered: Rendered, doc: DocumentMut) -> FileBase {
        let Rendered { text, layout } = rendered;
        FileBase {
            config,
            written: Some(Written { text, doc, layout }),
        }
    }

    /// The document of the file whose text is `now`, and, if that is the text this daemon
    /// last wrote (its own document, not parsed again), the layout of that text. The document
    /// is taken: a save that fails after editing it leaves a base that parses the file next
    /// time.
    pub fn document(&mut self, now: &str) -> Result<(DocumentMut, Option<Layout>), MergeError> {
        match self.written.take() {
            Some(w) if w.text == now => Ok((w.doc, Some(w.layout))),
            _ => Ok((now.parse().map_err(MergeError::FileNotToml)?, None)),
        }
    }
}

/// The text of `file` with the changes from `base` to `running` applied.
pub fn merge(file: &str, base: &Config, running: &Config) -> Result<String, MergeError> {
    let mut doc: DocumentMut = file.parse().map_err(MergeError::FileNotToml)?;
    Ok(merge_into(&mut doc, None, base, running)?.text)
}

/// `doc`, a config file's document, with the changes from `base` to `running` made in it, and
/// its text. `kept`: the text `doc` was last rendered to by a merge, and its layout; the text
/// of each table the merge did not touch is taken from there.
pub fn merge_into(
    doc: &mut DocumentMut,
    kept: Kept<'_>,
    base: &Config,
    running: &Config,
) -> Result<Rendered, MergeError> {
    let render = |c: &Config| -> Result<DocumentMut, MergeError> {
        c.to_toml_with_secrets().parse().map_err(MergeError::Render)
    };
    let (base, running) = changed_only(doc, base, running);
    let (mut before, mut after) = (render(&base)?, render(&running)?);
    for key in LISTS {
        // A list trimmed to nothing on one side still has its changes to make.
        for rendered in [&mut before, &mut after] {
            let table = rendered.as_table_mut();
            if !table.contains_key(key) {
                table.insert(key, Item::ArrayOfTables(ArrayOfTables::new()));
            }
        }
    }
    let (base, running) = (&base, &running);
    each_table(after.as_table_mut(), &mut |t| t.set_at(NEW));
    let mut edits = Edits {
        touched: HashSet::new(),
        ours: kept.is_some(),
    };
    merge_table(
        doc.as_table_mut(),
        before.as_table(),
        after.as_table(),
        Some((base, running)),
        &mut edits,
    );
    let was_at = place_new_tables(doc.as_table_mut());
    settle_as_parsed(doc.as_table_mut());
    // A table's part of the text is kept if the table was there, untouched, at the last save.
    let unchanged = |at: usize| {
        let was = was_at.get(at).copied().flatten()?;
        let (text, layout) = kept?;
        (!edits.touched.contains(&was))
            .then(|| layout.part(text, was))
            .flatten()
    };
    let (text, layout) = render::render(doc, &unchanged);
    Ok(Rendered { text, layout })
}

/// Makes each table what parsing its text would: a document kept for the next save must be.
/// The lists of tables the merge emptied are taken out: they write nothing, so the parse has
/// no such key (a list filled again then goes where the parse puts a new key: at the end).
/// The keys are ordered as the parse orders them: values first (written under the header),
/// then tables and lists of tables by where the first header of each stands. The text follows
/// the positions, not the key order, but `place_new_tables` walks the keys in order (a list
/// whose first element was removed may now come after a key it used to precede). Returns the
/// table's [`first_header`] as a table, found on the way.
fn settle_as_parsed(table: &mut Table) -> Option<usize> {
    table.retain(|_, item| !matches!(item, Item::ArrayOfTables(list) if list.is_empty()));
    let mut firsts = Vec::with_capacity(table.len());
    for (_, item) in table.iter_mut() {
        firsts.push(match item {
            Item::Table(t) if t.is_dotted() => settle_as_parsed(t).and(None),
            Item::Table(t) => settle_as_parsed(t),
            Item::ArrayOfTables(list) => {
                let each = list.iter_mut().map(settle_as_parsed);
                each.collect::<Vec<_>>().into_iter().flatten().min()
            }
            _ => None,
        });
    }
    // Sorting rebuilds the table's index: at thousands of devices, most of a merge's time
    // was spent sorting tables already in order.
    if !firsts.is_sorted() {
        table.sort_values_by(|_, a, _, b| first_header(a).cmp(&first_header(b)));
    }
    let own = table.at().filter(|_| !table.is_implicit());
    own.into_iter().chain(firsts.into_iter().flatten()).min()
}

/// The position of the first header under `item` (its own or a descendant's); None for a value
/// or a dotted table, which are written with the values.
fn first_header(item: &Item) -> Option<usize> {
    fn under(t: &Table) -> Option<usize> {
        let own = t.at().filter(|_| !t.is_implicit());
        let children = t.iter().filter_map(|(_, item)| first_header(item)).min();
        own.into_iter().chain(children).min()
    }
    match item {
        Item::Table(t) if !t.is_dotted() => under(t),
        Item::ArrayOfTables(list) => list.iter().filter_map(under).min(),
        _ => None,
    }
}

/// The lists of the config that [`changed_only`] trims: those that grow with the array.
const LISTS: [&str; 2] = ["device", "target"];

/// `base` and `running` without the devices and targets they hold alike: the merge leaves an
/// element the file holds and neither config names as the file has it, so it need not be
/// rendered and compared. Saving one change to a file of thousands of devices then renders
/// that change, not the file. A list the file writes in another form than `[[device]]` tables
/// is not trimmed (the merge replaces it whole).
fn changed_only(file: &DocumentMut, base: &Config, running: &Config) -> (Config, Config) {
    let (mut trimmed_base, mut trimmed_running) = (base.clone(), running.clone());
    let tables = |key: &str| file.get(key).is_none_or(Item::is_array_of_tables);
    if tables("device") {
        (trimmed_base.devices, trimmed_running.devices) =
            keep_changed(&base.devices, &running.devices, |d| d.name.as_str());
    }
    if tables("target") {
        (trimmed_base.targets, trimmed_running.targets) =
            keep_changed(&base.targets, &running.targets, |t| t.iqn.as_str());
    }
    (trimmed_base, trimmed_running)
}

/// The elements of `was` and of `now` whose name was added, removed or changed between them.
fn keep_changed<T: PartialEq>(
    was: &[std::sync::Arc<T>],
    now: &[std::sync::Arc<T>],
    name: impl Fn(&T) -> &str,
) -> (Vec<std::sync::Arc<T>>, Vec<std::sync::Arc<T>>) {
    // The lists' common ends (the same elements, which a verb that adds, removes or edits one
    // leaves in place) are passed over by pointer; names are unique in each list, so none of
    // them is also in the rest, which is matched by name.
    let same = |(a, b): (&std::sync::Arc<T>, &std::sync::Arc<T>)| std::sync::Arc::ptr_eq(a, b);
    let head = was.iter().zip(now).take_while(|&p| same(p)).count();
    let (was, now) = (&was[head..], &now[head..]);
    let tail = was
        .iter()
        .rev()
        .zip(now.iter().rev())
        .take_while(|&p| same(p))
        .count();
    let (was, now) = (&was[..was.len() - tail], &now[..now.len() - tail]);
    let changed = changed_names(was, now, &name);
    let keep = |list: &[std::sync::Arc<T>]| {
        let kept = list.iter().filter(|e| changed.contains(name(e)));
        kept.cloned().collect()
    };
    (keep(was), keep(now))
}

/// The names of the elements added, removed or changed from `was` to `now`.
fn changed_names<'a, T: PartialEq>(
    was: &'a [std::sync::Arc<T>],
    now: &'a [std::sync::Arc<T>],
    name: impl Fn(&'a T) -> &'a str,
) -> std::collections::HashSet<&'a str> {
    let index = |list: &'a [std::sync::Arc<T>]| -> HashMap<&'a str, &'a std::sync::Arc<T>> {
        list.iter().map(|e| (name(e), e)).collect()
    };
    let (was_by, now_by) = (index(was), index(now));
    let differs = |a: &std::sync::Arc<T>, b: Option<&&std::sync::Arc<T>>| {
        b.is_none_or(|b| !(std::sync::Arc::ptr_eq(a, b) || **a == ***b))
    };
    let mut changed: std::collections::HashSet<&str> = was_by
        .iter()
        .filter(|(n, e)| differs(e, now_by.get(*n)))
        .map(|(n, _)| *n)
        .collect();
    changed.extend(
        now_by
            .iter()
            .filter(|(n, e)| differs(e, was_by.get(*n)))
            .map(|(n, _)| *n),
    );
    changed
}

/// A table's position as the merge counts it: toml_edit's rank of its header, never negative
/// for what it parsed or the merge numbered.
trait Ranked {
    fn at(&self) -> Option<usize>;
    fn set_at(&mut self, at: usize);
}

impl Ranked for Table {
    fn at(&self) -> Option<usize> {
        self.position().and_then(|p| usize::try_from(p).ok())
    }

    fn set_at(&mut self, at: usize) {
        self.set_position(Some(isize::try_from(at).unwrap_or(isize::MAX)));
    }
}

/// The position of a table the merge copies from the running config's rendering.
const NEW: usize = isize::MAX as usize;

/// Calls `f` on `table` and every table under it, in the order toml_edit's `Display` visits
/// them (a table, then its children in key order), skipping dotted tables as it does.
fn each_table(table: &mut Table, f: &mut dyn FnMut(&mut Table)) {
    if !table.is_dotted() {
        f(table);
    }
    for (_, item) in table.iter_mut() {
        match item {
            Item::Table(t) => each_table(t, f),
            Item::ArrayOfTables(a) => a.iter_mut().for_each(|t| each_table(t, f)),
            _ => {}
        }
    }
}

/// toml_edit writes a document's tables sorted by `Table::position()` (the rank of their
/// header in the text they were parsed from), not under their parent. A table copied from
/// the rendered config would keep that text's rank and land anywhere among the file's: a
/// `[[target.group]]` of the first target written after the second `[[target]]` header
/// belongs to the second. So each table is ranked by the last of the file's tables visited
/// up to it (itself, if it is one), then by visiting order: the file's tables keep their
/// order, and a new one comes right after what logically precedes it (its previous
/// sibling's subtree, or its parent), inside its parent's part of the text. The tables are
/// then numbered `0..n` in that order; returned: the position each had before (None for a
/// new one), by its new one.
fn place_new_tables(doc: &mut Table) -> Vec<Option<usize>> {
    let mut anchors = Vec::new();
    let mut was = Vec::new();
    let mut anchor = 0;
    each_table(doc, &mut |t| {
        let own = t.at().filter(|&p| p != NEW);
        anchor = own.unwrap_or(anchor);
        anchors.push(anchor);
        was.push(own);
    });
    let mut order: Vec<usize> = (0..anchors.len()).collect();
    order.sort_by_key(|&i| anchors[i]); // stable: ties keep visiting order
    let mut rank = vec![0; order.len()];
    for (r, &i) in order.iter().enumerate() {
        rank[i] = r;
    }
    let mut ranks = rank.into_iter();
    each_table(doc, &mut |t| t.set_at(ranks.next().unwrap_or(0)));
    order.into_iter().map(|i| was[i]).collect()
}

/// The key naming each element of an array of tables.
fn identity_key(array: &str) -> Option<&'static str> {
    match array {
        "device" | "group" | "pool" => Some("name"),
        "target" => Some("iqn"),
        "credentials" => Some("initiator"),
        "portal_group" => Some("tag"),
        _ => None,
    }
}

/// An item's rendering without its whitespace and comments, for comparing.
fn bare(item: &Item) -> String {
    match item {
        Item::Value(v) => {
            let mut v = v.clone();
            v.decor_mut().clear();
            v.to_string()
        }
        other => other.to_string(),
    }
}

/// Whether the part of the config under a top-level key is the same in both configs: then
/// its renderings are the same too (one renderer), and need not be made to be compared.
/// (Not the converse: a difference the renderer does not write, the cache of a RAM device,
/// leaves the renderings to say.)
fn same_part(key: &str, (base, running): (&Config, &Config)) -> bool {
    match key {
        "device" => base.devices == running.devices,
        "target" => base.targets == running.targets,
        "pool" => base.pools == running.pools,
        "portal_group" => base.portal_groups == running.portal_groups,
        "limits" => base.limits == running.limits,
        "discovery" => base.discovery == running.discovery,
        _ => false,
    }
}

/// Whether an item renders the same in both (what a key that did not change does), without
/// rendering where that is known: lists of tables of different lengths differ.
fn renders_same(was: &Item, wanted: &Item) -> bool {
    if let (Item::ArrayOfTables(a), Item::ArrayOfTables(b)) = (was, wanted) {
        if a.len() != b.len() {
            return false;
        }
    }
    bare(was) == bare(wanted)
}

/// What a merge knows and notes on its way.
struct Edits {
    /// The position of each table whose part of the text the merge changed (a dotted table's
    /// part is its parent's).
    touched: HashSet<usize>,
    /// The document is the one this daemon rendered `base` to: it holds the elements `base`
    /// holds, no others (its text loads as `base`).
    ours: bool,
}

/// `configs`: the base and running configs at the top level (None below it).
fn merge_table(
    doc: &mut Table,
    before: &Table,
    after: &Table,
    configs: Option<(&Config, &Config)>,
    edits: &mut Edits,
) {
    let owner = doc.at();
    merge_table_of(doc, before, after, configs, owner, edits);
}

/// [`merge_table`] of a table whose text is written in the part of the table at `owner`
/// (itself, unless it is dotted).
fn merge_table_of(
    doc: &mut Table,
    before: &Table,
    after: &Table,
    configs: Option<(&Config, &Config)>,
    owner: Option<usize>,
    edits: &mut Edits,
) {
    let owner = if doc.is_dotted() { owner } else { doc.at() };
    let top = configs.is_some();
    for (key, wanted) in after.iter() {
        if top && key == "server" {
            continue;
        }
        let was = before.get(key);
        let same = |w: &Item| configs.is_some_and(|c| same_part(key, c)) || renders_same(w, wanted);
        if was.is_some_and(same) {
            continue;
        }
        match (doc.get_mut(key), wanted) {
            (Some(Item::ArrayOfTables(have)), Item::ArrayOfTables(want)) => {
                let empty = ArrayOfTables::new();
                let was = was.and_then(Item::as_array_of_tables).unwrap_or(&empty);
                merge_array(have, was, want, identity_key(key), edits);
            }
            (Some(Item::Table(have)), Item::Table(want)) => {
                let empty = Table::new();
                let was = was.and_then(Item::as_table).unwrap_or(&empty);
                merge_table_of(have, was, want, None, owner, edits);
            }
            (Some(Item::Value(have)), Item::Value(want)) => {
                // The new value where the old one stood, with its comments and spacing.
                let decor = have.decor().clone();
                *have = want.clone();
                *have.decor_mut() = decor;
                edits.touched.extend(owner);
            }
            // Absent from the file (a default it left out), or written in another form.
            _ => {
                doc.insert(key, wanted.clone());
                edits.touched.extend(owner);
            }
        }
    }
    let gone: Vec<String> = before
        .iter()
        .map(|(key, _)| key.to_string())
        .filter(|key| !(after.contains_key(key) || top && key == "server"))
        .collect();
    for key in gone {
        doc.remove(&key);
        edits.touched.extend(owner);
    }
}

/// The identity of an element (its name, IQN or tag): the value, however the text spells it
/// (`'vm1'` and `"vm1"`, `0x1` and `1` are one element), and without rendering it.
fn identity<'t>(table: &'t Table, key: Option<&str>) -> Option<Cow<'t, str>> {
    let item = table.get(key?)?;
    Some(match item.as_value() {
        Some(toml_edit::Value::String(s)) => Cow::Borrowed(s.value()),
        Some(toml_edit::Value::Integer(i)) => Cow::Owned(i.value().to_string()),
        _ => Cow::Owned(bare(item)),
    })
}

fn merge_array(
    doc: &mut ArrayOfTables,
    before: &ArrayOfTables,
    after: &ArrayOfTables,
    key: Option<&str>,
    edits: &mut Edits,
) {
    let Some(key) = key else {
        // Nothing to match elements by: the list as it is now.
        *doc = after.clone();
        return;
    };
    // Elements are matched by identity through maps, not by walking the lists for each one:
    // a file of thousands of devices is merged in time linear in them. `before` and `after`
    // hold what changed; the file's elements are looked up, not copied.
    let was_at = positions(before, key, |_| true);
    let wanted = positions(after, key, |_| true);
    // In a document of this daemon's, an element new to `before` is not in the file either: the
    // file's thousands are not looked through for a volume just created.
    let ours = edits.ours;
    let look = |id: &str| wanted.contains_key(id) && (!ours || was_at.contains_key(id));
    let mut have_at = match wanted.keys().any(|id| look(id)) {
        true => positions(doc, key, look),
        false => HashMap::new(),
    };
    for want in after.iter() {
        let Some(id) = identity(want, Some(key)) else {
            continue;
        };
        let was = was_at.get(&*id).and_then(|&i| before.get(i));
        let at = have_at.get(&*id).copied();
        match at.and_then(|i| doc.get_mut(i)) {
            Some(have) => {
                let empty = Table::new();
                merge_table(have, was.unwrap_or(&empty), want, None, edits);
            }
            None => {
                have_at.entry(id.into_owned()).or_insert(doc.len());
                doc.push(want.clone());
            }
        }
    }
    // How many elements of each identity go: the first ones of it in the file.
    let mut gone: HashMap<String, usize> = HashMap::new();
    for id in before.iter().filter_map(|t| identity(t, Some(key))) {
        if !wanted.contains_key(&*id) {
            *gone.entry(id.into_owned()).or_default() += 1;
        }
    }
    if gone.is_empty() {
        return;
    }
    doc.retain(|t| {
        let Some(left) = identity(t, Some(key)).and_then(|id| gone.get_mut(&*id)) else {
            return true;
        };
        if *left == 0 {
            return true;
        }
        *left -= 1;
        false
    });
}

/// The position of the first element of each identity in `list` that `wanted`.
fn positions(
    list: &ArrayOfTables,
    key: &str,
    wanted: impl Fn(&str) -> bool,
) -> HashMap<String, usize> {
    let mut at = HashMap::new();
    for (i, t) in list.iter().enumerate() {
        match identity(t, Some(key)) {
            Some(id) if wanted(&id) => {
                at.entry(id.into_owned()).or_insert(i);
            }
            _ => {}
        }
    }
    at
}

/// Writes `text` to `path` through a temporary file beside it, an fsync and a rename, so a
/// reader finds the old text or the new, never part of one. The file's mode is kept (0600 for
/// a new file), never more open than 0640 when `secret`. Err: the path that failed, and why.
pub fn write_atomically(
    path: &std::path::Path,
    text: &str,
    secret: bool,
) -> Result<(), (std::path::PathBuf, std::io::Error)> {
    use std::io::Write as _;
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let name = path.file_name().ok_or_else(|| {
        let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name");
        (path.to_path_buf(), e)
    })?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let at_tmp = |e| (tmp.clone(), e);
    let mode = std::fs::metadata(path).map_or(0o600, |m| m.permissions().mode() & 0o777);
    let mode = if secret { mode & 0o640 } else { mode };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(at_tmp)?;
    // The mode of a file left by an earlier attempt is not changed by open: set it.
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(at_tmp)?;
    file.write_all(text.as_bytes()).map_err(at_tmp)?;
    file.sync_all().map_err(at_tmp)?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(|e| (path.to_path_buf(), e))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"# Our array: edit with care.
[server]
workers = 2

[limits]
max_sessions = 64   # a small lab

[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]

# The VM images.
[[device]]
name = "vm1"
store = "ram"
size = "1G"     # one gibibyte

[[device]]
name = "vm2"
store = "ram"
size = "2G"

[[target]]
iqn = "iqn.2026-11.org.example:store1"
  # Everyone sees vm1.
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "vm1" } ]
"#;

    fn parse(text: &str) -> Config {
        Config::from_toml_str(text, "test").unwrap()
    }

    #[test]
    fn only_what_changed_changes() {
        let base = parse(FILE);
        let mut running = base.clone();
        // Map vm2 as LUN 1, remove nothing, change one limit.
        let group = &mut std::sync::Arc::make_mut(&mut running.targets[0]).groups[0];
        group.luns.push(super::super::LunMapping {
            lun: 1,
            device: "vm2".into(),
            read_only: true,
        });
        running.limits.max_sessions = 128;
        let text = merge(FILE, &base, &running).unwrap();
        assert_eq!(parse(&text), running, "the file says what runs:\n{text}");
        for kept in [
            "# Our array: edit with care.",
            "# The VM images.",
            "size = \"1G\"     # one gibibyte",
            "# Everyone sees vm1.",
            "[server]\nworkers = 2",
        ] {
            assert!(text.contains(kept), "{kept:?} lost:\n{text}");
        }
        assert!(
            text.contains("max_sessions = 128   # a small lab"),
            "{text}"
        );
        // Nothing spelled out that was not written before.
        assert!(!text.contains("serial"), "{text}");
        assert!(!text.contains("block_size"), "{text}");
    }

    /// An element is found by its name's value, however the file spells the string (`'vm2'`,
    /// `"vm2"`, `"""vm2"""`), and by its tag's value (`0x1`, `1`).
    #[test]
    fn elements_are_matched_by_value_not_by_spelling() {
        let file = FILE
            .replace("name = \"vm2\"", "name = 'vm2'")
            .replace("name = \"all\"", "name = \"\"\"all\"\"\"")
            .replace("tag = 1", "tag = 0x1");
        let base = parse(&file);
        let mut running = base.clone();
        let vm2 = std::sync::Arc::make_mut(&mut running.devices[1]);
        assert_eq!(vm2.name, "vm2");
        vm2.read_only = true;
        std::sync::Arc::make_mut(&mut running.targets[0]).groups[0]
            .luns
            .push(super::super::LunMapping {
                lun: 1,
                device: "vm2".into(),
                read_only: false,
            });
        running.portal_groups[0]
            .listen
            .push("127.0.0.2:3260".parse().unwrap());
        let text = merge(&file, &base, &running).unwrap();
        assert_eq!(parse(&text), running, "{text}");
        for once in [
            "[[device]]\nname = 'vm2'",
            "name = \"\"\"all\"\"\"",
            "tag = 0x1",
        ] {
            assert_eq!(text.matches(once).count(), 1, "{once:?}:\n{text}");
        }
    }

    #[test]
    fn devices_added_and_removed_and_edits_of_the_file_kept() {
        let base = parse(FILE);
        let mut running = base.clone();
        running.devices.retain(|d| d.name != "vm2");
        let mut vm3 = crate::config::DeviceConfig::clone(&base.devices[0]);
        vm3.name = "vm3".into();
        vm3.serial = "vm3-serial".into();
        vm3.naa[7] ^= 0x55;
        running.devices.push(vm3.into());
        // The operator edited the file meanwhile (not reloaded): that edit stays.
        let edited = FILE.replace("max_sessions = 64", "max_sessions = 32");
        let text = merge(&edited, &base, &running).unwrap();
        let saved = parse(&text);
        assert_eq!(saved.devices, running.devices, "{text}");
        assert_eq!(saved.limits.max_sessions, 32, "{text}");
        assert!(!text.contains("\"vm2\""), "{text}");
        assert!(text.contains("# one gibibyte"), "{text}");
    }

    #[test]
    fn many_devices_matched_by_name_each_keeps_its_place_and_comment() {
        let mut file = FILE.to_string();
        let at = file.find("\n[[target]]").unwrap();
        let mut more = String::new();
        for i in 0..40 {
            more.push_str(&format!(
                "\n# disk {i}\n[[device]]\nname = \"d{i}\"\nstore = \"ram\"\nsize = \"{}M\"\n",
                i + 1
            ));
        }
        file.insert_str(at, &more);
        let base = parse(&file);
        let mut running = base.clone();
        // Every third one goes, one in the middle grows, one is added.
        let third = |name: &str| name.strip_prefix('d').and_then(|n| n.parse::<u32>().ok());
        running
            .devices
            .retain(|d| third(&d.name).is_none_or(|n| n % 3 != 0));
        let grown = running
            .devices
            .iter_mut()
            .find(|d| d.name == "d20")
            .map(std::sync::Arc::make_mut)
            .unwrap();
        grown.store = super::super::StoreKind::Ram {
            size_bytes: 64 << 20,
        };
        let mut new = crate::config::DeviceConfig::clone(&base.devices[0]);
        new.name = "late".into();
        new.serial = "late-serial".into();
        new.naa[7] ^= 0x55;
        running.devices.push(new.into());
        let text = merge(&file, &base, &running).unwrap();
        assert_eq!(parse(&text).devices, running.devices, "{text}");
        for i in 0..40 {
            let comment = format!("# disk {i}\n[[device]]\nname = \"d{i}\"");
            assert_eq!(text.contains(&comment), i % 3 != 0, "d{i}:\n{text}");
        }
        assert!(
            text.contains("name = \"d20\"\nstore = \"ram\"\nsize = \"64M\""),
            "{text}"
        );
        assert!(text.find("\"d38\"") < text.find("\"late\""), "{text}");
    }

    #[test]
    fn a_list_the_running_config_left_alone_keeps_the_files_edits() {
        let base = parse(FILE);
        let mut running = base.clone();
        running.limits.max_sessions = 100;
        // The operator took vm2 out of the file meanwhile; the running config still has it,
        // unchanged since the file was loaded: the file's edit stands.
        let edited = FILE.replace(
            "[[device]]\nname = \"vm2\"\nstore = \"ram\"\nsize = \"2G\"\n",
            "",
        );
        let text = merge(&edited, &base, &running).unwrap();
        assert!(!text.contains("vm2"), "{text}");
        assert!(text.contains("max_sessions = 100"), "{text}");
        // A device added to the running config is added; vm2, which the running config did
        // not change either, stays out as the file has it (a three-way merge: a change made
        // on one side only stands), however much else of its list changed.
        let mut vm3 = crate::config::DeviceConfig::clone(&base.devices[0]);
        vm3.name = "vm3".into();
        vm3.serial = "vm3-serial".into();
        vm3.naa[7] ^= 0x55;
        running.devices.push(vm3.into());
        let text = merge(&edited, &base, &running).unwrap();
        assert!(text.contains("\"vm3\""), "{text}");
        assert!(!text.contains("\"vm2\""), "{text}");
    }

    #[test]
    fn every_device_and_target_removed_leaves_none_in_the_file() {
        let base = parse(FILE);
        let mut running = base.clone();
        running.devices.clear();
        running.targets.clear();
        let text = merge(FILE, &base, &running).unwrap();
        assert_eq!(parse(&text), running, "{text}");
        assert!(
            !text.contains("[[device]]") && !text.contains("iqn"),
            "{text}"
        );
    }

    #[test]
    fn devices_written_as_an_inline_list_are_saved_whole() {
        let file = "device = [ { name = \"a\", store = \"ram\", size = \"16M\" },\n  \
                    { name = \"b\", store = \"ram\", size = \"16M\" } ]\n";
        let base = parse(file);
        let mut running = base.clone();
        let mut c = crate::config::DeviceConfig::clone(&base.devices[0]);
        c.name = "c".into();
        c.serial = "c-serial".into();
        c.naa[7] ^= 0x55;
        running.devices.push(c.into());
        let text = merge(file, &base, &running).unwrap();
        assert_eq!(parse(&text), running, "{text}");
        running.devices.remove(0);
        let again = merge(&text, &parse(&text), &running).unwrap();
        assert_eq!(parse(&again), running, "{again}");
    }

    #[test]
    fn a_file_that_no_longer_parses_is_not_saved_over() {
        let base = parse(FILE);
        let e = merge("[[device]\nname =", &base, &base).unwrap_err();
        assert!(e.to_string().contains("not saving over it"), "{e}");
    }

    /// Two targets, each with a group: what the issue's file looked like.
    const TWO_TARGETS: &str = r#"# Two targets.
[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]

[[device]]
name = "a"
store = "ram"
size = "1G"

[[target]]
iqn = "iqn.2026-11.test:t1"

  [[target.group]]
  name = "web"
  initiators = ["iqn.2026-11.test:web"]
  luns = [ { lun = 0, device = "a" } ]

# The second target.
[[target]]
iqn = "iqn.2026-11.test:t2"

  [[target.group]]
  name = "db"
  any_initiator = true
  luns = [ { lun = 0, device = "a" } ]
"#;

    #[test]
    fn new_tables_land_under_their_parent() {
        let base = parse(TWO_TARGETS);
        // What `ctl volume export --target t1`, `ctl credentials-add` and `ctl portal-add`
        // leave running: a device, a group of t1 mapping it, t1's credentials, a portal group.
        let running = parse(
            &TWO_TARGETS
                .replace(
                    "\n[[device]]",
                    "\n[[portal_group]]\ntag = 2\nlisten = [\"127.0.0.1:3261\"]\n\n[[device]]",
                )
                .replace(
                    "\n[[target]]\niqn = \"iqn.2026-11.test:t1\"",
                    "\n[[device]]\nname = \"b\"\nstore = \"ram\"\nsize = \"2G\"\n\
                     \n[[target]]\niqn = \"iqn.2026-11.test:t1\"",
                )
                .replace(
                    "\n# The second target.",
                    "\n  [[target.group]]\n  name = \"host-x\"\n  \
                     initiators = [\"iqn.2026-11.test:x\"]\n  \
                     luns = [ { lun = 0, device = \"b\" } ]\n\
                     \n  [[target.credentials]]\n  initiator = \"iqn.2026-11.test:web\"\n  \
                     users = [ { user = \"web\", secret = \"web-secret-0001\" } ]\n\
                     \n# The second target.",
                ),
        );
        assert_eq!(running.targets[0].groups.len(), 2);
        assert_eq!(running.targets[0].credentials.len(), 1);
        let text = merge(TWO_TARGETS, &base, &running).unwrap();
        assert_eq!(parse(&text), running, "the file says what runs:\n{text}");
        let at = |needle: &str| {
            text.find(needle)
                .unwrap_or_else(|| panic!("{needle:?} not in:\n{text}"))
        };
        let (t1, t2) = (at("iqn.2026-11.test:t1"), at("# The second target."));
        for new in ["\"host-x\"", "[[target.credentials]]"] {
            assert!(t1 < at(new) && at(new) < t2, "{new} not under t1:\n{text}");
        }
        assert!(at("tag = 2") < at("[[device]]"), "{text}");
        assert!(at("name = \"b\"") < t1, "{text}");
        assert!(
            text.contains("# The second target.\n[[target]]\niqn = \"iqn.2026-11.test:t2\""),
            "{text}"
        );
    }

    #[test]
    fn pools_are_matched_by_name() {
        let file = format!(
            "{FILE}\n# Thin LVs of the fast disks.\n[[pool]]\nname = \"fast\"\nkind = \"lvm\"\n\
             vg = \"vg0\"      # the NVMe pair\nthin_pool = \"thin\"\n"
        );
        let base = parse(&file);
        let mut running = base.clone();
        let mut slow = base.pools[0].clone();
        slow.name = "slow".into();
        slow.kind = crate::config::PoolKind::Lvm(store::lvm::ThinPool {
            vg: "vg1".into(),
            pool: "thin".into(),
        });
        running.pools.push(slow);
        let text = merge(&file, &base, &running).unwrap();
        assert_eq!(parse(&text), running, "{text}");
        for kept in [
            "# Thin LVs of the fast disks.",
            "vg = \"vg0\"      # the NVMe pair",
        ] {
            assert!(text.contains(kept), "{kept:?} lost:\n{text}");
        }
    }

    /// SplitMix64: a small deterministic generator for the edits below.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        /// A number below `n` (0 when `n` is 0).
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    #[derive(Clone, Default)]
    struct Group {
        name: String,
        /// Empty: `any_initiator = true`.
        initiators: Vec<String>,
        luns: Vec<(u64, String)>,
    }

    #[derive(Clone, Default)]
    struct Target {
        iqn: String,
        groups: Vec<Group>,
        /// Initiators with credentials, each with the number its user and secret are made of.
        credentials: Vec<(String, u32)>,
    }

    /// A config that the generator edits and writes as text, its `[server]` always the same.
    #[derive(Clone, Default)]
    struct Model {
        names: u32,
        max_sessions: u32,
        portal_groups: Vec<u16>,
        /// Name and size in MiB.
        devices: Vec<(String, u32)>,
        /// Never empty.
        targets: Vec<Target>,
    }

    impl Model {
        fn new(rng: &mut Rng) -> Model {
            let mut m = Model {
                max_sessions: 64,
                portal_groups: vec![1],
                ..Model::default()
            };
            m.add_target(rng);
            m.add_target(rng);
            for _ in 0..10 {
                m.edit(rng);
            }
            m
        }

        /// A target with one group (a target needs one).
        fn add_target(&mut self, rng: &mut Rng) {
            let iqn = self.fresh("iqn.2026-11.test:t");
            self.targets.push(Target {
                iqn,
                ..Target::default()
            });
            self.add_group(self.targets.len() - 1, rng);
        }

        /// A group of target `t`, for any initiator if the target has no such group yet.
        fn add_group(&mut self, t: usize, rng: &mut Rng) {
            let has_any = self.targets[t]
                .groups
                .iter()
                .any(|g| g.initiators.is_empty());
            let name = self.fresh("g");
            let initiators = match has_any || rng.below(2) == 0 {
                true => vec![self.fresh("iqn.2026-11.test:i")],
                false => Vec::new(),
            };
            let luns = match self.devices.is_empty() {
                true => Vec::new(),
                false => vec![(0, self.devices[rng.below(self.devices.len())].0.clone())],
            };
            self.targets[t].groups.push(Group {
                name,
                initiators,
                luns,
            });
        }

        fn group(&mut self, at: Option<(usize, usize)>) -> Option<&mut Group> {
            at.map(|(t, g)| &mut self.targets[t].groups[g])
        }

        fn fresh(&mut self, prefix: &str) -> String {
            self.names += 1;
            format!("{prefix}{}", self.names)
        }

        /// One random edit, as `ctl` commands make them.
        fn edit(&mut self, rng: &mut Rng) {
            let t = rng.below(self.targets.len());
            let all: Vec<(usize, usize)> = (self.targets.iter().enumerate())
                .flat_map(|(t, x)| (0..x.groups.len()).map(move |g| (t, g)))
                .collect();
            let at = all.get(rng.below(all.len())).copied();
            match rng.below(19) {
                0 | 1 => {
                    let name = self.fresh("d");
                    self.devices.push((name, 1 + rng.below(64) as u32));
                }
                2 if !self.devices.is_empty() => {
                    let gone = self.devices.remove(rng.below(self.devices.len())).0;
                    for g in self.targets.iter_mut().flat_map(|t| &mut t.groups) {
                        g.luns.retain(|(_, d)| *d != gone);
                    }
                }
                3 => self.add_target(rng),
                4 if self.targets.len() > 1 => {
                    self.targets.remove(t);
                }
                5..=7 => self.add_group(t, rng),
                8 if self.targets[t].groups.len() > 1 => {
                    let len = self.targets[t].groups.len();
                    self.targets[t].groups.remove(rng.below(len));
                }
                9 | 10 => {
                    let devices = self.devices.clone();
                    if let Some(group) = self.group(at) {
                        let free: Vec<&(String, u32)> = devices
                            .iter()
                            .filter(|(d, _)| group.luns.iter().all(|(_, m)| m != d))
                            .collect();
                        if !free.is_empty() {
                            let lun = group.luns.iter().map(|(l, _)| l + 1).max().unwrap_or(0);
                            group
                                .luns
                                .push((lun, free[rng.below(free.len())].0.clone()));
                        }
                    }
                }
                11 => {
                    if let Some(group) = self.group(at).filter(|g| !g.luns.is_empty()) {
                        group.luns.remove(rng.below(group.luns.len()));
                    }
                }
                12 => {
                    let initiator = self.fresh("iqn.2026-11.test:i");
                    if let Some(group) = self.group(at).filter(|g| !g.initiators.is_empty()) {
                        group.initiators.push(initiator);
                    }
                }
                13 => {
                    if let Some(group) = self.group(at).filter(|g| g.initiators.len() > 1) {
                        group.initiators.remove(rng.below(group.initiators.len()));
                    }
                }
                14 | 15 => {
                    let initiator = self.fresh("iqn.2026-11.test:c");
                    self.targets[t].credentials.push((initiator, self.names));
                }
                16 if !self.targets[t].credentials.is_empty() => {
                    let len = self.targets[t].credentials.len();
                    self.targets[t].credentials.remove(rng.below(len));
                }
                17 => {
                    let tag = self.portal_groups.iter().max().map_or(1, |t| t + 1);
                    self.portal_groups.push(tag);
                }
                18 if self.portal_groups.len() > 1 => {
                    self.portal_groups
                        .remove(rng.below(self.portal_groups.len()));
                }
                // A limit and a size (also when an edit above had nothing to work on).
                _ => {
                    self.max_sessions = 16 + rng.below(200) as u32;
                    if let Some((_, mib)) = self.devices.first_mut() {
                        *mib += 1;
                    }
                }
            }
        }

        /// The config as text: as a program writes it, or (`hand`) as an operator might, with
        /// comments, other indentation, sizes in `M`, LUNs as tables, targets first and
        /// `[limits]` between the first target's header and its groups.
        fn text(&self, hand: bool) -> String {
            let note = |s: String| if hand { s } else { String::new() };
            let limits = format!(
                "\n[limits]\nmax_sessions = {}{}\n",
                self.max_sessions,
                note("   # a small lab".into())
            );
            let mut pgs = String::new();
            for tag in &self.portal_groups {
                pgs += &note(format!("\n# portal group {tag}"));
                let port = 3260 + tag;
                pgs +=
                    &format!("\n[[portal_group]]\ntag = {tag}\nlisten = [\"127.0.0.1:{port}\"]\n");
            }
            let mut devices = String::new();
            for (name, mib) in &self.devices {
                devices += &note(format!("\n# device {name}"));
                let size = match hand {
                    true => format!("\"{mib}M\"   # {mib} MiB"),
                    false => (u64::from(*mib) << 20).to_string(),
                };
                devices +=
                    &format!("\n[[device]]\nname = \"{name}\"\nstore = \"ram\"\nsize = {size}\n");
            }
            let pad = if hand { "    " } else { "  " };
            let mut targets = String::new();
            for (i, t) in self.targets.iter().enumerate() {
                targets += &note(format!("\n# target {}", t.iqn));
                targets += &format!("\n[[target]]\niqn = \"{}\"\n", t.iqn);
                if hand && i == 0 {
                    targets += &limits;
                }
                for (j, g) in t.groups.iter().enumerate() {
                    targets += &format!("\n{pad}[[target.group]]\n{pad}name = \"{}\"\n", g.name);
                    targets += &match g.initiators.is_empty() {
                        true => format!("{pad}any_initiator = true\n"),
                        false => format!("{pad}initiators = {:?}\n", g.initiators),
                    };
                    let luns = g
                        .luns
                        .iter()
                        .map(|(l, d)| format!("{{ lun = {l}, device = \"{d}\" }}"));
                    if hand && j % 2 == 1 {
                        for lun in luns {
                            let lun = lun.trim_matches(['{', '}', ' ']).replace(", ", "\n");
                            let lun = lun.replace('\n', &format!("\n{pad}"));
                            targets += &format!("\n{pad}[[target.group.luns]]\n{pad}{lun}\n");
                        }
                    } else {
                        let luns: Vec<String> = luns.collect();
                        targets += &format!("{pad}luns = [ {} ]\n", luns.join(", "));
                    }
                }
                for (initiator, n) in &t.credentials {
                    targets += &format!(
                        "\n{pad}[[target.credentials]]\n{pad}initiator = \"{initiator}\"\n\
                         {pad}users = [ {{ user = \"u{n}\", secret = \"secret-{n:08}\" }} ]\n"
                    );
                }
            }
            match hand {
                true => format!("# Hand-edited.\n[server]\nworkers = 2\n{targets}{devices}{pgs}"),
                false => format!("[server]\nworkers = 2\n{limits}{pgs}{devices}{targets}"),
            }
        }
    }

    /// Generated edits, saved one after the other into a file written by a program or by
    /// hand: the file always says what runs, and the comments of what was kept stay with it.
    #[test]
    fn saved_edits_round_trip() {
        let mut rng = Rng(0x5eed);
        for case in 0..300 {
            let mut model = Model::new(&mut rng);
            let hand = case % 3 != 0;
            let mut file = model.text(hand);
            let first = model.clone();
            let mut base = parse(&file);
            assert!(base == parse(&model.text(false)), "case {case}: {file}");
            // The document a daemon keeps between saves (`FileBase`), edited in place, and the
            // text it rendered last: the parts of what a save leaves alone are taken from it.
            let mut kept: DocumentMut = file.parse().unwrap();
            let mut layout: Option<Layout> = None;
            for save in 0..3 {
                for _ in 0..1 + rng.below(4) {
                    model.edit(&mut rng);
                }
                let running = parse(&model.text(false));
                let text = merge(&file, &base, &running).unwrap();
                let parts = layout.as_ref().map(|l| (file.as_str(), l));
                let rendered = merge_into(&mut kept, parts, &base, &running).unwrap();
                assert_eq!(rendered.text, text, "case {case}, save {save}: by parts");
                assert_eq!(kept.to_string(), text, "case {case}, save {save}: kept");
                layout = Some(rendered.layout);
                let saved = Config::from_toml_str(&text, "test")
                    .unwrap_or_else(|e| panic!("case {case}, save {save}: {e}\n{text}"));
                assert!(
                    saved == running,
                    "case {case}, save {save}:\n{file}\n---\n{text}"
                );
                (file, base) = (text, running);
            }
            if !hand {
                continue;
            }
            for t in &first.targets {
                let kept = model.targets.iter().any(|m| m.iqn == t.iqn);
                let header = format!("# target {}\n[[target]]\niqn = \"{}\"\n", t.iqn, t.iqn);
                assert_eq!(
                    file.contains(&header),
                    kept,
                    "case {case}: {}\n{file}",
                    t.iqn
                );
            }
            for (d, _) in &first.devices {
                let kept = model.devices.iter().any(|(m, _)| m == d);
                let header = format!("# device {d}\n[[device]]\nname = \"{d}\"\n");
                assert_eq!(file.contains(&header), kept, "case {case}: {d}\n{file}");
            }
        }
    }
}
