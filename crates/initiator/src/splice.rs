//! Output with write data spliced in: encoded PDU bytes in one buffer, and pieces of shared
//! write data that belong between them, sent together with one `writev` instead of copied into
//! the buffer first (a benchmark's host writing 1 MiB per command spent a quarter of its CPU on
//! that copy, and the target waited while it ran).

/// Slices one `writev` takes (Linux's IOV_MAX is 1,024); the rest go in the next.
pub(crate) const SLICES_MAX: usize = 1024;

/// What is left to send from byte `from` of `out` with `pieces` in it (each `(at, bytes)`:
/// `bytes` go before byte `at` of `out`, in order), as slices in order (into `slices`, at most
/// [`SLICES_MAX`]); returns how many bytes are left in all.
pub(crate) fn gather<'a>(
    out: &'a [u8],
    pieces: impl Iterator<Item = (usize, &'a [u8])>,
    from: usize,
    slices: &mut Vec<std::io::IoSlice<'a>>,
) -> usize {
    let mut skip = from;
    let mut total = 0;
    let mut push = |piece: &'a [u8]| {
        if skip >= piece.len() {
            skip -= piece.len();
            return;
        }
        let rest = &piece[skip..];
        skip = 0;
        total += rest.len();
        if slices.len() < SLICES_MAX {
            slices.push(std::io::IoSlice::new(rest));
        }
    };
    let mut at = 0;
    for (piece_at, bytes) in pieces {
        push(out.get(at..piece_at).unwrap_or(&[]));
        push(bytes);
        at = piece_at;
    }
    push(out.get(at..).unwrap_or(&[]));
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What is left after any number of bytes sent is the rest of the output with the
    /// pieces in their places, whatever piece the cut falls in.
    #[test]
    fn gather_resumes_at_any_byte() {
        let data: Vec<u8> = (100..200u8).collect();
        let out: Vec<u8> = (0..10u8).collect();
        let pieces = [(3, &data[0..5]), (7, &data[50..52])];
        let whole: Vec<u8> =
            [&out[..3], &data[0..5], &out[3..7], &data[50..52], &out[7..]].concat();
        for from in 0..=whole.len() {
            let mut slices = Vec::new();
            let left = gather(&out, pieces.iter().copied(), from, &mut slices);
            let got: Vec<u8> = slices.iter().flat_map(|s| s.iter().copied()).collect();
            assert_eq!(left, whole.len() - from);
            assert_eq!(got, whole[from..], "from {from}");
        }
    }
}
