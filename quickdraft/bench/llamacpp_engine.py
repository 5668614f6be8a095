"""llama.cpp (PyPI `llama-cpp-python`, the optional `bench` extra) as a `BenchEngine`
(bench/compare.py) and as Spec-Bench rows: the same GGUF file and token ids as quickdraft, the
same thread count.

`Llama(...)` loads; plain decoding goes through llama.cpp's C API directly (one `llama_decode`
per pass, its own greedy sampler, `llama_memory_seq_rm` to drop fed tokens), so the binding's
Python bookkeeping (copying logits into numpy per token) is not charged to llama.cpp. Prompt
lookup is the binding's own (`LlamaPromptLookupDecoding` in its `generate` loop): the only
speculative decoding it offers, bookkeeping included.
"""
from __future__ import annotations

from pathlib import Path
from typing import AbstractSet, Any, Iterator, Sequence

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
        for start in range(0, len(tokens), self.n_batch):  # one pass per n_batch tokens, as llama.cpp's tools
            self._decode(tokens[start:start + self.n_batch], all_logits=False)

    def feed(self, tokens: Sequence[int]) -> None:
        self._decode(tokens, all_logits=True)

    def stream_greedy(self, prompt: Sequence[int], n: int) -> Iterator[int]:
        self.prefill(prompt)
        for i in range(n):
            token = self.lc.llama_sampler_sample(self.sampler, self.ctx, -1)  # argmax of the last logits
            yield token
            if i < n - 1:
                self._decode([token], all_logits=False)


    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: AbstractSet[int]) -> list[int]:
        """Greedy tokens after `prompt`, up to max_new_tokens or through the first EOS (included)."""
        check_room(len(prompt), max_new_tokens, self.llm.n_ctx())
        out = []
        for token in self.stream_greedy(prompt, max_new_tokens):
            out.append(token)
            if token in eos:
                break
        return out


def check_room(prompt_tokens: int, max_new_tokens: int, n_ctx: int) -> None:
    if prompt_tokens + max_new_tokens > n_ctx:
        raise QuickdraftError(f"llama.cpp's context holds {n_ctx} tokens, but a turn needs {prompt_tokens} "
                              f"prompt + {max_new_tokens} new tokens")


CTX_PAD = 256


class LlamaCppPromptLookup:
    """The binding's prompt-lookup decoding, greedy: `Llama(draft_model=LlamaPromptLookupDecoding(
    max_ngram_size, num_pred_tokens))` and its `generate` loop, which verifies each draft in one
    llama_decode and keeps the tokens up to the first mismatch. Counts its passes and drafts."""
    name = "llama.cpp prompt lookup"

    def __init__(self, path: Path, threads: int, n_ctx: int, num_pred_tokens: int = 10,
                 max_ngram_size: int = 2) -> None:
        lc = import_llama_cpp()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        lookup = LlamaPromptLookupDecoding(max_ngram_size=max_ngram_size, num_pred_tokens=num_pred_tokens)
        self.passes = self.drafted = 0

        def draft(input_ids, **kwargs):  # noqa: ANN001, ANN003 (the binding's draft-model call)
            tokens = lookup(input_ids, **kwargs)
            self.drafted += len(tokens)
            return tokens

        # logits_all: the binding's drafting loop reads every fed position's logits, and sizes its
        # logits array by this flag (not by the draft model); flash attention as LlamaCppEngine's.
        # n_ctx a multiple of 256: llama.cpp pads the context to one, and the binding's loop bounds
        # drafts by the padded size but its token array by the size asked for (overflowing it)
        n_ctx = -(-n_ctx // CTX_PAD) * CTX_PAD
        self.llm = lc.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                            flash_attn=True, logits_all=True, draft_model=draft, verbose=False)
        if self.llm.n_ctx() != len(self.llm.input_ids):
            self.llm.close()
            raise QuickdraftError(f"llama.cpp made a context of {self.llm.n_ctx()} tokens for {n_ctx} asked for; "
                                  f"the binding's prompt lookup needs them equal")
        evaluate = self.llm.eval

        def counted_eval(tokens: Sequence[int]) -> None:
            self.passes += 1  # one llama_decode per call unless the tokens exceed n_batch (the prompt)
            evaluate(tokens)

        self.llm.eval = counted_eval

    def close(self) -> None:
        self.llm.close()

    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: AbstractSet[int]) -> tuple[list[int], int, int]:
        """Greedy tokens after `prompt` (up to max_new_tokens or through the first EOS), with the
        target passes and drafted tokens it took."""
        check_room(len(prompt), max_new_tokens, self.llm.n_ctx())
        self.llm.reset()  # no prefix reuse from an earlier call: every turn starts from an empty cache
        self.passes = self.drafted = 0
        out: list[int] = []
        for token in self.llm.generate(list(prompt), top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if token in eos or len(out) == max_new_tokens:
                break
        return out, self.passes, self.drafted
