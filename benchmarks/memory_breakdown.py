"""Where a CPU training run's peak resident memory goes: libraries, weights, gradients, optimizer state,
the activations saved for the backward, and what is left (allocator slack and transients).

    python benchmarks/memory_breakdown.py                      # full SFT and LoRA, compare.py's workload
    python benchmarks/memory_breakdown.py --mode lora --steps 16 --out breakdown.json
    python benchmarks/revisions.py HEAD~1 HEAD --rounds 4 -- python benchmarks/memory_breakdown.py --work /tmp/w

The workload is `compare.py`'s (a 28.5M-parameter Llama, fp32, batch 4, alpaca rows of 18-305
tokens, one thread), built once into ``--work`` (kept and reused when given). Each mode runs
``posttune``'s own composition and trainer in a fresh child process, as compare.py's posttune
side does, while a thread samples the process's resident memory every 2 ms. Reported per mode:

- ``peak_mib``: ``ru_maxrss``; ``after_imports_mib`` (torch, posttune, the plugin registry) and
  ``after_compose_mib`` (model loaded, data read and tokenized, optimizer built);
- ``libraries_mib``: a second fresh child importing every top-level package the run had imported,
  nothing else (``libraries_by_package_mib``: the RSS each of the largest adds after torch);
- ``parameters_mib``, ``gradients_mib`` (the trainable parameters': alive from the backward to the
  optimizer step), ``optimizer_state_mib``: the bytes of those tensors;
- ``saved_activations_mib``: the largest step's tensors saved for the backward (counted once per
  storage through `torch.autograd.graph.saved_tensors_hooks`, parameters left out), and
  ``saved_bytes_per_token``;
- ``rest_mib``: the peak less all of the above: the allocator's cached and fragmented heap, the
  gradients of activations alive during the backward, logits, the tokenizer and the data.

The per-step lines (``steps``) give each step's tokens and the RSS at its end. Prints JSON.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from child import emit, run_child

HERE = Path(__file__).resolve().parent

CHILD = '''
import json, sys
sys.path.insert(0, json.loads(sys.argv[1])["bench_dir"])
from memory_breakdown import measure
print(json.dumps(measure(json.loads(sys.argv[1]))))
'''

IMPORTS_CHILD = '''
import importlib, json, resource, sys
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
spec = json.loads(sys.argv[1])
import torch
added, before = {}, rss()
for name in spec["packages"]:
    try:
        importlib.import_module(name)
    except Exception:
        continue
    now = rss()
    added[name], before = round(now - before, 1), now
print(json.dumps({"libraries_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                  "added_mib": added}))
'''

MIB = 2**20


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / MIB


def measure(spec: dict) -> dict:
    """One run in this (fresh) process: the figures of the module docstring."""
    import resource
    import threading
    import time

    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(resident_mib())
            time.sleep(0.002)

    threading.Thread(target=sample, daemon=True).start()
    import torch

    torch.set_num_threads(spec["threads"])
    from compare_support.posttune_side import run_config
    from compare_support.timing import posttune_steps, summarise

    from posttune.config import validate
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry
    from posttune.training import output_dir
    from posttune.training.compose import compose
    from posttune.training.metrics import read_metrics
    from posttune.training.trainer import train

    plan = resolve_plan(validate(run_config(spec)), get_registry())
    after_imports = resident_mib()
    steps: list[dict] = []
    saved: dict[int, int] = {}  # storage address -> bytes, this step
    largest = [0, 0]  # bytes saved, tokens of that step
    with output_dir.claimed(plan.config, main=True):
        session = compose(plan)
        after_compose = resident_mib()
        parameters = {p.untyped_storage().data_ptr() for p in session.model.parameters()}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        def step_end(*_: object) -> None:
            steps.append({"rss_mib": round(resident_mib(), 1), "saved_mib": round(sum(saved.values()) / MIB, 1)})
            if sum(saved.values()) > largest[0]:
                largest[:] = [sum(saved.values()), len(steps) - 1]
            saved.clear()

        session.optimizer.register_step_post_hook(step_end)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            train(session)
        gradients = sum(p.nbytes for p in session.model.parameters() if p.requires_grad)  # freed after each step
        optimizer_state = sum(t.nbytes for state in session.optimizer.state.values() for t in state.values()
                              if isinstance(t, torch.Tensor))
        weights = sum(p.nbytes for p in session.model.parameters())
    done.set()
    tokens, seconds, _ = posttune_steps(read_metrics(Path(spec["out"])))
    for step, count in zip(steps, tokens):
        step["tokens"] = count
    modules = sorted({name.split(".")[0] for name in sys.modules if not name.startswith("_")})
    return {"peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "sampled_peak_mib": round(max(samples), 1), "after_imports_mib": round(after_imports, 1),
            "after_compose_mib": round(after_compose, 1), "parameters_mib": round(weights / MIB, 1),
            "gradients_mib": round(gradients / MIB, 1), "optimizer_state_mib": round(optimizer_state / MIB, 1),
            "saved_activations_mib": round(largest[0] / MIB, 1),
            "saved_bytes_per_token": round(largest[0] / max(1, tokens[largest[1]])),
            "tokens_per_s": summarise(tokens, seconds, spec["warmup_steps"])["tokens_per_s"],
            "steps": steps, "modules": modules}


def libraries(modules: list[str]) -> dict:
    """A fresh child importing torch, then the run's largest packages one by one, then the rest."""
    first = [name for name in ("posttune", "datasets", "tokenizers", "jinja2", "safetensors", "torchao", "transformers")
             if name in modules]
    rest = [name for name in modules if name not in first and name != "torch"]
    return run_child(IMPORTS_CHILD, {"packages": first + rest})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", help="build the workload here (reused when it is already there) and keep it")
    parser.add_argument("--out")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from compare_support import workload

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="posttune-breakdown-"))
    if not (work / "sft.jsonl").is_file():
        work.mkdir(parents=True, exist_ok=True)
        workload.build_tokenizer(work / "model")
        workload.save_checkpoint(work / "model", workload.SHAPE)
        workload.write_rows(work / "model", work, rows=args.steps * 4)
    report: dict = {"settings": vars(args) | {"work": None}}
    try:
        for mode in args.mode:
            spec = {"bench_dir": str(HERE), "work": str(work), "mode": mode, "out": str(work / "runs" / mode),
                    "steps": args.steps, "warmup_steps": args.warmup_steps, "batch_size": 4, "max_seq_len": 512,
                    "lr": 1e-4, "max_grad_norm": 1.0, "seed": 0, "threads": args.threads}
            result = run_child(CHILD, spec)
            found = libraries(result.pop("modules"))
            accounted = (found["libraries_mib"] + result["parameters_mib"] + result["gradients_mib"]
                         + result["optimizer_state_mib"] + result["saved_activations_mib"])
            report[mode] = {**result, "libraries_mib": found["libraries_mib"],
                            "libraries_by_package_mib": dict(sorted(found["added_mib"].items(),
                                                                    key=lambda item: -item[1])[:6]),
                            "rest_mib": round(result["peak_mib"] - accounted, 1)}
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    emit(report, args.out)


if __name__ == "__main__":
    main()
