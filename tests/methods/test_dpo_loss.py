"""DPO, cDPO, IPO, SimPO, SLiC's hinge, robust DPO, RPO and ORPO on a real model and batch: losses, rewards,
metrics and gradients equal the papers' formulas computed independently (plain log-softmax over padded
rows, no posttune loss code),
fp32, 1e-6, for padded and padding-free (one row of documents) batches alike, with each pair's prompt
computed once (``share_prompt``) or per response. TRL's other pair losses (DPO on mean log-probs, EXO, NCA,
BCO, SPPO, APO, DiscoPOP) the same way, on the shared-prompt layout (the layouts are the batch's, not the
loss's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from run_support import assert_loss_kernel_keeps_the_step, compose_run, pair_rows

from posttune.adapters import AdaptersOff, adapted_modules

TOL = 1e-6
CASES = {
    "dpo": {"loss_type": "sigmoid", "beta": 0.5},
    "cdpo": {"loss_type": "sigmoid", "beta": 0.5, "label_smoothing": 0.2},
    "ipo": {"loss_type": "ipo", "beta": 0.5},
    "simpo": {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.3},
    "simpo_smoothed": {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.3, "label_smoothing": 0.1},
    "hinge": {"loss_type": "hinge", "beta": 0.5},
    "robust": {"loss_type": "robust", "beta": 0.5, "label_smoothing": 0.2},
    "rpo": {"loss_type": "sigmoid", "beta": 0.5, "rpo_alpha": 0.7},
    "rpo_ipo": {"loss_type": "ipo", "beta": 0.5, "rpo_alpha": 0.7},
    "orpo": {"loss_type": "orpo", "beta": 0.3},
}
#: TRL's further pair losses, checked on one layout
MORE_CASES = {
    "sigmoid_norm": {"loss_type": "sigmoid_norm", "beta": 2.0},
    "exo_pair": {"loss_type": "exo_pair", "beta": 0.5, "label_smoothing": 1e-3},
    "nca_pair": {"loss_type": "nca_pair", "beta": 0.5},
    "bco_pair": {"loss_type": "bco_pair", "beta": 0.5},
    "sppo_hard": {"loss_type": "sppo_hard", "beta": 0.5},
    "apo_zero": {"loss_type": "apo_zero", "beta": 0.5},
    "apo_down": {"loss_type": "apo_down", "beta": 0.5},
    "discopop": {"loss_type": "discopop", "beta": 0.5, "discopop_tau": 0.3},
    "aot": {"loss_type": "aot", "beta": 0.5, "label_smoothing": 0.1},
    "aot_unpaired": {"loss_type": "aot_unpaired", "beta": 0.5},
}
LAYOUTS = ("shared_prompt", "padding_free", "padded")
#: SPPO's gradient is proportional to the log-ratios themselves (a squared error of them, not a saturating
#: function): differences of log-prob sums near 40, where one fp32 ulp is 3.8e-6 -- measured 2.4e-6 relative to
#: the largest gradient entry, where the others stay within 1e-6
LOOSER = {"sppo_hard": 5.0}
#: the loss types computed on per-token mean log-probabilities, and those without a reference model
AVERAGED, REFERENCE_FREE = ("ipo", "simpo", "orpo", "sigmoid_norm"), ("simpo", "orpo")
#: how far the policy is moved off its reference, where not the default: hinge's pairs fall on both sides of
#: its corner, ``1 - beta h`` from -0.38 to 1.6 (checked in the test)
PERTURB = {"hinge": 0.1}


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int = 1, scale: float = 0.05) -> None:
    """Move the policy away from its reference so the log-ratios are not all zero."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.add_(torch.randn(param.shape, generator=generator) * scale)


def independent_logps(model, batch, *, average: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) sequence log-probs: full logits, log-softmax, gather, masked sum (or mean)."""
    logits = model(batch["input_ids"]).float()
    labels = batch["labels"]
    mask = labels != -100
    per_token = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    sequences = per_token.sum(-1) / mask.sum(-1) if average else per_token.sum(-1)
    return sequences.chunk(2)


def paper(settings: dict, pc, pr, rc, rr, chosen_means) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Per-pair loss, rewards and extra metrics as the papers write them (DPO eq. 7, cDPO, IPO eq. 17, SimPO
    eq. 6, SLiC-HF's calibration loss as TRL scales it, rDPO eq. 8, RPO eq. 2 with its length-normalised NLL,
    ORPO eq. 4, 6 and 7); ``chosen_means``: the chosen responses' per-token mean log-probs."""
    beta, eps = settings["beta"], settings.get("label_smoothing", 0.0)
    kind, extra = settings["loss_type"], {}
    if kind == "simpo":
        z = beta * pc - beta * pr - settings["simpo_gamma"]
        loss = -(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))
        return loss, beta * pc, beta * pr, extra
    if kind == "orpo":
        def log_odds(logp):  # log(p / (1 - p)), p the per-token mean probability exp(logp)
            return torch.log(torch.exp(logp) / (1 - torch.exp(logp)))

        ratio = log_odds(pc) - log_odds(pr)
        extra = {"nll_loss": -pc, "log_odds_ratio": torch.log(torch.sigmoid(ratio)), "log_odds_chosen": ratio}
        return -pc - beta * torch.log(torch.sigmoid(ratio)), beta * pc, beta * pr, extra
    h = (pc - rc) - (pr - rr)
    c, r = beta * (pc - rc), beta * (pr - rr)  # each response's implicit reward
    if kind == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    elif kind == "exo_pair":  # EXO eq. 16, K = 2: KL(softmax(beta (pi - ref)) over {chosen, rejected} || (1-eps, eps))
        q_chosen = torch.exp(c) / (torch.exp(c) + torch.exp(r))
        loss = q_chosen * torch.log(q_chosen / (1 - eps)) + (1 - q_chosen) * torch.log((1 - q_chosen) / eps)
    elif kind == "nca_pair":  # NCA's pairwise loss
        loss = -torch.log(torch.sigmoid(c)) - 0.5 * torch.log(torch.sigmoid(-c)) - 0.5 * torch.log(torch.sigmoid(-r))
    elif kind == "bco_pair":  # BCO's binary classifier, chosen as positives and rejected as negatives, no shift
        loss = -torch.log(torch.sigmoid(c)) - torch.log(torch.sigmoid(-r))
    elif kind == "sppo_hard":  # SPPO eq. 4.7 with win probabilities 1 and 0: log-ratios pulled to +-1 / (2 beta)
        loss = ((pc - rc) - 1 / (2 * beta)) ** 2 + ((pr - rr) + 1 / (2 * beta)) ** 2
    elif kind == "apo_zero":  # APO eq. 7
        loss = 1 - torch.sigmoid(c) + torch.sigmoid(r)
    elif kind == "apo_down":  # APO eq. 8
        loss = torch.sigmoid(c) + 1 - torch.sigmoid(c - r)
    elif kind == "discopop":  # DiscoPOP eq. 5: a logistic and an exponential loss, blended by sigmoid(z / tau)
        z = beta * h
        blend = 1 / (1 + torch.exp(-z / settings["discopop_tau"]))
        loss = (1 - blend) * torch.log(1 + torch.exp(-z)) + blend * torch.exp(-z)
    elif kind in ("aot", "aot_unpaired"):  # AOT eq. 9 and its unpaired form: values matched by rank in the batch
        first, second = ((pc - pr, rc - rr) if kind == "aot" else (pc - rc, pr - rr))
        ranked = [sorted(range(len(values)), key=lambda i, v=values: float(v[i].detach()))
                  for values in (first, second)]
        d = torch.stack([first[i] - second[j] for i, j in zip(*ranked, strict=True)])  # k-th smallest of each
        loss = -(1 - eps) * torch.log(torch.sigmoid(beta * d)) - eps * torch.log(torch.sigmoid(-beta * d))
    elif kind == "hinge":
        loss = torch.clamp(1 - beta * h, min=0)
    elif kind == "robust":
        loss = ((1 - eps) * -torch.log(torch.sigmoid(beta * h)) - eps * -torch.log(torch.sigmoid(-beta * h))) \
            / (1 - 2 * eps)
    else:
        loss = -(1 - eps) * torch.log(torch.sigmoid(beta * h)) - eps * torch.log(torch.sigmoid(-beta * h))
    if settings.get("rpo_alpha") is not None:
        extra = {"nll_loss": -chosen_means}
        loss = loss + settings["rpo_alpha"] * -chosen_means
    return loss, beta * (pc - rc), beta * (pr - rr), extra


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(("case", "layout"), [(case, layout) for case in CASES for layout in LAYOUTS]
                         + [(case, "shared_prompt") for case in MORE_CASES])
def test_loss_rewards_and_gradients_equal_the_papers_formulas(llama_dpo, make_dpo_config, tmp_path, case, layout):
    settings = {**CASES, **MORE_CASES}[case]
    padding_free, shared = layout != "padded", layout == "shared_prompt"
    session = compose_run(make_dpo_config(tmp_path, rows=8, method={"name": "dpo", "padding_free": padding_free,
                                                                    "share_prompt": shared, **settings}))
    assert ("reference" in session.models) == (settings["loss_type"] not in REFERENCE_FREE)
    perturb(session.model, scale=PERTURB.get(case, 0.05))
    batch = next(iter(session.train_data))
    forwards = []
    handle = session.model.register_forward_hook(lambda _m, args, out: forwards.append((args[0].shape, out.shape)))
    out = session.plan.method.descriptor.loss(session, batch)
    handle.remove()
    assert ("document_ids" in batch) == padding_free
    rows = 1 if padding_free else 8  # chosen and rejected in one forward pass
    labelled = int((batch["labels"] != -100).sum())  # only they reach the head
    assert forwards == [((rows, batch["input_ids"].shape[1]), (labelled, 384))]
    assert ("positions" in batch) == shared
    if shared:  # each rejected response without the prompt tokens it shares with its chosen one
        assert batch["input_ids"].shape[1] < int(batch["num_tokens"])
    elif padding_free:  # no padding computed: the row is the 8 responses end to end
        assert batch["input_ids"].shape[1] == int(batch["num_tokens"])
    assert out.unit == "pairs" and float(out.normaliser) == 4
    (out.loss_sum / out.normaliser).backward()
    ours = gradients(session.model)

    average = settings["loss_type"] in AVERAGED
    pc, pr = independent_logps(session.model, pair_rows(batch), average=average)
    rc = rr = None
    if "reference" in session.models:
        with torch.no_grad():
            rc, rr = independent_logps(session.models["reference"], pair_rows(batch), average=average)
    chosen_means = independent_logps(session.model, pair_rows(batch), average=True)[0]
    losses, chosen_rewards, rejected_rewards, extra = paper(settings, pc, pr, rc, rr, chosen_means)
    if settings["loss_type"] == "hinge":  # some pairs inside the margin, some past it (no gradient)
        margins = 1 - (chosen_rewards - rejected_rewards)  # 1 - beta h
        assert bool((margins > 0.1).any()) and bool((margins < -0.1).any()), margins
    losses.mean().backward()
    theirs = gradients(session.model)

    # fp32 rounding grows with the value: hinge's larger perturbation gives gradient entries near 1.3, and SPPO's
    # and EXO's losses are near 3, where two orders of summing differ by up to 2e-6 (measured on an Intel Xeon):
    # 1e-6 times the value's scale, doubled
    loss_scale = max(1.0, abs(float(losses.mean().detach())))
    torch.testing.assert_close(out.loss_sum / out.normaliser, losses.mean().detach(), atol=2 * TOL * loss_scale,
                               rtol=0)
    assert ours.keys() == theirs.keys() and len(ours) == len(list(session.model.parameters()))
    for name, grad in theirs.items():
        scale = max(1.0, float(grad.abs().max())) * LOOSER.get(case, 1.0)
        torch.testing.assert_close(ours[name], grad, atol=2 * TOL * scale, rtol=0, msg=name)
    metrics = {key: float(total.detach() / count) for key, (total, count) in out.metrics.items()}
    expected = {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
                "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
                "rewards/accuracy": (chosen_rewards > rejected_rewards).float().mean(),
                "logps/chosen": pc.mean(), "logps/rejected": pr.mean(),
                **{key: values.mean() for key, values in extra.items()}}
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(metrics[key] - float(value.detach())) <= TOL, key


#: loss kernels of posttune-memory, with options that make them cheap here (aot_eager: Dynamo and AOTAutograd's
#: graphs, run without inductor's code generation)
KERNEL_OPTIONS = {"chunked_cross_entropy": {"chunk_size": 7}, "compile": {"backend": "aot_eager"}}


@pytest.mark.parametrize("technique", sorted(KERNEL_OPTIONS))
def test_with_a_loss_kernel_technique_the_loss_and_gradients_are_unchanged(llama_dpo, make_dpo_config, tmp_path,
                                                                           technique):
    """Padding-free pairs with the shared prompt once (``positions`` continue it): the kernel's logits
    at labelled positions give the plain path's loss and gradients."""
    assert_loss_kernel_keeps_the_step(
        lambda directory, memory: make_dpo_config(directory, rows=8, memory=memory,
                                                  memory_options={technique: KERNEL_OPTIONS[technique]}
                                                  if memory else {}),
        tmp_path, technique, prepare=perturb)


@torch.no_grad()
def train_adapters(model: torch.nn.Module) -> None:
    """Give every adapter a non-zero update (as after some training), the same in every model."""
    generator = torch.Generator().manual_seed(3)
    for layer in adapted_modules(model).values():
        layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=generator) * 0.05)


def test_lora_reference_with_adapters_disabled_equals_a_frozen_copy_of_the_base(llama_dpo, make_dpo_config,
                                                                                 tmp_path):
    adapter = {"rank": 4, "alpha": 8}
    shared = compose_run(make_dpo_config(tmp_path / "shared", rows=8, adapter=adapter))
    config = make_dpo_config(tmp_path / "copy", rows=8, adapter=adapter)
    copied = compose_run({**config, "reference": dict(config["model"])})  # an explicit source: a frozen copy
    assert isinstance(shared.models["reference"], AdaptersOff) and shared.models["reference"].model is shared.model
    assert not isinstance(copied.models["reference"], AdaptersOff)
    assert not any(p.requires_grad for p in copied.models["reference"].parameters())
    losses = []
    for session in (shared, copied):
        train_adapters(session.model)
        out = session.plan.method.descriptor.loss(session, next(iter(session.train_data)))
        (out.loss_sum / out.normaliser).backward()
        losses.append((out.loss_sum.detach(), gradients(session.model), dict(out.metrics)))
    (loss_shared, grads_shared, metrics_shared), (loss_copied, grads_copied, metrics_copied) = losses
    assert float(metrics_shared["rewards/margin"][0]) != 0.0  # the adapters moved the policy off its reference
    torch.testing.assert_close(loss_shared, loss_copied, atol=TOL, rtol=0)
    assert grads_shared.keys() == grads_copied.keys() and all(".lora_" in name for name in grads_shared)
    for name, grad in grads_copied.items():
        torch.testing.assert_close(grads_shared[name], grad, atol=TOL, rtol=0, msg=name)
    for session in (shared, copied):  # the reference pass left the adapters switched on
        assert not any(layer.disabled for layer in adapted_modules(session.model).values())


def test_a_tie_is_not_an_accurate_pair(llama_dpo, make_dpo_config, tmp_path):
    """A LoRA policy before its first step is its reference (B = 0): every pair's rewards tie at 0, and TRL's
    ``rewards/accuracies`` (chosen > rejected) counts none of them."""
    from posttune_dpo.method import loss

    session = compose_run(make_dpo_config(tmp_path, rows=8, adapter={"rank": 4, "alpha": 8}))
    metrics = loss(session, next(iter(session.train_data))).metrics
    margin, pairs = metrics["rewards/margin"]
    accurate, _ = metrics["rewards/accuracy"]
    assert float(margin) == 0.0 and float(pairs) > 0 and float(accurate) == 0.0


def test_chunked_log_probs_equal_the_log_softmax_in_values_and_gradients():
    """With soft-caps and a sampling temperature too (what GRPO's loss scores completions with)."""
    from posttune_memory.linear_cross_entropy import linear_logps

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(29, 16, generator=generator).requires_grad_()
    weight = torch.randn(50, 16, generator=generator).requires_grad_()
    bias = torch.randn(50, generator=generator).requires_grad_()
    targets = torch.randint(0, 50, (29,), generator=generator)
    upstream = torch.randn(29, generator=generator)  # a loss that weighs each row differently
    for softcap, temperature in ((None, 1.0), (3.0, 1.0), (3.0, 0.7)):
        ours = linear_logps(hidden, weight, targets, bias=bias, softcap=softcap, chunk_size=8, temperature=temperature)
        (ours * upstream).sum().backward()
        mine = [t.grad.clone() for t in (hidden, weight, bias)]
        for t in (hidden, weight, bias):
            t.grad = None
        logits = hidden @ weight.T + bias
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        expected = F.log_softmax(logits / temperature, -1).gather(1, targets.unsqueeze(1)).squeeze(1)
        (expected * upstream).sum().backward()
        torch.testing.assert_close(ours, expected.detach(), atol=1e-5, rtol=0)
        for got, t in zip(mine, (hidden, weight, bias)):
            torch.testing.assert_close(got, t.grad, atol=1e-5, rtol=0)
            t.grad = None



def test_aot_sorts_the_real_pairs_alone_and_gives_placeholders_no_loss():
    """A micro-batch's placeholder pairs (an empty share) take no rank in AOT's sort: the real pairs' losses are
    those of the batch without them, each at a real pair's place, and the placeholders' losses and gradients 0."""
    from posttune_dpo.losses import preference_losses

    generator = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(5, generator=generator, dtype=torch.float64) for _ in range(4))
    real = torch.tensor([True, False, True, True, False])
    for kind, ranked in (("aot", pc - pr), ("aot_unpaired", pc - rc)):
        assert not torch.equal(torch.sort(ranked[real]).values, ranked[real])  # the sort moves these values
        policy = pc.clone().requires_grad_()
        losses, _, _ = preference_losses(policy, pr, rc, rr, loss_type=kind, beta=0.5, label_smoothing=0.1, real=real)
        alone, _, _ = preference_losses(pc[real], pr[real], rc[real], rr[real], loss_type=kind, beta=0.5,
                                        label_smoothing=0.1)
        torch.testing.assert_close(losses[real], alone, rtol=0, atol=1e-12)
        assert losses[~real].eq(0).all()
        losses.sum().backward()
        assert policy.grad[~real].eq(0).all() and policy.grad[real].ne(0).all()


@pytest.mark.parametrize("loss_type", ["sigmoid", "orpo"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_empty_share_is_a_placeholder_pair_of_no_weight(llama_dpo, make_dpo_config, tmp_path, loss_type, layout):
    """A rank's empty share of the last batch is one placeholder pair without targets (``rows`` -1): it counts no
    pair in the step's normaliser and adds no loss (DPO's would be log 2 at a zero log-ratio) and no gradient, so
    the step's real pairs are averaged over their own count; ORPO's odds of its mean log-prob 0 stay finite."""
    padding_free, shared = layout != "padded", layout == "shared_prompt"
    session = compose_run(make_dpo_config(tmp_path, rows=8, method={"name": "dpo", "loss_type": loss_type,
                                                                    "padding_free": padding_free,
                                                                    "share_prompt": shared}))
    batch = session.train_data.collate([])  # what the loader hands a rank with no pairs left
    assert batch["rows"].tolist() == [-1]
    out = session.plan.method.descriptor.loss(session, batch)
    assert float(out.normaliser) == 0 and float(out.loss_sum.detach()) == 0.0
    out.loss_sum.backward()
    grads = [p.grad for p in session.model.parameters() if p.grad is not None]
    assert grads and all(bool(grad.eq(0).all()) for grad in grads)
    for key, (total, _) in out.metrics.items():
        assert float(total) == 0.0, key


def test_discopop_stays_finite_where_its_exponential_overflows():
    """``exp(-z)`` is inf below z = -88.7 in fp32 and the blend weight there 0: the loss was NaN from beta h = -89
    (TRL's formula too). Written as ``exp(log m - z)``: the paper's value where both are finite, and finite beyond."""
    from posttune_dpo.losses import preference_losses

    margins = torch.tensor([-120.0, -89.0, -80.0, -1.0, 0.0, 2.0, 30.0])
    policy = margins.clone().requires_grad_()
    zeros = torch.zeros_like(margins)
    losses, _, _ = preference_losses(policy, zeros, zeros, zeros, loss_type="discopop", beta=1.0, tau=0.05)
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(policy.grad).all()
    z = margins.double()
    blend = torch.sigmoid(z / 0.05)
    paper = (1 - blend) * -F.logsigmoid(z) + blend * torch.exp(-z)
    torch.testing.assert_close(losses[2:].double(), paper[2:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(losses[:2], -margins[:2], rtol=1e-6, atol=0)  # -log sigmoid(z) = -z, far below 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wpo_weights_equal_the_papers_and_scale_each_pairs_loss_and_gradient(llama_dpo, make_dpo_config, tmp_path,
                                                                            layout):
    """WPO (eq. 2 as TRL computes it): each pair's DPO loss times ``w(chosen) * w(rejected)``, ``w(y) = exp(mean over
    y's tokens of log p(y_t) - log sum_v p(v)^2)``, the weights without gradient; from full softmaxes here."""
    padding_free, shared = layout != "padded", layout == "shared_prompt"
    session = compose_run(make_dpo_config(tmp_path, rows=8, method={
        "name": "dpo", "beta": 0.5, "wpo_weights": True, "padding_free": padding_free, "share_prompt": shared}))
    perturb(session.model)
    batch = next(iter(session.train_data))
    out = session.plan.method.descriptor.loss(session, batch)
    (out.loss_sum / out.normaliser).backward()
    ours = gradients(session.model)

    rows = pair_rows(batch)
    logps = session.model(rows["input_ids"]).float().log_softmax(-1)
    mask = rows["labels"] != -100
    label_logps = logps.gather(-1, rows["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    log_sum_sq = torch.log((logps.exp() ** 2).sum(-1))
    aligned = ((label_logps - log_sum_sq) * mask).sum(-1) / mask.sum(-1)
    weights = torch.exp(aligned).detach()
    pc, pr = label_logps.sum(-1).chunk(2)
    with torch.no_grad():
        rc, rr = independent_logps(session.models["reference"], rows, average=False)
    pair_weights = weights.chunk(2)[0] * weights.chunk(2)[1]
    losses = -torch.log(torch.sigmoid(0.5 * ((pc - rc) - (pr - rr)))) * pair_weights
    losses.mean().backward()
    theirs = gradients(session.model)

    assert float(pair_weights.mean()) < 0.8  # far enough from 1 to tell weighted from unweighted
    torch.testing.assert_close(out.loss_sum / out.normaliser, losses.mean().detach(), atol=2 * TOL, rtol=0)
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, atol=2 * TOL * max(1.0, float(grad.abs().max())), rtol=0, msg=name)
    total, count = out.metrics["wpo_weight"]
    assert abs(float(total / count) - float(pair_weights.mean())) <= TOL



def test_wpo_weights_are_refused_with_a_loss_kernel_that_never_forms_the_logits(llama_dpo, make_dpo_config,
                                                                                 tmp_path):
    from posttune.plugin import ConfigError

    config = make_dpo_config(tmp_path, rows=8, method={"name": "dpo", "wpo_weights": True},
                             memory=["chunked_cross_entropy"])
    with pytest.raises(ConfigError, match="^config: method.wpo_weights: WPO's weights need the policy's logits, "
                                          "which the loss kernel 'chunked_cross_entropy' never forms; remove that "
                                          "memory technique$"):
        compose_run(config)
