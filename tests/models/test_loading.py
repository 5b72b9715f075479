"""gbv.models.loading.ModelPair built from model objects."""

import torch

from gbv.models.loading import ModelPair


def test_model_pair_device_follows_the_target():
    """A pair built from model objects decodes where the target's weights are (not on a fixed CPU)."""
    target = torch.nn.Linear(2, 2).to(torch.device("meta"))
    assert ModelPair(target).device == "meta"
    assert ModelPair(torch.nn.Linear(2, 2)).device == "cpu"
    assert ModelPair(torch.nn.Linear(2, 2), device="cuda").device == "cuda"
