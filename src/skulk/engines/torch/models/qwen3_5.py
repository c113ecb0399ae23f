"""Qwen3.5 (Qwen3.5-397B-A17B and the other `qwen3_5_moe` checkpoints; the dense `qwen3_5` too): Qwen3-Next's
decoder (qwen3_next.py) under a vision-language wrapper, with the linear layers' input projections split four
ways (transformers' modeling_qwen3_5_moe / modeling_qwen3_5 are the reference, op for op).

What differs from Qwen3-Next:
- the config is multimodal: the language model's numbers sit in text_config (config.text_config gives them the
  wrapper's model_type; a text-only `qwen3_5_moe_text` config runs through the transformers fallback) and its
  tensors under model.language_model. beside a vision tower (model.visual.) this engine does not load: a request
  with images is refused (vision.load_tower finds no tower it runs), text runs natively.
- a gated DeltaNet layer projects q, k and v with one in_proj_qkv whose rows are every key head's q, then every
  key head's k, then every value head's v (the conv's channel order, not grouped per key head as Qwen3-Next's
  in_proj_qkvz), and z, b and a each with its own projection (in_proj_z, in_proj_b, in_proj_a) by value head.
  Tensor parallel: a rank holds its key heads' rows of each of in_proj_qkv's three parts (tp_parts, as the conv's)
  and its value heads' rows of z, b and a (model.tp_split_dim).
- the MoE's every layer is sparse (no mlp_only_layers, no decoder_sparse_step) and its router always renormalises
  its top k; the dense qwen3_5 has a SwiGLU MLP in every layer instead.
- rope is multimodal (mrope_section), but a text prompt's three coordinates are its position each, so it is
  Qwen3-Next's partial rope (partial_rotary_factor of each head).

Everything else (gated full attention, the gated delta rule and its per-stream states, the gated shared expert,
norms by 1 + weight, the family's `stateful` rule) is qwen3_next.py's.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import ModelArgs
from ..layers import AllReduce
from ..matmul import Linear
from . import qwen3_next
from .family import Family
from .qwen3_next import GatedDeltaNet, Qwen3NextLayer


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's fields (qwen3_next.fields) with Qwen3.5's defaults (Qwen3_5MoeTextConfig's: 256 experts, 8 a
    token) and rules: every layer a MoE when it has experts, the top k always renormalised; none for the dense."""
    moe = cfg.get("model_type") == "qwen3_5_moe"  # config.text_config names the language model as its wrapper
    experts = int(cfg.get("num_experts", 256) if moe else 0)
    shaped = {**cfg, "num_experts": experts, "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 8)),
              "mlp_only_layers": [], "decoder_sparse_step": 1,
              "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)}
    return {**qwen3_next.fields(shaped), "norm_topk_prob": True}


class SplitDeltaNet(GatedDeltaNet):
    """qwen3_next.GatedDeltaNet with Qwen3.5's four input projections (the module docstring)."""

    def _projections(self, hidden: int, whole: tuple[int, int, int]) -> None:
        self.in_proj_qkv = Linear(hidden, 2 * self.key_dim + self.value_dim, bias=False)
        self.in_proj_qkv.tp_parts = {"weight": whole}  # type: ignore[assignment]  # loader._tp_parts reads it
        self.in_proj_z = Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = Linear(hidden, self.nv, bias=False)
        self.in_proj_a = Linear(hidden, self.nv, bias=False)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v flat as the conv takes them, z [B, T, v_heads, dv], b, a [B, T, v_heads]): in_proj_qkv's rows
        are already in the conv's order."""
        b, t, _ = x.shape
        return (self.in_proj_qkv(x), self.in_proj_z(x).view(b, t, -1, self.dv), self.in_proj_b(x),
                self.in_proj_a(x))


class Qwen3_5Layer(Qwen3NextLayer):
    delta_net = SplitDeltaNet


def layer(args: ModelArgs, index: int, tp_size: int, reduce: AllReduce) -> Qwen3_5Layer:
    return Qwen3_5Layer(args, index, tp_size, reduce)


FAMILY = Family(("qwen3_5_moe", "qwen3_5"), layer, fields, norm_unit_offset=True, stateful=True)
