"""Mesh dimensions are what the active plans declare (``MeshDim``): the mesh order, which ranks
the loaders shard by and which ranks sum their losses all follow the declarations, so a plan with
a dimension of its own needs no core change. Plans set options on each other (``adjusts``) and
say where parameters materialise (``init_device``) in their declarations too."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from posttune.config import validate
from posttune.descriptors import MeshDim, ParallelPlan
from posttune.errors import ConfigError
from posttune.plan import resolve_plan
from posttune.plugins import hookimpl
from posttune.registry import Registered
from posttune.training import distributed
from posttune.training.compose import init_device


def noop(*_args):
    return None


@dataclass(frozen=True)
class BodyOptions:
    width: int = 1
    depth: int = 1


def plugin_with(*plans: ParallelPlan):
    class Plans:
        POSTTUNE_PLUGIN_API = 2

        @hookimpl
        def posttune_register_parallel_plans(self, register):
            for plan in plans:
                register(plan)

    return Plans()


@pytest.fixture
def registry(fake_plugin, register_plugin, posttune_plugins):
    """The fake plugin (method fsft, family fam) plus plans of three made-up dimensions."""
    register_plugin(plugin_with(
        ParallelPlan("outer", noop, mesh_dim=MeshDim("rows", order=5, splits="batch")),
        ParallelPlan("experts", noop, mesh_dim=MeshDim("ep", order=15, splits="tokens")),
        ParallelPlan("body", noop, mesh_dim=MeshDim("w", order=40), config=BodyOptions),
        ParallelPlan("head", noop, adjusts={"body": {"width": 4}}),
        ParallelPlan("typo", noop, adjusts={"body": {"wdth": 4}}),
        ParallelPlan("rows_again", noop, mesh_dim=MeshDim("rows", order=6, splits="batch")),
        ParallelPlan("old_style", noop, mesh_dim="rows"),
    ), name="dims", distribution="posttune-dims", version="1.0")
    return posttune_plugins.registry


def resolve(registry, world: int, **parallel):
    raw = {"model": {"family": "fam", "size": "tiny"}, "method": "fsft", "tokenizer": {"path": "unused"},
           "data": {"train": {"path": "d.jsonl"}}, "parallel": parallel}
    return resolve_plan(validate(raw), registry, world_size=world)


def test_the_mesh_is_ordered_by_the_declared_order_whatever_the_listing(registry):
    plan = resolve(registry, 8, plans=["body", "experts", "outer"], dims={"w": 2, "ep": 2})
    assert list(plan.mesh.items()) == [("rows", 2), ("ep", 2), ("w", 2)]
    assert {name: dim.splits for name, dim in plan.mesh_dims.items()} == {"rows": "batch", "ep": "tokens",
                                                                         "w": "none"}
    assert list(plan.mesh_dims) == list(plan.mesh)


def test_plans_declaring_one_dimension_differently_are_refused(registry):
    with pytest.raises(ConfigError, match=r"parallel\.plans: plans 'outer' and 'rows_again' declare mesh dimension "
                                          r"'rows' differently; remove one"):
        resolve(registry, 2, plans=["outer", "rows_again"])


def test_a_mesh_dim_that_is_not_a_declaration_is_refused_naming_the_plan(registry):
    with pytest.raises(ConfigError, match=r"parallel\.plans: plan 'old_style' \(posttune-dims 1\.0\) declares "
                                          r"mesh_dim='rows'; expected MeshDim\(name, order, splits\)"):
        resolve(registry, 2, plans=["old_style"])


def test_a_misspelt_split_is_refused_where_the_plugin_declares_it():
    with pytest.raises(ValueError, match=r"MeshDim 'ep': splits must be one of batch, sequence, tokens, none, "
                                         r"not 'token'"):
        MeshDim("ep", order=15, splits="token")


def test_a_plan_sets_options_of_another_listed_plan(registry):
    assert resolve(registry, 2, plans=["body", "head"]).parallel_options["body"] == BodyOptions(width=4)
    same = resolve(registry, 2, plans=["body", "head"], options={"body": {"width": 4, "depth": 2}})
    assert same.parallel_options["body"] == BodyOptions(width=4, depth=2)
    assert resolve(registry, 2, plans=["body"]).parallel_options["body"] == BodyOptions()  # head not listed
    assert resolve(registry, 2, plans=["outer", "head"]).parallel_options == {}  # body not listed: nothing to set


def test_an_adjustment_the_config_contradicts_or_the_plan_does_not_take_is_refused(registry):
    with pytest.raises(ConfigError, match=r"^config: parallel\.options\.body\.width: plan 'head' \(posttune-dims "
                                          r"1\.0\) needs 4, not 3; remove this setting$"):
        resolve(registry, 2, plans=["body", "head"], options={"body": {"width": 3}})
    with pytest.raises(ConfigError, match=r"^config: parallel\.plans: plan 'typo' \(posttune-dims 1\.0\) sets "
                                          r"parallel\.options\.body\.wdth: unknown key \(did you mean 'width'\?\)$"):
        resolve(registry, 2, plans=["body", "typo"])


def registered(plan: ParallelPlan) -> Registered:
    return Registered(plan, "posttune-dims 1.0")


def test_parameters_materialise_where_the_plans_applied_to_a_model_say():
    offload = ParallelPlan("offload", noop, config=BodyOptions, frozen="skip",
                           init_device=lambda options: "cpu" if options.width > 1 else None)
    session = SimpleNamespace(device=torch.device("meta"), plan=SimpleNamespace(
        parallel=[registered(ParallelPlan("other", noop)), registered(offload)],
        parallel_options={"offload": BodyOptions(width=2)}, roles={}))
    policy, frozen = SimpleNamespace(role="policy", trainable=True), SimpleNamespace(role="teacher", trainable=False)
    assert init_device(session, policy) == "cpu"
    assert init_device(session, frozen) == torch.device("meta")  # the plan skips frozen roles
    session.plan.parallel_options["offload"] = BodyOptions(width=1)
    assert init_device(session, policy) == torch.device("meta")  # the plan says None: the run's device


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def session_on(dims: dict[str, MeshDim]):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,) * len(dims), mesh_dim_names=tuple(dims))
    return SimpleNamespace(mesh=mesh, plan=SimpleNamespace(mesh_dims=dims))


def test_loaders_shard_by_the_batch_dimensions_and_losses_sum_over_every_splitting_one(world_of_one):
    session = session_on({"rows": MeshDim("rows", 5, "batch"), "ep": MeshDim("ep", 15, "tokens"),
                          "seq": MeshDim("seq", 20, "sequence"), "w": MeshDim("w", 40)})
    assert distributed.split_mesh(session, ("batch",)).mesh_dim_names == ("rows",)
    assert distributed.token_mesh(session).mesh_dim_names == ("rows_ep_seq",)  # flattened, in mesh order
    assert distributed.data_rank(session) == (0, 1)
    group, size = distributed.token_group(session)
    assert group is not None and size == 1


def test_a_mesh_that_splits_no_data_has_one_data_rank_and_sums_nothing(world_of_one):
    session = session_on({"w": MeshDim("w", 40)})
    assert distributed.token_mesh(session) is None
    assert distributed.data_rank(session) == (0, 1)
    assert distributed.token_group(session) == (None, 1)


def test_without_a_mesh_the_process_is_its_own_data_rank():
    session = SimpleNamespace(mesh=None, plan=SimpleNamespace(mesh_dims={}))
    assert distributed.data_rank(session) == (0, 1)
    assert distributed.token_group(session) == (None, 1)


def test_a_rank_leaves_with_its_status_after_its_threads_atexit_handlers_and_buffered_output(tmp_path):
    """``exit_process`` skips only the interpreter's teardown (where a live mesh's gloo threads can abort a finished
    rank): what a process does as it exits still happens, in the order a normal exit does it."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import atexit, pathlib, sys, threading, time
        from posttune.training.distributed import exit_process
        done = pathlib.Path({str(tmp_path)!r})
        def late():
            time.sleep(0.3)
            (done / "thread").write_text("joined")
        threading.Thread(target=late).start()
        atexit.register(lambda: (done / "atexit").write_text((done / "thread").read_text()))
        sys.stdout.write("buffered, no newline")
        exit_process(3)
        raise AssertionError("exit_process returned")
    """)
    buffered = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=buffered)
    assert result.returncode == 3, result.stderr
    assert result.stdout == "buffered, no newline" and result.stderr == ""
    assert (tmp_path / "atexit").read_text() == "joined"  # the thread finished before the handlers ran
