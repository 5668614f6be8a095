"""Prompt scoring (issue 44 item 5): `LLM.score`, and /v1/completions' echo, logprobs over the prompt,
max_tokens 0 and batched prompts, as lm-eval's loglikelihood tasks use them.

Oracles: log_softmax of one plain forward of the model over the whole prompt, in a cache of its own
(bitwise where the C kernels run, the prompts being within their batch-invariant rows), whether the
prompt is new, sent again, shares a prefix with an earlier one or continues a speculative answer
(its K/V and features then come from the prefix cache); the Python API's own generation for the
echoed choices' new tokens and for each prompt of a batch alone; the tokenizer's text of the prompt
for the echoed text and its offsets; LLM.score's sums for lm-eval's local-completions run.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from gguf import GGMLQuantizationType

import quickdraft
from quickdraft import kernels
from quickdraft.proposers import SpecConfig
from quickdraft.spec.logprobs import TokenLogprob
from quickdraft.spec.sampling import SamplingParams
from support.http import token_bytes
from support.server import MAX_SEQ, NAME, Server
from tiny_tokenizer import tiny_model, write_llama_gguf

EXACT = kernels.active_library() is not None  # else torch's kernels: each pass's sums by its own shape
PROMPT = "The quick brown fox jumps over the lazy dog again"  # ~50 tokens: one batch-invariant pass
SHARING = PROMPT[:40] + " and then sleeps in the sun"     # its first 40 tokens are PROMPT's
PLAIN = SpecConfig("none")


@pytest.fixture(scope="module")
def gguf_llm(tmp_path_factory: pytest.TempPathFactory) -> quickdraft.LLM:
    path = write_llama_gguf(tiny_model(max_position_embeddings=MAX_SEQ),
                            tmp_path_factory.mktemp("scoring") / "q8.gguf", qtype=GGMLQuantizationType.Q8_0)
    return quickdraft.load(str(path), spec=PLAIN)


@pytest.fixture(scope="module")
def server(llm) -> Server:
    s = Server(llm, max_batch=4, max_waiting=4)  # 8 places: a batch of 3 prompts with n = 3 is too many
    yield s
    s.stop()


@torch.inference_mode()
def plain(llm: quickdraft.LLM, ids: list[int], top: int) -> list[TokenLogprob]:
    """Each token's after the first: one forward over the whole prompt, log_softmax at each position."""
    model = llm.model
    logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache(1, len(ids))).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)[:-1]  # [n - 1, V]: position i scores token i + 1
    chosen = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    values, alternatives = logp.topk(top, dim=-1)
    return [TokenLogprob(c, tuple(zip(i, v))) for c, i, v in zip(chosen.tolist(), alternatives.tolist(),
                                                                  values.tolist())]


def assert_same(got: list[TokenLogprob], expected: list[TokenLogprob]) -> None:
    assert len(got) == len(expected) > 0
    if EXACT:
        assert got == expected
        return
    assert [x.top[0][0] for x in got] == [x.top[0][0] for x in expected]
    assert torch.allclose(torch.tensor([x.logprob for x in got]), torch.tensor([x.logprob for x in expected]),
                          atol=1e-5)


# -- LLM.score ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["float", "gguf"])
def test_scores_are_a_plain_forwards_log_softmax_cold_and_cached(which: str, llm, gguf_llm) -> None:
    model = llm if which == "float" else gguf_llm
    ids = model.tokenizer.encode(PROMPT)
    assert 32 < len(ids) <= 64 and (which == "float") != model.model.quantized  # the premises
    expected = plain(model, ids, 4)
    cold = model.score(PROMPT, top_logprobs=4)
    assert cold.token_ids == ids and cold.stats.new_tokens == 0
    assert_same(cold.logprobs, expected)
    again = model.score(ids, top_logprobs=4)  # token ids: the same prompt, now in the prefix cache
    assert again.stats.cached_tokens == len(ids) - 1  # all but the last token (always fed)
    assert_same(again.logprobs, expected)
    sharing = model.score(SHARING, top_logprobs=4)
    shared = next(i for i, (a, b) in enumerate(zip(ids, sharing.token_ids)) if a != b)
    assert sharing.stats.cached_tokens == shared > 32  # the premise: a prefix of PROMPT's, not all of it
    assert_same(sharing.logprobs, plain(model, sharing.token_ids, 4))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_speculative_answer_scored_again_is_the_plain_forwards(method: str, llm, dirs) -> None:
    """The answer's K/V and features come from the verify passes that accepted its drafts."""
    spec = SpecConfig(method, k=4, adaptive=False, draft_model=str(dirs[0]))  # the target as its own draft
    prompt = "abc abc abc abd abc"
    answer = llm.generate(prompt, params=SamplingParams(max_new_tokens=24, ignore_eos=True), spec=spec)
    assert answer.stats.accepted_tokens > 0  # the premise: drafts were accepted
    ids = llm.tokenizer.encode(prompt) + answer.token_ids
    scored = llm.score(ids, top_logprobs=2)
    assert scored.stats.cached_tokens == len(ids) - 1  # the answer's too, from the prefix cache
    assert_same(scored.logprobs, plain(llm, ids, 2))


def test_scoring_refuses_what_it_cannot_score(llm) -> None:
    with pytest.raises(quickdraft.QuickdraftError, match="token ids must be integers in 0..299"):
        llm.score([5, 300])
    with pytest.raises(quickdraft.ContextTooLong, match="empty"):
        llm.score([])
    with pytest.raises(quickdraft.InvalidSamplingParams, match="logprobs"):
        llm.score("hi", top_logprobs=21)
    assert llm.score([7]).logprobs == []  # one token: nothing before it scores it


# -- /v1/completions --------------------------------------------------------------------------------------

def post(server: Server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": NAME, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def spelled(llm, ids: list[int]) -> list[str]:
    return [b.decode("utf-8", errors="replace") for b in token_bytes(llm, ids)]


def legacy_top(llm, lp: TokenLogprob) -> dict[str, float]:
    """OpenAI's top_logprobs entry: keyed by text, of alternatives that spell alike the likeliest."""
    top: dict[str, float] = {}
    for text, (_, value) in zip(spelled(llm, [i for i, _ in lp.top]), lp.top):
        top.setdefault(text, value)
    return top


@pytest.mark.parametrize("form", ["text", "ids", "batch of ids"])
def test_echo_with_max_tokens_0_answers_the_prompt_and_its_scores(server: Server, llm, form: str) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    prompt = {"text": PROMPT, "ids": ids, "batch of ids": [ids]}[form]
    r = post(server, prompt=prompt, echo=True, logprobs=3, max_tokens=0)
    (choice,) = r["choices"]
    lp, expected = choice["logprobs"], plain(llm, ids, 3)
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 0
    assert lp["tokens"] == spelled(llm, ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing scores the first token
    if EXACT:
        assert lp["token_logprobs"][1:] == [x.logprob for x in expected]
        assert lp["top_logprobs"][1:] == [legacy_top(llm, x) for x in expected]
    assert lp["text_offset"] == [len(llm.tokenizer.decode(ids[:i])) for i in range(len(ids))]
    bare = post(server, prompt=prompt, max_tokens=0)  # no echo: no text at all
    assert bare["choices"][0]["text"] == "" and bare["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("speculative", [{"method": "none"}, {"method": "ngram", "k": 4, "adaptive": False}])
def test_echo_puts_the_prompt_before_the_new_tokens(server: Server, llm, speculative: dict) -> None:
    prompt = "abc abc abc abd abc"
    ids = llm.tokenizer.encode(prompt)
    alone = llm.generate(prompt, params=SamplingParams(max_new_tokens=16, logprobs=2), spec=PLAIN)
    first = post(server, prompt=prompt, echo=True, logprobs=2, max_tokens=16, temperature=0, speculative=speculative)
    again = post(server, prompt=prompt, echo=True, logprobs=2, max_tokens=16, temperature=0, speculative=speculative)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1  # the premise: a cached prompt
    for r in (first, again):
        (choice,) = r["choices"]
        lp = choice["logprobs"]
        assert choice["text"] == prompt + alone.text
        assert lp["token_logprobs"][len(ids):] == [x.logprob for x in alone.logprobs]
        if EXACT:
            assert lp["token_logprobs"][1:len(ids)] == [x.logprob for x in plain(llm, ids, 2)]
        assert lp["text_offset"][len(ids)] == len(prompt) and len(lp["tokens"]) == len(ids) + len(alone.token_ids)
    if speculative["method"] == "ngram":
        assert first["stats"]["accepted_tokens"] > 0  # the premise: speculation ran
    assert first["choices"][0]["logprobs"] == again["choices"][0]["logprobs"]


def test_a_batch_of_prompts_answers_each_with_its_choices(server: Server, llm) -> None:
    prompts = ["Once upon a time", "1 2 3 4", "Dear diary, today"]
    sampling = dict(temperature=1.0, seed=7, max_tokens=6, speculative={"method": "none"})
    r = post(server, prompt=prompts, n=2, **sampling)
    assert [c["index"] for c in r["choices"]] == list(range(6))  # prompt i's choice j: i * n + j, as OpenAI's
    texts = [c["text"] for c in r["choices"]]
    for i, prompt in enumerate(prompts):
        for j in range(2):
            params = SamplingParams(temperature=1.0, seed=7 + j, max_new_tokens=6)
            alone = llm.generate(prompt, params=params, spec=PLAIN)
            assert texts[2 * i + j] == alone.text, (i, j)
    assert len(set(texts)) > 3
    lengths = [len(llm.tokenizer.encode(p)) for p in prompts]
    assert r["usage"]["prompt_tokens"] == sum(lengths)  # each prompt once, whatever its n
    assert r["usage"]["completion_tokens"] == sum(c["stats"]["new_tokens"] for c in r["choices"])
    ids = post(server, prompt=[llm.tokenizer.encode(p) for p in prompts], n=2, **sampling)
    assert [c["text"] for c in ids["choices"]] == texts and ids["usage"]["prompt_tokens"] == sum(lengths)


def test_a_streamed_echo_sends_the_prompt_first(server: Server, llm) -> None:
    body = dict(prompt=["abc abc", "xyz"], echo=True, logprobs=1, max_tokens=5, temperature=0)
    whole = post(server, **body)
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                      json={"model": NAME, **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    for choice in whole["choices"]:
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == choice["index"]]
        prompt = body["prompt"][choice["index"]]
        assert mine[0]["text"] == prompt and mine[0]["logprobs"]["token_logprobs"][0] is None  # the echo, alone
        assert "".join(c["text"] for c in mine) == choice["text"]
        streamed = [v for c in mine for v in c["logprobs"]["token_logprobs"]]
        assert len(streamed) == len(choice["logprobs"]["token_logprobs"])
        assert streamed == choice["logprobs"]["token_logprobs"] or not EXACT  # the prompt cached meanwhile
        offsets = [v for c in mine for v in c["logprobs"]["text_offset"]]
        assert offsets == choice["logprobs"]["text_offset"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: more the second time
    assert [events[-1]["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]


def error_of(server: Server, path: str = "/v1/completions", **body) -> dict:
    r = httpx.post(f"{server.url}{path}", json={"model": NAME, **body}, timeout=30)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_what_stays_refused_is_a_400_naming_the_field(server: Server) -> None:
    error = error_of(server, prompt=["a", "b", "c"], n=3)  # 9 choices, 8 places
    assert error["param"] == "prompt" and "3 prompts of n = 3 choices, 9 choices" in error["message"]
    assert error_of(server, prompt=[[]])["param"] == "prompt.0"
    assert error_of(server, prompt="hi", echo=True, best_of=2)["param"] == "best_of"
    chat = error_of(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert chat["param"] == "max_tokens"
    assert error_of(server, prompt="hi", max_tokens=-1)["param"] == "max_tokens"


def test_the_published_schema_takes_batches_and_max_tokens_0(server: Server, llm) -> None:
    schema = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    fields = schema["CompletionRequest"]["properties"]
    forms = fields["prompt"]["anyOf"]
    batch_of_ids = next(f for f in forms if f.get("items", {}).get("type") == "array")
    ids = batch_of_ids["items"]
    assert ids["items"] == {"type": "integer", "minimum": 0, "maximum": llm.model.config.vocab_size - 1}
    assert ids["maxItems"] == MAX_SEQ - 1 and batch_of_ids["maxItems"] == 8  # the server's places
    batch_of_texts = next(f for f in forms if f.get("items", {}).get("type") == "string")
    assert batch_of_texts["maxItems"] == 8
    assert fields["max_tokens"]["anyOf"][0]["minimum"] == 0 and fields["echo"]["anyOf"][0] == {"type": "boolean"}
    assert schema["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["minimum"] == 1


# -- lm-eval's local-completions ----------------------------------------------------------------------------

TASK = """task: quickdraft_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
DOCS = [{"question": "What does the fox do?", "choices": ["jumps", "sleeps", "runs away"], "answer": 0},
        {"question": "1 2 3 4", "choices": ["5", "6 7"], "answer": 0},
        {"question": "Dear diary, today", "choices": ["I ate", "we sang a song"], "answer": 1}]


def test_lm_eval_loglikelihoods_are_the_python_apis(server: Server, llm, dirs,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lm_eval = pytest.importorskip("lm_eval")  # the clients extra: lm-eval[api]
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["quickdraft_tiny"], log_samples=True,
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        model_args={"model": NAME, "base_url": f"{server.url}/v1/completions", "tokenizer": str(dirs[0]),
                    "tokenizer_backend": "huggingface", "batch_size": 2, "max_length": MAX_SEQ})
    samples = results["samples"]["quickdraft_tiny"]
    assert len(samples) == len(DOCS) and sum(len(s["resps"]) for s in samples) == 7
    scored = []
    for sample in samples:
        for (context, continuation), ((ll, greedy),) in zip(sample["arguments"], sample["resps"]):
            context_ids = llm.tokenizer.encode(context, add_special_tokens=False)
            ids = llm.tokenizer.encode(context + continuation, add_special_tokens=False)
            tail = llm.score(ids, top_logprobs=1).logprobs[len(context_ids) - 1:]  # the continuation's tokens
            assert ll == sum(x.logprob for x in tail)
            assert greedy == all(x.logprob == x.top[0][1] for x in tail)
            scored.append(ll)
    assert len(set(scored)) == len(scored)  # the premise: a choice given another's score would show
