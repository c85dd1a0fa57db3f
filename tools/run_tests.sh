#!/usr/bin/env bash
# The whole test suite (what `make test` runs): notebooks clean and library in sync, every notebook under
# nbdev_test in the smoke profile, and the pytest suite. Ends with the plain line "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ -z "${RAG_LAB_DATA:-}" ] && [ -d ../shared/data ]; then export RAG_LAB_DATA="$(cd ../shared/data && pwd)"; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# keep Jupyter, IPython and matplotlib state out of $HOME; no model hub, ever
export IPYTHONDIR="$tmp/ipython" JUPYTER_CONFIG_DIR="$tmp/jupyter" JUPYTER_RUNTIME_DIR="$tmp/jupyter-runtime" \
       MPLCONFIGDIR="$tmp/mpl" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# independent tests on every core (pytest-xdist; TEST_WORKERS=1 for one process): each test goes to whichever worker
# is free, except that the tests of a file sharing a fixture built once per file stay on one worker (tests/conftest.py
# marks them; --dist loadgroup honours the marks). Without pytest-xdist installed, the suite runs in one process.
workers=${TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
parallel=()
if [ "$workers" -gt 1 ] && "$VENV/bin/python" -c 'import xdist' 2>/dev/null; then
  parallel=(-n "$workers" --dist loadgroup)
  # one compute thread per worker (llama.cpp and torch follow RAG_LAB_LLM_THREADS): N workers on N cores, never N x N
  # threads spinning against each other; the user's own setting wins
  export RAG_LAB_LLM_THREADS="${RAG_LAB_LLM_THREADS:-1}"
fi
# a test still running after TEST_TIMEOUT seconds fails, named, instead of holding the whole run until CI kills it
timeout=()
if "$VENV/bin/python" -c 'import pytest_timeout' 2>/dev/null; then timeout=(--timeout "${TEST_TIMEOUT:-1800}"); fi
t0=$(date +%s)
"$VENV/bin/python" -m pytest tests -q -p no:cacheprovider --durations=40 --junitxml="$tmp/junit.xml" "${parallel[@]}" "${timeout[@]}" "$@"
rc=$?
echo "pytest took $(( $(date +%s) - t0 )) s in $([ ${#parallel[@]} -gt 0 ] && echo "$workers workers" || echo "one process")"
"$VENV/bin/python" - "$tmp/junit.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
try: suites = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError): print("0 passed, 1 failed"); sys.exit()
suites = [suites] if suites.tag == 'testsuite' else list(suites)
get = lambda k: sum(int(s.get(k, 0)) for s in suites)
failed = get('failures') + get('errors')
print(f"{get('tests') - failed - get('skipped')} passed, {failed} failed" + (f", {get('skipped')} skipped" if get('skipped') else ''))
PY
exit $rc
