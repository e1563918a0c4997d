"""A generation engine as a third party writes one: ``recorder``, the core's ``builtin`` engine with a
log of every call made to it.

    method: {name: grpo, engine: recorder, engine_options: {log: /tmp/engine.jsonl}}

Each event (start, generate, update, close) is appended to ``log`` as one JSON line, with the
process id and the weight version the engine held, so a test can see which engine a method
chose by name, what it asked of it and that it was closed. It uses the public surface only: the
``GenerationEngine`` descriptor with an options dataclass, the ``EnginePolicy`` it is started on,
``Sampling``, and ``lookup`` to start the engine it wraps. A real one (vLLM) would hold its own
copy of the weights: load ``policy.source`` or take ``update_weights``' state dicts, and refresh
from ``policy.model`` when ``update_weights(None, version)`` says the live policy moved on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttune.plugin import Completions, EnginePolicy, GenerationEngine, Sampling, lookup

NAME = "recorder"


@dataclass(frozen=True)
class RecorderOptions:
    """``method.engine_options`` for the recorder."""

    log: str  # the JSON-lines file each event is appended to (several processes may share it)


class Recorder:
    """The protocol (``GenerationEngine``): ``generate``, ``update_weights``, ``version``, ``close``."""

    def __init__(self, policy: EnginePolicy):
        self.log = Path(policy.options.log)
        self.inner = lookup("generation_engine", "builtin").start(policy)
        self._write("start", live=policy.model is not None)

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 seeds: Sequence[int] | None = None) -> Completions:
        self._write("generate", rows=len(prompts), temperature=sampling.temperature, seeded=seeds is not None)
        return self.inner.generate(prompts, sampling, seeds)

    def update_weights(self, weights: Mapping[str, Any] | None, version: int) -> None:
        self.inner.update_weights(weights, version)
        self._write("update", weights=weights is not None)

    def close(self) -> None:
        self.inner.close()
        self._write("close")

    def _write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "pid": os.getpid(), "version": self.inner.version, **fields}
        with self.log.open("a") as out:
            out.write(json.dumps(record) + "\n")


def register_generation_engines(register: Any) -> None:
    register(GenerationEngine(NAME, Recorder, config=RecorderOptions,
                              description="the builtin engine, logging each call to engine_options.log (test)"))
