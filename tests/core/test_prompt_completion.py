"""The ``completion`` format: TRL's prompt-completion rows, trained on the completion only. Text rows are encoded
as TRL's SFT trainer encodes them (prompt + completion, then EOS; the tokens shared with the prompt alone
untrained), message rows rendered by the chat template as transformers renders them (the prompt with the
generation prompt untrained); both compared with transformers' tokenizer on the same files."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from posttune.data import SampleMaker
from posttune.plugins import new_plugin_set
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tok"), template="chatml")


def maker(folder, fmt: str = "completion", **kwargs) -> SampleMaker:
    return SampleMaker(new_plugin_set().registry.get("dataset_format", fmt), load_tokenizer(folder), max_seq_len=512,
                       **kwargs)


def trained(ids: list[int], labels: list[int]) -> list[int]:
    """The trained tokens (labels are pre-shifted: label t is the target of position t)."""
    return [ids[t + 1] for t in range(len(ids) - 1) if labels[t] != -100]


def test_text_rows_train_the_completion_and_eos_as_trls_sft_encodes_them(folder):
    theirs = AutoTokenizer.from_pretrained(folder)
    row = {"prompt": "Reverse: ABC\nAnswer:", "completion": " CBA"}
    ids, labels = maker(folder)(row, 0)
    expected = theirs(row["prompt"] + row["completion"])["input_ids"] + [theirs.eos_token_id]
    prompt = len(theirs(row["prompt"])["input_ids"])
    assert ids == expected and trained(ids, labels) == expected[prompt:]
    ids, labels = maker(folder, train_on_input=True)(row, 0)
    assert trained(ids, labels) == expected[1:]  # every token but the first, which nothing predicts


def test_message_rows_train_the_completions_turns_as_transformers_renders_them(folder):
    theirs = AutoTokenizer.from_pretrained(folder)
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
              {"role": "user", "content": "Reverse ABC"}]  # the prompt's own assistant turn does not train
    completion = [{"role": "assistant", "content": "CBA"}]
    ids, labels = maker(folder)({"prompt": prompt, "completion": completion}, 0)
    whole = theirs.apply_chat_template(prompt + completion, return_dict=False)
    start = len(theirs.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False))
    assert ids == whole
    tokens = trained(ids, labels)  # the completion's turn right after the generation prompt, and its end token
    assert tokens == whole[start:start + len(tokens)] and theirs.decode(tokens) == "CBA<|im_end|>"
    as_chat = maker(folder, "chat")({"messages": prompt + completion}, 0)  # a chat row trains every assistant turn
    assert "Hello" in theirs.decode(trained(*as_chat))


@pytest.mark.parametrize(("prompt", "completion", "expected"), [
    ("Hello, ", "world!", " world!<|im_end|>"), ("Q ", "a", " a<|im_end|>"), ("Answer:", " Paris", " Paris<|im_end|>")])
def test_a_token_merged_across_the_boundary_trains_with_the_completion_as_in_trl(folder, prompt, completion, expected):
    """"Hello, " + "world!" encodes " world": counting the prompt's own tokens would leave it (and with a one-word
    completion, every word) untrained. TRL 1.16 trains from where the two encodings part; so does posttune."""
    trl_sft = pytest.importorskip("trl.trainer.sft_trainer")
    theirs = AutoTokenizer.from_pretrained(folder)
    ids, labels = maker(folder)({"prompt": prompt, "completion": completion}, 0)
    whole = theirs(prompt + completion)["input_ids"] + [theirs.eos_token_id]
    start = trl_sft.common_prefix_length(theirs(prompt)["input_ids"], whole)
    assert ids == whole and trained(ids, labels) == whole[start:]
    assert theirs.decode(trained(ids, labels)) == expected


@pytest.mark.parametrize(("row", "problem"), [
    ({"prompt": "Q", "completion": [{"role": "assistant", "content": "A"}]},
     "fields 'prompt' and 'completion' must both be text or both be lists of messages"),
    ({"prompt": "Q"}, "missing field 'completion'"),
])
def test_a_bad_row_names_the_field(folder, row, problem):
    with pytest.raises(Exception, match=f"row 0: {problem}"):
        maker(folder, where="data.train")(row, 0)
