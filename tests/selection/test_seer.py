"""SeerAttention-R: the gate, its self-distillation, its file, and the policy that reads with it."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import tiny_llama, tiny_qwen3
from reasonkv.calibrate.gates import collect_examples, gate_recall, shape_for
from reasonkv.hf import model_info
from reasonkv.selection.distill import block_targets, gate_loss, mean_loss, train_gate
from reasonkv.selection.gate import SeerGate
from reasonkv.selection.gatefile import GateFile, load_gate, save_gate

BLOCK = 16


def _sequences(count: int, length: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (length,), generator=generator).tolist() for _ in range(count)]


def test_targets_are_the_group_max_of_block_max_attention_renormalised():
    generator = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(4, 40, 8, generator=generator), torch.randn(2, 40, 8, generator=generator)
    rows = torch.tensor([10, 25, 39])
    target, visible = block_targets(queries, keys, rows, 0.3, 8)
    for i, t in enumerate(rows.tolist()):
        for h in range(2):
            heads = []
            for g in (2 * h, 2 * h + 1):
                weights = (queries[g, t] @ keys[h, : t + 1].T * 0.3).softmax(-1)
                heads.append(torch.stack([weights[j * 8 : (j + 1) * 8].max() for j in range(t // 8)]))
            expected = torch.stack(heads).amax(0)
            torch.testing.assert_close(target[h, i, : t // 8], expected / expected.sum())
            assert target[h, i, t // 8 :].eq(0).all()
        assert visible[i].tolist() == [j < t // 8 for j in range(5)]


def test_training_lowers_the_loss_on_a_tiny_model_in_a_few_steps():
    model = tiny_qwen3(layers=2)
    examples = collect_examples(model, _sequences(4, 120), BLOCK, 48)
    gate = SeerGate(shape_for(model, block_size=BLOCK, gate_dim=16), seed=1)
    before = mean_loss(gate, examples)
    losses = train_gate(gate, examples, steps=40, lr=1e-2)
    after = mean_loss(gate, examples)
    assert len(losses) == 40 and after < 0.8 * before, (before, after)
    assert all(gate_loss(gate, e).item() >= 0 for e in examples[0])  # a KL divergence


def _trained_gate_file(model, path) -> GateFile:
    examples = collect_examples(model, _sequences(3, 100, seed=2), BLOCK, 32)
    gate = SeerGate(shape_for(model, block_size=BLOCK, gate_dim=16), seed=3)
    train_gate(gate, examples, steps=10, lr=1e-2)
    gate_file = GateFile(gate, "tiny", model_info(model).fingerprint, "test", {"steps": 10})
    save_gate(gate_file, path)
    return gate_file


def _choices(model, prompts, path, **options):
    """Every layer's block choice at every decode step of a seer generation."""
    record = []

    def spy(step, cache):
        if step == 0:
            cache.evictor.selector.on_read = lambda layer, choice, *rest: record.append(
                (choice.blocks.clone(), choice.chosen.clone())
            )

    out = reasonkv.generate(
        model,
        None,
        prompts,
        policy="seer",
        budget=3 * BLOCK,
        block_size=BLOCK,
        gates=str(path),
        max_new_tokens=60,
        ignore_eos=True,
        on_step=spy,
        **options,
    )
    return record, out


def test_a_saved_gate_file_loads_and_gives_identical_selections(tmp_path):
    model = tiny_llama(layers=2)
    gate_file = _trained_gate_file(model, tmp_path / "gates.pt")
    loaded = load_gate(tmp_path / "gates.pt")
    for mine, theirs in zip([*gate_file.gate.parameters()], [*loaded.gate.parameters()], strict=True):
        assert torch.equal(mine.detach().half().float(), theirs.detach())
    save_gate(loaded, tmp_path / "again" / "gates.pt")  # the loaded gate written again: the same gate
    prompts = _sequences(3, 90, seed=4)
    prompts[1] = prompts[1][:61]  # ragged
    first, out = _choices(model, prompts, tmp_path / "gates.pt")
    second, _ = _choices(model, prompts, tmp_path / "again")  # a calibrate --gates folder
    assert len(first) == 2 * 59
    for (a, x), (b, y) in zip(first, second, strict=True):
        assert torch.equal(a, b) and torch.equal(x, y)
    assert all(0 < r.stats["selection"]["read_fraction"] < 1 for r in out)


def test_the_threshold_variant_reads_no_more_than_the_top_k(tmp_path):
    model = tiny_llama(layers=2)
    _trained_gate_file(model, tmp_path / "gates.pt")
    prompts = _sequences(2, 100, seed=5)
    _, top = _choices(model, prompts, tmp_path / "gates.pt")
    _, thresholded = _choices(model, prompts, tmp_path / "gates.pt", threshold=0.4)
    for a, b in zip(top, thresholded, strict=True):
        assert b.stats["selection"]["kv_bytes_read_per_step"] < a.stats["selection"]["kv_bytes_read_per_step"]


def test_a_budget_covering_every_block_decodes_as_the_full_cache(tmp_path):
    model = tiny_llama(layers=2)
    _trained_gate_file(model, tmp_path / "gates.pt")
    prompts = _sequences(2, 80, seed=6)
    full = reasonkv.generate(model, None, prompts, policy="full", max_new_tokens=50, ignore_eos=True)
    seer = reasonkv.generate(
        model,
        None,
        prompts,
        policy="seer",
        budget=16 * BLOCK,
        block_size=BLOCK,
        gates=str(tmp_path / "gates.pt"),
        max_new_tokens=50,
        ignore_eos=True,
    )
    assert [r.token_ids for r in full] == [r.token_ids for r in seer]


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (dict(layers=3), "layers 2 \\(the model has 3\\)"),
        (dict(kv_heads=4), "kv_heads 2 \\(the model has 4\\)"),
    ],
)
def test_a_gate_file_for_another_model_is_refused_naming_the_counts(tmp_path, other, message):
    _trained_gate_file(tiny_llama(layers=2), tmp_path / "gates.pt")
    with pytest.raises(ValueError, match=message):
        reasonkv.generate(
            tiny_llama(**{"layers": 2, **other}),
            None,
            [[5] * 40],
            policy="seer",
            budget=32,
            block_size=BLOCK,
            gates=str(tmp_path / "gates.pt"),
            max_new_tokens=2,
        )


def test_bad_gate_inputs_are_refused(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a gate")
    model = tiny_llama(layers=2)
    with pytest.raises(ValueError, match="is not a reasonkv gate file"):
        reasonkv.generate(
            model,
            None,
            [[5] * 40],
            policy="seer",
            budget=32,
            block_size=BLOCK,
            gates=str(tmp_path / "junk.pt"),
            max_new_tokens=2,
        )
    with pytest.raises(ValueError, match="does not exist"):
        load_gate(tmp_path / "missing.pt")
    _trained_gate_file(model, tmp_path / "gates.pt")
    with pytest.raises(ValueError, match="block_size=16"):
        reasonkv.generate(
            model, None, [[5] * 40], policy="seer", budget=64, gates=str(tmp_path / "gates.pt"), max_new_tokens=2
        )
    with pytest.raises(ValueError, match="at least one block"):
        reasonkv.generate(model, None, [[5] * 40], policy="seer", budget=8, block_size=BLOCK, max_new_tokens=2)


def test_recall_of_the_gate_and_of_quest_are_fractions():
    model = tiny_qwen3(layers=2)
    examples = collect_examples(model, _sequences(2, 110, seed=7), BLOCK, 24, quest=True)
    gate = SeerGate(shape_for(model, block_size=BLOCK, gate_dim=16))
    for scorer in (gate, None):
        recall = gate_recall(scorer, examples, 2)
        assert 0 <= recall <= 1


def test_a_model_without_a_shipped_gate_is_told_how_to_make_one():
    with pytest.raises(ValueError, match="ships no gate for this model .*reasonkv calibrate --gates"):
        reasonkv.generate(tiny_llama(layers=2), None, [[5] * 40], policy="seer", budget=128, max_new_tokens=2)


@pytest.mark.integration
@pytest.mark.slow
def test_the_shipped_smollm2_gate_loads_by_its_weights_and_reads_within_the_budget(smollm2):
    model, tokenizer = smollm2
    [result] = reasonkv.generate(
        model,
        tokenizer,
        ["Natalia sold 48 clips in April and half as many in May. How many in all?"],
        policy="seer",
        budget=128,
        max_new_tokens=120,
        ignore_eos=True,
    )
    read = result.stats["selection"]
    # 30 layers x 3 kv-heads, at most 128 tokens each per step, K and V of 64 float32 channels.
    assert 0 < read["kv_bytes_read_per_step"] <= 30 * 3 * 128 * 2 * 64 * 4
    assert read["read_fraction"] < 1 and result.stats["evictions"] == 0
