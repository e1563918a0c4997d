"""The head at labelled positions only against the full logits, at a large vocabulary.

    python benchmarks/labelled_head.py --rounds 3 --out benchmarks/results/labelled_head.json

``token_cross_entropy`` (SFT's loss) forward and backward over one batch, on a ``posttune.modules``
decoder shaped like Qwen2.5-0.5B cut to 6 layers (hidden 896, intermediate 4864, 14 heads over
2 KV heads, vocabulary 38,000, untied, fp32, random weights): the head is 0.38 of the layers'
parameters, as Qwen2.5-0.5B's 136M head is of its 358M of layers. The batch: 4 samples of 256
tokens end to end (padding-free), each a 96-token prompt (ignored) and a 160-token response, so
625 of every 1,000 positions are labelled. Two sides, each a fresh child per round (its own
``ru_maxrss``), alternating: ``labelled`` (the core's default: the decoder's ``logits_at``) and
``full`` (the same model behind a forward without ``logits_at``: every position's logits, what
a model without the option gets). One thread by default. Prints JSON: medians of the step time
(3 timed steps per child after one warm-up), tokens/s and peak RSS, and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from child import MIB, emit, run_child

CHILD = r'''
import json, resource, sys, time
import torch
from torch import nn
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
from types import SimpleNamespace
from posttune.losses import token_cross_entropy
from posttune.modules import Attention, Decoder, DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding

hidden, heads, kv, head_dim = 896, 14, 2, 64
torch.manual_seed(0)
layers = [DecoderLayer(Attention(hidden, heads, kv, head_dim), GatedMLP(hidden, 4864), RMSNorm(hidden),
                       RMSNorm(hidden)) for _ in range(6)]
model = Decoder(nn.Embedding(spec["vocab"], hidden), layers, RMSNorm(hidden), RotaryEmbedding(head_dim))

class FullLogits(nn.Module):  # another model's contract: no logits_at, so every position reaches the head
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
    def forward(self, input_ids, *, document_ids=None, positions=None):
        return self.inner(input_ids, document_ids=document_ids, positions=positions)

session = SimpleNamespace(model=model if spec["side"] == "labelled" else FullLogits(model))
samples, prompt, response = 4, 96, 160
length = prompt + response
ids = torch.randint(0, spec["vocab"], (1, samples * length), generator=torch.Generator().manual_seed(1))
labels = torch.randint(0, spec["vocab"], ids.shape, generator=torch.Generator().manual_seed(2))
for s in range(samples):
    labels[0, s * length: s * length + prompt] = -100
batch = {"input_ids": ids, "labels": labels,
         "document_ids": torch.arange(samples).repeat_interleave(length)[None]}
times = []
for step in range(4):
    start = time.perf_counter()
    loss, count = token_cross_entropy(session, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    if step:
        times.append(time.perf_counter() - start)
print(json.dumps({"step_seconds": times, "tokens": samples * length, "loss": float(loss.detach()),
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
'''

SIDES = ("labelled", "full")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=38000)
    parser.add_argument("--out")
    args = parser.parse_args()
    spec = {"bench_dir": str(Path(__file__).parent), "threads": args.threads, "vocab": args.vocab}
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for _ in range(args.rounds):
        for side in SIDES:
            runs[side].append(run_child(CHILD, {**spec, "side": side}))
    report: dict = {"vocab": args.vocab, "threads": args.threads, "rounds": args.rounds}
    for side, results in runs.items():
        step = statistics.median(t for r in results for t in r["step_seconds"])
        report[side] = {"step_seconds_median": round(step, 3),
                        "tokens_per_s": round(results[0]["tokens"] / step, 1),
                        "peak_rss_mib_median": round(statistics.median(r["peak"] for r in results) / MIB, 1),
                        "loss": results[0]["loss"]}
    report["tokens_per_s_ratio"] = round(report["labelled"]["tokens_per_s"] / report["full"]["tokens_per_s"], 3)
    report["peak_rss_ratio"] = round(report["labelled"]["peak_rss_mib_median"]
                                     / report["full"]["peak_rss_mib_median"], 3)
    emit(report, args.out)


if __name__ == "__main__":
    main()
