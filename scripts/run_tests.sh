#!/usr/bin/env bash
# Runs the whole test suite (fast and slow; GPU tests skip themselves without a GPU).
# pytest's exit code 5 ("no tests collected") means the suite is broken: report it as a failure on purpose.
# The 30 slowest test phases are printed at the end: where CI's time goes, in every run's log.
set -u
PY=${1:-.venv/bin/python}
"$PY" -m pytest -q -p no:cacheprovider --durations=30 tests
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; the suite is broken" >&2
  exit 1
fi
exit "$rc"
