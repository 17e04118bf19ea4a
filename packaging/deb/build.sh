#!/usr/bin/env bash
# Debian packages of edgeinfer for amd64 and arm64, made from the static
# binaries of cross/build.sh: dist/edgeinfer_VERSION-1_ARCH.deb.
#
#   packaging/deb/build.sh                              # amd64 and arm64
#   packaging/deb/build.sh aarch64-unknown-linux-musl   # one
#
# What goes in is listed in Cargo.toml ([package.metadata.deb]); the
# maintainer scripts are packaging/deb/postinst and postrm. This script
# (re)builds the binaries (a no-op when they are fresh), writes the unit,
# the shell completions and the man pages into target/deb-assets/, then runs
# `cargo deb --no-build` per target. Needs cargo-deb (`cargo install
# cargo-deb --locked`) and what cross/build.sh needs.
set -euo pipefail
cd "$(dirname "$0")/../.."
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(x86_64-unknown-linux-musl aarch64-unknown-linux-musl)
command -v cargo-deb >/dev/null || { echo "packaging/deb/build.sh: cargo-deb not found; cargo install cargo-deb --locked" >&2; exit 1; }

# The completions and man pages come from a binary this host runs; they are
# the same for every target (one set of clap definitions).
host_target="$(uname -m)-unknown-linux-musl"
build=("${targets[@]}")
[[ " ${targets[*]} " == *" $host_target "* ]] || build+=("$host_target")
cross/build.sh "${build[@]}"
host_bin="target/$host_target/release/edgeinfer"

assets=target/deb-assets
rm -rf "$assets" && mkdir -p "$assets/completions" "$assets/man"
"$host_bin" completions bash > "$assets/completions/edgeinfer.bash"
"$host_bin" completions zsh > "$assets/completions/_edgeinfer"
"$host_bin" completions fish > "$assets/completions/edgeinfer.fish"
"$host_bin" manpages "$assets/man" > /dev/null

# The unit of systemd/ with the package's paths: the binary in /usr/bin
# (/usr/local is the administrator's), run as the system user the postinst
# makes (its state in /var/lib/edgeinfer, deleted by a purge) instead of a
# dynamic one.
unit="$assets/edgeinfer.service"
{
    echo "# edgeinfer under systemd, installed by the edgeinfer package. Edit"
    echo "# /etc/edgeinfer/edgeinfer.toml, run \`edgeinfer doctor\`, then:"
    echo "#   systemctl enable --now edgeinfer"
    sed -e '1,/^\[Unit\]/{/^#/d}' \
        -e 's|^ExecStart=/usr/local/bin/edgeinfer |ExecStart=/usr/bin/edgeinfer |' \
        -e 's|^DynamicUser=yes$|User=edgeinfer\nGroup=edgeinfer|' \
        systemd/edgeinfer.service
} > "$unit"
grep -q '^ExecStart=/usr/bin/edgeinfer serve ' "$unit" && grep -q '^User=edgeinfer$' "$unit" \
    && ! grep -q '^DynamicUser' "$unit" \
    || { echo "packaging/deb/build.sh: systemd/edgeinfer.service changed shape; update the rewrite above" >&2; exit 1; }

for target in "${targets[@]}"; do
    cargo deb --no-build --no-strip --target "$target" --output dist/ | tail -n 1
done
