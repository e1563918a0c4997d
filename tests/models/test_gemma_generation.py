"""KV-cached generation of the gemma families matches transformers' greedy decoding token for token."""

from __future__ import annotations

import pytest
import torch

from gemma_tiny import CONFIGS, native_from_hf
from posttune_generate import generate
from posttune.testing.tiny import tiny_hf_model

PROMPT = [5, 17, 300, 42, 7, 99]


# the gemma2/gemma3 configs have 8- and 5-token windows: 6 + 20 tokens decode well past them
@pytest.mark.parametrize("name", ["gemma_gqa", "gemma2_softcap_window", "gemma2_no_softcap_mqa",
                                  "gemma3_local_global_rope", "gemma3_final_softcap_untied"])
def test_greedy_matches_transformers_token_for_token(name):
    config = CONFIGS[name]()
    hf_model = tiny_hf_model(config)
    model = native_from_hf(hf_model)
    expected = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                                 eos_token_id=config.eos_token_id, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert generate(model, PROMPT, max_new_tokens=20, eos_token_ids=(config.eos_token_id,)) == expected
    assert len(expected) == 20 or expected[-1] == config.eos_token_id
