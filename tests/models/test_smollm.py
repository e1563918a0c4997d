"""SmolLM3 (the ``smollm3`` family of posttune-llama) and SmolLM2 (``llama``) against transformers.

SmolLM3 is Llama with no RoPE in the layers ``no_rope_layers`` marks 0 (every fourth layer in the
release); SmolLM2 is a tied ``LlamaForCausalLM`` with a ChatML template that adds a default
system turn. Checkpoints go through ``save_pretrained`` and ``posttune.load_model``.
"""

from __future__ import annotations

import json

import datasets
import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

import posttune
import posttune_llama
import posttune_generate
import posttune_lora
import posttune_sft
from posttune.config import load_config, validate
from posttune.errors import PosttuneError
from posttune_generate import generate
from posttune.plan import resolve_plan
from posttune.plugins import get_registry
from posttune.testing.tiny import TINY, tiny_hf_model, tiny_llama_config
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.training.compose import compose

TOL = 1e-4
IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))


def smollm3_config(**overrides) -> transformers.SmolLM3Config:
    """4 layers (the fourth NoPE, as transformers derives it), biases on attention and MLP; weights drawn
    10x wider than transformers' default, so that positions (RoPE or none) visibly move the logits."""
    return transformers.SmolLM3Config(**{**TINY, "num_hidden_layers": 4, "attention_bias": True, "mlp_bias": True,
                                         "initializer_range": 0.2, **overrides})


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("flags", [None, [0, 1, 1, 0]], ids=["every-fourth", "listed"])
def test_smollm3_matches_transformers_with_its_nope_layers(tmp_path, flags):
    hf_model = tiny_hf_model(smollm3_config(no_rope_layers=flags))
    hf_model.save_pretrained(tmp_path / "ckpt")
    model = posttune.load_model(tmp_path / "ckpt", dtype="float32").eval()
    assert [int(layer.attn.use_rope) for layer in model.layers] == hf_model.config.no_rope_layers
    assert (logits(model) - logits(hf_model)).abs().max().item() <= TOL


def test_the_nope_layer_changes_the_logits(tmp_path):
    """Guards the parity test: the same weights with RoPE in every layer give other logits."""
    nope, rope = tiny_hf_model(smollm3_config()), tiny_hf_model(smollm3_config(no_rope_layers=[1, 1, 1, 1]))
    assert (logits(nope) - logits(rope)).abs().max().item() > 1e-2


def test_smollm3_saves_what_transformers_loads_and_generates_alike(tmp_path):
    config = smollm3_config()
    hf_model = tiny_hf_model(config)
    hf_model.save_pretrained(tmp_path / "ckpt")
    model = posttune.load_model(tmp_path / "ckpt", dtype="float32").eval()
    out = posttune.save_model(model, tmp_path / "saved")
    saved, original = load_file(out / "model.safetensors"), load_file(tmp_path / "ckpt" / "model.safetensors")
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in original)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.config.no_rope_layers == [1, 1, 1, 0]
    assert (logits(reloaded) - logits(hf_model)).abs().max().item() <= TOL
    prompt = [5, 17, 300, 42, 7, 99]
    expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=2,
                                 pad_token_id=0)[0, len(prompt):].tolist()
    assert len(expected) == 20 and len(set(expected)) >= 8
    assert generate(model, prompt, max_new_tokens=20, eos_token_ids=(2,)) == expected


def test_smollm3_config_round_trips_through_transformers_for_every_size(tmp_path):
    family = posttune_llama.SMOLLM3
    for size, kwargs in family.sizes.items():
        (tmp_path / "config.json").write_text(json.dumps(family.to_hf_config(kwargs)))
        loaded = transformers.AutoConfig.from_pretrained(tmp_path)
        assert loaded.architectures == ["SmolLM3ForCausalLM"]
        back = family.from_hf_config(loaded.to_dict())
        assert {k: back[k] for k in kwargs} == kwargs, size


@pytest.mark.parametrize(("field", "message"), [
    ({"no_rope_layers": [1, 2, 1, 0]}, "config.json: no_rope_layers must list 0 (no RoPE) or 1 for each of the 4 "
                                       "layers, got [1, 2, 1, 0]"),
    ({"no_rope_layers": [1, 0]}, "config.json: no_rope_layers must list 0 (no RoPE) or 1 for each of the 4 layers, "
                                 "got [1, 0]"),
    ({"no_rope_layers": None, "no_rope_layer_interval": 0}, "config.json: no_rope_layer_interval must be a positive "
                                                            "integer, got 0"),
    ({"use_sliding_window": True, "sliding_window": 8}, "config.json: use_sliding_window: the smollm3 family builds "
                                                        "no sliding window (no released SmolLM3 uses one); set it to "
                                                        "false"),
])
def test_smollm3_config_errors_are_one_line(field, message):
    config = {**smollm3_config().to_dict(), **field}
    with pytest.raises(PosttuneError) as caught:
        posttune_llama.SMOLLM3.from_hf_config(config)
    assert str(caught.value) == message


def test_smollm3_defaults_are_smollm3config_s():
    config = smollm3_config().to_dict()
    for key in ("rope_parameters", "rope_theta", "rope_scaling", "no_rope_layers", "max_position_embeddings"):
        config.pop(key, None)
    kwargs = posttune_llama.SMOLLM3.from_hf_config(config)
    assert (kwargs["rope_theta"], kwargs["no_rope_layers"], kwargs["max_position_embeddings"]) == (
        2_000_000.0, (1, 1, 1, 0), 32768)


#: SmolLM2-Instruct's template: ChatML, with a default system turn when the chat has none
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATS = [[{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
          {"role": "user", "content": "And of Italy?"}, {"role": "assistant", "content": "Rome."}],
         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi."},
          {"role": "assistant", "content": "Hello!"}]]


@pytest.fixture
def smollm2(register_plugin, tmp_path, monkeypatch):
    """A tiny SmolLM2 checkpoint (tied LlamaForCausalLM) with its chat template, and an SFT session on it."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    checkpoint = tmp_path / "smollm2"
    hf_model = tiny_hf_model(tiny_llama_config(vocab_size=384, tie_word_embeddings=True))
    hf_model.save_pretrained(checkpoint)
    save_tiny_tokenizer(checkpoint, template="chatml")
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config,
                                                                  "chat_template": SMOLLM2_TEMPLATE}))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    config = {"model": {"path": str(checkpoint)}, "method": {"name": "sft"},
              "data": {"train": {"path": str(data), "format": "chat"}, "max_seq_len": 128},
              "train": {"batch_size": 1, "epochs": 1, "seed": 0}, "checkpoint": {"output_dir": str(tmp_path / "out")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    session = compose(resolve_plan(validate(load_config(tmp_path / "run.yaml", [])), get_registry()))
    return hf_model, checkpoint, session


def test_smollm2_loads_as_llama_with_tied_embeddings(smollm2):
    hf_model, checkpoint, session = smollm2
    model = posttune.load_model(checkpoint, dtype="float32").eval()
    assert session.targets["policy"].family.name == "llama"
    assert model.output.weight is model.embed.weight
    ids = IDS.clamp(max=383)
    assert (logits(model, ids) - logits(hf_model, ids)).abs().max().item() <= TOL


def test_smollm2_template_trains_only_the_assistant_turns(smollm2):
    """Labels are each assistant reply and its <|im_end|>; the default system turn the template adds
    (and every user turn) is masked, as TRL's completion-only masking builds them."""
    from test_qwen_chatml_sft import reference_labels

    _, checkpoint, session = smollm2
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.apply_chat_template(CHATS[0], tokenize=False)
    seen = set()
    for batch in session.train_data:  # the loader may shuffle: match each batch to its chat
        ids = batch["input_ids"][0].tolist()
        chat = next(index for index, c in enumerate(CHATS) if reference_labels(tokenizer, c)[0] == ids)
        seen.add(chat)
        _, labels = reference_labels(tokenizer, CHATS[chat])
        assert batch["labels"][0].tolist() == labels[1:] + [-100]  # pre-shifted by the pipeline
        targets = [t for t in labels if t != -100]
        replies = [m["content"] + "<|im_end|>" for m in CHATS[chat] if m["role"] == "assistant"]
        assert tokenizer.decode(targets) == "".join(replies)
    assert seen == {0, 1}
