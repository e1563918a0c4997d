"""SFT's ``neftune_alpha`` (NEFTune, Jain et al. 2023): uniform noise on the input embeddings while training,
drawn as transformers' own hook draws it, absent from evaluation."""

from __future__ import annotations

import pytest
import torch
from run_support import compose_run, sft_config

from posttune.errors import ConfigError
from posttune.training.trainer import train
from posttune_sft import noisy_embeddings



def test_the_noise_is_transformers_neftune_draw_for_the_same_seed():
    from transformers.integrations.neftune import neftune_post_forward_hook

    embed = torch.nn.Embedding(50, 16)
    embed.neftune_noise_alpha = 5.0
    clean = embed(torch.randint(0, 50, (3, 11)))
    torch.manual_seed(7)
    ours = noisy_embeddings(embed, (), clean, alpha=5.0)
    torch.manual_seed(7)
    theirs = neftune_post_forward_hook(embed, (), clean)
    assert torch.equal(ours, theirs)
    bound = 5.0 / (11 * 16) ** 0.5
    assert 0.9 * bound < (ours - clean).abs().max() <= bound  # the whole range is used
    embed.eval()
    assert noisy_embeddings(embed, (), clean, alpha=5.0) is None  # evaluation: the embeddings as they are


def test_a_run_trains_on_noisy_embeddings_and_evaluates_on_clean_ones(llama_sft, tmp_path):
    def first_step(**method):
        session = compose_run(sft_config(tmp_path / str(len(method)), method={"name": "sft", **method},
                                         train={"max_steps": 1, "device": "cpu", "seed": 0}))
        batch = next(iter(session.train_data))
        session.model.eval()
        with torch.no_grad():
            clean = session.model(batch["input_ids"])
        session.model.train()
        train(session)
        return clean, session

    clean, plain = first_step()
    noisy_clean, noisy = first_step(neftune_alpha=5.0)
    assert torch.equal(clean, noisy_clean)  # same weights, eval mode: no noise
    changed = [n for n, p in plain.model.named_parameters() if not torch.equal(p, noisy.model.get_parameter(n))]
    assert changed  # the noise changed what the step learned


def test_a_non_positive_alpha_is_refused_naming_the_key(llama_sft, tmp_path):
    with pytest.raises(ConfigError, match="method.neftune_alpha: expected a number > 0"):
        compose_run(sft_config(tmp_path, method={"name": "sft", "neftune_alpha": 0}))
