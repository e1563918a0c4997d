"""A checkpoint's tokenizer and chat template, read from its own files, giving transformers' token ids.

    tok = load_tokenizer("/ckpt/Llama-3.2-1B-Instruct")      # or a hub id
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids, trained = tok.tokenize_messages(messages)          # trained[i]: token i is an assistant token

``tokenizer.json`` runs through the `tokenizers` library (what transformers' fast tokenizers wrap);
``tokenizer_config.json`` supplies the special tokens and the chat template (also read from
``chat_template.jinja`` and ``additional_chat_templates/``, as transformers 5 saves them), and
``generation_config.json`` the extra stop tokens. The ids equal ``AutoTokenizer``'s on the same
files, so training data matches what the model sees at inference (but for transformers 5's rebuilt
pipeline of sentencepiece-style ``LlamaTokenizer`` files: docs/training.md). No transformers at run time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from posttune import chat_template as ct
from posttune import hub
from posttune.errors import PosttuneError
from posttune.template_limits import TemplateLimitError, read_limits
from posttune.tokenizer_files import NAMED_TOKENS, read_tokenizer_files, write_tokenizer_files

__all__ = ["NAMED_TOKENS", "TOKENIZER_FILES", "Tokenizer", "load_tokenizer"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "additional_chat_templates/*.jinja")
# owner/name in the hub's characters (stricter than the checkpoint reader's is_hub_id): anything else is a local
# path with a typo
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class Tokenizer:
    """Encode, decode and render chats with one checkpoint's tokenizer. Build it with `load_tokenizer`.

    ``template_files`` names the file each chat template came from (by its text), for errors;
    the rendering limits (`posttune.template_limits`) are read from the environment here, once.
    """

    def __init__(self, backend: Backend, config: dict[str, Any], *, special_tokens: dict[str, str],
                 chat_template: str | dict[str, str] | None, generation_eos_ids: Sequence[int] = (),
                 source: str = "tokenizer", template_files: Mapping[str, str] | None = None):
        self.backend = backend
        self.config = config
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self.source = source
        self.template_files = dict(template_files or {})
        self.template_kwargs: dict[str, Any] = {}  # what every render gets (a run's tokenizer.chat_template_kwargs)
        self.render_limits = read_limits()
        self._generation_eos_ids = list(generation_eos_ids)
        self._cleanup = bool(config.get("clean_up_tokenization_spaces")) and type(backend.model).__name__ != "BPE"

    # -- ids of special tokens -------------------------------------------------------------------
    def token_id(self, name: str) -> int | None:
        """Id of a named special token (``"bos_token"``), or None when the checkpoint has none."""
        text = self.special_tokens.get(name)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def bos_id(self) -> int | None:
        return self.token_id("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self.token_id("eos_token")

    @property
    def eos_ids(self) -> list[int]:
        """Every stop token: the eos token, then ``generation_config.json``'s (e.g. Llama 3's ``<|eot_id|>``)."""
        ids = [] if self.eos_id is None else [self.eos_id]
        return ids + [i for i in self._generation_eos_ids if i not in ids]

    @property
    def pad_id(self) -> int | None:
        """The pad token, or eos when there is none: padded positions are masked, so any real id serves."""
        pad = self.token_id("pad_token")
        return self.eos_id if pad is None else pad

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included: the least embedding size a model needs."""
        return max(self.backend.get_vocab_size(with_added_tokens=True),
                   max(self.backend.get_added_tokens_decoder(), default=-1) + 1)

    # -- text <-> ids ----------------------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int] | Any, *, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._cleanup else text

    # -- chats -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, tools: list[dict] | None = None,
                            **template_kwargs: Any) -> list[int] | str:
        """The chat rendered by the checkpoint's template, as ids (default) or text.

        The template writes its own BOS and turn tokens, so the text is encoded without adding
        special tokens again, as transformers does: no doubled ``<|begin_of_text|>``.
        """
        text = self._render(ct.prepare_messages(messages), add_generation_prompt, tools, template_kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def tokenize_messages(self, messages: Sequence[Mapping[str, Any]], *, train_on_input: bool = False,
                          max_seq_len: int | None = None, tools: list[dict] | None = None,
                          **template_kwargs: Any) -> tuple[list[int], list[bool]]:
        """(ids, mask) of a whole chat for SFT; ``mask[i]`` is True when token i is trained on.

        Trained tokens are those of assistant turns: the content and the end-of-turn token that
        closes it (see `chat_template.assistant_spans` for how turns are found and why), or what
        the template's own ``{% generation %}`` blocks mark when it has them. ``train_on_input``
        trains on every token but those of an assistant turn with ``weight: 0``. ``max_seq_len`` cuts both lists
        on the right.
        """
        prepared = ct.prepare_messages(messages)
        source = self._template(tools)
        ct.check_tool_use(source, prepared, tools, self._where(source))  # training text must hold them
        variables = {**self.special_tokens, **self.template_kwargs, **template_kwargs}
        if ct.has_generation_blocks(source):
            text, spans = ct.render_generation_spans(source, prepared, where=self._where(source), tools=tools,
                                                     variables=variables, limits=self.render_limits)
        else:
            text = self._render(prepared, False, tools, template_kwargs)
            spans = ct.assistant_spans(
                lambda prefix, prompt: self._try_render(prefix, prompt, tools, template_kwargs),
                prepared, text, self._added_token_texts())
        weights = [message.get("weight", 1) for message in prepared if message["role"] == "assistant"]
        encoding = self.backend.encode(text, add_special_tokens=False)
        ids = encoding.ids
        if train_on_input:  # every token but those of a turn marked weight 0: the turn's own switch still holds
            mask = [not hit for hit in ct.tokens_in_spans(encoding.offsets, _weighted(spans, weights, weight=0))]
        else:
            mask = ct.tokens_in_spans(encoding.offsets, _weighted(spans, weights))
        if max_seq_len is not None:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        return ids, mask

    def check_tool_use(self, messages: Sequence[Mapping[str, Any]], tools: Any) -> None:
        """Refuse tools or tool calls this tokenizer's template never reads (`chat_template.check_tool_use`):
        ``tokenize_messages`` does for training text; ``apply_chat_template`` renders as transformers does."""
        source = self._template(tools)
        ct.check_tool_use(source, messages, tools, self._where(source))

    def _added_token_texts(self) -> list[str]:
        return [token.content for token in self.backend.get_added_tokens_decoder().values()]

    def _template(self, tools: Any) -> str:
        if self.chat_template is None:
            raise PosttuneError(f"{self.source} has no chat template: add chat_template.jinja (or a 'chat_template' "
                                f"entry in tokenizer_config.json) next to tokenizer.json")
        return ct.select_template(self.chat_template, tools=tools, where=self.source)

    def _where(self, source: str) -> str:
        """The file a template came from (``chat_template.jinja``, ``tokenizer_config.json``...), else the folder."""
        return self.template_files.get(source, self.source)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Any,
                template_kwargs: Mapping[str, Any]) -> str:
        source = self._template(tools)
        return ct.render(source, messages, where=self._where(source), tools=tools,
                         add_generation_prompt=add_generation_prompt,
                         variables={**self.special_tokens, **self.template_kwargs, **template_kwargs},
                         limits=self.render_limits)

    def _try_render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Any,
                    template_kwargs: Mapping[str, Any]) -> str | None:
        """A prefix of the chat rendered, or None where the template refuses it (empty, or ends oddly).

        A template past a rendering limit is not refusing a prefix: that error goes on.
        """
        try:
            return self._render(messages, add_generation_prompt, tools, template_kwargs)
        except TemplateLimitError:
            raise
        except PosttuneError:
            return None

    # -- files -----------------------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> Path:
        """Write tokenizer.json, tokenizer_config.json and the chat template(s) as transformers 5 saves them.

        ``AutoTokenizer.from_pretrained(out_dir)`` loads the result. ``generation_config.json`` belongs
        to the model and is written with it, not here.
        """
        return write_tokenizer_files(self, Path(out_dir))

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size})"


def _weighted(spans: list[Any], weights: list[int], weight: int = 1) -> list[Any]:
    """The spans of the assistant turns of this ``weight`` (1: not 0), one span per assistant turn, in order."""
    if all(weights):
        return spans if weight else []
    if len(spans) != len(weights):  # a template's {% generation %} blocks need not be one per turn
        raise ValueError(f"a turn's weight needs one trained span per assistant turn; this template marks "
                         f"{len(spans)} for {len(weights)} assistant turns")
    return [span for span, turn in zip(spans, weights, strict=True) if bool(turn) == bool(weight)]


def check_fits(tokenizer: Tokenizer, model: Any, where: str) -> None:
    """A tokenizer with ids past the model's embedding rows (tokens added without resizing it) would index past
    the embedding at the first forward, a raw IndexError on CPU and a device-side assert on a GPU: one line
    instead. Models without a native ``embed`` (another family's contract) are not checked here."""
    rows = getattr(getattr(model, "embed", None), "num_embeddings", None)
    if isinstance(rows, int) and tokenizer.vocab_size > rows:
        raise PosttuneError(too_many_ids(where, tokenizer.vocab_size, rows))


def too_many_ids(where: str, ids: int, rows: int) -> str:
    return (f"{where}: the tokenizer has {ids} token ids and the model's embedding {rows} rows: ids {rows} and up "
            "(tokens added without resizing the embeddings?) would index past it; use the model's own tokenizer")


def load_tokenizer(path_or_id: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory, or of a hub id (only the tokenizer files are downloaded)."""
    files = read_tokenizer_files(_resolve(path_or_id))
    return Tokenizer(files.backend, files.config, special_tokens=files.special_tokens,
                     chat_template=files.chat_template, generation_eos_ids=files.generation_eos_ids,
                     source=files.source, template_files=files.template_files)


def _resolve(path_or_id: str | Path) -> Path:
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise PosttuneError(f"tokenizer: {path} is a file; give the checkpoint folder that holds tokenizer.json")
    if isinstance(path_or_id, Path) or not _HUB_ID.match(str(path_or_id)) or hub.first_part_exists(str(path_or_id)):
        raise PosttuneError(f"tokenizer: no such folder {str(path_or_id)!r}")
    return _download(str(path_or_id))


def _download(repo_id: str) -> Path:
    """Fetch only the tokenizer files of a hub repository (no weights), through the hub cache."""
    from huggingface_hub import snapshot_download

    cache_only = not hub.offline_requested() and not hub.reachable()  # HF_HUB_OFFLINE: the library reads the cache
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(TOKENIZER_FILES),
                                      **({"local_files_only": True} if cache_only else {})))
    except Exception as exc:  # offline, unknown repo, gated: one line naming the id
        if cache_only:
            raise hub.unreachable(repo_id, "tokenizer", local="a local checkpoint folder") from None
        raise PosttuneError(f"tokenizer: could not download {repo_id!r} from the Hugging Face hub "
                            f"({type(exc).__name__}); give a local checkpoint folder instead") from None


def _clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization_spaces`` (applied to non-BPE tokenizers only, as there)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
