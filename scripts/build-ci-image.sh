#!/usr/bin/env bash
# Build the small Debian image the container tests run ranks in (tests/integration/
# test_container_devcluster.py): debootstrap minbase bookworm plus python3 and numpy, unpacked
# into a directory, which is what Charliecloud's ch-run takes. Cached outside the checkout, so a
# rerun costs nothing; built into DIR.tmp and renamed, so an interrupted build never counts.
# Usage: bash scripts/build-ci-image.sh [DIR]     (default $HPCRING_CI_IMAGE or /var/cache/hpcring-ci-image)
#   HPCRING_CI_IMAGE_TIMEOUT  seconds the build may take (default 600)
set -euo pipefail
exec </dev/null
dir=${1:-${HPCRING_CI_IMAGE:-/var/cache/hpcring-ci-image}}
mirror=${HPCRING_DEBIAN_MIRROR:-http://deb.debian.org/debian}
limit=${HPCRING_CI_IMAGE_TIMEOUT:-600}
# bump when the recipe changes, so that a cached image of an older recipe is rebuilt
version=2
if [[ -x "$dir/usr/bin/python3" && "$(cat "$dir/.hpcring-image-ok" 2>/dev/null)" == "$version" ]]; then
    echo "build-ci-image.sh: $dir is built"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "build-ci-image.sh: debootstrap needs root; run: sudo $0 $dir" >&2
    exit 1
fi
missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v ch-run >/dev/null || missing+=(charliecloud-runtime)
if [[ ${#missing[@]} -gt 0 ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get -y -q -o DPkg::Lock::Timeout=300 install "${missing[@]}"
fi
start=$(date +%s)
rm -rf "$dir.tmp"
mkdir -p "$(dirname "$dir")"
# python3's stdlib package brings the shared libraries (libssl, libffi, zlib, ...) that a
# bind-mounted interpreter built on a Debian 12 host needs too (docs/containers.md)
timeout --kill-after=10 "$limit" debootstrap --variant=minbase --include=python3,python3-numpy \
    bookworm "$dir.tmp" "$mirror" > "$dir.log" 2>&1 || {
    echo "build-ci-image.sh: debootstrap failed or ran past ${limit}s; last lines of $dir.log:" >&2
    tail -n 20 "$dir.log" >&2
    exit 1
}
# smaller image, nothing the ranks need: package caches, docs, locales
rm -rf "$dir.tmp"/var/cache/apt/archives/*.deb "$dir.tmp"/var/lib/apt/lists/* \
       "$dir.tmp"/usr/share/doc "$dir.tmp"/usr/share/man "$dir.tmp"/usr/share/locale
# ch-run binds the host's /etc/hosts and /etc/resolv.conf only onto files the image has: without
# them the ranks cannot resolve the other nodes' names
touch "$dir.tmp/etc/hosts" "$dir.tmp/etc/resolv.conf"
echo "$version" > "$dir.tmp/.hpcring-image-ok"
rm -rf "$dir"
mv "$dir.tmp" "$dir"
echo "build-ci-image.sh: built $dir in $(( $(date +%s) - start )) s ($(du -sh "$dir" | cut -f1))"
