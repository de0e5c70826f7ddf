"""Per-token signals against references computed from an eager pass with ``output_attentions``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import VOCAB, tiny_llama
from reasonkv.calibrate.signals import SignalSettings, causal_zscore, chunk_means, token_signals, trace_signals


def _naive_zscore(g: list[float], window: int, eps: float) -> list[float]:
    out = []
    for t, value in enumerate(g):
        history = [v for v in g[max(0, t - window) : t] if not math.isnan(v)]
        if math.isnan(value) or len(history) < 2:
            out.append(0.0)
            continue
        mu = sum(history) / len(history)
        sigma = math.sqrt(sum((v - mu) ** 2 for v in history) / len(history))
        out.append((value - mu) / (sigma + eps))
    return out


@pytest.mark.parametrize("window", [1, 2, 5, 40])
def test_zscore_equals_the_definition(window):
    g = torch.rand(3, 30) * torch.linspace(1, 3, 30)
    g[:, 0] = math.nan
    g[1, 7] = math.nan
    z = causal_zscore(g, window, 1e-6)
    for row in range(3):
        want = torch.tensor(_naive_zscore(g[row].tolist(), window, 1e-6))
        torch.testing.assert_close(z[row], want, atol=1e-5, rtol=1e-5)


def test_chunk_means_skip_missing_values():
    values = torch.tensor([[math.nan, 1.0, 2.0, 3.0, math.nan]])
    torch.testing.assert_close(chunk_means(values, [(0, 2), (2, 4), (4, 5)])[0, :2], torch.tensor([1.0, 2.5]))
    assert math.isnan(chunk_means(values, [(4, 5)])[0, 0])


def _reference(model, ids: torch.Tensor, settings: SignalSettings):
    eager = tiny_llama()
    eager.load_state_dict(model.state_dict())
    eager.config._attn_implementation = "eager"
    layers, hidden = eager.model.layers, {}
    handles = [
        layer.register_forward_hook(lambda m, a, o, i=i: hidden.__setitem__(i, o[0] if isinstance(o, tuple) else o))
        for i, layer in enumerate(layers)
    ]
    with torch.no_grad():
        out = eager(ids.unsqueeze(0), output_attentions=True, output_hidden_states=True, use_cache=True)
    for h in handles:
        h.remove()
    T = ids.shape[0]
    g = torch.full((len(layers), T), math.nan)
    for layer in range(len(layers)):
        # hidden_states[l + 1] is layer l's output except for the last layer (final norm applied there)
        state = out.hidden_states[layer + 1][0] if layer < len(layers) - 1 else hidden[layer][0]
        for t in range(1, T):
            g[layer, t] = (state[t] - state[t - 1]).norm()
    cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
    h2o, tova, snap, knorm = (torch.zeros(T) for _ in range(4))
    for layer, att in enumerate(out.attentions):
        a = att[0]  # [H, T, T]
        h2o += a.sum(1).mean(0)
        tova += a[:, -1].mean(0)
        hkv = cache.layers[layer].keys.shape[1]
        per_group = a[:, -settings.query_window :].sum(1).view(hkv, -1, T).mean(1)
        pooled = F.max_pool1d(per_group.unsqueeze(1), settings.kernel, 1, settings.kernel // 2).squeeze(1)
        snap += pooled.mean(0)
        knorm += -cache.layers[layer].keys[0].norm(dim=-1).mean(0)
    n = len(layers)
    return g, {"h2o": h2o / n, "tova": tova / n, "snapkv": snap / n, "knorm": knorm / n}


def test_signals_equal_the_eager_reference():
    model = tiny_llama(layers=3)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    settings = SignalSettings(window=8, query_window=5, kernel=3)
    got = token_signals(model, ids, settings, seed_key="x")
    g, scores = _reference(model, ids, settings)
    torch.testing.assert_close(got["g"], g, equal_nan=True, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["z"], causal_zscore(g, 8, 1e-6), atol=1e-3, rtol=1e-3)
    for name, want in scores.items():
        torch.testing.assert_close(got["scores"][name], want, atol=1e-5, rtol=1e-4, msg=name)
    torch.testing.assert_close(got["scores"]["recency"], torch.arange(40.0))
    assert torch.equal(got["scores"]["random"], token_signals(model, ids, settings, seed_key="x")["scores"]["random"])
    # the model gets its own attention back
    assert model.config._attn_implementation == "sdpa"


def test_trace_signals_are_chunk_means():
    model = tiny_llama(layers=2)
    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    chunks = [[8, 12], [12, 16], [16, 20]]
    record = trace_signals(model, ids, chunks, seed_key="y")
    full = token_signals(model, ids, seed_key="y")
    assert len(record["g"]) == 2 and len(record["g"][0]) == 3
    torch.testing.assert_close(torch.tensor(record["z"]), chunk_means(full["z"], chunks))
    torch.testing.assert_close(torch.tensor(record["scores"]["h2o"]), chunk_means(full["scores"]["h2o"], chunks))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(window=0), "window must be a positive integer"),
        (dict(kernel=4), "kernel must be odd"),
        (dict(pooling="median"), "pooling must be one of max, avg"),
        (dict(eps=-1.0), "eps must be a non-negative number"),
    ],
)
def test_bad_settings(options, message):
    with pytest.raises(ValueError, match=message):
        SignalSettings(**options)


@pytest.mark.parametrize("variant", ["zscore", "raw", "band"])
def test_epikv_scores_match_the_policy(variant):
    """The chunk scores the AUC table gives EPIKV equal the chunk means of the policy's own token scores."""
    import reasonkv
    from reasonkv.calibrate.scores import epikv_scores
    from reasonkv.hf import decoder_layers, model_info
    from reasonkv.policies.calibration import Calibration
    from reasonkv.policies.contract import Step

    if "epikv" not in reasonkv.list_policies():
        pytest.skip("the epikv policy is not installed")
    model = tiny_llama(layers=4)
    ids = torch.randint(3, VOCAB, (48,), generator=torch.Generator().manual_seed(5))
    layers = Calibration(num_layers=4, a=1, b=3, band_a=(0, 1), band_b=(2, 3))
    policy = reasonkv.get_policy("epikv", variant=variant, a=1, b=3, band_a=(0, 1), band_b=(2, 3), stats_window=8)
    hidden = {}
    handles = [
        layer.register_forward_hook(lambda m, a, o, i=i: hidden.__setitem__(i, o[0] if isinstance(o, tuple) else o))
        for i, layer in enumerate(decoder_layers(model))
    ]
    with torch.no_grad():
        model(ids.unsqueeze(0))
    for handle in handles:
        handle.remove()
    info = model_info(model.config)
    policy.reset(info, 1, torch.device("cpu"))
    positions = torch.arange(48).unsqueeze(0)
    policy.observe(Step(input_valid=torch.ones(1, 48, dtype=torch.bool), input_positions=positions, hidden=hidden))
    want = policy.token_scores(positions)[0]

    chunks = [[8, 16], [16, 24], [24, 32], [32, 40], [40, 48]]
    signals = token_signals(model, ids, SignalSettings(window=8))
    got = epikv_scores(chunk_means(signals["g"], chunks).numpy(), chunk_means(signals["z"], chunks).numpy(), layers)
    name = {"zscore": "epikv", "raw": "epikv-raw", "band": "epikv-band"}[variant]
    torch.testing.assert_close(torch.tensor(got[name]).float(), chunk_means(want, chunks), atol=1e-4, rtol=1e-4)
