"""What models/speed.py's options swap into a model: the bf16 residual stream's entry and exit and its norms, and
the fused Q/K/V projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.speed import ModelSpeed
from paratrain.models.weight_copies import linear_operands


def bf16_stream(h: torch.Tensor, speed: ModelSpeed) -> torch.Tensor:
    """h as the blocks carry it: cast to bf16 when the option is on and bf16 autocast runs, else unchanged."""
    device = h.device.type
    if speed.bf16_residual and torch.is_autocast_enabled(device) and \
            torch.get_autocast_dtype(device) == torch.bfloat16:
        return h.to(torch.bfloat16)
    return h


def leave_stream(h: torch.Tensor, entry_dtype: torch.dtype, speed: ModelSpeed) -> torch.Tensor:
    """A pipeline stage's hidden states as it hands them on: in the dtype they came in (its peers' message)."""
    return h.to(entry_dtype) if speed.bf16_residual else h


def stream_out(model: nn.Module, h: torch.Tensor, entry_dtype: torch.dtype, targets=None, loss_chunks=None):
    """The end of a decoder's forward (both families): the final norm and the head on the last stage (the logits,
    or the loss when targets are given: models/fused_loss.py); a stage without them hands its hidden states on
    in the dtype they came in."""
    if model.norm is not None:
        h = model.norm(h)
    elif model.output is None:
        h = leave_stream(h, entry_dtype, model.speed)
    if model.output is None:
        return h
    return model.output(h) if targets is None else model.output(h, targets, loss_chunks)


class StreamLayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters) that keeps a bf16 stream in bf16. CUDA autocast would run it in fp32 on an
    fp32 copy of its input (saved for the backward); here the kernel reads bf16 and accumulates in fp32 itself.
    The affine parameters are cast to the input's dtype, as the CUDA kernel requires and autocast does to
    every matmul weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


def stream_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a bf16 stream in torch's kernel (fp32 statistics inside; fused on CUDA), bf16 out."""
    with torch.autocast(x.device.type, enabled=False):
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


def project_qkv(x: torch.Tensor, wq: nn.Linear, wk: nn.Linear, wv: nn.Linear,
                fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v = wq(x), wk(x), wv(x); fused: one F.linear over the three weights (and biases) concatenated, its
    output split back. Projections swapped for another linear (FP8's) run as their own modules."""
    if not fused or not all(type(m) is nn.Linear for m in (wq, wk, wv)):
        return wq(x), wk(x), wv(x)
    # the parameters, or their bf16 copies where --bf16-param-copies attached them (models/weight_copies.py)
    (q_weight, q_bias), (k_weight, k_bias), (v_weight, v_bias) = (linear_operands(m, x) for m in (wq, wk, wv))
    weight = torch.cat((q_weight, k_weight, v_weight))
    bias = None if q_bias is None else torch.cat((q_bias, k_bias, v_bias))
    return F.linear(x, weight, bias).split((wq.out_features, wk.out_features, wv.out_features), dim=-1)
