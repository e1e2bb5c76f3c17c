#!/usr/bin/env bash
# Makes the base image the Dockerfile starts FROM (debian:bookworm-slim) from the Debian
# archive this machine's apt uses, with debootstrap, for machines that reach Debian's packages but no image
# registry. Does nothing when an image with that name is already there (it is kept by
# podman between runs). Needs root, podman and debootstrap (.ci/setup-containers.sh).
#
#   docker/local-base.sh [IMAGE]     (default docker.io/library/debian:bookworm-slim)
set -euo pipefail
IMAGE="${1:-docker.io/library/debian:bookworm-slim}"
# The Debian archive this machine's apt is configured with (deb822 URIs: lines, or one-line deb
# entries), the first whose path ends in /debian; CKPTFS_DEBIAN_MIRROR overrides it.
apt_mirror() {
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
    | awk '/^[[:space:]]*URIs:/ {for (i = 2; i <= NF; i++) print $i}
           /^[[:space:]]*deb[[:space:]]/ {for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; break}}' \
    | grep -E '/debian/?$' | head -1 || true
}
MIRROR="${CKPTFS_DEBIAN_MIRROR:-$(apt_mirror)}"
if podman image exists "$IMAGE"; then
  exit 0
fi
if [ -z "$MIRROR" ]; then
  echo "local-base: no Debian archive in this machine's apt sources: set CKPTFS_DEBIAN_MIRROR" >&2
  exit 1
fi
rootfs="$(mktemp -d /var/tmp/ckptfs-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
echo "local-base: debootstrap bookworm from $MIRROR into $rootfs (about a minute)" >&2
debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 || {
  tail -20 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"
# as in Debian's own slim images: no package lists, no apt cache
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" -c . | podman import \
  --change 'CMD ["bash"]' \
  --change 'LABEL org.opencontainers.image.description="debian bookworm minbase, made locally by ckptfs docker/local-base.sh"' \
  - "$IMAGE" >/dev/null
echo "local-base: made $IMAGE" >&2
