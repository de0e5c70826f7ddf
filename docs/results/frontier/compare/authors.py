"""Authors' side of the score comparison (run in a separate environment with kvpress 0.5.5 and the
transformers it pins, 5.2; TriAttention's code from a checkout of its repository, commit c3744ee6):

    python authors.py src/reasonkv/data/centers/smollm2-135m.pt src/reasonkv/data/math500.jsonl authors.pt TRIATTENTION_CHECKOUT

Real SmolLM2-135M tensors (fp32): a 512-token text, every layer's attention input (hidden states after
the input norm), post-RoPE queries, cached post-RoPE keys and values. Scores: kvpress 0.5.5's
ExpectedAttentionPress.score and KeyDiffPress.score per layer; TriAttention's pruning_utils
(invert_rope, compute_frequency_statistics_from_means, score_keys_for_round) per (layer, head) with the
query centers file given, then the authors' per-head aggregation (z-score per head, max over the kv
group, mean over layers).
"""

import importlib.util
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvpress import ExpectedAttentionPress, KeyDiffPress

MODEL = Path.home() / ".cache/reasonkv/models/smollm2-135m"
centers_path, data_path, out_path, triattention_repo = sys.argv[1:5]
N = 512

spec = importlib.util.spec_from_file_location(
    "pruning_utils", Path(triattention_repo) / "triattention" / "methods" / "pruning_utils.py"
)
pu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pu)

torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()
rows = [json.loads(line) for line in open(data_path)]
text = "\n\n".join(r["problem"] + "\n" + r["solution"] for r in rows[100:140])
ids = torch.tensor([tok(text)["input_ids"][:N]])

hidden = {}
for i, layer in enumerate(model.model.layers):
    layer.self_attn.register_forward_pre_hook(
        lambda m, a, kw, i=i: hidden.__setitem__(i, kw["hidden_states"].detach()), with_kwargs=True
    )
    layer.self_attn.rotary_emb = model.model.rotary_emb  # what kvpress's press setup does
with torch.no_grad():
    out = model(input_ids=ids, use_cache=True)
cache = out.past_key_values
positions = torch.arange(N).unsqueeze(0)
rotary = model.model.rotary_emb
cos, sin = rotary(hidden[0], positions)
cfg = model.config
heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim if hasattr(cfg, "head_dim") else 64

stats_raw = torch.load(centers_path, weights_only=True)
q_mean = torch.complex(stats_raw["mean_real"], stats_raw["mean_imag"])  # [layers, heads, pairs]
q_abs = stats_raw["modulus"]

offsets = pu.build_geometric_offsets(65536, torch.device("cpu"))
freq_scale_sq = pu.compute_frequency_scaling(rotary, d, torch.float32, torch.device("cpu")).pow(2)
omega = rotary.inv_freq.float()[: d // 2]
scale = float(getattr(rotary, "attention_scaling", 1.0))
cos_t, sin_t = rotary(torch.zeros(1, N, d), positions)
cos_t, sin_t = cos_t[0], sin_t[0]

result = {"ids": ids, "inv_freq": rotary.inv_freq.float(), "scaling": scale, "layers": []}
tri_matrix = []
with torch.no_grad():
    for i, layer in enumerate(model.model.layers):
        module = layer.self_attn
        keys, values = cache.layers[i].keys, cache.layers[i].values
        h = hidden[i]
        q = module.q_proj(h).view(1, N, heads, d).transpose(1, 2)
        q_post, _ = apply_rotary_pos_emb(q, q, cos, sin)
        ea = ExpectedAttentionPress().score(module, h, keys, values, None, {})
        kd = KeyDiffPress().score(module, h, keys, values, None, {})
        tri = []
        for head in range(heads):
            k = keys[0, head // (heads // kv_heads)]
            k_unrot = pu.invert_rope(k, cos_t, sin_t, scale, style="half")
            amp, phi, extra = pu.compute_frequency_statistics_from_means(q_mean[i, head], q_abs[i, head], k_unrot)
            tri.append(
                pu.score_keys_for_round(
                    torch.arange(N), N, amp, phi, omega, extra, offsets, "mean", freq_scale_sq
                )
            )
        tri = torch.stack(tri)  # [heads, N]
        tri_matrix.append(tri)
        result["layers"].append(
            {"keys": keys.clone(), "values": values.clone(), "queries": q_post.clone(), "ea": ea, "kd": kd, "tri": tri}
        )
# the authors' per-head pruning: z-score each (layer, head) row, max over its kv group, mean over layers
group = heads // kv_heads
per_layer = []
for tri in tri_matrix:
    z = (tri - tri.mean(1, keepdim=True)) / tri.std(1, unbiased=False, keepdim=True).clamp_min(1e-6)
    per_layer.append(z.view(kv_heads, group, N).max(1).values)
result["tri_shared"] = torch.stack(per_layer).mean(0)  # [kv_heads, N]
torch.save(result, out_path)
print("saved", out_path, "layers", len(result["layers"]))
