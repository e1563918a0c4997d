"""Where a CPU training step's time goes: the torch.profiler table of a few SFT steps.

    python benchmarks/profile_step.py                    # 28M Llama shape, batch 4, padded rows
    python benchmarks/profile_step.py --packed --rows 20 --threads 1

The step is the trainer's: forward, token cross-entropy, backward, the normalising multiply,
the optimizer's step. The batch holds alpaca-length rows (18-305 tokens, seeded) padded to the
longest (or packed into rows of ``--seq`` with ``--packed``). Prints the top operators by self
CPU time, then one JSON line: seconds per step and non-padding tokens per second. Run it on an
idle machine; the table's shares are what the issue notes quote.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from posttune.losses import token_cross_entropy
from posttune.training.compose import random_init
from posttune.training.optim import build_optimizer
from posttune_llama.model import build

SHAPE = dict(vocab_size=16000, hidden_size=512, intermediate_size=1376, num_layers=8, num_heads=8)


def batch_of(lengths: list[int], *, vocab: int, seq: int, packed: bool, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    if not packed:
        width = max(lengths)
        ids = torch.zeros(len(docs), width, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for row, doc in enumerate(docs):
            ids[row, :len(doc)] = doc
            labels[row, :len(doc) - 1] = doc[1:]
        return {"input_ids": ids, "labels": labels}
    rows, current = [], []
    for doc in docs:
        if sum(map(len, current)) + len(doc) > seq:
            rows.append(current)
            current = []
        current.append(doc)
    rows.append(current)
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    labels, document_ids = torch.full_like(ids, -100), torch.zeros_like(ids)
    for row, parts in enumerate(rows):
        start = 0
        for index, doc in enumerate(parts):
            end = start + len(doc)
            ids[row, start:end], labels[row, start:end - 1] = doc, doc[1:]
            document_ids[row, start:end] = index
            start = end
        document_ids[row, start:] = len(parts)
    return {"input_ids": ids, "labels": labels, "document_ids": document_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4, help="documents per step (default 4: batch 4 padded)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    model = build(**SHAPE, max_position_embeddings=4096)
    random_init(model, 0)
    model.train()
    train = type("Train", (), {"weight_decay": 0.0, "optimizer": "adamw", "lr": 1e-4})()
    optimizer = build_optimizer(model.named_parameters(), train)
    session = type("Session", (), {"model": model, "loss_kernel": None})()
    lengths = [[rng.randint(18, 305) for _ in range(args.rows)] for _ in range(args.steps + 1)]
    batches = [batch_of(step_lengths, vocab=SHAPE["vocab_size"], seq=args.seq, packed=args.packed, seed=i)
               for i, step_lengths in enumerate(lengths)]

    def step(batch: dict[str, torch.Tensor]) -> None:
        loss, labelled = token_cross_entropy(session, batch)
        loss.backward()
        torch._foreach_mul_([p.grad for p in model.parameters()], 1.0 / float(labelled))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(batches[0])  # warm-up: allocator, optimizer state
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        started = time.perf_counter()
        for batch in batches[1:]:
            step(batch)
        seconds = (time.perf_counter() - started) / args.steps
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    tokens = sum(map(sum, lengths[1:])) / args.steps  # non-padding tokens
    print(json.dumps({"packed": args.packed, "seconds_per_step": round(seconds, 3),
                      "tokens_per_step": tokens, "tokens_per_s": round(tokens / seconds, 1),
                      "optimizer": type(optimizer).__name__, "fused": optimizer.defaults.get("fused")}))


if __name__ == "__main__":
    main()
