"""benchmarks/gpu_check.sh, the one-shot check for a lent GPU, run here on the CPU (``--device cpu --quick``) so that
the script, the tests' --device option and bench_core.py's device mode cannot rot before a GPU shows up."""

import json
import subprocess

from conftest import REPO


def test_gpu_check_runs_on_the_cpu_and_writes_one_summary(tmp_path):
    out = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--quick", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["tests_rc"] == 0 and summary["bench_rc"] == 0
    assert summary["tests"]["tests"] == 4 and summary["tests"]["failures"] == 0 and summary["tests"]["failed"] == []
    rows = summary["bench"]["rows"]
    assert [(r["num_seqs"], r["max_len"]) for r in rows] == [(64, 512), (1024, 128)]
    for row in rows:
        assert row["list_ms"] > 0 and row["packed_ms"] > 0 and row["padded_ms"] > 0
        assert row["list_compiled_ms"] > 0 and row["packed_compiled_ms"] > 0 and row["first_compiled_call_s"] > 0
        for entry in ("list", "packed", "list_compiled", "packed_compiled"):
            counts = row["counts"][entry]
            # on a CPU: no CUDA kernel or sync; one scalar read per call (what a GPU would wait for)
            assert counts["kernel_launches"] == 0 and counts["host_syncs"] == 0 and counts["scalar_reads"] >= 1
            assert counts["aten_events"] > 100
    assert summary["bench"]["compiled_fallbacks"] == []
    assert "summary.json" in out.stderr


def test_gpu_check_refuses_an_unknown_argument():
    out = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--devcie", "cpu"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "unknown argument --devcie" in out.stderr
