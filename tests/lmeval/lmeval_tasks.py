"""Helpers of the posttune-lmeval tests: a tiny random Llama checkpoint and three tiny local lm-eval tasks.

The checkpoint's context is 32 tokens (``max_position_embeddings``), so the tasks exercise what
long inputs do at real scale: rolling windows for perplexity, left truncation of generation
prompts (20 tokens are kept free for the answer), and of long multiple-choice inputs.

The generation task's targets come from transformers' own greedy ``generate`` on the truncated
prompt, cut at the stop string: every other document gets its true greedy answer and the rest a
wrong one, so the expected exact_match is 0.5 by construction, whichever wrapper runs it.
"""

from __future__ import annotations

import json
from pathlib import Path

CONTEXT = 32
MAX_GEN = 20
#: the context of the chat tests' checkpoint: a templated prompt with few-shot turns is ~150 tokens
CHAT_CONTEXT = 256

QUESTIONS = ["The quick brown fox", "Hello, world! How are", "What is the capital of France?", "Numbers 0 1 2",
             "def add(a, b):", "The model was trained on the data, and the results were good. You are a helpful",
             "A journey of a thousand", "Café, naïve,", "User: please answer the question. Assistant: Sure,",
             "I am fine,"]
CHOICES = [" jumps", " Paris", " thank you", " the data", " 42 100 2024"]
TEXTS = ["The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step. "
         "Hello, world! How are you today? I am fine, thank you.",
         "def add(a, b):\n    return a + b\n\nfor i in range(10):\n\tprint(i)\n",
         "Café, naïve, résumé, über, señor. What is the capital of France? Paris."]

#: where every task reads its rows: a local JSON Lines file as its test split
SOURCE = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
MC_YAML = """task: tiny_mc
""" + SOURCE + """output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_YAML = """task: tiny_gen
""" + SOURCE + """output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - metric: exact_match
"""
PPL_YAML = """task: tiny_ppl
""" + SOURCE + """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""

#: tiny_mc's questions with an assistant turn the model continues (lm-eval's gen_prefix)
PREFIX_MC_YAML = """task: tiny_mc_prefix
""" + SOURCE + """output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}"
gen_prefix: "The answer is"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def greedy_answers(path: Path, prompts: list[str], stop: str) -> list[str]:
    """transformers' greedy completion of each prompt (left-truncated to leave MAX_GEN tokens), cut at ``stop``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    answers = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)[-(CONTEXT - MAX_GEN):]
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=MAX_GEN, pad_token_id=tokenizer.eos_token_id)
        answers.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).split(stop)[0])
    return answers


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def hflm_results(model_dir: Path, task_dir: Path, tasks: list[str], evaluate: dict | None = None,
                 **hflm_options) -> dict:
    """lm-eval's own Hugging Face wrapper on the same files: the reference. ``evaluate``: more
    ``simple_evaluate`` arguments (e.g. ``apply_chat_template``)."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=4, **hflm_options)
    return local_results(lm, task_dir, tasks, **(evaluate or {}))


def local_results(lm, task_dir: Path, tasks: list[str], **options) -> dict:
    """``simple_evaluate`` of an lm-eval ``LM`` on local tasks, samples logged. The task manager indexes the
    local tasks only (lm-eval's own ~15k YAMLs take seconds to index; `posttune eval` does that)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True, **options)


def posttune_results(tmp_path: Path, *args: str) -> dict:
    """`posttune eval ARGS --output ... --log-samples`, in this process with the installed plugins; its JSON."""
    from posttune.testing import run_cli

    out = tmp_path / "results.json"
    result = run_cli("eval", *args, "--device", "cpu", "--output", str(out), "--log-samples")
    assert result.exit_code == 0, result.stderr[-3000:]
    assert "results written to" in result.stdout
    return json.loads(out.read_text(encoding="utf-8"))
