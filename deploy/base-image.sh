#!/usr/bin/env bash
# A local base image for the Dockerfile where Docker Hub cannot be reached: Debian bookworm
# (debootstrap, from the Debian mirror) with Python 3.11, venv, pip and the host's CA bundle.
#   bash deploy/base-image.sh [image-name]      (default dpfl-base:bookworm; needs root)
set -euo pipefail
name=${1:-dpfl-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
rootfs=$(mktemp -d)
trap 'umount "$rootfs/proc" 2>/dev/null || true; rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
mount --bind /proc "$rootfs/proc"
chroot "$rootfs" /bin/bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends python3 python3-venv python3-pip \
  ca-certificates >/dev/null && apt-get clean && rm -rf /var/lib/apt/lists/*"
umount "$rootfs/proc"
# pip in the image build reaches the registry with the host's trust store
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
rm -f "$rootfs/etc/resolv.conf"
tar -C "$rootfs" -c . | docker import - "$name" >/dev/null
echo "$name"
