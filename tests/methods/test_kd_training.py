"""posttune-kd end to end on tiny models: the method's loss on a composed run equals the divergence
computed from transformers' own teacher logits; chunked and plain paths agree; a teacher of another
family; on-policy batches; what validate refuses; LoRA students with an NF4 teacher; bundled configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import posttune_kd
import posttune_memory
import posttune_generate
import posttune_lora
import pytest
import torch
import torch.nn.functional as F
from run_support import check_bundled_config, compose_run, kd_config, save_hf_teacher, write

TOL = 1e-6


@pytest.fixture
def llama_kd(register_plugin):
    import posttune_llama
    import posttune_qwen

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_qwen, distribution="posttune-qwen", version="0.1.0")
    register_plugin(posttune_kd, distribution="posttune-kd", version="0.1.0")
    register_plugin(posttune_memory, distribution="posttune-memory", version="0.1.0")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return save_hf_teacher(tmp_path_factory.mktemp("kd") / "teacher")


def records(config: dict) -> list[dict]:
    return [json.loads(line) for line in (Path(config["checkpoint"]["output_dir"]) / "metrics.jsonl")
            .read_text().splitlines()]


def hf_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


def reference_loss(session, batch, teacher_logits, *, kind="forward_kl", temperature=1.0, beta=0.5, kd_ratio=0.5):
    """The loss from its definition: float64 softmaxes of the student's and transformers' teacher logits."""
    keep = batch["labels"] != -100
    student = session.model(batch["input_ids"])[keep].double() / temperature
    teacher = teacher_logits[keep].double() / temperature
    p_s, p_t = student.softmax(-1), teacher.softmax(-1)
    log_s, log_t = student.log_softmax(-1), teacher.log_softmax(-1)
    if kind == "forward_kl":
        divergence = (p_t * (log_t - log_s)).sum(-1)
    elif kind == "reverse_kl":
        divergence = (p_s * (log_s - log_t)).sum(-1)
    else:
        log_m = (beta * p_t + (1 - beta) * p_s).log()
        divergence = beta * (p_t * (log_t - log_m)).sum(-1) + (1 - beta) * (p_s * (log_s - log_m)).sum(-1)
    ce = F.cross_entropy(session.model(batch["input_ids"])[keep].double(), batch["labels"][keep], reduction="none")
    return (kd_ratio * divergence + (1 - kd_ratio) * ce).sum(), divergence.sum(), ce.sum()


@pytest.mark.parametrize("method", [
    {"divergence": "forward_kl", "kd_ratio": 0.5},
    {"divergence": "reverse_kl", "kd_ratio": 1.0, "temperature": 2.0},
    {"divergence": "jsd", "beta": 0.3, "kd_ratio": 0.7, "chunk_size": None},
], ids=["forward", "reverse_t2", "jsd_plain"])
def test_the_methods_loss_is_the_definition_on_transformers_teacher_logits(llama_kd, teacher, tmp_path, method):
    """Trained tokens only, the teacher as transformers computes it; loss, terms and gradients (fp32)."""
    session = compose_run(kd_config(tmp_path, teacher, method=method))
    batch = next(iter(session.train_data))
    out = session.plan.method.descriptor.loss(session, batch)
    out.loss_sum.backward()
    ours = {name: param.grad.clone() for name, param in session.model.named_parameters()}
    session.model.zero_grad(set_to_none=True)
    settings = {"kind": method["divergence"], "temperature": method.get("temperature", 1.0),
                "beta": method.get("beta", 0.5), "kd_ratio": method["kd_ratio"]}
    want, divergence, ce = reference_loss(session, batch, hf_logits(teacher, batch["input_ids"]), **settings)
    assert int(out.normaliser) == int((batch["labels"] != -100).sum()) > 0
    torch.testing.assert_close(out.loss_sum.double(), want, atol=1e-5, rtol=TOL)
    assert out.metrics["divergence"][0] == pytest.approx(float(divergence), rel=1e-5)
    assert out.metrics["ce"][0] == pytest.approx(float(ce), rel=1e-5)
    want.backward()
    for name, param in session.model.named_parameters():
        torch.testing.assert_close(ours[name], param.grad.float(), atol=1e-5, rtol=1e-5, msg=name)


def test_chunked_and_plain_paths_train_alike(llama_kd, teacher, tmp_path):
    """chunk_size 16 vs null (full logits) in the composed method: loss and every gradient, 1e-6."""
    grads, losses = {}, {}
    for name, chunk in (("chunked", 7), ("plain", None)):
        session = compose_run(kd_config(tmp_path / name, teacher, method={"chunk_size": chunk, "kd_ratio": 0.4}))
        assert session.method_state["chunked"] is (chunk is not None)
        batch = next(iter(session.train_data))
        out = session.plan.method.descriptor.loss(session, batch)
        out.loss_sum.backward()
        losses[name] = out.loss_sum.detach()
        grads[name] = {n: p.grad for n, p in session.model.named_parameters()}
    torch.testing.assert_close(losses["chunked"], losses["plain"], atol=TOL, rtol=TOL)
    for name, grad in grads["plain"].items():
        torch.testing.assert_close(grads["chunked"][name], grad, atol=TOL, rtol=TOL, msg=name)


def test_a_run_logs_what_distillation_users_watch(llama_kd, teacher, posttune_cli, tmp_path):
    config = kd_config(tmp_path, teacher, train={"max_steps": 6, "eval_every": 3, "lr": 3e-3})
    config["data"]["validation"] = dict(config["data"]["train"])
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    steps = records(config)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "divergence", "ce", "on_policy", "grad_norm", "labelled_tokens"):
        assert key in steps[0], key
    first = steps[0]
    assert first["loss"] == pytest.approx(0.5 * first["divergence"] + 0.5 * first["ce"], rel=1e-5)
    assert first["on_policy"] == 0.0
    assert {"val_loss", "val_divergence", "val_ce"} <= set(steps[2])
    assert steps[5]["val_divergence"] < steps[2]["val_divergence"]  # it learns from the teacher
    assert (Path(config["checkpoint"]["output_dir"]) / "model" / "config.json").is_file()
    batch = config["train"]["batch_size"]  # the banner says what a micro-batch is (not a placeholder)
    assert (f"made by method 'kd' (train.batch_size {batch} conversations a micro-batch, as SFT's)"
            in result.stderr + result.stdout)


def test_a_teacher_of_another_family_with_the_same_vocabulary(llama_kd, tmp_path):
    """A tiny Qwen2 teacher (transformers' own checkpoint) for a tiny Qwen3 student: the composed
    teacher is posttune-qwen's qwen2 model and its logits are transformers'."""
    qwen2 = save_hf_teacher(tmp_path / "qwen2", family="qwen2", seed=1)
    config = kd_config(tmp_path, qwen2, teacher={"family": "qwen2"}, method={"kd_ratio": 1.0})
    config["model"] = {"family": "qwen3", "size": "tiny", "build_overrides": {"vocab_size": 384}}
    session = compose_run(config)
    assert session.plan.roles["teacher"].family.descriptor.name == "qwen2"
    assert session.plan.family.descriptor.name == "qwen3"
    batch = next(iter(session.train_data))
    torch.testing.assert_close(session.models["teacher"](batch["input_ids"]), hf_logits(qwen2, batch["input_ids"]),
                               atol=1e-5, rtol=1e-5)
    out = session.plan.method.descriptor.loss(session, batch)
    want, _, _ = reference_loss(session, batch, hf_logits(qwen2, batch["input_ids"]), kd_ratio=1.0)
    torch.testing.assert_close(out.loss_sum.double(), want, atol=1e-5, rtol=TOL)


def test_a_lora_student_with_an_nf4_teacher(llama_kd, register_plugin, teacher, posttune_cli, tmp_path):
    """QLoRA: the student's base and the teacher's decoder layers both stored in NF4; the adapters train."""
    import posttune_torchao
    from torchao.quantization.quantize_.workflows import NF4Tensor

    register_plugin(posttune_torchao, distribution="posttune-torchao", version="0.1.0")
    config = kd_config(tmp_path, teacher, adapter={"rank": 4, "alpha": 8, "dropout": 0.0}, memory=["qlora_nf4"],
                       train={"max_steps": 2})
    session = compose_run(config)
    teacher_model = session.models["teacher"]
    assert isinstance(teacher_model.layers[0].attn.q_proj.weight, NF4Tensor)
    assert not isinstance(teacher_model.output.weight, NF4Tensor)
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    assert (Path(config["checkpoint"]["output_dir"]) / "adapter" / "adapter_config.json").is_file()


# ---- on-policy (GKD) ------------------------------------------------------------------------------

def test_on_policy_batches_are_the_students_own_completions_of_the_same_prompts(llama_kd, teacher, tmp_path):
    from posttune_kd.method import batches

    config = kd_config(tmp_path, teacher, method={"on_policy_fraction": 1.0, "max_new_tokens": 5})
    session = compose_run(config)
    batch = next(iter(batches(session)))
    loaded = next(iter(compose_run(config).train_data))  # the same loader position, off-policy
    assert batch["on_policy"] is True
    for original, original_labels, ids, labels in zip(loaded["input_ids"], loaded["labels"], batch["input_ids"],
                                                      batch["labels"], strict=True):
        start = int((original_labels != -100).nonzero()[0]) + 1  # the prompt: up to the first answer token
        assert torch.equal(ids[:start], original[:start])  # kept verbatim
        trained = (labels != -100).nonzero().flatten()
        assert 1 <= len(trained) <= 5 and int(trained[0]) == start - 1
        assert torch.equal(labels[trained], ids[trained + 1])  # the labels are the sampled continuation
    out = session.plan.method.descriptor.loss(session, batch)
    assert out.metrics["on_policy"] == 1.0 and out.metrics["ce"][0] > 0
    assert float(out.loss_sum) == pytest.approx(out.metrics["divergence"][0], rel=1e-6)  # divergence alone

    again = compose_run(config)
    assert torch.equal(next(iter(batches(again)))["input_ids"], batch["input_ids"])  # seeded: the same samples


@pytest.mark.parametrize("fraction", [0.0, 1.0], ids=["off_policy", "on_policy"])
def test_the_memory_estimate_counts_on_policy_rows_as_prompt_plus_completion(llama_kd, teacher, tmp_path,
                                                                               fraction):
    """`posttune plan` assumes batch x max_seq_len off-policy and batch x (max_seq_len + max_new_tokens)
    on-policy: an upper bound of the rows the student really forwards (its own completions added)."""
    from posttune.config import validate
    from posttune.estimate import estimate
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry
    from posttune_kd.method import batches

    config = kd_config(tmp_path, teacher, method={"on_policy_fraction": fraction, "max_new_tokens": 5})
    planned = estimate(resolve_plan(validate(config), get_registry()))
    rows, width = config["train"]["batch_size"], config["data"]["max_seq_len"]
    assert planned.tokens == rows * (width + (5 if fraction else 0))
    session = compose_run(config)
    batch = next(iter(batches(session)))
    assert batch["input_ids"].numel() <= planned.tokens
    if fraction:
        assert "(max_seq_len 48 + max_new_tokens 5): on-policy rows" in planned.lines()[1]
        prompts = [int((labels != -100).nonzero()[0]) + 1 for labels in next(iter(session.train_data))["labels"]]
        assert batch["input_ids"].shape[1] > max(prompts)  # the completions made the rows longer


def test_the_on_policy_share_is_lambda_and_the_same_for_every_rank(llama_kd, teacher, tmp_path):
    from posttune_kd.method import on_policy

    session = compose_run(kd_config(tmp_path, teacher, method={"on_policy_fraction": 0.3}))
    draws = [on_policy(session, position) for position in range(1, 2001)]
    assert 0.26 < sum(draws) / len(draws) < 0.34
    assert draws == [on_policy(session, position) for position in range(1, 2001)]
    session.epoch = 1
    assert [on_policy(session, position) for position in range(1, 2001)] != draws  # a new draw each epoch


def test_on_policy_max_new_tokens_past_the_students_context_is_refused_and_a_long_prompt_warned(llama_kd, teacher,
                                                                                                tmp_path, capsys):
    """As GRPO's: generation stops at max_position_embeddings, so samples past it would be cut silently. A prompt
    ends at its row's first target, so it is at most data.max_seq_len - 1 (47) tokens. Off-policy nothing is
    generated, so nothing is checked."""
    from posttune.errors import ConfigError

    student = {"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 384, "max_position_embeddings": 64}}
    with pytest.raises(ConfigError) as error:
        compose_run(kd_config(tmp_path / "a", teacher, model=student,
                              method={"on_policy_fraction": 0.5, "max_new_tokens": 64}))
    assert str(error.value) == ("config: method.max_new_tokens: 64 leaves no room for a prompt in the model's "
                                "context of 64 tokens (max_position_embeddings)")
    compose_run(kd_config(tmp_path / "b", teacher, model=student, method={"max_new_tokens": 64}))
    compose_run(kd_config(tmp_path / "c", teacher, model=student, method={"on_policy_fraction": 0.5,
                                                                          "max_new_tokens": 17}))
    assert "warning" not in capsys.readouterr().err  # 47 + 17 = 64 fits
    compose_run(kd_config(tmp_path / "d", teacher, model=student, method={"on_policy_fraction": 0.5,
                                                                          "max_new_tokens": 20}))
    assert capsys.readouterr().err.splitlines()[-1] == (
        "posttune: warning: method.max_new_tokens: a prompt of 47 tokens (data.max_seq_len - 1) leaves 17 of the 20 "
        "new tokens in the model's context of 64: longer completions are cut there")


# ---- refused before launch ------------------------------------------------------------------------

@pytest.mark.parametrize("change,message", [
    ({"teacher": {"build_overrides": {"vocab_size": 400}}},
     "models.teacher: the teacher's vocabulary has 400 tokens and the student's 384: distillation compares them token "
     "by token; if the teacher's extra rows are padding, set method.teacher_extra_vocab: drop"),
    ({"teacher": {"build_overrides": {"vocab_size": 300}}, "method": {"teacher_extra_vocab": "drop"}},
     "models.teacher: the teacher's vocabulary has 300 tokens and the policy's 384: it reads the policy's token "
     "ids (up to 383: those of the data and those the policy samples)"),
    ({"method": {"kd_ratio": 1.5}}, "method.kd_ratio: expected a value in [0, 1], got 1.5"),
    ({"method": {"temperature": 0}}, "method.temperature: expected a positive number"),
    ({"method": {"divergence": "reverse_kl", "beta": 0.9}},
     "method.beta: only divergence jsd uses it (this run: reverse_kl)"),
    ({"method": {"on_policy_fraction": 0.5, "packing": True}}, "method.packing: on-policy distillation"),
    ({"method": {"packing": True}, "data": {"group_by_length": True}}, "data.group_by_length: packed rows are"),
    ({"method": {"on_policy_fraction": 0.5, "train_on_input": True}}, "method.train_on_input: on-policy"),
    ({"memory": ["chunked_cross_entropy"]}, "memory: kd chunks its own loss"),
    ({"parallel": {"plans": ["tp"]}}, "method.chunk_size: kd's chunked loss needs each model's whole head"),
    ({"method": {"on_policy_fraction": 0.5, "engine": "biltin"}},
     "method.engine: no generation engine 'biltin' is installed (installed: builtin) (did you mean 'builtin'?)"),
])
def test_impossible_distillation_runs_are_refused_by_validate(llama_kd, register_plugin, posttune_cli, teacher,
                                                              tmp_path, change, message):
    import posttune_tp

    register_plugin(posttune_tp, distribution="posttune-tp", version="0.1.0")
    config = kd_config(tmp_path, teacher)
    for section, values in change.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    if "build_overrides" in config["teacher"]:  # a named size instead of the checkpoint: checked at validate
        config["teacher"] = {"family": "llama", "size": "tiny", "build_overrides": config["teacher"]["build_overrides"]}
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2, result.stdout
    assert result.stderr.startswith(f"posttune: error: config: {message}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_padded_teacher_is_accepted_with_drop_and_cut_to_the_students_vocabulary(llama_kd, tmp_path):
    padded = save_hf_teacher(tmp_path / "padded", vocab_size=448)
    session = compose_run(kd_config(tmp_path, padded, method={"teacher_extra_vocab": "drop", "kd_ratio": 1.0}))
    assert session.method_state["vocab"] == 384
    batch = next(iter(session.train_data))
    out = session.plan.method.descriptor.loss(session, batch)
    want, _, _ = reference_loss(session, batch, hf_logits(padded, batch["input_ids"])[..., :384], kd_ratio=1.0)
    torch.testing.assert_close(out.loss_sum.double(), want, atol=1e-5, rtol=TOL)


def test_the_teacher_section_is_required(llama_kd, posttune_cli, teacher, tmp_path):
    config = kd_config(tmp_path, teacher)
    del config["teacher"]
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2
    assert result.stderr.startswith("posttune: error: config: models.teacher: required: method 'kd' needs its teacher "
                                    "model (models.teacher.path, or models.teacher.family and models.teacher.size)")


# ---- bundled configs ------------------------------------------------------------------------------

NAMES = sorted(path.stem for path in posttune_kd.CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("name", NAMES)
def test_bundled_configs_validate_and_show_their_command(llama_kd, register_plugin, posttune_cli, name):
    import posttune_fsdp2

    register_plugin(posttune_fsdp2, distribution="posttune-fsdp2", version="0.1.0")
    check_bundled_config(posttune_cli, posttune_kd.CONFIGS, name)


def test_the_bundled_configs_cover_the_cpu_example_qwen_and_llama_lora():
    assert {"kd-tiny-reverse", "qwen2.5-1.5b-to-0.5b-kd", "llama3.1-8b-to-3.2-1b-kd-lora"} <= set(NAMES)


def test_a_teacher_with_another_tokenizer_of_the_same_size_is_refused(llama_kd, posttune_cli, teacher, tmp_path):
    """Same vocabulary size, other token ids: the size check passes, the teacher would score other words."""
    from run_support import TOKENIZER

    folder = tmp_path / "teacher"
    shutil.copytree(teacher, folder)
    shutil.copy(Path(TOKENIZER) / "tokenizer.json", folder / "tokenizer.json")
    config = kd_config(tmp_path, folder)
    assert posttune_cli("validate", str(write(tmp_path, config))).exit_code == 0  # the policy's own tokenizer
    document = json.loads((folder / "tokenizer.json").read_text())
    vocab = document["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (folder / "tokenizer.json").write_text(json.dumps(document))
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"posttune: error: config: models.teacher.path: the teacher's tokenizer is not the policy's: token id 100 is "
        f"{second!r} in {folder} and {first!r} in {TOKENIZER}; it reads the policy's token ids, so give it a model "
        "trained with the policy's tokenizer")


@pytest.mark.parametrize("chunk_size", [8, 64, None])
def test_plan_estimates_the_loss_kd_holds_both_heads_chunked_or_not(llama_kd, tmp_path, teacher, chunk_size):
    """posttune plan gave kd the generic term (three fp32 [tokens, vocab] tensors of one head) whatever chunk_size:
    far too much for a chunked loss, too little for null (both heads' full logits). Its own term (kd.md's
    measured tensor counts) applies to min(chunk_size, tokens) rows."""
    from posttune.config import validate
    from posttune.estimate import estimate
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry

    est = estimate(resolve_plan(validate(kd_config(tmp_path, teacher, method={"chunk_size": chunk_size})),
                                get_registry()))
    rows, tensors = (est.tokens, posttune_kd.FULL_TENSORS) if chunk_size is None else (
        min(chunk_size, est.tokens), posttune_kd.CHUNK_TENSORS)
    assert est.tokens > 8 and est.logits == tensors * 4 * rows * est.shape.vocab
    assert "kd" not in est.unmodelled


def test_the_banner_names_the_on_policy_share():
    from types import SimpleNamespace

    run = SimpleNamespace(train=SimpleNamespace(batch_size=4))
    assert posttune_kd.batch_text(run, posttune_kd.KDConfig(on_policy_fraction=0.5)) == (
        "train.batch_size 4 conversations a micro-batch, as SFT's; a share of 0.5 of them with the student's own "
        "completions")
