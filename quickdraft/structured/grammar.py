"""Grammar constraints (structured output), on llguidance: one request's matcher, advanced by the
tokens the engine commits and by nothing else; the tokens the grammar allows at every position of
a draft tree, each node's found by walking the matcher along that node's own path and rolling it
back after; the tokens it forces, drafted first. The verifier masks p (and q) with them
(verify.py), so speculation under a grammar stays exact.

Knows nothing of models, HTTP or the engine's loop; compiling is the caller's to bound in time.
"""
from __future__ import annotations

import functools
import json
import logging
import sys
import time
from collections import deque
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np
import torch

from quickdraft.errors import RequestError
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.spec.draft_contract import MAX_K, NO_DRAFT, Committed, Draft

log = logging.getLogger("quickdraft.structured.grammar")
DEAD_END = "grammar_dead_end"  # the finish reason of a request whose grammar allows no token and is not complete
# JSON on one line as json.dumps writes it (", " and ": "): a small model cannot loop on blank lines,
# and the grammar forces the separators. Fully compact JSON (",", ":") made SmolLM2-135M drop facts
# its prompt gave ("age": 23 for "who is 36"); with the spaces it wrote them right, in as many tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
Ended = Literal["stop", "grammar_dead_end"] | None
# A compile walks the grammar's first steps (probe): llguidance builds lexer states and parser rows as
# text reaches them, so its limits are met there, not by validate_grammar.
PROBE_STATES = 32    # masks computed (~5 ms for a 49k vocabulary; a step that meets a limit, up to ~150 ms)
PROBE_BRANCHES = 4   # one-byte tokens followed from a state that forces none
PROBE_FORCED = 16    # forced tokens taken as one step
PROBE_FREE = 24      # a state allowing more of PROBE_BYTES is free text
PROBE_BYTES = b'"{[-0123456789tfn,:]} ' + bytes(range(ord("a"), ord("z") + 1)) + bytes(range(ord("A"), ord("Z") + 1))


class GrammarError(RequestError, ValueError):
    """A grammar or JSON schema that is invalid, or that llguidance cannot compile."""
    code = "invalid_response_format"


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:  # a base dependency: missing only from a broken install
        raise GrammarError(f"structured output needs the llguidance package ({e}); pip install quickdraft "
                           f"again, or pip install llguidance") from None
    return llguidance


class Vocabulary:
    """A tokenizer as llguidance walks it: ~1 s to build for a 49k vocabulary, so once per model.
    Ids from the tokenizer's length up to `size` (the model's embedding rows) are never allowed."""

    def __init__(self, tokenizer: Tokenizer, size: int) -> None:
        ll = _llguidance()
        self.size = size
        self.words = (size + 31) // 32  # int32 words of a bitmask
        self.eos = sorted(tokenizer.eos_token_ids)
        self.tokenizer = ll.hf.from_tokenizer(tokenizer.hf, n_vocab=size, eos_token=self.eos or None)
        self._encode = tokenizer.encode
        singles = (self.tokenizer.tokenize_bytes(bytes([b])) for b in PROBE_BYTES)
        ones = [ids[0] for ids in singles if len(ids) == 1]
        self.probe = np.array(sorted(set(ones), key=ones.index), dtype=np.int64)  # probe's steps, in order

    def special(self, texts: Iterable[str]) -> frozenset[str]:
        """Those of `texts` that are one token llguidance holds as special (written <text> in Lark,
        never matched by a string)."""
        tokens = {text: self._encode(text, add_special_tokens=False) for text in texts}
        return frozenset(text for text, ids in tokens.items()
                         if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]))


def grammar_text(response_format: Mapping[str, Any]) -> str:
    """OpenAI's response_format ({"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"schema": ..., "strict": ...}}) -> llguidance's grammar; refused with a GrammarError. strict:
    false lets keywords llguidance does not implement pass unchecked (strict: true refuses them)."""
    ll = _llguidance()
    schema, strict = response_schema(response_format)
    try:
        return ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS,
                                                     overrides=None if strict else {"lenient": True})
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the schema is not valid JSON: {e}") from None


def response_schema(response_format: Mapping[str, Any]) -> tuple[Mapping[str, Any], bool]:
    """OpenAI's response_format as (its JSON schema, strict); refused with a GrammarError."""
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "object"}, True
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise GrammarError("json_schema must be an object whose schema is a JSON schema (an object)")
        return spec.get("schema", {}), spec.get("strict") is not False
    raise GrammarError(f"type must be json_object or json_schema here (text needs no grammar), found {kind!r}")


def lark_grammar(lark: str) -> str:
    """llguidance's grammar for Lark source in its dialect (tools.grammar writes it); refused with a
    GrammarError."""
    try:
        return _llguidance().LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the grammar is not valid Lark: {e}") from None


def constrain(vocabulary: Vocabulary, grammar: str) -> Constraint:
    """A request's constraint for an llguidance grammar (grammar_text, or Lark as
    LLMatcher.grammar_from_lark writes it); a grammar llguidance refuses is a GrammarError naming why."""
    ll = _llguidance()
    error = ll.LLMatcher.validate_grammar(grammar, vocabulary.tokenizer)
    if error:
        raise GrammarError(f"the grammar cannot be compiled: {error}")
    matcher = ll.LLMatcher(vocabulary.tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"the grammar cannot be compiled: {matcher.get_error()}")
    if problem := probe(matcher, vocabulary):
        raise GrammarError(problem)
    return Constraint(matcher, vocabulary)


def probe(matcher: Any, vocabulary: Vocabulary) -> str | None:
    """Why the grammar cannot be used, or None, from a walk of its first steps (on copies of the
    matcher). A regex or an alternative past llguidance's limits (a pattern "^a{1000000}$", an anyOf
    of 5,000 objects) compiles, and fails at the first mask that reaches it; a grammar that allows
    no text (a schema only a $ref to itself) fails at the first mask. Breadth first, PROBE_STATES
    masks: from each state its forced tokens (PROBE_FORCED of them), else the first PROBE_BRANCHES
    one-byte tokens it allows, JSON's structure first. A path no token goes on from (the vocabulary
    cannot spell what the grammar wants) is left: a request may never take it. A limit met past the
    walk, or that dead end, ends the request with DEAD_END while it decodes."""
    words = np.zeros(vocabulary.words, dtype=np.int32)
    queue: deque[tuple[list[int], Any, list[int]]] = deque([([], matcher, [])])  # path, its parent's state, step
    for _ in range(PROBE_STATES):
        if not queue:
            return None
        path, parent, step = queue.popleft()
        # a copy (~1 us) of the parent's state, which computed its mask and forced tokens before the step as
        # the engine's matcher does (llguidance meets some limits only then); one in error never leaves it
        walker = parent.deep_copy()
        walker.consume_tokens(step)
        if not walker.is_error():
            walker.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        forced = [] if walker.is_error() or walker.is_stopped() else walker.compute_ff_tokens()[:PROBE_FORCED]
        if walker.is_error():
            why = walker.get_error().split("\n<state>")[0].strip()  # llguidance appends its parser's state
            if why != "NoExtensionBias" or not path:
                return _refusal(why, vocabulary.tokenizer.decode_str(path))
            continue
        if not path and not _writes(words, vocabulary):
            return "the grammar allows no text: nothing but the end may come first"
        allows = vocabulary.probe[_bits(words, vocabulary.probe)] if not walker.is_stopped() else []
        # in free text (a string's) one step, the first (its closing quote): the rest is more of the same
        steps = [forced] if forced else [[int(t)] for t in allows[:1 if len(allows) > PROBE_FREE else
                                                                   PROBE_BRANCHES]]
        queue.extend((path + next_step, walker, next_step) for next_step in steps)
    return None


def _writes(words: np.ndarray, vocabulary: Vocabulary) -> bool:
    """Whether the bitmask `words` allows a token other than the end."""
    tokens = allowed(torch.from_numpy(words[None]), vocabulary.size)[0].nonzero().flatten().tolist()
    return not set(tokens) <= set(vocabulary.eos)


def _bits(words: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Whether each of `tokens` is allowed by the bitmask `words`."""
    return ((words.view(np.uint32)[tokens >> 5] >> (tokens & 31).astype(np.uint32)) & 1).astype(bool)


def _refusal(why: str, text: str) -> str:
    if not text and why == "NoExtensionBias":
        return ("the grammar allows no text: nothing can be written at its start (a schema that is only a "
                "reference to itself, such as {\"$ref\": \"#\"}, has no value)")
    if "too many expressions" in why:
        why += " (its lexer's work per token: a regex too large to match, such as a pattern or length with a " \
               "repetition count in the thousands)"
    where = f"after {text if len(text) <= 40 else text[:20] + '...' + text[-20:]!r}" if text else "at its start"
    return f"the grammar exceeds a limit of the grammar library (llguidance) {where}: {why}; give a simpler one"


def allowed(bits: torch.Tensor, size: int) -> torch.Tensor:
    """int32 bitmasks [R, words] -> allowed tokens [R, size] bool (token t: bit t % 32 of word t // 32)."""
    assert sys.byteorder == "little"  # the words' bytes in memory, lowest bits first: tokens in order
    # numpy's unpackbits: ~9 us a row for 49k tokens, 6-18x torch's shifts
    unpacked = np.unpackbits(bits.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(unpacked.view(np.bool_))[:, :size]


def _timed(method: Callable) -> Callable:
    """The call's time added to the constraint's `seconds`."""
    @functools.wraps(method)
    def timed(self: Constraint, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
    return timed


class Constraint:
    """One request's grammar state. The engine calls, per step: `shape` (the next draft: forced
    tokens first, the proposer's continuation, cut at forbidden tokens), `masks` (the allowed tokens
    at the root and after each verified node), `advance` (the committed tokens), `translate` (the
    step as the proposer, which drafted something else, must hear it)."""

    def __init__(self, matcher: Any, vocabulary: Vocabulary) -> None:
        self.matcher, self.size, self.eos = matcher, vocabulary.size, vocabulary.eos
        self.bits = torch.full((MAX_K + 1, vocabulary.words), -1, dtype=torch.int32)  # row 0: the root,
        self._view = self.bits.numpy()                    # 1 + i: after node i of the shaped draft
        self._eos_only = torch.zeros(vocabulary.words, dtype=torch.int32)  # after the end: the end alone
        for eos in self.eos:
            self._eos_only[eos >> 5] |= torch.tensor(1 << (eos & 31), dtype=torch.int64).to(torch.int32)
        self.offered: Draft | None = None  # the proposer's last draft (None: none shaped since translate)
        self.own: dict[int, int] = {}    # its nodes in the shaped draft: proposer node -> shaped node
        self.verified = 0                # shaped nodes the engine verified (masks' n)
        self.seconds = 0.0               # in the engine's calls below: the grammar's share of the steps
        self._fill(0)

    # -- the engine's calls ----------------------------------------------------------------------

    @_timed
    def shape(self, offered: Draft, limit: int) -> Draft:
        """The draft to verify, at most `limit` nodes: the tokens the grammar forces from the
        committed text (llguidance's tokenization of the bytes it forces; each still verified), then
        `offered`'s nodes below them (those under a forced depth hang on if their path spells the
        forced tokens; the others go, whatever their tokens), every node the grammar forbids cut
        with its subtree. Which nodes stay depends on the drafted tokens alone: exact (verify.py
        masks q as the cut conditions it)."""
        limit = max(limit, 0)
        self.offered, self.own, self.verified = offered, {}, 0
        forced = self.matcher.compute_ff_tokens()[:limit] if limit else []
        tokens, parents, own = list(forced), list(range(-1, len(forced) - 1)), [None] * len(forced)
        at: dict[int, int] = {}  # offered node -> merged node
        for i, (token, parent, depth) in enumerate(zip(offered.tokens, offered.tree, offered.depths())):
            up = -1 if parent < 0 else at.get(parent)
            if up is None and parent >= 0:
                continue  # its parent went
            if depth <= len(forced):
                if token == forced[depth - 1] and up == depth - 2:
                    at[i] = depth - 1  # the forced node stands for it
                continue
            at[i] = len(tokens)
            tokens.append(token)
            parents.append(up)
            own.append(i)
        n = min(len(tokens), limit)
        kept = self._walk(tokens[:n], parents[:n])
        self.own = {i: kept.index(m) for i, m in at.items() if m in kept}
        if not kept:
            return NO_DRAFT
        index = {m: j for j, m in enumerate(kept)}
        q = None
        if offered.q is not None:
            q = torch.zeros(len(kept), offered.q.shape[-1], dtype=offered.q.dtype, device=offered.q.device)
            for j, m in enumerate(kept):
                if own[m] is None:
                    q[j, tokens[m]] = 1.0  # a forced token: deterministic
                else:
                    q[j] = offered.q[own[m]]
        estimates = None
        if offered.accept_probs is not None or not offered.tokens:
            estimates = [1.0 if own[m] is None else offered.accept_probs[own[m]] for m in kept]
        source = offered.source if any(own[m] is not None for m in kept) else "grammar"
        return Draft([tokens[m] for m in kept], q, estimates, [-1 if parents[m] < 0 else index[parents[m]]
                                                                for m in kept], source)

    @_timed
    def masks(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[1+n, V] bool: the tokens allowed after the root and after each of the shaped draft's
        first n nodes (the ones verified)."""
        self.verified = n
        return allowed(self.bits[:1 + n], self.size).to(device)

    @_timed
    def advance(self, tokens: Sequence[int]) -> Ended:
        """The engine committed `tokens` (each allowed where it stands): "stop" once the text is
        complete and the grammar allows nothing but the end, DEAD_END when the text is incomplete
        and no token can go on with it, else None."""
        for token in tokens:
            if not self.matcher.consume_token(token):  # masks allow only what it takes: a library fault
                log.warning("the grammar refused committed token %d (%s); ending the request", token,
                            self.matcher.get_error())
                return DEAD_END
        if self.matcher.is_stopped():
            return "stop"
        self._fill(0)
        words = self._view[0].view(np.uint32).copy()
        for eos in self.eos:
            words[eos >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (eos & 31)))
        if words.any():
            return None
        # nothing but the end (EOS): a complete text, or, where llguidance allows the end because no
        # token fits an incomplete one, a dead end
        return "stop" if self.matcher.is_accepting() else DEAD_END

    @_timed
    def translate(self, step: Committed) -> Committed:
        """`step` as the proposer must hear it, which drafted `offered`, not the shaped draft: how many
        of the tokens its own draft's path spells, how many of its nodes were verified, the target's
        top tokens at the fed token and at those nodes."""
        if self.offered is None:  # the prompt's step: no draft was shaped
            return step
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(self.offered.tree):
            children.setdefault(parent, []).append(i)
        node, drafted = -1, 0
        for token in step.tokens[:-1]:
            node = next((c for c in children.get(node, ()) if self.offered.tokens[c] == token), -2)
            if node == -2:
                break
            drafted += 1
        rows = [0, *(1 + j for i, j in sorted(self.own.items()) if j < self.verified)]
        top, shaped = None, step.top
        if shaped is not None:
            top = (lambda n: (lambda scored: [scored[r] for r in rows])(shaped(n)))
        self.offered = None
        return Committed(step.tokens, drafted, len(rows) - 1, step.features, top, step.cost)

    # -- the matcher's walk ----------------------------------------------------------------------

    def _fill(self, row: int) -> None:
        self.matcher.unsafe_compute_mask_ptr(self.bits[row].data_ptr(), self.bits.shape[1] * 4)

    def _allows(self, row: int, token: int) -> bool:
        return bool((int(self._view[row, token >> 5]) >> (token & 31)) & 1)

    def _walk(self, tokens: list[int], parents: list[int]) -> list[int]:
        """The nodes the grammar allows (a forbidden node goes with its subtree, an EOS node keeps
        none), each one's mask filled in (bits row 1 + its place among the kept); the matcher ends
        where it began."""
        kept: list[int] = []
        paths: dict[int, list[int]] = {-1: []}  # kept node -> the kept nodes root to it
        path: list[int] = []                    # the nodes the matcher has consumed, root to last
        for m, (token, parent) in enumerate(zip(tokens, parents)):
            if parent not in paths or not self._allows(0 if parent < 0 else 1 + kept.index(parent), token):
                continue
            kept.append(m)
            if token in self.eos:  # the end: a leaf, never consumed (llguidance's rollback would not count it)
                self.bits[len(kept)] = self._eos_only
                continue
            path = self._goto(path, paths[parent], tokens)
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token}, which its mask allowed: "
                                   f"{self.matcher.get_error()}")
            path.append(m)
            paths[m] = path.copy()
            self._fill(len(kept))
        self._goto(path, [], tokens)
        return kept

    def _goto(self, path: list[int], target: list[int], tokens: list[int]) -> list[int]:
        """Move the matcher from having consumed `path` to having consumed `target`."""
        common = 0
        while common < min(len(path), len(target)) and path[common] == target[common]:
            common += 1
        if len(path) > common:
            self.matcher.rollback(len(path) - common)
        for m in target[common:]:
            self.matcher.consume_token(tokens[m])
        return list(target)

