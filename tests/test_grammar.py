"""Structured output under speculation: a grammar's mask at every drafted position keeps decoding exact.

Oracles: constrained plain decoding through the same engine (greedy: token for token, for every
proposer, chains and trees, batch 1 and N); jsonschema's validator for every output; the masked
target's law computed by hand (chi-square, a negative control the same test must reject); the
matcher's own answers after a walk (rolled back where it began). Tiny random models and the tiny
byte-level tokenizer, made in the test.
"""
from __future__ import annotations

import functools
import json

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.proposers.base import EACH, Draft
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.spec.sampling import SamplingParams, probabilities
from quickdraft.spec.verify import verify
from quickdraft.structured.grammar import (
    DEAD_END,
    GrammarError,
    Vocabulary,
    allowed,
    constrain,
    grammar_text,
)
from support.engine import first_tokens_in_batches
from support.grammar import (
    PROPOSERS,
    SCHEMAS,
    letters,
    prompt_for,
    run,
    schema_constraint,
    target,
    text,
    tokenizer,
    vocabulary,
)
from support.laws import ALPHA, PROMPT16, chi_square_p_value, plain_law
from support.models import V16, tiny16, tiny16_draft
from tiny_tokenizer import EOS_ID, VOCAB_SIZE

# -- greedy: speculation under a grammar == constrained plain decoding --------------------------------------

GREEDY = SamplingParams(max_new_tokens=150)


@pytest.mark.parametrize("method", [m for m in PROPOSERS if m != "plain"])
def test_greedy_constrained_speculation_equals_constrained_plain_decoding(method: str) -> None:
    plain = [run([(prompt_for(s), GREEDY, "plain", schema_constraint(s))], 1)[0][0] for s in SCHEMAS]
    for i, schema in enumerate(SCHEMAS):
        (spec,), (reason,) = run([(prompt_for(schema), GREEDY, method, schema_constraint(schema))], 1)
        assert spec == plain[i], (method, i, text(spec), text(plain[i]))
        assert reason == "stop"
        jsonschema.validate(json.loads(text(spec)), schema)
    # batch N: every schema and proposer in one engine, rows joining and leaving
    jobs = [(prompt_for(s), GREEDY, m, schema_constraint(s)) for s in SCHEMAS for m in ("plain", method)]
    batched, reasons = run(jobs, 3)
    assert batched == [plain[i] for i in range(len(SCHEMAS)) for _ in range(2)]
    assert set(reasons) == {"stop"}


def test_the_grammar_changes_the_output_and_unconstrained_rows_beside_are_untouched() -> None:
    schema = SCHEMAS[0]
    free = run([(prompt_for(schema), GREEDY, "ngram", None)], 1)[0][0]
    mixed, _ = run([(prompt_for(schema), GREEDY, "ngram", None), (prompt_for(schema), GREEDY, "ngram",
                                                                   schema_constraint(schema))], 2)
    assert mixed[0] == free
    assert mixed[1] != free  # a random tiny model writes no JSON of its own
    jsonschema.validate(json.loads(text(mixed[1])), schema)


def test_forced_tokens_are_drafted_and_accepted() -> None:
    """Jump-forward: after the prompt, the grammar forces '{"name": "' (a key it requires first): the
    first decode step verifies those tokens as a draft, even for a request whose proposer has none."""
    schema = SCHEMAS[0]
    engine = Engine(target(), EngineConfig(max_batch=1))

    class Nothing:
        group = EACH

        def propose(self, k: int) -> Draft:
            return Draft([])

        def commit(self, step) -> None:
            pass

    prompt = prompt_for(schema)
    engine.add(Request(prompt, GREEDY, frozenset({EOS_ID}), Nothing(), 8, constraint=schema_constraint(schema)))
    events = []
    while engine.has_work():
        events += [e for _, e in engine.step()]
    stats = events[-1].stats
    assert stats.accepted_tokens >= len(tokenizer().encode('{"name": "', add_special_tokens=False)) - 1
    assert stats.target_passes < stats.new_tokens
    assert any(o.source == "grammar" for e in events for o in e.origins)
    assert text([t for e in events for t in e.token_ids]).startswith('{"name": "')


def test_shape_cuts_a_draft_at_its_first_forbidden_token_and_walks_trees_per_path() -> None:
    c = schema_constraint(SCHEMAS[2])  # an array of small integers
    enc = lambda s: tokenizer().encode(s, add_special_tokens=False)
    forced = enc("[")
    assert c.shape(Draft([]), 8).tokens == forced
    # a chain: '[' forced (the draft's own '[' stands for it), '1', ',', then 'x' is forbidden (a space
    # must follow): cut there
    chain = Draft(enc("[1,x2"))
    shaped = c.shape(chain, 8)
    assert shaped.tokens == enc("[1,")
    masks = c.masks(len(shaped.tokens))
    assert masks.shape == (1 + len(shaped.tokens), VOCAB_SIZE)
    assert masks[0, forced[0]] and masks[0].sum() == 1        # only '[' at the root
    assert masks[1, enc("1")[0]] and not masks[1, enc("]")[0]]  # minItems 1: no ']' yet
    assert masks[2, enc(",")[0]] and masks[2, enc("]")[0]]
    assert not masks[3, enc("]")[0]] and not masks[3, enc(",")[0]]  # after '[1,' a number
    # a tree under '[': '5' with children ']' and 'q' (forbidden), sibling ']' (forbidden: minItems)
    t = enc("[5]q")
    tree = Draft([t[0], t[1], t[2], t[3], t[2]], parents=[-1, 0, 1, 1, 0])
    shaped = c.shape(tree, 8)
    assert shaped.tokens == [t[0], t[1], t[2]] and shaped.parents == [-1, 0, 1]
    masks = c.masks(3)
    assert masks[3].sum() == 1 and masks[3, EOS_ID]  # after '[5]': complete, the end alone
    # a draft through the end: EOS is a leaf (what follows it goes), after it the end alone
    shaped = c.shape(Draft([*enc("[5]"), EOS_ID, *enc("1")]), 8)
    assert shaped.tokens == [*enc("[5]"), EOS_ID]
    ended = c.masks(4)
    assert ended[4].sum() == 1 and ended[4, EOS_ID]
    # the walks leave the matcher where it began: the root's mask and forced tokens are as before,
    # and it takes the committed text from there
    assert c.shape(Draft([]), 8).tokens == forced
    assert torch.equal(c.masks(0)[0], masks[0])
    assert c.advance(enc("[5")) is None and c.advance(enc("]")) == "stop"


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_a_grammar_that_dead_ends_ends_the_request(method: str) -> None:
    """A vocabulary of 'a', 'b', 'ab' under a grammar that wants "abc": after 'ab' (forced) no token
    goes on, and the request ends with DEAD_END (never a NaN distribution, an error or a hang)."""
    import llguidance

    bpe = RawTokenizer(models.BPE(vocab={"<eos>": 0, "a": 1, "b": 2, "ab": 3}, merges=[("a", "b")]))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    small = Vocabulary(Tokenizer(PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")), VOCAB_SIZE)
    c = constrain(small, llguidance.LLMatcher.grammar_from_lark('start: "ab" "c"'))
    tokens, reasons = run([([5, 6, 7], SamplingParams(max_new_tokens=20), method, c)], 1)
    assert reasons == [DEAD_END] and tokens == [[3]]


def test_bad_schemas_are_refused_by_name() -> None:
    with pytest.raises(GrammarError, match="objectx"):
        schema_constraint({"type": "objectx"})
    with pytest.raises(GrammarError, match="type must be json_object or json_schema"):
        grammar_text({"type": "yaml"})
    with pytest.raises(GrammarError, match="schema"):
        grammar_text({"type": "json_schema", "json_schema": {"schema": [1, 2]}})


def test_strict_refuses_keywords_the_library_does_not_implement_and_lenient_lets_them_pass() -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(GrammarError, match="uniqueItems"):
        schema_constraint(schema)
    lenient = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": False}}
    assert constrain(vocabulary(), grammar_text(lenient)).shape(Draft([]), 4).tokens == \
        tokenizer().encode("[", add_special_tokens=False)


def test_json_object_gives_an_object() -> None:
    c = constrain(vocabulary(), grammar_text({"type": "json_object"}))
    (out,), (reason,) = run([(prompt_for({}), SamplingParams(max_new_tokens=400, temperature=0.8, seed=3),
                              "ngram", c)], 1)
    if reason == "stop":
        assert isinstance(json.loads(text(out)), dict)
    else:  # a random model may write a long object; what it wrote is an object's start
        assert reason == "length" and text(out).startswith("{")


@pytest.mark.parametrize("method", ["ngram", "ngram-tree", "draft-same", "draft-random", "draft-tree"])
def test_sampled_outputs_validate_for_every_proposer(method: str) -> None:
    for i, schema in enumerate(SCHEMAS):
        params = SamplingParams(max_new_tokens=150, temperature=1.0, seed=10 + i)
        (out,), (reason,) = run([(prompt_for(schema), params, method, schema_constraint(schema))], 1)
        assert reason == "stop", (reason, text(out))
        jsonschema.validate(json.loads(text(out)), schema)


# -- the masked sampling law --------------------------------------------------------------------------------

T1 = SamplingParams(temperature=1.0)
V = 12
N_DRAWS = 40_000


def law_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [2, V] (the root, and after the draft's node), q [1, V], mask [2, V]."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(1, V, generator=g) * 2.0, -1)
    mask = torch.zeros(2, V, dtype=torch.bool)
    mask[0, [1, 3, 4, 7, 8, 10]] = True
    mask[1, [0, 2, 3, 9]] = True
    return logits, q, mask


def first_token_counts(mask_q: bool) -> torch.Tensor:
    """The first committed token of N_DRAWS verifications of a one-node draft drawn from q and cut
    (as the engine cuts it) when the grammar forbids it; mask_q=False: the verifier is not told
    the mask at q's position (q left unmasked: the negative control)."""
    logits, q, mask = law_case()
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(11)
    counts = torch.zeros(V)
    for _ in range(N_DRAWS):
        x = int(torch.multinomial(q[0], 1, generator=g))
        draft = Draft([x], q) if mask[0, x] else Draft([])
        m = mask[:1 + len(draft.tokens)]
        if not mask_q and draft.tokens:
            verdict = verify([draft], logits[None].masked_fill(~mask[None], float("-inf")), [params], [g])
        else:
            verdict = verify([draft], logits[None], [params], [g], [m])
        counts[verdict.tokens[0][0]] += 1
    return counts


def test_sampled_speculation_under_a_mask_follows_the_masked_target() -> None:
    """The first token's law is the masked target's, p = softmax(logits) on the allowed tokens,
    renormalized. A correct verifier fails with probability ALPHA (1e-6); seeded: deterministic."""
    logits, _, mask = law_case()
    p = probabilities(logits[:1].masked_fill(~mask[:1], float("-inf")), SamplingParams(temperature=1.0))[0]
    counts = first_token_counts(mask_q=True)
    assert counts[~mask[0]].sum() == 0
    assert chi_square_p_value(counts, p) > ALPHA


def test_negative_control_unmasked_q_is_rejected() -> None:
    """The same test rejects a verifier that masks p but tests drafts against q unmasked."""
    logits, _, mask = law_case()
    p = probabilities(logits[:1].masked_fill(~mask[:1], float("-inf")), SamplingParams(temperature=1.0))[0]
    assert chi_square_p_value(first_token_counts(mask_q=False), p) < ALPHA


def test_allowed_unpacks_bits_in_token_order() -> None:
    bits = torch.tensor([[-(1 << 31) | 1, 0, 1 << 3]], dtype=torch.int32)
    assert allowed(bits, 70)[0].nonzero().flatten().tolist() == [0, 31, 67]


# -- the masked law through the engine: a draft model under a grammar --------------------------------------

N_ENGINE = 1200


def two_letters_law() -> torch.Tensor:
    """[V16, V16]: the masked target's law of the first two tokens after PROMPT16 under 'two of a-f'."""
    law = plain_law(tiny16(), PROMPT16, T1, 2)  # [V, V] unmasked: renormalize each step over a-f
    allowed = torch.zeros(V16, dtype=torch.bool)
    allowed[:6] = True
    first = law.sum(1) * allowed
    second = law / law.sum(1, keepdim=True) * allowed
    second = second / second.sum(1, keepdim=True)
    return (first / first.sum())[:, None] * second


def engine_two_letters() -> tuple[torch.Tensor, int, int]:
    """Counts [V16, V16] of N_ENGINE seeded requests, 8 rows at a time, each drafting 3 tokens with a
    draft model (a noisy copy of the target: its q is not p) under the grammar 'two of a-f'."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark("start: /[a-f][a-f]/")
    drafter = Drafter(tiny16_draft())
    requests = []
    for seed in range(N_ENGINE):
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=4)
        requests.append(Request(PROMPT16, params, frozenset({15}), DraftModelProposer(drafter, PROMPT16, params, 16),
                                3, constraint=constrain(letters(), grammar), id=str(seed)))
    return first_tokens_in_batches(tiny16(), requests, 2)


@functools.lru_cache(maxsize=None)
def engine_counts() -> tuple[torch.Tensor, int, int]:
    return engine_two_letters()


def test_engine_under_a_grammar_samples_the_masked_target() -> None:
    """Sampled speculation with a draft model, drafts cut at forbidden tokens, q masked: the first
    two tokens follow the masked target's law (false failure ALPHA = 1e-6, seeded: deterministic)."""
    counts, drafted, accepted = engine_counts()
    assert 0 < accepted < drafted, (accepted, drafted)  # drafts verified, some rejected
    assert counts.sum() == N_ENGINE and counts[6:].sum() == 0 and counts[:, 6:].sum() == 0  # two of a-f each
    law = two_letters_law()
    assert counts[law == 0].sum() == 0
    assert chi_square_p_value(counts, law) > ALPHA


def test_engine_negative_control_the_unmasked_target_is_rejected() -> None:
    """The same draws against the target's law renormalized over a-f at the first token only (the
    second unmasked: what a verifier masking only position 0 would aim at) must fail."""
    counts, _, _ = engine_counts()
    law = plain_law(tiny16(), PROMPT16, T1, 2)
    allowed = torch.zeros(V16, dtype=torch.bool)
    allowed[:6] = True
    first = law.sum(1) * allowed
    wrong = (first / first.sum())[:, None] * (law / law.sum(1, keepdim=True))
    assert chi_square_p_value(counts, wrong) < ALPHA
