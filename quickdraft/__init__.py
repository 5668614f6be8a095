"""quickdraft: fast, exact speculative decoding for Llama-family models."""
from quickdraft.api import LLM, Chunk, Completion, load
from quickdraft.errors import (ContextTooLong, InvalidSamplingParams, ModelLoadError, QuickdraftError,
                               UnsupportedArchitecture)
from quickdraft.sampling import SamplingParams
from quickdraft.proposers import SpecConfig, SpecConfigError

__all__ = ["LLM", "Chunk", "Completion", "ContextTooLong", "InvalidSamplingParams", "ModelLoadError",
           "QuickdraftError", "SamplingParams", "SpecConfig", "SpecConfigError", "UnsupportedArchitecture", "load"]
__version__ = "0.1.0"
