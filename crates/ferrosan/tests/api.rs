//! The remote management API (docs/OPERATIONS.md, *Remote API*): the socket's verbs over
//! HTTPS with tokens, through `ferrosan ctl --url` and through curl for the statuses.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{api_array_config, free_port, run_path, Ctl, Daemon, Scratch};
use serde_json::Value;

const IQN: &str = "iqn.2026-12.test:api";

struct Api {
    daemon: Daemon,
    ctl: Ctl,
    url: String,
    ca: PathBuf,
    dir: Scratch,
}

/// A daemon serving the API on a loopback port, its self-signed certificate in its state
/// directory.
fn start() -> Api {
    start_with(None)
}

/// As [`start`], taking client certificates of the CA in `client_ca` when given.
fn start_with(client_ca: Option<&Path>) -> Api {
    let dir = Scratch::new("api");
    let ctl = Ctl::new();
    let (port, api_port) = (free_port(), free_port());
    let state = dir.file("state");
    let pool = dir.file("pool");
    let mut text = api_array_config("fast", &pool, api_port, &state, &ctl, port);
    if let Some(ca) = client_ca {
        let line = format!("[server]\napi_client_ca = \"{}\"\n", ca.display());
        text = text.replacen("[server]\n", &line, 1);
    }
    text.push_str(&format!(
        r#"
[[device]]
name = "d0"
store = "ram"
size = "16M"

[[target]]
iqn = "{IQN}"
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "d0" }} ]
"#
    ));
    let daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    Api {
        daemon,
        ctl,
        url: format!("https://127.0.0.1:{api_port}"),
        ca: state.join("api-cert.pem"),
        dir,
    }
}

impl Api {
    /// A token of `role` made over the socket, in a file.
    fn token(&self, name: &str, role: &str) -> (String, PathBuf) {
        let made = self.ctl.json(&["token", "create", name, "--role", role]);
        assert_eq!(made["ok"], true, "{made}");
        let token = made["token"].as_str().unwrap().to_string();
        let file = self.dir.file(name);
        std::fs::write(&file, format!("{token}\n")).unwrap();
        (token, file)
    }

    /// `ferrosan ctl --url ... --json ARGS` with the token in `token_file`.
    fn ctl_remote(&self, token_file: &Path, args: &[&str]) -> Value {
        let token = token_file.display().to_string();
        self.ctl_as(&["--token-file", &token], args)
            .unwrap_or_else(|r| panic!("{}", r.describe()))
    }

    /// `ferrosan ctl --url ... --json ARGS`, proving itself with `proof` (its options); the
    /// answer, or the run that gave none.
    fn ctl_as(&self, proof: &[&str], args: &[&str]) -> Result<Value, common::Run> {
        let ca = self.ca.display().to_string();
        let mut all = vec!["ctl", "--url", &self.url, "--ca-file", &ca, "--json"];
        all.extend_from_slice(proof);
        all.extend_from_slice(args);
        let r = run_path(Path::new(env!("CARGO_BIN_EXE_ferrosan")), &all);
        serde_json::from_str(&r.stdout).map_err(|_| r)
    }

    /// curl's status codes for `method` on each of `paths`, one connection, with `token`.
    fn statuses(
        &self,
        method: &str,
        paths: &[&str],
        token: Option<&str>,
        body: Option<&str>,
    ) -> Vec<u16> {
        self.statuses_with(method, paths, token, body, &[])
    }

    /// [`Self::statuses`] with more arguments for curl.
    fn statuses_with(
        &self,
        method: &str,
        paths: &[&str],
        token: Option<&str>,
        body: Option<&str>,
        extra: &[&str],
    ) -> Vec<u16> {
        let mut c = Command::new("curl");
        c.args(["-s", "-w", "%{http_code}\\n", "--cacert"])
            .arg(&self.ca)
            .args(["-X", method])
            .args(extra);
        if let Some(token) = token {
            c.args(["-H", &format!("Authorization: Bearer {token}")]);
        }
        if let Some(body) = body {
            // From a file: a body may be longer than one argument may be.
            let file = self.dir.file("body.json");
            std::fs::write(&file, body).expect("the body's file");
            c.args(["-H", "Content-Type: application/json", "--data-binary"])
                .arg(format!("@{}", file.display()));
        }
        for path in paths {
            // Each URL's body is dropped: -o applies to one URL.
            c.args(["-o", "/dev/null"])
                .arg(format!("{}{path}", self.url));
        }
        let out = c.output().expect("curl");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.trim().parse().unwrap_or(0))
            .collect()
    }
}

#[test]
fn tokens_decide_who_may_call_what_and_a_revoked_one_stops_at_once() {
    let api = start();
    let (admin, admin_file) = api.token("ci", "admin");
    let (reader, reader_file) = api.token("grafana", "reader");
    // The same verbs and answers as the socket, through `ctl --url`.
    let status = api.ctl_remote(&reader_file, &["status"]);
    assert_eq!(status["ok"], true, "{status}");
    assert_eq!(status["targets"], api.ctl.json(&["status"])["targets"]);
    assert!(status["request_id"]
        .as_str()
        .is_some_and(|id| id.len() == 16));
    // No token, a wrong one: 401; a reader changing something: 403; GET only for reading.
    assert_eq!(api.statuses("GET", &["/v1/status"], None, None), [401]);
    assert_eq!(
        api.statuses("GET", &["/v1/status"], Some("fsn_00"), None),
        [401]
    );
    assert_eq!(
        api.statuses("GET", &["/v1/status", "/v1/luns"], Some(&reader), None),
        [200, 200]
    );
    let add = r#"{"name":"d1","spec":"ram:8M"}"#;
    assert_eq!(
        api.statuses("POST", &["/v1/device-add"], Some(&reader), Some(add)),
        [403]
    );
    assert_eq!(
        api.statuses("GET", &["/v1/device-add"], Some(&admin), None),
        [405]
    );
    assert_eq!(
        api.statuses("POST", &["/v1/no-such-verb"], Some(&admin), None),
        [404]
    );
    assert_eq!(
        api.statuses("POST", &["/v1/token-list"], Some(&reader), None),
        [403]
    );
    // An admin changes the array: the socket sees it, the log says who.
    let added = api.ctl_remote(&admin_file, &["device", "add", "d1", "ram:8M"]);
    assert_eq!(added["ok"], true, "{added}");
    let config = api.ctl.json(&["config", "show"]);
    assert!(
        config["toml"].as_str().unwrap().contains("name = \"d1\""),
        "{config}"
    );
    assert!(
        api.daemon.output().contains("API change"),
        "{}",
        api.daemon.output()
    );
    assert!(
        api.daemon.output().contains("token=ci"),
        "{}",
        api.daemon.output()
    );
    // The same request again: the socket's answer (it exists), with its status.
    let again = api.ctl_remote(&admin_file, &["device", "add", "d1", "ram:8M"]);
    assert_eq!(again["kind"], "conflict", "{again}");
    // Revoked: the next request is refused.
    assert_eq!(api.ctl.json(&["token", "revoke", "grafana"])["ok"], true);
    assert_eq!(
        api.statuses("GET", &["/v1/status"], Some(&reader), None),
        [401]
    );
    let listed = api.ctl.json(&["token", "list"]).to_string();
    assert!(listed.contains("\"ci\"") && !listed.contains("grafana") && !listed.contains(&admin));
}

#[test]
fn bodies_and_rates_are_bounded_and_the_document_lists_every_verb() {
    let api = start();
    let (admin, _) = api.token("ci", "admin");
    let big = format!(r#"{{"name":"{}"}}"#, "x".repeat(700 * 1024));
    // Each refusal reaches the client (the body is read, not reset under it), and the
    // connection serves the next request.
    assert_eq!(
        api.statuses("POST", &["/v1/device-add"; 5], Some(&admin), Some(&big)),
        [413; 5]
    );
    // A refusal before the body is read (who the caller is, what it may do) reads it away
    // too.
    let (reader, _) = api.token("grafana", "reader");
    assert_eq!(
        api.statuses("POST", &["/v1/device-add"; 3], Some(&reader), Some(&big)),
        [403; 3]
    );
    assert_eq!(
        api.statuses("POST", &["/v1/device-add"; 3], None, Some(&big)),
        [401; 3]
    );
    // Without a declared length (chunked), the same.
    assert_eq!(
        api.statuses_with(
            "POST",
            &["/v1/device-add"; 2],
            Some(&admin),
            Some(&big),
            &["-H", "Transfer-Encoding: chunked"]
        ),
        [413; 2]
    );
    assert_eq!(
        api.statuses("POST", &["/v1/status"], Some(&admin), Some("[1]")),
        [400]
    );
    let doc = Command::new("curl")
        .args(["-s", "--cacert"])
        .arg(&api.ca)
        .arg(format!("{}/v1/openapi.json", api.url))
        .output()
        .expect("curl");
    let doc: Value = serde_json::from_slice(&doc.stdout).expect("a JSON document");
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().unwrap();
    for verb in ["status", "volume-create", "lun-map", "token-create"] {
        assert!(paths.contains_key(&format!("/v1/{verb}")), "{verb}");
    }
    // The requests above spent part of the burst: wait until it is whole again (40 at 20 a
    // second).
    std::thread::sleep(std::time::Duration::from_millis(2500));
    // 100 requests at once from one address: the burst passes, then the rate's refill in the
    // time the requests took (measured, so a slow machine only lets more through), the rest
    // are told to wait.
    let paths: Vec<&str> = (0..100).map(|_| "/v1/status").collect();
    let started = std::time::Instant::now();
    let got = api.statuses("GET", &paths, Some(&admin), None);
    let took = started.elapsed().as_secs_f64();
    let ok = got.iter().filter(|s| **s == 200).count();
    let limited = got.iter().filter(|s| **s == 429).count();
    assert_eq!(ok + limited, 100, "{got:?}");
    assert!(ok >= 40, "the burst of 40 passes: {ok} passed: {got:?}");
    let refill = (20.0 * took).ceil() as usize;
    assert!(ok <= 40 + refill, "{ok} passed in {took:.2} s: {got:?}");
    assert!(
        got[..40].iter().all(|s| *s == 200),
        "the first 40 pass: {got:?}"
    );
    let metrics = api.ctl.json(&["status"]);
    assert_eq!(metrics["ok"], true);
}

/// Parallel changes from several clients over HTTPS are linearizable, as over the socket
/// (state.rs, `parallel_exports_all_land`): eight exports at once each get their own LUN and
/// all land.
#[test]
fn parallel_exports_over_https_all_land() {
    const N: usize = 8;
    const HOST: &str = "iqn.2026-12.org.example:host-a";
    let api = std::sync::Arc::new(start());
    let (_, admin_file) = api.token("csi", "admin");
    for i in 0..N {
        let made = api.ctl_remote(
            &admin_file,
            &["volume", "create", "fast", &format!("v{i}"), "4M"],
        );
        assert_eq!(made["ok"], true, "{made}");
    }
    let threads: Vec<_> = (0..N)
        .map(|i| {
            let (api, file) = (std::sync::Arc::clone(&api), admin_file.clone());
            std::thread::spawn(move || {
                api.ctl_remote(
                    &file,
                    &["volume", "export", &format!("v{i}"), "--initiator", HOST],
                )
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
    let shown = api.ctl.json(&["luns"]).to_string();
    for i in 0..N {
        assert!(shown.contains(&format!("\"v{i}\"")), "v{i}: {shown}");
    }
}

/// A test CA (`DIR/NAME-ca.pem`) and, for each common name, a certificate it signed and its
/// key (`DIR/CN.pem`, `DIR/CN.key`), made with the openssl command.
fn pki(dir: &Scratch, name: &str, common_names: &[&str]) -> PathBuf {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir.file(""))
            .output()
            .expect("openssl");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let (ca, ca_key) = (format!("{name}-ca.pem"), format!("{name}-ca.key"));
    let subject = format!("/CN={name} test CA");
    let mut args = vec!["req", "-x509", "-days", "2", "-subj", &subject];
    args.extend_from_slice(&ec);
    args.extend_from_slice(&["-keyout", &ca_key, "-out", &ca]);
    openssl(&args);
    for cn in common_names {
        let (cert, key, csr) = (
            format!("{cn}.pem"),
            format!("{cn}.key"),
            format!("{cn}.csr"),
        );
        let subject = format!("/CN={cn}");
        let mut args = vec!["req", "-subj", &subject, "-keyout", &key, "-out", &csr];
        args.extend_from_slice(&ec);
        openssl(&args);
        openssl(&[
            "x509",
            "-req",
            "-days",
            "2",
            "-in",
            &csr,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &cert,
        ]);
    }
    dir.file(&ca)
}

/// With `api_client_ca`, a client certificate of that CA is the token of its common name: its
/// role, stopped by the token's revocation; one of another CA fails the handshake, one naming
/// no token is 401, and tokens still work beside.
#[test]
fn client_certificates_of_the_configured_ca_are_the_tokens_they_name() {
    let keys = Scratch::new("api-pki");
    let ca = pki(&keys, "ours", &["ops", "viewer", "stranger"]);
    pki(&keys, "theirs", &["intruder"]);
    let api = start_with(Some(&ca));
    let (admin, _) = api.token("ops", "admin");
    api.token("viewer", "reader");
    let as_cn = |cn: &str, args: &[&str]| {
        let (cert, key) = (
            keys.file(&format!("{cn}.pem")),
            keys.file(&format!("{cn}.key")),
        );
        let (cert, key) = (cert.display().to_string(), key.display().to_string());
        api.ctl_as(&["--cert-file", &cert, "--key-file", &key], args)
    };
    let added = as_cn("ops", &["device", "add", "d1", "ram:8M"]).unwrap();
    assert_eq!(added["ok"], true, "{added}");
    let log = api.daemon.output();
    assert!(
        log.contains("token=ops") && log.contains("proof=\"certificate\""),
        "{log}"
    );
    let status = as_cn("viewer", &["status"]).unwrap();
    assert_eq!(status["ok"], true, "{status}");
    let refused = as_cn("viewer", &["device", "add", "d2", "ram:8M"]).unwrap();
    assert_eq!(refused["kind"], "forbidden", "{refused}");
    let unknown = as_cn("stranger", &["status"]).unwrap();
    assert_eq!(unknown["kind"], "unauthorized", "{unknown}");
    let outsider = as_cn("intruder", &["status"]);
    assert!(
        outsider.is_err(),
        "another CA's certificate was answered: {outsider:?}"
    );
    // Neither a token nor a certificate: 401, as without a client CA; a token still works.
    assert_eq!(api.statuses("GET", &["/v1/status"], None, None), [401]);
    assert_eq!(
        api.statuses("GET", &["/v1/status"], Some(&admin), None),
        [200]
    );
    assert_eq!(api.ctl.json(&["token", "revoke", "ops"])["ok"], true);
    let revoked = as_cn("ops", &["status"]).unwrap();
    assert_eq!(revoked["kind"], "unauthorized", "{revoked}");
}
