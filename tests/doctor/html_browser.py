"""Load a page in headless Chromium (Debian's package; .ci/run installs it when missing): its screenshot and
the text of the page as the browser rendered it."""

from __future__ import annotations

import re
import shutil
import subprocess
from html import unescape
from pathlib import Path


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "headless Chromium is needed for the HTML report test: apt-get install chromium (.ci/run does)"
    return exe


def render(page: Path, shot: Path) -> str:
    """Screenshot `page` into `shot`; return the visible text of the DOM after rendering."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             f"--user-data-dir={shot.parent / 'chromium-profile'}"]
    url = page.resolve().as_uri()
    subprocess.run([chromium(), *flags, f"--screenshot={shot}", "--window-size=1000,1400", url],
                   capture_output=True, timeout=120, check=True, stdin=subprocess.DEVNULL)
    dom = subprocess.run([chromium(), *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120,
                         check=True, stdin=subprocess.DEVNULL).stdout
    body = re.sub(r"<style.*?</style>", " ", dom, flags=re.S)
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", body)).split())


def non_blank_share(shot: Path) -> float:
    """Fraction of the screenshot's pixels that are not the page's white background."""
    from PIL import Image

    image = Image.open(shot).convert("L")
    histogram = image.histogram()
    return 1.0 - histogram[255] / sum(histogram)
