"""`quickdraft train-head`: ShareGPT prompts -> the target's own responses -> its features over
them -> a draft head, each stage saved in the output folder so that a rerun resumes where it
stopped; reports the head's acceptance on held-out prompts at the end."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

from quickdraft.cli.common import add_model_args, load_llm
from quickdraft.engine.startup import set_threads
from quickdraft.errors import QuickdraftError
from quickdraft.train.trainer import DTYPES

HELD_OUT = 8  # held-out prompts of the closing acceptance report


def cmd_train_head(args: argparse.Namespace) -> int:
    from quickdraft.bench.questions import OWN_QUESTIONS, default_questions_path, load_questions
    from quickdraft.proposers.head import load_head
    from quickdraft.train.data import (
        HELD_OUT_FROM,
        chat_prompts,
        code_prompts,
        held_out_prompts,
        iter_sharegpt,
        mixed,
        sharegpt_path,
        without_benchmark,
    )
    from quickdraft.train.features import FEATURES, training_examples
    from quickdraft.train.responses import RESPONSES, generate_responses, sampled_file
    from quickdraft.train.trainer import TrainConfig, acceptance, train_head, training_dtype

    try:
        config = TrainConfig(steps=args.steps, batch_size=args.batch_size, max_len=args.max_len, lr=args.lr,
                             unroll=args.unroll, draft_vocab=args.draft_vocab, ce_weight=args.ce_weight,
                             checkpoint_every=args.checkpoint_every, seed=args.seed, dtype=args.train_dtype,
                             feature_layers=feature_layers(args.feature_layers), mlp_width=args.mlp_width)
    except ValueError as e:
        raise QuickdraftError(str(e)) from None
    if args.init_from and not Path(args.init_from).is_file():
        raise QuickdraftError(f"--init-from {args.init_from}: no such checkpoint file")
    if not 0 <= args.code_share <= 1:
        raise QuickdraftError(f"--code-share must be in 0..1, found {args.code_share}")
    for flag in ("conversations", "max_prompt_len", "max_new_tokens", "gen_batch"):
        if getattr(args, flag) < 1:
            raise QuickdraftError(f"--{flag.replace('_', '-')} must be >= 1, found {getattr(args, flag)}")
    if args.sampled_answers < 0:
        raise QuickdraftError(f"--sampled-answers must be >= 0, found {args.sampled_answers}")
    if not 0 < args.sample_temperature <= 2:
        raise QuickdraftError(f"--sample-temperature must be in (0, 2], found {args.sample_temperature}")
    data = sharegpt_path("train")
    set_threads(args.threads)
    llm = load_llm(args, progress=not args.no_progress, prefix_cache=False)
    top = llm.model.config.num_layers - 1
    try:  # the features the head reads, exactly (examples carry them): no engine over this model keeps others
        llm.model.keep_features(config.feature_layers or (top,))
    except ValueError as e:
        raise QuickdraftError(f"--feature-layers: {e}") from None
    if config.feature_layers == (top,):  # the last layer alone, however named: the same head and run
        config = dataclasses.replace(config, feature_layers=())
    questions = default_questions_path()
    banned = {t for f in (questions, OWN_QUESTIONS) if f for q in load_questions(f) for t in q.turns}
    print(f"quickdraft: {len(banned)} benchmark turns excluded from training"
          f"{'' if questions else ' (no Spec-Bench file found)'}", file=sys.stderr)
    conversations = without_benchmark(itertools.islice(iter_sharegpt(data), HELD_OUT_FROM), banned)
    chats = chat_prompts(conversations, llm.tokenizer, args.max_prompt_len)
    prompts = list(itertools.islice(mixed(chats, code_prompts(llm.tokenizer, args.max_prompt_len), args.code_share),
                                    args.conversations))
    if len(prompts) < args.conversations:
        raise QuickdraftError(f"--conversations {args.conversations}: the first {HELD_OUT_FROM} conversations (the "
                              f"rest are held out for `bench head`) and the standard library's functions give "
                              f"{len(prompts)} usable prompts")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    code = f" and the standard library's code ({args.code_share:.0%})" if args.code_share else ""
    sampled = (f", then {args.sampled_answers} sampled answer{'s' * (args.sampled_answers > 1)} to each at "
               f"temperature {args.sample_temperature:g}" if args.sampled_answers else "")
    print(f"quickdraft: the target answers {len(prompts)} prompts from {data.name}{code} (greedy{sampled}; up to "
          f"{args.max_new_tokens} tokens each; those in {out} are kept)", file=sys.stderr)
    try:
        # the greedy answers first, then each round of sampled ones (seeded by its round)
        rounds = [(RESPONSES, 0.0)] + [(sampled_file(r), args.sample_temperature)
                                       for r in range(1, args.sampled_answers + 1)]
        responses = []
        for seed, (name, temperature) in enumerate(rounds):
            responses += generate_responses(llm.model, prompts, llm.tokenizer.eos_token_ids, args.max_new_tokens,
                                            out / name, args.gen_batch, progress, temperature=temperature, seed=seed)
        examples = training_examples(llm.model, responses, out / FEATURES, progress)
        print(f"quickdraft: {len(examples)} examples, {sum(len(e.tokens) for e in examples)} tokens; training "
              f"in {str(training_dtype(config.dtype, llm.model.device)).removeprefix('torch.')}", file=sys.stderr)
        train_head(llm.model, examples, config, out, args.model, progress=progress,
                   init=Path(args.init_from) if args.init_from else None)
    except ValueError as e:
        raise QuickdraftError(str(e)) from None
    head = load_head(out, llm.model)
    held_out = held_out_prompts(llm.tokenizer, HELD_OUT, args.max_prompt_len, "train")
    if held_out:
        rate, per_pass = acceptance(llm.model, head, held_out, k=4, max_new_tokens=64)
        print(f"quickdraft: held-out acceptance {rate:.0%}, {per_pass:.2f} tokens per target pass "
              f"(greedy, up to k=4, {len(held_out)} prompts)", file=sys.stderr)
    print(f"quickdraft: head written to {out}", file=sys.stderr)
    return 0


def feature_layers(text: str) -> tuple[int, ...]:
    """--feature-layers: "last" (the default), or layer indices "2,15,29" ascending to the last."""
    if text == "last":
        return ()
    try:
        return tuple(int(i) for i in text.split(","))
    except ValueError:
        raise QuickdraftError(f"--feature-layers takes 'last' or comma-separated layer indices, found {text!r}") from None


def add_train_head(sub) -> None:
    tr = sub.add_parser("train-head", help="train an EAGLE-style draft head for a target on ShareGPT")
    add_model_args(tr)
    tr.add_argument("--out", required=True, help="folder for head.safetensors, head.json and checkpoints")
    tr.add_argument("--conversations", type=int, default=2000,
                    help="prompts the target answers for training: ShareGPT opening turns, then later turns "
                         "after their conversation's history, code mixed in by --code-share (the name is old)")
    tr.add_argument("--code-share", type=float, default=0.0,
                    help="share of the prompts that are code to complete (the standard library's functions, "
                         "signature and docstring, as HumanEval's prompts) rather than ShareGPT turns")
    tr.add_argument("--max-prompt-len", type=int, default=256, help="longer prompts (a later turn: with its history) are skipped")
    tr.add_argument("--max-new-tokens", type=int, default=160, help="tokens per generated response at most")
    tr.add_argument("--gen-batch", type=int, default=32, help="responses generated together")
    tr.add_argument("--sampled-answers", type=int, default=0,
                    help="after the greedy answers, this many sampled answers to each prompt (seeded; more text "
                         "to learn from than the prompts alone give: a head that memorizes its data generalizes "
                         "less)")
    tr.add_argument("--sample-temperature", type=float, default=0.7, help="temperature of --sampled-answers")
    tr.add_argument("--steps", type=int, default=1000)
    tr.add_argument("--batch-size", type=int, default=8, help="examples per step")
    tr.add_argument("--max-len", type=int, default=384, help="positions per example at most")
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--unroll", type=int, default=3,
                    help="head passes per step: the first on the target's features, then on its own")
    tr.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head may draft")
    tr.add_argument("--ce-weight", type=float,
                    help="weight of the next-token cross-entropy beside the feature regression (default: a resumed "
                         "run's own, else EAGLE's 0.1); a resumed run may change it")
    tr.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    tr.add_argument("--feature-layers", default="last",
                    help="the target's layers the head reads: 'last', or indices ending with the last layer, e.g. "
                         "2,15,29 for SmolLM2 (EAGLE-3: a low, a middle and the last layer's outputs, fused)")
    tr.add_argument("--mlp-width", type=int, default=0,
                    help="the head's MLP width (default 0: the target's; a narrower one trains and drafts faster, "
                         "as a large target's 8,960 makes a head of ~60M weights)")
    tr.add_argument("--init-from", metavar="CHECKPOINT",
                    help="start a head that fuses layers from the checkpoint.pt of one that read the last layer "
                         "alone (same settings otherwise, --ce-weight aside): its step, its history, its weights, the fuse passing "
                         "the last layer's output at first")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--train-dtype", choices=DTYPES, default="auto",
                    help="dtype of the training's matmuls (the head's weights stay float32; --dtype is the target's); "
                         "auto: bfloat16 where the CPU multiplies it natively (AMX-BF16 or AVX512-BF16) or on "
                         "a GPU that does, else float32")
    tr.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    tr.add_argument("--no-progress", action="store_true")
    tr.set_defaults(func=cmd_train_head)


def cmd_build_datastore(args: argparse.Namespace) -> int:
    import gzip
    import json

    from quickdraft.proposers.datastore import load_datastore, save
    from quickdraft.proposers.identity import trained_for

    llm = load_llm(args, progress=not args.no_progress, prefix_cache=False)
    docs: list[list[int]] = []
    for path in args.answers:
        try:
            saved = json.loads(gzip.decompress(Path(path).read_bytes()))
            answers = [r["tokens"][r["prompt_len"]:] for r in saved["responses"]]
            theirs = saved["settings"]["target_probe"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise QuickdraftError(f"--answers {path}: not a file of `train-head`'s answers ({e})") from None
        if not trained_for({"target_probe": theirs, "target_config": {}}, llm.model):  # the probe, to its tolerance
            raise QuickdraftError(f"--answers {path}: the answers of another model (its probe differs from "
                                  f"{args.model}'s)")
        docs += answers
    out = save(Path(args.out), docs, llm.model, {"sources": [Path(p).name for p in args.answers]})
    store = load_datastore(out, llm.model.config.vocab_size)  # the table a proposer builds: that it loads, its size
    print(f"quickdraft: {len(docs)} answers, {store.size} tokens, {len(store.keys)} contexts written to {out} "
          f"({out.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


def add_build_datastore(sub) -> None:
    p = sub.add_parser("build-datastore", help="a datastore of the target's own answers for --spec store|lookup-store")
    add_model_args(p)
    p.add_argument("--answers", nargs="+", required=True,
                   help="files of the target's answers: `train-head` writes them (its --out folder's "
                        "responses.json.gz); made by this model, never from a benchmark's prompts")
    p.add_argument("--out", required=True, help="the datastore file to write (.npz); pass it with --datastore FILE")
    p.add_argument("--no-progress", action="store_true", help="no loading progress bar")
    p.set_defaults(func=cmd_build_datastore)
