"""TriAttention: scores against the paper's trigonometric series on fixed tensors, statistics files, prefill
statistics, one kept set per kv head in every layer."""

from __future__ import annotations

import math

import pytest
import torch

import reasonkv
from conftest import NoEosTokenizer, tiny_llama
from fixed_view import FixedCache, fixed_view, hf_rotate, hf_unrotate, model_info
from reasonkv.calibrate.centers import compute_centers
from reasonkv.hf import cache_keyword
from reasonkv.hf import model_info as hf_model_info
from reasonkv.policies.query_centers import QueryCenters, bundled_centers
from reasonkv.policies.rotary import Rotary

HEADS, KV_HEADS, DIM, LAYERS, SLOTS = 4, 2, 8, 2, 12
PAIRS = DIM // 2
INV_FREQ = 1.0 / (500.0 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
SCALING = 1.3  # a YaRN-style attention scaling folded into cos/sin


def _rotary() -> Rotary:
    return Rotary("yarn", tuple(INV_FREQ.tolist()), SCALING, "half", DIM)


def _centers(seed: int = 0, fingerprint: str = "fixed") -> QueryCenters:
    g = torch.Generator().manual_seed(seed)
    mean = torch.complex(torch.randn(LAYERS, HEADS, PAIRS, generator=g), torch.randn(LAYERS, HEADS, PAIRS, generator=g))
    modulus = mean.abs() + torch.rand(LAYERS, HEADS, PAIRS, generator=g)
    return QueryCenters(mean, modulus, tuple(range(LAYERS)), LAYERS, HEADS, DIM, "fixed", fingerprint, 100, "test")


def _setup(tmp_path, **options):
    """A policy on a stats file, a two-layer cache of rotated keys, and the pre-RoPE keys behind it."""
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 2, 3, 9, 15, 16, 30, 41, 42, 57, 60]).view(1, 1, SLOTS).expand(1, KV_HEADS, SLOTS)
    pre = [torch.randn(1, KV_HEADS, SLOTS, DIM, generator=g) for _ in range(LAYERS)]
    keys = [hf_rotate(k, INV_FREQ, SCALING, positions) for k in pre]
    values = [torch.randn(1, KV_HEADS, SLOTS, DIM, generator=g) for _ in range(LAYERS)]
    path = tmp_path / "centers.pt"
    _centers().save(path)
    policy = reasonkv.get_policy("triattention", stats=str(path), **options)
    info = model_info(LAYERS, HEADS, KV_HEADS, DIM, _rotary())
    policy.reset(info, 1, torch.device("cpu"))
    cache = FixedCache(keys, values, positions, budget=6)
    return policy, info, cache, pre, positions


def _series(centers: QueryCenters, layer: int, pre: torch.Tensor, positions: torch.Tensor, t: int, offset_max: int):
    """The paper's score, term by term: mean over o of Σ_f |q̄||k| s² cos(ω(t - p + o) + φ) + Σ_f (E|q| - |q̄|)|k| s²."""
    offsets = [2**i for i in range(int(math.log2(offset_max)) + 1)]
    out = torch.zeros(HEADS, SLOTS, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for h in range(HEADS):
        q = centers.mean[layer, h].to(torch.complex128)
        m = centers.modulus[layer, h].double()
        for s in range(SLOTS):
            k = pre[0, h // group, s].double()
            kf = torch.complex(k[:PAIRS], k[PAIRS:])
            phi = torch.angle(q * kf.conj())
            p = positions[0, 0, s].item()
            terms = [
                (q.abs() * kf.abs() * SCALING**2 * torch.cos(INV_FREQ.double() * (t - p + o) + phi)).sum()
                for o in offsets
            ]
            extra = ((m - q.abs()) * kf.abs() * SCALING**2).sum()
            out[h, s] = torch.stack(terms).mean() + extra
    return out


def test_scores_equal_the_papers_series_on_fixed_tensors(tmp_path):
    policy, info, cache, pre, positions = _setup(tmp_path, offset_max=64, normalize=False)
    view = fixed_view(cache, policy, info, layer=1)
    t = int(positions.max()) + 1
    expected = _series(_centers(), 1, pre[1], positions, t, 64)
    got = policy.head_scores(view)[0].double()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_max_over_offsets_and_the_head_aggregation(tmp_path):
    """``aggregation="max"``, then z-normalised per head over the candidates, max over the group, mean
    over layers (the authors' per-head pruning)."""
    policy, info, cache, pre, positions = _setup(tmp_path, offset_max=16, aggregation="max", sinks=2)
    t = int(positions.max()) + 1
    centers = _centers()
    per_layer = []
    for layer in range(LAYERS):
        offsets = [1, 2, 4, 8, 16]
        heads = []
        for o in offsets:  # the series at one offset: a mean over one offset
            heads.append(_series_at(centers, layer, pre[layer], positions, t, o))
        raw = torch.stack(heads).amax(0)  # [heads, slots]
        candidates = positions[0, 0] >= 2  # the two sinks are protected
        c = raw[:, candidates]
        z = (raw - c.mean(-1, keepdim=True)) / c.std(-1, unbiased=False, keepdim=True)
        per_layer.append(z.view(KV_HEADS, HEADS // KV_HEADS, SLOTS).amax(1))
    expected = torch.stack(per_layer).mean(0)
    got = policy.score(fixed_view(cache, policy, info, layer=0))[0].double()
    torch.testing.assert_close(got[:, 2:], expected[:, 2:], rtol=1e-4, atol=1e-4)


def _series_at(centers, layer, pre, positions, t, offset):
    group = HEADS // KV_HEADS
    out = torch.zeros(HEADS, SLOTS, dtype=torch.float64)
    for h in range(HEADS):
        q = centers.mean[layer, h].to(torch.complex128)
        m = centers.modulus[layer, h].double()
        k = pre[0, h // group].double()
        kf = torch.complex(k[:, :PAIRS], k[:, PAIRS:])
        phi = torch.angle(q * kf.conj())
        p = positions[0, 0].double().unsqueeze(-1)
        base = (q.abs() * kf.abs() * SCALING**2 * torch.cos(INV_FREQ.double() * (t - p + offset) + phi)).sum(-1)
        out[h] = base + ((m - q.abs()) * kf.abs() * SCALING**2).sum(-1)
    return out


def test_pre_rope_keys_are_the_cached_keys_rotated_back(tmp_path):
    """reasonkv's rotation undone equals the authors' inversion (and the keys before rotation)."""
    _, _, cache, pre, positions = _setup(tmp_path)
    tables = _rotary().tables()
    back = tables.unrotate(cache.layers[0].keys, positions)
    torch.testing.assert_close(back, hf_unrotate(cache.layers[0].keys, INV_FREQ, SCALING, positions))
    torch.testing.assert_close(back, pre[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_per_head_selection_keeps_one_set_per_kv_head_in_every_layer():
    model = tiny_llama(layers=3)
    with reasonkv.EvictingCache(12, 4, model=model, policy="triattention") as cache:
        ids = torch.tensor([NoEosTokenizer()("A prompt of some length for the test.")["input_ids"]])
        model.generate(ids, max_new_tokens=20, do_sample=False, **{cache_keyword(model): cache})
    assert cache.evictions > 2
    assert torch.equal(cache.positions(0), cache.positions(1)) and torch.equal(cache.positions(1), cache.positions(2))
    assert not torch.equal(cache.positions(0)[0, 0], cache.positions(0)[0, 1])  # kv heads choose apart


@pytest.mark.slow
def test_per_layer_head_selection_lets_layers_differ():
    model = tiny_llama(layers=3)
    with reasonkv.EvictingCache(12, 4, model=model, policy="triattention", selection="per-layer-head") as cache:
        ids = torch.tensor([NoEosTokenizer()("A prompt of some length for the test.")["input_ids"]])
        model.generate(ids, max_new_tokens=20, do_sample=False, **{cache_keyword(model): cache})
    assert not torch.equal(cache.positions(0), cache.positions(2))


def test_prefill_statistics_are_the_prompts_pre_rope_query_means():
    """stats="prefill" averages the first forward's queries: what the calibration computes on the prompt."""
    model = tiny_llama(layers=2)
    prompt = NoEosTokenizer()("Some prompt whose queries give the centers.")["input_ids"]
    cache = reasonkv.EvictingCache(12, 4, model=model, policy="triattention")
    with cache, torch.no_grad():
        with pytest.warns(UserWarning, match="stats='prefill'"):  # the run says where its centers come from
            model(input_ids=torch.tensor([prompt]), **{cache_keyword(model): cache})
        mean, modulus = cache.evictor.policy._state.sums.means()
        model(input_ids=torch.tensor([[7]]), **{cache_keyword(model): cache})  # a decode step adds nothing
        after = cache.evictor.policy._state.sums.means()[0]
    expected = compute_centers(model, [prompt])
    torch.testing.assert_close(mean[0], expected.mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(modulus[0], expected.modulus, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, mean)


def test_a_file_for_another_model_is_refused(tmp_path):
    model = tiny_llama(layers=2)
    info = hf_model_info(model)
    other = compute_centers(tiny_llama(layers=2, seed=5), [[5, 6, 7, 8]], name="other-weights")
    path = tmp_path / "other.pt"
    other.save(path)
    policy = reasonkv.get_policy("triattention", stats=str(path))
    with pytest.raises(ValueError, match="computed on other weights .*other-weights"):
        policy.reset(info, 1, torch.device("cpu"))
    shaped = tmp_path / "shape.pt"
    compute_centers(tiny_llama(layers=3), [[5, 6, 7]], name="three-layers").save(shaped)
    with pytest.raises(ValueError, match="3 layers, 4 heads of dim 16 .*this model has 2 layers"):
        reasonkv.get_policy("triattention", stats=str(shaped)).reset(info, 1, torch.device("cpu"))
    mine = tmp_path / "mine.pt"
    compute_centers(model, [[5, 6, 7, 8]], name="mine").save(mine)
    reasonkv.get_policy("triattention", stats=str(mine)).reset(info, 1, torch.device("cpu"))  # accepted


def test_bad_statistics_and_options_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        reasonkv.get_policy("triattention", stats=str(tmp_path / "missing.pt"))
    text = tmp_path / "notes.txt"
    text.write_text("not a statistics file")
    with pytest.raises(
        ValueError, match="is not a reasonkv query centers file \\(a text file of 21 bytes, not a torch file\\)"
    ):
        reasonkv.get_policy("triattention", stats=str(text))
    assert text.read_text() == "not a statistics file"
    with pytest.raises(ValueError, match="aggregation must be one of mean, max"):
        reasonkv.get_policy("triattention", aggregation="median")
    with pytest.raises(ValueError, match="selection must be one of per-head, per-layer-head"):
        reasonkv.get_policy("triattention", selection="global")
    with pytest.raises(ValueError, match="no query centers for this model"):
        reasonkv.get_policy("triattention", stats="bundled").reset(hf_model_info(tiny_llama()), 1, torch.device("cpu"))


def test_a_rotary_type_that_cannot_be_undone_is_refused_by_name():
    refused = Rotary("dynamic", head_dim=DIM, refused="rotary type 'dynamic' ...")
    info = model_info(LAYERS, HEADS, KV_HEADS, DIM, refused)
    for name in ("triattention", "expected-attention"):
        with pytest.raises(ValueError, match=f"{name}: cannot rotate keys back .*'dynamic'"):
            reasonkv.get_policy(name).reset(info, 1, torch.device("cpu"))


@pytest.mark.integration
def test_the_bundled_models_centers_are_found_by_their_fingerprint(smollm2):
    model, _ = smollm2
    centers, name = bundled_centers(hf_model_info(model), "triattention")
    assert name == "smollm2-135m.pt" and (centers.num_layers, centers.num_heads, centers.tokens) == (30, 9, 56486)
