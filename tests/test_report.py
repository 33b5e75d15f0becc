"""The analyze report (Markdown, JSON, stdout summary, comparison) and its figures, on hand-made statistics dicts
in the schema of ``miles_mis.analyze.statistics`` and hand-made advisor results."""

import copy
import json
import math
import sys
from dataclasses import dataclass

import pytest
import yaml

from miles_mis.analyze.report import as_json as report_json
from miles_mis.analyze.report import comparison, figures, formatting
from miles_mis.analyze.report import configs as report_configs
from miles_mis.analyze.report import files as report_files
from miles_mis.analyze.report import markdown as report_markdown
from miles_mis.analyze.report import sentences as report_sentences
from miles_mis.analyze.report import tables as report_tables
from miles_mis.config import MisConfig


SECTIONS = ("## Whole-dump statistics", "## Where the mismatch lives", "### By token position",
            "### By rollout probability", "### By response length", "### Over calls (training time)",
            "### Distribution of the token log ratio", "### Worst sequences",
            "## Candidate configurations on these tokens", "## Recommendation")


@dataclass(frozen=True)
class Rec:
    """The advisor's Recommendation fields (name, config, reasons)."""
    name: object
    config: object
    reasons: list


def make_statistics(k3_per_call=(1e-4, 1.1e-4, 1.3e-4, 2e-4, 3e-4, 4e-4)):
    calls = [{"call": c, "sequences": 8, "tokens": 320, "k3": k, "k1": -k / 2, "max_abs_log_ratio": 0.5 + c,
              "nonfinite_fraction": 0.0} for c, k in enumerate(k3_per_call)]
    half = len(calls) // 2
    first = sum(k3_per_call[:half]) / half if half else None
    second = sum(k3_per_call[half:]) / (len(calls) - half)
    mean_call = (len(calls) - 1) / 2
    mean_k3 = sum(k3_per_call) / len(calls)
    sxx = sum((c - mean_call) ** 2 for c in range(len(calls)))
    slope = (sum((c - mean_call) * (k - mean_k3) for c, k in enumerate(k3_per_call)) / sxx) if sxx else None
    magnitudes = [10.0 ** (e / 2) for e in range(-8, 3)]
    edges = [-m for m in reversed(magnitudes)] + magnitudes
    counts = [0, 1, 3, 10, 40, 120, 300, 200, 100, 20] + [5] + [30, 90, 210, 310, 110, 35, 12, 2, 1, 0]
    return {
        "files": 4, "calls": len(calls), "sequences": 48, "tokens": 1920, "usable_tokens": 1900,
        "nonfinite_fraction": 0.01041666, "nonfinite_engine_fraction": 0.01041666, "nonfinite_trainer_fraction": 0.0,
        "k1": -6.2e-05, "k3": 0.000123456, "chi2_token": 0.000251, "mean_abs_log_ratio": 0.0123456,
        "max_abs_log_ratio": 5.4321, "fraction_ratio_above_2": 0.0005263, "fraction_ratio_below_half": None,
        "catastrophic_fraction": 0.0, "seq_product_outside_half_two_fraction": 0.0625, "mean_response_length": 40.0,
        "by_position": [
            {"bucket": "0", "start": 0, "end": 1, "tokens": 48, "k3": 0.00456789, "k1": -0.002,
             "mean_abs_log_ratio": 0.0811},
            {"bucket": "[1, 2)", "start": 1, "end": 2, "tokens": 48, "k3": 2e-4, "k1": -1e-4,
             "mean_abs_log_ratio": 0.02},
            {"bucket": "[2, 4)", "start": 2, "end": 4, "tokens": 96, "k3": 1e-4, "k1": -5e-5,
             "mean_abs_log_ratio": 0.01},
            {"bucket": "[4, 8)", "start": 4, "end": 8, "tokens": 1708, "k3": 8e-5, "k1": -4e-5,
             "mean_abs_log_ratio": 0.009},
            {"bucket": "[8, 16)", "start": 8, "end": 16, "tokens": 0, "k3": None, "k1": None,
             "mean_abs_log_ratio": None},
        ],
        "by_rollout_prob": [
            {"bucket": "[0, 0.001)", "low": 0.0, "high": 0.001, "tokens": 20, "k3": 0.0123, "mean_abs_log_ratio": 0.3},
            {"bucket": "[0.001, 0.01)", "low": 0.001, "high": 0.01, "tokens": 0, "k3": None,
             "mean_abs_log_ratio": None},
            {"bucket": "[0.5, 0.9)", "low": 0.5, "high": 0.9, "tokens": 580, "k3": 1e-4, "mean_abs_log_ratio": 0.01},
            {"bucket": "[0.99, 1]", "low": 0.99, "high": 1.0, "tokens": 1300, "k3": 2e-6, "mean_abs_log_ratio": 0.001},
        ],
        "by_length": [
            {"bucket": "[32, 64)", "low": 32, "high": 64, "sequences": 48, "tokens": 1920, "k3": 0.000123456,
             "seq_product_outside_half_two_fraction": 0.0625},
        ],
        "by_call": calls,
        "trend": {"k3_slope_per_call": slope, "k3_first_half": first, "k3_second_half": second,
                  "growth": second / first if first else None},
        "histogram": {"edges": edges, "counts": counts},
        "quantiles": {"0.001": -0.9, "0.01": -0.2, "0.05": -0.05, "0.5": 0.0, "0.95": 0.05, "0.99": 0.2,
                      "0.999": 0.95},
        "worst_sequences": [{"call": 3, "index": 17, "length": 41, "k3": 0.0345678, "max_abs_log_ratio": 5.4321,
                             "worst_position": 29},
                            {"call": 1, "index": 2, "length": 40, "k3": 0.001, "max_abs_log_ratio": 1.0,
                             "worst_position": 0}],
        "warnings": ["call 5 lacks rank 1 (--allow-partial)"],
    }


def make_results():
    def row(name, level, ess, kept, signal_shift=0.01):
        config = MisConfig.preset(name, use_tis=True).to_dict() if level is None else \
            MisConfig(use_tis=True, tis_level=level, tis_upper_bound=3.0).to_dict()
        return {"config": config, "kept_token_fraction": kept, "kept_sequence_fraction": 1.0, "ess": ess,
                "mean_final_weight": 1.0, "max_final_weight": 2.0, "bounded_fraction": 0.001,
                "signal_shift": signal_shift, "signal_bias": -0.001}
    return {"seq_tis_3": row(None, "sequence", 0.95, 1.0), "token_tis": row("token_tis", None, 0.97, 1.0),
            "mis": row("mis", None, 0.99, 0.999), "geo_tis_3": row(None, "geometric", 0.5, 1.0, None)}


def make_recommendation():
    return Rec("mis", MisConfig.preset("mis", use_tis=True),
               ["tokens with rho < 1e-4 exist: use a veto", "keeps 99.9% of tokens"])


def nonfinite(statistics):
    """The statistics with NaN/inf where numbers were (the schema forbids them; the report must survive them)."""
    bad = copy.deepcopy(statistics)
    bad["k1"], bad["chi2_token"], bad["max_abs_log_ratio"] = math.nan, math.inf, -math.inf
    bad["by_position"][1]["k3"] = math.nan
    bad["by_call"][2]["k3"] = math.inf
    bad["quantiles"]["0.999"] = math.inf
    bad["trend"]["growth"] = math.nan
    return bad


def section(markdown, heading):
    start = markdown.index(heading)
    end = markdown.find("\n#", start + len(heading))
    return markdown[start:] if end < 0 else markdown[start:end]


# --------------------------------------------------------------------------- Markdown
def test_markdown_has_every_section_and_the_values():
    statistics, results, rec = make_statistics(), make_results(), make_recommendation()
    markdown = report_markdown.render_markdown(statistics, results, rec, title="analysis of /dumps", figures=None)
    assert markdown.startswith("# analysis of /dumps\n")
    positions = [markdown.index(heading) for heading in SECTIONS]
    assert positions == sorted(positions)
    assert markdown.index("**Warning:** call 5 lacks rank 1") < positions[0]
    assert "**Warning:** 0.01042 of the valid tokens have NaN/inf log-probs" in markdown
    whole = section(markdown, "## Whole-dump statistics")
    for key in report_tables.STATISTICS:
        assert f"| {key} |" in whole
    assert "| k3 | 0.0001235 |" in whole and "| max_abs_log_ratio | 5.432 |" in whole
    assert "| fraction_ratio_below_half | n/a |" in whole and "| tokens | 1920 |" in whole
    assert "within the range published for dense models" in whole and "step 320" in whole
    position = section(markdown, "### By token position")
    assert "| 0 | 48 | 0.004568 | -0.002 | 0.0811 |" in position
    assert "[8, 16)" not in position  # empty buckets are left out
    assert "k3 is largest at position 0: 0.004568 (37 × the whole-dump k3, 48 tokens)." in position
    assert "| [0, 0.001) | 20 | 0.0123 | 0.3 |" in section(markdown, "### By rollout probability")
    assert "| [32, 64) | 48 | 1920 | 0.0001235 | 0.0625 |" in section(markdown, "### By response length")
    calls = section(markdown, "### Over calls")
    assert "k3 grows over calls: slope 6.114e-05 per call, second half / first half = 2.647" in calls
    assert "| 3 | 8 | 320 | 0.0002 | -0.0001 | 3.5 | 0 |" in calls
    assert "| 0.999 | 0.95 | 2.586 |" in section(markdown, "### Distribution of the token log ratio")
    assert "| 3 | 17 | 41 | 0.03457 | 5.432 | 29 |" in section(markdown, "### Worst sequences")
    assert "matplotlib is not installed" not in markdown or not figures.figures_available()
    for word in ("nan", "inf |", "NaN"):
        assert word not in markdown.replace("NaN/inf", "")


def test_candidates_grouped_by_level_largest_ess_first_and_the_recommendation():
    markdown = report_markdown.render_markdown(make_statistics(), make_results(), make_recommendation(), title="t")
    rows = [line for line in section(markdown, "## Candidate configurations").splitlines() if line.startswith("| ")]
    names = [row.split(" | ")[0][2:] for row in rows[1:]]
    assert names == ["**mis** (recommended)", "token_tis", "geo_tis_3", "seq_tis_3"]
    assert "truncate [0.5, 2]; RS token [0.5, 2]; veto ρ < 0.0001; normalized per micro_batch" in rows[1]
    assert rows[1].endswith("| 0.999 | 1 | 0.99 | 1 | 2 | 0.001 | 0.01 | -0.001 |")
    assert "| n/a |" in rows[3]  # geo_tis_3: no signal shift
    recommendation = section(markdown, "## Recommendation")
    assert recommendation.startswith("## Recommendation: `mis`")
    assert "- tokens with rho < 1e-4 exist: use a veto" in recommendation
    assert f"`{report_markdown.USAGE} FILE`" in recommendation
    assert "--use-tis --custom-tis-function-path miles_mis.compute_mis_weights_with_cp --custom-config-path" \
        in recommendation
    block = recommendation.split("```yaml\n")[1].split("```")[0]
    assert MisConfig.from_dict(yaml.safe_load(block)) == MisConfig.preset("mis", use_tis=True)
    named = report_markdown.render_markdown(make_statistics(), {}, make_recommendation(), title="t",
                                            config_path="out/mis.yaml")
    assert "It is written to `out/mis.yaml`." in named and f"`{report_markdown.USAGE} out/mis.yaml`" in named
    assert "No candidate was evaluated." in named


def test_no_recommendation_says_why():
    rec = Rec(None, None, ["the engine's log-probs are broken: 40% of valid tokens are NaN/inf"])
    markdown = report_markdown.render_markdown(make_statistics(), {}, rec, title="t")
    assert "## Recommendation: none\n\n- the engine's log-probs are broken" in markdown
    assert report_markdown.USAGE not in markdown
    assert "## Recommendation: none\n\n- no recommendation made" in report_markdown.render_markdown(
        make_statistics(), {}, None, title="t")


def test_markdown_and_json_never_show_nan_or_inf():
    bad, results = nonfinite(make_statistics()), make_results()
    results["mis"]["ess"], results["token_tis"]["max_final_weight"] = math.nan, math.inf
    markdown = report_markdown.render_markdown(bad, results, make_recommendation(), title="t")
    assert "| k1 | n/a |" in markdown and "| chi2_token | n/a |" in markdown and "| 0.999 | n/a | n/a |" in markdown
    assert "nan" not in markdown.lower().replace("nan/inf", "") and "| inf" not in markdown
    data = report_json.to_json(bad, results, make_recommendation())
    text = json.dumps(data, allow_nan=False)
    assert data["k1"] is None and data["by_call"][2]["k3"] is None and data["candidates"]["mis"]["ess"] is None
    assert json.loads(text)["trend"]["growth"] is None


def test_json_has_the_required_keys():
    data = report_json.to_json(make_statistics(), make_results(), make_recommendation())
    for key in ("files", "sequences", "tokens", "nonfinite_fraction", "k3", "by_position", "by_rollout_prob",
                "by_length", "by_call", "candidates", "recommendation"):
        assert key in data, key
    assert data["k3"] == 0.000123456 and data["files"] == 4 and len(data["by_call"]) == 6
    assert data["recommendation"]["name"] == "mis"
    assert data["recommendation"]["config"] == MisConfig.preset("mis", use_tis=True).to_dict()
    assert data["recommendation"]["reasons"][0].startswith("tokens with rho")
    assert data["candidates"]["token_tis"]["ess"] == 0.97
    assert data["trend_sentence"].startswith("k3 grows over calls") and "dense models" in data["k3_context"]
    json.dumps(data, allow_nan=False)
    empty = report_json.to_json({"warnings": []}, None, Rec(None, None, ["nothing"]))
    assert empty["k3"] is None and empty["by_call"] == [] and empty["candidates"] == {}
    assert empty["recommendation"] == {"name": None, "config": None, "reasons": ["nothing"]}


@pytest.mark.parametrize("k3, words", [(3e-6, "below the range published for dense"),
                                       (1e-3, "within the range published for dense"),
                                       (0.02, "within that for MoE"), (0.5, "above the ranges published"),
                                       (None, "cannot be placed")])
def test_k3_against_published_ranges(k3, words):
    assert words in report_sentences.k3_context({"k3": k3})


@pytest.mark.parametrize("per_call, words", [
    ((1e-4, 1.1e-4, 1.3e-4, 2e-4, 3e-4, 4e-4), "k3 grows over calls: slope 6.114e-05 per call, second half / first "
                                               "half = 2.647 (first half 0.0001133, second half 0.0003, 6 calls)."),
    ((2e-4, 2.1e-4, 1.9e-4, 2e-4, 2.05e-4, 1.95e-4), "k3 is flat over calls: slope -8.571e-07 per call, second "
                                                     "half / first half = 1 "),
    ((4e-4, 3e-4, 1e-4, 1e-4), "k3 shrinks over calls"),
    ((0.0, 0.0, 1e-4, 2e-4), "k3 grows over calls"),  # first half 0: judged by the slope
    ((1e-4,), "no trend, it needs per-call k3 on at least 2 calls (this dump has 1)"),
])
def test_trend_sentence(per_call, words):
    assert words in report_sentences.trend_sentence(make_statistics(per_call))


def test_numbers_have_four_significant_digits():
    assert [formatting.fmt(v) for v in (0.000123456, 5.43219, 1920, 40.0, 123456.7, None, math.nan, -math.inf, True)] \
        == ["0.0001235", "5.432", "1920", "40", "1.235e+05", "n/a", "n/a", "n/a", "n/a"]


def test_summary_text_is_a_few_lines():
    text = report_files.summary_text(make_statistics(), make_results(), make_recommendation())
    lines = text.splitlines()
    assert 3 <= len(lines) <= 6
    assert lines[0] == "4 dump files, 6 calls, 48 sequences, 1920 valid tokens (1900 usable)."
    assert "token k3 = 0.0001235" in text and "non-finite log-probs: 0.01042" in text
    assert "k3 grows over calls" in text
    assert lines[-1].startswith("recommendation of 4 candidates: mis (tokens with rho < 1e-4")
    assert report_files.summary_text(make_statistics(), {}, Rec(None, None, ["broken"])).splitlines()[-1] == \
        "recommendation: none (broken)"


# --------------------------------------------------------------------------- files and figures
def test_write_report_with_figures(tmp_path):
    pytest.importorskip("matplotlib")
    paths = report_files.write_report(tmp_path / "out", make_statistics(), make_results(), make_recommendation(),
                                title="analysis")
    pngs = sorted((tmp_path / "out").glob("*.png"))
    assert len(pngs) == 5 and set(pngs) == {paths[key] for key in figures.FIGURES}
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    markdown = paths["markdown"].read_text()
    for name in figures.FIGURES.values():
        assert f"]({name})" in markdown
    assert "Figures not drawn" not in markdown
    data = json.loads(paths["json"].read_text())
    assert data["figures"] == list(figures.FIGURES.values())


def test_histogram_figure_has_symlog_x_log_counts_and_the_bound_lines():
    pytest.importorskip("matplotlib")
    statistics = make_statistics()
    assert len(statistics["histogram"]["edges"]) == len(statistics["histogram"]["counts"]) + 1
    figure = figures._draw("histogram", statistics, [("a", 0.5, 2.0), ("b", 0.2, 5.0)])
    (ax,) = figure.axes
    assert (ax.get_xscale(), ax.get_yscale()) == ("symlog", "log")
    lines = sorted(round(line.get_xdata()[0], 6) for line in ax.get_lines())
    assert lines == sorted(round(v, 6) for v in (math.log(0.5), math.log(2), math.log(0.2), math.log(5), 0.0))
    assert "log" in ax.get_ylabel() and "l =" in ax.get_title()
    calls = figures._draw("by_call", make_statistics((1e-6, 1e-5, 1e-4, 1e-3)), [])
    assert calls.axes[0].get_yscale() == "log"  # k3 spans decades
    assert "least-squares" in calls.axes[0].get_legend().get_texts()[1].get_text()


def test_figures_survive_empty_and_nonfinite_statistics(tmp_path):
    pytest.importorskip("matplotlib")
    empty = {"by_position": [], "by_rollout_prob": [], "by_length": [], "by_call": [], "histogram": {},
             "trend": {}}
    assert len(figures.write_figures(empty, tmp_path / "empty")) == 5
    written = figures.write_figures(nonfinite(make_statistics()), tmp_path / "bad", bounds=[("x", 0.1, 10.0)])
    assert all(p.stat().st_size > 0 for p in written)


def test_histogram_bounds_come_from_the_candidates():
    bounds = figures.candidate_bounds(make_results(), first="mis")
    assert bounds[0] == ("mis (recommended), token_tis", 0.5, 2.0)
    assert figures.candidate_bounds({}) == [("ratio 0.5 and 2", 0.5, 2.0)]
    assert figures.least_squares([(0, 1.0), (1, 3.0), (2, 5.0)]) == (2.0, 1.0)
    assert figures.least_squares([(1, 1.0)]) is None


def test_without_matplotlib_the_report_says_how_to_get_figures(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert not figures.figures_available()
    with pytest.raises(ImportError, match=r'pip install "miles-mis\[figures\]"'):
        figures.write_figures(make_statistics(), tmp_path / "figs")
    paths = report_files.write_report(tmp_path / "out", make_statistics(), make_results(), make_recommendation(),
                                title="analysis")
    assert set(paths) == {"markdown", "json", "html"} and not list((tmp_path / "out").glob("*.png"))
    assert 'pip install "miles-mis[figures]"' in paths["markdown"].read_text()
    assert json.loads(paths["json"].read_text())["figures"] is None


def test_figures_turned_off(tmp_path, monkeypatch):
    monkeypatch.setattr(figures, "figures_available", lambda: True)
    monkeypatch.setattr(figures, "write_figures", lambda *a, **k: pytest.fail("figures drawn"))
    paths = report_files.write_report(tmp_path, make_statistics(), {}, make_recommendation(), title="t",
                                with_figures=False)
    assert "Figures not drawn (turned off: --no-figures)." in paths["markdown"].read_text()


# --------------------------------------------------------------------------- comparison
def test_comparison_highlights_a_tenfold_k3(tmp_path):
    a, b = make_statistics(), make_statistics()
    b["k3"] = a["k3"] * 10
    b["by_position"][0]["k3"] = a["by_position"][0]["k3"] * 10
    b["fraction_ratio_below_half"] = 0.001  # None in A: a value on one side only
    b["tokens"] = 1920 * 5  # a size, not a difference
    rec_b = Rec("token_tis", MisConfig.preset("token_tis", use_tis=True), ["moderate mismatch"])
    markdown = comparison.render_comparison(a, b, make_results(), make_results(), make_recommendation(), rec_b,
                                        names=("bf16", "fp8"))
    assert "| k3 | **0.0001235** | **0.001235** | **10** |" in markdown
    assert "| fraction_ratio_below_half | **n/a** | **0.001** | **n/a** |" in markdown
    assert "| tokens | 1920 | 9600 | 5 |" in markdown and "| files | 4 | 4 | 1 |" in markdown
    assert "| mean_abs_log_ratio | 0.01235 | 0.01235 | 1 |" in markdown
    row = "| 0 | 48 | 48 | **0.004568** | **0.04568** | **10** | -0.002 | -0.002 | 1 | 0.0811 | 0.0811 | 1 |"
    assert row in markdown
    largest = section(markdown, "## Largest differences")
    assert "- **fraction_ratio_below_half** (whole dump): bf16 n/a, fp8 0.001, fp8/bf16 = n/a" in largest
    assert "- **k3** (whole dump): bf16 0.0001235, fp8 0.001235, fp8/bf16 = 10" in largest
    assert "tokens" not in largest
    assert "- bf16: `mis` — tokens with rho" in markdown and "- fp8: `token_tis` — moderate mismatch" in markdown
    assert "**The recommendations differ.**" in markdown
    for heading in ("## Whole-dump statistics", "### By token position", "### By rollout probability",
                    "### By response length", "### Over calls", "## Candidate configurations", "## Recommendations"):
        assert heading in markdown
    paths = comparison.write_comparison(tmp_path, a, b, make_results(), make_results(), make_recommendation(), rec_b,
                                    names=("bf16", "fp8"))
    data = json.loads(paths["json"].read_text())
    assert set(data) == {"names", "a", "b", "differences"} and data["b"]["k3"] == b["k3"]
    whole_k3 = [d for d in data["differences"] if d["where"] == "whole dump" and d["statistic"] == "k3"]
    assert len(whole_k3) == 1 and whole_k3[0]["ratio"] == pytest.approx(10)
    assert paths["markdown"].read_text() == markdown


def test_comparison_of_equal_dumps_has_no_differences():
    a = make_statistics()
    markdown = comparison.render_comparison(a, copy.deepcopy(a), {}, {}, make_recommendation(), make_recommendation())
    assert "None: every mismatch statistic of B is within a factor 2 of A's." in markdown
    assert "**" not in section(markdown, "## Whole-dump statistics")
    assert "Both dumps get the same recommendation." in markdown
    data = comparison.comparison_json(nonfinite(a), a, None, None, None, None)
    json.dumps(data, allow_nan=False)
    assert comparison.differs(0.0, 1e-9) and not comparison.differs(0.0, 0.0) and not comparison.differs(None, None)


def test_config_descriptions():
    describe = report_configs.describe_config
    assert describe(MisConfig.preset("k3_rs", use_tis=True).to_dict()) == "truncate [0.5, 2]; reject seq_mean_k3 > 0.01"
    assert describe(MisConfig.preset("geo_rs", use_tis=True).to_dict()).endswith(
        "reject seq_mean_k1 outside [0.999, 1.001]")
    assert describe(MisConfig.preset("metrics_only").to_dict()) == "metrics only"
    assert describe({}) == "n/a"
