"""Schemathesis hooks for test_server_hardening's run against the live server (SCHEMATHESIS_HOOKS).

The documented exceptions to "a request the published schema allows is accepted": the schema
bounds max_tokens by the context, but cannot say that the prompt's tokens and max_tokens together
must fit it, so such a request is a 400 with code context_length_exceeded (as OpenAI answers); and
it bounds each proposer option, but cannot say that ngram_min may not exceed ngram_max (or its
default), a 400 with code invalid_speculation that says so; nor which JSON schemas in
response_format the grammar library compiles, a 400 with code invalid_response_format; nor which
tools' parameters it compiles, that tool_choice names one of the tools and that tools are named
once, a 400 with code invalid_tools; nor that a batch of prompts times n must fit the server's
places (each is bounded by them alone), a 400 naming prompt; nor that an Anthropic conversation may
not end with the assistant's turn (prefill, code prefill_not_supported); nor that n times max_tokens
must fit the per-request token budget (each is bounded alone; code request_tokens_exceeded); nor
which models take a reasoning effort (gpt-oss's harmony template; others: code unsupported_parameter,
as OpenAI answers). A body the schema refuses
but over the size limit is a 413 before it is read (ST201 expects the 400 of a refused body).
"""
from __future__ import annotations

import schemathesis


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    """Keep every failure but the documented refusals of schema-valid requests."""
    if failure.code == "ST201" and response.status_code == 413:
        return False
    if failure.code != "ST202" or response.status_code != 400:
        return True
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return True
    message = response.json()["error"].get("message", "")
    return not (code in ("context_length_exceeded", "invalid_response_format", "invalid_tools",
                         "prefill_not_supported", "request_tokens_exceeded") or
                (code == "unsupported_parameter" and "reasoning effort" in message) or
                (code == "invalid_speculation" and "ngram_min <= ngram_max" in message) or
                (response.json()["error"].get("param") == "prompt" and "each a request of its own" in message))
