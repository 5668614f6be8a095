"""llama.cpp (PyPI `llama-cpp-python`, the optional `llamacpp` extra) in a process of its own: the
engines the benchmarks compare with, and the loop that serves them to llamacpp_engine.py's proxies.

It runs as a script (`python llamacpp_worker.py`), importing neither quickdraft nor torch, so
llama.cpp's OpenMP threads wait as the user's environment says: quickdraft sets a passive wait
policy for torch's pool, which in one process llama.cpp shares and which slowed its decoding by a
third (18 vs 27 tok/s on the 1.5B).

`Llama(...)` loads; plain decoding goes through llama.cpp's C API directly (one `llama_decode`
per pass, its own greedy sampler, `llama_memory_seq_rm` to drop fed tokens), so the binding's
Python bookkeeping (copying logits into numpy per token) is not charged to llama.cpp. Speculative
decoding is the binding's own loop (`Llama(draft_model=...)` and its `generate`, bookkeeping
included), drafting by its prompt lookup (`LlamaPromptLookupDecoding`) or by a second model as
llama.cpp's own speculative decoding drafts (`ModelDraft`).
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Sequence

import llama_cpp as lc
import numpy as np
from amx_guard import AMX_REFUSED, amx_refused, refuse_amx_tile_state  # a sibling: this file runs by path


def system_info() -> str:
    """llama.cpp's own line of what it was built with, and what this process refused it."""
    info = lc.llama_print_system_info().decode(errors="replace").strip()
    return f"{info} {AMX_REFUSED}" if amx_refused() else info


class NoRoom(ValueError):
    """A turn does not fit llama.cpp's context."""


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, n_ctx: int, n_batch: int = 512) -> None:
        self.lc = lc
        refuse_amx_tile_state()
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
        return system_info()

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
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Feed tokens after the cached ones, the last one's logits kept."""
        for start in range(0, len(tokens), self.n_batch):  # one pass per n_batch tokens, as llama.cpp's tools
            self._decode(tokens[start:start + self.n_batch], all_logits=False)

    def feed(self, tokens: Sequence[int]) -> None:
        self._decode(tokens, all_logits=True)

    def n_ctx(self) -> int:
        return self.llm.n_ctx()

    def stream_greedy(self, prompt: Sequence[int], n: int) -> Iterator[int]:
        self.prefill(prompt)
        for i in range(n):
            token = self.lc.llama_sampler_sample(self.sampler, self.ctx, -1)  # argmax of the last logits
            yield token
            if i < n - 1:
                self._decode([token], all_logits=False)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: Collection[int]) -> list[int]:
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
        raise NoRoom(f"llama.cpp's context holds {n_ctx} tokens, but a turn needs {prompt_tokens} "
                              f"prompt + {max_new_tokens} new tokens")


CTX_PAD = 256


class LlamaCppSpeculative:
    """The binding's speculative decoding, greedy: `Llama(draft_model=draft)` and its `generate`
    loop, which verifies each draft in one llama_decode and keeps the tokens up to the first
    mismatch. Counts its passes and drafted tokens."""

    def __init__(self, path: Path, threads: int, n_ctx: int, draft: Callable[..., np.ndarray]) -> None:
        refuse_amx_tile_state()
        self.draft = draft
        self.passes = self.drafted = 0

        def counted(input_ids, **kwargs):  # noqa: ANN001, ANN003 (the binding's draft-model call)
            tokens = draft(input_ids, **kwargs)
            self.drafted += len(tokens)
            return tokens

        # logits_all: the binding's drafting loop reads every fed position's logits, and sizes its
        # logits array by this flag (not by the draft model); flash attention as LlamaCppEngine's.
        # n_ctx a multiple of 256: llama.cpp pads the context to one, and the binding's loop bounds
        # drafts by the padded size but its token array by the size asked for (overflowing it)
        n_ctx = -(-n_ctx // CTX_PAD) * CTX_PAD
        try:
            self.llm = lc.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                flash_attn=True, logits_all=True, draft_model=counted, verbose=False)
        except Exception:
            getattr(draft, "close", lambda: None)()
            raise
        if self.llm.n_ctx() != len(self.llm.input_ids):
            self.close()
            raise NoRoom(f"llama.cpp made a context of {self.llm.n_ctx()} tokens for {n_ctx} asked for; "
                         f"the binding's speculative loop needs them equal")
        evaluate = self.llm.eval

        def counted_eval(tokens: Sequence[int]) -> None:
            self.passes += 1  # one llama_decode per call unless the tokens exceed n_batch (the prompt)
            evaluate(tokens)

        self.llm.eval = counted_eval

    def close(self) -> None:
        self.llm.close()
        getattr(self.draft, "close", lambda: None)()

    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: Collection[int]) -> tuple[list[int], int, int]:
        """Greedy tokens after `prompt` (up to max_new_tokens or through the first EOS), with the
        target passes and drafted tokens it took."""
        check_room(len(prompt), max_new_tokens, self.llm.n_ctx())
        self.llm.reset()  # no prefix reuse from an earlier call: every turn starts from an empty cache
        getattr(self.draft, "reset", lambda: None)()  # the draft model's too
        self.passes = self.drafted = 0
        out: list[int] = []
        for token in self.llm.generate(list(prompt), top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if token in eos or len(out) == max_new_tokens:
                break
        return out, self.passes, self.drafted


def prompt_lookup(path: Path, threads: int, n_ctx: int, num_pred_tokens: int = 10,
                  max_ngram_size: int = 2) -> LlamaCppSpeculative:
    """The binding's prompt lookup: `LlamaPromptLookupDecoding(max_ngram_size, num_pred_tokens)`."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    return LlamaCppSpeculative(path, threads, n_ctx, LlamaPromptLookupDecoding(max_ngram_size=max_ngram_size,
                                                                               num_pred_tokens=num_pred_tokens))


class ModelDraft:
    """Drafts from a second model, as llama.cpp's own speculative decoding drafts (common/speculative.cpp,
    its defaults: --draft-max 16, --draft-p-min 0.75): the draft's greedy tokens, up to n_max, ending
    after the first whose probability among the draft's top 10 is below p_min (that token still
    drafted, as its gen_draft did in 2025; later versions leave it out). The draft model's
    cache is kept between calls: the longest prefix it shares with the new input is reused, the
    rest fed (the last accepted draft token and the target's own, after each verification)."""
    TOP = 10  # the candidates llama.cpp's draft sampler keeps (top-k), whose softmax gives p

    def __init__(self, path: Path, threads: int, n_ctx: int, n_max: int = 16, p_min: float = 0.75) -> None:
        self.engine = LlamaCppEngine(path, threads, n_ctx)
        self.vocab = self.engine.llm.n_vocab()
        self.n_max, self.p_min = n_max, p_min
        self.tokens = np.zeros(0, np.int64)  # what the draft model's cache holds

    def close(self) -> None:
        self.engine.close()

    def reset(self) -> None:
        """Nothing cached: a turn's prompt is the draft's to prefill, as the target's."""
        self.tokens = np.zeros(0, np.int64)

    def __call__(self, input_ids: np.ndarray, **kwargs: Any) -> np.ndarray:
        ids = np.asarray(input_ids, dtype=np.int64)
        n = min(len(self.tokens), len(ids) - 1)  # the input's last token is always fed: its logits start the draft
        differ = np.flatnonzero(self.tokens[:n] != ids[:n])
        keep = int(differ[0]) if differ.size else n
        e = self.engine
        e.truncate(keep)
        self.tokens = ids[:keep]  # what the cache holds, should feeding fail
        e.extend(ids[keep:].tolist())
        draft: list[int] = []
        while True:
            logits = np.ctypeslib.as_array(e.lc.llama_get_logits_ith(e.ctx, -1), shape=(self.vocab,))
            top = np.argpartition(logits, -self.TOP)[-self.TOP:]
            best = int(top[np.argmax(logits[top])])
            p = 1.0 / float(np.exp(logits[top] - logits[best]).sum())
            draft.append(best)
            if len(draft) == self.n_max or p < self.p_min:
                break
            e.extend([best])
        self.tokens = np.concatenate((ids, np.array(draft[:-1], dtype=np.int64)))
        return np.array(draft, dtype=np.intc)


def draft_model(path: Path, threads: int, n_ctx: int, draft: str, n_max: int = 16,
                p_min: float = 0.75) -> LlamaCppSpeculative:
    """Speculative decoding with the GGUF model `draft` drafting (ModelDraft), same threads; its context
    holds the target's (padded as LlamaCppSpeculative pads it) and a draft past it."""
    room = -(-n_ctx // CTX_PAD) * CTX_PAD + n_max
    drafter = ModelDraft(Path(draft), threads, room, n_max, p_min)
    speculative = LlamaCppSpeculative(path, threads, n_ctx, drafter)
    if drafter.vocab != speculative.llm.n_vocab():  # as llama.cpp's own check: its ids must be the target's
        speculative.close()
        raise ValueError(f"the draft model's vocabulary ({drafter.vocab} tokens) is not the target's "
                         f"({speculative.llm.n_vocab()}): llama.cpp drafts only with a model of the same tokenizer")
    return speculative


ENGINES = {"plain": LlamaCppEngine, "prompt-lookup": prompt_lookup, "draft-model": draft_model}


def serve(kind: str, args: list[Any]) -> None:
    """One engine, called over stdin/stdout in JSON lines: {"call": name, "args": [...]} ->
    {"ok": result} | {"error": message, "kind": exception class}; a generator's items come one
    per {"call": "next"} ({"ok": item} or {"done": true})."""
    out = sys.stdout
    sys.stdout = sys.stderr  # llama.cpp's and the binding's own prints must not mix with answers

    def answer(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    try:
        engine = ENGINES[kind](Path(args[0]), *args[1:])
    except Exception as e:  # noqa: BLE001 - the proxy raises it, with its message
        answer({"error": f"{type(e).__name__}: {e}", "kind": type(e).__name__})
        return
    answer({"ok": {"version": lc.__version__, "system_info": system_info()}})
    stream: Iterator[Any] | None = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["call"] == "next":
                item = next(stream, StopIteration)
                answer({"done": True} if item is StopIteration else {"ok": item})
                continue
            result = getattr(engine, request["call"])(*request["args"])
            if isinstance(result, Iterator):
                stream, result = result, None
            answer({"ok": result})
        except Exception as e:  # noqa: BLE001 - the proxy raises it, with its message
            answer({"error": str(e) if isinstance(e, NoRoom) else traceback.format_exc(), "kind": type(e).__name__})
        if request["call"] == "close":
            return


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]))
