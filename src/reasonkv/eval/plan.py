"""A grid made concrete, before any model loads: its problems, its units and their split across shards.

``--plan`` prints :meth:`GridPlan.summary`; a run does the units :meth:`GridPlan.mine` gives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reasonkv.eval.datasets import Problem, dataset_path, load_dataset
from reasonkv.eval.grid import Cell, GridSpec
from reasonkv.eval.shards import Shard
from reasonkv.eval.units import Unit, assign, grid_units, unit_cost

__all__ = ["GridPlan", "plan_grid"]


def dataset_file(name: str) -> Path:
    """The file a dataset name reads: the bundled file, or the path itself."""
    try:
        return dataset_path(name)
    except ValueError:
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

    def samples_for(self, dataset: str, index: int) -> int:
        return self.grid.samples_for(dataset, self.cells[index])

    def mine(self) -> set[Unit]:
        return {u for u in self.units if self.owner[u] == self.shard.index}

    def dataset_files(self) -> list[Path]:
        return [dataset_file(name) for name, _ in self.datasets]

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


def plan_grid(
    grid: GridSpec | None = None, *, shard: Shard | str | tuple[int, int] | None = None, **settings
) -> GridPlan:
    """Load the grid's problems and split its units across shards.

    ``grid`` is a :class:`GridSpec`; or give its settings as keywords (see :meth:`GridSpec.build`).
    ``shard``: this process's share (``"I/N"``), default from a ``torch.distributed`` launcher, else all.
    """
    if grid is None:
        grid = GridSpec.build(**settings)
    elif settings:
        raise ValueError(f"the grid's settings come from grid=...; do not also pass {', '.join(sorted(settings))}")
    datasets = [(name, load_dataset(name, limit=limit)) for name, limit in grid.datasets]
    if all(len(problems) == 0 for _, problems in datasets):
        raise ValueError("the datasets hold no problems")
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
