"""The default (real) model's chats and speculation prompts (test_real_model's)."""
from __future__ import annotations


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


SPEC_PROMPTS = [
    "Fix the spelling in this sentence and return it only: The quick brown fox jumpd over the lazy dogg.",
    "Write a haiku about the sea.",
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
]
