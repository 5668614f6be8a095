"""The head trainer: its loss falls, a trained head is accepted more often than an untrained one,
a resumed run continues exactly, and the ShareGPT reader keeps what parses of a cut-off file."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from quickdraft.cli import main
from quickdraft.engine import generate_tokens
from quickdraft.sampling import SamplingParams
from quickdraft.spec.head import DraftHead, head_config, load_head
from quickdraft.train.data import iter_sharegpt, without_benchmark
from quickdraft.train import trainer
from quickdraft.train.trainer import TrainConfig, acceptance, train_head
from test_spec_exactness import tiny
from tiny_tokenizer import tiny_llm_dir

CONFIG = TrainConfig(steps=80, batch_size=8, max_len=48, lr=3e-3, warmup=5, checkpoint_every=40)


def target():
    return tiny("llama-gqa-untied", init=0.1)


def corpus(n: int, seed: int) -> list[list[int]]:
    """The target's own greedy continuations of random prompts: the text a head must predict."""
    g = torch.Generator().manual_seed(seed)
    model, out = target(), []
    for _ in range(n):
        prompt = torch.randint(3, 96, (6,), generator=g).tolist()
        new = [t for ev in generate_tokens(model, prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
               for t in ev.token_ids]
        out.append(prompt + new)
    return out


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
    model = target()
    prompts = [s[:10] for s in corpus(8, 1)]  # held out: other random prompts
    torch.manual_seed(CONFIG.seed)
    untrained = DraftHead(head_config(model.config)).eval()
    rate_before, _ = acceptance(model, untrained, prompts)
    rate_after, per_pass = acceptance(model, load_head(out, model), prompts)
    assert rate_after > rate_before + 0.05 and per_pass > 1.1
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


def test_train_head_command_on_a_tiny_model(tmp_path: Path) -> None:
    model_dir = tiny_llm_dir(tmp_path / "model", max_position_embeddings=512)
    out = tmp_path / "head"
    rc = main(["train-head", "--model", str(model_dir), "--out", str(out), "--conversations", "6", "--steps", "3",
               "--batch-size", "2", "--max-len", "64", "--no-progress"])
    assert rc == 0 and (out / "head.safetensors").is_file() and (out / "checkpoint.pt").is_file()
    info = json.loads((out / "head.json").read_text())
    assert info["training"]["sequences"] == 6 and info["training"]["steps"] == 3
