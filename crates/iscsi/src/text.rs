//! `key=value` text (RFC 7143 §6.1): NUL-terminated UTF-8 pairs in Login and Text PDUs.

/// RFC 7143 §6.1: key names are at most 63 bytes.
pub const KEY_LEN_MAX: usize = 63;
/// Values are at most 255 bytes except binary CHAP values and SendTargets answers, which we
/// bound by the whole text's length instead.
pub const VALUE_LEN_MAX: usize = 8192;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TextError {
    NotNulTerminated,
    MissingEquals,
    EmptyKey,
    KeyTooLong,
    ValueTooLong,
    NotUtf8,
    TooManyKeys(usize),
    TooLong(usize),
    DuplicateKey(String),
}

impl std::fmt::Display for TextError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TextError::NotNulTerminated => write!(f, "text data is not NUL-terminated"),
            TextError::MissingEquals => write!(f, "a key has no '='"),
            TextError::EmptyKey => write!(f, "empty key name"),
            TextError::KeyTooLong => write!(f, "key name longer than {KEY_LEN_MAX} bytes"),
            TextError::ValueTooLong => write!(f, "value longer than {VALUE_LEN_MAX} bytes"),
            TextError::NotUtf8 => write!(f, "text is not UTF-8"),
            TextError::TooManyKeys(n) => write!(f, "more than {n} keys"),
            TextError::TooLong(n) => write!(f, "text longer than {n} bytes"),
            TextError::DuplicateKey(k) => write!(f, "key {k} sent twice"),
        }
    }
}

/// Parses a complete (no longer continued) text. Keys must be unique within one request.
pub fn parse(data: &[u8], max_keys: usize) -> Result<Vec<(String, String)>, TextError> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    if data.is_empty() {
        return Ok(pairs);
    }
    // Some initiators pad with extra NULs; an unterminated last pair is an error.
    let trimmed_end = data.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
    if trimmed_end == data.len() {
        return Err(TextError::NotNulTerminated);
    }
    for item in data[..trimmed_end].split(|&b| b == 0) {
        if item.is_empty() {
            continue;
        }
        let text = std::str::from_utf8(item).map_err(|_| TextError::NotUtf8)?;
        let (key, value) = text.split_once('=').ok_or(TextError::MissingEquals)?;
        if key.is_empty() {
            return Err(TextError::EmptyKey);
        }
        if key.len() > KEY_LEN_MAX {
            return Err(TextError::KeyTooLong);
        }
        if value.len() > VALUE_LEN_MAX {
            return Err(TextError::ValueTooLong);
        }
        if pairs.iter().any(|(k, _)| k == key) {
            return Err(TextError::DuplicateKey(key.to_string()));
        }
        if pairs.len() >= max_keys {
            return Err(TextError::TooManyKeys(max_keys));
        }
        pairs.push((key.to_string(), value.to_string()));
    }
    Ok(pairs)
}

pub fn encode_pair(out: &mut Vec<u8>, key: &str, value: &str) {
    out.extend_from_slice(key.as_bytes());
    out.push(b'=');
    out.extend_from_slice(value.as_bytes());
    out.push(0);
}

pub fn encode(pairs: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in pairs {
        encode_pair(&mut out, k, v);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pairs() {
        let p = parse(b"A=1\0B=two\0Empty=\0", 8).unwrap();
        assert_eq!(
            p,
            vec![
                ("A".into(), "1".into()),
                ("B".into(), "two".into()),
                ("Empty".into(), "".into())
            ]
        );
        assert_eq!(parse(b"", 8).unwrap(), vec![]);
        assert_eq!(parse(b"A=1\0\0\0", 8).unwrap().len(), 1);
        assert_eq!(parse(b"A=b=c\0", 8).unwrap()[0].1, "b=c");
    }

    #[test]
    fn rejects_malformed() {
        assert_eq!(parse(b"A=1", 8), Err(TextError::NotNulTerminated));
        assert_eq!(parse(b"A\0", 8), Err(TextError::MissingEquals));
        assert_eq!(parse(b"=1\0", 8), Err(TextError::EmptyKey));
        assert_eq!(parse(b"\xff=1\0", 8), Err(TextError::NotUtf8));
        assert_eq!(
            parse(b"A=1\0A=2\0", 8),
            Err(TextError::DuplicateKey("A".into()))
        );
        assert_eq!(parse(b"A=1\0B=2\0C=3\0", 2), Err(TextError::TooManyKeys(2)));
        let long_key = format!("{}=1\0", "k".repeat(64));
        assert_eq!(parse(long_key.as_bytes(), 8), Err(TextError::KeyTooLong));
        let long_value = format!("k={}\0", "v".repeat(VALUE_LEN_MAX + 1));
        assert_eq!(
            parse(long_value.as_bytes(), 8),
            Err(TextError::ValueTooLong)
        );
    }

    #[test]
    fn encode_round_trip() {
        let pairs = vec![("X".to_string(), "y".to_string()), ("Z".into(), "".into())];
        assert_eq!(parse(&encode(&pairs), 8).unwrap(), pairs);
    }
}
