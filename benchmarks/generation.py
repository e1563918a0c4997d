"""Generation throughput: posttune's ``generate_batch`` vs transformers' ``generate``, on CPU.

    python benchmarks/generation.py                        # greedy and sampled, 3 runs each, JSON to stdout
    python benchmarks/generation.py --modes greedy --runs 5 --max-new-tokens 32 --out result.json

Both complete the same 16 prompts of mixed lengths (16 to 128 tokens) in one left-padded batch
with the same randomly initialised Llama-shaped model (hidden 512, 8 layers, 8 query / 4 kv
heads, vocab 32000, fp32; transformers with its default SDPA attention), KV-cached, torch
threads 2. Sampled: temperature 0.8, top-k 50, top-p 0.95. tokens/s = generated tokens (each
row's tokens up to and including its first EOS; padding not counted) / wall time of the call,
after a short warm-up call. Each measurement runs in a fresh subprocess; the two libraries
alternate (and swap which goes first each round); the report gives the medians and
``ratio`` = posttune / transformers. ``same_greedy_tokens`` says whether the greedy runs
produced identical tokens (near-uniform logits of a random model can flip a near tie).

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
config = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
torch.manual_seed(0)
hf_model = transformers.LlamaForCausalLM(config).float().eval()
gen = torch.Generator().manual_seed(1)
lengths = torch.randint(16, 129, (16,), generator=gen).tolist()
prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in lengths]
sampling = {"temperature": 0.8, "top_k": 50, "top_p": 0.95} if spec["mode"] == "sampled" else {}
EOS, PAD = 2, 0

if spec["impl"] == "posttune":
    import posttune_llama
    from posttune.generation import generate_batch
    from posttune.testing.tiny import native_from_hf
    converter = {c.family: c for c in posttune_llama.CONVERTERS}["llama"]
    model = native_from_hf(hf_model, posttune_llama.LLAMA, converter).eval()
    del hf_model

    def run(rows, new):
        out = generate_batch(model, rows, max_new_tokens=new, seed=0, stop_token_ids=(EOS,), pad_id=PAD, **sampling)
        return out.token_lists()
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

IMPLS = ("posttune", "transformers")


def measure(impl: str, mode: str, max_new_tokens: int) -> dict:
    spec = {"impl": impl, "mode": mode, "max_new_tokens": max_new_tokens}
    return run_child(CHILD, spec)


def compare(mode: str, runs: int, max_new_tokens: int) -> dict:
    results: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
    for round_ in range(runs):
        for impl in IMPLS if round_ % 2 == 0 else IMPLS[::-1]:
            results[impl].append(measure(impl, mode, max_new_tokens))
            print(f"{mode} {impl}: {results[impl][-1]['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    medians = {impl: statistics.median(r["tokens_per_s"] for r in results[impl]) for impl in IMPLS}
    report = {
        **{f"{impl}_tokens_per_s_median": round(medians[impl], 1) for impl in IMPLS},
        "ratio": round(medians["posttune"] / medians["transformers"], 3),
        "runs": {impl: [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
                        for r in results[impl]] for impl in IMPLS},
    }
    if mode == "greedy":
        report["same_greedy_tokens"] = len({r["digest"] for impl in IMPLS for r in results[impl]}) == 1
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="*", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    parser.add_argument("--runs", type=int, default=3, help="measurements per library and mode")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    report = {mode: compare(mode, args.runs, args.max_new_tokens) for mode in args.modes}
    emit(report, args.out)


if __name__ == "__main__":
    main()
