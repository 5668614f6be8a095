"""A draft model's reduced vocabulary: the LM head over the tokens a draft is likely to propose.

On a CPU the LM head of a large vocabulary is a large part of a small draft model's forward
(Qwen2.5-Coder-0.5B's tied 151,936 x 896 matrix: a third of its matmul time for one token). A
draft over a subset of the vocabulary (EAGLE-3 drafts over the most frequent tokens) computes the
head's rows of that subset only; every other token gets the logit -inf, so q is a distribution
over the subset, zero elsewhere, and greedy and rejection-sampling verification stay exact for
any subset: a target token outside it is only never drafted.

The subset is the `size` lowest token ids and the tokenizer's added tokens (the special ones,
end-of-sequence included). Byte-level BPE numbers its tokens in the order their merges were
learned, most frequent pairs first: on HumanEval's dev reference solutions the lowest 32,768 of
Qwen2.5's ids cover 96.9% of the tokens, as many as its 32,768 most frequent tokens in ShareGPT
(96.7%), without a table to ship per tokenizer.
"""
from __future__ import annotations

import torch

from quickdraft.kernels import linear
from quickdraft.kernels.quantized import QuantizedWeight
from quickdraft.model.llama import Transformer
from quickdraft.model.tokenizer import Tokenizer


def draft_vocabulary(tokenizer: Tokenizer, vocab_size: int, size: int) -> torch.Tensor | None:
    """Sorted token ids [Vd] a draft may propose, or None for the whole vocabulary (size 0, or as
    large as it)."""
    if size == 0 or size >= vocab_size:
        return None
    special = {int(i) for i in tokenizer.hf.added_tokens_decoder} | set(tokenizer.eos_token_ids)
    ids = sorted(set(range(size)) | {i for i in special if i < vocab_size})
    return None if len(ids) >= vocab_size else torch.tensor(ids)


class VocabHead:
    """The model's final norm and LM head restricted to `vocab` (None: the whole head)."""

    def __init__(self, model: Transformer, vocab: torch.Tensor | None) -> None:
        self.model = model
        self.vocab = None if vocab is None else vocab.to(model.device)
        weight = model.lm_head.weight
        # the subset's rows as the model stores them (quantized rows stay quantized)
        self.weight = None if vocab is None else (
            weight.take(vocab) if isinstance(weight, QuantizedWeight) else weight[self.vocab].contiguous())

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] last-layer outputs (pre-norm) -> [..., V] logits, -inf outside the vocabulary."""
        if self.vocab is None:
            return self.model.logits(hidden)
        sub = linear(hidden, self.weight, norm=self.model.norm.fused)  # [..., Vd]
        full = sub.new_full((*sub.shape[:-1], self.model.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab, sub)
