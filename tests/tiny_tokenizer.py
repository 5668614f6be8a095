"""A tiny byte-level BPE tokenizer and the files that carry it (HF directory, GGUF), made in the test.

Ids 0-2 are ChatML special tokens (as in SmolLM2), 3-258 the 256 byte-level symbols, then a few
merges, some of which end or start in the middle of a multi-byte UTF-8 character so streaming
detokenization sees split characters. Never downloads anything.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tiny_models import hf_model, save_hf_dir

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = "<|im_end|>"
EOS_ID = 2
VOCAB_SIZE = 300  # the tiny model's embedding rows; the tokenizer uses fewer

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def render_chatml(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """CHATML written out by hand: the oracle for what the template must produce."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def byte_symbols() -> list[str]:
    """GPT-2's byte -> printable-symbol table, indexed by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _sym(data: bytes) -> str:
    table = byte_symbols()
    return "".join(table[b] for b in data)


# (left, right) merges in priority order. Multi-byte ones split characters across tokens on purpose.
MERGES: tuple[tuple[str, str], ...] = (
    (_sym(b" "), _sym(b"t")), (_sym(b"h"), _sym(b"e")), (_sym(b" t"), _sym(b"he")),
    (_sym(b"l"), _sym(b"l")), (_sym(b"o"), _sym(b"r")), (_sym(b"i"), _sym(b"n")),
    (_sym(b"S"), _sym(b"T")), (_sym(b"ST"), _sym(b"O")),
    (_sym(b"\xc3"), _sym(b"\xa9")),          # "é" whole
    (_sym(b"\xe4"), _sym(b"\xb8")),          # first two bytes of "中"
    (_sym(b"\xad"), _sym(b"\xe6")),          # last byte of "中" + first byte of "文"
    (_sym(b"\xf0"), _sym(b"\x9f")),          # first two bytes of most emoji
    (_sym(b"\x98"), _sym(b"\x80")),          # last two bytes of "😀"
)


def build_tokenizer() -> Tokenizer:
    vocab = {s: i for i, s in enumerate(SPECIAL)}
    for s in byte_symbols():
        vocab[s] = len(vocab)
    for left, right in MERGES:
        vocab.setdefault(left + right, len(vocab))
    assert len(vocab) <= VOCAB_SIZE, len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    return tok


def save_tokenizer(path: Path, chat_template: str | None = CHATML) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None,
              "add_bos_token": False, "model_max_length": 1 << 20}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def tiny_model(name: str = "llama-gqa-untied", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random HF model whose vocabulary covers the tiny tokenizer, EOS = <|im_end|>.

    Weights ~N(0, 0.2) rather than transformers' 0.02: the logits then spread enough that greedy
    output varies from token to token (at 0.02 the tied Qwen2 model repeats one token forever).
    """
    return hf_model(name, seed=seed, **{"vocab_size": VOCAB_SIZE, "bos_token_id": 1, "eos_token_id": EOS_ID,
                                        "initializer_range": 0.2, **overrides})


def tiny_llm_dir(path: Path, name: str = "llama-gqa-untied", seed: int = 0, **overrides) -> Path:
    """config.json + model.safetensors + tokenizer files: what `quickdraft.load(path)` needs."""
    save_hf_dir(tiny_model(name, seed, **overrides), path)
    return save_tokenizer(path)


def write_llama_gguf(model: torch.nn.Module, path: Path, arch: str | None = None, tokenizer: bool = True,
                     qtype=None, window: int | None = None, expert_qtype=None) -> Path:
    """A GGUF (float32, or `qtype` blocks) of a tiny HF model with (by default) the tiny tokenizer in
    its metadata; `arch`: the family's (Mistral: "llama") unless given."""
    from gguf_writer import write_gguf

    vocab_size = model.config.vocab_size
    write_gguf(model, path, arch=arch, qtype=qtype, window=window, expert_qtype=expert_qtype,
               metadata=(lambda w: _add_tokenizer(w, vocab_size)) if tokenizer else None)
    return path


def _add_tokenizer(w, vocab_size: int) -> None:
    tok = json.loads(build_tokenizer().to_str())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)




def both_formats(name: str, root: Path, window: int | None = None) -> tuple[Path, Path]:
    """A tiny model as a safetensors directory with the tiny tokenizer, and as a float32 GGUF
    written as llama.cpp's converter writes it (`window`: its sliding window)."""
    hf = tiny_model(name)
    return save_tokenizer(save_hf_dir(hf, root / "hf")), write_llama_gguf(hf, root / "model.gguf", window=window)


def assert_plain_and_speculative(llm, path: Path, prompt: str, n: int, expected: list[int]) -> None:
    """n greedy tokens of `prompt` are `expected` plain and under speculation: prompt lookup as a
    chain and as a tree, and the model at `path` as its own draft (every draft accepted)."""
    from quickdraft import SamplingParams
    from quickdraft.proposers import SpecConfig

    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    assert len(set(expected)) > 3  # a model repeating one token would prove little
    assert llm.generate(prompt, params=params).token_ids == expected
    for spec in (SpecConfig("ngram", k=4, adaptive=False), SpecConfig("ngram-tree", k=6, adaptive=False),
                 SpecConfig("draft", k=4, draft_model=str(path), adaptive=False)):
        out = llm.generate(prompt, params=params, spec=spec)
        assert out.token_ids == expected, spec.method
        if spec.method == "draft":  # the target as its own draft: speculation really ran
            assert out.stats.accepted_tokens >= n // 2


def assert_every_proposer(llm, path: Path, prompt: str, n: int, expected: list[int]) -> None:
    """n greedy tokens of `prompt` are `expected` under every registered proposer that needs no
    trained head or datastore (those drafting with a model take the one at `path`, the target itself)."""
    from quickdraft import SamplingParams
    from quickdraft.proposers import PROPOSERS, SpecConfig

    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    methods = sorted(m for m, p in PROPOSERS.items() if p.loads not in ("head", "datastore"))  # test_datastore.py
    assert {"ngram", "ngram-tree", "recycle", "lookup-recycle", "suffix", "draft", "draft-tree",
            "lookup-draft"} <= set(methods)
    for method in methods:
        spec = SpecConfig(method, k=4, adaptive=False,
                          draft_model=str(path) if PROPOSERS[method].loads == "draft_model" else None)
        assert llm.generate(prompt, params=params, spec=spec).token_ids == expected, method
