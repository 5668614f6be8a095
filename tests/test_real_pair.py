"""The real draft/target pair: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) verifying drafts from its
packaged sibling Qwen2.5-Coder-0.5B-Instruct, both by their packaged names (the chunk packages
that scripts/install.sh installs). Slow: run with `pytest -m slow`.

Oracle: plain greedy decoding of the same target in the same engine; `--spec draft` and
`--spec draft-tree` must give the same tokens, token for token, on a chat coding prompt, a chat
prose prompt and a HumanEval development prompt continued as raw text (problems 0-81 only).
"""
from __future__ import annotations

import json

import pytest

import quickdraft
from quickdraft import SamplingParams
from quickdraft.bench.questions import load_humaneval
from quickdraft.cli import main
from quickdraft.proposers import SpecConfig
from quickdraft.proposers.draft_model import DraftOptions
from quickdraft.proposers.drafter import Drafter

pytestmark = pytest.mark.slow

N = 32
CHATS = ["Write a Python function that returns the n-th Fibonacci number iteratively.",
         "Explain in two sentences what a hash table is."]


@pytest.fixture(scope="module")
def llm() -> quickdraft.LLM:
    # no --draft-model: the target's packaged draft, loaded now
    return quickdraft.load("qwen2.5-coder-1.5b", spec=SpecConfig("draft", k=8))


def test_the_packaged_draft_is_the_0_5b(llm: quickdraft.LLM) -> None:
    draft = llm.draft_model()
    assert llm.loaded.source.name == "qwen2.5-coder-1.5b" and draft.loaded.source.name == "qwen2.5-coder-0.5b"
    assert draft.model.config.vocab_size == llm.model.config.vocab_size == 151936
    assert draft.model.config.hidden_size < llm.model.config.hidden_size


@pytest.mark.parametrize("method", ["draft", "draft-tree"])
def test_greedy_draft_decoding_equals_plain(llm: quickdraft.LLM, method: str) -> None:
    params = SamplingParams(max_new_tokens=N)
    # whole drafts every step (adaptive off): on a CPU where the draft cannot pay, the cost rule
    # would otherwise stop drafting after its first measurement, and nothing would be tested
    spec = SpecConfig(method, k=8, adaptive=False)
    prompts = [{"messages": [{"role": "user", "content": c}]} for c in CHATS]
    prompts.append({"prompt": load_humaneval("dev")[2].turns[0]})
    accepted = 0
    for prompt in prompts:
        plain = llm.generate(**prompt, params=params, spec=SpecConfig(method="none"))
        out = llm.generate(**prompt, params=params, spec=spec)
        assert out.token_ids == plain.token_ids, prompt
        assert len(plain.token_ids) > 8 and plain.stats.drafted_tokens == 0
        assert out.stats.drafted_at[0] >= out.stats.target_passes - 2  # drafted at every step
        accepted += out.stats.accepted_tokens
    assert accepted > 2 * len(prompts) * N // 3  # the pair agrees often (73% on a coding prompt when measured)
    # the premise: the draft proposed over its default reduced vocabulary (draft_vocab.py)
    drafter = llm.shared((Drafter, llm.draft_model().model, DraftOptions().draft_vocab), lambda: None)
    assert drafter is not None and 65536 <= len(drafter.head.vocab) < 151936


def test_generate_command_compare(capsys) -> None:
    assert main(["generate", "-m", "qwen2.5-coder-1.5b", "--spec", "draft", "-k", "4", "-n", str(N), "--compare",
                 "--json", "--chat", "Write a Python function that checks whether a string is a palindrome."]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["identical"] is True and res["speculative"]["stats"]["drafted_tokens"] > 0
    assert res["plain"]["token_ids"] == res["speculative"]["token_ids"]
