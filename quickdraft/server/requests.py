"""A generation request on its way to the engine, the server's way through the one request pipeline
(requests/): every check a request can fail (the model named, its choices, its speculation, its
response format or tools, its prompt and token budgets against the context, its logit bias) as a
400 naming the field, before anything reaches the batch; then its engine requests, one per choice.
Plain functions of the shared state (state.Served) and the body, which every route uses; a
RequestError from the pipeline's steps is answered by server/errors.py with its param and code;
`chat_prompt` is also how the cluster's front names a chat's prefixes; the ids it made ride to the
replica in the call's scope (`PROMPT_IDS`), so the replica renders and tokenizes nothing again.
Knows the engine's request and the model's limits, not the engine's loop or HTTP answers.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

from fastapi import Request as HTTPRequest

from quickdraft.engine.batch import Request, check_context
from quickdraft.engine.service import MakeProposer
from quickdraft.errors import ContextTooLong, QuickdraftError, RequestError
from quickdraft.proposers import PROPOSERS, SpecConfig, SpecConfigError
from quickdraft.requests.prompt import check_length, given
from quickdraft.requests.shape import FORMAT_CODE, Shape, constraint_of, shape_of
from quickdraft.server.choices import logprobs_asked, prompt_logprobs_asked, seeds
from quickdraft.server.errors import BadRequest
from quickdraft.server.guards import ADMIT, TENANT
from quickdraft.server.prompts import Prompts
from quickdraft.server.schemas import SPEC_FIELDS, ChatCompletionRequest, NamedToolChoice, _Common
from quickdraft.server.state import Served
from quickdraft.spec.sampling import SamplingParams
from quickdraft.structured.grammar import Constraint
from quickdraft.structured.tools import Tools, ToolsError

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context
CONTEXT = "context_length_exceeded"
REQUEST_TOKENS = "request_tokens_exceeded"  # n x max_tokens past --max-request-tokens
GRAMMAR_TIMEOUT_S = 10.0  # a response_format's schema compiled for longer is a 400 (other requests go on meanwhile)

# scope key: a prompt's ids as a cluster's front rendered and tokenized them (cluster/asgi.py puts them
# in the scope of the call it hands a replica's app; no HTTP request can set a scope key)
PROMPT_IDS = "quickdraft.prompt_ids"

Budget = dict[str, int | None]  # the body's fields that bound the new tokens, by name: the first one given decides
Made = list[tuple[Request, MakeProposer]]  # per choice, its engine request and the call that builds its proposer


def check_model(served: Served, body: _Common, prompts: int = 1) -> None:
    """Before any work on the prompt: a request for another model costs nothing, nor one for
    more choices than the server ever holds (each choice takes a place, Admission; n for each
    of `prompts`, a batch's)."""
    name = served.config.model_name
    if body.model != name:
        raise BadRequest(404, f"model {body.model!r} is not served here; this server serves {name!r}", "model",
                         "model_not_found")
    if body.n * prompts > served.places:
        asks = f"n asks for {body.n} choices" if prompts == 1 else \
            f"prompt holds {prompts} prompts of n = {body.n} choices, {body.n * prompts} choices"
        raise BadRequest(400, f"{asks}, each a request of its own, but this server holds {served.places} requests "
                              f"at once (--max-batch + --max-waiting); expected at most {served.places}",
                         "n" if prompts == 1 else "prompt")


def spec_of(served: Served, body: _Common) -> SpecConfig:
    """The request's speculation over the server's, checked (before any work on its prompt)."""
    spec = served.config.spec
    if body.speculative is not None:
        chosen = body.speculative.model_dump(exclude_none=True)
        own = {name: value for name, value in chosen.items() if name in SPEC_FIELDS}
        options = {name: value for name, value in chosen.items() if name not in SPEC_FIELDS}
        try:  # SpecConfig validates (unknown method, k range, no draft, the proposer's option values)
            spec = replace(spec, **own, options={**spec.options, **options})
        except SpecConfigError as e:
            raise BadRequest(400, str(e), "speculative", "invalid_speculation") from None
    if problem := unusable(served, spec):
        raise BadRequest(400, problem, "speculative", "invalid_speculation")
    return spec


def unusable(served: Served, spec: SpecConfig) -> str | None:
    """Why this server cannot run `spec`, or None: what it can run depends on the models it has."""
    if spec.needs_head and served.head_error:
        return served.head_error
    if spec.needs_datastore and served.datastore_error:
        return served.datastore_error
    try:
        if spec.needs_draft_model:
            served.llm.draft_name(spec.draft_model)  # loads nothing; an error names the missing flag
    except SpecConfigError as e:
        return str(e)
    return None


def methods(served: Served) -> list[str]:
    """The speculation methods a request may name here (the published schema, the playground)."""
    default = served.config.spec
    return [method for method in ["none", *sorted(PROPOSERS)]
            if unusable(served, replace(default, method=method, k=max(default.k, 1))) is None]


def shape(body: _Common) -> Shape:
    """The request's tools (a chat's) and response format, checked (requests/shape.py)."""
    fmt = body.response_format.constrains() if body.response_format is not None else None
    if not isinstance(body, ChatCompletionRequest):
        return shape_of(None, None, None, fmt, chat=False)
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
    return shape_of([tool.model_dump(exclude_none=True) for tool in body.tools or ()], choice,
                    body.parallel_tool_calls, fmt, chat=True)


async def constraints(served: Served, shape: Shape, n: int) -> list[Constraint | None]:
    """The reply's grammar (requests/shape.py `constraint_of`), compiled off the event loop within
    GRAMMAR_TIMEOUT_S: one per choice (each follows its own text); Nones without one."""
    if shape.free:
        return [None] * n
    llm = served.llm
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(served.grammars, llm.grammar_vocabulary)  # once per model (~1 s), not the schema's
    try:
        return [await asyncio.wait_for(loop.run_in_executor(
            served.grammars, constraint_of, shape, llm.grammar_vocabulary(), served.prompts.syntax), GRAMMAR_TIMEOUT_S)
            for _ in range(n)]
    except TimeoutError:
        param, code = ("tools", ToolsError.code) if shape.tools is not None else ("response_format", FORMAT_CODE)
        raise RequestError(f"the schema did not compile within {GRAMMAR_TIMEOUT_S:g} s; give a simpler one",
                           param, code) from None


async def chat_prompt(prompts: Prompts, body: ChatCompletionRequest, tools: Tools | None) -> str:
    """A chat's prompt text: its messages, tools and reasoning effort as the model's chat template takes
    them. The one rendering of a chat, so the cluster's front names the prefixes of the prompt a replica
    runs."""
    return await prompts.chat_text(body.chat(), tools, body.reasoning_effort)


async def tokenized(served: Served, text: str, budget: Budget, param: str, http: HTTPRequest,
                    add_special_tokens: bool, n: int) -> list[int]:
    """The text's token ids: refused first if its length alone says it cannot fit, then n places
    in the queue (n choices), then the tokenizer (off the event loop, a few at a time; stopped once
    a prefix is past the context)."""
    prompts = served.prompts
    try:
        fits(served, await prompts.min_tokens(text), budget, param, at_least=True)
        check_request_tokens(served, budget, n)
        http.scope[ADMIT](n)
        return await prompts.encode(text, add_special_tokens, served.context)
    except BadRequest:
        raise
    except QuickdraftError as e:  # ContextTooLong from a prefix (requests/prompt.py `bounded`)
        raise BadRequest(400, str(e), param, e.code if isinstance(e, RequestError) else None) from None
    finally:
        prompts.done_with(text)


def given_ids(served: Served, ids: list[int], budget: Budget, http: HTTPRequest, n: int,
              param: str = "prompt") -> list[int]:
    """A prompt given as token ids: it fits, each is in the vocabulary; then n places in the queue."""
    fits(served, len(ids), budget, param)
    check_request_tokens(served, budget, n)
    ids = given(ids, served.llm.model.config.vocab_size, param)
    http.scope[ADMIT](n)
    return ids


def forwarded_ids(served: Served, budget: Budget, http: HTTPRequest, n: int, param: str) -> list[int] | None:
    """The prompt's ids where a cluster's front made them (PROMPT_IDS, taken once: a route's one
    text prompt), checked as given ids; None where it did not (one process, or a request the front
    could not tokenize within the context: the replica's own refusal then says why)."""
    ids = http.scope.pop(PROMPT_IDS, None)
    return None if ids is None else given_ids(served, list(ids), budget, http, n, param)


def fits(served: Served, n: int, budget: Budget, param: str, at_least: bool = False) -> None:
    """A prompt of n tokens (at least n: known from its length alone) and each budget field fit
    the context, or a 400; the message says why the context ends there where the model's RoPE
    is why (ModelConfig.context_note), as the Python API's does."""
    limit = served.context
    note = served.llm.model.config.context_note(limit)
    try:
        if at_least:
            check_length(served.prompts.tokenizer, n, limit, note, param)
        else:
            check_context(n, limit, note)
    except ContextTooLong as e:
        raise BadRequest(400, str(e), param, CONTEXT) from None
    has = f"at least {n}" if at_least else f"{n}"
    for field, wanted in budget.items():
        if wanted is not None and n + wanted > limit:
            raise BadRequest(400, f"the prompt has {has} tokens and {field} asks for {wanted} more, but the context "
                                  f"holds {limit}{note}; expected at most {limit - n} new tokens", field, CONTEXT)


def check_request_tokens(served: Served, budget: Budget, choices: int, prompt: int | None = None) -> None:
    """A request's new tokens over its `choices` (n, or n per prompt of a batch) within
    --max-request-tokens, or a 400 naming the field that sets them: choices x max_tokens, known
    before the prompt is tokenized; where no field is given (a chat runs to the context), choices x
    the context's rest once the prompt's `prompt` tokens are known (None: not yet)."""
    bound = served.config.request_tokens(served.context)
    field, wanted = next(((field, wanted) for field, wanted in budget.items() if wanted is not None), (None, None))
    unset = wanted is None
    if unset:
        if prompt is None or not budget:  # not known yet; or no budget at all, not a generation (count_tokens)
            return
        field, wanted = next(iter(budget)), served.context - prompt
    if choices * wanted <= bound:
        return
    each = f"is unset, so each runs to the context's end, {wanted}" if unset else f"asks for {wanted}"
    raise BadRequest(400, f"{field}: {each} new tokens for each of {choices} choices, {choices * wanted} in all, "
                          f"but this server generates at most {bound} for one request (--max-request-tokens); "
                          f"expected at most {bound // choices} each for {choices} choices, or fewer choices (n)",
                     field, REQUEST_TOKENS)


def cache_scope(http: HTTPRequest, body: _Common) -> str:
    """The prefix-cache scope of a request (prefix_cache.py): its API key's tenant (guards.ApiKey), narrowed
    by the request's cache_salt (vLLM's name) and prompt_cache_key (OpenAI's); "" with none of them, the
    scope every such request shares."""
    parts = [http.scope.get(TENANT, ""), body.cache_salt or "", getattr(body, "prompt_cache_key", None) or ""]
    return json.dumps(parts) if any(parts) else ""


def prepare(served: Served, body: _Common, spec: SpecConfig, constraints: list[Constraint | None],
            ids: list[int], budget: Budget, scope: str = "") -> tuple[Made, SamplingParams]:
    """Per choice, its engine request and the call that builds its proposer; and the sampling
    settings they share but for their seeds. scope: the prefix-cache scope (cache_scope)."""
    llm, limit = served.llm, served.context
    fits(served, len(ids), budget, "messages" if isinstance(body, ChatCompletionRequest) else "prompt")
    check_request_tokens(served, budget, body.n, len(ids))
    max_tokens = next((wanted for wanted in budget.values() if wanted is not None), None)
    bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
    vocab = llm.model.config.vocab_size
    if any(token >= vocab for token in bias):
        raise BadRequest(400, f"logit_bias names token {max(bias)}; token ids are 0..{vocab - 1}", "logit_bias")
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                            seed=body.seed, max_new_tokens=limit - len(ids) if max_tokens is None else max_tokens,
                            stop=tuple(body.stop or ()),
                            logit_bias=bias, presence_penalty=body.presence_penalty or 0.0,
                            frequency_penalty=body.frequency_penalty or 0.0, logprobs=logprobs_asked(body))
    return [llm.request(ids, replace(params, seed=seed), spec, constraint, prompt_logprobs_asked(body), scope)
            for seed, constraint in zip(seeds(params.seed, body.n), constraints)], params
