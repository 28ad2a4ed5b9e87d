//! `ferrosan systemd-dropin`: the drop-in the packaged unit needs to serve a config's block
//! devices and files outside its state directory. The unit is sandboxed for RAM and files in
//! /var/lib/ferrosan (PrivateDevices, ProtectSystem=strict, ProtectHome); what a config names
//! beyond that is opened up here, device by device and directory by directory, not wholesale.
//! With `--udev` it prints the udev rule that gives exactly those block devices' nodes to the
//! group ferrosan, instead of the unit joining the group disk (every disk's nodes).

use std::collections::BTreeSet;
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
    match Config::load(&args.config) {
        Ok(config) if args.udev => {
            print!("{}", udev_rules(&config, &args.config));
            ExitCode::SUCCESS
        }
        Ok(config) => {
            print!("{}", dropin(&config, &args.config));
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!("{errors}");
            ExitCode::from(1)
        }
    }
}

/// The drop-in's text for `config` (read from `file`).
pub fn dropin(config: &Config, file: &Path) -> String {
    let mut blocks = Vec::new();
    let mut dirs = BTreeSet::new();
    let mut rbd = false;
    for d in &config.devices {
        match &d.store {
            StoreKind::Block { path } => blocks.push((path.clone(), d.read_only)),
            // The directory, not the file: ferrosan creates a missing file of a given size.
            StoreKind::File { path, .. } => {
                if let Some(dir) = path.parent().filter(|p| !under_unit_writable(p)) {
                    dirs.insert(dir.to_path_buf());
                }
            }
            StoreKind::Rbd(_) => rbd = true,
            StoreKind::Ram { .. } => {}
        }
    }
    if let Some(state) = config
        .server
        .state_dir
        .as_ref()
        .filter(|p| !under_unit_writable(p))
    {
        dirs.insert(state.clone());
    }
    let mut out = format!(
        "# /etc/systemd/system/ferrosan.service.d/devices.conf, made by\n\
         #   ferrosan systemd-dropin --config {}\n\
         # for that config's devices; then: systemctl daemon-reload && systemctl restart ferrosan\n\
         [Service]\n",
        file.display()
    );
    if blocks.is_empty() && dirs.is_empty() && !rbd {
        out.push_str(
            "# Nothing to add: RAM devices and files in /var/lib/ferrosan need no change.\n",
        );
        return out;
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
    out
}

fn block_devices(out: &mut String, blocks: &[(PathBuf, bool)]) {
    out.push_str(
        "# Block devices: the unit's own /dev again, with only these devices allowed (the\n\
         # device cgroup refuses the others even to the group disk).\n\
         PrivateDevices=no\n",
    );
    for (path, read_only) in blocks {
        let mode = if *read_only { "r" } else { "rw" };
        let _ = writeln!(out, "DeviceAllow={} {mode}", quoted(path));
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
/// a symlink udev makes (`/dev/disk/by-id/…`, `/dev/mapper/…`, `/dev/VG/LV`).
pub fn udev_rules(config: &Config, file: &Path) -> String {
    let mut out = format!(
        "# /etc/udev/rules.d/60-ferrosan.rules, made by\n\
         #   ferrosan systemd-dropin --udev --config {}\n\
         # gives that config's block devices to the group ferrosan; then:\n\
         #   udevadm control --reload && udevadm trigger --subsystem-match=block\n",
        file.display()
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
                    path.display()
                );
            }
        }
    }
    if !any {
        out.push_str("# Nothing to add: the config has no block devices.\n");
    }
    out
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

fn directories(out: &mut String, dirs: &BTreeSet<PathBuf>) {
    out.push_str("# Files and state outside /var/lib/ferrosan: these directories writable (make them\n# the user ferrosan's: chown ferrosan: DIR).\n");
    if dirs.iter().any(|d| HOMES.iter().any(|h| d.starts_with(h))) {
        out.push_str("# A home directory: ProtectHome=yes would hide it.\nProtectHome=no\n");
    }
    let list: Vec<String> = dirs.iter().map(|d| quoted(d)).collect();
    let _ = writeln!(out, "ReadWritePaths={}", list.join(" "));
}

fn under_unit_writable(p: &Path) -> bool {
    UNIT_WRITABLE.iter().any(|w| p.starts_with(w))
}

/// A path as systemd reads one word: quoted (with `\` and `"` escaped) when it has a space,
/// a quote or a backslash.
fn quoted(p: &Path) -> String {
    let s = p.display().to_string();
    if s.chars()
        .any(|c| c.is_whitespace() || c == '"' || c == '\\' || c == '\'')
    {
        format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
    } else {
        s
    }
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
}
