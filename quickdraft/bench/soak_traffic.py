"""What the soak sends: the mix of request kinds, the well-formed requests (whose answers do not
depend on what runs beside them) and the malformed ones with the status each must get.
"""
from __future__ import annotations

import json
from typing import Any

# how often a client sends each kind (Soak._<kind> sends one)
WEIGHTS = {"valid": 0.35, "conversation": 0.1, "malformed": 0.15, "cancelled": 0.1, "oversized": 0.05,
           "slow_body": 0.08, "stalled": 0.07, "huge_prompt": 0.05, "flood": 0.05}
TURNS = ["Name three rivers.", "Which of them is the longest?", "Say it again in French."]
SYSTEMS = ["You are a terse geography tutor.", "You answer in one short sentence. " * 12]  # the fixed conversations'


def valid_requests(model: str) -> list[dict[str, Any]]:
    """(route, body): well-formed requests whose answer does not depend on what runs beside them."""
    chat = [{"role": "user", "content": "Count to five, then say why."}]
    prompts = ["The quick brown fox", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    out = []
    for i, prompt in enumerate(prompts):
        out.append({"route": "completions", "body": {"model": model, "prompt": prompt, "max_tokens": 24 + 8 * i,
                                                     "temperature": 0, "stream": i % 2 == 1}})
    out.append({"route": "chat/completions", "body": {"model": model, "messages": chat, "max_tokens": 32,
                                                      "temperature": 0, "stream": True}})
    out.append({"route": "chat/completions", "body": {"model": model, "messages": chat, "max_tokens": 32,
                                                      "temperature": 0.8, "seed": 7}})
    out.append({"route": "completions", "body": {"model": model, "prompt": prompts[1], "max_tokens": 40,
                                                 "temperature": 0, "speculative": {"method": "none"}}})
    return out


def malformed_requests(model: str) -> list[tuple[str, str, bytes, int]]:
    """(method, route, raw body, the status it must get)."""
    def body(fields: dict[str, Any]) -> bytes:
        return json.dumps({"model": model, "prompt": "hi", **fields}).encode()
    return [
        ("POST", "completions", b'{"model": "x", "prompt": ', 400),
        ("POST", "completions", b"[1, 2]", 400),
        ("POST", "completions", body({"max_tokens": "ten"}), 400),
        ("POST", "completions", body({"temperature": 7}), 400),
        ("POST", "completions", body({"n": 17}), 400),
        ("POST", "completions", body({"min_p": 1.5}), 400),
        ("POST", "completions", body({"stop": ["x" * 1025]}), 400),
        ("POST", "completions", body({"prompt": [1, 10**9]}), 400),
        ("POST", "completions", body({"max_tokens": 10**7}), 400),
        ("POST", "completions", body({"speculative": {"method": "magic"}}), 400),
        ("POST", "completions", json.dumps({"model": model, "prompt": "a\ud800"}).encode(), 400),
        ("POST", "completions", body({"model": "gpt-9"}), 404),
        ("POST", "chat/completions", json.dumps({"model": model, "messages": []}).encode(), 400),
        ("POST", "chat/completions", json.dumps({"model": model, "tools": [{"type": "function"}],
                                                 "messages": [{"role": "user", "content": "hi"}]}).encode(), 400),
        ("POST", "completions", b'{"model": "x", "prompt": "\xff"}', 400),
        ("DELETE", "completions", b"", 405),
    ]
