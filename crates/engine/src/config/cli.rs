//! Quick exports: `serve --listen ADDR --target IQN --lun SPEC...` and the demo.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use super::names::{
    check_iscsi_name, derive_identity, parse_listen, parse_nvme_listen, parse_size,
    portals_overlap, ISCSI_PORT_DEFAULT, NVME_PORT_DEFAULT,
};
use super::Invalid;
use super::{
    CacheMode, Config, ConfigError, DeviceConfig, InitiatorGroup, Limits, LunMapping, NodeName,
    PortalGroup, ServerConfig, StoreKind, TargetConfig, COMMAND_LINE, DEMO_TARGET_IQN,
};

/// The size of the demo's RAM LUN and of a quick export that names no LUN: 1 GiB.
pub(crate) const DEMO_RAM_BYTES: u64 = 1 << 30;

fn cli_error(field: String, message: impl Into<String>) -> ConfigError {
    ConfigError {
        file: COMMAND_LINE.to_string(),
        line: 0,
        column: 0,
        field,
        message: message.into(),
    }
}

/// One parsed `--lun` argument.
struct LunSpec {
    store: StoreKind,
    block_size: u32,
    read_only: bool,
    /// `,write_cache`: WCE=1 at start (write-back).
    write_cache: bool,
    cache: CacheMode,
}

pub(crate) fn demo() -> Config {
    let lun = LunSpec {
        store: StoreKind::Ram {
            size_bytes: DEMO_RAM_BYTES,
        },
        block_size: 512,
        read_only: false,
        write_cache: false,
        cache: CacheMode::Auto,
    };
    let listen = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), ISCSI_PORT_DEFAULT);
    // The demo's name is a constant in normal form (a unit test checks it).
    let iqn = NodeName::from_config(DEMO_TARGET_IQN).unwrap_or_else(|e| unreachable!("{e}"));
    // Both doors: the same RAM disk is an NVMe/TCP namespace on 4420.
    let nvme = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), NVME_PORT_DEFAULT);
    quick_export(vec![listen], vec![nvme], iqn, vec![lun])
}

/// The NVMe subsystem name of a quick export's target: its IQN as an NQN (`iqn.` becomes
/// `nqn.`), or under ferrosan's own naming authority for an `eui.`/`naa.` target.
pub(crate) fn nqn_of(iqn: &NodeName) -> NodeName {
    let text = match iqn.as_str().strip_prefix("iqn.") {
        Some(rest) => format!("nqn.{rest}"),
        None => format!("nqn.2026-11.org.ferrosan:{}", iqn.as_str()),
    };
    NodeName::from_wire(&text).unwrap_or_else(|_| iqn.clone())
}

pub(crate) fn from_cli(
    listen: &[String],
    nvme_listen: &[String],
    target: &str,
    luns: &[String],
) -> Result<Config, ConfigError> {
    let mut addrs: Vec<SocketAddr> = Vec::new();
    let mut nvme: Vec<SocketAddr> = Vec::new();
    for a in nvme_listen {
        let field = format!("--nvme-listen {a}");
        let addr = parse_nvme_listen(a).map_err(|m| cli_error(field.clone(), m))?;
        if let Some(other) = nvme.iter().find(|o| portals_overlap(**o, addr)) {
            return Err(cli_error(field, format!("overlaps --nvme-listen {other}")));
        }
        nvme.push(addr);
    }
    for a in listen {
        let field = format!("--listen {a}");
        let addr = parse_listen(a).map_err(|m| cli_error(field.clone(), m))?;
        if let Some(other) = addrs.iter().find(|o| portals_overlap(**o, addr)) {
            return Err(cli_error(field, format!("overlaps --listen {other}")));
        }
        if let Some(other) = nvme.iter().find(|o| portals_overlap(**o, addr)) {
            return Err(cli_error(field, format!("overlaps --nvme-listen {other}")));
        }
        addrs.push(addr);
    }
    if addrs.is_empty() {
        // No address at all: the demo's two doors.
        if nvme.is_empty() {
            nvme.push(SocketAddr::new(
                Ipv4Addr::LOCALHOST.into(),
                NVME_PORT_DEFAULT,
            ));
        }
        addrs.push(SocketAddr::new(
            Ipv4Addr::LOCALHOST.into(),
            ISCSI_PORT_DEFAULT,
        ));
    }
    let target = if target.is_empty() {
        DEMO_TARGET_IQN
    } else {
        target
    };
    let target =
        check_iscsi_name(target).map_err(|m| cli_error(format!("--target {target}"), m))?;
    let mut specs = Vec::new();
    for spec in luns {
        specs.push(parse_lun_spec(spec).map_err(|m| cli_error(format!("--lun {spec}"), m))?);
    }
    if specs.is_empty() {
        specs.push(LunSpec {
            store: StoreKind::Ram {
                size_bytes: DEMO_RAM_BYTES,
            },
            block_size: 512,
            read_only: false,
            write_cache: false,
            cache: CacheMode::Auto,
        });
    }
    for (i, a) in specs.iter().enumerate() {
        let path = |s: &StoreKind| match s {
            StoreKind::File { path, .. } | StoreKind::Block { path } => Some(path.clone()),
            StoreKind::Rbd(spec) => {
                Some(PathBuf::from(format!("rbd:{}/{}", spec.pool, spec.image)))
            }
            StoreKind::Ram { .. } => None,
        };
        if let Some(p) = path(&a.store) {
            if specs[..i]
                .iter()
                .any(|b| path(&b.store).as_ref() == Some(&p))
            {
                return Err(cli_error(
                    format!("--lun {}", luns[i]),
                    format!("{} is exported twice", p.display()),
                ));
            }
        }
    }
    Ok(quick_export(addrs, nvme, target, specs))
}

/// `ram:SIZE` | `file:PATH[,size=SIZE]` | `block:PATH` | `rbd:POOL/IMAGE[,conf=PATH]
/// [,client=NAME]`, each with optional `,block_size=512|4096`, `,cache=auto|direct|page` and
/// `,ro` at the end.
fn parse_lun_spec(spec: &str) -> Result<LunSpec, Invalid> {
    let (kind, rest) = spec
        .split_once(':')
        .ok_or("expected ram:SIZE, file:PATH[,size=SIZE], block:PATH or rbd:POOL/IMAGE")?;
    let (rest, options) = lun_options(kind, rest)?;
    let (store, size) = lun_store(kind, rest, &options)?;
    if let Some(n) = size {
        if n == 0 {
            return Err(Invalid("size must not be 0".into()));
        }
        if n % u64::from(options.block_size) != 0 {
            return Err(Invalid(format!(
                "size {n} is not a multiple of block_size {}",
                options.block_size
            )));
        }
    }
    Ok(LunSpec {
        store,
        block_size: options.block_size,
        read_only: options.read_only,
        write_cache: options.write_cache,
        cache: options.cache,
    })
}

/// The `,OPTION`s of a `--lun` spec.
struct LunOptions {
    ceph_conf: Option<PathBuf>,
    ceph_client: Option<String>,
    size: Option<u64>,
    block_size: u32,
    read_only: bool,
    write_cache: bool,
    cache: CacheMode,
}

/// Peels the known options off the end of a spec's `rest` (so that a path may contain
/// commas); returns what is left and the options.
fn lun_options<'s>(kind: &str, mut rest: &'s str) -> Result<(&'s str, LunOptions), Invalid> {
    let mut o = LunOptions {
        ceph_conf: None,
        ceph_client: None,
        size: None,
        block_size: 512,
        read_only: false,
        write_cache: false,
        cache: CacheMode::Auto,
    };
    while let Some((head, opt)) = rest.rsplit_once(',') {
        if opt == "ro" {
            o.read_only = true;
        } else if opt == "write_cache" {
            o.write_cache = true;
        } else if let Some(v) = opt.strip_prefix("cache=") {
            o.cache = CacheMode::parse(v)
                .ok_or_else(|| format!("cache must be auto, direct or page, got {v}"))?;
        } else if let Some(v) = opt.strip_prefix("conf=").filter(|_| kind == "rbd") {
            super::names::check_path_text(v)?;
            o.ceph_conf = Some(PathBuf::from(v));
        } else if let Some(v) = opt.strip_prefix("client=").filter(|_| kind == "rbd") {
            o.ceph_client = Some(v.to_string());
        } else if let Some(v) = opt.strip_prefix("size=") {
            o.size = Some(parse_size(v)?);
        } else if let Some(v) = opt.strip_prefix("block_size=") {
            o.block_size = match v {
                "512" => 512,
                "4096" => 4096,
                _ => return Err(Invalid(format!("block_size must be 512 or 4096, got {v}"))),
            };
        } else {
            unknown_option(kind, opt)?;
            break;
        }
        rest = head;
    }
    Ok((rest, o))
}

/// The options a `--lun` spec of `kind` takes (what `lun_options` peels off).
fn known_options(kind: &str) -> &'static [&'static str] {
    if kind == "rbd" {
        &[
            "size=",
            "block_size=",
            "cache=",
            "ro",
            "write_cache",
            "conf=",
            "client=",
        ]
    } else {
        &["size=", "block_size=", "cache=", "ro", "write_cache"]
    }
}

/// A `,OPTION` no spec takes: an error where it cannot be part of what the spec names (a RAM
/// size, an RBD image: neither has commas), or where it is close to a known option; else
/// (a file or block path may contain commas) it is left to the path.
fn unknown_option(kind: &str, opt: &str) -> Result<(), Invalid> {
    let key = opt.split_once('=').map_or(opt, |(k, _)| k);
    let known = known_options(kind);
    let near = known
        .iter()
        .map(|k| k.trim_end_matches('='))
        .map(|k| (strsim::normalized_damerau_levenshtein(key, k), k))
        .filter(|(score, _)| *score >= 0.6)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k);
    if near.is_none() && matches!(kind, "file" | "block") {
        return Ok(());
    }
    let hint = near.map_or(String::new(), |k| format!(" (did you mean `{k}`?)"));
    Err(Invalid(format!(
        "unknown option `{opt}`{hint}; {kind}: takes {}",
        known.join(", ")
    )))
}

/// The store a spec names, and its size when it has one.
fn lun_store(kind: &str, rest: &str, o: &LunOptions) -> Result<(StoreKind, Option<u64>), Invalid> {
    let own_size = |why: &str| match o.size {
        Some(_) => Err(Invalid(why.into())),
        None => Ok(()),
    };
    if matches!(kind, "file" | "block") {
        super::names::check_path_text(rest)?;
    }
    match kind {
        "ram" => {
            if o.size.is_some() {
                return Err(Invalid("ram takes its size as ram:SIZE".into()));
            }
            let n = parse_size(rest)?;
            if n > super::RAM_SIZE_BYTES_MAX {
                return Err(Invalid(format!(
                    "ram: {n} bytes exceeds the largest RAM LUN ({} bytes, 16T)",
                    super::RAM_SIZE_BYTES_MAX
                )));
            }
            Ok((StoreKind::Ram { size_bytes: n }, Some(n)))
        }
        "file" | "block" if rest.is_empty() => Err(Invalid(format!("{kind}: needs a path"))),
        "file" => {
            let path = PathBuf::from(rest);
            let store = StoreKind::File {
                path,
                size_bytes: o.size,
            };
            Ok((store, o.size))
        }
        "block" => {
            own_size("a block device's size is the device's own; remove size=")?;
            let path = PathBuf::from(rest);
            Ok((StoreKind::Block { path }, None))
        }
        "rbd" => {
            own_size("an RBD image's size is the image's own; remove size=")?;
            let (pool, image) = super::parse_rbd_image(rest)?;
            let spec = store::RbdSpec {
                pool,
                image,
                conf: o.ceph_conf.clone(),
                client: o.ceph_client.clone(),
            };
            Ok((StoreKind::Rbd(spec), None))
        }
        other => Err(Invalid(format!(
            "unknown store {other:?}: expected ram, file, block or rbd"
        ))),
    }
}

/// One target on one portal group, open to any initiator, LUNs numbered in order.
/// Identities: from target IQN + LUN for RAM, from the path for files and block devices.
fn quick_export(
    listen: Vec<SocketAddr>,
    nvme_listen: Vec<SocketAddr>,
    iqn: NodeName,
    specs: Vec<LunSpec>,
) -> Config {
    let mut devices = Vec::new();
    let mut luns = Vec::new();
    for (lun, spec) in specs.into_iter().enumerate() {
        let name = format!("lun{lun}");
        luns.push(LunMapping {
            lun: lun as u64,
            device: name.clone(),
            read_only: spec.read_only,
        });
        devices.push(device_of(name, spec, &format!("ram:{iqn}:{lun}")));
    }
    Config {
        server: ServerConfig::default(),
        limits: Limits::default(),
        portal_groups: vec![PortalGroup {
            tag: 1,
            listen,
            nvme_listen: nvme_listen.clone(),
            nvme_discovery_listen: None,
            alua_state: scsi::AccessState::ActiveOptimized,
            gateway: None,
            peer_address: None,
        }],
        pools: Vec::new(),
        devices: devices.into_iter().map(std::sync::Arc::new).collect(),
        targets: vec![std::sync::Arc::new(TargetConfig {
            nqn: (!nvme_listen.is_empty()).then(|| nqn_of(&iqn)),
            iqn,
            alias: None,
            portal_groups: vec![1],
            groups: vec![InitiatorGroup {
                name: "default".into(),
                initiators: Vec::new(),
                any_initiator: true,
                luns,
                auth: Default::default(),
                allowed_sources: Vec::new(),
            }],
            auth: Default::default(),
            allowed_sources: Vec::new(),
            credentials: Vec::new(),
            tls_keys: Vec::new(),
        })],
        discovery: Default::default(),
    }
}

/// A device from a quick-export LUN spec (`ram:SIZE`, `file:PATH[,size=SIZE]`, `block:PATH`,
/// options as `--lun` takes them), for `ferrosan ctl device-add`. Its identity is derived from
/// its medium (RAM: its name) as quick exports derive theirs.
pub(crate) fn device_from_spec(name: &str, spec: &str) -> Result<DeviceConfig, Invalid> {
    let spec = parse_lun_spec(spec)?;
    Ok(device_of(
        name.to_string(),
        spec,
        &format!("ram-device:{name}"),
    ))
}

/// The device a LUN spec describes: write-through, thin, its identity derived from its medium
/// (a file's or block device's path; `ram_key` for RAM, which has none).
fn device_of(name: String, spec: LunSpec, ram_key: &str) -> DeviceConfig {
    let key = match &spec.store {
        StoreKind::Ram { .. } => ram_key.to_string(),
        StoreKind::File { path, .. } => format!("file:{}", path.display()),
        StoreKind::Block { path } => format!("block:{}", path.display()),
        // The image, not the gateway: every gateway exporting it shows the same identity.
        StoreKind::Rbd(spec) => format!("rbd:{}/{}", spec.pool, spec.image),
    };
    let (serial, naa) = derive_identity(&key);
    DeviceConfig {
        name,
        store: spec.store,
        block_size: spec.block_size,
        serial,
        vendor: None,
        product: None,
        naa,
        read_only: spec.read_only,
        write_cache: spec.write_cache,
        thin: true,
        cache: spec.cache,
        offline: false,
        lineage: super::Lineage::default(),
        // The error names the device and its --lun value already.
        origin: super::Origin::default(),
    }
}
