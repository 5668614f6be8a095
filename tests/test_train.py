"""The head trainer: responses are the target's own greedy output, generated resumably; features
rebuilt by prefill are those recorded while decoding; the loss falls (in float32 and in bfloat16),
a trained head is accepted more often than an untrained one, a resumed run continues exactly, and
the ShareGPT reader keeps what parses of a cut-off file."""
from __future__ import annotations

import copy
import dataclasses
import gzip
import itertools
import json
import math
import tempfile
from pathlib import Path

import pytest
import torch

from quickdraft import kernels
from quickdraft.cli import main
from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.engine.loop import generate_tokens
from quickdraft.proposers.base import EACH
from quickdraft.proposers.head import DraftHead, head_config, load_head
from quickdraft.spec.draft_contract import NO_DRAFT, Committed, Draft
from quickdraft.spec.sampling import SamplingParams
from quickdraft.train import data, features, responses, trainer
from quickdraft.train.data import chat_prompts, iter_sharegpt, without_benchmark
from quickdraft.train.features import FEATURES, Example, training_examples
from quickdraft.train.responses import RESPONSES, generate_responses
from quickdraft.train.trainer import (
    CE_WEIGHT,
    TrainConfig,
    acceptance,
    loss_positions,
    step_rate,
    train_head,
    training_dtype,
)
from support.models import tiny
from tiny_tokenizer import tiny_llm_dir

CONFIG = TrainConfig(steps=80, batch_size=8, max_len=48, lr=3e-3, warmup=5, checkpoint_every=40, dtype="float32",
                     ce_weight=CE_WEIGHT)


def target(name: str = "llama-gqa-untied"):
    return tiny(name, init=0.1)


def fusing(layers: tuple[int, ...]):
    """A copy of the target keeping `layers`' features (tiny models are shared between tests)."""
    model = copy.deepcopy(target())
    model.keep_features(layers)
    return model


def prompts(n: int, seed: int, lengths: tuple[int, int] = (4, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (int(torch.randint(*lengths, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def corpus(n: int, seed: int, layers: tuple[int, ...] = ()) -> list[Example]:
    """The target's own greedy continuations of random prompts, with its features there (of its
    last layer, or of `layers`): the text a head must predict."""
    model = fusing(layers) if layers else target()
    with tempfile.TemporaryDirectory() as tmp:
        answers = generate_responses(model, prompts(n, seed), frozenset(), 40, Path(tmp) / RESPONSES, batch_size=8,
                                     progress=False)
        return training_examples(model, answers, Path(tmp) / FEATURES, progress=False)


def test_responses_are_plain_greedy_output(tmp_path: Path) -> None:
    model = target()
    answers = generate_responses(model, prompts(6, 3), frozenset(), 20, tmp_path / RESPONSES, batch_size=4,
                                 progress=False)
    for prompt, r in zip(prompts(6, 3), answers):
        new = [t for ev in generate_tokens(model, prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
               for t in ev.token_ids]
        assert r.tokens == prompt + new and r.prompt_len == len(prompt)


def test_generation_resumes_where_it_stopped(tmp_path: Path, monkeypatch) -> None:
    """A run killed after its first shard was saved, rerun, answers only the prompts still missing
    and ends with the uninterrupted run's responses; a third run answers none."""
    model, asked = target(), prompts(10, 4)

    def run(path: Path):
        # token 41 ends some responses early: rows finish out of prompt order
        return generate_responses(model, asked, frozenset({41}), 12, path, batch_size=4, progress=False, shard=3)

    whole = run(tmp_path / "whole" / RESPONSES)
    real_save, real_request, saves, requested = responses.save_responses, responses.Request, [], []

    def dies_at_second_save(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2:
            raise KeyboardInterrupt
        return real_save(*args, **kwargs)

    def counted(*args, **kwargs):
        requested.append(args[0])
        return real_request(*args, **kwargs)

    path = tmp_path / "killed" / RESPONSES
    monkeypatch.setattr(responses, "save_responses", dies_at_second_save)
    with pytest.raises(KeyboardInterrupt):
        run(path)
    monkeypatch.setattr(responses, "save_responses", real_save)
    monkeypatch.setattr(responses, "Request", counted)
    requested.clear()
    assert run(path) == whole and requested == asked[3:]
    requested.clear()
    assert run(path) == whole and requested == []
    assert sorted(len(r.tokens) - r.prompt_len for r in whole)[:3] == [0, 0, 2]  # as the stop token ended them
    with pytest.raises(ValueError, match="other settings"):
        generate_responses(model, asked, frozenset({41}), 13, path, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        generate_responses(model, asked, frozenset(), 12, path, progress=False)
    with pytest.raises(ValueError, match="other prompts"):
        generate_responses(model, prompts(10, 5), frozenset({41}), 12, path, progress=False)


def test_sampled_answers_are_each_prompts_seeded_sample_alone_and_resume_the_same(tmp_path: Path, monkeypatch) -> None:
    """Sampled answers (more text than the prompts' greedy answers): each is what its prompt's own
    seeded request gives decoded alone, whatever shared its batch, so a killed run's rerun ends with
    the same answers; another temperature or round is another file's."""
    model, asked = target(), prompts(6, 8)
    path = tmp_path / responses.sampled_file(1)

    def run(batch_size: int = 4):
        return generate_responses(model, asked, frozenset({41}), 12, path, batch_size=batch_size, progress=False,
                                  shard=2, temperature=0.9, seed=1)

    real_save, saves = responses.save_responses, []

    def dies_at_second_save(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2:
            raise KeyboardInterrupt
        return real_save(*args, **kwargs)

    monkeypatch.setattr(responses, "save_responses", dies_at_second_save)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(responses, "save_responses", real_save)
    answers = run(batch_size=3)  # the rest, beside other rows than the first run's
    greedy = generate_responses(model, asked, frozenset({41}), 12, tmp_path / RESPONSES, progress=False)
    for i, (prompt, r) in enumerate(zip(asked, answers)):
        params = SamplingParams(temperature=0.9, seed=(1 << 32) + i, max_new_tokens=12, stop_token_ids=(41,))
        alone = [t for ev in generate_tokens(model, prompt, params) for t in ev.token_ids]
        assert r.tokens == prompt + alone and r.prompt_len == len(prompt)
    assert [r.tokens for r in answers] != [r.tokens for r in greedy]  # sampled, not greedy text
    with pytest.raises(ValueError, match="other settings"):
        generate_responses(model, asked, frozenset({41}), 12, path, progress=False, temperature=0.8, seed=1)
    with pytest.raises(ValueError, match="other settings"):
        generate_responses(model, asked, frozenset({41}), 12, path, progress=False, temperature=0.9, seed=2)


class FeatureRecorder:
    """A proposer that proposes nothing and records the features the engine commits (its steps are
    plain decoding steps)."""
    group = EACH

    def __init__(self) -> None:
        self.features: list[torch.Tensor] = []

    def commit(self, step: Committed) -> None:
        self.features.append(step.features.to("cpu", features.STORE_DTYPE))

    def propose(self, k: int) -> Draft:
        return NO_DRAFT


@pytest.mark.parametrize("name, lengths", [("llama-gqa-untied", (4, 9)), ("llama-gqa-untied@Q8_0", (70, 90))])
def test_prefill_features_are_those_recorded_while_decoding(tmp_path: Path, monkeypatch, name: str,
                                                             lengths: tuple[int, int]) -> None:
    """Bitwise where the target's passes are batch-invariant (the C kernels: float weights up to
    kernels.MAX_ROWS tokens, GGUF blocks at any length); the cache is reused, and a changed
    response recomputes its shard only."""
    model, asked = target(name), prompts(5, 6, lengths)
    answers = generate_responses(model, asked, frozenset(), 16, tmp_path / RESPONSES, batch_size=4, progress=False)
    got = training_examples(model, answers, tmp_path / FEATURES, progress=False, shard=2)
    engine = Engine(model, EngineConfig(max_batch=4, max_seq_len=lengths[1] + 16))
    recorders = [FeatureRecorder() for _ in asked]
    for i, (prompt, recorder) in enumerate(zip(asked, recorders)):
        engine.add(Request(prompt, SamplingParams(max_new_tokens=16), frozenset(), recorder, k=1, id=str(i)))
    while engine.has_work():
        engine.step()
    for r, e, recorder in zip(answers, got, recorders):
        recorded = torch.cat(recorder.features)  # all but the last step's: the engine hands that to no one
        assert e.tokens == r.tokens and e.prompt_len == r.prompt_len and len(e.features) == len(r.tokens) - 1
        assert len(recorded) == len(e.features) - 1
        if kernels.active_library() is not None:
            assert torch.equal(e.features[:len(recorded)], recorded)
        else:  # torch's GEMM: the last bits of float32 differ, seldom a bfloat16 rounding
            assert torch.allclose(e.features[:len(recorded)].float(), recorded.float(), rtol=1e-2, atol=1e-2)
    real, ran = features.prefill, []

    def counted(model, tokens):
        ran.append(tokens)
        return real(model, tokens)

    monkeypatch.setattr(features, "prefill", counted)
    again = training_examples(model, answers, tmp_path / FEATURES, progress=False, shard=2)
    assert ran == [] and all(torch.equal(a.features, b.features) for a, b in zip(got, again))
    changed = answers[:3] + [dataclasses.replace(answers[3], tokens=answers[3].tokens[:-1])] + answers[4:]
    training_examples(model, changed, tmp_path / FEATURES, progress=False, shard=2)
    assert ran == [r.tokens for r in changed[2:4]]


def test_losses_count_where_the_head_drafts() -> None:
    # 3 prompt tokens, 4 features: pair 2 (f_2, s_3) predicts f_3, the feature that gives the first
    # drafted token; pairs 0-1 are context only. A padded shorter row counts nothing past its end.
    e = Example(list(range(5)), torch.zeros(4, 2), prompt_len=3)
    short = Example(list(range(3)), torch.zeros(2, 2), prompt_len=1)
    assert loss_positions([e, short], 3).tolist() == [[False, False, True], [True, False, False]]
    with pytest.raises(ValueError, match="response tokens"):  # a prompt with no answer teaches nothing
        train_head(target(), [Example(list(range(4)), torch.zeros(3, 32), prompt_len=3)], CONFIG,
                   Path("unused"), "tiny", progress=False)
    # nor one whose answer starts past the positions a step reads: a batch of them had a NaN loss
    long_prompt = Example(list(range(CONFIG.max_len + 10)), torch.zeros(CONFIG.max_len + 9, 64), CONFIG.max_len)
    with pytest.raises(ValueError, match="response tokens"):
        train_head(target(), [long_prompt], CONFIG, Path("unused"), "tiny", progress=False)


def test_cross_entropy_equals_the_log_softmax_form() -> None:
    """The loss's H(p, q) = logsumexp(W h) - h.(p W) and its gradient are -(p log_softmax(W h)).sum()'s."""
    g = torch.Generator().manual_seed(0)
    h0, weight = torch.randn(50, 16, generator=g), torch.randn(300, 16, generator=g)
    p = torch.softmax(3 * torch.randn(50, 300, generator=g), dim=-1)
    h = h0.clone().requires_grad_(True)
    log_total, best = trainer.LogSumExp.apply(h @ weight.T)
    ours = (log_total - (h * (p @ weight)).sum(-1)).mean()
    ours.backward()
    h_ref = h0.clone().requires_grad_(True)
    logits = h_ref @ weight.T
    reference = -(p * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    reference.backward()
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
    assert torch.allclose(h.grad, h_ref.grad, rtol=1e-4, atol=1e-6) and torch.equal(best, logits.argmax(-1))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("head")
    return out, train_head(target(), corpus(48, 0), CONFIG, out, "tiny", progress=False)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def test_training_lowers_the_loss_and_raises_acceptance(trained) -> None:
    out, record = trained
    history = record["history"]
    assert len(history) == CONFIG.steps
    # The tiny target's next-token distributions are nearly flat (cross-entropy near ln 96), so the
    # feature regression and the top-1 agreement move most.
    assert mean(h["loss"] for h in history[-10:]) < 0.8 * mean(h["loss"] for h in history[:10])
    assert mean(h["regression"] for h in history[-10:]) < 0.6 * mean(h["regression"] for h in history[:10])
    assert mean(h["top1"] for h in history[-10:]) > mean(h["top1"] for h in history[:10]) + 0.15
    # the later passes, which read the head's own predictions, learn too
    assert mean(h["top1_3"] for h in history[-10:]) > mean(h["top1_3"] for h in history[:10]) + 0.1
    model = target()
    held_out = [e.tokens[:10] for e in corpus(8, 1)]  # other random prompts, a little of their answer
    torch.manual_seed(CONFIG.seed)
    untrained = DraftHead(head_config(model.config)).eval()
    rate_before, _ = acceptance(model, untrained, held_out)
    rate_after, per_pass = acceptance(model, load_head(out, model), held_out)
    assert rate_after > rate_before + 0.05 and per_pass > 1.05
    info = json.loads((out / "head.json").read_text())
    assert info["target"] == "tiny" and info["training"]["steps"] == CONFIG.steps
    assert info["training"]["dtype"] == "float32"


def test_bfloat16_training_lowers_the_loss(trained, tmp_path: Path) -> None:
    """Under autocast: the first step's loss is the float32 one up to bfloat16's rounding (and not
    bitwise, or the matmuls did not run in bfloat16), and the loss falls as in float32."""
    _, record = trained
    config = dataclasses.replace(CONFIG, steps=40, dtype="bfloat16")
    half = train_head(target(), corpus(48, 0), config, tmp_path, "tiny", progress=False)
    first, first32 = half["history"][0], record["history"][0]
    assert first["loss"] == pytest.approx(first32["loss"], rel=2e-2) and first["loss"] != first32["loss"]
    history = half["history"]
    assert mean(h["loss"] for h in history[-10:]) < 0.85 * mean(h["loss"] for h in history[:10])
    assert mean(h["top1"] for h in history[-10:]) > mean(h["top1"] for h in history[:10]) + 0.1
    assert half["dtype"] == "bfloat16" and json.loads((tmp_path / "head.json").read_text())["training"]["dtype"] == \
        "bfloat16"


def test_auto_dtype_is_bfloat16_where_the_cpu_multiplies_it(monkeypatch) -> None:
    cpu = torch.device("cpu")
    for flags, expected in [({"avx512f", "amx_bf16"}, torch.bfloat16), ({"avx512f", "avx512_bf16"}, torch.bfloat16),
                            ({"avx512f", "avx2"}, torch.float32), (None, torch.float32)]:
        monkeypatch.setattr(trainer, "cpu_flags", lambda flags=flags: flags)
        assert training_dtype("auto", cpu) == expected
    assert training_dtype("float32", cpu) == torch.float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        TrainConfig(dtype="float16")


def test_step_rate_times_the_steps_train_head_runs(trained) -> None:
    _, record = trained
    rate, history = step_rate(target(), corpus(48, 0), CONFIG, steps=3, warmup=2)
    assert rate > 0 and [h["loss"] for h in history] == pytest.approx([h["loss"] for h in record["history"][:5]],
                                                                        rel=1e-5)


def killed_after_step_40(data: list[Example], out: Path, monkeypatch) -> None:
    """A training run into `out` killed while taking step 41 (its step-40 checkpoint written)."""
    real, calls = trainer.head_loss, []

    def dies_at_step_41(*args, **kwargs):
        calls.append(1)
        if len(calls) == 40 * CONFIG.length_groups + 1:  # a step's first pass (one a part of its batch)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "head_loss", dies_at_step_41)
    with pytest.raises(KeyboardInterrupt):
        train_head(target(), data, CONFIG, out, "tiny", progress=False)
    monkeypatch.setattr(trainer, "head_loss", real)


def test_resume_continues_exactly(trained, tmp_path: Path, monkeypatch) -> None:
    """A run killed after its step-40 checkpoint, rerun, ends as the uninterrupted run did."""
    _, record = trained
    data = corpus(48, 0)
    killed_after_step_40(data, tmp_path, monkeypatch)
    resumed = train_head(target(), data, CONFIG, tmp_path, "tiny", progress=False)
    assert [h["loss"] for h in resumed["history"]] == pytest.approx([h["loss"] for h in record["history"]], rel=1e-5)
    with pytest.raises(ValueError, match="other settings"):
        train_head(target(), data, dataclasses.replace(CONFIG, lr=1e-4), tmp_path, "tiny", progress=False)


def test_a_resumed_run_may_weigh_the_cross_entropy_otherwise(trained, tmp_path: Path, monkeypatch, capsys) -> None:
    """--ce-weight on a resume: the same head, data and moments go on under the other objective (said,
    and each step's weight is in the history); its parts are the uninterrupted run's at step 41, the
    updates from there differ. Resumed again without the flag, the run keeps the weight it had."""
    _, record = trained
    data = corpus(48, 0)
    killed_after_step_40(data, tmp_path, monkeypatch)
    capsys.readouterr()
    resumed = train_head(target(), data, dataclasses.replace(CONFIG, ce_weight=1.0), tmp_path, "tiny", progress=False)
    assert f"weighs 1.0 from here on ({tmp_path / trainer.CHECKPOINT}'s steps: {CE_WEIGHT})" in capsys.readouterr().err
    history, uninterrupted = resumed["history"], record["history"]
    assert [h["ce_weight"] for h in history] == [CE_WEIGHT] * 40 + [1.0] * 40
    assert history[40]["ce"] == pytest.approx(uninterrupted[40]["ce"], rel=1e-5)
    assert history[40]["loss"] != pytest.approx(uninterrupted[40]["loss"], rel=1e-3)  # weighed otherwise
    assert [h["ce"] for h in history[41:]] != pytest.approx([h["ce"] for h in uninterrupted[41:]], rel=1e-3)
    more = train_head(target(), data, dataclasses.replace(CONFIG, steps=90, ce_weight=None), tmp_path, "tiny", progress=False)
    assert [h["ce_weight"] for h in more["history"][80:]] == [1.0] * 10 and "weighs" not in capsys.readouterr().err


def test_a_checkpoint_from_before_the_newer_settings_resumes(trained, tmp_path: Path, monkeypatch) -> None:
    """Checkpoints written before TrainConfig had feature_layers, mlp_width and length_groups (the
    repository keeps such runs) resume as runs with their defaults."""
    _, record = trained
    data = corpus(48, 0)
    killed_after_step_40(data, tmp_path, monkeypatch)
    state = torch.load(tmp_path / trainer.CHECKPOINT, weights_only=False)
    for key in ("feature_layers", "mlp_width", "length_groups"):
        del state["config"][key]
    torch.save(state, tmp_path / trainer.CHECKPOINT)
    resumed = train_head(target(), data, CONFIG, tmp_path, "tiny", progress=False)
    assert [h["loss"] for h in resumed["history"]] == pytest.approx([h["loss"] for h in record["history"]], rel=1e-5)


def test_a_checkpoint_kept_without_the_optimizer_resumes_with_fresh_moments(trained, tmp_path: Path, monkeypatch,
                                                                           capsys) -> None:
    """A repository keeps checkpoint.pt alone: a rerun resumes from its step and says the moments start
    afresh; its losses then leave the uninterrupted run's (the optimizer's state mattered)."""
    _, record = trained
    data = corpus(48, 0)
    killed_after_step_40(data, tmp_path, monkeypatch)
    (tmp_path / trainer.OPTIMIZER).unlink()
    resumed = train_head(target(), data, CONFIG, tmp_path, "tiny", progress=False)
    assert "moments afresh" in capsys.readouterr().err
    losses, uninterrupted = [h["loss"] for h in resumed["history"]], [h["loss"] for h in record["history"]]
    # step 41's loss is taken before its update, on the same weights; the updates from there differ
    assert len(losses) == len(uninterrupted) and losses[:41] == pytest.approx(uninterrupted[:41], rel=1e-5)
    assert losses[41:] != pytest.approx(uninterrupted[41:], rel=1e-5) and all(map(math.isfinite, losses))


def test_a_head_grown_to_fuse_layers_starts_as_the_last_layer_head_and_trains_on(trained, tmp_path: Path) -> None:
    """--init-from: a head reading layers 0 and 1 through a fuse, grown from the checkpoint of one
    that read layer 1 alone, has that head's loss on the same batch (the fuse passes the last
    layer through), continues its step count and history, and learns its fuse. The features it
    reads are cached apart from the last layer's (their key names the layers), their last D
    columns the last layer's features."""
    out, record = trained
    model, layers = fusing((0, 1)), (0, 1)
    top, both = corpus(48, 0), corpus(48, 0, layers)
    D = model.config.hidden_size
    assert all(b.features.shape[-1] == 2 * D and torch.equal(b.features[:, -D:], t.features)
               for t, b in zip(top, both))
    state = torch.load(out / trainer.CHECKPOINT, weights_only=False)
    config = dataclasses.replace(CONFIG, steps=100, feature_layers=layers)
    last_only = DraftHead(head_config(model.config), state["head"]["vocab"])
    last_only.load_state_dict(state["head"])
    grown = DraftHead(head_config(model.config), state["head"]["vocab"], layers)
    trainer.grown_from(grown, state, config, out / trainer.CHECKPOINT)
    before = trainer.head_loss(target(), last_only, trainer.batch_of(top, 80, CONFIG), CONFIG)
    after = trainer.head_loss(model, grown, trainer.batch_of(both, 80, config), config)
    assert after[0].item() == pytest.approx(before[0].item(), rel=1e-6) and after[1] == pytest.approx(before[1])
    with pytest.raises(ValueError, match="other settings"):
        trainer.grown_from(grown, state, dataclasses.replace(config, lr=1e-4), out / trainer.CHECKPOINT)
    with pytest.raises(ValueError, match="starts a head that fuses layers"):
        trainer.grown_from(last_only, state, CONFIG, out / trainer.CHECKPOINT)
    with pytest.raises(ValueError, match="not the 128 columns a head reading layers \\[0, 1\\] takes"):
        train_head(model, top, config, tmp_path, "tiny", progress=False)

    run = train_head(model, both, config, tmp_path, "tiny", progress=False, init=out / trainer.CHECKPOINT)
    losses = [h["loss"] for h in run["history"]]
    assert len(losses) == 100 and losses[:80] == [h["loss"] for h in record["history"]]
    assert all(map(math.isfinite, losses[80:]))
    head = load_head(tmp_path, model)
    assert json.loads((tmp_path / "head.json").read_text())["feature_layers"] == [0, 1]
    assert head.fuse.weight[:, :D].abs().max() > 0  # it learned to read layer 0
    _, per_pass = acceptance(model, head, [e.tokens[:10] for e in corpus(4, 1)])
    assert per_pass >= 1.0


def test_a_grown_head_keeps_its_sources_optimizer_moments(trained, tmp_path: Path) -> None:
    """With the source run's optimizer.pt beside its checkpoint, a grown head's next steps follow
    the source run's own continuation closely (only the fuse's moments start afresh); with the
    moments afresh, Adam's first updates move every weight by about the learning rate, and its
    losses leave that continuation further (the control)."""
    import shutil
    out, _ = trained
    ten_more = dataclasses.replace(CONFIG, steps=90)
    shutil.copytree(out, tmp_path / "top")
    source = train_head(target(), corpus(48, 0), ten_more, tmp_path / "top", "tiny", progress=False)["history"]
    shutil.copytree(out, tmp_path / "source-without-moments")
    (tmp_path / "source-without-moments" / trainer.OPTIMIZER).unlink()
    grown = {}
    for name, source_folder in (("kept", out), ("afresh", tmp_path / "source-without-moments")):
        grown[name] = train_head(fusing((0, 1)), corpus(48, 0, (0, 1)), dataclasses.replace(ten_more, feature_layers=(0, 1)),
                                 tmp_path / name, "tiny", progress=False, init=source_folder / trainer.CHECKPOINT)["history"]
    gap = {name: mean(abs(g["loss"] - s["loss"]) for g, s in zip(h[81:], source[81:])) for name, h in grown.items()}
    assert grown["kept"][80]["loss"] == pytest.approx(source[80]["loss"], rel=1e-6)  # step 81: before any update
    assert gap["kept"] < 0.5 * gap["afresh"], gap


def test_a_head_that_fuses_layers_learns_from_scratch() -> None:
    config = dataclasses.replace(CONFIG, steps=40, feature_layers=(0, 1))
    with tempfile.TemporaryDirectory() as tmp:
        history = train_head(fusing((0, 1)), corpus(48, 0, (0, 1)), config, Path(tmp), "tiny", progress=False)["history"]
    assert mean(h["loss"] for h in history[-10:]) < 0.85 * mean(h["loss"] for h in history[:10])
    assert mean(h["top1"] for h in history[-10:]) > mean(h["top1"] for h in history[:10]) + 0.1


def test_a_narrower_head_trains_saves_its_width_and_resumes_only_at_it(tmp_path: Path) -> None:
    config = dataclasses.replace(CONFIG, steps=6, checkpoint_every=3, mlp_width=16)
    examples = corpus(16, 0)
    train_head(target(), examples, config, tmp_path, "tiny", progress=False)
    assert json.loads((tmp_path / "head.json").read_text())["mlp_width"] == 16
    assert load_head(tmp_path, target()).config.intermediate_size == 16
    with pytest.raises(ValueError, match="written with other settings"):
        train_head(target(), examples, dataclasses.replace(config, steps=9, mlp_width=0), tmp_path, "tiny",
                   progress=False)
    with pytest.raises(ValueError, match="mlp_width must be >= 0"):
        dataclasses.replace(config, mlp_width=-1)


@pytest.mark.parametrize("layers, width", [((), 0), ((0, 1), 0), ((), 24)], ids=["last", "fused", "narrow"])
def test_step_flops_are_the_matmuls_torch_counts_plus_attention(layers, width) -> None:
    """step_flops against torch's own count of a step's matrix products (FlopCounterMode: forward
    and backward, whatever autograd skips), which does not see the head's attention (quickdraft's
    kernel): that term is added from its shape, causal, forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode
    model, examples = (fusing(layers) if layers else target()), corpus(16, 0, layers)
    config = dataclasses.replace(CONFIG, feature_layers=layers, mlp_width=width)
    head, _ = trainer.new_head(model, examples, config)
    batch = trainer.batch_of(examples, 0, config)
    with FlopCounterMode(display=False) as counter:
        loss, _ = trainer.head_loss(model, head, batch, config)
        loss.backward()
    n, c = max(len(e.features) for e in batch), head.config
    attention = 2 * 3 * config.unroll * len(batch) * (n - 1) * n // 2 * 2 * c.num_heads * c.head_dim
    assert trainer.step_flops(head, batch, config) == counter.get_total_flops() + attention


def test_a_step_in_parts_of_like_lengths_is_the_whole_batchs_step() -> None:
    """A step's examples run in passes of like lengths (less padding): its loss, its figures and the
    gradient it applies are the whole batch's, to float32 rounding; fewer positions are run."""
    model = target()
    # answers of unlike lengths (the corpus's are alike): parts of unlike counted pairs, which a mean
    # of the parts' means, or weights by examples, would weigh wrongly
    examples = [Example(e.tokens[:len(e.tokens) - 4 * i], e.features[:len(e.features) - 4 * i], e.prompt_len)
                for i, e in enumerate(corpus(8, 0))]
    batch = trainer.batch_of(examples, 3, CONFIG)
    assert len({trainer.counted(g) for g in trainer.by_length(batch, 2)}) == 2
    assert sorted(len(e.features) for e in batch) == [len(e.features) for g in trainer.by_length(batch, 3) for e in g]
    results = {}
    for groups in (1, 2, 4):
        config = dataclasses.replace(CONFIG, length_groups=groups, steps=1)
        head, _ = trainer.new_head(model, examples, config)
        before = {k: v.clone() for k, v in head.state_dict().items()}
        sgd = torch.optim.SGD(head.parameters())  # the update is the (clipped) gradient, scaled
        entry = next(trainer.train_steps(model, head, sgd, examples, config))
        results[groups] = entry, {k: v - before[k] for k, v in head.state_dict().items()}
    whole, whole_update = results[1]
    for groups in (2, 4):
        entry, update = results[groups]
        for k in ("loss", "regression", "ce", "top1", "top1_2", "top1_3"):
            assert entry[k] == pytest.approx(whole[k], rel=1e-5, abs=1e-6), k
        for k, v in ((k, v) for k, v in update.items() if v.is_floating_point()):
            # as a whole: elementwise, float32's sums in another order differ in the last bits
            assert (v - whole_update[k]).norm() <= 1e-4 * whole_update[k].norm(), k
        assert entry["flops"] < whole["flops"]


def test_sharegpt_reader_keeps_what_parses(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}]},
        {"id": "c", "conversations": [{"from": "system", "value": "be kind"}, {"from": "human", "value": "Q?"},
                                      {"from": "gpt", "value": "A."}]},
        {"id": "d", "conversations": [{"from": "human", "value": "cut"}, {"from": "gpt", "value": "off"}]},
    ]
    text = json.dumps(rows, indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:text.index('"id": "d"') + 12])  # cut inside the last conversation
    got = list(iter_sharegpt(path))
    assert [[m["role"] for m in c] for c in got] == [["user", "assistant"], ["system", "user", "assistant"]]
    kept = list(without_benchmark(got, {"  Q? "}))
    assert kept == got[:1]


class _CharTokenizer:
    """One token per character, a message as its role's initial and its content: enough to see
    which messages a prompt holds."""

    def apply_chat_template(self, messages, add_generation_prompt: bool = False) -> list[int]:
        text = "".join(m["role"][0] + m["content"] for m in messages) + ("a" if add_generation_prompt else "")
        return [ord(c) for c in text]


def test_chat_prompts_are_the_openings_then_later_turns_after_their_history() -> None:
    def chat(*turns: str) -> list[dict]:
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]

    conversations = [chat("hello!", "HI", "more", "MORE", "last", "LAST"),
                     [{"role": "system", "content": "kind"}] + chat("ask", "ANSWER", "then", "THEN"),
                     chat("x" * 40, "long answer"),
                     chat("short!", "a very long answer indeed", "cut", "CUT")]
    texts = ["".join(map(chr, ids)) for ids in chat_prompts(iter(conversations), _CharTokenizer(), max_len=30)]
    assert texts == ["uhello!a", "skinduaska", "ushort!a",          # every opening first (the long one skipped)
                     "uhello!aHIumorea", "uhello!aHIumoreaMOREulasta",  # then later turns after their history
                     "skinduaskaANSWERuthena"]                      # (the last one's second turn: too long)
    # a run asking for fewer prompts gets the first of the same order
    assert list(itertools.islice(chat_prompts(iter(conversations), _CharTokenizer(), 30), 2)) == \
        [[ord(c) for c in t] for t in texts[:2]]


def test_code_prompts_are_the_standard_librarys_documented_functions_mixed_in_evenly(tmp_path: Path) -> None:
    source = '''import os

def documented(a, b):
    """Add a and b."""
    return a + b

def bare(x):
    return x

@decorated
def hidden():
    """Decorated: its opening would not start at `def`."""

class Holder:
    def method(self):
        """Methods are left out."""
'''
    assert list(data.function_openings(source)) == ['def documented(a, b):\n    """Add a and b."""\n']
    assert list(data.function_openings("def broken(:\n")) == []
    (tmp_path / "lib" / "test").mkdir(parents=True)
    (tmp_path / "lib" / "a.py").write_text(source)
    (tmp_path / "lib" / "test" / "b.py").write_text(source)  # test suites are not code to learn from
    assert data.stdlib_sources(tmp_path / "lib") == [tmp_path / "lib" / "a.py"]
    assert len(data.stdlib_sources()) > 100  # the real one, in a fixed order
    chats, code = [[i] for i in range(100)], [[-i] for i in range(1, 100)]
    mix = list(data.mixed(chats, code, 0.25))
    assert mix[:8] == [[0], [1], [2], [-1], [3], [4], [5], [-2]]
    assert list(itertools.islice(data.mixed(chats, code, 0.25), 20)) == mix[:20]  # a longer run extends it
    assert list(data.mixed(chats, code, 0.0)) == chats and len(mix) == 133  # (until the chats run out)


def test_train_head_command_on_a_tiny_model(tmp_path: Path, monkeypatch, capsys) -> None:
    model_dir = tiny_llm_dir(tmp_path / "model", max_position_embeddings=512)
    out = tmp_path / "head"
    args = ["train-head", "--model", str(model_dir), "--out", str(out), "--conversations", "6",
            "--batch-size", "2", "--max-new-tokens", "12", "--no-progress",
            "--train-dtype", "float32"]
    assert main(args + ["--steps", "3"]) == 0
    assert (out / "head.safetensors").is_file() and (out / "checkpoint.pt").is_file()
    assert (out / RESPONSES).is_file() and (out / FEATURES / "00000.pt").is_file()
    info = json.loads((out / "head.json").read_text())
    assert info["training"]["examples"] == 6 and info["training"]["steps"] == 3
    # a rerun asking for more steps reuses the responses and their features and resumes the checkpoint
    def no_generation(*args, **kwargs):
        raise AssertionError("the responses and features should have been reused")

    monkeypatch.setattr(responses, "Engine", no_generation)
    monkeypatch.setattr(features, "prefill", no_generation)
    assert main(args + ["--steps", "5"]) == 0
    info = json.loads((out / "head.json").read_text())
    history = json.loads((out / "history.json").read_text())
    assert info["training"]["steps"] == 5 and len(history) == 5 and all(math.isfinite(h["loss"]) for h in history)
    assert info["feature_layers"] == [1]
    # sampled answers too: the greedy ones (and their features) kept, a round of sampled ones after them
    monkeypatch.undo()
    greedy = (out / RESPONSES).read_bytes()
    assert main(args + ["--steps", "6", "--sampled-answers", "1"]) == 0
    assert (out / RESPONSES).read_bytes() == greedy and (out / responses.sampled_file(1)).is_file()
    assert json.loads((out / "head.json").read_text())["training"]["examples"] == 12
    capsys.readouterr()
    for flags, error in ((["--sampled-answers", "-1"], "--sampled-answers must be >= 0"),
                         (["--sample-temperature", "0"], "--sample-temperature must be in (0, 2]")):
        assert main(args + ["--steps", "6", *flags]) == 1
        assert error in capsys.readouterr().err
    # a head that fuses both layers: its own run (the checkpoint's settings differ), its features cached apart
    fused = tmp_path / "fused"  # (and half its prompts code to complete: the standard library's functions)
    assert main([*args, "--out", str(fused), "--steps", "3", "--feature-layers", "0,1", "--code-share", "0.5"]) == 0
    assert json.loads((fused / "head.json").read_text())["feature_layers"] == [0, 1]
    def prompts_of(folder: Path) -> list[list[int]]:
        saved = json.loads(gzip.decompress((folder / RESPONSES).read_bytes()))["responses"]
        return [r["tokens"][:r["prompt_len"]] for r in saved]
    chats, mixed = prompts_of(out), prompts_of(fused)
    assert len(mixed) == 6 and mixed[::2] == chats[:3] and not set(map(tuple, mixed[1::2])) & set(map(tuple, chats))
    capsys.readouterr()
    for layers, error in (("1,0", "--feature-layers: feature layers must be distinct, ascending"),
                          ("top", "--feature-layers takes 'last' or comma-separated layer indices")):
        assert main([*args, "--out", str(fused), "--steps", "3", "--feature-layers", layers]) == 1
        assert error in capsys.readouterr().err


def test_bench_head_scores_a_head_and_a_checkpoint_alike(trained) -> None:
    """`bench head`'s agreement: the trained head (head.safetensors) and its run's last checkpoint
    (checkpoint.pt, float32) agree with the target on held-out answers alike and more often than an
    untrained head; every answer token a head drafts is counted once (all but the first:
    the target's own, from the prompt's last position)."""
    import shutil

    from quickdraft.bench.head_eval import first_token_agreement, head_from
    out, record = trained
    model = target()
    held_out = [(e.tokens[:e.prompt_len], e.tokens[e.prompt_len:]) for e in corpus(8, 1)]
    only_checkpoint = out.parent / "checkpoint-only"
    only_checkpoint.mkdir(exist_ok=True)
    shutil.copy(out / trainer.CHECKPOINT, only_checkpoint)
    torch.manual_seed(CONFIG.seed)
    untrained = DraftHead(head_config(model.config)).eval()
    (head, none), (checkpointed, training) = head_from(out, model), head_from(only_checkpoint, model)
    assert none is None and training.steps == training.timed_steps == CONFIG.steps
    assert training.seconds > 0 and training.flops == sum(h["flops"] for h in record["history"]) > 0
    rates = {}
    for name, h in (("head", head), ("checkpoint", checkpointed), ("untrained", untrained)):
        scores = [first_token_agreement(model, h, prompt, answer) for prompt, answer in held_out]
        assert [c for _, c in scores] == [len(answer) - 1 for _, answer in held_out]
        rates[name] = sum(a for a, _ in scores) / sum(c for _, c in scores)
    assert abs(rates["head"] - rates["checkpoint"]) < 0.05  # bfloat16 weights against float32
    # the tiny target's next tokens are nearly flat guesses: its trained head agrees rarely, yet ~20x
    # as often as an untrained one
    assert rates["head"] > max(0.04, 5 * rates["untrained"]), rates
