//! The array owns its state (docs/OPERATIONS.md, *What a client may rely on*): every change
//! is one transaction on the running config of its moment, a reload never drops unsaved
//! changes silently, and a directory pool's files are the array's own (created exclusively,
//! never followed through a link, removed only by whoever made them). Each test reproduces
//! one way this failed, against the daemon binary, as an orchestrator or operator meets it.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{Ctl, Daemon};
use serde_json::Value;

const IQN: &str = "iqn.2026-11.org.ferrosan:state";
const HOST: &str = "iqn.2026-11.org.example:host-a";

fn ok(ctl: &Ctl, args: &[&str]) -> Value {
    let r = ctl.json(args);
    assert_eq!(r["ok"], true, "ctl {args:?}: {r}");
    r
}

fn refused(ctl: &Ctl, args: &[&str], kind: &str, why: &str) -> Value {
    let r = ctl.json(args);
    assert_eq!(r["ok"], false, "ctl {args:?} should be refused: {r}");
    assert_eq!(r["kind"], kind, "ctl {args:?}: {r}");
    assert!(
        r["error"].as_str().unwrap_or("").contains(why),
        "ctl {args:?}: {r}"
    );
    r
}

/// A daemon with a directory pool `fast` at `pool` and a RAM LUN 0 for everyone.
fn daemon_with_pool(pool: &Path, ctl: &Ctl) -> Daemon {
    let s = ctl.socket.display().to_string();
    let body = format!(
        "[[pool]]\nname = \"fast\"\npath = \"{}\"\n\n[[device]]\nname = \"boot\"\nstore = \"ram\"\nsize = \"8M\"\n\n[[target]]\niqn = \"{IQN}\"\n  [[target.group]]\n  name = \"all\"\n  any_initiator = true\n  luns = [ {{ lun = 0, device = \"boot\" }} ]\n",
        pool.display()
    );
    Daemon::start_config_args(IQN, &body, &["--control-socket", &s])
}

/// The LUNs `host` is shown, by volume, from the running config.
fn exported_to(ctl: &Ctl, host: &str) -> Vec<String> {
    let luns = ok(ctl, &["luns"]);
    let group = format!("host-{}", host.replace(':', "."));
    let mut out: Vec<String> = luns["luns"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["group"] == group.as_str())
        .map(|l| l["device"].as_str().unwrap().to_string())
        .collect();
    out.sort();
    out
}

/// A clone that copies for a while (the disk here cannot reflink, and the source is unmapped)
/// commits against the config of its end: an unexport acknowledged meanwhile stays done. The
/// config copied at the clone's start put the volume back before.
#[test]
fn a_slow_clone_does_not_undo_an_unexport_acknowledged_meanwhile() {
    // ext4 on a loop device: copies are copies, whatever filesystem the tests run on.
    let fs = common::loopfs::LoopFs::new("ext4", 1 << 30);
    let dir = fs.path("state-clone");
    let pool = dir.join("pool");
    std::fs::create_dir_all(&pool).unwrap();
    let ctl = Ctl::new();
    let mut daemon = daemon_with_pool(&pool, &ctl);
    ok(&ctl, &["volume", "create", "fast", "big", "512M"]);
    ok(&ctl, &["volume", "create", "fast", "vm1", "16M"]);
    fill(&pool.join("big.img"), 384 << 20);
    // The race needs the unexport answered while the copy runs; on a busy machine the copy
    // may win once: then its clone goes and the race is run again, a few times at most.
    let exercised = (0..4).any(|attempt| unexport_during_a_clone(&ctl, &pool, attempt));
    assert!(
        exercised,
        "every clone answered before the unexport: the race was never run"
    );
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Exports vm1 to the host, clones `big` (copying, for as long as its data takes) and
/// unexports vm1 while the copy runs; the unexport must stay done once the clone commits.
/// Whether the unexport was answered before the clone (the race run).
fn unexport_during_a_clone(ctl: &Ctl, pool: &Path, attempt: u32) -> bool {
    let name = format!("copy{attempt}");
    ok(ctl, &["volume", "export", "vm1", "--initiator", HOST]);
    let clone = {
        let ctl = ctl.clone();
        let name = name.clone();
        std::thread::spawn(move || ctl.json(&["volume", "clone", "big", &name]))
    };
    // Copying: into a partial file, or (before) straight into the volume's file.
    let partial = pool.join(format!(".{name}.img.partial"));
    let copying = || partial.exists() || pool.join(format!("{name}.img")).exists();
    let started = Instant::now();
    while !copying() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the clone never started copying"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let gone = ok(ctl, &["volume", "unexport", "vm1", "--initiator", HOST]);
    assert_eq!(gone["unexported"], true, "{gone}");
    let raced = !clone.is_finished();
    let cloned = clone.join().unwrap();
    assert_eq!(cloned["ok"], true, "{cloned}");
    assert_eq!(cloned["method"], "copy", "{cloned}");
    assert!(
        exported_to(ctl, HOST).is_empty(),
        "the clone undid the unexport: {:?}",
        exported_to(ctl, HOST)
    );
    let listed = ok(ctl, &["volume", "list"]);
    assert_eq!(listed["volumes"].as_array().unwrap().len(), 3, "{listed}");
    ok(ctl, &["volume", "delete", &name]);
    raced
}

/// Writes `bytes` of non-zero data at the start of `path` (a sparse copy skips nothing).
fn fill(path: &Path, bytes: usize) {
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let chunk = vec![0x5a_u8; 1 << 20];
    for _ in 0..bytes / chunk.len() {
        file.write_all(&chunk).unwrap();
    }
    file.sync_all().unwrap();
}

/// Many exports at once, as a CSI controller sends them: every one lands, each at a LUN of
/// its own, and the saved file holds them all.
#[test]
fn parallel_exports_all_land() {
    const N: usize = 8;
    let dir = common::disk_dir("state-exports");
    let pool = dir.join("pool");
    let ctl = Ctl::new();
    let mut daemon = daemon_with_pool(&pool, &ctl);
    for i in 0..N {
        ok(&ctl, &["volume", "create", "fast", &format!("v{i}"), "4M"]);
    }
    let threads: Vec<_> = (0..N)
        .map(|i| {
            let ctl = ctl.clone();
            std::thread::spawn(move || {
                let v = format!("v{i}");
                ctl.json(&["volume", "export", &v, "--initiator", HOST, "--save"])
            })
        })
        .collect();
    let mut luns: Vec<u64> = threads
        .into_iter()
        .map(|t| {
            let r = t.join().unwrap();
            assert_eq!(r["ok"], true, "{r}");
            r["lun"].as_u64().unwrap()
        })
        .collect();
    luns.sort();
    assert_eq!(luns, (0..N as u64).collect::<Vec<_>>());
    assert_eq!(exported_to(&ctl, HOST).len(), N);
    let text = std::fs::read_to_string(daemon.file("ferrosan.toml")).unwrap();
    for i in 0..N {
        assert!(text.contains(&format!("device = \"v{i}\"")), "{text}");
    }
    // The daemon's command line (`--control-socket`) stays out of the file.
    assert!(!text.contains("control_socket"), "{text}");
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// `if_generation`: a client that read the config, decided and writes is refused when
/// anything changed in between.
#[test]
fn a_change_with_a_stale_generation_is_refused() {
    let dir = common::disk_dir("state-generation");
    let ctl = Ctl::new();
    let mut daemon = daemon_with_pool(&dir.join("pool"), &ctl);
    let read = ok(&ctl, &["status"])["generation"].as_u64().unwrap();
    let g = read.to_string();
    ok(&ctl, &["volume", "create", "fast", "a", "4M"]);
    refused(
        &ctl,
        &["--if-generation", &g, "volume", "create", "fast", "b", "4M"],
        "conflict",
        "not",
    );
    let now = ok(&ctl, &["status"])["generation"].as_u64().unwrap();
    assert!(now > read);
    let made = ok(
        &ctl,
        &[
            "--if-generation",
            &now.to_string(),
            "volume",
            "create",
            "fast",
            "b",
            "4M",
        ],
    );
    assert_eq!(made["existed"], false, "{made}");
    assert!(!dir.join("pool/c.img").exists());
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ctl reload` (and `systemctl reload`, which runs it) refuses to drop changes made with
/// `ctl` and not saved, saying which, and fails; told to discard them, it returns to the
/// file.
#[test]
fn a_reload_never_drops_unsaved_changes_silently() {
    let dir = common::disk_dir("state-reload");
    let ctl = Ctl::new();
    let mut daemon = daemon_with_pool(&dir.join("pool"), &ctl);
    ok(&ctl, &["volume", "create", "fast", "vm1", "4M"]);
    ok(&ctl, &["lun", "map", IQN, "all", "1", "vm1"]);
    let r = refused(&ctl, &["reload"], "conflict", "LUN 1 maps device vm1");
    assert!(r["error"].as_str().unwrap().contains("--discard"), "{r}");
    let plain = ctl.run(&["reload"]);
    assert!(!plain.status.success(), "{}", plain.describe());
    assert_eq!(ok(&ctl, &["luns"])["luns"].as_array().unwrap().len(), 2);
    // Saved, a reload has nothing to drop.
    ok(&ctl, &["save"]);
    ok(&ctl, &["reload"]);
    ok(&ctl, &["lun", "unmap", IQN, "all", "1"]);
    ok(&ctl, &["reload", "--discard"]);
    assert_eq!(ok(&ctl, &["luns"])["luns"].as_array().unwrap().len(), 2);
    assert_eq!(
        ok(&ctl, &["status"])["unsaved_changes"],
        serde_json::json!([])
    );
    // A change undone by its opposite leaves nothing unsaved to refuse for.
    ok(&ctl, &["lun", "unmap", IQN, "all", "1"]);
    ok(&ctl, &["lun", "map", IQN, "all", "1", "vm1"]);
    ok(&ctl, &["reload"]);
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A file in the pool that the array did not make is never taken as a new volume (a new host
/// read another tenant's data), and a create refused over it leaves it as it was (a failed
/// create deleted it: there, the live backing file of another device). Only `--adopt` takes
/// it, with its data.
#[test]
fn a_create_neither_adopts_nor_deletes_a_file_it_did_not_make() {
    let dir = common::disk_dir("state-adopt");
    let pool = dir.join("pool");
    std::fs::create_dir_all(&pool).unwrap();
    let secret = pool.join("vm9.img");
    let mut data = b"SECRET-TENANT-A-DATA".to_vec();
    data.resize(4 << 20, 0);
    std::fs::write(&secret, &data).unwrap();
    let ctl = Ctl::new();
    let mut daemon = daemon_with_pool(&pool, &ctl);
    for size in ["4M", "8M"] {
        refused(
            &ctl,
            &["volume", "create", "fast", "vm9", size],
            "conflict",
            "adopt",
        );
        assert_eq!(std::fs::read(&secret).unwrap(), data, "{size}");
    }
    assert!(ok(&ctl, &["volume", "list"])["volumes"]
        .as_array()
        .unwrap()
        .is_empty());
    let adopted = ok(&ctl, &["volume", "create", "fast", "vm9", "4M", "--adopt"]);
    assert_eq!(adopted["existed"], false, "{adopted}");
    assert_eq!(std::fs::read(&secret).unwrap(), data);
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A link planted in a pool is never followed: a snapshot that is a link to a file outside
/// the pool is neither listed, cloned nor rolled back to (an initiator read a root-only
/// file through it), and a `.snapshots` that is a link makes snapshots fail, writing nothing
/// where it points.
#[test]
fn links_in_a_pool_are_never_followed() {
    let dir = common::disk_dir("state-links");
    let pool = dir.join("pool");
    let outside = dir.join("outside");
    std::fs::create_dir_all(pool.join(".snapshots")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    let root_only = outside.join("shadow");
    std::fs::write(&root_only, vec![b'R'; 4 << 20]).unwrap();
    let ctl = Ctl::new();
    let mut daemon = daemon_with_pool(&pool, &ctl);
    ok(&ctl, &["volume", "create", "fast", "vm1", "4M"]);
    std::os::unix::fs::symlink(&root_only, pool.join(".snapshots/vm1@evil.img")).unwrap();
    let snaps = ok(&ctl, &["snapshot", "list", "vm1"]);
    assert_eq!(snaps["snapshots"], serde_json::json!([]), "{snaps}");
    refused(
        &ctl,
        &["volume", "clone", "vm1", "x", "--snapshot", "evil"],
        "not_found",
        "no snapshot",
    );
    refused(
        &ctl,
        &["volume", "rollback", "vm1", "evil"],
        "not_found",
        "no snapshot",
    );
    assert!(!pool.join("x.img").exists());
    assert!(std::fs::read(pool.join("vm1.img"))
        .unwrap()
        .iter()
        .all(|b| *b == 0));
    // A volume file that is a link is not opened either.
    std::os::unix::fs::symlink(&root_only, pool.join("vm2.img")).unwrap();
    refused(
        &ctl,
        &["volume", "create", "fast", "vm2", "4M", "--adopt"],
        "conflict",
        "symbolic link",
    );
    // `.snapshots` a link: refused, nothing lands where it points.
    std::fs::remove_dir_all(pool.join(".snapshots")).unwrap();
    std::os::unix::fs::symlink(&outside, pool.join(".snapshots")).unwrap();
    ok(&ctl, &["device", "offline", "vm1"]);
    refused(
        &ctl,
        &["volume", "snapshot", "vm1", "s1"],
        "conflict",
        "not a directory",
    );
    let there: Vec<_> = std::fs::read_dir(&outside).unwrap().collect();
    assert_eq!(there.len(), 1, "only the shadow file: {there:?}");
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pool's arguments are the config's to judge before a directory is made or a tool runs: a
/// directory outside `device_roots` was made before the refusal, a VG named like an option
/// reached `lvm` as one (overwriting a file outside the roots), and a path with a newline came
/// out of `systemd-dropin` as a directive of its own.
#[test]
fn pool_arguments_are_judged_before_anything_is_made() {
    let dir = common::disk_dir("state-pool-add");
    let allowed = dir.join("allowed");
    std::fs::create_dir_all(&allowed).unwrap();
    let ctl = Ctl::new();
    let s = ctl.socket.display().to_string();
    let port = common::free_port();
    let text = format!(
        "[server]\ndevice_roots = [\"{}\"]\n\n[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:{port}\"]\n\n[[device]]\nname = \"boot\"\nstore = \"ram\"\nsize = \"8M\"\n\n[[target]]\niqn = \"{IQN}\"\n  [[target.group]]\n  name = \"all\"\n  any_initiator = true\n  luns = [ {{ lun = 0, device = \"boot\" }} ]\n",
        allowed.display()
    );
    let mut daemon = Daemon::start_config_text(IQN, port, &text, &["--control-socket", &s]);
    let outside = dir.join("outside/deeper");
    let r = ctl.json(&["pool", "add", "x", outside.to_str().unwrap()]);
    assert_eq!(r["ok"], false, "{r}");
    assert!(!dir.join("outside").exists(), "made before it was refused");
    let evil = dir.join("evil-target");
    let vg = format!("--config=log{{file={}}}", evil.display());
    let vg = format!("--vg={vg}");
    let r = ctl.json(&["pool", "add", "y", &vg, "--thin-pool", "thin"]);
    assert_eq!(
        (&r["ok"], &r["kind"]),
        (&false.into(), &"bad_request".into()),
        "{r}"
    );
    assert!(!evil.exists());
    let newline = format!("{}/x\nExecStartPre=+/bin/true", allowed.display());
    let r = ctl.json(&["pool", "add", "z", &newline]);
    assert_eq!(r["ok"], false, "{r}");
    assert!(std::fs::read_dir(&allowed).unwrap().next().is_none());
    let made = ok(
        &ctl,
        &[
            "pool",
            "add",
            "fine",
            allowed.join("pool").to_str().unwrap(),
        ],
    );
    assert_eq!(made["existed"], false, "{made}");
    assert!(allowed.join("pool").is_dir());
    // A second pool of the same directory could not tell whose a volume is.
    let r = ctl.json(&[
        "pool",
        "add",
        "twin",
        allowed.join("pool").to_str().unwrap(),
    ]);
    assert_eq!(r["ok"], false, "{r}");
    let why = r["error"].as_str().unwrap_or("");
    assert!(why.contains("is pool fine's already"), "{r}");
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A clone is idempotent by what it is a clone of, not only by name: the same clone asked
/// again answers `existed`, a clone of another source into that name is a conflict (it holds
/// other data), and `volume list` says where each
/// volume came from and when it was made, across a restart.
#[test]
fn a_clone_is_idempotent_by_its_source_and_records_its_lineage() {
    let dir = common::disk_dir("state-lineage");
    let ctl = Ctl::new();
    let mut daemon = daemon_with_pool(&dir.join("pool"), &ctl);
    ok(&ctl, &["volume", "create", "fast", "a", "4M"]);
    ok(&ctl, &["volume", "create", "fast", "b", "4M"]);
    ok(&ctl, &["volume", "snapshot", "a", "monday"]);
    let made = ok(
        &ctl,
        &[
            "volume",
            "clone",
            "a",
            "c",
            "--snapshot",
            "monday",
            "--save",
        ],
    );
    assert_eq!(
        (&made["existed"], &made["clone_of"]),
        (&false.into(), &"a@monday".into()),
        "{made}"
    );
    let again = ok(&ctl, &["volume", "clone", "a", "c", "--snapshot", "monday"]);
    assert_eq!(again["existed"], true, "{again}");
    refused(
        &ctl,
        &["volume", "clone", "b", "c"],
        "conflict",
        "not what was asked for",
    );
    refused(
        &ctl,
        &["volume", "clone", "a", "c"],
        "conflict",
        "not what was asked for",
    );
    refused(
        &ctl,
        &["volume", "create", "fast", "c", "4M"],
        "conflict",
        "not what was asked for",
    );
    ok(&ctl, &["save"]);
    daemon.restart();
    let listed = ok(&ctl, &["volume", "list"]);
    let by_name = |n: &str| {
        listed["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["volume"] == n)
            .cloned()
            .unwrap()
    };
    assert_eq!(by_name("c")["clone_of"], "a@monday", "{listed}");
    assert_eq!(by_name("a")["clone_of"], Value::Null, "{listed}");
    for v in ["a", "b", "c"] {
        let created = by_name(v)["created"].as_str().unwrap_or("").to_string();
        assert!(
            created.starts_with("20") && created.ends_with('Z'),
            "{v}: {listed}"
        );
    }
    let snaps = ok(&ctl, &["snapshot", "list", "a"]);
    let taken = snaps["snapshots"][0]["created"].as_str().unwrap_or("");
    assert!(taken.starts_with("20") && taken.ends_with('Z'), "{snaps}");
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A delete asked while a snapshot of the volume is being taken (a copy, on ext4) is refused
/// as busy, never run between the snapshot's start and its end: it would remove the volume
/// and leave a snapshot of nothing (or the snapshot's copy would fail midway).
#[test]
fn a_delete_never_leaves_a_snapshot_of_nothing() {
    let fs = common::loopfs::LoopFs::new("ext4", 1 << 30);
    let dir = fs.path("state-snapshot");
    let pool = dir.join("pool");
    std::fs::create_dir_all(&pool).unwrap();
    let ctl = Ctl::new();
    let mut daemon = daemon_with_pool(&pool, &ctl);
    ok(&ctl, &["volume", "create", "fast", "big", "512M"]);
    fill(&pool.join("big.img"), 384 << 20);
    let exercised = (0..4).any(|attempt| delete_during_a_snapshot(&ctl, &pool, attempt));
    assert!(
        exercised,
        "every snapshot answered before the delete: the race was never run"
    );
    // The volume and its snapshots are all there; each goes in its turn.
    for attempt in 0..4 {
        let _ = ctl.json(&["snapshot", "delete", "big", &format!("s{attempt}")]);
    }
    ok(&ctl, &["volume", "delete", "big"]);
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Snapshots `big` (copying) and asks for its delete while the copy runs. Whether the delete
/// was asked before the snapshot answered (the race run); either way the volume is there
/// with its snapshot after.
fn delete_during_a_snapshot(ctl: &Ctl, pool: &Path, attempt: u32) -> bool {
    let snap = format!("s{attempt}");
    let snapshot = {
        let ctl = ctl.clone();
        let snap = snap.clone();
        std::thread::spawn(move || ctl.json(&["volume", "snapshot", "big", &snap]))
    };
    let partial = pool.join(format!(".snapshots/.big@{snap}.img.partial"));
    let started = Instant::now();
    while !partial.exists() && !snapshot.is_finished() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the snapshot never started copying"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let delete = ctl.json(&["volume", "delete", "big"]);
    let raced = !snapshot.is_finished();
    let taken = snapshot.join().unwrap();
    assert_eq!(taken["ok"], true, "{taken}");
    assert_eq!(
        delete["ok"], false,
        "a delete with a snapshot ran: {delete}"
    );
    assert_eq!(delete["kind"], "conflict", "{delete}");
    let listed = ok(ctl, &["snapshot", "list", "big"]);
    assert!(listed.to_string().contains(&snap), "{listed}");
    assert!(pool.join("big.img").exists(), "the volume's file is gone");
    raced
}
