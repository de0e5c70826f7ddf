"""``reasonkv calibrate``: find a model's EPIKV layer bands from counterfactual importance labels, or, with
``--centers``, write the query centers file TriAttention loads (``--out`` is then that file; the traces
come from ``--dataset`` / ``--traces`` / ``--max-trace-tokens``, or from a plain-text file, ``--text``;
:func:`reasonkv.calibrate.centers.run_centers`), or, with ``--gates``, train SeerAttention-R's gate on the
model's own answers to ``--gate-traces`` problems of ``--dataset`` and write ``gates.pt`` and ``gates.json``
into ``--out`` (:func:`reasonkv.calibrate.gates.run_gates`), or, with ``--budgets``, write the budget file of
``allocation="calibrated"`` (``--out`` is that file): each (layer, kv-head) weighted by the attention mass its
queries pay beyond ``--budget-sinks`` and the ``--budget-window`` most recent keys
(:func:`reasonkv.calibrate.budgets.run_budgets`).

Writes into ``--out``: ``labels.jsonl`` and ``signals.jsonl`` (one record per trace, appended as
they are computed: rerunning the same command resumes, and a larger ``--traces`` adds traces),
``calibration.json`` (the file EPIKV loads), ``correlation.png``, ``results.json`` (every number)
and ``summary.md``. The folder must be calibrate's own (or new, or free of these files); it is locked
while the command runs (:func:`reasonkv.calibrate.store.claim_output`).

Every flag is declared once, as a field of the settings it sets (:mod:`reasonkv.runs.flags`), or, for the
switches that pick the calibration, of :class:`CalibrationKind`; this module adds them to the parser, reads them
back into the settings the switches pick, and refuses combinations no calibration takes.
:func:`reasonkv.calibrate.run.run_calibration` (or the picked calibration's own run) does the rest.
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
    if picked.budgets:
        if args.analyse_only or picked.centers or picked.gates:
            raise ValueError(
                "--budgets writes a budget file; it does not combine with --analyse-only, --centers or --gates"
            )
        return BudgetsSettings(**read_flags(BudgetsSettings, args))
    if picked.gates and (args.analyse_only or picked.centers):
        raise ValueError("--gates trains a gate; it does not combine with --analyse-only or --centers")
    if picked.centers:
        if args.analyse_only:
            raise ValueError("--analyse-only analyses anatomy records; --centers has none")
        return CentersSettings(**read_flags(CentersSettings, args))
    if args.text is not None:
        raise ValueError("--text is read by --centers and --budgets only (--gates and the anatomy read --dataset)")
    cls = GatesSettings if picked.gates else CalibrateSettings
    return cls(**read_flags(cls, args))


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if isinstance(settings, BudgetsSettings):
        return run_budgets(settings)
    if isinstance(settings, GatesSettings):
        return run_gates(settings)
    return run_centers(settings) if isinstance(settings, CentersSettings) else run_calibration(settings)
