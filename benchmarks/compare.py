"""posttune against Hugging Face (transformers Trainer, + PEFT, + TRL) and torchtune on the same CPU workload.

    python benchmarks/compare.py                          # every mode but torchtune's, 3 runs per side
    python benchmarks/compare.py --mode full lora --runs 5 --out result.json
    python benchmarks/compare.py --quick --mode full --runs 1      # a smoke check (tiny model)
    python benchmarks/compare.py --mode tt_full tt_packed tt_fastest hf_padding_free tt_lora_dpo \
        --runs 3 --steps 16 --warmup-steps 4 --out benchmarks/results/compare_torchtune.json

Modes: ``full`` (full SFT), ``lora`` (LoRA r8 on q/v/o, alpha 16, no dropout), ``dpo`` (sigmoid,
beta 0.1, the reference a frozen copy on both sides), and posttune only: ``packing`` (padded vs
packed rows, same data), ``compile`` (without vs with ``memory: [compile]``; refused in one
line when no installed plugin registers that technique), ``dpo_layout`` (DPO's padded pairs vs
its padding-free default), ``dpo_prompt`` (DPO's padding-free pairs with each prompt computed per
response, ``share_prompt: false``, vs once, the default), ``packing_layout`` (SFT's padding-free
samples vs packed rows),
``packed_rows`` (packed rows of exactly ``max_seq_len``, ``padding_free: false``, vs packed rows
end to end without their tails, the default) and ``rm_layout`` (posttune-rm's padded pairs vs its
padding-free default, on DPO's pairs).

Against the peers' fastest settings (issue 29, item 5): ``hf_padding_free`` (posttune's full SFT vs
TRL's ``SFTTrainer`` with ``padding_free=True``: a batch's rows end to end, SDPA, no mask), ``hf_fastest``
(posttune's ``memory: [compile]`` vs the same TRL run with the Trainer's ``torch_compile=True``), and
torchtune 0.6.1 (its ``full_finetune_single_device`` / ``lora_dpo_single_device`` recipes, a YAML
config written per run; details in ``compare_support/torchtune_side.py``): ``tt_full`` (posttune's
full SFT, padding-free rows, vs torchtune's defaults: padded batches, no packing, no compile),
``tt_packed`` (posttune ``packing: true`` vs torchtune ``dataset.packed: True``), ``tt_fastest``
(posttune ``memory: [compile]`` vs torchtune packed + ``compile: True``) and ``tt_lora_dpo``
(posttune LoRA DPO vs ``lora_dpo_single_device``, LoRA r8 alpha 16 on q/v/o on both; torchtune's
recipe does not clip gradients). torchtune runs in its own venv, ``--torchtune-venv`` (default
``~/.cache/posttune-bench/torchtune-0.6.1``), made with ``python -m venv`` and ``pip install -c
constraints.txt torch==2.13.0 torchtune==0.6.1 torchao==0.13.* torchdata==0.11.*`` the first time a
``tt_*`` mode is asked for, and reused after; the default mode list leaves the ``tt_*`` modes out.
Packed sides do not train on the same batches (each side packs its own way): their report gives
each side's mean tokens per step instead of ``same_batches``; the other peer modes check that the
per-step token counts are equal and quote both sides' first-step losses.

Allocators: every side runs on the system's malloc unless ``--posttune-allocator LIB`` /
``--peer-allocator LIB`` preload another in that side's children (``posttune train`` itself preloads
jemalloc where the machine has it; these children call posttune's trainer directly, so it is set here).

Every run is a fresh child process (``child.run_child``; torchtune's with the venv's python); the
sides alternate (posttune, peer, posttune, peer, ...). Per run: non-padding tokens per second over
the timed steps (the first ``--warmup-steps`` excluded) and the child's peak RSS (``ru_maxrss``);
per mode: the medians and the ratio posttune/peer (packing: packed/padded; compile:
compiled/uncompiled).

The workload, built once into a temporary directory (no downloads):
- a Llama of ~28.5M parameters (hidden 512, 8 layers, 8 heads, 8 KV heads, intermediate 1376,
  vocabulary 3072, untied), random init (seed 0) saved by transformers' ``save_pretrained``
  and loaded by both sides (posttune: ``model: {family: llama, path: DIR}``), fp32;
- a byte-level BPE (3072 ids, Llama 3's special tokens and a Llama-3-style chat template)
  trained with ``tokenizers`` on seeded pseudo-word text;
- steps x batch alpaca rows (one epoch exactly) of about 18-305 tokens once rendered, and as many
  preference pairs (prompt/chosen/rejected messages) for DPO.
Both sides: batch 4, max_seq_len 512, AdamW (fused) lr 1e-4, betas (0.9, 0.999), eps 1e-8,
weight decay 0, constant schedule, no warm-up, max grad norm 1.0, loss on the response only,
batches padded to their longest row, the same batch order (the report checks the per-step token
counts are equal), torch threads = --threads, no workers, no gradient checkpointing, no compile
(except the compile mode), no evaluation, no checkpoint or final save, no progress bars.
The HF side's details are in ``compare_support/hf_side.py``, posttune's in
``compare_support/posttune_side.py``.

--quick: a 2-layer hidden-64 model, 6 steps (2 warm-up), for checking that everything runs.
Timings on a shared or loaded machine mean little: run the real comparison on an idle one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from child import emit, run_child
from compare_support.venv import ensure_torchtune_venv, python_of, run_child_with

HERE = Path(__file__).resolve().parent

CHILD = r'''
import json, sys
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["bench_dir"])
task = spec["task"]
if task == "prepare":
    from pathlib import Path
    from compare_support import hf_side, workload
    work = Path(spec["work"])
    shape = workload.QUICK_SHAPE if spec["quick"] else workload.SHAPE
    workload.build_tokenizer(work / "model")
    parameters = workload.save_checkpoint(work / "model", shape)
    lengths = workload.write_rows(work / "model", work, rows=spec["rows"])
    checked = hf_side.check_tokenization(work, spec["max_seq_len"])
    if spec["torchtune_rows"]:  # the HF side's rows, for the torchtune child to check its own against
        from compare_support import torchtune_side
        torchtune_side.write_reference_rows(work, spec["max_seq_len"])
    from posttune.plugins import get_registry
    techniques = get_registry().names("memory_technique")
    result = {"shape": shape, "parameters": parameters, "lengths": lengths, "rows_checked": checked,
              "memory_techniques": techniques}
else:
    from compare_support import hf_side, posttune_side, timing
    side = posttune_side if task == "posttune" else hf_side
    if spec.get("profile"):
        result, result["profile"] = timing.profiled(side.run, spec)
    else:
        result = side.run(spec)
print(json.dumps(result))
'''

#: run with the torchtune venv's python (compare_support/torchtune_side.py)
TORCHTUNE_CHILD = r'''
import json, sys
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["bench_dir"])
from compare_support import torchtune_side
print(json.dumps(torchtune_side.run(spec)))
'''

#: mode -> (the side measured first, the side measured second), each (name, spec additions)
MODES = {
    "full": (("posttune", {"task": "posttune"}), ("hf", {"task": "hf"})),
    "lora": (("posttune", {"task": "posttune"}), ("hf", {"task": "hf"})),
    "dpo": (("posttune", {"task": "posttune"}), ("hf", {"task": "hf"})),
    "packing": (("posttune-padded", {"task": "posttune", "padding_free": False}),
                ("posttune-packed", {"task": "posttune", "packing": True})),
    "compile": (("posttune", {"task": "posttune"}), ("posttune-compile", {"task": "posttune", "compile": True})),
    "dpo_layout": (("posttune-dpo-padded", {"task": "posttune", "padding_free": False}),
                   ("posttune-dpo-padding-free", {"task": "posttune"})),
    "dpo_prompt": (("posttune-dpo-prompt-twice", {"task": "posttune", "share_prompt": False}),
                   ("posttune-dpo-shared-prompt", {"task": "posttune"})),
    "packing_layout": (("posttune-padding-free", {"task": "posttune"}),
                       ("posttune-packed", {"task": "posttune", "packing": True})),
    "packed_rows": (("posttune-packed-fixed", {"task": "posttune", "packing": True, "padding_free": False}),
                    ("posttune-packed", {"task": "posttune", "packing": True})),
    "rm_layout": (("posttune-rm-padded", {"task": "posttune", "padding_free": False}),
                  ("posttune-rm-padding-free", {"task": "posttune"})),
    # against the peers' fastest settings (issue 29, item 5)
    "tt_full": (("posttune", {"task": "posttune"}), ("torchtune", {"task": "torchtune"})),
    "tt_packed": (("posttune-packed", {"task": "posttune", "packing": True}),
                  ("torchtune-packed", {"task": "torchtune", "packing": True})),
    "tt_fastest": (("posttune-compile", {"task": "posttune", "compile": True}),
                   ("torchtune-packed-compile", {"task": "torchtune", "packing": True, "compile": True})),
    "hf_padding_free": (("posttune", {"task": "posttune"}), ("hf-padding-free", {"task": "hf", "padding_free": True})),
    # TRL's fastest SFT setting on CPU: padding-free rows and the Trainer's torch_compile, against posttune's compile
    "hf_fastest": (("posttune-compile", {"task": "posttune", "compile": True}),
                   ("hf-padding-free-compile", {"task": "hf", "padding_free": True, "compile": True})),
    "tt_lora_dpo": (("posttune-lora-dpo", {"task": "posttune", "lora": True}),
                    ("torchtune-lora-dpo", {"task": "torchtune", "lora": True})),
}
RATIO = {"full": "posttune/hf", "lora": "posttune/hf", "dpo": "posttune/hf", "packing": "packed/padded",
         "compile": "compiled/uncompiled", "dpo_layout": "padding-free/padded", "dpo_prompt": "shared/twice",
         "packing_layout": "packed/padding-free", "packed_rows": "padding-free/fixed rows",
         "rm_layout": "padding-free/padded",
         "tt_full": "posttune/torchtune", "tt_packed": "posttune/torchtune", "tt_fastest": "posttune/torchtune",
         "hf_padding_free": "posttune/hf", "hf_fastest": "posttune/hf", "tt_lora_dpo": "posttune/torchtune"}
#: posttune-only modes: the second side over the first
AGAINST_ITSELF = ("packing", "compile", "dpo_layout", "dpo_prompt", "packing_layout", "packed_rows", "rm_layout")
#: posttune against a peer on the same batches (the per-step token counts and losses are compared)
SAME_BATCHES = ("full", "lora", "dpo", "tt_full", "hf_padding_free", "hf_fastest", "tt_lora_dpo")
#: posttune against a peer on differently packed rows: the batches differ, the losses are only indicative
OWN_BATCHES = ("tt_packed", "tt_fastest")
TORCHTUNE_MODES = tuple(mode for mode, sides in MODES.items() if any(s["task"] == "torchtune" for _, s in sides))
DEFAULT_TORCHTUNE_VENV = Path("~/.cache/posttune-bench/torchtune-0.6.1")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", nargs="+", default=[m for m in MODES if m not in TORCHTUNE_MODES],
                        choices=list(MODES), help="modes to run (default: all but the tt_* modes)")
    parser.add_argument("--runs", type=int, default=3, help="runs per side and mode")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 30; --quick 6)")
    parser.add_argument("--warmup-steps", type=int, help="first steps left out of tokens/s (default 5; --quick 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    parser.add_argument("--quick", action="store_true", help="a tiny model and few steps: a smoke check")
    parser.add_argument("--out", help="also write the JSON report here")
    parser.add_argument("--profile", action="store_true",
                        help="run the posttune and HF children under torch.profiler (slower; read the op shares, "
                             "not the tokens/s): each result gains the top operators by self CPU time")
    parser.add_argument("--keep", help="build the workload and run outputs in this directory and keep it")
    parser.add_argument("--posttune-allocator", metavar="LIB",
                        help="preload this allocator library (LD_PRELOAD) in posttune's runs, as `posttune train` "
                             "does with jemalloc where the machine has it (posttune/allocator.py)")
    parser.add_argument("--peer-allocator", metavar="LIB", help="preload this allocator library in the peers' runs")
    parser.add_argument("--torchtune-venv", type=Path, default=DEFAULT_TORCHTUNE_VENV,
                        help="torchtune's own venv (tt_* modes): created here when missing, reused when present "
                             f"(default {DEFAULT_TORCHTUNE_VENV})")
    args = parser.parse_args()
    args.steps = args.steps or (6 if args.quick else 30)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (2 if args.quick else 5)
    if args.steps <= args.warmup_steps:
        parser.error(f"--steps ({args.steps}) must be more than --warmup-steps ({args.warmup_steps})")
    return args


def child_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}


def summarise_mode(mode: str, runs: list[dict]) -> dict:
    first, second = (name for name, _ in MODES[mode])
    by_side = {side: [r for r in runs if r["side"] == side] for side in (first, second)}
    summary: dict = {"ratio": RATIO[mode]}
    for side, results in by_side.items():
        summary[side] = {"runs": len(results),
                         "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in results),
                         "peak_rss_mib_median": statistics.median(r["peak_rss_mib"] for r in results)}
    a, b = (by_side[second], by_side[first]) if mode in AGAINST_ITSELF else (by_side[first], by_side[second])
    num, den = (summary[a[0]["side"]], summary[b[0]["side"]])
    summary["tokens_per_s_ratio"] = round(num["tokens_per_s_median"] / den["tokens_per_s_median"], 3)
    summary["peak_rss_ratio"] = round(num["peak_rss_mib_median"] / den["peak_rss_mib_median"], 3)
    if mode in SAME_BATCHES + OWN_BATCHES:
        mine, theirs = by_side[first][0], by_side[second][0]
        summary["trainable_parameters"] = {first: mine["trainable_parameters"],
                                           second: theirs["trainable_parameters"]}
        summary["first_step_loss"] = {first: round(mine["losses"][0], 5), second: round(theirs["losses"][0], 5)}
        if mode in SAME_BATCHES:  # the two sides must have trained on the same batches
            summary["same_batches"] = mine["step_tokens"] == theirs["step_tokens"]
            summary["max_step_loss_difference"] = round(max(abs(x - y) for x, y in
                                                            zip(mine["losses"], theirs["losses"], strict=False)), 6)
        else:  # each side packs the rows its own way: different batches, so only their sizes are reported
            summary["same_batches"] = "not applicable: each side packs its own rows"
            summary["step_tokens_mean"] = {side: round(statistics.mean(r["step_tokens"]), 1)
                                           for side, r in ((first, mine), (second, theirs))}
    return summary


def main() -> int:
    args = parse()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="posttune-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(args.threads)
    torchtune = None
    if any(mode in TORCHTUNE_MODES for mode in args.mode):
        venv = args.torchtune_venv.expanduser()
        torchtune = {"venv": str(venv), "python": str(python_of(venv)),
                     **ensure_torchtune_venv(venv, HERE.parent / "constraints.txt")}
    base = {"bench_dir": str(HERE), "work": str(work), "steps": args.steps, "warmup_steps": args.warmup_steps,
            "threads": args.threads, "batch_size": 4, "lr": 1e-4, "max_grad_norm": 1.0, "seed": 0,
            "max_seq_len": 512, "profile": args.profile}
    try:
        prepared = run_child(CHILD, {**base, "task": "prepare", "quick": args.quick, "torchtune_rows": bool(torchtune),
                                     "rows": args.steps * base["batch_size"]}, env=env)
        if {"compile", "tt_fastest"} & set(args.mode) and "compile" not in prepared["memory_techniques"]:
            print("compare.py: modes 'compile' and 'tt_fastest' need posttune's 'compile' memory technique, and no "
                  "installed plugin registers it (memory techniques: "
                  f"{', '.join(prepared['memory_techniques'])}); run without --mode compile/tt_fastest, or install "
                  "the plugin that adds it", file=sys.stderr)
            return 2
        shape = prepared["shape"]
        print(f"workload: Llama {shape}, {prepared['parameters']:,} parameters, fp32; "
              f"{args.steps * base['batch_size']} rows, tokens per row {prepared['lengths']['sft_tokens']}; "
              f"{args.steps} steps ({args.warmup_steps} warm-up), batch 4, {args.threads} thread(s)", file=sys.stderr)
        runs = []
        for mode in args.mode:
            for index in range(args.runs):
                for side, extra in MODES[mode]:
                    out = work / "runs" / f"{mode}-{side}-{index}"
                    kind = ("dpo" if mode in ("dpo", "dpo_layout", "dpo_prompt", "tt_lora_dpo")
                            else "rm" if mode == "rm_layout" else "lora" if mode == "lora" else "full")
                    spec = {**base, "mode": kind, **extra, "out": str(out)}
                    library = args.posttune_allocator if spec["task"] == "posttune" else args.peer_allocator
                    side_env = {**env, "LD_PRELOAD": library} if library else env
                    result = (run_child_with(torchtune["python"], TORCHTUNE_CHILD, spec, env=side_env)
                              if spec["task"] == "torchtune" else run_child(CHILD, spec, env=side_env))
                    shutil.rmtree(out, ignore_errors=True)
                    runs.append({"mode": mode, "side": side, "run": index, **result})
                    print(f"{mode} run {index} {side}: {result['tokens_per_s']:.1f} tokens/s, peak RSS "
                          f"{result['peak_rss_mib']:.1f} MiB, {result['steps']} steps", file=sys.stderr)
        report = {
            "workload": {"model": {"architecture": "LlamaForCausalLM", **shape, "tie_word_embeddings": False,
                                   "parameters": prepared["parameters"], "dtype": "fp32"},
                         "rows": args.steps * base["batch_size"], "lengths": prepared["lengths"],
                         "sft_rows_checked_against_posttune": prepared["rows_checked"]},
            "settings": {**{k: v for k, v in base.items() if k not in ("bench_dir", "work")}, "quick": args.quick,
                         "runs": args.runs, **({"torchtune": torchtune} if torchtune else {}),
                         "allocators": {"posttune": args.posttune_allocator or "system",
                                        "peers": args.peer_allocator or "system"}},
            "summary": {mode: summarise_mode(mode, [r for r in runs if r["mode"] == mode]) for mode in args.mode},
            "runs": runs,
        }
        emit(report, args.out)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
