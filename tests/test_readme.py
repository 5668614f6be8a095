"""What the README says of the code's defaults is what the code does."""
from __future__ import annotations

import re
from pathlib import Path

from quickdraft.proposers.ngram import NgramOptions

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_prompt_lookups_suffix_lengths_are_the_defaults() -> None:
    said = re.search(r"suffix of (\d+) to (\d+) tokens, `--ngram-min` to `--ngram-max`", " ".join(README.split()))
    assert said, "the README no longer says which suffixes prompt lookup matches"
    assert (int(said[1]), int(said[2])) == (NgramOptions().ngram_min, NgramOptions().ngram_max)
