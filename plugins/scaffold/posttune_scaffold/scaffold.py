"""`posttune new plugin`: write a ready-to-install third-party plugin distribution.

The templates live next to this module (``templates/<kind>/`` plus ``templates/common/``) and
are package data, so the command works from a wheel. Kinds whose bundled config builds a
model from scratch also get ``templates/tokenizer/``: a tiny byte-level BPE tokenizer with a
ChatML template (384 ids, made by ``posttune.plugin.save_tiny_tokenizer(
template="chatml")``; a test keeps the copy identical), so the config trains with no download.

A file ending in ``.j2`` is rendered with jinja2 (``StrictUndefined``: a misspelt variable fails
here, not in the user's plugin); any other file is copied byte for byte (the tokenizer). In
paths, ``__package__``, ``__name__`` and ``__dashed__`` become the package name, the plugin name
and its dashed spelling, and a ``dot-`` prefix becomes ``.``. Template files carry ``.j2`` so
that neither pytest nor a linter mistakes them for the core's own modules. The example data
(string reversal) is generated here, deterministically.

``templates/common/`` gives every kind the release metadata PyPI needs (the first-party
distributions carry the same: an SPDX licence with its LICENSE file, classifiers, keywords,
authors, project URLs); what only the author knows (their name, their repository) is a
``PLACEHOLDERS`` value containing "TODO", which the pyproject's header tells them to grep for.

Importing this module does not import torch: ``posttune --help`` stays fast.
"""

from __future__ import annotations

import datetime
import json
import keyword
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from posttune.plugin import PosttuneError

TEMPLATES = Path(__file__).parent / "templates"
SUFFIX = ".j2"


@dataclass(frozen=True)
class ScaffoldKind:
    """What `posttune new plugin --kind KIND` writes: the hook it implements and its example data."""

    name: str
    registry_kind: str  # the registry key a clash is checked against
    about: str  # one line for --help and the README
    data: tuple[str, ...] = ()  # example data files, each made by DATA_MAKERS
    tokenizer: bool = False  # ships templates/tokenizer/ (its bundled config builds a model from scratch)


KINDS: dict[str, ScaffoldKind] = {kind.name: kind for kind in (
    ScaffoldKind("family", "model_family", "a model family (a small decoder from posttune.modules) and its HF "
                 "checkpoint converter", ("train.jsonl", "validation.jsonl"), tokenizer=True),
    ScaffoldKind("method", "method", "a training method (token cross-entropy with label smoothing and z-loss) "
                 "that builds its own loader", ("train.jsonl", "validation.jsonl"), tokenizer=True),
    ScaffoldKind("preference", "method", "a preference method (IPO: a squared loss on the margin of chosen over "
                 "rejected log probability ratios to a frozen reference model)",
                 ("prefs_train.jsonl", "prefs_validation.jsonl"), tokenizer=True),
    ScaffoldKind("online", "method", "an online RL method (RLOO: REINFORCE with the mean reward of the prompt's "
                 "other completions as baseline; sampled with a generation engine, scored by GRPO's rewards)",
                 ("prompts_train.jsonl", "prompts_validation.jsonl")),
    ScaffoldKind("reward", "reward_function", "a reward function for GRPO (partial credit per matching "
                 "character), with options", ("prompts_train.jsonl", "prompts_validation.jsonl")),
    ScaffoldKind("dataset", "dataset_format", "a dataset format (question/answer rows with an optional "
                 "context) for SFT-style methods", ("qa_train.jsonl",), tokenizer=True),
    ScaffoldKind("command", "command", "a `posttune` subcommand (a summary of a run's metrics.jsonl)"),
    ScaffoldKind("technique", "memory_technique", "a memory technique (freeze the embedding and the first decoder "
                 "layers: no gradients or optimizer state for them), with options"),
    ScaffoldKind("plan", "parallel_plan", "a parallel plan (plain data parallelism: a whole model per rank, "
                 "gradients averaged over a mesh dimension of its own), with options"),
    ScaffoldKind("tracker", "metric_logger", "an experiment tracker (each metrics record as a line of a JSON-lines "
                 "file, trimmed on resume), with options"),
)}

#: What only the plugin's author knows, written where a release needs it (pyproject.toml, LICENSE):
#: each holds "TODO" so that `grep -rn TODO pyproject.toml LICENSE` finds them before publishing.
PLACEHOLDERS = {"author": "TODO: your name", "account": "TODO-your-account"}

NAME_RULE = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class Names:
    """The spellings of one plugin name: ``my-thing`` -> posttune-my-thing / posttune_my_thing / my_thing."""

    name: str  # the registered name and entry-point name (an identifier)
    distribution: str  # posttune-my-thing
    package: str  # posttune_my_thing
    camel: str  # MyThing, for class-like names (HF architectures)
    dashed: str  # my-thing, for bundled config names


def plugin_names(raw: str) -> Names:
    """Validate NAME: after '-' -> '_' it must be a lowercase Python identifier (it names a package)."""
    name = raw.replace("-", "_")
    if name.startswith("posttune_"):
        raise PosttuneError(f"plugin name {raw!r}: give it without the 'posttune-' prefix (the distribution "
                            f"becomes posttune-{raw[len('posttune-'):]})")
    if keyword.iskeyword(name):
        raise PosttuneError(f"plugin name {raw!r}: a Python keyword cannot name a package; choose another name")
    if not NAME_RULE.fullmatch(name) or name.endswith("_"):
        raise PosttuneError(f"plugin name {raw!r}: expected lowercase letters, digits, '-' or '_', starting with a "
                            f"letter (it must be a Python identifier once '-' becomes '_'), e.g. 'my-method'")
    return Names(name=name, distribution=f"posttune-{name.replace('_', '-')}", package=f"posttune_{name}",
                 camel="".join(part.capitalize() for part in name.split("_") if part), dashed=name.replace("_", "-"))


def scaffold(kind: str, raw_name: str, parent: Path) -> tuple[Path, list[Path]]:
    """Write ``parent/posttune-NAME/`` for ``kind``; return the folder and the files written (relative)."""
    if kind not in KINDS:
        raise PosttuneError(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    names = plugin_names(raw_name)
    above = next((p for p in (parent, *parent.parents) if p.exists()), None)  # a file on the way: not a folder
    if above is not None and not above.is_dir():
        raise PosttuneError(f"{above}: not a directory")
    root = parent / names.distribution
    if root.exists():
        raise PosttuneError(f"{root} exists; remove it or choose another name or -o DIR (nothing was written)")
    files = _render_all(KINDS[kind], names)
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return root, sorted(files)


def _render_all(kind: ScaffoldKind, names: Names) -> dict[Path, bytes]:
    """Every file of the new distribution, in memory first: a template error leaves nothing half-written."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, autoescape=False)
    variables = {"kind": kind.name, "about": kind.about, "name": names.name, "distribution": names.distribution,
                 "package": names.package, "camel": names.camel, "dashed": names.dashed, "data_files": kind.data,
                 "posttune_requirement": posttune_requirement(), "label": kind.registry_kind.replace("_", " "),
                 # the online kind scores with posttune-grpo's API: the same minor series as the core
                 "grpo_requirement": posttune_requirement().replace("posttune", "posttune-grpo", 1),
                 "tokenizer": kind.tokenizer, "year": datetime.date.today().year, **PLACEHOLDERS}
    files: dict[Path, bytes] = {}
    folders = [(TEMPLATES / "common", Path()), (TEMPLATES / kind.name, Path())]
    if kind.tokenizer:  # a config that builds a model from scratch needs a tokenizer; this one ships inside
        folders.append((TEMPLATES / "tokenizer", Path(names.package) / "tokenizer"))
    for folder, into in folders:
        for source in sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            relative = into / (str(source.relative_to(folder)).replace("__package__", names.package)
                               .replace("__name__", names.name).replace("__dashed__", names.dashed))
            if relative.name.startswith("dot-"):  # dot-gitignore.j2 -> .gitignore (package data skips dotfiles)
                relative = relative.with_name("." + relative.name[len("dot-"):])
            if source.suffix == SUFFIX:
                text = env.from_string(source.read_text(encoding="utf-8")).render(**variables)
                files[relative.with_suffix("")] = text.encode("utf-8")
            else:
                files[relative] = source.read_bytes()
    for file in kind.data:
        rows = DATA_MAKERS[file]()
        files[Path(names.package) / "data" / file] = "".join(json.dumps(row) + "\n" for row in rows).encode()
    return files


def posttune_requirement() -> str:
    """The range of posttune versions a new plugin accepts: this release's minor series (0.1.x -> >=0.1,<0.2)."""
    from posttune import __version__

    major, minor = (int(part) for part in __version__.split(".")[:2])
    upper = f"{major}.{minor + 1}" if major == 0 else f"{major + 1}"
    return f"posttune>={major}.{minor},<{upper}"


# ---- example data: reversing strings of capital letters, learnable by a tiny model in minutes ----

def _words(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(3, 6))) for _ in range(count)]


def _chat(count: int, seed: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Reverse: {word}"},
                          {"role": "assistant", "content": word[::-1]}]} for word in _words(count, seed)]


def _prompts(count: int, seed: int) -> list[dict]:
    return [{"prompt": f"Reverse: {word}", "answer": word[::-1]} for word in _words(count, seed)]


def _pairs(count: int, seed: int) -> list[dict]:
    """Preference rows: the reversal is chosen over the word copied unchanged. Palindromes are left
    out: their two responses would be the same, a pair with nothing to prefer."""
    words = [word for word in _words(2 * count, seed) if word != word[::-1]][:count]
    return [{"prompt": f"Reverse: {word}", "chosen": word[::-1], "rejected": word} for word in words]


def _qa(count: int, seed: int) -> list[dict]:
    rows = []
    for index, word in enumerate(_words(count, seed)):
        row = {"question": f"What is {word} written backwards?", "answer": word[::-1]}
        if index % 2:  # half the rows carry the optional context
            row["context"] = "Answer with the reversed letters only."
        rows.append(row)
    return rows


DATA_MAKERS: dict[str, Callable[[], list[dict]]] = {
    "train.jsonl": lambda: _chat(512, seed=0),
    "validation.jsonl": lambda: _chat(32, seed=1),
    "prompts_train.jsonl": lambda: _prompts(256, seed=0),
    "prompts_validation.jsonl": lambda: _prompts(32, seed=1),
    "qa_train.jsonl": lambda: _qa(256, seed=0),
    "prefs_train.jsonl": lambda: _pairs(32, seed=0),  # few: the bundled config fits them (see its comment)
    "prefs_validation.jsonl": lambda: _pairs(16, seed=1),
}
