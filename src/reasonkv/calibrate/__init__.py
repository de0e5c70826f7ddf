"""Layer anatomy: find the layers whose hidden-state change marks important and filler tokens.

The EPIKV paper found its two layer bands by hand on one 32-layer model. This package measures them
for any model, one step per module:

``traces``
    The token sequences to study: a dataset's reference solutions teacher-forced after their
    problem prompts, or the model's own generations, with the span of the final answer.
``labels``
    Counterfactual importance: hide one chunk of earlier trace tokens at a time through the
    attention mask (positions never move), teacher-force the rest, and record how much the
    log-likelihood of the later tokens and of the final answer drops. Cached as JSONL; resumable.
``signals``
    One teacher-forced pass per trace: ``g_l(t) = ||h_l(t) - h_l(t-1)||`` of every decoder layer,
    its causal z-score, and the per-token scores of the baseline policies (key norm and the
    attention-based ones, computed from eager attention in this offline pass), averaged per chunk.
``profile``
    Per-layer Spearman correlation of the chunk signal with the labels, within each trace (the
    chunk's position partialled out by default), averaged over traces, with a bootstrap interval
    that resamples traces.
``bands``
    Band A (strongest positive run of layers) and band B (strongest negative), by a documented
    rule, written as the calibration file EPIKV loads.
``scores`` / ``auc``
    The per-chunk score of every policy with a per-token score (EPIKV at the default and at the
    calibrated layers, key norm, H2O, TOVA, SnapKV, recency, random) and its AUC at telling a
    trace's top-20% chunks from the rest.

Helpers: ``stats`` (ranks, Spearman, AUC, bootstrap; numpy only), ``store`` (resumable JSONL),
``pipeline`` (collect records, analyse them), ``plot`` and ``summary`` (the PNG and the markdown).

``settings`` holds every setting of a run (:class:`~reasonkv.calibrate.settings.CalibrateSettings`) and
``run`` runs all of it from them (:func:`~reasonkv.calibrate.run.run_calibration`), writing a plot and a
markdown summary; ``reasonkv calibrate`` (:mod:`reasonkv.cli.calibrate`) builds the settings from its
arguments. Importing this package does not import torch.
"""

from __future__ import annotations

__all__: list[str] = []
