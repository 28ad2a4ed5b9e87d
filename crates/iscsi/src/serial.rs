//! RFC 1982 serial number arithmetic on 32-bit sequence numbers (CmdSN, StatSN, DataSN, R2TSN).

/// `a < b` in serial arithmetic. Undefined pairs (exactly 2^31 apart) compare as not-less.
pub fn lt(a: u32, b: u32) -> bool {
    a != b && b.wrapping_sub(a) < (1 << 31)
}

/// `a <= b` in serial arithmetic.
pub fn le(a: u32, b: u32) -> bool {
    a == b || lt(a, b)
}

/// Whether `sn` lies in the window `[low, high]` (inclusive) under serial arithmetic.
pub fn in_window(sn: u32, low: u32, high: u32) -> bool {
    le(low, sn) && le(sn, high)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordering_wraps() {
        assert!(lt(1, 2));
        assert!(!lt(2, 1));
        assert!(!lt(5, 5));
        assert!(lt(u32::MAX, 0));
        assert!(lt(u32::MAX - 10, 5));
        assert!(!lt(5, u32::MAX - 10));
        assert!(le(7, 7));
        // Exactly half the space apart is undefined: never "less" either way.
        assert!(!lt(0, 1 << 31) || !lt(1 << 31, 0));
    }

    #[test]
    fn window() {
        assert!(in_window(10, 10, 20));
        assert!(in_window(20, 10, 20));
        assert!(!in_window(21, 10, 20));
        assert!(!in_window(9, 10, 20));
        assert!(in_window(1, u32::MAX - 1, 5));
        assert!(!in_window(6, u32::MAX - 1, 5));
        // Empty window: high just below low.
        assert!(!in_window(10, 10, 9));
    }
}
