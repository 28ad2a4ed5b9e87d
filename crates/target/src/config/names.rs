//! Pure helpers of the config model: iSCSI names, sizes, addresses and stable identities.

use std::net::{IpAddr, SocketAddr};

/// The longest iSCSI name, in bytes (RFC 7143 §4.2.7.1).
pub const ISCSI_NAME_BYTES_MAX: usize = 223;

/// The well-known iSCSI port, used when a listen address names no port.
pub const ISCSI_PORT_DEFAULT: u16 = 3260;

/// Whether `s` is a well-formed iSCSI name: `iqn.YYYY-MM.reversed.domain[:anything]`,
/// `eui.` + 16 hex digits or `naa.` + 16 or 32 hex digits, at most 223 bytes.
///
/// `iqn.` names must be lowercase (the stringprep normal form of RFC 3722); the hex digits
/// of `eui.`/`naa.` names may be of either case (RFC 7143's own examples use uppercase).
pub fn is_valid_iscsi_name(s: &str) -> bool {
    check_iscsi_name(s).is_ok()
}

/// Like [`is_valid_iscsi_name`], with the reason a name is malformed.
pub fn check_iscsi_name(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("iSCSI name is empty".into());
    }
    if s.len() > ISCSI_NAME_BYTES_MAX {
        return Err(format!(
            "iSCSI name is {} bytes long, the limit is {ISCSI_NAME_BYTES_MAX}",
            s.len()
        ));
    }
    let prefix = s.get(..4).unwrap_or("");
    match prefix {
        "iqn." => check_iqn(&s[4..]),
        "eui." => check_hex(&s[4..], &[16], "eui."),
        "naa." => check_hex(&s[4..], &[16, 32], "naa."),
        _ if ["iqn.", "eui.", "naa."]
            .iter()
            .any(|p| p.eq_ignore_ascii_case(prefix)) =>
        {
            Err(format!("the type prefix `{prefix}` must be lowercase"))
        }
        _ => Err("an iSCSI name must start with `iqn.`, `eui.` or `naa.`".into()),
    }
}

fn check_hex(digits: &str, lengths: &[usize], prefix: &str) -> Result<(), String> {
    if !digits.bytes().all(|b| b.is_ascii_hexdigit()) || !lengths.contains(&digits.len()) {
        let want = if lengths.len() == 1 { "16" } else { "16 or 32" };
        return Err(format!(
            "`{prefix}` must be followed by exactly {want} hex digits"
        ));
    }
    Ok(())
}

fn check_iqn(rest: &str) -> Result<(), String> {
    // rest = "YYYY-MM.reversed.domain[:anything]"
    let date_ok = rest.len() >= 8 && {
        let b = rest.as_bytes();
        b[..4].iter().all(u8::is_ascii_digit)
            && b[4] == b'-'
            && b[5..7].iter().all(u8::is_ascii_digit)
            && matches!(
                &rest[5..7],
                "01" | "02" | "03" | "04" | "05" | "06" | "07" | "08" | "09" | "10" | "11" | "12"
            )
            && b[7] == b'.'
    };
    if !date_ok {
        return Err("`iqn.` must be followed by a date `YYYY-MM.` (month 01..12)".into());
    }
    let after_date = &rest[8..];
    let (authority, suffix) = match after_date.find(':') {
        Some(i) => (&after_date[..i], Some(&after_date[i + 1..])),
        None => (after_date, None),
    };
    if authority.is_empty() {
        return Err(
            "`iqn.` name has no naming authority (reversed domain name) after the date".into(),
        );
    }
    for label in authority.split('.') {
        if label.is_empty() {
            return Err("naming authority has an empty label (`..` or a trailing `.`)".into());
        }
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
        {
            return Err(if c.is_ascii_uppercase() {
                "iSCSI names must be lowercase".into()
            } else {
                format!("naming authority may contain only a-z, 0-9, `-` and `.`, found {c:?}")
            });
        }
    }
    if let Some(suffix) = suffix {
        if suffix.is_empty() {
            return Err("nothing follows the `:` of an `iqn.` name".into());
        }
        for c in suffix.chars() {
            let ok = c.is_ascii_lowercase()
                || c.is_ascii_digit()
                || matches!(c, '-' | '.' | ':')
                || (!c.is_ascii() && !c.is_whitespace() && !c.is_control());
            if !ok {
                return Err(if c.is_ascii_uppercase() {
                    "iSCSI names must be lowercase".into()
                } else {
                    format!("iSCSI names may contain only a-z, 0-9, `-`, `.`, `:` and non-ASCII letters, found {c:?}")
                });
            }
        }
    }
    Ok(())
}

/// iSCSI names compare case-insensitively (RFC 3722 maps them to lowercase).
pub(crate) fn iscsi_names_equal(a: &str, b: &str) -> bool {
    a.eq_ignore_ascii_case(b)
        || (!(a.is_ascii() && b.is_ascii()) && a.to_lowercase() == b.to_lowercase())
}

/// Parses a size in bytes: an integer with an optional binary unit suffix, case-insensitive:
/// `K`/`KiB` (2^10), `M`/`MiB`, `G`/`GiB`, `T`/`TiB`, `P`/`PiB`, or `B`/none for bytes.
/// `1.5G` (fractions) and `1GB` (ambiguous decimal-or-binary) are refused with a hint.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits_end == 0 {
        return Err(format!(
            "size `{s}` must start with a number, e.g. `512M` or `10G`"
        ));
    }
    let (number, unit) = t.split_at(digits_end);
    if unit.starts_with(['.', ',']) {
        return Err(format!(
            "size `{s}`: fractions are not accepted; use a smaller unit, e.g. `1536M` for 1.5G"
        ));
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
            return Err(format!(
                "size `{s}`: unit `{unit}` is ambiguous (decimal or binary?); write `{}` or `{}iB` (binary units)",
                &unit[..1].to_ascii_uppercase(),
                &unit[..1].to_ascii_uppercase()
            ))
        }
        _ => {
            return Err(format!(
                "size `{s}`: unknown unit `{unit}`; use K, M, G, T, P (or KiB, MiB, GiB, TiB, PiB)"
            ))
        }
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("size `{s}` is too large"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size `{s}` is too large"))
}

/// Parses a listen address: `IPv4[:PORT]` or `[IPv6][:PORT]`; the port defaults to 3260.
/// Host names are not accepted (the config is resolved without DNS).
pub fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    let t = s.trim();
    let addr = if let Ok(a) = t.parse::<SocketAddr>() {
        a
    } else if let Ok(ip) = t.parse::<std::net::Ipv4Addr>() {
        SocketAddr::new(IpAddr::V4(ip), ISCSI_PORT_DEFAULT)
    } else if let Some(ip) = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        match ip.parse::<std::net::Ipv6Addr>() {
            Ok(ip) => SocketAddr::new(IpAddr::V6(ip), ISCSI_PORT_DEFAULT),
            Err(_) => return Err(format!("`{s}` is not an IPv6 address")),
        }
    } else if t.parse::<std::net::Ipv6Addr>().is_ok() {
        return Err(format!(
            "`{s}`: write IPv6 addresses in brackets, e.g. `[{t}]:3260`"
        ));
    } else {
        return Err(format!(
            "`{s}` is not an address: expected IPv4:PORT or [IPv6]:PORT (no host names)"
        ));
    };
    if addr.port() == 0 {
        return Err(format!(
            "`{s}`: port 0 is not allowed (the port must be known to initiators)"
        ));
    }
    match addr.ip() {
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => {
            return Err(format!(
                "`{s}`: use the plain IPv4 form instead of an IPv4-mapped IPv6 address"
            ))
        }
        ip if ip.is_multicast() => {
            return Err(format!("`{s}`: a multicast address cannot be listened on"))
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
pub(crate) fn parse_naa(s: &str) -> Result<Vec<u8>, String> {
    let hex = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    if !hex.bytes().all(|b| b.is_ascii_hexdigit()) || !(hex.len() == 16 || hex.len() == 32) {
        return Err(format!(
            "`{s}` must be 16 or 32 hex digits (8 or 16 bytes), optionally after `0x`"
        ));
    }
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect();
    let naa_type = bytes.first().map_or(0, |b| b >> 4);
    match (bytes.len(), naa_type) {
        (8, 2 | 3 | 5) | (16, 6) => Ok(bytes),
        (8, t) => Err(format!(
            "`{s}`: an 8-byte NAA must be of type 2, 3 or 5 (first hex digit), got {t:x}"
        )),
        (_, t) => Err(format!(
            "`{s}`: a 16-byte NAA must be of type 6 (first hex digit), got {t:x}"
        )),
    }
}

/// Checks a configured unit serial number: 1..=20 printable ASCII characters, no spaces.
pub(crate) fn check_serial(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 20 {
        return Err(format!("must be 1 to 20 characters, got {}", s.len()));
    }
    if let Some(c) = s.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "may contain only printable ASCII without spaces, found {c:?}"
        ));
    }
    Ok(())
}

/// Checks a device or group name: 1..=64 of `A-Z a-z 0-9 . _ -`.
pub(crate) fn check_object_name(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 64 {
        return Err(format!("must be 1 to 64 characters, got {}", s.len()));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "may contain only A-Z, a-z, 0-9, `.`, `_` and `-`, found {c:?}"
        ));
    }
    Ok(())
}
