"""Suite-wide settings."""
import importlib.util

import pytest
import torch

# llama.cpp tests need the optional `bench` extra: without it they are not collected at all
# (rather than skipped), and the file's docstring says so.
collect_ignore = [] if importlib.util.find_spec("llama_cpp") else ["test_llamacpp_real.py", "test_llamacpp_tiny.py"]


@pytest.fixture(autouse=True, scope="session")
def single_thread():
    """Tiny models run fastest on one thread, and on a busy 2-core machine torch's thread pool
    can make them 30x slower; the slow real-model tests are not timed, so they run so too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
