"""Context parallelism on CPU: what torch 2.13 runs there is the forward pass (flex attention has
no CPU backward), so the forward logits under CP must equal the single-process ones; the
training path is refused on CPU before launch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import env
from posttune_cp.shard import ContextParallel, head_tail_order

SCRIPT = Path(__file__).with_name("cp_forward.py")


def test_head_tail_order_balances_causal_work():
    order = head_tail_order(8, 2)
    assert order.tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    # causal work of a query at position p is p + 1 keys: both ranks get the same total
    work = (order + 1).sum(dim=1)
    assert work[0] == work[1]


def test_a_batch_is_padded_and_sharded_in_place(monkeypatch):
    monkeypatch.setattr("posttune_cp.shard.causal_mask", lambda *args: "mask")
    mesh = SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 1)
    batch = {"input_ids": torch.arange(6)[None], "labels": torch.arange(1, 7)[None]}
    state = ContextParallel(mesh, multiple=4)
    state.shard(batch)
    # padded to 8, cut in 4 chunks of 2; rank 1 holds chunks 1 and 2
    assert batch["input_ids"].tolist() == [[2, 3, 4, 5]]
    assert batch["labels"].tolist() == [[3, 4, 5, 6]]
    assert state.positions.tolist() == [[2, 3, 4, 5]]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, family", [("float32", "llama"), ("float64", "llama"), ("float64", "gemma2")])
def test_cp_forward_logits_equal_one_process(dtype, family):
    """gemma2: soft-capped attention scores, which flex attention gets as its score_mod (dropped before: off by
    ~3 on logits of ~7)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(SCRIPT),
               dtype, family]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env())
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    found = json.loads(line.removeprefix("RESULT "))
    assert found["padded_local_len"] == 12  # 22 tokens padded to 24, half on each rank
    # Against one-process flex attention (the same kernel), CP must agree within 1e-5 in fp32.
    # Against one-process SDPA the kernels also round differently (measured 1.1e-5 on logits of
    # magnitude ~1); fp64 takes that rounding out, so any sharding or mask mistake would show in full.
    exact = 1e-5 if dtype == "float32" else 1e-10
    assert found["padded_vs_flex"] <= exact and found["packed_vs_flex"] <= exact, found
    # a soft-capped layer's one-process path takes its softmax in fp32 (as transformers'), in fp64 runs too
    across_kernels = 2e-5 if dtype == "float32" or family == "gemma2" else 1e-10
    assert found["padded"] <= across_kernels and found["packed"] <= across_kernels, found


@pytest.mark.slow
def test_context_parallel_ranks_read_the_same_rows_and_sum_over_each_other():
    """cp splits each sequence, not the batch: its ranks are one data rank (else each would read other rows and
    no rank would hold a whole sequence), while their losses and token counts are summed over both."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(Path(__file__).with_name("data_ranks.py"))]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env())
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT ")).removeprefix(
        "RESULT "))
    assert [(r["data_rank"], r["token_group_size"]) for r in found] == [([0, 1], 2), ([0, 1], 2)]
