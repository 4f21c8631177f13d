import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The recurrences are thousands of tiny ops: threads only add overhead (10x on a busy 2-core CI machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
