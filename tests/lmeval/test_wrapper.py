"""PosttuneLM request by request against lm-eval's HFLM on the same checkpoint, without a task run:
stop strings per request, several generation settings in one call, empty contexts, batch sizes."""

from __future__ import annotations

import pytest
from lm_eval.api.instance import Instance
from lmeval_tasks import CHOICES, CONTEXT, MAX_GEN, QUESTIONS, greedy_answers


@pytest.fixture(scope="module")
def wrappers(tiny_checkpoint):
    from lm_eval.models.huggingface import HFLM
    from posttune.plugin import load_model, load_tokenizer
    from posttune_lmeval.model import PosttuneLM

    ours = PosttuneLM(load_model(tiny_checkpoint, dtype="float32"), load_tokenizer(tiny_checkpoint), batch_size=3)
    hf = HFLM(pretrained=str(tiny_checkpoint), dtype="float32", device="cpu", batch_size=3)
    return ours, hf


def requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=args, idx=0, metadata=("t", i, 1))
            for i, args in enumerate(arguments)]


def test_context_length_comes_from_config_json(wrappers):
    ours, hf = wrappers
    assert ours.max_length == hf.max_length == CONTEXT


def test_each_request_stops_at_its_own_stop_string(wrappers, tiny_checkpoint):
    """Stop strings taken from inside transformers' own greedy answers (the middle of some, the end of
    others: past the first 16-token generation chunk): each answer is cut right there, with two
    generation settings in one call."""
    ours, hf = wrappers
    full = greedy_answers(tiny_checkpoint, QUESTIONS, "\x00never")
    stops = [(answer[len(answer) // 2:len(answer) // 2 + 2] if i % 2 else answer[-2:]) or "\n"
             for i, answer in enumerate(full)]
    kwargs = [{"until": [stop], "max_gen_toks": MAX_GEN if i % 3 else 12, "do_sample": False}
              for i, stop in enumerate(stops)]
    batch = requests("generate_until", list(zip(QUESTIONS, kwargs, strict=True)))
    mine = ours.generate_until(batch, disable_tqdm=True)
    assert mine == hf.generate_until(batch, disable_tqdm=True)
    cut = [answer.split(stop)[0] for answer, stop in zip(full, stops, strict=True)]
    assert [m for i, m in enumerate(mine) if i % 3] == [c for i, c in enumerate(cut) if i % 3]
    assert sum(len(c) < len(a) for c, a in zip(cut, full, strict=True)) >= 5  # the stops really cut


def test_loglikelihoods_equal_hflm_with_empty_contexts_and_long_inputs(wrappers):
    ours, hf = wrappers
    pairs = [("Question: " + q + "\nAnswer:", c) for q in QUESTIONS[:4] for c in CHOICES]
    pairs += [("", " hello world"), ("", "The quick brown fox"), (QUESTIONS[5] * 2, " the data")]  # > 32 tokens
    batch = requests("loglikelihood", pairs)
    mine, theirs = ours.loglikelihood(batch, disable_tqdm=True), hf.loglikelihood(batch, disable_tqdm=True)
    assert [g for _, g in mine] == [g for _, g in theirs]
    assert [ll for ll, _ in mine] == pytest.approx([ll for ll, _ in theirs], abs=1e-4)


def test_scores_do_not_depend_on_the_batch_size(wrappers):
    from posttune_lmeval.model import PosttuneLM

    ours, _ = wrappers
    pairs = [("Question: " + q + "\nAnswer:", c) for q in QUESTIONS for c in CHOICES]
    one = PosttuneLM(ours.model, ours.tok, batch_size=1).loglikelihood(requests("loglikelihood", pairs), True)
    many = ours.loglikelihood(requests("loglikelihood", pairs), disable_tqdm=True)
    assert [ll for ll, _ in one] == pytest.approx([ll for ll, _ in many], abs=1e-5)


def test_sampling_is_reproducible_from_the_seed(wrappers):
    from posttune_lmeval.model import PosttuneLM

    ours, _ = wrappers
    options = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": True, "temperature": 1.0}
    batch = requests("generate_until", [(q, options) for q in QUESTIONS[:4]])
    first = PosttuneLM(ours.model, ours.tok, seed=5).generate_until(batch, disable_tqdm=True)
    assert PosttuneLM(ours.model, ours.tok, seed=5).generate_until(batch, disable_tqdm=True) == first
    assert PosttuneLM(ours.model, ours.tok, seed=6).generate_until(batch, disable_tqdm=True) != first
