"""Config: YAML loading, command-line overrides, schema validation, `_component_`, `requires`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import ClassVar  # module level: dataclasses reads a ClassVar annotation from here

import pytest
import torch

from posttune.config import apply_overrides, instantiate, load_config, load_yaml, validate
from posttune.config.loader import parse_value, parse_yaml
from posttune.config.requires import check_requires
from posttune.errors import ConfigError, PosttuneError

BASE = {"model": {"family": "llama", "size": "tiny"}, "method": "sft"}


def base(**sections):
    return {**{k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}, **sections}


# ---- overrides ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("3", 3), ("-2", -2), ("1e-4", 1e-4), ("2E5", 2e5), ("0.5", 0.5), (".5", 0.5), ("true", True),
    ("False", False), ("null", None), ("~", None), ("[1, 2]", [1, 2]), ("[a, 1e-3]", ["a", 1e-3]),
    ("{a: 1}", {"a": 1}), ("hello", "hello"), ("'007'", "007"), ("", ""), ("a: b: c", "a: b: c"),
])
def test_override_values_are_typed_like_yaml(text, value):
    assert parse_value(text) == value
    assert type(parse_value(text)) is type(value)


def test_overrides_set_nested_keys_creating_mappings():
    config = apply_overrides({"train": {"lr": 1.0}}, ["train.lr=3e-4", "data.train.path=x.jsonl", "memory=[a,b]"])
    assert config == {"train": {"lr": 3e-4}, "data": {"train": {"path": "x.jsonl"}}, "memory": ["a", "b"]}


def test_overrides_index_into_lists():
    config = apply_overrides({"items": [{"a": 1}, {"a": 2}]}, ["items.1.a=5", "~items.0"])
    assert config == {"items": [{"a": 5}]}
    config = apply_overrides({"items": [{"a": 1}, {"a": 2}]}, ["items[1].a=5", "~items[0]"])  # as errors write it
    assert config == {"items": [{"a": 5}]}


def test_override_value_keeps_equals_signs():
    assert apply_overrides({}, ["model.path=a=b"]) == {"model": {"path": "a=b"}}


def test_tilde_deletes_a_key():
    config = apply_overrides({"train": {"lr": 1, "seed": 2}, "adapter": {"rank": 8}}, ["~train.seed", "~adapter"])
    assert config == {"train": {"lr": 1}}


@pytest.mark.parametrize("overrides, message", [
    (["~train.nope"], "config: train.nope: no such key to delete"),
    (["~nothere.x"], "config: nothere: no such key"),
    (["train.lr.x=1"], "config: train.lr: is float 0.1, not a mapping"),
    (["items.5=1"], "config: items.5: no item '5' in a list of 1"),
    (["justaword"], "config: override 'justaword': expected KEY=VALUE or ~KEY"),
    (["train..lr=1"], "config: override 'train..lr=1': empty key in 'train..lr'"),
])
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        apply_overrides({"train": {"lr": 0.1}, "items": [1]}, overrides)
    assert str(error.value) == message


@pytest.mark.parametrize("overrides, expected", [
    (["method.beta=0.5"], {"name": "dpo", "beta": 0.5}),
    (["method.name=kd"], {"name": "kd"}),
    (["method.loss.kind=x"], {"name": "dpo", "loss": {"kind": "x"}}),
])
def test_a_dotted_override_under_a_short_form_method_writes_its_long_form(overrides, expected):
    """`method: dpo` stands for `method: {name: dpo}`: a key under it is a setting of that method."""
    assert apply_overrides({"method": "dpo"}, overrides) == {"method": expected}
    assert apply_overrides({"method": {"name": "dpo"}}, overrides) == {"method": expected}  # as the long form


def test_adapter_lora_as_axolotl_writes_it_takes_dotted_keys():
    assert apply_overrides({"adapter": "lora"}, ["adapter.rank=16"]) == {"adapter": {"kind": "lora", "rank": 16}}


def test_a_component_replaces_a_built_in_optimizer_or_schedule_by_name():
    """`optimizer: adamw` is a built-in's name, not `{name: adamw}`: a `_component_` takes its place (config.md's
    own example, on a file that names one), and a component's argument before it is refused saying so."""
    config = apply_overrides({"train": {"optimizer": "adamw", "scheduler": "cosine"}},
                             ["train.optimizer._component_=torch.optim.SGD", "train.optimizer.momentum=0.9",
                              "train.scheduler._component_=torch.optim.lr_scheduler.StepLR"])
    assert config == {"train": {"optimizer": {"_component_": "torch.optim.SGD", "momentum": 0.9},
                                "scheduler": {"_component_": "torch.optim.lr_scheduler.StepLR"}}}
    with pytest.raises(ConfigError) as error:
        apply_overrides({"train": {"optimizer": "adamw"}}, ["train.optimizer.lr=1"])
    assert str(error.value) == ("config: train.optimizer: is the built-in 'adamw', which takes no lr; a component's "
                                "arguments follow its train.optimizer._component_=... override (e.g. "
                                "torch.optim.AdamW)")
    with pytest.raises(ConfigError, match="^config: x.method: is str 'a', not a mapping$"):
        apply_overrides({"x": {"method": "a"}}, ["x.method.k=1"])  # a nested `method` is no section


def test_top_level_x_keys_hold_anchors_and_are_left_out(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("x-data: &ds {path: d.jsonl, format: chat}\nmodel: {family: llama}\nmethod: sft\n"
                    "data: {train: *ds, validation: {<<: *ds, split: 'train[:10%]'}}\n")
    config = load_config(path)
    assert "x-data" not in config and config["data"]["validation"] == {"path": "d.jsonl", "format": "chat",
                                                                       "split": "train[:10%]"}


@pytest.mark.parametrize("override", ["checkpoint.output_dir=${oc.env:OUT}/a", "data.train.path=${data_dir}/x.jsonl",
                                      "checkpoint.output_dir=$SCRATCH/a"])  # a shell left it: single quotes, YAML
def test_a_variable_in_a_path_is_refused_not_taken_as_a_folder_name(tmp_path, override):
    """torchtune's `${output_dir}` and OmegaConf's `${oc.env:...}`: nothing fills them in here."""
    path = tmp_path / "run.yaml"
    path.write_text("model: {family: llama}\nmethod: sft\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, [override])
    key, variable = override.split("=")[0], override.split("=")[1].split("/")[0]
    assert str(error.value) == (f"config: {key}: {variable} is not filled in (a config has no variables); let the "
                                f"shell expand one: {key}=$OUT/run")
    assert load_config(path, ["train.sample_prompts=['cost: ${price}']"])["train"]["sample_prompts"]  # not a path


def test_a_home_relative_output_dir_is_expanded_once_for_every_writer(tmp_path):
    """`checkpoint.output_dir=~/runs/r1` reaches posttune unexpanded (a shell leaves ~ after `=`); half a run in a
    folder named `~` under the working directory could not be resumed."""
    config = validate(base(checkpoint={"output_dir": "~/runs/r1"}))
    assert config.checkpoint.output_dir == os.path.expanduser("~/runs/r1") != "~/runs/r1"


def test_deleting_under_a_short_form_method_finds_no_such_key():
    with pytest.raises(ConfigError) as error:
        apply_overrides({"method": "dpo"}, ["~method.beta"])
    assert str(error.value) == "config: method.beta: no such key to delete"


PREFERENCE = {"prompt": "Reverse: AB", "chosen": "BA", "rejected": "AB"}


def test_cli_takes_a_setting_under_a_short_form_method(fake_plugin, posttune_cli, tmp_path):
    """The documented `method: NAME` with `method.KEY=VALUE` reaches the method's own settings."""
    (tmp_path / "p.jsonl").write_text(json.dumps(PREFERENCE) + "\n")
    path = tmp_path / "s.yaml"
    path.write_text(f"model: {{family: fam, size: tiny}}\ntokenizer: {{path: org/tiny-tokenizer}}\nmethod: fdpo\n"
                    f"models: {{reference: {{family: fam, size: tiny}}}}\n"
                    f"data: {{train: {{path: {tmp_path / 'p.jsonl'}, format: preference}}}}\n")
    result = posttune_cli("validate", str(path), "method.beta=0.5")
    assert (result.exit_code, result.stderr) == (0, ""), result.stderr
    assert validate(load_config(path, ["method.beta=0.5"])).method_settings == {"beta": 0.5}
    wrong = posttune_cli("validate", str(path), "method.betta=0.5")
    assert (wrong.exit_code, wrong.stdout) == (2, "")
    assert wrong.stderr == "posttune: error: config: method.betta: unknown key (did you mean 'beta'?)\n"


def test_yaml_reads_integers_as_yaml_1_2_does():
    """YAML 1.1 (PyYAML's) read `batch_size: 010` as octal 8 and `1:30` as 90; a config means ten and a string."""
    assert parse_yaml("a: 010\nb: 0o10\nc: 0x1f\nd: 1_000\ne: -5\nf: 1:30\ng: 007") == {
        "a": 10, "b": 8, "c": 31, "d": 1000, "e": -5, "f": "1:30", "g": 7}


def test_yaml_reads_exponent_floats_and_rejects_non_mappings(tmp_path):
    good = tmp_path / "a.yaml"
    good.write_text("train:\n  lr: 2e-5\n  warmup: 1_000\n")
    assert load_yaml(good) == {"train": {"lr": 2e-5, "warmup": 1000}}
    bad = tmp_path / "b.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(PosttuneError, match="the top level must be a mapping of keys, got list"):
        load_yaml(bad)
    broken = tmp_path / "c.yaml"
    broken.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(PosttuneError, match=r"c.yaml:3: invalid YAML"):
        load_yaml(broken)
    with pytest.raises(PosttuneError, match="config file not found"):
        load_yaml(tmp_path / "missing.yaml")


@pytest.mark.parametrize("text, line, key, first", [
    ("train:\n  lr: 1e-4\nmethod: sft\ntrain:\n  seed: 3\n", 4, "train", 1),
    ("model: {family: x}\nmethod: sft\nmethod: dpo\n", 3, "method", 2),
    ("data:\n  train:\n    path: a.jsonl\n    format: chat\n    path: b.jsonl\n", 5, "path", 3),
    ("memory_options:\n  - {every: 2, every: 3}\n", 2, "every", 2),
])
def test_yaml_refuses_a_key_given_twice_at_any_depth(tmp_path, text, line, key, first):
    """PyYAML keeps the last of two equal keys: the first section would vanish without a word."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(PosttuneError) as error:
        load_yaml(path)
    assert str(error.value) == f"{path}:{line}: invalid YAML: duplicate key '{key}' (first at line {first})"
    with pytest.raises(PosttuneError, match=f"^{path}:{line}: invalid YAML: duplicate key"):
        load_config(path)


def test_yaml_merge_keys_may_be_overridden_explicitly(tmp_path):
    """``<<: *base`` then a key of the base's is what a merge is for, not a duplicate; a base that
    merges another keeps its own override too, wherever it is flattened first."""
    path = tmp_path / "run.yaml"
    path.write_text("defaults: &d {lr: 1e-4, seed: 1}\n"
                    "nested:\n  inner: &i\n    <<: *d\n    seed: 2\n"
                    "train:\n  <<: [*i, *d]\n  lr: 2e-5\n")
    assert load_yaml(path) == {"defaults": {"lr": 1e-4, "seed": 1}, "nested": {"inner": {"lr": 1e-4, "seed": 2}},
                               "train": {"lr": 2e-5, "seed": 2}}
    twice = tmp_path / "twice.yaml"
    twice.write_text("a: &a {x: 1}\nb:\n  <<: *a\n  <<: *a\n")
    with pytest.raises(PosttuneError, match=r"twice.yaml:4: invalid YAML: duplicate key '<<' \(first at line 3\)$"):
        load_yaml(twice)


def test_yaml_never_constructs_python_objects(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("x: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(PosttuneError, match="invalid YAML"):
        load_yaml(evil)


@pytest.mark.parametrize("text", ["", "# my run, to be written\n", "---\n"])
def test_an_empty_config_file_is_said_to_be_empty(tmp_path, text):
    """Not "config: model: required", as if one section were missing."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(PosttuneError) as caught:
        load_config(path)
    assert str(caught.value) == (f"{path}: the config file is empty (a config names a model, a method and data: "
                                 "`posttune cp` copies a bundled one to start from)")


def test_yaml_nested_past_the_parsers_recursion_is_one_line(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("model: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(PosttuneError) as caught:
        load_yaml(deep)
    assert str(caught.value) == f"{deep}: invalid YAML: nested too deeply (no config nests more than a few levels)"


# ---- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, message", [
    (base(train={"lr": "fast"}), "config: train.lr: expected a number, got 'fast'"),
    (base(train={"lrr": 1.0}), "config: train.lrr: unknown key (did you mean 'lr'?)"),
    (base(trian={}), "config: trian: unknown key (did you mean 'train'?)"),
    (base(train={"batch_size": 2.5}), "config: train.batch_size: expected an integer, got 2.5"),
    (base(train={"batch_size": True}), "config: train.batch_size: expected an integer, got true"),
    (base(train={"lr": True}), "config: train.lr: expected a number, got true"),  # not lr 1.0
    (base(data={"train": {"path": "x"}, "group_by_length": True, "shuffle": False}),
     "config: data.group_by_length: groups a shuffled order, but data.shuffle is false (the rows in the order read); "
     "keep one"),
    (base(data={"train": {"path": "x"}}, train={"eval_every": 5}, checkpoint={"best_metric": "val_loss"}),
     "config: checkpoint.best_metric: needs evaluations: set train.eval_every and data.validation (or "
     "data.validation_split)"),
    (base(train={"batch_size": 0}), "config: train.batch_size: expected a positive integer, got 0"),
    (base(adapter={"targets": []}), "config: adapter.targets: an empty list adapts nothing: list module-name "
                                    "patterns, or leave it out for the family's default targets"),
    (base(train={"max_grad_norm": "x"}), "config: train.max_grad_norm: expected a number or null, got 'x'"),
    (base(train={"optimizer": 3}), "config: train.optimizer: expected a string or a mapping, got 3"),
    # null only where the type allows it: no method, no optimizer would pass validate and crash later
    (base(method=None), "config: method: expected a string or a mapping, got null"),
    (base(train={"optimizer": None}), "config: train.optimizer: expected a string or a mapping, got null"),
    (base(train={"scheduler": "constant_with_warmup"}), "config: train.scheduler: unknown name 'constant_with_warmup' "
     "(known: constant, linear, cosine, wsd, or a _component_ mapping); transformers' constant_with_warmup is "
     "constant with train.warmup_steps here"),
    (base(train={"optimizer": "adamw_torch_fused"}), "config: train.optimizer: unknown name 'adamw_torch_fused' "
     "(known: adamw, adam, sgd, or a _component_ mapping); transformers' adamw_torch_fused is adamw here"),
    (base(train=[1]), "config: train: expected a mapping of keys, got a list"),
    (base(model={"dtype": "fp64", "path": "x"}),
     "config: model.dtype: expected one of 'fp32', 'bf16', 'fp16' (or torch's names: 'bfloat16', ...), got 'fp64' "
     "(did you mean 'fp16'?)"),
    (base(memory="activation_checkpointing"), "config: memory: expected a list, got 'activation_checkpointing'"),
    (base(memory=["a", 3]), "config: memory[1]: expected a string, got 3"),
    (base(parallel={"dims": {"tp": "two"}}), "config: parallel.dims.tp: expected an integer, got 'two'"),
    (base(parallel={"dims": {"tp": 0}}), "config: parallel.dims.tp: expected a positive degree or -1, got 0"),
    (base(data={"train": {"format": "chat"}}), "config: data.train.path: required"),
    (base(data={"train": {"path": "x", "column_map": {"a": 1}}}),
     "config: data.train.column_map.a: expected a string, got 1"),
    ({"method": "sft"}, "config: model: required"),
    ({"model": {"path": "x"}}, "config: method: required"),
    (base(model={"family": "llama"}),
     "config: model: set `path` (a checkpoint) or both `family` and `size` (random init)"),
    (base(method={"beta": 0.1}), "config: method.name: required: the method to run (e.g. sft)"),
])
def test_validation_errors_name_the_field(raw, message):
    with pytest.raises(ConfigError) as error:
        validate(raw)
    assert str(error.value) == message


def test_validation_fills_defaults_and_converts():
    config = validate(base(train={"lr": 1, "optimizer": {"_component_": "torch.optim.SGD"}}, memory=[]))
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)
    assert config.train.optimizer == {"_component_": "torch.optim.SGD"}
    assert config.train.batch_size == 1 and config.checkpoint.keep_last == 2
    assert config.method_name == "sft" and config.method_settings == {}
    assert validate(base(method={"name": "dpo", "beta": 0.1})).method_settings == {"beta": 0.1}


def test_null_for_a_list_or_mapping_is_its_empty_default():
    """`models=null` or `train.sample_prompts=null` on the command line clears them (as ~models does); a field
    that may hold null (checkpoint.resume) keeps it."""
    config = validate(base(models=None, train={"sample_prompts": None}, memory=None, checkpoint={"resume": None}))
    assert config.models == {} and config.train.sample_prompts == [] and config.memory == []
    assert config.checkpoint.resume is None


# ---- _component_ -------------------------------------------------------------------------------

def test_component_builds_the_callable_with_sibling_kwargs():
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = instantiate({"_component_": "torch.optim.SGD", "lr": 0.5, "momentum": 0.9}, params)
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.defaults["lr"] == 0.5 and optimizer.defaults["momentum"] == 0.9


def test_component_instantiates_nested_mappings_and_lists(monkeypatch):
    monkeypatch.setenv("POSTTUNE_TRUST_COMPONENTS", "1")  # modules are outside the default allow-list
    built = instantiate({
        "_component_": "torch.nn.ModuleDict",
        "modules": {"a": {"_component_": "torch.nn.Linear", "in_features": 2, "out_features": 3}},
    })
    assert isinstance(built, torch.nn.ModuleDict) and isinstance(built["a"], torch.nn.Linear)
    assert built["a"].out_features == 3
    layers = instantiate({"layers": [{"_component_": "torch.nn.ReLU"}, 3, {"plain": True}]})
    assert isinstance(layers["layers"][0], torch.nn.ReLU) and layers["layers"][1:] == [3, {"plain": True}]


def test_component_accepts_a_class_attribute_path(monkeypatch):
    monkeypatch.setenv("POSTTUNE_TRUST_COMPONENTS", "1")  # collections is outside the default allow-list
    assert instantiate({"_component_": "collections.OrderedDict.fromkeys", "iterable": "ab"}) == {"a": None, "b": None}


@pytest.mark.parametrize("node, message", [
    ({"_component_": "torch.optim.Adamx"},
     "config: optimizer._component_: cannot import 'torch.optim.Adamx': 'torch.optim' has no attribute 'Adamx'"),
    ({"_component_": "nopackage_xyz.Thing"},
     "config: optimizer._component_: cannot import 'nopackage_xyz.Thing': no module named 'nopackage_xyz' "
     "(installed, or in the working directory)"),
    ({"_component_": "torch.optim.SGD.not here"},
     "config: optimizer._component_: expected a dotted path like 'torch.optim.AdamW', got 'torch.optim.SGD.not here'"),
    ({"_component_": "torch.float32"}, "config: optimizer._component_: 'torch.float32' is a dtype, not callable"),
    ({"_component_": "torch.optim.SGD", "lrr": 1},
     "config: optimizer: torch.optim.SGD: SGD.__init__() got an unexpected keyword argument 'lrr'"),
    ({"_component_": "torch.nn.ModuleDict", "x": {"_component_": "nope_mod.f"}},
     "config: optimizer.x._component_: cannot import 'nope_mod.f': no module named 'nope_mod' (installed, or "
     "in the working directory)"),
])
def test_component_errors_are_one_line_naming_the_field(node, message):
    with pytest.raises(ConfigError) as error:
        instantiate(node, [torch.nn.Parameter(torch.zeros(1))], where="optimizer")
    assert str(error.value) == message
    assert "\n" not in str(error.value)


def test_component_by_default_builds_only_optimizer_and_scheduler_classes(monkeypatch):
    monkeypatch.delenv("POSTTUNE_TRUST_COMPONENTS", raising=False)
    with pytest.raises(ConfigError) as error:
        instantiate({"layers": [{"_component_": "torch.nn.ReLU"}]}, where="optimizer")
    assert str(error.value).startswith("config: optimizer.layers[0]._component_: refusing 'torch.nn.ReLU': it is a "
                                       "class, but not an optimizer or LR scheduler class; ")
    params = [torch.nn.Parameter(torch.zeros(2))]
    scheduler = instantiate({"_component_": "torch.optim.lr_scheduler.StepLR", "step_size": 2},
                            torch.optim.SGD(params, lr=1.0), where="train.scheduler")
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and scheduler.step_size == 2


def test_component_refuses_keys_posttune_sets_itself():
    with pytest.raises(ConfigError, match="config: optimizer.params: is set by posttune itself"):
        instantiate({"_component_": "torch.optim.SGD", "params": [], "lr": 1}, where="optimizer", params=[])


# ---- requires ----------------------------------------------------------------------------------

def test_requires_accepts_installed_versions():
    check_requires(["posttune>=0.1", "pyyaml", "torch>=2.6"])


@pytest.mark.parametrize("requirement, message", [
    ("posttune-nonexistent>=0.1",
     "config requires posttune-nonexistent>=0.1, which is not installed — pip install 'posttune-nonexistent>=0.1'"),
    ("posttune>=99", "config requires posttune>=99, but posttune 0.1.0 is installed — pip install 'posttune>=99'"),
])
def test_requires_names_what_is_missing(requirement, message):
    with pytest.raises(PosttuneError) as error:
        check_requires([requirement])
    assert str(error.value) == message


def test_requires_names_everything_missing_in_one_pip_install_line():
    """The bundled mixtral-8x7b-qlora requires posttune-memory and posttune-torchao: both named at once."""
    with pytest.raises(PosttuneError) as error:
        check_requires(["posttune-nonexistent>=0.1", "pyyaml", "posttune>=99", "posttune-absent"])
    assert str(error.value) == ("config requires posttune-nonexistent>=0.1, which is not installed; and posttune>=99, "
                                "but posttune 0.1.0 is installed; and posttune-absent, which is not installed — "
                                "pip install 'posttune-nonexistent>=0.1' 'posttune>=99' 'posttune-absent'")


def test_requires_rejects_an_invalid_specifier():
    with pytest.raises(ConfigError, match=r"config: requires\[1\]: invalid requirement 'posttune>>1'"):
        check_requires(["posttune", "posttune>>1"])
    with pytest.raises(ConfigError) as error:  # packaging's caret diagram of the text is left out
        check_requires(["posttune-llama>=>0.1"])
    line = str(error.value)  # packaging's own words follow (they differ between its releases), on one line
    assert line.startswith("config: requires[0]: invalid requirement 'posttune-llama>=>0.1': Expected ")
    assert "\n" not in line and "^" not in line


def test_package_paths_resolve_inside_installed_packages():
    from posttune.config.bundled import resolve_package_paths

    raw = resolve_package_paths({"data": {"train": {"path": "package:posttune/builtin/datasets.py"}},
                                 "model": {"path": "plain/dir"}})
    assert raw["data"]["train"]["path"].endswith("posttune/builtin/datasets.py")
    assert __import__("pathlib").Path(raw["data"]["train"]["path"]).is_file()
    assert raw["model"]["path"] == "plain/dir"
    with pytest.raises(ConfigError,
                       match="config: tokenizer.path: package:nope_pkg/x: package 'nope_pkg' is not installed"):
        resolve_package_paths({"tokenizer": {"path": "package:nope_pkg/x"}})


def test_a_value_a_plugin_config_refuses_itself_is_named_under_its_section():
    """A plugin's config dataclass refuses a value in ``__post_init__`` naming only its field; the error names
    it under the section it was read from, and a path that is already the section's stays as it is."""
    from dataclasses import dataclass

    from posttune.config.typed import from_dict

    @dataclass(frozen=True)
    class Weighted:
        default_weight: float = 1.0

        def __post_init__(self) -> None:
            if self.default_weight < 0:
                raise ConfigError("default_weight", f"expected >= 0, got {self.default_weight}")
            if self.default_weight > 10:
                raise ConfigError("method.default_weight", "at most 10")

    assert from_dict(Weighted, {"default_weight": 2}, "method") == Weighted(2.0)
    with pytest.raises(ConfigError) as low:
        from_dict(Weighted, {"default_weight": -1}, "method")
    assert str(low.value) == "config: method.default_weight: expected >= 0, got -1.0"
    with pytest.raises(ConfigError) as high:
        from_dict(Weighted, {"default_weight": 11}, "method")
    assert str(high.value) == "config: method.default_weight: at most 10"
    with pytest.raises(ConfigError) as top:
        from_dict(Weighted, {"default_weight": -1})
    assert str(top.value) == "config: default_weight: expected >= 0, got -1.0"


@dataclasses.dataclass(frozen=True)
class _Spec:
    FROM_STRING: ClassVar[str] = "name"
    name: str
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class _Holder:
    specs: list[_Spec] = dataclasses.field(default_factory=list)


def test_a_dataclass_with_from_string_reads_a_lone_string_as_that_field():
    """``FROM_STRING`` (a ClassVar) names the field a lone string fills: ``rewards: [exact_answer]`` as TRL lists
    its reward functions; the mapping form, and errors inside it, are unchanged."""
    from posttune.config.typed import from_dict

    assert from_dict(_Holder, {"specs": ["a", {"name": "b", "weight": 2}]}, "method") == _Holder(
        [_Spec("a"), _Spec("b", 2.0)])
    with pytest.raises(ConfigError, match=r"^config: method.specs\[0\]: expected a mapping of keys, got 7$"):
        from_dict(_Holder, {"specs": [7]}, "method")


@dataclasses.dataclass(frozen=True)
class _Betas:
    betas: tuple[float, float] = (0.9, 0.999)


def test_a_fixed_length_tuple_of_a_plugin_s_config_counts_its_items():
    """``tuple[float, float]`` in a plugin's options: a list of another length is one line naming the field and the
    count it needs, not a ValueError from deep inside the conversion."""
    from posttune.config.typed import from_dict

    assert from_dict(_Betas, {"betas": [0.8, 1]}, "method") == _Betas((0.8, 1.0))
    for given in ([0.8], [0.8, 0.9, 0.99]):
        with pytest.raises(ConfigError) as exc:
            from_dict(_Betas, {"betas": given}, "method")
        assert str(exc.value) == f"config: method.betas: expected a list of 2, got {len(given)}"
