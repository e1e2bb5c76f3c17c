#!/usr/bin/env bash
# Installs what the container tests and the Docker sidecar example need on a fresh
# Debian 12 machine (as root): rootful podman and buildah from Debian's packages, runc
# (crun fails on this machine's hybrid cgroup setup), debootstrap to make a local base
# image (no image registry is reachable here), podman-compose via the venv (pyproject's
# test extras). Called by .ci/setup.sh; without root it only says what is missing, and
# the container tests then skip with that reason.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="podman buildah debootstrap runc fuse-overlayfs slirp4netns uidmap containernetworking-plugins"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "ckptfs setup: installing$missing (container tests)" >&2
    apt-get update -qq
    # shellcheck disable=SC2086  # one word per package
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  else
    echo "ckptfs setup: container tests will skip: missing apt packages:$missing" \
         "(run as root or: sudo apt-get install$missing)" >&2
  fi
fi
