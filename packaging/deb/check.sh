#!/usr/bin/env bash
# Checks a package of packaging/deb/build.sh. Always: its control fields and
# contents (dpkg-deb), and that the binary inside is for its architecture.
# With --install (as root, on a machine of the package's architecture that
# can be changed: CI's): dpkg -i, every installed path, the unit verified by
# systemd-analyze and neither enabled nor started, `edgeinfer --help`,
# `config check` and `models verify` from the installed paths, then
# dpkg -r (config, user and state kept) and dpkg -P (all of them gone).
#
#   packaging/deb/check.sh dist/edgeinfer_0.1.0-1_arm64.deb
#   packaging/deb/check.sh --install dist/edgeinfer_0.1.0-1_amd64.deb
set -euo pipefail
install=false
if [ "${1:-}" = --install ]; then install=true; shift; fi
deb="${1:?usage: packaging/deb/check.sh [--install] DEB}"
fail() { echo "packaging/deb/check.sh: $deb: $*" >&2; exit 1; }
has() { grep -qx "$1" <<<"$listing" || fail "has no $1"; }

arch="$(dpkg-deb -f "$deb" Architecture)"
echo "$deb: $(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version) $arch, $(stat -c %s "$deb") bytes"
case "$arch" in
    amd64) machine=x86-64 ;;
    arm64) machine=aarch64 ;;
    *) fail "architecture $arch is not one edgeinfer is built for" ;;
esac
[ "$(dpkg-deb -f "$deb" Depends)" = adduser ] || fail "Depends is not adduser alone (a static binary links nothing)"
listing="$(dpkg-deb -c "$deb" | awk '{ print $6 }' | sed 's|^\./|/|')"
for path in /usr/bin/edgeinfer /etc/edgeinfer/edgeinfer.toml /usr/lib/systemd/system/edgeinfer.service \
    /usr/share/edgeinfer/models/digits/1/model.onnx /usr/share/edgeinfer/models/digits/1/golden.json \
    /usr/share/bash-completion/completions/edgeinfer /usr/share/zsh/vendor-completions/_edgeinfer \
    /usr/share/fish/vendor_completions.d/edgeinfer.fish /usr/share/doc/edgeinfer/README.md; do
    has "$path"
done
grep -q '^/usr/share/man/man1/edgeinfer-doctor\.1' <<<"$listing" || fail "has no man page for doctor"
grep -q '^/usr/share/man/man1/edgeinfer\.1' <<<"$listing" || fail "has no edgeinfer(1)"
dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles | grep -qx /etc/edgeinfer/edgeinfer.toml \
    || fail "/etc/edgeinfer/edgeinfer.toml is not a conffile"
unpacked="$(mktemp -d)"
trap 'rm -rf "$unpacked"' EXIT
dpkg-deb -x "$deb" "$unpacked"
file -b "$unpacked/usr/bin/edgeinfer" | grep -q "$machine.*statically linked\|static-pie linked.*$machine\|$machine.*static-pie" \
    || fail "usr/bin/edgeinfer is not a static $machine binary: $(file -b "$unpacked/usr/bin/edgeinfer")"
echo "$deb: contents, conffile and a static $machine binary: ok"
$install || exit 0

[ "$(id -u)" = 0 ] || fail "--install needs root"
[ "$arch" = "$(dpkg --print-architecture)" ] || fail "--install needs an $arch machine"
unit=/usr/lib/systemd/system/edgeinfer.service
dpkg -i "$deb"
getent passwd edgeinfer > /dev/null || fail "installing made no edgeinfer user"
[ "$(stat -c '%U %a' /var/lib/edgeinfer)" = "edgeinfer 700" ] || fail "/var/lib/edgeinfer is not the user's, 0700"
[ ! -e /etc/systemd/system/multi-user.target.wants/edgeinfer.service ] || fail "installing enabled the unit"
grep -q '^ExecStart=/usr/bin/edgeinfer serve --config /etc/edgeinfer/edgeinfer.toml$' "$unit" || fail "the unit runs something else"
grep -q '^User=edgeinfer$' "$unit" || fail "the unit does not run as edgeinfer"
systemd-analyze verify "$unit"
/usr/bin/edgeinfer --help | grep -q '^Usage: edgeinfer' || fail "edgeinfer --help"
runuser -u edgeinfer -- /usr/bin/edgeinfer config check /etc/edgeinfer/edgeinfer.toml
# As the service would: the installed config names the installed models.
(cd / && runuser -u edgeinfer -- /usr/bin/edgeinfer --config /etc/edgeinfer/edgeinfer.toml models verify --iterations 5) \
    | tee "$unpacked/verify.txt"
grep -q 'digits' "$unpacked/verify.txt" || fail "models verify listed no digits"

dpkg -r edgeinfer
[ ! -e /usr/bin/edgeinfer ] && [ ! -e "$unit" ] || fail "dpkg -r left the binary or the unit"
[ -f /etc/edgeinfer/edgeinfer.toml ] && [ -d /var/lib/edgeinfer ] && getent passwd edgeinfer > /dev/null \
    || fail "dpkg -r removed the config, the state or the user (only a purge may)"
dpkg -P edgeinfer
[ ! -e /etc/edgeinfer ] && [ ! -e /var/lib/edgeinfer ] || fail "dpkg -P left /etc/edgeinfer or /var/lib/edgeinfer"
! getent passwd edgeinfer > /dev/null || fail "dpkg -P left the edgeinfer user"
! dpkg -s edgeinfer > /dev/null 2>&1 || fail "dpkg -P left the package known to dpkg"
echo "$deb: installed, verified, removed and purged cleanly: ok"
