"""Property-based: no row of any built-in format, and no bytes in a data file, end in a traceback.

Every row either becomes samples or is refused with a ``PosttuneError`` naming it. Deterministic
(``derandomize``) and small, so the suite stays fast and a failure reproduces.
"""

from __future__ import annotations

import json

import datasets
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttune.config.schema import DatasetConfig
from posttune.data.loading import load_rows
from posttune.data.local_files import guarded
from posttune.data.preference import PairMaker
from posttune.data.prompts import PromptMaker
from posttune.data.samples import SampleMaker, SkipCounts
from posttune.errors import PosttuneError
from posttune.plugins import new_plugin_set
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FIELDS = ["instruction", "input", "output", "messages", "conversations", "text", "prompt", "chosen", "rejected",
          "answer", "completion", "role", "content", "from", "value"]
ROLES = ["system", "user", "assistant", "tool", "human", "gpt", "observation", "function_call", "bot", ""]

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
turn = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(ROLES) | json_values, "content": st.text(max_size=30) | json_values,
    "from": st.sampled_from(ROLES) | json_values, "value": st.text(max_size=30) | json_values})
turns = st.lists(turn | json_values, max_size=5)
field_value = st.text(max_size=40) | turns | json_values
rows = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), field_value, max_size=6)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """One tokenizer with a chat template, one without (plain-text prompts)."""
    folder = tmp_path_factory.mktemp("tok")
    chat = load_tokenizer(save_tiny_tokenizer(folder / "chat", template="chatml"))
    plain = load_tokenizer(save_tiny_tokenizer(folder / "plain", template="chatml"))
    plain.chat_template = None
    return {"chat": chat, "plain": plain}


@pytest.fixture(scope="module")
def formats():
    return {item.descriptor.name: item.descriptor for item in new_plugin_set().registry.items("dataset_format")}


def maker(kind: str, fmt, tokenizer, skip: bool, system_prompt: str | None):
    common = dict(skip_bad_rows=skip, system_prompt=system_prompt)
    if kind == "preference":
        return PairMaker(fmt, tokenizer, max_seq_len=48, max_prompt_len=12, **common)
    if kind == "prompt":
        return PromptMaker(fmt, tokenizer, max_prompt_len=12, **common)
    return SampleMaker(fmt, tokenizer, max_seq_len=48, train_on_input=skip, **common)


@pytest.mark.parametrize("name", ["alpaca", "chat", "text", "completion", "preference", "preference_text", "prompt"])
@pytest.mark.parametrize("template", ["chat", "plain"])
@FUZZ
@given(row=rows, skip=st.booleans(), system_prompt=st.none() | st.text(max_size=10))
def test_any_row_becomes_samples_or_a_one_line_error(formats, tokenizers, name, template, row, skip, system_prompt):
    fmt = formats[name]
    make = maker(fmt.kind, fmt, tokenizers[template], skip, system_prompt)
    try:
        make(row, 7)
    except PosttuneError as exc:
        assert "\n" not in str(exc)
        assert not skip or "gives chat messages" in str(exc)  # skipping rows: only a misconfiguration raises


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


row_lines = rows.map(lambda r: json.dumps(r).encode())
good_rows = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": st.text(
    max_size=10)}), min_size=1, max_size=3).map(lambda m: json.dumps({"messages": m}).encode())
lines = st.lists(st.one_of(good_rows, good_rows, row_lines, st.text(max_size=20).map(str.encode),
                           st.binary(max_size=20), json_values.map(lambda v: json.dumps(v).encode())),
                 min_size=1, max_size=5)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".txt", ".csv"])
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(content=lines, skip=st.booleans())
def test_any_bytes_in_a_data_file_load_or_fail_in_one_line(tmp_path_factory, cache, formats, tokenizers, suffix,
                                                           content, skip):
    folder = tmp_path_factory.mktemp("data")
    path = folder / f"rows{suffix}"
    path.write_bytes(b"\n".join(content))
    skipped = SkipCounts()
    make = maker("sft", formats["chat"], tokenizers["chat"], True, None)
    try:
        loaded = load_rows(DatasetConfig(str(path)), skip_bad_rows=skip, skipped=skipped)
        for index, row in enumerate(guarded(loaded, "data.train")):
            make(row, index)
    except PosttuneError as exc:
        assert "\n" not in str(exc)
