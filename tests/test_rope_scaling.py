"""Every RoPE type (issue 31): linear, dynamic NTK, llama3, YaRN and LongRoPE, from a safetensors
directory and from a GGUF written as llama.cpp's converter writes it (its rope.scaling.* keys,
rope_freqs, Phi-3's rope_factors_long/short tensors; nothing for dynamic NTK), each against
transformers on the same tiny random weights; and where transformers rotates every position anew
(dynamic NTK past max_position_embeddings, LongRoPE past the original context), the context ends.

Oracles: transformers' 16 greedy tokens, plain and speculative; its logits of a longer sequence
against a shorter one's (the premise of the context's end); the same inverse frequencies and
cos/sin scale from both formats. GGUF rope keys and tensors outside these: refused by name
(here and in test_model_accounting.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import quickdraft
from gguf_writer import write_gguf
from quickdraft import ContextTooLong, SamplingParams, UnsupportedArchitecture
from quickdraft.model.rope import RotaryTable
from tiny_models import transformers_greedy
from tiny_tokenizer import assert_plain_and_speculative, both_formats, tiny_model

PROMPT = "the cat sat on the mat; the cat sat on the"
N = 16
ROPE_TYPES = ["llama-rope-linear", "llama-dynamic", "llama3-rope-scaling", "llama-yarn", "llama-yarn-betas",
              "phi3-longrope"]


@pytest.fixture(scope="module", params=ROPE_TYPES)
def files(request, tmp_path_factory):
    name = request.param
    return name, *both_formats(name, tmp_path_factory.mktemp(name))


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_greedy_tokens_equal_transformers_plain_and_speculative(files, fmt):
    name, directory, gguf = files
    path = directory if fmt == "safetensors" else gguf
    llm = quickdraft.load(path)
    ids = llm.tokenizer.encode(PROMPT)
    assert len(ids) + N <= llm.model.config.max_position_embeddings  # within the context: all of it compared
    assert_plain_and_speculative(llm, path, PROMPT, N, transformers_greedy(tiny_model(name), ids, N))


def test_both_formats_give_the_same_rotation(files):
    """The GGUF's rope keys and tensors are read into the rotation config.json gives: the same
    inverse frequencies (llama3's as rope_freqs divisors: to rounding), cos/sin scale and context."""
    name, directory, gguf = files
    ours, theirs = quickdraft.load(gguf).model, quickdraft.load(directory).model
    assert ours.config.max_position_embeddings == theirs.config.max_position_embeddings
    if name == "llama3-rope-scaling":
        torch.testing.assert_close(ours.inv_freq, theirs.inv_freq, rtol=1e-6, atol=0)
    else:
        assert torch.equal(ours.inv_freq, theirs.inv_freq)
    scale = [torch.tensor(RotaryTable.of(m.config).scale, dtype=torch.float32) for m in (ours, theirs)]
    assert torch.equal(*scale)
    if name in ("llama-yarn-betas", "phi3-longrope"):  # the premise: a scale other than 1 to compare
        assert scale[0] != 1


# -- where transformers rotates every position anew, the context ends --------------------------------

@pytest.mark.parametrize("name, context", [("llama-dynamic", 48), ("phi3-longrope", 64)])
def test_past_the_context_every_position_rotates_anew_so_the_context_ends_there(name, context, tmp_path):
    """transformers' dynamic NTK raises the base for each sequence length past max_position_embeddings,
    and its LongRoPE switches to the long factors past the original context: the logits of the
    first positions change with the length of the sequence, which K/V cached at those positions
    cannot follow. So the context ends there, from either format: a longer prompt is refused, and
    generation stops at it (finish reason length). Within it: transformers' tokens (test above)."""
    hf = tiny_model(name)
    ids = torch.randint(3, 250, (1, context + 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        within = hf(ids[:, :context]).logits
        # up to the context: causal (a shorter sequence's logits are the longer one's first ones)
        torch.testing.assert_close(hf(ids[:, :context - 1]).logits, within[:, :-1], atol=1e-5, rtol=0)
        past = hf(ids).logits[:, :context]
    assert (past - within).abs().max() > 1e-2  # past it: every position's logits moved
    for path in both_formats(name, tmp_path):
        llm = quickdraft.load(path)
        assert llm.model.config.max_position_embeddings == context
        why = {"dynamic": " \\(dynamic NTK RoPE: past max_position_embeddings",
               "longrope": " \\(LongRoPE: past its original context .* the checkpoint names 256\\)",
               None: ";"}[llm.model.config.rope_scaling and llm.model.config.rope_scaling.kind]
        assert (why == ";") == (name == "llama-dynamic" and path.suffix == ".gguf")  # its GGUF: default RoPE
        with pytest.raises(ContextTooLong, match=f"the context holds {context}{why}"):
            llm.generate(" ".join(["cat"] * context), params=SamplingParams(max_new_tokens=1))
        prompt = "the cat sat on the mat; " * 2
        out = llm.generate(prompt, params=SamplingParams(max_new_tokens=context, ignore_eos=True))
        assert len(llm.tokenizer.encode(prompt)) + len(out.token_ids) == context and out.finish_reason == "length"


# -- what a GGUF's rope settings must not leave unsaid -----------------------------------------------

@pytest.mark.parametrize("keys, tensors, message", [
    ({"phi3.rope.scaling.factor": 4.0}, None, "LongRoPE with 'phi3.rope.scaling.factor' 4.0"),
    ({"phi3.rope.scaling.yarn_log_multiplier": 0.1}, None, "'phi3.rope.scaling.yarn_log_multiplier' = 0.1.* 'longrope'"),
    ({}, {"rope_factors_short.weight"}, r"both tensors .*found \['rope_factors_short.weight'\]"),
    ({}, {"rope_factors_short.weight", "rope_factors_long.weight", "rope_freqs.weight"},
     "'rope_freqs.weight' with rope scaling 'longrope'"),
])
def test_a_longrope_gguf_missing_or_adding_a_setting_is_refused_by_name(keys, tensors, message, tmp_path):
    from quickdraft.weights.gguf_file import config_from_metadata, open_reader, read_metadata
    path = tmp_path / "m.gguf"
    write_gguf(tiny_model("phi3-longrope"), path)
    reader = open_reader(path)
    meta, names = read_metadata(reader), {t.name for t in reader.tensors}
    rope = {t.name: np.asarray(t.data) for t in reader.tensors if t.name.startswith("rope_")}
    assert set(rope) == {"rope_factors_long.weight", "rope_factors_short.weight"}
    assert config_from_metadata(meta, names, rope).rope_scaling.kind == "longrope"  # as written: loads
    if tensors is not None:
        rope = {n: rope.get(n, np.ones(8, np.float32)) for n in tensors}
    with pytest.raises(UnsupportedArchitecture, match=message):
        config_from_metadata({**meta, **keys}, names, rope)


@pytest.mark.parametrize("keys, message", [
    ({"llama.rope.scaling.yarn_ext_factor": 0.5}, "'llama.rope.scaling.yarn_ext_factor' = 0.5 .* 'yarn'"),
    ({"llama.rope.scaling.type": "su"}, "'llama.rope.scaling.type' = 'su'"),
    ({"llama.rope.scaling.factor": 1.0}, "'yarn' needs 'llama.rope.scaling.factor'"),
])
def test_a_yarn_gguf_with_a_setting_it_cannot_follow_is_refused_by_name(keys, message, tmp_path):
    from quickdraft.errors import ModelLoadError
    from quickdraft.weights.gguf_file import config_from_metadata, open_reader, read_metadata
    path = tmp_path / "m.gguf"
    write_gguf(tiny_model("llama-yarn-betas"), path)
    reader = open_reader(path)
    meta, names = read_metadata(reader), {t.name for t in reader.tensors}
    scaling = config_from_metadata(meta, names).rope_scaling
    assert (scaling.kind, scaling.beta_fast, scaling.beta_slow) == ("yarn", 8.0, 2.0)
    with pytest.raises(ModelLoadError, match=message):
        config_from_metadata({**meta, **keys}, names)
