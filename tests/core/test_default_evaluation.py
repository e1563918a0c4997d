"""The default evaluation runs the method's loss on the validation loader's batches as they come. A method whose
``batches`` makes its micro-batches out of what its loader gives (an online method's rollouts from prompts) and has
no ``evaluate`` of its own gets one line naming it and the remedy, not a traceback from inside its loss."""

from __future__ import annotations

import dataclasses

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_sft
import yaml
from posttune.plugin import hookimpl
from run_support import sft_config


class Wrapped:
    """Its loader gives ``{"rows": batch}``; ``batches`` unwraps them for the loss (as a method generating
    rollouts from prompt batches makes what its loss reads); no ``evaluate``."""

    POSTTUNE_PLUGIN_API = 2

    def __init__(self, with_evaluate: bool = False):
        self.with_evaluate = with_evaluate

    @hookimpl
    def posttune_register_methods(self, register):
        found = []
        posttune_sft.posttune_register_methods(found.append)
        sft = found[0]

        class Loader:
            def __init__(self, inner):
                self.inner = inner

            def __iter__(self):
                return ({"rows": batch} for batch in self.inner)

            def __len__(self):
                return len(self.inner)

        def data(session, dataset, split):
            return Loader(sft.data(session, dataset, split))

        def batches(session):
            return (item["rows"] for item in session.train_data)

        evaluate = (lambda session: {"answered": 1.0}) if self.with_evaluate else None
        register(dataclasses.replace(sft, name="wrapped", data=data, batches=batches, evaluate=evaluate))


def run(register_plugin, posttune_cli, tmp_path, **plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(Wrapped(**plugin), name="wrapped", distribution="wrapped-method", version="1")
    config = sft_config(tmp_path, method={"name": "wrapped"}, train={"max_steps": 2, "eval_every": 2})
    config["data"]["validation"] = dict(config["data"]["train"])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return posttune_cli("train", str(path))


def test_a_method_making_its_own_batches_without_evaluate_is_told_to_write_one(register_plugin, posttune_cli, tmp_path):
    result = run(register_plugin, posttune_cli, tmp_path)
    assert result.exit_code == 2
    assert result.stderr.endswith(
        "posttune: error: method 'wrapped' (wrapped-method 1): the default evaluation ran its loss on a batch of the "
        "validation loader, which raised KeyError: 'labels'; a method whose batches callback makes its micro-batches "
        "from what its loader gives needs an evaluate callback of its own (GRPO's answers the validation prompts and "
        "scores them)\n"), result.stderr


def test_with_its_own_evaluate_it_trains(register_plugin, posttune_cli, tmp_path):
    result = run(register_plugin, posttune_cli, tmp_path, with_evaluate=True)
    assert result.exit_code == 0, result.stderr
    assert "val_answered" in (tmp_path / "out" / "metrics.jsonl").read_text()
