"""The protocol every adapted linear layer keeps, whatever its kind (docs/architecture.md, "Adapter kinds").

An adapter kind (LoRA, DoRA, IA3, ... each registered by a plugin) wraps a frozen ``nn.Linear`` in a
subclass of ``AdaptedLinear``, which keeps the wrapped layer, untouched, as its child ``base``::

    layers.0.attn.q_proj.base.weight      the base weight (frozen), native name + ".base"
    layers.0.attn.q_proj.<own tensors>    the kind's trainable tensors, anywhere outside ``base``

Why a child and not a subclass of ``nn.Linear``: the base layer stays a plain ``nn.Linear`` (FSDP2,
tensor parallelism and quantisation see the module type they expect), and the base model's own
state-dict key is recovered by dropping one ``.base`` segment. Everything the core does with
adapters (freeze, initialise after loading, switch off, merge, gather for a save, estimate) goes
through this protocol, so it never needs to know a kind.
"""

from __future__ import annotations

import torch
from torch import nn

from posttune.checkpoint.keymap import BASE  # the child holding the wrapped nn.Linear
from posttune.errors import PosttuneError


class AdaptedLinear(nn.Module):
    """A frozen ``nn.Linear`` (``base``) plus a kind's trainable update. A kind overrides the four methods."""

    kind: str = ""  # the registered adapter kind's name, set by the kind's layer
    rank: int = 0  # the width of the update's own activations per token (the memory estimate's unit); 0: none
    dropout_p: float = 0.0  # dropout on the adapter's input: nonzero cannot be folded into one weight

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.disabled = False  # set by adapters_disabled(): the layer then computes exactly ``base``
        self.train(base.training)  # an adapter added to a model in eval mode must not drop out

    # Read-only views of the base layer, for code written against nn.Linear.
    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """Initialise the update so the layer computes exactly ``base`` (needs the real base weight: called
        at construction, or by ``init_adapters`` once a meta-built model has its weights)."""
        raise NotImplementedError

    def effective_weight(self) -> torch.Tensor:
        """The one weight the layer computes with (no dropout), differentiable w.r.t. the adapter's
        tensors, in the base weight's dtype: what a loss that projects to the vocabulary itself uses."""
        raise NotImplementedError

    def merged_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``effective_weight`` without a graph, in ``dtype`` (default: the base's): what a merge writes."""
        raise NotImplementedError

    def adapter_modules(self) -> list[nn.Module]:
        """The submodules that are the adapter's own (not ``base`` or inside it)."""
        inner = {id(m) for m in self.base.modules()}
        return [m for m in self.modules() if m is not self and id(m) not in inner]


def adapter_parameter_names(layer: nn.Module) -> list[str]:
    """The layer's own trainable tensors, relative to the layer: everything outside ``base``."""
    return [name for name, _ in layer.named_parameters() if not name.startswith(f"{BASE}.")]


def head_weight(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An output head's effective (weight, bias), differentiable w.r.t. whatever trains in it: an adapted
    head folded into one weight, for losses that project hidden states to the vocabulary themselves,
    chunk by chunk."""
    if not isinstance(head, AdaptedLinear) or head.disabled:
        return head.weight, head.bias
    if head.dropout_p > 0:
        raise PosttuneError(f"the output head's adapter folds into one weight, which dropout ({head.dropout_p}) "
                            "does not allow; set adapter.dropout to 0 or leave `output` out of adapter.targets")
    return head.effective_weight(), head.bias
