//! Pure helpers of the config model: iSCSI names, sizes, addresses and stable identities.

use std::net::{IpAddr, SocketAddr};

use seam::name::NodeName;
pub use seam::name::ISCSI_NAME_BYTES_MAX;

use super::Invalid;

/// The well-known iSCSI port, used when a listen address names no port.
pub const ISCSI_PORT_DEFAULT: u16 = 3260;
/// The NVMe/TCP port (IANA `nvme-tcp`, 4420); discovery controllers answer on it too.
pub const NVME_PORT_DEFAULT: u16 = 4420;
/// The NVMe/TCP discovery port (NVMe/TCP transport specification: 8009).
pub const NVME_DISCOVERY_PORT: u16 = 8009;

/// Whether `s` is an iSCSI name as a config must write it (see [`check_iscsi_name`]).
pub fn is_valid_iscsi_name(s: &str) -> bool {
    check_iscsi_name(s).is_ok()
}

/// Parses a configured iSCSI name: well-formed (`iqn.YYYY-MM.reversed.domain[:anything]`,
/// `eui.` + 16 hex digits or `naa.` + 16 or 32 hex digits, at most 223 bytes) and written in
/// the normal form of RFC 3722 (lowercase, NFKC), which is the form every comparison uses
/// ([`NodeName`]); the error says why not, and how to write it.
pub fn check_iscsi_name(s: &str) -> Result<NodeName, Invalid> {
    NodeName::from_config(s).map_err(|e| Invalid(e.to_string()))
}

/// Parses a size in bytes: an integer with an optional binary unit suffix, case-insensitive:
/// `K`/`KiB` (2^10), `M`/`MiB`, `G`/`GiB`, `T`/`TiB`, `P`/`PiB`, or `B`/none for bytes.
/// `1.5G` (fractions) and `1GB` (ambiguous decimal-or-binary) are refused with a hint.
pub fn parse_size(s: &str) -> Result<u64, Invalid> {
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits_end == 0 {
        return Err(Invalid(format!(
            "size `{s}` must start with a number, e.g. `512M` or `10G`"
        )));
    }
    let (number, unit) = t.split_at(digits_end);
    if unit.starts_with(['.', ',']) {
        return Err(Invalid(format!(
            "size `{s}`: fractions are not accepted; use a smaller unit, e.g. `1536M` for 1.5G"
        )));
    }
    let unit = unit.trim_start().to_ascii_lowercase();
    let shift: u32 = match unit.as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        "p" | "pib" => 50,
        "kb" | "mb" | "gb" | "tb" | "pb" => {
            return Err(Invalid(format!(
                "size `{s}`: unit `{unit}` is ambiguous (decimal or binary?); write `{}` or `{}iB` (binary units)",
                &unit[..1].to_ascii_uppercase(),
                &unit[..1].to_ascii_uppercase()
            )))
        }
        _ => {
            return Err(Invalid(format!(
                "size `{s}`: unknown unit `{unit}`; use K, M, G, T, P (or KiB, MiB, GiB, TiB, PiB)"
            )))
        }
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("size `{s}` is too large"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| Invalid(format!("size `{s}` is too large")))
}

/// A size as [`parse_size`] reads it back, in the largest binary unit that holds it whole
/// (`1G`, `1536M`, `4K`); a size no unit divides stays a number of bytes.
pub fn size_text(bytes: u64) -> String {
    for (shift, unit) in [(50, "P"), (40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes != 0 && bytes.trailing_zeros() >= shift {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// Parses a listen address: `IPv4[:PORT]` or `[IPv6][:PORT]`; the port defaults to 3260.
/// Host names are not accepted (the config is resolved without DNS).
pub fn parse_listen(s: &str) -> Result<SocketAddr, Invalid> {
    parse_listen_on(s, ISCSI_PORT_DEFAULT)
}

/// An NVMe/TCP listen address: as [`parse_listen`], the port 4420 when none is given.
pub fn parse_nvme_listen(s: &str) -> Result<SocketAddr, Invalid> {
    parse_listen_on(s, NVME_PORT_DEFAULT)
}

/// An NVMe/TCP discovery listen address: the port 8009 when none is given.
pub fn parse_nvme_discovery_listen(s: &str) -> Result<SocketAddr, Invalid> {
    parse_listen_on(s, NVME_DISCOVERY_PORT)
}

fn parse_listen_on(s: &str, default_port: u16) -> Result<SocketAddr, Invalid> {
    let t = s.trim();
    let addr = if let Ok(a) = t.parse::<SocketAddr>() {
        a
    } else if let Ok(ip) = t.parse::<std::net::Ipv4Addr>() {
        SocketAddr::new(IpAddr::V4(ip), default_port)
    } else if let Some(ip) = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        match ip.parse::<std::net::Ipv6Addr>() {
            Ok(ip) => SocketAddr::new(IpAddr::V6(ip), default_port),
            Err(_) => return Err(Invalid(format!("`{s}` is not an IPv6 address"))),
        }
    } else if t.parse::<std::net::Ipv6Addr>().is_ok() {
        return Err(Invalid(format!(
            "`{s}`: write IPv6 addresses in brackets, e.g. `[{t}]:{default_port}`"
        )));
    } else {
        return Err(Invalid(format!(
            "`{s}` is not an address: expected IPv4:PORT or [IPv6]:PORT (no host names)"
        )));
    };
    if addr.port() == 0 {
        return Err(Invalid(format!(
            "`{s}`: port 0 is not allowed (the port must be known to initiators)"
        )));
    }
    match addr.ip() {
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => {
            return Err(Invalid(format!(
                "`{s}`: use the plain IPv4 form instead of an IPv4-mapped IPv6 address"
            )))
        }
        ip if ip.is_multicast() => {
            return Err(Invalid(format!(
                "`{s}`: a multicast address cannot be listened on"
            )))
        }
        _ => {}
    }
    Ok(addr)
}

/// Whether two listen addresses would conflict: the same address and port, or a wildcard
/// (`0.0.0.0`, `[::]`) and any address of the same family on the same port. `0.0.0.0:P` and
/// `[::]:P` do not conflict: the engine binds IPv6 sockets with `IPV6_V6ONLY`.
pub fn portals_overlap(a: SocketAddr, b: SocketAddr) -> bool {
    if a.port() != b.port() || a.is_ipv4() != b.is_ipv4() {
        return false;
    }
    a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified()
}

/// FNV-1a, 64 bits: tiny and stable forever (std's `DefaultHasher` is not stable across releases).
pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The default identity of a device, derived from `key`: (serial, NAA).
/// Serial: the 16 lowercase hex digits of the hash. NAA: type 3 (locally assigned),
/// 8 bytes, high nibble 3 followed by the low 60 bits of the hash.
pub(crate) fn derive_identity(key: &str) -> (String, Vec<u8>) {
    let h = fnv1a64(key.as_bytes());
    let naa = (3u64 << 60) | (h & ((1u64 << 60) - 1));
    (format!("{h:016x}"), naa.to_be_bytes().to_vec())
}

/// Parses a configured NAA: 16 or 32 hex digits, optional `0x`; the NAA type (first nibble)
/// must be 2, 3 or 5 for 8 bytes and 6 for 16 bytes.
pub(crate) fn parse_naa(s: &str) -> Result<Vec<u8>, Invalid> {
    let hex = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    if !hex.bytes().all(|b| b.is_ascii_hexdigit()) || !(hex.len() == 16 || hex.len() == 32) {
        return Err(Invalid(format!(
            "`{s}` must be 16 or 32 hex digits (8 or 16 bytes), optionally after `0x`"
        )));
    }
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect();
    let naa_type = bytes.first().map_or(0, |b| b >> 4);
    match (bytes.len(), naa_type) {
        (8, 2 | 3 | 5) | (16, 6) => Ok(bytes),
        (8, t) => Err(Invalid(format!(
            "`{s}`: an 8-byte NAA must be of type 2, 3 or 5 (first hex digit), got {t:x}"
        ))),
        (_, t) => Err(Invalid(format!(
            "`{s}`: a 16-byte NAA must be of type 6 (first hex digit), got {t:x}"
        ))),
    }
}

/// Checks a configured unit serial number: 1..=20 printable ASCII characters, no spaces.
pub(crate) fn check_serial(s: &str) -> Result<(), Invalid> {
    if s.is_empty() || s.len() > 20 {
        return Err(Invalid(format!(
            "must be 1 to 20 characters, got {}",
            s.len()
        )));
    }
    if let Some(c) = s.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(Invalid(format!(
            "may contain only printable ASCII without spaces, found {c:?}"
        )));
    }
    Ok(())
}

/// Checks an INQUIRY text (vendor, product): 1..=`max` printable ASCII, spaces allowed (the
/// field is space-padded on the wire).
pub(crate) fn check_inquiry_text(s: &str, max: usize) -> Result<(), Invalid> {
    if s.trim().is_empty() || s.len() > max {
        return Err(Invalid(format!(
            "must be 1 to {max} characters, got {}",
            s.len()
        )));
    }
    if let Some(c) = s.chars().find(|c| !(c.is_ascii_graphic() || *c == ' ')) {
        return Err(Invalid(format!(
            "may contain only printable ASCII, found {c:?}"
        )));
    }
    Ok(())
}

/// Checks a device, group, pool, volume or snapshot name: 1..=64 of `A-Z a-z 0-9 . _ -`, not
/// starting with `-` and not `.` or `..`. Such a name becomes a file name (a directory pool's
/// `NAME.img`) or an argument of LVM's tools (a volume's LV): a leading `-` would read as an
/// option there, `.` and `..` as directories.
pub fn check_object_name(s: &str) -> Result<(), Invalid> {
    if s.is_empty() || s.len() > 64 {
        return Err(Invalid(format!(
            "must be 1 to 64 characters, got {}",
            s.len()
        )));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(Invalid(format!(
            "may contain only A-Z, a-z, 0-9, `.`, `_` and `-`, found {c:?}"
        )));
    }
    not_an_option_nor_a_directory(s)
}

/// A name that no tool reads as an option (a leading `-`) and no path as a directory.
fn not_an_option_nor_a_directory(s: &str) -> Result<(), Invalid> {
    if s.starts_with('-') {
        return Err(Invalid(format!("{s:?} must not start with `-`")));
    }
    if s == "." || s == ".." {
        return Err(Invalid(format!("{s:?} is not a name")));
    }
    Ok(())
}

/// The longest VG or LV name LVM takes (lvm(8), VALID NAMES: NAME_LEN 128 with its NUL).
const LVM_NAME_MAX: usize = 127;

/// Checks an LVM volume group name as lvm(8) allows it: 1 to 127 of `A-Z a-z 0-9 + _ . -`, not
/// starting with `-`, not `.` or `..`.
pub fn check_lvm_vg_name(s: &str) -> Result<(), Invalid> {
    if s.is_empty() || s.len() > LVM_NAME_MAX {
        return Err(Invalid(format!(
            "{s:?}: an LVM name has 1 to {LVM_NAME_MAX} characters, got {}",
            s.len()
        )));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '_' | '.' | '-')))
    {
        return Err(Invalid(format!(
            "{s:?}: an LVM name may contain only A-Z, a-z, 0-9, `+`, `_`, `.` and `-`, found {c:?}"
        )));
    }
    not_an_option_nor_a_directory(s)
}

/// What LVM names its own hidden LVs with (lvm(8), VALID NAMES): no LV of ours may contain
/// one.
const LVM_RESERVED_PARTS: [&str; 17] = [
    "_cdata", "_cmeta", "_corig", "_cpool", "_cvol", "_imeta", "_iorig", "_mimage", "_mlog",
    "_pmspare", "_rimage", "_rmeta", "_tdata", "_tmeta", "_vdata", "_vorigin", "_wcorig",
];

/// Checks an LVM logical volume name (a thin pool, a volume, a snapshot's `VOLUME+SNAPSHOT`):
/// a VG name's rules, not starting with `snapshot` or `pvmove` and without the parts LVM
/// reserves for its hidden LVs (`_tdata`, `_tmeta`, ...). Stricter than LVM where it is
/// simpler: LVM refuses some of these only in some places.
pub fn check_lvm_lv_name(s: &str) -> Result<(), Invalid> {
    check_lvm_vg_name(s)?;
    if let Some(prefix) = ["snapshot", "pvmove"].iter().find(|p| s.starts_with(*p)) {
        return Err(Invalid(format!(
            "{s:?}: LVM reserves LV names starting with `{prefix}`"
        )));
    }
    if let Some(part) = LVM_RESERVED_PARTS.iter().find(|p| s.contains(*p)) {
        return Err(Invalid(format!(
            "{s:?}: LVM reserves `{part}` for its own LVs' names"
        )));
    }
    Ok(())
}

/// Checks a Ceph pool name: 1 to 127 of `A-Z a-z 0-9 . _ -`, not starting with `-`, not `.` or
/// `..`. Ceph itself takes more; a gateway's pools need no more, and every such name stays a
/// plain word wherever it is shown or passed on.
pub fn check_rbd_pool_name(s: &str) -> Result<(), Invalid> {
    if s.is_empty() || s.len() > 127 {
        return Err(Invalid(format!(
            "{s:?}: a Ceph pool name has 1 to 127 characters here, got {}",
            s.len()
        )));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(Invalid(format!(
            "{s:?}: a Ceph pool name may contain only A-Z, a-z, 0-9, `.`, `_` and `-` here, \
             found {c:?}"
        )));
    }
    not_an_option_nor_a_directory(s)
}

/// Checks a path as the config writes it: no control character (U+0000–U+001F, U+007F, and the
/// C1 controls U+0080–U+009F). Paths are copied into files other programs read line by line
/// (`ferrosan systemd-dropin`'s drop-in, run by systemd as root, and its udev rules; the saved
/// config; the log): a newline there would start a line of the path's choosing.
pub fn check_path_text(s: &str) -> Result<(), Invalid> {
    match s.char_indices().find(|(_, c)| c.is_control()) {
        Some((at, c)) => Err(Invalid(format!(
            "{s:?} contains a control character ({c:?} at byte {at}): a path may not"
        ))),
        None => Ok(()),
    }
}
