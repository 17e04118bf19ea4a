#!/usr/bin/env bash
# The integer ops on arm64: their property tests against the scalar
# references, and the MLPerf Tiny agreement test, built for
# aarch64-unknown-linux-musl and run under qemu-user. There the products
# run on our byte tiles (`sdot`, and I8MM's `usmmla` and `sudot`: qemu
# has both, and the property tests run each) or tract-linalg's NEON
# kernels, and depthwise convolutions on our NEON kernel, so this is what
# proves those paths bit-exact. Correctness only: timing under qemu means
# nothing.
#
#   cross/test-arm64.sh
#
# Needs gcc-aarch64-linux-gnu and qemu-user-static (Debian).
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-musl
rustup target add "$target" >/dev/null
command -v qemu-aarch64-static >/dev/null || { echo "cross/test-arm64.sh: apt-get install -y qemu-user-static" >&2; exit 1; }
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_musl=aarch64-linux-gnu-gcc
export AR_aarch64_unknown_linux_musl=aarch64-linux-gnu-ar
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_RUNNER=qemu-aarch64-static
cargo test --locked --target "$target" --lib model::quant::
cargo test --locked --target "$target" --test integration mlperf::every_mlperf_tiny_model_matches_onnxruntime_and_litert
