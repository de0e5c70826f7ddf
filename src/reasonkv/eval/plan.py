"""A grid made concrete before any model loads: its problems, its units and their split across shards
(``--plan`` prints :meth:`GridPlan.summary`; a run's manifest records :meth:`GridPlan.description`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from reasonkv.eval.datasets import Problem, dataset_path, grid_problems
from reasonkv.eval.extraction import CODE_KINDS
from reasonkv.eval.grid import Cell, GridSpec
from reasonkv.eval.manifest import file_sha256, grid_identity, grid_sha256
from reasonkv.eval.shards import Shard
from reasonkv.eval.units import Unit, assign, grid_units, unit_cost

__all__ = ["GridPlan", "has_code", "plan_grid"]


def dataset_file(name: str) -> Path:
    """The file a dataset name reads: the bundled file, or the path itself."""
    with contextlib.suppress(ValueError):
        return dataset_path(name)
    return Path(name)


@dataclass
class GridPlan:
    """A grid with its problems loaded, its units and their owners: everything but the model."""

    grid: GridSpec
    datasets: list[tuple[str, list[Problem]]]
    fidelity: bool  # the grid's fidelity setting, decided now that the datasets are known
    shard: Shard
    units: list[Unit]
    owner: dict[Unit, int]

    @property
    def cells(self) -> tuple[Cell, ...]:
        return self.grid.cells

    def mine(self) -> set[Unit]:
        return {u for u in self.units if self.owner[u] == self.shard.index}

    def dataset_files(self) -> list[Path]:
        return [dataset_file(name) for name, _ in self.datasets]

    def sampling(self) -> dict[str, Any]:
        """The decoding settings as the manifest's setup records them."""
        sampling = asdict(self.grid.sampling)
        return {
            **sampling,
            **{name: float(sampling[name]) for name in ("temperature", "top_p")},
            "seed": self.grid.seed,
        }

    @cached_property
    def description(self) -> dict[str, Any]:
        """The manifest's ``grid``: datasets (with their files' SHA-256), cells, what is measured, and
        ``sha256``, the grid's identity (see :func:`reasonkv.eval.manifest.grid_identity`)."""
        limits = dict(self.grid.datasets)
        datasets = [
            {
                "name": name,
                "file": str(path),
                "sha256": file_sha256(path),
                "limit": limits[name],
                "problems": len(problems),
                "samples": self.grid.samples[name],
            }
            for (name, problems), path in zip(self.datasets, self.dataset_files(), strict=True)
        ]
        policies = [{"label": c.label, "budget": c.budget, "buffer": c.buffer, "config": c.config} for c in self.cells]
        grid = {
            "datasets": datasets,
            "policies": policies,
            "fidelity": bool(self.fidelity),
            "fidelity_tokens": self.grid.replay_tokens,
            "generation": self.grid.generation,
            "batch_size": self.grid.batch_size,
            "compile": self.grid.compile,
        }
        grid = json.loads(json.dumps(grid, default=str))  # as a manifest reads back
        grid["sha256"] = grid_sha256(grid_identity(grid, self.sampling()))
        return grid

    def identity(self) -> dict[str, Any]:
        """What decides this grid's units and their split (:func:`~reasonkv.eval.manifest.grid_identity`)."""
        return grid_identity(self.description, self.sampling())

    def summary(self) -> str:
        """Units, the most tokens they may generate, and each shard's share of the expected cost."""
        most = self.grid.sampling.max_new_tokens
        generations = [u for u in self.units if u.kind == "generation"]
        lines = [
            f"{len(generations)} generation units (at most {len(generations) * most:,} new tokens, "
            f"every one running to {most}) and {len(self.units) - len(generations)} fidelity replays"
        ]
        for name, problems in self.datasets:
            count = sum(1 for u in generations if u.dataset == name)
            lines.append(f"  {name}: {len(problems)} problems, {count} generation units")
        if self.shard.count > 1:
            cost = [0.0] * self.shard.count
            units = [0] * self.shard.count
            for unit in self.units:
                cost[self.owner[unit]] += unit_cost(unit, self.cells, most, self.grid.replay_tokens)
                units[self.owner[unit]] += 1
            total = sum(cost) or 1.0
            for rank in range(self.shard.count):
                share = f"{cost[rank] / total:.1%}"
                lines.append(f"  shard {rank}/{self.shard.count}: {units[rank]} units, {share} of the expected cost")
        return "\n".join(lines)


def has_code(problems: list[Problem]) -> bool:
    return any(p.kind in CODE_KINDS for p in problems)


def plan_grid(
    grid: GridSpec | None = None, *, shard: Shard | str | tuple[int, int] | None = None, **settings
) -> GridPlan:
    """Load the grid's problems and split its units across shards (``shard``: ``"I/N"``; default from a
    ``torch.distributed`` launcher, else all). ``grid``, or its settings as keywords (:meth:`GridSpec.build`)."""
    if grid is None:
        grid = GridSpec.build(**settings)
    elif settings:
        raise ValueError(f"the grid's settings come from grid=...; do not also pass {', '.join(sorted(settings))}")
    datasets = [(name, grid_problems(name, limit, grid.code.after, grid.code.before)) for name, limit in grid.datasets]
    if all(len(problems) == 0 for _, problems in datasets):
        raise ValueError("the datasets hold no problems")
    code = [name for name, problems in datasets if has_code(problems)]
    if code and not grid.code.allow_execution:
        raise ValueError(
            f"{', '.join(code)} holds code problems, graded by running the model's programs: pass "
            "--allow-code-execution to run them in the sandbox (allow_execution=True in Python)"
        )
    unknown = grid.trace_problems - {p.id for _, problems in datasets for p in problems}
    if unknown:
        raise ValueError(f"trace_problems names problems that are not in the grid's datasets: {sorted(unknown)}")
    fidelity = grid.fidelity
    if fidelity is None:
        fidelity = any(p.solution for _, problems in datasets for p in problems)
    shard = Shard.resolve(shard)
    cells = grid.cells
    counts = {(name, i): grid.samples_for(name, cell) for name, _ in datasets for i, cell in enumerate(cells)}
    units = grid_units(datasets, cells, counts, fidelity, grid.generation)
    most = grid.sampling.max_new_tokens
    owner = assign(units, cells, shard.count, max_new_tokens=most, fidelity_tokens=grid.replay_tokens)
    return GridPlan(grid, datasets, fidelity, shard, units, owner)
