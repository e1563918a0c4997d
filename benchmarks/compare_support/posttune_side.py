"""The posttune side of one measured run (in its own child process).

The run is driven as ``posttune train`` drives it (``posttune.training.run``): the output
directory claimed, ``compose(plan)``, ``train(session)``; only the final save is left out (the
HF side saves nothing either), so the peak RSS covers composition and the training steps.
Tokens and step times come from the run's own ``metrics.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compare_support.timing import peak_rss_mib, posttune_steps, summarise


def run_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The run config of a spec: the same hyper-parameters as the HF side's (compare.py)."""
    work, mode = Path(spec["work"]), spec["mode"]
    dpo = mode in ("dpo", "rm")  # the reward model reads DPO's preference pairs
    padding_free = spec.get("padding_free", True)  # every method's default: padding-free rows
    method = ({"name": "dpo", "loss_type": "sigmoid", "beta": 0.1, "padding_free": padding_free,
               "share_prompt": spec.get("share_prompt", True)} if mode == "dpo" else
              {"name": "reward_model", "padding_free": padding_free} if mode == "rm" else
              {"name": "sft", "packing": bool(spec.get("packing")), "padding_free": padding_free})
    config: dict[str, Any] = {
        "model": {"family": "llama", "path": str(work / "model"), "dtype": "fp32"},
        "method": method,
        "data": {"train": {"path": str(work / ("dpo.jsonl" if dpo else "sft.jsonl")),
                           "format": "preference" if dpo else "alpaca"},
                 "max_seq_len": spec["max_seq_len"], "group_by_length": False},
        "train": {"max_steps": spec["steps"], "batch_size": spec["batch_size"], "grad_accum_steps": 1,
                  "lr": spec["lr"], "weight_decay": 0.0, "optimizer": "adamw", "scheduler": "constant",
                  "warmup_steps": 0, "max_grad_norm": spec["max_grad_norm"], "seed": spec["seed"],
                  "device": "cpu", "log_every": 1},
        "checkpoint": {"output_dir": spec["out"], "save_every": None, "overwrite": True},
    }
    if mode == "lora" or spec.get("lora"):  # spec["lora"]: LoRA DPO (compare.py's tt_lora_dpo)
        config["adapter"] = {"kind": "lora", "rank": 8, "alpha": 16, "dropout": 0.0,
                             "targets": ["q_proj", "v_proj", "o_proj"]}
    if spec.get("compile"):
        # dynamic shapes: one compilation for every padded length (static shapes would recompile
        # per distinct batch length, inside the timed steps)
        config["memory"] = ["compile"]
        config["memory_options"] = {"compile": {"dynamic": True}}
    return config


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    from posttune.config import validate
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry
    from posttune.training import output_dir
    from posttune.training.compose import compose
    from posttune.training.metrics import read_metrics
    from posttune.training.trainer import train

    registry = get_registry()
    if spec.get("compile") and "compile" not in registry.names("memory_technique"):
        raise SystemExit("compare.py: mode 'compile' needs posttune's 'compile' memory technique, and no installed "
                         f"plugin registers it (memory techniques: {', '.join(registry.names('memory_technique'))})")
    plan = resolve_plan(validate(run_config(spec)), registry)
    with output_dir.claimed(plan.config, main=True):
        session = compose(plan)
        trainable = sum(p.numel() for p in session.model.parameters() if p.requires_grad)
        summary = train(session)
    peak = peak_rss_mib()
    tokens, seconds, losses = posttune_steps(read_metrics(Path(spec["out"])))
    return {"trainable_parameters": trainable, "peak_rss_mib": round(peak, 1), "losses": losses,
            "summary_tokens_per_s": summary.get("tokens_per_s"),
            **summarise(tokens, seconds, spec["warmup_steps"])}


if __name__ == "__main__":  # python posttune_side.py SPEC_JSON (compare.py runs it through run_child)
    import sys

    print(json.dumps(run(json.loads(sys.argv[1]))))
