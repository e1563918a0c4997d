"""Names that first-party distributions provide, so a missing one gets its `pip install` line.

This is a hint table only: nothing is looked up or built from it, except the old spellings
(``ROLE_SECTIONS``, ``RENAMED_KINDS``) that configs and plugins written before may still use.
The rest of the core names no first-party plugin.
"""

from __future__ import annotations

#: kind -> name -> distribution that registers it
NAMES: dict[str, dict[str, str]] = {
    "model_family": {
        "llama": "posttune-llama",
        "mistral": "posttune-llama",
        "qwen2": "posttune-qwen",
        "qwen3": "posttune-qwen",
        "qwen2_moe": "posttune-qwen",
        "qwen3_moe": "posttune-qwen",
        "mixtral": "posttune-llama",
        "gemma": "posttune-gemma",
        "gemma2": "posttune-gemma",
        "gemma3": "posttune-gemma",
        "smollm3": "posttune-llama",
        "phi3": "posttune-phi3",
    },
    "method": {
        "sft": "posttune-sft",
        "dpo": "posttune-dpo",
        "kto": "posttune-dpo",
        "reward_model": "posttune-rm",
        "grpo": "posttune-grpo",
        "kd": "posttune-kd",
        "ppo": "posttune-ppo",
    },
    "parallel_plan": {
        "fsdp2": "posttune-fsdp2",
        "tp": "posttune-tp",
        "cp": "posttune-cp",
        "ep": "posttune-ep",
        "loss_parallel": "posttune-loss-parallel",
    },
    "reward_function": {
        "math_answer": "posttune-grpo",
        "exact_answer": "posttune-grpo",
        "format": "posttune-grpo",
        "length": "posttune-grpo",
        "reward_model": "posttune-grpo",
    },
    "dataset_format": {
        "unpaired": "posttune-dpo",
        "unpaired_text": "posttune-dpo",
    },
    "quantized_format": {
        "torchao": "posttune-torchao",
    },
    "generation_engine": {
        "builtin": "posttune-generate",
        "vllm": "posttune-vllm",
    },
    "adapter_kind": {
        "lora": "posttune-lora",
        "dora": "posttune-lora",
    },
    "memory_technique": {
        "activation_checkpointing": "posttune-memory",
        "activation_offloading": "posttune-memory",
        "optimizer_in_backward": "posttune-memory",
        "chunked_cross_entropy": "posttune-memory",
        "compile": "posttune-memory",
        "qlora_nf4": "posttune-torchao",
        "qat": "posttune-torchao",
        "fp8": "posttune-torchao",
        "adamw_8bit": "posttune-torchao",
        "adamw_4bit": "posttune-torchao",
    },
    "command": {
        "generate": "posttune-generate",
        "eval": "posttune-lmeval",
        "quantize": "posttune-torchao",
        "new": "posttune-scaffold",
    },
    "metric_logger": {
        "wandb": "posttune-wandb",
        "tensorboard": "posttune-tensorboard",
        "mlflow": "posttune-mlflow",
        "trackio": "posttune-trackio",
    },
    "config": {  # bundled configs
        **dict.fromkeys(["dpo-tiny-reverse", "kto-tiny-reverse", "llama3.2-1b-dpo-lora", "qwen2.5-0.5b-dpo"],
                        "posttune-dpo"),
        **dict.fromkeys(["gemma-7b-lora", "gemma2-2b-sft", "gemma2-9b-lora", "gemma3-1b-lora", "gemma3-1b-sft"],
                        "posttune-gemma"),
        **dict.fromkeys(["grpo-tiny-reverse", "qwen2.5-1.5b-grpo-gsm8k", "qwen3-0.6b-grpo-gsm8k"], "posttune-grpo"),
        **dict.fromkeys(["kd-tiny-reverse", "llama3.1-8b-to-3.2-1b-kd-lora", "qwen2.5-1.5b-to-0.5b-kd"], "posttune-kd"),
        **dict.fromkeys(["llama-demo-reverse", "llama3.1-8b-lora", "llama3.2-1b-lora", "llama3.2-1b-sft",
                         "llama3.2-3b-lora", "mistral-7b-lora", "mixtral-8x7b-qlora", "mixtral-tiny-reverse",
                         "smollm2-135m-sft", "smollm3-3b-lora"], "posttune-llama"),
        **dict.fromkeys(["phi4-mini-lora", "phi4-mini-sft"], "posttune-phi3"),
        **dict.fromkeys(["ppo-tiny-reverse", "qwen2.5-1.5b-ppo"], "posttune-ppo"),
        **dict.fromkeys(["qwen2.5-0.5b-lora", "qwen2.5-0.5b-sft", "qwen2.5-1.5b-lora", "qwen2.5-1.5b-sft",
                         "qwen2.5-7b-lora", "qwen2.5-7b-sft", "qwen3-0.6b-lora", "qwen3-0.6b-sft",
                         "qwen3-30b-a3b-lora", "qwen3-8b-lora", "qwen3-8b-sft"], "posttune-qwen"),
        **dict.fromkeys(["qwen2.5-1.5b-rm", "rm-tiny-reverse"], "posttune-rm"),
    },
}

#: the plan suggested when several processes are launched and no listed plan owns a mesh dimension
MESH_HINT = "fsdp2"

#: the first-party model roles' config sections from before `models:` (plugin API 2), still read
#: as `models.<role>`: `reference:` is `models.reference`
ROLE_SECTIONS: tuple[str, ...] = ("reference", "teacher")
#: dataset kinds renamed since plugin API 2, old -> new, still read under the old name (`sft`
#: was the core's kind for chat, alpaca and text rows, and is also the sft method's name)
RENAMED_KINDS: dict[str, str] = {"sft": "conversation"}

#: Hugging Face `architectures` entries -> distribution whose family reads them
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "posttune-llama",
    "MistralForCausalLM": "posttune-llama",
    "Qwen2ForCausalLM": "posttune-qwen",
    "Qwen3ForCausalLM": "posttune-qwen",
    "GemmaForCausalLM": "posttune-gemma",
    "Gemma2ForCausalLM": "posttune-gemma",
    "Gemma3ForCausalLM": "posttune-gemma",
    "SmolLM3ForCausalLM": "posttune-llama",
    "Phi3ForCausalLM": "posttune-phi3",
}


#: the kind an `adapter:` section without `kind` means (as it did when LoRA was the core's): configs written so
ADAPTER_KIND = "lora"
#: the generation engine of a run's ``train.sample_prompts`` (one-off generations through ``complete``)
ENGINE = "builtin"
#: a saved adapter folder's PEFT ``peft_type`` -> the distribution whose adapter kinds read it
PEFT_TYPES = {"LORA": "posttune-lora"}
#: kind -> another tool's name for something registered here under another name (axolotl's dataset types and
#: its ``adapter: qlora``); a value with a space is said as it is, not as a name
OTHER_NAMES: dict[str, dict[str, str]] = {
    "adapter_kind": {"qlora": "kind: lora with memory: [qlora_nf4] (posttune-torchao)"},
    "dataset_format": {"sharegpt": "chat", "chat_template": "chat", "conversation": "chat", "messages": "chat"},
}


def install_hint(distribution: str | None) -> str:
    return f" — pip install {distribution}" if distribution else ""


#: keys of transformers', TRL's and axolotl's configs whose place here is a first-party plugin's setting: the run
#: config's unknown-key errors name it (``posttune.config.schema.TRAINING_ARGUMENTS`` holds the core's places)
KNOWN_AS: dict[str, str] = {
    "gradient_checkpointing": "memory: [activation_checkpointing] (posttune-memory)",
    "activation_offloading": "memory: [activation_checkpointing, activation_offloading] (posttune-memory)",
    "torch_compile": "memory: [compile] (posttune-memory)", "compile": "memory: [compile] (posttune-memory)",
    "enable_activation_checkpointing": "memory: [activation_checkpointing] (posttune-memory)",
    "enable_activation_offloading": "memory: [activation_checkpointing, activation_offloading] (posttune-memory)",
    "optimizer_in_bwd": "memory: [optimizer_in_backward] (posttune-memory)",
    "loss": "the method's own (sft: token cross-entropy; torchtune's chunked one: memory: [chunked_cross_entropy], "
            "posttune-memory)",
    "metric_logger": "logging: [tensorboard, wandb, mlflow or trackio] (posttune-tensorboard, ...)",
    "quantize_base": "memory: [qlora_nf4] with an adapter section (posttune-torchao)",
    "use_liger_kernel": "memory: [chunked_cross_entropy] (posttune-memory)",
    "packing": "method.packing (sft)", "sample_packing": "method.packing (sft)", "packed": "method.packing (sft)",
    "split_across_pack": "method.long_samples: split (sft)", "packing_strategy": "method.packing (sft)",
    "train_on_input": "method.train_on_input (sft)",
    "train_on_inputs": "method.train_on_input (sft)", "neftune_noise_alpha": "method.neftune_alpha (sft)",
    "beta": "method.beta",
    "load_in_4bit": "memory: [qlora_nf4] with an adapter section (posttune-torchao)",
    "load_in_8bit": "not here (no 8-bit base weights); 4-bit: memory: [qlora_nf4] with an adapter section "
                    "(posttune-torchao)",
    "pad_to_sequence_len": "method.padding_free: false (sft; rows padded, packed ones to data.max_seq_len)",
    "wandb_project": "logging: [wandb] with logging_options: {wandb: {project: ...}} (posttune-wandb)",
    "report_to": "logging: [wandb, tensorboard, mlflow or trackio] (posttune-wandb, ...)",
    "fsdp": "parallel: {plans: [fsdp2]} (posttune-fsdp2)", "fsdp_config": "parallel.options.fsdp2 (posttune-fsdp2)",
    "deepspeed": "parallel: {plans: [fsdp2]} (posttune-fsdp2; ZeRO-3's sharding)",
}
