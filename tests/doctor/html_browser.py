"""Check an HTML report as a reader gets it, and return the text it shows (the HTML report tests of doctor and
bench).

Always, with Python's html.parser: every inline SVG parses and draws something, and nothing is fetched from
elsewhere (no src or href but data: or #id, no URL or @import in a style sheet). Then, in headless Chromium
when it is installed (Debian's package; .ci/run installs it): the page is rendered, its screenshot must not be
blank, and the text comes from the DOM after rendering. Without Chromium the text comes from the parsed page, and a warning says
once that the real-browser check did not run; in CI (CI=true) a missing Chromium fails the test instead, so the
real-browser check always runs there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import warnings
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

MISSING = "headless Chromium is not installed (apt-get install chromium; .ci/run does)"
SHAPES = {"rect", "line", "polyline", "polygon", "circle", "ellipse", "path"}
URL_ATTRS = {"src", "href", "xlink:href", "srcset", "poster", "data", "action", "background"}
_warned = []


class BrowserCheckSkipped(UserWarning):
    """The page was checked with html.parser only: no Chromium on this machine."""


def chromium() -> str | None:
    """Chromium's path, or None. A name bound over /dev/null (fresh-check --bare hides programs so) is absent."""
    for name in ("chromium", "chromium-browser"):
        exe = shutil.which(name)
        if exe and os.path.isfile(os.path.realpath(exe)):
            return exe
    return None


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def page_text(page: Path, workdir: Path) -> str:
    """Check `page` (see the module docstring) and return its text; `workdir` takes the screenshot."""
    html = page.read_text()
    parsed = parse_page(html)
    assert not parsed.external, f"{page} fetches from elsewhere: {parsed.external[:5]}"
    check_svgs(html)
    exe = chromium()
    if exe is None:
        assert not in_ci(), f"CI=true: the HTML report test needs a real browser: {MISSING}"
        if not _warned:
            _warned.append(page)
            warnings.warn(f"{MISSING}: the HTML reports were checked with html.parser only, not rendered",
                          BrowserCheckSkipped, stacklevel=2)
        return parsed.text()
    shot = workdir / "shot.png"
    text = render(exe, page, shot)
    assert non_blank_share(shot) > 0.03, f"{page} renders (almost) blank in Chromium"
    return text


class _Page(HTMLParser):
    """The page's text (style sheets dropped, as render() drops them) and anything it would fetch."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.pieces: list[str] = []
        self.external: list[str] = []
        self._in_style = 0

    def handle_starttag(self, tag, attrs):
        self.pieces.append(" ")
        if tag == "style":
            self._in_style += 1
        for name, value in attrs:  # a link (<a href>) is not a fetch; any other URL but data: or #id is
            if tag != "a" and name in URL_ATTRS and value and not value.strip().lower().startswith(("data:", "#")):
                self.external.append(f"<{tag} {name}={value!r}>")

    def handle_endtag(self, tag):
        self.pieces.append(" ")
        if tag == "style" and self._in_style:
            self._in_style -= 1

    def handle_data(self, data):
        if self._in_style:
            if re.search(r"@import|url\(\s*['\"]?\s*(?!data:)[a-z]+:|url\(\s*['\"]?//", data, re.I):
                self.external.append("a style sheet that loads a URL")
            return
        self.pieces.append(data)

    def text(self) -> str:
        return " ".join("".join(self.pieces).split())


def parse_page(html: str) -> _Page:
    parser = _Page()
    parser.feed(html)
    parser.close()
    return parser


def check_svgs(html: str) -> None:
    """Every inline <svg> is well-formed XML with a size and at least one drawn shape."""
    for source in re.findall(r"<svg\b.*?</svg>", html, re.S):
        try:
            svg = ET.fromstring(source)
        except ET.ParseError as exc:
            raise AssertionError(f"an inline SVG does not parse ({exc}): {source[:300]}") from None
        assert float(svg.get("width", 0)) > 0 and float(svg.get("height", 0)) > 0, source[:300]
        shapes = [el for el in svg.iter() if el.tag.split("}")[-1] in SHAPES]
        assert shapes, f"an inline SVG draws nothing: {source[:300]}"


def render(exe: str, page: Path, shot: Path) -> str:
    """Screenshot `page` into `shot`; return the visible text of the DOM after rendering."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             f"--user-data-dir={shot.parent / 'chromium-profile'}"]
    url = page.resolve().as_uri()
    shot.unlink(missing_ok=True)  # a screenshot of an earlier page must not pass for this one's
    # one start of the browser does both: the screenshot to its file, the DOM to stdout
    dom = subprocess.run([exe, *flags, f"--screenshot={shot}", "--window-size=1000,1400", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120, check=True, stdin=subprocess.DEVNULL).stdout
    assert shot.is_file(), f"Chromium wrote no screenshot of {page}"
    return parse_page(dom).text()


def non_blank_share(shot: Path) -> float:
    """Fraction of the screenshot's pixels that are not the page's white background."""
    from PIL import Image

    image = Image.open(shot).convert("L")
    histogram = image.histogram()
    return 1.0 - histogram[255] / sum(histogram)
