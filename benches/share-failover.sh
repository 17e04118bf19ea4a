#!/bin/bash
# A node leaves the site (issue 42): three nodes in one share group on
# mosquitto (loopback) under 300 requests a second from 100 devices, each
# request with a 2 s deadline; one node is killed (kill -9), stopped
# (SIGTERM) or hung without a TCP reset (SIGSTOP), then comes back. Prints,
# for each fault, the replies each node sent per second around it (t_s 0 is
# the fault) and a summary: requests answered, within the deadline, and how
# long after the fault every request was answered by the other two. The
# runs are the tests in tests/integration/mqtt/share_failover.rs (about 30 s
# each, 2 minutes in all), which also assert the figures.
# Usage: benches/share-failover.sh [BIN], e.g.
#   cargo build --release && benches/share-failover.sh target/release/edgeinfer
# Without BIN: the debug build the tests build.
set -o pipefail
cd "$(dirname "$0")/.."
if [ -n "$1" ]; then export EDGEINFER_TEST_BIN=$(realpath "$1"); fi
timeout 600 cargo test --features failpoints --test integration share_failover -- --nocapture --test-threads 1 2>&1 \
  | grep -E '^share-(summary|timeline)|^test result|panicked|SKIPPED'
