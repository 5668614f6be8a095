"""Every family (issue 31), each a row of model/families.py: Llama, Qwen2 (q/k/v biases), Mistral with
a true sliding window, Qwen3 (QK-norm per head), OLMo 2 (post-norms, QK-norm over the
projection), Phi-3 (fused q|k|v and gate|up, a window), Gemma 2 (sandwich norms, soft-caps,
alternating windows) and Gemma 3 (sandwich norms, QK-norm, a RoPE base per layer type), and GELU
gates in any family.

Oracles: transformers' greedy tokens on the same tiny random weights (safetensors and a float GGUF;
the prompt is longer than every window), plain against speculative (prompt lookup as a chain and
as a tree, the target as its own draft) and each request alone against the engine's batch; a GGUF
of Q8_0 blocks (the fused C layer, layer.c) against its own dequantized model and against itself
in other batches, bitwise; a tree's nodes against decoding their paths; torch's attention path
against transformers. What each row reads and refuses: test_family_specs.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

import quickdraft
from quickdraft.kernels import QuantizedWeight
from quickdraft.model.build import build_transformer
from quickdraft.model.llama import RMSNorm
from quickdraft.proposers import SpecConfig
from support.families import GREEDY, N, run_engine
from tiny_models import (
    BASE,
    CONFIGS,
    NEW_FAMILIES,
    hf_model,
    ours_from_hf,
    quantized_tensors,
    save_hf_dir,
    transformers_greedy,
)
from tiny_tokenizer import (
    assert_every_proposer,
    assert_plain_and_speculative,
    both_formats,
    save_tokenizer,
    tiny_model,
    write_llama_gguf,
)

PROMPT = "the cat sat on the mat; the cat sat on the"
PROMPTS = [PROMPT, "hello world, hello", "STOP the cat"]


def window_of(name: str) -> int | None:
    return CONFIGS[name].get("sliding_window")


@pytest.fixture(scope="module", params=["llama-gqa-untied", "qwen2-qkv-bias", *NEW_FAMILIES])
def files(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """A family's tiny model as a safetensors directory and as a float32 GGUF (with its window)."""
    name = request.param
    return name, *both_formats(name, tmp_path_factory.mktemp(name), window=window_of(name))


@pytest.fixture(scope="module")
def expected(files) -> dict[str, list[int]]:
    """transformers' 16 greedy tokens for each prompt."""
    name, directory, _ = files
    llm = quickdraft.load(directory)
    hf = tiny_model(name)
    return {p: transformers_greedy(hf, llm.tokenizer.encode(p), N) for p in PROMPTS}


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_greedy_tokens_equal_transformers_plain_and_speculative(files, expected, fmt):
    name, directory, gguf = files
    path = directory if fmt == "safetensors" else gguf
    llm = quickdraft.load(path)
    config = llm.model.config
    assert config.model_type == (CONFIGS[name]["model_type"] if fmt == "safetensors" or name != "mistral-window"
                                 else "llama")
    window = window_of(name)
    ids = llm.tokenizer.encode(PROMPT)
    if window:  # the premise: queries see fewer keys than the prompt has
        assert max(w or 0 for w in config.layer_windows) == window < len(ids)
    assert_plain_and_speculative(llm, path, PROMPT, N, expected[PROMPT])


def test_every_proposer_without_a_trained_head_gives_plain_greedy_tokens(files, expected):
    """Speculation on each family: every registered proposer that needs no trained head (those
    drafting with a model take the target itself) commits transformers' greedy tokens."""
    name, directory, _ = files
    assert_every_proposer(quickdraft.load(directory), directory, PROMPT, N, expected[PROMPT])


def test_the_engines_batch_gives_each_request_transformers_tokens(files, expected):
    name, directory, _ = files
    llm = quickdraft.load(directory)
    for spec in (SpecConfig("ngram", k=4), SpecConfig("ngram-tree", k=6)):
        assert run_engine(llm, PROMPTS, spec) == expected, spec.method


# -- the fused C layer (layer.c) over GGUF blocks ---------------------------------------------------

@pytest.fixture(scope="module")
def q8(files, tmp_path_factory) -> Path:
    name, _, _ = files
    return write_llama_gguf(tiny_model(name), tmp_path_factory.mktemp("q8") / "model.gguf",
                            qtype=GGMLQuantizationType.Q8_0, window=window_of(name))


def logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache(1, len(ids))).logits[0]


def test_gguf_blocks_run_the_fused_layer_close_to_their_dequantized_model(files, q8):
    _, directory, _ = files
    stored, dense = quickdraft.load(q8), quickdraft.load(q8, dequantize=True)
    assert "Q8_0" in stored.model.weight_format and dense.model.weight_format == "float32"
    ids = stored.tokenizer.encode(PROMPT)
    ours = logits(stored.model, ids)
    assert all(block.fused is not None for block in stored.model.blocks)  # layer.c ran every layer
    ref = logits(dense.model, ids)
    # int16 activations against float32: within ~2e-3 of the logits' spread (Gemma's norm gains up to
    # 2.5 in 12 norms a pass); a wrong norm, gate or window is ~1
    assert (ours - ref).abs().max() <= 5e-3 * ref.abs().max()


def test_gguf_blocks_are_batch_invariant_and_speculation_is_exact(q8):
    """A row's bits do not depend on the other rows of a pass: the engine's batch gives every
    request its tokens alone, and speculative decoding (chain, tree, self-draft) plain's."""
    llm = quickdraft.load(q8)
    alone = {p: llm.generate(p, params=GREEDY).token_ids for p in PROMPTS}
    assert run_engine(llm, PROMPTS, SpecConfig("ngram", k=4)) == alone
    for spec in (SpecConfig("ngram-tree", k=6, adaptive=False),
                 SpecConfig("draft", k=4, draft_model=str(q8), adaptive=False)):
        assert llm.generate(PROMPT, params=GREEDY, spec=spec).token_ids == alone[PROMPT], spec.method


def test_a_pass_past_the_mlp_row_chunk_gives_each_row_its_bits_alone(q8):
    """layer.c runs the MLP half MLP_ROWS (256) rows at a time: a pass of 3 x 200 rows, split at
    rows 256 and 512 in the middle of a sequence, gives every row the bits of its sequence alone
    (200 rows: one piece), post-norm families included."""
    model = quickdraft.load(q8).model
    ids = torch.randint(3, 96, (3, 200), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(200).expand(3, 200)
    both = model(ids, positions, model.new_cache(3, 200), last_n=0).hidden
    assert all(block.fused is not None for block in model.blocks)
    for b in range(3):
        alone = model(ids[b:b + 1], positions[:1], model.new_cache(1, 200), last_n=0).hidden[0]
        assert torch.equal(both[b], alone), b


def test_features_are_the_kept_layers_outputs_side_by_side(q8):
    """keep_features (a draft head that fuses layers): each position's features are the kept layers'
    outputs as each layer returned them (a later layer writes none of them again), the last layer's
    last; the logits and the last layer's output are those of the model keeping that layer alone."""
    model = quickdraft.load(q8).model
    L, D = model.config.num_layers, model.config.hidden_size
    layers = tuple(sorted({0, L // 2, L - 1}))
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(30).expand(2, 30)
    alone = model(ids, positions, model.new_cache(2, 30))
    assert alone.features is alone.hidden and model.feature_width == D
    seen = {}
    hooks = [model.blocks[i].register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out.clone()))
             for i in layers]
    model.keep_features(layers)
    kept = model(ids, positions, model.new_cache(2, 30))
    for hook in hooks:
        hook.remove()
    assert model.feature_width == len(layers) * D
    assert torch.equal(kept.features, torch.cat([seen[i] for i in layers], dim=-1))
    assert torch.equal(kept.hidden, alone.hidden) and torch.equal(kept.logits, alone.logits)
    assert torch.equal(model.logits(kept.features), alone.logits)
    for wrong in ((0,), (L - 1, 0), (0, 0, L - 1), (-1, L - 1), ()):
        with pytest.raises(ValueError, match="feature layers must be distinct, ascending, and end with the last"):
            model.keep_features(wrong)


# -- GELU gates ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, gate", [("llama-gelu-tanh", "gelu_tanh"), ("qwen2-gelu-erf", "gelu")])
def test_a_gelu_gate_runs_in_every_c_path(name, gate):
    """hidden_act gelu_pytorch_tanh / gelu (erf): the float model equals transformers (the parity
    suite too), and GGUF blocks run the fused layer with the same gate, close to their float32
    dequantization and each row the same bits in any batch."""
    hf = hf_model(name)
    ours = ours_from_hf(hf)
    assert ours.config.activation == gate
    # 3 x 20 rows: a float LM head (the tied, unquantized table) is batch-invariant up to 64 rows
    tokens = torch.randint(0, BASE["vocab_size"], (3, 20), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(20).expand(3, 20)
    with torch.no_grad():
        ref = hf(tokens).logits
    torch.testing.assert_close(ours(tokens, positions, ours.new_cache(3, 32)).logits, ref, atol=1e-4, rtol=0)
    q8 = ours_from_hf(hf, qtype=GGMLQuantizationType.Q8_0)
    batch = q8(tokens, positions, q8.new_cache(3, 32)).logits
    assert all(block.fused is not None for block in q8.blocks)
    dense = build_transformer(q8.config, {k: v.dequantize() if isinstance(v, QuantizedWeight) else v
                                          for k, v in quantized_tensors(hf_tensors(hf), GGMLQuantizationType.Q8_0).items()})
    expected = dense(tokens, positions, dense.new_cache(3, 32)).logits
    assert (batch - expected).abs().max() <= 2e-3 * expected.abs().max()
    for i in range(3):
        alone = q8(tokens[i:i + 1], positions[:1], q8.new_cache(1, 32)).logits
        assert torch.equal(alone[0], batch[i]), i


def hf_tensors(hf) -> dict[str, torch.Tensor]:
    tensors = dict(hf.state_dict())
    if hf.config.tie_word_embeddings:
        del tensors["lm_head.weight"]
    return tensors


# -- Gemma 3 ------------------------------------------------------------------------------------

def test_gemma3_scales_scores_by_query_pre_attn_scalar_and_rotates_sliding_layers_with_their_base():
    """Gemma 3 27B scores by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5; sliding layers
    rotate with rope_local_base_freq, full ones with rope_theta (and its scaling): each must show in
    the logits, against transformers."""
    tokens = torch.randint(0, BASE["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(30).expand(2, 30)
    for overrides in (dict(query_pre_attn_scalar=24, tie_word_embeddings=True), dict(rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=2.0, rope_theta=5e5),
            sliding_attention=dict(rope_type="default", rope_theta=300.0)))):
        hf = hf_model("gemma3-sandwich", **overrides)
        ours = ours_from_hf(hf)
        with torch.no_grad():
            ref = hf(tokens).logits
        torch.testing.assert_close(ours(tokens, positions, ours.new_cache(2, 32)).logits, ref, atol=1e-4, rtol=0)
    assert (ours.config.rope_theta, ours.config.rope_local_theta, ours.config.rope_scaling.factor) == (5e5, 300.0, 2.0)


@pytest.mark.parametrize("name", ["mistral-window", "qwen3-window-layer", "gemma2-softcap", "gemma3-sandwich"])
def test_the_torch_attention_path_equals_transformers(name, monkeypatch):
    """Where the C attention does not run (CUDA, other dtypes) torch's does: SDPA with the window's
    mask, or soft-capped scores written out (SDPA cannot cap). Forced here on CPU."""
    from quickdraft import kernels
    monkeypatch.setattr(kernels, "rope_attention_usable", lambda *args: False)
    hf = hf_model(name)
    ours = ours_from_hf(hf)
    tokens = torch.randint(0, BASE["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
    out = ours(tokens, torch.arange(30).expand(2, 30), ours.new_cache(2, 32)).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_a_draft_head_of_each_family_runs_its_block_row_by_row(name):
    """proposers/head.py's DraftHead is one Block shaped as the target's first layer (Gemma 3's: a
    sliding layer, rotating with the head's one table): it runs on every family, each row of a batch
    the bits it has alone."""
    from quickdraft.proposers.head import DraftHead
    config = ours_from_hf(hf_model(name)).config
    torch.manual_seed(0)
    head = DraftHead(config).requires_grad_(False)  # drafting: the C kernels, as in a proposal
    for p in head.parameters():
        torch.nn.init.normal_(p, 0.5 if p.ndim == 1 else 0.0, 0.1)
    g = torch.Generator().manual_seed(1)
    f, e = (torch.randn(2, 5, config.hidden_size, generator=g) for _ in range(2))
    both = head(f, e, torch.arange(5).expand(2, 5), head.new_cache(8, torch.device("cpu"), torch.float32, 2))
    for i in range(2):
        alone = head(f[i:i + 1], e[i:i + 1], torch.arange(5)[None], head.new_cache(8, torch.device("cpu"), torch.float32))
        assert torch.equal(alone[0], both[i]), i


# -- windows in trees and batches -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mistral-window", "qwen3-window-layer"])
@pytest.mark.parametrize("fmt", ["float", "q8"])
def test_a_tree_node_past_the_window_equals_decoding_its_path(name, fmt, tmp_path):
    """Nodes at depth positions in slots with gaps (a tree after a prompt longer than the window)
    see exactly the keys decoding their path sees: bitwise on CPU (float: the rope_attention
    kernel; q8: the fused layer)."""
    if fmt == "float":
        model = quickdraft.load(save_tokenizer(save_hf_dir(tiny_model(name), tmp_path / "m"))).model
    else:
        model = quickdraft.load(write_llama_gguf(tiny_model(name), tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q8_0,
                                                 window=window_of(name))).model
    prompt = list(range(10, 30))  # 20 tokens, windows of 8 and 6
    parents = [-1, -1, 0, 1, 2, 2, 4]
    tokens = [40, 41, 42, 43, 44, 45, 46]
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    n, T = len(prompt), len(parents)
    cache = model.new_cache(1, n + T + 8)
    model(torch.tensor([prompt]), torch.arange(n)[None], cache)
    visible = torch.zeros(1, T, n + T, dtype=torch.bool)
    visible[..., :n] = True
    for i in range(T):
        j = i
        while j >= 0:
            visible[0, i, n + j] = True
            j = parents[j]
    tree = model(torch.tensor([tokens]), torch.tensor([[n + d for d in depth]]), cache, attn_mask=visible,
                 slots=torch.arange(n, n + T)[None]).logits[0]
    for leaf in (3, 6):  # paths 1-3 and 0-2-4-6
        path, j = [], leaf
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        step_cache = model.new_cache(1, n + T + 8)
        model(torch.tensor([prompt]), torch.arange(n)[None], step_cache)
        for s, node in enumerate(path):
            out = model(torch.tensor([[tokens[node]]]), torch.tensor([[n + s]]), step_cache).logits[0, 0]
            assert torch.equal(out, tree[node]), (leaf, node, float((out - tree[node]).abs().max()))


def test_rows_at_other_positions_see_their_own_window(tmp_path):
    """Two rows in one pass, one past its window and one not: each row's logits are its alone, bitwise."""
    model = quickdraft.load(save_tokenizer(save_hf_dir(tiny_model("mistral-window"), tmp_path / "m"))).model
    prompts = [list(range(3, 23)), list(range(50, 55))]  # 20 and 5 tokens: window 8
    alone = [logits(model, p)[-1] for p in prompts]
    cache = model.new_cache(2, 32)
    width = max(map(len, prompts))
    batch = torch.tensor([p + [5] * (width - len(p)) for p in prompts])
    out = model(batch, torch.arange(width).expand(2, width), cache).logits
    for i, p in enumerate(prompts):
        assert torch.equal(out[i, len(p) - 1], alone[i]), i


# -- torch's per-token ops are batch-invariant -----------------------------------------------------

def test_rmsnorm_over_the_last_dim_gives_a_row_the_same_bits_in_any_batch():
    """The QK-norms and OLMo 2's post-norms run in torch (F.rms_norm per row) outside the fused
    layer: a row's result must not depend on how many rows come with it, at any width those norms
    take (a head, a projection, the hidden size) and any row count up to and past a pass's 64."""
    g = torch.Generator().manual_seed(0)
    for dim in (16, 64, 96, 2048):
        norm = RMSNorm(dim, 1e-6)
        norm.weight.data = torch.rand(dim, generator=g) + 0.5
        x = torch.randn(130, dim, generator=g) * 3
        alone = torch.cat([norm(x[i:i + 1]) for i in range(len(x))])
        for rows in (2, 7, 64, 130):
            assert torch.equal(norm(x[:rows]), alone[:rows]), (dim, rows)
        assert torch.equal(norm(x.view(10, 13, dim)).view(130, dim), alone)


@pytest.mark.parametrize("name, layers", [("gemma2-softcap", 46), ("gemma3-sandwich", 62)])
def test_a_gemma_27b_gguf_scales_scores_as_llama_cpp_does(name, layers, tmp_path):
    """Gemma's 27B scores by query_pre_attn_scalar = hidden / heads (144), not head_dim (128), and
    its GGUF does not record it: at that layer count the loader takes hidden / heads, as llama.cpp
    does for those files. A tiny model of the same shape (head_dim 8, hidden / heads 16) agrees
    with transformers; its layer count with head_dim's scale would not."""
    hf = tiny_model(name, num_hidden_layers=layers, head_dim=8, query_pre_attn_scalar=16)
    llm = quickdraft.load(write_llama_gguf(hf, tmp_path / "m.gguf", window=window_of(name)))
    assert llm.model.config.attn_scale == 16 ** -0.5
    tokens = torch.randint(3, BASE["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(tokens).logits
    ours = llm.model(tokens, torch.arange(24)[None], llm.model.new_cache(1, 32)).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    unscaled = tiny_model(name, num_hidden_layers=layers, head_dim=8, query_pre_attn_scalar=8)
    with torch.no_grad():  # the premise: head_dim's scale gives other logits
        assert (unscaled(tokens).logits - ref).abs().max() > 1e-2
