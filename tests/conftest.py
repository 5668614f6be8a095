"""Suite-wide settings."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def single_thread():
    """Tiny models run fastest on one thread, and on a busy 2-core machine torch's thread pool
    can make them 30x slower; the slow real-model tests are not timed, so they run so too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
