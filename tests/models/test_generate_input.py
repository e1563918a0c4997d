"""What `posttune generate` and `generate_batch` accept: every option in its range or one line naming it
(exit 2, before the model loads), and a generation never longer than the model's context.

A prompt that leaves no room in the context is refused, never truncated (cutting either end would
change the question without saying so); `--max-new-tokens` past the context is capped, with one
warning line, and memory is sized by the cap, not by what was asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from rank_support import run_ranks

import posttune_generate
import posttune_llama
import posttune_lora
from posttune.generation import SamplingError, check_sampling, context_length
from posttune_generate import generate_batch
from posttune.modules import RotaryEmbedding
from posttune.testing.tiny import native_from_hf, save_tiny_hf_checkpoint, tiny_hf_model, tiny_llama_config
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer

CONTEXT = 32  # the tiny checkpoints' max_position_embeddings: short, so a full context takes little time


def short_context_checkpoint(path, template="llama3"):
    save_tiny_tokenizer(path, template=template)
    tokenizer = load_tokenizer(path)
    config = tiny_llama_config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                               eos_token_id=tokenizer.eos_ids, max_position_embeddings=CONTEXT)
    save_tiny_hf_checkpoint(path, config, seed=3)
    return path, tokenizer


@pytest.fixture(autouse=True)
def generate_command(register_plugin):
    """`posttune generate` is posttune-generate's command."""
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")


@pytest.fixture
def checkpoint(tmp_path, register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    return short_context_checkpoint(tmp_path)


def ids_of(result):
    """The token ids `--show-ids` printed (the last stdout line)."""
    assert result.exit_code == 0, result.stderr
    return [int(i) for i in result.stdout.rstrip("\n").rsplit("\n", 1)[1].split()]


# ---- every option in its range, or one line naming it ---------------------------------------------

BAD = [
    (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
    (["--temperature", "1", "--top-k", "0"], "--top-k must be an integer >= 1, got 0"),
    (["--temperature", "1", "--top-k", "-3"], "--top-k must be an integer >= 1, got -3"),
    (["--temperature", "1", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--temperature", "1", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--temperature", "1", "--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    (["--temperature", "1", "--min-p", "2"], "--min-p must be in [0, 1], got 2.0"),
    (["--temperature", "1", "--min-p", "-0.5"], "--min-p must be in [0, 1], got -0.5"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be >= 1, got -5"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--seed", "3"], "--seed only applies when sampling: add --temperature above 0"),
    (["--temperature", "0", "--top-k", "5"], "--top-k only applies when sampling"),
    (["--top-p", "0.9"], "--top-p only applies when sampling"),
    (["--min-p", "0.1"], "--min-p only applies when sampling"),
    (["--system", "be brief"], "--system needs --chat"),
    (["--device", "tpu"], "--device 'tpu' is not a device"),
    (["--device", "cuda:x"], "--device 'cuda:x' is not a device"),
    (["--device", "meta"], "--device meta holds no weights"),
]


@pytest.mark.parametrize(("flags", "message"), BAD, ids=[" ".join(flags) for flags, _ in BAD])
def test_an_option_out_of_range_is_one_line_naming_it(checkpoint, posttune_cli, flags, message):
    path, _ = checkpoint
    result = posttune_cli("generate", "--model", str(path), "--prompt", "hi", *flags)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"posttune: error: generate: {message}"), result.stderr
    assert result.stdout == ""


def test_options_are_checked_before_the_model_loads(tmp_path, posttune_cli):
    """No checkpoint at all: the option is still what the error names (nothing loads for a typo)."""
    result = posttune_cli("generate", "--model", str(tmp_path / "absent"), "--prompt", "hi", "--top-p", "0",
                          "--temperature", "1")
    assert result.exit_code == 2 and "--top-p must be in (0, 1]" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line(checkpoint, posttune_cli):
    path, _ = checkpoint
    result = posttune_cli("generate", "--model", str(path), "--prompt", "hi", "--device", "cuda")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "--device cuda: no CUDA device is available" in result.stderr


def test_the_documented_off_values_keep_every_token(checkpoint, posttune_cli):
    """`--top-p 1` and `--min-p 0` are spellings of "no filter": the same sample as leaving them out."""
    path, _ = checkpoint
    args = ["generate", "--model", str(path), "--prompt", "hello", "--max-new-tokens", "8", "--show-ids",
            "--temperature", "1.0", "--seed", "5"]
    plain = ids_of(posttune_cli(*args))
    assert ids_of(posttune_cli(*args, "--top-p", "1")) == plain
    assert ids_of(posttune_cli(*args, "--min-p", "0")) == plain


def test_a_tiny_temperature_samples_the_greedy_completion(checkpoint, posttune_cli):
    """1e-40 overflows logits / temperature to inf in float32; the limit of sampling is greedy, not token 0."""
    path, _ = checkpoint
    args = ["generate", "--model", str(path), "--prompt", "hello", "--max-new-tokens", "8", "--show-ids"]
    greedy = ids_of(posttune_cli(*args))
    assert ids_of(posttune_cli(*args, "--temperature", "1e-40", "--seed", "1")) == greedy
    assert set(greedy) != {0}


def test_an_empty_prompt_is_one_line(tmp_path, register_plugin, posttune_cli):
    """The chatml tiny tokenizer adds no BOS: "" is no tokens at all."""
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    path, tokenizer = short_context_checkpoint(tmp_path, template="chatml")
    assert tokenizer.encode("") == []
    result = posttune_cli("generate", "--model", str(path), "--prompt", "hi", "--prompt", "")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "--prompt 2 of 2 is empty" in result.stderr


# ---- the context: prompts refused, new tokens capped ---------------------------------------------

def test_a_prompt_that_fills_the_context_is_refused_not_truncated(checkpoint, posttune_cli):
    path, tokenizer = checkpoint
    long_prompt = "abcdefgh" * 8
    length = len(tokenizer.encode(long_prompt))
    assert length >= CONTEXT
    result = posttune_cli("generate", "--model", str(path), "--prompt", long_prompt)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and result.stdout == ""
    assert (f"--prompt is {length} tokens, which leaves no room for a new token in the model's context of "
            f"{CONTEXT} (max_position_embeddings)") in result.stderr
    assert "never truncated" in result.stderr
    several = posttune_cli("generate", "--model", str(path), "--prompt", "hi", "--prompt", long_prompt)
    assert several.exit_code == 2 and "--prompt 2 of 2 is" in several.stderr


def test_the_context_boundary_is_exact(capsys):
    """A prompt one token short of the context leaves room for exactly one new token; one of the context's length
    leaves none and is refused (not capped to 0 new tokens)."""
    from posttune_generate.command import fit_prompts
    from posttune.errors import PosttuneError

    assert fit_prompts(8, [[5] * 7], 16) == 1 and "capped to 1" in capsys.readouterr().err
    with pytest.raises(PosttuneError, match="is 8 tokens, which leaves no room for a new token"):
        fit_prompts(8, [[5] * 8], 16)


def test_generation_stops_at_every_stop_id_the_checkpoint_lists(checkpoint, posttune_cli, monkeypatch):
    """generation_config.json's ``eos_token_id`` list (Llama 3: end of turn and end of text) is what transformers'
    ``generate`` stops at; ``posttune generate`` passes the same ids, not only the tokenizer's eos."""
    import transformers

    from posttune_generate import kv_loop as generation

    path, tokenizer = checkpoint
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_id, 1]}))
    passed, real = [], generation.generate_batch
    monkeypatch.setattr(generation, "generate_batch",
                        lambda *args, **kwargs: passed.append(kwargs["stop_token_ids"]) or real(*args, **kwargs))
    assert posttune_cli("generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "2").exit_code == 0
    assert [list(ids) for ids in passed] == [transformers.GenerationConfig.from_pretrained(path).eos_token_id] \
        == [[tokenizer.eos_id, 1]]


def test_new_tokens_past_the_context_are_capped_with_one_warning(checkpoint, posttune_cli):
    """The capped run is exactly the run that asked for the room left; a request that fits says nothing."""
    path, tokenizer = checkpoint
    room = CONTEXT - len(tokenizer.encode("hello"))
    args = ["generate", "--model", str(path), "--prompt", "hello", "--show-ids"]
    capped = posttune_cli(*args, "--max-new-tokens", "1000")
    exact = posttune_cli(*args, "--max-new-tokens", str(room))
    assert capped.stdout == exact.stdout and exact.stderr == ""
    assert capped.stderr == (f"posttune: warning: generate: --max-new-tokens 1000 capped to {room}: the prompt "
                             f"({CONTEXT - room} tokens) and its completion must fit the model's context of "
                             f"{CONTEXT} tokens (max_position_embeddings)\n")
    assert len(ids_of(capped)) <= room


CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (8 << 30, resource.getrlimit(resource.RLIMIT_DATA)[1]))
from posttune.cli.main import main
code = main(sys.argv[2:])
peak = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
open(sys.argv[1], "w").write(str(peak))
sys.exit(code)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_a_huge_max_new_tokens_finishes_quickly_in_bounded_memory(tmp_path):
    """Asked for 1e8 tokens (a 50 GB KV cache for this model; the probe's run was killed at 22 GB),
    a fresh process generates what fits the context and peaks far below 2 GiB. VmHWM, not ru_maxrss:
    Linux carries the forking pytest's peak into a child's ru_maxrss. RLIMIT_DATA makes a regression
    fail fast instead of filling the machine."""
    path, _ = short_context_checkpoint(tmp_path / "model")
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "peak"), "generate", "--model", str(path),
                          "--prompt", "hi", "--max-new-tokens", "100000000", "--device", "cpu", "--show-ids"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.stderr[-2000:]
    warnings = [line for line in run.stderr.splitlines() if line.startswith("posttune:")]
    assert len(warnings) == 1 and "--max-new-tokens 100000000 capped to" in warnings[0]
    assert len(run.stdout.rstrip("\n").rsplit("\n", 1)[1].split()) < CONTEXT
    assert int((tmp_path / "peak").read_text()) < 2 << 30
    assert elapsed < 120


# ---- the library: the same ranges and the same cap for every caller (GRPO, KD, generate) -----------

@pytest.mark.parametrize(("setting", "value"), [("temperature", -1.0), ("temperature", float("nan")),
                                                ("temperature", float("inf")), ("top_k", 0), ("top_k", 2.5),
                                                ("top_p", 0.0), ("top_p", 1.01), ("min_p", -0.1), ("min_p", 1.5)])
def test_check_sampling_names_the_setting_out_of_range(setting, value):
    with pytest.raises(SamplingError) as error:
        check_sampling(**{setting: value})
    assert error.value.name == setting and str(error.value).startswith(f"{setting} must be {error.value.allowed}")


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_sampling_checks_its_new_token_count_on_creation(value):
    from posttune.generation import Sampling

    with pytest.raises(SamplingError, match=f"max_new_tokens must be an integer >= 0, got {value!r}"):
        Sampling(value)


def test_a_batch_of_prompts_given_as_one_is_refused(short_model):
    """generate takes one prompt: a [2, n] tensor was read as one prompt, its rows end to end."""
    from posttune_generate import generate

    with pytest.raises(ValueError, match=r"got shape \[2, 3\] \(generate_batch takes several prompts\)"):
        generate(short_model, torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=2)
    assert len(generate(short_model, torch.tensor([[5, 6, 7]]), max_new_tokens=2)) == 2


def test_the_off_values_and_the_edges_are_accepted():
    check_sampling(temperature=0.0, top_k=None, top_p=None, min_p=None)
    check_sampling(temperature=0.7, top_k=1, top_p=1.0, min_p=0.0)
    check_sampling(temperature=1e-40, top_k=10**9, top_p=1e-9, min_p=1.0)


@pytest.fixture(scope="module")
def short_model():
    converter = {c.family: c for c in posttune_llama.CONVERTERS}["llama"]
    return native_from_hf(tiny_hf_model(tiny_llama_config(max_position_embeddings=CONTEXT)), posttune_llama.LLAMA,
                          converter)


def test_generate_batch_refuses_a_negative_temperature_rather_than_going_greedy(short_model):
    with pytest.raises(SamplingError, match="temperature must be a finite number >= 0, got -1.0"):
        generate_batch(short_model, [[5, 6, 7]], max_new_tokens=4, temperature=-1.0)


def test_generate_batch_caps_each_rows_new_tokens_and_sizes_its_kv_cache_by_the_context(short_model, monkeypatch):
    """Rows of 5 and 9 tokens, no stop token, 1e8 asked: each row fills the context of 32, 27 and 23 new tokens
    (its own room, not the longest prompt's), and the left-padded cache holds 9 + 27 positions, not 1e8 (a
    larger one fails here, before it allocates anything). The short row's completion is the one it gets alone."""
    import posttune_generate.kv_loop as generation

    sizes = []

    class RecordingCache(generation.KVCache):
        def __init__(self, max_len):
            assert max_len <= 9 + CONTEXT - 5, f"a KV cache of {max_len} positions for a context of {CONTEXT}"
            sizes.append(max_len)
            super().__init__(max_len)

    monkeypatch.setattr(generation, "KVCache", RecordingCache)
    prompts = [list(range(5, 10)), list(range(5, 14))]
    out = generate_batch(short_model, prompts, max_new_tokens=10**8, temperature=1.0, seed=0)
    assert sizes == [9 + CONTEXT - 5] and out.tokens.shape == (2, CONTEXT - 5)
    assert out.mask.sum(dim=1).tolist() == [CONTEXT - 5, CONTEXT - 9]
    capped = generate_batch(short_model, prompts, max_new_tokens=CONTEXT - 5, temperature=1.0, seed=0)
    assert torch.equal(out.tokens, capped.tokens) and torch.equal(out.logprobs, capped.logprobs)
    alone = generate_batch(short_model, prompts[:1], max_new_tokens=10**8, seeds=[generation.derive_seed(0, 0)],
                           temperature=1.0)
    assert torch.equal(alone.tokens[0], out.tokens[0])


def test_generate_batch_refuses_a_prompt_longer_than_the_context(short_model):
    with pytest.raises(ValueError, match=f"longer than the model's context of {CONTEXT} tokens"):
        generate_batch(short_model, [[5] * 3, [5] * (CONTEXT + 1)], max_new_tokens=4)
    full = generate_batch(short_model, [[5] * CONTEXT], max_new_tokens=4)  # fits exactly: no room, no tokens
    assert full.tokens.shape == (1, 0)


def test_a_row_that_fills_the_context_gets_no_token_beside_one_with_room(short_model):
    """In one batch with a row that has room, a prompt of exactly the context's length still gets no new token
    (a token past the context would sit at an untrained position), and the other row's completion is its own."""
    prompts = [[5] * CONTEXT, [5, 6, 7]]
    out = generate_batch(short_model, prompts, max_new_tokens=4)
    alone = generate_batch(short_model, prompts[1:], max_new_tokens=4)
    assert out.mask.sum(dim=1).tolist() == [0, 4]
    assert out.token_lists() == [[], alone.token_lists()[0]]


def test_context_length_reads_the_rotary_embedding_and_its_scaling(short_model):
    assert context_length(short_model) == CONTEXT
    assert context_length(torch.nn.Linear(2, 2)) is None  # unknown: no cap
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length(RotaryEmbedding(16, scaling=yarn, max_position_embeddings=32768)) == 131072
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert context_length(RotaryEmbedding(16, scaling=dynamic, max_position_embeddings=4096)) == 8192
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    assert context_length(RotaryEmbedding(16, scaling=llama3, max_position_embeddings=131072)) == 131072


RANK_PROGRAM = r"""
import json, sys
import torch, torch.distributed as dist
import posttune_llama
from posttune_generate import generate_batch
from posttune.training import distributed
from posttune.testing.tiny import native_from_hf, tiny_hf_model, tiny_llama_config
torch.set_num_threads(1)
dist.init_process_group("gloo")
converter = {c.family: c for c in posttune_llama.CONVERTERS}["llama"]
model = native_from_hf(tiny_hf_model(tiny_llama_config(max_position_embeddings=16)), posttune_llama.LLAMA, converter)
forwards = []
model.register_forward_hook(lambda *_: forwards.append(1))
prompts = json.loads(sys.argv[1])[dist.get_rank()]
out = generate_batch(model, prompts, max_new_tokens=8, temperature=1.0, seed=0)
print(json.dumps({"forwards": len(forwards), "kept": int(out.mask.sum())}))
distributed.shutdown()  # barrier, then destroy: a rank leaving a live gloo group can abort at exit
"""


@pytest.mark.slow
def test_each_row_has_its_own_cap_and_the_ranks_agree_on_the_steps():
    """Context 16: rank 0's 3-token prompt leaves room for all 8 tokens, rank 1's 12-token one for 4. Each row
    gets what its own prompt leaves (not the smallest room of any rank: a completion depends on its prompt alone),
    and both ranks run 8 forwards (one rank stepping alone would hang the other in the per-step all-reduce)."""
    jobs = json.dumps([[[5, 6, 7]], [list(range(5, 17))]])
    results = run_ranks(RANK_PROGRAM, jobs, env=dict(os.environ))
    assert results == [{"forwards": 8, "kept": 8}, {"forwards": 8, "kept": 4}]
