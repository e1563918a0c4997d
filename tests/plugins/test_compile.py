"""compile: compiled training logs the eager run's losses, recompilation stays bounded, refusals.

The full runs use the inductor backend (C++ codegen on CPU: slow to compile, hence ``slow``)
with every batch padded to one length, so each run compiles one graph per function. The
recompilation tests count Dynamo's graphs with the ``eager`` backend: how many graphs Dynamo
captures does not depend on the backend that turns them into code.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_memory
import posttune_sft
import pytest
import torch
import yaml
from memory_support import batch, compose_run, fake_session, sft_config, tiny_llama
from posttune_memory import CompileConfig
from posttune_memory.compile import apply, expected_graphs, raise_recompile_limit
from posttune.training.metrics import read_metrics
from posttune.training.trainer import train
from torch._dynamo.utils import counters

#: every batch of the tiny SFT data padded to a multiple of max_seq_len (48): few shapes (SFT's padding-free
#: rows hold a whole batch: 2 x 48 at most)
ONE_SHAPE = {"pad_to_multiple_of": 48}
TRAIN = {"max_steps": 5}
LORA = {"kind": "lora", "rank": 4, "alpha": 8, "dropout": 0.0}


@pytest.fixture
def llama_sft(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_memory, distribution="posttune-memory", version="0.1.0")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test counts its own graphs, and no compiled code outlives it."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def trained(config: dict) -> tuple[list[dict], object]:
    """The run's metric records (one per step) and its session, after training through the real loop."""
    session = compose_run(config)
    train(session)
    return read_metrics(session.config.checkpoint.output_dir), session


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


# ---- compiled runs give the eager run's losses -----------------------------------------------------

@pytest.mark.slow
# the default run compiles the plain model; tox -e extended every variant
@pytest.mark.parametrize("variant", ["plain", *(pytest.param(v, marks=pytest.mark.extended)
                                                for v in ("activation_checkpointing", "lora", "dora", "packed"))])
def test_compiled_training_logs_the_losses_of_the_eager_run(llama_sft, tmp_path, variant):
    sections: dict = {"method": {"packing": True}} if variant == "packed" else {"data": ONE_SHAPE}
    sections["train"] = TRAIN
    memory = []
    if variant == "activation_checkpointing":  # padded rows: the checkpointed layer is one graph
        memory, sections["method"] = ["activation_checkpointing"], {"padding_free": False}
    if variant in ("lora", "dora"):
        sections["adapter"] = {**LORA, "kind": variant}
    eager, _ = trained(sft_config(tmp_path / "eager", memory=memory, **sections))
    assert graphs() == 0
    compiled, session = trained(sft_config(tmp_path / "compiled", memory=[*memory, "compile"], **sections))
    assert all(getattr(layer, "compiled", False) for layer in session.model.layers)
    assert session.loss_kernel is not None and session.loss_kernel.name == "compile"
    assert graphs() >= 2  # the layer graph (shared by both layers) and the loss graph
    assert len(compiled) == len(eager) == 5
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], abs=1e-5, rel=0)
    # the same gradients, so the same updates: the steps after the first see the same weights
    assert [r["grad_norm"] for r in compiled] == pytest.approx([r["grad_norm"] for r in eager], rel=1e-4)
    assert len({r["loss"] for r in compiled}) == 5  # five different steps, not one repeated value


def test_compile_keeps_parameter_names_and_chunked_cross_entropy_keeps_its_kernel(llama_sft, tmp_path):
    plain = compose_run(sft_config(tmp_path / "a", data=ONE_SHAPE))
    session = compose_run(sft_config(tmp_path / "b", data=ONE_SHAPE, memory=["compile", "chunked_cross_entropy"]))
    assert list(session.model.state_dict()) == list(plain.model.state_dict())
    assert all(layer.compiled for layer in session.model.layers)
    # the loss stage runs after parallelize: its kernel replaces the compiled plain loss
    assert session.loss_kernel.name == "chunked_cross_entropy"
    assert graphs() == 0  # nothing is compiled before the first training call


def test_forwards_without_gradients_run_eagerly(llama_sft, tmp_path):
    session = compose_run(sft_config(tmp_path, data=ONE_SHAPE, memory_options={"compile": {"backend": "eager"}},
                                     memory=["compile"]))
    ids = torch.randint(3, 300, (2, 48))
    with torch.no_grad():
        session.model(ids)
    assert graphs() == 0  # evaluation, generation and frozen references never compile
    session.model(ids).sum().backward()
    assert graphs() == 1


def test_the_compiled_loss_kernel_gives_the_plain_losses_and_logps():
    """The kernel DPO and GRPO reach through ``token_logps`` (temperature, no-grad reference calls) and
    SFT through ``token_cross_entropy``: the same values and gradients as the core's plain path."""
    from posttune.losses import token_cross_entropy, token_logps

    model = tiny_llama()
    plain = fake_session(model)
    session = fake_session(model, compile=CompileConfig(backend="aot_eager", dynamic=False))
    session.config = run_config(max_seq_len=24, pad_to_multiple_of=24)
    apply(session, session.target)
    assert session.loss_kernel.name == "compile"
    data = batch(seq=24)
    for temperature in (1.0, 0.7):
        torch.testing.assert_close(token_logps(session, data, temperature=temperature),
                                   token_logps(plain, data, temperature=temperature), atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(token_logps(session, data), token_logps(plain, data), atol=1e-5, rtol=0)
        # the kernel computes no entropies: GRPO's high-entropy selection takes the plain path's, logps included
        torch.testing.assert_close(token_logps(session, data, temperature=0.7, entropies=True),
                                   token_logps(plain, data, temperature=0.7, entropies=True), atol=1e-5, rtol=0)
    (loss, count), (expected, expected_count) = token_cross_entropy(session, data), token_cross_entropy(plain, data)
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=0)
    assert count == expected_count
    assert graphs() >= 3  # layers, logps (one graph per temperature), the summed loss


def head_rows(model: torch.nn.Module) -> list[int]:
    """The number of positions each later call of ``model``'s head receives (a forward hook)."""
    seen: list[int] = []
    model.output.register_forward_hook(lambda module, args, out: seen.append(args[0].flatten(0, -2).shape[0]))
    return seen


def test_the_compiled_loss_reaches_the_head_with_labelled_positions_only_and_one_graph_for_every_count():
    """As the plain path: only labelled positions reach the head (the prompts' logits are never made),
    the loss and gradients equal the plain path's, and a new labelled count compiles nothing new
    although the layers use static shapes."""
    from posttune.losses import token_cross_entropy, token_logps

    model, reference = tiny_llama(), tiny_llama()
    session = fake_session(model, compile=CompileConfig(backend="aot_eager", dynamic=False))
    session.config = run_config(max_seq_len=24, pad_to_multiple_of=24)
    apply(session, session.target)
    seen = head_rows(model)
    counts = []
    for seed in range(4):
        data = batch(seq=24, seed=seed)
        data["labels"][:, : 8 + seed] = -100  # another prompt length each batch: another labelled count
        counts.append(int((data["labels"] != -100).sum()))
        loss, _ = token_cross_entropy(session, data)
        expected, _ = token_cross_entropy(fake_session(reference), data)
        torch.testing.assert_close(loss, expected, atol=1e-4, rtol=0)
        loss.backward()
        expected.backward()
        for (name, param), other in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(param.grad, other.grad, atol=1e-5, rtol=1e-4, msg=name)
        if seed == 0:
            after_first = graphs()
    assert seen == counts and len(set(counts)) == 4  # the head saw exactly the labelled positions
    assert graphs() == after_first  # the layers' one shape and the loss's symbolic count: nothing new
    seen.clear()
    data = batch(seq=24)
    logps = token_logps(session, data, temperature=0.7)
    assert seen == [int((data["labels"] != -100).sum())]
    assert logps.shape == data["labels"].shape and bool((logps[data["labels"] == -100] == 0).all())
    torch.testing.assert_close(logps, token_logps(fake_session(reference), data, temperature=0.7), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("mode", "loss_mode"), [(None, None), ("reduce-overhead", None),
                                                ("max-autotune", "max-autotune-no-cudagraphs"),
                                                ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs")])
def test_the_loss_compiles_with_symbolic_shapes_and_without_cuda_graphs(mode, loss_mode):
    """CUDA graphs record a graph per shape, and the loss's labelled count changes every batch."""
    from posttune_memory.compile import compiler

    options = CompileConfig(dynamic=False, backend="inductor", mode=mode)
    layers, loss = compiler(options).keywords, compiler(options, loss=True).keywords
    assert layers["dynamic"] is False and layers.get("mode") == mode
    assert loss["dynamic"] is True and loss.get("mode") == loss_mode and loss["backend"] == "inductor"


# ---- recompilation -----------------------------------------------------------------------------------

def varying_batches(count: int = 20, multiple: int | None = None, seed: int = 0) -> list[torch.Tensor]:
    """``count`` batches of 9..120 tokens (rows 2, every 7th batch 1 row: a short last batch)."""
    rng, out = random.Random(seed), []
    for index in range(count):
        length = rng.randint(9, 120)
        if multiple:
            length = -(-length // multiple) * multiple
        out.append(torch.randint(3, 500, (1 if index % 7 == 0 else 2, length)))
    return out


def run_config(max_seq_len: int = 128, pad_to_multiple_of: int | None = 64, batch_size: int = 2) -> SimpleNamespace:
    """The part of a RunConfig ``apply`` reads."""
    return SimpleNamespace(data=SimpleNamespace(max_seq_len=max_seq_len, pad_to_multiple_of=pad_to_multiple_of),
                           train=SimpleNamespace(batch_size=batch_size))


def compiled_tiny(options: CompileConfig, layers: int = 3) -> torch.nn.Module:
    """A tiny Llama with ``apply`` run on it (the loss kernel goes to the fake session, unused here)."""
    model = tiny_llama(num_layers=layers)
    session = fake_session(model, compile=options)
    session.config = run_config()
    apply(session, session.target)
    return model


def test_static_shapes_compile_once_per_length_bucket_shared_by_every_layer():
    model = compiled_tiny(CompileConfig(backend="eager", dynamic=False))
    batches = varying_batches(multiple=64)
    shapes = {tuple(ids.shape) for ids in batches}
    for ids in batches:
        model(ids).sum().backward()
    assert len(shapes) == 3  # (1, 128), (2, 64), (2, 128)
    assert graphs() == len(shapes)  # 20 batches, 3 layers: one graph per shape, not per layer or batch


def test_static_shapes_without_buckets_recompile_per_length():
    """Why validate asks for buckets (or packing, or dynamic: true): unpadded lengths give a graph per
    length, until Dynamo's limit (8) gives up and runs the rest eagerly."""
    model = compiled_tiny(CompileConfig(backend="eager", dynamic=False), layers=2)
    batches = varying_batches()
    for ids in batches:
        model(ids).sum().backward()
    assert len({tuple(ids.shape) for ids in batches}) > 8
    assert graphs() == torch._dynamo.config.recompile_limit == 8


def graphs_after_each(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[int]:
    """Train on each batch (forward and backward); Dynamo's graph count after each."""
    history = []
    for data in batches:
        model(data["input_ids"], document_ids=data.get("document_ids")).sum().backward()
        history.append(graphs())
    return history


def test_dynamic_shapes_stop_compiling_after_the_first_batches():
    model = compiled_tiny(CompileConfig(backend="eager", dynamic=True), layers=2)
    batches = [{"input_ids": ids} for ids in varying_batches()]
    history = graphs_after_each(model, batches)
    assert len({tuple(b["input_ids"].shape) for b in batches}) > 12
    # symbolic lengths: once a 1-row and a 2-row batch were seen, no new length compiles anything
    assert history[-1] == history[8] > 0


def packed_batches(count: int = 20, length: int = 128, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Packed rows of ``length`` tokens, 4 documents each at random boundaries (every 7th batch 1 row)."""
    rng, out = random.Random(seed), []
    for index in range(count):
        rows = 1 if index % 7 == 0 else 2
        document_ids = torch.zeros(rows, length, dtype=torch.long)
        for row in range(rows):
            for cut in sorted(rng.sample(range(1, length), 3)):
                document_ids[row, cut:] += 1
        out.append({"input_ids": torch.randint(3, 500, (rows, length)), "document_ids": document_ids})
    return out


def test_packed_rows_compile_once_per_shape_whatever_their_documents():
    model = compiled_tiny(CompileConfig(backend="eager", dynamic=False), layers=2)
    history = graphs_after_each(model, packed_batches())
    # the per-document attention is kept out of the graph (a graph break), but new document layouts
    # never recompile: the graphs of the first 1-row and 2-row batches serve all 20
    assert history[-1] == history[1] > 0


def test_the_recompile_limit_is_raised_to_the_number_of_buckets():
    config = run_config(max_seq_len=2048, batch_size=4)
    # a padding-free row holds up to 4 x 2048 tokens: 128 buckets of 64, each for a full and a last batch
    assert expected_graphs(config, CompileConfig(dynamic=False)) == 256
    assert expected_graphs(config, CompileConfig(dynamic=True)) is None
    assert expected_graphs(run_config(), CompileConfig(dynamic=False), fixed_rows=True) == 2
    with torch._dynamo.config.patch(recompile_limit=8):  # restored afterwards, for the other tests
        raise_recompile_limit(config, CompileConfig(dynamic=False))
        assert torch._dynamo.config.recompile_limit == 256
        raise_recompile_limit(run_config(), CompileConfig(dynamic=False))
        assert torch._dynamo.config.recompile_limit == 256  # never lowered


# ---- refusals before launch ------------------------------------------------------------------------

def validate(posttune_cli, tmp_path, **sections):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(sft_config(tmp_path, **sections)))
    return posttune_cli("validate", str(path))


@pytest.mark.parametrize(("sections", "field", "words"), [
    ({"memory": ["compile"], "memory_options": {"compile": {"dynamic": False}}}, "data.pad_to_multiple_of",
     "compiles once per padded length"),
    ({"memory": ["compile"], "data": ONE_SHAPE, "memory_options": {"compile": {"backend": "no_such_backend"}}},
     "memory_options.compile.backend", "unknown torch.compile backend 'no_such_backend'"),
    ({"memory": ["compile"], "data": ONE_SHAPE, "memory_options": {"compile": {"mode": "fastest"}}},
     "memory_options.compile.mode", "got 'fastest'"),
    ({"memory": ["compile"], "data": ONE_SHAPE, "memory_options": {"compile": {"mode": "default",
                                                                               "backend": "eager"}}},
     "memory_options.compile.mode", "modes are inductor's"),
    ({"memory": ["compile"], "data": ONE_SHAPE, "memory_options": {"compile": {"mode": "reduce-overhead"}}},
     "memory", "'compile' needs a CUDA device"),
    ({"memory": ["activation_checkpointing", "activation_offloading", "compile"], "data": ONE_SHAPE},
     "memory", "compile"),
    ({"memory": ["activation_checkpointing", "compile"], "method": {"packing": True}},
     "method.packing", "packed attention breaks the graph inside the checkpointed layer"),
    ({"memory": ["activation_checkpointing", "compile"], "data": ONE_SHAPE},
     "method.padding_free", "needs padded rows of few lengths (method.packing and method.padding_free false, "
                            "data.pad_to_multiple_of set"),
    ({"memory": ["activation_checkpointing", "compile"], "method": {"padding_free": False},
      "memory_options": {"compile": {"dynamic": True}}},
     "memory_options.compile.dynamic", "must be false with compile and activation_checkpointing"),
    ({"memory": ["activation_checkpointing", "compile"], "memory_options": {"compile": {"dynamic": None}},
      "method": {"padding_free": False}}, "data.pad_to_multiple_of: must be set with compile and",
     "data.pad_to_multiple_of set, memory_options.compile.dynamic not true"),
    ({"memory": ["compile"], "method": {"packing": True}, "memory_options": {"compile": {"fullgraph": True}}},
     "memory_options.compile.fullgraph", "must be false with rows of documents"),
])
def test_impossible_settings_are_refused_in_one_line(llama_sft, posttune_cli, tmp_path, sections, field, words):
    result = validate(posttune_cli, tmp_path, **sections)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.stderr
    assert len(lines) == 1 and field in lines[0] and words in lines[0], lines


def test_offloading_and_compile_name_each_other(llama_sft, posttune_cli, tmp_path):
    result = validate(posttune_cli, tmp_path, memory=["activation_checkpointing", "activation_offloading", "compile"],
                      data=ONE_SHAPE)
    assert "activation_offloading" in result.stderr and "compile" in result.stderr


@pytest.mark.parametrize("sections", [{"data": ONE_SHAPE}, {"method": {"packing": True}}])
def test_bucketed_or_packed_data_and_dynamic_shapes_are_accepted(llama_sft, posttune_cli, tmp_path, sections):
    assert validate(posttune_cli, tmp_path, memory=["compile"], **sections).exit_code == 0
    assert validate(posttune_cli, tmp_path / "auto", memory=["compile"]).exit_code == 0  # dynamic by default
    assert validate(posttune_cli, tmp_path / "d", memory=["compile"],
                    memory_options={"compile": {"dynamic": True}}).exit_code == 0
