"""``reasonkv calibrate --gates``: train SeerAttention-R's gate for a model by self-distillation (docs/calibrate.md).

:func:`run_gates` packs the model's own answers into sequences, takes every full-attention layer's queries and keys
from the attention tap, builds the targets (:mod:`reasonkv.policies.seer`), trains the gate and writes ``gates.pt``
and ``gates.json`` into ``--out``, claimed first (:func:`claim_gates_output`).
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from reasonkv.calibrate.shared import (
    ModelSettings,
    check_choices,
    check_positive,
    generation_setting,
    out_setting,
    progress_setting,
)
from reasonkv.calibrate.traces import prompt_ids
from reasonkv.eval.datasets import load_dataset
from reasonkv.generation.loop import generate
from reasonkv.hf import AttentionTap, model_info
from reasonkv.policies.quest import quest_scores
from reasonkv.policies.seer import (
    GATE_DIM,
    GATE_FILE,
    INITS,
    GateFile,
    GateShape,
    LayerExample,
    SeerGate,
    block_pool,
    gate_bytes,
    layer_example,
    load_gate,
    mean_loss,
    train_gate,
)
from reasonkv.runs.flags import flags, option, setting
from reasonkv.runs.outputs import ClaimedFolder, claim_folder, write_atomic
from reasonkv.runs.paths import portable_command, portable_path
from reasonkv.selection.recall import top_block_recall
from reasonkv.suggest.integers import check_int

__all__ = [
    "GATES_GROUP",
    "GatesSettings",
    "claim_gates_output",
    "collect_examples",
    "gate_recall",
    "pack_sequences",
    "query_rows",
    "run_gates",
    "self_traces",
    "shape_for",
]

GATES_GROUP = "gates (SeerAttention-R)"  # the flags' group on the command line
SUMMARY_FILE = "gates.json"
TOP_K = (1, 3)  # the recall measured on held-out sequences: of the true top 1 and top 3 blocks


def _gate(default: Any, help: str, **flag: Any) -> Any:
    """A setting of ``--gates``, its flag shown in the gates' group."""
    return setting(default, group=GATES_GROUP, help=help, **flag)


@dataclass(frozen=True, kw_only=True)
class GatesSettings(ModelSettings):
    """Everything one ``reasonkv calibrate --gates`` run is told. The model answers the problems of ``dataset``
    in order, ``batch`` at a time, and its answers (prompt and output) are packed into sequences of at least
    ``pack`` tokens until ``traces + held_out`` are full: the gate trains on ``traces`` of them (Adam, ``steps``
    sequences at ``lr``, ``queries`` query positions each) and its recall is measured on the other ``held_out``.
    ``seed`` seeds the sampling, the initial weights and the order; each field's flag says the rest."""

    traces: int = _gate(24, "packed sequences to train on (default 24)", name="--gate-traces", type="positive")
    held_out: int = _gate(4, "further packed sequences to measure recall on (default 4)", type=int)
    max_new_tokens: int = generation_setting(384)
    steps: int = _gate(300, "Adam steps, one sequence each (default 300)", name="--gate-steps", type="positive")
    temperature: float = _gate(
        0.6,
        "sampling temperature of the model's answers (default 0.6, as the papers decode; 0: greedy)",
        name="--gate-temperature",
        type=float,
    )
    pack: int = _gate(
        2048,
        "answers are packed end to end into sequences of at least this many tokens (default 2048)",
        name="--gate-pack",
        type="positive",
    )
    batch: int = _gate(16, "answers generated at a time (default 16)", name="--gate-batch", type="positive")
    queries: int = _gate(
        128,
        "query positions per packed sequence the loss is taken at (default 128)",
        name="--gate-queries",
        type="positive",
    )
    gate_dim: int = _gate(GATE_DIM, f"gate channels (default {GATE_DIM}, the authors' width)", type="positive")
    init: str = _gate(
        "normal",
        "initial gate weights: normal (default: N(0, 0.02), the authors' training) or xavier (uniform)",
        name="--gate-init",
        choices=INITS,
    )
    qk_norm: bool = _gate(
        True,
        "no RMSNorm on the gate's q and k (the authors' training turns it on, the default)",
        name="--no-gate-norm",
        negated=True,
    )
    later_half: bool = _gate(
        True,
        "train on queries from each sequence's second block, not only its later half (the authors' choice)",
        name="--gate-loss-everywhere",
        negated=True,
    )
    block_size: int = _gate(64, "tokens per block (default 64)", type="positive")
    lr: float = 2e-3
    seed: int = 0
    progress: bool = progress_setting()
    out: Path = out_setting()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "out", Path(self.out))
        check_positive(self, "traces", "max_new_tokens", "pack", "batch", "block_size", "gate_dim", "steps", "queries")
        check_int("held_out", self.held_out, 0)
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be 0 (greedy) or above, got {self.temperature!r}")
        check_choices(self)
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {str(self.out)!r} is a file; --gates writes a folder (gates.pt, gates.json)")
        needed = self.shortest(held_out=self.held_out > 0)
        if self.pack < needed:
            raise ValueError(
                f"--gate-pack {self.pack} is too short: a training sequence needs at least {self.shortest()} tokens "
                f"(a query after two whole blocks of --block-size {self.block_size}, so the gate has blocks to "
                f"choose among) and a held-out one {self.shortest(held_out=True)} (more than {max(TOP_K)} blocks, "
                f"for the recall of the top {max(TOP_K)}); use --gate-pack {needed} or more"
            )

    def shortest(self, *, held_out: bool = False) -> int:
        """The fewest tokens a sequence needs: its last query must have more whole blocks before its own block
        than it picks, two for training (with one, the target is that block whatever the gate: the loss is 0)
        and, on a held-out sequence, one more than the recall's largest top k (with k, every pick is right)."""
        return (max(TOP_K) + 1 if held_out else 2) * self.block_size + 1

    def command(self) -> str:
        spelled = {field.name: option(field, flag) for field, flag in flags(GatesSettings)}
        parts = ["reasonkv", "calibrate", "--gates", "--model", self.model, "--dataset", self.dataset]
        for name in ("traces", "held_out", "max_new_tokens", "steps", "temperature", "pack", "batch", "queries"):
            parts += [spelled[name], str(getattr(self, name))]
        parts += ["--block-size", str(self.block_size), "--gate-dim", str(self.gate_dim), "--gate-init", self.init]
        parts += [spelled[name] for name in ("qk_norm", "later_half") if not getattr(self, name)]
        return shlex.join([*parts, "--out", str(self.out)])


def shape_for(model, *, block_size: int = 64, gate_dim: int = GATE_DIM, qk_norm: bool = True) -> GateShape:
    """The gate shape for ``model``: its layers and heads, RoPE base read from its rotary frequencies."""
    info = model_info(model)
    rotary = info.rotary_of(info.full_layers[0], "calibrate --gates")
    base = 10000.0
    if len(rotary.inv_freq) > 1:  # inv_freq[f] = base^(-2f / rotary_dim)
        base = float(rotary.inv_freq[1]) ** (-rotary.rotary_dim / 2)
    shape = (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim, gate_dim, block_size, base)
    return GateShape(*shape, qk_norm=qk_norm)


def pack_sequences(answers: list[list[int]], length: int) -> list[list[int]]:
    """``answers`` concatenated in order into sequences of at least ``length`` tokens each (an answer is never
    split); the answers left over that do not fill one more are dropped."""
    packed, current = [], []
    for answer in answers:
        current = current + answer
        if len(current) >= length:
            packed.append(current)
            current = []
    return packed


def self_traces(model, tokenizer, settings: GatesSettings) -> list[list[int]]:
    """``traces + held_out`` sequences of at least ``pack`` tokens: prompts and the model's answers (full cache,
    ``batch`` at a time, sampled at ``temperature``, seeded from ``seed``, ``max_new_tokens`` at most) to the
    problems of ``dataset`` in order, packed end to end, as token ids."""
    s = settings
    dataset, count, batch, pack = s.dataset, s.traces + s.held_out, s.batch, s.pack
    problems = list(load_dataset(dataset))
    answers: list[list[int]] = []
    bar = tqdm(total=count, desc="gates: packed traces", leave=False)
    for start in range(0, len(problems), batch):
        prompts = [prompt_ids(tokenizer, p) for p in problems[start : start + batch]]
        results = generate(
            model,
            tokenizer,
            prompts,
            policy="full",
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            seed=[s.seed + start + i for i in range(len(prompts))],
        )
        answers += [p + list(r.token_ids) for p, r in zip(prompts, results, strict=True)]
        packed = pack_sequences(answers, pack)
        bar.update(min(len(packed), count) - bar.n)
        if len(packed) >= count:
            bar.close()
            return packed[:count]
    raise ValueError(
        f"dataset {dataset!r}'s {len(problems)} answers fill {len(pack_sequences(answers, pack))} sequences of "
        f"{pack} tokens; {count} were asked for"
    )


def query_rows(length: int, block_size: int, queries: int, later_half: bool) -> torch.Tensor:
    """``queries`` query positions of a sequence of ``length`` tokens, evenly spread to its end from its second
    block (the first with a block to choose), or with ``later_half`` from its middle if that is later."""
    first = max(block_size, length // 2) if later_half else block_size
    rows = torch.linspace(first, length - 1, min(queries, length - first))
    return rows.round().long().unique()


@torch.no_grad()  # not inference mode: the examples feed a gradient
def collect_examples(
    model,
    sequences: list[list[int]],
    block_size: int,
    queries: int,
    *,
    quest: bool = False,
    later_half: bool = False,
) -> list[list[LayerExample]]:
    """Per sequence, one :class:`LayerExample` per full-attention layer at ``queries`` positions (:func:`query_rows`),
    the frozen model run once over it; with ``quest``, also the post-RoPE queries and key bounds Quest scores with."""
    info = model_info(model)
    device = next(model.parameters()).device
    tables = {layer: info.rotary_of(layer, "calibrate --gates").tables(device) for layer in info.full_layers}
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def listen(layer, query, key, mask, kwargs) -> None:
        if layer in tables:
            captured[layer] = (query[0], key[0])

    examples = []
    with AttentionTap(model, listen):
        for ids in sequences:
            if len(ids) <= block_size:
                continue
            captured.clear()
            model(input_ids=torch.tensor([ids], device=device), use_cache=False)
            positions = torch.arange(len(ids), device=device)
            rows = query_rows(len(ids), block_size, queries, later_half).to(device)
            sequence = []
            for layer, (query, key) in sorted(captured.items()):
                before_q = tables[layer].unrotate(query, positions)
                before_k = tables[layer].unrotate(key, positions)
                example = layer_example(layer, query, key, before_q, before_k, rows, info.scaling, block_size)
                if quest:  # Quest's bounds are the post-RoPE keys' per-block extremes
                    high, low, _ = block_pool(key, block_size)
                    example.quest = (query[:, rows].float(), low, high)
                sequence.append(example)
            examples.append(sequence)
    return examples


@torch.no_grad()
def gate_recall(gate: SeerGate | None, examples: list[list[LayerExample]], k: int) -> float:
    """Mean recall of the true top ``k`` blocks over every layer and held-out query, by the gate's logits
    (None: Quest's bound, from the examples' ``quest`` tensors)."""
    total, count = 0.0, 0
    for sequence in examples:
        for e in sequence:
            if gate is None:
                query, low, high = e.quest
                # quest_scores takes one query per row: the queries go in as the batch.
                n = query.shape[1]
                scores = quest_scores(
                    query.transpose(0, 1),
                    low.unsqueeze(0).expand(n, -1, -1, -1),
                    high.unsqueeze(0).expand(n, -1, -1, -1),
                ).transpose(0, 1)
            else:
                scores = e.logits(gate)
            recall, pairs = top_block_recall(scores, e.target, e.visible, k)
            if pairs:
                total, count = total + recall * pairs, count + pairs
    return total / count if count else float("nan")


def _is_old_gates_folder(folder: Path) -> bool:
    """A gates folder from before output markers: each of its files is this command's (a gate, its summary)."""
    try:
        if (folder / GATE_FILE).exists():
            load_gate(folder / GATE_FILE)
        if (folder / SUMMARY_FILE).exists():
            summary = json.loads((folder / SUMMARY_FILE).read_text(encoding="utf-8"))
            command = summary.get("command") if isinstance(summary, dict) else None
            if not (isinstance(command, str) and command.startswith("reasonkv calibrate --gates")):
                return False
    except (OSError, ValueError):  # unreadable, not a gate file, not JSON (JSONDecodeError is a ValueError)
        return False
    return True


def claim_gates_output(settings: GatesSettings) -> ClaimedFolder:
    """Claim and lock the ``--out`` folder (it may hold calibrate's other files): ``ValueError`` when a gate
    file or summary there is not this command's, before anything is written."""
    return claim_folder(
        settings.out, "calibrate", (GATE_FILE, SUMMARY_FILE), recognise=_is_old_gates_folder, inputs=[settings.dataset]
    )


def run_gates(settings: GatesSettings) -> int:
    """Train and write the gate ``settings`` describe; returns 0."""
    with claim_gates_output(settings):
        return _run(settings)


def _check_trained(train: list, recall: dict) -> None:
    """Refuse to train on nothing, or to write a gate whose held-out recall measured nothing."""
    if not train:
        raise ValueError(
            "calibrate --gates: no trace to train on (no sequence holds a block to choose); nothing was written"
        )
    empty = sorted(k for k, values in recall.items() if any(v != v for v in values.values()))  # nan != nan
    if empty:
        raise ValueError(
            f"calibrate --gates: the held-out recall ({', '.join(empty)}) had no query with enough blocks to choose "
            "among; nothing was written"
        )


def _run(settings: GatesSettings) -> int:
    model, tokenizer = settings.load()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    sequences = self_traces(model, tokenizer, settings)
    block, queries, half = settings.block_size, settings.queries, settings.later_half
    train = collect_examples(model, sequences[: settings.traces], block, queries, later_half=half)
    held = collect_examples(model, sequences[settings.traces :], block, queries, quest=True, later_half=half)
    _check_trained(train, {})
    shape = shape_for(model, block_size=settings.block_size, gate_dim=settings.gate_dim, qk_norm=settings.qk_norm)
    gate = SeerGate(shape, seed=settings.seed, init=settings.init).to(settings.device)
    untrained = SeerGate(shape, seed=settings.seed, init=settings.init).to(settings.device)
    bar = tqdm(total=settings.steps, desc="gates: train", disable=not settings.progress)

    def step(index: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")

    with torch.enable_grad():
        losses = train_gate(gate, train, steps=settings.steps, lr=settings.lr, on_step=step, seed=settings.seed)
    bar.close()
    recall = {}
    if held:
        for k in TOP_K:
            recall[f"top{k}"] = {
                "trained": gate_recall(gate, held, k),
                "untrained": gate_recall(untrained, held, k),
                "quest": gate_recall(None, held, k),
            }
    summary = {
        "settings": {**asdict(settings), "out": portable_path(settings.out, settings.out)},
        "command": portable_command(settings.command(), settings.out),
        "traces": len(train),
        "held_out": len(held),
        "trace_tokens": [len(s) for s in sequences],
        "losses": losses,
        "held_out_loss": {"trained": mean_loss(gate, held), "untrained": mean_loss(untrained, held)} if held else {},
        "recall": recall,
    }
    _check_trained(train, recall)
    training = {"steps": settings.steps, "first_loss": losses[0], "last_loss": losses[-1], "recall": recall}
    sampling = f"temperature {settings.temperature:g}" if settings.temperature else "greedy"
    source = (
        f"{settings.dataset}: {len(train)} sequences of at least {settings.pack} tokens packed from the model's own "
        f"answers ({sampling}, up to {settings.max_new_tokens} tokens each)"
    )
    info = model_info(model)
    path = settings.out / GATE_FILE
    write_atomic(path, gate_bytes(GateFile(gate.cpu(), settings.model, info.fingerprint, source, training)))
    write_atomic(settings.out / SUMMARY_FILE, json.dumps(summary, indent=1) + "\n")
    print(
        f"calibrate --gates: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {settings.steps} steps on {len(train)} "
        f"traces; recall of the top 3 blocks on {len(held)} held-out traces: {recall.get('top3')}; wrote {path}",
        file=sys.stderr,
    )
    return 0
