#!/usr/bin/env bash
# The one-shot check for the day a GPU is lent (docs/performance.md, "The GPU check"): the device-aware tests with
# their tensors on the device, then bench_core.py on it (CUDA events; kernel launches and host syncs per call; eager
# and the compiled backend, kernel_backend: compiled, side by side), and
# one summary file, DIR/summary.json. Under 5 minutes on one GPU. Needs torch and this project only (run from the
# repository root, nothing installed): the tests also need pytest and hypothesis, installed from --wheels DIR
# (`pip download -d DIR pytest hypothesis pyyaml`, carried along) when they are missing; without them the tests are
# reported as not run and the benchmark still runs.
#
#   bash benchmarks/gpu_check.sh [--device cuda] [--out DIR] [--wheels DIR] [--quick]
#
# --quick: a few test cases and the two smallest bench shapes (what CI runs on the CPU, so the script cannot rot).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda OUT_DIR=gpu_check WHEELS="" QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT_DIR="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n 2,12p "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (allowed: --device, --out, --wheels, --quick)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)

if ! python -c "import pytest, hypothesis, yaml" 2>/dev/null && [ -n "$WHEELS" ]; then
  echo "gpu_check: installing pytest and hypothesis from $WHEELS" >&2
  python -m pip install -q --no-index --find-links "$WHEELS" pytest hypothesis pyyaml >&2
fi

tests_rc=-1
if python -c "import pytest, hypothesis, yaml" 2>/dev/null; then
  echo "gpu_check: the device-aware tests on $DEVICE" >&2
  if [ "$QUICK" = 1 ]; then
    selection=(tests/test_reference_equivalence.py::test_separate_rs_bounds_match_reference
               "tests/test_differential.py::test_cp1_entry_points_agree_on_the_test_device"
               tests/test_entry_points.py::test_fsdp_entry_point_equals_cp_entry_point_at_cp1
               tests/test_precision.py::test_ess_of_equal_weights_is_exactly_one)
  else
    selection=(tests/test_reference_equivalence.py tests/test_divergence.py tests/test_entry_points.py
               "tests/test_differential.py::test_cp1_entry_points_agree_on_the_test_device"
               tests/test_packed.py tests/test_precision.py tests/test_host.py)
  fi
  python -m pytest -q -p no:cacheprovider --device "$DEVICE" --junitxml "$OUT_DIR/tests.xml" "${selection[@]}" \
    > "$OUT_DIR/tests.log" 2>&1
  tests_rc=$?
  tail -3 "$OUT_DIR/tests.log" >&2
else
  echo "gpu_check: pytest, hypothesis or pyyaml missing (no --wheels): the tests are not run" >&2
fi

echo "gpu_check: bench_core.py --device $DEVICE" >&2
repeats=$([ "$QUICK" = 1 ] && echo 2 || echo 25)
python benchmarks/bench_core.py --device "$DEVICE" --repeats "$repeats" --json "$OUT_DIR/bench_core.json" \
  $([ "$QUICK" = 1 ] && echo --quick) > "$OUT_DIR/bench_core.log" 2> "$OUT_DIR/bench_core.err"
bench_rc=$?
grep -v "^USDT:" "$OUT_DIR/bench_core.log" >&2

python - "$OUT_DIR" "$DEVICE" "$tests_rc" "$bench_rc" "$(( $(date +%s) - started ))" <<'PY'
import json, platform, sys
from pathlib import Path
import xml.etree.ElementTree as ET
import torch

out, device, tests_rc, bench_rc, seconds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
tests = None
if (out / "tests.xml").exists():
    suite = ET.parse(out / "tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    tests = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    tests["failed"] = failed
bench = json.loads((out / "bench_core.json").read_text()) if (out / "bench_core.json").exists() else None
summary = {"device": device, "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "python": platform.python_version(), "seconds": seconds,
           "tests_rc": tests_rc, "tests": tests, "bench_rc": bench_rc, "bench": bench}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"gpu_check: {out / 'summary.json'} (tests rc {tests_rc}, bench rc {bench_rc}, {seconds} s)", file=sys.stderr)
PY
[ "$tests_rc" -le 0 ] && [ "$bench_rc" = 0 ]
