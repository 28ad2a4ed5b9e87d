//! `ferrosan systemd-dropin`: the drop-in the packaged unit needs to serve a config's block
//! devices and files outside its state directory. The unit is sandboxed for RAM and files in
//! /var/lib/ferrosan (PrivateDevices, ProtectSystem=strict, ProtectHome); what a config names
//! beyond that is opened up here, device by device and directory by directory, not wholesale.
//! With `--udev` it prints the udev rule that gives exactly those block devices' nodes to the
//! group ferrosan, instead of the unit joining the group disk (every disk's nodes).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use engine::config::{Config, StoreKind};

/// Where the packaged unit keeps state and may already write.
const UNIT_WRITABLE: [&str; 2] = ["/var/lib/ferrosan", "/etc/ferrosan"];
/// What the unit's ProtectHome=yes hides.
const HOMES: [&str; 3] = ["/home", "/root", "/run/user"];

#[derive(Args)]
pub struct DropinArgs {
    /// The configuration the unit serves.
    #[arg(long, short, default_value = "/etc/ferrosan/ferrosan.toml")]
    config: PathBuf,
    /// Print the udev rule for the config's block devices (for
    /// /etc/udev/rules.d/60-ferrosan.rules) instead of the drop-in.
    #[arg(long)]
    udev: bool,
}

pub fn run(args: DropinArgs) -> ExitCode {
    let config = match Config::load(&args.config) {
        Ok(config) => config,
        Err(errors) => {
            eprintln!("{errors}");
            return ExitCode::from(1);
        }
    };
    let text = if args.udev {
        udev_rules(&config, &args.config)
    } else {
        dropin(&config, &args.config)
    };
    match text {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ferrosan systemd-dropin: {e}");
            ExitCode::from(1)
        }
    }
}

/// A path the drop-in or the udev rules cannot hold as the path it is: written, it would
/// name another path or, with a newline, add a line of its own (a unit's `ExecStartPre=+…`
/// runs as root). Nothing is printed then.
#[derive(Debug, PartialEq, Eq)]
pub struct Unwritable {
    pub path: PathBuf,
    pub why: &'static str,
}

impl std::fmt::Display for Unwritable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?}: {}; nothing written (name it by a path without them, e.g. a symlink)",
            self.path, self.why
        )
    }
}

/// The drop-in's text for `config` (read from `file`), or the first path it cannot hold.
pub fn dropin(config: &Config, file: &Path) -> Result<String, Unwritable> {
    let mut blocks = Vec::new();
    let mut dirs = BTreeMap::new();
    let mut rbd = false;
    for d in &config.devices {
        match &d.store {
            StoreKind::Block { path } => blocks.push((quoted(path)?, d.read_only)),
            // The directory, not the file: ferrosan creates a missing file of a given size.
            StoreKind::File { path, .. } => {
                let dir = path.parent().unwrap_or(path);
                if !under_unit_writable(dir) {
                    dirs.insert(dir.to_path_buf(), quoted(dir)?);
                }
            }
            StoreKind::Rbd(_) => rbd = true,
            StoreKind::Ram { .. } => {}
        }
    }
    if let Some(state) = &config.server.state_dir {
        if !under_unit_writable(state) {
            dirs.insert(state.clone(), quoted(state)?);
        }
    }
    let mut out = format!(
        "# /etc/systemd/system/ferrosan.service.d/devices.conf, made by\n\
         #   ferrosan systemd-dropin --config {}\n\
         # for that config's devices; then: systemctl daemon-reload && systemctl restart ferrosan\n\
         [Service]\n",
        commented(file)?
    );
    if blocks.is_empty() && dirs.is_empty() && !rbd {
        out.push_str(
            "# Nothing to add: RAM devices and files in /var/lib/ferrosan need no change.\n",
        );
        return Ok(out);
    }
    if !blocks.is_empty() {
        block_devices(&mut out, &blocks);
    }
    if !dirs.is_empty() {
        directories(&mut out, &dirs);
    }
    if rbd {
        out.push_str(
            "# RBD: the unit reads ceph.conf and the keyring it names as the user ferrosan: give\n\
             # that client's keyring to the group ferrosan (mode 0640), not client.admin's.\n",
        );
    }
    Ok(out)
}

/// `blocks`: each device's path as [`quoted`] wrote it, and whether it is read-only.
fn block_devices(out: &mut String, blocks: &[(String, bool)]) {
    out.push_str(
        "# Block devices: the unit's own /dev again, with only these devices allowed (the\n\
         # device cgroup refuses the others even to the group disk).\n\
         PrivateDevices=no\n",
    );
    for (path, read_only) in blocks {
        let mode = if *read_only { "r" } else { "rw" };
        let _ = writeln!(out, "DeviceAllow={path} {mode}");
    }
    out.push_str(
        "# Their nodes are root:disk 0660. The udev rule of\n\
         #   ferrosan systemd-dropin --udev --config FILE > /etc/udev/rules.d/60-ferrosan.rules\n\
         # (then: udevadm control --reload && udevadm trigger --subsystem-match=block) gives\n\
         # exactly these to the group ferrosan. Without it, join the group disk instead (every\n\
         # disk's nodes; the DeviceAllow lines above still refuse the others):\n\
         #SupplementaryGroups=disk\n",
    );
}

/// The udev rule giving `config`'s block devices to the group ferrosan: read and write, or
/// read only for a read-only device. A node is matched by its kernel name (`/dev/md0`) or by
/// a symlink udev makes (`/dev/disk/by-id/…`, `/dev/mapper/…`, `/dev/VG/LV`); another path
/// gets a comment, and one that not even a comment can hold refuses the whole.
pub fn udev_rules(config: &Config, file: &Path) -> Result<String, Unwritable> {
    let mut out = format!(
        "# /etc/udev/rules.d/60-ferrosan.rules, made by\n\
         #   ferrosan systemd-dropin --udev --config {}\n\
         # gives that config's block devices to the group ferrosan; then:\n\
         #   udevadm control --reload && udevadm trigger --subsystem-match=block\n",
        commented(file)?
    );
    let mut any = false;
    for d in &config.devices {
        let StoreKind::Block { path } = &d.store else {
            continue;
        };
        any = true;
        let mode = if d.read_only { "0640" } else { "0660" };
        match udev_match(path) {
            Some(m) => {
                let _ = writeln!(
                    out,
                    "SUBSYSTEM==\"block\", {m}, GROUP=\"ferrosan\", MODE=\"{mode}\""
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "# {}: not under /dev, or not a name udev matches: give it to the group \
                     ferrosan by hand",
                    commented(path)?
                );
            }
        }
    }
    if !any {
        out.push_str("# Nothing to add: the config has no block devices.\n");
    }
    Ok(out)
}

/// The udev match for a device node path: `KERNEL=="md0"` for `/dev/md0`, `SYMLINK=="…"` for
/// a link below /dev; None for anything udev could not name.
fn udev_match(path: &Path) -> Option<String> {
    let rel = path.strip_prefix("/dev").ok()?.to_str()?;
    // A udev match value is a glob in double quotes: nothing that would change its meaning.
    let plain = |s: &str| {
        !s.is_empty()
            && s.chars().all(|c| {
                c.is_ascii_alphanumeric()
                    || matches!(c, '.' | '_' | '-' | ':' | '/' | '+' | '@' | '=')
            })
    };
    if !plain(rel) || rel.split('/').any(|part| part.is_empty() || part == "..") {
        return None;
    }
    Some(if rel.contains('/') {
        format!("SYMLINK==\"{rel}\"")
    } else {
        format!("KERNEL==\"{rel}\"")
    })
}

/// `dirs`: each directory, and its path as [`quoted`] wrote it.
fn directories(out: &mut String, dirs: &BTreeMap<PathBuf, String>) {
    out.push_str("# Files and state outside /var/lib/ferrosan: these directories writable (make them\n# the user ferrosan's: chown ferrosan: DIR).\n");
    if dirs.keys().any(|d| HOMES.iter().any(|h| d.starts_with(h))) {
        out.push_str("# A home directory: ProtectHome=yes would hide it.\nProtectHome=no\n");
    }
    let list: Vec<&str> = dirs.values().map(String::as_str).collect();
    let _ = writeln!(out, "ReadWritePaths={}", list.join(" "));
}

fn under_unit_writable(p: &Path) -> bool {
    UNIT_WRITABLE.iter().any(|w| p.starts_with(w))
}

/// A path as a comment can hold it: UTF-8 (what is printed is the path itself) without a
/// control character (a newline would end the comment and begin a line of the path's own).
fn commented(p: &Path) -> Result<&str, Unwritable> {
    let refuse = |why| Unwritable {
        path: p.to_path_buf(),
        why,
    };
    let s = p.to_str().ok_or_else(|| refuse("not UTF-8"))?;
    if s.chars().any(char::is_control) {
        return Err(refuse(
            "it holds a control character (a newline would begin a line of its own)",
        ));
    }
    Ok(s)
}

/// A path as one word of `DeviceAllow=` or `ReadWritePaths=`: absolute, in double quotes when
/// it holds whitespace. Refused rather than escaped: a control character, `"`, `'`, `\` or
/// `%`. How systemd unescapes inside a word (C escapes or not) and which settings expand
/// specifiers (`%h`) has varied with the setting and the version; a path without these
/// characters means the same to every systemd, quoted or not, and a device or a directory can
/// always be named without them (a symlink).
fn quoted(p: &Path) -> Result<String, Unwritable> {
    let s = commented(p)?;
    let refuse = |why| Unwritable {
        path: p.to_path_buf(),
        why,
    };
    if !p.is_absolute() {
        return Err(refuse("not an absolute path, which systemd needs here"));
    }
    if s.chars().any(|c| matches!(c, '"' | '\'' | '\\' | '%')) {
        return Err(refuse(
            "it holds a quote, a backslash or `%`, which systemd reads as quoting or a specifier",
        ));
    }
    Ok(if s.chars().any(char::is_whitespace) {
        format!("\"{s}\"")
    } else {
        s.to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udev_names_a_node_by_its_kernel_name_or_a_link() {
        let m = |p: &str| udev_match(Path::new(p));
        assert_eq!(m("/dev/md0").as_deref(), Some("KERNEL==\"md0\""));
        assert_eq!(
            m("/dev/disk/by-id/nvme-Samsung_SSD_980_S64DNX0R123456").as_deref(),
            Some("SYMLINK==\"disk/by-id/nvme-Samsung_SSD_980_S64DNX0R123456\"")
        );
        assert_eq!(
            m("/dev/mapper/vg0-lun1").as_deref(),
            Some("SYMLINK==\"mapper/vg0-lun1\"")
        );
        // What udev cannot match as written: not under /dev, a glob, a quote, `..`.
        for bad in [
            "/srv/disk.img",
            "/dev/sd*",
            "/dev/x\"y",
            "/dev/../etc/passwd",
            "/dev/",
        ] {
            assert_eq!(m(bad), None, "{bad}");
        }
    }

    /// A config made in memory (as `ctl` edits make them), past the load's checks.
    fn with(store: StoreKind, state_dir: Option<&str>) -> Config {
        let mut config = Config::demo();
        let mut device = Config::device_from_spec("b", "block:/dev/md0").unwrap();
        device.store = store;
        config.devices.push(device.into());
        config.server.state_dir = state_dir.map(PathBuf::from);
        config
    }

    fn block(path: &str) -> Config {
        with(StoreKind::Block { path: path.into() }, None)
    }

    const FILE: &str = "/etc/ferrosan/ferrosan.toml";

    /// A path with a newline would become a line of its own: an `ExecStartPre=+` of the
    /// drop-in (run as root by systemd), or a rule of the udev file. It is refused.
    #[test]
    fn a_path_that_would_break_its_line_is_refused_not_written() {
        let file = Path::new(FILE);
        let directive = "/srv/x\nExecStartPre=+/bin/sh -c id";
        let file_in = |dir: &str| StoreKind::File {
            path: Path::new(dir).join("a.img"),
            size_bytes: None,
        };
        for config in [
            block(directive),
            with(file_in(directive), None),
            with(file_in("/srv"), Some(directive)),
        ] {
            let e = dropin(&config, file).unwrap_err();
            assert_eq!(e.path, Path::new(directive), "{e}");
            assert!(e.to_string().contains("control character"), "{e}");
        }
        let e = udev_rules(&block("/srv/x\nRUN+=\"/bin/sh -c id\""), file).unwrap_err();
        assert!(e.to_string().contains("control character"), "{e}");
        // The config file's own path is printed in a comment: no newline there either.
        let e = udev_rules(&block("/dev/md1"), Path::new("/etc/f\nRUN+=\"x\"")).unwrap_err();
        assert!(e.to_string().contains("control character"), "{e}");
    }

    #[test]
    fn systemd_words_are_quoted_for_whitespace_and_refused_for_quotes_and_specifiers() {
        let file = Path::new(FILE);
        let out = dropin(&block("/dev/disk/by-id/a b"), file).unwrap();
        assert!(
            out.lines()
                .any(|l| l == "DeviceAllow=\"/dev/disk/by-id/a b\" rw"),
            "{out}"
        );
        for bad in ["/dev/a\"b", "/dev/a\\b", "/dev/%h", "/dev/a'b", "dev/md0"] {
            let e = dropin(&block(bad), file).unwrap_err();
            assert_eq!(e.path, Path::new(bad));
        }
        // A comment holds what a udev match cannot, as long as it stays one line.
        let rules = udev_rules(&block("/srv/a\"b"), file).unwrap();
        assert!(rules.contains("# /srv/a\"b: not under /dev"), "{rules}");
    }
}
