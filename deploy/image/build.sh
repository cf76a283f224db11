#!/usr/bin/env bash
# make image: the control image (lmcache_controller, lmcache_router, lmcache_server; no torch) on a
# base built here from Debian's packages with debootstrap, so no container registry is needed.
#
#   bash deploy/image/build.sh            # base (once), then the control image
#   BASE_IMAGE=... CONTROL_IMAGE=... DEBIAN_MIRROR=... BUILD_CA_BUNDLE=... bash deploy/image/build.sh
#
# Needs root, podman, runc and debootstrap (make image installs Debian's). Prints each image's size.
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=$(sed -n 's/^__version__ = "\(.*\)".*/\1/p' lmcache_p2p/__init__.py)
BASE_IMAGE=${BASE_IMAGE:-localhost/lmcache-p2p-base:bookworm}
CONTROL_IMAGE=${CONTROL_IMAGE:-localhost/lmcache-p2p-control:$VERSION}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# What pip in the build trusts: the host's CA bundle (a TLS proxy's CA is in it where there is one).
BUILD_CA_BUNDLE=${BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
# No systemd here to manage cgroups or keep a journal: podman's own cgroupfs manager and an event
# file; runc, which runs on hybrid cgroup hierarchies (crun refuses them). The build runs its steps
# in a chroot (--isolation chroot), so it needs no container runtime at all.
PODMAN=(podman --cgroup-manager=cgroupfs --events-backend=file --runtime runc)

if "${PODMAN[@]}" image exists "$BASE_IMAGE"; then
    echo "==> base $BASE_IMAGE exists"
else
    echo "==> building the base $BASE_IMAGE: Debian bookworm (minbase) with Python 3, from $DEBIAN_MIRROR"
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$DEBIAN_MIRROR" \
        > "$root.log" 2>&1 || { tail -20 "$root.log"; exit 1; }
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
    tar -C "$root" -c . | "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" > /dev/null
    rm -rf "$root" "$root.log"
    trap - EXIT
fi

echo "==> building $CONTROL_IMAGE"
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
cp pyproject.toml README.md "$context/"
cp "$BUILD_CA_BUNDLE" "$context/build-ca.crt"
cp -r lmcache_p2p csrc "$context/"
find "$context" -name __pycache__ -prune -exec rm -rf {} +
"${PODMAN[@]}" build --isolation chroot --network host --build-arg "BASE=$BASE_IMAGE" \
    -f deploy/image/Containerfile.control -t "$CONTROL_IMAGE" "$context" > /dev/null
"${PODMAN[@]}" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "lmcache-p2p-(base|control)" | sed 's/^/    /'
