"""Helpers of benchmarks/compare.py and benchmarks/gpu.py (not a library).

- ``workload``: the synthetic workload both sides train on (tokenizer, rows, a random HF
  checkpoint), built locally without downloads.
- ``posttune_side``, ``hf_side``: what one measured child process runs.
- ``timing``: reading posttune's per-step metrics into tokens/s.

The benchmark parents never import torch (a child would inherit their peak RSS through fork);
these modules import it lazily, in the children.
"""
