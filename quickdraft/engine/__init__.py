"""The engine: the only place that knows the order of a decoding step."""
from quickdraft.engine.events import GenerationStats, TokenEvent
from quickdraft.engine.loop import generate_tokens

__all__ = ["GenerationStats", "TokenEvent", "generate_tokens"]
