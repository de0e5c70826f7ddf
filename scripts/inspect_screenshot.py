"""A screenshot of a ``reasonkv inspect`` page, as the README shows it: the slider at a chosen eviction, a token's
grid open. Needs Selenium and the system's Chromium and chromedriver.

    python scripts/inspect_screenshot.py docs/inspect/demo.html docs/inspect/screenshot.png \
        --moment 8 --run h2o --position 300
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By


def _executable(names: tuple[str, ...], debian: str) -> str | None:
    """The first of ``names`` on PATH, else where Debian's package puts it (not always on PATH), else None."""
    for name in names:
        if found := shutil.which(name):
            return found
    return debian if os.access(debian, os.X_OK) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path)
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--moment", type=int, default=1, help="slider position (1 = the first eviction)")
    parser.add_argument("--run", default=None, help="the run whose token is clicked (default: none)")
    parser.add_argument("--position", type=int, default=0, help="the clicked token's position")
    parser.add_argument("--size", default="1600,1000", help="window width,height in pixels")
    args = parser.parse_args()
    # Both paths are passed to Selenium: given no driver path, Selenium Manager tries to download one.
    browser = _executable(("chromium", "chromium-browser"), "/usr/lib/chromium/chromium")
    driver = _executable(("chromedriver",), "/usr/lib/chromium/chromedriver")
    if not (browser and driver):
        raise SystemExit("needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={args.size}"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    try:
        chrome.get(args.page.resolve().as_uri())
        chrome.execute_script(
            "const s = document.getElementById('moment'); s.value = arguments[0];s.dispatchEvent(new Event('input'));",
            args.moment,
        )
        if args.run:
            chrome.find_element(By.CSS_SELECTOR, f'#run-{args.run} .tok[data-pos="{args.position}"]').click()
        chrome.save_screenshot(str(args.out))
    finally:
        chrome.quit()


if __name__ == "__main__":
    main()
