"""Every numeric field has a documented range, and `_component_` arguments are bound, at validate time."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from posttune.config import schema, validate
from posttune.config.ranges import RANGES
from posttune import hookimpl
from posttune.descriptors import Method
from posttune.errors import ConfigError, PluginError

BASE = {"model": {"family": "llama", "size": "tiny"}, "method": "sft", "data": {"train": {"path": "d.jsonl"}}}

CONFIG = """\
model: {family: fam, size: tiny}
method: fsft
data:
  train: {path: d.jsonl, format: chat}
"""


def with_section(section: str, **values) -> dict:
    raw = {key: dict(value) if isinstance(value, dict) else value for key, value in BASE.items()}
    raw[section] = {**raw.get(section, {}), **values}
    return raw


@pytest.mark.parametrize("section, values, message", [
    ("train", {"max_grad_norm": -1}, "train.max_grad_norm: expected a number > 0, or null (no clipping), got -1.0"),
    ("train", {"max_grad_norm": 0}, "train.max_grad_norm: expected a number > 0, or null (no clipping), got 0.0"),
    ("train", {"lr": float("inf")}, "train.lr: expected a finite number, got inf"),
    ("train", {"lr": float("nan")}, "train.lr: expected a finite number, got nan"),
    ("train", {"lr": -1e-3}, "train.lr: expected a number > 0, got -0.001"),
    ("train", {"lr": 0}, "train.lr: expected a number > 0, got 0.0"),
    ("train", {"weight_decay": -0.1}, "train.weight_decay: expected a number >= 0, got -0.1"),
    ("train", {"warmup_steps": -1}, "train.warmup_steps: expected an integer >= 0, got -1"),
    ("train", {"skip_nonfinite": -1}, "train.skip_nonfinite: expected an integer >= 0, got -1"),
    ("train", {"seed": -1}, "train.seed: expected an integer >= 0 and < 2**63, got -1"),
    ("train", {"max_steps": 0}, "train.max_steps: expected a positive integer, or null (train.epochs decides), got 0"),
    ("train", {"eval_every": 0},
     "train.eval_every: expected a positive integer, or null (no evaluation during training), got 0"),
    ("train", {"epochs": 0}, "train.epochs: expected a positive integer, got 0"),
    ("train", {"sample_max_new_tokens": 0}, "train.sample_max_new_tokens: expected a positive integer, got 0"),
    ("checkpoint", {"keep_last": 0},
     "checkpoint.keep_last: expected a positive integer, or null (keep every checkpoint), got 0"),
    ("checkpoint", {"save_every": -5},
     "checkpoint.save_every: expected a positive integer, or null (no checkpoints, only the final model: not "
     "resumable), got -5"),
    ("adapter", {"rank": 0}, "adapter.rank: expected a positive integer, got 0"),
    ("adapter", {"alpha": -16}, "adapter.alpha: expected a number > 0, got -16.0"),
    ("adapter", {"dropout": 1.0}, "adapter.dropout: expected a number >= 0 and < 1, got 1.0"),
    ("adapter", {"alpha": float("-inf")}, "adapter.alpha: expected a finite number, got -inf"),
    # a field that may be null says what is wrong with .inf, not "expected a number or null"
    ("train", {"max_grad_norm": float("inf")}, "train.max_grad_norm: expected a finite number, got inf"),
    ("data", {"max_seq_len": 0}, "data.max_seq_len: expected a positive integer, got 0"),
    ("data", {"max_prompt_len": -3},
     "data.max_prompt_len: expected a positive integer, or null (keep the whole prompt), got -3"),
    ("data", {"max_seq_len": 512, "max_prompt_len": 512},
     "data.max_prompt_len: must be below data.max_seq_len (512) to leave room for a response"),
    # just outside each bound (the docs table shows the same bounds: changed together, only these notice)
    ("data", {"max_prompt_len": 0},
     "data.max_prompt_len: expected a positive integer, or null (keep the whole prompt), got 0"),
    ("data", {"pad_to_multiple_of": 0},
     "data.pad_to_multiple_of: expected a positive integer, or null (pad to the longest row only), got 0"),
    ("data", {"validation_split": 0},
     "data.validation_split: expected a number > 0 and < 1, or null (data.validation, if any, is the validation set), "
     "got 0.0"),
    ("data", {"validation_split": 1},
     "data.validation_split: expected a number > 0 and < 1, or null (data.validation, if any, is the validation set), "
     "got 1.0"),
    ("train", {"batch_size": 0}, "train.batch_size: expected a positive integer, got 0"),
    ("train", {"grad_accum_steps": 0}, "train.grad_accum_steps: expected a positive integer, got 0"),
    ("train", {"log_every": 0}, "train.log_every: expected a positive integer, got 0"),
    ("train", {"seed": 2**63}, "train.seed: expected an integer >= 0 and < 2**63, got 9223372036854775808"),
    ("train", {"warmup_ratio": -0.01},
     "train.warmup_ratio: expected a number >= 0 and < 1, or null (train.warmup_steps decides), got -0.01"),
    ("train", {"warmup_ratio": 1.0},
     "train.warmup_ratio: expected a number >= 0 and < 1, or null (train.warmup_steps decides), got 1.0"),
    ("train", {"min_lr_ratio": -0.01, "scheduler": "cosine"},
     "train.min_lr_ratio: expected a number >= 0 and < 1, got -0.01"),
    ("train", {"min_lr_ratio": 1.0, "scheduler": "cosine"},
     "train.min_lr_ratio: expected a number >= 0 and < 1, got 1.0"),
    ("train", {"decay_ratio": 0, "scheduler": "wsd"},
     "train.decay_ratio: expected a number > 0 and < 1, or null (0.1), got 0.0"),
    ("train", {"decay_ratio": 1, "scheduler": "wsd"},
     "train.decay_ratio: expected a number > 0 and < 1, or null (0.1), got 1.0"),
    ("train", {"early_stopping_patience": 0},
     "train.early_stopping_patience: expected a positive integer, or null (no early stopping), got 0"),
    ("checkpoint", {"save_every": 0},
     "checkpoint.save_every: expected a positive integer, or null (no checkpoints, only the final model: not "
     "resumable), got 0"),
    ("adapter", {"alpha": 0}, "adapter.alpha: expected a number > 0, got 0.0"),
    ("adapter", {"dropout": -0.01}, "adapter.dropout: expected a number >= 0 and < 1, got -0.01"),
    ("adapter", {"loraplus_lr_ratio": 0},
     "adapter.loraplus_lr_ratio: expected a number > 0, or null (the B matrices learn at train.lr), got 0.0"),
    ("parallel", {"timeout_s": 0}, "parallel.timeout_s: expected a number > 0, or null (torch's default), got 0.0"),
    # a dataset's weight is checked in every data section, and named by its place in a list
    ("data", {"train": {"path": "d.jsonl", "weight": 0}},
     "data.train.weight: expected a number > 0, or null (an equal share), got 0.0"),
    ("data", {"validation": {"path": "v.jsonl", "weight": -1}},
     "data.validation.weight: expected a number > 0, or null (an equal share), got -1.0"),
    ("data", {"train": [{"path": "a.jsonl", "streaming": True}, {"path": "b.jsonl", "weight": 0, "streaming": True}]},
     "data.train[1].weight: expected a number > 0, or null (an equal share), got 0.0"),
    ("data", {"validation": [{"path": "a.jsonl", "streaming": True}, {"path": "b.jsonl", "weight": 0,
                                                                        "streaming": True}]},
     "data.validation[1].weight: expected a number > 0, or null (an equal share), got 0.0"),
    ("data", {"validation": {"path": "v.jsonl", "weight": 2}},
     "data.validation.weight: a weight shares the rows drawn between the datasets of a streamed list; this section "
     "names one dataset"),
])
def test_out_of_range_values_are_refused_naming_the_field(section, values, message):
    with pytest.raises(ConfigError) as error:
        validate(with_section(section, **values))
    assert str(error.value) == f"config: {message}"


@pytest.mark.parametrize("section, values", [
    ("train", {"max_grad_norm": None}), ("checkpoint", {"keep_last": None}), ("train", {"max_steps": None}),
    ("train", {"warmup_steps": 0, "skip_nonfinite": 0, "weight_decay": 0, "seed": 0}),
    ("adapter", {"dropout": 0.0}), ("checkpoint", {"keep_last": 1, "save_every": 1}),
    ("data", {"max_seq_len": 512, "max_prompt_len": 511}),
    # just inside each bound
    ("data", {"max_seq_len": 2, "max_prompt_len": 1, "pad_to_multiple_of": 1}), ("data", {"validation_split": 0.001}),
    ("data", {"validation_split": 0.999}), ("data", {"max_seq_len": 1}),
    ("train", {"batch_size": 1, "grad_accum_steps": 1, "log_every": 1, "epochs": 1, "max_steps": 1, "eval_every": 1,
               "sample_max_new_tokens": 1, "seed": 2**63 - 1, "lr": 1e-12, "max_grad_norm": 1e-12}),
    ("train", {"warmup_ratio": 0.0}), ("train", {"warmup_ratio": 0.999}),
    ("train", {"min_lr_ratio": 0.999, "scheduler": "cosine"}),
    ("train", {"decay_ratio": 0.001, "scheduler": "wsd"}), ("train", {"decay_ratio": 0.999, "scheduler": "wsd"}),
    ("adapter", {"rank": 1, "alpha": 0.001, "dropout": 0.999, "loraplus_lr_ratio": 0.001}),
    ("parallel", {"timeout_s": 0.001}),
    ("data", {"train": [{"path": "a.jsonl", "streaming": True, "weight": 0.001},
                        {"path": "b.jsonl", "streaming": True}],
              "validation": [{"path": "a.jsonl", "streaming": True},
                             {"path": "b.jsonl", "streaming": True, "weight": 0.001}]}),
])
def test_boundaries_and_null_for_off_are_accepted(section, values):
    validate(with_section(section, **values))


def test_the_smallest_early_stopping_patience_is_accepted():
    raw = with_section("train", eval_every=10, early_stopping_patience=1)
    raw["checkpoint"] = {"best_metric": "val_loss", "save_every": 10}
    raw["data"] = {**raw["data"], "validation_split": 0.1}
    assert validate(raw).train.early_stopping_patience == 1


def _numeric(tp) -> bool:
    args = typing.get_args(tp) or (tp,)
    return any(a in (int, float) for a in args)


def test_every_numeric_field_of_the_schema_has_a_range():
    sections = {"model": schema.ModelConfig, "data": schema.DataConfig, "train": schema.TrainConfig,
                "adapter": schema.AdapterConfig, "checkpoint": schema.CheckpointConfig,
                "tokenizer": schema.TokenizerConfig, "dataset": schema.DatasetConfig, "parallel": schema.ParallelConfig}
    numeric = {f"{name}.{f.name}" for name, cls in sections.items()
               for f in dataclasses.fields(cls) if _numeric(typing.get_type_hints(cls)[f.name])}
    # parallel.dims holds degrees (a mapping): the plan checks them against the launch (plan._mesh)
    assert numeric - {"parallel.dims"} == set(RANGES)


def test_documented_ranges_cover_every_field():
    text = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    assert all(f"`{field}`" in text for field in RANGES)


def test_a_negative_max_grad_norm_is_one_line_from_validate(fake_plugin, posttune_cli, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    result = posttune_cli("validate", str(path), "train.max_grad_norm=-1")
    assert result.exit_code == 2
    assert result.stderr == ("posttune: error: config: train.max_grad_norm: expected a number > 0, or null "
                             "(no clipping), got -1.0\n")


@pytest.mark.parametrize("override", ["train.lr=.inf", "train.lr=.nan", "train.lr=-1e-3", "checkpoint.keep_last=0"])
def test_values_that_break_a_run_fail_validate(fake_plugin, posttune_cli, tmp_path, override):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    result = posttune_cli("validate", str(path), override)
    field = override.split("=")[0]
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith(f"posttune: error: config: {field}: ") and result.stderr.count("\n") == 1


# ---- _component_ arguments bound at validate time ---------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["train.optimizer._component_=torch.optim.AdamW", "train.optimizer.betass=[0.9,0.95]"],
     "config: train.optimizer: torch.optim.AdamW: got an unexpected keyword argument 'betass'"),
    (["train.optimizer._component_=torch.optim.SGD", "train.optimizer.lr=0.1"],
     "config: train.optimizer.lr: posttune sets it from train.lr (and its schedule); set that instead"),
    # the parameter groups' weight decay overrides the constructor's: a value here would be ignored
    (["train.optimizer._component_=torch.optim.AdamW", "train.optimizer.weight_decay=0.1"],
     "config: train.optimizer.weight_decay: posttune sets it from train.weight_decay (for each parameter group, "
     "none on biases and norms); set that instead"),
    # posttune's warmup belongs to its named schedules: a component's schedule would run without it
    (["train.scheduler._component_=torch.optim.lr_scheduler.StepLR", "train.scheduler.step_size=2",
      "train.warmup_steps=2"],
     "config: train.warmup_steps: a _component_ scheduler is the whole schedule, without posttune's warmup (the "
     "named schedules have it); set it to 0, or warm up in the component (e.g. torch.optim.lr_scheduler.SequentialLR)"),
    (["train.scheduler._component_=torch.optim.lr_scheduler.StepLR"],
     "config: train.scheduler: torch.optim.lr_scheduler.StepLR: missing a required argument: 'step_size'"),
    (["train.optimizer._component_=torch.optim.Adamx"],
     "config: train.optimizer._component_: cannot import 'torch.optim.Adamx': 'torch.optim' has no attribute "
     "'Adamx'"),
])
def test_component_arguments_fail_in_validate(fake_plugin, posttune_cli, tmp_path, overrides, message):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    result = posttune_cli("validate", str(path), *overrides)
    assert result.exit_code == 2
    assert result.stderr == f"posttune: error: {message}\n"


def test_validate_and_plan_list_the_components(fake_plugin, posttune_cli, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    overrides = ["train.optimizer._component_=torch.optim.AdamW", "train.optimizer.betas=[0.9,0.95]",
                 "train.scheduler._component_=torch.optim.lr_scheduler.StepLR", "train.scheduler.step_size=2",
                 "tokenizer.path=org/tiny-tokenizer"]  # a hub id: named, as validate asks, and never loaded
    validated = posttune_cli("validate", str(path), *overrides)
    assert validated.exit_code == 0, validated.stderr
    listing = ("components: train.optimizer -> torch.optim.AdamW, "
               "train.scheduler -> torch.optim.lr_scheduler.StepLR")
    assert listing in validated.stdout.splitlines()
    planned = posttune_cli("plan", str(path), *overrides, "--no-estimate")
    assert planned.exit_code == 0, planned.stderr
    assert listing in planned.stdout.splitlines()


@pytest.mark.parametrize("section, values, message", [
    ("train", {"optimizer": "adamww"},
     "train.optimizer: unknown name 'adamww' (known: adamw, adam, sgd, or a _component_ mapping) (did you mean "
     "'adamw'?)"),
    ("train", {"scheduler": "cosin"},
     "train.scheduler: unknown name 'cosin' (known: constant, linear, cosine, wsd, or a _component_ mapping) (did you "
     "mean 'cosine'?)"),
    ("train", {"optimizer": {"momentum": 0.9}},
     "train.optimizer: a mapping needs `_component_: dotted.path` (or give a name: adamw, adam, sgd)"),
])
def test_optimizer_and_schedule_names_are_checked_before_launch(section, values, message):
    with pytest.raises(ConfigError) as error:
        validate(with_section(section, **values))
    assert str(error.value) == f"config: {message}"


def test_the_names_validate_accepts_are_the_ones_training_builds():
    from posttune.training import optim

    assert tuple(optim.OPTIMIZERS) == schema.OPTIMIZER_NAMES and optim.SCHEDULES == schema.SCHEDULE_NAMES


class StrictMethodPlugin:
    """A third party's method whose check raises ValueError instead of the documented ConfigError."""

    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_methods(self, register):
        def refuse(config, method_config):
            raise ValueError("strict needs data.max_seq_len <= 64\nsecond line")

        register(Method("strict", dict, "sft", data=lambda *a: None, loss=lambda *a: None, validate=refuse))


def test_a_plugin_check_raising_another_exception_is_one_line_naming_the_plugin(fake_plugin, register_plugin,
                                                                               posttune_cli, tmp_path):
    register_plugin(StrictMethodPlugin(), name="strict", distribution="acme-strict", version="0.3")
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.replace("method: fsft", "method: strict"))
    result = posttune_cli("validate", str(path))
    assert (result.exit_code, result.stderr) == (2, "posttune: error: Method 'strict' (acme-strict 0.3) refused the "
                                                    "config with ValueError: strict needs data.max_seq_len <= 64 "
                                                    "(--debug: where)\n")
    with pytest.raises(PluginError) as debug:  # --debug: the traceback, with the plugin's own exception as cause
        posttune_cli("--debug", "validate", str(path))
    assert isinstance(debug.value.__cause__, ValueError)
