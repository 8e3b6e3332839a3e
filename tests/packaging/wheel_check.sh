#!/usr/bin/env bash
# The wheel on its own: build it, install it with its declared dependencies into a clean venv outside
# the checkout, and run the CLI from a folder outside the checkout. Run: `make test-wheel` (about 2-3
# minutes with a warm pip cache; not part of pytest's run).
#
# Checks: every non-.py file under lmcollect/ is in the wheel (and nothing but lmcollect/ and its
# dist-info); every lmcollect module imports without test-only packages; `lmcollect` resolves to the
# clean venv; `lmcollect --help`, a 5-step `lmcollect demo` and a short `lmcollect collect` succeed,
# building the tiny model into an empty cache (no downloads: Hugging Face is set offline); their output
# never names the checkout; `lmcollect bench` exits 2 with a one-line error pointing to a source checkout.
#
# Environment: PY (python for the venv, default python3), BUILD_PY (python with `build`, default the
# checkout's .venv, else a throwaway venv), KEEP_TMP=1 (keep the temp folder for a look after a failure).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PY:-python3}"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/lmcollect-wheel.XXXXXX")"
cleanup() {
    if [[ "${KEEP_TMP:-0}" == 1 ]]; then echo "wheel check: kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
case "$TMP/" in "$REPO"/*) echo "wheel check: temp folder $TMP lies inside the checkout" >&2; exit 1 ;; esac

start=$SECONDS
step() { echo "wheel check [$((SECONDS - start)) s]: $*"; }
fail() { echo "wheel check FAILED: $*" >&2; exit 1; }
# run a command with its output in a log; show the log's tail only when it fails
logged() {
    local log="$TMP/logs/$1.log"; shift
    if ! "$@" >"$log" 2>&1; then tail -n 40 "$log" >&2; fail "$* (log above)"; fi
}
mkdir -p "$TMP/logs" "$TMP/work" "$TMP/dist"

# ---- build from a copy of the sources: setuptools' build/ folder in the checkout may hold stale modules
step "building the wheel"
# (the top level without hidden entries, venvs and outputs: no wheel needs them, and they can be GBs)
entries=()
for path in "$REPO"/*; do
    name="$(basename "$path")"
    case "$name" in build | dist | runs | site | *.egg-info) continue ;; esac
    [[ -f "$path/pyvenv.cfg" ]] && continue
    entries+=("$name")
done
mkdir "$TMP/src"
tar -C "$REPO" -cf - --exclude=__pycache__ --exclude='*.pyc' "${entries[@]}" | tar -C "$TMP/src" -xf -
BUILD_PY="${BUILD_PY:-$REPO/.venv/bin/python}"
if ! "$BUILD_PY" -m build --version >/dev/null 2>&1; then
    BUILD_PY="$TMP/build-venv/bin/python"
    logged build-venv "$PY" -m venv "$TMP/build-venv"
    logged build-install "$BUILD_PY" -m pip install build
fi
logged build "$BUILD_PY" -m build --wheel --outdir "$TMP/dist" "$TMP/src"
WHEEL="$(ls "$TMP"/dist/lmcollect-*.whl)"

# ---- a clean venv: torch first (the local CPU wheel), then the wheel and its declared dependencies
step "installing $(basename "$WHEEL") into a clean venv"
VENV="$TMP/venv"
logged venv "$PY" -m venv "$VENV"
export PIP_NO_INPUT=1  # --no-compile below: modules are byte-compiled when first imported, a fraction of the whole
logged pip-torch "$VENV/bin/pip" install --no-compile torch==2.13.0
CONSTRAINTS=()
[[ -f "$REPO/constraints.txt" ]] && CONSTRAINTS=(-c "$REPO/constraints.txt")
logged pip-wheel "$VENV/bin/pip" install --no-compile "${CONSTRAINTS[@]}" "$WHEEL"

# ---- everything below runs outside the checkout, with nothing of it on the path
cd "$TMP/work"
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV
export LMCOLLECT_CACHE="$TMP/cache" HF_HOME="$TMP/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg
PYTHON="$VENV/bin/python"
LMC="$VENV/bin/lmcollect"

step "checking the wheel's files and imports"
logged contents "$PYTHON" - "$WHEEL" "$TMP/src/lmcollect" "$VENV" <<'EOF'
import importlib, pkgutil, sys, zipfile
from pathlib import Path

wheel, src, venv = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]).resolve()
names = set(zipfile.ZipFile(wheel).namelist())
data = sorted(
    "lmcollect/" + p.relative_to(src).as_posix()
    for p in src.rglob("*")
    if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
)
missing = [d for d in data if d not in names]
assert not missing, f"package data missing from the wheel (add to [tool.setuptools.package-data]): {missing}"
tops = {n.split("/")[0] for n in names}
stray = sorted(t for t in tops if t != "lmcollect" and not t.endswith(".dist-info"))
assert not stray, f"the wheel holds more than lmcollect/: {stray}"
print("package data in the wheel:", data)

import lmcollect

where = Path(lmcollect.__file__).resolve()
assert where.is_relative_to(venv), f"lmcollect imported from {where}, not from the clean venv {venv}"
failed = []
for module in pkgutil.walk_packages(lmcollect.__path__, "lmcollect."):
    try:
        importlib.import_module(module.name)
    except Exception as exc:
        failed.append(f"{module.name}: {type(exc).__name__}: {exc}")
assert not failed, "modules that do not import in the clean venv:\n" + "\n".join(failed)
test_only = sorted(m for m in ("pytest", "selenium", "benchmarks", "tests") if m in sys.modules)
assert not test_only, f"importing lmcollect pulled in {test_only}"
print("lmcollect at", where)
EOF
cat "$TMP/logs/contents.log"

step "lmcollect --help"
logged help "$LMC" --help
grep -q "collect" "$TMP/logs/help.log" || fail "lmcollect --help does not list its commands"

step "lmcollect demo --max-steps 5"
logged demo "$LMC" demo --max-steps 5 --warmup-steps 2 --num-eval-prompts 8 --num-collectors 1 \
    --output-dir "$TMP/work/runs" --no-progress
ls "$TMP"/work/runs/demo-*/summary.json >/dev/null 2>&1 || fail "lmcollect demo wrote no summary.json"

step "lmcollect collect"
logged collect "$LMC" collect --num-turns 8 --num-envs 4 --max-new-tokens 8 --output "$TMP/work/rollouts.parquet" \
    --no-progress
logged read-rollouts "$PYTHON" -c "
import pyarrow.parquet as pq, sys
n = pq.read_table(sys.argv[1]).num_rows
assert n >= 8, f'{n} rows, expected 8'" "$TMP/work/rollouts.parquet"

step "lmcollect bench (needs a source checkout)"
set +e
"$LMC" bench --quick >"$TMP/logs/bench.log" 2>&1
rc=$?
set -e
if [[ $rc != 2 ]] || ! grep -q "source checkout" "$TMP/logs/bench.log" || [[ $(wc -l <"$TMP/logs/bench.log") != 1 ]]; then
    cat "$TMP/logs/bench.log" >&2
    fail "lmcollect bench: expected exit status 2 and a one-line error naming the source checkout, got status $rc"
fi
cat "$TMP/logs/bench.log"

if grep -l -F "$REPO/" "$TMP"/logs/{contents,help,demo,collect,bench}.log; then
    fail "the installed package's output names the checkout $REPO (files above)"
fi
step "passed"
