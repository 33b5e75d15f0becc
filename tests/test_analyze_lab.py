"""analyze v2 end to end on real lab dumps: `miles-mis train --dump-details`, then `miles-mis analyze` with
--out-dir, --write-config and --compare, as a user without a cluster would."""

import json
import subprocess
import sys

import pytest

from miles_mis import MisConfig
from miles_mis.lab.train import parse_args, train

REQUIRED = ("files", "sequences", "tokens", "nonfinite_fraction", "k3", "by_position", "by_rollout_prob", "by_length",
            "by_call", "candidates", "recommendation")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Two 4-step lab runs: an fp32 engine (no mismatch) and a bf16 + int8 engine that is 2 steps stale."""
    root = tmp_path_factory.mktemp("lab")
    for name, engine in (("fp32", ["--rollout-dtype", "fp32"]),
                         ("bf16", ["--rollout-dtype", "bf16", "--rollout-weight-quant", "int8",
                                   "--rollout-staleness", "2"])):
        train(parse_args([*engine, "--steps", "4", "--prompts-per-step", "4", "--sft-steps", "10", "--quiet",
                          "--out-dir", str(root / name / "run"), "--dump-details", str(root / name / "dumps")]))
    return root


def cli(*argv):
    return subprocess.run([sys.executable, "-m", "miles_mis.cli", *map(str, argv)], capture_output=True, text=True)


def test_lab_dump_analysed_end_to_end(dumps):
    out, config = dumps / "report", dumps / "mis.yaml"
    run = cli("analyze", dumps / "bf16" / "dumps", "--out-dir", out, "--write-config", config)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert "recommendation" in run.stdout and len(run.stdout.splitlines()) < 12  # a short summary on stdout
    report = json.loads((out / "report.json").read_text())
    assert all(key in report for key in REQUIRED)
    assert report["files"] == 8 and report["tokens"] > 0 and report["k3"] > 1e-4  # 4 steps x 2 minibatches
    assert [row["call"] for row in report["by_call"]] == list(range(8))
    assert report["by_position"][0]["bucket"] == "0 (first token)"
    text = (out / "report.md").read_text()
    for section in ("## Whole-dump statistics", "### By token position", "### By rollout probability",
                    "### By response length", "### Over calls", "## Recommendation"):
        assert section in text, section
    pytest.importorskip("matplotlib")
    assert len(list(out.glob("*.png"))) == 5 and all(p.stat().st_size > 5000 for p in out.glob("*.png"))
    # the written config: loads, passes check-config, and is the recommendation
    loaded = MisConfig.from_yaml(config)
    recommended = MisConfig.from_dict(report["recommendation"]["config"])
    assert (loaded.tis_level, loaded.tis_mode, loaded.tis_upper_bound) == \
        (recommended.tis_level, recommended.tis_mode, recommended.tis_upper_bound)
    check = cli("check-config", config, "--use-tis")
    assert check.returncode == 0, check.stderr
    assert "# miles-mis analyze" in config.read_text()


def test_fp32_engine_agrees_and_compare_shows_the_difference(dumps):
    one = cli("analyze", dumps / "fp32" / "dumps", "--out-dir", dumps / "fp32_report")
    assert one.returncode == 0, one.stderr
    fp32 = json.loads((dumps / "fp32_report" / "report.json").read_text())
    assert fp32["k3"] < 1e-6  # the engine's fp32 KV-cache path against the trainer's fp32 forward: rounding only
    assert fp32["recommendation"]["name"] is not None and "agrees" in fp32["recommendation"]["reasons"][0]
    both = cli("analyze", dumps / "fp32" / "dumps", "--compare", dumps / "bf16" / "dumps", "--out-dir",
               dumps / "compare")
    assert both.returncode == 0, both.stderr
    comparison = json.loads((dumps / "compare" / "comparison.json").read_text())
    assert {"a", "b", "differences"} <= set(comparison)
    assert any("k3" in json.dumps(d) for d in comparison["differences"])
    assert "**" in (dumps / "compare" / "comparison.md").read_text()  # highlighted cells
