#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ briefly (default 20 s each) and fails on the first crash.
# For CI: installs cargo-fuzz only when missing; uses RUSTC_BOOTSTRAP=1 so the stable toolchain
# accepts the nightly flags cargo-fuzz passes (sanitizer, coverage instrumentation).
#
#   scripts/fuzz-smoke.sh                 # all targets, 20 s each, two at a time
#                                         # (FUZZ_PARALLEL=N: N at a time)
#   FUZZ_SECONDS=600 scripts/fuzz-smoke.sh session login
#
# Corpora persist in fuzz/corpus/<target> (git-ignored), crashes land in fuzz/artifacts/<target>.
set -euo pipefail

cd "$(dirname "$0")/../fuzz"
seconds="${FUZZ_SECONDS:-20}"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz-smoke: installing cargo-fuzz" >&2
    cargo install --locked cargo-fuzz
fi

export RUSTC_BOOTSTRAP=1
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo fuzz list)
fi

# -a: debug assertions on (cargo fuzz turns them off with -O): the cores' invariants are
# what the fuzzers check.
cargo fuzz build -O -a

# fuzz TARGET: one target for $seconds; its verdict in its own file (runs go two at a time).
fuzz() {
    local t=$1
    mkdir -p "corpus/$t"
    echo "fuzz-smoke: $t for ${seconds}s" >&2
    if cargo fuzz run -O -a "$t" "corpus/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        2> >(grep -E 'panicked|ERROR|SUMMARY|stat::number_of_executed_units|Test unit written' >&2); then
        echo ok >"$verdicts/$t"
    else
        echo failed >"$verdicts/$t"
    fi
}

# A libFuzzer run uses one core: two at a time on the test machine's two.
parallel=${FUZZ_PARALLEL:-$(($(nproc) < 2 ? 1 : 2))}
verdicts=$(mktemp -d)
trap 'rm -rf "$verdicts"' EXIT
running=0
for t in "${targets[@]}"; do
    fuzz "$t" &
    running=$((running + 1))
    if ((running >= parallel)); then
        wait -n || true
        running=$((running - 1))
    fi
done
wait
failed=()
for t in "${targets[@]}"; do
    [[ $(cat "$verdicts/$t" 2>/dev/null) == ok ]] || failed+=("$t")
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz-smoke: crashes in: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz-smoke: ${#targets[@]} targets, ${seconds}s each, no crash" >&2
