"""`quickdraft bench random-gguf`: a random-weight GGUF of an MoE shape that quickdraft loads as the
model it describes (Qwen3-MoE: types by llama.cpp's Q4_K_M rule; gpt-oss: MXFP4 experts, Q8_0,
biases, sinks, a padded vocabulary), with finite, varied output, and speculation on it exact.

Oracles: the shape written (read back with gguf's reader), plain greedy decoding of the same file.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

import quickdraft
from quickdraft.bench.random_gguf import MoeShape, more_bits, write_random_moe
from quickdraft.cli import main
from quickdraft.spec.sampling import SamplingParams

SMALL = MoeShape(layers=3, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, experts_used=2,
                 expert_size=256, dense_size=512, context=2048)
SMALL_OSS = MoeShape(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=4, experts_used=2, expert_size=256,
                     dense_size=256, vocab=152000, context=8192, rope_theta=150000.0, eps=1e-5, arch="gpt-oss")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_moe(SMALL, tmp_path_factory.mktemp("moe") / "small.gguf")


def test_the_file_holds_the_shape_with_q4_k_m_types(small: Path) -> None:
    reader = GGUFReader(small)
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.ffn_gate_exps.weight"].shape.tolist() == [SMALL.hidden, SMALL.expert_size, SMALL.experts]
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert tensors["output.weight"].tensor_type.name == "Q6_K"
    for i in range(SMALL.layers):
        expected = "Q6_K" if more_bits(i, SMALL.layers) else "Q4_K"
        assert tensors[f"blk.{i}.ffn_down_exps.weight"].tensor_type.name == expected
        assert tensors[f"blk.{i}.attn_v.weight"].tensor_type.name == expected
    assert [more_bits(i, 48) for i in range(8)] == [True] * 6 + [False, False]  # llama.cpp's rule at 48 layers
    assert int(reader.fields["qwen3moe.expert_count"].contents()) == SMALL.experts
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == SMALL.vocab


def test_a_gpt_oss_shape_has_mxfp4_experts_q8_matrices_and_runs_as_gpt_oss(tmp_path: Path) -> None:
    path = write_random_moe(SMALL_OSS, tmp_path / "oss.gguf")
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type.name == "MXFP4"
    assert tensors["blk.1.attn_q.weight"].tensor_type.name == "Q8_0"
    assert tensors["blk.0.attn_sinks.weight"].shape.tolist() == [SMALL_OSS.heads]
    llm = quickdraft.load(str(path))
    config = llm.model.config
    assert (config.model_type, config.vocab_size, config.num_experts, config.layer_windows) == \
        ("gpt_oss", 152000, 4, (128, None))
    assert "MXFP4" in llm.model.weight_format and "Q8_0" in llm.model.weight_format
    # its YaRN is gpt-oss's checkpoints' (the correction range unrounded, which the file does not
    # record), bitwise transformers'; rounded (llama.cpp's) it would differ at these dimensions
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from quickdraft.model.rope import inverse_frequencies
    rope = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096,
                rope_theta=150000.0)
    frequencies = {truncate: ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.for_model(
        "gpt_oss", hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=8192,
        rope_parameters={**rope, "truncate": truncate}), "cpu")[0] for truncate in (False, True)}
    assert torch.equal(inverse_frequencies(config), frequencies[False].float())
    assert not torch.equal(frequencies[False], frequencies[True])
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = llm.generate("def fibonacci(n):", params=params, spec=quickdraft.SpecConfig("none"))
    assert len(Counter(plain.token_ids)) > 4
    assert llm.generate("def fibonacci(n):", params=params, spec=quickdraft.SpecConfig("ngram")).token_ids == \
        plain.token_ids


def test_quickdraft_runs_it_as_the_mixture_it_describes_and_speculation_stays_exact(small: Path) -> None:
    llm = quickdraft.load(str(small))
    config = llm.model.config
    assert (config.num_layers, config.num_experts, config.experts_per_token) == (3, 8, 2)
    assert "Q4_K" in llm.model.weight_format and "Q6_K" in llm.model.weight_format
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = llm.generate("def fibonacci(n):", params=params, spec=quickdraft.SpecConfig("none"))
    assert len(Counter(plain.token_ids)) > 4  # varied: centred weights, not one token over and over
    for method in ("ngram", "suffix"):
        assert llm.generate("def fibonacci(n):", params=params, spec=quickdraft.SpecConfig(method)).token_ids == \
            plain.token_ids, method
    scored = llm.score("def fibonacci(n): return n")
    assert all(np.isfinite(t.logprob) for t in scored.logprobs)


def test_the_command_refuses_an_existing_file_and_too_many_layers(small: Path, capsys) -> None:
    assert main(["bench", "random-gguf", "--out", str(small)]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["bench", "random-gguf", "--layers", "49", "--out", str(small.parent / "x.gguf")]) == 1
    assert "--layers must be in 1..48" in capsys.readouterr().err
