"""The tiny server every server test runs: the model pair's directories (`dirs`), the loaded target
with its draft (`llm`), `Server` (uvicorn on 127.0.0.1 in a thread, the official `openai` client on
it) and what a test compares its answers with (`alone`, `stream_text`)."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

import quickdraft
from quickdraft.engine.batch import EngineConfig
from quickdraft.proposers import SpecConfig
from quickdraft.server import BackgroundServer, ServerConfig
from quickdraft.spec.sampling import SamplingParams
from tiny_tokenizer import tiny_llm_dir

NAME = "tiny"
MAX_SEQ = 2048
PROMPTS = ["The quick brown fox", "hello hello hello hello", "abc abc abd abc", "Once upon a time",
           "1 2 3 4 5 6", "zzz", "Dear diary, today", "print('hi')"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("server")
    target = tiny_llm_dir(root / "target", max_position_embeddings=MAX_SEQ)
    draft = tiny_llm_dir(root / "draft", seed=3, max_position_embeddings=MAX_SEQ)
    return target, draft


@pytest.fixture(scope="module")
def llm(dirs) -> quickdraft.LLM:
    target, draft = dirs
    return quickdraft.load(str(target), spec=SpecConfig("ngram", k=4, draft_model=str(draft)))


class Server(BackgroundServer):
    def __init__(self, llm: quickdraft.LLM, max_batch: int, shutdown_timeout_s: float = 30.0, max_seq: int = MAX_SEQ,
                 **config) -> None:
        engine = EngineConfig(max_batch=max_batch, max_seq_len=max_seq)
        super().__init__(llm, ServerConfig(NAME, llm.spec, engine, **config), shutdown_timeout_s=shutdown_timeout_s)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def alone(llm: quickdraft.LLM, prompt: str, n: int, spec: dict, **sampling) -> str:
    config = SpecConfig(**{"method": "ngram", "k": 4, "draft_model": llm.spec.draft_model, **spec})
    return llm.generate(prompt, params=SamplingParams(max_new_tokens=n, **sampling), spec=config).text


def stream_text(client: openai.OpenAI, prompt: str, n: int, spec: dict, **kw) -> tuple[str, list]:
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=n, stream=True,
                                            extra_body={"speculative": spec} if spec else None, **kw))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


@contextlib.contextmanager
def serve_process(dirs, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`quickdraft serve` in a process of its own on a free port, up and answering /health."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "quickdraft", "serve", "--model", str(dirs[0]), "--port", str(port),
                             "--spec", "ngram", "--served-model-name", NAME, "--no-measure-cost",
                             "--log-level", "warning", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.TransportError:
                return False
        wait_for(up, 120)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.05)
