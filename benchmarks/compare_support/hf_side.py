"""The Hugging Face side of one measured run (in its own child process): transformers' Trainer
for SFT (+ PEFT LoRA), TRL's DPOTrainer for DPO.

``padding_free`` (compare.py's ``hf_padding_free``): TRL's ``SFTTrainer`` with ``padding_free=True``
instead of the plain Trainer, on the same tokenized rows and settings.

Made to match the posttune side (compare.py's docstring lists every setting):
- the same checkpoint (``LlamaForCausalLM``, fp32, transformers' default SDPA attention), the
  same tokenizer and rows; SFT labels are -100 over the prompt, which is the chat template's
  rendering of the user turn with the generation prompt, exactly as posttune masks it (the ids
  are checked against posttune's tokenizer row by row);
- batches padded to their longest row (``DataCollatorForSeq2Seq``; TRL's own collator), in
  the same order as posttune's loader (epoch 0 of a ``torch.randperm`` seeded like posttune's),
  so both sides see the same batches: the per-step token counts are compared in the report;
- AdamW (torch's fused kernel, as posttune uses on CPU), lr 1e-4, betas (0.9, 0.999), eps 1e-8,
  weight decay 0, constant schedule, no warm-up, max grad norm 1.0; no gradient checkpointing,
  no torch.compile, no length grouping, no evaluation, no saving, no logging, no progress bar.

Timing: a callback notes the wall clock at each ``on_step_end``; a step's time is from the
previous step's end (so it includes fetching and collating the batch, as posttune's does) to
its own end. ``compute_seconds`` (``on_step_begin`` to ``on_step_end``) is kept too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from compare_support.timing import peak_rss_mib, summarise


def posttune_order(count: int, seed: int, epoch: int = 0) -> list[int]:
    """posttune's loader order for a map-style dataset (``posttune/data/loader.py``)."""
    import torch

    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63))
    return torch.randperm(count, generator=generator).tolist()


def sft_rows(work: Path, max_seq_len: int, tokenizer: Any) -> list[dict[str, list[int]]]:
    """Alpaca rows -> input_ids, attention_mask and labels (-100 over the prompt: every token that
    starts inside the user turn rendered with the generation prompt, as posttune masks it)."""
    out = []
    for line in (work / "sft.jsonl").read_text().splitlines():
        row = json.loads(line)
        prompt_text = f"{row['instruction']}\n\n{row['input']}" if row.get("input") else row["instruction"]
        user = [{"role": "user", "content": prompt_text}]
        chat = user + [{"role": "assistant", "content": row["output"]}]
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        if not text.startswith(prompt):
            raise SystemExit("hf side: the rendered prompt is not a prefix of the rendered chat")
        # Mask by characters, not by the prompt's own ids: the prompt's trailing "\n\n" tokenizes
        # differently alone than before the response (as with Llama 3's real tokenizer).
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"][:max_seq_len]
        labels = [token if start >= len(prompt) else -100
                  for token, (start, _) in zip(ids, encoded["offset_mapping"], strict=False)]
        out.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    return out


def check_tokenization(work: Path, max_seq_len: int) -> int:
    """The HF side's SFT ids and prompt masks equal posttune's, row by row (run once, in the
    prepare step, so that the measured HF child never imports posttune); returns the rows checked."""
    from posttune.tokenizer import load_tokenizer
    from transformers import AutoTokenizer

    tokenizer, reference = AutoTokenizer.from_pretrained(work / "model"), load_tokenizer(work / "model")
    rows = sft_rows(work, max_seq_len, tokenizer)
    for index, (line, row) in enumerate(zip((work / "sft.jsonl").read_text().splitlines(), rows, strict=True)):
        data = json.loads(line)
        prompt = f"{data['instruction']}\n\n{data['input']}" if data.get("input") else data["instruction"]
        ids, trained = reference.tokenize_messages([{"role": "user", "content": prompt},
                                                    {"role": "assistant", "content": data["output"]}],
                                                   max_seq_len=max_seq_len)
        if list(ids) != row["input_ids"] or list(trained) != [label != -100 for label in row["labels"]]:
            raise SystemExit(f"hf side: row {index}: token ids or the prompt mask differ from posttune's")
    return len(rows)


def dpo_rows(work: Path) -> list[dict[str, Any]]:
    """Preference rows as written: TRL's conversational format (prompt, chosen and rejected messages)."""
    return [json.loads(line) for line in (work / "dpo.jsonl").read_text().splitlines()]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    import datasets
    from torch.utils.data import Sampler
    from transformers import AutoTokenizer, LlamaForCausalLM, Trainer, TrainerCallback

    model_dir = Path(spec["work"]) / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out: its id does not matter

    def load() -> Any:
        return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")

    class PosttuneOrder(Sampler):
        def __init__(self, count: int):
            self.count = count

        def __iter__(self):
            return iter(posttune_order(self.count, spec["seed"]))

        def __len__(self) -> int:
            return self.count

    class Counted:
        """Trainer mixin: posttune's order, and each micro-batch's non-padding tokens and loss."""

        bench_tokens: list[int]
        bench_losses: list[float]

        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return PosttuneOrder(len(train_dataset if train_dataset is not None else self.train_dataset))

        def training_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            # padding-free batches have no attention mask and no padding: every position is a token
            self.bench_tokens.append(int(inputs["attention_mask"].sum()) if "attention_mask" in inputs
                                     else int(inputs["input_ids"].numel()))
            loss = super().training_step(model, inputs, *args, **kwargs)
            self.bench_losses.append(float(loss.detach()))
            return loss

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.begin = self.last_end = None
            self.seconds: list[float] = []
            self.compute: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            self.seconds.append(now - (self.last_end if self.last_end is not None else self.begin))
            self.compute.append(now - self.begin)
            self.last_end = now

    common = dict(
        output_dir=spec["out"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=1, learning_rate=spec["lr"], weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch_fused", lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=spec["max_grad_norm"], seed=spec["seed"], use_cpu=True, bf16=False,
        fp16=False, gradient_checkpointing=False, torch_compile=bool(spec.get("compile")), dataloader_num_workers=0,
        dataloader_pin_memory=False, eval_strategy="no", save_strategy="no", logging_strategy="no",
        report_to=[], disable_tqdm=True, remove_unused_columns=False,
    )
    timer = StepTimer()
    if spec["mode"] == "dpo":
        from trl import DPOConfig, DPOTrainer

        class BenchDPOTrainer(Counted, DPOTrainer):
            pass

        args = DPOConfig(**common, beta=0.1, loss_type=["sigmoid"], max_length=spec["max_seq_len"],
                         precompute_ref_log_probs=False, padding_free=False, disable_dropout=True)
        trainer = BenchDPOTrainer(model=load(), ref_model=load(), args=args,
                                  train_dataset=datasets.Dataset.from_list(dpo_rows(Path(spec["work"]))),
                                  processing_class=tokenizer, callbacks=[timer])
    elif spec.get("padding_free"):
        # TRL's SFTTrainer, padding-free (SFTConfig.padding_free): a batch's rows end to end in one row,
        # position_ids restarting at each; no attention mask (transformers' SDPA mask builder makes the
        # block-causal mask from the restarts). max_length=None: TRL refuses it padding-free without
        # packing; the rows are shorter than max_seq_len already (truncated in sft_rows).
        from trl import SFTConfig, SFTTrainer

        class BenchSFTTrainer(Counted, SFTTrainer):
            pass

        rows = [{"input_ids": r["input_ids"], "labels": r["labels"]}
                for r in sft_rows(Path(spec["work"]), spec["max_seq_len"], tokenizer)]
        args = SFTConfig(**common, padding_free=True, packing=False, max_length=None)
        trainer = BenchSFTTrainer(model=load(), args=args, train_dataset=datasets.Dataset.from_list(rows),
                                  processing_class=tokenizer, callbacks=[timer])
    else:
        from transformers import DataCollatorForSeq2Seq, TrainingArguments

        class BenchTrainer(Counted, Trainer):
            pass

        model = load()
        if spec["mode"] == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                                                     target_modules=["q_proj", "v_proj", "o_proj"],
                                                     task_type="CAUSAL_LM"))
        rows = sft_rows(Path(spec["work"]), spec["max_seq_len"], tokenizer)
        trainer = BenchTrainer(model=model, args=TrainingArguments(**common),
                               train_dataset=datasets.Dataset.from_list(rows),
                               data_collator=DataCollatorForSeq2Seq(tokenizer, padding="longest",
                                                                    label_pad_token_id=-100),
                               processing_class=tokenizer, callbacks=[timer])
    trainer.bench_tokens, trainer.bench_losses = [], []
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.train()
    peak = peak_rss_mib()
    result = summarise(trainer.bench_tokens, timer.seconds, spec["warmup_steps"])
    compute = timer.compute[spec["warmup_steps"]:]
    result["compute_tokens_per_s"] = round(result["timed_tokens"] / max(sum(compute), 1e-9), 1)
    return {"trainable_parameters": trainable, "peak_rss_mib": round(peak, 1), "losses": trainer.bench_losses,
            "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                              else trainer.optimizer).__name__,
            "attention": trainer.model.config._attn_implementation if spec["mode"] != "lora"
            else trainer.model.base_model.model.config._attn_implementation, **result}
