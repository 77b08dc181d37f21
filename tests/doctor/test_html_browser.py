"""The HTML report check (html_browser.py): with Chromium hidden, the page is checked with html.parser and a
warning says the real-browser check did not run; in CI (CI=true) a missing Chromium fails; bad pages fail
either way; where Chromium is installed, its rendered text is the text the parser reads."""

import pytest

from doctor import html_browser
from doctor.html_browser import BrowserCheckSkipped, chromium, in_ci, page_text, parse_page

GOOD = """<!doctype html><html><head><meta charset="utf-8"><title>report: 12.5 ms per step</title>
<style>body{font-family:sans-serif}h1{font-size:20px}</style></head><body>
<h1>report: <b>12.5</b> ms per step</h1><p>compute 80.0% &amp; the rest</p>
<svg width="900" height="340"><text x="0" y="19">rank 0</text><rect x="60" y="4" width="800" height="320"
fill="#2e7d32"><title>compute: 10.0 ms</title></rect></svg>
<table><tr><th>cause</th><td>communication</td></tr></table><a href="https://example.org/docs">docs</a>
</body></html>"""


@pytest.fixture
def no_chromium(monkeypatch):
    monkeypatch.setattr(html_browser.shutil, "which", lambda name: None)
    monkeypatch.setattr(html_browser, "_warned", [])
    monkeypatch.delenv("CI", raising=False)


def write(tmp_path, html, name="page.html"):
    page = tmp_path / name
    page.write_text(html)
    return page


def test_without_chromium_the_parsed_text_is_checked_and_a_warning_says_so(tmp_path, no_chromium):
    with pytest.warns(BrowserCheckSkipped, match="not rendered"):
        text = page_text(write(tmp_path, GOOD), tmp_path)
    assert "report: 12.5 ms per step" in text and "compute 80.0% & the rest" in text and "rank 0" in text
    assert "font-family" not in text  # style sheets are not text
    assert not (tmp_path / "shot.png").exists()


def test_without_chromium_in_ci_the_check_fails(tmp_path, no_chromium, monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(AssertionError, match="CI=true: the HTML report test needs a real browser"):
        page_text(write(tmp_path, GOOD), tmp_path)


def test_a_name_bound_over_dev_null_is_no_chromium(monkeypatch):
    monkeypatch.setattr(html_browser.shutil, "which", lambda name: "/dev/null")  # as fresh-check --bare hides it
    assert chromium() is None


@pytest.mark.parametrize("bad, why", [
    ('<link rel="stylesheet" href="https://cdn.example/x.css">', "fetches"),
    ('<img src="plot.png">', "fetches"),
    ("<style>@import 'other.css';</style>", "fetches"),
    ("<style>body{background:url(http://example.org/bg.png)}</style>", "fetches"),
    ('<script src="app.js"></script>', "fetches"),
    ('<svg width="10" height="10"><rect x="0" y="0" width="5" height="5"></svg>', "does not parse"),
    ('<svg width="10" height="10"><text x="0" y="5">no shapes</text></svg>', "draws nothing"),
])
def test_bad_pages_fail_without_a_browser(tmp_path, no_chromium, bad, why):
    with pytest.raises(AssertionError, match=why):
        page_text(write(tmp_path, GOOD.replace("</body>", bad + "</body>")), tmp_path)


def test_self_contained_pieces_pass(tmp_path, no_chromium):
    extra = '<img src="data:image/png;base64,iVBORw0KGgo="><a href="#top">top</a>'
    with pytest.warns(BrowserCheckSkipped):
        assert "top" in page_text(write(tmp_path, GOOD.replace("</body>", extra + "</body>")), tmp_path)


def test_chromium_renders_the_text_the_parser_reads(tmp_path):
    if chromium() is None:
        assert not in_ci(), "CI=true: Chromium must be installed"
        pytest.skip("headless Chromium is not installed")
    page = write(tmp_path, GOOD)
    assert page_text(page, tmp_path) == parse_page(GOOD).text()
    assert (tmp_path / "shot.png").exists()
