"""Peak memory and time of posttune-kd's loss, chunked vs naive, at vocabulary 128k and 2048 tokens.

    python benchmarks/kd_memory.py                       # JSON to stdout, a summary line to stderr
    python benchmarks/kd_memory.py --steps 3 --chunks 1024 256 --out result.json

The loss alone, forward and backward, on two heads of Llama 3's vocabulary (128,256 rows; the
student's hidden size 256, the teacher's 512: the logits' size does not depend on it) over 2048
trained tokens of random hidden states, forward KL mixed with the cross-entropy (kd_ratio 0.5),
fp32 on CPU:

- ``naive``: both heads' full ``[2048, 128256]`` logits, then ``plain_kd_loss`` (what a KD loss
  written over model outputs does: torchtune's and TRL's);
- ``chunked=N``: ``chunked_kd_loss``, N trained tokens projected to the vocabulary at a time.

Each case runs in a fresh subprocess that records its peak resident memory (``ru_maxrss``) after
setup and again after one warm-up and ``--steps`` timed steps; ``step_peak`` is the difference:
what the loss adds on top of the heads and hidden states. This process never imports torch.
"""

from __future__ import annotations

import argparse
import json
import sys

from child import emit, memory_and_time, run_child

CHILD = r'''
import json, resource, sys, time
import torch
torch.set_num_threads(2)
from posttune_kd.chunked import Head, Settings, chunked_kd_loss, plain_kd_loss

spec = json.loads(sys.argv[1])
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
vocab, tokens = spec["vocab"], spec["tokens"]
gen = torch.Generator().manual_seed(0)
student_weight = (torch.randn(vocab, 256, generator=gen) * 0.02).requires_grad_()
teacher_weight = torch.randn(vocab, 512, generator=gen) * 0.02
hidden = torch.randn(tokens, 256, generator=gen).requires_grad_()
teacher_hidden = torch.randn(tokens, 512, generator=gen)
targets = torch.randint(0, vocab, (tokens,), generator=gen)
settings = Settings("forward_kl", kd_ratio=0.5)

def step():
    if spec["chunk"] is None:
        student_logits = hidden @ student_weight.T
        with torch.no_grad():
            teacher_logits = teacher_hidden @ teacher_weight.T
        loss = plain_kd_loss(student_logits, teacher_logits, targets, settings).loss
    else:
        loss = chunked_kd_loss(hidden, Head(student_weight), teacher_hidden, Head(teacher_weight), targets, settings,
                               chunk_size=spec["chunk"]).loss
    loss.backward()
    value = float(loss)
    hidden.grad = None
    student_weight.grad = None
    return value

setup_peak = rss()
loss = step()
times = []
for _ in range(spec["steps"]):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
print(json.dumps({"setup_peak": setup_peak, "peak": rss(), "step_seconds": times, "loss": loss}))
'''


def measure(spec: dict, steps: int) -> dict:
    result = run_child(CHILD, {**spec, "steps": steps})
    return {"loss": result["loss"], **memory_and_time(result)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--tokens", type=int, default=2048, help="trained tokens (the sequence)")
    parser.add_argument("--chunks", type=int, nargs="*", default=[1024, 512, 256], help="chunk sizes to compare")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case (after one warm-up)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    base = {"vocab": args.vocab, "tokens": args.tokens}
    cases = {"naive": {**base, "chunk": None}, **{f"chunked={c}": {**base, "chunk": c} for c in args.chunks}}
    runs = {label: {"spec": spec, **measure(spec, args.steps)} for label, spec in cases.items()}
    naive = runs["naive"]
    versus = {label: {"step_peak_ratio": round(run["step_peak_mib"] / max(naive["step_peak_mib"], 1e-9), 3),
                      "peak_ratio": round(run["peak_mib"] / naive["peak_mib"], 3),
                      "time_ratio": round(run["step_seconds_median"] / naive["step_seconds_median"], 3),
                      "loss_difference": abs(run["loss"] - naive["loss"])}
              for label, run in runs.items() if label != "naive"}
    report = {"runs": runs, "vs_naive": versus}
    print(json.dumps(versus), file=sys.stderr)
    emit(report, args.out)


if __name__ == "__main__":
    main()
