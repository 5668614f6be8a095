"""One pass over tokens of several cache rows, unpadded (Transformer.forward's `rows`): what the
engine feeds when a prompt's chunk rides along with the decode rows' step. Each token's hidden
state, logits and K/V must be bitwise those of a pass of its own row alone, or the mixed step
would change outputs (and the prefix cache would hold other bits than a one-pass prefill)."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from tiny_models import hf_model, ours_from_hf

# a plain family; windows (Mistral: one window for all layers; Gemma 3: local and global layers
# with rotary bases of their own), whose masks are built per query's row in a ragged pass
NAMES = ["llama-gqa-untied", "mistral-window", "gemma3-sandwich"]


def _model(name: str, quantized: bool):
    return ours_from_hf(hf_model(name), qtype=GGMLQuantizationType.Q8_0 if quantized else None)


def _prefill(model, cache, row: int, tokens: list[int]) -> None:
    model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache.rows(row, row + 1), last_n=0)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q8_0"])
@pytest.mark.parametrize("name", NAMES)
@torch.inference_mode()
def test_a_ragged_pass_gives_each_row_the_bits_of_its_own_pass(name, quantized):
    model = _model(name, quantized)
    assert model.ragged
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (21, 13, 30)]
    # row 0 decodes a tree (root, two children of it, a grandchild: slots differ from positions),
    # row 1 one token, row 2 is a prompt whose tokens 11..29 are prefilled in this pass
    tree_ids, tree_depth, tree_parent = [5, 17, 40, 8], [0, 1, 1, 2], [-1, 0, 0, 1]
    segments = []  # (row, ids, positions, slots, mask [T, kv] or None)
    L0 = len(prompts[0])
    kv = L0 + 4
    mask0 = torch.arange(kv)[None, :] < L0
    mask0 = mask0.expand(4, -1).clone()
    for i in range(4):
        j = i
        while j >= 0:
            mask0[i, L0 + j] = True
            j = tree_parent[j]
    segments.append((0, tree_ids, [L0 + d for d in tree_depth], [L0 + i for i in range(4)], mask0))
    segments.append((1, [33], [13], [13], None))
    segments.append((2, prompts[2][11:], list(range(11, 30)), list(range(11, 30)), None))

    def fresh():
        cache = model.new_cache(3, 64)
        _prefill(model, cache, 0, prompts[0])
        _prefill(model, cache, 1, prompts[1])
        _prefill(model, cache, 2, prompts[2][:11])
        return cache

    alone_cache = fresh()
    alone = []
    for row, ids, pos, slots, mask in segments:
        out = model(torch.tensor([ids]), torch.tensor([pos]), alone_cache.rows(row, row + 1),
                    None if mask is None else mask[None], slots=torch.tensor([slots]))
        alone.append(out)

    ragged_cache = fresh()
    ids = sum((s[1] for s in segments), [])
    positions = sum((s[2] for s in segments), [])
    slots = sum((s[3] for s in segments), [])
    rows = sum(([s[0]] * len(s[1]) for s in segments), [])
    kv_len = max(slots) + 1
    mask = torch.arange(kv_len)[None, :] <= torch.tensor(slots)[:, None]  # [T, kv]: causal in each row
    at = 0
    for _, seg_ids, _, _, seg_mask in segments:
        if seg_mask is not None:
            mask[at:at + len(seg_ids)] = False
            mask[at:at + len(seg_ids), :seg_mask.shape[1]] = seg_mask
        at += len(seg_ids)
    out = model(torch.tensor([ids]), torch.tensor([positions]), ragged_cache.rows(0, 3), mask[None],
                slots=torch.tensor([slots]), rows=torch.tensor(rows))

    at = 0
    for (row, seg_ids, _, seg_slots, _), ref in zip(segments, alone):
        n = len(seg_ids)
        assert torch.equal(out.hidden[0, at:at + n], ref.hidden[0]), f"row {row}: hidden states differ"
        assert torch.equal(out.logits[0, at:at + n], ref.logits[0]), f"row {row}: logits differ"
        mine, theirs = ragged_cache.read(row, 0, kv_len), alone_cache.read(row, 0, kv_len)
        assert torch.equal(mine[..., seg_slots, :], theirs[..., seg_slots, :]), f"row {row}: K/V differ"
        at += n


@torch.inference_mode()
def test_a_ragged_pass_is_refused_where_attention_runs_in_torch(monkeypatch):
    """torch's attention reads keys by batch row: a pass that cannot give each token its own row's
    keys must fail, not attend over another row's."""
    model = _model("llama-gqa-untied", quantized=False)
    monkeypatch.setattr("quickdraft.kernels.rope_attention_usable", lambda *a: False)
    monkeypatch.setattr("quickdraft.model.llama.kernels.rope_attention_usable", lambda *a: False)
    cache = model.new_cache(2, 16)
    with pytest.raises(ValueError, match="ragged"):
        model(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 0]]), cache, slots=torch.tensor([[0, 1, 0]]),
              rows=torch.tensor([0, 0, 1]))


# -- the engine: prompts' chunks ride along with the decode rows' passes ------------------------------

LONG = [(i * 7 + 3) % 90 + 1 for i in range(45)]  # prompts of several chunks


@pytest.mark.parametrize("ragged", [True, False], ids=["riding", "passes-of-their-own"])
def test_chunks_that_ride_along_change_no_output(ragged, monkeypatch):
    """Prompts prefilled in chunks of 5 while other rows decode (greedy, seeded sampling, drafts and
    trees): every request's tokens equal its own run alone, every row's K/V those of a fresh
    forward; in ragged passes the chunks shared the decode rows' pass (counted), otherwise they ran
    in passes of their own (the padded path, as on CUDA)."""
    from quickdraft.engine.batch import EngineConfig
    from quickdraft.model.llama import Transformer
    from support.engine import Job, draft_same, greedy, ngram, run_batched, target

    model = target()
    monkeypatch.setattr(Transformer, "ragged", property(lambda self: ragged))
    shared = []  # per pass fed as one sequence: (cache rows, tokens)
    forward = model.forward

    def counted(tokens, positions, cache, *args, rows=None, **kw):
        if rows is not None:
            shared.append((len(set(rows.tolist())), tokens.shape[1]))
        return forward(tokens, positions, cache, *args, rows=rows, **kw)
    monkeypatch.setattr(model, "forward", counted)
    jobs = [
        Job([1, 17, 42, 8, 77, 23], greedy(40), None, 0),
        Job(LONG, greedy(20), ngram, 4, join_at=2),
        Job(LONG[::-1], greedy(20, temperature=1.0, seed=7), draft_same, 3, join_at=3),
        Job(LONG[5:], greedy(25), None, 0, join_at=4),
    ]
    out, _, violations = run_batched(model, jobs, EngineConfig(max_batch=3, prefill_chunk=5))
    assert violations == []
    for i, job in enumerate(jobs):
        assert out[str(i)] == job.alone(model), f"request {i} differs from its run alone"
    if ragged:
        assert sum(rows > 1 for rows, _ in shared) > 10  # the premise: chunks rode with decode rows
    else:
        assert shared == []
