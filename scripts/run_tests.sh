#!/usr/bin/env bash
# Runs the test suite: `all` (the default; what `make test` and CI run) is every test, fast and slow (GPU tests skip
# themselves without a GPU); `fast` (`make test-fast`) is the tests not marked slow. tests/tiers.py says which are.
# pytest's exit code 5 ("no tests collected") means the suite is broken: report it as a failure on purpose.
# The 30 slowest test phases are printed at the end: where CI's time goes, in every run's log; so are the tests
# outside the slow tier that took over tests/tiers.py's limit (a new slow test shows there).
# Plugin autoload is off: pytest rewrites the asserts of every module of every installed package that declares a
# pytest plugin (langsmith, hypothesis, schemathesis, anyio: hundreds of modules), and where bytecode is not written
# (PYTHONDONTWRITEBYTECODE) it does so again on every run. The suite needs only hypothesis's plugin, loaded by name.
# The tests run in one pytest-xdist worker per core (at most 4, and at most one per 6 GiB of available memory: a
# real-dims test holds a model of a few GiB), each worker pinned to its own cores and taking whole modules, the
# heaviest first (tests/workers.py). TEST_WORKERS=N sets the number; 1 runs everything in this one process.
set -u
PY=${1:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-$("$PY" -c 'import os
mem = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemAvailable")) // (6 << 20)
print(max(1, min(len(os.sched_getaffinity(0)), 4, mem)))')}
if [ "$WORKERS" -gt 1 ]; then
  PARALLEL=(-p xdist.plugin -n "$WORKERS" --dist loadfile --no-loadscope-reorder)
else
  PARALLEL=()
fi
TIER=${2:-all}
case "$TIER" in
  all) SELECT=() ;;
  fast) SELECT=(-m "not slow") ;;
  *) echo "run_tests: unknown tier '$TIER' (all or fast)" >&2; exit 2 ;;
esac
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -q -p no:cacheprovider -p _hypothesis_pytestplugin --durations=30 \
  ${PARALLEL[@]+"${PARALLEL[@]}"} ${SELECT[@]+"${SELECT[@]}"} tests
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; the suite is broken" >&2
  exit 1
fi
exit "$rc"
