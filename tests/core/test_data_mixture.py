"""Dataset mixtures: ``data.train`` as a list, each dataset read with its own format, columns, split and
system prompt, their rows concatenated and shuffled as one; errors name the entry (``data.train[1]``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import posttune_generate

import posttune_lora
import pytest
import yaml
from run_support import compose_run, preference_rows, prompt_rows, reversal_rows, sft_config
from test_data import formats, tokenizer  # noqa: F401 - the SFT data tests' fixtures: chatml, alpaca and chat

from posttune.config import validate
from posttune.config.schema import DataConfig, DatasetConfig, mixture
from posttune.config.typed import plain
from posttune.data import SampleMaker, SkipCounts, make_loader
from posttune.errors import ConfigError, PosttuneError
from posttune.plugins import new_plugin_set
from posttune.training.run_report import describe_data
from posttune_sft import sft_loader

ALPACA = [{"instruction": f"Spell {word}", "input": "", "output": " ".join(word)} for word in ("CAT", "DOG", "OWL")]
CHATS = [{"dialogue": [{"role": "user", "content": f"Reverse: {word}"}, {"role": "assistant", "content": word[::-1]}]}
         for word in ("ABC", "HELLO", "XY", "QRST")]
CHAT_COLUMNS = {"messages": "dialogue"}

pytestmark = pytest.mark.usefixtures("datasets_cache")


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def sources(tmp_path: Path) -> list[DatasetConfig]:
    """An alpaca file, and chats in a column of another name, with a system prompt."""
    return [DatasetConfig(path=write(tmp_path / "alpaca.jsonl", ALPACA), format="alpaca"),
            DatasetConfig(path=write(tmp_path / "chats.jsonl", CHATS), format="chat", column_map=CHAT_COLUMNS,
                          system_prompt="Answer in capitals.")]


def loader(dataset: DatasetConfig, tokenizer, formats, *, shuffle=False, **data):
    config = DataConfig(train=dataset, **{"max_seq_len": 96, **data})
    return sft_loader(dataset, data=config, fmt=formats[dataset.format], tokenizer=tokenizer, batch_size=64,
                      shuffle=shuffle, padding_free=False)


def samples(built) -> list[tuple[list[int], list[int]]]:
    return [(sample.ids.tolist(), sample.labels.tolist())
            for index in range(len(built.samples)) for sample in built.samples.group(index)]


def test_each_dataset_reads_with_its_own_settings_and_the_mixture_is_them_in_order(tmp_path, tokenizer, formats):
    alpaca, chats = sources(tmp_path)
    mixed = loader(mixture([alpaca, chats], "data.train"), tokenizer, formats)
    alone = [loader(source, tokenizer, formats) for source in (alpaca, chats)]
    assert samples(mixed) == samples(alone[0]) + samples(alone[1])
    # the chats got their system prompt, the alpaca rows did not
    system = tokenizer.encode("Answer in capitals.")
    texts = [ids for ids, _ in samples(mixed)]
    assert [any(ids[i:i + len(system)] == system for i in range(len(ids))) for ids in texts] == [False] * 3 + [True] * 4
    assert mixed.samples.rows.tolist() == list(range(7))  # every row of the mixture has its own number
    assert describe_data(mixed).endswith("samples, 1 batch an epoch, "
                                         f"{mixed.samples.ids.numel()} tokens from train[0] 3, train[1] 4")


def test_a_shuffled_mixture_mixes_the_datasets_and_holds_every_sample_once(tmp_path, tokenizer, formats):
    rows = [{"messages": row["messages"]} for row in reversal_rows(40)]
    first = DatasetConfig(path=write(tmp_path / "a.jsonl", rows[:20]), format="chat")
    second = DatasetConfig(path=write(tmp_path / "b.jsonl", rows[20:]), format="chat")
    make = SampleMaker(formats["chat"], tokenizer, max_seq_len=96)
    built = make_loader(mixture([first, second], "data.train"), make=make, max_seq_len=96, batch_size=8,
                        collate=lambda rows: [row[0].row for row in rows])
    seen = [row for batch in built for row in batch]
    assert sorted(seen) == list(range(40))
    assert {row < 20 for row in seen[:8]} == {True, False}  # the first batch draws from both files


def test_preference_pairs_from_a_mixture_are_each_source_s_pairs(tmp_path, tokenizer):
    from posttune.data import PairMaker

    fmt = new_plugin_set().registry.get("dataset_format", "preference")
    pairs = preference_rows(5)
    renamed = [{"question": row["prompt"], "good": row["chosen"], "bad": row["rejected"]}
               for row in preference_rows(3, 1)]
    first = DatasetConfig(path=write(tmp_path / "pairs.jsonl", pairs), format="preference")
    second = DatasetConfig(path=write(tmp_path / "renamed.jsonl", renamed), format="preference",
                           column_map={"prompt": "question", "chosen": "good", "rejected": "bad"})

    def groups(dataset):
        make = PairMaker(fmt, tokenizer, max_seq_len=96, column_map=dataset.column_map)
        built = make_loader(dataset, make=make, max_seq_len=96, batch_size=8, shuffle=False, collate=list)
        store = built.samples
        return [[(s.ids.tolist(), s.labels.tolist()) for s in store.group(i)] for i in range(len(store))]

    assert groups(mixture([first, second], "data.train")) == groups(first) + groups(second)


def test_packing_packs_the_mixture_as_one_dataset(tmp_path, tokenizer, formats):
    dataset = mixture(sources(tmp_path), "data.train")
    config = DataConfig(train=dataset, max_seq_len=96)
    packed = sft_loader(dataset, data=config, fmt=formats["alpaca"], tokenizer=tokenizer, batch_size=64,
                        shuffle=False, packing=True, padding_free=True)
    (batch,) = list(packed)
    assert int(batch["document_ids"].max()) + 1 == 7  # all seven rows, as documents of the packed rows


def test_a_bad_row_names_the_entry_and_its_own_row(tmp_path, tokenizer, formats):
    alpaca, chats = sources(tmp_path)
    write(Path(chats.path), [*CHATS[:2], {"dialogue": None}, CHATS[3]])
    with pytest.raises(PosttuneError, match=r"^data\.train\[1\]: row 2: "):
        loader(mixture([alpaca, chats], "data.train"), tokenizer, formats)
    skipped = loader(mixture([alpaca, chats], "data.train"), tokenizer, formats, skip_bad_rows=True)
    assert len(skipped.samples) == 6 and skipped.skipped.bad_rows == 1


def test_a_missing_column_names_the_entry(tmp_path, tokenizer, formats):
    alpaca, chats = sources(tmp_path)
    with pytest.raises(ConfigError, match=r"data\.train\[1\]\.column_map\.messages: .*'talk'"):
        loader(mixture([alpaca, DatasetConfig(path=chats.path, column_map={"messages": "talk"})], "data.train"),
               tokenizer, formats)


def streamed(tmp_path: Path, weights=(3.0, 1.0), count=(300, 200)) -> DatasetConfig:
    rows = [{"messages": row["messages"]} for row in reversal_rows(sum(count))]
    first = DatasetConfig(path=write(tmp_path / "a.jsonl", rows[:count[0]]), format="chat", streaming=True,
                          weight=weights[0])
    second = DatasetConfig(path=write(tmp_path / "b.jsonl", rows[count[0]:]), format="chat", streaming=True,
                           weight=weights[1], system_prompt="Reverse it.")
    return mixture([first, second], "data.train")


def drawn(dataset, tokenizer, formats, *, state=None, batches=None):
    """(which file, its own row) of each sample, in order: the file told by the system prompt."""
    make = SampleMaker(formats["chat"], tokenizer, max_seq_len=96)
    built = make_loader(dataset, make=make, max_seq_len=96, batch_size=4, seed=7,
                        collate=lambda rows: [(row[0].row, row[0].ids.tolist()) for row in rows])
    if state is not None:
        built.load_state_dict(state)
    out = []
    for batch in built:
        out.extend(batch)
        if batches is not None and len(out) == 4 * batches:
            return out, built.state_dict()
    return out, built.state_dict()


def test_a_streamed_mixture_interleaves_by_weight_each_file_in_order_and_resumes(tmp_path, tokenizer, formats):
    system = tokenizer.encode("Reverse it.")
    rows, _ = drawn(streamed(tmp_path), tokenizer, formats)
    assert [row for row, _ in rows] == list(range(len(rows)))  # numbered in the order drawn
    second = [any(ids[i:i + len(system)] == system for i in range(len(ids))) for _, ids in rows]
    # it stops when the first file runs out (300 rows at 3:1 run out long before b's 200): no file is read twice
    assert second.count(False) == 300 and 60 <= second.count(True) <= 140
    first_half = second[: len(second) // 2]
    assert 0.15 <= sum(first_half) / len(first_half) <= 0.35  # about a quarter drawn from b all along
    alone = [ids for _, ids in drawn(replace(streamed(tmp_path).sources[0], weight=None), tokenizer, formats)[0]]
    assert [ids for (_, ids), b in zip(rows, second) if not b] == alone  # a's rows in a's order
    head, state = drawn(streamed(tmp_path), tokenizer, formats, batches=5)
    tail, _ = drawn(streamed(tmp_path), tokenizer, formats, state=state)
    assert head + tail == rows  # resumed mid-stream: the same rows after as an uninterrupted read


def test_a_bad_row_of_a_streamed_mixture_names_the_entry_and_its_own_row(tmp_path, tokenizer, formats):
    dataset = streamed(tmp_path, weights=(1.0, 1.0), count=(30, 20))
    rows = [json.loads(line) for line in Path(dataset.sources[1].path).read_text().splitlines()]
    rows[3] = {"messages": [{"role": "robot", "content": "?"}]}
    write(Path(dataset.sources[1].path), rows)
    with pytest.raises(PosttuneError, match=r"^data\.train\[1\]: row 3: .*unknown role 'robot'"):
        drawn(dataset, tokenizer, formats)


def test_a_maker_that_reads_one_dataset_refuses_a_mixture_by_name(tmp_path):
    class OwnMaker:  # a method's maker that is not a SampleMaker: it has no for_source
        skipped = SkipCounts()

        def __call__(self, row, index):
            return [1, 2], [2, -100]

    with pytest.raises(PosttuneError, match=r"^data\.train: a list of datasets needs .* this method's OwnMaker "
                                            "reads one dataset"):
        make_loader(mixture(sources(tmp_path), "data.train"), make=OwnMaker(), max_seq_len=96, batch_size=8,
                    collate=list)


# -- the config ---------------------------------------------------------------------------------------------------

def run_config(tmp_path: Path, train) -> dict:
    return {"model": {"family": "llama", "size": "tiny"}, "method": "sft", "data": {"train": train}}


def test_a_list_is_a_mixture_written_back_as_the_list(tmp_path):
    entries = [{"path": "a.jsonl", "format": "alpaca"}, {"path": "b.jsonl", "system_prompt": "Be brief."}]
    config = validate(run_config(tmp_path, entries))
    train = config.data.train
    assert (train.path, train.format) == ("a.jsonl", "alpaca")  # code that reads one dataset sees the first
    assert [(s.path, s.format, s.system_prompt) for s in train.sources] == [
        ("a.jsonl", "alpaca", None), ("b.jsonl", "chat", "Be brief.")]
    written = plain(config)
    assert [entry["path"] for entry in written["data"]["train"]] == ["a.jsonl", "b.jsonl"]
    assert validate(yaml.safe_load(yaml.safe_dump(written))) == config
    one = validate(run_config(tmp_path, entries[:1])).data.train
    assert one == validate(run_config(tmp_path, entries[0])).data.train and not one.sources


@pytest.mark.parametrize("train, field, says", [
    ([], "data.train", "an empty list"),
    ([{"path": "a"}, {"path": "b", "streaming": True}], "data.train[1].streaming", "all stream, or none does"),
    ([{"path": "a", "weight": 2}, {"path": "b"}], "data.train[0].weight", "weights draw rows from streamed"),
    ([{"path": "a", "streaming": True}, {"path": "b", "streaming": True, "weight": 0}], "data.train[1].weight",
     "expected a number > 0, or null (an equal share), got 0"),
    ({"path": "a", "streaming": True, "weight": 2}, "data.train.weight", "this section names one dataset"),
    ([{"path": "a"}, {"format": "chat"}], "data.train[1].path", "required"),
    ([{"path": "a"}, {"path": "b", "colum_map": {}}], "data.train[1].colum_map", "unknown key"),
])
def test_a_bad_entry_is_named(tmp_path, train, field, says):
    with pytest.raises(ConfigError) as caught:
        validate(run_config(tmp_path, train))
    assert caught.value.path == field and says in str(caught.value)


def cli_error(posttune_cli, tmp_path: Path, config: dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune_cli("validate", str(path))
    errors = [line for line in result.stderr.splitlines() if "posttune: error:" in line]
    assert result.exit_code == 2 and len(errors) == 1, result.stderr
    return errors[0].split("posttune: error: ", 1)[1]


def with_mixture(config: dict, tmp_path: Path, second: dict) -> dict:
    config["data"]["train"] = [config["data"]["train"], second]
    return config


@pytest.fixture
def llama_sft(register_plugin):
    import posttune_llama
    import posttune_sft

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")


def test_validate_checks_every_entry_before_launch(llama_sft, posttune_cli, tmp_path):
    missing = with_mixture(sft_config(tmp_path), tmp_path, {"path": str(tmp_path / "nope.jsonl")})
    assert cli_error(posttune_cli, tmp_path, missing).startswith("config: data.train[1].path: no such file")
    pairs = write(tmp_path / "pairs.jsonl", preference_rows(4))
    kinds = with_mixture(sft_config(tmp_path), tmp_path, {"path": pairs, "format": "preference"})
    assert cli_error(posttune_cli, tmp_path, kinds) == (
        "config: data.train[1].format: 'preference' gives preference rows; method 'sft' needs conversation rows")
    alpaca = write(tmp_path / "alpaca.jsonl", ALPACA)
    unreadable = with_mixture(sft_config(tmp_path), tmp_path, {"path": alpaca, "format": "chat"})
    assert cli_error(posttune_cli, tmp_path, unreadable).startswith(
        f"config: data.train[1].format: 'chat' cannot read the first row of {alpaca}")


def test_a_mixture_trains_and_its_config_yaml_holds_the_list(llama_sft, posttune_cli, tmp_path):
    alpaca = write(tmp_path / "alpaca.jsonl", ALPACA * 2)
    config = with_mixture(sft_config(tmp_path, rows=10), tmp_path, {"path": alpaca, "format": "alpaca"})
    config["train"]["max_steps"] = 2
    session = compose_run(config)
    assert len(session.train_data.samples) == 16
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    saved = yaml.safe_load((Path(config["checkpoint"]["output_dir"]) / "config.yaml").read_text())
    assert [entry["path"] for entry in saved["data"]["train"]] == [config["data"]["train"][0]["path"], alpaca]


def test_grpo_prompts_from_a_mixture_are_numbered_apart_and_their_fields_checked(register_plugin, posttune_cli,
                                                                                 tmp_path):
    import posttune_grpo
    import posttune_llama
    from run_support import grpo_config

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_grpo, distribution="posttune-grpo", version="0.1.0")
    renamed = [{"question": row["prompt"], "solution": row["answer"]} for row in prompt_rows(6, seed=1)]
    second = {"path": write(tmp_path / "more.jsonl", renamed), "format": "prompt",
              "column_map": {"prompt": "question"}}
    config = with_mixture(grpo_config(tmp_path, rows=4), tmp_path, second)
    assert "data.train[1].column_map: {answer: <column>}" in cli_error(posttune_cli, tmp_path, config)
    second["column_map"]["answer"] = "solution"
    prompts = compose_run(config).train_data
    assert sorted(int(row) for batch in prompts for row in batch["rows"]) == list(range(10))
    for entry in config["data"]["train"]:
        entry["streaming"] = True
    streamed_prompts = compose_run(config).train_data
    batches = list(streamed_prompts)
    assert [int(row) for batch in batches for row in batch["rows"]] == list(range(sum(len(b["rows"]) for b in batches)))
    assert {answer for batch in batches for answer in batch["fields"]["answer"]} <= {
        row["answer"] for row in prompt_rows(4)} | {row["solution"] for row in renamed}
