"""quickdraft: fast, exact speculative decoding for Llama-family models."""
import os

# The kernels run on their own thread pool. torch's OpenMP threads, spinning while they wait (the
# default policy), held the cores the kernels wanted, and torch's reductions right after a pass
# then waited on them: a softmax over [5, 151936] logits took 4-25 ms instead of 0.7, sampled
# speculation on the Qwen pair ran 10-14% slower. Waiting passively frees the core. It must be set
# before torch loads OpenMP (so before any `import torch`); a policy the user set wins.
# llama.cpp, which the benchmarks run in a process of their own, gets the user's (bench/llamacpp_engine.py).
USER_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The public names load on first use (PEP 562), not with the package: a module that needs neither
# the model nor the kernels (spec/draft_contract.py, spec/sequences.py) imports without them.
_PUBLIC = {"LLM": "api", "Chunk": "requests.text", "Completion": "api", "load": "api", "ContextTooLong": "errors",
           "InvalidSamplingParams": "errors", "ModelLoadError": "errors", "QuickdraftError": "errors",
           "RequestError": "errors", "UnsupportedArchitecture": "errors", "SamplingParams": "spec.sampling",
           "SpecConfig": "proposers", "SpecConfigError": "proposers"}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'quickdraft' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f"quickdraft.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value


__all__ = ["LLM", "Chunk", "Completion", "ContextTooLong", "InvalidSamplingParams", "ModelLoadError",
           "QuickdraftError", "RequestError", "SamplingParams", "SpecConfig", "SpecConfigError",
           "UnsupportedArchitecture", "load"]
__version__ = "0.1.0"
