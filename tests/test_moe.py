"""Mixtures of experts (issue 48): Qwen3-MoE (8 experts, top-2, QK-norm, top-k weights renormalized
or not), Mixtral (4 experts, top-2; GGUF architecture "llama" with stacked expert tensors) and
gpt-oss (4 biased experts with its clamped SwiGLU, top-2 of the logits softmaxed, attention sinks,
alternating sliding and full layers, unrounded YaRN), each a row of model/families.py, the experts
run by model/experts.py.

Oracles: transformers' own router on the same logits (weights bitwise, same experts), its logits
and its 16 greedy tokens on the same tiny random weights, from safetensors and from a float GGUF
written as llama.cpp's converter writes it; plain against speculative (prompt lookup as a chain and
as a tree, the model as its own draft, a chain and a tree) and each request alone against the
engine's batch; a row alone against the same row in a batch of 3, bitwise (float weights, and Q8_0
expert blocks kept as stored); the exact law of sampled tokens with an MoE target and draft (with a
negative control). What is not implemented is refused by name.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config

import quickdraft
from quickdraft import SamplingParams
from quickdraft.engine.loop import generate_tokens
from quickdraft.errors import ModelLoadError, UnsupportedArchitecture
from quickdraft.kernels import QuantizedWeight
from quickdraft.kernels.experts import run_experts
from quickdraft.model.build import build_transformer
from quickdraft.model.config import ModelConfig
from quickdraft.model.llama import Transformer
from quickdraft.proposers import SpecConfig
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.weights.gguf_file import config_from_metadata, open_reader, read_metadata
from support.families import run_engine
from support.laws import (
    ALPHA,
    N_SAMPLES,
    N_TOKENS,
    PROMPT16,
    SAMPLE_K,
    SAMPLE_NEW,
    assert_plain_sampling_law,
    chi_square_p_value,
    plain_law,
)
from support.models import V16
from tiny_models import (
    BASE,
    MOE_CONFIGS,
    checkpoint_tensors,
    hf_model,
    mxfp4_experts,
    ours_from_hf,
    save_mxfp4_dir,
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
N = 16
GREEDY = SamplingParams(max_new_tokens=N, ignore_eos=True)


def logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    B, T = tokens.shape
    return model(tokens, torch.arange(T).expand(B, T), model.new_cache(B, T)).logits


def random_tokens(rows: int, length: int, vocab: int = BASE["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0))


# -- routing and logits against transformers ------------------------------------------------------

@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_routing_is_transformers_own(name):
    """The same router logits give transformers' weights bitwise and the same experts: softmax in
    float32 over every expert, top-k, renormalized where the config says (Mixtral always)."""
    hf = hf_model(name)
    ours = ours_from_hf(hf)
    mlp = hf.model.layers[0].mlp
    router, experts = getattr(mlp, "router", None) or mlp.gate, ours.blocks[0].moe
    h = torch.randn(50, BASE["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        router_logits, their_weights, their_experts = router(h)
    weights, chosen = experts.route(router_logits)
    assert torch.equal(chosen, their_experts) and torch.equal(weights.to(their_weights.dtype), their_weights)
    normalized = MOE_CONFIGS[name]["model_type"] in ("mixtral", "gpt_oss") or MOE_CONFIGS[name]["norm_topk_prob"]
    assert torch.allclose(weights.sum(-1), torch.ones(50)) == normalized


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_logits_equal_transformers(name):
    """Weights ~N(0, 0.2) (as the greedy tests' models): in each layer most experts are chosen by
    some token (the premise: routing decides the output)."""
    hf = hf_model(name, initializer_range=0.2)
    ours = ours_from_hf(hf)
    assert ours.config.num_experts == MOE_CONFIGS[name].get("num_experts", MOE_CONFIGS[name].get("num_local_experts"))
    tokens = random_tokens(2, 40)
    chosen = []
    hooks = [(getattr(layer.mlp, "router", None) or layer.mlp.gate).register_forward_hook(
        lambda m, args, out: chosen.append(out[2])) for layer in hf.model.layers]
    with torch.no_grad():
        ref = hf(tokens).logits
    for hook in hooks:
        hook.remove()
    assert len(chosen) == 2 and all(len(c.unique()) > ours.config.num_experts // 2 for c in chosen)
    torch.testing.assert_close(logits(ours, tokens), ref, atol=1e-4, rtol=0)


def test_renormalizing_the_top_k_weights_shows_in_the_logits():
    hf = hf_model("qwen3moe", initializer_range=0.2)
    tokens = random_tokens(1, 20)
    normalized = logits(ours_from_hf(hf), tokens)
    hf.config.norm_topk_prob = False
    for layer in hf.model.layers:
        layer.mlp.gate.norm_topk_prob = False
    with torch.no_grad():
        ref = hf(tokens).logits
    unnormalized = logits(ours_from_hf(hf), tokens)
    torch.testing.assert_close(unnormalized, ref, atol=1e-4, rtol=0)
    assert (normalized - unnormalized).abs().max() > 100 * 1e-4  # far past the tolerance


@pytest.mark.parametrize("change", ["no sinks", "silu experts", "softmax before the top k"])
def test_gpt_oss_sinks_clamped_experts_and_routing_each_show_in_the_logits(change):
    """The negative controls of gpt-oss's parity: each of its own pieces, replaced by the other
    families' (no sinks, plain SwiGLU, Qwen's routing order), moves the logits far past the tolerance."""
    hf = hf_model("gptoss", initializer_range=0.2)
    tokens = random_tokens(2, 40)
    with torch.no_grad():
        ref = hf(tokens).logits
    ours = ours_from_hf(hf)
    for block in ours.blocks:
        if change == "no sinks":
            block.sinks, block.fused = None, None
        elif change == "silu experts":
            block.moe.gate, block.moe.fused = "silu", None
        else:
            block.moe.topk_first = False
    assert (logits(ours, tokens) - ref).abs().max() > 1000 * 1e-4


# -- greedy tokens from both formats, plain and speculative -------------------------------------------

@pytest.fixture(scope="module", params=["qwen3moe", "mixtral", "gptoss"])
def files(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """A family's tiny model as a safetensors directory and as a float32 GGUF."""
    name = request.param
    return name, *both_formats(name, tmp_path_factory.mktemp(name))


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
    assert llm.model.config.model_type == MOE_CONFIGS[name]["model_type"]  # a "llama" GGUF with experts: Mixtral
    assert_plain_and_speculative(llm, path, PROMPT, N, expected[PROMPT])
    spec = SpecConfig("draft-tree", k=6, draft_model=str(path), adaptive=False)
    assert llm.generate(PROMPT, params=GREEDY, spec=spec).token_ids == expected[PROMPT]


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_every_proposer_without_a_trained_head_gives_transformers_tokens(files, expected, fmt):
    """Each MoE family from each format under every proposer that needs no trained head (the
    heads' own test drafts on each family: test_head.py)."""
    _, directory, gguf = files
    path = directory if fmt == "safetensors" else gguf
    assert_every_proposer(quickdraft.load(path), path, PROMPT, N, expected[PROMPT])


def test_unnormalized_routing_from_safetensors_gives_transformers_tokens(tmp_path):
    """Qwen3-MoE's default (norm_topk_prob false); its GGUF would be renormalized, as llama.cpp runs it."""
    directory, _ = both_formats("qwen3moe-unnormalized", tmp_path)
    llm = quickdraft.load(directory)
    assert not llm.model.config.norm_topk and llm.model.config.qkv_bias
    ids = llm.tokenizer.encode(PROMPT)
    assert_plain_and_speculative(llm, directory, PROMPT, N, transformers_greedy(tiny_model("qwen3moe-unnormalized"),
                                                                               ids, N))


def test_the_engines_batch_gives_each_request_transformers_tokens(files, expected):
    _, directory, _ = files
    llm = quickdraft.load(directory)
    for spec in (SpecConfig("ngram", k=4), SpecConfig("ngram-tree", k=6)):
        assert run_engine(llm, PROMPTS, spec) == expected, spec.method


# -- batch invariance; expert blocks kept as stored ---------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3moe", "mixtral", "gptoss"])
def test_a_row_alone_is_bitwise_the_same_row_in_a_batch_of_3(name):
    """3 x 20 rows (float weights: the C kernel's up to 64 rows a pass); the rows route to different
    experts, so each expert's matmul sees another set of rows in the batch than alone."""
    ours = ours_from_hf(hf_model(name))
    tokens = random_tokens(3, 20)
    batch = logits(ours, tokens)
    for i in range(3):
        assert torch.equal(logits(ours, tokens[i:i + 1])[0], batch[i]), i


def test_mxfp4_checkpoints_run_as_stored_and_give_transformers_tokens(tmp_path):
    """gpt-oss's published safetensors (experts as MXFP4 blocks and scales, quantization_config mxfp4)
    load as stored: their experts are MXFP4 blocks the kernel runs, and the greedy tokens are those of
    transformers reading the same files (its own unpacking, dequantized), plain and speculative;
    `dequantize` loads their float values, with transformers' logits."""
    path = save_tokenizer(save_mxfp4_dir(mxfp4_experts(tiny_model("gptoss")), tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.float32)
    llm = quickdraft.load(path)
    weight = llm.model.blocks[1].moe.experts[3].w_down.weight
    assert isinstance(weight, QuantizedWeight) and weight.parts[0].qtype == GGMLQuantizationType.MXFP4
    assert "MXFP4" in llm.model.weight_format
    ids = llm.tokenizer.encode(PROMPT)
    assert_plain_and_speculative(llm, path, PROMPT, N, transformers_greedy(hf, ids, N))
    floats = quickdraft.load(path, dequantize=True)
    assert not floats.model.quantized
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits(floats.model, torch.tensor([ids]))[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("drop, message", [
    ("model.layers.0.mlp.experts.down_proj_scales", "down_proj_blocks has no model.layers.0.mlp.experts.down_proj_scales"),
    ("model.layers.1.mlp.experts.gate_up_proj_blocks", "gate_up_proj_scales has no model.layers.1.mlp.experts.gate_up_proj_blocks"),
])
def test_an_mxfp4_matrix_missing_half_is_refused_by_name(tmp_path, drop, message):
    path = save_tokenizer(save_mxfp4_dir(tiny_model("gptoss"), tmp_path / "hf"))
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[drop]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=message):
        quickdraft.load(path)


@pytest.fixture(scope="module", params=["qwen3moe", "mixtral", "gptoss", "gptoss-mxfp4"])
def q8(request, tmp_path_factory) -> Path:
    """Q8_0 matrices (gpt-oss-mxfp4: its experts in MXFP4, as gpt-oss's files hold them)."""
    name, _, experts = request.param.partition("-")
    return write_llama_gguf(tiny_model(name), tmp_path_factory.mktemp("q8") / "model.gguf",
                            qtype=GGMLQuantizationType.Q8_0,
                            expert_qtype=GGMLQuantizationType.MXFP4 if experts else None)


def test_mxfp4_experts_run_as_stored_and_give_transformers_tokens(tmp_path):
    """gpt-oss whose experts hold MXFP4 values (transformers runs the same numbers as floats), written
    as its GGUFs are (MXFP4 experts): the experts stay MXFP4 blocks, and the greedy tokens are
    transformers', plain and speculative."""
    hf = mxfp4_experts(tiny_model("gptoss"))
    path = write_llama_gguf(hf, tmp_path / "model.gguf", expert_qtype=GGMLQuantizationType.MXFP4)
    llm = quickdraft.load(path)
    weight = llm.model.blocks[1].moe.experts[3].w_down.weight
    assert isinstance(weight, QuantizedWeight) and weight.parts[0].qtype == GGMLQuantizationType.MXFP4
    assert "MXFP4" in llm.model.weight_format
    expected = transformers_greedy(hf, llm.tokenizer.encode(PROMPT), N)
    assert_plain_and_speculative(llm, path, PROMPT, N, expected)


def test_q8_experts_run_as_stored_close_to_their_dequantized_model(q8):
    stored, dense = quickdraft.load(q8), quickdraft.load(q8, dequantize=True)
    experts = stored.model.blocks[0].moe.experts
    assert all(isinstance(e.w_gate_up.weight, QuantizedWeight) and isinstance(e.w_down.weight, QuantizedWeight)
               for e in experts)
    assert not isinstance(stored.model.blocks[0].moe.router.weight, QuantizedWeight)  # F32, as llama.cpp keeps it
    assert "Q8_0" in stored.model.weight_format and dense.model.weight_format == "float32"
    tokens = torch.tensor([stored.tokenizer.encode(PROMPT)])
    ours, ref = logits(stored.model, tokens), logits(dense.model, tokens)
    assert (ours - ref).abs().max() <= 5e-3 * ref.abs().max()


def test_the_c_experts_are_the_torch_loops_experts_bit_for_bit(q8, monkeypatch):
    """experts.c runs the same matmuls in the same order as the torch loop over GGUF experts: the
    same logits to the bit over a 30-row pass, the same layer output for a decode's one row; other
    weights give other sums (a negative control)."""
    llm = quickdraft.load(q8)
    moe = llm.model.blocks[0].moe
    tokens = random_tokens(1, 30, vocab=llm.model.config.vocab_size)
    x = torch.randn(1, llm.model.config.hidden_size)
    norm = (torch.rand(x.shape[-1]) + 0.5, 1e-6)
    kernel, kernel_one = logits(llm.model, tokens), moe(x, norm)
    assert moe.fused is not None  # the C call ran (and packed the experts)
    with monkeypatch.context() as patch:
        patch.setattr("quickdraft.model.experts.experts_usable", lambda x: False)
        assert torch.equal(kernel, logits(llm.model, tokens)) and torch.equal(kernel_one, moe(x, norm))
    weights, chosen = moe.route(x @ moe.router.weight.T)
    assert not torch.equal(run_experts(x, norm, chosen, weights.flip(-1), moe.fused, moe.gate),
                           run_experts(x, norm, chosen, weights, moe.fused, moe.gate))
    assert run_experts(x[:0], norm, chosen[:0], weights[:0], moe.fused, moe.gate).shape == (0, x.shape[-1])
    many = chosen[:, :1].expand(1, 3 * chosen.shape[1]).contiguous()  # one expert 3k times (no router does)
    twice = run_experts(x, norm, many, torch.full(many.shape, 1.0 / many.shape[1]), moe.fused, moe.gate)
    assert torch.allclose(twice, run_experts(x, norm, chosen[:, :1], torch.ones(1, 1), moe.fused, moe.gate), atol=1e-6)
    with pytest.raises(ValueError, match="expert index outside"):
        run_experts(x, norm, chosen + moe.fused.experts, weights, moe.fused, moe.gate)


def test_q8_experts_are_batch_invariant_at_any_row_count_and_speculation_is_exact(q8):
    """GGUF attention and expert blocks, a float router fed the C kernel 64 rows at most a call:
    any pass is batch-invariant (3 x 30 rows here), so the engine's batch gives each request its
    tokens alone, and speculation (chain, tree, self-draft) plain's."""
    llm = quickdraft.load(q8)
    assert llm.model.invariant_rows is None
    tokens = random_tokens(3, 30, vocab=llm.model.config.vocab_size)
    batch = logits(llm.model, tokens)
    for i in range(3):
        assert torch.equal(logits(llm.model, tokens[i:i + 1])[0], batch[i]), i
    alone = {p: llm.generate(p, params=GREEDY).token_ids for p in PROMPTS}
    assert run_engine(llm, PROMPTS, SpecConfig("ngram", k=4)) == alone
    for spec in (SpecConfig("ngram-tree", k=6, adaptive=False),
                 SpecConfig("draft", k=4, draft_model=str(q8), adaptive=False)):
        assert llm.generate(PROMPT, params=GREEDY, spec=spec).token_ids == alone[PROMPT], spec.method


# -- sampling: the law of the first tokens is plain sampling's ----------------------------------------

def moe16(name: str, noise: float = 0.0) -> Transformer:
    """A 16-token MoE of the family (init 0.35, as test_spec_exactness's tiny16); `noise`: its weights
    plus that much Gaussian noise (a correlated draft)."""
    hf = hf_model(name, initializer_range=0.35, vocab_size=V16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn(param.shape, generator=g) * noise * param.std())
    return ours_from_hf(hf)


@pytest.mark.parametrize("name", ["qwen3moe", "gptoss"])
def test_sampling_law_with_an_moe_target_and_draft(name):
    """A draft model's drafts (a noisy copy of the target: some accepted, some rejected) sampled at
    temperature 1: the first tokens follow plain sampling's law; the same draws against the law at
    temperature 0.75 are rejected (the negative control). gpt-oss: its sinks and clamped experts too."""
    target, drafter = moe16(name), Drafter(moe16(name, noise=0.1))
    counts = torch.zeros([V16] * N_TOKENS, dtype=torch.long)
    drafted = accepted = 0
    for seed in range(50_000, 50_000 + N_SAMPLES):
        p = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=SAMPLE_NEW, ignore_eos=True)
        proposer = DraftModelProposer(drafter, PROMPT16, p, len(PROMPT16) + SAMPLE_NEW + SAMPLE_K + 1)
        ids, stats = [], None
        for event in generate_tokens(target, PROMPT16, p, frozenset(), proposer, SAMPLE_K):
            ids += event.token_ids
            stats = event.stats
        counts[tuple(ids[:N_TOKENS])] += 1
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
    assert_plain_sampling_law(target, counts, drafted, accepted)
    other = plain_law(target, PROMPT16, SamplingParams(temperature=0.75), N_TOKENS)
    assert chi_square_p_value(counts, other) < ALPHA


# -- what is not implemented is refused by name ----------------------------------------------------

def config_of(name: str, **changes) -> dict:
    return {**hf_model(name).config.to_dict(), **changes}


@pytest.mark.parametrize("config, message", [
    (config_of("qwen3moe", decoder_sparse_step=2), r"decoder_sparse_step 2 .*dense MLP layers"),
    (config_of("qwen3moe", mlp_only_layers=[0]), r"mlp_only_layers \[0\]"),
    (config_of("qwen3moe", num_local_experts=0), r"num_experts 0"),
    ({**BASE, "model_type": "qwen2_moe"}, r"'qwen2_moe' \(a mixture of experts with a shared expert\)"),
    (config_of("gptoss", swiglu_limit=8.0), r"swiglu_limit 8.0 is not supported; expected 7.0"),
])
def test_what_the_experts_do_not_implement_is_refused_by_name(config, message):
    with pytest.raises(UnsupportedArchitecture, match=message):
        ModelConfig.from_hf(config)


def test_qwen_moe_checkpoints_name_the_expert_count_num_experts():
    """The Hub's Qwen MoE config.json says num_experts; transformers 5 writes num_local_experts."""
    cfg = config_of("qwen3moe")
    cfg["num_experts"] = cfg.pop("num_local_experts")
    assert ModelConfig.from_hf(cfg) == ModelConfig.from_hf(config_of("qwen3moe"))
    assert ModelConfig.from_hf({**cfg, "num_experts": 4}).num_experts == 4


def test_a_shared_expert_in_the_checkpoint_is_refused_by_name():
    hf = hf_model("qwen3moe")
    tensors = checkpoint_tensors(hf) | {"model.layers.0.mlp.shared_expert.up_proj.weight": torch.zeros(32, 64)}
    with pytest.raises(UnsupportedArchitecture, match="'model.layers.0.mlp.shared_expert.up_proj.weight'"):
        build_transformer(ModelConfig.from_hf(hf.config.to_dict()), tensors)


@pytest.fixture(scope="module")
def qwen_moe_meta(tmp_path_factory) -> tuple[dict, set[str]]:
    path = write_llama_gguf(tiny_model("qwen3moe"), tmp_path_factory.mktemp("meta") / "m.gguf")
    reader = open_reader(path)
    return read_metadata(reader), {t.name for t in reader.tensors}


@pytest.mark.parametrize("changes, error, message", [
    ({"qwen3moe.expert_shared_count": 1}, UnsupportedArchitecture, r"expert_shared_count' = 1 \(a shared expert\)"),
    ({"qwen3moe.expert_gating_func": 2}, UnsupportedArchitecture, r"expert_gating_func' = 2 \(expert gating other"),
    ({"qwen3moe.expert_weights_norm": False}, UnsupportedArchitecture, r"not renormalized"),
    ({"qwen3moe.leading_dense_block_count": 1}, UnsupportedArchitecture, r"dense layers before the experts"),
    ({"qwen3moe.expert_count": 0}, UnsupportedArchitecture, r"'qwen3moe' without experts"),
    ({"general.architecture": "qwen3"}, UnsupportedArchitecture, r"'qwen3' with experts \(a mixture of experts\)"),
    ({"general.architecture": "qwen2moe"}, UnsupportedArchitecture, r"'qwen2moe' \(a mixture of experts with a shared"),
    ({"general.architecture": "deepseek2"}, UnsupportedArchitecture, r"'deepseek2' \(shared experts, grouped"),
    ({"qwen3moe.expert_used_count": 9}, ModelLoadError, r"8 experts need 1 to 8 experts per token"),
])
def test_gguf_expert_settings_that_change_the_math_are_refused_by_name(qwen_moe_meta, changes, error, message):
    meta, names = qwen_moe_meta
    config = config_from_metadata(meta, names)  # the file as written loads
    assert (config.num_experts, config.experts_per_token, config.expert_size, config.norm_topk) == (8, 2, 32, True)
    if "general.architecture" in changes:
        arch = changes["general.architecture"]
        meta = {k.replace("qwen3moe.", f"{arch}."): v for k, v in meta.items()}
    with pytest.raises(error, match=message):
        config_from_metadata({**meta, **changes}, names)
