"""One target pass's inputs for every row of a step: each row feeds its newest committed token (the
root) and its draft's nodes, padded to the widest row.

A node's rotary position is its row's length plus its depth; its cache slot is the row's length
plus its index (the root at the length itself), so siblings share a position but not a slot. A
query sees its row's committed slots and the slots of its own ancestors. When every row's draft is
a chain, positions and slots coincide and the causal mask the model builds says the same, so no
slots or mask are built. Padding's outputs are ignored and its K/V land past the row's length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from quickdraft.spec.draft_contract import Draft


@dataclass(frozen=True)
class StepInputs:
    ids: torch.Tensor           # [B, 1+W] the root, the draft's nodes, padding (the root again)
    positions: torch.Tensor     # [B, 1+W] rotary positions
    slots: torch.Tensor | None  # [B, 1+W] cache slots; None = the positions (every row a chain)
    mask: torch.Tensor | None   # [B, 1+W, kv_len] True = may attend; None = causal (every row a chain)


def _visible(lengths: Sequence[int], drafts: Sequence[Draft], width: int, device: torch.device) -> torch.Tensor:
    """[B, width, kv_len]: each fed token sees the row's committed slots and its ancestors' (itself included)."""
    kv_len = max(lengths) + width
    starts = torch.tensor(lengths, device=device)
    mask = (torch.arange(kv_len, device=device) < starts[:, None, None]).expand(-1, width, -1).clone()
    rows, queries, keys = [], [], []
    for b, (length, draft) in enumerate(zip(lengths, drafts)):
        lines: list[list[int]] = [[0]]  # per fed token, the fed tokens it sees (0 = the root)
        for i, p in enumerate(draft.tree):
            lines.append(lines[p + 1] + [i + 1])
        lines += [[j] for j in range(len(lines), width)]  # padding sees itself
        for j, line in enumerate(lines):
            rows += [b] * len(line)
            queries += [j] * len(line)
            keys += [length + c for c in line]
    mask[rows, queries, keys] = True
    return mask


def build_inputs(lengths: Sequence[int], roots: Sequence[int], drafts: Sequence[Draft],
                 device: torch.device) -> StepInputs:
    """lengths: per row, tokens with K/V in the cache; roots: per row, the newest committed token
    (not yet run); drafts: per row, the part of its draft to verify."""
    width = 1 + max(len(d.tokens) for d in drafts)
    ids = torch.tensor([[root] + d.tokens + [root] * (width - 1 - len(d.tokens)) for root, d in zip(roots, drafts)],
                       device=device)
    starts = torch.tensor(lengths, device=device)[:, None]
    slots = starts + torch.arange(width, device=device)  # [B, 1+W]
    if all(d.is_chain for d in drafts):
        return StepInputs(ids, slots, None, None)
    depths = [[0] + d.depths() + list(range(len(d.tokens) + 1, width)) for d in drafts]
    positions = starts + torch.tensor(depths, device=device)
    return StepInputs(ids, positions, slots, _visible(lengths, drafts, width, device))


@dataclass(frozen=True)
class RaggedInputs:
    """A step's rows unpadded, one sequence of every row's tokens (each in its own cache row), and
    maybe a prompt's chunk riding along: where the model feeds ragged passes (Transformer.ragged),
    padding costs nothing and a prompt's chunk shares the pass over the weights with the decode rows."""
    ids: torch.Tensor        # [1, M]
    positions: torch.Tensor  # [1, M] rotary positions
    slots: torch.Tensor      # [1, M] cache slots
    mask: torch.Tensor | None  # [1, M, kv_len] True = may attend (within the token's own cache row); None: causal
    rows: torch.Tensor       # [M] each token's cache row
    index: torch.Tensor      # [B, 1+W] the pass's token at each of StepInputs' places (padding: its row's root)
    decoded: int             # the decode rows' tokens come first, the chunk's (if any) after them


def ragged(step: StepInputs, sizes: Sequence[int], chunk: tuple[int, Sequence[int]] | None = None) -> RaggedInputs:
    """`step`'s rows without their padding (row b: its first sizes[b] tokens, in cache row b), then
    `chunk` = (start, tokens): a prompt's tokens at positions and slots start, start+1, ... of
    cache row B, seeing that row's slots up to their own (causal), as a prefill pass of their own."""
    device = step.ids.device
    B, W = step.ids.shape
    keep = torch.arange(W, device=device)[None, :] < torch.tensor(sizes, device=device)[:, None]  # [B, W]
    slots = step.positions if step.slots is None else step.slots
    ids, positions, flat_slots = step.ids[keep], step.positions[keep], slots[keep]
    rows = torch.arange(B, device=device)[:, None].expand(B, W)[keep]
    decoded = ids.shape[0]
    if chunk is not None:
        start, tokens = chunk
        span = torch.arange(start, start + len(tokens), device=device)
        ids = torch.cat((ids, torch.tensor(tokens, device=device, dtype=ids.dtype)))
        positions, flat_slots = torch.cat((positions, span)), torch.cat((flat_slots, span))
        rows = torch.cat((rows, torch.full_like(span, B)))
    mask = None  # every row a chain: causal within each row (the model's mask)
    if step.mask is not None:  # trees: each node sees its row's committed slots and its ancestors
        kv_len = int(flat_slots.max()) + 1
        mask = torch.arange(kv_len, device=device)[None, :] <= flat_slots[:, None]  # [M, kv_len] causal
        # the padded step's mask is as wide as the longest row plus the widest draft, which may be
        # more than the slots fed here (a shorter row drafted the widest): nothing past them is seen
        tree = step.mask[keep][:, :kv_len]
        mask[:decoded, :tree.shape[-1]] &= tree
        mask = mask[None]
    index = torch.cumsum(keep.flatten(), 0).view(B, W) - 1  # padding: the last kept token before it
    index = torch.where(keep, index, index[:, :1])
    return RaggedInputs(ids[None], positions[None], flat_slots[None], mask, rows, index, decoded)
