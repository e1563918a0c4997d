"""DPO on 2 gloo ranks trains exactly like one process (fp32, per step, 1e-5): FSDP2 with full
fine-tuning (the frozen reference sharded too) and with LoRA (the adapters-disabled reference), and
tensor parallelism, with and without loss parallel; TR-DPO's synced reference under FSDP2 and TP. KTO's first
step too (see its test)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TIMEOUT, env, metrics, write_config

pytestmark = pytest.mark.slow

TOL = 1e-5
DPO = {"name": "dpo", "beta": 0.5}
LORA = {"rank": 4, "alpha": 8}
SCRIPT = Path(__file__).with_name("role_sharding.py")
KEYS = ("loss", "grad_norm", "rewards/margin", "rewards/accuracy", "logps/chosen")


def assert_same_curve(run: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in run] == [r["step"] for r in reference] == [1, 2, 3, 4]
    for got, want in zip(run, reference):
        assert got["pairs"] == want["pairs"] == 8 and got["tokens"] == want["tokens"]
        for key in KEYS:
            assert abs(got[key] - want[key]) <= TOL * max(1.0, abs(want[key])), (got["step"], key, got[key], want[key])
    assert run[-1]["loss"] != reference[0]["loss"]  # it trained


@pytest.mark.parametrize("adapter", [None, pytest.param(LORA, marks=pytest.mark.extended)], ids=["full", "lora"])
def test_dpo_under_fsdp2_matches_one_process(runs, adapter):
    name = "lora" if adapter else "full"
    single = runs(f"dpo_{name}_single", batch_size=8, method=DPO, adapter=adapter)
    sharded = runs(f"dpo_{name}_fsdp2", nproc=2, batch_size=4, parallel={"plans": ["fsdp2"]}, method=DPO,
                   adapter=adapter)
    assert_same_curve(metrics(sharded), metrics(single))


@pytest.mark.parametrize("plans", [["tp"], ["tp", "loss_parallel"]], ids=["tp", "tp_loss_parallel"])
def test_dpo_under_tensor_parallelism_matches_one_process(runs, plans):
    """TP splits the frozen reference too; with loss parallel both models' logits stay vocabulary-sharded."""
    single = runs("dpo_full_single", batch_size=8, method=DPO)
    split = runs(f"dpo_{'_'.join(plans)}", nproc=2, batch_size=8, parallel={"plans": plans}, method=DPO)
    assert_same_curve(metrics(split), metrics(single))


@pytest.mark.parametrize("plans", [["fsdp2"], ["tp"]])
def test_tr_dpo_syncs_each_ranks_shard_of_the_reference_as_one_process_syncs_it(runs, plans):
    """TR-DPO (``sync_reference_every: 2``): the reference moves toward the policy after steps 2 and 4, each rank
    its own shard, and steps 3 and 4 (scored against the moved reference) match one process's."""
    tr_dpo = {**DPO, "sync_reference_every": 2, "sync_reference_alpha": 0.5}
    single = runs("tr_dpo_single", batch_size=8, method=tr_dpo)
    split = runs(f"tr_dpo_{plans[0]}", nproc=2, batch_size=4 if plans == ["fsdp2"] else 8,
                 parallel={"plans": plans}, method=tr_dpo)
    assert_same_curve(metrics(split), metrics(single))
    fixed = metrics(runs("dpo_full_single", batch_size=8, method=DPO))
    assert abs(metrics(single)[2]["loss"] - fixed[2]["loss"]) > 1e-4  # the synced reference changed step 3


def test_the_frozen_reference_is_sharded_like_the_policy(tmp_path):
    config = write_config(tmp_path, batch_size=4, parallel={"plans": ["fsdp2"]}, method=DPO)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(SCRIPT),
               str(config)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert found["all_dtensors"] and found["frozen"] and found["policy_frozen_params"] == 0
    assert found["sharded_after_forward"]  # its root (embedding, head) too: no backward would free them
    assert found["placements"] == ["(Shard(dim=0),)"]
    assert found["local_values"] * 2 <= found["full_values"] + 2 * 384  # each rank holds about half of it


def test_kto_under_fsdp2_takes_the_first_step_of_one_process(runs):
    """On step 1 the policy is its reference, so KTO's reference point z0 is 0 wherever it is estimated, and two
    ranks holding 4 rows each must take one process's step over the same 8 (the loss normalised over both
    ranks' examples, the sharded reference). Later steps estimate z0 from each rank's own micro-batch pooled
    over the ranks, as TRL does per device, which no single process reproduces: they are checked for finite
    values only."""
    kto = {"name": "kto", "beta": 0.5}
    single = metrics(runs("kto_single", batch_size=8, method=kto, steps=3))
    sharded = metrics(runs("kto_fsdp2", nproc=2, batch_size=4, parallel={"plans": ["fsdp2"]}, method=kto, steps=3))
    assert [r["step"] for r in sharded] == [r["step"] for r in single] == [1, 2, 3]
    first, want = sharded[0], single[0]
    assert first["examples"] == want["examples"] == 8 and first["kl"] == want["kl"] == 0
    for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen"):
        assert abs(first[key] - want[key]) <= TOL * max(1.0, abs(want[key])), (key, first[key], want[key])
    assert all(math.isfinite(r[key]) for r in sharded for key in ("loss", "grad_norm", "kl"))
    assert sharded[-1]["loss"] != first["loss"]  # it trained
