"""Chat templates: PosttuneLM under lm-eval's ``apply_chat_template`` builds the prompts lm-eval's HFLM builds
(rendered by transformers) and scores them the same, on a tiny Llama whose tokenizer carries a llama3-style
template. Each comparison also checks that the template was really applied: a plain-prompt run gives other
contexts and other scores, so equal numbers cannot come from both wrappers ignoring the template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lmeval_tasks import local_results

TASKS = ["tiny_mc", "tiny_gen"]
SYSTEM = "You are a terse assistant. Answer in one word."
HEADER = "<|start_header_id|>{}<|end_header_id|>\n\n"


@pytest.fixture(scope="module")
def wrappers(chat_checkpoint):
    from lm_eval.models.huggingface import HFLM
    from posttune.plugin import load_model, load_tokenizer
    from posttune_lmeval.model import PosttuneLM

    ours = PosttuneLM(load_model(chat_checkpoint, dtype="float32"), load_tokenizer(chat_checkpoint), batch_size=3)
    hf = HFLM(pretrained=str(chat_checkpoint), dtype="float32", device="cpu", batch_size=4)
    return ours, hf


def samples(results: dict, task: str) -> dict[int, dict]:
    return {sample["doc_id"]: sample for sample in results["samples"][task]}


def contexts(results: dict, task: str) -> list[str]:
    return [arguments[0] for _, sample in sorted(samples(results, task).items()) for arguments in sample["arguments"]]


def assert_same_scores(ours: dict, hf: dict) -> None:
    """Equal prompts, metrics, per-choice log-likelihoods (float32 noise) and generated texts."""
    for task in ours["results"]:
        assert contexts(ours, task) == contexts(hf, task), task
        metrics = {k: v for k, v in hf["results"][task].items() if k.endswith(",none")}
        assert {k: ours["results"][task][k] for k in metrics} == pytest.approx(metrics), task
    if "tiny_gen" in ours["results"]:
        mine, theirs = samples(ours, "tiny_gen"), samples(hf, "tiny_gen")
        assert {d: s["filtered_resps"] for d, s in mine.items()} == {d: s["filtered_resps"] for d, s in theirs.items()}
    for task in {"tiny_mc", "tiny_mc_prefix"} & set(ours["results"]):
        mine, theirs = samples(ours, task), samples(hf, task)
        for doc_id, sample in mine.items():
            expected = theirs[doc_id]["filtered_resps"]
            assert [g for _, g in sample["filtered_resps"]] == [g for _, g in expected]
            assert [ll for ll, _ in sample["filtered_resps"]] == pytest.approx([ll for ll, _ in expected], abs=1e-4)


@pytest.mark.parametrize("multiturn", [True, False], ids=["multiturn", "one-turn"])
def test_chat_prompts_and_scores_equal_hflm_and_differ_from_plain_prompts(wrappers, task_dir, multiturn):
    ours, hf = wrappers
    options = {"apply_chat_template": True, "system_instruction": SYSTEM, "num_fewshot": 2,
               "fewshot_as_multiturn": multiturn}
    mine = local_results(ours, task_dir, TASKS, **options)
    assert_same_scores(mine, local_results(hf, task_dir, TASKS, **options))

    first = contexts(mine, "tiny_mc")[0]
    assert first.startswith("<|begin_of_text|>" + HEADER.format("system") + SYSTEM + "<|eot_id|>")
    assert first.endswith(HEADER.format("assistant"))
    assert first.count(HEADER.format("user")) == (3 if multiturn else 1)  # two examples + the question, or one turn
    plain = local_results(ours, task_dir, TASKS, system_instruction=SYSTEM, num_fewshot=2)
    assert not set(contexts(plain, "tiny_mc")) & set(contexts(mine, "tiny_mc"))
    assert not set(contexts(plain, "tiny_gen")) & set(contexts(mine, "tiny_gen"))
    chat_lls = [ll for s in mine["samples"]["tiny_mc"] for ll, _ in s["filtered_resps"]]
    plain_lls = [ll for s in plain["samples"]["tiny_mc"] for ll, _ in s["filtered_resps"]]
    assert max(abs(a - b) for a, b in zip(chat_lls, plain_lls, strict=True)) > 0.1


def test_an_assistant_prefix_is_continued_as_hflm_continues_it(wrappers, task_dir):
    """tiny_mc_prefix has a gen_prefix: the prompt ends inside the assistant turn, after "The answer is"."""
    ours, hf = wrappers
    mine = local_results(ours, task_dir, ["tiny_mc_prefix"], apply_chat_template=True)
    assert_same_scores(mine, local_results(hf, task_dir, ["tiny_mc_prefix"], apply_chat_template=True))
    assert all(c.endswith(HEADER.format("assistant") + "The answer is") for c in contexts(mine, "tiny_mc_prefix"))


def chats() -> list[tuple[list[dict], bool]]:
    user, assistant = {"role": "user", "content": "Question: 2+2?"}, {"role": "assistant", "content": "4"}
    system = {"role": "system", "content": SYSTEM}
    return [([user], True), ([system, user], True), ([system, user, assistant, user], True),
            ([user, {"role": "assistant", "content": "The answer is"}], False),
            ([system, user, {"role": "assistant", "content": "Answer: "}], False),  # its trailing space
            ([user, {"role": "assistant", "content": "  "}], False)]


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_rendering_equals_transformers_continue_final_message_included(style, tmp_path):
    """What HFLM.apply_chat_template calls: transformers' apply_chat_template, continuing the last message
    when no generation prompt is asked for (llama3's template trims content, chatml's keeps its spaces)."""
    from posttune.plugin import load_tokenizer
    from posttune.tiny_tokenizer import save_tiny_tokenizer
    from posttune_lmeval.chat import render
    from transformers import AutoTokenizer

    path = save_tiny_tokenizer(tmp_path, template=style)
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    for messages, prompt in chats()[:-1] if style == "llama3" else chats():
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt,
                                              continue_final_message=not prompt)
        assert render(ours, messages, add_generation_prompt=prompt) == expected, messages


def test_a_template_that_rejects_system_messages_renders_without_them_as_hflm_does(tmp_path, caplog):
    from posttune.plugin import load_tokenizer
    from posttune.tiny_tokenizer import LLAMA3_TEMPLATE, save_tiny_tokenizer
    from posttune_lmeval.chat import render

    path = save_tiny_tokenizer(tmp_path, template="llama3")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{%- if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                               "supported') }}{%- endif %}" + LLAMA3_TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer, warned = load_tokenizer(path), set()
    system, user = {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}
    assert render(tokenizer, [system, user], add_generation_prompt=True, warned=warned) == render(
        tokenizer, [user], add_generation_prompt=True)
    assert render(tokenizer, [system, user], add_generation_prompt=True, warned=warned)  # warned once only
    assert [r.getMessage() for r in caplog.records].count(
        f"the chat template of {tokenizer.source} rejects a system message: the system instruction is left out "
        "(as lm-eval's HF model does)") == 1


@pytest.fixture
def named_templates(tmp_path) -> Path:
    """A tokenizer with two named templates, as transformers 5 saves them: chat_template.jinja (default) and
    additional_chat_templates/brief.jinja."""
    from posttune.tiny_tokenizer import LLAMA3_TEMPLATE, save_tiny_tokenizer

    path = save_tiny_tokenizer(tmp_path / "named", template="llama3")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "brief.jinja").write_text(
        "{%- for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{%- endfor %}"
        "{%- if add_generation_prompt %}[assistant] {%- endif %}")
    return path


def test_a_named_template_renders_what_transformers_renders_with_it(named_templates, chat_checkpoint):
    from posttune.plugin import load_model, load_tokenizer
    from posttune_lmeval.model import PosttuneLM
    from transformers import AutoTokenizer

    model = load_model(chat_checkpoint, dtype="float32")
    theirs = AutoTokenizer.from_pretrained(named_templates)
    assert set(theirs.chat_template) == {"default", "brief"}
    for name in (None, "brief"):
        lm = PosttuneLM(model, load_tokenizer(named_templates), chat_template=name)
        for messages, prompt in chats():
            expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt,
                                                  continue_final_message=not prompt, chat_template=name)
            assert lm.apply_chat_template(messages, add_generation_prompt=prompt) == expected
        assert lm.chat_template(True) == theirs.chat_template[name or "default"]
    assert "[user] Question" in lm.apply_chat_template(chats()[0][0])


@pytest.mark.parametrize(("template", "name", "expected"), [
    (None, None, "{where} has no chat template (no chat_template.jinja, no 'chat_template' in tokenizer_config"),
    ("llama3", "brief", "--apply-chat-template brief: {where} has a single chat template, not named ones"),
    ("named", "brif", "--apply-chat-template brif: {where} has no chat template 'brif' (did you mean 'brief'?)"),
])
def test_a_missing_template_is_one_line(template, name, expected, named_templates, tmp_path):
    from posttune.plugin import PosttuneError, load_tokenizer
    from posttune.tiny_tokenizer import save_tiny_tokenizer
    from posttune_lmeval.chat import template_source

    path = named_templates if template == "named" else save_tiny_tokenizer(tmp_path / "tok", template=template)
    with pytest.raises(PosttuneError) as error:
        template_source(load_tokenizer(path), name, str(path))
    assert expected.format(where=path) in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow  # `posttune eval` indexes lm-eval's ~15k task YAMLs, then two runs
def test_posttune_eval_with_chat_options_equals_hflm_and_records_them(chat_checkpoint, task_dir, tmp_path):
    from lmeval_tasks import hflm_results, posttune_results
    from transformers import AutoTokenizer

    ours = posttune_results(tmp_path, "--model", str(chat_checkpoint), "--tasks", ",".join(TASKS), "--include-path",
                            str(task_dir), "--num-fewshot", "2", "--apply-chat-template",
                            "--system-instruction", SYSTEM)
    hf = hflm_results(chat_checkpoint, task_dir, TASKS, evaluate={
        "apply_chat_template": True, "system_instruction": SYSTEM, "fewshot_as_multiturn": True, "num_fewshot": 2})
    assert_same_scores(ours, hf)
    assert contexts(ours, "tiny_mc")[0].count(HEADER.format("user")) == 3  # few-shot turns: the default
    assert ours["chat_template"] == AutoTokenizer.from_pretrained(chat_checkpoint).chat_template
    assert ours["system_instruction"] == SYSTEM and ours["fewshot_as_multiturn"] is True
    assert ours["chat_template_sha"] and ours["system_instruction_sha"]
