"""Read and write the tokenizer files of a checkpoint folder, with transformers 5's precedence rules.

What transformers does, and so what we do (it is the reference the ids must match):
- ``tokenizer.json`` is the whole pipeline; when it exists, ``add_bos_token``/``add_eos_token`` in
  ``tokenizer_config.json`` are ignored (transformers 5 pops them): the post-processor decides.
- Named special tokens (``bos_token``...) and ``added_tokens_decoder`` entries missing from
  ``tokenizer.json`` are added as added tokens, so they are never split.
- ``special_tokens_map.json`` is read only when the config has no ``added_tokens_decoder``, and
  then its entries win over the config's.
- ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` win over a ``chat_template``
  entry in the config, which is a string or a list of ``{"name", "template"}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from posttune.errors import PosttuneError, first_line

if TYPE_CHECKING:  # posttune.tokenizer imports this module, never the other way round
    from posttune.tokenizer import Tokenizer

NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"


@dataclass(frozen=True)
class TokenizerFiles:
    """What a checkpoint folder's tokenizer files hold, read and checked (``Tokenizer`` is built from it)."""

    backend: Backend
    config: dict[str, Any]
    special_tokens: dict[str, str]
    chat_template: str | dict[str, str] | None
    generation_eos_ids: list[int]
    source: str
    #: the file each chat template was read from, by its text (errors in a template name that file)
    template_files: dict[str, str] = field(default_factory=dict)


def read_tokenizer_files(folder: Path) -> TokenizerFiles:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise PosttuneError(f"tokenizer: {folder} has no tokenizer.json (posttune reads fast tokenizers; "
                            "AutoTokenizer.from_pretrained(...).save_pretrained(...) writes one)")
    try:
        backend = Backend.from_file(str(path))
    except Exception as exc:  # the Rust error text spans lines; keep its first
        raise PosttuneError(f"tokenizer: {path} cannot be read: {first_line(str(exc))}") from None
    config = read_json(folder / "tokenizer_config.json") or {}
    raw_tokens = _special_token_values(folder, config)
    special_tokens = {name: _token_text(value) for name, value in raw_tokens.items()}
    _add_missing_tokens(backend, config, raw_tokens, folder / "tokenizer_config.json")
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    templates, files = _chat_templates(folder, config)
    return TokenizerFiles(backend, config, special_tokens, templates, _generation_eos_ids(folder), str(folder), files)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, None when absent; broken JSON is one line naming the file and place."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PosttuneError(f"tokenizer: {path}: invalid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise PosttuneError(f"tokenizer: {path}: expected a JSON object, got {type(value).__name__}")
    return value


#: ChatML (``<|im_start|>role\ntext<|im_end|>``), the one template other tools name (axolotl's and unsloth's
#: ``chatml``) that needs no model's own tokens but those two: ``tokenizer.chat_template: chatml``
CHATML = ("{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] "
          "or '') + '<|im_end|>\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
          "{%- endif -%}")
NAMED_TEMPLATES = {"chatml": CHATML}


def chat_template_override(value: str, field: str = "tokenizer.chat_template") -> tuple[str, str]:
    """``tokenizer.chat_template``: (the template, where it came from). A value holding ``{%`` or ``{{`` is the
    template itself, a name in ``NAMED_TEMPLATES`` that one; anything else names a file. Compiled here, so a
    syntax error is one line before launch."""
    from posttune.chat_template import compile_template
    from posttune.errors import ConfigError

    if "{%" in value or "{{" in value:
        text, where = value, field
    elif value in NAMED_TEMPLATES and not Path(value).is_file():
        text, where = NAMED_TEMPLATES[value], f"the named template {value}"
    else:
        path = Path(value).expanduser()
        if value == "tokenizer_default":
            raise ConfigError(field, "leave it unset (null): the tokenizer's own template is the default")
        if not path.is_file():
            raise ConfigError(field, f"no such file {value!r} (a .jinja file, the template itself, or a named "
                                     f"one: {', '.join(NAMED_TEMPLATES)})")
        try:
            text, where = path.read_text(encoding="utf-8"), str(path)
        except UnicodeDecodeError:
            raise ConfigError(field, f"{path}: not UTF-8 text") from None
    try:
        compile_template(text, where)
    except PosttuneError as exc:
        raise ConfigError(field, str(exc)) from None
    return text, where


def id_count(folder: str | Path | None) -> int | None:
    """1 + the largest token id ``folder``'s tokenizer.json defines, added tokens included, plus the tokens its
    tokenizer_config.json names that tokenizer.json lacks (loading adds each, as transformers does): the least
    embedding a model reading it needs; None without a local tokenizer.json or with an unknown layout."""
    data = _tokenizer_json(folder)
    ids = None if data is None else _model_vocabulary(data)
    if ids is None:
        return None
    added = [entry for entry in data.get("added_tokens") or [] if isinstance(entry, dict)]
    added_ids = [entry["id"] for entry in added if isinstance(entry.get("id"), int)]
    config = read_json(Path(str(folder)).expanduser() / "tokenizer_config.json") or {}
    decoder = config.get("added_tokens_decoder")
    named = [*(decoder.values() if isinstance(decoder, dict) else ()),
             *_special_token_values(Path(str(folder)).expanduser(), config).values()]
    extras = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    named += extras if isinstance(extras, list) else []
    wanted = {value if isinstance(value, str) else value["content"] for value in named
              if isinstance(value, str) or _is_serialised_token(value)}
    new = wanted - set(ids.values()) - {entry.get("content") for entry in added}
    return max([*ids, *added_ids], default=-1) + 1 + len(new)


def vocabulary(folder: str | Path | None) -> dict[int, str] | None:
    """Id -> token of the tokenizer model's own vocabulary in ``folder``'s tokenizer.json (added and special
    tokens left out: fine-tunes rename reserved ones); None for no local tokenizer.json or an unknown layout."""
    data = _tokenizer_json(folder)
    return None if data is None else _model_vocabulary(data)


def _tokenizer_json(folder: str | Path | None) -> dict[str, Any] | None:
    path = None if folder is None else Path(str(folder)).expanduser() / "tokenizer.json"
    return (read_json(path) or {}) if path is not None and path.is_file() else None


def _model_vocabulary(data: dict[str, Any]) -> dict[int, str] | None:
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        return {int(i): token for token, i in vocab.items() if isinstance(i, int)}
    if isinstance(vocab, list):  # Unigram: [token, score] at its id
        return {i: entry[0] for i, entry in enumerate(vocab) if isinstance(entry, list) and entry}
    return None


def _special_token_values(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Named special tokens as written (text or serialised AddedToken): the template sees them by name."""
    where = folder / "tokenizer_config.json"
    values = {key: value for key, value in config.items() if _is_token_key(key, value)}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):  # transformers 5: model-specific named tokens, e.g. image_token
        values.update(extra)
    legacy = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        values.update({k: v for k, v in (read_json(legacy) or {}).items() if _is_token_key(k, v)})
        where = legacy
    for key, value in values.items():
        if value is not None and not isinstance(value, str) and not _is_serialised_token(value):
            raise PosttuneError(f"tokenizer: {where}: '{key}' must be a token string, got {json.dumps(value)}")
    # transformers' order (standard names first) decides the ids of tokens it has to add
    ordered = [key for key in NAMED_TOKENS if key in values] + [key for key in values if key not in NAMED_TOKENS]
    return {key: values[key] for key in ordered if values[key] is not None}


def _is_token_key(key: str, value: Any) -> bool:
    return key in NAMED_TOKENS or (key.endswith("_token") and isinstance(value, (str, dict)))


def _is_serialised_token(value: Any) -> bool:
    return isinstance(value, Mapping) and isinstance(value.get("content"), str)


def _token_text(value: Any) -> str:
    return value if isinstance(value, str) else value["content"]


def _add_missing_tokens(backend: Backend, config: dict[str, Any], named: dict[str, Any], where: Path) -> None:
    """Add config tokens that tokenizer.json lacks, as transformers does on load (they must never split)."""
    known = {token.content for token in backend.get_added_tokens_decoder().values()}
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict) or not all(_is_serialised_token(v) for v in decoder.values()):
        raise PosttuneError(f"tokenizer: {where}: 'added_tokens_decoder' must map ids to "
                            "{\"content\": ...} objects")
    wanted = [added_token(value, special=bool(value.get("special")))
              for _, value in sorted(decoder.items(), key=lambda item: _int_key(item[0], where))]
    wanted += [added_token(value, special=True) for value in named.values()]
    extras = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extras, list):
        wanted += [added_token(value, special=True) for value in extras if isinstance(value, (str, dict))]
    new, seen = [], set(known)
    for token in wanted:
        if token.content not in seen:
            seen.add(token.content)
            new.append(token)
    if new:
        backend.add_tokens(new)


def _int_key(key: str, where: Path) -> int:
    try:
        return int(key)
    except ValueError:
        raise PosttuneError(f"tokenizer: {where}: 'added_tokens_decoder' key {key!r} is not a token id") from None


def _chat_templates(folder: Path, config: dict[str, Any]) -> tuple[str | dict[str, str] | None, dict[str, str]]:
    """The template(s), and the file each was read from, by its text."""
    templates, files = {}, {}
    if (folder / TEMPLATE_FILE).is_file():
        templates["default"] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
        files[templates["default"]] = str(folder / TEMPLATE_FILE)
    if (folder / TEMPLATE_DIR).is_dir():
        for path in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = text = path.read_text(encoding="utf-8")
            files[text] = str(path)
    if templates:
        return (templates["default"] if list(templates) == ["default"] else templates), files
    where = folder / "tokenizer_config.json"
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value, {value: str(where)} if value else {}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return ({t["name"]: t["template"] for t in value},
                {t["template"]: f"{where} (template '{t['name']}')" for t in value})
    raise PosttuneError(f"tokenizer: {where}: 'chat_template' must be a string or a "
                        "list of {\"name\", \"template\"} objects")


def _generation_eos_ids(folder: Path) -> list[int]:
    """generation_config.json's stop ids; without that file, config.json's ``eos_token_id``, as transformers
    falls back to it."""
    source = folder / "generation_config.json"
    eos = (read_json(source if source.is_file() else folder / "config.json") or {}).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return [i for i in ids if isinstance(i, int)]


def write_tokenizer_files(tokenizer: Tokenizer, out: Path) -> Path:
    """tokenizer.json + tokenizer_config.json + chat templates as ``.jinja`` files (transformers 5 layout)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(out / "tokenizer.json"))
    config = {key: value for key, value in tokenizer.config.items() if key != "chat_template"}
    for name, text in tokenizer.special_tokens.items():
        if not (_is_token_key(name, config.get(name)) and _token_text(config[name]) == text):
            config[name] = text
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")  # what AutoTokenizer needs without config.json
    _write_templates(tokenizer.chat_template, out)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return out


def _write_templates(templates: str | dict[str, str] | None, out: Path) -> None:
    named = {"default": templates} if isinstance(templates, str) else dict(templates or {})
    (out / TEMPLATE_FILE).unlink(missing_ok=True)  # a stale file would win over what we write
    for name, source in named.items():
        if name == "default":
            (out / TEMPLATE_FILE).write_text(source, encoding="utf-8")
            continue
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise PosttuneError(f"tokenizer: chat template name {name!r} cannot be a file name")
        (out / TEMPLATE_DIR).mkdir(exist_ok=True)
        (out / TEMPLATE_DIR / f"{name}.jinja").write_text(source, encoding="utf-8")


def added_token(value: str | Mapping[str, Any], *, special: bool) -> AddedToken:
    """A `tokenizers.AddedToken` from a config value (plain text or transformers' serialised dict)."""
    if isinstance(value, str):
        return AddedToken(value, special=special)
    fields = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
    return AddedToken(value["content"], special=bool(value.get("special", special)) or special, **fields)
