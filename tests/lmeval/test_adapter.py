"""`posttune eval --adapter DIR` (the base found from adapter_config.json) scores what lm-eval's HFLM
scores with ``peft=DIR`` on the same base, and not what the base alone scores."""

from __future__ import annotations

import pytest
from lm_eval.api.instance import Instance
from lmeval_tasks import hflm_results, posttune_results

pytestmark = pytest.mark.slow  # two lm-eval runs; `posttune eval` indexes lm-eval's ~15k task YAMLs


@pytest.fixture(scope="module")
def adapter(tiny_checkpoint, tmp_path_factory):
    """A PEFT LoRA adapter with random (non-zero) B matrices on attention and MLP projections."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    path = tmp_path_factory.mktemp("adapter")
    peft.get_peft_model(base, config).save_pretrained(path)
    return path


def test_adapter_scores_equal_hflm_with_peft_and_differ_from_the_base(adapter, tiny_checkpoint, task_dir,
                                                                       tmp_path):
    from lm_eval.models.huggingface import HFLM

    ours = posttune_results(tmp_path, "--adapter", str(adapter), "--tasks", "tiny_mc", "--include-path",
                            str(task_dir))
    hf = hflm_results(tiny_checkpoint, task_dir, ["tiny_mc"], peft=str(adapter))
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == hf["results"]["tiny_mc"][metric]
    mine = sorted((s["doc_id"], s["filtered_resps"], s["arguments"]) for s in ours["samples"]["tiny_mc"])
    theirs = sorted((s["doc_id"], s["filtered_resps"]) for s in hf["samples"]["tiny_mc"])
    adapted = [ll for _, resps, _ in mine for ll, _ in resps]
    assert adapted == pytest.approx([ll for _, resps in theirs for ll, _ in resps], abs=1e-4)

    pairs = [tuple(args) for _, _, arguments in mine for args in arguments]
    base = HFLM(pretrained=str(tiny_checkpoint), dtype="float32", device="cpu", batch_size=4).loglikelihood(
        [Instance("loglikelihood", {}, pair, 0, ("t", i, 1)) for i, pair in enumerate(pairs)], disable_tqdm=True)
    assert max(abs(a - b) for a, (b, _) in zip(adapted, base, strict=True)) > 0.01
