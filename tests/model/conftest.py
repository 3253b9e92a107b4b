import os

import pytest
import torch

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.set_num_threads(1)
