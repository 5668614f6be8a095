"""llama.cpp's Spec-Bench rows on a tiny random GGUF written in the test: fast, but collected only
when the optional `llamacpp` extra (llama-cpp-python) is installed (tests/conftest.py leaves this file
out otherwise; `bash scripts/install.sh --llamacpp` installs it).

Oracles: the binding's own high-level greedy `generate` without a draft model (the tokens both
llama.cpp rows must produce), a prefill in one pass (what a prefill in n_batch pieces must equal),
and the prompt ids quickdraft's rows decode from.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quickdraft.bench.llamacpp_engine import LlamaCppDraftModel, LlamaCppEngine, LlamaCppPromptLookup, import_llama_cpp
from quickdraft.cli import main
from quickdraft.errors import QuickdraftError
from tiny_tokenizer import VOCAB_SIZE, tiny_model, write_llama_gguf

PROMPT = [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41, 42]  # the lookup finds 41, 42
N = 24


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tiny_model(), tmp_path_factory.mktemp("llamacpp") / "tiny.gguf")


@pytest.fixture(scope="module")
def reference(gguf: Path) -> list[int]:
    """The binding's greedy generate, no draft model."""
    llm = import_llama_cpp().Llama(model_path=str(gguf), n_ctx=128, n_threads=1, verbose=False)
    out = []
    for token in llm.generate(PROMPT, top_k=1, temp=0.0, repeat_penalty=1.0):
        out.append(token)
        if len(out) == N:
            break
    llm.close()
    return out


def test_plain_engine_stops_at_eos_and_prefills_in_pieces(gguf: Path, reference: list[int]) -> None:
    whole = LlamaCppEngine(gguf, threads=1, n_ctx=128, n_batch=64)
    pieces = LlamaCppEngine(gguf, threads=1, n_ctx=128, n_batch=8)  # the prompt in 3 passes
    try:
        assert whole.generate(PROMPT, N, frozenset()) == reference
        assert pieces.generate(PROMPT, N, frozenset()) == reference
        stop = reference[5]
        first = reference.index(stop)
        assert whole.generate(PROMPT, N, frozenset({stop})) == reference[:first + 1]  # through the EOS
        room = whole.n_ctx()  # llama.cpp may round the context up
        message = f"context holds {room} tokens, but a turn needs 18 prompt \\+ {room - 17}"
        with pytest.raises(QuickdraftError, match=message):
            whole.generate(PROMPT, room - 17, frozenset())
    finally:
        whole.close()
        pieces.close()


def test_prompt_lookup_drafts_and_decodes_the_greedy_tokens(gguf: Path, reference: list[int]) -> None:
    lookup = LlamaCppPromptLookup(gguf, threads=1, n_ctx=128, num_pred_tokens=4)
    try:
        for _ in range(2):  # a second call starts from an empty cache: the same tokens and counts
            out, passes, drafted = lookup.generate(PROMPT, N, frozenset())
            assert out == reference
            assert drafted > 0 and 1 <= passes <= len(out)
        stop = reference[5]
        assert lookup.generate(PROMPT, N, frozenset({stop}))[0] == reference[:reference.index(stop) + 1]
    finally:
        lookup.close()


def test_a_draft_model_drafts_and_decodes_the_greedy_tokens(gguf: Path, reference: list[int]) -> None:
    """The model as its own draft: each draft is the target's own greedy continuation, all accepted
    (fewer passes than tokens); the tokens are the binding's greedy ones, call after call (the draft's
    cache reused from one call to the next)."""
    speculative = LlamaCppDraftModel(gguf, threads=1, n_ctx=128, draft=gguf, n_max=4)
    try:
        for _ in range(2):
            out, passes, drafted = speculative.generate(PROMPT, N, frozenset())
            assert out == reference
            assert drafted >= len(out) - passes and passes < len(out)
        stop = reference[5]
        assert speculative.generate(PROMPT, N, frozenset({stop}))[0] == reference[:reference.index(stop) + 1]
    finally:
        speculative.close()


def test_a_draft_of_another_vocabulary_is_refused(gguf: Path, tmp_path: Path) -> None:
    other = write_llama_gguf(tiny_model(vocab_size=VOCAB_SIZE + 8), tmp_path / "other.gguf")
    with pytest.raises(QuickdraftError, match=r"vocabulary \(\d+ tokens\) is not the target's"):
        LlamaCppDraftModel(gguf, threads=1, n_ctx=128, draft=other)


def test_specbench_rows_with_the_real_binding(gguf: Path, tmp_path: Path, capsys) -> None:
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["the cat the cat the"]}) + "\n")
    rc = main(["bench", "specbench", "--model", str(gguf), "--questions", str(qfile), "--groups", "qa",
               "--max-new-tokens", "12", "--compare-llamacpp", "--llamacpp-draft", str(gguf), "--threads", "1",
               "--json", "--no-progress"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["config"]["llama_cpp_python"] == import_llama_cpp().__version__
    (q,) = res["questions"]
    runs = q["runs"]
    assert runs["llama.cpp-plain"]["turns"][0]["prompt_tokens"] == runs["plain"]["turns"][0]["prompt_tokens"]
    assert res["config"]["llamacpp_draft"] == str(gguf) and res["config"]["llamacpp_draft_max"] == 16
    for label in ("llama.cpp-plain", "llama.cpp-prompt-lookup", "llama.cpp-draft"):
        assert runs[label]["new_tokens"] > 0 and runs[label]["tokens_per_s"] > 0
        assert runs[label]["identical_to_plain"] is not None  # reported, not required
    assert runs["llama.cpp-plain"]["tokens_per_pass"] == 1.0
    assert runs["llama.cpp-prompt-lookup"]["tokens_per_pass"] >= 1.0
    assert runs["llama.cpp-draft"]["tokens_per_pass"] > 1.0  # its own draft: every drafted token accepted


@pytest.mark.parametrize("given", [None, "active"])
def test_llamacpp_runs_with_the_users_openmp_wait_policy(gguf: Path, given: str | None) -> None:
    """quickdraft waits passively (torch's pool); llama.cpp, in its own process, as the user said.
    The worker's environment is read from /proc, as the OpenMP runtime there read it."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": given} if given else {})
    script = ("import os, quickdraft; from quickdraft.bench.llamacpp_engine import LlamaCppEngine; "
              f"e = LlamaCppEngine({str(gguf)!r}, 1, 64); "
              "w = open(f'/proc/{e.worker.process.pid}/environ', 'rb').read().split(b'\\0'); "
              "print(os.environ['OMP_WAIT_POLICY'], [v.decode() for v in w if v.startswith(b'OMP_WAIT_POLICY=')]); "
              "e.close()")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1]).stdout.split("\n")[-2]
    ours, theirs = out.split(" ", 1)
    assert ours == (given or "PASSIVE")
    assert theirs == (f"['OMP_WAIT_POLICY={given}']" if given else "[]")


def test_a_failing_llamacpp_process_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(QuickdraftError, match="llama.cpp: "):
        LlamaCppEngine(bad, threads=1, n_ctx=64)


def test_llama_cpp_is_kept_off_amx_where_the_cpu_has_it() -> None:
    """llama.cpp's AMX kernels crash on the first pass on AMX CPUs (the real-model tests segfaulted
    there): the worker refuses its process the tile state, and says so in the system info. Where
    the CPU has no AMX nothing is installed. Run in a child: the filter stays for a process's life."""
    code = """
import ctypes, json, sys
sys.path.insert(0, sys.argv[1])
from llamacpp_worker import AMX_REFUSED, refuse_amx_tile_state, system_info
libc = ctypes.CDLL(None, use_errno=True)
print(json.dumps({"said": refuse_amx_tile_state(), "again": refuse_amx_tile_state(), "info": system_info(),
                  "request": libc.syscall(158, 0x1023, 18), "errno": ctypes.get_errno(), "refused": AMX_REFUSED}))
"""
    worker_dir = Path(__file__).parents[1] / "quickdraft" / "bench"
    run = subprocess.run([sys.executable, "-c", code, str(worker_dir)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if " amx_int8" in Path("/proc/cpuinfo").read_text():
        assert out["said"] == out["again"] == out["refused"] and out["info"].endswith(out["refused"])
        assert (out["request"], out["errno"]) == (-1, 1)  # EPERM: ggml finds AMX not ready
    else:
        assert out["said"] == out["again"] == "" and out["refused"] not in out["info"]
