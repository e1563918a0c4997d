"""Peak memory of `posttune.load_model` against the size of the checkpoint it loads.

    python benchmarks/load_memory.py                 # ~1 GB fp32, one safetensors file
    python benchmarks/load_memory.py --shards 4      # the same weights in 4 shards + index

Writes a random llama-shaped fp32 checkpoint (a few wide layers, config.json +
safetensors, written directly with `safetensors`, no transformers) into a temporary
directory, then loads it in a fresh process and reads that process's peak resident memory
(`ru_maxrss`). A second fresh process that only imports torch and posttune and loads the
plugin registry gives the baseline. Prints JSON; the target is peak < 1.3x the checkpoint.

Every step runs in its own process, and this one never imports torch: on Linux a child
inherits its parent's peak RSS through fork, so a parent that had held the weights would
inflate every measurement.

Needs posttune-llama installed (the checkpoint says LlamaForCausalLM).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

TARGET_RATIO = 1.3

CHILD_BASELINE = """
import resource, torch, posttune
from posttune.plugins import get_registry
get_registry().get("model_family", "llama")
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""

CHILD_LOAD = """
import resource, sys, time, torch, posttune
start = time.perf_counter()
model = posttune.load_model(sys.argv[1])
seconds = time.perf_counter() - start
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, params, seconds)
"""


def llama_config(layers: int, hidden: int, intermediate: int, vocab: int, heads: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "hidden_act": "silu",
    }


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of a llama checkpoint, in the order transformers writes them."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        shapes |= {p + f"self_attn.{x}_proj.weight": (h, h) for x in "qkvo"}
        shapes |= {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (v, h)}


def write_checkpoint(directory: Path, cfg: dict, shards: int) -> tuple[int, int]:
    """Write config.json and the weights in ``shards`` files; return (total bytes, largest tensor bytes)."""
    import torch
    from safetensors.torch import save_file

    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    shapes = tensor_shapes(cfg)
    sizes = {name: 4 * torch.Size(shape).numel() for name, shape in shapes.items()}
    total, per_shard = sum(sizes.values()), sum(sizes.values()) / shards
    groups: list[list[str]] = [[]]
    filled = 0
    for name in shapes:
        if groups[-1] and filled + sizes[name] > per_shard * 1.01:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += sizes[name]
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{k:05d}-of-{len(groups):05d}.safetensors" for k in range(1, len(groups) + 1)])
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for file, group in zip(names, groups, strict=True):  # one shard's tensors in memory at a time
        tensors = {name: torch.randn(shapes[name], generator=generator) * 0.02 for name in group}
        save_file(tensors, directory / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, file)
        del tensors
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total, max(sizes.values())


def run_child(code: str | None, *args: str) -> list[str]:
    """Run ``code`` (or this script with ``args``) in a fresh interpreter; its stdout's words."""
    env = {**os.environ, "POSTTUNE_LOAD_PLUGINS": "posttune-llama"}
    command = [sys.executable, "-c", textwrap.dedent(code)] if code else [sys.executable, __file__]
    result = subprocess.run([*command, *args], env=env,
                            capture_output=True, text=True, check=True)
    return result.stdout.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--write-into", help=argparse.SUPPRESS)  # the writer child
    args = parser.parse_args()
    if args.write_into:
        cfg = llama_config(args.layers, args.hidden, args.intermediate, args.vocab, heads=16)
        print(*write_checkpoint(Path(args.write_into), cfg, args.shards))
        return
    shape = [f"--{k}={getattr(args, k)}" for k in ("shards", "layers", "hidden", "intermediate", "vocab")]
    with tempfile.TemporaryDirectory(prefix="posttune-load-memory-") as tmp:
        start = time.perf_counter()
        total, largest = map(int, run_child(None, *shape, f"--write-into={tmp}"))
        write_seconds = time.perf_counter() - start
        baseline = int(run_child(CHILD_BASELINE)[0])
        peak, loaded, load_seconds = run_child(CHILD_LOAD, tmp)
    peak, loaded = int(peak), int(loaded)
    print(json.dumps({
        "checkpoint_bytes": total,
        "shards": args.shards,
        "largest_tensor_bytes": largest,
        "loaded_parameter_bytes": loaded,
        "peak_rss_bytes": peak,
        "ratio": round(peak / total, 3),
        "baseline_rss_bytes": baseline,
        "ratio_net_of_baseline": round((peak - baseline) / total, 3),
        "target_ratio": TARGET_RATIO,
        "meets_target": peak / total < TARGET_RATIO,
        "load_seconds": round(float(load_seconds), 2),
        "write_seconds": round(write_seconds, 2),
    }, indent=2))


if __name__ == "__main__":
    main()
