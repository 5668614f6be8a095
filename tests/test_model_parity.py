"""Our Transformer against transformers' classes of every family on the same tiny random weights.

Oracles: transformers' logits (and its last decoder layer's output), one full forward of ours
against prefill + decode, and single-row runs against batched rows at different positions.
"""
from __future__ import annotations

import pytest
import torch

from tiny_models import BASE, CONFIGS, hf_model, ours_from_hf

VOCAB = BASE["vocab_size"]
B, T = 2, 40
MAX_LEN = 64


def random_tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def arange_positions(batch: int, start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop).expand(batch, stop - start)


def full_forward(model, tokens: torch.Tensor):
    b, t = tokens.shape
    return model(tokens, arange_positions(b, 0, t), model.new_cache(b, MAX_LEN))


def hf_logits_and_last_layer(hf, tokens: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits [B, T, V] and its last decoder layer's output [B, T, D] (pre final norm)."""
    seen = {}

    def hook(module, args, output):
        seen["h"] = output[0] if isinstance(output, tuple) else output

    handle = hf.model.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = hf(tokens, **kwargs).logits
    finally:
        handle.remove()
    return logits, seen["h"]


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    hf = hf_model(request.param)
    return hf, ours_from_hf(hf)


def test_logits_and_hidden_equal_transformers(pair):
    hf, ours = pair
    tokens = random_tokens(B, T)
    out = full_forward(ours, tokens)
    ref_logits, ref_hidden = hf_logits_and_last_layer(hf, tokens)
    assert out.logits.shape == (B, T, VOCAB)
    assert out.hidden.shape == (B, T, BASE["hidden_size"])
    torch.testing.assert_close(out.logits, ref_logits, atol=1e-4, rtol=0)
    # `hidden` is the last layer's output before the final norm (what draft heads read).
    torch.testing.assert_close(out.hidden, ref_hidden, atol=1e-4, rtol=0)


def test_last_n_returns_the_last_positions(pair):
    _, ours = pair
    tokens = random_tokens(B, T, seed=1)
    full = full_forward(ours, tokens)
    for n in (1, 5):
        part = ours(tokens, arange_positions(B, 0, T), ours.new_cache(B, MAX_LEN), last_n=n)
        assert part.logits.shape == (B, n, VOCAB)
        assert part.hidden.shape == full.hidden.shape  # hidden states of every fed position
        torch.testing.assert_close(part.logits, full.logits[:, -n:], atol=1e-6, rtol=0)
        torch.testing.assert_close(part.hidden, full.hidden, atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk", [1, 5])
def test_prefill_then_decode_equals_full_forward(pair, chunk):
    _, ours = pair
    tokens = random_tokens(B, T, seed=2)
    full = full_forward(ours, tokens)
    prefill = 32
    cache = ours.new_cache(B, MAX_LEN)
    out = ours(tokens[:, :prefill], arange_positions(B, 0, prefill), cache)
    pieces = [out.logits]
    for start in range(prefill, T, chunk):
        stop = min(start + chunk, T)
        pieces.append(ours(tokens[:, start:stop], arange_positions(B, start, stop), cache).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full.logits, atol=1e-5, rtol=0)


def test_rows_of_different_lengths_match_single_row_runs(pair):
    """Right-padded rows, positions running on through the pad: each row's real positions give
    the logits that row gives alone, and decode steps at per-row positions match too."""
    _, ours = pair
    lengths = (17, 9)
    prompts = [random_tokens(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    tokens = torch.full((2, width), 5, dtype=torch.long)  # pad id 5: an ordinary token, never attended to
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    batch_cache = ours.new_cache(2, MAX_LEN)
    batch_out = ours(tokens, arange_positions(2, 0, width), batch_cache)

    continuations = random_tokens(2, 2, seed=20)
    singles = []
    for i, p in enumerate(prompts):
        cache = ours.new_cache(1, MAX_LEN)
        out = ours(p[None], arange_positions(1, 0, len(p)), cache)
        # every real position, the last one included, matches the row run alone
        torch.testing.assert_close(batch_out.logits[i, :len(p)], out.logits[0], atol=1e-5, rtol=0)
        steps = []
        for s in range(continuations.shape[1]):
            pos = torch.tensor([[len(p) + s]])
            steps.append(ours(continuations[i, s].view(1, 1), pos, cache).logits[0, 0])
        singles.append(torch.stack(steps))

    for s in range(continuations.shape[1]):
        pos = torch.tensor([[lengths[0] + s], [lengths[1] + s]])
        step = ours(continuations[:, s:s + 1], pos, batch_cache).logits[:, 0]
        for i in range(2):
            torch.testing.assert_close(step[i], singles[i][s], atol=1e-5, rtol=0)


def test_attn_mask_hides_a_key(pair):
    """Hiding key j from every later query equals transformers run on the sequence without
    token j, the other tokens keeping their positions; an all-True mask changes nothing."""
    hf, ours = pair
    t, j = 20, 6
    tokens = random_tokens(B, t, seed=3)
    positions = arange_positions(B, 0, t)
    plain = ours(tokens, positions, ours.new_cache(B, MAX_LEN)).logits

    all_true = torch.ones(B, t, t, dtype=torch.bool)
    assert torch.equal(ours(tokens, positions, ours.new_cache(B, MAX_LEN), attn_mask=all_true).logits, plain)

    mask = torch.ones(B, t, t, dtype=torch.bool)
    mask[:, j + 1:, j] = False
    masked = ours(tokens, positions, ours.new_cache(B, MAX_LEN), attn_mask=mask).logits
    keep = [i for i in range(t) if i != j]
    if not ours.config.layer_windows:  # transformers counts a window in sequence indices, not positions
        ref, _ = hf_logits_and_last_layer(hf, tokens[:, keep], position_ids=positions[:, keep])
        torch.testing.assert_close(masked[:, keep], ref, atol=1e-4, rtol=0)
    assert torch.equal(masked[:, :j + 1], plain[:, :j + 1])
    assert (masked[:, j + 1:] - plain[:, j + 1:]).abs().amax(dim=-1).min() > 1e-4


def test_bfloat16_agrees_with_float32(pair):
    hf, ours = pair
    ours_bf16 = ours_from_hf(hf, dtype=torch.bfloat16)
    tokens = random_tokens(B, T, seed=4)
    ref = full_forward(ours, tokens).logits
    out = full_forward(ours_bf16, tokens)
    # bfloat16 weights; on CPU activations stay float32 (compute_dtype), elsewhere bfloat16.
    assert ours_bf16.blocks[0].wqkv.weight.dtype == torch.bfloat16
    assert out.logits.dtype == ours_bf16.compute_dtype and out.hidden.dtype == ours_bf16.compute_dtype
    logits = out.logits.float()
    diff = (logits - ref).abs().max().item()
    assert 0 < diff < 0.05 * ref.abs().max().item()  # rounded, but only a little
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"bf16 argmax agrees with float32 on {agree:.0%} of positions"


def test_rotary_frequencies_are_computed_on_the_cpu_under_the_meta_device() -> None:
    """The loader builds the model on "meta": the frequencies must still be real numbers (and
    computed without torch's meta decompositions, which cost ~1.5 s of a load), equal to the CPU's."""
    from quickdraft.model.rope import inverse_frequencies
    config = ours_from_hf(hf_model("llama3-rope-scaling")).config
    with torch.device("meta"):
        on_meta = inverse_frequencies(config)
    assert on_meta.device.type == "cpu" and torch.equal(on_meta, inverse_frequencies(config))
