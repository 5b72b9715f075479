import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the `engine_toy` helper module


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest and steadiest on one thread; restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
