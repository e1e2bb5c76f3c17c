#!/usr/bin/env bash
# Installs ckptfs's OS integration (as root): the mount(8) helper /sbin/mount.ckptfs
# (also umount(8)'s, as /sbin/umount.fuse.ckptfs and umount.ckptfs) and the systemd unit template
# ckptfs@.service, with an example configuration in /etc/ckptfs.
#
#   mount/install.sh [--ckptfs PATH]     PATH: the ckptfs command the helper runs
#                                        (default: the one on $PATH)
# DESTDIR=DIR installs under DIR instead of / (packaging, tests).
set -euo pipefail
cd "$(dirname "$0")"
ckptfs=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ckptfs) ckptfs="$2"; shift 2 ;;
    *) echo "usage: $0 [--ckptfs PATH]" >&2; exit 2 ;;
  esac
done
[ -n "$ckptfs" ] || ckptfs="$(command -v ckptfs || true)"
if [ -z "$ckptfs" ] || [ ! -x "$ckptfs" ]; then
  echo "install.sh: cannot find the ckptfs command: pass --ckptfs /path/to/venv/bin/ckptfs" >&2
  exit 1
fi
ckptfs="$(cd "$(dirname "$ckptfs")" && pwd)/$(basename "$ckptfs")"
root="${DESTDIR:-}"
install -d "$root/sbin" "$root/etc/systemd/system" "$root/etc/ckptfs"
sed "s|^DEFAULT_CKPTFS = None.*|DEFAULT_CKPTFS = \"$ckptfs\"  # set by mount/install.sh|" mount.ckptfs \
  > "$root/sbin/mount.ckptfs.new"
chmod 0755 "$root/sbin/mount.ckptfs.new"
mv "$root/sbin/mount.ckptfs.new" "$root/sbin/mount.ckptfs"
# umount(8) runs umount.fuse.ckptfs when the mount has an entry in /run/mount/utab
# (mount with -o uhelper=ckptfs), umount.ckptfs for uhelper=ckptfs as a non-root user
ln -sfn mount.ckptfs "$root/sbin/umount.fuse.ckptfs"
ln -sfn mount.ckptfs "$root/sbin/umount.ckptfs"
install -m 0644 'ckptfs@.service' "$root/etc/systemd/system/ckptfs@.service"
install -m 0644 ckptfs.conf.example "$root/etc/ckptfs/ckptfs.conf.example"
echo "installed $root/sbin/mount.ckptfs (runs $ckptfs), $root/sbin/umount.{fuse.,}ckptfs," \
     "$root/etc/systemd/system/ckptfs@.service, $root/etc/ckptfs/ckptfs.conf.example"
if [ -z "$root" ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
fi
