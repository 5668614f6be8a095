"""Suite-wide settings."""
import importlib.util

import pytest
import torch

from support.bench import model_dir  # noqa: F401 (the bench tests' fixture, a module's own `model_dir` wins)
from support.server import dirs, llm  # noqa: F401 (the server tests' fixtures, a module's own `llm` wins)

# llama.cpp tests need the optional `llamacpp` extra: without it they are not collected at all
# (rather than skipped), and the file's docstring says so.
collect_ignore = [] if importlib.util.find_spec("llama_cpp") else ["test_llamacpp_real.py", "test_llamacpp_tiny.py"]

# The fast subset (`pytest -m unit`, under a minute on 2 cores: 28 s with a training run beside it on
# an AMD EPYC Zen 4): the modules whose tests need no model heavier than a tiny random one and no
# server process (test_request_budget's servers run in a thread), listed so that a module joins by name.
UNIT = {"test_cache", "test_docs_links", "test_draft_contract", "test_draft_cost", "test_engine_stats", "test_extras",
        "test_family_specs", "test_goodput", "test_imports", "test_ngram", "test_proposer_shape", "test_registry",
        "test_request_budget", "test_rope_scaling", "test_sampling", "test_scheduler", "test_schema_validity", "test_scores",
        "test_spec_errors", "test_token_bound", "test_token_origins", "test_tokenizer", "test_harmony"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__ in UNIT and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True, scope="session")
def single_thread():
    """Tiny models run fastest on one thread, and on a busy 2-core machine torch's thread pool
    can make them 30x slower; the slow real-model tests are not timed, so they run so too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def free_draft_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft-model forwards measured as free, in every test unless it says otherwise.

    A drafter weighs its own forwards before drafting (proposers/draft_cost.py): a draft that costs
    as much as its target drafts little or nothing. The tiny test drafts cost what their tiny
    targets do, so without this most tests' drafts would be cut short by timing, and their premises
    (drafts offered, accepted and rejected) would hang on the machine's speed. Under it a drafter
    behaves as one far cheaper than its target: a token is drafted when its expected gain pays for
    its verification. tests/test_draft_cost.py measures real costs instead."""
    from quickdraft.proposers.draft_cost import ForwardTimes
    observe = ForwardTimes.observe
    monkeypatch.setattr(ForwardTimes, "observe", lambda self, kind, seconds: observe(self, kind, 0.0))
