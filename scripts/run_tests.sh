#!/usr/bin/env bash
# Runs the test suite: `all` (the default; what `make test` and CI run) is every test, fast and slow (GPU tests skip
# themselves without a GPU); `fast` (`make test-fast`) is the tests not marked slow. tests/tiers.py says which are.
# pytest's exit code 5 ("no tests collected") means the suite is broken: report it as a failure on purpose.
# The 30 slowest test phases are printed at the end: where CI's time goes, in every run's log; so are the tests
# outside the slow tier that took over tests/tiers.py's limit (a new slow test shows there).
# Plugin autoload is off: pytest rewrites the asserts of every module of every installed package that declares a
# pytest plugin (langsmith, hypothesis, schemathesis, anyio: hundreds of modules), and where bytecode is not written
# (PYTHONDONTWRITEBYTECODE) it does so again on every run. The suite needs only hypothesis's plugin, loaded by name.
set -u
PY=${1:-.venv/bin/python}
TIER=${2:-all}
case "$TIER" in
  all) SELECT=() ;;
  fast) SELECT=(-m "not slow") ;;
  *) echo "run_tests: unknown tier '$TIER' (all or fast)" >&2; exit 2 ;;
esac
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -q -p no:cacheprovider -p _hypothesis_pytestplugin --durations=30 \
  ${SELECT[@]+"${SELECT[@]}"} tests
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; the suite is broken" >&2
  exit 1
fi
exit "$rc"
