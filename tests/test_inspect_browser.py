"""The inspect page in a real browser: headless Chromium (the system's, driven by Selenium) opens it from a file
URL with no console error and no request; the slider recolours exactly the tokens the trace says were evicted;
a click opens the token's grid, whose cells are the trace's. A screenshot is kept (``REASONKV_TEST_ARTIFACTS``).

Skipped, saying why, where Chromium, its driver or Selenium is missing (``scripts/setup.sh`` installs them
when it runs as root on Debian); CI sets ``REASONKV_REQUIRE_BROWSER`` so that there it fails instead."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import NoEosTokenizer, tiny_llama
from reasonkv.cache.spec import CacheSpec
from reasonkv.inspect.page import write_page
from reasonkv.inspect.runs import Inspection, inspect_prompt


def _executable(names: tuple[str, ...], debian: str) -> str | None:
    """The first of ``names`` on PATH, else where Debian's package puts it (not always on PATH), else None."""
    for name in names:
        if found := shutil.which(name):
            return found
    return debian if os.access(debian, os.X_OK) else None


# Both paths are passed to Selenium: given no driver path, Selenium Manager tries to download one.
CHROMIUM = _executable(("chromium", "chromium-browser"), "/usr/lib/chromium/chromium")
DRIVER = _executable(("chromedriver",), "/usr/lib/chromium/chromedriver")
MISSING = "no system Chromium and chromedriver (Debian: apt-get install chromium chromium-driver)"
if os.environ.get("REASONKV_REQUIRE_BROWSER") and not (CHROMIUM and DRIVER):
    pytest.fail(f"REASONKV_REQUIRE_BROWSER is set but there is {MISSING}", pytrace=False)
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason=MISSING)
if os.environ.get("REASONKV_REQUIRE_BROWSER"):
    from selenium import webdriver  # required: an ImportError fails the run
else:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")


@pytest.fixture(scope="module")
def inspection() -> Inspection:
    specs = [CacheSpec.build("h2o", 12, 4), CacheSpec.build("streaming", 12, 6)]
    return inspect_prompt(tiny_llama(), NoEosTokenizer(), "What is two plus two? Think.", specs, max_new_tokens=40)


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    assert driver.service.path == DRIVER  # this driver, not one Selenium Manager looked up
    yield driver
    driver.quit()


def held_counts(run, eviction_index: int | None) -> np.ndarray:
    """Per position, the evicting layers' slots holding it after an eviction (None: before any)."""
    trace = run.trace
    slots = len(trace.evicting) * trace.heads
    counts = np.full(len(run.pieces), slots)
    if eviction_index is not None:
        eviction = trace.evictions[eviction_index]
        kept = eviction.kept_mask()[list(trace.evicting)]
        counts[: eviction.seen] = kept.sum((0, 1))
    return counts


def read_tokens(driver, name: str) -> tuple[list[str], list[int]]:
    script = (
        f"const s = [...document.querySelectorAll('#run-{name} .tok')];"
        "return [s.map(x => getComputedStyle(x).backgroundColor), s.map(x => Number(x.dataset.held))];"
    )
    colours, held = driver.execute_script(script)
    return colours, held


def test_the_page_in_chromium(inspection, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    page = write_page(tmp_path / "inspect.html", inspection)
    browser.get_log("performance")  # drop what came before
    browser.get(page.resolve().as_uri())
    assert browser.title.startswith("reasonkv inspect")

    # The slider steps through the union of the runs' eviction moments; step with the arrow keys to the
    # h2o run's second eviction, then one more: each step recolours exactly the tokens that lost slots.
    h2o = next(run for run in inspection.runs if run.name == "h2o")
    moments = sorted({e.seen for run in inspection.runs for e in run.trace.evictions})
    second, third = h2o.trace.evictions[1], h2o.trace.evictions[2]
    body = browser.find_element(By.TAG_NAME, "body")
    for _ in range(moments.index(second.seen) + 1):
        ActionChains(browser).send_keys_to_element(body, Keys.ARROW_RIGHT).perform()
    before_colours, before_held = read_tokens(browser, "h2o")
    assert before_held[: second.seen] == held_counts(h2o, 1)[: second.seen].tolist()
    steps = moments.index(third.seen) - moments.index(second.seen)
    for _ in range(steps):
        ActionChains(browser).send_keys_to_element(body, Keys.ARROW_RIGHT).perform()
    after_colours, after_held = read_tokens(browser, "h2o")
    assert after_held[: third.seen] == held_counts(h2o, 2)[: third.seen].tolist()
    old = held_counts(h2o, 1)
    evicted = [p for p in range(second.seen) if held_counts(h2o, 2)[p] < old[p]]
    unchanged = [p for p in range(second.seen) if held_counts(h2o, 2)[p] == old[p]]
    assert evicted and unchanged
    assert all(after_colours[p] != before_colours[p] for p in evicted)
    assert all(after_colours[p] == before_colours[p] for p in unchanged)

    # A click on a token the eviction dropped opens its layer x head grid: one cell per layer, head and
    # eviction after it, in the states the trace holds.
    p = evicted[0]
    browser.find_element(By.CSS_SELECTOR, f'#run-h2o .tok[data-pos="{p}"]').click()
    panel = browser.find_element(By.ID, "grid-panel")
    assert panel.is_displayed()
    states = browser.execute_script(
        "return [...document.querySelectorAll('#grid-panel .grid tr')].slice(1, -2)"
        ".map(r => [...r.querySelectorAll('td')].map(td => [...td.children].map(c => c.dataset.state)));"
    )
    shown = [e for e in h2o.trace.evictions if e.seen > p]
    trace = h2o.trace
    assert len(states) == len(trace.layers) and all(len(row) == len(shown) for row in states)
    column = shown.index(third)
    kept, before = third.kept_mask()[:, :, p], third.before_mask()[:, :, p]
    protected = third.protected_mask()[:, :, p]
    for t in range(len(trace.layers)):
        expected = [
            "gone" if not before[t, h] else "evicted" if not kept[t, h] else "protected" if protected[t, h] else "kept"
            for h in range(trace.heads)
        ]
        assert states[t][column] == expected, (t, p)
    assert "evicted" in [s for row in states for s in row[column]]
    # Each cell names the token's rank in the policy's ranking at that eviction, as the trace holds it.
    title = browser.execute_script(
        f"return document.querySelectorAll('#grid-panel .grid tr')[1].querySelectorAll('td')[{column}]"
        ".children[0].title;"
    )
    rank = int(third.ranks[0, 0][np.flatnonzero(third.before_mask()[0, 0]).tolist().index(p)])
    assert f"rank {rank} of " in title, title

    artifacts = Path(os.environ.get("REASONKV_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(artifacts / "inspect-page.png"))

    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors
    requests = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            requests.append(message["params"]["request"]["url"])
    assert requests and all(url == page.resolve().as_uri() for url in requests), requests


@pytest.fixture(scope="module")
def signal_inspection() -> Inspection:
    specs = [
        CacheSpec.build("epikv", 12, 4),
        CacheSpec.build("vase-attnv", 12, 4, window=4, query_window=4, reserve=4),
    ]
    return inspect_prompt(tiny_llama(), NoEosTokenizer(), "What is two plus two? Think.", specs, max_new_tokens=40)


def near(pixels: list[int], colour: tuple[int, int, int]) -> int:
    """How many opaque pixels of RGBA ``pixels`` are close to ``colour`` (lines are anti-aliased)."""
    return sum(
        1
        for i in range(0, len(pixels), 4)
        if pixels[i + 3] > 200 and sum(abs(pixels[i + k] - colour[k]) for k in range(3)) < 60
    )


@pytest.mark.slow
def test_the_policies_signals_in_chromium(signal_inspection, browser, tmp_path):
    """At each eviction, EPIKV's band A and band B are drawn as two lines under its text (one point per token
    the policy scored), and the tokens of VASE's value-range reserve are outlined, exactly those the trace holds."""
    page = write_page(tmp_path / "signals.html", signal_inspection)
    browser.get(page.resolve().as_uri())
    epikv, vase = signal_inspection.runs[1], signal_inspection.runs[2]
    moments = sorted({e.seen for run in signal_inspection.runs for e in run.trace.evictions})
    legend = browser.find_element("id", "legend").text
    assert "value-range reserve" in legend
    drawn_before = None
    for eviction in (epikv.trace.evictions[1], epikv.trace.evictions[-1]):
        browser.execute_script(
            "const s = document.getElementById('moment'); s.value = arguments[0]; s.dispatchEvent(new Event('input'));",
            moments.index(eviction.seen) + 1,
        )
        drawn, pixels = browser.execute_script(
            "const c = document.querySelector('canvas.lines[data-run=\"epikv\"]');"
            "return [JSON.parse(c.dataset.drawn), [...c.getContext('2d').getImageData(0, 0, c.width, c.height).data]];"
        )
        finite = {
            name: int(np.isfinite(eviction.signal(name).astype(np.float32)).sum()) for name in ("band_a", "band_b")
        }
        assert drawn == finite and min(finite.values()) >= 8
        assert near(pixels, (0, 114, 178)) > 50 and near(pixels, (230, 159, 0)) > 30  # band A blue, band B orange
        assert pixels != drawn_before
        drawn_before = pixels

        # Outlined: the tokens some (layer, head) reserved, as strongly as the share of heads (the most: opaque).
        at = max((e for e in vase.trace.evictions if e.seen <= eviction.seen), key=lambda e: e.seen, default=None)
        counts = at.signal("reserve").sum((0, 1))
        outlined = browser.execute_script(
            "return [...document.querySelectorAll('#run-vase-attnv .tok.reserve')]"
            ".map(s => [Number(s.dataset.pos), Number(s.dataset.reserve), getComputedStyle(s).boxShadow]);"
        )
        assert {p: n for p, n, _ in outlined} == {p: int(counts[p]) for p in np.flatnonzero(counts)}
        assert len(outlined) >= 4 and all("204, 121, 167" in shadow for *_, shadow in outlined)
        strongest = [shadow for p, _, shadow in outlined if counts[p] == counts.max()]
        assert strongest and all("rgb(204, 121, 167)" in shadow for shadow in strongest)  # opaque
        assert not browser.execute_script("return document.querySelectorAll('#run-epikv .tok.reserve').length;")
    artifacts = Path(os.environ.get("REASONKV_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(artifacts / "inspect-signals.png"))
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


@pytest.fixture(scope="module")
def allocated_inspection() -> Inspection:
    specs = [
        CacheSpec.build("h2o", 16, 5, allocation="pyramid"),
        CacheSpec.build("snapkv", 16, 5, window=3, allocation="adaptive"),
    ]
    prompt = [5 + (7 * i) % 80 for i in range(40)]
    return inspect_prompt(tiny_llama(layers=4), NoEosTokenizer(), prompt, specs, max_new_tokens=40)


def test_each_heads_budget_in_chromium(allocated_inspection, browser, tmp_path):
    """Under an allocation each run shows a layers x kv-heads table: pyramid's budgets, adaptive's counts kept
    at the chosen eviction (the uniform split before any); a token's grid names each head's own budget."""
    from selenium.webdriver.common.by import By

    page = write_page(tmp_path / "budgets.html", allocated_inspection)
    browser.get(page.resolve().as_uri())
    h2o, snapkv = allocated_inspection.runs[1], allocated_inspection.runs[2]
    read = (
        "return [...document.querySelectorAll(`table.budgets[data-run='${arguments[0]}'] tr`)].slice(1)"
        ".map(r => [...r.querySelectorAll('td')].map(td => td.textContent));"
    )

    def shown(name: str) -> tuple[np.ndarray, np.ndarray]:
        rows = browser.execute_script(read, name)
        table = np.array([[int(x) for x in row] for row in rows])
        return table[:, :-1], table[:, -1]

    budgets, sums = shown("h2o")
    assert np.array_equal(budgets, h2o.trace.budgets) and np.array_equal(sums, h2o.trace.budgets.sum(1))
    assert budgets[0, 0] > budgets[-1, 0]
    counts, _ = shown("snapkv")
    assert (counts == 16).all()  # before any eviction: the uniform split
    moments = sorted({e.seen for run in allocated_inspection.runs for e in run.trace.evictions})
    differing = [e for e in snapkv.trace.evictions if len(set(e.kept_counts().flatten().tolist())) > 1]
    assert differing, "adaptive kept as many in every head at every eviction"
    for eviction in (snapkv.trace.evictions[0], differing[-1]):
        browser.execute_script(
            "const s = document.getElementById('moment'); s.value = arguments[0]; s.dispatchEvent(new Event('input'));",
            moments.index(eviction.seen) + 1,
        )
        counts, sums = shown("snapkv")
        assert np.array_equal(counts, eviction.kept_counts()) and (sums == 16 * 2).all()
        assert np.array_equal(shown("h2o")[0], h2o.trace.budgets)  # a static table stays
    # A token's grid: each head's rank against its own budget (pyramid: its layer's).
    last = h2o.trace.evictions[-1]
    p = int(np.flatnonzero(last.before_mask()[-1, 0])[0])
    browser.find_element(By.CSS_SELECTOR, f'#run-h2o .tok[data-pos="{p}"]').click()
    titles = browser.execute_script(
        "return [...document.querySelectorAll('#grid-panel .grid tr')].slice(1, -2)"
        ".map(r => [...r.querySelectorAll('td')].pop().children[0].title);"
    )
    ranked = [(t, title) for t, title in enumerate(titles) if "; rank " in title]
    assert len(ranked) >= 2
    for t, title in ranked:
        assert f"(budget {h2o.trace.budgets[t, 0]})" in title, title
    assert "within each head's budget" in browser.find_element(By.ID, "grid-panel").text
    artifacts = Path(os.environ.get("REASONKV_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(artifacts / "inspect-budgets.png"))
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors
