"""Generation throughput: posttune's ``builtin`` engine (``generate_batch``), the ``vllm`` engine
(posttune-vllm, when vLLM is installed) and transformers' ``generate``, on CPU.

    python benchmarks/generation.py                        # greedy and sampled, 3 runs each, JSON to stdout
    python benchmarks/generation.py --modes greedy --runs 5 --max-new-tokens 32 --out result.json
    python benchmarks/generation.py --hidden 1024 --layers 16 --prompts 64   # a larger model and batch

All complete the same prompts of mixed lengths (16 to 128 tokens; 16 by default) with the same
randomly initialised Llama-shaped model (hidden 512, 8 layers, heads of 64 with 4 kv heads, vocab
32000, fp32; transformers with its default SDPA attention), KV-cached, torch threads 2. posttune
and transformers run one left-padded batch; vLLM schedules the rows itself (through the engine's
``generate``, weights handed over in memory first, not timed). Sampled: temperature 1.0, top-k
50, top-p 0.95 (temperature 1: the setting for which the vllm engine's log-probs are exact with
filters on). tokens/s = generated tokens (each row's tokens up to and including its first EOS;
padding not counted) / wall time of the call, after a short warm-up call. Each measurement runs
in a fresh subprocess; the implementations alternate (the order rotates each round); the report
gives the medians and the ratios to transformers. ``same_greedy_tokens`` says whether the greedy
runs produced identical tokens (near-uniform logits of a random model can flip a near tie).

Each run also records the 1-minute load average before and after its timed call: on a shared
2-core machine another busy process slows a 2-thread run by 10x or more (threads wait on each
other at every parallel region), so discard runs whose load was well above 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from child import emit, run_child

CHILD = r'''
import hashlib, json, os, sys, time
import torch
torch.set_num_threads(2)
import transformers

spec = json.loads(sys.argv[1])
hidden, layers = spec["hidden"], spec["layers"]
config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden,
                                  num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
                                  max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  tie_word_embeddings=False)
torch.manual_seed(0)
hf_model = transformers.LlamaForCausalLM(config).float().eval()
gen = torch.Generator().manual_seed(1)
lengths = torch.randint(16, 129, (spec["prompts"],), generator=gen).tolist()
prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in lengths]
sampling = {"temperature": 1.0, "top_k": 50, "top_p": 0.95} if spec["mode"] == "sampled" else {}
EOS, PAD = 2, 0

if spec["impl"] in ("posttune", "vllm"):
    import posttune_llama
    from posttune_generate import generate_batch
    from posttune.testing.tiny import native_from_hf
    converter = {c.family: c for c in posttune_llama.CONVERTERS}["llama"]
    model = native_from_hf(hf_model, posttune_llama.LLAMA, converter).eval()
    del hf_model

def start_vllm():
    from posttune.checkpoint.origin import ModelOrigin, attach
    from posttune.generation import Sampling
    from posttune.plugin import EnginePolicy, start_engine
    hf_config = {**config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    kwargs = posttune_llama.LLAMA.from_hf_config(hf_config)
    attach(model, ModelOrigin("llama", kwargs, hf_config=hf_config))
    policy = EnginePolicy("llama", kwargs, model=model, version=0)
    return start_engine("vllm", {"kv_cache_gib": 2}, policy, sampling=Sampling(1, **sampling))

if spec["impl"] == "posttune":
    def run(rows, new):
        out = generate_batch(model, rows, max_new_tokens=new, seed=0, stop_token_ids=(EOS,), pad_id=PAD, **sampling)
        return out.token_lists()
elif spec["impl"] == "vllm":
    from posttune.generation import Sampling, derive_seed
    engine = start_vllm()

    def run(rows, new):
        settings = Sampling(new, stop_token_ids=(EOS,), pad_id=PAD, **sampling)
        return engine.generate(rows, settings, [derive_seed(0, i) for i in range(len(rows))]).token_lists()
else:
    def run(rows, new):
        longest = max(map(len, rows))
        ids = torch.tensor([[PAD] * (longest - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=bool(sampling),
                                    eos_token_id=EOS, pad_token_id=PAD, **sampling)[:, longest:].tolist()
        return [row[:row.index(EOS) + 1] if EOS in row else row for row in out]

run(prompts[:2], 4)  # warm-up
load = os.getloadavg()[0]
start = time.perf_counter()
rows = run(prompts, spec["max_new_tokens"])
seconds = time.perf_counter() - start
tokens = sum(map(len, rows))
digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
print(json.dumps({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "digest": digest,
                  "load_before": load, "load_after": os.getloadavg()[0]}))
'''

def available() -> tuple[str, ...]:
    """posttune and transformers always; vllm when vLLM and posttune-vllm are installed here."""
    import importlib.util

    has_vllm = all(importlib.util.find_spec(name) is not None for name in ("vllm", "posttune_vllm"))
    return ("posttune", "transformers", *(("vllm",) if has_vllm else ()))


def measure(impl: str, mode: str, args: argparse.Namespace) -> dict:
    spec = {"impl": impl, "mode": mode, "max_new_tokens": args.max_new_tokens, "hidden": args.hidden,
            "layers": args.layers, "prompts": args.prompts}
    return run_child(CHILD, spec)


def compare(mode: str, args: argparse.Namespace) -> dict:
    impls = available()
    results: dict[str, list[dict]] = {impl: [] for impl in impls}
    for round_ in range(args.runs):
        for impl in impls[round_ % len(impls):] + impls[:round_ % len(impls)]:
            results[impl].append(measure(impl, mode, args))
            print(f"{mode} {impl}: {results[impl][-1]['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    medians = {impl: statistics.median(r["tokens_per_s"] for r in results[impl]) for impl in impls}
    report = {
        **{f"{impl}_tokens_per_s_median": round(medians[impl], 1) for impl in impls},
        "ratio": round(medians["posttune"] / medians["transformers"], 3),
        **({"vllm_ratio": round(medians["vllm"] / medians["transformers"], 3)} if "vllm" in impls else {}),
        "runs": {impl: [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
                        for r in results[impl]] for impl in impls},
    }
    if mode == "greedy":
        report["same_greedy_tokens"] = {impl: len({r["digest"] for r in results[impl]} |
                                                  {r["digest"] for r in results["transformers"]}) == 1
                                        for impl in impls if impl != "transformers"}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="*", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    parser.add_argument("--runs", type=int, default=3, help="measurements per library and mode")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512, help="model width (heads of 64)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    report = {"model": {"hidden": args.hidden, "layers": args.layers, "prompts": args.prompts},
              **{mode: compare(mode, args) for mode in args.modes}}
    emit(report, args.out)


if __name__ == "__main__":
    main()
