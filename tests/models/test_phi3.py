"""The phi3 family (posttune-phi3) against transformers' Phi3ForCausalLM, through the real loader.

Checkpoints are written by ``save_pretrained`` and read by ``posttune.load_model``, so every test
goes through the converter that splits the fused ``qkv_proj``/``gate_up_proj`` and joins them on
save. Covered: Phi-3 (fused weights, GQA, a sliding window shorter than the sequence), Phi-4-mini
style (partial rotary 0.75, LongRoPE at lengths on both sides of the original context), greedy
generation, and LoRA/DoRA adapters written for PEFT as fused adapters.
"""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import posttune
import posttune_generate
import posttune_lora
import posttune_phi3
from posttune.adapters import load_adapter, save_adapter
from posttune_lora.layer import apply_lora
from posttune.errors import PosttuneError
from posttune_generate import generate
from posttune.testing.tiny import TINY, tiny_hf_model

TOL = 1e-4
#: weights drawn 10x wider than transformers' default, so that how positions are rotated visibly moves the logits
WIDE = {"initializer_range": 0.2}
CONFIGS = {
    # fused weights, GQA 4:2, an 8-token window over 24+ tokens
    "phi3": lambda: transformers.Phi3Config(**{**TINY, **WIDE, "sliding_window": 8}),
}
ALL_LINEAR = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
              "mlp.down_proj"]


def _phi4_mini_config() -> transformers.Phi3Config:
    return transformers.Phi3Config(**{**TINY, **WIDE, "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
                                      "max_position_embeddings": 64, "original_max_position_embeddings": 16,
                                      "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                          "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
                                                          "long_factor": [1.0, 3.0, 7.0, 11.0, 13.0, 17.0]}})


#: Phi-4-mini's shape: 3/4 of each head rotated (12 of 16 dims), LongRoPE, tied embeddings
CONFIGS["phi4_mini"] = _phi4_mini_config


def ids(seq: int) -> torch.Tensor:
    return torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def checkpoint(tmp_path):
    """``checkpoint(name)`` -> (transformers model, its save_pretrained folder)."""
    def write(name: str, **overrides):
        config = CONFIGS[name]()
        for key, value in overrides.items():
            setattr(config, key, value)
        hf_model = tiny_hf_model(config)
        hf_model.save_pretrained(tmp_path / name)
        return hf_model, tmp_path / name

    return write


def max_diff(hf_model, model, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (hf_model(tokens).logits - model(tokens)).abs().max().item()


@pytest.mark.parametrize(("name", "seq"), [("phi3", 24), ("phi4_mini", 12), ("phi4_mini", 40)],
                         ids=["phi3-fused-window", "phi4-mini-short", "phi4-mini-past-original-context"])
def test_logits_match_transformers_fp32(checkpoint, name, seq):
    hf_model, path = checkpoint(name)
    model = posttune.load_model(path, dtype="float32").eval()
    assert model.rope.head_dim == (12 if name == "phi4_mini" else 16)
    assert max_diff(hf_model, model, ids(seq)) <= TOL


def test_an_explicit_head_dim_splits_the_fused_qkv_and_matches_transformers(tmp_path):
    """Phi3Config has no head_dim field, but transformers' Phi3Attention reads one a config.json sets (here 32, not
    hidden_size / heads = 16): the fused qkv_proj's rows are split with it, and the logits match."""
    hf_model = tiny_hf_model(transformers.Phi3Config(**{**TINY, **WIDE, "head_dim": 32}))
    assert hf_model.model.layers[0].self_attn.qkv_proj.weight.shape[0] == (4 + 2 * 2) * 32
    hf_model.save_pretrained(tmp_path)
    model = posttune.load_model(tmp_path, dtype="float32").eval()
    assert model.rope.head_dim == 32
    assert max_diff(hf_model, model, ids(24)) <= TOL


def test_longrope_switches_to_the_long_factors_past_the_original_context(checkpoint):
    """Guards the LongRoPE parity test: the same first 12 tokens get other logits in a 40-token
    forward (long factors) than alone (short factors), in transformers and here alike."""
    hf_model, path = checkpoint("phi4_mini")
    model = posttune.load_model(path, dtype="float32").eval()
    long = ids(40)
    with torch.no_grad():
        alone, within = model(long[:, :12]), model(long)[:, :12]
        assert (alone - within).abs().max().item() > 1e-3
        assert (hf_model(long).logits[:, :12] - within).abs().max().item() <= TOL


def test_partial_rotary_leaves_the_unrotated_dimensions_alone():
    from posttune.modules import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(4)
    x = torch.randn(1, 2, 5, 6)
    cos, sin = rope(torch.arange(5)[None])
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert torch.equal(out[..., :4], apply_rotary(x[..., :4], cos, sin))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_save_joins_the_fused_tensors_transformers_wrote_and_transformers_loads_it(checkpoint, tmp_path, name):
    hf_model, path = checkpoint(name)
    out = posttune.save_model(posttune.load_model(path, dtype="float32"), tmp_path / "saved")
    saved, original = load_file(out / "model.safetensors"), load_file(path / "model.safetensors")
    assert sorted(saved) == sorted(original) and all(torch.equal(saved[k], original[k]) for k in original)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.config.rope_parameters == hf_model.config.rope_parameters  # partial rotary and LongRoPE
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids(40)).logits, hf_model(ids(40)).logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_transformers_token_for_token(checkpoint, name):
    """6 + 20 tokens: through phi3's 8-token window, and past phi4_mini's 16-position original context
    (LongRoPE switches factors mid-generation, for the cached keys too, as transformers does)."""
    hf_model, path = checkpoint(name)
    model = posttune.load_model(path, dtype="float32").eval()
    prompt = [5, 17, 300, 42, 7, 99]
    expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=2,
                                 pad_token_id=0)[0, len(prompt):].tolist()
    assert len(expected) == 20 and len(set(expected)) >= 8  # no eos, no loop: every step is compared
    assert generate(model, prompt, max_new_tokens=20, eos_token_ids=(2,)) == expected


def test_config_json_round_trips_through_transformers_for_every_size(tmp_path):
    family = posttune_phi3.PHI3
    long = {**family.sizes["tiny"], "max_position_embeddings": 64,
            "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6,
                             "original_max_position_embeddings": 16}}
    for size, kwargs in [*family.sizes.items(), ("tiny+longrope", long)]:
        (tmp_path / "config.json").write_text(json.dumps(family.to_hf_config(kwargs)))
        loaded = transformers.AutoConfig.from_pretrained(tmp_path)
        assert loaded.architectures == ["Phi3ForCausalLM"]
        back = family.from_hf_config(loaded.to_dict())
        assert {k: back[k] for k in kwargs} == kwargs, size


def test_old_longrope_spellings_and_the_switch_point_are_read_as_transformers_reads_them():
    base = {**_phi4_mini_config().to_dict(), "rope_parameters": None}
    factors = {"short_factor": [1.0] * 6, "long_factor": [2.0] * 6}
    su = posttune_phi3.PHI3.from_hf_config({**base, "rope_scaling": {"type": "su", **factors}})
    assert su["rope_scaling"] == {"rope_type": "longrope", **factors, "original_max_position_embeddings": 16}
    assert su["partial_rotary_factor"] == 0.75
    without = posttune_phi3.PHI3.from_hf_config({**base, "rope_scaling": {"type": "longrope", **factors},
                                                 "original_max_position_embeddings": None})
    assert without["rope_scaling"]["original_max_position_embeddings"] == 4096  # Phi3Config's default


@pytest.mark.parametrize("spelling", ["su", "yarn", "longrope"])
def test_longrope_spellings_and_a_switch_point_in_the_rope_dict_read_as_transformers_reads_them(spelling):
    """Phi3Config reads both older spellings of LongRoPE, ``su`` and ``yarn``, as ``longrope`` (the same factors here,
    not another rope type of that name), and its top-level original_max_position_embeddings (16) wins over the rope
    dict's own (8): the switch point of both libraries."""
    factors = {"short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0], "long_factor": [1.0, 3.0, 7.0, 11.0, 13.0, 17.0]}
    config = {**_phi4_mini_config().to_dict(), "rope_parameters": None,
              "rope_scaling": {"type": spelling, **factors, "original_max_position_embeddings": 8}}
    ours = posttune_phi3.PHI3.from_hf_config(config)["rope_scaling"]
    theirs = transformers.Phi3Config.from_dict(copy.deepcopy(config)).rope_parameters  # it edits the dict it reads
    assert theirs["rope_type"] == ours["rope_type"] == "longrope"
    keys = (*factors, "original_max_position_embeddings")
    assert {key: ours[key] for key in keys} == {key: theirs[key] for key in keys} == \
        {**factors, "original_max_position_embeddings": 16}


def test_longrope_factors_of_the_wrong_length_are_one_line():
    config = {**_phi4_mini_config().to_dict(), "rope_parameters": None,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 6}}
    with pytest.raises(PosttuneError) as caught:
        posttune_phi3.PHI3.from_hf_config(config)
    assert str(caught.value) == ("config.json: rope_scaling.short_factor must list 6 factors (head_dim 16 x "
                                 "partial_rotary_factor 0.75 / 2), got 8")


def test_a_fused_tensor_of_the_wrong_size_is_one_line(checkpoint):
    _, path = checkpoint("phi3")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.gate_up_proj.weight"] = torch.zeros(250, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PosttuneError) as caught:
        posttune.load_model(path)
    assert str(caught.value) == (f"{path}: checkpoint tensor 'model.layers.1.mlp.gate_up_proj.weight' has 250 rows; "
                                 "config.json's sizes give 128 + 128 = 256")


def trained_adapters(path, *, kind: str, targets: list[str], rslora: bool = False):
    """The checkpoint with adapters whose A, B (and magnitudes) are random, as after training."""
    model = posttune.load_model(path, dtype="float32")
    apply_lora(model, targets=targets, rank=2, alpha=6, kind=kind, rslora=rslora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name or "magnitude" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()


@pytest.mark.parametrize(("kind", "targets", "rslora"), [
    ("lora", ALL_LINEAR, False), ("dora", ALL_LINEAR[:3] + ALL_LINEAR[4:6], False),
    ("lora", ["attn.q_proj", "attn.v_proj"], False), ("lora", ALL_LINEAR, True)],
    ids=["lora-all-linear", "dora-fused-only", "lora-q-v-only", "rslora-all-linear"])
def test_adapters_load_in_peft_on_transformers_phi3_with_equal_logits(checkpoint, tmp_path, kind, targets, rslora):
    """q/k/v adapters of rank r become one qkv_proj adapter of rank 3r (gate/up: 2r) with a
    block-diagonal B and alpha scaled to keep each part's scale (rank-stabilised: sqrt(3) alpha, as
    alpha / sqrt(r) is the scale); a part without an adapter gets zero blocks."""
    hf_model, path = checkpoint("phi4_mini")
    model = trained_adapters(path, kind=kind, targets=targets, rslora=rslora)
    out = save_adapter(model, tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    fused = {"qkv_proj": 3} if "attn.q_proj" in targets else {}
    if "mlp.gate_proj" in targets:
        fused["gate_up_proj"] = 2
    assert config["rank_pattern"] == {name: 2 * n for name, n in fused.items()}
    assert config["alpha_pattern"] == {name: 6 * (n ** 0.5 if rslora else n) for name, n in fused.items()}
    peft_model = peft.PeftModel.from_pretrained(tiny_hf_model(hf_model.config), out).eval()
    assert max_diff(peft_model, model, ids(40)) <= TOL
    assert max_diff(hf_model, model, ids(40)) > 1e-2  # the adapters change the model
    reloaded = posttune.load_model(path, dtype="float32")
    load_adapter(reloaded, out)  # split back: each part's own rank-r adapter
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(ids(40)), model(ids(40)))
    assert reloaded.layers[0].attn.q_proj.rank == 2


def test_resuming_q_v_adapters_keeps_the_zero_k_block_out(checkpoint, tmp_path):
    _, path = checkpoint("phi3")
    model = trained_adapters(path, kind="lora", targets=["attn.q_proj", "attn.v_proj"])
    out = save_adapter(model, tmp_path / "adapter")
    resumed = posttune.load_model(path, dtype="float32")
    apply_lora(resumed, targets=["attn.q_proj", "attn.v_proj"], rank=2, alpha=6)
    load_adapter(resumed, out)
    assert not hasattr(resumed.layers[0].attn.k_proj, "lora_A")
    with torch.no_grad():
        assert torch.equal(resumed.eval()(ids(24)), model(ids(24)))


def test_fused_adapters_that_are_not_per_part_adapters_of_one_rank_are_refused_in_one_line(checkpoint, tmp_path):
    """PEFT's own dense adapter on qkv_proj loads (tests/core/test_peft_interop.py): rank r, each part its rows of B.
    Refused: one changing k on a model that adapts only q and v, a pattern giving qkv_proj neither r nor 3r, and a
    rank-3r adapter (posttune's export) that is not block-diagonal."""
    hf_model, path = checkpoint("phi3")
    config = peft.LoraConfig(r=6, lora_alpha=18, target_modules=["qkv_proj"], init_lora_weights=False)
    peft.get_peft_model(hf_model, config).save_pretrained(tmp_path / "peft")
    saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())

    def refusal(targets: list[str], rank: int, alpha: float, **overrides) -> str:
        (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({**saved, **overrides}))
        model = posttune.load_model(path, dtype="float32")
        apply_lora(model, targets=targets, rank=rank, alpha=alpha)
        with pytest.raises(PosttuneError) as caught:
            load_adapter(model, tmp_path / "peft")
        return str(caught.value)

    qkv = ["attn.q_proj", "attn.k_proj", "attn.v_proj"]
    assert refusal(["attn.q_proj", "attn.v_proj"], 6, 18).endswith(
        "'model.layers.0.self_attn.qkv_proj': the adapter changes 'layers.0.attn.k_proj', which this model does not "
        "adapt; adapt all of ['layers.0.attn.q_proj', 'layers.0.attn.k_proj', 'layers.0.attn.v_proj']")
    assert refusal(qkv, 2, 6, r=2, lora_alpha=6, rank_pattern={"qkv_proj": 4}, alpha_pattern={"qkv_proj": 12}).endswith(
        "'model.layers.0.self_attn.qkv_proj' has rank 4 and alpha 12 after rank_pattern/alpha_pattern; expected rank r "
        "and lora_alpha, or (fused from 3 layers) rank 3 x r and alpha 3 x lora_alpha (posttune's adapters share one "
        "rank and alpha)")
    assert "lora_B is not block-diagonal over" in refusal(qkv, 2, 6, r=2, lora_alpha=6, rank_pattern={"qkv_proj": 6},
                                                          alpha_pattern={"qkv_proj": 18})


@pytest.fixture
def phi3_plugins(register_plugin):
    import posttune_memory
    import posttune_sft

    register_plugin(posttune_phi3, distribution="posttune-phi3", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_memory, distribution="posttune-memory", version="0.1.0")  # phi4-mini-sft


@pytest.mark.parametrize("name", sorted(path.stem for path in posttune_phi3.CONFIGS.glob("*.yaml")))
def test_bundled_config_validates_and_shows_its_command(phi3_plugins, posttune_cli, name):
    assert (posttune_phi3.CONFIGS / f"{name}.yaml").read_text().splitlines()[0] == f"# posttune train {name}"
    result = posttune_cli("validate", name)
    assert result.exit_code == 0, result.stderr


def test_plan_counts_phi4_mini_as_released(phi3_plugins, posttune_cli):
    """Phi-4-mini-instruct has 3.84B parameters (its model card's 3.8B): tied embeddings of 200,064 x 3072,
    32 layers of GQA 24:8 with head_dim 128 and an 8192-wide MLP; rank-16 LoRA on every projection adds
    16 x (in + out) per layer: 868,352 x 32."""
    result = posttune_cli("plan", "phi4-mini-lora", "~model.path", "model.size=phi4-mini")
    assert result.exit_code == 0, result.stderr
    params = next(line for line in result.stdout.splitlines() if line.startswith("parameters: "))
    assert params == f"parameters: {3_836_021_760 + 27_787_264:,} ({27_787_264:,} trainable)", params
