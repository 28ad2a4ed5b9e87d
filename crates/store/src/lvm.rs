//! Thin volumes of an LVM thin pool, driven through LVM's own tools (`lvcreate`, `lvextend`,
//! `lvrename`, `lvremove`, `lvs`): LVM keeps its metadata consistent across hosts and crashes,
//! and its command line is its stable interface. A volume is the thin LV `NAME`
//! (`/dev/VG/NAME`, a block device the file store opens); a snapshot of it is the thin snapshot
//! `NAME+SNAPSHOT` (`+` is valid in an LV name and never in a ferrosan object name, so the two
//! never collide), kept inactive and skipped at activation, as LVM makes thin snapshots; a
//! clone is an active thin snapshot of either, independent of its origin (LVM's thin
//! snapshots share blocks, not lifetimes).
//!
//! Every command gives its options first, each value glued to its option (`--name=NAME`),
//! then `--`, then the VG and LV names: LVM parses its command line with getopt_long, so a
//! name that slipped past the config's checks (`--config=log{file=…}`) is still a name to it,
//! never an option. The names themselves are checked in the config (`config::names`).

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long one LVM command may run. LVM waits on its lock and on udev; longer means it is
/// stuck (a suspended device, a lost lock), and the verb fails rather than hang its caller.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// The separator between a volume's name and its snapshot's in a snapshot LV's name.
pub const SNAPSHOT_SEPARATOR: char = '+';

/// What went wrong, as far as the verb that asked needs to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LvmErrorKind {
    /// The LV (or the VG, or the thin pool) does not exist.
    NotFound,
    /// An LV of that name exists already.
    Exists,
    /// The LV is open (a device still holds it).
    Busy,
    /// Anything else: LVM's own words say what.
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LvmError {
    pub kind: LvmErrorKind,
    /// The command, as run.
    pub command: String,
    /// What LVM said (its standard error, trimmed), or why it could not run.
    pub message: String,
}

impl std::fmt::Display for LvmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.command, self.message)
    }
}

impl std::error::Error for LvmError {}

/// Sorts LVM's complaint into a kind. LVM exits 5 for every failure; its message is the only
/// thing that tells them apart (stable across lvm2 2.02–2.03).
fn kind_of(stderr: &str) -> LvmErrorKind {
    let s = stderr.to_ascii_lowercase();
    if s.contains("already exists") {
        LvmErrorKind::Exists
    } else if s.contains("not found") || s.contains("failed to find") {
        LvmErrorKind::NotFound
    } else if s.contains("in use") || s.contains("is open") || s.contains("busy") {
        LvmErrorKind::Busy
    } else {
        LvmErrorKind::Failed
    }
}

/// One thin LV as `lvs` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinLv {
    pub name: String,
    pub size_bytes: u64,
    /// The LV it was snapshotted from, while that LV exists.
    pub origin: Option<String>,
    /// Whether a process holds its device open.
    pub open: bool,
}

impl ThinLv {
    /// (volume, snapshot) for a snapshot LV's name, None for a volume's.
    pub fn snapshot_of(&self) -> Option<(&str, &str)> {
        self.name.split_once(SNAPSHOT_SEPARATOR)
    }
}

/// A thin pool `VG/POOL` whose thin LVs are volumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinPool {
    pub vg: String,
    pub pool: String,
}

/// The name of the LV that holds snapshot `snapshot` of volume `volume`.
pub fn snapshot_lv(volume: &str, snapshot: &str) -> String {
    format!("{volume}{SNAPSHOT_SEPARATOR}{snapshot}")
}

impl ThinPool {
    /// The block device of LV `name`.
    pub fn device_path(&self, name: &str) -> PathBuf {
        PathBuf::from("/dev").join(&self.vg).join(name)
    }

    fn lv(&self, name: &str) -> String {
        format!("{}/{name}", self.vg)
    }

    /// Whether `VG/POOL` exists and is a thin pool. One that queues writes when full (LVM's
    /// default, `lvchange --errorwhenfull n`) is warned of: dm-thin holds a write to a full
    /// pool up to 60 s before failing it, past the hosts' command timeouts, where one that
    /// errors lets ferrosan answer SPACE ALLOCATION FAILED at once.
    pub fn check(&self) -> Result<(), LvmError> {
        let lv = self.lv(&self.pool);
        let out = lvs("--options=segtype,lv_when_full", &lv)?;
        let (segtype, when_full) = out.trim().split_once('|').unwrap_or((out.trim(), ""));
        match segtype.trim() {
            "thin-pool" => {
                if when_full.trim() != "error" {
                    tracing::warn!(thin_pool = %lv, "the thin pool queues writes when it is full (up to 60 s, past the hosts' timeouts): `lvchange --errorwhenfull y {lv}` lets ferrosan answer SPACE ALLOCATION FAILED at once");
                }
                Ok(())
            }
            other => Err(LvmError {
                kind: LvmErrorKind::Failed,
                command: format!("lvs {lv}"),
                message: format!("{lv} is a {other:?} LV, not a thin pool"),
            }),
        }
    }

    /// The VG's extent size: every LV's size is a multiple of it.
    pub fn extent_bytes(&self) -> Result<u64, LvmError> {
        let out = run(&[
            "vgs",
            "--noheadings",
            "--nosuffix",
            "--units=b",
            "--options=vg_extent_size",
            "--",
            &self.vg,
        ])?;
        out.trim().parse().map_err(|_| LvmError {
            kind: LvmErrorKind::Failed,
            command: format!("vgs {}", self.vg),
            message: format!("an extent size that is no number: {:?}", out.trim()),
        })
    }

    /// `size` rounded up to whole extents, as LVM will make it.
    pub fn rounded(&self, size: u64) -> Result<u64, LvmError> {
        let extent = self.extent_bytes()?.max(1);
        Ok(size.div_ceil(extent).saturating_mul(extent))
    }

    /// A new thin volume of `size` bytes (rounded up to whole extents), active.
    pub fn create(&self, name: &str, size: u64) -> Result<(), LvmError> {
        let size = format!("--virtualsize={size}b");
        let pool = format!("--thinpool={}", self.lv(&self.pool));
        let name = format!("--name={name}");
        run(&[
            "lvcreate",
            "--yes",
            "--quiet",
            "--type=thin",
            &size,
            &pool,
            &name,
        ])
        .map(drop)
    }

    /// A thin snapshot `name` of `origin`: active and writable (a clone) or, as LVM makes
    /// snapshots, skipped at activation and left inactive.
    pub fn snapshot(&self, origin: &str, name: &str, active: bool) -> Result<(), LvmError> {
        let origin = self.lv(origin);
        let name = format!("--name={name}");
        let mut args = vec!["lvcreate", "--yes", "--quiet", "--snapshot", &name];
        if active {
            args.extend(["--setactivationskip=n", "--activate=y"]);
        }
        args.extend(["--", &origin]);
        run(&args).map(drop)
    }

    /// Grows LV `name` to `size` bytes (rounded up to whole extents); the same size is no
    /// change.
    pub fn extend(&self, name: &str, size: u64) -> Result<(), LvmError> {
        let lv = self.lv(name);
        if self.get(name)?.is_some_and(|lv| lv.size_bytes >= size) {
            return Ok(());
        }
        let size = format!("--size={size}b");
        run(&["lvextend", "--quiet", &size, "--", &lv]).map(drop)
    }

    pub fn rename(&self, from: &str, to: &str) -> Result<(), LvmError> {
        run(&["lvrename", "--quiet", "--", &self.vg, from, to]).map(drop)
    }

    /// Removes LV `name`, waiting up to `wait` while a closing store still holds it open.
    pub fn remove(&self, name: &str, wait: Duration) -> Result<(), LvmError> {
        let lv = self.lv(name);
        let started = Instant::now();
        loop {
            match run(&["lvremove", "--yes", "--quiet", "--", &lv]) {
                Err(e) if e.kind == LvmErrorKind::Busy && started.elapsed() < wait => {
                    std::thread::sleep(Duration::from_millis(200))
                }
                other => return other.map(drop),
            }
        }
    }

    /// The thin pool's data LV: (its size, the bytes its volumes have written), as `lvs`
    /// reports them (`data_percent`, to a hundredth of a percent).
    pub fn data_usage(&self) -> Result<(u64, u64), LvmError> {
        let lv = format!("{}/{}", self.vg, self.pool);
        let out = lvs("--options=lv_size,data_percent", &lv)?;
        parse_usage(&out).ok_or_else(|| LvmError {
            kind: LvmErrorKind::Failed,
            command: format!("lvs {lv}"),
            message: format!("unexpected answer {:?}", out.trim()),
        })
    }

    /// LV `name` of the pool, if it exists.
    pub fn get(&self, name: &str) -> Result<Option<ThinLv>, LvmError> {
        Ok(self.thin_lvs()?.into_iter().find(|lv| lv.name == name))
    }

    /// The thin LVs of this pool (volumes and snapshots), by name.
    pub fn thin_lvs(&self) -> Result<Vec<ThinLv>, LvmError> {
        let out = lvs(
            "--options=lv_name,pool_lv,lv_size,origin,lv_device_open",
            &self.vg,
        )?;
        let mut lvs = parse_lvs(&out, &self.pool);
        lvs.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(lvs)
    }
}

/// `lvs OPTIONS -- WHAT`: its fields separated by `|`, sizes in bytes without a unit.
fn lvs(options: &str, what: &str) -> Result<String, LvmError> {
    run(&[
        "lvs",
        "--noheadings",
        "--nosuffix",
        "--units=b",
        "--separator=|",
        options,
        "--",
        what,
    ])
}

/// `lvs`' `SIZE|DATA_PERCENT` line of a thin pool: (size, bytes used).
fn parse_usage(out: &str) -> Option<(u64, u64)> {
    let (size, percent) = out.trim().split_once('|')?;
    let size: u64 = size.trim().parse().ok()?;
    let percent: f64 = percent.trim().parse().ok()?;
    if !(0.0..=100.0).contains(&percent) {
        return None;
    }
    // `as` rounds toward zero; the product stays below `size`, which fits.
    let used = (size as f64 * percent / 100.0) as u64;
    Some((size, used.min(size)))
}

/// `lvs`' lines (`NAME|POOL|SIZE|ORIGIN|OPEN`) of the LVs in thin pool `pool`.
fn parse_lvs(out: &str, pool: &str) -> Vec<ThinLv> {
    out.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.trim().split('|').map(str::trim).collect();
            let [name, in_pool, size, origin, open] = f[..] else {
                return None;
            };
            (in_pool == pool).then(|| ThinLv {
                name: name.to_string(),
                size_bytes: size.parse().unwrap_or(0),
                origin: (!origin.is_empty()).then(|| origin.to_string()),
                open: open == "open",
            })
        })
        .collect()
}

/// The `lvm` binary: on PATH, else where Debian and Red Hat put it (a daemon's PATH may lack
/// the sbin directories).
fn lvm_binary() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("lvm"))
        .find(|p| p.is_file());
    on_path
        .or_else(|| {
            ["/usr/sbin/lvm", "/sbin/lvm"]
                .into_iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| PathBuf::from("lvm"))
}

/// Runs `lvm ARGS…` and returns its standard output; a failure carries its standard error.
fn run(args: &[&str]) -> Result<String, LvmError> {
    #[cfg(test)]
    if let Some(answer) = tests::intercepted(args) {
        return answer;
    }
    let command = args.join(" ");
    let failed = |kind, message: String| LvmError {
        kind,
        command: command.clone(),
        message,
    };
    let mut child = Command::new(lvm_binary())
        .args(args)
        // The daemon's sockets and stores are open descriptors LVM would warn about, one line
        // each, on every command.
        .env("LVM_SUPPRESS_FD_WARNINGS", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            let hint = if e.kind() == std::io::ErrorKind::NotFound {
                " (is lvm2 installed?)"
            } else {
                ""
            };
            failed(LvmErrorKind::Failed, format!("cannot run lvm{hint}: {e}"))
        })?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < COMMAND_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(failed(
                    LvmErrorKind::Failed,
                    format!("no answer within {} s", COMMAND_TIMEOUT.as_secs()),
                ));
            }
            Err(e) => return Err(failed(LvmErrorKind::Failed, e.to_string())),
        }
    };
    let (mut out, mut err) = (String::new(), String::new());
    if let Some(mut s) = child.stdout.take() {
        let _ = s.read_to_string(&mut out);
    }
    if let Some(mut s) = child.stderr.take() {
        let _ = s.read_to_string(&mut err);
    }
    if status.success() {
        return Ok(out);
    }
    let message = err.trim().to_string();
    Err(failed(kind_of(&message), message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    thread_local! {
        /// The commands `run` was asked for on this thread, while a test records them.
        static RECORDED: RefCell<Option<Vec<Vec<String>>>> = const { RefCell::new(None) };
    }

    /// While recording: the command is kept and answered with empty output, LVM not run.
    pub(super) fn intercepted(args: &[&str]) -> Option<Result<String, LvmError>> {
        RECORDED.with(|r| {
            let mut r = r.borrow_mut();
            let seen = r.as_mut()?;
            seen.push(args.iter().map(|a| a.to_string()).collect());
            Some(Ok(String::new()))
        })
    }

    /// The LVM commands `f` would run.
    fn commands_of(f: impl FnOnce()) -> Vec<Vec<String>> {
        RECORDED.with(|r| *r.borrow_mut() = Some(Vec::new()));
        f();
        RECORDED.with(|r| r.borrow_mut().take()).unwrap_or_default()
    }

    /// A name that LVM would take for its `--config` option, were it read as one: it would
    /// make LVM write its log where the name says, were it read as an option.
    fn hostile(what: &str) -> String {
        format!("--config=log{{file=/tmp/ferrosan-{what}}}")
    }

    #[test]
    fn a_thin_pools_usage_is_its_size_and_data_percent() {
        assert_eq!(
            parse_usage("  1073741824|25.00\n"),
            Some((1 << 30, 1 << 28))
        );
        assert_eq!(parse_usage("  4194304|0.00"), Some((4 << 20, 0)));
        assert_eq!(parse_usage("  4194304|100.00"), Some((4 << 20, 4 << 20)));
        // A pool LVM cannot read reports an empty percentage; out of range is not believed.
        assert_eq!(parse_usage("  4194304|"), None);
        assert_eq!(parse_usage("  4194304|100.01"), None);
        assert_eq!(parse_usage(""), None);
    }

    #[test]
    fn names_reach_lvm_only_after_the_end_of_its_options() {
        let pool = ThinPool {
            vg: hostile("vg"),
            pool: hostile("pool"),
        };
        let (a, b) = (hostile("a"), hostile("b"));
        let commands = commands_of(|| {
            let _ = pool.check();
            let _ = pool.extent_bytes();
            let _ = pool.create(&a, 1 << 20);
            let _ = pool.snapshot(&a, &b, true);
            let _ = pool.snapshot(&a, &b, false);
            let _ = pool.extend(&a, 1 << 20); // lvs, then lvextend
            let _ = pool.rename(&a, &b);
            let _ = pool.remove(&a, Duration::ZERO);
            let _ = pool.thin_lvs();
        });
        assert_eq!(commands.len(), 10, "{commands:?}");
        for argv in &commands {
            // Before `--`, options only, each value glued to its option with `=`; after it,
            // the names, which getopt then never reads as options.
            let end = argv.iter().position(|a| a == "--").unwrap_or(argv.len());
            let options = &argv[1..end];
            assert!(
                options
                    .iter()
                    .all(|a| a.starts_with("--") && !a.starts_with("--config")),
                "{argv:?}"
            );
        }
    }

    #[test]
    fn lvs_lines_of_other_pools_and_plain_lvs_are_left_out() {
        let out = "  vol1|thin|67108864||open\n  vol1+s1|thin|67108864|vol1|\n  \
                   thin||536870912||\n  other|thin2|4194304||\n  garbage\n";
        let lvs = parse_lvs(out, "thin");
        assert_eq!(lvs.len(), 2);
        assert_eq!(lvs[0].name, "vol1");
        assert!(lvs[0].open);
        assert_eq!(lvs[0].snapshot_of(), None);
        assert_eq!(lvs[1].origin.as_deref(), Some("vol1"));
        assert_eq!(lvs[1].size_bytes, 64 << 20);
        assert!(!lvs[1].open);
        assert_eq!(lvs[1].snapshot_of(), Some(("vol1", "s1")));
    }

    #[test]
    fn lvm_complaints_sort_into_kinds() {
        let k = |s| kind_of(s);
        assert_eq!(
            k("  Logical Volume \"v\" already exists in volume group \"vg\""),
            LvmErrorKind::Exists
        );
        assert_eq!(
            k("  Failed to find logical volume \"vg/x\""),
            LvmErrorKind::NotFound
        );
        assert_eq!(
            k("  Volume group \"nope\" not found"),
            LvmErrorKind::NotFound
        );
        assert_eq!(k("  Logical volume vg/v in use."), LvmErrorKind::Busy);
        assert_eq!(k("  Insufficient free space"), LvmErrorKind::Failed);
    }

    #[test]
    fn snapshot_names_cannot_collide_with_volume_names() {
        assert_eq!(snapshot_lv("a.b", "c"), "a.b+c");
        let pool = ThinPool {
            vg: "vg0".into(),
            pool: "thin".into(),
        };
        assert_eq!(pool.device_path("v"), PathBuf::from("/dev/vg0/v"));
    }
}
