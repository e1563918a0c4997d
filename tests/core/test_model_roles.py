"""Open model roles and dataset kinds: a method names its roles and kinds; the config's `models:` section
(or the old `reference:` / `teacher:`) gives a role's weights; old data keys and kind names still read."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import yaml

from posttune.config import load_config, validate
from posttune.descriptors import DatasetFormat, MemoryTechnique, Method, ModelRole
from posttune.errors import ConfigError, PosttuneError
from posttune.plan import resolve_plan
from posttune.plugins import hookimpl
from posttune.training.compose import applies_to


def noop(*args):
    return None


@dataclass(frozen=True)
class RolesConfig:
    base_off: bool = False  # declare `base` as the policy with adapters off instead of a copy of its source


def roles(config: RolesConfig) -> tuple[ModelRole, ...]:
    return (ModelRole("critic"), ModelRole("base", from_policy=True, adapters_off=config.base_off),
            ModelRole("whole", from_policy=True, run_plans=False))


class RolesPlugin:
    """Methods with roles the core has no name for, and formats of kinds old and new."""

    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_methods(self, register):
        register(Method("roles", RolesConfig, "conversation", data=noop, loss=noop, roles=roles))
        register(Method("both", dict, ("conversation", "preference"), data=noop, loss=noop))
        for name, role in (("trained", ModelRole("value", trained=True, adapters_off=True)),
                           ("loose_head", ModelRole("value", on_policy=True)), ("policy_role", ModelRole("policy")),
                           ("twice", "critic")):
            register(Method(name, dict, "conversation", data=noop, loss=noop,
                            roles=(role, "critic") if name == "twice" else (role,)))
        register(Method("misspelt", dict, "preferences", data=noop, loss=noop))  # no format gives that kind

    @hookimpl
    def posttune_register_datasets(self, register):
        register(DatasetFormat("old_chat", "sft", noop))  # a plugin written when the kind was called sft

    @hookimpl
    def posttune_register_memory_techniques(self, register):
        register(MemoryTechnique("frozen_too", "build", noop, frozen="apply"))


@pytest.fixture
def registry(fake_plugin, register_plugin, posttune_plugins):
    register_plugin(RolesPlugin(), name="roles", distribution="posttune-roles", version="1.0")
    return posttune_plugins.registry


TINY = {"family": "fam", "size": "tiny"}


def config(**sections):
    raw = {"model": TINY, "method": "roles", "data": {"train": {"path": "d.jsonl", "format": "chat"}},
           "models": {"critic": TINY}}
    raw.update(sections)
    return validate(raw)


def test_each_role_is_built_as_its_method_declares(registry):
    plan = resolve_plan(config(parallel={"plans": ["fsdp"]}), registry, world_size=2)
    assert {name: role.section for name, role in plan.roles.items()} == {
        "critic": "models.critic", "base": "model", "whole": "model"}
    lines = [step.what for step in plan.steps if step.stage == "roles"]
    assert lines == ["critic: frozen 'fam' model (random init, size tiny), with fsdp",
                     "base: frozen 'fam' model (random init, size tiny), with fsdp",
                     "whole: frozen 'fam' model (random init, size tiny)"]  # run_plans=False: no plan acts on it


def test_adapters_off_makes_the_role_the_policy_itself_under_an_adapter(registry):
    plan = resolve_plan(config(method={"name": "roles", "base_off": True}, adapter={"kind": "fadapt", "rank": 4}),
                        registry)
    assert plan.roles["base"].shares_policy and not plan.roles["whole"].shares_policy
    assert "base: the policy with its adapters disabled (no copy)" in [step.what for step in plan.steps]


def test_the_runs_plans_and_techniques_act_only_on_roles_that_take_them(registry):
    plan = resolve_plan(config(memory=["frozen_too", "ckpt"]), registry)
    technique, skipping = plan.memory
    session = SimpleNamespace(plan=plan)
    target = {name: SimpleNamespace(role=name, trainable=False) for name in ("critic", "whole")}
    assert applies_to(session, technique, target["critic"]) and not applies_to(session, technique, target["whole"])
    assert not applies_to(session, skipping, target["critic"])  # frozen="skip"
    assert applies_to(session, skipping, SimpleNamespace(role="policy", trainable=True))


@pytest.mark.parametrize("sections, message", [
    ({"models": {}}, "config: models.critic: required: method 'roles' needs its critic model (models.critic.path, "
                     "or models.critic.family and models.critic.size)"),
    ({"models": {"critic": TINY, "judge": TINY}},
     "config: models.judge: method 'roles' uses no judge model with these settings; remove it"),
    ({"model": {**TINY, "build_overrides": {"vocab_size": 32}},
      "models": {"critic": {**TINY, "build_overrides": {"vocab_size": 16}}}},
     "config: models.critic: the critic's vocabulary has 16 tokens and the policy's 32: it reads the policy's token "
     "ids (up to 31: those of the data and those the policy samples); give both models one vocabulary size (a "
     "policy padded past its tokenizer can be built with 16)"),
    ({"models": {"critic": TINY, "critc": TINY}},
     "config: models.critc: method 'roles' uses no critc model with these settings (did you mean 'critic'?)"),
    ({"models": {"critic": {"family": "nope", "size": "tiny"}}},
     "config: models.critic.family: no model family 'nope' is installed (installed: fam)"),
    ({"method": "trained"}, "config: method: method 'trained' (posttune-roles 1.0) declares model role 'value' as "
                            "trained and adapters_off: a trained role is its own model, built like the "
                            "policy"),
    ({"method": "loose_head"}, "config: method: method 'loose_head' (posttune-roles 1.0) declares model role "
                               "'value' as on_policy: a head on the policy is a trained score head (trained=True, "
                               "score=True)"),
    ({"method": "policy_role"}, "config: method: method 'policy_role' (posttune-roles 1.0) declares model role "
                                "'policy': not a role name"),
    ({"method": "twice"}, "config: method: method 'twice' (posttune-roles 1.0) declares model role 'critic' twice"),
    ({"data": {"train": {"path": "d.jsonl", "format": "preference"}}},
     "config: data.train.format: 'preference' gives preference rows; method 'roles' needs conversation rows"),
    ({"method": "both", "data": {"train": {"path": "d.jsonl", "format": "prompt"}}},
     "config: data.train.format: 'prompt' gives prompt rows; method 'both' needs conversation or preference rows"),
])
def test_roles_and_kinds_are_checked_before_launch_in_one_line(registry, sections, message):
    with pytest.raises(PosttuneError) as error:
        resolve_plan(config(**sections), registry)
    assert str(error.value) == message


def test_a_method_may_read_several_kinds(registry):
    for fmt in ("chat", "preference"):
        plan = resolve_plan(config(method="both", models={}, data={"train": {"path": "d.jsonl", "format": fmt}}),
                            registry)
        assert plan.datasets["train"].descriptor.name == fmt


def test_a_kind_no_installed_format_gives_is_named_with_those_they_give(registry):
    """A method's misspelt kind registers (a plugin not installed yet may bring that kind); a run says so."""
    with pytest.raises(ConfigError) as caught:
        resolve_plan(config(method="misspelt", models={}), registry)
    assert str(caught.value).startswith(
        "config: data.train.format: 'chat' gives conversation rows; method 'misspelt' needs preferences rows (no "
        "installed format gives them: they give ")
    assert str(caught.value).endswith("; the method is posttune-roles 1.0) (did you mean 'preference'?)")


def test_the_old_kind_name_reads_as_the_new_one(registry):
    assert registry.get("dataset_format", "old_chat").kind == "conversation"
    assert Method("old", dict, "sft", data=noop, loss=noop).dataset_kinds == ("conversation",)
    plan = resolve_plan(config(data={"train": {"path": "d.jsonl", "format": "old_chat"}}), registry)
    assert plan.datasets["train"].descriptor.name == "old_chat"


# ---- the config: `models:`, the old spellings, the moved data keys -----------------------------------

def test_the_old_role_sections_are_read_as_models():
    old = validate({"model": TINY, "method": "x", "reference": TINY, "teacher": {"path": "t"}})
    assert set(old.models) == {"reference", "teacher"} and old.models["teacher"].path == "t"
    assert validate({"model": TINY, "method": "x", "reference": None, "teacher": None}).models == {}  # old config.yaml


@pytest.mark.parametrize("raw, message", [
    ({"reference": TINY, "models": {"reference": TINY}},
     "config: reference: given twice: `reference:` is the old spelling of `models.reference`; keep one"),
    ({"models": {"policy": TINY}},
     "config: models.policy: the policy is the `model:` section; models holds the method's others"),
    ({"models": {"critic": {"family": "fam"}}},
     "config: models.critic: set `path` (a checkpoint) or both `family` and `size` (random init)"),
    ({"data": {"train": {"path": "d.jsonl"}, "packing": True}}, "config: data.packing: moved: set method.packing"),
    ({"data": {"train": {"path": "d.jsonl"}, "padding_free": None}},
     "config: data.padding_free: moved: set method.padding_free"),
])
def test_config_shapes_that_cannot_be_read_are_one_line(raw, message):
    with pytest.raises(ConfigError) as error:
        validate({"model": TINY, "method": "x", **raw})
    assert str(error.value) == message


def test_overrides_reach_a_role_under_either_spelling(tmp_path):
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"model": TINY, "method": "x", "models": {"teacher": {"path": "a"}}}))
    assert load_config(new, ["teacher.path=b"])["models"] == {"teacher": {"path": "b"}}
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"model": TINY, "method": "x", "teacher": {"path": "a"}}))
    assert load_config(old, ["models.teacher.dtype=bf16"])["models"] == {"teacher": {"path": "a", "dtype": "bf16"}}
    assert load_config(old, ["~teacher"])["models"] == {}


def test_the_vocabulary_check_reads_no_hub_config(registry, monkeypatch):
    """Hub ids with their family named wait for the run (validate stays offline): so does this check."""
    import posttune.plan

    def no_hub(path):
        raise AssertionError(f"read {path}")

    monkeypatch.setattr(posttune.plan, "read_hf_config", no_hub)
    hub = {"family": "fam", "path": "org/model"}
    plan = resolve_plan(config(model=hub, models={"critic": hub}), registry)
    assert plan.roles["critic"].config.path == "org/model"
