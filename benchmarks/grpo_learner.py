"""GRPO's learner pass over one micro-batch of rollouts: padded rows vs padding-free rows vs each group's prompt once.

    python benchmarks/grpo_learner.py                      # JSON to stdout
    python benchmarks/grpo_learner.py --rounds 7 --prompt-tokens 300 --out result.json

What ``method.padding_free`` and ``method.share_prompt`` change (docs/grpo.md, "The learner's rows"):
the forward and backward of the policy over a micro-batch of ``groups x group_size`` completions
(``posttune_grpo.loss.learner_logps``, then ``-sum(logps)`` over the completion tokens), on a
Llama-shaped decoder from ``posttune.modules`` (hidden 512, 8 layers, vocabulary 3072, fp32, the
size of ``benchmarks/compare.py``), random weights, random prompts of ``--prompt-tokens`` tokens and
completions of 1..``--max-new-tokens`` tokens. The three layouts alternate within each round in one
process (a busy neighbour slows all alike); per layout the median seconds per pass over the rounds
after a warm-up, tokens/s counting the rows' real tokens (prompt + completion), the same on every side,
and the ratio to padded rows. The log-probabilities of the three layouts are checked to agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from torch import nn

from child import emit

from posttune.modules import Attention, Decoder, DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding

LAYOUTS = {"padded": {"padding_free": False}, "padding_free": {"share_prompt": False}, "shared_prompt": {}}


def model(vocab: int) -> Decoder:
    torch.manual_seed(0)
    layers = [DecoderLayer(Attention(512, 8, 8, 64), GatedMLP(512, 1376), RMSNorm(512), RMSNorm(512))
              for _ in range(8)]
    return Decoder(nn.Embedding(vocab, 512), layers, RMSNorm(512), RotaryEmbedding(64))


def rollouts(groups: int, size: int, prompt_tokens: int, max_new: int, vocab: int) -> dict[str, torch.Tensor]:
    """Right-padded rows prompt + completion, labels on the completion, as posttune_grpo lays them out."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (prompt_tokens,), generator=generator) for _ in range(groups)]
    completions = [torch.randint(3, vocab, (int(torch.randint(1, max_new + 1, (1,), generator=generator)),),
                                 generator=generator) for _ in range(groups * size)]
    width = prompt_tokens + max(len(c) for c in completions)
    input_ids = torch.zeros(groups * size, width, dtype=torch.long)
    labels = torch.full_like(input_ids, -100)
    for row, completion in enumerate(completions):
        end = prompt_tokens + len(completion)
        input_ids[row, :end] = torch.cat([prompts[row // size], completion])
        labels[row, prompt_tokens - 1:end - 1] = completion
    lengths = torch.tensor([len(c) for c in completions])
    return {"input_ids": input_ids, "labels": labels, "lengths": lengths,
            "prompt_lengths": torch.full_like(lengths, prompt_tokens)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", type=int, default=2, help="prompts per micro-batch")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from posttune_grpo import GRPOConfig
    from posttune_grpo.loss import learner_logps

    vocab = 3072
    batch = rollouts(args.groups, args.group_size, args.prompt_tokens, args.max_new_tokens, vocab)
    net = model(vocab)
    base = GRPOConfig(group_size=args.group_size, temperature=1.0)
    session = SimpleNamespace(model=net, loss_kernel=None, step_contexts=[], tokenizer=SimpleNamespace(pad_id=0))
    mask = batch["labels"] != -100
    seconds: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    values = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, layout in LAYOUTS.items():
            session.method_config = dataclasses.replace(base, **layout)
            started = time.perf_counter()
            logps = learner_logps(session, batch)
            (-(logps * mask).sum()).backward()
            elapsed = time.perf_counter() - started
            net.zero_grad(set_to_none=True)
            values[name] = logps.detach()
            if round_:
                seconds[name].append(elapsed)
    for name in LAYOUTS:
        torch.testing.assert_close(values[name][mask], values["padded"][mask], rtol=0, atol=1e-4)
    tokens = int((batch["prompt_lengths"] + batch["lengths"]).sum())
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    report = {
        "workload": {"rows": len(batch["lengths"]), "groups": args.groups, "group_size": args.group_size,
                     "prompt_tokens": args.prompt_tokens, "completion_tokens": int(batch["lengths"].sum()),
                     "padded_positions": batch["input_ids"].numel(), "real_tokens": tokens,
                     "threads": args.threads, "rounds": args.rounds},
        "layouts": {name: {"seconds_median": round(medians[name], 3), "seconds": [round(s, 3) for s in seconds[name]],
                           "tokens_per_s": round(tokens / medians[name], 1),
                           "speed_vs_padded": round(medians["padded"] / medians[name], 3)} for name in LAYOUTS},
    }
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
