#!/bin/sh
# Lays out the image's whole file tree under DEST from a built `shimmer` binary: the binary
# (stripped), every shared library it needs and its program interpreter at their usual paths, a
# passwd/group entry for the unprivileged user (10001), /tmp and /data. Used by both of
# deploy/Containerfile's ways (inside the Rust image, and offline by deploy/image/build.sh), so
# the image is the same either way.
#
#   deploy/image/rootfs.sh BIN DEST        # LIB_ROOT=/usr/aarch64-linux-gnu for a cross-built BIN
#
# Must never: take a library from anywhere but the binary's own dependency list.
set -eu
BIN="$1"
DEST="$2"
STRIP="${STRIP:-strip}"
[ -x "$BIN" ] || { echo "rootfs.sh: $BIN is not an executable" >&2; exit 1; }
rm -rf "$DEST"
mkdir -p "$DEST/usr/local/bin" "$DEST/etc" "$DEST/tmp" "$DEST/data/cache"
cp "$BIN" "$DEST/usr/local/bin/shimmer"
"$STRIP" "$DEST/usr/local/bin/shimmer"

# copy_lib PATH: PATH (resolved through symlinks) at PATH's own location under DEST.
copy_lib() {
  mkdir -p "$DEST$(dirname "$1")"
  cp -L "$1" "$DEST$1"
}
if [ -n "${LIB_ROOT:-}" ]; then
  # Cross-built: the libraries named in the binary's dynamic section, from the cross sysroot,
  # put where the target's loader looks (Debian's multiarch directory for that architecture).
  interp="$(readelf -l "$BIN" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')"
  triplet="$(basename "$LIB_ROOT")"
  mkdir -p "$DEST$(dirname "$interp")" "$DEST/lib/$triplet"
  cp -L "$LIB_ROOT/lib/$(basename "$interp")" "$DEST$interp"
  for lib in $(readelf -d "$BIN" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    cp -L "$LIB_ROOT/lib/$lib" "$DEST/lib/$triplet/$lib"
  done
else
  for lib in $(ldd "$BIN" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'); do
    copy_lib "$lib"
  done
fi

printf 'root:x:0:0:root:/root:/sbin/nologin\nshimmer:x:10001:10001:shimmer:/data:/sbin/nologin\n' > "$DEST/etc/passwd"
printf 'root:x:0:\nshimmer:x:10001:\n' > "$DEST/etc/group"
chmod 1777 "$DEST/tmp"
chmod 0755 "$DEST/data" "$DEST/data/cache"
