"""Property-based: no YAML document, override or value reaches the user as a traceback.

Whatever is generated, loading, overriding, validating and resolving a config either succeeds or
raises ``PosttuneError`` (the CLI's one line, exit status 2). Deterministic (``derandomize``).
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttune.config import apply_overrides, validate
from posttune.config.components import TRUST_ENV, check_components
from posttune.config.loader import load_yaml, parse_value
from posttune.errors import PosttuneError

FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
BASE = {"model": {"family": "fam", "size": "tiny"}, "method": "fsft",
        "data": {"train": {"path": "d.jsonl", "format": "chat"}}, "train": {"lr": 1e-4}}
KEYS = ["model", "model.path", "model.size", "model.family", "model.dtype", "model.build_overrides.x", "method",
        "method.name", "method.beta", "tokenizer.path", "data", "data.train", "data.train.path", "data.train.format",
        "data.train.column_map.prompt", "data.validation", "data.max_seq_len", "data.max_prompt_len",
        "data.skip_bad_rows", "train", "train.lr", "train.max_grad_norm", "train.epochs", "train.max_steps",
        "train.seed", "train.optimizer", "train.optimizer._component_", "train.optimizer.momentum",
        "train.scheduler", "train.scheduler._component_", "train.sample_prompts", "train.sample_prompts.0",
        "adapter", "adapter.rank", "adapter.dropout", "adapter.targets", "parallel.plans", "parallel.dims.tp",
        "parallel.options.fsdp", "memory", "memory.0", "memory_options.ckpt", "checkpoint.keep_last",
        "checkpoint.output_dir", "requires", "requires.0", "reference", "teacher.path", "description"]
VALUES = ["1", "0", "-1", "2.5", "1e-3", "1e400", ".inf", "-.inf", ".nan", "null", "~", "true", "no", "''", "'x'",
          "[]", "[1, 2]", "[a, b]", "{}", "{a: 1}", "{name: fsft}", "&a {x: *a}",
          "{_component_: os.system, command: ls}", "{_component_: torch.optim.SGD}", "torch.optim.AdamW", "[", "{",
          "a: b: c", "&a [*a]", "*a",
          "!!python/object/apply:os.system [ls]", "0x1F", "1_000", "2024-01-01", "\x00", "caf\xe9", "-", "=", "."]

keys = st.sampled_from(KEYS) | st.lists(st.sampled_from(["a", "0", "train", "_component_", "", " "]), min_size=1,
                                        max_size=3).map(".".join)
values = st.sampled_from(VALUES) | st.text(max_size=12)
overrides = st.lists(st.one_of(st.tuples(keys, values).map("=".join), keys.map("~".__add__), st.text(max_size=10)),
                     max_size=5)


@pytest.fixture(autouse=True)
def untrusted(monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)


def check(raw: dict) -> None:
    """What `posttune validate` does up to the plugins: validate, then every _component_ (gated, bound)."""
    check_components(validate(raw))


@FUZZ
@given(changes=overrides)
def test_overrides_then_validation_raise_only_posttune_errors(fake_plugin, changes):
    try:
        check(apply_overrides(copy.deepcopy(BASE), changes))
    except PosttuneError as exc:
        assert "\n" not in str(exc)


FREE_FORM = ["model.build_overrides.x", "method.x", "parallel.options.fsdp.x", "memory_options.ckpt.x",
             "train.optimizer.x", "train.scheduler.x", "data.train.column_map.x", "reference.build_overrides.x"]


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(FREE_FORM), values).map("=".join), min_size=1, max_size=3))
def test_any_value_in_a_free_form_field_fails_in_one_line(fake_plugin, changes):
    try:
        check(apply_overrides(copy.deepcopy(BASE), changes))
    except PosttuneError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(text=st.text(max_size=40) | st.sampled_from(VALUES))
def test_any_override_value_parses(text):
    parse_value(text)  # a string when it is not YAML: never an exception


yaml_text = st.lists(st.one_of(
    st.tuples(st.sampled_from(["model", "method", "train", "data", "  lr", "  - x", "- ", "? ", "a"]),
              st.sampled_from([":", ": ", " ", ":\n  "]), values).map("".join),
    st.text(max_size=20)), max_size=6).map("\n".join)


@FUZZ
@given(document=yaml_text | st.binary(max_size=60).map(lambda b: b.decode("latin-1")))
def test_any_yaml_document_loads_or_fails_in_one_line(fake_plugin, tmp_path_factory, document):
    path = tmp_path_factory.mktemp("yaml") / "run.yaml"
    path.write_text(document, encoding="utf-8", errors="surrogateescape")
    try:
        check({**copy.deepcopy(BASE), **load_yaml(path)})
    except PosttuneError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(document=st.binary(max_size=80))
def test_any_bytes_as_a_config_fail_in_one_line(tmp_path_factory, document):
    path = tmp_path_factory.mktemp("yaml") / "run.yaml"
    path.write_bytes(document)
    try:
        load_yaml(path)
    except PosttuneError as exc:
        assert "\n" not in str(exc)


json_like = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                         lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.sampled_from(["name", "path", "lr", "_component_", "x"]) | st.text(
                             max_size=5), inner, max_size=3), max_leaves=10)


@FUZZ
@given(section=st.sampled_from(["model", "method", "data", "train", "adapter", "parallel", "memory",
                                "memory_options", "checkpoint", "tokenizer", "reference", "requires"]),
       value=json_like)
def test_any_value_in_any_section_validates_or_fails_in_one_line(fake_plugin, section, value):
    try:
        check({**copy.deepcopy(BASE), section: value})
    except PosttuneError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(changes=overrides)
def test_the_cli_answers_any_overrides_in_one_line(fake_plugin, posttune_cli, tmp_path_factory, changes):
    path = tmp_path_factory.mktemp("cli") / "run.yaml"
    path.write_text("model: {family: fam, size: tiny}\nmethod: fsft\ndata:\n  train: {path: d.jsonl}\n")
    result = posttune_cli("validate", str(path), *changes)
    assert result.exit_code in (0, 2), result.stderr
    assert "Traceback" not in result.stderr
    if result.exit_code == 2 and result.stderr.startswith("posttune: error:"):
        assert result.stderr.count("\n") == 1
