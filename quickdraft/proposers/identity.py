"""What a file made for one target (a draft head, a datastore, train-head's answers) records of
that target, and the check that a model is it: its shape and a few embedding values, which tell
one target's weights from another's while a bfloat16 or re-quantized copy still matches.
"""
from __future__ import annotations

from quickdraft.model.llama import Transformer

PROBE_ROWS = (0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89)  # embedding rows that identify a target
PROBE_TOLERANCE = 0.02       # relative: a bfloat16 or re-quantized copy of the target still matches


def target_probe(target: Transformer) -> list[float]:
    """A few embedding values: enough to tell one target's weights from another's."""
    rows = [r for r in PROBE_ROWS if r < target.config.vocab_size]
    return target.embed.weight[rows, :4].float().flatten().tolist()


def target_identity(target: Transformer) -> dict:
    """What a file made for `target` records of it (`trained_for` checks): its shape and an
    embedding probe."""
    return {"target_probe": target_probe(target),
            "target_config": {"vocab_size": target.config.vocab_size, "hidden_size": target.config.hidden_size,
                              "num_layers": target.config.num_layers, "num_heads": target.config.num_heads,
                              "num_kv_heads": target.config.num_kv_heads}}


def trained_for(info: dict, target: Transformer) -> bool:
    """Whether a file made for a target (a head's head.json, a datastore's description) names
    `target`: same shape (the keys it records), same embedding probe."""
    ours = target_probe(target)
    theirs = info.get("target_probe", [])
    shape = {k: getattr(target.config, k, None) for k in info.get("target_config", {})}
    scale = max(max((abs(v) for v in ours), default=0.0), 1e-6)
    return shape == info.get("target_config") and len(theirs) == len(ours) and \
        all(abs(a - b) <= PROBE_TOLERANCE * scale for a, b in zip(ours, theirs))
