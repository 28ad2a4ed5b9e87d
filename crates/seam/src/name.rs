//! Node names — iSCSI names (RFC 7143 §4.2.7) and NVMe Qualified Names, which share the
//! `iqn.` grammar — and the one way they are compared.
//!
//! An initiator's or target's name decides who it is: its group, its credentials, its LUNs, its
//! reservations. Two spellings of one name must therefore be one identity everywhere, so a name
//! is normalised once, where it enters (config, Login Request, SendTargets, NVMe Connect), by the stringprep
//! profile of RFC 3722, and from then on compared only as a [`NodeName`] — byte equality of
//! normal forms. There is no way to compare one with a raw `&str`.
//!
//! The profile (RFC 3722 §3–§7): map RFC 3454 table B.1 to nothing and B.2 (case folding),
//! normalise to NFKC, prohibit tables C.1.1–C.9 (spaces, controls, private use, non-characters,
//! surrogates, …), apply the bidirectional-text rule of RFC 3454 §6, and (stricter than a
//! query, as for stored strings) refuse unassigned code points (table A.1). The Unicode tables
//! are those of the `stringprep` and `unicode-normalization` crates.

use std::fmt;

use unicode_normalization::UnicodeNormalization;

/// The longest iSCSI name, in bytes of its normal form (RFC 7143 §4.2.7.1).
pub const ISCSI_NAME_BYTES_MAX: usize = 223;

/// A normalised node name (an iSCSI name or an NQN): what stringprep (RFC 3722) made of the
/// name it was given.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeName(Box<str>);

/// Why a string is not an iSCSI name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NameError {
    Empty,
    /// Longer than [`ISCSI_NAME_BYTES_MAX`] bytes once normalised.
    TooLong {
        bytes: usize,
    },
    /// A character the profile prohibits (space, control, private use, unassigned, ...).
    Prohibited {
        found: char,
    },
    /// Mixed left-to-right and right-to-left text (RFC 3454 §6).
    Bidirectional,
    /// Not of the form `iqn.…`, `eui.…` or `naa.…` (RFC 7143 §4.2.7.2).
    Format(String),
    /// A configured name that is not in normal form: it must be written as `normal`.
    NotNormal {
        normal: String,
    },
}

impl fmt::Display for NameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NameError::Empty => write!(f, "iSCSI name is empty"),
            NameError::TooLong { bytes } => write!(
                f,
                "iSCSI name is {bytes} bytes long, the limit is {ISCSI_NAME_BYTES_MAX}"
            ),
            NameError::Prohibited { found } => write!(
                f,
                "iSCSI names may not contain {found:?} (RFC 3722 prohibits it)"
            ),
            NameError::Bidirectional => write!(
                f,
                "iSCSI name mixes left-to-right and right-to-left text (RFC 3454 §6)"
            ),
            NameError::Format(why) => f.write_str(why),
            NameError::NotNormal { normal } => write!(
                f,
                "iSCSI names must be lowercase and in the normal form of RFC 3722 (stringprep): \
                 write `{normal}`"
            ),
        }
    }
}

impl std::error::Error for NameError {}

impl NodeName {
    /// A name as an initiator sent it (Login Request, SendTargets): normalised, never refused
    /// for its grammar (real initiators send names outside RFC 7143's, e.g. with `_`; such a
    /// name can still be matched by an `any_initiator` group), only for what the profile
    /// prohibits and for its length.
    pub fn from_wire(s: &str) -> Result<NodeName, NameError> {
        let normal = prepare(s)?;
        check_length(&normal)?;
        Ok(NodeName(normal.into_boxed_str()))
    }

    /// A name as a configuration states it: well-formed (`iqn.`/`eui.`/`naa.`, or an NVMe
    /// `nqn.`, which shares the `iqn.` grammar and is compared the same way) and already in
    /// normal form, so that what the admin wrote is exactly what is compared. The one mapping
    /// accepted is upper-case hex digits of `eui.`/`naa.` names (RFC 7143's own examples use
    /// them); they are stored lowercase.
    pub fn from_config(s: &str) -> Result<NodeName, NameError> {
        let normal = prepare(s)?;
        check_length(&normal)?;
        check_format(&normal).map_err(NameError::Format)?;
        let hex_case_only = (normal.starts_with("eui.") || normal.starts_with("naa."))
            && normal.eq_ignore_ascii_case(s);
        if normal != s && !hex_case_only {
            if s.get(..4).is_some_and(|p| {
                ["iqn.", "nqn.", "eui.", "naa."]
                    .iter()
                    .any(|want| want.eq_ignore_ascii_case(p) && *want != p)
            }) {
                return Err(NameError::Format(format!(
                    "the type prefix `{}` must be lowercase",
                    &s[..4]
                )));
            }
            return Err(NameError::NotNormal { normal });
        }
        Ok(NodeName(normal.into_boxed_str()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the name follows RFC 7143's grammar (`iqn.`, `eui.`, `naa.`) or an NQN's.
    pub fn is_well_formed(&self) -> bool {
        check_format(&self.0).is_ok()
    }

    /// Whether this is an NVMe Qualified Name (an NVMe host's or subsystem's), not an iSCSI
    /// name.
    pub fn is_nqn(&self) -> bool {
        self.0.starts_with("nqn.")
    }
}

impl fmt::Display for NodeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for NodeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl AsRef<str> for NodeName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

fn check_length(normal: &str) -> Result<(), NameError> {
    if normal.is_empty() {
        return Err(NameError::Empty);
    }
    if normal.len() > ISCSI_NAME_BYTES_MAX {
        return Err(NameError::TooLong {
            bytes: normal.len(),
        });
    }
    Ok(())
}

/// The stringprep profile of RFC 3722. Pure ASCII names of the usual alphabet are already in
/// normal form (the fast path every real initiator takes).
fn prepare(s: &str) -> Result<String, NameError> {
    use stringprep::tables;
    if s.is_empty() {
        return Err(NameError::Empty);
    }
    // Bounded before any work, so a hostile Login Request's name costs little: a valid name
    // of 223 bytes is never spelled with more than four times as many (B.1 characters that
    // map to nothing can pad it, but no real initiator sends them).
    if s.len() > 4 * ISCSI_NAME_BYTES_MAX {
        return Err(NameError::TooLong { bytes: s.len() });
    }
    if s.bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b':'))
    {
        return Ok(s.to_owned());
    }
    // Unassigned in Unicode 3.2 (the profile's version) is refused in the input too, not only
    // in the output: NFKC here follows today's Unicode, and a character added since can
    // decompose into one the 3.2 case folding never saw (U+1CCE3, OUTLINED LATIN CAPITAL
    // LETTER, becomes `L`; found by the `iscsi_name` fuzz target).
    if let Some(found) = s.chars().find(|&c| tables::unassigned_code_point(c)) {
        return Err(NameError::Prohibited { found });
    }
    let map = |text: &str| -> String {
        text.chars()
            .filter(|&c| !tables::commonly_mapped_to_nothing(c))
            .flat_map(tables::case_fold_for_nfkc)
            .nfkc()
            .collect()
    };
    let normal = map(s);
    // A normal form must be its own normal form, or two spellings could compare unequal;
    // should the tables ever disagree on some character, the name is refused instead.
    if map(&normal) != normal {
        let found = s.chars().find(|c| !c.is_ascii()).unwrap_or('?');
        return Err(NameError::Prohibited { found });
    }
    let prohibited = |c: char| {
        tables::ascii_space_character(c)
            || tables::non_ascii_space_character(c)
            || tables::ascii_control_character(c)
            || tables::non_ascii_control_character(c)
            || tables::private_use(c)
            || tables::non_character_code_point(c)
            || tables::surrogate_code(c)
            || tables::inappropriate_for_plain_text(c)
            || tables::inappropriate_for_canonical_representation(c)
            || tables::change_display_properties_or_deprecated(c)
            || tables::tagging_character(c)
            || tables::unassigned_code_point(c)
    };
    if let Some(found) = normal.chars().find(|&c| prohibited(c)) {
        return Err(NameError::Prohibited { found });
    }
    // RFC 3454 §6: right-to-left text may not contain left-to-right characters and must both
    // start and end with a right-to-left character.
    if normal.chars().any(tables::bidi_r_or_al) {
        let first_last_rtl = normal.chars().next().is_some_and(tables::bidi_r_or_al)
            && normal.chars().next_back().is_some_and(tables::bidi_r_or_al);
        if normal.chars().any(tables::bidi_l) || !first_last_rtl {
            return Err(NameError::Bidirectional);
        }
    }
    Ok(normal)
}

/// RFC 7143 §4.2.7.2: `iqn.YYYY-MM.reversed.domain[:anything]`, `eui.` + 16 hex digits,
/// `naa.` + 16 or 32 hex digits; applied to a normal form (so lowercase throughout).
fn check_format(s: &str) -> Result<(), String> {
    match s.get(..4).unwrap_or("") {
        "iqn." => check_iqn(&s[4..], "iqn."),
        // An NVMe Qualified Name (NVMe base 2.0, 4.5) has the grammar of an `iqn.` name.
        "nqn." => check_iqn(&s[4..], "nqn."),
        "eui." => check_hex(&s[4..], &[16], "eui."),
        "naa." => check_hex(&s[4..], &[16, 32], "naa."),
        _ => Err("a name must start with `iqn.`, `eui.` or `naa.` (iSCSI) or `nqn.` (NVMe)".into()),
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

fn check_iqn(rest: &str, prefix: &str) -> Result<(), String> {
    // rest = "YYYY-MM.reversed.domain[:anything]"
    let b = rest.as_bytes();
    let date_ok = b.len() >= 8
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && matches!((b[5], b[6]), (b'0', b'1'..=b'9') | (b'1', b'0'..=b'2'))
        && b[7] == b'.';
    if !date_ok {
        return Err(format!(
            "`{prefix}` must be followed by a date `YYYY-MM.` (month 01..12)"
        ));
    }
    let after_date = &rest[8..];
    let (authority, suffix) = match after_date.split_once(':') {
        Some((authority, suffix)) => (authority, Some(suffix)),
        None => (after_date, None),
    };
    if authority.is_empty() {
        return Err(format!(
            "`{prefix}` name has no naming authority (reversed domain name) after the date"
        ));
    }
    for label in authority.split('.') {
        if label.is_empty() {
            return Err("naming authority has an empty label (`..` or a trailing `.`)".into());
        }
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
        {
            return Err(format!(
                "naming authority may contain only a-z, 0-9, `-` and `.`, found {c:?}"
            ));
        }
    }
    if let Some(suffix) = suffix {
        if suffix.is_empty() {
            return Err(format!("nothing follows the `:` of an `{prefix}` name"));
        }
        // Non-ASCII characters left after the profile are letters and marks it allows.
        if let Some(c) = suffix.chars().find(|&c| {
            !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.' | ':'))
                && c.is_ascii()
        }) {
            return Err(format!(
                "iSCSI names may contain only a-z, 0-9, `-`, `.`, `:` and non-ASCII letters, \
                 found {c:?}"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_names_are_folded_to_one_identity() {
        let pairs = [
            ("iqn.2026-11.test:É", "iqn.2026-11.test:é"),
            ("IQN.2026-11.Test:Host", "iqn.2026-11.test:host"),
            // Decomposed e + combining acute composes (NFKC).
            ("iqn.2026-11.test:e\u{301}", "iqn.2026-11.test:é"),
            // Soft hyphen (B.1) vanishes; ß folds to ss; the fullwidth A is compatibility-mapped.
            ("iqn.2026-11.te\u{ad}st:ß", "iqn.2026-11.test:ss"),
            ("iqn.2026-11.test:\u{ff21}", "iqn.2026-11.test:a"),
            ("iqn.2026-11.test:K", "iqn.2026-11.test:k"),
            // Kelvin sign folds to k.
            ("iqn.2026-11.test:\u{212a}", "iqn.2026-11.test:k"),
            ("EUI.02004567A425678D", "eui.02004567a425678d"),
        ];
        for (given, normal) in pairs {
            let a = NodeName::from_wire(given).unwrap();
            let b = NodeName::from_wire(normal).unwrap();
            assert_eq!(a, b, "{given:?} and {normal:?} are one name");
            assert_eq!(a.as_str(), normal);
        }
        assert_ne!(
            NodeName::from_wire("iqn.2026-11.test:a").unwrap(),
            NodeName::from_wire("iqn.2026-11.test:b").unwrap()
        );
    }

    #[test]
    fn prohibited_characters_and_lengths_are_refused() {
        for bad in [
            "iqn.2026-11.test:a b",
            "iqn.2026-11.test:a\u{0}",
            "iqn.2026-11.test:a\u{7f}",
            "iqn.2026-11.test:a\u{a0}",   // non-ASCII space
            "iqn.2026-11.test:\u{e000}",  // private use
            "iqn.2026-11.test:\u{fffe}",  // non-character
            "iqn.2026-11.test:\u{200e}",  // LRM (C.8)
            "iqn.2026-11.test:\u{e0001}", // language tag (C.9)
            "iqn.2026-11.test:\u{1cce3}", // unassigned in Unicode 3.2 (found by fuzzing)
        ] {
            assert!(
                matches!(NodeName::from_wire(bad), Err(NameError::Prohibited { .. })),
                "{bad:?}: {:?}",
                NodeName::from_wire(bad)
            );
        }
        assert_eq!(NodeName::from_wire(""), Err(NameError::Empty));
        // Only B.1 characters: nothing is left.
        assert_eq!(NodeName::from_wire("\u{ad}"), Err(NameError::Empty));
        let long = format!("iqn.2026-11.test:{}", "a".repeat(ISCSI_NAME_BYTES_MAX));
        assert!(matches!(
            NodeName::from_wire(&long),
            Err(NameError::TooLong { .. })
        ));
        let huge = "\u{ad}".repeat(10_000);
        assert!(matches!(
            NodeName::from_wire(&huge),
            Err(NameError::TooLong { .. })
        ));
        // Mixed directions.
        assert_eq!(
            NodeName::from_wire("iqn.2026-11.test:\u{5d0}a"),
            Err(NameError::Bidirectional)
        );
    }

    #[test]
    fn wire_names_outside_the_grammar_are_still_names() {
        let n = NodeName::from_wire("iqn.1998-01.com.vmware:ESX_01").unwrap();
        assert_eq!(n.as_str(), "iqn.1998-01.com.vmware:esx_01");
        assert!(!n.is_well_formed());
        assert!(
            NodeName::from_wire("iqn.2007-10.com.github:sahlberg:libiscsi:iscsi-test")
                .unwrap()
                .is_well_formed()
        );
    }

    #[test]
    fn configured_names_must_be_written_in_normal_form() {
        assert!(NodeName::from_config("iqn.2026-11.test:é").is_ok());
        assert!(NodeName::from_config("iqn.2001-04.com.example:stockage.données").is_ok());
        assert_eq!(
            NodeName::from_config("iqn.2026-11.test:É"),
            Err(NameError::NotNormal {
                normal: "iqn.2026-11.test:é".into()
            })
        );
        let decomposed = NodeName::from_config("iqn.2026-11.test:e\u{301}").unwrap_err();
        assert!(decomposed
            .to_string()
            .contains("write `iqn.2026-11.test:é`"));
        assert!(NodeName::from_config("iqn.2026-11.org.x:Disk")
            .unwrap_err()
            .to_string()
            .contains("lowercase"));
        assert!(NodeName::from_config("IQN.2026-11.org.x:disk")
            .unwrap_err()
            .to_string()
            .contains("prefix"));
        // Hex digits of either case; stored lowercase, equal to the wire's normal form.
        let eui = NodeName::from_config("eui.02004567A425678D").unwrap();
        assert_eq!(eui, NodeName::from_wire("eui.02004567a425678d").unwrap());
        for bad in [
            "iqn.2026-13.x",
            "iqn.2026-11.",
            "iqn.2026-11.x..y",
            "iqn.2026-11.x:",
            "iqn.2026-11.x:a_b",
            "eui.0200",
            "naa.0123",
            "foo.bar",
        ] {
            assert!(
                matches!(NodeName::from_config(bad), Err(NameError::Format(_))),
                "{bad}"
            );
        }
    }

    /// Any string a wire name is made from normalises to a fixed point: preparing the normal
    /// form again changes nothing, so comparing normal forms is comparing names.
    #[test]
    fn normal_forms_are_fixed_points() {
        let alphabet: Vec<char> = "aAzZ09.-:_éÉe\u{301}ßẞſ\u{212a}K\u{ad}\u{ff21}ǅǄǆΣσςİıi\u{307}ﬁ"
            .chars()
            .collect();
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..20_000 {
            let mut s = String::from("iqn.2026-11.x:");
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            for k in 0..(seed % 12) {
                let i = ((seed >> (k * 5)) as usize) % alphabet.len();
                s.push(alphabet[i]);
            }
            for spelling in [s.clone(), s.to_uppercase(), s.to_lowercase()] {
                if let Ok(n) = NodeName::from_wire(&spelling) {
                    let again = NodeName::from_wire(n.as_str()).unwrap();
                    assert_eq!(n, again, "{spelling:?}");
                }
            }
        }
    }
}
