"""Draft heads for the tests: a random one over a target (test_head's)."""
from __future__ import annotations

from typing import Sequence

import torch

from quickdraft.model.llama import Transformer
from quickdraft.proposers.head import DraftHead, head_config


def random_head(model: Transformer, seed: int = 0, vocab: Sequence[int] | None = None) -> DraftHead:
    torch.manual_seed(seed)
    return DraftHead(head_config(model.config), None if vocab is None else torch.tensor(vocab)
                     ).requires_grad_(False).eval()
