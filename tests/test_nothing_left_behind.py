"""After ``generate`` returns, compiled or not, nothing of reasonkv's stays behind: no other model passes
through reasonkv code, the model carries no hook and no claim, the cache dies when its last user drops it
(no reference cycle waits for a garbage collection), and the memory live during the decode does not grow
with the context at a fixed K + B beyond the policies' per-position scalars."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

import reasonkv
from conftest import fast_few, tiny_gemma3, tiny_llama
from reasonkv.hf import decoder_layers
from reasonkv.hf.tap import check_untapped
from reasonkv.policies import policy_class

pytestmark = pytest.mark.filterwarnings("ignore:triattention. query centers:UserWarning")

PACKAGE = str(Path(reasonkv.__file__).parent)
PROMPT = [5 + (7 * i) % 80 for i in range(40)]
EVICTING = [name for name in reasonkv.list_policies() if policy_class(name).evicts]


def _settings(policy: str, **extra) -> dict:
    options = policy_class(policy).options()
    small = {k: v for k, v in {"window": 4, "query_window": 4, "sinks": 2}.items() if k in options}
    if options.get("protect_prompt"):
        small["protect_prompt"] = False  # the prompt exceeds K
    return dict(policy=policy, budget=16, buffer=4, max_new_tokens=30, ignore_eos=True, **small, **extra)


def _reasonkv_frames(run) -> set[str]:
    """The reasonkv functions that run while ``run()`` does."""
    entered: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            entered.add(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return entered


def _has_hooks(model: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in [model, *decoder_layers(model)])


@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_no_model_passes_through_reasonkv_after_generate(compile):
    model = tiny_llama(layers=3)
    first = reasonkv.generate(model, None, [PROMPT], **_settings("h2o"), compile=compile)
    if compile:
        assert first[0].stats["compile"]["compiled"]
    check_untapped(model)
    assert not _has_hooks(model)
    other = tiny_llama(layers=2, seed=3)  # a plain transformers model built after the run
    with torch.no_grad():
        assert _reasonkv_frames(lambda: other(torch.tensor([PROMPT]))) == set()
        assert _reasonkv_frames(lambda: model(torch.tensor([PROMPT]))) == set()


def test_check_untapped_names_what_is_left():
    model = tiny_llama(layers=2)
    with reasonkv.hf.AttentionTap(model, lambda *args: None), pytest.raises(RuntimeError, match="still wrapped"):
        check_untapped(model)
    check_untapped(model)


def _cache_of_a_run(model, **settings) -> weakref.ref:
    caches = []
    keep_first = lambda step, cache: caches or caches.append(cache)  # noqa: E731
    reasonkv.generate(model, None, [PROMPT, PROMPT[:23]], on_step=keep_first, **settings)
    return weakref.ref(caches.pop())


@pytest.mark.parametrize("policy", fast_few(EVICTING))
def test_every_policys_cache_dies_without_a_garbage_collection(policy):
    model = tiny_llama(layers=3)
    gc.collect()
    gc.disable()
    try:
        cache = _cache_of_a_run(model, **_settings(policy))
        assert cache() is None, f"{policy}: the cache outlived its run (a reference cycle holds it)"
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "case",
    ["compiled", "quantized tier", "hybrid model", "trace"],
)
def test_caches_of_other_kinds_die_without_a_garbage_collection(case):
    model = tiny_gemma3() if case == "hybrid model" else tiny_llama(layers=3)
    extra = {
        "compiled": dict(compile="aot_eager"),
        "quantized tier": dict(quantized=16, bits=8),
        "hybrid model": {},
        "trace": dict(trace=True),
    }[case]
    gc.collect()
    gc.disable()
    try:
        cache = _cache_of_a_run(model, **_settings("snapkv", **extra))
        assert cache() is None, f"{case}: the cache outlived its run"
    finally:
        gc.enable()


def _live_bytes(exclude: set[int]) -> int:
    """Bytes of every tensor storage alive now, but those in ``exclude`` (the weights)."""
    seen, total = set(exclude), 0
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor:
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["streaming", "h2o", "epikv", "vase-attnv", "snapkv"])
def test_decode_memory_is_flat_in_the_context(policy):
    """Live tensor bytes late in the decode, at a fixed K + B, after a prompt of 150 and of 900 tokens: the
    same, but for the per-position scalars some policies keep (a float per position and kv head per layer,
    in a table grown by doubling) and the prompt's own token ids."""
    model = tiny_llama(layers=4)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    info = reasonkv.hf.model_info(model)
    live = {}
    for length in (150, 900):
        prompt = [5 + (7 * i) % 80 for i in range(length)]

        def probe(step, cache, length=length):
            if step == 60:
                gc.collect()
                live[length] = _live_bytes(weights)

        reasonkv.generate(model, None, [prompt], on_step=probe, **{**_settings(policy), "max_new_tokens": 62})
    per_position = 2 * 4 * info.num_layers * info.num_kv_heads + 8  # doubling table of float32, prompt ids
    growth = live[900] - live[150]
    assert growth <= (900 - 150) * per_position, f"{policy}: {growth} more bytes live at 900 tokens than at 150"
    if policy == "streaming":  # no per-position state at all
        assert growth <= 8 * (900 - 150), growth
