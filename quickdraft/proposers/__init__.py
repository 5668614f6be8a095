"""Proposers behind one protocol, found by name in a registry."""
from quickdraft.proposers import draft_model, head, hybrid, ngram  # noqa: F401  (importing registers them)
from quickdraft.proposers.base import (DEFAULT_K, MAX_K, NO_DRAFT, PROPOSERS, Committed, Draft, Proposer,
                                  ProposerContext, SpecConfig, SpecConfigError)

__all__ = ["DEFAULT_K", "MAX_K", "NO_DRAFT", "PROPOSERS", "Committed", "Draft", "Proposer", "ProposerContext",
           "SpecConfig", "SpecConfigError"]
