"""posttune-kd's losses: each divergence, with temperature and kd_ratio, equals the papers' formulas
written out directly (float64 softmaxes, no posttune code) and TRL's GKD loss; the chunked loss
equals the plain one in value and gradients (fp32, 1e-6), soft-caps, padded teachers and LoRA
heads included."""

from __future__ import annotations

import pytest
import torch
from posttune_lora.layer import LoRALinear
from posttune.plugin import head_weight
from posttune_kd.chunked import Head, Settings, chunked_kd_loss, plain_kd_loss
from posttune_kd.divergences import token_divergence

TOL = 1e-6
KINDS = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.1), ("jsd", 0.9), ("jsd", 0.0),
         ("jsd", 1.0)]


def logits_pair(rows: int = 9, vocab: int = 37, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * 3, torch.randn(rows, vocab, generator=generator) * 3)


def direct(student: torch.Tensor, teacher: torch.Tensor, kind: str, temperature: float, beta: float) -> torch.Tensor:
    """The per-token divergence from its definition, in float64 probabilities."""
    p_s = torch.softmax(student.double() / temperature, -1)
    p_t = torch.softmax(teacher.double() / temperature, -1)

    def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return (p * (p.log() - q.log())).sum(-1)

    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return kl(p_t, p_s)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return kl(p_s, p_t)
    mixture = beta * p_t + (1 - beta) * p_s
    return beta * kl(p_t, mixture) + (1 - beta) * kl(p_s, mixture)


@pytest.mark.parametrize("kind,beta", KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_divergence_equals_its_definition(kind, beta, temperature):
    student, teacher = logits_pair()
    got = token_divergence(student, teacher, kind, temperature=temperature, beta=beta)
    want = direct(student, teacher, kind, temperature, beta)
    assert got.dtype == torch.float32 and got.shape == (9,)
    torch.testing.assert_close(got.double(), want, atol=TOL, rtol=TOL)
    assert (want > 1e-3).all()  # the cases are not trivially zero


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_jsd_equals_trl_gkd(beta, temperature):
    """TRL's GKD loss (summed over tokens) is the same generalised JSD, limits included."""
    trainer = pytest.importorskip("trl.experimental.gkd.gkd_trainer",  # tox installs trl: this runs in CI
                                  reason="the reference is TRL's GKD trainer (trl.experimental.gkd)")
    gkd = trainer.GKDTrainer.generalized_jsd_loss
    student, teacher = logits_pair(seed=3)
    want = gkd(student[None], teacher[None], beta=beta, temperature=temperature, reduction="sum")
    got = token_divergence(student, teacher, "jsd", temperature=temperature, beta=beta).sum()
    torch.testing.assert_close(got, want, atol=TOL * 10, rtol=TOL)


@pytest.mark.parametrize("kind,beta", KINDS[:3])
@pytest.mark.parametrize("kd_ratio", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_mixed_loss_equals_its_definition(kind, beta, kd_ratio, temperature):
    """kd_ratio * divergence(T) + (1 - kd_ratio) * cross-entropy of the untempered student to the labels."""
    student, teacher = logits_pair()
    targets = torch.randint(0, 37, (9,), generator=torch.Generator().manual_seed(1))
    sums = plain_kd_loss(student, teacher, targets, Settings(kind, temperature, beta, kd_ratio))
    ce = -torch.log_softmax(student.double(), -1).gather(1, targets[:, None]).squeeze(1)
    divergence = direct(student, teacher, kind, temperature, beta)
    torch.testing.assert_close(sums.loss.double(), (kd_ratio * divergence + (1 - kd_ratio) * ce).sum(),
                               atol=TOL * 10, rtol=TOL)
    torch.testing.assert_close(sums.divergence.double(), divergence.sum(), atol=TOL * 10, rtol=TOL)
    torch.testing.assert_close(sums.ce.double(), ce.sum(), atol=TOL * 10, rtol=TOL)


def test_padded_teacher_is_cut_to_the_students_vocabulary():
    student, teacher = logits_pair(vocab=37)
    padded = torch.cat([teacher, torch.full((9, 11), 5.0)], dim=1)
    targets = torch.zeros(9, dtype=torch.long)
    cut = plain_kd_loss(student, padded, targets, Settings("forward_kl", vocab=37))
    same = plain_kd_loss(student, teacher, targets, Settings("forward_kl"))
    assert float(cut.loss) == pytest.approx(float(same.loss), abs=1e-6)


# ---- chunked == plain -----------------------------------------------------------------------------

def heads(hidden: int = 16, vocab: int = 40, teacher_vocab: int = 40, seed: int = 0, bias: bool = True):
    generator = torch.Generator().manual_seed(seed)
    student = torch.nn.Linear(hidden, vocab, bias=bias)
    teacher = torch.nn.Linear(hidden + 8, teacher_vocab, bias=bias)
    with torch.no_grad():
        for param in [*student.parameters(), *teacher.parameters()]:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    rows = 23
    student_hidden = torch.randn(rows, hidden, generator=generator, requires_grad=True)
    teacher_hidden = torch.randn(rows, hidden + 8, generator=generator)
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    return student, teacher, student_hidden, teacher_hidden, targets


def plain_reference(student, teacher, student_hidden, teacher_hidden, targets, settings, softcap=None,
                    teacher_softcap=None):
    def cap(x, c):
        return x if c is None else torch.tanh(x / c) * c

    return plain_kd_loss(cap(student(student_hidden).float(), softcap),
                         cap(teacher(teacher_hidden).float(), teacher_softcap), targets, settings)


def grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.0),
                                       ("jsd", 1.0)])
@pytest.mark.parametrize("temperature,kd_ratio", [(1.5, 0.6), (1.0, 1.0), (2.0, 0.0), (1.0, 0.3)])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_chunked_equals_plain(kind, beta, temperature, kd_ratio, chunk_size):
    """The chunked loss's closed-form gradients against autograd through the plain loss."""
    student, teacher, hidden, teacher_hidden, targets = heads()
    how = Settings(kind, temperature, beta, kd_ratio=kd_ratio)
    want = plain_reference(student, teacher, hidden, teacher_hidden, targets, how)
    got = chunked_kd_loss(hidden, Head(student.weight, student.bias), teacher_hidden,
                          Head(teacher.weight, teacher.bias), targets, how, chunk_size=chunk_size)
    for name in ("loss", "divergence", "ce"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=TOL, rtol=TOL)
    params = [hidden, student.weight, student.bias]
    for g_got, g_want in zip(grads(got.loss, params), grads(want.loss, params), strict=True):
        assert g_want.abs().max() > 1e-4
        torch.testing.assert_close(g_got, g_want, atol=TOL, rtol=TOL)


def test_chunked_with_softcaps_padding_and_a_scaled_gradient():
    """Gemma-style soft-caps on both heads, a teacher padded past the student's vocabulary, and a
    loss that is scaled before backward (the trainer's accumulation)."""
    student, teacher, hidden, teacher_hidden, targets = heads(teacher_vocab=48, bias=False)
    how = Settings("jsd", 1.0, 0.5, kd_ratio=0.5, vocab=40)
    want = plain_reference(student, teacher, hidden, teacher_hidden, targets, how, softcap=3.0, teacher_softcap=4.0)
    got = chunked_kd_loss(hidden, Head(student.weight, None, 3.0), teacher_hidden, Head(teacher.weight, None, 4.0),
                          targets, how, chunk_size=4)
    torch.testing.assert_close(got.loss, want.loss, atol=TOL, rtol=TOL)
    params = [hidden, student.weight]
    for g_got, g_want in zip(grads(got.loss * 0.37, params), grads(want.loss * 0.37, params), strict=True):
        torch.testing.assert_close(g_got, g_want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_chunked_reaches_an_adapted_head(kind):
    """A LoRA/DoRA head folded into one weight by head_weight: the adapters get the plain loss's gradients.

    The folded DoRA weight rounds differently from the layer's own forward (fp32), hence 2e-6."""
    student, teacher, hidden, teacher_hidden, targets = heads(bias=False)
    torch.manual_seed(0)
    head = LoRALinear(student, rank=4, alpha=8.0, kind=kind)
    with torch.no_grad():
        head.lora_B.weight.normal_(0, 0.3)
    student.weight.requires_grad_(False)
    how = Settings("forward_kl", kd_ratio=0.8)
    want = plain_kd_loss(head(hidden).float(), teacher(teacher_hidden).float(), targets, how)
    weight, bias = head_weight(head)
    got = chunked_kd_loss(hidden, Head(weight, bias), teacher_hidden, Head(teacher.weight), targets, how,
                          chunk_size=6)
    torch.testing.assert_close(got.loss, want.loss, atol=TOL, rtol=TOL)
    params = [hidden, *[p for p in head.parameters() if p.requires_grad]]
    for g_got, g_want in zip(grads(got.loss, params), grads(want.loss, params), strict=True):
        torch.testing.assert_close(g_got, g_want, atol=2 * TOL, rtol=TOL)


def test_chunked_without_grad_and_twice_through_backward(monkeypatch):
    """Under no_grad (evaluation) no chunk computes a gradient: autograd still said a trainable head needed one,
    and each evaluation of a full fine-tune built a head-sized fp32 gradient it threw away (a KD audit)."""
    import posttune_kd.chunked

    student, teacher, hidden, teacher_hidden, targets = heads()
    how = Settings("forward_kl")
    asked, chunk_loss = [], posttune_kd.chunked.chunk_loss
    monkeypatch.setattr(posttune_kd.chunked, "chunk_loss",
                        lambda *args, need_grad, **kwargs: asked.append(need_grad) or chunk_loss(
                            *args, need_grad=need_grad, **kwargs))
    with torch.no_grad():
        quiet = chunked_kd_loss(hidden, Head(student.weight, student.bias), teacher_hidden,
                                Head(teacher.weight, teacher.bias), targets, how, chunk_size=8)
    loud = chunked_kd_loss(hidden, Head(student.weight, student.bias), teacher_hidden,
                           Head(teacher.weight, teacher.bias), targets, how, chunk_size=8)
    assert float(quiet.loss) == float(loud.loss) and not quiet.loss.requires_grad
    chunks = -(-len(targets) // 8)
    assert asked == [False] * chunks + [True] * chunks
    loud.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loud.loss.backward()
