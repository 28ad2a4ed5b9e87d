//! The ferrosan binary against libiscsi's command-line initiators
//! (iscsi-ls, iscsi-inq, iscsi-readcapacity16) over loopback.

mod common;

use common::{iscsi_ls_sizes, run, Daemon, Scratch, IQN};

/// The "Lun:N ... (Size:S)" lines of `iscsi-ls -s`, as (lun, size text).
fn ls_luns(stdout: &str) -> Vec<(u32, String)> {
    stdout
        .lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("Lun:")?;
            let lun: u32 = rest.split_whitespace().next()?.parse().ok()?;
            let size = line
                .split("(Size:")
                .nth(1)?
                .trim_end()
                .trim_end_matches(')');
            Some((lun, size.to_string()))
        })
        .collect()
}

fn assert_lun_size(stdout: &str, lun: u32, bytes: u64) {
    let luns = ls_luns(stdout);
    let (_, size) = luns
        .iter()
        .find(|(n, _)| *n == lun)
        .unwrap_or_else(|| panic!("iscsi-ls shows no LUN {lun} with a size:\n{stdout}"));
    let want = iscsi_ls_sizes(bytes);
    assert!(
        want.contains(size),
        "LUN {lun}: iscsi-ls size {size:?}, expected one of {want:?}:\n{stdout}"
    );
}

#[test]
fn iscsi_ls_lists_target_portal_and_lun_size() {
    let daemon = Daemon::start(&["ram:64M"]);
    let out = run("iscsi-ls", &["-s", &daemon.portal()]).expect_ok(&daemon);
    // Discovery (SendTargets) must name our target and the portal we reached.
    let target_line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("Target:"))
        .unwrap_or_else(|| panic!("no Target: line\n{}", out.describe()));
    assert!(
        target_line.contains(&format!("Target:{IQN} ")),
        "wrong target in {target_line:?}"
    );
    assert!(
        target_line.contains(&format!("Portal:127.0.0.1:{}", daemon.port)),
        "discovery did not return the portal address: {target_line:?}"
    );
    assert!(
        out.stdout.contains("DIRECT_ACCESS"),
        "LUN 0 is not a disk:\n{}",
        out.stdout
    );
    assert_lun_size(&out.stdout, 0, 64 << 20);
}

#[test]
fn two_luns_are_visible_with_their_sizes() {
    let daemon = Daemon::start(&["ram:16M", "ram:32M"]);
    let out = run("iscsi-ls", &["-s", &daemon.portal()]).expect_ok(&daemon);
    let luns = ls_luns(&out.stdout);
    assert_eq!(
        luns.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        vec![0, 1],
        "expected exactly LUNs 0 and 1:\n{}",
        out.stdout
    );
    assert_lun_size(&out.stdout, 0, 16 << 20);
    assert_lun_size(&out.stdout, 1, 32 << 20);
    // And each answers READ CAPACITY with its own size.
    for (lun, blocks) in [(0, 32768u64), (1, 65536)] {
        let rc = run("iscsi-readcapacity16", &[&daemon.url(lun)]).expect_ok(&daemon);
        assert!(
            rc.stdout
                .contains(&format!("RETURNED LOGICAL BLOCK ADDRESS:{}", blocks - 1)),
            "LUN {lun}: {}",
            rc.describe()
        );
    }
}

#[test]
fn standard_inquiry_names_ferrosan() {
    let daemon = Daemon::start(&["ram:64M"]);
    let out = run("iscsi-inq", &[&daemon.url(0)]).expect_ok(&daemon);
    let vendor = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("Vendor:"))
        .unwrap_or_else(|| panic!("no Vendor: line\n{}", out.describe()));
    assert_eq!(vendor.trim(), "FERROSAN", "{}", out.stdout);
    assert!(
        out.stdout.contains("Peripheral Device Type:DIRECT_ACCESS"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.lines().any(|l| l.starts_with("Product:")),
        "{}",
        out.stdout
    );
}

// iscsi-inq 1.19 parses -c with atoi(), so page codes must be given in decimal
// (0x80 = 128, 0x83 = 131, 0xb0 = 176); "-c 0x80" silently asks for page 0.

#[test]
fn vpd_unit_serial_number() {
    let daemon = Daemon::start(&["ram:64M"]);
    let out = run("iscsi-inq", &["-e", "1", "-c", "128", &daemon.url(0)]).expect_ok(&daemon);
    let serial = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("Unit Serial Number:["))
        .unwrap_or_else(|| panic!("no serial number\n{}", out.describe()));
    let serial = serial.trim_end_matches(']').trim();
    assert!(!serial.is_empty(), "empty serial number:\n{}", out.stdout);
    assert!(
        serial.bytes().all(|b| b.is_ascii_graphic()),
        "serial {serial:?} is not printable ASCII"
    );
}

#[test]
fn vpd_device_identification_has_naa() {
    let daemon = Daemon::start(&["ram:64M"]);
    let out = run("iscsi-inq", &["-e", "1", "-c", "131", &daemon.url(0)]).expect_ok(&daemon);
    assert!(
        out.stdout
            .contains("Page Code:(0x83) DEVICE_IDENTIFICATION"),
        "{}",
        out.describe()
    );
    assert!(
        out.stdout.contains("Designator Type:(3) NAA"),
        "no NAA designator:\n{}",
        out.stdout
    );
}

#[test]
fn vpd_block_limits() {
    let daemon = Daemon::start(&["ram:64M"]);
    let out = run("iscsi-inq", &["-e", "1", "-c", "176", &daemon.url(0)]).expect_ok(&daemon);
    for field in [
        "maximum transfer length:",
        "optimal transfer length:",
        "maximum write same length:",
    ] {
        assert!(
            out.stdout.lines().any(|l| l.starts_with(field)),
            "block limits page lacks {field:?}:\n{}",
            out.describe()
        );
    }
}

fn readcap16(daemon: &Daemon) -> (u64, u64) {
    let out = run("iscsi-readcapacity16", &[&daemon.url(0)]).expect_ok(daemon);
    let field = |name: &str| -> u64 {
        out.stdout
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{}", out.describe()))
    };
    let last_lba = field("RETURNED LOGICAL BLOCK ADDRESS:");
    let block = field("LOGICAL BLOCK LENGTH IN BYTES:");
    assert_eq!(
        field("Total size:"),
        (last_lba + 1) * block,
        "{}",
        out.stdout
    );
    (last_lba + 1, block)
}

#[test]
fn readcapacity16_ram_lun() {
    let daemon = Daemon::start(&["ram:64M"]);
    assert_eq!(readcap16(&daemon), (131072, 512));
}

#[test]
fn readcapacity16_file_lun() {
    let scratch = Scratch::new("readcap");
    let img = scratch.file("disk.img");
    let daemon = Daemon::start(&[&format!("file:{},size=48M", img.display())]);
    assert_eq!(readcap16(&daemon), (98304, 512));
    let meta = std::fs::metadata(&img).expect("the file LUN's image exists");
    assert_eq!(meta.len(), 48 << 20, "image file has the LUN's size");
}

#[test]
fn unknown_target_fails_login_and_daemon_keeps_serving() {
    let mut daemon = Daemon::start(&["ram:16M"]);
    let bogus = format!(
        "iscsi://127.0.0.1:{}/iqn.2024-01.dev.ferrosan:no-such-target/0",
        daemon.port
    );
    let out = run("iscsi-inq", &[&bogus]);
    assert!(
        !out.success(),
        "login to a non-existent target succeeded:\n{}",
        out.describe()
    );
    let text = format!("{}{}", out.stdout, out.stderr);
    assert!(
        text.to_lowercase().contains("login"),
        "expected a login failure message:\n{}",
        out.describe()
    );
    assert!(daemon.alive(), "daemon died:\n{}", daemon.output());
    // The next client is served normally.
    let ok = run("iscsi-inq", &[&daemon.url(0)]).expect_ok(&daemon);
    assert!(ok.stdout.contains("Vendor:"), "{}", ok.stdout);
    assert!(daemon.alive(), "daemon died:\n{}", daemon.output());
}
