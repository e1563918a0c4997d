"""A LoRA policy in the `vllm` engine: folded into full weights at each update, or a vLLM adapter (not a test).

    python benchmarks/vllm_lora.py                       # 3 rounds, JSON to stdout
    python benchmarks/vllm_lora.py --hidden 2048 --layers 16 --rank 64 --out result.json

A randomly initialised Llama-shaped policy (hidden 1024, 8 layers, heads of 64, vocabulary 32000,
fp32) with LoRA (rank 16, alpha 32) on every linear layer of its blocks, in the `vllm` engine
(posttune-vllm; needs vLLM) with ``engine_options.lora`` ``merged`` or ``adapter``. What an RL
step costs the engine: ``update_weights`` after the adapters changed (merged: fold every adapter
and reload every weight; adapter: write the PEFT adapter and switch vLLM to it), then ``generate``
16 prompts (16-128 tokens) x 64 sampled tokens (temperature 1, seeded, no EOS). Each setting runs
in a fresh subprocess, alternating, ``--rounds`` times; each child times 3 updates and 3
generations after a warm-up of each and reports the medians; the report gives the medians over
rounds and merged / adapter ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from child import emit, run_child

CHILD = r'''
import json, sys, time
import torch
torch.set_num_threads(2)

spec = json.loads(sys.argv[1])
from posttune.adapters import apply_adapters
from posttune.checkpoint.origin import ModelOrigin, attach
from posttune.generation import Sampling, derive_seed
from posttune.plugin import EnginePolicy, build_model, start_engine

hidden = spec["hidden"]
model = build_model("llama", None, vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden,
                    num_layers=spec["layers"], num_heads=hidden // 64, num_kv_heads=4, head_dim=64,
                    max_position_embeddings=2048, tie_word_embeddings=False)
apply_adapters(model, targets=["*_proj"], rank=spec["rank"], alpha=2.0 * spec["rank"])
origin = model.posttune_origin
gen = torch.Generator().manual_seed(1)
prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in torch.randint(16, 129, (16,), generator=gen)]
sampling = Sampling(64, temperature=1.0)
engine = start_engine("vllm", {"lora": spec["lora"], "kv_cache_gib": 2}, EnginePolicy("llama", origin.build_kwargs,
                      model=model, version=0), sampling=sampling)
seeds = [derive_seed(0, i) for i in range(len(prompts))]

def nudge():
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora" in name:
                parameter.add_(0.01 * torch.randn_like(parameter))

updates, generations, tokens = [], [], 0
for version in range(1, 5):
    nudge()
    start = time.perf_counter()
    engine.update_weights(None, version)
    updates.append(time.perf_counter() - start)
    start = time.perf_counter()
    out = engine.generate(prompts, sampling, seeds)
    generations.append(time.perf_counter() - start)
    tokens = int(out.mask.sum())
engine.close()
print(json.dumps({"update_s": statistics.median(updates[1:]), "generate_s": statistics.median(generations[1:]),
                  "tokens": tokens}))
'''.replace("statistics.median", "__import__('statistics').median")

MODES = ("merged", "adapter")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
            spec = {"lora": mode, "hidden": args.hidden, "layers": args.layers, "rank": args.rank}
            results[mode].append(run_child(CHILD, spec))
            print(f"{mode}: {results[mode][-1]}", file=sys.stderr)
    medians = {mode: {key: statistics.median(r[key] for r in results[mode]) for key in ("update_s", "generate_s")}
               for mode in MODES}
    report = {
        "model": {"hidden": args.hidden, "layers": args.layers, "lora_rank": args.rank},
        **{f"{mode}_{key}_median": round(value, 4) for mode in MODES for key, value in medians[mode].items()},
        "update_ratio_merged_to_adapter": round(medians["merged"]["update_s"] / medians["adapter"]["update_s"], 2),
        "generate_ratio_merged_to_adapter": round(medians["merged"]["generate_s"] / medians["adapter"]["generate_s"],
                                                  2),
        "runs": results,
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
