"""Proposers behind one protocol, found by name in a registry."""
from quickdraft.spec import draft_model, head, hybrid, ngram  # noqa: F401  (importing registers them)
from quickdraft.spec.base import (MAX_K, PROPOSERS, Draft, Proposer, ProposerContext, SpecConfig,
                                  SpecConfigError)

__all__ = ["MAX_K", "PROPOSERS", "Draft", "Proposer", "ProposerContext", "SpecConfig", "SpecConfigError"]
