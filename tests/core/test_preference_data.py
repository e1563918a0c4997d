"""Preference data: rows -> (chosen, rejected) samples sharing a masked prompt, batched side by side."""

from __future__ import annotations

import json

import pytest

from posttune.config.schema import DatasetConfig
from posttune.data import IGNORE_INDEX, PairMaker, make_loader, pair_batch, preference_pair
from posttune.errors import PosttuneError
from posttune.plugins import new_plugin_set
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]

pytestmark = pytest.mark.usefixtures("datasets_cache")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tiny_tokenizer(tmp_path_factory.mktemp("tok"), template="llama3"))


@pytest.fixture(scope="module")
def fmt():
    return new_plugin_set().registry.get("dataset_format", "preference")


def maker(fmt, tokenizer, **kwargs) -> PairMaker:
    return PairMaker(fmt, tokenizer, **{"max_seq_len": 256, **kwargs})


def scored(ids: list[int], labels: list[int]) -> list[int]:
    """The ids of the positions that carry a target (the response tokens after the first)."""
    return [ids[t + 1] for t, label in enumerate(labels) if label != IGNORE_INDEX]


def test_explicit_prompt_rows_mask_the_prompt_and_score_only_the_response(fmt, tokenizer):
    (chosen, chosen_labels), (rejected, rejected_labels) = maker(fmt, tokenizer)(
        {"prompt": PROMPT, "chosen": "Blue.", "rejected": "I like trains."}, 0)
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    for ids, labels, answer in ((chosen, chosen_labels, "Blue."), (rejected, rejected_labels, "I like trains.")):
        full = tokenizer.apply_chat_template([*PROMPT, {"role": "assistant", "content": answer}])
        assert ids == full and ids[: len(prompt)] == prompt
        assert all(label == IGNORE_INDEX for label in labels[: len(prompt) - 1])  # no prompt token is a target
        assert tokenizer.decode(scored(ids, labels)) == answer + "<|eot_id|>"


def test_string_prompt_is_one_user_turn_and_message_lists_work_as_responses(fmt, tokenizer):
    row = {"prompt": "Name a colour.", "chosen": [{"role": "assistant", "content": "Red."}],
           "rejected": [{"role": "assistant", "content": "No."}]}
    pair = preference_pair(row)
    assert pair.prompt == [{"role": "user", "content": "Name a colour."}]
    (ids, labels), _ = maker(fmt, tokenizer)(row, 0)
    assert tokenizer.decode(scored(ids, labels)) == "Red.<|eot_id|>"


def test_implicit_prompt_is_the_shared_start_of_both_conversations(fmt, tokenizer):
    chosen = [*PROMPT, {"role": "assistant", "content": "Green."}]
    rejected = [*PROMPT, {"role": "assistant", "content": "Seven."}]
    pair = preference_pair({"chosen": chosen, "rejected": rejected})
    assert pair.prompt == PROMPT
    assert pair.chosen == [{"role": "assistant", "content": "Green."}]
    multi_turn = [*PROMPT, {"role": "assistant", "content": "Green."}, {"role": "user", "content": "Another?"}]
    (ids, labels), _ = maker(fmt, tokenizer)({"chosen": [*multi_turn, {"role": "assistant", "content": "Red."}],
                                             "rejected": [*multi_turn, {"role": "assistant", "content": "No."}]}, 0)
    assert tokenizer.decode(scored(ids, labels)) == "Red.<|eot_id|>"  # the earlier assistant turn is prompt


def test_max_prompt_len_keeps_the_prompts_tail_and_max_seq_len_cuts_the_responses(fmt, tokenizer):
    row = {"prompt": "word " * 40, "chosen": "A long answer " * 10, "rejected": "Short."}
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "word " * 40}], add_generation_prompt=True)
    make = maker(fmt, tokenizer, max_seq_len=60, max_prompt_len=20)
    (chosen, chosen_labels), (rejected, _) = make(row, 0)
    assert chosen[:20] == prompt[-20:] and rejected[:20] == prompt[-20:]  # the tail, next to the response
    assert len(chosen) == 60 and len(rejected) < 60
    assert chosen_labels[19:59] == chosen[20:60]  # every kept response token is scored
    assert chosen_labels[-1] == IGNORE_INDEX
    assert make.skipped.truncated == 1  # a response cut to max_seq_len is counted (the prompt's cut is asked for)
    make({"prompt": "word " * 40, "chosen": "Yes.", "rejected": "No."}, 1)
    assert make.skipped.truncated == 1 and make.skipped.total == 0


def test_a_pair_left_with_nothing_to_score_is_skipped_and_counted(fmt, tokenizer):
    make = maker(fmt, tokenizer, max_seq_len=8)
    assert make({"prompt": "word " * 40, "chosen": "A", "rejected": "B"}, 3) is None
    assert make.skipped.untrained == 1


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "p", "rejected": "r"}, "row 2: missing field 'chosen'"),
    ({"prompt": "p", "chosen": "c"}, "row 2: missing field 'rejected'"),
    ({"prompt": "p", "chosen": 7, "rejected": "r"}, "row 2: field 'chosen' must be a string or a non-empty list"),
    ({"prompt": "p", "chosen": [{"role": "assistant"}], "rejected": "r"},
     "row 2: field 'chosen[0].content' must be a string"),
    ({"prompt": "p", "chosen": ["hi"], "rejected": "r"},
     "row 2: field 'chosen[0]' must be an object with 'role' and 'content'"),
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
     "row 2: no 'prompt' field, and 'chosen' and 'rejected' share no first message"),
    ({"chosen": PROMPT, "rejected": PROMPT}, "row 2: 'chosen' and 'rejected' are the same conversation"),
])
def test_bad_rows_are_named_or_skipped_and_counted(fmt, tokenizer, row, problem):
    with pytest.raises(PosttuneError) as error:
        maker(fmt, tokenizer)(row, 2)
    assert str(error.value).startswith(f"data.train: {problem}")
    assert str(error.value).endswith("(set data.skip_bad_rows: true to skip such rows)")
    lenient = maker(fmt, tokenizer, skip_bad_rows=True)
    assert lenient(row, 2) is None and lenient.skipped.bad_rows == 1


def test_pairs_batch_chosen_first_then_rejected_with_their_rows(fmt, tokenizer, tmp_path):
    rows = [{"prompt": f"Question {i}?", "chosen": "Yes." * (i + 1), "rejected": "No."} for i in range(5)]
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    make = maker(fmt, tokenizer)
    loader = make_loader(DatasetConfig(str(path), format="preference"), make=make, max_seq_len=256, batch_size=2,
                         shuffle=False, collate=lambda items: pair_batch(items, pad_id=tokenizer.pad_id))
    batches = list(loader)
    assert [b["rows"].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    first = batches[0]
    assert first["input_ids"].shape[0] == 4  # chosen 0, chosen 1, rejected 0, rejected 1
    for position, (row, side) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):
        ids, labels = make(rows[row], row)[side]
        assert first["input_ids"][position, : len(ids)].tolist() == ids
        assert first["labels"][position, : len(labels)].tolist() == labels
        assert (first["labels"][position, len(labels):] == IGNORE_INDEX).all()
    assert int(first["num_tokens"]) == sum(len(make(rows[r], r)[s][0]) for r in (0, 1) for s in (0, 1))


def test_an_empty_share_is_one_placeholder_pair_without_targets():
    batch = pair_batch([], pad_id=0)
    assert batch["rows"].tolist() == [-1]
    assert batch["input_ids"].shape[0] == 2 and (batch["labels"] == IGNORE_INDEX).all()
    assert int(batch["num_tokens"]) == 0


def test_a_template_that_renders_the_prompt_differently_before_a_response_is_a_row_error(fmt, tmp_path):
    path = save_tiny_tokenizer(tmp_path / "odd", template="llama3")
    config = json.loads((path / "tokenizer_config.json").read_text())
    # the generation prompt adds a marker that the rendered conversation does not have
    config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant (thinking): {% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(PosttuneError, match="renders the prompt differently once a response follows"):
        maker(fmt, load_tokenizer(path))({"prompt": "Hi", "chosen": "A", "rejected": "B"}, 0)


@pytest.fixture(scope="module")
def text_fmt():
    return new_plugin_set().registry.get("dataset_format", "preference_text")


def test_text_rows_need_no_chat_template_and_keep_the_prompt_tail(text_fmt, tmp_path):
    """``preference_text`` (TRL's standard rows): prompt + response encoded as text, EOS after each, the prompt
    untrained; ``max_prompt_len`` keeps its tail. Compared with TRL's DPOTrainer in tests/methods/test_dpo_trl.py."""
    plain = load_tokenizer(save_tiny_tokenizer(tmp_path / "base", template=None))
    assert plain.chat_template is None
    row = {"prompt": "Question: name a colour.\nAnswer:", "chosen": " Blue.", "rejected": " Seven."}
    (chosen_ids, chosen), (rejected_ids, rejected) = maker(text_fmt, plain)(row, 0)
    assert chosen_ids == plain.encode(row["prompt"] + row["chosen"]) + [plain.eos_id]
    assert plain.decode(scored(chosen_ids, chosen)) == " Blue." + plain.decode([plain.eos_id])
    assert plain.decode(scored(rejected_ids, rejected)) == " Seven." + plain.decode([plain.eos_id])
    (tail_ids, tail), _ = maker(text_fmt, plain, max_prompt_len=4)(row, 0)
    assert tail_ids == chosen_ids[len(chosen_ids) - len(tail_ids):] and scored(tail_ids, tail) == scored(
        chosen_ids, chosen)
    assert len(tail_ids) - len(scored(tail_ids, tail)) == 4  # the prompt's last 4 tokens


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "p", "rejected": "r"}, "row 2: missing field 'chosen'"),
    ({"prompt": [{"role": "user", "content": "p"}], "chosen": "c", "rejected": "r"},
     "row 2: field 'prompt' must be text in format preference_text, got list (message lists: use format preference)"),
    ({"chosen": "Human: hi\n\nAssistant: yes", "rejected": "Human: hi"},
     "row 2: no 'prompt' field, and 'chosen' and 'rejected' are the same text up to the end of one of them"),
    ({"chosen": "yes", "rejected": "no"},
     "row 2: no 'prompt' field, and 'chosen' and 'rejected' share no opening text to use as the prompt"),
])
def test_bad_text_rows_are_named(text_fmt, tokenizer, row, problem):
    with pytest.raises(PosttuneError) as error:
        maker(text_fmt, tokenizer)(row, 2)
    assert str(error.value).startswith(f"data.train: {problem}")


def test_an_implicit_text_prompt_is_the_shared_opening_less_its_final_space():
    from posttune.data.preference import text_pair

    pair = text_pair({"chosen": "Human: hi\n\nAssistant: Hello there", "rejected": "Human: hi\n\nAssistant: Go"})
    assert (pair.prompt, pair.chosen, pair.rejected) == ("Human: hi\n\nAssistant:", " Hello there", " Go")
