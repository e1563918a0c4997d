"""lm-evaluation-harness's model interface over a posttune model: what `posttune eval` runs.

    lm = PosttuneLM(posttune.load_model(path), posttune.load_tokenizer(path), batch_size=8)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

The harness asks three things of a model, and each is answered with posttune's own forward:

- ``loglikelihood``: the log-probability of a continuation after a context, and whether greedy
  decoding would produce it (multiple choice: acc, acc_norm);
- ``loglikelihood_rolling``: a whole text's log-probability in windows of ``max_length``
  (perplexity tasks);
- ``generate_until``: greedy (or sampled) completions cut at the task's stop strings, through
  posttune-generate's batched KV-cached ``generate_batch``.

With ``apply_chat_template`` (``posttune eval --apply-chat-template``) lm-eval also asks for
``apply_chat_template`` (its chat messages rendered as text by the checkpoint's template, see
chat.py), ``tokenizer_name`` and ``chat_template``; the rendered text starts with the template's
BOS, so ``tok_encode`` adds none.

Tokenisation, truncation and the stop-string rules follow lm-eval's Hugging Face wrapper
(``HFLM``) choice by choice, so the same checkpoint scores the same under both: contexts and
continuations are encoded together and split (``TemplateLM._encode_pair``), an empty context is
the BOS (else EOS) token, inputs longer than ``max_length`` lose tokens on the left, a generation
prompt leaves room for ``max_gen_toks``, and the text is cut at the first stop string, EOS
included. Two things differ on purpose: log-softmax is taken in float32 whatever the model's
dtype (HFLM takes it in the model's dtype unless ``softmax_dtype`` is set), and only the
positions a continuation is scored on go through the output head (a [batch, seq, vocab] logits
tensor is most of the memory of a long multiple-choice batch).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from posttune.plugin import PosttuneError, derive_seed
from posttune_generate import generate_batch
from tqdm import tqdm

from posttune_lmeval import chat

log = logging.getLogger(__name__)

#: lm-eval's (and HFLM's) length when neither config.json nor the tokenizer names one
DEFAULT_MAX_LENGTH = 2048
#: config.json fields that carry a context length, in the order HFLM reads them
LENGTH_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx")
#: the first generation chunk; each next one is twice as long (see ``_complete``)
FIRST_CHUNK = 16
#: generation options understood here; others (e.g. ``repetition_penalty``) are ignored with a warning
SAMPLING_OPTIONS = {"do_sample", "temperature", "top_k", "top_p", "min_p", "until", "max_gen_toks"}

#: (cache key, context ids, continuation ids): what ``TemplateLM.loglikelihood`` hands over
Request = tuple[Any, list[int], list[int]]


class PosttuneLM(TemplateLM):
    """A posttune model and tokenizer as an lm-eval ``LM`` (one process; batches of ``batch_size``).

    ``chat_template`` names the template that ``apply_chat_template`` renders with, among a
    tokenizer's named ones (``additional_chat_templates/NAME.jinja``); None: its default one.
    lm-eval's ``simple_evaluate(apply_chat_template=NAME)`` does not pass the name on to the model,
    so it is given here.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 8,
                 max_length: int | None = None, max_gen_toks: int = 256, seed: int = 0,
                 chat_template: str | None = None):
        super().__init__()
        self._template_name = chat_template
        self._chat_tok = tokenizer if chat_template is None else chat.with_template(
            tokenizer, chat.template_source(tokenizer, chat_template, str(tokenizer.source)))
        self.model = model.eval()
        self.tok = tokenizer  # not `self.tokenizer`: lm-eval treats that one as a transformers tokenizer
        self.batch_size = batch_size
        self._max_length = max_length or max_length_of(model, tokenizer)
        self._max_gen_toks = max_gen_toks
        self.seed = seed
        self._device = next(model.parameters()).device
        self._warned: set[str] = set()

    # ---- what TemplateLM asks -----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and each rolling window's first token) is conditioned on: BOS, else EOS."""
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        """Part of lm-eval's request-cache key when a chat template is applied."""
        name = str(self.tok.source).replace("/", "__")
        return name if self._template_name is None else f"{name}-{self._template_name}"

    # ---- chat templates (lm-eval's apply_chat_template) -----------------------------------------
    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval's chat messages as the prompt text the checkpoint's template makes of them (chat.py)."""
        return chat.render(self._chat_tok, chat_history, add_generation_prompt=add_generation_prompt,
                           warned=self._warned)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The Jinja source applied (lm-eval records it, and its hash, with the results); None when off."""
        if chat_template is False or chat_template is None:
            return None
        name = self._template_name if chat_template is True else chat_template
        return chat.template_source(self.tok, name, str(self.tok.source))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's own special tokens (BOS for Llama), unless the text already starts with BOS."""
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.tok.decode([self.prefix_token_id]))
        return self.tok.encode(string, add_special_tokens=add_special_tokens)

    # ---- scoring ------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: Sequence[Request], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), continuation == greedy) for each request.

        Requests whose model input is the same token row (the choices of a question that differ
        only in their last token) share one forward pass. Rows run longest first, so the first
        batch is the largest and an out-of-memory error comes at once.
        """
        rows: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for index, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise ValueError("loglikelihood needs a non-empty context and continuation")
            if len(continuation) > self.max_length:
                raise PosttuneError(f"eval: a continuation of {len(continuation)} tokens does not fit the context "
                                    f"of {self.max_length} tokens (see --max-length)")
            row = (context + continuation)[-(self.max_length + 1):][:-1]
            rows[tuple(row)].append(index)
        order = sorted(rows, key=lambda row: (-len(row), row))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="posttune: loglikelihood")
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            wanted = [[requests[i][2] for i in rows[row]] for row in batch]
            scored = self._score_rows(batch, [max(len(c) for c in conts) for conts in wanted])
            for row, conts, (logprobs, greedy) in zip(batch, wanted, scored, strict=True):
                for index, continuation in zip(rows[row], conts, strict=True):
                    n = len(continuation)
                    target = torch.tensor(continuation, device=logprobs.device)
                    chosen = logprobs[-n:].gather(-1, target[:, None]).sum()
                    results[index] = (float(chosen), bool((greedy[-n:] == target).all()))
                    bar.update(1)
        bar.close()
        return results

    @torch.no_grad()
    def _score_rows(self, rows: list[tuple[int, ...]], keep: list[int]
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each right-padded row, the log-probabilities [keep, vocab] (float32) and argmax [keep] of
        its last ``keep`` real positions. Right padding needs no mask: a causal row never sees it."""
        longest = len(rows[0])
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
        hidden = self.model.hidden_states(ids.to(self._device))
        picked = torch.cat([hidden[i, len(row) - k:len(row)] for i, (row, k) in enumerate(zip(rows, keep,
                                                                                             strict=True))])
        logprobs = self.model.logits(picked).float().log_softmax(dim=-1)
        pieces = logprobs.split(keep)
        return [(piece, piece.argmax(dim=-1)) for piece in pieces]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """A text's log-probability: disjoint windows of at most ``max_length`` tokens, each conditioned on
        the tokens before it (the first on the prefix token), as HFLM cuts them."""
        windows: list[Request] = []
        owner: list[int] = []
        for index, (text,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(text)
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, context, continuation))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm),
                                       strict=True):
            totals[index] += logprob
        return totals

    # ---- generation ---------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context's completion, cut before the first of its stop strings (EOS among them).

        Requests are grouped by their generation options and run longest first in batches of
        ``batch_size``: left-padded, KV-cached, greedy unless the task asks to sample.
        """
        groups: dict[str, list[int]] = defaultdict(list)
        for index, request in enumerate(requests):
            groups[json.dumps(request.args[1], sort_keys=True, default=str)].append(index)
        results = [""] * len(requests)
        eos_text = self.tok.decode([self.eot_token_id])
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="posttune: generate_until")
        for indices in groups.values():
            options = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            self._warn_unused(options)
            until = handle_stop_sequences(options.get("until"), eos=eos_text)
            max_new = int(options["max_gen_toks"])
            room = self.max_length - max_new
            if room <= 0:
                raise PosttuneError(f"eval: max_gen_toks {max_new} leaves no room for a prompt within the "
                                    f"context of {self.max_length} tokens (see --max-length)")
            prompts = {i: self.tok_encode(requests[i].args[0])[-room:] for i in indices}
            order = sorted(indices, key=lambda i: (-len(prompts[i]), requests[i].args[0]))
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                texts = self._complete([prompts[i] for i in batch], batch, until, max_new, options)
                for i, text in zip(batch, texts, strict=True):
                    results[i] = postprocess_generated_text(text, until, None)
                bar.update(len(batch))
        bar.close()
        return results

    def _complete(self, prompts: list[list[int]], keys: list[int], until: list[str], max_new: int,
                  options: dict) -> list[str]:
        """Completions of ``prompts`` (text, special tokens skipped), stopping each row at EOS, at a stop
        string, or after ``max_new`` tokens.

        ``generate_batch`` knows stop tokens but not stop strings, so it runs in chunks of 16, 32,
        64... tokens: after each, rows whose text holds a stop string are done and the others
        continue from prompt + tokens so far (one more prefill per chunk). A short answer costs
        one short chunk instead of ``max_new`` steps; a long one at most log2(max_new / 16)
        extra prefills.
        """
        sampling = bool(options.get("do_sample")) and float(options.get("temperature", 0.0)) > 0.0
        produced: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        chunk = FIRST_CHUNK
        while live:
            steps = min(chunk, max_new - len(produced[live[0]]))
            extra = {}
            if sampling:
                extra = {"temperature": float(options["temperature"]), "top_k": options.get("top_k"),
                         "top_p": options.get("top_p"), "min_p": options.get("min_p"),
                         "seeds": [derive_seed(self.seed, keys[i], len(produced[i])) for i in live]}
            out = generate_batch(self.model, [prompts[i] + produced[i] for i in live], max_new_tokens=steps,
                                 stop_token_ids=self.tok.eos_ids, pad_id=self.tok.pad_id or 0, **extra)
            still = []
            for i, new in zip(live, out.token_lists(), strict=True):
                produced[i] += new
                ended = len(new) < steps or (new and new[-1] in self.tok.eos_ids) or len(produced[i]) >= max_new
                text = self.tok.decode(produced[i], skip_special_tokens=True)
                if not ended and not any(stop and stop in text for stop in until):
                    still.append(i)
            live, chunk = still, chunk * 2
        return [self.tok.decode(tokens, skip_special_tokens=True) for tokens in produced]

    def _warn_unused(self, options: dict) -> None:
        for name in sorted(set(options) - SAMPLING_OPTIONS - self._warned):
            log.warning("posttune eval ignores the generation option %r", name)
            self._warned.add(name)


def max_length_of(model: torch.nn.Module, tokenizer: Any) -> int:
    """The context length HFLM would use: config.json's (``text_config`` first), else the tokenizer's
    ``model_max_length``, else 2048."""
    origin = getattr(model, "posttune_origin", None)
    config = dict(getattr(origin, "hf_config", None) or {})
    config = config.get("text_config") or config
    for name in LENGTH_FIELDS:
        if config.get(name) is not None:
            return int(config[name])
    declared = tokenizer.config.get("model_max_length")
    if isinstance(declared, (int, float)) and declared < 1e29:  # transformers writes 1e30 for "unset"
        return int(declared)
    return DEFAULT_MAX_LENGTH
