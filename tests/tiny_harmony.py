"""A tiny tokenizer that speaks gpt-oss's harmony format, and the tiny gpt-oss model that goes with it.

The tiny byte-level tokenizer (tiny_tokenizer.py) with harmony's special tokens added (<|endoftext|>
is already its id 0), <|return|> its end of sequence as in gpt-oss's tokenizer_config.json, and a
chat template written for these tests from the harmony format's rules (transformers ships none
offline): the system message with the reasoning effort, the developer message with the instructions
and the functions as a TypeScript namespace, earlier answers on the final channel, an earlier call
with the recipient in its header and its analysis before it (unless a later answer follows, as
gpt-oss's template drops it), a tool's result from functions.NAME, and the generation prompt
`<|start|>assistant`. Like gpt-oss's template it refuses a call message with both content and thinking.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from quickdraft.model.tokenizer import Tokenizer
from tiny_models import save_hf_dir
from tiny_tokenizer import MERGES, VOCAB_SIZE, build_tokenizer, tiny_model

HARMONY_SPECIAL = ("<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                   "<|message|>", "<|call|>")

_TYPES = "{%- set types = {'string': 'string', 'integer': 'number', 'number': 'number', 'boolean': 'boolean'} %}"
HARMONY_TEMPLATE = (
    _TYPES +
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: {{ reasoning_effort if reasoning_effort is defined else 'medium' }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools %}{{ '\\n' }}Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>"
    "{%- if messages[0].role in ('system', 'developer') %}{% set instructions = messages[0].content %}"
    "{% set turns = messages[1:] %}{% else %}{% set instructions = '' %}{% set turns = messages %}{% endif %}"
    "{%- if instructions or tools %}<|start|>developer<|message|>"
    "{%- if instructions %}# Instructions\n\n{{ instructions }}\n\n{% endif %}"
    "{%- if tools %}# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{% for tool in tools %}{% set f = tool.function %}{% if f.description %}// {{ f.description }}\n{% endif %}"
    "type {{ f.name }} = (_: {\n"
    "{% for name, spec in (f.parameters.properties or {}).items() %}{{ name }}"
    "{%- if name not in (f.parameters.required or []) %}?{% endif %}: {{ types.get(spec.type, 'any') }},\n"
    "{% endfor %}}) => any;\n\n{% endfor %}} // namespace functions{% endif %}<|end|>{% endif %}"
    "{%- set last = namespace(name=none) %}"
    "{%- for m in turns %}"
    "{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and 'tool_calls' in m %}"
    "{%- if m.content and m.thinking %}{{ raise_exception('Cannot pass both content and thinking') }}{% endif %}"
    "{%- set later = namespace(final=false) %}"
    "{%- for n in turns[loop.index:] %}{% if n.role == 'assistant' and 'tool_calls' not in n %}"
    "{% set later.final = true %}{% endif %}{% endfor %}"
    "{%- if (m.thinking or m.content) and not later.final %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking or m.content }}<|end|>{% endif %}"
    "{%- set call = m.tool_calls[0].function %}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>"
    "{{ call.arguments | tojson }}<|call|>{% set last.name = call.name %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")


def harmony_raw():
    raw = build_tokenizer()
    raw.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in HARMONY_SPECIAL])
    assert raw.get_vocab_size() <= VOCAB_SIZE
    return raw


CONFIG = dict(eos_token="<|return|>", bos_token="<|startoftext|>", pad_token="<|endoftext|>",
              chat_template=HARMONY_TEMPLATE)


def harmony_tokenizer(extra_eos: tuple[int, ...] = ()) -> Tokenizer:
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=harmony_raw(), **CONFIG), extra_eos)


def token(text: str) -> int:
    """A harmony special token's id in the tiny tokenizer."""
    return harmony_raw().token_to_id(text)


def tiny_gpt_oss(seed: int = 0):
    return tiny_model("gptoss", seed, eos_token_id=token("<|return|>"), bos_token_id=token("<|startoftext|>"),
                      max_position_embeddings=4096)


def harmony_llm_dir(path: Path, seed: int = 0) -> Path:
    """A tiny random gpt-oss checkpoint with the harmony tokenizer; its config.json names <|return|> its
    eos_token_id, as gpt-oss's does (<|call|> and <|endoftext|> only its generation_config.json lists)."""
    save_hf_dir(tiny_gpt_oss(seed), path)
    harmony_raw().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "add_bos_token": False, **CONFIG}))
    return path


def harmony_gguf(path: Path) -> Path:
    """The tiny gpt-oss as a float32 GGUF with the harmony tokenizer in its metadata, as llama.cpp's
    converter writes gpt-oss's: its special tokens control tokens, <|return|> its eos_token_id."""
    from gguf_writer import write_gguf

    raw = json.loads(harmony_raw().to_str())
    ids = {**raw["model"]["vocab"], **{t["content"]: t["id"] for t in raw["added_tokens"]}}
    tokens = sorted(ids, key=ids.get) + [f"<unused{i}>" for i in range(VOCAB_SIZE - len(ids))]
    special = {t["content"] for t in raw["added_tokens"]}

    def metadata(w) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in special else 1 for t in tokens])
        w.add_token_merges([f"{a} {b}" for a, b in MERGES])
        w.add_bos_token_id(token("<|startoftext|>"))
        w.add_eos_token_id(token("<|return|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(HARMONY_TEMPLATE)
    write_gguf(tiny_gpt_oss(), path, metadata=metadata)
    return path
