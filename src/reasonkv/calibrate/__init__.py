"""Layer anatomy: find the layers whose hidden-state change marks important and filler tokens (docs/calibrate.md).

One step per module: ``traces`` (the sequences studied), ``labels`` (counterfactual importance by occlusion),
``signals`` (per-layer ``g`` and ``z`` and the baselines' scores), ``profile`` (per-layer correlation with the
labels), ``bands`` (bands A and B, written as the calibration file EPIKV loads), ``scores`` and ``auc`` (how
well each score finds the important chunks). Helpers: ``stats`` (numpy only), ``store`` (resumable JSONL),
``pipeline`` (collect, analyse), ``plot`` and ``summary``. ``settings`` holds a run's settings and ``run`` runs
it (``reasonkv calibrate``); ``centers``, ``budgets`` and ``gates`` write the files of ``--centers``,
``--budgets`` and ``--gates``. Importing this package does not import torch.
"""

from __future__ import annotations

__all__: list[str] = []
