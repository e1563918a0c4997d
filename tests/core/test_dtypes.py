"""One dtype vocabulary: configs and commands take the short names and torch's alike."""

from __future__ import annotations

import pytest
import torch
from posttune.checkpoint.materialize import resolve_dtype
from posttune.config.schema import Dtype
from posttune.config.typed import convert
from posttune.errors import ConfigError


@pytest.mark.parametrize(("spelling", "short", "dtype"), [
    ("bf16", "bf16", torch.bfloat16), ("bfloat16", "bf16", torch.bfloat16), ("torch.bfloat16", "bf16", torch.bfloat16),
    ("fp32", "fp32", torch.float32), ("float32", "fp32", torch.float32),
    ("fp16", "fp16", torch.float16), ("float16", "fp16", torch.float16), ("half", "fp16", torch.float16),
])
def test_every_spelling_means_one_dtype_in_configs_and_commands(spelling, short, dtype):
    assert convert(Dtype, spelling, "model.dtype") == short  # a config stores the short name
    assert resolve_dtype(spelling) is dtype  # what generate --dtype and load_model(dtype=) build in


def test_an_unknown_dtype_is_still_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"model\.dtype: expected one of 'fp32', 'bf16', 'fp16' \(or torch's names: "
                                          r"'bfloat16', \.\.\.\), got 'bf17'"):
        convert(Dtype, "bf17", "model.dtype")


def test_a_torch_name_cut_short_is_pointed_to_the_torch_name():
    """'bfloat' got no hint (the short names alone are too far from it); the hint chooses among the short names
    and torch's full ones (not the aliases: 'float', fp32's, is nearer to 'bfloat' than 'bfloat16')."""
    with pytest.raises(ConfigError, match=r"got 'bfloat' \(did you mean 'bfloat16'\?\)$"):
        convert(Dtype, "bfloat", "model.dtype")


def test_an_optional_dtype_s_typo_gets_the_hint_too():
    """``adapter.dtype`` (a dtype or null) went through the union's message, without the hint."""
    from posttune.config.schema import AdapterConfig
    from posttune.config.typed import from_dict

    with pytest.raises(ConfigError, match=r"^config: adapter.dtype: expected one of 'fp32', 'bf16', 'fp16' or null, "
                                          r"got 'bfloat' \(did you mean 'bfloat16'\?\)$"):
        from_dict(AdapterConfig, {"dtype": "bfloat"}, "adapter")
    assert from_dict(AdapterConfig, {"dtype": "float32"}, "adapter").dtype == "fp32"


def test_a_number_that_pyyaml_read_as_text_is_explained():
    """PyYAML (YAML 1.1) reads 1e-3 as a string; a mapping passed to posttune.train carried it (a sweep trial)."""
    from posttune.config.schema import TrainConfig
    from posttune.config.typed import from_dict

    with pytest.raises(ConfigError, match=r"^config: train.lr: expected a number, got '1e-3' \(text: PyYAML's "
                                          r"safe_load reads 1e-3 so; write 1.0e-3, or give the file's path\)$"):
        from_dict(TrainConfig, {"lr": "1e-3"}, "train")
