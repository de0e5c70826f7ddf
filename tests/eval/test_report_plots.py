"""The report's plots: what each axis shows at one and at several budgets, and figures with nothing to show."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from reasonkv.eval.report_plots import _panel, plot, plot_names  # noqa: E402
from reasonkv.eval.report_rows import Row, Section  # noqa: E402

SECTION = Section("m", "gsm8k", 64, 0.0, 1.0, 0)


def _row(policy: str, budget: int | None, **values) -> Row:
    return Row(section=SECTION, policy=policy, budget=budget, buffer=None if budget is None else 16, **values)


def _axes():
    fig, ax = plt.subplots()
    return fig, ax


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_at_one_budget_the_policies_stand_side_by_side_on_their_own_ticks():
    rows = [_row("full", None, tokens_per_second=15.6)]
    rows += [_row(p, 64, tokens_per_second=t) for p, t in (("streaming", 15.2), ("h2o", 15.4), ("snapkv", 15.5))]
    _, ax = _axes()
    _panel(ax, rows, "tokens_per_second", None, "tokens/s")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["streaming", "h2o", "snapkv"]
    assert list(ax.get_xticks()) == [0, 1, 2]
    low, high = ax.get_xlim()
    assert low < 0 and high > 2 and high - low < 4  # the points fill the axis, next to their ticks
    assert ax.get_ylim()[0] == 0  # 15.2 against 15.6 tokens/s: 3% apart, drawn as 3%


def test_at_several_budgets_equal_values_stay_visible():
    rows = [_row(p, b, collapse_rate=0.25) for p in ("streaming", "h2o") for b in (32, 64, 128)]
    _, ax = _axes()
    _panel(ax, rows, "collapse_rate", None, "collapse")
    lines = [c.lines[0] for c in ax.containers]
    assert len(lines) == 2
    streaming, h2o = (list(line.get_xdata()) for line in lines)
    assert all(a != b for a, b in zip(streaming, h2o, strict=True))  # set apart, not one over the other
    assert lines[0].get_marker() != lines[1].get_marker() and lines[0].get_linestyle() != lines[1].get_linestyle()
    assert ax.get_xscale() == "log" and list(ax.get_xticks()) == [32, 64, 128]
    for x, budget in zip(streaming, (32, 64, 128), strict=True):
        assert abs(math.log2(x) - math.log2(budget)) < 0.2  # near its budget's tick


def test_fidelity_panels_draw_their_intervals():
    rows = [_row("h2o", 64, fidelity_n=4, top1_agreement=0.9, top1_low=0.85, top1_high=0.95)]
    rows += [_row("h2o", 128, fidelity_n=4, top1_agreement=0.97, top1_low=0.95, top1_high=0.99)]
    _, ax = _axes()
    _panel(ax, rows, "top1_agreement", ("top1_low", "top1_high"), "top-1")
    [container] = ax.containers
    bars = container.lines[2][0].get_segments()
    assert [tuple(round(y, 3) for y in (s[0][1], s[1][1])) for s in bars] == [(0.85, 0.95), (0.95, 0.99)]


def test_a_figure_is_drawn_only_when_an_evicting_policy_has_something_to_show(tmp_path):
    fidelity_only = [_row("full", None, n=4, accuracy=0.0, ci_low=0.0, ci_high=0.5, tokens_per_second=20.0)]
    fidelity_only += [_row("h2o", 64, fidelity_n=4, top1_agreement=0.9, kl_mean=0.1)]
    assert list(plot_names(fidelity_only)[SECTION]) == ["fidelity"]  # no throughput axis with full alone
    failed = [_row("full", None, n=2, accuracy=0.5, ci_low=0.1, ci_high=0.9), _row("raas", 48, errors=2)]
    assert plot_names(failed)[SECTION] == {}
    assert plot(failed, tmp_path) == [] and list(tmp_path.iterdir()) == []
