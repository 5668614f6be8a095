"""A mixture of experts in place of a layer's MLP (Qwen3-MoE, Mixtral, gpt-oss): a router picks each
token's top-k experts, each a gated MLP of its own, and sums their outputs weighted by the router.

Routing follows transformers' order of ops (softmax in float32 over every expert, the top k, their
weights renormalized where the family says; gpt-oss: the top k of the biased logits, then a softmax
over those k), so the same experts win. A token's output is its own:
the router and the experts run through kernels.linear, fed at most kernels.MAX_ROWS rows a call
where float weights run the C kernel (each row the same bits at any row count; GGUF blocks are at
any count), and a token's experts are summed in ascending expert index whichever other tokens share
the pass. Over GGUF blocks on the CPU one C call a layer runs it all (kernels/experts.c, the same
matmuls in the same order); elsewhere the torch loop below, one matmul pair per expert a pass chose.
Knows nothing of attention, caches or files.
"""
from __future__ import annotations

import torch
from torch import nn

from quickdraft.kernels import MAX_ROWS, QuantizedWeight, linear, usable
from quickdraft.kernels.experts import ExpertTable, experts_usable, run_experts
from quickdraft.model.config import ModelConfig


class Expert(nn.Module):
    """One expert's gated MLP: gate|up as one matrix (as the dense MLP's), then down; biases where
    the family has them (gpt-oss)."""

    def __init__(self, hidden: int, size: int, bias: bool) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(hidden, 2 * size, bias=bias)
        self.w_down = nn.Linear(size, hidden, bias=bias)


class Experts(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=config.expert_biases)
        self.experts = nn.ModuleList(Expert(config.hidden_size, config.expert_size, config.expert_biases)
                                     for _ in range(config.num_experts))
        self.top_k, self.norm_topk, self.topk_first = config.experts_per_token, config.norm_topk, config.topk_first
        self.weights_float32 = config.expert_weights_float32
        self.gate = config.activation
        # the experts packed for experts.c on first use ("fused", as a Block's layer.c packing: set to
        # None where the weights change, weights/activations.py)
        self.fused: ExpertTable | None = None

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [N, E] -> each token's experts' weights (float32) and indices, [N, k] each."""
        if self.topk_first:  # (the weights rounded to the logits' dtype, as transformers' GptOssTopKRouter)
            top, chosen = torch.topk(logits.float(), self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(logits.dtype).float(), chosen
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def forward(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None) -> torch.Tensor:
        """x [..., D] the sublayer's input; `norm`: the RMSNorm (weight, eps) fused before the router
        and each expert's first matmul (None: none). -> [..., D] the experts' weighted sum."""
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        weights, chosen = self.route(_rows_linear(flat, self.router.weight, self.router.bias, norm=norm))
        table = self._packed() if experts_usable(flat) else None
        if table is not None:  # (the table itself: another thread may reset `fused` meanwhile)
            return run_experts(flat, norm, chosen, weights, table, self.gate).view_as(x)
        out = torch.zeros_like(flat)
        # one host sync a layer: which experts the pass chose, in ascending order (each token's sum order)
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == e)  # each token at most once: one add per token below
            expert = self.experts[e]
            h = _rows_linear(flat[rows], expert.w_gate_up.weight, expert.w_gate_up.bias, norm=norm)
            y = _rows_linear(h, expert.w_down.weight, expert.w_down.bias, swiglu=self.gate)
            w = weights[rows, slot, None]
            y = (y.float() * w).to(y.dtype) if self.weights_float32 else y * w.to(y.dtype)
            # index_add_ opens an OpenMP region per call (3.6 ms each beside the kernels' pool: 70% of a
            # decode step on Qwen3-30B-A3B's shape); index_put_ does the same adds, rows being distinct
            out.index_put_((rows,), y, accumulate=True)
        return out.view_as(x)


    def _packed(self) -> ExpertTable | None:
        """The experts as experts.c reads them, packed once; None where they are not all GGUF blocks
        the kernel runs (float weights take the torch loop)."""
        if self.fused is None and isinstance(self.experts[0].w_down.weight, QuantizedWeight):
            self.fused = ExpertTable.of([(e.w_gate_up.weight, e.w_down.weight) for e in self.experts],
                                        [(e.w_gate_up.bias, e.w_down.bias) for e in self.experts])
        return self.fused


def _rows_linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
    """kernels.linear of x [N, K], at most MAX_ROWS rows a call where float weights run the C kernel:
    torch's GEMM, which takes more, blocks its sums by the row count."""
    if isinstance(weight, torch.Tensor) and x.shape[0] > MAX_ROWS and usable(x[:MAX_ROWS], weight):
        return torch.cat([linear(part, weight, bias, **kwargs) for part in x.split(MAX_ROWS)])
    return linear(x, weight, bias, **kwargs)
