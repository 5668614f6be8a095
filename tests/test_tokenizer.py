"""Tokenizer wrapper, StreamDetokenizer and StopStringFilter on a tiny byte-level BPE (made here).

Oracles: decode() of all ids at once for the streaming detokenizer, and str.find on the whole
text for the stop-string filter.
"""
from __future__ import annotations

import random
import time

import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.model.tokenizer import StopStringFilter, StreamDetokenizer, Tokenizer
from quickdraft.weights.tokenizers import load_hf_tokenizer
from tiny_tokenizer import EOS_ID, SPECIAL, build_tokenizer, render_chatml, save_tokenizer

MULTIBYTE_TEXTS = [
    "héllo wörld, naïve café",
    "中文 and 日本語の文章",
    "emoji 😀👍🏽 then 🎉 done",
    "mixed: the 中文😀é “quotes” — dash",
    "😀",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_hf_tokenizer(save_tokenizer(tmp_path_factory.mktemp("tok")))


def stream(tok: Tokenizer, ids: list[int], sizes: list[int] | None = None) -> list[str]:
    """Deltas from pushing ids in pieces of the given sizes (1 each by default), then flush."""
    detok, deltas, i = StreamDetokenizer(tok), [], 0
    for size in sizes or [1] * len(ids):
        deltas.append(detok.push(ids[i:i + size]))
        i += size
    assert i == len(ids)
    deltas.append(detok.flush())
    return deltas


# -- the wrapper ---------------------------------------------------------------------------------

def test_wrapper_round_trips_and_agrees_with_the_raw_tokenizer(tok: Tokenizer) -> None:
    raw = build_tokenizer()
    for text in MULTIBYTE_TEXTS:
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids  # no BOS added: the config says add_bos_token false
        assert tok.decode(ids) == text
    assert tok.eos_token_ids == frozenset({EOS_ID})
    assert tok.token_strings()[:3] == list(SPECIAL)


def test_lone_surrogates_are_a_clear_error(tok: Tokenizer) -> None:
    """Issue 16 item 6: JSON can carry "\\ud800"; the raw tokenizer raised a bare TypeError."""
    with pytest.raises(QuickdraftError, match=r"the prompt: found the lone surrogate '\\ud800' at character 1"):
        tok.encode("a\ud800b")
    with pytest.raises(QuickdraftError, match=r"'user' message: found the lone surrogate '\\udc00' at character 0"):
        tok.apply_chat_template([{"role": "system", "content": "ok"}, {"role": "user", "content": "\udc00"}])
    assert tok.decode(tok.encode("a\U0001F600b")) == "a😀b"  # a surrogate pair in JSON is one valid character


def test_chat_template_renders_chatml(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hé 😀"}]
    expected = build_tokenizer().encode(render_chatml(messages)).ids
    assert tok.apply_chat_template(messages) == expected
    assert expected.count(1) == 3 and expected.count(EOS_ID) == 2  # <|im_start|> x3, <|im_end|> x2
    no_prompt = build_tokenizer().encode(render_chatml(messages, add_generation_prompt=False)).ids
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == no_prompt


# -- StreamDetokenizer ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_stream_one_token_at_a_time_equals_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    # The test is only worth something if some token boundary falls inside a character.
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas), deltas
    assert deltas[-1] == ""  # nothing was left to flush: every character was complete


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_stream_never_emits_text_it_would_take_back(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok, emitted = StreamDetokenizer(tok), ""
    for i in range(len(ids)):
        emitted += detok.push([ids[i]])
        so_far = tok.decode(ids[:i + 1])
        assert so_far.startswith(emitted) and "\ufffd" not in emitted
        if not so_far.endswith("\ufffd"):  # at a character boundary everything is out
            assert emitted == so_far, (i, emitted, so_far)


def test_stream_in_chunks_of_several_tokens(tok: Tokenizer) -> None:
    # Speculative decoding commits several tokens per step.
    text = " ".join(MULTIBYTE_TEXTS)
    ids = tok.encode(text)
    rng = random.Random(0)
    for _ in range(20):
        sizes, left = [], len(ids)
        while left:
            sizes.append(min(left, rng.randint(0, 5)))  # 0: a step that committed nothing
            left -= sizes[-1]
        deltas = stream(tok, ids, sizes)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_stream_skips_special_tokens_like_decode(tok: Tokenizer) -> None:
    ids = tok.encode("a😀") + [EOS_ID, 1] + tok.encode("中b")
    assert "".join(stream(tok, ids)) == tok.decode(ids) == "a😀中b"


def test_stream_of_random_ids_equals_decode(tok: Tokenizer) -> None:
    # Random models emit arbitrary byte sequences (invalid UTF-8 included): the concatenated
    # stream must still be exactly what decode() gives for all the ids.
    rng = random.Random(1)
    for trial in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 25))]
        sizes = None  # even trials: one id per push; odd trials: several per push
        if trial % 2:
            sizes, left = [], len(ids)
            while left:
                sizes.append(min(left, rng.randint(1, 4)))
                left -= sizes[-1]
        assert "".join(stream(tok, ids, sizes)) == tok.decode(ids), ids


def test_flush_emits_an_incomplete_character_as_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("ok😀")
    detok = StreamDetokenizer(tok)
    out = "".join(detok.push([i]) for i in ids[:-1])  # the emoji's last token is missing
    assert out == "ok"
    assert detok.flush() == tok.decode(ids[:-1])[2:] and "\ufffd" in tok.decode(ids[:-1])


# -- StopStringFilter -----------------------------------------------------------------------------

def run_filter(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    """(all emitted text, whether a stop was found, the per-feed outputs)."""
    f, outs = StopStringFilter(stops), []
    for d in deltas:
        text, stopped = f.feed(d)
        outs.append(text)
        if stopped:
            return "".join(outs), True, outs
    outs.append(f.flush())
    return "".join(outs), False, outs


def expected_cut(stops: list[str], text: str) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def test_stop_split_across_deltas() -> None:
    emitted, stopped, outs = run_filter(["STOP"], ["Hello ST", "O", "P and more"])
    assert (emitted, stopped) == ("Hello ", True)
    assert outs == ["Hello ", "", ""]  # "ST" and "STO" were held back, never emitted


def test_stop_at_the_very_start() -> None:
    assert run_filter(["STOP"], ["STOP here"])[:2] == ("", True)
    assert run_filter(["STOP"], ["S", "TOP"])[:2] == ("", True)


def test_partial_match_that_is_not_a_stop_is_released() -> None:
    emitted, stopped, outs = run_filter(["STOP"], ["abc ST", "ART", " end"])
    assert (emitted, stopped) == ("abc START end", False)
    assert outs[0] == "abc " and outs[1] == "START"
    # A partial match still held when the stream ends comes out of flush().
    emitted, stopped, outs = run_filter(["STOP"], ["abc STO"])
    assert (emitted, stopped, outs) == ("abc STO", False, ["abc ", "STO"])


def test_multiple_stop_strings_earliest_position_wins() -> None:
    # List order does not matter: the stop that starts first in the text wins.
    assert run_filter(["world", "lo"], ["hello world"])[:2] == ("hel", True)
    assert run_filter(["zzz", "b"], ["ab", "zzz"])[:2] == ("a", True)
    assert run_filter(["b", "zzz"], ["azz", "zb"])[:2] == ("a", True)  # "zzz" starts before "b"
    # The longer held tail of two candidates is the one kept back.
    emitted, stopped, outs = run_filter(["xyz", "yzw"], ["ab xy", "z!"])
    assert (emitted, stopped, outs[0]) == ("ab ", True, "ab ")


def test_overlapping_partial_matches() -> None:
    assert run_filter(["abc"], ["xab", "ab", "c tail"])[:2] == ("xab", True)
    assert run_filter(["aab"], ["a", "a", "a", "b"])[:2] == ("a", True)


def test_filter_matches_str_find_on_random_splits() -> None:
    rng = random.Random(2)
    alphabet = "abSTOP😀 "
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = rng.sample(["STOP", "ab", "😀a", "OPS", "bbb"], rng.randint(1, 3))
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 6)))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        emitted, stopped, _ = run_filter(stops, deltas)
        assert (emitted, stopped) == expected_cut(stops, text), (stops, deltas)


def test_no_stops_passes_text_through() -> None:
    f = StopStringFilter([])
    assert f.feed("abc") == ("abc", False) and f.feed("") == ("", False) and f.flush() == ""


def test_long_stop_strings_cost_linear_time() -> None:
    """Issue 16 item 3: 16 stop strings of 1024 characters fed one character at a time. Matching
    that re-tests every prefix of every stop at each feed took ~10 ms a feed here (~50 s for
    this test); the incremental matcher takes well under a second."""
    stops = ["a" * 1023 + str(i % 10) for i in range(16)]
    f, start = StopStringFilter(stops), time.perf_counter()
    emitted = "".join(f.feed("a")[0] for _ in range(5000))
    assert emitted == "a" * (5000 - 1023) and f.pending == "a" * 1023  # the longest possible start held
    assert f.feed("7") == ("", True)  # the held tail was the start of the stop "a..a7"
    assert time.perf_counter() - start < 3


# -- rebuilt from GGUF metadata --------------------------------------------------------------------

def gguf_metadata(**extra) -> dict:
    """The tiny tokenizer as a GGUF file's metadata reads (read_metadata's dict)."""
    import json

    from tiny_tokenizer import MERGES
    vocab = json.loads(build_tokenizer().to_str())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    return {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t in SPECIAL else 1 for t in tokens],
            "tokenizer.ggml.merges": [f"{a} {b}" for a, b in MERGES], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": EOS_ID, **extra}


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_gguf_add_bos_token_is_the_files_word(add_bos: bool | None) -> None:
    """Gemma's GGUFs say add_bos_token true and llama.cpp prepends <bos>: without it Gemma 3 270M
    greedy-decoded " France. The The The ..." (transformers' rebuilt backend adds none by default).
    False or absent: no BOS, as llama.cpp's BPE vocabularies."""
    from quickdraft.weights.tokenizers import gguf_tokenizer

    extra = {} if add_bos is None else {"tokenizer.ggml.add_bos_token": add_bos}
    tok = gguf_tokenizer(gguf_metadata(**extra))
    text = "héllo wörld"
    body = build_tokenizer().encode(text).ids
    assert tok.encode(text) == ([1] + body if add_bos else body)
    assert tok.encode(text, add_special_tokens=False) == body
