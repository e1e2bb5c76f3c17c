#!/usr/bin/env bash
# Installs everything ckptfs and its tests need on a fresh Debian machine (as root):
# apt packages for FUSE, then a virtual environment with the package and its test extras.
# --bench: also what `make bench` needs: libaio-dev, the bench extra (matplotlib, deepspeed),
# and DeepSpeed's async_io/utils ops compiled once (~10 min on 2 cores; cached in
# ~/.cache/torch_extensions). Where deepspeed cannot be installed, matplotlib alone is
# installed and the benchmarks skip FastPersist, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
BENCH=0
for arg in "$@"; do
  case "$arg" in
    --bench) BENCH=1 ;;
    *) echo "usage: $0 [--bench]" >&2; exit 2 ;;
  esac
done
PKGS="fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv e2fsprogs util-linux attr"
[ "$BENCH" = 1 ] && PKGS="$PKGS g++ libaio-dev"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  else
    echo "ckptfs setup: missing apt packages:$missing (run as root or: sudo apt-get install$missing)" >&2
    exit 1
  fi
fi
# rootful podman and friends for the Docker sidecar tests (without root: a note, and they skip)
bash .ci/setup-containers.sh
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || {
  echo "ckptfs setup: Python 3.11+ is required ($("$PY" --version))" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c 'import pyfuse3, trio, torch, crc32c, blake3, prometheus_client, rich' || { echo "ckptfs setup: install failed" >&2; exit 1; }
if [ "$BENCH" = 1 ]; then
  "$VENV/bin/pip" install -q --disable-pip-version-check -e ".[test,bench]" 2>&1 | grep -v "^WARNING: Location" || true
  if ! "$VENV/bin/python" -c 'import deepspeed' >/dev/null 2>&1; then
    echo "ckptfs setup: deepspeed did not install; benchmarks will skip FastPersist" >&2
    "$VENV/bin/pip" install -q --disable-pip-version-check "matplotlib>=3.8" "py-spy>=0.3.14" 2>&1 | grep -v "^WARNING: Location" || true
  fi
  "$VENV/bin/python" -c 'import matplotlib' || { echo "ckptfs setup: matplotlib install failed" >&2; exit 1; }
  "$VENV/bin/python" -c 'import deepspeed' >/dev/null 2>&1 && {
    "$VENV/bin/python" benchmarks/fastpersist.py --build || echo "ckptfs setup: benchmarks will skip FastPersist" >&2; }
fi
