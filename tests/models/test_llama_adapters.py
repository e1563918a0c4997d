"""LoRA / DoRA on Llama against the reference implementations: transformers + peft, fp32.

Adapters get random values (a fresh adapter is the identity and would prove nothing).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

import posttune
import posttune_llama
import posttune_generate
import posttune_lora
from posttune.adapters import (
    adapted_key,
    adapter_state_dict,
    adapters_disabled,
    init_adapters,
    load_adapter,
    merge_adapters,
    save_adapter,
)
from posttune_lora.layer import apply_lora
from posttune.checkpoint import materialize as mat
from posttune.errors import PosttuneError
from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config

peft = pytest.importorskip("peft")

IDS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
FP32_TOLERANCE = 1e-4
TARGETS = list(posttune_llama.LORA_TARGETS)


@pytest.fixture(autouse=True)
def llama_plugin(register_plugin):
    register_plugin(posttune_llama, name="llama", distribution="posttune-llama")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_checkpoint(path, tiny_llama_config(tie_word_embeddings=True))
    return path


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS)
    return (out.logits if hasattr(out, "logits") else out).float()


def seeded_logits(model) -> torch.Tensor:
    torch.manual_seed(5)
    return logits(model)


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() <= FP32_TOLERANCE


def adapted_llama(checkpoint, kind: str, seed: int = 1, rslora: bool = False):
    model = posttune.load_model(checkpoint)
    apply_lora(model, targets=TARGETS, rank=4, alpha=8, dropout=0.1, kind=kind, rslora=rslora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, tensor in adapter_state_dict(model).items():
            noise = torch.randn(tensor.shape, generator=generator) * 0.1
            tensor.mul_(1.0 + noise) if key.endswith("magnitude") else tensor.copy_(noise)
    return model


@pytest.mark.parametrize(("kind", "rslora"), [("lora", False), ("dora", False), ("lora", True), ("dora", True)])
def test_peft_loads_the_saved_adapter_with_posttune_logits(checkpoint, tmp_path, kind, rslora):
    model = adapted_llama(checkpoint, kind, rslora=rslora)
    assert model.layers[0].attn.q_proj.scaling == (8 / 2 if rslora else 8 / 4)  # alpha / sqrt(r), alpha / r
    save_adapter(model, tmp_path / "adapter")
    reference = peft.PeftModel.from_pretrained(hf_model(checkpoint), tmp_path / "adapter").eval()
    assert reference.peft_config["default"].use_dora is (kind == "dora")
    assert reference.peft_config["default"].use_rslora is rslora
    adapted = logits(model)
    assert_close(adapted, logits(reference))
    model.train(), reference.train()  # dropout too: same random draws in the same order as peft
    assert_close(seeded_logits(model), seeded_logits(reference))
    assert not torch.allclose(seeded_logits(model), adapted, atol=1e-3)
    model.eval(), reference.eval()
    with adapters_disabled(model), reference.disable_adapter():
        assert (logits(model) - adapted).abs().max() > 1e-2
        assert_close(logits(model), logits(reference))
        assert_close(logits(model), logits(hf_model(checkpoint)))


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_merged_model_saves_as_a_checkpoint_transformers_loads(checkpoint, tmp_path, kind):
    model = adapted_llama(checkpoint, kind)
    adapted = logits(model)
    merge_adapters(model)
    posttune.save_model(model, tmp_path / "merged")
    assert_close(logits(hf_model(tmp_path / "merged")), adapted)


@pytest.mark.parametrize(("kind", "rslora"), [("lora", False), ("dora", False), ("lora", True)])
def test_an_adapter_trained_with_peft_loads_into_posttune(checkpoint, tmp_path, kind, rslora):
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"],
                             use_dora=kind == "dora", task_type="CAUSAL_LM", use_rslora=rslora)
    reference = peft.get_peft_model(hf_model(checkpoint), config)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    reference.save_pretrained(tmp_path / "peft")
    model = posttune.load_model(checkpoint)
    names = load_adapter(model, tmp_path / "peft")
    assert names == [f"layers.{i}.{m}" for i in range(2) for m in ("attn.q_proj", "attn.v_proj", "mlp.down_proj")]
    assert_close(logits(model), logits(reference.eval()))


@pytest.mark.parametrize(("key", "value"), [
    ("bias", "all"), ("fan_in_fan_out", True), ("lora_bias", True),
    # each loaded as a plain LoRA before, silently wrong: aLoRA is off until its invocation tokens, the trainable
    # tokens and replicated layers are weights of their own, QALoRA pools its input
    ("alora_invocation_tokens", [5, 7]), ("trainable_token_indices", [3]), ("layer_replication", [[0, 2]]),
    ("use_qalora", True)])
def test_a_peft_option_posttune_does_not_implement_is_refused_naming_it(checkpoint, tmp_path, key, value):
    out = save_adapter(adapted_llama(checkpoint, "lora"), tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, key: value}))
    refusal = f"adapter_config.json: {key}={value!r} is not supported by posttune's"
    with pytest.raises(PosttuneError, match=re.escape(refusal)):
        load_adapter(posttune.load_model(checkpoint), out)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_adapter_whose_init_changed_peft_s_base_is_refused(checkpoint, tmp_path, init):
    """PiSSA and OLoRA subtract the adapter's initial product from the base weights, and PEFT does so again at
    every load: on the checkpoint's own base the saved A and B gave logits 0.1-0.2 away from PEFT's, silently."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=init,
                             task_type="CAUSAL_LM")
    peft.get_peft_model(hf_model(checkpoint), config).save_pretrained(tmp_path / "peft")
    with pytest.raises(PosttuneError) as error:
        load_adapter(posttune.load_model(checkpoint), tmp_path / "peft")
    assert str(error.value) == (f"{tmp_path / 'peft' / 'adapter_config.json'}: init_lora_weights={init!r} is not "
                                "supported by posttune's adapters: its weights apply to a base PEFT changes when it "
                                "loads them; save it from PEFT with path_initial_model_for_weight_conversion (a "
                                "plain LoRA on the original base)")


@pytest.mark.parametrize("init", ["corda", "loftq", "lora_ga", "PiSSA_niter_4"])
def test_every_init_that_changes_the_base_is_refused(checkpoint, tmp_path, init):
    """The rest of PEFT's base-changing initialisations (their PEFT runs need data or a quantiser): the same
    refusal, named as the file spells it."""
    out = save_adapter(adapted_llama(checkpoint, "lora"), tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": init}))
    with pytest.raises(PosttuneError, match=re.escape(f"init_lora_weights={init!r} is not supported")):
        load_adapter(posttune.load_model(checkpoint), out)


def test_an_adapter_config_without_lora_alpha_scales_as_peft_defaults_it(checkpoint, tmp_path):
    """PEFT reads a missing ``lora_alpha`` as LoraConfig's default (8): posttune the same, the same logits."""
    out = save_adapter(adapted_llama(checkpoint, "lora"), tmp_path / "adapter")  # rank 4, alpha 8
    config = json.loads((out / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (out / "adapter_config.json").write_text(json.dumps(config))
    model = posttune.load_model(checkpoint)
    load_adapter(model, out)
    reference = peft.PeftModel.from_pretrained(hf_model(checkpoint), out).eval()
    assert_close(logits(model), logits(reference))


def test_an_adapter_of_the_embedding_is_refused_naming_the_layer(checkpoint, tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"], task_type="CAUSAL_LM")
    peft.get_peft_model(hf_model(checkpoint), config).save_pretrained(tmp_path / "peft")
    with pytest.raises(PosttuneError, match=r"belongs to no adapter of this model: 'model.embed_tokens' is no linear "
                                            r"layer posttune adapts \(an embedding, say; adapter_config.json "
                                            r"target_modules names it\)$"):
        load_adapter(posttune.load_model(checkpoint), tmp_path / "peft")


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_meta_build_inject_materialise_load_init(checkpoint, kind):
    loaded = posttune.load_model(checkpoint)
    family = posttune_llama.LLAMA
    kwargs = family.from_hf_config(loaded.posttune_origin.hf_config)
    model = mat.build(family.build, kwargs, torch.float32, "meta")
    apply_lora(model, targets=TARGETS, rank=4, alpha=8, kind=kind)
    mat.materialize(model, "cpu")
    state = model.state_dict()
    for key, tensor in loaded.state_dict().items():  # what the trainer's loader does, by adapted_key
        state[adapted_key(key, model)].copy_(tensor)
    mat.init_buffers(model)
    init_adapters(model)
    assert model.output.weight is model.embed.weight  # still tied
    assert_close(logits(model.eval()), logits(loaded))
