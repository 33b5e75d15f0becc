"""``miles-mis analyze --metrics``: score centering's per-step series read from hand-made metrics files (the lab's
metrics.jsonl, W&B-style CSV and JSON exports), the section's numbers against hand-computed ones, what a file without
the series says, and bad files as one-line errors or counted skips."""

import json
import math
import statistics

import pytest
import torch

from cli_answers import analyze_cli, one_line_error

from miles_mis.analyze import lab_staleness, published, sc_metrics
from miles_mis.analyze.report import as_json as report_json
from miles_mis.analyze.report import figures
from miles_mis.analyze.report import files as report_files
from miles_mis.analyze.report import markdown as report_markdown
from miles_mis.analyze import analyze as run_analysis

SC_ROWS = published.with_topic("score_centering", published.load())
TAIL = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 3.5, 21.0, 4.0]  # steps 1..14
TRAIN_MASS = [0.90 + 0.005 * i for i in range(14)]
ROLLOUT_MASS = [0.95 - 0.01 * i for i in range(14)]
WEIGHT = [1.0, 0.99, 1.02, 0.97, 1.0, 1.01, 0.98, 1.0, 1.03, 0.96, 1.0, 0.9, 0.8, 1.1]
CORRECTION = [-0.01 * (i + 1) for i in range(14)]


def lab_rows(prefix="mis_sc_"):
    return [{"step": i + 1, "reward": 0.5, "raw_k3": 0.01, f"{prefix}tail_ratio": TAIL[i],
             f"{prefix}train_head_mass": TRAIN_MASS[i], f"{prefix}rollout_head_mass": ROLLOUT_MASS[i],
             f"{prefix}importance_weight": WEIGHT[i], f"{prefix}correction": CORRECTION[i]} for i in range(14)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_dump(directory):
    """A one-call, one-rank dump in miles' layout (4 sequences of 10 tokens)."""
    out = directory / "policy_loss_debug"
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        old = -torch.rand(10, generator=gen) * 2
        samples.append({"index": i, "total_length": 20, "response_length": 10, "train_log_probs": old.clone(),
                        "old_log_probs": old, "rollout_log_probs": old + 0.05 * torch.randn(10, generator=gen),
                        "advantages": torch.zeros(10), "local_loss_mask": torch.ones(10)})
    torch.save({"rank": 0, "call": 0, "samples": samples}, out / "rank_0_call_0.pt")
    return directory


# --------------------------------------------------------------------------- the numbers, by hand
def test_the_labs_metrics_jsonl_by_hand(tmp_path):
    metrics = sc_metrics.read_metrics(write_jsonl(tmp_path / "metrics.jsonl", lab_rows()))
    assert (metrics.format, metrics.rows, metrics.step_key, sorted(metrics.values)) == ("jsonl", 14, "step",
                                                                                       list(range(1, 15)))
    summary = sc_metrics.summarize(metrics)
    tail = summary["tail_ratio"]
    # the median of the first 10 steps' 1.0 .. 1.9 is (1.4 + 1.5) / 2; twice it is 2.9: step 12 (3.5) is the first
    # above it (step 11's 2.0 is not); step 13 (21) the first above 20
    assert tail["baseline_median"] == pytest.approx(1.45) and tail["baseline_steps"] == 10
    assert (tail["baseline_first_step"], tail["baseline_last_step"]) == (1, 10)
    assert tail["rise_threshold"] == pytest.approx(2.9)
    assert (tail["first_step_above_rise"], tail["first_step_above_limit"]) == (12, 13)
    assert (tail["max"], tail["max_step"], tail["last"], tail["last_step"]) == (21.0, 13, 4.0, 14)
    for name, values in (("train_head_mass", TRAIN_MASS), ("rollout_head_mass", ROLLOUT_MASS),
                         ("importance_weight", WEIGHT), ("correction", CORRECTION), ("tail_ratio", TAIL)):
        s = summary["series"][name]
        assert s["steps"] == 14 and (s["first"], s["first_step"], s["last"], s["last_step"]) == (values[0], 1,
                                                                                                   values[-1], 14)
        assert (s["min"], s["min_step"]) == (min(values), values.index(min(values)) + 1)
        assert (s["max"], s["max_step"]) == (max(values), values.index(max(values)) + 1)
        assert s["median"] == pytest.approx(statistics.median(values))
    assert [row["tail_ratio"] for row in summary["per_step"]] == TAIL
    assert summary["missing"] == [] and summary["nonfinite_skipped"] == 0 and summary["replaced"] == 0
    assert {item["key"] for item in summary["keys"].values()} == {f"mis_sc_{name}" for name in sc_metrics.SERIES}
    json.dumps(summary, allow_nan=False)


def test_our_names_are_the_adapters_and_miles_names_are_sc():
    from miles_mis.hosts import score_centering

    assert {f"mis_sc_{name}" for name in sc_metrics.SERIES} == set(score_centering.METRICS)
    assert sc_metrics.series_of("train/sc_tail_ratio") == ("tail_ratio", "miles")
    assert sc_metrics.series_of("train/mis_sc_importance_weight") == ("importance_weight", "miles_mis")
    assert sc_metrics.series_of("sc_correction") == ("correction", "miles")
    assert sc_metrics.series_of("my-run - train/sc_tail_ratio") == ("tail_ratio", "miles")
    for key in ("my-run - train/sc_tail_ratio__MIN", "train/sc_tail", "train/critic-sc_tail_ratio", "tail_ratio",
                "train/train_rollout_kl"):
        assert sc_metrics.series_of(key) is None


def test_a_wandb_style_csv_with_train_prefixes_by_hand(tmp_path):
    """A W&B history export: rollout rows (no train/step, no sc values) between the train rows; a NaN counted and
    skipped; the step is train/step, not _step."""
    lines = ["_step,train/step,rollout/step,rollout/raw_reward,train/sc_tail_ratio,train/sc_train_head_mass,"
             "train/sc_rollout_head_mass,train/sc_importance_weight,train/sc_correction"]
    step = 0
    for i, value in enumerate(TAIL):
        lines.append(f"{step},,{i},0.4,,,,,")
        shown = "NaN" if i == 4 else repr(value)
        lines.append(f"{step + 1},{i},,,{shown},{TRAIN_MASS[i]},{ROLLOUT_MASS[i]},{WEIGHT[i]},{CORRECTION[i]}")
        step += 2
    path = tmp_path / "history.csv"
    path.write_text("\n".join(lines) + "\n")
    summary = sc_metrics.summarize(sc_metrics.read_metrics(path))
    assert (summary["format"], summary["rows"], summary["rows_without_values"]) == ("csv", 28, 14)
    assert summary["step_key"] == "train/step" and (summary["first_step"], summary["last_step"]) == (0, 13)
    assert summary["nonfinite_skipped"] == 1 and summary["first_nonfinite"] == "line 11, train/sc_tail_ratio = nan"
    kept = TAIL[:4] + TAIL[5:]
    tail = summary["tail_ratio"]
    assert tail["steps"] == 13 and tail["baseline_median"] == pytest.approx(statistics.median(kept[:10]))
    assert tail["baseline_median"] == pytest.approx(1.55)  # of 1.0 1.1 1.2 1.3 1.5 | 1.6 1.7 1.8 1.9 2.0
    assert (tail["first_step_above_rise"], tail["first_step_above_limit"]) == (11, 12)  # 3.5 > 3.1 at train step 11
    assert summary["series"]["importance_weight"]["steps"] == 14  # the NaN row keeps its other values
    assert summary["keys"]["tail_ratio"] == {"key": "train/sc_tail_ratio", "names": "miles' sc_*"}


def test_a_json_export_and_a_chart_export(tmp_path):
    records = [{"_step": 10 + i, "train/sc_tail_ratio": v, "_runtime": 1.5, "_wandb": {"runtime": 2}}
               for i, v in enumerate(TAIL)]
    path = tmp_path / "history.json"
    path.write_text(json.dumps(records))
    summary = sc_metrics.summarize(sc_metrics.read_metrics(path))
    assert summary["format"] == "json" and summary["step_key"] == "_step"
    assert summary["tail_ratio"]["first_step_above_rise"] == 21 and summary["tail_ratio"]["max_step"] == 22
    assert summary["missing"] == ["train_head_mass", "rollout_head_mass", "importance_weight", "correction"]
    chart = tmp_path / "chart.csv"
    chart.write_text('"Step","run-7 - train/sc_tail_ratio","run-7 - train/sc_tail_ratio__MIN",'
                     '"run-7 - train/sc_tail_ratio__MAX"\n'
                     + "".join(f"{i},{v},{v - 0.1},{v + 0.1}\n" for i, v in enumerate(TAIL)))
    summary = sc_metrics.summarize(sc_metrics.read_metrics(chart))
    assert summary["step_key"] == "Step" and summary["series"]["tail_ratio"]["max"] == 21.0
    assert list(summary["keys"]) == ["tail_ratio"]


def test_repeated_steps_merge_and_count_replacements(tmp_path):
    rows = [{"step": 1, "mis_sc_tail_ratio": 1.0}, {"step": 2, "mis_sc_tail_ratio": 1.5},
            {"step": 2, "mis_sc_correction": -0.5}, {"step": 2, "mis_sc_tail_ratio": 1.25},
            {"step": 1, "reward": 0.5}]
    summary = sc_metrics.summarize(sc_metrics.read_metrics(write_jsonl(tmp_path / "m.jsonl", rows)))
    assert [(r["step"], r["tail_ratio"], r["correction"]) for r in summary["per_step"]] == [(1, 1.0, None),
                                                                                          (2, 1.25, -0.5)]
    assert summary["replaced"] == 1 and summary["first_replaced"] == "step 2, mis_sc_tail_ratio (line 4)"
    assert summary["rows_without_values"] == 1


# --------------------------------------------------------------------------- no series, partial series
def test_a_file_without_score_centering_gives_no_section_and_says_nothing_false(tmp_path):
    path = write_jsonl(tmp_path / "metrics.jsonl", [{"step": i, "reward": 0.1 * i, "raw_k3": 0.01} for i in range(5)])
    summary = sc_metrics.summarize(sc_metrics.read_metrics(path))
    assert summary["present"] is False and summary["steps"] == 0 and summary["rows_without_values"] == 5
    assert "tail_ratio" not in summary and "advice" not in summary
    lines = report_markdown.score_centering_section(summary, None)
    text = "\n".join(lines)
    assert "## Score centering" not in text
    assert text.startswith(f"_Metrics: Read `{path}` (JSON lines): 5 rows, none with a score-centering value")
    for claim in ("collapsed", "held", "tail ratio", "Published", "step 33", "safe"):
        assert claim not in text
    assert report_markdown.score_centering_section(None, None) == []


def test_a_file_with_only_the_tail_ratio_says_what_it_lacks(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"step": i + 1, "train/sc_tail_ratio": v} for i, v in enumerate(TAIL)])
    summary = sc_metrics.summarize(sc_metrics.read_metrics(path))
    text = "\n".join(report_markdown.score_centering_section(summary, None))
    assert ("- not in the file: train head mass (mis_sc_train_head_mass / sc_train_head_mass), rollout head mass "
            "(mis_sc_rollout_head_mass / sc_rollout_head_mass), importance weight (mis_sc_importance_weight / "
            "sc_importance_weight), correction (mis_sc_correction / sc_correction); nothing is shown for them.") in text
    assert "importance weight is exactly 1" not in text  # nothing said about a weight the file does not log
    header = [line for line in text.splitlines() if line.startswith("| step |")]
    assert header == ["| step | tail ratio |"]


def test_without_the_tail_ratio_the_advice_says_it_cannot_read_the_rise(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"step": 1, "sc_train_head_mass": 0.9, "sc_importance_weight": 1.0}])
    summary = sc_metrics.summarize(sc_metrics.read_metrics(path))
    assert summary["tail_ratio"] is None
    assert summary["advice"].startswith("This file has no tail ratio (mis_sc_tail_ratio or sc_tail_ratio) in its 1 "
                                        "steps with score-centering values")
    assert "importance weight is exactly 1" in summary["advice"]
    assert "| tail ratio | value | step |" not in "\n".join(report_markdown.score_centering_section(summary, None))


# --------------------------------------------------------------------------- the advice
@pytest.mark.parametrize("tail, rise, limit", [
    (TAIL, 12, 13),
    ([1.2] * 30, None, None),
    ([1.2] * 3, None, None),
    ([30.0] * 12, None, 1),
    ([1.2] * 10 + [2.5, 19.0, 19.5], 11, None),
])
def test_the_advice_says_what_was_measured_cites_the_outcomes_and_never_calls_a_run_safe(tmp_path, tail, rise, limit):
    path = write_jsonl(tmp_path / "m.jsonl", [{"step": i + 1, "mis_sc_tail_ratio": v, "mis_sc_importance_weight": 0.97}
                                              for i, v in enumerate(tail)])
    summary = sc_metrics.summarize(sc_metrics.read_metrics(path))
    text = summary["advice"]
    assert "safe" not in text.lower() and "no risk" not in text.lower()
    assert (summary["tail_ratio"]["first_step_above_rise"], summary["tail_ratio"]["first_step_above_limit"]) == (rise,
                                                                                                              limit)
    assert text.startswith(f"Measured in this file: the tail ratio over {len(tail)} steps (1–{len(tail)})")
    if rise is not None:
        assert f"first exceeded 2× that median at step {rise}" in text
    if limit is not None:
        assert f"20 at step {limit}" in text
    if rise is None and limit is None:
        assert f"No such rise in these {len(tail)} steps, up to step {len(tail)}: that is what this file" in text
    else:
        assert "score_centering_is: mis, score_centering_mis_low: 0.5, score_centering_mis_high: 5.0" in text
    if len(tail) < 10:
        assert f"over its first {len(tail)} steps (all it has: fewer than 10)" in text
    assert "importance weight is exactly 1" not in text
    for row in SC_ROWS:  # the collapse without a weight, the SC + MIS run that held and the null replication
        assert published.describe(row) in text


def test_the_advice_cites_the_three_score_centering_rows():
    ids = [row["id"] for row in SC_ROWS]
    assert ids == ["qwen36-35b-a3b-hetero-sc-alone-collapse", "qwen36-35b-a3b-hetero-sc-mis-held",
                   "marin-9291-score-centering-null-replication"]
    text = sc_metrics.advice({"steps": 40, "first_step": 1, "last_step": 40,
                              "tail_ratio": sc_metrics.tail_ratio_summary([(s, 1.2) for s in range(1, 41)])})
    assert "Qwen3.6-35B-A3B collapsed by step 33 at sc_tail_ratio 1.2–52, no k3 stated (Qwen3.6-35B-A3B mismatch " \
           "study, 2026-10-04)" in text
    assert "trained past step 220" in text and "a mean of -0.2 (95% interval -65.8 to +65.4)" in text
    assert "(marin-community/marin PR #9291, 2026-09-20)" in text
    assert "in the collapses cited the rise began within tens of steps (from about step 33 there)" in text


# --------------------------------------------------------------------------- bad files
def bad_files(tmp_path):
    d = tmp_path
    (d / "empty.jsonl").write_text("  \n")
    (d / "bad.jsonl").write_text('{"step": 1, "mis_sc_tail_ratio": 1.0}\n{"step": 2, "mis_sc_tail_ratio": \n')
    (d / "list.jsonl").write_text('{"step": 1, "mis_sc_tail_ratio": 1.0}\n\n[1, 2]\n')
    (d / "nostep.csv").write_text("train/sc_tail_ratio,rollout/step\n1.2,0\n")
    (d / "nostep.jsonl").write_text('{"step": 1, "mis_sc_tail_ratio": 1.0}\n{"reward": 0.5}\n')
    (d / "mixed.jsonl").write_text('{"train/step": 1, "_step": 5, "train/sc_tail_ratio": 1.0}\n'
                                   '{"_step": 6, "train/sc_tail_ratio": 1.1}\n')
    (d / "fracstep.jsonl").write_text('{"step": 1.5, "mis_sc_tail_ratio": 1.0}\n')
    (d / "nanstep.csv").write_text("step,train/sc_tail_ratio\n1,1.0\nnan,1.1\n")
    (d / "word.jsonl").write_text('{"step": 1, "mis_sc_tail_ratio": "high"}\n')
    (d / "bool.jsonl").write_text('{"step": 1, "mis_sc_tail_ratio": true}\n')
    (d / "both.jsonl").write_text('{"step": 1, "mis_sc_tail_ratio": 1.0}\n{"step": 2, "train/sc_tail_ratio": 1.0}\n')
    (d / "wide.csv").write_text("step,train/sc_tail_ratio\n1,1.0\n2,1.0,7\n")
    (d / "latin1.csv").write_bytes("step,train/sc_tail_ratio\n1,1.0 \xe9\n".encode("latin-1"))
    (d / "dict.json").write_text('{"summary": {"sc_tail_ratio": 3.0}}')  # a W&B summary, not a history
    (d / "array.json").write_text('[{"step": 1, "sc_tail_ratio": 1.0}, 3]')
    (d / "a_directory").mkdir()
    return {
        "empty.jsonl": "{p}: empty file: no metrics rows",
        "bad.jsonl": "{p}:2: not JSON (Expecting value at column 34)",
        "list.jsonl": "{p}:3: a JSON list, not an object of metrics",
        "nostep.csv": "{p}:1: no step column (one of step, train/step, _step, Step, global_step); the header has: "
                      "train/sc_tail_ratio, rollout/step",
        "nostep.jsonl": "{p}: line 2: no step (looked for step, train/step, _step, Step, global_step)",
        "mixed.jsonl": "{p}: line 2: no 'train/step' (the step of this file's earlier rows with score-centering "
                       "values)",
        "fracstep.jsonl": "{p}: line 1: step = 1.5 is not an integer step",
        "nanstep.csv": "{p}: line 3: step = 'nan' is not an integer step",
        "word.jsonl": "{p}: line 1: mis_sc_tail_ratio = 'high' is not a number",
        "bool.jsonl": "{p}: line 1: mis_sc_tail_ratio is a bool, not a number",
        "both.jsonl": "{p}: line 2: both 'mis_sc_tail_ratio' and 'train/sc_tail_ratio' give the tail ratio: keep "
                      "one run's (or one host's) series per file",
        "wide.csv": "{p}:3: 3 fields, but the header has 2",
        "latin1.csv": "{p}: unreadable: not UTF-8 text (byte 31: invalid continuation byte)",
        "dict.json": "{p}: line 1: no step (looked for step, train/step, _step, Step, global_step)",
        "array.json": "{p}: record 2 is a JSON int, not an object of metrics",
        "a_directory": "{p} is a directory, not a metrics file (--metrics FILE: a metrics.jsonl, a JSON export or "
                       "a CSV)",
        "missing.jsonl": "{p} does not exist (--metrics FILE: a metrics.jsonl, a JSON export or a CSV)",
    }


def test_bad_metrics_files_are_one_line_errors_naming_the_file_and_line(tmp_path, capsys):
    dump = write_dump(tmp_path / "dump")
    for name, message in bad_files(tmp_path).items():
        path = tmp_path / name
        with pytest.raises(ValueError) as caught:
            sc_metrics.read_metrics(path)
        assert str(caught.value) == message.format(p=path), name
        assert one_line_error(*analyze_cli(capsys, dump, "--metrics", path)[::2]) == message.format(p=path)


def test_a_nonfinite_value_is_a_counted_reported_skip(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"step": 1, "mis_sc_tail_ratio": 1.0},
                                              {"step": 2, "mis_sc_tail_ratio": math.inf, "mis_sc_correction": 0.1},
                                              {"step": 3, "mis_sc_tail_ratio": math.nan}])
    summary = sc_metrics.summarize(sc_metrics.read_metrics(path))
    assert summary["steps"] == 2 and summary["nonfinite_skipped"] == 2  # step 3 held nothing finite
    assert summary["first_nonfinite"] == "line 2, mis_sc_tail_ratio = inf"
    text = "\n".join(report_markdown.score_centering_section(summary, None))
    assert "- 2 NaN/inf values skipped, not replaced (first: line 2, mis_sc_tail_ratio = inf)." in text
    json.dumps(report_json.to_json({"warnings": []}, None, None, summary), allow_nan=False)


# --------------------------------------------------------------------------- the command and the report files
def test_the_command_finds_the_labs_metrics_jsonl_and_writes_the_section(tmp_path, capsys):
    dump = write_dump(tmp_path / "run")
    write_jsonl(dump / "metrics.jsonl", lab_rows())
    code, out, err = analyze_cli(capsys, dump, "--out-dir", tmp_path / "out")
    assert code == 0, err
    assert (f"score centering ({dump / 'metrics.jsonl'}, 14 steps): tail ratio first-10-step median 1.45, max 21 "
            "(step 13), last 4; above 2x the median: step 12; above 20: step 13") in out
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "## Score centering over training steps" in markdown
    assert f"Read `{dump / 'metrics.jsonl'}` (JSON lines, found in the run directory): 14 rows" in markdown
    assert "| first step above 2 × that median (2.9) |  | 12 |" in markdown
    assert "| first step above 20 |  | 13 |" in markdown
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["score_centering"]["tail_ratio"]["first_step_above_rise"] == 12
    if figures.figures_available():
        assert f"![score centering over training steps]({figures.SC_FIGURE})" in markdown
        assert data["figures"][-1] == figures.SC_FIGURE and (tmp_path / "out" / figures.SC_FIGURE).stat().st_size
    code, out, err = analyze_cli(capsys, dump)  # the Markdown on stdout holds the section too
    assert code == 0 and "## Score centering over training steps" in out


def test_an_explicit_metrics_file_wins_and_compare_refuses_it(tmp_path, capsys):
    dump = write_dump(tmp_path / "run")
    write_jsonl(dump / "metrics.jsonl", [{"step": 1, "reward": 0.2}])
    csv = tmp_path / "wandb.csv"
    csv.write_text("Step,train/sc_tail_ratio\n" + "".join(f"{i},{v}\n" for i, v in enumerate(TAIL)))
    code, out, err = analyze_cli(capsys, dump, "--metrics", csv)
    assert code == 0, err
    assert f"Read `{csv}` (CSV): 14 rows; 14 steps" in out and "found in the run directory" not in out
    assert one_line_error(*analyze_cli(capsys, dump, "--compare", dump, "--metrics", csv)[::2]) == (
        f"--metrics {csv}: the score-centering section is part of the single-dump report, not of --compare: "
        "analyse the dump alone with --metrics")
    code, out, err = analyze_cli(capsys, dump, "--compare", dump)  # the found metrics.jsonl is not read for it
    assert code == 0 and "Score centering" not in out and "_Metrics:" not in out


def test_the_python_api_reads_metrics_only_when_asked(tmp_path):
    dump = write_dump(tmp_path / "run")
    write_jsonl(dump / "metrics.jsonl", lab_rows())
    assert run_analysis(dump).score_centering is None
    assert run_analysis(dump, find_metrics=True).score_centering["tail_ratio"]["max"] == 21.0
    other = write_jsonl(tmp_path / "other.jsonl", lab_rows("sc_"))
    assert run_analysis(dump, metrics=other).score_centering["keys"]["tail_ratio"]["key"] == "sc_tail_ratio"


def test_without_figures_the_section_stands_and_no_png_is_written(tmp_path, capsys):
    dump = write_dump(tmp_path / "run")
    metrics = write_jsonl(tmp_path / "m.jsonl", lab_rows())
    code, _, err = analyze_cli(capsys, dump, "--metrics", metrics, "--out-dir", tmp_path / "out", "--no-figures")
    assert code == 0, err
    assert not list((tmp_path / "out").glob("*.png"))
    assert "## Score centering over training steps" in (tmp_path / "out" / "report.md").read_text()


def test_the_figure_has_four_panels_and_the_two_lines(tmp_path):
    pytest.importorskip("matplotlib")
    summary = sc_metrics.summarize(sc_metrics.read_metrics(write_jsonl(tmp_path / "m.jsonl", lab_rows())))
    path = figures.write_score_centering_figure(summary, tmp_path / "figs")
    assert path.name == figures.SC_FIGURE and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = figures._score_centering_figure(summary)
    tail_axis, mass_axis = drawn.axes[0], drawn.axes[1]
    assert len(drawn.axes) == 4
    levels = sorted(line.get_ydata()[0] for line in tail_axis.get_lines()[1:])
    assert levels == pytest.approx([2.9, 20.0])
    assert len(mass_axis.get_lines()) == 2
    only_tail = sc_metrics.summarize(sc_metrics.read_metrics(write_jsonl(
        tmp_path / "t.jsonl", [{"step": 1, "sc_tail_ratio": 1.0}])))
    texts = [t.get_text() for ax in figures._score_centering_figure(only_tail).axes[1:] for t in ax.texts]
    assert texts == ["not in the metrics file"] * 3


def test_summary_text_and_json_without_metrics_are_unchanged(tmp_path):
    summary = sc_metrics.summarize(sc_metrics.read_metrics(write_jsonl(tmp_path / "m.jsonl", lab_rows())))
    line = report_files.sc_line(summary)
    assert line.endswith("above 2x the median: step 12; above 20: step 13")
    assert report_json.to_json({"warnings": []}, None, None)["score_centering"] is None


# --------------------------------------------------------------------------- staleness: marin 8955
def test_a_dump_with_stale_samples_cites_the_published_staleness_outcome():
    stats = {"by_lag": [{"bucket": "0", "sequences": 4, "tokens": 40, "k3": 1e-4, "k1": 0.0,
                         "mean_abs_log_ratio": 0.01},
                        {"bucket": "2", "sequences": 4, "tokens": 40, "k3": 1e-2, "k1": 0.0,
                         "mean_abs_log_ratio": 0.1}],
             "lag_attribution": {"numerics_k3": 1e-4, "stale_buckets": [{"bucket": "2", "k3": 1e-2,
                                                                          "staleness_share": 0.99}]}}
    text = report_markdown.staleness_evidence(stats)
    (row,) = published.with_topic("staleness", published.load())
    assert row["id"] == "marin-8955-qwen3-0.6b-stale-ppo-vs-tis"
    # the published run first, then the lab's paired runs at a version lag (the published weigh more)
    said = published.staleness_sentence(published.load())
    assert said == "Published runs with stale rollouts: " + published.cite(row)
    assert text == said + " " + lab_staleness.sentence() and lab_staleness.sentence().startswith("The lab's paired")
    assert "plain PPO completed 2 of 128 answers" in text and "(marin-community/marin issue #8955, 2026-09-08)" in text
    assert text in report_markdown.render_markdown(stats, None, None, title="t", figures=[])
    assert report_json.to_json(stats, None, None)["staleness_evidence"] == text
    fresh = {"by_lag": stats["by_lag"][:1], "lag_attribution": {"numerics_k3": 1e-4, "stale_buckets": []}}
    assert report_markdown.staleness_evidence(fresh) is None
    assert "Published runs with stale rollouts" not in report_markdown.render_markdown(fresh, None, None, title="t")
