"""The torchtune side of one measured run, in its own child process with the torchtune venv's python
(torchtune 0.6.1, torchao 0.13, torchdata 0.11, torch 2.13 CPU; ``compare_support/venv.py`` builds it).

torchtune is run the way its docs run it: its ``full_finetune_single_device`` recipe class, given an
OmegaConf config read from a YAML file written here (``recipe_config``); the components it names:
- model: ``torchtune.models.llama3.llama3`` with the saved HF config's dimensions, rope base and norm eps;
- checkpointer: ``FullModelHFCheckpointer`` (model_type LLAMA3) reading the ``save_pretrained``
  safetensors; it converts HF's rotate-half q/k layout to torchtune's (``convert_weights.hf_to_tune``),
  which the report checks: the first step's loss equals posttune's on the same batch;
- tokenizer: torchtune has no model tokenizer for an arbitrary HF ``tokenizer.json`` with a chat
  template (``HuggingFaceBaseTokenizer`` only encodes text), so ``ChatTemplateTokenizer`` below is one:
  it renders the template as transformers does and masks every token that starts inside the prompt,
  as ``hf_side.sft_rows`` does (the rows are checked against the HF side's, id by id);
- dataset: ``alpaca_rows`` below, torchtune's ``SFTDataset`` over the workload's ``sft.jsonl`` (the
  alpaca prompt rendered as posttune and the HF side render it: instruction, blank line, input); padded:
  in posttune's loader order with ``shuffle: False`` (so that the batches are the other sides'); packed:
  torchtune's ``PackedDataset`` (as its ``alpaca_dataset`` wraps it) with its default ``shuffle: True``;
- optimizer ``torch.optim.AdamW`` (fused, lr 1e-4, weight decay 0, betas/eps torch's defaults, the
  same as the other sides), ``clip_grad_norm: 1.0``, no scheduler (constant), batch 4, gradient
  accumulation 1, ``optimizer_in_bwd: False`` (it cannot clip), fp32, cpu, no activation
  checkpointing or offloading, seed 0; loss ``CEWithChunkedOutputLoss`` (8 chunks), the loss every
  torchtune Llama 3 full-finetune config names; ``compile`` as the spec says.
DPO (``dpo_config``): the ``lora_dpo_single_device`` recipe, ``lora_llama3`` (r8, alpha 16, q/v/output
projections), ``preference_rows`` (torchtune's ``PreferenceDataset`` over ``dpo.jsonl``, posttune's
order), ``DPOLoss`` (beta 0.1); the recipe has no gradient clipping. Its token count is the policy
forward's non-padding tokens (chosen and rejected), as the other sides count DPO's.

What the benchmark changes, for measuring only (``BenchRecipe``): ``_loss_step`` notes each batch's
non-padding tokens (tokens != the pad id, which no row contains); the metric logger is ``StepClock``
(``log_every_n_steps: 1``: the recipe calls it once per optimizer step, after the loss's ``.item()``),
which notes the wall clock and the loss and stops the run after ``steps`` optimizer steps (``epochs``
is an upper bound: packed rows give fewer batches per epoch than ``steps``, and the other sides go
on into the next epoch too); ``save_checkpoint`` does nothing (the other sides save nothing). A step's
time is from the previous step's clock (the first: the start of ``train``) to its own, so it includes
fetching and collating the batch, as the other sides' do.

This module imports only the standard library at import time: the dev env imports it too
(``write_reference_rows``, compare.py's prepare step).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

#: a token the chat template never renders: torchtune pads with it, so tokens != it are the real ones
PAD_TOKEN = "<|end_of_text|>"
REFERENCE_ROWS = "sft_rows_hf.json"


def write_reference_rows(work: Path, max_seq_len: int) -> int:
    """The HF side's SFT rows (ids and labels, file order) for the torchtune child to check its own
    against; runs in the dev env (prepare step), so that the torchtune venv needs no transformers."""
    from transformers import AutoTokenizer

    from compare_support.hf_side import sft_rows

    rows = sft_rows(work, max_seq_len, AutoTokenizer.from_pretrained(work / "model"))
    (work / REFERENCE_ROWS).write_text(json.dumps([{"tokens": r["input_ids"], "labels": r["labels"]} for r in rows]))
    return len(rows)


def posttune_order(count: int, seed: int, epoch: int = 0) -> list[int]:
    """posttune's loader order for a map-style dataset (as ``hf_side.posttune_order``)."""
    import torch

    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63))
    return torch.randperm(count, generator=generator).tolist()


class ChatTemplateTokenizer:
    """A torchtune ``ModelTokenizer`` over a HF ``tokenizer.json`` + ``tokenizer_config.json`` chat template.

    ``tokenize_messages`` renders the whole conversation with the template (as transformers'
    ``apply_chat_template``) and encodes it in one piece; the mask is True (not trained) for every
    token starting before the end of the prompt, the template's rendering of all but the last
    message with the generation prompt.
    """

    def __init__(self, path: str, max_seq_len: int | None = None, pad_token: str = PAD_TOKEN):
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        directory = Path(path)
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "tokenizer_config.json").read_text())
        self.template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
            config["chat_template"])
        self.bos_token, self.eos_token = config["bos_token"], config["eos_token"]
        self.bos_id = self.tokenizer.token_to_id(self.bos_token)
        self.eos_id = self.tokenizer.token_to_id(self.eos_token)
        self.pad_id = self.tokenizer.token_to_id(pad_token)
        self.special_tokens = {token.content: index for index, token in
                               self.tokenizer.get_added_tokens_decoder().items()}
        self.max_seq_len = max_seq_len

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.template.render(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                                    add_generation_prompt=add_generation_prompt, tools=None)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def tokenize_messages(self, messages: list[Any], **kwargs: Any) -> tuple[list[int], list[bool]]:
        if messages[-1].role != "assistant":
            raise ValueError("ChatTemplateTokenizer: the last message must be the assistant's response")
        plain = [{"role": m.role, "content": m.text_content} for m in messages]
        prompt = self.render(plain[:-1], add_generation_prompt=True)
        text = self.render(plain, add_generation_prompt=False)
        if not text.startswith(prompt):
            raise ValueError("ChatTemplateTokenizer: the rendered prompt is not a prefix of the rendered chat")
        encoded = self.tokenizer.encode(text, add_special_tokens=False)
        ids, offsets = encoded.ids, encoded.offsets
        if self.max_seq_len is not None:
            ids, offsets = ids[:self.max_seq_len], offsets[:self.max_seq_len]
        return ids, [start < len(prompt) for start, _ in offsets]

    def __call__(self, sample: dict[str, Any], inference: bool = False) -> dict[str, Any]:
        tokens, mask = self.tokenize_messages(sample.pop("messages"))
        return {**sample, "tokens": tokens, "mask": mask}


class AlpacaRowToMessages:
    """An alpaca row -> [user, assistant] messages, the prompt as posttune's alpaca format writes it
    (torchtune's ``AlpacaToMessages`` would wrap it in the Stanford Alpaca prompt instead)."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        from torchtune.data import Message

        prompt = f"{sample['instruction']}\n\n{sample['input']}" if sample.get("input") else sample["instruction"]
        return {"messages": [Message(role="user", content=prompt, masked=True),
                             Message(role="assistant", content=sample["output"])]}


class Reordered:
    """A map-style dataset read in a given order (posttune's loader order)."""

    def __init__(self, dataset: Any, order: list[int]):
        self.dataset, self.order = dataset, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[self.order[index]]


def alpaca_rows(tokenizer: ChatTemplateTokenizer, *, data_file: str, order_seed: int | None = None,
                packed: bool = False, cache_dir: str | None = None) -> Any:
    """The workload's alpaca rows as torchtune's ``SFTDataset`` (packed: ``PackedDataset``, padded
    with the pad id; torchtune's builders pad packs with id 0, the BOS here)."""
    from torchtune.datasets import PackedDataset, SFTDataset

    rows = SFTDataset(source="json", data_files=data_file, split="train", cache_dir=cache_dir,
                      message_transform=AlpacaRowToMessages(), model_transform=tokenizer)
    dataset = Reordered(rows, posttune_order(len(rows), order_seed) if order_seed is not None
                        else list(range(len(rows))))
    if packed:
        return PackedDataset(dataset, max_seq_len=tokenizer.max_seq_len, padding_idx=tokenizer.pad_id)
    return dataset


class PreferenceRowToMessages:
    """A preference row (prompt, chosen and rejected messages, the workload's ``dpo.jsonl``) -> torchtune's
    chosen and rejected conversations, the prompt masked."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        from torchtune.data import Message

        prompt = [Message(role=m["role"], content=m["content"], masked=True) for m in sample["prompt"]]
        return {side: prompt + [Message(role=m["role"], content=m["content"]) for m in sample[side]]
                for side in ("chosen", "rejected")}


def preference_rows(tokenizer: ChatTemplateTokenizer, *, data_file: str, order_seed: int | None = None,
                    cache_dir: str | None = None) -> Any:
    """The workload's preference pairs as torchtune's ``PreferenceDataset``, in posttune's loader order."""
    from torchtune.datasets import PreferenceDataset

    rows = PreferenceDataset(source="json", data_files=data_file, split="train", cache_dir=cache_dir,
                             message_transform=PreferenceRowToMessages(), tokenizer=tokenizer)
    return Reordered(rows, posttune_order(len(rows), order_seed) if order_seed is not None
                     else list(range(len(rows))))


class StepClock:
    """A torchtune metric logger that notes the time and loss of each optimizer step, and ends the run
    after ``stop_after`` steps (``StopTraining``, caught by ``run``)."""

    def __init__(self, stop_after: int):
        self.stop_after = stop_after
        self.last: float | None = None
        self.seconds: list[float] = []
        self.losses: list[float] = []

    def log_config(self, config: Any) -> None:
        pass

    def log(self, name: str, data: Any, step: int) -> None:
        pass

    def log_dict(self, payload: dict[str, Any], step: int) -> None:
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now
        self.losses.append(float(payload["loss"]))
        if len(self.seconds) >= self.stop_after:
            raise StopTraining

    def close(self) -> None:
        pass


class StopTraining(Exception):
    """Raised by ``StepClock`` after the last measured step."""


def model_arguments(model_dir: Path, max_seq_len: int) -> dict[str, Any]:
    """``torchtune.models.llama3.llama3``'s arguments from a saved HF ``config.json``."""
    config = json.loads((model_dir / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise SystemExit("torchtune side: the checkpoint's rope is scaled; llama3() builds plain rope")
    return {"_component_": "torchtune.models.llama3.llama3", "vocab_size": config["vocab_size"],
            "num_layers": config["num_hidden_layers"], "num_heads": config["num_attention_heads"],
            "num_kv_heads": config["num_key_value_heads"], "embed_dim": config["hidden_size"],
            "intermediate_dim": config["intermediate_size"], "max_seq_len": max_seq_len,
            "rope_base": theta, "norm_eps": config["rms_norm_eps"], "attn_dropout": 0.0}


def shared_config(spec: dict[str, Any]) -> dict[str, Any]:
    """What both recipes' configs hold alike: the tokenizer, the checkpointer, the optimizer, fp32 on the CPU,
    no checkpointing or offloading, and StepClock ending the run after ``steps`` steps."""
    work, out = Path(spec["work"]), Path(spec["out"])
    model_dir = work / "model"
    return {
        "output_dir": str(out),
        "tokenizer": {"_component_": "compare_support.torchtune_side.ChatTemplateTokenizer", "path": str(model_dir),
                      "max_seq_len": spec["max_seq_len"]},
        "seed": spec["seed"],
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": str(model_dir),
                         "checkpoint_files": ["model.safetensors"], "recipe_checkpoint": None,
                         "output_dir": str(out / "checkpoints"), "model_type": "LLAMA3"},
        "resume_from_checkpoint": False,
        "batch_size": spec["batch_size"],
        "epochs": spec["steps"],  # an upper bound: StepClock ends the run after `steps` steps
        "max_steps_per_epoch": None,
        "gradient_accumulation_steps": 1,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": spec["lr"], "weight_decay": 0.0, "fused": True},
        "compile": bool(spec.get("compile")),
        "device": "cpu",
        "dtype": "fp32",
        "enable_activation_checkpointing": False,
        "enable_activation_offloading": False,
        "metric_logger": {"_component_": "compare_support.torchtune_side.StepClock", "stop_after": spec["steps"]},
        "log_every_n_steps": 1,
        "log_peak_memory_stats": False,
    }


def dpo_config(spec: dict[str, Any]) -> dict[str, Any]:
    """``lora_dpo_single_device``'s config: LoRA r8 alpha 16 on q/v/output projections, no dropout, the
    reference the base model (adapters disabled), DPOLoss (sigmoid, beta 0.1). That recipe has no
    ``clip_grad_norm``: it never clips (the other sides clip at 1.0)."""
    work, out = Path(spec["work"]), Path(spec["out"])
    model = {**model_arguments(work / "model", spec["max_seq_len"]),
             "_component_": "torchtune.models.llama3.lora_llama3",
             "lora_attn_modules": ["q_proj", "v_proj", "output_proj"], "apply_lora_to_mlp": False,
             "apply_lora_to_output": False, "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0}
    return {
        **shared_config(spec),
        "model": model,
        "dataset": {"_component_": "compare_support.torchtune_side.preference_rows",
                    "data_file": str(work / "dpo.jsonl"), "order_seed": spec["seed"],
                    "cache_dir": str(out / "datasets-cache")},
        "shuffle": False,
        "save_adapter_weights_only": True,
        "loss": {"_component_": "torchtune.rlhf.loss.DPOLoss", "beta": 0.1, "label_smoothing": 0.0},
    }


def recipe_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The YAML config of a spec (written to the run's directory, read back with OmegaConf)."""
    if spec["mode"] == "dpo":
        return dpo_config(spec)
    work, out = Path(spec["work"]), Path(spec["out"])
    packed = bool(spec.get("packing"))
    return {
        **shared_config(spec),
        "model": model_arguments(work / "model", spec["max_seq_len"]),
        # padded rows: posttune's order, not reshuffled (the other sides' batches); packed: torchtune's
        # own shuffle of the packs (its default; sampler seed 0), packs built from the rows in file order
        "dataset": {"_component_": "compare_support.torchtune_side.alpaca_rows", "data_file": str(work / "sft.jsonl"),
                    "order_seed": None if packed else spec["seed"], "packed": packed,
                    "cache_dir": str(out / "datasets-cache")},
        "shuffle": packed,
        "optimizer_in_bwd": False,
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "clip_grad_norm": spec["max_grad_norm"],
    }


def check_rows(dataset: Any, work: Path) -> int:
    """The SFTDataset's tokens and labels equal the HF side's rows (file order); returns the rows checked."""
    while not hasattr(dataset, "_prepare_sample"):  # PackedDataset.ds -> Reordered.dataset -> SFTDataset
        dataset = dataset.ds if hasattr(dataset, "ds") else dataset.dataset
    reference = json.loads((work / REFERENCE_ROWS).read_text())
    for index, expected in enumerate(reference):
        row = dataset[index]
        if list(row["tokens"]) != expected["tokens"] or [int(x) for x in row["labels"]] != expected["labels"]:
            raise SystemExit(f"torchtune side: row {index}: token ids or labels differ from the HF side's")
    if len(dataset) != len(reference):
        raise SystemExit(f"torchtune side: {len(dataset)} rows, the HF side has {len(reference)}")
    return len(reference)


def load_recipe(name: str) -> Any:
    """A torchtune recipe module loaded from its file, as ``tune run`` runs it (torchtune's ``recipes``
    directory refuses to be imported as a package)."""
    import importlib.util

    location = importlib.util.find_spec("recipes").submodule_search_locations[0]
    module_spec = importlib.util.spec_from_file_location(f"torchtune_recipe_{name}", Path(location) / f"{name}.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """One measured torchtune run (``spec`` as compare.py builds it)."""
    import torch

    torch.set_num_threads(spec["threads"])
    import yaml
    from omegaconf import OmegaConf

    from compare_support.timing import peak_rss_mib, summarise

    dpo = spec["mode"] == "dpo"
    if dpo:
        Recipe = load_recipe("lora_dpo_single_device").LoRADPORecipeSingleDevice
    else:
        Recipe = load_recipe("full_finetune_single_device").FullFinetuneRecipeSingleDevice

    class BenchRecipe(Recipe):
        bench_tokens: list[int]

        def _loss_step(self, batch: dict[str, Any]) -> Any:  # SFT
            self.bench_tokens.append(int((batch["tokens"] != self._tokenizer.pad_id).sum()))
            return super()._loss_step(batch)

        def concatenated_forward(self, model: Any, batch: Any) -> Any:  # DPO: the policy's call, not the reference's
            if torch.is_grad_enabled():
                self.bench_tokens.append(int((batch[0] != self._tokenizer.pad_id).sum()))
            return super().concatenated_forward(model, batch)

        def save_checkpoint(self, epoch: int) -> None:
            pass

        def train(self) -> None:
            self._metric_logger.last = time.perf_counter()
            try:
                super().train()
            except StopTraining:
                pass

    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "torchtune.yaml"
    config_path.write_text(yaml.safe_dump(recipe_config(spec), sort_keys=False))
    cfg = OmegaConf.load(config_path)
    recipe = BenchRecipe(cfg=cfg)
    recipe.bench_tokens = []
    recipe.setup(cfg=cfg)
    trainable = sum(p.numel() for p in recipe._model.parameters() if p.requires_grad)
    recipe.train()
    peak = peak_rss_mib()
    recipe.cleanup()
    clock: StepClock = recipe._metric_logger
    tokens = recipe.bench_tokens[:len(clock.seconds)]
    if len(tokens) != spec["steps"]:
        raise SystemExit(f"torchtune side: {len(tokens)} steps, asked for {spec['steps']}")
    result = summarise(tokens, clock.seconds, spec["warmup_steps"])
    dataset = recipe._dataloader.dataset
    return {"trainable_parameters": trainable, "peak_rss_mib": round(peak, 1), "losses": clock.losses,
            "rows_checked_against_hf": None if dpo else check_rows(dataset, Path(spec["work"])),
            "batches_per_epoch": len(recipe._dataloader), "dataset_items": len(dataset),
            "loss_fn": type(recipe._loss_fn).__name__, "optimizer": type(recipe._optimizer).__name__,
            "fused_adamw": bool(recipe._optimizer.defaults.get("fused")), "compile": bool(cfg.compile),
            "recipe": "lora_dpo_single_device" if dpo else "full_finetune_single_device",
            "torchtune_config": OmegaConf.to_container(cfg),
            "epochs_started": recipe.epochs_run + 1, **result}
