"""`posttune validate` refuses impossible memory combinations with one line naming both sides."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import yaml
from memory_support import sft_config, tiny_llama

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_memory
import posttune_sft
from posttune.errors import PosttuneError


@pytest.fixture
def plugins(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_memory, distribution="posttune-memory", version="0.1.0")
    for name in ("posttune_tp", "posttune_loss_parallel", "posttune_fsdp2"):  # their conflicts are checked too
        register_plugin(pytest.importorskip(name), distribution=name.replace("_", "-"), version="0.1.0")


def validate(posttune_cli, tmp_path, **sections):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(sft_config(tmp_path, **sections)))
    return posttune_cli("validate", str(path))


def conflicting_pairs(registry) -> list[tuple[str, str]]:
    """Each conflict a memory technique is part of, declared by either side."""
    techniques = registry.entries["memory_technique"]
    declared = {**registry.entries["parallel_plan"], **techniques}
    return sorted({(name, other) for name, item in declared.items() for other in item.descriptor.conflicts
                   if name in techniques or other in techniques})


def test_every_conflicting_pair_is_refused_naming_both(plugins, posttune_plugins, posttune_cli, tmp_path):
    pairs = conflicting_pairs(posttune_plugins.registry)
    assert ("loss_parallel", "chunked_cross_entropy") in pairs  # declared by the plan: the core names no plan
    plans = posttune_plugins.registry.entries["parallel_plan"]
    for name, other in pairs:
        listed = [p for p in (name, other) if p in plans]
        needed = [r for p in listed for r in plans[p].descriptor.requires if r not in listed]
        result = validate(posttune_cli, tmp_path, memory=[p for p in (name, other) if p not in plans],
                          parallel={"plans": needed + listed} if listed else {})
        lines = result.stderr.strip().splitlines()
        assert result.exit_code != 0, (name, other)
        assert len(lines) == 1 and name in lines[0] and other in lines[0], lines


def test_offloading_without_checkpointing_is_refused(plugins, posttune_cli, tmp_path):
    result = validate(posttune_cli, tmp_path, memory=["activation_offloading"])
    assert result.exit_code != 0
    assert "'activation_offloading' requires 'activation_checkpointing'" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only without CUDA")
def test_offloading_is_refused_on_cpu(plugins, posttune_cli, tmp_path):
    result = validate(posttune_cli, tmp_path, memory=["activation_checkpointing", "activation_offloading"])
    assert result.exit_code != 0
    assert "'activation_offloading' needs a CUDA device" in result.stderr
    from posttune_memory.offloading import apply

    with pytest.raises(PosttuneError, match="needs a CUDA device"):
        model = tiny_llama()
        apply(SimpleNamespace(model=model, device=torch.device("cpu")), SimpleNamespace(model=model))


def test_memory_options_are_checked_against_the_techniques_dataclass(plugins, posttune_cli, tmp_path):
    ok = validate(posttune_cli, tmp_path, memory=["activation_checkpointing"],
                  memory_options={"activation_checkpointing": {"every": 2}})
    assert ok.exit_code == 0, ok.stderr
    typo = validate(posttune_cli, tmp_path, memory=["activation_checkpointing"],
                    memory_options={"activation_checkpointing": {"evrey": 2}})
    assert "memory_options.activation_checkpointing.evrey: unknown key" in typo.stderr
    absent = validate(posttune_cli, tmp_path, memory=[], memory_options={"activation_checkpointing": {"every": 2}})
    assert "memory_options.activation_checkpointing: 'activation_checkpointing' is not in memory" in absent.stderr
    none = validate(posttune_cli, tmp_path, memory=["optimizer_in_backward"], train={"max_grad_norm": None},
                    memory_options={"optimizer_in_backward": {"x": 1}})
    assert "takes no options" in none.stderr
    zero = validate(posttune_cli, tmp_path, memory=["activation_checkpointing"],
                    memory_options={"activation_checkpointing": {"every": 0}})
    assert "memory_options.activation_checkpointing.every: expected a positive integer" in zero.stderr


@pytest.mark.parametrize("head", ["lm_head", "output"])
def test_chunked_loss_with_a_dropout_adapter_on_the_head_is_refused_before_launch(plugins, posttune_cli, tmp_path,
                                                                                  head):
    """It passed validate and plan, and train refused it once the model was built (naming `output` only)."""
    adapter = {"rank": 2, "alpha": 4, "dropout": 0.1, "targets": ["q_proj", head]}
    result = validate(posttune_cli, tmp_path, memory=["chunked_cross_entropy"], adapter=adapter)
    assert result.exit_code == 2 and result.stderr == (
        "posttune: error: config: adapter.dropout: chunked_cross_entropy folds the output head's adapter into one "
        "weight, which dropout (0.1) does not allow; set adapter.dropout to 0, or leave the head (lm_head) out of "
        "adapter.targets\n")
    ok = validate(posttune_cli, tmp_path, memory=["chunked_cross_entropy"], adapter={**adapter, "dropout": 0.0})
    assert ok.exit_code == 0, ok.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloading_gives_the_same_gradients_on_cuda(monkeypatch):
    from memory_support import batch, fake_session, grads, twin

    from posttune.losses import token_cross_entropy
    from posttune_memory import CheckpointingConfig
    from posttune_memory import checkpointing, offloading

    plain = tiny_llama().cuda()
    ours = twin(plain)
    session = fake_session(ours, activation_checkpointing=CheckpointingConfig())
    session.device = torch.device("cuda")
    checkpointing.apply(session, session.target)
    monkeypatch.setattr(offloading, "MIN_BYTES", 0)  # offload everything, even these tiny activations
    offloading.apply(session, session.target)
    data = {k: v.cuda() for k, v in batch().items()}
    token_cross_entropy(fake_session(plain), data)[0].backward()
    token_cross_entropy(fake_session(ours), data)[0].backward()
    for name, grad in grads(plain).items():
        torch.testing.assert_close(grads(ours)[name], grad, atol=1e-5, rtol=0, msg=name)
