#!/usr/bin/env bash
# Builds the shimmer image offline with Debian's buildah: the release binary built on this
# machine (or SHIMMER_BIN), laid out by rootfs.sh, then deploy/Containerfile's `prebuilt` way —
# no registry is reached (the image is FROM scratch).
#
#   deploy/image/build.sh [--arch amd64|arm64] [--tag NAME]      # default localhost/shimmer:VERSION
#
# Needs root (or a user namespace buildah can use). BUILDAH_STORAGE_DRIVER (default vfs, which
# works everywhere, overlay where the kernel allows it). arm64 cross-compiles with Debian's
# gcc-aarch64-linux-gnu and rustup's aarch64 standard library.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
ARCH=amd64
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
TAG="localhost/shimmer:$VERSION"
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH="$2"; shift 2 ;;
    --tag) TAG="$2"; shift 2 ;;
    *) echo "usage: deploy/image/build.sh [--arch amd64|arm64] [--tag NAME]" >&2; exit 2 ;;
  esac
done
command -v buildah >/dev/null || { echo "error: buildah not found (Debian: apt-get install buildah)" >&2; exit 1; }
target="${CARGO_TARGET_DIR:-$ROOT/target}"
case "$ARCH" in
  amd64)
    BIN="${SHIMMER_BIN:-}"
    if [ -z "$BIN" ]; then
      cargo build --release --locked -p shimmer-coordinator --bin shimmer
      BIN="$target/release/shimmer"
    fi
    deploy/image/rootfs.sh "$BIN" deploy/image/rootfs ;;
  arm64)
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc \
      cargo build --release --locked -p shimmer-coordinator --bin shimmer --target aarch64-unknown-linux-gnu
    LIB_ROOT=/usr/aarch64-linux-gnu STRIP=aarch64-linux-gnu-strip \
      deploy/image/rootfs.sh "$target/aarch64-unknown-linux-gnu/release/shimmer" deploy/image/rootfs ;;
  *) echo "error: --arch is amd64 or arm64, not $ARCH" >&2; exit 2 ;;
esac
revision="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
# Docker's image format: OCI's has no HEALTHCHECK.
buildah --storage-driver "${BUILDAH_STORAGE_DRIVER:-vfs}" bud --isolation chroot --format docker --arch "$ARCH" \
  --build-arg ROOTFS=prebuilt --build-arg VERSION="$VERSION" --build-arg REVISION="$revision" \
  -f deploy/Containerfile -t "$TAG" .
echo "built $TAG ($ARCH)" >&2
