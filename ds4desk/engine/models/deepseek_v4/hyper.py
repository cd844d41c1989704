"""The hyper-connection sites of DeepSeek-V4 (mHC): how a block reads the `hc_mult` residual
streams and how the head collapses them.

Each block reads Σ_j pre_j X_j (RMS-normed) and writes back X'_k = post_k y + Σ_j C[j, k] X_j, where
pre, post and the mixing matrix C come from the normed streams themselves, C made doubly stochastic
by Sinkhorn iterations (float32). The fused forms (kernels/deepseek_v4/hc_fused.py) do a block's
expand inside the next site, so their callers carry the block's (y, post, comb) until then.
"""

from __future__ import annotations

import torch
from torch import nn

from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
from ds4desk.engine.kernels.deepseek_v4.hc_kernel import hc_weights
from ds4desk.engine.models.deepseek_v4 import ops
from ds4desk.engine.models.deepseek_v4.config import DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.modules import Backbone, HyperConnection


class HyperConnectionSites:
    """DeepseekV4Model's hyper-connection methods (a mixin: prefill and decode both call them)."""

    config: DeepseekV4Config
    model: Backbone

    def _hc_site(
        self, streams: torch.Tensor, site: HyperConnection, norm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One hyper-connection site: the block input Σ_j pre_j X_j RMS-normed with `norm`'s weight
        [T, D] in the streams' dtype, and the float32 post [T, m] and comb [T, m, m] for ops.expand."""
        cfg = self.config
        m = cfg.hc_mult
        z, streams32 = ops.hc_mix(streams, site.fn, cfg.rms_norm_eps)
        gates, comb = hc_weights(z, site.scale, site.base, m, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        h = ops.rms_norm(ops.collapse(streams32, gates[:, :m]), norm, cfg.rms_norm_eps, streams.dtype)
        return h, gates[:, m:], comb

    def _hc_head(self, streams: torch.Tensor) -> torch.Tensor:
        """The final collapse of the streams and the norm: the head's input [T, D]."""
        cfg, head = self.config, self.model.hc_head
        z, streams32 = ops.hc_mix(streams, head.hc_fn, cfg.rms_norm_eps)
        pre = torch.sigmoid(torch.addcmul(head.hc_base, z, head.hc_scale)) + cfg.hc_eps
        return ops.rms_norm(
            ops.collapse(streams32, pre), self.model.norm.weight, cfg.rms_norm_eps, streams.dtype
        )

    def _hc_site_fused(
        self,
        streams: torch.Tensor,
        previous: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        site: HyperConnection,
        norm: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """ops.expand of `previous` (when given) then _hc_site, fused: (streams, h, post, comb)."""
        cfg = self.config
        return v4_hc_fused.site(
            streams,
            previous,
            site.fn,
            site.scale,
            site.base,
            norm.weight,
            cfg.hc_mult,
            cfg.hc_sinkhorn_iters,
            cfg.hc_eps,
            cfg.rms_norm_eps,
        )

    def _hc_head_fused(
        self, streams: torch.Tensor, previous: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """ops.expand of the last block then _hc_head, with the fused expand + mix and collapse + norm."""
        cfg, head = self.config, self.model.hc_head
        streams, z = v4_hc_fused.expand_mix(streams, *previous, head.hc_fn, cfg.rms_norm_eps)
        pre = torch.sigmoid(torch.addcmul(head.hc_base, z, head.hc_scale)) + cfg.hc_eps
        weight = self.model.norm.weight
        return v4_hc_fused.collapse_norm(streams, pre, weight, cfg.rms_norm_eps, streams.dtype)
