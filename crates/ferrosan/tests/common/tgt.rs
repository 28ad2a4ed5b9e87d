//! tgtd (Debian tgt) as a peer target for tests: started on a free loopback port with its own
//! control socket, SIGKILLed by PID on Drop (it ignores SIGTERM).

use super::{free_port, require_tool, Scratch};
use std::process::{Child, Command as Process, Stdio};
use std::time::{Duration, Instant};

pub struct Tgt {
    child: Child,
    pub port: u16,
    ctl: String,
    _scratch: Scratch,
}

pub const TGT_IQN: &str = "iqn.2024-01.dev.ferrosan:tgt-initiator";

impl Tgt {
    /// tgtd on a free loopback port with a private control socket; LUN 1 is a 16 MiB file.
    pub fn start() -> Tgt {
        let tgtd = require_tool("tgtd");
        require_tool("tgtadm");
        let scratch = Scratch::new("tgt");
        let port = free_port();
        let ctl = (1000 + u32::from(port) % 30000).to_string();
        let log = std::fs::File::create(scratch.file("tgtd.log")).unwrap();
        let child = Process::new(tgtd)
            .args([
                "-f",
                "-C",
                &ctl,
                "--iscsi",
                &format!("portal=127.0.0.1:{port}"),
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn tgtd");
        let backing = scratch.file("disk.img");
        std::fs::File::create(&backing)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        let tgt = Tgt {
            child,
            port,
            ctl,
            _scratch: scratch,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !tgt.adm_ok(&[
            "--op", "new", "--mode", "target", "--tid", "1", "-T", TGT_IQN,
        ]) {
            assert!(
                Instant::now() < deadline,
                "tgtd's control socket never answered"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        tgt.adm(&[
            "--op",
            "new",
            "--mode",
            "logicalunit",
            "--tid",
            "1",
            "--lun",
            "1",
            "--backing-store",
            backing.to_str().unwrap(),
        ]);
        tgt.adm(&[
            "--op", "bind", "--mode", "target", "--tid", "1", "-I", "ALL",
        ]);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "tgtd never listened on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        tgt
    }

    pub fn adm_ok(&self, args: &[&str]) -> bool {
        Process::new("tgtadm")
            .args(["-C", &self.ctl, "--lld", "iscsi"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    pub fn adm(&self, args: &[&str]) {
        assert!(self.adm_ok(args), "tgtadm {args:?} failed");
    }

    pub fn account(&self, user: &str, password: &str, outgoing: bool) {
        self.adm(&[
            "--op",
            "new",
            "--mode",
            "account",
            "--user",
            user,
            "--password",
            password,
        ]);
        let mut bind = vec![
            "--op", "bind", "--mode", "account", "--tid", "1", "--user", user,
        ];
        if outgoing {
            bind.push("--outgoing");
        }
        self.adm(&bind);
    }
}

impl Drop for Tgt {
    fn drop(&mut self) {
        // SIGKILL by PID (tgtd ignores SIGTERM), then reap.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
