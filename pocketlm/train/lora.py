"""LoRA: low-rank adapters on the linear layers of a :class:`~pocketlm.train.model.PocketLM`.

``add_lora(model, rank, alpha)`` freezes every parameter and gives each targeted ``nn.Linear``
two trainable matrices, ``lora_a`` [rank, in] (small random) and ``lora_b`` [out, rank] (zeros),
so the layer computes ``x W^T + (alpha / rank) (x A^T) B^T``: at the start exactly the base model.
The state dict keeps the base names (``layers.0.attn.w_q.weight``) and adds ``.lora_a`` /
``.lora_b`` beside them; :func:`merge_lora_state` folds the adapters into the weights
(``W + (alpha / rank) B A``), which is what export does before quantization.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import PocketError

__all__ = ["LoRALinear", "add_lora", "fake_quant_int4", "merge_lora_state", "DEFAULT_TARGETS"]

DEFAULT_TARGETS = ("w_q", "w_k", "w_v", "w_o", "w_gate", "w_up", "w_down")


def fake_quant_int4(w: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """``w`` rounded to the INT4 grid the deploy file stores (asymmetric, min-max range per
    group of ``group_size`` inputs, float16 scale and minimum), computed in float32: what
    ``pocketlm.quant.quantize_int4(w, search=False)`` dequantizes to."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = ((hi - lo) / 15.0).half().float()
    m = lo.half().float()
    inv = torch.where(s != 0, 1.0 / torch.where(s != 0, s, torch.ones_like(s)),
                      torch.zeros_like(s))
    q = torch.clamp(torch.round((g - m) * inv), 0, 15)
    return (q * s + m).reshape(out_f, in_f).to(w.dtype)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update. With ``qat_group`` the layer
    computes with ``W + (alpha/rank) B A`` rounded to the deploy file's INT4 grid (gradients
    pass straight through the rounding): the adapters learn what survives INT4."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator,
                 qat_group: int | None = None):
        super().__init__()
        self.qat_group = qat_group
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.scale = alpha / rank
        out_f, in_f = self.weight.shape
        bound = 1.0 / math.sqrt(in_f)
        a = (torch.rand(rank, in_f, generator=generator) * 2 - 1) * bound
        self.lora_a = nn.Parameter(a.to(self.weight.dtype))
        self.lora_b = nn.Parameter(torch.zeros(out_f, rank, dtype=self.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qat_group:
            w = self.weight + self.scale * (self.lora_b @ self.lora_a)
            wq = fake_quant_int4(w.detach(), self.qat_group)
            return F.linear(x, w + (wq - w).detach(), self.bias)
        y = F.linear(x, self.weight, self.bias)
        return y + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, *,
             targets: tuple[str, ...] = DEFAULT_TARGETS, seed: int = 0,
             qat_group: int | None = None, base_grid: int | None = None) -> int:
    """Freeze ``model`` and put adapters on its linear layers named in ``targets``; returns the
    number of trainable parameters. ``qat_group``: train against the INT4 grid of that group
    size (quantization-aware: base + adapter rounded together, for a merged export).
    ``base_grid``: round the frozen base weights to the INT4 grid of that group size once, and
    train the adapters in float on that base: the arithmetic of a deploy file that keeps the
    adapters beside its INT4 weights (``--keep-lora``)."""
    if not isinstance(rank, int) or rank < 1:
        raise PocketError(f"LoRA rank must be a positive integer, got {rank!r}")
    if qat_group and base_grid:
        raise PocketError("LoRA trains against the INT4 grid either merged (qat_group) or "
                          "beside an INT4 base (base_grid), not both")
    alpha = float(2 * rank if alpha is None else alpha)
    widths = [min(c.in_features, c.out_features) for m in model.modules()
              for n, c in m.named_children() if n in targets and isinstance(c, nn.Linear)]
    if widths and rank > min(widths):
        # past a layer's narrower side an adapter adds parameters and no expressiveness
        raise PocketError(f"--lora-rank {rank} is more than the narrowest adapted layer's "
                          f"{min(widths)} (its smaller dimension); use at most {min(widths)}")
    grid = qat_group or base_grid
    if grid:
        odd = sorted({c.in_features for m in model.modules() for n, c in m.named_children()
                      if n in targets and isinstance(c, nn.Linear)
                      and c.in_features % max(grid, 32)})
        if odd:
            # the INT4 grid is cut in groups of inputs: such a layer has no grid to train
            # against (the pack refuses to quantize it), and the rounding was a traceback
            raise PocketError(f"training against the INT4 grid (--qat) needs adapted layers "
                              f"whose input width is a multiple of "
                              f"{max(grid, 32)}; this model has {odd[0]}")
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(int(seed))
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                if base_grid:
                    with torch.no_grad():
                        child.weight.copy_(fake_quant_int4(child.weight, base_grid))
                setattr(module, name, LoRALinear(child, rank, alpha, gen, qat_group))
                replaced += 1
    if not replaced:
        raise PocketError(f"no linear layer named {', '.join(targets)} to put LoRA on")
    model.lora = {"rank": rank, "alpha": alpha, "targets": list(targets), "qat_group": qat_group,
                  "base_grid": base_grid}
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def merge_lora_state(state: dict[str, torch.Tensor], lora: dict) -> dict[str, torch.Tensor]:
    """The state dict with every adapter folded into its weight (and the adapters removed)."""
    scale = float(lora["alpha"]) / int(lora["rank"])
    out = {k: v for k, v in state.items() if not k.endswith((".lora_a", ".lora_b"))}
    for k in state:
        if k.endswith(".lora_a"):
            stem = k[: -len(".lora_a")]
            a, b = state[k].float(), state[stem + ".lora_b"].float()
            w = out[stem + ".weight"]
            out[stem + ".weight"] = (w.float() + scale * (b @ a)).to(w.dtype)
    return out
