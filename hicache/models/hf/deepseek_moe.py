"""DeepSeek-V3's feed-forward blocks: the SwiGLU MLP of the first ``first_k_dense_replace``
layers, and the mixture of experts of the others (a sigmoid router choosing
``num_experts_per_tok`` routed experts within the ``topk_group`` best of ``n_group`` groups,
plus always-on shared experts).

The router is computed as transformers computes it, in float32 from float32 weights (its
``_keep_in_fp32_modules_strict``); ``e_score_correction_bias`` steers which experts are
chosen but not how much each counts. Each routed expert runs on the tokens routed to it only,
the experts in index order and their outputs added as transformers adds them, so a float32
checkpoint gives its numbers to rounding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.models.hf.config import RawConfig
from hicache.models.hf.weights import Shapes
from hicache.models.layers import routed_experts, swiglu, swiglu_shapes

__all__ = [
    "ROUTER_TENSORS",
    "MoeConfig",
    "feed_forward",
    "mlp_shapes",
    "moe_config",
]

# Router tensors, read in float32 whatever the compute dtype (transformers keeps them so).
ROUTER_TENSORS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The feed-forward sizes and routing of a DeepSeek-V3 checkpoint."""

    hidden: int
    intermediate: int  # the dense layers' MLP
    expert_intermediate: int  # each routed expert's; shared experts have ``shared`` times it
    routed: int  # n_routed_experts
    shared: int  # n_shared_experts
    per_token: int  # num_experts_per_tok
    groups: int  # n_group
    top_groups: int  # topk_group: the groups a token's experts are chosen from
    scale: float  # routed_scaling_factor
    normalize: bool  # norm_topk_prob
    dense_layers: int  # first_k_dense_replace

    def is_moe(self, layer: int) -> bool:
        return layer >= self.dense_layers


def moe_config(raw: RawConfig, hidden: int) -> MoeConfig:
    """The MLP and routing fields of ``raw`` (transformers' defaults where absent), refused by
    name where transformers' router could not run them."""
    routed, groups = raw.positive_int("n_routed_experts", 256), raw.positive_int("n_group", 8)
    top_groups, per_token = (
        raw.positive_int("topk_group", 4),
        raw.positive_int("num_experts_per_tok", 8),
    )
    if routed % groups:
        raise raw.fail(f"n_routed_experts {routed} is not a multiple of n_group {groups}")
    # transformers scores a group by the sum of its best two experts
    if routed // groups < 2:
        raise raw.fail(f"each of the {groups} expert groups needs at least 2 experts")
    if top_groups > groups:
        raise raw.fail(f"topk_group {top_groups} exceeds n_group {groups}")
    if per_token > top_groups * (routed // groups):
        raise raw.fail(
            f"num_experts_per_tok {per_token} exceeds the experts of topk_group {top_groups} groups"
        )
    _refuse_other_routing(raw)
    dense_layers = raw.get("first_k_dense_replace", 3)
    if type(dense_layers) is not int or dense_layers < 0:
        raise raw.fail(f"'first_k_dense_replace' must be an int >= 0, got {dense_layers!r}")
    normalize = raw.get("norm_topk_prob", True)
    if not isinstance(normalize, bool):
        raise raw.fail(f"'norm_topk_prob' must be true or false, got {normalize!r}")
    return MoeConfig(
        hidden=hidden, intermediate=raw.positive_int("intermediate_size", 18432),
        expert_intermediate=raw.positive_int("moe_intermediate_size", 2048), routed=routed,
        shared=raw.positive_int("n_shared_experts", 1), per_token=per_token, groups=groups,
        top_groups=top_groups, scale=raw.number("routed_scaling_factor", 2.5, 0.0, float("inf")),
        normalize=normalize, dense_layers=dense_layers,
    )  # fmt: skip


def _refuse_other_routing(raw: RawConfig) -> None:
    """DeepSeek's own config names its routing; transformers implements only V3's (sigmoid
    scores, group-limited top-k with the correction bias), so anything else is refused rather
    than computed differently."""
    raw.require("scoring_func", "sigmoid")
    raw.require("topk_method", "noaux_tc")


def mlp_shapes(cfg: MoeConfig, layer: int) -> Shapes:
    """Layer ``layer``'s feed-forward tensors (names below ``model.layers.{layer}.``)."""
    if not cfg.is_moe(layer):
        return swiglu_shapes("mlp", cfg.hidden, cfg.intermediate)
    shapes: Shapes = {
        "mlp.gate.weight": (cfg.routed, cfg.hidden),
        "mlp.gate.e_score_correction_bias": (cfg.routed,),
    }
    shapes |= swiglu_shapes("mlp.shared_experts", cfg.hidden, cfg.expert_intermediate * cfg.shared)
    for expert in range(cfg.routed):
        shapes |= swiglu_shapes(f"mlp.experts.{expert}", cfg.hidden, cfg.expert_intermediate)
    return shapes


def feed_forward(
    cfg: MoeConfig, weights: Mapping[str, torch.Tensor], h: torch.Tensor
) -> torch.Tensor:
    """The feed-forward block of the layer whose tensors are ``weights`` (:func:`mlp_shapes`'
    names) over the normed hidden states ``h`` (N, hidden)."""
    if "mlp.gate.weight" not in weights:
        return swiglu(weights, "mlp", h)
    expert_weights, experts = _route(
        cfg, weights["mlp.gate.weight"], weights["mlp.gate.e_score_correction_bias"], h
    )
    routed = routed_experts(weights, "mlp.experts", h, experts, expert_weights)
    return routed + swiglu(weights, "mlp.shared_experts", h)


def _route(
    cfg: MoeConfig, gate: torch.Tensor, bias: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's routed experts (N, per_token) and their weights (float32), as
    transformers' ``DeepseekV3TopkRouter`` computes them."""
    scores = F.linear(h.to(torch.float32), gate.to(torch.float32)).sigmoid()
    choice = scores + bias
    per_group = cfg.routed // cfg.groups
    group_scores = choice.view(-1, cfg.groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    best_groups = torch.topk(group_scores, k=cfg.top_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1)
    allowed = group_mask.unsqueeze(-1).expand(-1, cfg.groups, per_group).reshape(-1, cfg.routed)
    choice = choice.masked_fill(~allowed.bool(), float("-inf"))
    experts = torch.topk(choice, k=cfg.per_token, dim=-1, sorted=False)[1]
    chosen = scores.gather(1, experts)
    if cfg.normalize:
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen * cfg.scale, experts
