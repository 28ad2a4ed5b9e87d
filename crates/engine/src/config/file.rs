//! The declarative config file: raw (spanned) TOML structures, validation and resolution.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::ops::Range;

use scsi::AccessState;
use serde::Deserialize;
use toml::Spanned;

use super::auth::{
    auth_toml, raw_auth_of, resolve_auth, resolve_mutual, resolve_users, user_toml, RawAuth,
    RawChapUser, RawCredentials, RawDiscovery, SecretBook, SourceNet,
};
use super::names::{check_iscsi_name, check_object_name, parse_listen, portals_overlap};
use super::{
    ChapAlgorithm, Config, ConfigErrors, DeviceConfig, DiscoveryConfig, InitiatorCredentials,
    InitiatorGroup, LunMapping, NodeName, PortalGroup, RawLimits, ServerConfig, StoreKind,
    TargetConfig, LIMIT_TABLE,
};

/// The largest LUN number (flat addressing, SAM-5).
pub(crate) const LUN_MAX: u64 = 16_383;
/// The longest TargetAlias, in bytes (RFC 7143 text value limit).
const ALIAS_BYTES_MAX: usize = 255;
const WORKERS_MAX: i64 = 1024;

use super::cx::{bool_or, int, required, required_with, Cx, Pos};
use super::devices::{resolve_devices, RawDevice};
use super::Invalid;

type S<T> = Spanned<T>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    server: Option<RawServer>,
    limits: Option<RawLimits>,
    #[serde(default)]
    portal_group: Vec<S<RawPortalGroup>>,
    #[serde(default)]
    pool: Vec<S<RawPool>>,
    #[serde(default)]
    device: Vec<S<RawDevice>>,
    #[serde(default)]
    target: Vec<S<RawTarget>>,
    discovery: Option<S<RawDiscovery>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    workers: Option<S<i64>>,
    identity_seed: Option<S<String>>,
    chap_algorithms: Option<S<Vec<S<String>>>>,
    dhchap_hashes: Option<S<Vec<S<String>>>>,
    dhchap_groups: Option<S<Vec<S<String>>>>,
    metrics_listen: Option<S<String>>,
    io_uring: Option<S<bool>>,
    state_dir: Option<S<String>>,
    control_socket: Option<S<String>>,
    control_socket_group: Option<S<String>>,
    gateway: Option<S<String>>,
    gateway_standby: Option<S<bool>>,
    gateway_alua: Option<S<String>>,
    device_roots: Option<S<Vec<S<String>>>>,
    api_listen: Option<S<String>>,
    api_cert: Option<S<String>>,
    api_key: Option<S<String>>,
    api_client_ca: Option<S<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPool {
    name: Option<S<String>>,
    kind: Option<S<String>>,
    path: Option<S<String>>,
    /// `rbd`: the Ceph pool, and how to reach its cluster (as a `store = "rbd"` device).
    pool: Option<S<String>>,
    ceph_conf: Option<S<String>>,
    ceph_client: Option<S<String>>,
    /// `lvm`: the volume group and its thin pool.
    vg: Option<S<String>>,
    thin_pool: Option<S<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPortalGroup {
    tag: Option<S<i64>>,
    listen: Option<S<Vec<S<String>>>>,
    nvme_listen: Option<S<Vec<S<String>>>>,
    nvme_discovery_listen: Option<S<Vec<S<String>>>>,
    alua_state: Option<S<String>>,
    gateway: Option<S<String>>,
    peer_address: Option<S<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTarget {
    iqn: Option<S<String>>,
    nqn: Option<S<String>>,
    alias: Option<S<String>>,
    portal_groups: Option<S<Vec<S<i64>>>>,
    #[serde(default)]
    group: Vec<S<RawGroup>>,
    auth: Option<S<String>>,
    users: Option<S<Vec<S<RawChapUser>>>>,
    mutual: Option<S<RawChapUser>>,
    allowed_sources: Option<S<Vec<S<String>>>>,
    #[serde(default)]
    credentials: Vec<S<RawCredentials>>,
    tls_keys: Option<S<Vec<S<super::auth::RawTlsKey>>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGroup {
    name: Option<S<String>>,
    initiators: Option<S<Vec<S<String>>>>,
    any_initiator: Option<S<bool>>,
    luns: Option<S<Vec<S<RawLun>>>>,
    auth: Option<S<String>>,
    users: Option<S<Vec<S<RawChapUser>>>>,
    mutual: Option<S<RawChapUser>>,
    allowed_sources: Option<S<Vec<S<String>>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLun {
    lun: Option<S<i64>>,
    device: Option<S<String>>,
    read_only: Option<S<bool>>,
}

/// Turns a TOML syntax/type error into a located error naming the key it is about.
fn syntax_error(cx: &mut Cx<'_>, e: &toml::de::Error) {
    let span = e.span().unwrap_or(0..0);
    let mut message = for_people(e.message().trim());
    if let Some(near) = closest_expected(&message) {
        message.push_str(&format!(" (did you mean `{near}`?)"));
    }
    let repeated = (message == "duplicate key")
        .then(|| key_at(cx.src, &span))
        .flatten();
    if let Some(key) = &repeated {
        message.push_str(&format!(" `{key}`"));
    }
    let field = key_from_message(&message)
        .or(repeated)
        .or_else(|| key_before(cx.src, span.start))
        .unwrap_or_else(|| "toml".to_string());
    cx.err(span, field, message);
}

/// The bare or quoted key `span` covers (the parser points a repeated key's error at it).
fn key_at(src: &str, span: &std::ops::Range<usize>) -> Option<String> {
    let key = src.get(span.clone())?.trim();
    let bare = key.trim_matches('"');
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    (!bare.is_empty() && bare.chars().all(plain)).then(|| bare.to_string())
}

/// serde's type names as a person reads them: "expected i64" is "expected a whole number".
fn for_people(message: &str) -> String {
    let mut out = message.to_string();
    for ty in ["i64", "u64", "i32", "u32", "u16", "u8", "usize"] {
        out = out.replace(&format!("expected {ty}"), "expected a whole number");
    }
    out
}

/// For serde's "unknown field `sise`, expected one of `name`, `size`, …": the expected key
/// closest to the one written, if one is close enough to be what was meant.
fn closest_expected(message: &str) -> Option<&str> {
    let unknown = message.strip_prefix("unknown field `")?;
    let (written, rest) = unknown.split_once('`')?;
    let (_, expected) = rest.split_once("expected")?;
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|k| (strsim::normalized_damerau_levenshtein(written, k), k))
        .filter(|(score, _)| *score >= 0.6)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k)
}

/// `unknown field `x`` / `missing field `x`` → `x`.
fn key_from_message(message: &str) -> Option<String> {
    let rest = message
        .strip_prefix("unknown field `")
        .or_else(|| message.strip_prefix("missing field `"))?;
    Some(rest[..rest.find('`')?].to_string())
}

/// The key of a `key = value` whose value starts at `offset`.
fn key_before(src: &str, offset: usize) -> Option<String> {
    let before = src.get(..offset)?.trim_end();
    let before = before.strip_suffix('=')?.trim_end();
    let start = before
        .char_indices()
        .rev()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '"')))
        .map_or(0, |(i, c)| i + c.len_utf8());
    let key = &before[start..];
    (!key.is_empty()).then(|| key.to_string())
}

pub(crate) fn from_toml_str(text: &str, file_name: &str) -> Result<Config, ConfigErrors> {
    from_toml_str_seeded(text, file_name).map(|(config, _)| config)
}

/// [`from_toml_str`], with the `[server]`'s identity seed its devices were resolved with.
pub(crate) fn from_toml_str_seeded(
    text: &str,
    file_name: &str,
) -> Result<(Config, String), ConfigErrors> {
    let mut cx = Cx::new(text, file_name);
    let raw: RawFile = match toml::from_str(text) {
        Ok(raw) => raw,
        Err(e) => {
            syntax_error(&mut cx, &e);
            return Err(ConfigErrors { errors: cx.errors });
        }
    };
    let seed = (raw.server.as_ref())
        .and_then(|s| s.identity_seed.as_ref())
        .map(|seed| seed.get_ref().clone())
        .unwrap_or_default();
    let config = resolve(&mut cx, &raw);
    finished(cx, config).map(|config| (config, seed))
}

/// The `[[device]]` tables of `part`, a part of a config file that holds nothing else and
/// follows its first `lines_before` lines, each resolved as [`from_toml_str`] resolves it
/// beside a `[server]` of identity seed `seed` and device roots `roots` (its origin the
/// file's line); None if `part` holds anything else or refuses anything.
pub(crate) fn devices_of_part(
    part: &str,
    file_name: &str,
    lines_before: usize,
    seed: &str,
    roots: &[std::path::PathBuf],
) -> Option<Vec<DeviceConfig>> {
    let raw: RawFile = toml::from_str(part).ok()?;
    let devices_only = raw.server.is_none()
        && raw.limits.is_none()
        && raw.portal_group.is_empty()
        && raw.pool.is_empty()
        && raw.target.is_empty()
        && raw.discovery.is_none();
    if !devices_only {
        return None;
    }
    let mut cx = Cx::part(part, file_name, lines_before);
    let devices = resolve_devices(&mut cx, &raw.device, seed, roots);
    (cx.errors.is_empty() && devices.len() == raw.device.len()).then_some(devices)
}

/// A resolved config, or every error found, in the text's order.
fn finished(cx: Cx<'_>, config: Config) -> Result<Config, ConfigErrors> {
    if cx.errors.is_empty() {
        return Ok(config);
    }
    let mut errors = cx.errors;
    errors.sort_by_key(|e| (e.line, e.column));
    Err(ConfigErrors { errors })
}

/// `c` validated whole as loading `c.to_toml_with_secrets()` would validate it, without
/// writing and parsing that text: the raw tables are made from `c` in memory
/// ([`RawFile::of`]) and go through the same [`resolve`] as a file's. The config is the one
/// that text would load as, each device keeping its origin from `c` (there is no text to
/// point into); errors come in the order the text would give them, without a line. A value
/// the text could not hold (a number beyond TOML's integers) takes the text's way.
pub(crate) fn revalidate(c: &Config, file_name: &str) -> Result<Config, ConfigErrors> {
    let result = match RawFile::of(c) {
        Some(raw) => {
            let mut cx = Cx::without_text(file_name);
            let config = resolve(&mut cx, &raw);
            finished(cx, config)
        }
        None => from_toml_str(&to_toml(c, true), file_name),
    };
    #[cfg(debug_assertions)]
    same_as_the_text(c, file_name, &result);
    match result {
        Ok(mut config) => {
            // Without errors every device of `c` resolved to one, in order.
            for (device, was) in config.devices.iter_mut().zip(&c.devices) {
                std::sync::Arc::make_mut(device).origin = was.origin.clone();
            }
            Ok(config)
        }
        Err(mut errors) => {
            for e in &mut errors.errors {
                (e.line, e.column) = (0, 0);
            }
            Err(errors)
        }
    }
}

/// [`revalidate`] of `c` whose devices resolve to themselves (each is one a loaded config
/// holds, or was validated so): everything else is resolved as the whole way does, around
/// those devices, which are kept as they are (shared). None if anything is refused (the whole
/// way then says what) or a value would not fit the text.
pub(crate) fn revalidate_around_devices(c: &Config, file_name: &str) -> Option<Config> {
    let without = Config {
        devices: Vec::new(),
        ..c.clone()
    };
    let raw = RawFile::of(&without)?;
    let mut cx = Cx::without_text(file_name);
    let config = resolve_with(&mut cx, &raw, Some(&c.devices));
    finished(cx, config).ok()
}

/// Debug builds (every test) check [`revalidate`] against the text's way: the same config,
/// or the same errors in the same order.
#[cfg(debug_assertions)]
fn same_as_the_text(c: &Config, file_name: &str, result: &Result<Config, ConfigErrors>) {
    let text = to_toml(c, true);
    let said = |r: &Result<Config, ConfigErrors>| match r {
        Ok(_) => Vec::new(),
        Err(e) => e
            .errors
            .iter()
            .map(|e| format!("{}: {}", e.field, e.message))
            .collect(),
    };
    let by_text = from_toml_str(&text, file_name);
    assert_eq!(
        said(result),
        said(&by_text),
        "revalidate differs from loading the text:\n{text}"
    );
    if let (Ok(a), Ok(b)) = (result, &by_text) {
        assert!(a == b, "revalidate differs from loading the text:\n{text}");
    }
}

impl RawFile {
    /// The raw tables reading back `to_toml_with_secrets(c)` would give, made in memory, each
    /// value at its [`Pos`] in that text's order; None if a value would not fit the text.
    fn of(c: &Config) -> Option<RawFile> {
        let mut pos = Pos::default();
        let server = Some(RawServer::of(&c.server, &mut pos)?);
        let limits = Some(RawLimits::of(&c.limits, &mut pos)?);
        let discovery = (c.discovery != DiscoveryConfig::default()).then(|| {
            let at = pos.next();
            Spanned::new(at, RawDiscovery::of(&c.discovery.auth, &mut pos))
        });
        let portal_group = c
            .portal_groups
            .iter()
            .map(|pg| RawPortalGroup::of(pg, &mut pos))
            .collect();
        let pool = c.pools.iter().map(|p| RawPool::of(p, &mut pos)).collect();
        let device = c
            .devices
            .iter()
            .map(|d| RawDevice::of(d, &mut pos))
            .collect::<Option<_>>()?;
        let target = c
            .targets
            .iter()
            .map(|t| RawTarget::of(t, &mut pos))
            .collect::<Option<_>>()?;
        Some(RawFile {
            server,
            limits,
            portal_group,
            pool,
            device,
            target,
            discovery,
        })
    }
}

/// A list of strings at the next positions.
fn strings<I: IntoIterator<Item = String>>(pos: &mut Pos, items: I) -> S<Vec<S<String>>> {
    let at = pos.next();
    let list = items.into_iter().map(|item| pos.s(item)).collect();
    Spanned::new(at, list)
}

impl RawServer {
    fn of(server: &ServerConfig, pos: &mut Pos) -> Option<RawServer> {
        let workers = Some(pos.s(int(server.workers)?));
        let names = server.chap_algorithms.iter().map(|a| a.name().to_string());
        let chap_algorithms = Some(strings(pos, names));
        let (mut dhchap_hashes, mut dhchap_groups) = (None, None);
        if server.dhchap != nvme::auth::controller::Policy::default() {
            let hashes = server.dhchap.hashes.iter().map(|h| h.name().to_string());
            dhchap_hashes = Some(strings(pos, hashes));
            let groups = server.dhchap.groups.iter().map(|g| g.name().to_string());
            dhchap_groups = Some(strings(pos, groups));
        }
        let metrics_listen = server.metrics_listen.map(|m| pos.s(m.to_string()));
        let io_uring = (!server.io_uring).then(|| pos.s(false));
        let state_dir = (server.state_dir.as_ref()).map(|d| pos.s(d.display().to_string()));
        let control_socket =
            (server.control_socket.as_ref()).map(|p| pos.s(p.display().to_string()));
        let gateway = server.gateway.as_ref().map(|g| pos.s(g.clone()));
        let gateway_standby = server.gateway_standby.then(|| pos.s(true));
        let gateway_alua = (server.gateway_alua_explicit).then(|| pos.s("explicit".to_string()));
        let control_socket_group = (server.control_socket_group.as_ref()).map(|g| pos.s(g.clone()));
        let device_roots = (!server.device_roots.is_empty()).then(|| {
            let roots = server.device_roots.iter();
            strings(pos, roots.map(|r| r.to_string_lossy().into_owned()))
        });
        Some(RawServer {
            workers,
            identity_seed: None,
            chap_algorithms,
            dhchap_hashes,
            dhchap_groups,
            metrics_listen,
            io_uring,
            state_dir,
            control_socket,
            control_socket_group,
            gateway,
            gateway_standby,
            gateway_alua,
            device_roots,
            api_listen: server.api_listen.map(|a| pos.s(a.to_string())),
            api_cert: (server.api_cert.as_ref()).map(|p| pos.s(p.display().to_string())),
            api_key: (server.api_key.as_ref()).map(|p| pos.s(p.display().to_string())),
            api_client_ca: (server.api_client_ca.as_ref()).map(|p| pos.s(p.display().to_string())),
        })
    }
}

impl RawPortalGroup {
    fn of(pg: &PortalGroup, pos: &mut Pos) -> S<RawPortalGroup> {
        let at = pos.next();
        let addresses = |pos: &mut Pos, list: &[SocketAddr]| {
            strings(pos, list.iter().map(SocketAddr::to_string))
        };
        let tag = Some(pos.s(i64::from(pg.tag)));
        let listen = Some(addresses(pos, &pg.listen));
        let alua_state = Some(pos.s(alua_state_name(pg.alua_state).to_string()));
        let nvme_listen = (!pg.nvme_listen.is_empty()).then(|| addresses(pos, &pg.nvme_listen));
        let nvme_discovery_listen =
            (pg.nvme_discovery_listen.as_deref()).map(|l| addresses(pos, l));
        let gateway = pg.gateway.as_ref().map(|g| pos.s(g.clone()));
        let peer_address = pg.peer_address.map(|a| pos.s(a.to_string()));
        Spanned::new(
            at,
            RawPortalGroup {
                tag,
                listen,
                nvme_listen,
                nvme_discovery_listen,
                alua_state,
                gateway,
                peer_address,
            },
        )
    }
}

impl RawPool {
    fn of(p: &super::PoolConfig, pos: &mut Pos) -> S<RawPool> {
        let at = pos.next();
        let lossy = |p: &std::path::Path| p.to_string_lossy().into_owned();
        let mut raw = RawPool {
            name: Some(pos.s(p.name.clone())),
            kind: None,
            path: None,
            pool: None,
            ceph_conf: None,
            ceph_client: None,
            vg: None,
            thin_pool: None,
        };
        match &p.kind {
            super::PoolKind::Dir { path } => raw.path = Some(pos.s(lossy(path))),
            super::PoolKind::Rbd { pool, conf, client } => {
                raw.kind = Some(pos.s("rbd".to_string()));
                raw.pool = Some(pos.s(pool.clone()));
                raw.ceph_conf = conf.as_deref().map(|c| pos.s(lossy(c)));
                raw.ceph_client = client.as_ref().map(|c| pos.s(c.clone()));
            }
            super::PoolKind::Lvm(thin) => {
                raw.kind = Some(pos.s("lvm".to_string()));
                raw.vg = Some(pos.s(thin.vg.clone()));
                raw.thin_pool = Some(pos.s(thin.pool.clone()));
            }
        }
        Spanned::new(at, raw)
    }
}

impl RawTarget {
    fn of(t: &TargetConfig, pos: &mut Pos) -> Option<S<RawTarget>> {
        let at = pos.next();
        let iqn = Some(pos.s(t.iqn.as_str().to_string()));
        let nqn = t.nqn.as_ref().map(|n| pos.s(n.as_str().to_string()));
        let alias = t.alias.as_ref().map(|a| pos.s(a.clone()));
        let portal_groups = pos.list(&t.portal_groups, |_, tag| Some(i64::from(*tag)));
        let (auth, users, mutual) = raw_auth_of(&t.auth, pos);
        let allowed_sources = sources_of(&t.allowed_sources, pos);
        let tls_keys = (!t.tls_keys.is_empty())
            .then(|| {
                pos.list(&t.tls_keys, |pos, k| {
                    Some(super::auth::RawTlsKey::of(k, pos))
                })
            })
            .flatten();
        let group = t
            .groups
            .iter()
            .map(|g| RawGroup::of(g, pos))
            .collect::<Option<_>>()?;
        let credentials = t
            .credentials
            .iter()
            .map(|c| {
                let at = pos.next();
                Spanned::new(at, RawCredentials::of(c, pos))
            })
            .collect();
        Some(Spanned::new(
            at,
            RawTarget {
                iqn,
                nqn,
                alias,
                portal_groups,
                group,
                auth,
                users,
                mutual,
                allowed_sources,
                credentials,
                tls_keys,
            },
        ))
    }
}

/// `allowed_sources`, when there are any.
fn sources_of(nets: &[SourceNet], pos: &mut Pos) -> Option<S<Vec<S<String>>>> {
    (!nets.is_empty()).then(|| strings(pos, nets.iter().map(SourceNet::to_string)))
}

impl RawGroup {
    fn of(g: &InitiatorGroup, pos: &mut Pos) -> Option<S<RawGroup>> {
        let at = pos.next();
        let name = Some(pos.s(g.name.clone()));
        let initiators = (!g.initiators.is_empty())
            .then(|| strings(pos, g.initiators.iter().map(|i| i.as_str().to_string())));
        let any_initiator = Some(pos.s(g.any_initiator));
        let luns = Some(pos.list(&g.luns, |pos, l| {
            Some(RawLun {
                lun: Some(pos.s(int(l.lun)?)),
                device: Some(pos.s(l.device.clone())),
                read_only: Some(pos.s(l.read_only)),
            })
        })?);
        let (auth, users, mutual) = raw_auth_of(&g.auth, pos);
        let allowed_sources = sources_of(&g.allowed_sources, pos);
        Some(Spanned::new(
            at,
            RawGroup {
                name,
                initiators,
                any_initiator,
                luns,
                auth,
                users,
                mutual,
                allowed_sources,
            },
        ))
    }
}

fn resolve(cx: &mut Cx<'_>, raw: &RawFile) -> Config {
    resolve_with(cx, raw, None)
}

/// [`resolve`], with `devices` instead of `raw`'s when given (resolved already).
fn resolve_with(
    cx: &mut Cx<'_>,
    raw: &RawFile,
    devices: Option<&[std::sync::Arc<DeviceConfig>]>,
) -> Config {
    let mut server = ServerConfig::default();
    let mut identity_seed = String::new();
    if let Some(s) = &raw.server {
        identity_seed = resolve_server(cx, s, &mut server);
    }
    let mut book = SecretBook::default();
    let discovery = match &raw.discovery {
        None => DiscoveryConfig::default(),
        Some(d) => {
            let span = d.span();
            let d = d.get_ref();
            let view = RawAuth {
                auth: &d.auth,
                users: &d.users,
                mutual: &d.mutual,
            };
            DiscoveryConfig {
                auth: resolve_auth(cx, &view, "discovery", &span, false, &mut book),
            }
        }
    };
    let limits = match &raw.limits {
        Some(l) => {
            let mut limits = l.resolve(cx);
            check_limit_relations(cx, l, &mut limits);
            limits
        }
        None => super::Limits::default(),
    };
    let portal_groups = resolve_portal_groups(cx, &raw.portal_group, !server.gateway_standby);
    let pools = resolve_pools(cx, &raw.pool, &server.device_roots);
    let devices: Vec<std::sync::Arc<DeviceConfig>> = match devices {
        Some(given) => given.to_vec(),
        None => resolve_devices(cx, &raw.device, &identity_seed, &server.device_roots)
            .into_iter()
            .map(std::sync::Arc::new)
            .collect(),
    };
    let targets = resolve_targets(cx, &raw.target, &portal_groups, &devices, &mut book)
        .into_iter()
        .map(std::sync::Arc::new)
        .collect();
    book.check(cx);
    Config {
        server,
        limits,
        portal_groups,
        pools,
        devices,
        targets,
        discovery,
    }
}

/// `[[pool]]` tables: a unique name; `kind = "dir"` (the default) with an absolute `path`
/// inside `device_roots`, `kind = "rbd"` with a Ceph `pool` (and `ceph_conf`,
/// `ceph_client`), or `kind = "lvm"` with a `vg` and its `thin_pool`. What a pool's values
/// must be is [`super::PoolConfig::check`]'s, as for `ctl pool add`; here each problem is
/// reported at its key.
fn resolve_pools(
    cx: &mut Cx<'_>,
    raw: &[S<RawPool>],
    roots: &[std::path::PathBuf],
) -> Vec<super::PoolConfig> {
    let mut pools: Vec<super::PoolConfig> = Vec::new();
    for (i, rp) in raw.iter().enumerate() {
        let table = rp.span();
        let rp = rp.get_ref();
        let name = required(cx, &rp.name, &table, format!("pool #{}: name", i + 1));
        let ctx = name.map_or(format!("pool #{}", i + 1), |n| {
            format!("pool {:?}", n.get_ref())
        });
        let kind = match rp.kind.as_ref().map(|k| k.get_ref().as_str()) {
            None | Some("dir") => dir_pool(cx, rp, &table, &ctx),
            Some("rbd") => rbd_pool(cx, rp, &table, &ctx),
            Some("lvm") => lvm_pool(cx, rp, &table, &ctx),
            Some(other) => {
                let span = rp.kind.as_ref().map_or(table.clone(), |k| k.span());
                let why = format!("{other:?}: \"dir\", \"rbd\" or \"lvm\"");
                cx.err(span, format!("{ctx}: kind"), why);
                None
            }
        };
        let Some(name) = name else { continue };
        let pool = super::PoolConfig {
            name: name.get_ref().clone(),
            kind: match kind {
                Some(kind) => kind,
                None => {
                    // The kind is in error already; the name may be too.
                    if let Err(m) = check_object_name(name.get_ref()) {
                        cx.err(name.span(), format!("{ctx}: name"), m);
                    }
                    continue;
                }
            },
        };
        let problems = pool.problems(roots);
        for (key, why) in &problems {
            let span = pool_key_span(rp, key).unwrap_or_else(|| table.clone());
            cx.err(span, format!("{ctx}: {key}"), why.0.clone());
        }
        if problems.iter().any(|(key, _)| *key == "name") {
            continue;
        }
        let shared = pools.iter().find_map(|p| pool.shares_volumes_with(p));
        if pools.iter().any(|p| p.name == pool.name) {
            cx.err(name.span(), format!("{ctx}: name"), "duplicate pool name");
        } else if let Some((key, why)) = shared {
            let span = pool_key_span(rp, key).unwrap_or_else(|| table.clone());
            cx.err(span, format!("{ctx}: {key}"), why);
        } else if problems.is_empty() {
            pools.push(pool);
        }
    }
    pools
}

/// Where a `[[pool]]` key's value is written, if it is.
fn pool_key_span(rp: &RawPool, key: &str) -> Option<Range<usize>> {
    let value = match key {
        "name" => &rp.name,
        "path" => &rp.path,
        "pool" => &rp.pool,
        "ceph_conf" => &rp.ceph_conf,
        "ceph_client" => &rp.ceph_client,
        "vg" => &rp.vg,
        "thin_pool" => &rp.thin_pool,
        _ => return None,
    };
    value.as_ref().map(|v| v.span())
}

fn dir_pool(
    cx: &mut Cx<'_>,
    rp: &RawPool,
    table: &std::ops::Range<usize>,
    ctx: &str,
) -> Option<super::PoolKind> {
    other_kinds_keys(cx, rp, table, ctx, "dir");
    let p = required(cx, &rp.path, table, format!("{ctx}: path"))?;
    let path = std::path::PathBuf::from(p.get_ref());
    Some(super::PoolKind::Dir { path })
}

fn rbd_pool(
    cx: &mut Cx<'_>,
    rp: &RawPool,
    table: &std::ops::Range<usize>,
    ctx: &str,
) -> Option<super::PoolKind> {
    other_kinds_keys(cx, rp, table, ctx, "rbd");
    let pool = required(cx, &rp.pool, table, format!("{ctx}: pool"))?;
    Some(super::PoolKind::Rbd {
        pool: pool.get_ref().clone(),
        conf: rp
            .ceph_conf
            .as_ref()
            .map(|c| std::path::PathBuf::from(c.get_ref())),
        client: rp.ceph_client.as_ref().map(|c| c.get_ref().clone()),
    })
}

/// Each pool key and the kind it belongs to, with whether it was given.
fn kind_keys(rp: &RawPool) -> [(&'static str, &'static str, bool); 6] {
    [
        ("dir", "path", rp.path.is_some()),
        ("rbd", "pool", rp.pool.is_some()),
        ("rbd", "ceph_conf", rp.ceph_conf.is_some()),
        ("rbd", "ceph_client", rp.ceph_client.is_some()),
        ("lvm", "vg", rp.vg.is_some()),
        ("lvm", "thin_pool", rp.thin_pool.is_some()),
    ]
}

/// Refuses every key given that belongs to another kind than `kind`: a pool of one kind
/// with another's key is a mistake to point at, not to ignore.
fn other_kinds_keys(
    cx: &mut Cx<'_>,
    rp: &RawPool,
    table: &std::ops::Range<usize>,
    ctx: &str,
    kind: &str,
) {
    for (owner, key, given) in kind_keys(rp) {
        if given && owner != kind {
            let why = format!("only for kind = \"{owner}\", not for kind = \"{kind}\"");
            cx.err(table.clone(), format!("{ctx}: {key}"), why);
        }
    }
}

/// An LVM pool: a volume group and a thin pool in it (the group's directory `/dev/VG` is
/// where its volumes' devices appear).
fn lvm_pool(
    cx: &mut Cx<'_>,
    rp: &RawPool,
    table: &std::ops::Range<usize>,
    ctx: &str,
) -> Option<super::PoolKind> {
    other_kinds_keys(cx, rp, table, ctx, "lvm");
    let vg = required(cx, &rp.vg, table, format!("{ctx}: vg"));
    let pool = required(cx, &rp.thin_pool, table, format!("{ctx}: thin_pool"));
    Some(super::PoolKind::Lvm(store::lvm::ThinPool {
        vg: vg?.get_ref().clone(),
        pool: pool?.get_ref().clone(),
    }))
}

/// `[server]`, into `server`; returns the identity seed.
fn resolve_server(cx: &mut Cx<'_>, s: &RawServer, server: &mut ServerConfig) -> String {
    let mut identity_seed = String::new();
    if let Some(w) = &s.workers {
        if let Some(w) = cx.int_in(w, 0, WORKERS_MAX, "server: workers") {
            server.workers = w as usize;
        }
    }
    if let Some(seed) = &s.identity_seed {
        identity_seed = seed.get_ref().clone();
    }
    if let Some(list) = &s.chap_algorithms {
        server.chap_algorithms = resolve_algorithms(cx, list);
    }
    resolve_dhchap(cx, s, server);
    if let Some(addr) = &s.metrics_listen {
        match parse_listen(addr.get_ref()) {
            Ok(a) => server.metrics_listen = Some(a),
            Err(m) => cx.err(addr.span(), "server: metrics_listen", m),
        }
    }
    server.io_uring = bool_or(&s.io_uring, true);
    server_paths(cx, s, server);
    if let Some(g) = &s.gateway {
        match check_gateway_name(g.get_ref()) {
            Ok(()) => server.gateway = Some(g.get_ref().clone()),
            Err(m) => cx.err(g.span(), "server: gateway", m),
        }
    }
    if let Some(standby) = &s.gateway_standby {
        server.gateway_standby = *standby.get_ref();
    }
    if let Some(alua) = &s.gateway_alua {
        match alua.get_ref().as_str() {
            "implicit" => server.gateway_alua_explicit = false,
            "explicit" => server.gateway_alua_explicit = true,
            _ => cx.err(
                alua.span(),
                "server: gateway_alua",
                "\"implicit\" (the gateways move an image; the default) or \"explicit\" (initiators may move it too, with SET TARGET PORT GROUPS)",
            ),
        }
    }
    server_roots_and_group(cx, s, server);
    server_api(cx, s, server);
    identity_seed
}

/// `[server]`'s state directory and control socket: absolute paths.
fn server_paths(cx: &mut Cx<'_>, s: &RawServer, server: &mut ServerConfig) {
    if let Some(dir) = &s.state_dir {
        if dir.get_ref().is_empty() || !dir.get_ref().starts_with('/') {
            cx.err(dir.span(), "server: state_dir", "an absolute path");
        } else if let Err(m) = super::names::check_path_text(dir.get_ref()) {
            cx.err(dir.span(), "server: state_dir", m);
        } else {
            server.state_dir = Some(dir.get_ref().into());
        }
    }
    if let Some(path) = &s.control_socket {
        let p = path.get_ref();
        if p.is_empty() || !p.starts_with('/') {
            cx.err(path.span(), "server: control_socket", "an absolute path");
        } else if let Err(m) = super::names::check_path_text(p) {
            cx.err(path.span(), "server: control_socket", m);
        } else {
            server.control_socket = Some(p.into());
        }
    }
}

/// `[server]`'s remote API: its address, and its certificate and key (both or neither).
fn server_api(cx: &mut Cx<'_>, s: &RawServer, server: &mut ServerConfig) {
    if let Some(addr) = &s.api_listen {
        match parse_listen(addr.get_ref()) {
            Ok(a) => server.api_listen = Some(a),
            Err(m) => cx.err(addr.span(), "server: api_listen", m),
        }
    }
    for (raw, field, out) in [
        (&s.api_cert, "server: api_cert", &mut server.api_cert),
        (&s.api_key, "server: api_key", &mut server.api_key),
        (
            &s.api_client_ca,
            "server: api_client_ca",
            &mut server.api_client_ca,
        ),
    ] {
        let Some(path) = raw else { continue };
        let p = path.get_ref();
        if p.is_empty() || !p.starts_with('/') {
            cx.err(path.span(), field, "an absolute path");
        } else if let Err(m) = super::names::check_path_text(p) {
            cx.err(path.span(), field, m);
        } else {
            *out = Some(p.into());
        }
    }
    if let (Some(one), None) | (None, Some(one)) = (&s.api_cert, &s.api_key) {
        cx.err(
            one.span(),
            "server: api_cert, api_key",
            "both or neither (neither: a self-signed pair in the state directory)",
        );
    }
}

/// `[server]`'s device roots (absolute paths) and control socket group (a group name).
fn server_roots_and_group(cx: &mut Cx<'_>, s: &RawServer, server: &mut ServerConfig) {
    if let Some(roots) = &s.device_roots {
        for (i, root) in roots.get_ref().iter().enumerate() {
            let r = root.get_ref();
            let field = format!("server: device_roots[{i}]");
            if r.is_empty() || !r.starts_with('/') {
                cx.err(root.span(), field, "an absolute path");
            } else if let Err(m) = super::names::check_path_text(r) {
                cx.err(root.span(), field, m);
            } else {
                server.device_roots.push(r.into());
            }
        }
    }
    if let Some(group) = &s.control_socket_group {
        let g = group.get_ref();
        let valid = !g.is_empty()
            && g.len() <= 32
            && g.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
        if valid {
            server.control_socket_group = Some(g.clone());
        } else {
            cx.err(
                group.span(),
                "server: control_socket_group",
                "a group name (letters, digits, _ - .; at most 32)",
            );
        }
    }
}

fn resolve_algorithms(cx: &mut Cx<'_>, list: &S<Vec<S<String>>>) -> Vec<ChapAlgorithm> {
    let choices = "\"sha3-256\", \"sha256\", \"sha1\" or \"md5\"";
    let out = resolve_preferences(
        cx,
        list,
        "chap_algorithms",
        choices,
        ChapAlgorithm::from_name,
    );
    if out.is_empty() {
        return ChapAlgorithm::ALL.to_vec();
    }
    out
}

/// A `[server]` list of names in order of preference: at least one, each known, none twice.
fn resolve_preferences<T: PartialEq>(
    cx: &mut Cx<'_>,
    list: &S<Vec<S<String>>>,
    key: &str,
    choices: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> Vec<T> {
    let mut out = Vec::new();
    if list.get_ref().is_empty() {
        cx.err(
            list.span(),
            format!("server: {key}"),
            "must name at least one",
        );
    }
    for (i, name) in list.get_ref().iter().enumerate() {
        let field = format!("server: {key}[{i}]");
        match parse(name.get_ref()) {
            None => cx.err(
                name.span(),
                field,
                format!("must be {choices}, got {:?}", name.get_ref()),
            ),
            Some(a) if out.contains(&a) => cx.err(name.span(), field, "listed twice"),
            Some(a) => out.push(a),
        }
    }
    out
}

/// `dhchap_hashes` and `dhchap_groups`: what NVMe hosts may authenticate with, in order of
/// preference (the controller picks the first the host offers).
fn resolve_dhchap(cx: &mut Cx<'_>, s: &RawServer, server: &mut ServerConfig) {
    use nvme::auth::{DhGroup, HashId};
    if let Some(list) = &s.dhchap_hashes {
        let choices = "\"sha256\", \"sha384\" or \"sha512\"";
        let out = resolve_preferences(cx, list, "dhchap_hashes", choices, HashId::from_name);
        if !out.is_empty() {
            server.dhchap.hashes = out;
        }
    }
    if let Some(list) = &s.dhchap_groups {
        let choices =
            "\"ffdhe2048\", \"ffdhe3072\", \"ffdhe4096\", \"ffdhe6144\", \"ffdhe8192\" or \"null\"";
        let out = resolve_preferences(cx, list, "dhchap_groups", choices, DhGroup::from_name);
        if !out.is_empty() {
            server.dhchap.groups = out;
        }
    }
}

fn resolve_sources(cx: &mut Cx<'_>, raw: &Option<S<Vec<S<String>>>>, ctx: &str) -> Vec<SourceNet> {
    let mut out = Vec::new();
    let Some(list) = raw else {
        return out;
    };
    if list.get_ref().is_empty() {
        cx.err(
            list.span(),
            format!("{ctx}: allowed_sources"),
            "an empty list would refuse every source: remove the key to allow any",
        );
    }
    for (i, s) in list.get_ref().iter().enumerate() {
        match SourceNet::parse(s.get_ref()) {
            Ok(n) => out.push(n),
            Err(m) => cx.err(s.span(), format!("{ctx}: allowed_sources[{i}]"), m),
        }
    }
    out
}

/// Relations between limits. A dependent limit left at its default follows the one it depends
/// on; one set explicitly to a conflicting value is an error at its own line.
fn check_limit_relations(cx: &mut Cx<'_>, raw: &RawLimits, l: &mut super::Limits) {
    if l.first_burst_length > l.max_burst_length {
        match raw.span_of("first_burst_length") {
            None => l.first_burst_length = l.max_burst_length,
            Some(span) => cx.err(
                span,
                "limits: first_burst_length",
                format!(
                    "must not exceed max_burst_length ({}), got {}",
                    l.max_burst_length, l.first_burst_length
                ),
            ),
        }
    }
    if l.max_connections_per_source > l.max_connections {
        match raw.span_of("max_connections_per_source") {
            None => l.max_connections_per_source = l.max_connections,
            Some(span) => cx.err(
                span,
                "limits: max_connections_per_source",
                format!(
                    "must not exceed max_connections ({}), got {}",
                    l.max_connections, l.max_connections_per_source
                ),
            ),
        }
    }
    if l.max_discovery_sessions_per_source > l.max_discovery_sessions {
        match raw.span_of("max_discovery_sessions_per_source") {
            None => l.max_discovery_sessions_per_source = l.max_discovery_sessions,
            Some(span) => cx.err(
                span,
                "limits: max_discovery_sessions_per_source",
                format!(
                    "must not exceed max_discovery_sessions ({}), got {}",
                    l.max_discovery_sessions, l.max_discovery_sessions_per_source
                ),
            ),
        }
    }
    let need = u64::from(l.max_recv_data_segment_length) + u64::from(l.max_burst_length);
    if l.memory_per_connection_bytes < need {
        match raw.span_of("memory_per_connection_bytes") {
            None => l.memory_per_connection_bytes = need,
            Some(span) => cx.err(
                span,
                "limits: memory_per_connection_bytes",
                format!(
                    "must be at least max_recv_data_segment_length + max_burst_length ({need}), got {}",
                    l.memory_per_connection_bytes
                ),
            ),
        }
    }
    debug_assert!(LIMIT_TABLE.iter().all(|(_, d, lo, hi)| lo <= d && d <= hi));
}

const ALUA_ACTIVE_OPTIMIZED: &str = "active-optimized";
const ALUA_ACTIVE_NON_OPTIMIZED: &str = "active-non-optimized";
const ALUA_STANDBY: &str = "standby";
const ALUA_UNAVAILABLE: &str = "unavailable";

pub fn alua_state_name(state: AccessState) -> &'static str {
    match state {
        AccessState::ActiveOptimized => ALUA_ACTIVE_OPTIMIZED,
        AccessState::ActiveNonOptimized => ALUA_ACTIVE_NON_OPTIMIZED,
        AccessState::Standby => ALUA_STANDBY,
        AccessState::Unavailable => ALUA_UNAVAILABLE,
        // Never configured (a state between two others); named for completeness.
        AccessState::Transitioning => "transitioning",
    }
}

/// `shipping`: non-owner gateways ship commands to the owner (not `gateway_standby`), so
/// every gateway's portal group must be reachable by the others.
fn resolve_portal_groups(
    cx: &mut Cx<'_>,
    raw: &[S<RawPortalGroup>],
    shipping: bool,
) -> Vec<PortalGroup> {
    let mut groups = Vec::new();
    let mut tags: HashMap<u16, ()> = HashMap::new();
    let mut seen: Vec<(SocketAddr, String)> = Vec::new();
    for (i, rg) in raw.iter().enumerate() {
        let table = rg.span();
        let rg = rg.get_ref();
        let mut ctx = format!("portal_group #{}", i + 1);
        let mut tag = None;
        if let Some(t) = required(cx, &rg.tag, &table, format!("{ctx}: tag")) {
            if let Some(t) = cx.int_in(t, 1, 65_535, &format!("{ctx}: tag")) {
                let t = t as u16;
                ctx = format!("portal_group {t}");
                if tags.insert(t, ()).is_some() {
                    cx.err(
                        rg.tag.as_ref().map_or(table.clone(), |v| v.span()),
                        format!("{ctx}: tag"),
                        format!("duplicate portal group tag {t}"),
                    );
                }
                tag = Some(t);
            }
        }
        let listen = portal_listen(cx, &ctx, rg, &table, &mut seen);
        let nvme_listen = nvme_listen(cx, &ctx, rg, &mut seen);
        let nvme_discovery_listen = nvme_discovery_listen(cx, &ctx, rg, &mut seen);
        let alua_state = portal_alua_state(cx, &ctx, rg);
        let gateway = match &rg.gateway {
            None => None,
            Some(g) => match check_gateway_name(g.get_ref()) {
                Ok(()) => Some(g.get_ref().clone()),
                Err(m) => {
                    cx.err(g.span(), format!("{ctx}: gateway"), m);
                    None
                }
            },
        };
        let peer_address = peer_address(cx, &ctx, rg, gateway.is_some());
        // Other gateways ship commands here over iSCSI: they need an address to dial.
        let dialable = listen.iter().any(|a| !a.ip().is_unspecified());
        if shipping
            && gateway.is_some()
            && !listen.is_empty()
            && !dialable
            && rg.peer_address.is_none()
        {
            let span = rg.listen.as_ref().map_or(table.clone(), |l| l.span());
            cx.err(
                span,
                format!("{ctx}: listen"),
                "only wildcards, which the other gateways cannot connect to when they ship commands to this one: add peer_address = \"IP:PORT\" (an address of this gateway that reaches a listener), or a specific listen address",
            );
        }
        if let Some(tag) = tag {
            groups.push(PortalGroup {
                tag,
                listen,
                nvme_listen,
                nvme_discovery_listen,
                alua_state,
                gateway,
                peer_address,
            });
        }
    }
    let gateways: std::collections::BTreeSet<&str> =
        groups.iter().filter_map(|g| g.gateway.as_deref()).collect();
    if gateways.len() > super::GATEWAYS_MAX {
        cx.err(
            raw.first().map_or(0..0, |g| g.span()),
            "portal_group: gateway",
            format!(
                "{} gateways named; at most {} (each gives its own share of the NVMe controller IDs)",
                gateways.len(),
                super::GATEWAYS_MAX
            ),
        );
    }
    groups
}

/// A portal group's listen addresses, none of them another's (or overlapping one: a wildcard
/// and a specific address of the same family on one port).
fn portal_listen(
    cx: &mut Cx<'_>,
    ctx: &str,
    rg: &RawPortalGroup,
    table: &Range<usize>,
    seen: &mut Vec<(SocketAddr, String)>,
) -> Vec<SocketAddr> {
    let mut listen = Vec::new();
    // A port group may be NVMe/TCP only: then `listen` may be left out or empty.
    let nvme_only = rg
        .nvme_listen
        .as_ref()
        .is_some_and(|n| !n.get_ref().is_empty());
    if nvme_only && rg.listen.as_ref().is_none_or(|l| l.get_ref().is_empty()) {
        return listen;
    }
    let Some(l) = required(cx, &rg.listen, table, format!("{ctx}: listen")) else {
        return listen;
    };
    if l.get_ref().is_empty() {
        cx.err(
            l.span(),
            format!("{ctx}: listen"),
            "must name at least one address (or give nvme_listen for an NVMe/TCP-only group)",
        );
    }
    for (j, a) in l.get_ref().iter().enumerate() {
        let field = format!("{ctx}: listen[{j}]");
        let addr = match parse_listen(a.get_ref()) {
            Err(m) => {
                cx.err(a.span(), field, m);
                continue;
            }
            Ok(addr) => addr,
        };
        match seen.iter().find(|(o, _)| portals_overlap(*o, addr)) {
            Some((other, where_)) => {
                let msg = if *other == addr {
                    format!("{addr} is already listed in {where_}")
                } else {
                    format!("{addr} overlaps {other} ({where_}): a wildcard and a specific address of the same family on one port")
                };
                cx.err(a.span(), field, msg);
            }
            None => seen.push((addr, field)),
        }
        listen.push(addr);
    }
    listen
}

/// A portal group's NVMe/TCP listen addresses (optional; port 4420 by default), overlapping
/// no other listener of any kind.
fn nvme_listen(
    cx: &mut Cx<'_>,
    ctx: &str,
    rg: &RawPortalGroup,
    seen: &mut Vec<(SocketAddr, String)>,
) -> Vec<SocketAddr> {
    let Some(l) = &rg.nvme_listen else {
        return Vec::new();
    };
    let field = format!("{ctx}: nvme_listen");
    listeners(cx, &field, l, seen, super::names::parse_nvme_listen)
}

/// A portal group's NVMe/TCP discovery listen addresses, if given (port 8009 by default),
/// overlapping no other listener of any kind.
fn nvme_discovery_listen(
    cx: &mut Cx<'_>,
    ctx: &str,
    rg: &RawPortalGroup,
    seen: &mut Vec<(SocketAddr, String)>,
) -> Option<Vec<SocketAddr>> {
    let l = rg.nvme_discovery_listen.as_ref()?;
    let field = format!("{ctx}: nvme_discovery_listen");
    Some(listeners(
        cx,
        &field,
        l,
        seen,
        super::names::parse_nvme_discovery_listen,
    ))
}

/// A list of listen addresses, each parsed by `parse` and none overlapping one already `seen`.
fn listeners(
    cx: &mut Cx<'_>,
    field: &str,
    list: &S<Vec<S<String>>>,
    seen: &mut Vec<(SocketAddr, String)>,
    parse: fn(&str) -> Result<SocketAddr, super::Invalid>,
) -> Vec<SocketAddr> {
    let mut listen = Vec::new();
    for (j, a) in list.get_ref().iter().enumerate() {
        let field = format!("{field}[{j}]");
        let addr = match parse(a.get_ref()) {
            Err(m) => {
                cx.err(a.span(), field, m);
                continue;
            }
            Ok(addr) => addr,
        };
        match seen.iter().find(|(o, _)| portals_overlap(*o, addr)) {
            Some((other, where_)) => {
                cx.err(
                    a.span(),
                    field,
                    format!("{addr} overlaps {other} ({where_})"),
                );
            }
            None => seen.push((addr, field)),
        }
        listen.push(addr);
    }
    listen
}

/// An `alua_state` that is none of the four an operator can give.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownAluaState(pub String);

impl std::fmt::Display for UnknownAluaState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "unknown state {:?}: expected \"{ALUA_ACTIVE_OPTIMIZED}\", \"{ALUA_ACTIVE_NON_OPTIMIZED}\", \"{ALUA_STANDBY}\" or \"{ALUA_UNAVAILABLE}\"",
            self.0
        )
    }
}

impl std::error::Error for UnknownAluaState {}

/// The ALUA state an operator can give a portal group (`alua_state`, `ctl portal-group alua`).
pub fn configured_alua_state(name: &str) -> Result<AccessState, UnknownAluaState> {
    match name {
        ALUA_ACTIVE_OPTIMIZED => Ok(AccessState::ActiveOptimized),
        ALUA_ACTIVE_NON_OPTIMIZED => Ok(AccessState::ActiveNonOptimized),
        ALUA_STANDBY => Ok(AccessState::Standby),
        ALUA_UNAVAILABLE => Ok(AccessState::Unavailable),
        other => Err(UnknownAluaState(other.to_string())),
    }
}

fn portal_alua_state(cx: &mut Cx<'_>, ctx: &str, rg: &RawPortalGroup) -> AccessState {
    let Some(v) = &rg.alua_state else {
        return AccessState::ActiveOptimized;
    };
    configured_alua_state(v.get_ref()).unwrap_or_else(|unknown| {
        cx.err(v.span(), format!("{ctx}: alua_state"), unknown.to_string());
        AccessState::ActiveOptimized
    })
}

/// The address other gateways ship to this portal group's gateway at: specific (not a
/// wildcard), and only for a group that names its gateway.
fn peer_address(
    cx: &mut Cx<'_>,
    ctx: &str,
    rg: &RawPortalGroup,
    names_gateway: bool,
) -> Option<SocketAddr> {
    let a = rg.peer_address.as_ref()?;
    let field = format!("{ctx}: peer_address");
    match parse_listen(a.get_ref()) {
        Err(m) => cx.err(a.span(), field, m),
        Ok(addr) if addr.ip().is_unspecified() => cx.err(
            a.span(),
            field,
            format!("{addr}: an address the other gateways can connect to, not a wildcard"),
        ),
        Ok(_) if !names_gateway => cx.err(
            a.span(),
            field,
            "only for a portal group that names its gateway (where other gateways ship commands)",
        ),
        Ok(addr) => return Some(addr),
    }
    None
}

/// A gateway's name: what `[server] gateway` and a portal group's `gateway` say.
fn check_gateway_name(name: &str) -> Result<(), Invalid> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
    if valid {
        Ok(())
    } else {
        Err(Invalid(format!(
            "{name:?}: a gateway name (letters, digits, _ - .; at most 64)"
        )))
    }
}

fn resolve_targets(
    cx: &mut Cx<'_>,
    raw: &[S<RawTarget>],
    portal_groups: &[PortalGroup],
    devices: &[std::sync::Arc<DeviceConfig>],
    book: &mut SecretBook,
) -> Vec<TargetConfig> {
    let mut targets = Vec::new();
    let mut iqns: HashSet<NodeName> = HashSet::new();
    let devices = DeviceIndex::new(devices);
    for (i, rt) in raw.iter().enumerate() {
        let table = rt.span();
        let rt = rt.get_ref();
        let mut ctx = format!("target #{}", i + 1);
        let mut iqn = None;
        if let Some(n) = required(cx, &rt.iqn, &table, format!("{ctx}: iqn")) {
            ctx = format!("target {:?}", n.get_ref());
            match check_iscsi_name(n.get_ref()) {
                Err(m) => cx.err(n.span(), format!("{ctx}: iqn"), m),
                Ok(name) if name.is_nqn() => cx.err(
                    n.span(),
                    format!("{ctx}: iqn"),
                    "an NVMe name: give the target an iSCSI name here and the NQN as `nqn`",
                ),
                Ok(name) if !iqns.insert(name.clone()) => {
                    cx.err(n.span(), format!("{ctx}: iqn"), "duplicate target name")
                }
                Ok(name) => iqn = Some(name),
            }
        }
        let here = rt.iqn.as_ref().map_or(table.clone(), |n| n.span());
        let nqn = target_nqn(cx, &ctx, rt, &mut iqns);
        let alias = rt.alias.as_ref().map(|a| {
            let s = a.get_ref();
            if s.is_empty() || s.len() > ALIAS_BYTES_MAX || s.chars().any(char::is_control) {
                cx.err(
                    a.span(),
                    format!("{ctx}: alias"),
                    format!("must be 1 to {ALIAS_BYTES_MAX} bytes without control characters"),
                );
            }
            s.clone()
        });
        let pgs = target_portal_groups(cx, &ctx, rt, &here, portal_groups);
        if rt.group.is_empty() {
            cx.err(
                here.clone(),
                format!("{ctx}: group"),
                "no [[target.group]]: no initiator could log in",
            );
        }
        let view = RawAuth {
            auth: &rt.auth,
            users: &rt.users,
            mutual: &rt.mutual,
        };
        let auth = resolve_auth(cx, &view, &ctx, &here, false, book);
        let allowed_sources = resolve_sources(cx, &rt.allowed_sources, &ctx);
        let groups = resolve_groups(cx, &ctx, &rt.group, &devices, !auth.users.is_empty(), book);
        let credentials = resolve_credentials(cx, &ctx, &rt.credentials, book);
        let tls_keys = super::auth::resolve_tls_keys(cx, &rt.tls_keys, &ctx);
        if !tls_keys.is_empty() && nqn.is_none() {
            cx.err(
                here.clone(),
                format!("{ctx}: tls_keys"),
                "TLS keys are for NVMe/TCP hosts: give the target an `nqn`",
            );
        }
        // A target without a valid name has had its error reported; nothing runs it.
        let Some(iqn) = iqn else {
            continue;
        };
        targets.push(TargetConfig {
            iqn,
            nqn,
            alias,
            portal_groups: pgs,
            groups,
            auth,
            allowed_sources,
            credentials,
            tls_keys,
        });
    }
    targets
}

/// A target's NVMe subsystem name: an `nqn.` name, unique among every target's names, not the
/// discovery subsystem's.
fn target_nqn(
    cx: &mut Cx<'_>,
    ctx: &str,
    rt: &RawTarget,
    names: &mut HashSet<NodeName>,
) -> Option<NodeName> {
    let n = rt.nqn.as_ref()?;
    let field = format!("{ctx}: nqn");
    match check_iscsi_name(n.get_ref()) {
        Err(m) => cx.err(n.span(), field, m),
        Ok(name) if !name.is_nqn() => {
            cx.err(n.span(), field, "an NVMe subsystem name starts with `nqn.`")
        }
        Ok(name) if name.as_str() == nvme::fabrics::DISCOVERY_NQN => cx.err(
            n.span(),
            field,
            "the discovery subsystem's name: choose one of your own",
        ),
        Ok(name) if !names.insert(name.clone()) => cx.err(n.span(), field, "duplicate target name"),
        Ok(name) => return Some(name),
    }
    None
}

/// The portal groups a target is served on: the tags it lists, or every portal group.
fn target_portal_groups(
    cx: &mut Cx<'_>,
    ctx: &str,
    rt: &RawTarget,
    here: &Range<usize>,
    portal_groups: &[PortalGroup],
) -> Vec<u16> {
    match &rt.portal_groups {
        None => {
            if portal_groups.is_empty() {
                cx.err(
                    here.clone(),
                    format!("{ctx}: portal_groups"),
                    "no portals: define a [[portal_group]] to listen on",
                );
            }
            portal_groups.iter().map(|p| p.tag).collect()
        }
        Some(list) => {
            if list.get_ref().is_empty() {
                cx.err(
                    list.span(),
                    format!("{ctx}: portal_groups"),
                    "no portals: must name at least one portal group tag",
                );
            }
            let mut tags = Vec::new();
            for (j, t) in list.get_ref().iter().enumerate() {
                let field = format!("{ctx}: portal_groups[{j}]");
                let x = *t.get_ref();
                match portal_groups.iter().find(|p| i64::from(p.tag) == x) {
                    None => cx.err(t.span(), field, format!("no [[portal_group]] has tag {x}")),
                    Some(p) if tags.contains(&p.tag) => {
                        cx.err(t.span(), field, format!("tag {x} is listed twice"))
                    }
                    Some(p) => tags.push(p.tag),
                }
            }
            tags
        }
    }
}

/// The devices by name, for the LUN maps that name them (the first of a name, as a search
/// from the start would find it).
struct DeviceIndex<'d> {
    by_name: HashMap<&'d str, &'d DeviceConfig>,
}

impl<'d> DeviceIndex<'d> {
    fn new(devices: &'d [std::sync::Arc<DeviceConfig>]) -> Self {
        let mut by_name = HashMap::with_capacity(devices.len());
        for d in devices {
            by_name.entry(d.name.as_str()).or_insert(&**d);
        }
        DeviceIndex { by_name }
    }

    fn get(&self, name: &str) -> Option<&'d DeviceConfig> {
        self.by_name.get(name).copied()
    }
}

/// The LUN map of one group as it is resolved, with what must be unique in it.
#[derive(Default)]
struct GroupLuns {
    luns: Vec<LunMapping>,
    numbers: HashSet<u64>,
    /// Each device mapped and its first LUN.
    devices: HashMap<String, u64>,
}

impl GroupLuns {
    fn push(&mut self, mapping: LunMapping) {
        self.numbers.insert(mapping.lun);
        self.devices
            .entry(mapping.device.clone())
            .or_insert(mapping.lun);
        self.luns.push(mapping);
    }
}

fn resolve_groups(
    cx: &mut Cx<'_>,
    target_ctx: &str,
    raw: &[S<RawGroup>],
    devices: &DeviceIndex<'_>,
    target_has_users: bool,
    book: &mut SecretBook,
) -> Vec<InitiatorGroup> {
    let mut groups = Vec::new();
    let mut group_names: HashSet<String> = HashSet::new();
    let mut initiators_seen: HashMap<NodeName, String> = HashMap::new();
    let mut any_group: Option<String> = None;
    for (i, rg) in raw.iter().enumerate() {
        let table = rg.span();
        let rg = rg.get_ref();
        let mut ctx = format!("{target_ctx}: group #{}", i + 1);
        let mut name = String::new();
        if let Some(n) = required(cx, &rg.name, &table, format!("{ctx}: name")) {
            name = n.get_ref().clone();
            ctx = format!("{target_ctx}: group {name:?}");
            if let Err(m) = check_object_name(&name) {
                cx.err(n.span(), format!("{ctx}: name"), m);
            } else if !group_names.insert(name.clone()) {
                cx.err(
                    n.span(),
                    format!("{ctx}: name"),
                    "duplicate group name in this target",
                );
            }
        }
        let here = rg.name.as_ref().map_or(table.clone(), |n| n.span());
        let any_initiator = bool_or(&rg.any_initiator, false);
        let initiators = group_initiators(cx, &ctx, rg, &name, &mut initiators_seen);
        check_any_initiator(cx, &ctx, rg, &here, &name, &mut any_group);
        let mut luns = GroupLuns::default();
        if let Some(list) = &rg.luns {
            for (j, rl) in list.get_ref().iter().enumerate() {
                // Named only in an error: most maps have none, and thousands of entries.
                let lctx = || format!("{ctx}: luns[{j}]");
                if let Some(mapping) = lun_mapping(cx, &lctx, rl, devices, &luns) {
                    luns.push(mapping);
                }
            }
        }
        let luns = luns.luns;
        let view = RawAuth {
            auth: &rg.auth,
            users: &rg.users,
            mutual: &rg.mutual,
        };
        let auth = resolve_auth(cx, &view, &ctx, &here, target_has_users, book);
        let allowed_sources = resolve_sources(cx, &rg.allowed_sources, &ctx);
        groups.push(InitiatorGroup {
            name,
            initiators,
            any_initiator,
            luns,
            auth,
            allowed_sources,
        });
    }
    groups
}

/// A group's listed initiators, each in no other group of the target.
fn group_initiators(
    cx: &mut Cx<'_>,
    ctx: &str,
    rg: &RawGroup,
    name: &str,
    seen: &mut HashMap<NodeName, String>,
) -> Vec<NodeName> {
    let mut initiators = Vec::new();
    let Some(list) = &rg.initiators else {
        return initiators;
    };
    for (j, ini) in list.get_ref().iter().enumerate() {
        let field = format!("{ctx}: initiators[{j}]");
        let name_here = match check_iscsi_name(ini.get_ref()) {
            Ok(n) => n,
            Err(m) => {
                cx.err(ini.span(), field, m);
                continue;
            }
        };
        if let Some(other) = seen.get(&name_here) {
            let why = format!("{name_here} is already listed in {other}");
            cx.err(ini.span(), field, why);
            continue;
        }
        seen.insert(name_here.clone(), format!("group {name:?}"));
        initiators.push(name_here);
    }
    initiators
}

/// A group lists initiators or takes any initiator, not both, and one group of a target at
/// most takes any initiator.
fn check_any_initiator(
    cx: &mut Cx<'_>,
    ctx: &str,
    rg: &RawGroup,
    here: &Range<usize>,
    name: &str,
    any_group: &mut Option<String>,
) {
    let any_initiator = bool_or(&rg.any_initiator, false);
    let listed = rg
        .initiators
        .as_ref()
        .is_some_and(|l| !l.get_ref().is_empty());
    match (&rg.any_initiator, any_initiator, listed) {
        (_, false, false) => cx.err(
            here.clone(),
            format!("{ctx}: initiators"),
            "no initiators: list some, or set `any_initiator = true` to admit every initiator not in another group",
        ),
        (Some(a), true, true) => cx.err(
            a.span(),
            format!("{ctx}: any_initiator"),
            "a group is either for listed initiators or for any initiator, not both",
        ),
        (Some(a), true, _) => match any_group {
            Some(other) => {
                let why = format!("group {other:?} of this target already has any_initiator = true");
                cx.err(a.span(), format!("{ctx}: any_initiator"), why);
            }
            None => *any_group = Some(name.to_string()),
        },
        _ => {}
    }
}

/// One `luns` entry of a group: a LUN number not mapped before in the group, of a device that
/// exists and is not mapped before in the group. None after an error.
fn lun_mapping(
    cx: &mut Cx<'_>,
    lctx: &dyn Fn() -> String,
    raw: &S<RawLun>,
    devices: &DeviceIndex<'_>,
    luns: &GroupLuns,
) -> Option<LunMapping> {
    let (lspan, rl) = (raw.span(), raw.get_ref());
    let lun = required_with(cx, &rl.lun, &lspan, || format!("{}.lun", lctx())).and_then(|l| {
        let in_range = (0..=LUN_MAX as i64).contains(l.get_ref());
        let lun = match in_range {
            true => Some(*l.get_ref()),
            false => cx.int_in(l, 0, LUN_MAX as i64, &format!("{}.lun", lctx())),
        };
        lun.map(|x| (x as u64, l.span()))
    });
    if let Some((n, span)) = &lun {
        if luns.numbers.contains(n) {
            let why = format!("LUN {n} is mapped twice in this group");
            cx.err(span.clone(), format!("{}.lun", lctx()), why);
        }
    }
    let d = required_with(cx, &rl.device, &lspan, || format!("{}.device", lctx()));
    let device = d.and_then(|d| {
        let Some(dev) = devices.get(d.get_ref()) else {
            let why = format!("no [[device]] is named {:?}", d.get_ref());
            cx.err(d.span(), format!("{}.device", lctx()), why);
            return None;
        };
        if let Some(lun) = luns.devices.get(&dev.name) {
            let why = format!(
                "{:?} is already mapped as LUN {lun} in this group",
                dev.name
            );
            cx.err(d.span(), format!("{}.device", lctx()), why);
        }
        Some(dev)
    });
    let ((lun, _), dev) = (lun?, device?);
    Some(LunMapping {
        lun,
        device: dev.name.clone(),
        read_only: bool_or(&rl.read_only, false),
    })
}

fn resolve_credentials(
    cx: &mut Cx<'_>,
    target_ctx: &str,
    raw: &[S<RawCredentials>],
    book: &mut SecretBook,
) -> Vec<InitiatorCredentials> {
    let mut out: Vec<InitiatorCredentials> = Vec::new();
    for (i, rc) in raw.iter().enumerate() {
        let table = rc.span();
        let rc = rc.get_ref();
        let mut ctx = format!("{target_ctx}: credentials #{}", i + 1);
        let mut initiator = None;
        if let Some(n) = required(cx, &rc.initiator, &table, format!("{ctx}: initiator")) {
            ctx = format!("{target_ctx}: credentials {:?}", n.get_ref());
            match check_iscsi_name(n.get_ref()) {
                Err(m) => cx.err(n.span(), format!("{ctx}: initiator"), m),
                Ok(name) if out.iter().any(|c| c.initiator == name) => cx.err(
                    n.span(),
                    format!("{ctx}: initiator"),
                    "this initiator already has credentials in this target",
                ),
                Ok(name) => initiator = Some(name),
            }
        }
        let users = resolve_users(cx, &rc.users, &ctx, book);
        if rc.users.as_ref().is_none_or(|u| u.get_ref().is_empty()) {
            cx.err(
                table.clone(),
                format!("{ctx}: users"),
                "missing (required): the CHAP users of this initiator",
            );
        }
        let mutual = resolve_mutual(cx, &rc.mutual, &ctx, book);
        if let Some(initiator) = initiator {
            out.push(InitiatorCredentials {
                initiator,
                users,
                mutual,
            });
        }
    }
    out
}

/// TOML text of a string (quoted, escaped).
fn q(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

pub(crate) fn to_toml(c: &Config, reveal: bool) -> String {
    let mut out = String::new();
    server_toml(&mut out, &c.server);
    out.push('\n');
    c.limits.write_toml(&mut out);
    if c.discovery != DiscoveryConfig::default() {
        let _ = write!(
            out,
            "\n[discovery]\n{}",
            auth_toml(&c.discovery.auth, "", reveal)
        );
    }
    for pg in &c.portal_groups {
        portal_group_toml(&mut out, pg);
    }
    for p in &c.pools {
        let _ = write!(out, "\n[[pool]]\nname = {}\n", q(&p.name));
        match &p.kind {
            super::PoolKind::Dir { path } => {
                let _ = writeln!(out, "path = {}", q(&path.to_string_lossy()));
            }
            super::PoolKind::Rbd { pool, conf, client } => {
                let _ = writeln!(out, "kind = \"rbd\"\npool = {}", q(pool));
                if let Some(conf) = conf {
                    let _ = writeln!(out, "ceph_conf = {}", q(&conf.to_string_lossy()));
                }
                if let Some(client) = client {
                    let _ = writeln!(out, "ceph_client = {}", q(client));
                }
            }
            super::PoolKind::Lvm(thin) => {
                let _ = writeln!(
                    out,
                    "kind = \"lvm\"\nvg = {}\nthin_pool = {}",
                    q(&thin.vg),
                    q(&thin.pool)
                );
            }
        }
    }
    for d in &c.devices {
        device_toml(&mut out, d);
    }
    for t in &c.targets {
        target_toml(&mut out, t, reveal);
    }
    out
}

fn server_toml(out: &mut String, server: &ServerConfig) {
    let algs: Vec<String> = server.chap_algorithms.iter().map(|a| q(a.name())).collect();
    let _ = writeln!(
        out,
        "[server]\nworkers = {}\nchap_algorithms = [{}]",
        server.workers,
        algs.join(", ")
    );
    if server.dhchap != nvme::auth::controller::Policy::default() {
        let hashes: Vec<String> = server.dhchap.hashes.iter().map(|h| q(h.name())).collect();
        let groups: Vec<String> = server.dhchap.groups.iter().map(|g| q(g.name())).collect();
        let _ = writeln!(
            out,
            "dhchap_hashes = [{}]\ndhchap_groups = [{}]",
            hashes.join(", "),
            groups.join(", ")
        );
    }
    if let Some(m) = server.metrics_listen {
        let _ = writeln!(out, "metrics_listen = {}", q(&m.to_string()));
    }
    if !server.io_uring {
        let _ = writeln!(out, "io_uring = false");
    }
    if let Some(dir) = &server.state_dir {
        let _ = writeln!(out, "state_dir = {}", q(&dir.display().to_string()));
    }
    if let Some(path) = &server.control_socket {
        let _ = writeln!(out, "control_socket = {}", q(&path.display().to_string()));
    }
    if let Some(gateway) = &server.gateway {
        let _ = writeln!(out, "gateway = {}", q(gateway));
    }
    if server.gateway_standby {
        let _ = writeln!(out, "gateway_standby = true");
    }
    if server.gateway_alua_explicit {
        let _ = writeln!(out, "gateway_alua = \"explicit\"");
    }
    if let Some(group) = &server.control_socket_group {
        let _ = writeln!(out, "control_socket_group = {}", q(group));
    }
    if let Some(addr) = server.api_listen {
        let _ = writeln!(out, "api_listen = {}", q(&addr.to_string()));
    }
    for (key, path) in [
        ("api_cert", &server.api_cert),
        ("api_key", &server.api_key),
        ("api_client_ca", &server.api_client_ca),
    ] {
        if let Some(path) = path {
            let _ = writeln!(out, "{key} = {}", q(&path.display().to_string()));
        }
    }
    if !server.device_roots.is_empty() {
        let roots: Vec<String> = server
            .device_roots
            .iter()
            .map(|r| q(&r.to_string_lossy()))
            .collect();
        let _ = writeln!(out, "device_roots = [{}]", roots.join(", "));
    }
}

fn portal_group_toml(out: &mut String, pg: &PortalGroup) {
    let listen: Vec<String> = pg.listen.iter().map(|a| q(&a.to_string())).collect();
    let _ = writeln!(
        out,
        "\n[[portal_group]]\ntag = {}\nlisten = [{}]\nalua_state = \"{}\"",
        pg.tag,
        listen.join(", "),
        alua_state_name(pg.alua_state)
    );
    if !pg.nvme_listen.is_empty() {
        let nvme: Vec<String> = pg.nvme_listen.iter().map(|a| q(&a.to_string())).collect();
        let _ = writeln!(out, "nvme_listen = [{}]", nvme.join(", "));
    }
    if let Some(list) = &pg.nvme_discovery_listen {
        let d: Vec<String> = list.iter().map(|a| q(&a.to_string())).collect();
        let _ = writeln!(out, "nvme_discovery_listen = [{}]", d.join(", "));
    }
    if let Some(gateway) = &pg.gateway {
        let _ = writeln!(out, "gateway = {}", q(gateway));
    }
    if let Some(peer) = &pg.peer_address {
        let _ = writeln!(out, "peer_address = {}", q(&peer.to_string()));
    }
}

/// A size as the config writes it: `"1G"` where a unit holds it whole, else the bytes.
fn size_toml(bytes: u64) -> String {
    let text = super::names::size_text(bytes);
    if text.bytes().all(|b| b.is_ascii_digit()) {
        text
    } else {
        format!("\"{text}\"")
    }
}

fn device_toml(out: &mut String, d: &DeviceConfig) {
    let _ = writeln!(out, "\n[[device]]\nname = {}", q(&d.name));
    match &d.store {
        StoreKind::Ram { size_bytes } => {
            let _ = writeln!(out, "store = \"ram\"\nsize = {}", size_toml(*size_bytes));
        }
        StoreKind::File { path, size_bytes } => {
            let _ = writeln!(
                out,
                "store = \"file\"\npath = {}",
                q(&path.to_string_lossy())
            );
            if let Some(n) = size_bytes {
                let _ = writeln!(out, "size = {}", size_toml(*n));
            }
        }
        StoreKind::Block { path } => {
            let _ = writeln!(
                out,
                "store = \"block\"\npath = {}",
                q(&path.to_string_lossy())
            );
        }
        StoreKind::Rbd(spec) => {
            let _ = writeln!(
                out,
                "store = \"rbd\"\nimage = {}",
                q(&format!("{}/{}", spec.pool, spec.image))
            );
            if let Some(conf) = &spec.conf {
                let _ = writeln!(out, "ceph_conf = {}", q(&conf.to_string_lossy()));
            }
            if let Some(client) = &spec.client {
                let _ = writeln!(out, "ceph_client = {}", q(client));
            }
        }
    }
    let naa: String = d.naa.iter().map(|b| format!("{b:02x}")).collect();
    let _ = writeln!(
        out,
        "block_size = {}\nserial = {}\nnaa = \"0x{naa}\"\nread_only = {}\nwrite_cache = {}\nthin = {}",
        d.block_size,
        q(&d.serial),
        d.read_only,
        d.write_cache,
        d.thin
    );
    if matches!(d.store, StoreKind::File { .. } | StoreKind::Block { .. }) {
        let _ = writeln!(out, "cache = \"{}\"", d.cache.name());
    }
    if let Some(vendor) = &d.vendor {
        let _ = writeln!(out, "vendor = {}", q(vendor));
    }
    if let Some(product) = &d.product {
        let _ = writeln!(out, "product = {}", q(product));
    }
    if d.offline {
        out.push_str("offline = true\n");
    }
    if let Some(clone_of) = &d.lineage.clone_of {
        let _ = writeln!(out, "clone_of = {}", q(clone_of));
    }
    if let Some(created) = &d.lineage.created {
        let _ = writeln!(out, "created = {}", q(created));
    }
}

fn target_toml(out: &mut String, t: &TargetConfig, reveal: bool) {
    let _ = writeln!(out, "\n[[target]]\niqn = {}", q(t.iqn.as_str()));
    if let Some(nqn) = &t.nqn {
        let _ = writeln!(out, "nqn = {}", q(nqn.as_str()));
    }
    if let Some(a) = &t.alias {
        let _ = writeln!(out, "alias = {}", q(a));
    }
    let pgs: Vec<String> = t.portal_groups.iter().map(u16::to_string).collect();
    let _ = writeln!(out, "portal_groups = [{}]", pgs.join(", "));
    out.push_str(&auth_toml(&t.auth, "", reveal));
    out.push_str(&sources_toml(&t.allowed_sources, ""));
    if !t.tls_keys.is_empty() {
        let keys: Vec<String> = t
            .tls_keys
            .iter()
            .map(|k| {
                format!(
                    "    {{ host = {}, key_file = {}, derivation = {} }},\n",
                    q(k.host.as_str()),
                    q(&k.key_file),
                    q(k.derivation.name())
                )
            })
            .collect();
        let _ = writeln!(out, "tls_keys = [\n{}]", keys.concat());
    }
    for g in &t.groups {
        let inis: Vec<String> = g.initiators.iter().map(|s| q(s.as_str())).collect();
        let _ = writeln!(out, "\n  [[target.group]]\n  name = {}", q(&g.name));
        if !inis.is_empty() {
            let _ = writeln!(out, "  initiators = [{}]", inis.join(", "));
        }
        let _ = writeln!(out, "  any_initiator = {}", g.any_initiator);
        let luns: Vec<String> = g
            .luns
            .iter()
            .map(|l| {
                format!(
                    "    {{ lun = {}, device = {}, read_only = {} }},\n",
                    l.lun,
                    q(&l.device),
                    l.read_only
                )
            })
            .collect();
        let _ = writeln!(out, "  luns = [\n{}  ]", luns.concat());
        out.push_str(&auth_toml(&g.auth, "  ", reveal));
        out.push_str(&sources_toml(&g.allowed_sources, "  "));
    }
    for cr in &t.credentials {
        let users: Vec<String> = cr.users.iter().map(|u| user_toml(u, reveal)).collect();
        let _ = writeln!(
            out,
            "\n  [[target.credentials]]\n  initiator = {}\n  users = [{}]",
            q(cr.initiator.as_str()),
            users.join(", ")
        );
        if let Some(m) = &cr.mutual {
            let _ = writeln!(out, "  mutual = {}", user_toml(m, reveal));
        }
    }
}

fn sources_toml(nets: &[SourceNet], indent: &str) -> String {
    if nets.is_empty() {
        return String::new();
    }
    let list: Vec<String> = nets.iter().map(|n| q(&n.to_string())).collect();
    format!("{indent}allowed_sources = [{}]\n", list.join(", "))
}
