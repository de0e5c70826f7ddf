"""The ``reasonkv`` key: read through reasonkv's own settings (the same errors as the command line), every
setting the integration cannot honour refused in one line when the engine's config is built, and nothing
changed without the key."""

from __future__ import annotations

import pytest
from engines import model_dir, needs_vllm

needs_vllm()

import vllm  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from reasonkv.integrations.vllm import config as rk_config  # noqa: E402
from reasonkv.policies.registry import list_policies, policy_class  # noqa: E402

GOOD = {"policy": "streaming", "budget": 64, "buffer": 16}


def _config(reasonkv=None, **options):
    settings = dict(
        model=model_dir(),
        dtype="float32",
        block_size=32,
        enable_prefix_caching=False,
        enforce_eager=True,
        max_model_len=1024,
        additional_config={} if reasonkv is None else {"reasonkv": reasonkv},
    )
    settings.update(options)
    return EngineArgs(**settings).create_engine_config()


def _refused(reasonkv=GOOD, **options) -> str:
    with pytest.raises(ValueError) as caught:
        _config(reasonkv, **options)
    text = str(caught.value)
    reasonkv_line = [line for line in text.splitlines() if "reasonkv:" in line]
    assert reasonkv_line, text
    return reasonkv_line[0]


def test_without_the_key_the_engine_is_vllms_own():
    config = _config()
    assert config.scheduler_config.scheduler_cls is None
    assert config.parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"


def test_the_key_routes_scheduler_and_worker():
    config = _config(GOOD)
    assert config.scheduler_config.scheduler_cls == rk_config.SCHEDULER
    assert config.parallel_config.worker_cls == rk_config.WORKER
    settings = rk_config.settings_of(config)
    assert (settings.spec.policy.name, settings.spec.budget, settings.spec.buffer) == ("streaming", 64, 16)


@pytest.mark.parametrize(
    "reasonkv,expected",
    [
        ({"policy": "streamin", "budget": 64}, "unknown policy"),
        ({"policy": "streaming"}, "needs a budget"),
        ({"policy": "streaming", "budget": -3}, "budget must be a positive integer"),
        ({"policy": "knorm", "budget": 64, "sinks": "4"}, "sinks"),
        ({"policy": "knorm", "budget": 64, "colour": 1}, "has no option 'colour'"),
        ({"budget": 64}, "needs a 'policy'"),
        ("streaming", "must be a mapping"),
    ],
)
def test_bad_settings_get_reasonkvs_own_errors(reasonkv, expected):
    assert expected in _refused(reasonkv)


@pytest.mark.parametrize(
    "reasonkv,options,expected",
    [
        ({**GOOD, "quantized": 16}, {}, "quantized tier"),
        ({"policy": "knorm", "budget": 64, "allocation": "pyramid"}, {}, "allocation='pyramid'"),
        ({"policy": "quest", "budget": 64}, {}, "selects"),
        ({"policy": "full"}, {}, "evicts nothing"),
        ({"policy": "snapkv", "budget": 64}, {"enforce_eager": False}, "enforce_eager=True"),
        ({"policy": "h2o", "budget": 64}, {"enforce_eager": False}, "post-RoPE queries"),
        ({"policy": "epikv", "budget": 64}, {"enforce_eager": False}, "the residual stream"),
        ({"policy": "triattention", "budget": 64, "stats": "bundled"}, {}, "stats=PATH"),
        (GOOD, {"enable_prefix_caching": True}, "prefix caching"),
        (GOOD, {"kv_cache_dtype": "fp8"}, "quantized KV cache"),
        (GOOD, {"kv_transfer_config": KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")}, "KV"),
    ],
)
def test_unsupported_settings_are_refused_in_one_line(reasonkv, options, expected):
    assert expected in _refused(reasonkv, **options)


def test_every_evicting_policy_is_verified_and_a_new_one_is_refused_until_it_is(monkeypatch):
    evicting = [n for n in list_policies() if n != "full" and not policy_class(n).selects]
    assert sorted(rk_config.VERIFIED) == sorted(evicting)
    monkeypatch.setattr(rk_config, "VERIFIED", tuple(n for n in rk_config.VERIFIED if n != "lagkv"))
    assert "policy 'lagkv' is not yet verified" in _refused({"policy": "lagkv", "budget": 64})


def test_an_unknown_vllm_release_is_refused(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    assert "vLLM 0.99.0 is not a release" in _refused()
