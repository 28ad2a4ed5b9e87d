//! A model-based test of the control plane as orchestrators drive it: 8 clients send 2,000
//! random verbs at once (create, export, unexport, snapshot, clone — some of them copying
//! data —, rollback, delete, CHAP set, initiator add and remove, reload, save) over the
//! control socket. Each client owns its names (volumes `cN…`, group `gN`) and shares one host
//! group with the others, so every answer it gets is checked against its own sequential model
//! of what it was acknowledged; at quiescence the running state, the saved file (loaded again
//! by a restart) and the pool directory must all be the models' union. Then the daemon is
//! killed (SIGKILL) at a random moment of a second round, restarted from its file, and each
//! client's state must be its model either with or without the one verb it had in flight.
//!
//! The seed is printed; `FERROSAN_MODEL_SEED=N` replays one. Needs root (a loop-mounted ext4,
//! where copies are copies, as the test command runs it).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::loopfs::LoopFs;
use common::{Ctl, Daemon};
use serde_json::{json, Value};

const IQN: &str = "iqn.2026-11.org.ferrosan:model";
const HOST: &str = "iqn.2026-11.org.example:shared-host";
const CLIENTS: usize = 8;
const VERBS_PER_CLIENT: usize = 250;
/// Volume names per client besides its `big` one; snapshot names per volume.
const NAMES: u64 = 4;
const SNAPS: u64 = 2;
/// The data a client's `big` volume holds, copied by every clone of it.
const BIG_DATA_BYTES: usize = 16 << 20;

/// xorshift64*: small, deterministic, no crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One volume as its client's model has it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Vol {
    size_mib: u64,
    /// What it is a clone of (`VOLUME` or `VOLUME@SNAPSHOT`), None when created.
    clone_of: Option<String>,
    exported: bool,
    snapshots: BTreeSet<String>,
}

impl Vol {
    fn of_mib(size_mib: u64) -> Vol {
        Vol {
            size_mib,
            ..Vol::default()
        }
    }
}

/// A client's own part of the array.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Model {
    volumes: BTreeMap<String, Vol>,
    initiators: BTreeSet<String>,
    chap_user: Option<String>,
}

/// What a verb is expected to answer: success with these fields, or a refusal of this kind.
enum Expect {
    Ok(Vec<(&'static str, Value)>),
    Refused(&'static str),
}

/// A verb, the model's prediction of its answer, and the model after it if it succeeds.
struct Planned {
    request: Value,
    expect: Expect,
    after: Model,
}

fn ok(fields: &[(&'static str, Value)]) -> Expect {
    Expect::Ok(fields.to_vec())
}

impl Model {
    fn vol_name(c: usize, k: u64) -> String {
        format!("c{c}v{k}")
    }

    /// A random verb of client `c`, with its expected answer.
    fn plan(&self, c: usize, rng: &mut Rng, save: bool) -> Planned {
        let mut after = self.clone();
        let name = Model::vol_name(c, rng.below(NAMES));
        let snap = format!("s{}", rng.below(SNAPS));
        let vol = self.volumes.get(&name);
        let (request, expect) = match rng.below(13) {
            0 | 1 => {
                let r = json!({"verb": "volume-create", "pool": "p", "name": name, "size": "4M", "save": save});
                match vol {
                    Some(v) if v.size_mib == 4 && v.clone_of.is_none() => {
                        (r, ok(&[("existed", json!(true))]))
                    }
                    Some(_) => (r, Expect::Refused("conflict")),
                    None => {
                        after.volumes.insert(name, Vol::of_mib(4));
                        (r, ok(&[("existed", json!(false))]))
                    }
                }
            }
            2 => {
                let r = json!({"verb": "volume-delete", "volume": name, "save": save});
                match vol {
                    None => (r, ok(&[("deleted", json!(false))])),
                    Some(v) if v.exported || !v.snapshots.is_empty() => {
                        (r, Expect::Refused("conflict"))
                    }
                    Some(_) => {
                        after.volumes.remove(&name);
                        (r, ok(&[("deleted", json!(true))]))
                    }
                }
            }
            3 | 4 => {
                let r = json!({"verb": "volume-export", "volume": name, "initiator": HOST, "save": save});
                match vol {
                    None => (r, Expect::Refused("not_found")),
                    Some(v) => {
                        let existed = v.exported;
                        after.volumes.get_mut(&name).unwrap().exported = true;
                        (r, ok(&[("existed", json!(existed))]))
                    }
                }
            }
            5 => {
                let r = json!({"verb": "volume-unexport", "volume": name, "initiator": HOST, "save": save});
                match vol {
                    None => (r, Expect::Refused("not_found")),
                    Some(v) => {
                        let was = v.exported;
                        after.volumes.get_mut(&name).unwrap().exported = false;
                        (r, ok(&[("unexported", json!(was))]))
                    }
                }
            }
            6 => {
                let r = json!({"verb": "volume-snapshot", "volume": name, "snapshot": snap});
                match vol {
                    None => (r, Expect::Refused("not_found")),
                    Some(v) if v.snapshots.contains(&snap) => (r, ok(&[("existed", json!(true))])),
                    // ext4 cannot reflink: a volume in use is not copied under held writes.
                    Some(v) if v.exported => (r, Expect::Refused("conflict")),
                    Some(_) => {
                        after.volumes.get_mut(&name).unwrap().snapshots.insert(snap);
                        (r, ok(&[("existed", json!(false))]))
                    }
                }
            }
            7 | 8 => self.plan_clone(c, rng, name, save, &mut after),
            9 => {
                let r = json!({"verb": "volume-rollback", "volume": name, "snapshot": snap});
                match vol {
                    None => (r, Expect::Refused("not_found")),
                    Some(v) if !v.snapshots.contains(&snap) => (r, Expect::Refused("not_found")),
                    Some(v) if v.exported => (r, Expect::Refused("conflict")),
                    Some(_) => (r, ok(&[])),
                }
            }
            10 => {
                let r = json!({"verb": "snapshot-delete", "volume": name, "snapshot": snap});
                let had = vol.is_some_and(|v| v.snapshots.contains(&snap));
                if let Some(v) = after.volumes.get_mut(&name) {
                    v.snapshots.remove(&snap);
                }
                (r, ok(&[("deleted", json!(had))]))
            }
            11 => {
                let initiator = format!("iqn.2026-11.org.example:c{c}i{}", rng.below(3));
                let group = format!("g{c}");
                let add = rng.below(2) == 0;
                let verb = if add {
                    "initiator-add"
                } else {
                    "initiator-remove"
                };
                let r = json!({"verb": verb, "target": IQN, "group": group, "initiator": initiator, "save": save});
                let has = self.initiators.contains(&initiator);
                match (add, has) {
                    (true, true) => (r, Expect::Refused("conflict")),
                    (false, false) => (r, Expect::Refused("not_found")),
                    (true, false) => {
                        after.initiators.insert(initiator);
                        (r, ok(&[]))
                    }
                    (false, true) => {
                        after.initiators.remove(&initiator);
                        (r, ok(&[]))
                    }
                }
            }
            _ => {
                let user = format!("c{c}u{}", rng.below(1000));
                let secret = format!("secret-{:016x}", rng.next());
                let r = json!({"verb": "chap-set", "target": IQN, "group": format!("g{c}"),
                               "user": user, "secret": secret, "save": save});
                after.chap_user = Some(user);
                (r, ok(&[]))
            }
        };
        Planned {
            request,
            expect,
            after,
        }
    }

    /// A clone of `name` (or of the client's `big` volume, which holds data to copy) into
    /// another of the client's names, of the volume now or of a snapshot.
    fn plan_clone(
        &self,
        c: usize,
        rng: &mut Rng,
        name: String,
        save: bool,
        after: &mut Model,
    ) -> (Value, Expect) {
        let source = if rng.below(2) == 0 {
            format!("c{c}big")
        } else {
            name
        };
        let target = Model::vol_name(c, rng.below(NAMES));
        let snap = (rng.below(3) == 0).then(|| format!("s{}", rng.below(SNAPS)));
        let mut r = json!({"verb": "volume-clone", "volume": source, "name": target, "save": save});
        if let Some(s) = &snap {
            r["snapshot"] = json!(s);
        }
        let big = source.ends_with("big");
        let src = if big {
            Some(Vol::of_mib(32))
        } else {
            self.volumes.get(&source).cloned()
        };
        let clone_of = match &snap {
            Some(s) => format!("{source}@{s}"),
            None => source.clone(),
        };
        let existing = self.volumes.get(&target).map(|v| v.clone_of.as_deref());
        let expect = match (src, existing) {
            (None, _) => Expect::Refused("not_found"),
            // Idempotent by source: the same clone again is there; another is a conflict.
            (Some(_), Some(of)) if of == Some(clone_of.as_str()) => ok(&[("existed", json!(true))]),
            (Some(_), Some(_)) => Expect::Refused("conflict"),
            (src, None) => self.new_clone(src, snap.as_deref(), clone_of, target, after),
        };
        (r, expect)
    }

    /// A clone into a free name: refused for a missing snapshot or a source in use (no
    /// reflink on ext4), else made.
    fn new_clone(
        &self,
        src: Option<Vol>,
        snap: Option<&str>,
        clone_of: String,
        target: String,
        after: &mut Model,
    ) -> Expect {
        match src {
            None => Expect::Refused("not_found"),
            Some(v) if snap.is_some_and(|s| !v.snapshots.contains(s)) => {
                Expect::Refused("not_found")
            }
            Some(v) if snap.is_none() && v.exported => Expect::Refused("conflict"),
            Some(v) => {
                let mut new = Vol::of_mib(v.size_mib);
                new.clone_of = Some(clone_of.clone());
                after.volumes.insert(target, new);
                ok(&[("existed", json!(false)), ("clone_of", json!(clone_of))])
            }
        }
    }
}

/// A control-socket client: one JSON request per line, one answer per line.
struct Client {
    read: BufReader<UnixStream>,
    write: UnixStream,
}

impl Client {
    fn connect(socket: &Path) -> Client {
        let stream = UnixStream::connect(socket).expect("connect to the control socket");
        stream
            .set_read_timeout(Some(Duration::from_secs(120)))
            .unwrap();
        Client {
            read: BufReader::new(stream.try_clone().unwrap()),
            write: stream,
        }
    }

    /// The answer, or None when the daemon went away.
    fn ask(&mut self, request: &Value) -> Option<Value> {
        let mut line = request.to_string();
        line.push('\n');
        self.write.write_all(line.as_bytes()).ok()?;
        let mut answer = String::new();
        match self.read.read_line(&mut answer) {
            Ok(n) if n > 0 => Some(serde_json::from_str(&answer).expect("a JSON answer")),
            _ => None,
        }
    }
}

/// Whether `answer` is what `expect` says; else why not.
fn check(request: &Value, expect: &Expect, answer: &Value) -> Result<(), String> {
    let fail = || Err(format!("{request} answered {answer}"));
    match expect {
        Expect::Ok(fields) => {
            if answer["ok"] != true {
                return fail();
            }
            if fields.iter().any(|(k, v)| answer[*k] != *v) {
                return fail();
            }
        }
        Expect::Refused(kind) => {
            if answer["ok"] != false || answer["kind"] != *kind {
                return fail();
            }
        }
    }
    Ok(())
}

/// One client's round of `verbs` verbs: its model after the acknowledged ones, the verb in
/// flight when the daemon went away (if it did), and every answer that contradicted the
/// model.
fn round(
    socket: PathBuf,
    c: usize,
    mut model: Model,
    seed: u64,
    verbs: usize,
    always_save: bool,
) -> (Model, Option<Model>, Vec<String>) {
    let mut rng = Rng(seed ^ (c as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut client = Client::connect(&socket);
    let mut wrong = Vec::new();
    for _ in 0..verbs {
        let global = rng.below(20);
        if global == 0 && !always_save {
            let answer = client.ask(&json!({"verb": "reload"}));
            let Some(answer) = answer else { break };
            // Refused while another client's change is unsaved; never anything else.
            let fine = answer["ok"] == true || answer["kind"] == "conflict";
            if !fine {
                wrong.push(format!("reload answered {answer}"));
            }
            continue;
        }
        if global == 1 {
            let Some(answer) = client.ask(&json!({"verb": "save"})) else {
                break;
            };
            if answer["ok"] != true {
                wrong.push(format!("save answered {answer}"));
            }
            continue;
        }
        let save = always_save || rng.below(2) == 0;
        let planned = model.plan(c, &mut rng, save);
        let Some(answer) = client.ask(&planned.request) else {
            return (model, Some(planned.after), wrong);
        };
        if let Err(why) = check(&planned.request, &planned.expect, &answer) {
            wrong.push(why);
            continue;
        }
        if answer["ok"] == true {
            model = planned.after;
        }
    }
    (model, None, wrong)
}

/// The array's state as the models see it, read from the running daemon.
fn observed(ctl: &Ctl) -> Vec<Model> {
    let mut models = vec![Model::default(); CLIENTS];
    let listed = ctl.json(&["volume", "list"]);
    let group = format!("host-{}", HOST.replace(':', "."));
    for v in listed["volumes"].as_array().unwrap() {
        let name = v["volume"].as_str().unwrap();
        let Some(c) = client_of(name) else { continue };
        if name.ends_with("big") {
            continue;
        }
        let vol = Vol {
            size_mib: v["size_bytes"].as_u64().unwrap() >> 20,
            clone_of: v["clone_of"].as_str().map(str::to_string),
            exported: v["mapped"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m.as_str().unwrap().contains(&group)),
            snapshots: v["snapshots"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect(),
        };
        models[c].volumes.insert(name.to_string(), vol);
    }
    let config = ctl.json(&["config", "show"]);
    let config: toml::Table = config["toml"].as_str().unwrap().parse().unwrap();
    let config = toml::Value::Table(config);
    for group in config["target"][0]["group"].as_array().unwrap() {
        let name = group["name"].as_str().unwrap();
        let Some(c) = name.strip_prefix('g').and_then(|n| n.parse::<usize>().ok()) else {
            continue;
        };
        models[c].initiators = group
            .get("initiators")
            .and_then(|i| i.as_array())
            .map(|list| {
                list.iter()
                    .map(|i| i.as_str().unwrap().to_string())
                    .filter(|i| !i.ends_with("base"))
                    .collect()
            })
            .unwrap_or_default();
        models[c].chap_user = group
            .get("users")
            .and_then(|u| u.get(0)?.get("user")?.as_str())
            .map(str::to_string);
    }
    models
}

fn client_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix('c')?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The volume and snapshot files of the pool, and any partial file left.
fn pool_files(pool: &Path) -> (BTreeSet<String>, BTreeSet<String>, Vec<String>) {
    let list = |dir: &Path| -> Vec<String> {
        std::fs::read_dir(dir)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut partial = Vec::new();
    let mut volumes = BTreeSet::new();
    for name in list(pool) {
        if name.ends_with(".partial") {
            partial.push(name);
        } else if let Some(v) = name.strip_suffix(".img") {
            volumes.insert(v.to_string());
        }
    }
    let mut snapshots = BTreeSet::new();
    for name in list(&pool.join(".snapshots")) {
        if name.ends_with(".partial") {
            partial.push(name);
        } else if let Some(s) = name.strip_suffix(".img") {
            snapshots.insert(s.to_string());
        }
    }
    (volumes, snapshots, partial)
}

/// The files the models say the pool holds.
fn expected_files(models: &[Model]) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut volumes: BTreeSet<String> = (0..CLIENTS).map(|c| format!("c{c}big")).collect();
    let mut snapshots = BTreeSet::new();
    for m in models {
        for (name, v) in &m.volumes {
            volumes.insert(name.clone());
            snapshots.extend(v.snapshots.iter().map(|s| format!("{name}@{s}")));
        }
    }
    (volumes, snapshots)
}

fn config_text(port: u16, pool: &Path) -> String {
    let mut text = format!(
        "[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:{port}\"]\n\n[[pool]]\nname = \"p\"\npath = \"{}\"\n\n",
        pool.display()
    );
    for c in 0..CLIENTS {
        text.push_str(&format!(
            "[[device]]\nname = \"c{c}big\"\nstore = \"file\"\npath = \"{}/c{c}big.img\"\nsize = \"32M\"\n\n",
            pool.display()
        ));
    }
    text.push_str(&format!("[[target]]\niqn = \"{IQN}\"\n"));
    for c in 0..CLIENTS {
        text.push_str(&format!(
            "  [[target.group]]\n  name = \"g{c}\"\n  initiators = [\"iqn.2026-11.org.example:c{c}base\"]\n  luns = []\n"
        ));
    }
    text
}

/// Runs one round on every client at once; the models after it and the verbs in flight.
fn run_round(
    socket: &Path,
    models: Vec<Model>,
    seed: u64,
    verbs: usize,
    always_save: bool,
) -> (Vec<Model>, Vec<Option<Model>>, Vec<String>) {
    let threads: Vec<_> = models
        .into_iter()
        .enumerate()
        .map(|(c, model)| {
            let socket = socket.to_path_buf();
            std::thread::spawn(move || round(socket, c, model, seed, verbs, always_save))
        })
        .collect();
    let mut models = Vec::new();
    let mut in_flight = Vec::new();
    let mut wrong = Vec::new();
    for t in threads {
        let (m, flying, w) = t.join().expect("a client thread");
        models.push(m);
        in_flight.push(flying);
        wrong.extend(w);
    }
    (models, in_flight, wrong)
}

#[test]
fn concurrent_verbs_are_linearizable_and_survive_a_kill() {
    let seed = std::env::var("FERROSAN_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("model seed {seed} (FERROSAN_MODEL_SEED={seed} replays it)");
    let fs = LoopFs::new("ext4", 3 << 30);
    let pool = fs.path("pool");
    std::fs::create_dir_all(&pool).unwrap();
    for c in 0..CLIENTS {
        let mut data = vec![0x5a_u8; BIG_DATA_BYTES];
        data.resize(32 << 20, 0);
        std::fs::write(pool.join(format!("c{c}big.img")), data).unwrap();
    }
    let ctl = Ctl::new();
    let s = ctl.socket.display().to_string();
    let port = common::free_port();
    let mut daemon = Daemon::start_config_text(
        IQN,
        port,
        &config_text(port, &pool),
        &["--control-socket", &s],
    );

    // Round one: 2,000 verbs at once; every answer as the client's model says.
    let (models, in_flight, wrong) = run_round(
        &ctl.socket,
        vec![Model::default(); CLIENTS],
        seed,
        VERBS_PER_CLIENT,
        false,
    );
    assert!(
        in_flight.iter().all(Option::is_none),
        "the daemon went away"
    );
    assert!(
        wrong.is_empty(),
        "answers against the model:\n{}",
        wrong.join("\n")
    );
    assert_eq!(
        observed(&ctl),
        models,
        "the running state is not the models'"
    );
    let (volumes, snapshots, partial) = pool_files(&pool);
    assert_eq!(
        (volumes, snapshots),
        expected_files(&models),
        "the pool directory"
    );
    assert!(partial.is_empty(), "partial files left: {partial:?}");
    // Saved, the file loads back into the same state.
    assert_eq!(ctl.json(&["save"])["ok"], true);
    daemon.restart();
    assert_eq!(
        observed(&ctl),
        models,
        "the saved file is not the running state"
    );

    // Round two, every change saved, killed at a random moment.
    let kill_after = Duration::from_millis(300 + seed % 1500);
    let socket = ctl.socket.clone();
    let clients = std::thread::spawn({
        let models = models.clone();
        move || {
            run_round(
                &socket,
                models,
                seed.rotate_left(17),
                VERBS_PER_CLIENT,
                true,
            )
        }
    });
    std::thread::sleep(kill_after);
    daemon.signal("KILL");
    let (acked, in_flight, wrong) = clients.join().unwrap();
    assert!(
        wrong.is_empty(),
        "answers against the model:\n{}",
        wrong.join("\n")
    );
    assert!(
        in_flight.iter().any(Option::is_some),
        "every client finished before the kill: the crash was not exercised"
    );
    daemon.restart();
    let after = observed(&ctl);
    for c in 0..CLIENTS {
        let fine = after[c] == acked[c] || in_flight[c].as_ref() == Some(&after[c]);
        assert!(
            fine,
            "client {c} after the kill: {:?}\nacknowledged: {:?}\nin flight: {:?}",
            after[c], acked[c], in_flight[c]
        );
    }
    // Every volume the restarted array serves has its file; files beyond the models' are
    // only those of a verb in flight (made, not committed), and no partial file is left.
    let (volumes, snapshots, partial) = pool_files(&pool);
    let (want_volumes, want_snapshots) = expected_files(&after);
    assert!(
        want_volumes.is_subset(&volumes),
        "{want_volumes:?} ⊄ {volumes:?}"
    );
    assert!(
        partial.is_empty(),
        "partial files left after the restart: {partial:?}"
    );
    let extra: Vec<&String> = volumes.difference(&want_volumes).collect();
    assert!(extra.len() <= CLIENTS, "files of no volume: {extra:?}");
    let extra: Vec<&String> = snapshots.difference(&want_snapshots).collect();
    assert!(extra.len() <= CLIENTS, "snapshots of no model: {extra:?}");
    daemon.stop();
}
