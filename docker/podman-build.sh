#!/usr/bin/env bash
# Builds the sidecar and the example trainer images with rootful podman, on a machine
# like the project's: no image registry (the base image is made locally from Debian's
# packages by docker/local-base.sh), pip through the host's CA bundle, and torch's CPU
# wheel taken from a local directory when one holds it.
#
#   docker/podman-build.sh [TAG]   -> localhost/ckptfs:TAG, localhost/ckptfs-trainer:TAG
#                                     (default TAG: latest)
# With Docker and a registry, plain `docker build` does the same (see docker/Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."
export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/docker/containers.conf}"
TAG="${1:-latest}"
docker/local-base.sh
args=(--pull=never --format docker --network host -f docker/Dockerfile)
ca=/etc/ssl/certs/ca-certificates.crt
if [ -f "$ca" ]; then
  args+=(--volume "$ca:/host-ca.crt:ro" --build-arg PIP_CERT=/host-ca.crt)
fi
wheels="${CKPTFS_WHEELS:-/opt/wheels}"
wheel="$(find "$wheels" -maxdepth 1 -name 'torch-*+cpu-cp311-*.whl' 2>/dev/null | sort -V | tail -1)"
if [ -n "$wheel" ]; then
  version="$(basename "$wheel" | cut -d- -f2)"
  args+=(--volume "$wheels:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels
         --build-arg TORCH_INDEX_URL= --build-arg "TORCH_SPEC=torch==$version")
fi
podman build "${args[@]}" --target ckptfs -t "localhost/ckptfs:$TAG" .
podman build "${args[@]}" --target trainer -t "localhost/ckptfs-trainer:$TAG" .
