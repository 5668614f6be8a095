"""The datastore of the target's answers (proposers/datastore.py): its table holds each context's
most frequent follower, counted within answers only; a chain follows the longest known context;
greedy output with `store` and `lookup-store` equals plain greedy decoding (alone and in a batch
rows join and leave); sampled output follows plain sampling's law (chi-square, false failure
ALPHA = 1e-6, with a negative control); a file for another model, a missing one and a damaged one
are clear errors, and `build-datastore` writes what `--datastore` reads.
"""
from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from quickdraft.cli import main
from quickdraft.engine.batch import Request
from quickdraft.proposers import datastore
from quickdraft.proposers.base import ProposerContext, SpecConfig, SpecConfigError
from quickdraft.proposers.datastore import TABLE_N, Datastore, StoreProposer, find_datastore, load_datastore, save
from quickdraft.proposers.hybrid import HybridProposer, make_lookup_store
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.spec.sampling import SamplingParams
from quickdraft.train.responses import RESPONSES, generate_responses, target_settings
from support.engine import JOBS, first_tokens_in_batches, target
from support.laws import ALPHA, N_SAMPLES, N_TOKENS, PROMPT16, assert_plain_sampling_law, chi_square_p_value, plain_law
from support.models import tiny16
from support.shared_state import assert_alone_greedy_equals_plain, assert_batched_greedy_equals_plain


def table(docs: Sequence[Sequence[int]]) -> Datastore:
    return Datastore(np.array([t for d in docs for t in d]), np.array([len(d) for d in docs]))


def follower(store: Datastore, context: Sequence[int]) -> tuple[int, int, int] | None:
    """(follower, its count, the context's count) the table holds for `context`, or None."""
    key = store.contexts(context)[-1]
    i = int(np.searchsorted(store.keys, np.uint64(key)))
    if i == len(store.keys) or int(store.keys[i]) != key:
        return None
    return int(store.follower[i]), int(store.count[i]), int(store.total[i])


def test_the_table_holds_each_contexts_most_frequent_follower_within_answers() -> None:
    rng = random.Random(0)
    docs = [[rng.randrange(6) for _ in range(rng.randrange(1, 40))] for _ in range(60)]  # 6 tokens: contexts repeat
    store = table(docs)
    seen: dict[tuple[int, ...], Counter] = {}
    for d in docs:
        for i in range(len(d)):
            for n in range(1, min(TABLE_N, i) + 1):
                seen.setdefault(tuple(d[i - n:i]), Counter())[d[i]] += 1
    assert len(store.keys) == len(seen)  # no context spans two answers, none is missing
    for context, counts in seen.items():
        best = min(counts, key=lambda t: (-counts[t], t))  # the most frequent; the smallest token among equals
        assert follower(store, context) == (best, counts[best], sum(counts.values())), context


def test_a_chain_follows_the_longest_known_context_and_stops_where_none_is() -> None:
    store = table([[1, 2, 3, 4], [9, 2, 3, 5], [2, 3, 5], [7, 8]])
    assert follower(store, [2, 3]) == (5, 2, 3)
    assert [t for t, _, _ in store.chain([0, 1, 2, 3], 4)] == [4]  # (1, 2, 3) -> 4; nothing follows 4
    assert store.chain([0, 1, 2, 3], 4)[0][1:] == (3, 1.0)          # context length 3, its only follower
    assert [t for t, _, _ in store.chain([6, 2, 3], 4)] == [5]      # (2, 3) -> 5 of 3; nothing follows 5
    assert store.chain([0, 1, 2, 3], 4, min_n=4) == []
    assert store.chain([8], 4) == []                                # an answer's last token: no follower
    assert [t for t, _, _ in store.chain([7], 3)] == [8]


def test_answers_too_short_for_any_context_make_an_empty_table_that_drafts_nothing() -> None:
    store = table([[4], [5], []])
    assert len(store.keys) == 0 and store.chain([4, 5], 4) == []
    assert StoreProposer(store, [4, 5]).propose(4).tokens == []


def storing(store: Datastore):
    return lambda prompt, params: StoreProposer(store, prompt)


def own_answers(model, prompts: Sequence[Sequence[int]], tmp: Path, n: int = 40) -> list[list[int]]:
    return [r.tokens[r.prompt_len:] for r in generate_responses(model, [list(p) for p in prompts], frozenset(), n,
                                                                tmp / RESPONSES, batch_size=4, progress=False)]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Datastore:
    """The engine tests' target's own answers to their jobs' prompts and to other ones: drafts from
    it are accepted often, and not always."""
    rng = random.Random(1)
    other = [[rng.randrange(3, 96) for _ in range(6)] for _ in range(12)]
    return table(own_answers(target(), [job.prompt for job in JOBS] + other, tmp_path_factory.mktemp("answers")))


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_equals_plain_alone(store: Datastore, k: int) -> None:
    assert_alone_greedy_equals_plain(storing(store), k)


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
def test_batched_greedy_equals_plain_with_rows_joining_and_leaving(store: Datastore, policy: str) -> None:
    assert_batched_greedy_equals_plain(storing(store), 4, policy)
    lookup_store = lambda prompt, params: HybridProposer(NgramProposer(prompt), StoreProposer(store, prompt), "store")
    assert_batched_greedy_equals_plain(lookup_store, 4, policy)


def test_sampled_store_drafts_through_the_engine_follow_plain_sampling(tmp_path: Path) -> None:
    """Chi-square on the joint law of the first N_TOKENS tokens (support.laws); the negative control:
    the same counts against the law at another temperature are rejected."""
    model = tiny16()
    rng = random.Random(2)
    store16 = table(own_answers(model, [PROMPT16] + [[rng.randrange(16) for _ in range(8)] for _ in range(8)],
                                tmp_path, 12))
    params = [SamplingParams(temperature=1.0, seed=seed, max_new_tokens=N_TOKENS + 1, ignore_eos=True)
              for seed in range(80_000, 80_000 + N_SAMPLES)]
    counts, drafted, accepted = first_tokens_in_batches(model, [
        Request(PROMPT16, p, frozenset(), StoreProposer(store16, PROMPT16), 4, adaptive=False, id=str(p.seed))
        for p in params])
    assert_plain_sampling_law(model, counts, drafted, accepted)
    other = plain_law(model, PROMPT16, SamplingParams(temperature=0.6), N_TOKENS)
    assert chi_square_p_value(counts, other) < ALPHA


class Target:
    """A Target (proposers/base.py) whose datastore is found as quickdraft.LLM finds it."""
    name, prefix = None, None

    def __init__(self, model) -> None:
        self.model = model

    def datastore(self, path: str | None = None) -> Datastore:
        return load_datastore(find_datastore(path, self.model), self.model.config.vocab_size)


def test_files_name_their_model_and_are_found_for_it_alone(tmp_path: Path, monkeypatch) -> None:
    model, other = target(), tiny16()
    path = save(tmp_path / "answers.npz", [[5, 6, 7], [5, 6, 8]], model, {"about": "a test"})
    assert json.loads(str(np.load(path)["meta"]))["answers"] == 2
    assert follower(load_datastore(find_datastore(str(path), model), 96), [5, 6]) == (7, 1, 2)
    with pytest.raises(SpecConfigError, match="another model's answers"):
        find_datastore(str(path), other)
    monkeypatch.setattr(datastore, "PACKAGED", tmp_path)
    assert find_datastore(None, model) == path
    with pytest.raises(SpecConfigError, match="no datastore ships .* build-datastore"):
        find_datastore(None, other)
    for bad, content in (("bad.npz", b"not a zip"), ("truncated.npz", path.read_bytes()[:200])):
        (tmp_path / bad).write_bytes(content)
        with pytest.raises(SpecConfigError, match="cannot read the datastore"):
            find_datastore(str(tmp_path / bad), model)
        with pytest.raises(SpecConfigError, match="cannot read the datastore"):
            load_datastore(tmp_path / bad, 96)
    with pytest.raises(SpecConfigError, match="token 8, outside the model's 8"):
        load_datastore(path, 8)
    (tmp_path / "text.npz").write_text("a text file")
    with pytest.raises(SpecConfigError, match="it is no whole .npz file") as e:
        load_datastore(tmp_path / "text.npz", 96)
    assert "pickle" not in str(e.value)
    np.save(tmp_path / "array.npy", np.arange(3))
    with pytest.raises(SpecConfigError, match="cannot read the datastore"):
        load_datastore(tmp_path / "array.npy", 96)
    ctx = ProposerContext([5, 6], SamplingParams(), SpecConfig("lookup-store", k=4, datastore=str(path)),
                          Target(model))
    proposer = make_lookup_store(ctx)
    assert proposer.drafter.propose(2).tokens == [7]  # (5, 6) -> 7, then nothing follows 7


def test_build_datastore_writes_what_datastore_reads(tmp_path: Path, capsys) -> None:
    """Answers saved by train-head's generator become a datastore file that `--datastore` (here
    SpecConfig.datastore) reads: the same prompt again drafts from it, output equal to plain."""
    import quickdraft
    from tiny_tokenizer import tiny_llm_dir
    path = tiny_llm_dir(tmp_path / "model")
    llm = quickdraft.load(path)
    texts = ["the sea and the ships", "a harbour at night"]
    answers = generate_responses(llm.model, [llm.prompt_ids(t) for t in texts], frozenset(), 16,
                                 tmp_path / RESPONSES, batch_size=2, progress=False)
    out = tmp_path / "store.npz"
    assert main(["build-datastore", "-m", str(path), "--answers", str(tmp_path / RESPONSES), "--out", str(out),
                 "--no-progress"]) == 0
    assert "2 answers" in capsys.readouterr().err
    assert llm.datastore(str(out)).size == sum(len(r.tokens) - r.prompt_len for r in answers)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    got = llm.generate(prompt=texts[0], params=params, spec=SpecConfig("store", k=4, datastore=str(out), adaptive=False))
    assert got.token_ids == llm.generate(prompt=texts[0], params=params, spec=SpecConfig("none")).token_ids
    assert got.stats.accepted_tokens > 0
    spec = SpecConfig("lookup-store", k=4, datastore=str(out), adaptive=False)
    origins = [o for chunk in llm.stream(prompt=texts[0], params=params, spec=spec) for o in chunk.origins]
    assert "store" in {o.source for o in origins if o.kind == "accepted"}  # token origins name the part
    other = tmp_path / "other.json.gz"  # answers whose settings name another model
    saved = json.loads(gzip.decompress((tmp_path / RESPONSES).read_bytes()))
    saved["settings"] = {**saved["settings"], "target_probe": target_settings(tiny16())["target_probe"]}
    other.write_bytes(gzip.compress(json.dumps(saved).encode()))
    assert main(["build-datastore", "-m", str(path), "--answers", str(other), "--out", str(out)]) == 1
    assert "answers of another model" in capsys.readouterr().err


def test_a_server_builds_the_table_only_where_its_speculation_drafts_from_one(tmp_path: Path) -> None:
    """A datastore's table costs seconds and memory to build: a server builds it at start where its
    own speculation (or a named file) needs it, and elsewhere refuses requests that ask for one
    with a 400 rather than build it on the engine's thread."""
    import httpx

    import quickdraft
    from quickdraft.engine.batch import EngineConfig
    from quickdraft.server import BackgroundServer, ServerConfig
    from tiny_tokenizer import tiny_llm_dir
    path = tiny_llm_dir(tmp_path / "model")
    stored = save(tmp_path / "store.npz", [[5, 6, 7, 8]], quickdraft.load(path).model, {})
    body = {"model": "tiny", "prompt": "the sea", "max_tokens": 4, "temperature": 0,
            "speculative": {"method": "lookup-store"}}
    for spec, status in ((SpecConfig("ngram"), 400), (SpecConfig("ngram", datastore=str(stored)), 200),
                         (SpecConfig("store", datastore=str(stored)), 200)):
        llm = quickdraft.load(path)
        server = BackgroundServer(llm, ServerConfig("tiny", spec=spec, engine=EngineConfig(max_batch=2)))
        try:
            answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == status, (spec, answer.text)
            assert (str(stored) in llm._datastores) == (status == 200)
            if status == 400:
                assert "started without a datastore" in answer.text
        finally:
            server.stop()
