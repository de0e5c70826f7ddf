"""SeerAttention-R: the gate, its self-distillation, its file, and the policy that reads with it."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import tiny_llama, tiny_qwen3
from reasonkv.calibrate.gates import collect_examples, gate_recall, shape_for
from reasonkv.hf import model_info
from reasonkv.policies.seer import (
    GateFile,
    Seer,
    SeerGate,
    block_targets,
    gate_loss,
    load_gate,
    mean_loss,
    save_gate,
    train_gate,
)
from reasonkv.selection.pooled import PooledKeys

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
    # 30 layers x 3 kv-heads, at most 128 tokens and the current block each per step, K and V of 64 float32 channels.
    assert 0 < read["kv_bytes_read_per_step"] <= 30 * 3 * (128 + 64) * 2 * 64 * 4
    assert read["read_fraction"] < 1 and result.stats["evictions"] == 0


def _hand_rope(x, position, base):
    """RoPE written out pair by pair (channel i with channel i + dim/2), at one position."""
    dim = x.shape[-1]
    out = x.clone().double()
    for i in range(dim // 2):
        angle = position * base ** (-2 * i / dim)
        c, s = torch.cos(torch.tensor(angle, dtype=torch.float64)), torch.sin(torch.tensor(angle, dtype=torch.float64))
        out[..., i] = x[..., i] * c - x[..., i + dim // 2] * s
        out[..., i + dim // 2] = x[..., i + dim // 2] * c + x[..., i] * s
    return out


def _hand_norm(x, weight):
    return x / torch.sqrt((x * x).mean() + 1e-6) * weight


def _hand_logits(gate, layer, queries, maximum, minimum, mean, position):
    """The authors' gate for one query (pre-RoPE ``queries`` ``[heads, d]``): per kv-head, the group's projected
    queries summed, RMSNorm, RoPE at ``position``; per block, max/min/mean pooled keys projected, RMSNorm,
    RoPE at the block's first position; logits q . k / sqrt(gate_dim)."""
    s = gate.shape
    out = torch.zeros(s.kv_heads, maximum.shape[1], dtype=torch.float64)
    for k in range(s.kv_heads):
        q = sum(queries[k * s.group + g].double() @ gate.query[layer][k, g].double() for g in range(s.group))
        q = _hand_rope(_hand_norm(q, gate.query_norm[layer].double()), position, s.rope_base)
        for j in range(maximum.shape[1]):
            pooled = torch.cat([maximum[k, j], minimum[k, j], mean[k, j]]).double()
            key = _hand_norm(pooled @ gate.key[layer][k].double(), gate.key_norm[layer].double())
            out[k, j] = q @ _hand_rope(key, j * s.block_size, s.rope_base) / s.gate_dim**0.5
    return out


def test_the_gate_forward_with_rmsnorm_equals_a_hand_written_one():
    model = tiny_llama(layers=2)
    shape = shape_for(model, block_size=BLOCK, gate_dim=16)
    assert shape.qk_norm  # the authors' training turns it on: the default
    gate = SeerGate(shape, seed=4)
    with torch.no_grad():  # norm weights away from their initial ones, so that they count
        for w in [*gate.query_norm, *gate.key_norm]:
            w.uniform_(0.5, 1.5)
    generator = torch.Generator().manual_seed(5)
    queries = torch.randn(4, 16, generator=generator)
    maximum, minimum, mean = (torch.randn(2, 5, 16, generator=generator) for _ in range(3))
    got = gate.logits(
        gate.gate_queries(1, queries.view(1, 4, 1, 16), torch.tensor([[77]])),
        gate.gate_keys(1, maximum[None], minimum[None], mean[None]),
    )[0, :, 0]
    expected = _hand_logits(gate, 1, queries, maximum, minimum, mean, 77)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_gate_is_the_authors_width_and_initialisation_by_default():
    model = tiny_llama(layers=2)
    shape = shape_for(model, block_size=BLOCK)
    assert shape.gate_dim == 128
    gate = SeerGate(shape_for(tiny_llama(layers=2, heads=16, kv_heads=2), block_size=BLOCK), seed=0)
    weights = torch.cat([w.detach().flatten() for w in [*gate.query, *gate.key]])
    assert abs(float(weights.std()) - 0.02) < 0.001 and abs(float(weights.mean())) < 0.001
    assert all(torch.equal(w, torch.ones(128)) for w in [*gate.query_norm, *gate.key_norm])
    xavier = SeerGate(shape, init="xavier")
    assert float(xavier.key[0].abs().max()) > 0.1  # uniform over +-sqrt(6 / (fan_in + fan_out))
    with pytest.raises(ValueError, match="gate init must be one of normal, xavier, got 'zeros'"):
        SeerGate(shape, init="zeros")


def _seer(model, gate):
    policy = Seer(gates="unused", block_size=BLOCK)
    info = model_info(model)
    policy.gate, policy.info = gate, info
    policy.rotary = {layer: info.rotary_of(layer, "test").tables() for layer in info.full_layers}
    return policy, policy.rotary[0]


@pytest.mark.parametrize("newest", [70, 79])  # the current block filling (logit 0), and just completed (its own)
def test_the_softmax_runs_over_every_block_up_to_the_current_one(newest):
    model = tiny_llama(layers=2)
    gate = SeerGate(shape_for(model, block_size=BLOCK, gate_dim=16), seed=6)
    policy, rotary = _seer(model, gate)
    generator = torch.Generator().manual_seed(7)
    keys = torch.randn(1, 2, newest + 1, 16, generator=generator)  # pre-RoPE
    pooled = PooledKeys(BLOCK)
    pooled.add(keys, torch.arange(newest + 1).view(1, -1))
    before = torch.randn(4, 16, generator=generator)
    query = rotary.rotate(before.view(1, 4, 1, 16), torch.tensor(newest).view(1, 1, 1))[:, :, 0]
    got = policy.gate_probabilities(0, query, pooled, torch.tensor([newest]))[0]
    logits = _hand_logits(gate, 0, before, pooled.maximum[0], pooled.minimum[0], pooled.mean[0], newest)
    if newest % BLOCK != BLOCK - 1:
        logits[:, -1] = 0.0  # the authors' zeroed gate key of the block still filling
    torch.testing.assert_close(got.double(), logits.softmax(-1), atol=1e-5, rtol=1e-4)
    assert got.shape[-1] == newest // BLOCK + 1  # the current block is in the softmax


def test_the_threshold_variant_is_not_capped_at_the_budget_unless_asked():
    assert not Seer(gates="x", threshold=0.05).capped
    assert Seer(gates="x", threshold=0.05, cap=True).capped and Seer(gates="x").capped
    with pytest.raises(ValueError, match="cap=True caps the threshold variant"):
        Seer(gates="x", cap=True)
    with pytest.raises(ValueError, match="rule must be one of within, plus, got 'all'"):
        Seer(gates="x", rule="all")


def test_a_version_1_gate_file_loads_as_a_gate_without_norm(tmp_path):
    model = tiny_llama(layers=2)
    gate = SeerGate(shape_for(model, block_size=BLOCK, gate_dim=16, qk_norm=False), seed=8)
    save_gate(GateFile(gate, "tiny"), tmp_path / "new.pt")
    payload = torch.load(tmp_path / "new.pt", weights_only=True)
    payload["version"] = 1  # as written before RMSNorm: no qk_norm in the shape, no norm weights
    del payload["shape"]["qk_norm"], payload["query_norm"], payload["key_norm"]
    torch.save(payload, tmp_path / "old.pt")
    loaded = load_gate(tmp_path / "old.pt").gate
    assert not loaded.shape.qk_norm and len(loaded.query_norm) == 0
    assert torch.equal(loaded.key[1], gate.key[1].detach().half().float())
    payload["version"] = 3
    torch.save(payload, tmp_path / "future.pt")
    with pytest.raises(ValueError, match="has gate file version 3; this reasonkv reads 1, 2"):
        load_gate(tmp_path / "future.pt")
