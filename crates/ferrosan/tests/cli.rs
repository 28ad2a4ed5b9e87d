//! Bad command-line input: a clear error on stderr, a non-zero exit, no panic.

mod common;

use std::time::Duration;

use common::{free_port, run_path};

fn serve_with_lun(lun: &str) -> common::Run {
    serve_on(free_port(), lun)
}

/// `ferrosan serve` of the quick export `lun` on 127.0.0.1:`port`, run to its exit.
fn serve_on(port: u16, lun: &str) -> common::Run {
    run_path(
        std::path::Path::new(env!("CARGO_BIN_EXE_ferrosan")),
        &[
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--target",
            "iqn.2024-01.dev.ferrosan:cli",
            "--lun",
            lun,
        ],
    )
}

fn assert_rejected(lun: &str) {
    let out = serve_with_lun(lun);
    assert!(
        !out.success(),
        "--lun {lun} was accepted:\n{}",
        out.describe()
    );
    // Killed by a signal (no exit code) would also be a failure.
    assert!(out.status.code().is_some(), "{}", out.describe());
    assert!(
        !out.stderr.trim().is_empty(),
        "no error message:\n{}",
        out.describe()
    );
    for panic_text in ["panicked", "RUST_BACKTRACE", "unwrap()"] {
        assert!(
            !out.stderr.contains(panic_text),
            "--lun {lun} made ferrosan panic:\n{}",
            out.describe()
        );
    }
}

#[test]
fn unknown_lun_kind_is_rejected() {
    assert_rejected("bogus:1");
}

#[test]
fn bad_lun_size_unit_is_rejected() {
    assert_rejected("ram:12Q");
}

#[test]
fn bad_input_exits_promptly() {
    // run_path has a long timeout; a rejected config must not start serving.
    let started = std::time::Instant::now();
    assert_rejected("ram:");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn short_config_option_reads_the_file() {
    // docs/CONFIG.md shows `serve -c FILE`: the short form must reach the config loader, whose
    // error names the file and field (not clap's "unexpected argument").
    let scratch = common::Scratch::new("cli");
    let config = scratch.file("bad.toml");
    std::fs::write(&config, "[limits]\nmax_sessions = 0\n").expect("write config");
    let out = run_path(
        std::path::Path::new(env!("CARGO_BIN_EXE_ferrosan")),
        &["serve", "-c", &config.display().to_string()],
    );
    assert!(!out.success(), "{}", out.describe());
    assert!(
        out.stderr.contains("bad.toml") && out.stderr.contains("max_sessions"),
        "the config loader did not report the file's error:\n{}",
        out.describe()
    );
}

#[test]
fn an_existing_file_of_another_size_is_refused_and_left_alone() {
    let scratch = common::Scratch::new("cli-size");
    let path = scratch.file("ten.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(10 << 20)
        .unwrap();
    for size in ["20M", "5M"] {
        let lun = format!("file:{},size={size}", path.display());
        let out = serve_with_lun(&lun);
        assert!(!out.success(), "{}", out.describe());
        assert!(
            out.stderr.contains(&path.display().to_string())
                && out.stderr.contains("10485760 bytes")
                && out.stderr.contains("nothing was changed"),
            "the error names the file, its size and that nothing changed:\n{}",
            out.describe()
        );
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 10 << 20);
    }
    // The same through a config file: the error is located at the device.
    let config = scratch.file("ferrosan.toml");
    std::fs::write(
        &config,
        format!(
            "[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:{}\"]\n[[device]]\nname = \"vm\"\n\
             store = \"file\"\npath = \"{}\"\nsize = \"20M\"\n[[target]]\n\
             iqn = \"iqn.2024-01.dev.ferrosan:cli\"\n  [[target.group]]\n  name = \"g\"\n  \
             any_initiator = true\n  luns = [ {{ lun = 0, device = \"vm\" }} ]\n",
            free_port(),
            path.display()
        ),
    )
    .unwrap();
    let out = run_path(
        std::path::Path::new(env!("CARGO_BIN_EXE_ferrosan")),
        &["serve", "--config", &config.display().to_string()],
    );
    assert!(!out.success(), "{}", out.describe());
    assert!(
        out.stderr.contains("ferrosan.toml:4: device vm") && out.stderr.contains("10485760 bytes"),
        "the file and line of the device's table: {}",
        out.describe()
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 10 << 20);
}

#[test]
fn a_start_that_cannot_listen_creates_no_file() {
    let scratch = common::Scratch::new("cli-bind");
    let path = scratch.file("new.img");
    // Holds the port for the whole test.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = serve_on(port, &format!("file:{},size=8M", path.display()));
    assert!(!out.success(), "{}", out.describe());
    assert!(out.stderr.contains("cannot listen"), "{}", out.describe());
    assert!(
        !path.exists(),
        "a failed start created the LUN file {}",
        path.display()
    );
}

/// `check-config --deep` finds what `serve` would fail on, changing nothing; a config that
/// passes it starts. A config naming no target is refused by both unless asked for.
#[test]
fn check_config_deep_finds_what_the_start_would_meet() {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_ferrosan"));
    let scratch = common::Scratch::new("deep");
    let config = scratch.file("ferrosan.toml");
    let config_s = config.display().to_string();
    let state = scratch.file("state");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_port = busy.local_addr().unwrap().port();
    let sized = scratch.file("sized.img");
    std::fs::write(&sized, vec![0u8; 1 << 20]).unwrap();
    let write = |port: u16, devices: &str| {
        std::fs::write(
            &config,
            format!(
                "[server]\nstate_dir = \"{}\"\n\n[[portal_group]]\ntag = 1\n\
                 listen = [\"127.0.0.1:{port}\"]\n\n{devices}\n[[target]]\n\
                 iqn = \"iqn.2026-11.org.ferrosan:deep\"\n  [[target.group]]\n  name = \"all\"\n  \
                 any_initiator = true\n  luns = [ {{ lun = 0, device = \"a\" }} ]\n",
                state.display()
            ),
        )
        .unwrap();
    };
    let device = |name: &str, store: &str, rest: &str| {
        format!("[[device]]\nname = \"{name}\"\nstore = \"{store}\"\n{rest}\n")
    };
    // Four faults the plain check accepts: a missing file without a size, a file of
    // another size, a block device that is not there, a port in use.
    let missing = scratch.file("missing.img");
    write(
        busy_port,
        &[
            device("a", "file", &format!("path = \"{}\"", missing.display())),
            device(
                "b",
                "file",
                &format!("path = \"{}\"\nsize = \"2M\"", sized.display()),
            ),
            device("c", "block", "path = \"/dev/ferrosan-no-such-disk\""),
        ]
        .concat(),
    );
    let plain = run_path(bin, &["check-config", &config_s]);
    assert!(plain.success(), "{}", plain.describe());
    let deep = run_path(bin, &["check-config", "--deep", &config_s]);
    assert!(!deep.success(), "{}", deep.describe());
    for said in [
        "device a",
        "missing and no size given to create it",
        "device b",
        "1048576 bytes but 2097152 are configured",
        "device c",
        "/dev/ferrosan-no-such-disk",
        &format!("iSCSI portal 127.0.0.1:{busy_port}: cannot listen"),
        "4 problem(s)",
    ] {
        assert!(
            deep.stderr.contains(said),
            "no {said:?} in:\n{}",
            deep.describe()
        );
    }
    // Nothing was created or changed.
    assert!(!missing.exists() && !state.exists());
    assert_eq!(std::fs::metadata(&sized).unwrap().len(), 1 << 20);
    // The same config the way the start meets it: refused for the first fault found.
    let served = run_path(bin, &["serve", "--config", &config_s]);
    assert!(!served.success(), "{}", served.describe());

    // Fixed: a file to be created, the sized one as it is; it passes, and it starts.
    let port = free_port();
    write(
        port,
        &[
            device(
                "a",
                "file",
                &format!("path = \"{}\"\nsize = \"4M\"", missing.display()),
            ),
            device("b", "file", &format!("path = \"{}\"", sized.display())),
        ]
        .concat(),
    );
    let deep = run_path(bin, &["check-config", "--deep", &config_s]);
    assert!(deep.success(), "{}", deep.describe());
    assert!(!missing.exists(), "--deep created the file");
    let daemon = common::Daemon::start_config_text(
        "iqn.2026-11.org.ferrosan:deep",
        port,
        &std::fs::read_to_string(&config).unwrap(),
        &[],
    );
    assert_eq!(std::fs::metadata(&missing).unwrap().len(), 4 << 20);
    drop(daemon);

    // No target: refused by check-config and serve, unless asked for.
    std::fs::write(&config, "[limits]\nmax_sessions = 8\n").unwrap();
    let empty = run_path(bin, &["check-config", &config_s]);
    assert!(
        !empty.success() && empty.stderr.contains("no [[target]]"),
        "{}",
        empty.describe()
    );
    assert!(run_path(bin, &["check-config", "--allow-empty", &config_s]).success());
    let empty = run_path(bin, &["serve", "--config", &config_s]);
    assert!(
        !empty.success() && empty.stderr.contains("--allow-empty"),
        "{}",
        empty.describe()
    );
}
