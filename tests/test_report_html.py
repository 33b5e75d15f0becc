"""The analyze report as one self-contained HTML page: well-formed, its sections in order, nothing loaded from the
network, every text escaped, the token strips shaded from the dumped log-probs (hand-computed colours), the strips a
bounded sample kept while streaming; and the page in a real headless Chromium (no console error, every section drawn,
a screenshot)."""

import base64
import html
import json
import os
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from cli_answers import analyze_cli as analyze
from cli_answers import one_line_error
from test_analyze import batch, write_dump

from miles_mis.analyze import analyze as run_analysis
from miles_mis.analyze.report import figures
from miles_mis.analyze.reading import CallBatch, DumpReader
from miles_mis.analyze.report.page import SECTIONS, cited_outcomes, render_html, source_links
from miles_mis.analyze.report.strips import page_scale, shade, strips_section
from miles_mis.analyze.statistics import StatisticsAccumulator
from miles_mis.analyze.worst_sequences import STRIP_TOKENS, WORST, token_window

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Page(HTMLParser):
    """The page's tags: every start and end tag matched (void elements need none), every element's attributes, the
    ids of the sections in order, the token cells (their classes and style), the text."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.stack, self.problems, self.elements, self.sections, self.tokens, self.text = [], [], [], [], [], []
        self.feed(text)
        self.close()
        if self.stack:
            self.problems.append(f"unclosed: {self.stack}")

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.elements.append((tag, attrs))
        if tag == "section":
            self.sections.append(attrs.get("id"))
        if tag == "span" and "tok" in (attrs.get("class") or "").split():
            self.tokens.append(attrs)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def page_of(text):
    page = Page(text)
    assert page.problems == [], page.problems[:5]
    return page


def report_page(tmp_path, capsys, *argv, dump=None):
    """`miles-mis analyze DUMP --out-dir OUT ARGV...` on a 40-sequence dump; returns (report.html's text, OUT)."""
    if dump is None:
        dump = tmp_path / "dump"
        write_dump(dump, {0: batch(0, 0.05, num=40, length=200)})
    out = tmp_path / "out"
    code, _, err = analyze(capsys, dump, "--out-dir", out, *argv)
    assert code == 0, err
    return (out / "report.html").read_text(encoding="utf-8"), out


# --------------------------------------------------------------------------- the page
def test_the_page_is_well_formed_has_every_section_in_order_and_loads_nothing(tmp_path, capsys):
    text, out = report_page(tmp_path, capsys)
    page = page_of(text)
    assert page.sections == list(SECTIONS)
    for tag, attrs in page.elements:  # nothing fetched: images are data: URIs, the only links are <a href>
        for name in ("src", "href", "srcset", "poster", "data", "action"):
            value = attrs.get(name)
            if value is None:
                continue
            if tag == "a" and name == "href":
                assert value.startswith("https://"), value
            else:
                assert value.startswith("data:"), (tag, name, value[:60])
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", text)  # nor from the CSS
    assert not re.search(r"@import|<iframe|<object|<embed", text)
    policy = next(attrs["content"] for tag, attrs in page.elements
                  if tag == "meta" and attrs.get("http-equiv") == "Content-Security-Policy")
    assert policy.startswith("default-src 'none'; img-src data:;")
    # the figures the report drew, inlined byte for byte
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == len(figures.FIGURES) and figures.figures_available()
    images = [attrs["src"] for tag, attrs in page.elements if tag == "img"]
    assert len(images) == len(pngs)
    assert {base64.b64decode(src.split(",", 1)[1]) for src in images} == {p.read_bytes() for p in pngs}
    # the candidates' table holds report.md's rows, cell for cell and in the same order
    markdown = (out / "report.md").read_text().split("## Candidate configurations")[1].split("\n## ")[0]
    expected = [[cell.replace("**", "") for cell in line.strip("| ").split(" | ")]
                for line in markdown.splitlines() if line.startswith("| ")]
    table = text[text.index('<section id="candidates">'):].split("</table>")[0]
    shown = [[html.unescape(cell) for cell in re.findall(r"<t[hd]>(.*?)</t[hd]>", row)]
             for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table)]
    assert len(expected) > 20 and shown == expected


def test_every_text_is_escaped(tmp_path):
    write_dump(tmp_path, {0: batch(1, 0.05, num=4, length=20)})
    result = run_analysis(tmp_path)
    evil = "<script>alert('x')</script>"
    results = {**result.results, evil: next(iter(result.results.values()))}
    statistics = {**result.statistics, "warnings": [f"a warning with {evil}"]}
    text = render_html(statistics, results, result.recommendation, title=f"analysis of {evil}", figures=None,
                       figures_note=f"no figures {evil}")
    page = page_of(text)
    assert "<script>alert" not in text and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    assert [tag for tag, _ in page.elements].count("script") == 1  # the page's own sort script only
    shown = "".join(page.text)
    assert shown.count(evil) >= 4  # title (twice: <title> and <h1>), the warning, the table row, the note


def test_figures_off_or_missing_are_said(tmp_path, capsys):
    text, out = report_page(tmp_path, capsys, "--no-figures")
    section = text[text.index('<section id="figures">'):]
    assert "Figures not drawn (turned off: --no-figures)." in section.split("</section>")[0]
    assert "<img" not in text and not list(out.glob("*.png"))


# --------------------------------------------------------------------------- the strips
def test_shading_is_the_square_root_diverging_scale():
    # t = sqrt(min(|Δ| / S, 1)), channel = round(255 + t (end − 255)), end red (178, 24, 43) or blue (33, 102, 172)
    assert shade(1.0, 4.0) == "#d98c95"  # t = 1/2: 216.5 → 217, 139.5 → 140, 149
    assert shade(-1.0, 4.0) == "#90b3d6"  # 144, 178.5 → 179, 213.5 → 214
    assert shade(4.0, 4.0) == shade(9.0, 4.0) == "#b2182b" and shade(-4.0, 4.0) == "#2166ac"
    assert shade(0.0, 4.0) == shade(1.0, 0.0) == "#ffffff"


def hand_batch(rollouts, masks, old=-1.0, call=0, index=0, length=None):
    values = torch.tensor(rollouts, dtype=torch.float32)
    return CallBatch(calls=[call], indices=[index], response_lengths=[length or len(rollouts)],
                     old_log_probs=[torch.full_like(values, old)], rollout_log_probs=[values],
                     loss_masks=[torch.tensor(masks, dtype=torch.float32)], advantages=[None],
                     positions=[torch.arange(len(rollouts))], lags=[None])


def test_a_tiny_strip_is_shaded_from_its_log_probs():
    """old = −1 everywhere; rollouts −1, 1, −2, −1.5, then one the loss mask drops, a NaN and a fill value:
    Δ = 0, 2, −1, −0.5, (masked), (not usable), (not usable). S = 2 (the unusable ones do not count); Δ = 2 is full
    red, −1 is t = √½ blue, −0.5 is t = ½ blue."""
    accumulator = StatisticsAccumulator()
    accumulator.update(hand_batch([-1.0, 1.0, -2.0, -1.5, 5.0, math.nan, -3.0e38], [1, 1, 1, 1, 0, 1, 1]))
    statistics = accumulator.result()
    json.dumps(statistics, allow_nan=False)  # the NaN is null in report.json
    (strip,) = statistics["token_strips"]
    assert (strip["start"], strip["end"], strip["held"], strip["worst_position"]) == (0, 7, 7, 1)
    assert strip["usable"] == [True] * 4 + [False] * 3 and strip["rollout"][5] is None
    assert page_scale([strip]) == 2.0
    root_half = math.sqrt(0.5)
    blue = "#" + "".join(f"{math.floor(255 + root_half * (e - 255) + 0.5):02x}" for e in (33, 102, 172))
    assert blue == "#6293c4"  # 98.02, 146.81, 196.31
    page = page_of(strips_section(statistics))
    styles = [cell.get("style") for cell in page.tokens]
    assert styles == ["background:#ffffff", "background:#b2182b", f"background:{blue}", "background:#90b3d6", None,
                      None, None]
    assert page.tokens[4]["class"] == "tok masked" and "excluded by the loss mask" in page.tokens[4]["title"]
    assert page.tokens[5]["class"] == page.tokens[6]["class"] == "tok nonfinite"
    assert page.tokens[5]["title"].startswith("position 5: log π_rollout n/a, log π_old -1, Δ log p n/a (a NaN/inf")
    assert [cell["class"] for cell in page.tokens].count("tok peak") == 1 and page.tokens[1]["class"] == "tok peak"
    assert page.tokens[2]["title"] == "position 2: log π_rollout -2, log π_old -1, Δ log p -1"


def test_unknown_positions_mark_one_peak_and_say_unknown():
    """Shards off the zigzag layout have no response position (−1): the peak is still the one largest |Δ|."""
    one = hand_batch([-1.0, -1.0, 0.5, -1.2], [1, 1, 1, 1])
    one = CallBatch(**{**one.__dict__, "positions": [torch.full((4,), -1)]})
    accumulator = StatisticsAccumulator()
    accumulator.update(one)
    page = page_of(strips_section(accumulator.result()))
    assert [cell["class"] for cell in page.tokens] == ["tok", "tok", "tok peak", "tok"]
    assert page.tokens[2]["title"] == "position unknown (token 2): log π_rollout 0.5, log π_old -1, Δ log p 1.5"
    assert "max |Δ log p| 1.5 at an unknown position; tokens 0–3 of 4" in "".join(page.text)


def test_the_window_and_truncation_marks(tmp_path, capsys):
    """A 200-token response shows STRIP_TOKENS tokens around its largest |Δ| with marks for the rest; a sequence the
    dump holds only partly (--allow-partial) is marked truncated."""
    rollouts = [-1.0] * 200
    rollouts[150] = 2.0  # Δ = 3 at 150: the window is [150 − 32, 150 + 32)
    window = token_window(torch.full((200,), -1.0), torch.tensor(rollouts), torch.ones(200), torch.arange(200), 150)
    assert (window["start"], window["end"], window["held"]) == (150 - STRIP_TOKENS // 2, 150 + STRIP_TOKENS // 2, 200)
    near_end = token_window(torch.zeros(200), torch.zeros(200), torch.ones(200), torch.arange(200), 199)
    assert (near_end["start"], near_end["end"]) == (200 - STRIP_TOKENS, 200)
    accumulator = StatisticsAccumulator()
    accumulator.update(hand_batch(rollouts, [1] * 200))
    text = strips_section(accumulator.result())
    assert f'title="{150 - STRIP_TOKENS // 2} tokens before not shown">…{150 - STRIP_TOKENS // 2}<' in text
    assert f'title="{200 - 150 - STRIP_TOKENS // 2} tokens after not shown"' in text
    assert len(page_of(text).tokens) == STRIP_TOKENS

    dump = tmp_path / "partial"
    write_dump(dump, {0: batch(2, 0.05, num=3, length=30)}, response_lengths=[30, 40, 30])
    page, _ = report_page(tmp_path, capsys, "--allow-partial", dump=dump)
    assert "(response_length 40: 10 not in the dump)" in page and ">✂10</span>" in page


def test_the_strips_are_the_worst_sequences_a_bounded_sample_kept_while_streaming(tmp_path, capsys):
    """90 sequences over 3 calls: the page shows WORST of them, the ones with the highest mean k3 (a slow reference
    over every sequence), each a window of at most STRIP_TOKENS tokens holding its largest |Δ|; the same whether the
    statistics see the dump call by call or in one batch."""
    dump = tmp_path / "dump"
    for call in range(3):
        write_dump(dump, {0: batch(10 + call, 0.05 * (call + 1), num=30, length=120)}, call=call)
    reader = DumpReader(dump)
    reference = []
    for one in reader.batches():
        for i in range(len(one.calls)):
            ell = (one.old_log_probs[i] - one.rollout_log_probs[i]).double()
            k3 = float((torch.expm1(ell) - ell).mean())
            reference.append((-k3, one.calls[i], one.indices[i], int(ell.abs().argmax())))
    reference.sort()
    streamed = StatisticsAccumulator()
    for one in reader.batches():
        streamed.update(one)
        assert len(streamed.worst.rows()) <= WORST
    whole = StatisticsAccumulator()
    whole.update(reader.load_all())
    strips = streamed.result()["token_strips"]
    assert strips == whole.result()["token_strips"]
    assert [(s["call"], s["index"]) for s in strips] == [(c, i) for _, c, i, _ in reference[:WORST]]
    for strip, (_, _, _, peak) in zip(strips, reference):
        assert strip["end"] - strip["start"] == len(strip["rollout"]) == STRIP_TOKENS
        assert strip["start"] <= peak < strip["end"] and strip["worst_position"] == peak
    text, _ = report_page(tmp_path, capsys, "--no-figures", dump=dump)
    assert f"{WORST} of the 90 sequences are shown" in text
    assert len(page_of(text).tokens) == WORST * STRIP_TOKENS


# --------------------------------------------------------------------------- published outcomes
def test_sources_are_linked():
    assert source_links("THUDM/slime#1533") == ('<a href="https://github.com/THUDM/slime/issues/1533">'
                                                "THUDM/slime#1533</a>")
    assert source_links("https://arxiv.org/abs/1 ; read via <b> https://example.org/x") == (
        '<a href="https://arxiv.org/abs/1">https://arxiv.org/abs/1</a> ; read via &lt;b&gt; '
        '<a href="https://example.org/x">https://example.org/x</a>')
    assert source_links("https://lmsys.org/blog/ (read as a/b:c.md)").endswith("</a> (read as a/b:c.md)")


def test_the_cited_outcomes_are_the_ones_the_advice_names():
    rows = [{"model": "M1", "outcome": "collapsed", "source": "S1: long", "k3_equivalent": 0.01, "url": "a/b#1",
             "corrections": []},
            {"model": "M2 (x)", "outcome": "stable", "source": "S2", "url": "https://x.org",
             "corrections": [{"name": "token TIS", "result": "held"}]},
            {"model": "M3", "outcome": "collapsed", "source": "S3", "url": "c/d#2", "corrections": []}]
    from miles_mis.analyze import published
    advice = f"Published runs went wrong: {published.describe(rows[0])}. Held: token TIS (M2, S2)."
    assert cited_outcomes(advice, rows) == rows[:2]
    page = page_of(render_html({"sequences": 0, "tokens": 0}, {}, None, title="t", outcomes=rows))
    assert page.sections == list(SECTIONS)


def test_the_page_links_each_cited_source(tmp_path, capsys):
    text, _ = report_page(tmp_path, capsys, "--no-figures")
    section = text[text.index('<section id="published">'):]
    links = re.findall(r'<a href="([^"]+)">', section)
    assert links and all(link.startswith("https://") for link in links)
    assert "https://github.com/NovaSky-AI/SkyRL/issues/1665" in links  # the held geometric mask, cited as owner/repo#N


# --------------------------------------------------------------------------- the command line
def test_html_option(tmp_path, capsys):
    dump = tmp_path / "dump"
    write_dump(dump, {0: batch(5, 0.05, num=8, length=40)})
    alone = tmp_path / "alone.html"
    code, out, err = analyze(capsys, dump, "--html", alone)
    assert code == 0 and out.startswith("# miles_mis analysis of"), err  # the Markdown report still on stdout
    page = page_of(alone.read_text(encoding="utf-8"))
    assert sum(tag == "img" for tag, _ in page.elements) == len(figures.FIGURES)  # drawn in a scratch directory
    copy = tmp_path / "copy.html"
    code, _, err = analyze(capsys, dump, "--out-dir", tmp_path / "out", "--html", copy)
    assert code == 0 and copy.read_bytes() == (tmp_path / "out" / "report.html").read_bytes(), err
    code, _, err = analyze(capsys, dump, "--compare", dump, "--html", copy)
    assert "--html" in one_line_error(code, err)


# --------------------------------------------------------------------------- a real browser
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1200,2400")


def browser(tmp_path):
    """A Selenium-driven headless Chromium (Debian's chromium and chromium-driver), or a skip naming what is
    missing."""
    missing = [f"{path} (apt-get install {package})" for path, package in
               ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")) if not path.exists()]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip install selenium)")
    if missing:
        reason = "the browser test needs " + ", ".join(missing)
        if os.environ.get("MILES_MIS_BROWSER_TEST") == "required":  # CI installs them: a skip there would hide it
            pytest.fail(reason + " (MILES_MIS_BROWSER_TEST=required)")
        pytest.skip(reason)
    options = Options()
    options.binary_location = str(CHROMIUM)  # with the driver's path too: no Selenium Manager lookup or download
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def test_the_page_in_headless_chromium(tmp_path, capsys):
    dump = tmp_path / "dump"
    write_dump(dump, {0: batch(0, 0.05, num=40, length=200)})
    write_dump(dump, {0: batch(1, 0.08, num=40, length=200)}, call=1)
    text, out = report_page(tmp_path, capsys, dump=dump)
    driver = browser(tmp_path)
    try:
        from selenium.webdriver.common.by import By

        driver.get((out / "report.html").as_uri())
        assert driver.execute_script("return document.readyState") == "complete"
        sizes = {name: driver.find_element(By.ID, name).size for name in SECTIONS}
        assert all(size["width"] > 0 and size["height"] > 0 for size in sizes.values()), sizes
        images = driver.find_elements(By.CSS_SELECTOR, "#figures img")
        assert images and all(driver.execute_script("return arguments[0].naturalWidth", image) > 0
                              for image in images)  # the data: URIs decoded as PNGs
        # the inline script runs (the policy allows it by its hash): a click on "ESS" sorts the table by it
        heading = next(th for th in driver.find_elements(By.CSS_SELECTOR, "#candidates th") if th.text == "ESS")
        column = heading.get_attribute("cellIndex")
        driver.execute_script("arguments[0].scrollIntoView()", heading)
        heading.click()
        values = [float(cell.text) for cell in driver.find_elements(
            By.CSS_SELECTOR, f"#candidates tbody td:nth-child({int(column) + 1})") if cell.text != "n/a"]
        assert values == sorted(values)
        driver.execute_script("window.scrollTo(0, 0)")
        screenshot = tmp_path / "report_html.png"
        assert driver.save_screenshot(str(screenshot))
        severe = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        version = driver.capabilities.get("browserVersion")
    finally:
        driver.quit()
    assert severe == []
    data = screenshot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, len(data)
    print(f"Chromium {version}; screenshot {screenshot} ({len(data)} bytes); page {len(text.encode())} bytes")
