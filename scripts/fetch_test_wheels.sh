#!/usr/bin/env bash
# Fetch the wheels some tests read but never install (run once, where the network is allowed):
# sglang's wheel carries SGLang's determinism script, which tests/server/test_sglang_script.py runs
# against `detinf serve` with a two-file shim. Tests skip (saying so) when the wheel is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${DETINF_TEST_WHEELS:-${DETINF_CACHE_DIR:-$HOME/.cache/deterministic-inference}/test-wheels}"
mkdir -p "$dest"
.venv/bin/pip download "sglang==0.5.23" --no-deps --only-binary=:all: -d "$dest"
echo "wheels in $dest"
