#!/usr/bin/env bash
# Fully static release binaries of edgeinfer for x86-64 and arm64 gateways
# (musl libc, so one file runs on any Linux: Debian, Yocto, Jetson L4T,
# Raspberry Pi OS). Writes dist/edgeinfer-TARGET and prints its size.
#
#   cross/build.sh                                   # both targets
#   cross/build.sh aarch64-unknown-linux-musl        # one
#   cross/build.sh --small [TARGET...]               # the size profile: dist/edgeinfer-TARGET-small
#
# The default build optimises for speed (Cargo.toml `[profile.release]`,
# budget 32 MiB); `--small` builds `[profile.release-small]` for
# flash-constrained images (budget 20 MiB, slower: docs/BENCHMARKS.md).
#
# Needs the rustup targets (added here) and, on Debian, musl-tools and
# gcc-aarch64-linux-gnu for the C parts (mimalloc, ring). Users of cross-rs
# can run `cross build --release --target ...` instead (Cross.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
profile=release
suffix=
if [ "${1:-}" = --small ]; then profile=release-small; suffix=-small; shift; fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(x86_64-unknown-linux-musl aarch64-unknown-linux-musl)

need() {
    command -v "$1" >/dev/null || { echo "cross/build.sh: $1 not found; on Debian: apt-get install -y $2" >&2; exit 1; }
}
rustup target add "${targets[@]}" >/dev/null
mkdir -p dist
for target in "${targets[@]}"; do
    case "$target" in
        x86_64-unknown-linux-musl)
            need musl-gcc musl-tools
            export CC_x86_64_unknown_linux_musl=musl-gcc
            ;;
        aarch64-unknown-linux-musl)
            need aarch64-linux-gnu-gcc gcc-aarch64-linux-gnu
            export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_LINKER=aarch64-linux-gnu-gcc
            export CC_aarch64_unknown_linux_musl=aarch64-linux-gnu-gcc
            export AR_aarch64_unknown_linux_musl=aarch64-linux-gnu-ar
            ;;
        *) echo "cross/build.sh: $target is not a target this script knows" >&2; exit 2 ;;
    esac
    cargo build --profile "$profile" --locked --target "$target" --bin edgeinfer
    out="dist/edgeinfer-$target$suffix"
    cp "target/$target/$profile/edgeinfer" "$out"
    echo "$out: $(stat -c %s "$out") bytes; $(file -b "$out" | cut -d, -f1-2,4-5)"
done
