#!/usr/bin/env bash
# `cargo test --workspace --no-fail-fast`, with its test binaries in two lanes side by side.
#
#   scripts/cargo-tests.sh
#
# The binaries named in SLOW_LANE start a Ceph cluster and cut its networks: they spend their
# minutes waiting on the cluster and on the timeouts they check, the machine nearly idle. They
# run one after another beside every other binary of the workspace (one after another too),
# which halves the step's time without two cargo processes (cargo holds its build directory
# for as long as it runs tests). Each binary runs as cargo runs it: from its package's
# directory, with no arguments. Every binary runs even if one fails; then the doc tests.
# Prints each binary's output as cargo does, the slow lane's after the other's, and a total;
# exits non-zero if any binary failed.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOG_TAG=cargo-tests
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"
cd "$ROOT"

SLOW_LANE=(rbd netcut)
OUT=$(mktemp -d /tmp/ferrosan-cargo-tests.XXXXXX)
trap 'rm -rf "$OUT"' EXIT

# Every test binary of the workspace, as "NAME<TAB>PACKAGE DIR<TAB>EXECUTABLE" lines.
cargo test --workspace --no-run --message-format=json 2>"$OUT/build.err" | python3 -c '
import json, os, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], os.path.dirname(m["manifest_path"]), m["executable"], sep="\t")
' >"$OUT/binaries" || { cat "$OUT/build.err" >&2; die "the tests did not build"; }
[[ -s $OUT/binaries ]] || { cat "$OUT/build.err" >&2; die "cargo listed no test binary"; }

# run_lane LANE WANT: the binaries of SLOW_LANE (WANT slow) or the others (WANT rest), one
# after another; their output in OUT/LANE.log, failures in OUT/LANE.failed.
run_lane() {
    local lane=$1 want=$2 name dir exe
    : >"$OUT/$lane.failed"
    while IFS=$'\t' read -r name dir exe; do
        printf '     Running %s (%s)\n' "$name" "${exe#"$ROOT"/}"
        echo "$name" >>"$OUT/ran"
        (cd "$dir" && "$exe" </dev/null) 2>&1 || echo "$name" >>"$OUT/$lane.failed"
    done < <(awk -F'\t' -v slow="$(IFS='|'; echo "${SLOW_LANE[*]}")" -v want="$want" \
        'BEGIN { n = split(slow, s, "|"); for (i = 1; i <= n; i++) in_slow[s[i]] = 1 }
         (want == "slow") == ($1 in in_slow)' "$OUT/binaries") >"$OUT/$lane.log"
}

for name in "${SLOW_LANE[@]}"; do
    grep -q "^$name"$'\t' "$OUT/binaries" || die "no test binary named $name (SLOW_LANE is stale)"
done
run_lane slow slow &
SLOW=$!
trap 'kill -TERM "$SLOW" 2>/dev/null; wait "$SLOW"; rm -rf "$OUT"' EXIT
run_lane rest rest
cat "$OUT/rest.log"
cargo test --workspace --no-fail-fast --doc 2>&1 | tee "$OUT/doc.log" || echo doc-tests >>"$OUT/rest.failed"
wait "$SLOW"
trap 'rm -rf "$OUT"' EXIT
cat "$OUT/slow.log"

# The totals over every binary, as libtest printed them.
cat "$OUT/rest.log" "$OUT/doc.log" "$OUT/slow.log" | awk '
    /^test result:/ { p += $4; f += $6; i += $8; n++ }
    END { printf "cargo tests: %d binaries, %d passed, %d failed, %d ignored\n", n, p, f, i }'
# A lane that lost a binary must not pass for one that ran them all.
ran=$(wc -l <"$OUT/ran") listed=$(wc -l <"$OUT/binaries")
((ran == listed)) || die "ran $ran of the $listed test binaries"
failed=$(cat "$OUT/rest.failed" "$OUT/slow.failed")
[[ -z $failed ]] || die "failed: ${failed//$'\n'/ }"
