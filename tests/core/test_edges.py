"""Boundaries no other test reached (found by mutating the code): a packed row filled exactly, an epoch ending
in a partial accumulation, a zero-length row made a document, a reward score read at the last real token (as
transformers' sequence classifiers read it), a classifier config's label count, the hub's offline switch and a
TLS-intercepting proxy, a development build meeting a requirement, and an undecodable byte's line."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from packaging.specifiers import SpecifierSet

from posttune import hub
from posttune.checkpoint.score_head import checkpoint_labels, sequence_scores
from posttune.config.requires import check_requires
from posttune.data.collate import rows_as_documents
from posttune.data.local_files import _scan_utf8
from posttune.data.packing import pack
from posttune.training.compose import steps_per_epoch


def test_samples_that_fill_a_row_exactly_share_it():
    assert [[len(s) for s in row] for row in pack([[0] * 3, [0] * 5, [0] * 8], 8)] == [[3, 5], [8]]


@pytest.mark.parametrize("batches, accumulation, steps", [(5, 2, 3), (4, 2, 2), (1, 4, 1)])
def test_an_epochs_partial_accumulation_is_a_step(batches, accumulation, steps):
    session = SimpleNamespace(train_data=[0] * batches, config=SimpleNamespace(
        train=SimpleNamespace(grad_accum_steps=accumulation), data=SimpleNamespace(train=SimpleNamespace(
            streaming=False))))
    assert steps_per_epoch(session, "train.max_steps", "required") == steps


def test_a_row_of_no_tokens_is_still_a_document_of_its_own():
    """Each row stays one document (a placeholder keeps one token), so document i is row i: a score or a loss is
    never read from another row's tokens."""
    ids = torch.tensor([[5, 6, 7], [9, 0, 0], [4, 4, 0]])
    out = rows_as_documents(ids, ids.clone(), torch.tensor([3, 0, 2]), pad_id=0, share_prompt=False)
    assert sorted(set(out["document_ids"].flatten().tolist())) == [0, 1, 2]


def test_a_score_is_read_at_the_last_token_that_is_not_padding():
    """transformers' ``*ForSequenceClassification``: the last position whose id is not the pad id (left-padded
    rows, and a row with a pad id inside it: its last non-pad token)."""
    ids = torch.tensor([[0, 0, 5, 6], [5, 0, 6, 0]])
    scores = torch.arange(8.0).view(2, 4, 1)
    non_pad = (ids != 0).int()
    last = (torch.arange(4) * non_pad).argmax(-1)  # transformers' own rule, written out
    assert sequence_scores(scores, ids, 0).flatten().tolist() == scores[torch.arange(2), last, 0].tolist()


def test_a_classifier_config_without_labels_has_transformers_default_two():
    transformers = pytest.importorskip("transformers")
    assert checkpoint_labels({"architectures": ["LlamaForSequenceClassification"]}) == \
        transformers.PretrainedConfig().num_labels == 2


@pytest.mark.parametrize("value, offline", [("1", True), ("yes", True), ("ON", True), ("true", True), ("0", False),
                                            ("", False)])
def test_hf_hub_offline_reads_as_huggingface_hub_reads_it(monkeypatch, value, offline):
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert hub.offline_requested() is offline


def test_a_hub_behind_a_tls_intercepting_proxy_is_reachable():
    """The proxy's certificate is not the system's: the hub answered, so the error is the download's to tell."""
    error = urllib.error.URLError(ssl.SSLCertVerificationError(1, "self-signed certificate in chain"))
    with mock.patch.object(urllib.request, "urlopen", side_effect=error):
        assert hub._answers("https://huggingface.co", 1.0) is True


def test_a_development_build_meets_a_requirement_it_satisfies():
    assert SpecifierSet(">=0.1").contains("0.5.0.dev3", prereleases=True)  # packaging's own reading
    with mock.patch("importlib.metadata.version", return_value="0.5.0.dev3"):
        check_requires(["torch>=0.1"])


def test_an_undecodable_byte_is_named_on_its_own_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff bad"}\n{"text": "a"}\n{"text": "b"}\n')
    assert _scan_utf8(path)[1] == 2
