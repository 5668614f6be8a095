"""The head trainer: recorded examples are the target's own greedy output with its exact features,
the loss falls, a trained head is accepted more often than an untrained one, a resumed run
continues exactly, and the ShareGPT reader keeps what parses of a cut-off file."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from quickdraft.cli import main
from quickdraft.engine import generate_tokens
from quickdraft.proposers.head import DraftHead, head_config, load_head
from quickdraft.spec.sampling import SamplingParams
from quickdraft.train import trainer
from quickdraft.train.data import iter_sharegpt, without_benchmark
from quickdraft.train.responses import Example, generate_examples
from quickdraft.train.trainer import TrainConfig, acceptance, loss_positions, train_head
from test_spec_exactness import tiny
from tiny_tokenizer import tiny_llm_dir

CONFIG = TrainConfig(steps=80, batch_size=8, max_len=48, lr=3e-3, warmup=5, checkpoint_every=40)


def target():
    return tiny("llama-gqa-untied", init=0.1)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def corpus(n: int, seed: int) -> list[Example]:
    """The target's own greedy continuations of random prompts: the text a head must predict."""
    return generate_examples(target(), prompts(n, seed), frozenset(), 40, batch_size=8, progress=False)


def test_examples_are_plain_greedy_output_with_exact_features() -> None:
    model = target()
    examples = generate_examples(model, prompts(6, 3), frozenset(), 20, batch_size=4, progress=False)
    for prompt, e in zip(prompts(6, 3), examples):
        new = [t for ev in generate_tokens(model, prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
               for t in ev.token_ids]
        # features of every position the engine ran and handed over: all but the last two (the final
        # step's run is not handed to proposers, the last token never runs)
        assert e.tokens == (prompt + new)[:len(e.features) + 1] and len(e.features) == len(prompt) + 18
        assert e.prompt_len == len(prompt)
        ids = torch.tensor([e.tokens[:-1]])
        fresh = model(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, ids.shape[1]), last_n=1).hidden[0]
        assert torch.allclose(e.features.float(), fresh, rtol=2e-2, atol=2e-2)  # stored in bfloat16


def test_losses_count_where_the_head_drafts() -> None:
    # 3 prompt tokens, 4 features: pair 2 (f_2, s_3) predicts f_3, the feature that gives the first
    # drafted token; pairs 0-1 are context only. A padded shorter row counts nothing past its end.
    e = Example(list(range(5)), torch.zeros(4, 2), prompt_len=3)
    short = Example(list(range(3)), torch.zeros(2, 2), prompt_len=1)
    assert loss_positions([e, short], 3).tolist() == [[False, False, True], [True, False, False]]
    with pytest.raises(ValueError, match="response tokens"):  # a prompt with no answer teaches nothing
        train_head(target(), [Example(list(range(4)), torch.zeros(3, 32), prompt_len=3)], CONFIG,
                   Path("unused"), "tiny", progress=False)


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


def test_resume_continues_exactly(trained, tmp_path: Path, monkeypatch) -> None:
    """A run killed after its step-40 checkpoint, rerun, ends as the uninterrupted run did."""
    _, record = trained
    data = corpus(48, 0)
    real, calls = trainer.head_loss, []

    def dies_at_step_41(*args, **kwargs):
        calls.append(1)
        if len(calls) == 41:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "head_loss", dies_at_step_41)
    with pytest.raises(KeyboardInterrupt):
        train_head(target(), data, CONFIG, tmp_path, "tiny", progress=False)
    monkeypatch.setattr(trainer, "head_loss", real)
    resumed = train_head(target(), data, CONFIG, tmp_path, "tiny", progress=False)
    assert [h["loss"] for h in resumed["history"]] == pytest.approx([h["loss"] for h in record["history"]], rel=1e-5)
    with pytest.raises(ValueError, match="other settings"):
        train_head(target(), data, dataclasses.replace(CONFIG, lr=1e-4), tmp_path, "tiny", progress=False)


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


def test_train_head_command_on_a_tiny_model(tmp_path: Path, monkeypatch) -> None:
    model_dir = tiny_llm_dir(tmp_path / "model", max_position_embeddings=512)
    out = tmp_path / "head"
    args = ["train-head", "--model", str(model_dir), "--out", str(out), "--conversations", "6",
            "--batch-size", "2", "--max-len", "64", "--max-new-tokens", "12", "--no-progress"]
    assert main(args + ["--steps", "3"]) == 0
    assert (out / "head.safetensors").is_file() and (out / "checkpoint.pt").is_file()
    info = json.loads((out / "head.json").read_text())
    assert info["training"]["examples"] == 6 and info["training"]["steps"] == 3
    # a rerun asking for more steps reuses the generated examples and resumes the checkpoint
    def no_generation(*args, **kwargs):
        raise AssertionError("the examples should have been reused")

    monkeypatch.setattr("quickdraft.train.responses.generate_examples", no_generation)
    assert main(args + ["--steps", "5"]) == 0
    info = json.loads((out / "head.json").read_text())
    assert info["training"]["steps"] == 5 and len(json.loads((out / "history.json").read_text())) == 5
