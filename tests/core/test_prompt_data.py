"""Prompt data for online methods: rendered with the generation prompt, the tail kept, the row's other
fields passed on untouched, a system prompt where asked."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from posttune.config.schema import DataConfig, DatasetConfig, TrainConfig
from posttune.data import PromptMaker, prompt_batch, prompt_loader, prompt_row
from posttune.errors import PosttuneError
from posttune.plugins import new_plugin_set
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("datasets_cache")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tiny_tokenizer(tmp_path_factory.mktemp("tok"), template="llama3"))


@pytest.fixture(scope="module")
def fmt():
    return new_plugin_set().registry.get("dataset_format", "prompt")


def test_a_prompt_is_rendered_with_the_generation_prompt_and_its_fields_kept(fmt, tokenizer):
    row = {"prompt": "What is 6 x 7?", "answer": "42", "difficulty": 3, "tags": ["math"]}
    ids, prompt = PromptMaker(fmt, tokenizer)(row, 0)
    assert ids == tokenizer.apply_chat_template([{"role": "user", "content": "What is 6 x 7?"}],
                                                add_generation_prompt=True)
    assert prompt.prompt == "What is 6 x 7?"  # what rewards see: the prompt as the row held it
    assert prompt.fields == {"answer": "42", "difficulty": 3, "tags": ["math"]}  # untouched, types kept


def test_message_prompts_and_a_configured_system_prompt(fmt, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    make = PromptMaker(fmt, tokenizer, system_prompt="Answer in one word.")
    ids, _ = make({"prompt": messages}, 0)
    expected = [{"role": "system", "content": "Answer in one word."}, *messages]
    assert ids == tokenizer.apply_chat_template(expected, add_generation_prompt=True)
    own = [{"role": "system", "content": "Be kind."}, *messages]  # a row with its own system turn keeps it
    assert make({"prompt": own}, 1)[0] == tokenizer.apply_chat_template(own, add_generation_prompt=True)


def test_max_prompt_len_keeps_the_tail_next_to_the_answer(fmt, tokenizer):
    row = {"prompt": "word " * 60}
    full, _ = PromptMaker(fmt, tokenizer)(row, 0)
    cut, _ = PromptMaker(fmt, tokenizer, max_prompt_len=16)(row, 0)
    assert len(full) > 16 and cut == full[-16:]


def test_a_tokenizer_without_a_chat_template_encodes_a_string_prompt(fmt, tmp_path):
    plain = load_tokenizer(save_tiny_tokenizer(tmp_path / "plain", template=None))
    ids, _ = PromptMaker(fmt, plain)({"prompt": "2 + 2 ="}, 0)
    assert ids == plain.encode("2 + 2 =")
    with pytest.raises(PosttuneError, match="row 0: the prompt is a list of messages but the tokenizer has no chat"):
        PromptMaker(fmt, plain)({"prompt": [{"role": "user", "content": "Hi"}]}, 0)


@pytest.mark.parametrize("row, problem", [
    ({"question": "?"}, "row 4: missing field 'prompt'"),
    ({"prompt": 7}, "row 4: field 'prompt' must be a string or a non-empty list of messages"),
])
def test_bad_rows_are_named_or_skipped_and_counted(fmt, tokenizer, row, problem):
    with pytest.raises(PosttuneError) as error:
        PromptMaker(fmt, tokenizer)(row, 4)
    assert str(error.value).startswith(f"data.train: {problem}")
    lenient = PromptMaker(fmt, tokenizer, skip_bad_rows=True)
    assert lenient(row, 4) is None and lenient.skipped.bad_rows == 1


def test_every_field_but_the_prompt_is_kept():
    assert prompt_row({"prompt": "Q", "answer": 1}).fields == {"answer": 1}


def session_for(tokenizer):
    """What ``prompt_loader`` reads of a session: the data and train settings, the format, the tokenizer."""
    config = SimpleNamespace(data=DataConfig(train=DatasetConfig("x")), train=TrainConfig(batch_size=2, seed=0))
    fmt = new_plugin_set().registry.get("dataset_format", "prompt")
    plan = SimpleNamespace(datasets={"train": SimpleNamespace(descriptor=fmt)})
    return SimpleNamespace(config=config, plan=plan, tokenizer=tokenizer, mesh=None)


def test_the_loader_shards_prompts_by_rank_and_batches_them_unpadded(tokenizer, tmp_path, monkeypatch):
    rows = [{"prompt": f"Question {i}?", "answer": str(i)} for i in range(5)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    seen = {}
    for rank in (0, 1):
        monkeypatch.setattr("posttune.training.distributed.data_rank", lambda _mesh, r=rank: (r, 2))
        loader = prompt_loader(session_for(tokenizer), DatasetConfig(str(path), format="prompt"), "train")
        batches = list(loader)
        assert len(batches) == len(loader) == 2  # 5 prompts, 2 per rank per batch: the last share is short
        seen[rank] = [int(row) for batch in batches for row in batch["rows"]]
        first = batches[0]
        assert set(first) == {"prompt_ids", "prompts", "fields", "rows"}
        assert first["fields"]["answer"] == [rows[int(r)]["answer"] for r in first["rows"]]
    assert sorted(seen[0] + seen[1]) == list(range(5)) and not set(seen[0]) & set(seen[1])


def test_an_empty_share_is_an_empty_batch():
    batch = prompt_batch([])
    assert batch["prompt_ids"] == [] and batch["rows"].tolist() == [] and batch["fields"] == {}
