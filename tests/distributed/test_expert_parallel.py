"""Expert parallelism (posttune-ep), and tensor parallelism on a mixture of experts, train exactly like
one process; an EP run resumes after a kill -9 (gloo on CPU, fp32; docs/moe.md).

The checkpoint is a tiny Qwen3-MoE whose routing is skewed on purpose: every token's two
experts are experts 0 and 1, so with ep=2 rank 1 (experts 4-7) and with ep=4 ranks 1-3 receive
no token at all, and the all-to-all runs with empty splits. Each parallel run sees the same
global batch as the single process (8 rows); per-step losses agree within 1e-5, and so does the first
step's gradient norm; later gradient norms and the saved weights within 5e-5, full fine-tuning and LoRA.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import env, metrics, train, write_config
from safetensors.torch import load_file
from test_failure import KILLED_RANK_WORKER

from posttune.testing.tiny import TINY, tiny_hf_model

pytestmark = pytest.mark.slow

TOL = 1e-5
#: saved weights across ranks: TP's all-reduces and the data ranks' gradient reductions sum in another
#: order than one process, and Adam's division by the root of the second moment magnifies that rounding
#: where a gradient is near zero (after 3 steps: 1.1e-5 seen on q_proj under TP, 1.6e-5 under ep4 once
#: RMSNorm's backward summed its input's gradient in another order; 2.2e-5 under TP on an AMD EPYC, whose
#: gradient norm at step 2 then differed by 1.9e-5 relative); losses still agree within TOL
WEIGHTS_TOL = 5e-5
EP = {"plans": ["fsdp2", "ep"]}
LORA = {"rank": 4, "alpha": 8}
RUNS = {
    "ep2": dict(nproc=2, batch_size=4, parallel={**EP, "dims": {"ep": 2}}),
    "ep4": dict(nproc=4, batch_size=2, parallel={**EP, "dims": {"ep": 4}}),
    "ep2_x_dp_shard2": dict(nproc=4, batch_size=2, parallel={**EP, "dims": {"ep": 2, "dp_shard": 2}}),
    # TP splits the attention (Qwen3's per-head q/k norms included); each MoE layer runs whole per TP rank
    "tp2": dict(nproc=2, batch_size=8, parallel={"plans": ["tp"]}),
    "tp2_no_sequence_parallel": dict(nproc=2, batch_size=8, parallel={"plans": ["tp"], "options": {
        "tp": {"sequence_parallel": False}}}),
    "ep2_x_tp2": dict(nproc=4, batch_size=4, parallel={"plans": ["fsdp2", "ep", "tp"], "dims": {"ep": 2, "tp": 2}}),
}


@pytest.fixture(scope="module")
def skewed(tmp_path_factory) -> Path:
    """A Qwen3-MoE checkpoint whose routers send every token to experts 0 and 1.

    The embedding's first component is large and positive for every token, the MoE layers' input
    norm keeps only that component, and the router's first column ranks experts 0 > 1 > the rest:
    the routing margin is orders of magnitude beyond what 3 training steps move.
    """
    config = transformers.Qwen3MoeConfig(**{**TINY, "vocab_size": 384, "head_dim": 32, "num_experts": 8,
                                            "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                            "norm_topk_prob": True, "tie_word_embeddings": True})
    model = tiny_hf_model(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 20.0
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.zero_()
            layer.post_attention_layernorm.weight[0] = 1.0
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[:, 0] = torch.tensor([3.0, 2.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    path = tmp_path_factory.mktemp("skewed") / "moe"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ep_runs(skewed, tmp_path_factory):
    root, done = tmp_path_factory.mktemp("ep"), {}

    def run(name: str, *, nproc: int | None = None, steps: int = 3, **config) -> Path:
        if name not in done:
            path = write_config(root / name, model={"path": str(skewed)}, steps=steps, **config)
            train(path, nproc=nproc)
            done[name] = root / name / "out"
        return done[name]

    return run


def assert_same_run(run: Path, reference: Path, weights: str, weights_tol: float = TOL) -> None:
    got, want = metrics(run), metrics(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for a, b in zip(got, want):
        assert abs(a["loss"] - b["loss"]) <= TOL, (a["step"], a["loss"], b["loss"])
        # step 1 starts from the same weights; later steps from weights apart by Adam-magnified rounding
        norm_tol = TOL if a["step"] == 1 else WEIGHTS_TOL
        assert abs(a["grad_norm"] - b["grad_norm"]) <= norm_tol * max(1.0, b["grad_norm"]), a["step"]
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], abs=TOL)
    assert want[0]["expert_tokens_min"] == 0  # the skew holds: six experts get no token
    saved, expected = load_file(run / weights), load_file(reference / weights)
    assert saved.keys() == expected.keys()
    for key, tensor in expected.items():
        assert (saved[key] - tensor).abs().max().item() <= weights_tol, key


@pytest.fixture(scope="module")
def spread(tmp_path_factory) -> Path:
    """A random Qwen3-MoE (tokens spread over its 8 experts) whose load-balancing loss weighs 1.0: a token
    counted twice, or padding counted, moves the loss and its gradient well past the tolerance."""
    config = transformers.Qwen3MoeConfig(**{**TINY, "vocab_size": 384, "head_dim": 32, "num_experts": 8,
                                            "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                            "norm_topk_prob": True, "router_aux_loss_coef": 1.0})
    path = tmp_path_factory.mktemp("spread") / "moe"
    tiny_hf_model(config).save_pretrained(path)
    return path


def test_sequence_parallel_padding_stays_out_of_the_aux_loss(spread, tmp_path):
    """TP's sequence parallelism pads an odd-length batch by one token; the routing statistics leave it
    out, so the step is the one process's (counting it raised the gradient norm by a third)."""
    runs = {}
    for name, nproc, parallel in (("single", None, None), ("tp2", 2, {"plans": ["tp"]})):
        path = write_config(tmp_path / name, model={"path": str(spread)}, steps=1, batch_size=1, parallel=parallel)
        data = path.parent / "train.jsonl"  # the reversal chats are of even length: each prompt one token longer
        data.write_text(data.read_text().replace('"}, {"role": "assistant"', '?"}, {"role": "assistant"'))
        train(path, nproc=nproc)
        runs[name] = metrics(tmp_path / name / "out")[0]
    single, tp = runs["single"], runs["tp2"]
    assert single["tokens"] % 2 == 1  # the batch needs padding for TP=2
    assert tp["aux_loss"] == pytest.approx(single["aux_loss"], abs=TOL)
    assert tp["expert_tokens_mean"] == single["expert_tokens_mean"]
    assert abs(tp["grad_norm"] - single["grad_norm"]) <= TOL * max(1.0, single["grad_norm"])


def test_routing_is_skewed_onto_two_experts(skewed):
    import posttune

    model = posttune.load_model(skewed)
    router = model.layers[0].mlp.router
    hidden = model.layers[0].mlp_norm(model.embed(torch.randint(0, 384, (4, 16))))
    assert torch.unique(router(hidden.reshape(-1, 64))[3]).tolist() == [0, 1]


#: the default run keeps one layout of each kind (EP with FSDP, TP alone, EP x TP); tox -e extended the rest
EXTENDED = {"ep2", "ep4", "tp2_no_sequence_parallel"}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.extended) if name in EXTENDED else name
                                  for name in RUNS])
def test_full_finetuning_matches_one_process(ep_runs, name):
    reference = ep_runs("single", batch_size=8)
    assert_same_run(ep_runs(name, **RUNS[name]), reference, "model/model.safetensors", WEIGHTS_TOL)


def test_lora_matches_one_process(ep_runs):
    reference = ep_runs("lora_single", batch_size=8, adapter=LORA)
    run = ep_runs("lora_ep2", adapter=LORA, **RUNS["ep2"])
    assert_same_run(run, reference, "adapter/adapter_model.safetensors")


@pytest.mark.extended  # DCP resume on two ranks stays in the default run (tests/distributed/test_sharded_resume.py)
def test_kill_9_and_resume_is_bitwise_the_uninterrupted_run(ep_runs, skewed, tmp_path):
    # rank 1 dies by SIGKILL right after step 3; the checkpoint of step 2 is the one to resume from
    straight = ep_runs("ep2_saving", steps=4, checkpoint={"save_every": 2}, **RUNS["ep2"])
    config = write_config(tmp_path / "killed", model={"path": str(skewed)}, steps=4, checkpoint={"save_every": 2},
                          batch_size=4, parallel=RUNS["ep2"]["parallel"])
    script = tmp_path / "killed_rank_worker.py"
    script.write_text(KILLED_RANK_WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(script), str(config)]
    killed = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env())
    assert killed.returncode != 0
    out = tmp_path / "killed" / "out"
    assert [p.name for p in sorted((out / "checkpoints").glob("step-*"))] == ["step-00000002"]
    train(config, "checkpoint.resume=latest", nproc=2)
    keys = ("step", "loss", "grad_norm", "aux_loss")
    assert [[r[k] for k in keys] for r in metrics(out)] == [[r[k] for k in keys] for r in metrics(straight)]


def test_the_aux_loss_joins_a_loss_parallel_loss(runs):
    """Under loss parallelism the loss is a replicated DTensor; the aux loss joins it as one (a random
    tiny Qwen3-MoE: the skewed checkpoint's large logits round differently in the vocabulary-split loss)."""
    model = {"family": "qwen3_moe", "size": "tiny", "build_overrides": {"vocab_size": 384}}
    reference = runs("qwen3_moe_single", batch_size=8, model=model)
    run = runs("qwen3_moe_tp2_loss_parallel", nproc=2, batch_size=8, model=model,
               parallel={"plans": ["tp", "loss_parallel"]})
    got, want = metrics(run), metrics(reference)
    assert len(got) == len(want) == 4
    # a random router has near-ties: after the first update, rounding in the vocabulary-split loss may
    # move one token's second expert (2e-4 of aux, then 3e-5 of loss by step 4 seen); the skewed runs
    # above hold 1e-5 throughout because their routing has no ties
    for a, b in zip(got, want):
        tol = TOL if a["step"] == 1 else 1e-4
        assert abs(a["loss"] - b["loss"]) <= tol, a["step"]
        assert abs(a["aux_loss"] - b["aux_loss"]) <= 10 * tol, a["step"]
