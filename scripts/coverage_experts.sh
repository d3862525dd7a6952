#!/usr/bin/env bash
# Coverage of moeserve/experts/ (the store, its host tier, the loader, transfers, policies, traces...) by
# tests/experts and tests/test_offload*.py, measured in the tests' child processes too (coverage's subprocess
# patch: every Python the tests start is measured and its data combined), printed per module with the missed lines.
#
#   scripts/coverage_experts.sh                 # everything, slow tests included (CI runs those too)
#   scripts/coverage_experts.sh -m "not slow"   # extra arguments go to pytest
#
# Environment: PYTHON (default .venv/bin/python), COVERAGE_OUT (a folder for the data and the HTML report;
# default a new temporary folder). Exits with pytest's status when the tests fail, after printing the report.
set -u
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-.venv/bin/python}
if ! "$PY" -c "import coverage, sys; sys.exit(tuple(map(int, coverage.__version__.split('.')[:2])) < (7, 10))"; then
  echo "coverage_experts: needs coverage >= 7.10 in $PY (pip install -e '.[dev]')" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the tests' child processes import this tree, measured too
OUT=${COVERAGE_OUT:-$(mktemp -d -t moeserve-coverage.XXXXXX)}
mkdir -p "$OUT"
RC="$OUT/coveragerc"
cat > "$RC" <<EOF
[run]
source_pkgs = moeserve.experts
branch = true
parallel = true
patch = subprocess
data_file = $OUT/.coverage

[report]
show_missing = true
skip_empty = true
precision = 1

[html]
directory = $OUT/html
EOF
rm -f "$OUT"/.coverage*
"$PY" -m coverage run --rcfile="$RC" -m pytest -q -p no:cacheprovider tests/experts tests/test_offload*.py "$@"
status=$?
if [ "$status" -ge 128 ]; then
  echo "coverage_experts: the test run was killed (signal $((status - 128)); out of memory?): its coverage data is lost, no report" >&2
  exit "$status"
fi
"$PY" -m coverage combine --quiet --rcfile="$RC" || exit 2
echo
echo "coverage of moeserve/experts/ (statements and branches; tests/experts + tests/test_offload*.py, subprocesses included):"
"$PY" -m coverage report --rcfile="$RC"
"$PY" -m coverage html --quiet --rcfile="$RC" && echo "HTML report: $OUT/html/index.html"
if [ "$status" -eq 5 ]; then
  echo "coverage_experts: pytest collected no tests" >&2
  exit 1
fi
exit "$status"
