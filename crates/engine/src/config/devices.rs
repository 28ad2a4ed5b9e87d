//! `[[device]]` tables: validation and resolution into [`DeviceConfig`]s. Every error is
//! reported at its value's line; a device with an error is kept by name only (so that the
//! LUN maps naming it report no second error) and the config does not load.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::PathBuf;

use serde::Deserialize;
use toml::Spanned;

use super::cx::{bool_or, int, required_with, Cx, Pos};
use super::names::{
    check_inquiry_text, check_object_name, check_serial, derive_identity, parse_naa, parse_size,
};
use super::{CacheMode, DeviceConfig, Invalid, Lineage, Origin, StoreKind};

type S<T> = Spanned<T>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDevice {
    name: Option<S<String>>,
    store: Option<S<String>>,
    path: Option<S<String>>,
    /// RBD: `POOL/IMAGE`, and how to reach the cluster.
    image: Option<S<String>>,
    ceph_conf: Option<S<String>>,
    ceph_client: Option<S<String>>,
    size: Option<S<toml::Value>>,
    block_size: Option<S<i64>>,
    serial: Option<S<String>>,
    vendor: Option<S<String>>,
    product: Option<S<String>>,
    naa: Option<S<String>>,
    read_only: Option<S<bool>>,
    write_cache: Option<S<bool>>,
    thin: Option<S<bool>>,
    cache: Option<S<String>>,
    offline: Option<S<bool>>,
    clone_of: Option<S<String>>,
    created: Option<S<String>>,
}

impl RawDevice {
    /// `d`'s table as reading back `Config::to_toml` would give it, its values at the next
    /// positions in the order that writes them; None for a size beyond TOML's integers.
    pub(super) fn of(d: &DeviceConfig, pos: &mut Pos) -> Option<S<RawDevice>> {
        let table = pos.next();
        let lossy = |p: &std::path::Path| p.to_string_lossy().into_owned();
        let name = Some(pos.s(d.name.clone()));
        let mut raw = RawDevice {
            name,
            store: None,
            path: None,
            image: None,
            ceph_conf: None,
            ceph_client: None,
            size: None,
            block_size: None,
            serial: None,
            vendor: None,
            product: None,
            naa: None,
            read_only: None,
            write_cache: None,
            thin: None,
            cache: None,
            offline: None,
            clone_of: None,
            created: None,
        };
        let size = |pos: &mut Pos, n: u64| Some(pos.s(toml::Value::Integer(int(n)?)));
        match &d.store {
            StoreKind::Ram { size_bytes } => {
                raw.store = Some(pos.s("ram".to_string()));
                raw.size = Some(size(pos, *size_bytes)?);
            }
            StoreKind::File { path, size_bytes } => {
                raw.store = Some(pos.s("file".to_string()));
                raw.path = Some(pos.s(lossy(path)));
                if let Some(n) = size_bytes {
                    raw.size = Some(size(pos, *n)?);
                }
            }
            StoreKind::Block { path } => {
                raw.store = Some(pos.s("block".to_string()));
                raw.path = Some(pos.s(lossy(path)));
            }
            StoreKind::Rbd(spec) => {
                raw.store = Some(pos.s("rbd".to_string()));
                raw.image = Some(pos.s(format!("{}/{}", spec.pool, spec.image)));
                raw.ceph_conf = spec.conf.as_deref().map(|c| pos.s(lossy(c)));
                raw.ceph_client = spec.client.as_ref().map(|c| pos.s(c.clone()));
            }
        }
        raw.block_size = Some(pos.s(i64::from(d.block_size)));
        raw.serial = Some(pos.s(d.serial.clone()));
        let naa: String = d.naa.iter().map(|b| format!("{b:02x}")).collect();
        raw.naa = Some(pos.s(format!("0x{naa}")));
        raw.read_only = Some(pos.s(d.read_only));
        raw.write_cache = Some(pos.s(d.write_cache));
        raw.thin = Some(pos.s(d.thin));
        if matches!(d.store, StoreKind::File { .. } | StoreKind::Block { .. }) {
            raw.cache = Some(pos.s(d.cache.name().to_string()));
        }
        raw.vendor = d.vendor.as_ref().map(|v| pos.s(v.clone()));
        raw.product = d.product.as_ref().map(|p| pos.s(p.clone()));
        raw.offline = d.offline.then(|| pos.s(true));
        raw.clone_of = d.lineage.clone_of.as_ref().map(|c| pos.s(c.clone()));
        raw.created = d.lineage.created.as_ref().map(|c| pos.s(c.clone()));
        Some(Spanned::new(table, raw))
    }
}

/// What must be unique across devices, and which device has it.
#[derive(Default)]
struct Taken {
    names: HashSet<String>,
    naas: HashMap<Vec<u8>, String>,
    /// Media: file and block device paths, and `rbd:POOL/IMAGE`.
    media: HashMap<PathBuf, String>,
}

/// One device being resolved: its table, how errors name it, and whether any was found.
struct Dev<'r> {
    raw: &'r RawDevice,
    table: Range<usize>,
    ctx: String,
    ok: bool,
}

impl Dev<'_> {
    fn err(
        &mut self,
        cx: &mut Cx<'_>,
        span: Range<usize>,
        field: &str,
        message: impl Into<String>,
    ) {
        cx.err(span, format!("{}: {field}", self.ctx), message);
        self.ok = false;
    }
}

pub(super) fn resolve_devices(
    cx: &mut Cx<'_>,
    raw: &[S<RawDevice>],
    seed: &str,
    roots: &[PathBuf],
) -> Vec<DeviceConfig> {
    let mut taken = Taken::default();
    raw.iter()
        .enumerate()
        .filter_map(|(i, rd)| {
            let mut dev = Dev {
                raw: rd.get_ref(),
                table: rd.span(),
                ctx: format!("device #{}", i + 1),
                ok: true,
            };
            resolve_device(cx, &mut dev, seed, roots, &mut taken)
        })
        .collect()
}

fn resolve_device(
    cx: &mut Cx<'_>,
    dev: &mut Dev<'_>,
    seed: &str,
    roots: &[PathBuf],
    taken: &mut Taken,
) -> Option<DeviceConfig> {
    let name = device_name(cx, dev, &mut taken.names);
    let block_size = block_size(cx, dev);
    let cache = cache_mode(cx, dev);
    let size = size(cx, dev, block_size);
    let store = store(cx, dev, size, roots, &mut taken.media);
    let (serial, naa) = identity(cx, dev, seed, &name, store.as_ref(), &mut taken.naas);
    let vendor = inquiry_text(cx, dev, "vendor", 8);
    let product = inquiry_text(cx, dev, "product", 16);
    let rd = dev.raw;
    match store {
        Some(store) if dev.ok => Some(DeviceConfig {
            name,
            store,
            block_size,
            serial,
            vendor,
            product,
            naa,
            read_only: bool_or(&rd.read_only, false),
            write_cache: bool_or(&rd.write_cache, false),
            thin: bool_or(&rd.thin, true),
            cache,
            offline: bool_or(&rd.offline, false),
            lineage: lineage(cx, dev),
            origin: Origin(Some(format!(
                "{}:{}",
                cx.file,
                cx.line_col(dev.table.start).0
            ))),
        }),
        // Keep the name known so that mappings to it do not report a second error.
        _ if !name.is_empty() => Some(DeviceConfig {
            name,
            store: StoreKind::Ram { size_bytes: 0 },
            block_size,
            serial: String::new(),
            vendor: None,
            product: None,
            naa: Vec::new(),
            read_only: false,
            write_cache: false,
            thin: false,
            cache: CacheMode::Auto,
            offline: false,
            lineage: Lineage::default(),
            origin: Origin::default(),
        }),
        _ => None,
    }
}

/// `clone_of` (`VOLUME` or `VOLUME@SNAPSHOT`, each a name) and `created` (RFC 3339).
fn lineage(cx: &mut Cx<'_>, dev: &mut Dev<'_>) -> Lineage {
    let mut lineage = Lineage::default();
    if let Some(c) = &dev.raw.clone_of {
        let text = c.get_ref();
        let names = text
            .split_once('@')
            .map_or((text.as_str(), None), |(v, s)| (v, Some(s)));
        let bad = super::check_object_name(names.0)
            .and_then(|()| names.1.map_or(Ok(()), super::check_object_name));
        match bad {
            Ok(()) => lineage.clone_of = Some(text.clone()),
            Err(e) => dev.err(
                cx,
                c.span(),
                "clone_of",
                format!("VOLUME or VOLUME@SNAPSHOT: {}", e.0),
            ),
        }
    }
    if let Some(t) = &dev.raw.created {
        let rfc3339 = &time::format_description::well_known::Rfc3339;
        match time::OffsetDateTime::parse(t.get_ref(), rfc3339) {
            Ok(_) => lineage.created = Some(t.get_ref().clone()),
            Err(e) => dev.err(cx, t.span(), "created", format!("an RFC 3339 time: {e}")),
        }
    }
    lineage
}

/// The device's name (empty when missing); errors name the device by it from here on.
fn device_name(cx: &mut Cx<'_>, dev: &mut Dev<'_>, names: &mut HashSet<String>) -> String {
    let field = || format!("{}: name", dev.ctx);
    let Some(n) = required_with(cx, &dev.raw.name, &dev.table, field) else {
        dev.ok = false;
        return String::new();
    };
    dev.ctx = format!("device {:?}", n.get_ref());
    if let Err(m) = check_object_name(n.get_ref()) {
        dev.err(cx, n.span(), "name", m);
    } else if !names.insert(n.get_ref().clone()) {
        dev.err(cx, n.span(), "name", "duplicate device name");
    }
    n.get_ref().clone()
}

fn block_size(cx: &mut Cx<'_>, dev: &mut Dev<'_>) -> u32 {
    match &dev.raw.block_size {
        None => 512,
        Some(b) if matches!(*b.get_ref(), 512 | 4096) => *b.get_ref() as u32,
        Some(b) => {
            let why = format!("must be 512 or 4096, got {}", b.get_ref());
            dev.err(cx, b.span(), "block_size", why);
            512
        }
    }
}

fn cache_mode(cx: &mut Cx<'_>, dev: &mut Dev<'_>) -> CacheMode {
    let Some(c) = &dev.raw.cache else {
        return CacheMode::Auto;
    };
    CacheMode::parse(c.get_ref()).unwrap_or_else(|| {
        let why = format!(
            "unknown mode {:?}: expected \"auto\", \"direct\" or \"page\"",
            c.get_ref()
        );
        dev.err(cx, c.span(), "cache", why);
        CacheMode::Auto
    })
}

/// The size in bytes, if given and valid (a whole number of blocks, not 0).
fn size(cx: &mut Cx<'_>, dev: &mut Dev<'_>, block_size: u32) -> Option<u64> {
    let s = dev.raw.size.as_ref()?;
    let parsed = match s.get_ref() {
        toml::Value::Integer(n) if *n >= 0 => Ok(*n as u64),
        toml::Value::Integer(n) => Err(Invalid(format!("must not be negative, got {n}"))),
        toml::Value::String(t) => parse_size(t),
        other => Err(Invalid(format!(
            "must be a number of bytes or a string like \"10G\", got a {}",
            other.type_str()
        ))),
    };
    let why = match parsed {
        Ok(0) => "must not be 0".to_string(),
        Ok(n) if n % u64::from(block_size) != 0 => {
            format!("must be a multiple of block_size ({block_size}), got {n}")
        }
        Ok(n) => return Some(n),
        Err(m) => m.0,
    };
    dev.err(cx, s.span(), "size", why);
    None
}

fn store(
    cx: &mut Cx<'_>,
    dev: &mut Dev<'_>,
    size: Option<u64>,
    roots: &[PathBuf],
    media: &mut HashMap<PathBuf, String>,
) -> Option<StoreKind> {
    let field = || format!("{}: store", dev.ctx);
    let st = required_with(cx, &dev.raw.store, &dev.table, field)?;
    match st.get_ref().as_str() {
        "ram" => ram_store(cx, dev, st.span(), size),
        "file" => file_store(cx, dev, st, size, roots, media),
        "block" => file_store(cx, dev, st, size, roots, media),
        "rbd" => rbd_store(cx, dev, st.span(), size, media),
        other => {
            let why = format!("must be \"ram\", \"file\", \"block\" or \"rbd\", got {other:?}");
            cx.err(st.span(), format!("{}: store", dev.ctx), why);
            None
        }
    }
}

fn ram_store(
    cx: &mut Cx<'_>,
    dev: &mut Dev<'_>,
    at: Range<usize>,
    size: Option<u64>,
) -> Option<StoreKind> {
    if let Some(p) = &dev.raw.path {
        dev.err(cx, p.span(), "path", "a ram device has no path");
    }
    match (&dev.raw.size, size) {
        (Some(raw), Some(n)) if n > super::RAM_SIZE_BYTES_MAX => {
            let why = format!(
                "{n} bytes exceeds the largest RAM LUN ({} bytes, 16T)",
                super::RAM_SIZE_BYTES_MAX
            );
            cx.err(raw.span(), format!("{}: size", dev.ctx), why);
            None
        }
        (_, Some(n)) => Some(StoreKind::Ram { size_bytes: n }),
        (None, _) => {
            let why = "missing: a ram device needs a size";
            cx.err(at, format!("{}: size", dev.ctx), why);
            None
        }
        (Some(_), None) => None,
    }
}

fn file_store(
    cx: &mut Cx<'_>,
    dev: &mut Dev<'_>,
    st: &S<String>,
    size: Option<u64>,
    roots: &[PathBuf],
    media: &mut HashMap<PathBuf, String>,
) -> Option<StoreKind> {
    let is_file = st.get_ref() == "file";
    let path = medium_path(cx, dev, st, roots, media);
    if !is_file {
        if let (Some(s), Some(_)) = (&dev.raw.size, size) {
            let why = "a block device's size is the device's own; remove `size`";
            dev.err(cx, s.span(), "size", why);
        }
    }
    let path = path?;
    Some(if is_file {
        StoreKind::File {
            path,
            size_bytes: size,
        }
    } else {
        StoreKind::Block { path }
    })
}

/// A file or block device's path: given, not empty, within the device roots and no other
/// device's.
fn medium_path(
    cx: &mut Cx<'_>,
    dev: &mut Dev<'_>,
    st: &S<String>,
    roots: &[PathBuf],
    media: &mut HashMap<PathBuf, String>,
) -> Option<PathBuf> {
    let field = || format!("{}: path", dev.ctx);
    let Some(p) = &dev.raw.path else {
        let why = format!("missing: a {} device needs a path", st.get_ref());
        cx.err(st.span(), field(), why);
        return None;
    };
    if p.get_ref().is_empty() {
        cx.err(p.span(), field(), "must not be empty");
        return None;
    }
    if let Err(m) = super::names::check_path_text(p.get_ref()) {
        cx.err(p.span(), field(), m);
        return None;
    }
    let path = PathBuf::from(p.get_ref());
    if let Err(m) = super::within_roots(&path, roots) {
        dev.err(cx, p.span(), "path", m);
    }
    claim(cx, dev, media, path.clone(), p, "path");
    Some(path)
}

/// Records that `dev` uses `medium`; a medium another device uses already is an error.
fn claim(
    cx: &mut Cx<'_>,
    dev: &mut Dev<'_>,
    media: &mut HashMap<PathBuf, String>,
    medium: PathBuf,
    given: &S<String>,
    field: &str,
) {
    match media.get(&medium) {
        Some(other) => {
            let why = format!("{:?} is already the {field} of {other}", given.get_ref());
            dev.err(cx, given.span(), field, why);
        }
        None => {
            media.insert(medium, dev.ctx.clone());
        }
    }
}

fn rbd_store(
    cx: &mut Cx<'_>,
    dev: &mut Dev<'_>,
    at: Range<usize>,
    size: Option<u64>,
    media: &mut HashMap<PathBuf, String>,
) -> Option<StoreKind> {
    let rd = dev.raw;
    if let Some(p) = &rd.path {
        let why = "an rbd device has no path: name it with image = \"POOL/IMAGE\"";
        dev.err(cx, p.span(), "path", why);
    }
    if let (Some(s), Some(_)) = (&rd.size, size) {
        let why = "an RBD image's size is the image's own; remove `size`";
        dev.err(cx, s.span(), "size", why);
    }
    let image = rbd_image(cx, dev, at, media);
    let conf = rd.ceph_conf.as_ref().and_then(|c| {
        let why = match c.get_ref() {
            empty if empty.is_empty() => Invalid::from("must not be empty"),
            path => match super::names::check_path_text(path) {
                Ok(()) => return Some(PathBuf::from(path)),
                Err(why) => why,
            },
        };
        dev.err(cx, c.span(), "ceph_conf", why);
        None
    });
    let client = match &rd.ceph_client {
        Some(c) if c.get_ref().is_empty() || c.get_ref().contains('\0') => {
            let why = "must be a Ceph client name like \"client.iscsi\"";
            dev.err(cx, c.span(), "ceph_client", why);
            None
        }
        c => c.as_ref().map(|c| c.get_ref().clone()),
    };
    let (pool, image) = image?;
    Some(StoreKind::Rbd(store::RbdSpec {
        pool,
        image,
        conf,
        client,
    }))
}

/// An RBD device's `POOL/IMAGE`, no other device's.
fn rbd_image(
    cx: &mut Cx<'_>,
    dev: &mut Dev<'_>,
    at: Range<usize>,
    media: &mut HashMap<PathBuf, String>,
) -> Option<(String, String)> {
    let field = format!("{}: image", dev.ctx);
    let Some(i) = &dev.raw.image else {
        cx.err(
            at,
            field,
            "missing: an rbd device needs image = \"POOL/IMAGE\"",
        );
        return None;
    };
    match super::parse_rbd_image(i.get_ref()) {
        Ok(parts) => {
            let key = PathBuf::from(format!("rbd:{}", i.get_ref()));
            claim(cx, dev, media, key, i, "image");
            Some(parts)
        }
        Err(m) => {
            cx.err(i.span(), field, m);
            None
        }
    }
}

/// The device's SCSI identity: its serial and NAA, given or derived. An RBD image has one
/// identity on every gateway that exports it (whatever the device is called there):
/// multipath sees one LU behind all of them.
/// `vendor` or `product`: what INQUIRY reports instead of ferrosan's default.
fn inquiry_text(cx: &mut Cx<'_>, dev: &mut Dev<'_>, field: &str, max: usize) -> Option<String> {
    let raw = match field {
        "vendor" => dev.raw.vendor.as_ref(),
        _ => dev.raw.product.as_ref(),
    }?;
    if let Err(m) = check_inquiry_text(raw.get_ref(), max) {
        dev.err(cx, raw.span(), field, m);
    }
    Some(raw.get_ref().clone())
}

fn identity(
    cx: &mut Cx<'_>,
    dev: &mut Dev<'_>,
    seed: &str,
    name: &str,
    store: Option<&StoreKind>,
    naas: &mut HashMap<Vec<u8>, String>,
) -> (String, Vec<u8>) {
    let key = match store {
        Some(StoreKind::Rbd(spec)) => format!("rbd:{}/{}", spec.pool, spec.image),
        _ => format!("{seed}device:{name}"),
    };
    let (derived_serial, derived_naa) = derive_identity(&key);
    let rd = dev.raw;
    let serial = match &rd.serial {
        None => derived_serial,
        Some(s) => {
            if let Err(m) = check_serial(s.get_ref()) {
                dev.err(cx, s.span(), "serial", m);
            }
            s.get_ref().clone()
        }
    };
    let naa = match &rd.naa {
        None => derived_naa,
        Some(n) => parse_naa(n.get_ref()).unwrap_or_else(|m| {
            dev.err(cx, n.span(), "naa", m);
            Vec::new()
        }),
    };
    if dev.ok && !naa.is_empty() {
        unique_naa(cx, dev, &naa, naas);
    }
    (serial, naa)
}

fn unique_naa(cx: &mut Cx<'_>, dev: &Dev<'_>, naa: &[u8], naas: &mut HashMap<Vec<u8>, String>) {
    match naas.get(naa) {
        Some(other) => {
            let span = dev.raw.naa.as_ref().map_or(dev.table.clone(), |n| n.span());
            let why =
                format!("same NAA identifier as {other}: initiators would take them for one LU");
            cx.err(span, format!("{}: naa", dev.ctx), why);
        }
        None => {
            naas.insert(naa.to_vec(), dev.ctx.clone());
        }
    }
}
