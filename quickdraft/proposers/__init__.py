"""Proposers behind one protocol, found by name in a registry."""
# importing registers them
from quickdraft.proposers import datastore, draft_model, head, hybrid, ngram, recycle, suffix  # noqa: F401
from quickdraft.proposers.base import (
                                  DEFAULT_K,
                                  DEFAULT_METHOD,
                                  EACH,
                                  MAX_K,
                                  NO_DRAFT,
                                  PROPOSERS,
                                  Committed,
                                  Draft,
                                  Proposer,
                                  ProposerContext,
                                  SpecConfig,
                                  SpecConfigError,
)

__all__ = ["DEFAULT_K", "DEFAULT_METHOD", "EACH", "MAX_K", "NO_DRAFT", "PROPOSERS", "Committed", "Draft", "Proposer",
           "ProposerContext", "SpecConfig", "SpecConfigError"]
