"""SpecInfer's device form (:func:`gbv.verify.specinfer.verify_specinfer_on_device`: what
``verify_specinfer`` runs on a GPU, tensor code with one host read per call), held to the checks of
the host form: every shared exact check of ``exact_checks`` (bound below to the device form),
losslessness by enumeration on the grid, the SPEC section 10 values, the host form's outcome law
per drafted tuple, and negative controls that break the device rule and the shared level-wise
driver. Run on CPU tensors: the code is the same on any device.
"""

from __future__ import annotations

import pytest
import torch

from gbv.theory import random_instance
from gbv.verify import common, specinfer
from gbv.verify.specinfer import verify_specinfer, verify_specinfer_on_device

from exact_checks import (DEVICE_GRID, check_device_form, check_reads_the_host_once, check_reference_value,
                          check_same_outcome_laws, max_error_on_negative_set, verifier_fixture)
# The exact checks shared with the other multi-path verifiers, collected here on the device form:
from exact_checks import test_single_path_is_token_level  # noqa: F401
from exact_checks import test_temperature_zero, test_greedy_target_sampled_draft  # noqa: F401
from exact_checks import test_negative_control_set_is_lossless_unpatched, test_large_vocab_embeds_tiny  # noqa: F401

verifier = verifier_fixture(verify_specinfer_on_device)


@pytest.mark.parametrize("vocab,block_len,num_paths,kind", DEVICE_GRID)
def test_device_form_is_lossless(vocab, block_len, num_paths, kind):
    check_device_form(verify_specinfer_on_device, verify_specinfer, vocab, block_len, num_paths, kind)


@pytest.mark.parametrize("num_paths,expected", [(1, 10 / 9), (2, 4 / 3), (3, 1087 / 729)])
def test_spec_reference_values(num_paths, expected):
    check_reference_value(verify_specinfer_on_device, num_paths, expected, tol=1e-12)


@pytest.mark.parametrize("vocab,block_len,num_paths,seed", [(3, 2, 3, 0), (4, 2, 2, 1), (3, 3, 2, 2)])
def test_outcome_law_is_the_host_forms(vocab, block_len, num_paths, seed):
    """Per drafted tuple, the law of (path, accepted length, next token) equals the host form's to
    1e-12 (the forms consume their randomness differently, so only laws can be compared)."""
    inst = random_instance(vocab, block_len, num_paths, seed, "mixed")
    check_same_outcome_laws(verify_specinfer_on_device, verify_specinfer, inst, tuples=40, tol=1e-12)


def test_float32_calls_read_the_host_once():
    check_reads_the_host_once(verify_specinfer_on_device)


# ---------------------------------------------------------------------- negative controls
def _residual_never_updated(p_d, q_d, draws, alive):
    """Broken: every trial is judged against p itself (no residual after a rejection)."""
    probs, _ = _REAL_RULE(p_d, q_d, draws, alive)
    on_p, on_q = p_d.gather(0, draws).double(), q_d.gather(0, draws).double()
    return torch.where(alive, torch.clamp(on_p / on_q, max=1.0), 0.0), common.residual_on_device(p_d, q_d)


def _first_copy_only(p_d, q_d, draws, alive):
    """Broken: a duplicated draw is tried once (its later copies are treated as not alive)."""
    first = torch.tensor([int(draws[k]) not in draws[:k].tolist() for k in range(draws.shape[0])])
    return _REAL_RULE(p_d, q_d, draws, alive & first)


_REAL_RULE = specinfer._specinfer_level_on_device


@pytest.mark.parametrize("broken", [_residual_never_updated, _first_copy_only])
def test_broken_device_rules_are_caught(monkeypatch, broken):
    monkeypatch.setattr(specinfer, "_specinfer_level_on_device", broken)
    assert max_error_on_negative_set(verify_specinfer_on_device) > 1e-6


def test_driver_that_keeps_every_path_alive_is_caught(monkeypatch):
    """Broken driver: an accepted token no longer prunes the alive set (a path that disagrees with
    the emitted prefix goes on being tried at the next level)."""
    monkeypatch.setattr(common, "keep_carriers", lambda alive, draws, token: alive)
    assert max_error_on_negative_set(verify_specinfer_on_device) > 1e-6
