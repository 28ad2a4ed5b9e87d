//! docs/guides/ cannot rot: each guide's ferrosan side — the config after `<!--
//! guide:config -->`, the `ferrosan ctl` commands after `<!-- guide:ctl -->` — is served and
//! run here, moved onto this machine as docs/guides/README.md says, and every host the guide
//! names logs in with the guide's CHAP user and sees exactly the LUNs the guide gives it; a
//! host it does not name sees none.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{free_port, require_tool, run_path, Ctl, Daemon, Scratch};

const STRANGER: &str = "iqn.2026-11.test:not-in-any-guide";

/// A host a guide names: its initiator name, its CHAP user and the secret file the guide's
/// config names for it (None: no CHAP), and the LUNs it must see.
struct Host {
    initiator: String,
    chap: Option<(&'static str, &'static str)>,
    luns: &'static [u32],
}

/// The fenced blocks after each `<!-- guide:KIND -->` marker of `text`.
fn blocks(text: &str, kind: &str) -> Vec<String> {
    let marker = format!("<!-- guide:{kind} -->");
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(&marker) {
        let after = &rest[at + marker.len()..];
        let open = after.find("```").expect("a fenced block after the marker");
        let body_start = open + after[open..].find('\n').expect("a fence line") + 1;
        let close = after[body_start..].find("\n```").expect("a closing fence");
        out.push(after[body_start..body_start + close + 1].to_string());
        rest = &after[body_start + close..];
    }
    out
}

/// What a guide's text becomes on this machine (docs/guides/README.md has the table).
struct Here {
    port: u16,
    nvme_port: u16,
    secrets: PathBuf,
    srv: PathBuf,
    md0: Option<String>,
    md1: Option<String>,
}

impl Here {
    fn localize(&self, text: &str) -> String {
        let mut s = text
            .replace("192.0.2.0/24", "127.0.0.0/24")
            .replace("198.51.100.0/24", "127.0.1.0/24")
            .replace("192.0.2.10", "127.0.0.1")
            .replace("198.51.100.10", "127.0.0.2")
            .replace(":3260", &format!(":{}", self.port))
            .replace(":4420", &format!(":{}", self.nvme_port))
            .replace(
                "/etc/ferrosan/secrets/",
                &format!("{}/", self.secrets.display()),
            )
            .replace("/srv/ferrosan/", &format!("{}/", self.srv.display()));
        for (name, dev) in [("/dev/md0", &self.md0), ("/dev/md1", &self.md1)] {
            if let Some(dev) = dev {
                s = s.replace(name, dev);
            }
        }
        s
    }
}

/// The secret the test writes for the file `name` a guide's config names.
fn secret_of(name: &str) -> String {
    format!("guide-{name}-s3cret")
}

/// Each `/etc/ferrosan/secrets/NAME` the text names, written (mode 0600) into `dir`.
fn write_secrets(text: &str, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let prefix = "/etc/ferrosan/secrets/";
    for (at, _) in text.match_indices(prefix) {
        let name: String = text[at + prefix.len()..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            .collect();
        let path = dir.join(&name);
        std::fs::write(&path, secret_of(&name)).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
    }
}

/// A loop device over a sparse file, detached when dropped.
struct Loop(String);

impl Loop {
    fn new(file: &Path) -> Loop {
        std::fs::File::create(file)
            .and_then(|f| f.set_len(64 << 20))
            .unwrap();
        let out = Command::new(require_tool("losetup"))
            .args(["--find", "--show"])
            .arg(file)
            .output()
            .unwrap();
        assert!(out.status.success(), "losetup: {out:?}");
        Loop(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// The LUNs `initiator` sees of `target` through each portal discovery lists (iscsi-ls:
/// SendTargets, then a login and REPORT LUNS per portal), logging in with `chap` (user,
/// secret file name).
fn luns_seen(
    port: u16,
    target: &str,
    initiator: &str,
    chap: Option<(&str, &str)>,
) -> Vec<(String, Vec<u32>)> {
    let url = match chap {
        Some((user, file)) => format!("iscsi://{user}%{}@127.0.0.1:{port}", secret_of(file)),
        None => format!("iscsi://127.0.0.1:{port}"),
    };
    let out = run_path(&require_tool("iscsi-ls"), &["-s", "-i", initiator, &url]);
    let mut portals: Vec<(String, Vec<u32>)> = Vec::new();
    let mut ours = false;
    for line in out.stdout.lines() {
        if let Some(rest) = line.strip_prefix("Target:") {
            let mut words = rest.split_whitespace();
            ours = words.next() == Some(target);
            if ours {
                let portal = words.next().unwrap_or_default().to_string();
                portals.push((portal, Vec::new()));
            }
        } else if let Some(rest) = line.strip_prefix("Lun:").filter(|_| ours) {
            let n = rest.split_whitespace().next().unwrap_or_default();
            let lun = n.parse().unwrap_or_else(|_| panic!("{}", out.describe()));
            if let Some((_, luns)) = portals.last_mut() {
                luns.push(lun);
            }
        }
    }
    portals
}

/// A guide served: its daemon (stopped first when dropped), its loop device (detached once
/// the daemon has let go of it), its files.
struct Served {
    daemon: Daemon,
    here: Here,
    _md: [Option<Loop>; 2],
    _scratch: Scratch,
}

/// Serves guide `name`'s config, runs its ctl commands and checks its hosts.
fn serve_guide(name: &str, target: &str, hosts: &[Host]) -> Served {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../docs/guides/{name}.md"));
    let text = std::fs::read_to_string(&path).unwrap();
    let configs = blocks(&text, "config");
    assert_eq!(configs.len(), 1, "{name}: one config block");
    let scratch = Scratch::new(&format!("guide-{name}"));
    let srv = scratch.file("srv");
    std::fs::create_dir_all(&srv).unwrap();
    let md = ["md0", "md1"].map(|md| {
        text.contains(&format!("/dev/{md}"))
            .then(|| Loop::new(&scratch.file(&format!("{md}.img"))))
    });
    let here = Here {
        port: free_port(),
        nvme_port: free_port(),
        secrets: scratch.file("secrets"),
        srv,
        md0: md[0].as_ref().map(|l| l.0.clone()),
        md1: md[1].as_ref().map(|l| l.0.clone()),
    };
    write_secrets(&configs[0], &here.secrets);
    let config = here.localize(&configs[0]);
    let file = scratch.file("ferrosan.toml");
    std::fs::write(&file, &config).unwrap();
    let bin = Path::new(env!("CARGO_BIN_EXE_ferrosan"));
    let deep = run_path(
        bin,
        &["check-config", "--deep", &file.display().to_string()],
    );
    assert!(deep.success(), "{name}: {}\n{config}", deep.describe());
    let ctl = Ctl::new();
    let socket = ctl.socket.display().to_string();
    let state = scratch.file("state").display().to_string();
    let daemon = Daemon::start_config_text(
        target,
        here.port,
        &config,
        &["--control-socket", &socket, "--state-dir", &state],
    );
    for block in blocks(&text, "ctl") {
        for line in block.lines().filter(|l| l.starts_with("ferrosan ctl ")) {
            let line = here.localize(line);
            let args: Vec<&str> = line["ferrosan ctl ".len()..].split_whitespace().collect();
            let out = ctl.run(&args);
            assert!(out.success(), "{name}: `{line}`: {}", out.describe());
        }
    }
    // Through every portal group of the guide, the LUNs the guide gives the host.
    let groups = config.matches("[[portal_group]]").count();
    for host in hosts {
        let seen = luns_seen(here.port, target, &host.initiator, host.chap);
        assert_eq!(
            seen.len(),
            groups,
            "{name}: {} through {seen:?}",
            host.initiator
        );
        for (portal, luns) in &seen {
            assert_eq!(luns, host.luns, "{name}: {} via {portal}", host.initiator);
        }
    }
    assert!(
        luns_seen(here.port, target, STRANGER, hosts[0].chap)
            .iter()
            .all(|(_, luns)| luns.is_empty()),
        "{name}: a host the guide does not name sees LUNs"
    );
    Served {
        daemon,
        here,
        _md: md,
        _scratch: scratch,
    }
}

fn host(initiator: String, chap: (&'static str, &'static str), luns: &'static [u32]) -> Host {
    Host {
        initiator,
        chap: Some(chap),
        luns,
    }
}

/// The recipe's two forms: the config serves disk1 to host01 with CHAP, and the ctl commands
/// add disk2 the same way on the running array; host01 sees LUN 0 of each, nobody else.
#[test]
fn the_recipes() {
    let host01 = "iqn.2005-03.org.open-iscsi:host01";
    let chap = ("host01", "host01");
    let served = serve_guide(
        "recipes",
        "iqn.2026-12.org.example:disk1",
        &[host(host01.into(), chap, &[0])],
    );
    let port = served.here.port;
    let disk2 = "iqn.2026-12.org.example:disk2";
    let seen = luns_seen(port, disk2, host01, Some(chap));
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        seen[0].1,
        [0],
        "host01 through the ctl-made target: {seen:?}"
    );
    assert!(
        luns_seen(port, disk2, STRANGER, Some(chap))
            .iter()
            .all(|(_, luns)| luns.is_empty()),
        "a host the recipe does not name sees the ctl-made target's LUNs"
    );
    let saved = std::fs::read_to_string(served.daemon.file("ferrosan.toml")).unwrap();
    assert!(saved.contains("disk2"), "ctl save kept nothing: {saved}");
}

#[test]
fn the_ssd_array_guide() {
    let target = "iqn.2026-11.org.example:array1";
    let vm = ("array1", "vm-hosts");
    let backup = "iqn.2005-03.org.open-iscsi:backup01";
    let hosts = [
        host("iqn.1998-01.com.vmware:esx01-5e5c1a7d".into(), vm, &[0]),
        host("iqn.1998-01.com.vmware:esx02-7a3d2b11".into(), vm, &[0]),
        host(backup.into(), ("backup01", "backup"), &[0]),
    ];
    let served = serve_guide("ssd-array", target, &hosts);
    // The backup host has a user of its own: the most specific scope wins, the target's
    // user does not let it in.
    let as_array1 = luns_seen(served.daemon.port, target, backup, Some(vm));
    assert!(
        as_array1.iter().all(|(_, luns)| luns.is_empty()),
        "the backup host logged in as array1: {as_array1:?}"
    );
}

#[test]
fn the_esxi_guide() {
    // esx03 joined live by the guide's ctl commands.
    let hosts = ["esx01-5e5c1a7d", "esx02-7a3d2b11", "esx03-0c9e4f62"].map(|h| {
        host(
            format!("iqn.1998-01.com.vmware:{h}"),
            ("vmware", "vmware"),
            &[0],
        )
    });
    serve_guide("esxi", "iqn.2026-11.org.example:vmware", &hosts);
}

#[test]
fn the_windows_guide() {
    let hosts = ["node1", "node2"].map(|n| {
        let name = format!("iqn.1991-05.com.microsoft:{n}.corp.example.org");
        host(name, ("cluster1", "cluster1"), &[0, 1])
    });
    serve_guide("windows", "iqn.2026-11.org.example:cluster1", &hosts);
}

#[test]
fn the_linux_guide() {
    use initiator::nvme::NvmeHost;
    let hosts = [host(
        "iqn.2005-03.org.open-iscsi:db01".into(),
        ("db01", "db01"),
        &[0],
    )];
    let served = serve_guide("linux", "iqn.2026-11.org.example:linux", &hosts);
    // The NVMe host the group names reaches namespace 1; another host NQN is refused.
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", served.here.nvme_port)
        .parse()
        .unwrap();
    let subsystem = "nqn.2026-11.org.example:linux";
    let listed = "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427";
    let mut nvme = NvmeHost::connect(addr, subsystem, listed, 8).expect("the guide's NVMe host");
    let read = nvme.read(1, 0, 8, 512).expect("read namespace 1");
    assert_eq!(read.len(), 4096);
    let other = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000000";
    assert!(
        NvmeHost::connect(addr, subsystem, other, 8).is_err(),
        "an unlisted host connected"
    );
}

#[test]
fn the_proxmox_guide() {
    // pve4 joined live (and saved) by the guide's ctl command.
    let hosts = ["pve1a2b3c4d", "pve2e5f6a7b", "pve3c8d9e0f", "pve4a1b2c3d"].map(|n| {
        host(
            format!("iqn.1993-08.org.debian:01:{n}"),
            ("pve", "pve"),
            &[0],
        )
    });
    let served = serve_guide("proxmox", "iqn.2026-11.org.example:pve", &hosts);
    let saved = std::fs::read_to_string(served.daemon.file("ferrosan.toml")).unwrap();
    assert!(
        saved.contains("pve4a1b2c3d"),
        "--save did not write the new node:\n{saved}"
    );
}

#[test]
fn the_kubernetes_guide() {
    // LUN 2 mapped live by the guide's ctl commands, LUN 3 a pool's volume exported to one
    // worker, in the group every worker shares.
    let hosts = [1, 2, 3].map(|n| {
        let name = format!("iqn.2005-03.org.open-iscsi:k8s-worker-{n}");
        host(name, ("k8s", "k8s"), &[0, 1, 2, 3])
    });
    let served = serve_guide("kubernetes", "iqn.2026-11.org.example:k8s", &hosts);
    let saved = std::fs::read_to_string(served.daemon.file("ferrosan.toml")).unwrap();
    assert!(
        saved.contains("[[pool]]") && saved.contains("pvc-0c8e1f"),
        "--save did not write the pool and its volume:\n{saved}"
    );
}

#[test]
fn every_guide_is_tested_and_listed() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/guides");
    let index = std::fs::read_to_string(dir.join("README.md")).unwrap();
    let tested = [
        "ssd-array",
        "esxi",
        "windows",
        "linux",
        "proxmox",
        "kubernetes",
        "recipes",
    ];
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().to_string();
        let Some(guide) = name.strip_suffix(".md").filter(|n| *n != "README") else {
            continue;
        };
        assert!(
            tested.contains(&guide),
            "docs/guides/{name} has no test here"
        );
        assert!(
            index.contains(&format!("({name})")),
            "README.md does not list {name}"
        );
    }
}
