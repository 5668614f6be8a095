"""The Python API: `quickdraft.load(...)` and an `LLM` that generates (text, token ids and stats,
whole or streamed), scores prompts, and serves as the server's and the CLI's door to the model.

Layered iterators: the model's one engine (EngineService) yields token events, which the request
pipeline's other end (requests/text.py `TextAssembler`, the server's answers' too) turns into text
deltas cut at stop strings. A chat is rendered as the server renders it (requests/prompt.py).
"""
from __future__ import annotations

import threading
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence, TypeVar

import torch

from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.engine.events import GenerationStats
from quickdraft.engine.policy import StepCost
from quickdraft.engine.service import EngineService
from quickdraft.errors import ModelLoadError, QuickdraftError, RequestError
from quickdraft.kv.blocks import BlockPool
from quickdraft.kv.prefix_cache import PrefixCache, default_budget_mb
from quickdraft.model.llama import Transformer
from quickdraft.model.tokenizer import Message, Tokenizer
from quickdraft.proposers import PROPOSERS, Proposer, ProposerContext, SpecConfig, SpecConfigError
from quickdraft.proposers.datastore import Datastore, find_datastore, load_datastore
from quickdraft.proposers.draft_model import check_compatible
from quickdraft.proposers.head import DraftHead, load_head, packaged_head, packaged_reads
from quickdraft.proposers.registry import runs
from quickdraft.requests.completion import Completion, completion
from quickdraft.requests.prompt import bounded, check_length, given, text_of
from quickdraft.requests.reply import end_ids, read_stream, reasoning_counter
from quickdraft.requests.shape import constraint_of, shape_of
from quickdraft.requests.text import Chunk, TextAssembler
from quickdraft.spec.logprobs import TokenLogprob
from quickdraft.spec.sampling import SamplingParams
from quickdraft.structured.grammar import Constraint, Vocabulary
from quickdraft.structured.tools import (
    Syntax,
    Tools,
    kept_markers,
    template_syntax,
)
from quickdraft.weights import LoadedModel, load_model
from quickdraft.weights.packaged import PACKAGED_DRAFTS, packaged_draft

T = TypeVar("T")

# Rows the model's shared engine decodes together unless a server sets its own (the K/V cache grows
# with use: rows and room that no request asked for cost nothing).
ENGINE = EngineConfig(max_batch=8)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Scored:
    """A prompt scored (LLM.score): token_ids[i + 1]'s log-probability given token_ids[:i + 1] is
    logprobs[i].logprob (the first token has none: nothing comes before it)."""
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # [len(token_ids) - 1]
    stats: GenerationStats


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise QuickdraftError(f"dtype {dtype} is not supported; expected one of {', '.join(DTYPES)}")
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise QuickdraftError(f"dtype {dtype!r} is not supported; expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def parse_device(device: str | torch.device) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise QuickdraftError(f"device: expected a name such as 'cpu' or 'cuda', found {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise QuickdraftError(f"device {device!r} is not valid: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QuickdraftError(f"device {device!r} was asked for but CUDA is not available here; use 'cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise QuickdraftError(f"device {device!r} is not supported; expected 'cpu' or 'cuda'")
    return dev


def once(loaded: dict[str, Any], key: str, load: Callable[[], T]) -> T:
    """`load()` once per key; its SpecConfigError is kept too, so a file asked for again per request
    ("auto") fails fast, with no file reads."""
    if key not in loaded:
        try:
            loaded[key] = load()
        except SpecConfigError as e:
            loaded[key] = e
    if isinstance(loaded[key], SpecConfigError):
        raise SpecConfigError(str(loaded[key]))
    return loaded[key]


def checked_spec(spec: SpecConfig | None) -> SpecConfig | None:
    """A SpecConfig or None as given; anything else refused by name."""
    if spec is not None and not isinstance(spec, SpecConfig):
        raise SpecConfigError(f"spec: expected a quickdraft.SpecConfig, found {type(spec).__name__}")
    return spec


class LLM:
    def __init__(self, loaded: LoadedModel, spec: SpecConfig | None = None,
                 prefix_cache_mb: int | None = None) -> None:
        """prefix_cache_mb: the budget of the model's prefix cache, which every generation through
        this LLM (and a server over it) shares: a prompt that starts with tokens an earlier one had
        prefills only the rest; None: default_budget_mb(); 0: no prefix cache."""
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.spec = checked_spec(spec) or SpecConfig()
        self._drafts: dict[str, LLM] = {}
        self._heads: dict[str, DraftHead | SpecConfigError] = {}
        self._datastores: dict[str, Datastore | SpecConfigError] = {}
        # the layers the packaged head reads (`auto` may pick it), before the prefix cache: it keeps them too
        self.model.keep_features(packaged_reads(self.model))
        self.prefix = make_prefix_cache(self.model, prefix_cache_mb)
        self._shared: dict[Hashable, dict[Hashable, Any]] = {}  # scope -> key -> state
        self._scope: Hashable = None
        self._shared_lock = threading.Lock()  # proposers are made on engine threads and callers' threads
        self._service: EngineService | None = None
        self._service_lock = threading.Lock()
        self._vocabulary: Vocabulary | None = None
        self._vocabulary_lock = threading.Lock()
        self._tool_syntax: Syntax | None = None
        # each file named or needed loads and is checked now, not at the first request (a named one the
        # proposer does not read: a request may switch to one that does)
        if self.spec.draft_model or self.spec.needs_draft_model:
            self.draft_model(self.spec.draft_model)
        if self.spec.head or self.spec.needs_head:
            self.draft_head(self.spec.head)
        if self.spec.datastore or self.spec.needs_datastore:
            self.datastore(self.spec.datastore)

    @property
    def name(self) -> str | None:
        """The packaged name this model was loaded by (None when loaded from a path)."""
        return self.loaded.source.name

    def draft_name(self, name_or_path: str | None = None) -> str:
        """The draft model to use: the one named, else the packaged draft of this target's family
        (a target loaded by its packaged name); neither is a clear error. Loads nothing."""
        if name_or_path:
            return name_or_path
        source = self.loaded.source
        draft = packaged_draft(source.name)
        if draft is None:
            pairs = ", ".join(f"{target} -> {d}" for target, d in PACKAGED_DRAFTS.items())
            what = f"the packaged model {source.name!r}" if source.name else f"a model loaded from {source.path}"
            raise SpecConfigError(f"the 'draft' proposer needs a draft model, and none ships for {what} (packaged "
                                  f"pairs: {pairs}); name one with --draft-model NAME|PATH (in Python: "
                                  f"SpecConfig(draft_model=...))")
        return draft

    def draft_model(self, name_or_path: str | None = None) -> "LLM":
        """A draft model on this model's device and dtype, loaded once and checked compatible;
        None: this target's packaged draft (draft_name)."""
        name_or_path = self.draft_name(name_or_path)
        if name_or_path not in self._drafts:
            # the precision asked for the target, if any, holds for its draft's quantized matrices too
            draft = LLM(load_model(name_or_path, self.model.device, self.model.dtype,
                                   activations=self.loaded.activations), prefix_cache_mb=0)  # drafts keep their own
            check_compatible(self, draft)
            self._drafts[name_or_path] = draft
        return self._drafts[name_or_path]

    def draft_head(self, path: str | None = None) -> "DraftHead":
        """A trained draft head for this model, loaded once (a head for another model is an error);
        None: the head that ships for this model."""
        head = once(self._heads, path or "", lambda: load_head(path or packaged_head(self.model), self.model))
        self.keep_features_of(head, path)
        return head

    def datastore(self, path: str | None = None) -> Datastore:
        """The datastore of this model's answers (proposers/datastore.py), its table built once;
        None: the one that ships for this model."""
        return once(self._datastores, path or "",
                    lambda: load_datastore(find_datastore(path, self.model), self.model.config.vocab_size))

    def keep_features_of(self, head: "DraftHead", path: str | Path | None = None) -> None:
        """Have the model keep the layers `head` reads besides those it keeps (a head reads its own
        columns of them). One engine keeps one set of layers for every row and its prefix cache, so
        they can grow only until the engine is made: a head named at load, by a server at start or
        before the first generation. `path`: where the head came from, for the error."""
        reads, kept = head.reads(self.model), self.model.feature_layers
        if set(reads) <= set(kept):
            return
        if self._service is not None:
            raise SpecConfigError(f"the draft head {path or '(packaged)'} reads the target's layers {list(reads)}, and "
                                  f"this model's engine already runs keeping the features of layers {list(kept)}: "
                                  f"load the model with this head (--head DIR; in Python, quickdraft.load(..., "
                                  f"spec=SpecConfig(head=DIR)))")
        self.model.keep_features(sorted(set(reads) | set(kept)))
        if self.prefix is not None:  # nothing stored yet: no engine has run
            self.prefix.keep_features(self.model.feature_width)

    def shared(self, key: Hashable, make: Callable[[], T]) -> T:
        """State proposers share across this model's requests, made once per key (proposers/base.py
        Target), in the current scope (`shared_scope`)."""
        with self._shared_lock:
            state = self._shared.setdefault(self._scope, {})
            if key not in state:
                state[key] = make()
            return state[key]

    @contextmanager
    def shared_scope(self, name: Hashable) -> Iterator[None]:
        """Proposers made inside the block share state only with those made in the same scope: a
        benchmark gives each method its own, so that no method learns from another's answer to
        the question it is about to answer (suffix decoding would find it whole)."""
        with self._shared_lock:
            outer, self._scope = self._scope, name
        try:
            yield
        finally:
            with self._shared_lock:
                self._scope = outer

    def engine_service(self, config: EngineConfig | None = None, cost: StepCost | None = None) -> EngineService:
        """The one engine every generation of this model goes through (LLM.stream, a server over it):
        one batch, one prefix cache, one measured step cost. `config`/`cost` set it up anew (a
        server's rows and context) where they differ from the one it has, which only an idle engine
        allows."""
        with self._service_lock:
            service = self._service
            if service is None or (config is not None and config != service.engine.config) or \
                    (cost is not None and cost is not service.engine.cost):
                if service is not None and service.loops:
                    raise QuickdraftError("a server already runs this model's engine with other settings (rows, "
                                          "context or step costs); one model has one engine: stop that server "
                                          "first, or load the model again for a second one")
                if service is not None and service.busy():
                    raise QuickdraftError("this model's engine is running requests; it can be set up anew "
                                          "(another server's rows or context) only while idle")
                if service is not None:  # its rows' blocks, in the prefix cache's pool, go back
                    service.engine.close()
                self._service = EngineService(Engine(self.model, config or ENGINE, cost, prefix=self.prefix))
            return self._service

    def request(self, ids: list[int], params: SamplingParams, spec: SpecConfig, constraint: Constraint | None = None,
                prompt_logprobs: int | None = None, cache_scope: str = "") -> tuple[Request, Callable[[], Proposer | None]]:
        """A request for the engine, and the call that builds its proposer (on the driving thread);
        `prompt_logprobs`: its prompt scored too, with this many alternatives a token. A request that
        generates nothing has nothing to draft: no proposer. `cache_scope`: whose prefix-cache
        entries it reads and leaves (prefix_cache.py). It ends at the model's end tokens
        (requests/reply.py `end_ids`: a harmony model's <|return|> and <|call|>, never <|end|>)."""
        drafts = spec.enabled and params.max_new_tokens > 0
        request = Request(ids, params, end_ids(self.tokenizer, self.tool_syntax()), None, spec.k if drafts else 0,
                          spec.adaptive, constraint, prompt_logprobs, cache_scope)
        return request, lambda: self.proposer(ids, params, spec, cache_scope) if drafts else None

    def grammar_vocabulary(self) -> Vocabulary:
        """This model's vocabulary as the grammar library walks it, built on first use (~1 s)."""
        with self._vocabulary_lock:
            if self._vocabulary is None:
                self._vocabulary = Vocabulary(self.tokenizer, self.model.config.vocab_size)
            return self._vocabulary

    def constraint(self, response_format: Mapping[str, Any]) -> Constraint | None:
        """A new request's grammar for OpenAI's response_format ({"type": "json_object"}, or
        {"type": "json_schema", "json_schema": {"schema": {...}, "strict": true}}); an invalid or
        uncompilable schema is a GrammarError naming it (requests/shape.py)."""
        return constraint_of(shape_of(None, None, None, response_format, chat=False), self.grammar_vocabulary(),
                             self.tool_syntax())

    def tool_syntax(self) -> Syntax:
        """How this model's chat template takes tools (tools.syntax_of renders a probe), found once."""
        if self._tool_syntax is None:
            self._tool_syntax = template_syntax(self.tokenizer)
        return self._tool_syntax

    def proposer_name(self, spec: SpecConfig | None = None) -> str | None:
        """The registered name of the proposer `spec` (None: this model's default) runs on this model,
        auto's pick spelled out; None for plain decoding."""
        spec = spec or self.spec
        return runs(spec.method, self, spec) if spec.enabled else None

    def proposer(self, prompt_ids: list[int], params: SamplingParams, spec: SpecConfig, cache_scope: str = ""
                 ) -> Proposer | None:
        if not spec.enabled:
            return None
        return PROPOSERS[spec.method].factory(ProposerContext(prompt_ids, params, spec, self, cache_scope))

    def prompt_ids(self, prompt: str | None = None, messages: Sequence[Message] | None = None,
                   tools: Tools | None = None, context: int | None = None, reasoning_effort: str | None = None
                   ) -> list[int]:
        """The prompt's tokens; chat messages as the server writes them (requests/prompt.py `text_of`:
        the tools where the reply may call them, earlier calls and tool results in the template's
        syntax, a harmony template's reasoning_effort). `context`: a prompt past it is refused
        (ContextTooLong) from a prefix, as the server does (`bounded`); None: the whole text is tokenized."""
        if (prompt is None) == (messages is None):
            raise RequestError("give exactly one of a prompt or chat messages", "prompt" if messages is None else None)
        if messages is None and reasoning_effort is not None:
            raise RequestError("reasoning_effort: a chat's (the template writes it); give messages, not a prompt",
                               "reasoning_effort")
        if messages is None and not isinstance(prompt, str):
            raise RequestError(f"prompt: expected a text, found {type(prompt).__name__} (generate() and stream() "
                               f"take token ids as they are)", "prompt")
        if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
            raise RequestError(f"context: expected a number of tokens >= 1, found {context!r}", "context")
        if tools is not None and not isinstance(tools, Tools):  # OpenAI's list, as generate() takes it
            tools = shape_of(tools, None, None, None, chat=messages is not None).tools
        text = prompt if messages is None else text_of(self.tokenizer, self.tool_syntax(), messages, tools,
                                                       reasoning_effort)
        if context is None:
            return self.tokenizer.encode(text, messages is None)
        param = "prompt" if messages is None else "messages"
        check_length(self.tokenizer, self.tokenizer.min_tokens(text), context,
                     self.model.config.context_note(context), param)
        return bounded(self.tokenizer, text, messages is None, context, param)

    def stream(self, prompt: str | Sequence[int] | None = None, messages: Sequence[Message] | None = None,
               params: SamplingParams | None = None, spec: SpecConfig | None = None,
               response_format: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
               tool_choice: str | Mapping[str, Any] | None = None,
               parallel_tool_calls: bool | None = None, reasoning_effort: str | None = None) -> Iterator[Chunk]:
        """Text chunks as tokens are committed; `prompt`: a text, or its token ids as they are (no
        chat template, no special tokens added); `spec` overrides the model's default speculation;
        `response_format` (OpenAI's: json_object or json_schema) constrains the text to JSON (its
        finish reason "stop" once the JSON is complete, "grammar_dead_end" where no token can go on).
        `tools`, `tool_choice`, `parallel_tool_calls`: OpenAI's (docs/tools.md), with chat messages;
        `reasoning_effort`: low, medium or high, a harmony (gpt-oss) chat's. A chunk's `text` is the
        model's (calls in its syntax, a harmony reply's channels with their markers); a chat's is read
        as it streams, as generate reads it whole: `content`, `reasoning` and `tool_calls` (the calls'
        pieces, each call's name on its first), the last chunk's finish reason "tool_calls" where
        the calls are whole."""
        params, spec = self._settings(params, spec)
        ids, constraint, chosen = self._prepared(prompt, messages, response_format, tools, tool_choice,
                                                 parallel_tool_calls, reasoning_effort)
        chunks = self._chunks(ids, params, spec, constraint, chosen, messages is not None)
        return read_stream(chunks, self.tool_syntax(), chosen, messages is not None)

    def _settings(self, params: SamplingParams | None, spec: SpecConfig | None) -> tuple[SamplingParams, SpecConfig]:
        """A request's sampling and speculation settings (None: the defaults, the model's speculation),
        each of its kind or refused by name."""
        if params is not None and not isinstance(params, SamplingParams):
            raise RequestError(f"params: expected a quickdraft.SamplingParams, found {type(params).__name__}", "params")
        return params or SamplingParams(), checked_spec(spec) or self.spec

    def _prepared(self, prompt: str | Sequence[int] | None, messages: Sequence[Message] | None,
                  response_format: Mapping[str, Any] | None, tools: Sequence[Mapping[str, Any]] | None,
                  tool_choice: str | Mapping[str, Any] | None, parallel_tool_calls: bool | None,
                  reasoning_effort: str | None) -> tuple[list[int], Constraint | None, Tools | None]:
        """(prompt ids, constraint, tools) of a request, through the steps the server takes
        (requests/): a RequestError names the field at fault."""
        shape = shape_of(tools, tool_choice, parallel_tool_calls, response_format, chat=messages is not None)
        # the grammar vocabulary (~1 s on first use) only where there is a grammar
        constraint = None if shape.free else constraint_of(shape, self.grammar_vocabulary(), self.tool_syntax())
        if prompt is None or isinstance(prompt, str):
            ids = self.prompt_ids(prompt, messages, shape.tools, self.engine_service().engine.max_seq_len,
                                  reasoning_effort)
        elif messages is not None or reasoning_effort is not None:
            raise RequestError("give exactly one of a prompt or chat messages (reasoning_effort is a chat's)",
                               "prompt" if messages is not None else "reasoning_effort")
        else:  # token ids, as score() and the server's completions take them (the engine checks the context)
            ids = given(prompt, self.model.config.vocab_size)
        return ids, constraint, shape.tools

    def _chunks(self, ids: list[int], params: SamplingParams, spec: SpecConfig, constraint: Constraint | None,
                tools: Tools | None, chat: bool) -> Iterator[Chunk]:
        syntax = self.tool_syntax()
        text = TextAssembler(self.tokenizer, params, keep=kept_markers(self.tokenizer, syntax, tools),
                             reasoning=reasoning_counter(syntax, tools, chat))
        with closing(self.engine_service().stream(*self.request(ids, params, spec, constraint))) as events:
            for event in events:
                if event.error is not None:
                    raise event.error
                chunk = text.feed(event)
                yield chunk
                if chunk.finish_reason is not None:
                    return

    def generate(self, prompt: str | Sequence[int] | None = None, messages: Sequence[Message] | None = None,
                 params: SamplingParams | None = None, spec: SpecConfig | None = None,
                 response_format: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                 tool_choice: str | Mapping[str, Any] | None = None,
                 parallel_tool_calls: bool | None = None, reasoning_effort: str | None = None) -> Completion:
        """The whole text; the arguments as stream()'s. A chat's reply is read as the server reads it
        (requests/reply.py): with tools, its calls (tool_calls, their arguments parsed); on a harmony
        model, its reasoning; the rest is its content; finish_reason "tool_calls" once the calls are
        whole."""
        params, spec = self._settings(params, spec)
        ids, constraint, chosen = self._prepared(prompt, messages, response_format, tools, tool_choice,
                                                 parallel_tool_calls, reasoning_effort)
        chunks = self._chunks(ids, params, spec, constraint, chosen, messages is not None)
        return completion(chunks, self.tool_syntax(), chosen, chat=messages is not None)


    def score(self, prompt: str | Sequence[int], top_logprobs: int = 0) -> Scored:
        """The prompt's tokens (a text tokenized as `generate` does) and each one's log-probability
        after those before it, with its `top_logprobs` (0-20) likeliest alternatives': the model's
        raw log-softmax at every prompt position (logprobs.py), as one forward over the whole prompt
        computes it. Nothing is generated. A prefix found in the prefix cache is not run again: its
        cached last-layer outputs only go through the head (bitwise a prefill's where the kernels
        are batch invariant, as on CPU)."""
        ids = self.prompt_ids(prompt) if isinstance(prompt, str) else given(prompt, self.model.config.vocab_size)
        params = SamplingParams(max_new_tokens=0, logprobs=top_logprobs)  # checks top_logprobs
        with closing(self.engine_service().stream(*self.request(ids, params, self.spec, None, top_logprobs))) as events:
            for event in events:  # one: the prompt's pass ends the request
                if event.error is not None:
                    raise event.error
        return Scored(ids, event.prompt_logprobs, event.stats)


def make_prefix_cache(model: Transformer, budget_mb: int | None) -> PrefixCache | None:
    """The model's prefix cache with a budget of `budget_mb` MiB (None: the default; 0: none)."""
    if budget_mb == 0:
        return None
    if budget_mb is not None and (isinstance(budget_mb, bool) or not isinstance(budget_mb, int) or budget_mb < 0):
        raise QuickdraftError(f"the prefix cache's budget must be a whole number of MiB >= 0, found {budget_mb!r}")
    try:
        return PrefixCache((budget_mb or default_budget_mb()) << 20, model.config, model.compute_dtype,
                           model.feature_width, pool=BlockPool(model.config, model.compute_dtype, model.device))
    except ValueError as e:
        raise QuickdraftError(f"{e}; give --prefix-cache-mb at least that, or --no-prefix-cache") from None


def load(model: str | Path | None = None, device: str | torch.device = "cpu",
         dtype: str | torch.dtype = "float32", progress: bool = False, spec: SpecConfig | None = None,
         dequantize: bool = False, quantize: str | None = None, activations: str | None = None,
         prefix_cache_mb: int | None = None) -> LLM:
    """Load a model by packaged name (default `smollm2-135m`), HF directory or GGUF file;
    `spec` sets its default speculative decoding (absent: SpecConfig(), prompt lookup as in the CLI;
    SpecConfig(method="none") decodes plainly). A quantized GGUF
    runs as stored unless `dequantize`; `quantize` ('int8', 'int4') quantizes float matrices;
    `activations` ('int16', 'int8') is the precision the integer kernel rounds activations to
    (default: the model's measured choice, weights/activations.py); `prefix_cache_mb`: the
    budget of the prefix cache its generations share (None: default_budget_mb(); 0: none)."""
    checked_spec(spec)  # before the weights load, as device and dtype are
    loaded = load_model(model, parse_device(device), parse_dtype(dtype), progress=progress,
                        dequantize=dequantize, quantize=quantize, activations=activations)
    if activations is not None and not loaded.model.quantized:  # asked for: not a silent no-op
        raise ModelLoadError(f"--activations {activations} applies to quantized matrices run by the integer kernel "
                             f"(a quantized GGUF as stored on CPU, or --quantize); {model} keeps none")
    return LLM(loaded, spec, prefix_cache_mb)
