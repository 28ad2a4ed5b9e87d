//! A single-node Ceph cluster for a test (scripts/ceph-single-node.sh), stopped on Drop.
//! Missing Ceph packages are a failure, as every other missing tool is (scripts/test.sh
//! installs them). Shared with the rbd crate's binding test (`#[path]`), which uses a part.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct TestCluster {
    dir: PathBuf,
    pub conf: PathBuf,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-single-node.sh")
}

impl TestCluster {
    /// Starts a cluster whose OSD holds `osd_gib` GiB; `client_conf` is appended to its
    /// ceph.conf (e.g. shorter client timeouts).
    pub fn start(tag: &str, osd_gib: u32, client_conf: &str) -> TestCluster {
        TestCluster::start_where(tag, osd_gib, client_conf, Command::new(script()))
    }

    /// Like [`TestCluster::start`], its daemons in network namespace `netns` on `addr` of
    /// `network` (tests/netcut.rs), which the caller's namespace must reach.
    pub fn start_in_netns(
        tag: &str,
        osd_gib: u32,
        netns: &str,
        (addr, network): (&str, &str),
    ) -> TestCluster {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", netns]).arg(script());
        command.env("CEPH_ADDR", addr).env("CEPH_NETWORK", network);
        TestCluster::start_where(tag, osd_gib, "", command)
    }

    fn start_where(
        tag: &str,
        osd_gib: u32,
        client_conf: &str,
        mut command: Command,
    ) -> TestCluster {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("ceph-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = command
            .args(["start", &dir.display().to_string(), &osd_gib.to_string()])
            .output()
            .expect("run scripts/ceph-single-node.sh");
        let cluster = TestCluster {
            conf: dir.join("ceph.conf"),
            dir,
        };
        assert!(
            out.status.success(),
            "the test cluster did not start (apt-get install ceph-mon ceph-mgr ceph-osd ceph-common):\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !client_conf.is_empty() {
            let mut text = std::fs::read_to_string(&cluster.conf).expect("read ceph.conf");
            text.push_str(&format!("\n[client]\n{client_conf}\n"));
            std::fs::write(&cluster.conf, text).expect("write ceph.conf");
        }
        cluster
    }

    /// Runs `rbd -c CONF ARGS`, which must succeed; its stdout. A call that times out (the
    /// single-node cluster still peering after a test stopped its OSD) is tried again for up to
    /// a minute: what a test measures is ferrosan, not how fast this cluster recovers. A
    /// `create` whose first try timed out after writing may then find its image made.
    pub fn rbd(&self, args: &[&str]) -> Vec<u8> {
        let started = std::time::Instant::now();
        let mut timed_out = false;
        loop {
            let out = Command::new("rbd")
                .arg("-c")
                .arg(&self.conf)
                .args(args)
                .output()
                .expect("rbd");
            let stderr = String::from_utf8_lossy(&out.stderr);
            if out.status.success() || (timed_out && args[0] == "create" && stderr.contains("(17)"))
            {
                return out.stdout;
            }
            timed_out = stderr.contains("(110)");
            assert!(
                timed_out && started.elapsed() < std::time::Duration::from_secs(60),
                "rbd {args:?}: {stderr}"
            );
            std::thread::sleep(std::time::Duration::from_secs(2));
        }
    }

    /// Runs `rados -c CONF ARGS`, which must succeed; its stdout.
    pub fn rados(&self, args: &[&str]) -> Vec<u8> {
        self.tool("rados", args)
    }

    /// Runs `ceph -c CONF ARGS`, which must succeed; its stdout.
    pub fn ceph(&self, args: &[&str]) -> String {
        String::from_utf8_lossy(&self.tool("ceph", args)).into_owned()
    }

    /// Runs one of Ceph's command-line tools on this cluster, which must succeed; its stdout.
    fn tool(&self, tool: &str, args: &[&str]) -> Vec<u8> {
        let out = Command::new(tool)
            .arg("-c")
            .arg(&self.conf)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{tool}: {e}"));
        assert!(
            out.status.success(),
            "{tool} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    /// The PID of a daemon of the cluster (`osd.0`, `mon.a`).
    pub fn pid(&self, name: &str) -> u32 {
        let text = std::fs::read_to_string(self.dir.join("run").join(format!("{name}.pid")))
            .expect("daemon pid file");
        text.trim().parse().expect("pid")
    }

    /// The cephx user gateways run as, with the caps docs/RBD.md gives them (made once; its
    /// keyring where the test conf's `keyring = $cluster.$name.keyring` finds it).
    pub fn gateway_user(&self) -> &'static str {
        const USER: &str = "client.ferrosan-gw";
        let keyring = self.dir.join(format!("ceph.{USER}.keyring"));
        if !keyring.exists() {
            let out = Command::new("ceph")
                .arg("-c")
                .arg(&self.conf)
                .args(["auth", "get-or-create", USER])
                .args(["mon", "profile rbd", "osd", "profile rbd pool=rbd"])
                .args(["mgr", "profile rbd pool=rbd", "-o"])
                .arg(&keyring)
                .output()
                .expect("ceph auth get-or-create");
            assert!(
                out.status.success(),
                "ceph auth get-or-create {USER}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        USER
    }

    pub fn conf_str(&self) -> String {
        self.conf.display().to_string()
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        // A daemon a test stopped (SIGSTOP) must be able to die.
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("run/osd.0.pid")) {
            let _ = Command::new("kill").args(["-CONT", pid.trim()]).status();
        }
        let _ = Command::new(script())
            .args(["stop", &self.dir.display().to_string()])
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
