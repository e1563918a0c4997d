"""A checkpoint's chat template renders under a deadline and a character budget (posttune.template_limits).

A hostile template (loops without end, gigabytes of text, endless recursion) ends within the
limit as one PosttuneError line naming the template's file, through the tokenizer, training
data preparation and `posttune generate --chat`; real templates render exactly as transformers
renders them. Every hostile render runs in a thread joined with a timeout, so a limit that
stops working fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from posttune.errors import PosttuneError
from posttune.plugins import new_plugin_set
from posttune.template_limits import (
    DEFAULT_MAX_CHARS,
    DEFAULT_TIMEOUT,
    MAX_CHARS_ENV,
    TIMEOUT_ENV,
    RenderLimits,
    TemplateLimitError,
    read_limits,
)
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer
from transformers import AutoTokenizer

#: the limit the tests set (POSTTUNE_CHAT_TEMPLATE_TIMEOUT), and what a hostile render must end within: 10x that
TIMEOUT = 0.5
BOUND = 5.0
MAX_CHARS = 1_000_000
CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Say OK."}]

FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = {  # what each does without limits, then what stops it
    "nested range loops": (FOREVER, "rendering ran past 0.5 s"),
    "'A' * 10**9": ("{{ 'A' * 10**9 }}", "rendering built more than 1,000,000 characters"),
    "center filter": ("{{ 'a' | center(10**9) }}", "rendering built more than"),
    "ljust method": ("{{ 'a'.ljust(10**9) }}", "rendering built more than"),
    "format width": ("{{ '{:>1000000000}'.format('a') }}", "rendering built more than"),
    "percent width": ("{{ '%1000000000s' % 'a' }}", "rendering built more than"),
    "indent filter": ("{{ ('a\\n' * 1000) | indent(10**6) }}", "rendering built more than"),
    "join of repeats": ("{{ (['a' * 1000] * 2000) | join }}", "rendering built more than"),
    "doubling with +": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}{{ ns.s }}", "rendering built more than"),
    "doubling with ~": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s }}", "rendering built more than"),
    "a list holding one list twice, 64 deep": (
        "{% set ns = namespace(l='a') %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
        "{{ ns.l | tojson }}", "rendering built more than"),
    "loop text": ("{% for i in range(100000) %}" + "A" * 1000 + "{% endfor %}", "rendering built more than"),
    "macro calling itself": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                             "rendering nested deeper than Python's recursion limit"),
    "macro calling itself twice": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(64) }}",
        "rendering ran past 0.5 s"),
    "a huge number": ("{{ 9 ** 1000000000 }}", "rendering computed a number of more than 65,536 bits"),
}


def ends_within(seconds: float, call, *args, **kwargs):
    """What ``call`` raised (or returned), asserting it ended within ``seconds`` (run in a daemon thread)."""
    outcome = {}

    def run():
        try:
            outcome["returned"] = call(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the test looks at whatever it raised
            outcome["raised"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still rendering after {seconds} s"
    return outcome.get("raised", outcome.get("returned"))


def checkpoint_folder(tmp_path: Path, template: str, *, in_file: str = "tokenizer_config.json") -> Path:
    """A tiny tokenizer whose chat template is ``template``, in tokenizer_config.json or in ``in_file``."""
    folder = save_tiny_tokenizer(tmp_path / "ckpt", template="chatml")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if in_file == "tokenizer_config.json":
        config["chat_template"] = template
    else:
        del config["chat_template"]
        (folder / in_file).parent.mkdir(exist_ok=True)
        (folder / in_file).write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def small_limits(monkeypatch):
    """The documented knobs, set low (a tokenizer reads them when it is loaded)."""
    monkeypatch.setenv(TIMEOUT_ENV, str(TIMEOUT))
    monkeypatch.setenv(MAX_CHARS_ENV, str(MAX_CHARS))


# -- hostile templates ----------------------------------------------------------------------------

@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_template_ends_in_bounded_time_as_one_line_naming_its_file(case, tmp_path, small_limits):
    template, why = HOSTILE[case]
    folder = checkpoint_folder(tmp_path, template)
    tokenizer = load_tokenizer(folder)
    start = time.monotonic()
    error = ends_within(BOUND, tokenizer.apply_chat_template, CHAT, add_generation_prompt=True)
    assert time.monotonic() - start < BOUND
    assert isinstance(error, TemplateLimitError), error
    assert str(error).startswith(f"chat template in {folder / 'tokenizer_config.json'}: {why}")
    assert "\n" not in str(error)


def test_a_range_past_the_sandbox_limit_is_one_line_not_a_traceback(tmp_path, small_limits):
    folder = checkpoint_folder(tmp_path, "{% for i in range(10**9) %}x{% endfor %}")
    error = ends_within(BOUND, load_tokenizer(folder).apply_chat_template, CHAT)
    assert isinstance(error, PosttuneError), error
    assert str(error).startswith(f"chat template in {folder / 'tokenizer_config.json'} failed: OverflowError: "
                                 "Range too big")


@pytest.mark.parametrize("in_file", ["chat_template.jinja", "additional_chat_templates/tool_use.jinja"])
def test_the_error_names_the_file_the_template_came_from(in_file, tmp_path, small_limits):
    folder = checkpoint_folder(tmp_path, FOREVER, in_file=in_file)
    tools = None
    if in_file.endswith("tool_use.jinja"):  # the named template that renders with tools, beside a harmless default
        (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")
        tools = [{"type": "function", "function": {"name": "f"}}]
    error = ends_within(BOUND, load_tokenizer(folder).apply_chat_template, CHAT, tools=tools)
    assert str(error).startswith(f"chat template in {folder / in_file}: rendering ran past 0.5 s")


def test_a_limit_in_a_prefix_render_is_not_taken_for_a_refused_prefix(tmp_path, small_limits):
    """Finding assistant turns renders prefixes, where a refusal only means "no prefix": a limit stops."""
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}" + FOREVER + "{% endif %}")
    tokenizer = load_tokenizer(checkpoint_folder(tmp_path, template))
    error = ends_within(BOUND, tokenizer.tokenize_messages, CHAT)
    assert isinstance(error, TemplateLimitError) and "rendering ran past 0.5 s" in str(error)


def test_training_data_preparation_stops_at_a_hostile_template_even_when_skipping_bad_rows(tmp_path, small_limits):
    from posttune.plugin import SampleMaker

    folder = checkpoint_folder(tmp_path, FOREVER)
    chat = new_plugin_set().registry.get("dataset_format", "chat")
    maker = SampleMaker(chat, load_tokenizer(folder), max_seq_len=64, skip_bad_rows=True)
    error = ends_within(BOUND, maker, {"messages": CHAT[:2]}, 0)
    assert isinstance(error, TemplateLimitError), error
    assert str(error).startswith(f"data.train: row 0: chat template in {folder / 'tokenizer_config.json'}: "
                                 "rendering ran past 0.5 s")
    assert maker.skipped.bad_rows == 0


def test_a_row_too_long_for_the_render_budget_is_the_rows_fault(tmp_path, monkeypatch):
    """A 90 MB row from an untrusted dataset stopped the run even with skip_bad_rows (the limit was taken for the
    template's fault); a row whose text alone is half the budget is skipped and counted instead."""
    from posttune.plugin import SampleMaker

    monkeypatch.setenv(MAX_CHARS_ENV, "10000")
    folder = save_tiny_tokenizer(tmp_path / "ckpt", template="chatml")
    chat = new_plugin_set().registry.get("dataset_format", "chat")
    maker = SampleMaker(chat, load_tokenizer(folder), max_seq_len=64, skip_bad_rows=True)
    huge = {"messages": [{"role": "user", "content": "x" * 6000}, {"role": "assistant", "content": "y"}]}
    assert maker(huge, 0) is None and maker.skipped.bad_rows == 1
    assert re.match(r"data\.train: row 0: its text \(6,0\d\d characters\) is too long for the chat template's "
                    r"render budget \(chat template in .*: rendering built more than 10,000 characters",
                    maker.skipped.first_bad)
    strict = SampleMaker(chat, load_tokenizer(folder), max_seq_len=64)
    with pytest.raises(PosttuneError, match=r"row 0: its text \(6,0\d\d characters\) is too long"):
        strict(huge, 0)


def test_generate_chat_with_a_hostile_template_exits_2_with_one_line(tmp_path):
    import posttune_llama  # noqa: F401 - the tiny checkpoint's family must be installed
    from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config

    folder = checkpoint_folder(tmp_path, FOREVER)
    tokenizer = load_tokenizer(folder)
    save_tiny_hf_checkpoint(folder, tiny_llama_config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                                      eos_token_id=tokenizer.eos_ids), seed=0)
    env = {**os.environ, TIMEOUT_ENV: str(TIMEOUT), "HF_HUB_OFFLINE": "1"}
    posttune = Path(sys.executable).parent / "posttune"
    # the bound: starting Python and torch, loading the tiny model, then 0.5 s of rendering (TimeoutExpired fails)
    result = subprocess.run([str(posttune), "generate", "--model", str(folder), "--prompt", "Hi", "--chat",
                             "--max-new-tokens", "2", "--device", "cpu"], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == (f"posttune: error: chat template in {folder / 'tokenizer_config.json'}: rendering ran "
                             f"past 0.5 s (the limit; {TIMEOUT_ENV} sets it)\n")


# -- the knobs ------------------------------------------------------------------------------------

def test_limits_default_to_10_seconds_and_32_mi_characters(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(MAX_CHARS_ENV, raising=False)
    assert read_limits() == RenderLimits(DEFAULT_TIMEOUT, DEFAULT_MAX_CHARS) == RenderLimits(10.0, 32 * 2**20)


def test_the_character_limit_is_what_the_variable_sets(tmp_path, monkeypatch):
    folder = checkpoint_folder(tmp_path, "{{ 'A' * 2000000 }}")
    assert len(load_tokenizer(folder).apply_chat_template(CHAT, tokenize=False)) == 2_000_000
    monkeypatch.setenv(MAX_CHARS_ENV, "1000000")
    with pytest.raises(TemplateLimitError, match="built more than 1,000,000 characters"):
        load_tokenizer(folder).apply_chat_template(CHAT)


@pytest.mark.parametrize(("name", "value", "expected"), [
    (TIMEOUT_ENV, "soon", "expected a number of seconds > 0"),
    (TIMEOUT_ENV, "0", "expected a number of seconds > 0"),
    (MAX_CHARS_ENV, "1e6", "expected a whole number of characters > 0"),
])
def test_a_bad_limit_is_one_line_naming_the_variable(name, value, expected, tmp_path, monkeypatch):
    folder = checkpoint_folder(tmp_path, "{{ messages[0].content }}")
    monkeypatch.setenv(name, value)
    with pytest.raises(PosttuneError) as info:
        load_tokenizer(folder)
    assert str(info.value) == f"{name}={value!r}: {expected}"


# -- real templates: byte-identical to transformers -----------------------------------------------

QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\n\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> XML tags." }}
    {{- "<|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

QWEN3_STYLE = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>')) %}
        {%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
            {{- content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# every construct the limits rewrite or intercept, rendering what transformers renders
EVERY_CONSTRUCT = r"""{%- macro text(content) -%}
{{ content if content is string else content|map(attribute='text')|join }}
{%- endmacro -%}
{%- macro box(title) -%}[{{ title ~ ':' }}{{ caller() }}]{%- endmacro -%}
{%- set ns = namespace(count=0, roles=[]) -%}
{%- for message in messages -%}
{%- set ns.count = ns.count + 1 -%}{%- set ns.roles = ns.roles + [message.role] -%}
{%- call box(message.role|upper) -%}
{{ '%s/%d' % (loop.index, loop.length) }} {{ '{}>{}'.format(message.role, loop.last) }}
{{ text(message.content)[:12] ~ '|' ~ loop.index }} {{ loop.cycle('odd', 'even') }}
{%- endcall %}
{% endfor -%}
{{ ns.roles|join(',') }} {{ ns.count * 2 }} {{ 2 ** 5 }} {{ '-' * 10 }}
{{ messages[1:]|map(attribute='role')|list|tojson }}
{% set leaf = {'name': 'd', 'kids': []} %}
{% set tree = [{'name': 'a', 'kids': [{'name': 'b', 'kids': []}, {'name': 'c', 'kids': [leaf]}]}] %}
{% for node in tree recursive %}({{ node.name }}{{ loop(node.kids) if node.kids }}){% endfor %}
{% set summary %}{{ messages|length }} messages{% endset %}{{ summary|center(24) }}|{{ summary|indent(2, true) }}
{{ 'a-b'.replace('-', '+') }} {% filter upper %}tools: {{ tools|tojson(indent=2) if tools else 'none' }}{% endfilter %}
{{ dict(a=[1, 2])|tojson }} {{ {'k': none} }} {{ [1, 'x'] }}
{{ messages|selectattr('role', 'equalto', 'user')|list|length }}
{{ messages[-1].content.split()|reverse|join(' ') }} {{ (messages|last).content|wordcount }}
{%- if add_generation_prompt %}{{ '\nassistant>' }}{% endif %}"""

TOOL_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? And 日本 🙂?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "<think>\nadding\n</think>\n\n4, of course."},
    {"role": "user", "content": "  Spaces, then\ttabs.\n"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <two> \"numbers\"",
                                            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]


@pytest.mark.parametrize("template", [QWEN25, QWEN3_STYLE, EVERY_CONSTRUCT], ids=["qwen2.5", "qwen3-style", "every"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["chat", "tools"])
@pytest.mark.parametrize("prompt", [False, True], ids=["whole", "prompt"])
def test_real_templates_render_byte_identical_to_transformers(template, tools, prompt, tmp_path):
    folder = checkpoint_folder(tmp_path, template)
    ours = load_tokenizer(folder).apply_chat_template(TOOL_CHAT, tools=tools, add_generation_prompt=prompt,
                                                      tokenize=False)
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(TOOL_CHAT, tools=tools, tokenize=False,
                                                                       add_generation_prompt=prompt)
    assert ours == theirs
