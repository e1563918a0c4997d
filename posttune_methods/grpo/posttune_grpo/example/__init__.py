"""The CPU example's files: a tiny ChatML tokenizer, reversal prompts with answers, and the warm start.

    python -m posttune_grpo.example prepare          # ~30 s: outputs/grpo-tiny-start/model
    posttune train grpo-tiny-reverse                 # GRPO from there: the reward rises

``prepare`` gives GRPO something to improve: a tiny Qwen3-shaped model trained briefly (a few
hundred supervised steps, on purpose too few) to reverse strings of capital letters, so that
sampling finds right answers sometimes and wrong ones often. Run ``python -m
posttune_grpo.example make-data`` to regenerate the bundled files.
"""
