"""reasonkv's side of the score comparison (run with reasonkv's environment, src/ on the path:
``python ours.py authors.pt src/reasonkv/data/centers/smollm2-135m.pt``): the same tensors through reasonkv's policies; max abs differences
and kept-set Jaccard at K = 64 against the authors' scores (authors.py's output)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests" / "policies"))
from fixed_view import FixedCache, fixed_view  # noqa: E402

import reasonkv  # noqa: E402
from reasonkv.policies.contract import ModelInfo  # noqa: E402
from reasonkv.policies.recorded import Recorded  # noqa: E402
from reasonkv.policies.rotary import Rotary  # noqa: E402

authors_path, centers_path = sys.argv[1], sys.argv[2]
K = 64
data = torch.load(authors_path, weights_only=False)
layers = data["layers"]
L = len(layers)
_, heads, n, d = layers[0]["queries"].shape
kv_heads = layers[0]["keys"].shape[1]
rotary = Rotary("default", tuple(data["inv_freq"].tolist()), data["scaling"], "half", d)
info = ModelInfo(L, heads, kv_heads, d, rotary=(rotary,) * L, fingerprint="")
positions = torch.arange(n).view(1, 1, n).expand(1, kv_heads, n)
cache = FixedCache([x["keys"] for x in layers], [x["values"] for x in layers], positions, budget=K)


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over kv heads of |A ∩ B| / |A ∪ B| of two kept index sets ``[kv_heads, K]``."""
    out = []
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        x, y = set(x), set(y)
        out.append(len(x & y) / len(x | y))
    return sum(out) / len(out)


def top(scores: torch.Tensor) -> torch.Tensor:
    return scores.topk(K, dim=-1).indices


report = {}

# KeyDiff (sinks=0: kvpress protects nothing)
policy = reasonkv.get_policy("keydiff", sinks=0)
diffs, jac = [], []
for layer in range(L):
    view = fixed_view(cache, policy, info, layer=layer)
    ours = policy.score(view)[0]
    theirs = layers[layer]["kd"][0]
    diffs.append((ours - theirs).abs().max().item())
    jac.append(jaccard(policy.keep(view)[0], top(theirs)))
report["keydiff"] = (max(diffs), sum(jac) / L, min(jac))

# Expected attention (kvpress: n_sink 4, 512 future positions, covariance, value norm; queries = the prompt's,
# less the first n_sink, as its prefill press reads them: the "window" span)
policy = reasonkv.get_policy("expected-attention", query_window=n, query_span="window")
policy.reset(info, 1, torch.device("cpu"))
diffs, rel, jac = [], [], []
for layer in range(L):
    recorded = Recorded(n)
    recorded.push_queries(layer, layers[layer]["queries"], torch.arange(n).unsqueeze(0), torch.ones(1, n, dtype=torch.bool))
    view = fixed_view(cache, policy, info, recorded=recorded, layer=layer)
    ours = policy.score(view)[0]
    theirs = layers[layer]["ea"][0]
    diffs.append((ours[:, 4:] - theirs[:, 4:]).abs().max().item())
    rel.append(((ours[:, 4:] - theirs[:, 4:]).abs().max() / theirs[:, 4:].abs().max()).item())
    jac.append(jaccard(policy.keep(view)[0], top(theirs)))
report["expected-attention"] = (max(diffs), sum(jac) / L, min(jac), max(rel))

# TriAttention (sinks 0, window 0: every token a candidate, as the authors' with the prompt not pinned)
policy = reasonkv.get_policy("triattention", stats=centers_path, sinks=0)
info_tri = ModelInfo(L, heads, kv_heads, d, rotary=(rotary,) * L, fingerprint="")
policy.reset(info_tri, 1, torch.device("cpu"))
diffs, rel = [], []
for layer in range(L):
    view = fixed_view(cache, policy, info_tri, layer=layer)
    ours = policy.head_scores(view)[0]
    theirs = layers[layer]["tri"]
    diffs.append((ours - theirs).abs().max().item())
    rel.append(((ours - theirs).abs().max() / theirs.abs().max()).item())
view = fixed_view(cache, policy, info_tri, layer=0)
shared = policy.score(view)[0]
shared_diff = (shared - data["tri_shared"]).abs().max().item()
kept = policy.keep_layers(view)[0][0]
report["triattention"] = (max(diffs), max(rel), shared_diff, jaccard(kept, top(data["tri_shared"])))

print(f"tokens {n}, layers {L}, heads {heads}/{kv_heads}, head_dim {d}, K = {K}")
kd = report["keydiff"]
print(f"keydiff: max |diff| {kd[0]:.3e}; Jaccard of kept sets mean {kd[1]:.4f}, min {kd[2]:.4f}")
ea = report["expected-attention"]
print(f"expected-attention: max |diff| {ea[0]:.3e} (relative {ea[3]:.3e}); Jaccard mean {ea[1]:.4f}, min {ea[2]:.4f}")
tri = report["triattention"]
print(
    f"triattention: per-head score max |diff| {tri[0]:.3e} (relative {tri[1]:.3e}); per-head-pruning "
    f"aggregate max |diff| {tri[2]:.3e}; Jaccard of kept sets {tri[3]:.4f}"
)
