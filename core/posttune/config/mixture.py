"""The datasets one data section reads: itself, or each of a mixture's (``data.train`` written as a list).

Below the schema so that the range checks (``posttune.config.ranges``, which the schema imports) name a
mixture's entries the way every other check does.
"""

from __future__ import annotations

from typing import Any


def dataset_sources(dataset: Any, where: str) -> list[tuple[str, Any]]:
    """``(field, dataset)`` for every dataset a data section (a ``DatasetConfig``) reads: itself, or each of
    a mixture's as ``data.train[i]``, which is how errors about it are named."""
    if not dataset.sources:
        return [(where, dataset)]
    return [(f"{where}[{i}]", source) for i, source in enumerate(dataset.sources)]
