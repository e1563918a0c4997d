"""A resume refuses a config that would read its checkpoint as another run's: another base model
(family, architecture, weight shapes), method, adapter, optimizer or model role; the documented safe changes
(max_steps, cadence, logging, the learning rate) still resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fault_support import tree_digest
from run_support import TOKENIZER, preference_rows, save_hf_teacher, sft_config, write

from posttune.testing import run_cli  # the installed plugins: this file mixes methods and families


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {family: save_hf_teacher(root / family, family=family) for family in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, bases) -> dict[str, dict]:
    """Finished two-step runs, each with a checkpoint at step 2: full and LoRA SFT on a Llama base,
    LoRA DPO (reference: the policy with adapters off)."""
    root = tmp_path_factory.mktemp("runs")
    base = {"model": {"path": str(bases["llama"])}, "tokenizer": {"path": TOKENIZER},
            "train": {"max_steps": 2, "lr": 1e-3, "seed": 0, "device": "cpu"}, "checkpoint": {"save_every": 2}}
    lora = {"rank": 4, "alpha": 8}
    made = {"full": sft_config(root / "full", **base), "lora": sft_config(root / "lora", **base, adapter=lora)}
    dpo = sft_config(root / "dpo", **base, adapter=lora, method={"name": "dpo", "beta": 0.5})
    rows = root / "dpo" / "pairs.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in preference_rows(8)))
    dpo["data"]["train"] = {"path": str(rows), "format": "preference"}
    made["dpo"] = dpo
    for name, config in made.items():
        del config["model"]["family"], config["model"]["size"], config["model"]["build_overrides"]
        result = run_cli("train", str(write(root / name, config)))
        assert result.exit_code == 0, result.stderr
    return made


def refused(result) -> str:
    assert result.exit_code == 2, result.stdout[-2000:]
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip()


def outcome(tmp_path: Path, config: dict, *overrides: str) -> list[str]:
    """What `validate` and `train` say of the resumed config; the run's folder is left as it was."""
    out = Path(config["checkpoint"]["output_dir"])
    before = {k: v for k, v in tree_digest(out).items() if k != ".posttune.lock"}
    path = write(tmp_path, config)
    lines = [refused(run_cli(command, str(path), "checkpoint.resume=latest", *overrides))
             for command in ("validate", "train")]
    assert {k: v for k, v in tree_digest(out).items() if k != ".posttune.lock"} == before
    assert lines[0] == lines[1]
    return lines


def step2(config: dict) -> str:
    return f"{config['checkpoint']['output_dir']}/checkpoints/step-00000002"


HINT = ("; a resume continues the run that wrote it: to start from its weights, begin a new run in another "
        "checkpoint.output_dir (model.path or adapter.init_from set to its model/)")


def test_a_lora_checkpoint_resumed_on_a_base_of_another_family_is_refused(runs, bases, tmp_path):
    config = runs["lora"]
    line = outcome(tmp_path, config, f"model.path={bases['qwen2']}")[0]
    assert line == (f"posttune: error: config: model: cannot resume {step2(config)}: its policy model is family "
                    "'llama' (LlamaForCausalLM), this run's is family 'qwen2' (Qwen2ForCausalLM)" + HINT)


def test_a_base_of_other_shapes_is_refused_naming_both_values(runs, tmp_path):
    config = runs["full"]
    line = outcome(tmp_path, config, "model.build_overrides.intermediate_size=256")[0]
    assert line == (f"posttune: error: config: model: cannot resume {step2(config)}: its policy model has "
                    "intermediate_size 192, this run's has 256" + HINT)


@pytest.mark.parametrize("method", ["kd", "dpo"])
def test_an_sft_checkpoint_resumed_as_another_method_is_refused(runs, bases, tmp_path, method):
    config = json.loads(json.dumps(runs["full"]))
    if method == "kd":
        config["method"] = {"name": "kd", "chunk_size": 16}
        config["teacher"] = {"path": str(bases["llama"])}
    else:
        config["method"] = {"name": "dpo", "beta": 0.5}
        config["data"]["train"] = runs["dpo"]["data"]["train"]
    line = outcome(tmp_path, config)[0]
    assert line.startswith(f"posttune: error: config: method: cannot resume {step2(config)}: it was trained by "
                           f"method 'sft', this run's method is '{method}'; ")


def test_removing_the_adapter_says_so(runs, tmp_path):
    config = runs["lora"]
    line = outcome(tmp_path, config, "~adapter")[0]
    assert line == (f"posttune: error: config: adapter: cannot resume {step2(config)}: it trained a lora adapter "
                    "(rank 4, alpha 8) and this run has no adapter: section (keep it to continue; posttune merge "
                    "folds the adapter into its base)" + HINT)
    assert "config.json" not in line


@pytest.mark.parametrize(("overrides", "field", "words"), [
    (["adapter.rank=8"], "adapter.rank", "its adapter has rank 4, this run's 8"),
    (["adapter.alpha=16"], "adapter.alpha", "its adapter has alpha 8, this run's 16"),
    (["adapter.kind=dora"], "adapter.kind", 'its adapter has kind "lora", this run\'s "dora"'),
    (["adapter.targets=[q_proj]"], "adapter.targets", "its adapter has targets [\"layers.*.attn.k_proj\", "),
    (["adapter.loraplus_lr_ratio=16"], "adapter.loraplus_lr_ratio",
     "its adapter has loraplus_lr_ratio null, this run's 16"),
    (["adapter.rslora=true"], "adapter.rslora", "its adapter has rslora false, this run's true"),
    # the optimizer state: validate said valid, then SGD's step failed on AdamW's state (KeyError: 'momentum')
    (["train.optimizer=sgd"], "train.optimizer", "its optimizer state is adamw's, this run's optimizer is sgd"),
    (["memory=[adamw_8bit]"], "train.optimizer", "its optimizer state is adamw's, this run's optimizer is adamw + "
                                                 "adamw_8bit"),
])
def test_another_adapter_is_refused(runs, tmp_path, overrides, field, words):
    line = outcome(tmp_path, runs["lora"], *overrides)[0]
    assert line.startswith(f"posttune: error: config: {field}: cannot resume ") and words in line, line


def test_adding_an_adapter_to_a_full_checkpoint_is_refused(runs, tmp_path):
    line = outcome(tmp_path, runs["full"], "adapter.rank=4", "adapter.alpha=8")[0]
    assert "config: adapter: cannot resume" in line
    assert "it is full fine-tuning (no adapter), this run trains a lora adapter" in line


def test_a_sharded_checkpoint_points_at_the_way_to_its_weights(runs, tmp_path):
    """A sharded (FSDP2, TP) checkpoint has no model/ to start a new run from: the hint names the recipe that
    writes one. (The full run's checkpoint with a sharded/ folder added: what `validate` reads.)"""
    import shutil

    config = json.loads(json.dumps(runs["full"]))
    out = tmp_path / "out"
    shutil.copytree(config["checkpoint"]["output_dir"], out)
    (out / "checkpoints" / "step-00000002" / "sharded").mkdir()
    config["checkpoint"]["output_dir"] = str(out)
    result = run_cli("validate", str(write(tmp_path, config)), "checkpoint.resume=latest", "adapter.rank=4",
                     "adapter.alpha=8")
    assert refused(result).endswith("begin a new run in another checkpoint.output_dir (its shards written as a "
                                    "model first, as docs/parallel.md shows)")


def test_a_changed_model_role_is_refused(runs, bases, tmp_path):
    config = json.loads(json.dumps(runs["dpo"]))
    config["models"] = {"reference": {"path": str(bases["llama"])}}  # a frozen copy, not the policy without adapters
    line = outcome(tmp_path, config)[0]
    assert line.startswith(f"posttune: error: config: models.reference: cannot resume {step2(config)}: its reference "
                           "model is the policy with its adapters disabled, this run's is family 'llama' "
                           "(LlamaForCausalLM)")


def test_a_lora_dpo_run_resumes_with_its_adapters_off_reference(runs, tmp_path):
    """The same roles (the reference is the policy with adapters off on both sides) resume."""
    config = json.loads(json.dumps(runs["dpo"]))
    config["checkpoint"]["output_dir"] = str(tmp_path / "copy")
    import shutil

    shutil.copytree(runs["dpo"]["checkpoint"]["output_dir"], tmp_path / "copy")
    result = run_cli("train", str(write(tmp_path, config)), "checkpoint.resume=latest", "train.max_steps=3")
    assert result.exit_code == 0, result.stderr
    assert "resumed from step 2" in result.stdout


def test_the_documented_safe_changes_still_resume(runs, tmp_path):
    config = json.loads(json.dumps(runs["lora"]))
    config["checkpoint"]["output_dir"] = str(tmp_path / "copy")
    import shutil

    shutil.copytree(runs["lora"]["checkpoint"]["output_dir"], tmp_path / "copy")
    path = write(tmp_path, config)
    result = run_cli("train", str(path), "checkpoint.resume=latest", "train.max_steps=3", "train.log_every=2",
                     "train.eval_every=5", "checkpoint.save_every=3", "checkpoint.keep_last=2", "train.lr=5e-4")
    assert result.exit_code == 0, result.stderr
    assert "resumed from step 2" in result.stdout


def test_an_adapter_resumed_on_other_weights_of_the_same_shapes_is_refused(runs, tmp_path):
    """A LoRA run resumed with model.path at another checkpoint of the same architecture (a fine-tuned or merged
    base): it trained on, the adapter learning a second base and its adapter_config naming the new one."""
    config = runs["lora"]
    other = save_hf_teacher(tmp_path / "other", seed=1)  # the same shapes, other values
    line = outcome(tmp_path, config, f"model.path={other}")[0]
    assert line == (f"posttune: error: config: model.path: cannot resume {step2(config)}: its policy model had other "
                    "weights than this run's model.path holds (their safetensors differ; a moved copy of the same "
                    "files is accepted)" + HINT)


@pytest.mark.parametrize("name", ["lora", "full"])
def test_a_moved_copy_of_the_base_resumes(runs, bases, tmp_path, name):
    """The same files elsewhere resume; so does a full fine-tuning run from other weights (it resumes its own)."""
    import shutil

    config = json.loads(json.dumps(runs[name]))
    config["checkpoint"]["output_dir"] = str(tmp_path / "copy")
    shutil.copytree(runs[name]["checkpoint"]["output_dir"], tmp_path / "copy")
    moved = shutil.copytree(bases["llama"], tmp_path / "moved")
    if name == "full":
        moved = save_hf_teacher(tmp_path / "other", seed=1)
    result = run_cli("train", str(write(tmp_path, config)), "checkpoint.resume=latest", "train.max_steps=3",
                     f"model.path={moved}")
    assert result.exit_code == 0, result.stderr
    assert "resumed from step 2" in result.stdout


def test_an_adapter_started_on_another_base_is_said_once(runs, bases, tmp_path):
    """``adapter.init_from`` on a model other than its base (the merged model of its own run, say: its update
    then counts twice) trains, with one warning; a moved copy of its base has the same weights and none."""
    import shutil

    config = json.loads(json.dumps(runs["lora"]))
    config["checkpoint"]["output_dir"] = str(tmp_path / "new")
    adapter = Path(runs["lora"]["checkpoint"]["output_dir"]) / "adapter"
    other = save_hf_teacher(tmp_path / "other", seed=1)
    moved = shutil.copytree(bases["llama"], tmp_path / "moved")
    path = write(tmp_path, config)
    for model, warned in ((other, True), (moved, False)):
        result = run_cli("validate", str(path), f"adapter.init_from={adapter}", f"model.path={model}")
        assert result.exit_code == 0, result.stderr
        expected = (f"posttune: warning: adapter.init_from: {adapter} was trained on {bases['llama']}, not on "
                    f"model.path {model}: its update is added to other weights (to a model it was merged into, a "
                    "second time)\n")
        assert result.stderr == (expected if warned else ""), result.stderr


@pytest.mark.parametrize(("name", "given", "words"), [
    ("full", "", "; it is a run's output folder: its model is {out}/model"),
    ("lora", "", "; it holds an adapter; it is in {out}/adapter: its base model goes here, the adapter in "
                 "adapter.init_from"),
    ("lora", "adapter", "; it is a PEFT adapter (adapter_config.json): its base model goes here, the adapter in "
                        "adapter.init_from"),
])
def test_a_run_folder_or_an_adapter_given_as_the_model_says_what_it_is(runs, tmp_path, name, given, words):
    """`generate` and `merge` named these slips; `train` and `validate` said only "no config.json"."""
    out = runs[name]["checkpoint"]["output_dir"]
    config = json.loads(json.dumps(runs["full"]))
    config["checkpoint"]["output_dir"] = str(tmp_path / "new")
    given_path = f"{out}/{given}" if given else out
    result = run_cli("validate", str(write(tmp_path, config)), f"model.path={given_path}")
    assert refused(result) == (f"posttune: error: config: model.path: {given_path}: not a Hugging Face checkpoint "
                               f"(no config.json)" + words.format(out=out))


def test_another_seed_is_refused_naming_the_checkpoints(runs, tmp_path):
    """The epoch's order was drawn with the checkpoint's seed: another one would repeat and skip rows."""
    config = runs["full"]
    line = outcome(tmp_path, config, "train.seed=1", "train.max_steps=4")[0]
    assert line == (f"posttune: error: config: train.seed: checkpoint {step2(config)}: its data order was drawn with "
                    "seed 0, this run has 1; set train.seed: 0 to resume it")
