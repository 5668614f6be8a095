"""llama.cpp as the benchmarks see it: a `BenchEngine` (bench/compare.py) and Spec-Bench rows, on
the same GGUF file and token ids as quickdraft, with the same thread count, each engine a proxy of
one in llamacpp_worker.py running in a process of its own.

The worker gets the environment the user started quickdraft with: quickdraft's passive OpenMP wait
policy (quickdraft/__init__.py) is for torch's pool, and llama.cpp in the same process shares that
runtime, where the policy cost it a third of its decoding speed. A call costs a pipe round trip
(tens of microseconds, against passes of milliseconds), charged to llama.cpp's clock.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import AbstractSet, Any, Iterator, Sequence

import quickdraft
from quickdraft.errors import QuickdraftError

WORKER = Path(__file__).with_name("llamacpp_worker.py")  # run by path: it must not import quickdraft
INSTALL_HINT = ("llama.cpp comes from the optional `llamacpp` extra: pip install -e '.[llamacpp]' (or "
                "bash scripts/install.sh --llamacpp); pip builds llama-cpp-python from source with cmake "
                "(5-10 minutes on 2 cores)")


def import_llama_cpp() -> Any:
    """The binding, imported here only to say it is there and which version it is."""
    try:
        import llama_cpp
    except ImportError as e:
        raise QuickdraftError(f"--compare-llamacpp needs the Python package llama_cpp, which is not "
                              f"installed ({e}); {INSTALL_HINT}") from None
    return llama_cpp


def worker_environment() -> dict[str, str]:
    """This process's environment with OMP_WAIT_POLICY as the user had it (unset if they had none)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if quickdraft.USER_OMP_WAIT_POLICY is not None:
        env["OMP_WAIT_POLICY"] = quickdraft.USER_OMP_WAIT_POLICY
    return env


class _Worker:
    """One llamacpp_worker.py process serving one engine."""

    def __init__(self, kind: str, args: Sequence[Any]) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            import_llama_cpp()  # raises, saying what to install
        self.process = subprocess.Popen([sys.executable, str(WORKER), kind, json.dumps(list(args))],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=worker_environment())
        info = self._answer()
        self.version, self.system_info = info["version"], info["system_info"]

    def _answer(self) -> Any:
        line = self.process.stdout.readline()
        if not line:
            raise QuickdraftError(f"llama.cpp's process ended (exit code {self.process.wait()}); its output is above")
        message = json.loads(line)
        if "error" in message:
            raise QuickdraftError(f"llama.cpp: {message['error']}")
        return None if message.get("done") else message["ok"]

    def call(self, name: str, *args: Any) -> Any:
        self.process.stdin.write(json.dumps({"call": name, "args": list(args)}) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def stream(self, name: str, *args: Any) -> Iterator[Any]:
        self.call(name, *args)
        while True:
            self.process.stdin.write('{"call": "next"}\n')
            self.process.stdin.flush()
            line = self.process.stdout.readline()
            message = json.loads(line) if line else {"error": "its process ended"}
            if message.get("done"):
                return
            if "error" in message:
                raise QuickdraftError(f"llama.cpp: {message['error']}")
            yield message["ok"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.call("close")
            self.process.wait(timeout=60)


class LlamaCppEngine:
    """llama.cpp's plain greedy decoding, its prefill and its passes over fed tokens (llamacpp_worker.py)."""
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, n_ctx: int, n_batch: int = 512) -> None:
        self.worker = _Worker("plain", [str(path), threads, n_ctx, n_batch])
        self.version = self.worker.version

    def system_info(self) -> str:
        return self.worker.system_info

    def n_ctx(self) -> int:
        return self.worker.call("n_ctx")

    def close(self) -> None:
        self.worker.close()

    def prefill(self, tokens: Sequence[int]) -> None:
        self.worker.call("prefill", list(tokens))

    def feed(self, tokens: Sequence[int]) -> None:
        self.worker.call("feed", list(tokens))

    def truncate(self, n: int) -> None:
        self.worker.call("truncate", n)

    def stream_greedy(self, prompt: Sequence[int], n: int) -> Iterator[int]:
        return self.worker.stream("stream_greedy", list(prompt), n)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: AbstractSet[int]) -> list[int]:
        """Greedy tokens after `prompt`, up to max_new_tokens or through the first EOS (included)."""
        return self.worker.call("generate", list(prompt), max_new_tokens, sorted(eos))


class _Speculative:
    """The binding's speculative loop, greedy (llamacpp_worker.py), with its passes and drafts."""

    def __init__(self, kind: str, args: Sequence[Any]) -> None:
        self.worker = _Worker(kind, args)

    def close(self) -> None:
        self.worker.close()

    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: AbstractSet[int]) -> tuple[list[int], int, int]:
        """Greedy tokens after `prompt` (up to max_new_tokens or through the first EOS), with the
        target passes and drafted tokens it took."""
        out, passes, drafted = self.worker.call("generate", list(prompt), max_new_tokens, sorted(eos))
        return out, passes, drafted


class LlamaCppPromptLookup(_Speculative):
    """The binding's prompt-lookup decoding."""
    name = "llama.cpp prompt lookup"

    def __init__(self, path: Path, threads: int, n_ctx: int, num_pred_tokens: int = 10,
                 max_ngram_size: int = 2) -> None:
        super().__init__("prompt-lookup", [str(path), threads, n_ctx, num_pred_tokens, max_ngram_size])


class LlamaCppDraftModel(_Speculative):
    """Speculative decoding with a draft model (a GGUF file), drafting as llama.cpp's own does
    (llamacpp_worker.ModelDraft: up to n_max greedy tokens, ending at the first below p_min)."""
    name = "llama.cpp draft model"

    def __init__(self, path: Path, threads: int, n_ctx: int, draft: Path, n_max: int = 16) -> None:
        super().__init__("draft-model", [str(path), threads, n_ctx, str(draft), n_max])
