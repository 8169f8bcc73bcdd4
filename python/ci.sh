#!/usr/bin/env bash
# The Python package's CI: from a clean clone, a fresh virtualenv, the
# wheel built with maturin and installed from the file, mypy on the stubs,
# and pytest on memory, file, PostgreSQL and Redis (the tests start their
# own throwaway servers on loopback; a missing server binary fails them,
# it never skips a backend), the example, the two-language race and the
# conformance suite against a deliberately broken store.
#
# AGENTSTATE_PY_PROFILE=release builds an optimized wheel (the default,
# dev, reuses what the Rust tests compiled and keeps CI short).
set -euo pipefail
cd "$(dirname "$0")"
start=$SECONDS
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
export CARGO_TERM_COLOR=never
profile="${AGENTSTATE_PY_PROFILE:-dev}"
case "$profile" in
  dev) outdir=debug ;;
  *) outdir="$profile" ;;
esac
say() { printf '\n--- python/ci.sh: %s (%ss)\n' "$1" "$((SECONDS - start))"; }

say "virtualenv"
python3 --version
python3 -m venv --clear .venv
# shellcheck disable=SC1091
. .venv/bin/activate
pip install --quiet --disable-pip-version-check "maturin>=1.5,<2" "pytest>=7" "mypy>=1.8"
# pinned, the framework the seeds describe, is the judge of the seeds'
# protocol (tests/test_pinned_*.py): a test dependency at a pinned
# version, never a dependency of the package.
pip install --quiet --disable-pip-version-check "pinned[postgres]==0.16.0"

say "wheel ($profile profile)"
rm -rf dist
maturin build --profile "$profile" --out dist
ls -l dist
pip install --quiet --disable-pip-version-check --force-reinstall --no-deps dist/agentstate_rs-*.whl
# The tests import the installed wheel, never the source tree.
python -c 'import agentstate_rs, sys; assert "site-packages" in agentstate_rs.__file__, agentstate_rs.__file__; print(agentstate_rs.__file__)'

say "the two-language test's Rust side (examples/race.rs)"
cargo build --profile "$profile" -p agentstate-py --example race
export AGENTSTATE_RACE_BIN="${CARGO_TARGET_DIR:-$PWD/../target}/$outdir/examples/race"

say "mypy --strict on the stubs and a usage file"
mypy --strict typing/usage.py

say "pytest"
python -m pytest tests -ra -p no:cacheprovider --junitxml=dist/junit.xml
# Nothing skipped: every backend ran.
python - <<'PY'
import xml.etree.ElementTree as ET
root = ET.parse("dist/junit.xml").getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
skipped, tests = int(suite.get("skipped")), int(suite.get("tests"))
per = {}
for case in suite.iter("testcase"):
    cls = case.get("classname", "").rsplit(".", 1)[-1]
    for backend in ("Memory", "File", "Postgres", "Redis"):
        if cls.startswith(f"Test{backend}"):
            per[backend] = per.get(backend, 0) + 1
print("conformance tests per backend:", per)
assert skipped == 0, f"{skipped} tests were skipped"
assert all(per.get(b, 0) > 0 for b in ("Memory", "File", "Postgres", "Redis")), per
PY

say "done"
