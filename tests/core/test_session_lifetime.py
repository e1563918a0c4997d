"""A session the caller drops is freed at once, not at Python's next full collection."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOKENIZER = Path(__file__).resolve().parents[2] / "posttune_models/llama/posttune_llama/demo/tokenizer"

#: a fresh interpreter (torch._dynamo not yet imported, as in a new notebook), the cyclic collector off
SCRIPT = r'''
import gc, json, sys, weakref
gc.disable()
from posttune.config import validate
from posttune.plan import resolve_plan
from posttune.plugins import get_registry
from posttune.training.compose import compose

def first_model():
    session = compose(resolve_plan(validate(json.loads(sys.argv[1])), get_registry()))
    return weakref.ref(session.model), weakref.ref(session.optimizer)

refs = first_model()
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "alive": [ref() is not None for ref in refs]}))
'''


def test_the_first_composed_session_is_freed_when_dropped(tmp_path):
    """The first optimizer of a process imports torch._dynamo, and that import (torch.fx's ``wrap``) left a
    frame cycle holding ``compose``'s frame, so the first session lived on until a full collection."""
    pytest.importorskip("posttune_llama")
    pytest.importorskip("posttune_sft")
    row = {"messages": [{"role": "user", "content": "Reverse: AB"}, {"role": "assistant", "content": "BA"}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    config = {"model": {"family": "llama", "size": "tiny"}, "tokenizer": {"path": str(TOKENIZER)}, "method": "sft",
              "data": {"train": {"path": str(tmp_path / "d.jsonl"), "format": "chat"}}, "train": {"max_steps": 1},
              "checkpoint": {"output_dir": str(tmp_path / "out")}}
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(config)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"dynamo": True, "alive": [False, False]}
