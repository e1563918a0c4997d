"""The ``vllm`` generation engine: a vLLM ``LLM`` in this process, on a copy of the policy's weights.

In this process, not in worker processes of its own: the learner's weights are handed over in
memory (vLLM's in-place ``reload_weights``, fed the family's Hugging Face tensors one at a time),
nothing is written to disk, and no process exists that a crash or a kill could orphan. This is
how TRL colocates vLLM with its trainer. Under torch.distributed each rank runs its own engine on
a whole copy (vLLM's ``external_launcher``); a single process gets a world of its own, removed again
on ``close``.

Start-up changes to the process that vLLM makes and the learner must not see are undone: the
global random generators are restored (vLLM seeds them), and ``torch.set_num_threads`` is put
back (vLLM's CPU worker replaces it with a function that ignores its argument).

The sampler reports log-probabilities either of the raw logits or after temperature and the
filters; the engine picks the one that equals the contract for the method's sampling when it
starts (``logprobs_mode``), and refuses a later non-greedy call that the other one would need.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from posttune.plugin import (
    Completions,
    PosttuneError,
    Sampling,
    adapted_modules,
    derive_seed,
    hf_tensors,
    is_dtensor,
    plain_state_dict,
    save_adapter,
)

from posttune_vllm import VLLMOptions, check_options, logprobs_mode
from posttune_vllm.weights import check_state, dtype_of, expected_shapes, hf_config_of

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
CPU_MEMORY_FRACTION, GPU_MEMORY_FRACTION = 0.05, 0.4
_MASK64 = (1 << 64) - 1
_open: list[VLLMEngine] = []  # vLLM keeps one model-parallel state per process: one engine at a time


#: vLLM warnings every run of this engine gets, which change nothing: its chat-template warm-up needs a tokenizer
#: (the engine takes token ids, skip_tokenizer_init) and prints a traceback; its layerwise weight reload lists the
#: RoPE cos/sin cache, a buffer it keeps, among the weights not loaded (at every weight update)
BENIGN_LOGS = ("Chat template warmup failed", "RotaryEmbedding: Failed to load weights")


def _not_benign(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(BENIGN_LOGS)


def quiet_benign_logs() -> None:
    """Drop ``BENIGN_LOGS`` at vLLM's log handlers (its modules' loggers propagate to them)."""
    for handler in logging.getLogger("vllm").handlers:
        if _not_benign not in handler.filters:
            handler.addFilter(_not_benign)

class VLLMEngine:
    """The engine ``start`` returns (contract: docs/plugins.md, "Generation engines")."""

    def __init__(self, policy: Any):
        if _open:
            raise PosttuneError("generation engine 'vllm': another vLLM engine is open in this process; close it "
                                "first (vLLM keeps one model-parallel state per process)")
        self.options: VLLMOptions = policy.options or VLLMOptions()
        check_options(self.options)
        self.policy, self.version = policy, -1
        self.hf_config = hf_config_of(policy)
        self.expected = expected_shapes(policy.family, policy.build_kwargs)
        self.mode = logprobs_mode(policy.sampling) if policy.sampling is not None else "raw_logprobs"
        self.adapters = self._adapter_layers()
        self.lora: Any = None  # the vLLM LoRARequest of the current version (lora: adapter)
        self.lora_ids = 0
        self.device = _device(policy)
        self.cuda = self.device.type == "cuda"
        if not self.cuda:
            _check_cpu_head_size(self.hf_config)
        self.sleeping = False
        self.workdir = Path(tempfile.mkdtemp(prefix="posttune-vllm-"))
        (self.workdir / "config.json").write_text(_json(self.hf_config), encoding="utf-8")
        self.owns_world = not dist.is_initialized()
        try:
            self.llm = self._start_llm()
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        _open.append(self)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        if policy.model is not None and policy.version >= 0:
            try:
                self.update_weights(None, policy.version)
            except BaseException:
                self.close()  # nothing half-started stays open in this process
                raise

    # ---- the contract ------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int] | torch.Tensor], sampling: Sampling,
                 seeds: Sequence[int] | None = None) -> Completions:
        from vllm.inputs import TokensPrompt

        if self.version < 0:
            raise PosttuneError("generation engine 'vllm': asked to generate before it received any weights "
                                "(version -1)")
        rows = [prompt.tolist() if isinstance(prompt, torch.Tensor) else [int(t) for t in prompt]
                for prompt in prompts]
        self._check_call(rows, sampling, seeds)
        if sampling.max_new_tokens == 0:  # vLLM generates at least one token; the contract allows none
            return _completions([], sampling.pad_id, rows=len(rows))
        if seeds is None:  # unseeded: follow torch's global generator, as generate_batch does
            base = int(torch.randint(0, 2**62, (1,)).item())
            seeds = [derive_seed(base, row) for row in range(len(rows))]
        params = [self._params(sampling, len(row), seed) for row, seed in zip(rows, seeds, strict=True)]
        self._wake()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=row) for row in rows], params, use_tqdm=False,
                                    lora_request=self.lora)
        self._sleep()
        return _completions([output.outputs[0] for output in outputs], sampling.pad_id)

    def update_weights(self, weights: dict[str, torch.Tensor] | None, version: int) -> None:
        """Load ``weights`` (a plain state dict), or the live policy's current weights when None."""
        if version < self.version:
            raise PosttuneError(f"generation engine 'vllm': weights of version {version} after version "
                                f"{self.version}: an older policy would replace a newer one")
        if weights is None:
            model = self.policy.model
            if model is None:
                raise PosttuneError("generation engine 'vllm': update_weights(None) needs the live policy, and this "
                                    "engine was started without one; pass the weights")
            if self.adapters:
                if self.version < 0:  # the base weights once; each version then brings its adapter alone
                    self._load(plain_state_dict(model, device=self.device, adapters=False), version)
                self._load_adapter(model, version)
            else:
                self._load(plain_state_dict(model, device=self.device), version)
        else:
            self._load(weights, version)
        self.version = version

    def close(self) -> None:
        """Release vLLM's model, KV cache and (if it made one) its process group; remove the work folder."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            _release_parallel_state(self.owns_world)
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
            shutil.rmtree(self.workdir, ignore_errors=True)
            _open.remove(self)

    # ---- starting ----------------------------------------------------------------------------------

    def _start_llm(self) -> Any:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (module docstring)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        quiet_benign_logs()

        options = self.options
        kwargs: dict[str, Any] = {}
        if self.adapters:
            rank = max(layer.rank for layer in self.adapters.values())
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=next(r for r in LORA_RANKS if r >= rank))
        if self.cuda and options.sleep:
            kwargs["enable_sleep_mode"] = True
        world = dist.get_world_size() if dist.is_initialized() else 1
        fraction = options.memory_fraction or (GPU_MEMORY_FRACTION if self.cuda else CPU_MEMORY_FRACTION)
        eager = options.enforce_eager if options.enforce_eager is not None else not self.cuda
        with _process_state_kept():
            return LLM(model=str(self.workdir), load_format="dummy", skip_tokenizer_init=True,
                       dtype=dtype_of(self.policy, self.hf_config, options.dtype), generation_config="vllm",
                       logprobs_mode=self.mode, max_model_len=options.max_model_len, max_num_seqs=options.max_num_seqs,
                       kv_cache_memory_bytes=int(options.kv_cache_gib * 2**30), gpu_memory_utilization=fraction,
                       enforce_eager=eager, seed=0, tensor_parallel_size=1,
                       distributed_executor_backend="external_launcher" if world > 1 else "uni", **kwargs)

    def _adapter_layers(self) -> dict[str, Any]:
        """The policy's LoRA layers when they run as a vLLM adapter (``lora: adapter``), else none."""
        model = self.policy.model
        if self.options.lora != "adapter" or model is None:
            return {}
        layers = adapted_modules(model)
        if any(layer.kind != "lora" for layer in layers.values()):
            kind = next(layer.kind for layer in layers.values() if layer.kind != "lora")
            raise PosttuneError("generation engine 'vllm': engine_options.lora: adapter runs LoRA adapters, and this "
                                f"policy has {kind} ones, which vLLM does not run; use lora: merged")
        if any(is_dtensor(p) for p in model.parameters()):
            raise PosttuneError("generation engine 'vllm': engine_options.lora: adapter needs an unsharded policy; "
                                "use lora: merged with fsdp2 or tp")
        return layers

    # ---- weights -----------------------------------------------------------------------------------

    def _load(self, state: dict[str, torch.Tensor], version: int) -> None:
        check_state(state, self.expected, version)
        self._wake()
        tensors = hf_tensors(self.policy.family, state, self.hf_config)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors, "is_checkpoint_format": True})

    def _load_adapter(self, model: torch.nn.Module, version: int) -> None:
        from vllm.lora.request import LoRARequest

        previous = self.lora
        self.lora_ids += 1
        folder = save_adapter(model, self.workdir / f"adapter-{self.lora_ids}")
        self.lora = LoRARequest(f"policy-v{version}", self.lora_ids, str(folder))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    # ---- sampling ----------------------------------------------------------------------------------

    def _check_call(self, rows: list[list[int]], sampling: Sampling, seeds: Sequence[int] | None) -> None:
        if not rows or any(not row for row in rows):
            raise ValueError("generation engine 'vllm': generate needs at least one prompt, none of them empty")
        if seeds is not None and len(seeds) != len(rows):
            raise ValueError(f"generation engine 'vllm': {len(seeds)} seeds for {len(rows)} prompts")
        longest = max(len(row) for row in rows)
        if longest >= self.max_model_len:
            raise ValueError(f"generation engine 'vllm': a prompt of {longest} tokens leaves no room in the context "
                             f"of {self.max_model_len}")
        if sampling.temperature > 0 and logprobs_mode(sampling) != self.mode:
            raise PosttuneError(f"generation engine 'vllm': started to report {self.mode} (the method's sampling); "
                                f"temperature {sampling.temperature:g} with these filters needs "
                                f"{logprobs_mode(sampling)}")

    def _params(self, sampling: Sampling, prompt_length: int, seed: int) -> Any:
        from vllm import SamplingParams

        greedy = sampling.temperature == 0.0
        return SamplingParams(
            temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0,
            min_p=sampling.min_p or 0.0, seed=None if greedy else int(seed) & _MASK64,
            max_tokens=min(sampling.max_new_tokens, self.max_model_len - prompt_length),
            stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True, logprobs=0, detokenize=False)

    def _wake(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def _sleep(self) -> None:
        """On a GPU, between generations: vLLM's sleep level 1 (KV cache dropped, weights moved to CPU)."""
        if self.cuda and self.options.sleep:
            self.llm.sleep(level=1)
            self.sleeping = True


def _completions(outputs: list[Any], pad_id: int, rows: int | None = None) -> Completions:
    """The contract's [rows, T] tokens / float32 log-probs / mask from vLLM's completion outputs (``rows``
    empty ones when there are no outputs)."""
    count = len(outputs) if rows is None else rows
    width = max((len(out.token_ids) for out in outputs), default=0)
    tokens = torch.full((count, width), pad_id, dtype=torch.long)
    logprobs = torch.zeros((count, width), dtype=torch.float32)
    mask = torch.zeros((count, width), dtype=torch.bool)
    for row, out in enumerate(outputs):
        ids = list(out.token_ids)
        tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        logprobs[row, :len(ids)] = torch.tensor([step[token].logprob for token, step in zip(ids, out.logprobs,
                                                                                              strict=True)])
        mask[row, :len(ids)] = True
    return Completions(tokens, logprobs, mask)


def _check_cpu_head_size(hf_config: dict[str, Any]) -> None:
    """vLLM's CPU attention runs a few head sizes only; refuse the others here, before vLLM starts, rather than
    at the first generation deep inside its kernels."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # another vLLM layout: let vLLM decide
        return
    heads = hf_config.get("num_attention_heads")
    size = hf_config.get("head_dim") or (hf_config.get("hidden_size", 0) // heads if heads else None)
    if size is not None and size not in supported:
        raise PosttuneError(f"generation engine 'vllm': vLLM's CPU attention does not run heads of {size} (it runs "
                            f"{', '.join(map(str, supported))}); use the builtin engine for this model")


def _device(policy: Any) -> torch.device:
    if policy.device is not None:
        return torch.device(policy.device)
    if policy.model is not None:
        return next(policy.model.parameters()).device
    return torch.device("cpu")


@contextmanager
def _process_state_kept() -> Iterator[None]:
    """Undo what starting vLLM changes in this process: the global RNGs, ``torch.set_num_threads``."""
    import numpy as np

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    rng = (torch.random.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _release_parallel_state(owns_world: bool) -> None:
    """vLLM's model-parallel groups; and the process group, when vLLM made it (a single process)."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    if owns_world:
        destroy_distributed_environment()


def _json(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"
