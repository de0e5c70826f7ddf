"""``reasonkv calibrate``: a model's EPIKV layer bands, or one of the files other commands load (``--centers``:
TriAttention's query centers; ``--gates``: SeerAttention-R's gate; ``--budgets``: the budget file of
``allocation="calibrated"``); its outputs are listed in docs/cli.md.

Every flag is a field of the settings it sets, or, for the switches that pick the calibration, of
:class:`CalibrationKind`: this module adds them to the parser, reads them back into the settings the switches
pick, and refuses combinations no calibration takes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from reasonkv.calibrate.budgets import BUDGETS_GROUP, BudgetsSettings, run_budgets
from reasonkv.calibrate.centers import CentersSettings, run_centers
from reasonkv.calibrate.gates import GATES_GROUP, GatesSettings, run_gates
from reasonkv.calibrate.reading import TEXT_GROUP
from reasonkv.calibrate.run import run_calibration
from reasonkv.calibrate.settings import CalibrateSettings
from reasonkv.cli.flags import add_flags, read_flags
from reasonkv.runs.flags import setting

__all__ = ["CalibrationKind", "add_arguments", "run", "settings_from"]


@dataclass(frozen=True)
class CalibrationKind:
    """Which calibration runs: the layer anatomy (none of these), or one of the files another command loads."""

    centers: bool = setting(
        False,
        group=TEXT_GROUP,
        help="write TriAttention's query centers of the model to the file --out instead of the layer anatomy",
    )
    budgets: bool = setting(
        False,
        group=BUDGETS_GROUP,
        help="write the budget file of --allocation calibrated (attention mass per head) to the file --out",
    )
    gates: bool = setting(
        False,
        group=GATES_GROUP,
        help="train the seer policy's gate by self-distillation and write gates.pt into --out",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, CalibrateSettings, CalibrationKind, CentersSettings, BudgetsSettings, GatesSettings)


def settings_from(
    args: argparse.Namespace,
) -> CalibrateSettings | CentersSettings | GatesSettings | BudgetsSettings:
    """The settings the arguments describe (``ValueError`` for anything wrong, before any folder is touched)."""
    picked = CalibrationKind(**read_flags(CalibrationKind, args))
    if picked.budgets and (args.analyse_only or picked.centers or picked.gates):
        raise ValueError(
            "--budgets writes a budget file; it does not combine with --analyse-only, --centers or --gates"
        )
    if picked.gates and (args.analyse_only or picked.centers):
        raise ValueError("--gates trains a gate; it does not combine with --analyse-only or --centers")
    if picked.centers and args.analyse_only:
        raise ValueError("--analyse-only analyses anatomy records; --centers has none")
    if args.text is not None and not (picked.budgets or picked.centers):
        raise ValueError("--text is read by --centers and --budgets only (--gates and the anatomy read --dataset)")
    # at most one of the three is on by now
    kinds = ((picked.budgets, BudgetsSettings), (picked.centers, CentersSettings), (picked.gates, GatesSettings))
    cls = next((kind for chosen, kind in kinds if chosen), CalibrateSettings)
    return cls(**read_flags(cls, args))


_RUNS = {BudgetsSettings: run_budgets, GatesSettings: run_gates, CentersSettings: run_centers}


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    return _RUNS.get(type(settings), run_calibration)(settings)
