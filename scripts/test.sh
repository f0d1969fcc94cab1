#!/usr/bin/env bash
# Install everything (scripts/setup.sh), then run the test suite. Extra arguments go to pytest.
#   bash scripts/test.sh            # everything (about 14-15 minutes on the 2-core CI machines)
#   bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
PY=${PYTHON:-$(command -v python3 || command -v python)}
# Lint first (check only; `ruff check --fix` / `ruff format` are for developers, not CI).
"$PY" -m ruff check ds_cobalt tests benchmarks examples
# pytest's own exit code is the result; 5 (no tests collected) fails too.
OMP_NUM_THREADS=1 exec "$PY" -m pytest -ra --durations=15 tests "$@"
