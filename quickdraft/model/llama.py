"""The decoder: forward(tokens, positions, cache) -> logits and hidden states.

Knows the transformer math only: nothing of requests, sampling, proposers or cache policy.
One Block for every family: what a family changes (biases, norm placement, QK-norm, windows per
layer) are ModelConfig fields its row in families.py fills. Weights arrive under the family's
Hugging Face names (weights/ maps every format to them) and are fused by model/build.py (q|k|v,
gate|up) so a decode step runs few, large matmuls. A matrix is a float tensor or a
`QuantizedWeight` (GGUF blocks as stored); `kernels.linear` takes either.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft import kernels
from quickdraft.kernels import Pages, QuantizedWeight, linear
from quickdraft.kernels.layer import FusedLayer, fused_layer_usable, run_layer
from quickdraft.kv.cache import KVCache, Slots
from quickdraft.model.config import ModelConfig
from quickdraft.model.experts import Experts
from quickdraft.model.rope import RotaryTable, apply_rope, inverse_frequencies


@dataclass
class ForwardOutput:
    logits: torch.Tensor    # [B, n, V] for the last n positions asked for
    hidden: torch.Tensor    # [B, T, D] the last layer's output before the final norm at every fed position
    features: torch.Tensor  # [B, T, F] the outputs of the model's feature_layers there, side by side, the
                            # last layer's last (F = D where that layer alone is kept): what draft heads read


@dataclass
class AttentionInputs:
    """What every layer of one forward shares: rotary tables, the mask, the cache slots."""
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None  # [B, 1, T, kv_len], True = may attend; None = attend to all
    slots: Slots
    pages: Pages               # the cache's rows as the C kernels read them
    kv_len: int
    positions: torch.Tensor    # [B, T] int64: the cache slot each token's K/V go to (the kernels' name)
    rotary: torch.Tensor       # [B, T] each token's position (trees: its depth), what windows count in
    local: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of sliding layers with a base of their own
    rows: torch.Tensor | None = None  # [T] int64 each token's cache row (a ragged pass, B = 1); None: its batch row
    narrowed: bool = False  # the mask hides more than the keys past each token's slot (trees)
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @functools.cached_property
    def visible(self) -> torch.Tensor | None:
        """The mask as the C kernel reads it: [B, T, kv_len], contiguous; None where it is causal
        (the kernel then reads each token's keys up to its slot, faster and with the same bits)."""
        return None if self.mask is None or not self.narrowed else self.mask[:, 0].contiguous()

    def masks(self, window: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The mask ([B, 1, T, kv_len]) and `visible` of a layer whose queries see only the last
        `window` positions (themselves included), as transformers' sliding window: a key at
        position j is visible to a query at position i if j > i - window. Each row's mask depends on
        its own positions only, so a row's attention is the same in any batch. Built once per window."""
        if window is None or int(self.rotary.max()) < window:  # no key can be that far back
            return self.mask, self.visible
        if window not in self.windowed:
            B, T = self.rotary.shape
            # a key's position: its slot's, except the slots this pass writes (a tree's nodes), as
            # the query's own cache row wrote them (a ragged pass: other rows' writes land in column
            # kv_len, dropped; they may share a slot number)
            own = torch.ones(1, T, dtype=torch.bool, device=self.rotary.device) if self.rows is None \
                else self.rows[:, None] == self.rows[None, :]  # [Q, T]: which writes a query's row sees
            key_pos = torch.arange(self.kv_len + 1, device=self.rotary.device).expand(B, own.shape[0], -1).clone()
            writes = torch.where(own, self.positions[:, None, :], self.kv_len)  # [B, Q, T]
            key_pos.scatter_(2, writes, self.rotary.to(torch.int64)[:, None, :].expand_as(writes))
            near = key_pos[..., :self.kv_len] > self.rotary[..., None] - window  # [B, T, kv_len]
            mask = near & (self.mask[:, 0] if self.mask is not None else True)
            self.windowed[window] = (mask.unsqueeze(1), mask.contiguous())
        return self.windowed[window]


def attention_inputs(rope: RotaryTable, inv_freq: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                     attn_mask: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                     local: tuple[RotaryTable, torch.Tensor] | None = None,
                     rows: torch.Tensor | None = None) -> AttentionInputs:
    """A token's K/V go to cache slot `slots` [B, T] (default: its position; a tree's siblings share
    a position, not a slot); a query at slot s sees the cached keys at slots 0..s of its row, and
    `attn_mask` [B, T, kv_len] narrows that further (trees). `local`: the table and frequencies of
    sliding layers that rotate with a base of their own (Gemma 3). `rows` [T]: each token's cache row
    (a ragged pass, B = 1)."""
    slots = positions if slots is None else slots
    kv_len = int(slots.max()) + 1
    cos, sin = rope(inv_freq, positions, cache.dtype)
    mask = None  # one query at the last slot of one row sees every key: no mask needed
    if slots.shape != (1, 1) or attn_mask is not None or rows is not None:
        mask = torch.arange(kv_len, device=slots.device) <= slots.unsqueeze(-1)  # [B, T, kv_len]
        if attn_mask is not None:
            mask = mask & attn_mask
        mask = mask.unsqueeze(1)
    local_rope = None if local is None else local[0](local[1], positions, cache.dtype)
    written = cache.slots(slots, rows)  # blocks for the slots written first: `pages` names them
    return AttentionInputs(cos, sin, mask, written, cache.pages(kv_len), kv_len, slots.to(torch.int64).contiguous(), positions,
                           local_rope, None if rows is None else rows.to(torch.int64).contiguous(), attn_mask is not None)


class RMSNorm(nn.Module):
    """Holds the gain; the normalization itself is fused into the next matmul (kernels.linear)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    @property
    def fused(self) -> tuple[torch.Tensor, float]:
        return self.weight, self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Over the last dimension, each row alone (so batch-invariant), in float32 as transformers
        does (a no-op on CPU); where no matmul follows."""
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


ROW_CACHE_BYTES = 8 << 20  # dequantized rows a quantized embedding keeps for lookups of a few tokens
FEW = 16                   # tokens a lookup takes from those kept (a prompt's are dequantized at once)


class Embedding(nn.Module):
    """Token embeddings; quantized tables dequantize only the rows a forward looks up, and keep the
    most recently used ones for the lookups of a few tokens that every decode step and draft-head
    forward makes (a row's dequantization through numpy took ~46 us on SmolLM2, more than a head
    forward's attention inputs; a kept row is the same bits)."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim), requires_grad=False)
        self._rows: tuple[object, OrderedDict[int, torch.Tensor]] = (None, OrderedDict())  # (weight, id -> row)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.weight, QuantizedWeight):
            return F.embedding(tokens, self.weight)
        if tokens.numel() > FEW:
            return self.weight.rows_of(tokens).view(*tokens.shape, -1).to(tokens.device)
        return torch.stack([self._row(t) for t in tokens.reshape(-1).tolist()]).view(*tokens.shape, -1).to(tokens.device)

    def _row(self, token: int) -> torch.Tensor:
        """Row `token` dequantized [D], kept (least recently used dropped past ROW_CACHE_BYTES)."""
        weight, rows = self._rows
        if weight is not self.weight:
            rows = OrderedDict()
            self._rows = (self.weight, rows)
        row = rows.get(token)
        if row is None:
            row = rows[token] = self.weight.rows_of([token])[0]
            if len(rows) * row.numel() * row.element_size() > ROW_CACHE_BYTES:
                rows.popitem(last=False)
        else:
            rows.move_to_end(token)
        return row


class Block(nn.Module):
    """One decoder layer. Pre-norm families (Llama) normalize each sublayer's input, fused into its
    first matmul; post-norm families (OLMo 2) normalize its output before the residual add; Gemma 3
    both. QK-norm (Qwen3, Gemma 3: per head; OLMo 2: over the whole projection) runs between the
    q|k|v matmul and RoPE. A mixture of experts (model/experts.py) takes the MLP's place where the
    config has experts."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.window = c.window(layer)
        self.local_rope = self.window is not None and c.rope_local_theta is not None  # Gemma 3's sliding layers
        self.scale = c.attn_scale or c.head_dim ** -0.5
        self.softcap = c.attn_softcap  # Gemma 2: scores capped at c tanh(s / c)
        self.pre, self.post = c.norm != "post", c.norm != "pre"
        self.gate = c.activation  # the MLP gate's activation, fused before the down matmul
        qkv_out = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        names = ("attn_norm", "mlp_norm") * self.pre + ("attn_post_norm", "mlp_post_norm") * self.post
        for name in names:
            setattr(self, name, RMSNorm(c.hidden_size, c.rms_norm_eps))
        self.q_norm = self.k_norm = None
        if c.qk_norm is not None:
            per_head = c.qk_norm == "head"
            self.q_norm = RMSNorm(c.head_dim if per_head else c.num_heads * c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim if per_head else c.num_kv_heads * c.head_dim, c.rms_norm_eps)
        self.wqkv = nn.Linear(c.hidden_size, qkv_out, bias=c.qkv_bias)
        self.wo = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        # gpt-oss: a logit per query head that joins each softmax's denominator ("sinks")
        self.sinks = nn.Parameter(torch.zeros(c.num_heads), requires_grad=False) if c.attn_sinks else None
        self.moe = Experts(c) if c.num_experts else None
        if self.moe is None:
            self.w_gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
            self.w_down = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.fused: FusedLayer | None = None  # the weights packed for layer.c, on first use

    def _norm_weights(self) -> dict[str, torch.Tensor | None]:
        names = ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm", "q_norm", "k_norm")
        return {n: None if getattr(self, n, None) is None else getattr(self, n).weight for n in names}

    def forward(self, x: torch.Tensor, cache: KVCache, layer: int, at: AttentionInputs) -> torch.Tensor:
        mask, visible = at.masks(self.window)
        # a draft head (proposers/head.py) runs one block with one table of its own: at.local is None
        cos, sin = at.local if self.local_rope and at.local is not None else (at.cos, at.sin)
        linears = (self.wqkv, self.wo) + ((self.w_gate_up, self.w_down) if self.moe is None else ())
        eps = (self.attn_norm if self.pre else self.attn_post_norm).eps
        # GGUF blocks on CPU: one C call (with experts, layer.c the attention half and experts.c the rest:
        # the families with experts have pre-norms only)
        if (self.moe is None or not self.post) and fused_layer_usable(x, cache.dtype, *(m.weight for m in linears)):
            if self.fused is None:
                self.fused = FusedLayer.of([(m.weight, m.bias) for m in linears], self._norm_weights(), eps,
                                           self.n_heads, self.n_kv, self.head_dim, self.gate, self.scale, self.softcap,
                                           self.sinks)
            x = run_layer(x, self.fused, cos, sin, at.positions, at.pages, *cache.pools(layer), visible, at.kv_len,
                          at.rows)
            return x if self.moe is None else x + self.moe(x, self.mlp_norm.fused)
        B, T, _ = x.shape
        hd, n_q = self.head_dim, self.n_heads
        qkv = linear(x, self.wqkv.weight, self.wqkv.bias, norm=self.attn_norm.fused if self.pre else None)
        if self.q_norm is not None:
            qkv = self._qk_norm(qkv)
        if kernels.rope_attention_usable(qkv, cache.dtype):  # CPU: one call, each query alone
            attn = kernels.rope_attention(qkv, cos, sin, at.positions, at.pages, *cache.pools(layer),
                                          visible, at.kv_len, n_q, self.n_kv, self.scale, self.softcap, at.rows,
                                          self.sinks)
        else:
            if at.rows is not None:
                raise ValueError("a ragged pass needs the C attention kernel (Transformer.ragged)")
            qkv = qkv.to(cache.dtype).view(B, T, n_q + 2 * self.n_kv, hd)
            qk = apply_rope(qkv[:, :, :n_q + self.n_kv].transpose(1, 2), cos, sin)  # q and k in one go
            q, k = qk.split((n_q, self.n_kv), dim=1)
            v = qkv[:, :, n_q + self.n_kv:].transpose(1, 2)
            keys, values = cache.write(layer, at.slots, k, v, at.kv_len)
            attn = _attention(q, keys, values, mask, self.scale, self.softcap, self.sinks)
            attn = attn.transpose(1, 2).reshape(B, T, n_q * hd)
        # biases (None where the family has none) are added before the residual and before SwiGLU
        norm = self.mlp_norm.fused if self.pre else None
        if self.post:
            x = x + self.attn_post_norm(linear(attn.to(x.dtype), self.wo.weight, self.wo.bias))
            return x + self.mlp_post_norm(self._mlp(x, norm))
        x = linear(attn.to(x.dtype), self.wo.weight, self.wo.bias, residual=x)
        if self.moe is not None:
            return x + self.moe(x, norm)
        h = linear(x, self.w_gate_up.weight, self.w_gate_up.bias, norm=norm)
        return linear(h, self.w_down.weight, self.w_down.bias, swiglu=self.gate, residual=x)

    def _mlp(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(x, norm)
        h = linear(x, self.w_gate_up.weight, self.w_gate_up.bias, norm=norm)
        return linear(h, self.w_down.weight, self.w_down.bias, swiglu=self.gate)

    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """q and k of qkv [B, T, (n_q + 2 n_kv) * hd] normalized: per head, or each projection whole."""
        B, T, _ = qkv.shape
        hd = self.head_dim
        q, k, v = qkv.split((self.n_heads * hd, self.n_kv * hd, self.n_kv * hd), dim=-1)
        if self.q_norm.weight.shape[0] == hd:  # per head
            q = self.q_norm(q.reshape(B, T, self.n_heads, hd)).reshape(B, T, -1)
            k = self.k_norm(k.reshape(B, T, self.n_kv, hd)).reshape(B, T, -1)
        else:
            q, k = self.q_norm(q), self.k_norm(k)
        return torch.cat((q.to(qkv.dtype), k.to(qkv.dtype), v), dim=-1)


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
               softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, T, hd] over keys, values [B, Hkv, kv_len, hd]: torch's SDPA, or with soft-capped
    scores or sinks [Hq] (which SDPA cannot take) written out as transformers' eager attention."""
    gqa = keys.shape[1] != q.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa, scale=scale)
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = q @ keys.transpose(2, 3) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype) @ values
    # the sink joins the softmax as one more column, dropped after it
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1, dtype=torch.float32)[..., :-1]
    return probs.to(q.dtype) @ values


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", inverse_frequencies(config, rope_freq_factors), persistent=False)
        self.rope = RotaryTable.of(config)
        local = None if config.rope_local_theta is None else inverse_frequencies(config, local=True)
        self.register_buffer("inv_freq_local", local, persistent=False)  # Gemma 3's sliding layers
        self.rope_local = RotaryTable()
        self.feature_layers = (config.num_layers - 1,)  # whose outputs forward hands over (keep_features)
        self.requires_grad_(False)

    def keep_features(self, layers: Sequence[int]) -> None:
        """Hand over as each position's features the outputs of `layers` side by side (ascending,
        ending with the last layer, whose columns the LM head reads: `logits`): a draft head that
        fuses a low, a middle and the top layer's outputs reads them (EAGLE-3); the default is
        the last layer's alone."""
        layers, top = tuple(int(i) for i in layers), self.config.num_layers - 1
        if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] != top:
            raise ValueError(f"feature layers must be distinct, ascending, and end with the last layer ({top}); "
                             f"found {list(layers)}")
        self.feature_layers = layers

    @property
    def feature_width(self) -> int:
        """F: the features' width per position."""
        return len(self.feature_layers) * self.config.hidden_size

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (float32 for GGUF blocks kept as stored: their values' dtype)."""
        return self.embed.weight.dtype

    def _stored(self) -> list[QuantizedWeight]:
        return [w for m in self.modules() for w in vars(m).values() if isinstance(w, QuantizedWeight)]

    @property
    def quantized(self) -> bool:
        """Whether any matrix is kept in GGUF blocks (run by the integer kernel on CPU)."""
        return bool(self._stored())

    @property
    def weight_format(self) -> str:
        """How the matrices are held: a dtype name, or the GGUF block types kept as stored and the
        precision of the activations they multiply (e.g. "Q4_K+Q6_K, int8 activations")."""
        stored = self._stored()
        if not stored:
            return str(self.dtype).removeprefix("torch.")
        bits = "/".join(f"int{b}" for b in sorted({w.activation_bits for w in stored}, reverse=True))
        return "+".join(sorted({p.qtype.name for w in stored for p in w.parts})) + f", {bits} activations"

    @property
    def compute_dtype(self) -> torch.dtype:
        """Activations, norms and K/V: float32 on CPU, where bfloat16/float16 arithmetic is slow and
        those dtypes only halve the weight bytes each step reads; the weights' dtype elsewhere."""
        return torch.float32 if self.device.type == "cpu" else self.dtype

    @property
    def invariant_rows(self) -> int | None:
        """Rows one pass may feed with each row's result independent of the others: the C kernel
        over float matrices takes up to kernels.MAX_ROWS (torch's GEMM, which takes more, blocks its
        sums by the row count); over GGUF blocks any count. None: no limit (every block matrix is
        as stored, or the C kernels do not run here, which makes no pass batch-invariant anyway)."""
        if self.device.type != "cpu" or kernels.active_library() is None:
            return None
        # (experts feed the C kernel at most MAX_ROWS rows a call: invariant at any count, experts.py)
        names = ("wqkv", "wo", "w_gate_up", "w_down")
        stored = all(isinstance(getattr(block, name).weight, QuantizedWeight)
                     for block in self.blocks for name in names if hasattr(block, name))
        return None if stored else kernels.MAX_ROWS

    @property
    def ragged(self) -> bool:
        """Whether one pass may feed tokens of several cache rows as one sequence (forward's `rows`):
        the C attention kernel reads each token's keys from its own row; torch's attention cannot."""
        return (self.device.type == "cpu" and self.compute_dtype == torch.float32
                and kernels.active_library() is not None)

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        return KVCache(self.config, batch_size, max_len, self.device, self.compute_dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                attn_mask: torch.Tensor | None = None, last_n: int | None = None,
                slots: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> ForwardOutput:
        """tokens, positions (rotary): [B, T]. K/V go to cache `slots` [B, T] (default: the
        positions); a query at slot s sees the cached keys at slots 0..s of its row; `attn_mask`
        [B, T, kv_len] (True = may attend) narrows that further (trees).
        `last_n` limits the LM head to the last n positions (prefill needs only the last; 0: none,
        for a caller that applies its own head to `hidden`). `rows` [T] (B = 1, where `ragged`): each
        token's cache row, so one pass feeds several rows' tokens unpadded (decode rows and a prompt's
        chunk); a token's results are bitwise those of the same token in a pass of its row alone."""
        x = self.embed(tokens).to(self.compute_dtype)
        if self.config.embed_scale != 1.0:  # in the embeddings' dtype, as transformers' Gemma
            x = x * torch.tensor(self.config.embed_scale, dtype=self.embed.weight.dtype).to(x.dtype)
        local = None if self.inv_freq_local is None else (self.rope_local, self.inv_freq_local)
        at = attention_inputs(self.rope, self.inv_freq, positions, cache, attn_mask, slots, local, rows)
        taps, kept = self.feature_layers[:-1], []
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer, at)  # (a new tensor: a kept one is never written again)
            if layer in taps:
                kept.append(x)
        features = torch.cat([*kept, x], dim=-1) if kept else x
        if last_n == 0:
            return ForwardOutput(x.new_empty(x.shape[0], 0, self.config.vocab_size), x, features)
        return ForwardOutput(self.logits(x if last_n is None else x[:, -last_n:]), x, features)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., F] features (or [..., D] last-layer outputs: the features' last D columns), pre-norm ->
        [..., V] logits: the final norm and LM head."""
        hidden = features[..., -self.config.hidden_size:]
        logits = linear(hidden, self.lm_head.weight, norm=self.norm.fused)
        cap = self.config.logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)  # per value: batch-invariant
