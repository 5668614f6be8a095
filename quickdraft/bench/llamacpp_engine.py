"""llama.cpp (PyPI `llama-cpp-python`, the optional `bench` extra) as a `BenchEngine`
(bench/compare.py): the same GGUF file and token ids as quickdraft, the same thread count.

`Llama(...)` loads; everything timed goes through llama.cpp's C API directly (one `llama_decode`
per pass, its own greedy sampler, `llama_memory_seq_rm` to drop fed tokens), so the binding's
Python bookkeeping (copying logits into numpy per token) is not charged to llama.cpp.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

from quickdraft.errors import QuickdraftError

INSTALL_HINT = ("llama.cpp comes from the optional `bench` extra: pip install -e '.[bench]' (or "
                "bash scripts/install.sh --bench); pip builds llama-cpp-python from source with cmake "
                "(5-10 minutes on 2 cores)")


def import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as e:
        raise QuickdraftError(f"--compare-llamacpp needs the Python package llama_cpp, which is not "
                              f"installed ({e}); {INSTALL_HINT}") from None
    return llama_cpp


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, n_ctx: int, n_batch: int = 512) -> None:
        lc = import_llama_cpp()
        self.lc = lc
        # flash attention on: what llama.cpp's own tools choose on a CPU ("auto"), which the
        # binding's flag cannot express
        self.llm = lc.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                            n_threads=threads, n_threads_batch=threads, flash_attn=True, verbose=False)
        self.ctx = self.llm.ctx
        self.memory = lc.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        self.sampler = lc.llama_sampler_init_greedy()
        self.n = 0  # tokens in the KV cache

    @property
    def version(self) -> str:
        return self.lc.__version__

    def system_info(self) -> str:
        return self.lc.llama_print_system_info().decode(errors="replace").strip()

    def close(self) -> None:
        self.lc.llama_sampler_free(self.sampler)
        self.lc.llama_batch_free(self.batch)
        self.llm.close()

    def _decode(self, tokens: Sequence[int], all_logits: bool) -> None:
        if len(tokens) > self.n_batch:
            raise ValueError(f"{len(tokens)} tokens in one pass, expected at most n_batch = {self.n_batch}")
        b = self.batch
        b.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            b.token[i] = token
            b.pos[i] = self.n + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = all_logits or i == len(tokens) - 1
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {len(tokens)} tokens at position {self.n}")
        self.lc.llama_synchronize(self.ctx)  # the caller's clock must see the pass finished
        self.n += len(tokens)

    def truncate(self, n: int) -> None:
        self.lc.llama_memory_seq_rm(self.memory, 0, n, -1)
        self.n = n

    def prefill(self, tokens: Sequence[int]) -> None:
        self.truncate(0)
        self._decode(tokens, all_logits=False)

    def feed(self, tokens: Sequence[int]) -> None:
        self._decode(tokens, all_logits=True)

    def stream_greedy(self, prompt: Sequence[int], n: int) -> Iterator[int]:
        self.prefill(prompt)
        for i in range(n):
            token = self.lc.llama_sampler_sample(self.sampler, self.ctx, -1)  # argmax of the last logits
            yield token
            if i < n - 1:
                self._decode([token], all_logits=False)

