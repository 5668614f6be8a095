"""Learned draft head (EAGLE-style): one decoder layer that predicts the target's next last-layer
feature from its current feature and the next token's embedding; the target's own frozen final
norm and LM head turn a predicted feature into q.

Feature f_t is the target's last-layer output (before the final norm) at position t; the head's
input at position t is the pair (f_t, embedding of token t+1) and its output predicts f_{t+1}.
The target's forward returns those features for every position it runs, so a head costs no extra
target pass: the engine hands each step's features to `commit`. A head may read more of the target
than its last layer (EAGLE-3): its `feature_layers`, a low, a middle and the last layer's outputs,
which a learned `fuse` (3D -> D) turns into the f_t it reads at the target's positions; at its own
draft steps it reads its own predictions, D wide, as ever. The target keeps the layers its head
reads (Transformer.keep_features).

The head drafts over a *draft vocabulary*, the target's most frequent tokens in its training data:
on a CPU the LM head of a 49k-token vocabulary costs a fifth of a whole SmolLM2 forward per draft
token, 8k rows a thirtieth. q is zero outside it, which rejection sampling handles exactly.

    committed: s_0 .. s_{L-1}, features f_0 .. f_{L-2} (s_{L-1} is the target's newest token, not
    yet run) -> the head runs pairs (f_t, s_{t+1}) up to t = L-2, predicting f_{L-1}; q_1 comes
    from it, draft d_1 ~ q_1; then (f^_{L-1}, d_1) at position L-1 predicts f_L, and so on.

Heads that ship with quickdraft live in quickdraft/heads/<model>/; `packaged_head` finds the one
trained for a given target by its head.json (shape and embedding probe).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from gguf import GGMLQuantizationType
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from quickdraft.kernels import QuantizedWeight, linear
from quickdraft.kv.cache import KVCache
from quickdraft.model.config import ModelConfig
from quickdraft.model.llama import Block, Transformer, attention_inputs
from quickdraft.model.rope import RotaryTable, inverse_frequencies
from quickdraft.proposers.base import EACH, NO_DRAFT, Committed, Draft, ProposerContext, SpecConfigError, register
from quickdraft.proposers.growing_tree import GrowingTree
from quickdraft.proposers.identity import target_identity, trained_for
from quickdraft.proposers.registry import check_ranges, option
from quickdraft.spec.goodput import Acceptance
from quickdraft.spec.sampling import SamplingParams, probabilities
from quickdraft.weights.quantize import GROUP as QUANT_GROUP
from quickdraft.weights.quantize import as_blocks

HEAD_FORMAT = "quickdraft-head-v1"
WEIGHTS, CONFIG = "head.safetensors", "head.json"
HEAD_SEED_SALT = 0x4EAD_5EED  # the head's RNG must not replay the verifier's draws
HEAD_BLOCKS = GGMLQuantizationType.Q8_0  # the head's matrices over a target run as GGUF blocks
PACKAGED_HEADS = Path(__file__).resolve().parent.parent / "heads"  # one folder per model
MAX_REST = 16     # steps the head rests at most after the engine declines its drafts
STOP_REACH = 0.2  # drafting stops once the estimated chance that all drafts so far are accepted
                  # falls below this: a further draft step (a head forward) would rarely pay


def head_config(target: ModelConfig, mlp_width: int = 0) -> ModelConfig:
    """The head's one decoder layer has the target's layer shape, with a dense MLP where the
    target's layers have experts (intermediate_size: the family's dense width, or `mlp_width`
    where one is given: a 1.5B target's 8,960 would make a head of ~60M weights, seconds a
    training step on a CPU), no attention sinks (gpt-oss's are learned logits a head would hold
    fixed at 0), and the window of the target's first layer (Gemma's and gpt-oss's: a sliding one)."""
    return dataclasses.replace(target, num_layers=1, num_experts=0, experts_per_token=0, attn_sinks=False,
                               layer_windows=target.layer_windows[:1],
                               intermediate_size=mlp_width or target.intermediate_size)


class DraftHead(nn.Module):
    def __init__(self, config: ModelConfig, vocab: torch.Tensor | None = None,
                 feature_layers: Sequence[int] = ()) -> None:
        """vocab: the draft vocabulary's token ids [Vd] (default: the whole vocabulary); feature_layers:
        the target's layers whose outputs it reads (Transformer.keep_features; (): the last alone)."""
        super().__init__()
        self.config = config
        self.feature_layers = tuple(int(i) for i in feature_layers)
        D = config.hidden_size
        # (a grown head's passes the last layer's output through at first: `fuse_from_top`)
        self.fuse = nn.Linear(len(self.feature_layers) * D, D, bias=False) if len(self.feature_layers) > 1 else None
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.block = Block(config, 0)  # one layer shaped as the target's first
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)
        self.rope = RotaryTable()
        self.register_buffer("vocab", torch.arange(config.vocab_size) if vocab is None else vocab.long())
        self._output: tuple[object, torch.Tensor | QuantizedWeight] | None = None  # (the target's head, its rows)

    def output_rows(self, target: Transformer) -> torch.Tensor | QuantizedWeight:
        """The target's LM-head rows of the draft vocabulary [Vd, D], held as the target holds its
        head (GGUF blocks stay blocks: dequantized float32 rows are ~6x the bytes a draft token
        reads); made once per head and target weight, not per request (dequantizing took ~35 ms);
        the target's own head where the draft vocabulary is the whole one."""
        weight = target.lm_head.weight
        if self._output is None or self._output[0] is not weight:
            whole = len(self.vocab) == weight.shape[0] and \
                bool((self.vocab == torch.arange(len(self.vocab), device=self.vocab.device)).all())
            rows = weight if whole else \
                weight.take(self.vocab) if isinstance(weight, QuantizedWeight) else weight[self.vocab].contiguous()
            self._output = (weight, rows)
        return self._output[1]

    def reads(self, target: Transformer) -> tuple[int, ...]:
        """The target's layers this head reads, as Transformer.feature_layers names them."""
        return self.feature_layers or (target.config.num_layers - 1,)

    def read(self, features: torch.Tensor) -> torch.Tensor:
        """[..., F] the outputs of the layers it reads, side by side -> [..., D] the f_t the head reads."""
        return features if self.fuse is None else linear(features, self.fuse.weight)

    def columns(self, target: Transformer) -> torch.Tensor | None:
        """Which of the target's feature columns are the layers this head reads ([F_head] indices;
        None: all of them, in order); a head that reads a layer the target does not keep is an error."""
        reads, kept, D = self.reads(target), target.feature_layers, target.config.hidden_size
        if reads == kept:
            return None
        if not set(reads) <= set(kept):
            raise SpecConfigError(f"this draft head reads the target's layers {list(reads)}, and the model keeps the "
                                  f"features of layers {list(kept)}: load the model with this head (--head DIR; in "
                                  f"Python, quickdraft.load(..., spec=SpecConfig(head=DIR))) so that it keeps them")
        return torch.cat([torch.arange(kept.index(i) * D, (kept.index(i) + 1) * D) for i in reads]).to(target.device)

    def fuse_from_top(self) -> None:
        """Set the fuse to pass the last layer's output through: a head trained on that alone reads
        as before, and learns from there what the other layers add."""
        D = self.config.hidden_size
        with torch.no_grad():
            self.fuse.weight.zero_()[:, -D:] = torch.eye(D)

    def new_cache(self, capacity: int, device: torch.device, dtype: torch.dtype, batch_size: int = 1) -> KVCache:
        return KVCache(self.config, batch_size, capacity, device, dtype)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, attn_mask: torch.Tensor | None = None, slots: torch.Tensor | None = None
                ) -> torch.Tensor:
        """features (what `read` gives), token_embeds: [B, T, D] pairs (f_t, e(s_{t+1})) at positions t [B, T] ->
        predicted f_{t+1} [B, T, D]. K/V go to cache `slots` (default: the positions), narrowed
        by `attn_mask` [B, T, kv_len] as in the target's forward (a tree's nodes)."""
        x = linear(torch.cat([token_embeds, features], dim=-1), self.fc.weight)
        return self.block(x, cache, 0, attention_inputs(self.rope, self.inv_freq, positions, cache, attn_mask, slots))


def save_head(head: DraftHead, target: Transformer, path: Path, target_name: str,
              training: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """DIR/head.safetensors + DIR/head.json naming the target it was trained for."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous()
               for k, v in head.state_dict().items()}, str(path / WEIGHTS))
    info = {"format": HEAD_FORMAT, "target": target_name, **target_identity(target),
            "feature_layers": list(head.reads(target)), "mlp_width": head.config.intermediate_size,
            "training": training or {}}
    (path / CONFIG).write_text(json.dumps(info, indent=1))
    return path


def packaged_reads(target: Transformer) -> tuple[int, ...]:
    """The target layers the head that ships for `target` reads (its head.json alone is read); the
    last layer's where none ships or it cannot be read (loading it says why)."""
    try:
        return feature_layers_of(json.loads((packaged_head(target) / CONFIG).read_text()), target) or \
            (target.config.num_layers - 1,)
    except (SpecConfigError, OSError, ValueError):
        return (target.config.num_layers - 1,)


def feature_layers_of(info: dict, target: Transformer) -> tuple[int, ...]:
    """The target layers a head.json says its head reads, as DraftHead takes them (() for the last
    layer alone, as heads written before heads could fuse layers read); invalid ones are an error."""
    layers, top = info.get("feature_layers", [target.config.num_layers - 1]), target.config.num_layers - 1
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) and 0 <= i <= top for i in layers) \
            or layers != sorted(set(layers)) or layers[-1] != top:
        raise SpecConfigError(f"the draft head's feature_layers {layers!r} are not ascending layers of this target "
                              f"ending with its last ({top})")
    return () if layers == [top] else tuple(layers)


def mlp_width_of(info: dict) -> int:
    """The MLP width a head.json records (0, the target's, for heads written before it was recorded)."""
    width = info.get("mlp_width", 0)
    if not isinstance(width, int) or isinstance(width, bool) or width < 0:
        raise SpecConfigError(f"the draft head's mlp_width {width!r} is not an integer >= 0 (0: the target's width)")
    return width


def packaged_head(target: Transformer) -> Path:
    """The head that ships with quickdraft for `target` (quickdraft/heads/<model>/)."""
    for folder in sorted(PACKAGED_HEADS.iterdir()) if PACKAGED_HEADS.is_dir() else []:
        try:
            info = json.loads((folder / CONFIG).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and trained_for(info, target):
            return folder
    raise SpecConfigError("no draft head ships with quickdraft for this model; train one with "
                          "`quickdraft train-head` and pass its folder with --head DIR")


def load_head(path: str | Path, target: Transformer) -> DraftHead:
    """A head for `target` from DIR (head.safetensors + head.json); a head trained for another
    target, or damaged files, is a clear error."""
    path = Path(path)
    try:
        info = json.loads((path / CONFIG).read_text())
        tensors = load_file(str(path / WEIGHTS))
    except (OSError, ValueError, SafetensorError) as e:
        raise SpecConfigError(f"cannot read a draft head from {path}: expected {CONFIG} and {WEIGHTS} "
                              f"there ({e})") from None
    if info.get("format") != HEAD_FORMAT:
        raise SpecConfigError(f"{path / CONFIG} is not a quickdraft head (format {info.get('format')!r}, "
                              f"expected {HEAD_FORMAT!r})")
    if not trained_for(info, target):
        raise SpecConfigError(f"the draft head in {path} was trained for {info.get('target')!r}, a different "
                              f"model than this target (its shape or embedding weights differ)")
    vocab = tensors.get("vocab")
    if vocab is None or vocab.dim() != 1 or not len(vocab) or int(vocab.min()) < 0 or \
            int(vocab.max()) >= target.config.vocab_size:
        raise SpecConfigError(f"the draft head in {path} has no valid draft vocabulary for this target")
    head = DraftHead(head_config(target.config, mlp_width_of(info)), vocab, feature_layers_of(info, target))
    try:
        head.load_state_dict(tensors)
    except RuntimeError as e:
        raise SpecConfigError(f"the draft head in {path} does not fit this target: {e}") from None
    return as_target_runs(on_target(head, target).requires_grad_(False).eval(), target)


def as_target_runs(head: DraftHead, target: Transformer) -> DraftHead:
    """Over a target whose matrices run as GGUF blocks (CPU, the C kernels), the head's matrices
    become Q8_0 blocks too: a draft step is weight-bound like a decode step, and float32 matrices
    made SmolLM2's head forward cost ~18% of a target step (2.3 ms of 12.5, Intel Xeon, 2 threads),
    four times its blocks' bytes. Exactness does not depend on it: the target verifies every draft
    (and a sampled draft carries the q it was drawn from)."""
    matrices = (head.fc, head.block.wqkv, head.block.wo, head.block.w_gate_up, head.block.w_down) + \
        ((head.fuse,) if head.fuse is not None else ())
    if not target.quantized or any(m.weight.shape[1] % QUANT_GROUP for m in matrices):
        return head  # (rows that are not whole Q8_0 blocks stay float: a head for an odd-sized target)
    for owner in matrices:
        blocks = as_blocks(owner.weight, HEAD_BLOCKS)
        del owner.weight  # a plain attribute now, as the target's own blocks (model/build.py)
        owner.weight = blocks
    return head


def on_target(head: DraftHead, target: Transformer) -> DraftHead:
    """The head on the target's device in its compute dtype, its rotary frequencies float32 as the
    target's are (`.to(bfloat16)` would round them: on CUDA, angles off by ~0.4% of position x
    frequency, so the head attended to other relative positions than it was trained on)."""
    head = head.to(device=target.device, dtype=target.compute_dtype)
    head.inv_freq = inverse_frequencies(head.config).to(target.device)
    return head


class Rest:
    """When the engine declines a draft the head ran for, its forwards were work for nothing (a
    few percent of a batched step per row): the head then sits out a doubling number of steps, up
    to MAX_REST, until a draft it ran for is verified again. A hybrid's prompt lookup drafts
    meanwhile; its successes say nothing of the head's."""

    def __init__(self) -> None:
        self.length, self.left = 1, 0  # the rest after the next decline; steps still to sit out
        self.ran = False               # the head ran for the draft the engine just saw

    @property
    def resting(self) -> bool:
        return self.left > 0

    def after_step(self, verified: int) -> None:
        """Called once per engine step, before the next proposal."""
        if self.left:
            self.left -= 1
        elif self.ran and verified == 0:
            self.length = min(2 * self.length, MAX_REST)
            self.left = self.length
        elif self.ran:
            self.length = 1
        self.ran = False


class HeadProposer:
    """Drafts k tokens with a DraftHead over its own one-layer cache, from the target's features
    that each commit brings."""
    group = EACH  # drafts alone (proposers/base.py)

    def __init__(self, head: DraftHead, target: Transformer, prompt_ids: Sequence[int],
                 params: SamplingParams, capacity: int, width: int = 1) -> None:
        """width 1: a chain (sampled rows draw it from q); more: a tree (head_tree)."""
        self.columns = head.columns(target)  # the model may keep more layers than this head reads
        self.head, self.target, self.params, self.width = head, target, params, width
        self.cache = head.new_cache(capacity, target.device, target.compute_dtype)
        self.tokens = list(prompt_ids)
        self.features = torch.empty(capacity, target.config.hidden_size, device=target.device,
                                    dtype=target.compute_dtype)
        self.n_features = 0  # f_0 .. f_{n-1} known
        self.cached = 0      # pairs (f_t, s_{t+1}) with K/V in the head's cache: t < cached
        seed = None if params.seed is None else (params.seed ^ HEAD_SEED_SALT) % 2**63
        self.generator = SamplingParams(seed=seed).make_generator(target.device)
        self.agreement = Acceptance()
        self.rest = Rest()
        self.pending: list[int] = []       # the last proposal
        self.vocab = head.vocab.to(target.device)
        self.lm_weight = head.output_rows(target)  # [Vd, D] the draft vocabulary's rows

    @torch.inference_mode()
    def commit(self, step: Committed) -> None:
        self.cache.truncate([self.cached])  # the last proposal's draft steps are evicted
        self.agreement.judge(self.pending, step.tokens)
        self.pending = []
        self.tokens.extend(step.tokens)
        self.rest.after_step(step.verified)
        n = step.features.shape[0]
        # the fuse runs once per committed position; draft steps read the head's own D-wide outputs
        mine = step.features if self.columns is None else step.features[:, self.columns]
        self.features[self.n_features:self.n_features + n] = self.head.read(mine)
        self.n_features += n

    def _step(self, features: torch.Tensor, tokens: list[int], start: int, positions: list[int] | None = None,
              attn_mask: torch.Tensor | None = None, slots: list[int] | None = None) -> torch.Tensor:
        """Pairs (features [T, D], tokens) at positions start.. (or `positions`) -> predicted [T, D]."""
        device = self.target.device
        embeds = self.target.embed(torch.tensor([tokens], device=device)).to(features.dtype)
        at = torch.arange(start, start + len(tokens)) if positions is None else torch.tensor(positions)
        return self.head(features[None], embeds, at.to(device)[None], self.cache, attn_mask,
                         None if slots is None else torch.tensor([slots], device=device))[0]

    @torch.inference_mode()
    def propose(self, k: int) -> Draft:
        pairs = min(self.n_features, len(self.tokens) - 1)
        k = min(k, self.cache.max_len - pairs + 1)
        if k <= 0 or pairs == 0 or self.rest.resting:
            return NO_DRAFT
        self.rest.ran = True
        start = min(self.cached, pairs - 1)  # at least the newest pair runs: it predicts f_pairs
        self.cache.truncate([start])
        predicted = self._step(self.features[start:pairs], self.tokens[start + 1:pairs + 1], start)[-1:]
        self.cached = pairs
        return self._chain(predicted, pairs, k) if self.width == 1 else self._tree(predicted, pairs, k)

    def _q(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits [1, Vd] on the draft vocabulary -> q [1, V] on the target's."""
        V = self.target.config.vocab_size
        if self.params.logit_bias:
            return probabilities(logits.new_full((1, V), float("-inf")).index_copy_(1, self.vocab, logits), self.params)
        q_draft = probabilities(logits, self.params)
        return torch.zeros(1, V, device=q_draft.device).index_copy_(1, self.vocab, q_draft)

    def _chain(self, predicted: torch.Tensor, pairs: int, k: int) -> Draft:
        drafted, qs, estimates, reach = [], [], [], 1.0
        for i in range(k):
            logits = linear(predicted, self.lm_weight, norm=self.target.norm.fused)  # [1, Vd]
            if self.params.greedy:
                # the head's confidence in its top token estimates the chance the target agrees
                confidence, best = torch.softmax(logits.float(), dim=-1).max(-1)
                x, estimate = int(self.vocab[best]), float(confidence)
            else:
                # the target's processing on the draft vocabulary = on the whole one with -inf elsewhere
                # (there, where a logit bias names the target's ids)
                q = self._q(logits)  # [1, V]
                x, estimate = int(torch.multinomial(q, 1, generator=self.generator)), self.agreement.rate
                qs.append(q)
            drafted.append(x)
            estimates.append(estimate)
            reach *= estimate
            # each draft step costs a head forward: stop once the draft is unlikely to get this far
            if reach < STOP_REACH or i == k - 1:
                break
            predicted = self._step(predicted, [x], pairs + i)
        self.pending = drafted
        # the estimates let the engine's policy verify only what pays (engine/policy.py)
        return Draft(drafted, None if self.params.greedy else torch.cat(qs), estimates)

    def _tree(self, predicted: torch.Tensor, pairs: int, k: int) -> Draft:
        """EAGLE-2's dynamic tree: level by level, the `width` nodes of the newest level likeliest to
        be reached (the product of the head's probabilities along their paths) run in one head
        forward, each adding its `width` likeliest tokens as children; then the k likeliest nodes
        of all are the draft (a child is never likelier than its parent: they form a tree), in
        descending likelihood, as the policy verifies prefixes. The nodes are the head's choices,
        not draws: q is None for every row, which the verifier's recursive rejection takes exactly
        (a rejected sibling's token leaves p before the next is tried)."""
        tree = GrowingTree()
        expanded, features = [-1], predicted  # the nodes run last (-1: the root) and their predictions
        for level in range(k):
            logits = linear(features, self.lm_weight, norm=self.target.norm.fused)  # [len(expanded), Vd]
            top_p, top_i = torch.softmax(logits.float(), dim=-1).topk(min(self.width, logits.shape[-1]), dim=-1)
            newest = tree.grow(expanded, top_p.tolist(), self.vocab[top_i].tolist())
            run = sorted(newest, key=lambda n: -tree.reach[n])[:self.width]
            kth = sorted(tree.reach, reverse=True)[k - 1] if len(tree.reach) >= k else 0.0
            first = pairs + len(tree.slot)
            if level == k - 1 or tree.reach[run[0]] <= kth or first + len(run) > self.cache.max_len:
                break  # no deeper node could make the k likeliest (or the head's cache is full)
            tree.slot.update({n: first + j for j, n in enumerate(run)})
            mask = tree.visible(run, pairs)[None]  # [1, T, kv_len]
            rows = [expanded.index(tree.parents[n]) for n in run]
            features = self._step(features[rows], [tree.tokens[n] for n in run], pairs,
                                  [pairs + tree.depth[n] - 1 for n in run], mask.to(predicted.device),
                                  [tree.slot[n] for n in run])
            expanded = run
        keep, parents = tree.likeliest(k)
        self.pending = []
        return Draft([tree.tokens[n] for n in keep], None, [tree.probs[n] for n in keep], parents)


@register("head", loads="head", needs_file=True,
          about="a trained draft head (EAGLE-style) over the target's features")
def make_head(ctx: ProposerContext) -> HeadProposer:
    head = ctx.target.draft_head(ctx.config.head)
    capacity = len(ctx.prompt_ids) + ctx.params.max_new_tokens + ctx.config.k + 1
    return HeadProposer(head, ctx.target.model, ctx.prompt_ids, ctx.params, capacity)


@dataclass(frozen=True)
class HeadTreeOptions:
    head_width: int = option(4, "head-tree: nodes the head runs per level, and children each adds", 2, 16)

    def __post_init__(self) -> None:
        check_ranges(self)


@register("head-tree", HeadTreeOptions, loads="head", needs_file=True,
          about="the draft head's likeliest continuations as a tree (EAGLE-2's dynamic tree)")
def make_head_tree(ctx: ProposerContext) -> HeadProposer:
    width = ctx.options.head_width
    # the tree's nodes run in the head's cache past the committed pairs: width per level, k levels
    capacity = len(ctx.prompt_ids) + ctx.params.max_new_tokens + (width + 1) * ctx.config.k + 1
    return HeadProposer(ctx.target.draft_head(ctx.config.head), ctx.target.model, ctx.prompt_ids, ctx.params,
                        capacity, width)
