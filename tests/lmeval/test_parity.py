"""`posttune eval` gives lm-eval's Hugging Face wrapper's scores on the same weights.

One `posttune eval` run and one HFLM run over three local tasks (conftest.py): multiple choice
(loglikelihood: acc, acc_norm), generation (generate_until: exact_match) and perplexity
(loglikelihood_rolling, windows of the 32-token context). Scores must be equal; per-document
log-likelihoods equal to float32 noise, and generated texts equal character for character.
"""

from __future__ import annotations

import pytest
from lmeval_tasks import hflm_results, posttune_results

TASKS = ["tiny_mc", "tiny_gen", "tiny_ppl"]

pytestmark = pytest.mark.slow  # two lm-eval runs; `posttune eval` indexes lm-eval's ~15k task YAMLs


@pytest.fixture(scope="module")
def both(tiny_checkpoint, task_dir, tmp_path_factory):
    ours = posttune_results(tmp_path_factory.mktemp("eval"), "--model", str(tiny_checkpoint), "--tasks",
                            ",".join(TASKS), "--include-path", str(task_dir), "--batch-size", "3")
    return ours, hflm_results(tiny_checkpoint, task_dir, TASKS)


def by_doc(results: dict, task: str) -> dict[int, dict]:
    return {sample["doc_id"]: sample for sample in results["samples"][task]}


def test_multiple_choice_acc_and_acc_norm_equal_hflm(both):
    ours, hf = both
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == hf["results"]["tiny_mc"][metric]
    assert ours["results"]["tiny_mc"]["sample_len"] == 10


def test_each_choice_loglikelihood_equals_hflm(both):
    ours, hf = both
    mine, theirs = by_doc(ours, "tiny_mc"), by_doc(hf, "tiny_mc")
    assert mine.keys() == theirs.keys()
    for doc_id, sample in mine.items():
        expected = theirs[doc_id]["filtered_resps"]
        assert [greedy for _, greedy in sample["filtered_resps"]] == [greedy for _, greedy in expected]
        assert [ll for ll, _ in sample["filtered_resps"]] == pytest.approx([ll for ll, _ in expected], abs=1e-4)
    spread = {round(ll, 3) for sample in mine.values() for ll, _ in sample["filtered_resps"]}
    assert len(spread) > 10  # real, distinct scores: a constant would not tell wrappers apart


def test_generation_exact_match_equals_hflm_and_the_constructed_half(both):
    ours, hf = both
    assert ours["results"]["tiny_gen"]["exact_match,none"] == 0.5  # half the targets are transformers' greedy answers
    assert hf["results"]["tiny_gen"]["exact_match,none"] == 0.5


def test_generated_texts_equal_hflm(both):
    ours, hf = both
    mine, theirs = by_doc(ours, "tiny_gen"), by_doc(hf, "tiny_gen")
    assert {d: s["filtered_resps"] for d, s in mine.items()} == {d: s["filtered_resps"] for d, s in theirs.items()}
    assert any(s["filtered_resps"][0] for s in mine.values())  # not all empty


def test_rolling_perplexity_equals_hflm_over_several_windows(both, tiny_checkpoint):
    from transformers import AutoTokenizer

    ours, hf = both
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert max(len(tokenizer.encode(s["doc"]["text"])) for s in ours["samples"]["tiny_ppl"]) > 2 * 32
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["tiny_ppl"][metric] == pytest.approx(hf["results"]["tiny_ppl"][metric], rel=1e-5)


def test_results_json_carries_the_config_and_samples(both):
    ours, _ = both
    assert set(ours["results"]) == set(TASKS)
    assert ours["configs"]["tiny_gen"]["generation_kwargs"]["max_gen_toks"] == 20
    assert len(ours["samples"]["tiny_mc"]) == 10
