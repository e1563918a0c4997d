"""`posttune preview CONFIG`: the first batch of a split as the run will read it, its trained tokens marked.

What a user checks before a long run (axolotl's ``preprocess --debug``): that the chat template rendered the
rows as expected and that the loss falls on the right tokens (responses, not prompts; each turn's end token).
An online method's (GRPO's) rows are prompts: they are shown as the policy will
see them. The run's own data path makes the batch (the method's ``data`` with the run's tokenizer, format, column map,
packing and truncation), so what is shown is what trains; no model is built. Labels are pre-shifted
(``labels[t]`` is the target of position ``t``), so token ``t + 1`` is marked trained where ``labels[t]`` is set.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from posttune.errors import PosttuneError

EXAMPLES = ("posttune preview my-run.yaml", "posttune preview llama-demo-reverse --rows 1 --split validation")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a YAML file or a bundled config name")
    parser.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides: a.b.c=value sets, ~a.b deletes")
    parser.add_argument("--rows", type=int, default=2, help="rows of the first batch to show (default: 2)")
    parser.add_argument("--split", choices=("train", "validation"), default="train",
                        help="which data to read (default: train, whose first batch is shuffled by train.seed)")
    parser.add_argument("--marks", choices=("auto", "color", "brackets"), default="auto",
                        help="how trained tokens are marked: green, or between [[ ]] (default: green on a terminal, "
                             "unless the NO_COLOR environment variable is set)")


def use_color(marks: str, stream: Any = None) -> bool:
    """``--marks``: ``color`` always colours; ``auto`` only on a terminal and where NO_COLOR (https://no-color.org)
    is absent or empty. An explicit option wins over NO_COLOR, as that convention asks."""
    stream = sys.stdout if stream is None else stream
    if marks != "auto":
        return marks == "color"
    return not os.environ.get("NO_COLOR") and stream.isatty()


def run(args: argparse.Namespace, resolve: Callable[[argparse.Namespace, int], Any]) -> int:
    """``resolve(args, world_size)``: the commands' config resolution (validate's checks), given by the caller."""
    from posttune.plugin import IGNORE_INDEX, pad_id
    from posttune.session import Session
    from posttune.training.compose import load_tokenizer

    if args.rows < 1:
        raise PosttuneError(f"preview: --rows must be at least 1, got {args.rows}")
    plan = resolve(args, 1)
    config = plan.config
    dataset = config.data.train if args.split == "train" else config.data.validation
    if dataset is None:
        raise PosttuneError("preview: --split validation: the config has no data.validation")
    session = Session(config, plan, method_config=plan.method_config)
    session.tokenizer = load_tokenizer(session)
    batch = next(iter(plan.method.descriptor.data(session, dataset, args.split)), None)
    if isinstance(batch, Mapping) and "prompt_ids" in batch:  # the toolkit's prompt batches (prompt_loader)
        for number, ids in enumerate(list(batch["prompt_ids"])[:args.rows], 1):
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            print(f"== prompt {number}: {len(ids)} tokens (the completions are sampled as the run trains) ==")
            print(session.tokenizer.decode(ids, skip_special_tokens=False))
        return 0
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise PosttuneError(f"preview: method '{plan.method.descriptor.name}' gives batches without input_ids; "
                            "nothing to show")
    color = use_color(args.marks)
    samples = rows_of(batch, pad_id(session.tokenizer))
    if batch.get("document_ids") is not None:  # packed or padding-free: the batch's rows hold samples end to end
        shape = tuple(batch["input_ids"].shape)
        print(f"== the batch: {shape[0]} row(s) of {shape[1]} tokens, holding {len(samples)} samples end "
              f"to end (attention stays within each); each sample is shown below as a row ==")
    for number, (ids, labels, shared) in enumerate(samples[:args.rows], 1):
        trained = [False] + [label != IGNORE_INDEX for label in labels[:-1]]
        after = ", after the prompt shown above (computed once)" if shared else ""
        print(f"== row {number}: {len(ids)} tokens{after}, {sum(trained)} trained "
              f"({'marked green' if color else 'marked by double brackets'}) ==")
        print(marked(session.tokenizer, ids, trained, color))
    if args.rows > len(samples):  # a preview shows the first batch; the run's data summary counts all of it
        print(f"== the first batch holds {len(samples)} samples (--rows {args.rows} asks for more): train.batch_size "
              "sets how many; posttune train's banner and summary count the whole dataset ==")
    return 0


def rows_of(batch: Mapping[str, Any], pad: int) -> list[tuple[list[int], list[int], bool]]:
    """(ids, labels, whether it continues a prompt shown before it) of each sample of a batch: a padded row less
    its padding, or each document of a row of documents end to end (packing, padding-free; a document whose
    positions do not start at 0 continues a shared prompt, as DPO's rejected response does); a packed row's
    padding to ``max_seq_len`` is no sample."""
    from posttune.plugin import IGNORE_INDEX as IGNORE

    ids, labels = batch["input_ids"].tolist(), batch.get("labels")
    labels = labels.tolist() if labels is not None else [[IGNORE] * len(row) for row in ids]
    documents, positions = batch.get("document_ids"), batch.get("positions")
    out = []
    for index, (row, targets) in enumerate(zip(ids, labels, strict=True)):
        if documents is None:
            while len(row) > 1 and row[-1] == pad and targets[-1] == IGNORE and targets[-2] == IGNORE:
                row, targets = row[:-1], targets[:-1]
            out.append((row, targets, False))
            continue
        owners = documents[index].tolist()
        for document in dict.fromkeys(owners):
            kept = [i for i, owner in enumerate(owners) if owner == document]
            shared = positions is not None and int(positions[index][kept[0]]) > 0
            sample, sample_targets = [row[i] for i in kept], [targets[i] for i in kept]
            if set(sample) == {pad} and set(sample_targets) == {IGNORE}:  # a packed row's padding, no sample
                continue
            out.append((sample, sample_targets, shared))
    return out


def marked(tokenizer: Any, ids: list[int], trained: list[bool], color: bool) -> str:
    """The row's text, decoded a run of equally marked tokens at a time, trained runs marked."""
    pieces, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or trained[end] != trained[start]:
            text = tokenizer.decode(ids[start:end], skip_special_tokens=False)
            if trained[start]:
                text = f"\033[32m{text}\033[0m" if color else f"[[{text}]]"
            pieces.append(text)
            start = end
    return "".join(pieces)


HELP = "show the first rows of a config's data as the run reads them, trained tokens marked"
