"""benchmarks/lab_verdicts_docs.py: the tables go between the markers of the docs and nowhere else, a missing or
doubled marker is an error naming the file, and the line on the runs counts what the rows hold."""

import re

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def docs():
    return load_benchmark("lab_verdicts_docs")


SECTIONS = [
    ("bf16 + fp8 weights", "| algorithm | seeds |\n|---|---|\n| standard | 4 |\n\n- bypass ends below standard",
     "f8.png"),
    ("fp16", "(no runs yet)", None),
    ("fp32", "| algorithm | seeds |\n|---|---|\n| standard | 2 |", None),
    ("Mechanisms", "- a mechanism line", None),
    ("What mismatch needs a correction", "| regime | k3 |\n|---|---|\n| fp32 | 5.88e-11 |\n\n- standard: safe",
     "curve.png"),
]
ROWS = [{"machine": "AMD EPYC, 2 cores, boot aaaa"}, {"machine": "AMD EPYC, 2 cores, boot bbbb"},
        {"machine": "AMD EPYC, 2 cores, boot aaaa"}]
DOC = ("# Lab\n\nprose before\n\n<!-- lab_verdicts:verdicts -->\nold tables\n<!-- /lab_verdicts:verdicts -->\n\n"
       "prose between, kept\n\n<!-- lab_verdicts:safe -->\nold safe\n<!-- /lab_verdicts:safe -->\n\n![curve](x.png)\n")


def test_the_tables_land_between_the_markers_and_nothing_else_moves(docs, tmp_path):
    path = tmp_path / "lab.md"
    path.write_text(DOC)
    docs.write_docs(path, SECTIONS, ROWS, 40, "3 runs, about 0.4 CPU hours left", 0, tmp_path / "figures")
    text = path.read_text()
    verdicts = text[text.index("<!-- lab_verdicts:verdicts -->"):text.index("<!-- /lab_verdicts:verdicts -->")]
    assert verdicts.startswith("<!-- lab_verdicts:verdicts -->\n`tables` on the runs so far: 3 runs of 40 steps, "
                               "on 2 boot(s) of AMD EPYC, 2 cores (each row")
    assert "every boot so far reproduced the first rollouts of the others" in " ".join(verdicts.split())
    assert "`budget` says 3 runs, about 0.4 CPU hours left." in " ".join(verdicts.split())
    # the regimes with runs, in order, each with its figure when it has one; no empty regime, no mechanisms, no curve
    assert verdicts.index("**bf16 + fp8 weights**\n\n| algorithm") < verdicts.index("**fp32**")
    assert "- bypass ends below standard\n\n![reward per step, bf16 + fp8 weights](figures/f8.png)" in verdicts
    assert "fp16" not in verdicts and "mechanism" not in verdicts and "5.88e-11" not in verdicts
    assert "old tables" not in text and "old safe" not in text
    safe = text[text.index("<!-- lab_verdicts:safe -->"):text.index("<!-- /lab_verdicts:safe -->")]
    assert safe == "<!-- lab_verdicts:safe -->\n| regime | k3 |\n|---|---|\n| fp32 | 5.88e-11 |\n\n- standard: safe\n"
    assert text.startswith("# Lab\n\nprose before\n\n") and "\n\nprose between, kept\n\n" in text
    assert text.endswith("<!-- /lab_verdicts:safe -->\n\n![curve](x.png)\n")
    # a second write of the same tables changes nothing
    docs.write_docs(path, SECTIONS, ROWS, 40, "3 runs, about 0.4 CPU hours left", 0, tmp_path / "figures")
    assert path.read_text() == text


def test_the_figures_are_linked_from_where_the_page_lies(docs, tmp_path):
    """docs/lab/verdicts.md sits one folder below docs/figures' parent: its links go up one level."""
    page = tmp_path / "docs" / "lab" / "verdicts.md"
    page.parent.mkdir(parents=True)
    page.write_text(DOC)
    docs.write_docs(page, SECTIONS, ROWS, 40, "0 runs", 0, tmp_path / "docs" / "figures")
    assert "![reward per step, bf16 + fp8 weights](../figures/f8.png)" in page.read_text()
    assert docs.figures_link(docs.FIGURES.parent / "lab" / "verdicts.md") == "../figures"


def test_another_first_rollout_is_said(docs):
    line = " ".join(docs.runs_line(ROWS, 40, "0 runs", 2).split())
    assert "2 seed(s) had another first rollout on some boot, and the tables take each seed from the group" in line


@pytest.mark.parametrize("text, found", [
    ("no markers at all", "(found 0 and 0)"),
    ("<!-- lab_verdicts:safe -->\nx\n", "(found 1 and 0)"),
    ("<!-- /lab_verdicts:safe -->\nx\n<!-- lab_verdicts:safe -->", "(found 1 and 1)"),
    ("<!-- lab_verdicts:safe -->\n<!-- lab_verdicts:safe -->\n<!-- /lab_verdicts:safe -->", "(found 2 and 1)"),
])
def test_markers_missing_doubled_or_reversed_are_an_error_naming_the_file(docs, text, found):
    with pytest.raises(ValueError, match=r"^docs/lab\.md: needs one '<!-- lab_verdicts:safe -->' and, after it, one "
                                         r"'<!-- /lab_verdicts:safe -->' "
                                         + found.replace("(", r"\(").replace(")", r"\)")):
        docs.replace_marked(text, "safe", "body", "docs/lab.md")


def test_the_lab_docs_have_each_marker_once_and_their_figures_exist(docs):
    """The markers live on docs/lab/verdicts.md (docs/lab.md links to it and has none); every figure the tables
    link there is a file."""
    from conftest import REPO

    page = REPO / "docs" / "lab" / "verdicts.md"
    text = page.read_text()
    names = ("verdicts", "one-step-off_2-digit_addition", "safe")  # the sweep, the 200-step regime, the curve
    assert re.findall(r"<!-- lab_verdicts:(\S+) -->", text) == list(names)
    for name in names:
        assert docs.replace_marked(text, name, "x", "docs/lab/verdicts.md").count("<!-- lab_verdicts:") == 3
    assert "lab_verdicts:" not in (REPO / "docs" / "lab.md").read_text()
    marked = text[text.index("<!-- lab_verdicts:verdicts -->"):text.index("<!-- /lab_verdicts:verdicts -->")]
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", marked)
    assert figures and all(link.startswith("../figures/") and (page.parent / link).is_file() for link in figures)
