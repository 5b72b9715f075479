"""SpecTr's device form (:func:`gbv.verify.spectr.verify_spectr_on_device`: what ``verify_spectr``
runs on a GPU, tensor code with one host read per call), held to the checks of the host form: every
shared exact check of ``exact_checks`` (bound below to the device form), losslessness by
enumeration on the grid, the SPEC section 10 values, the host form's outcome law per drafted tuple,
its root search against the host's, and a negative control (rho = 1 with k > 1). Run on CPU
tensors: the code is the same on any device.
"""

from __future__ import annotations

import pytest
import torch

from gbv.theory import random_instance
from gbv.verify import spectr
from gbv.verify.spectr import _smallest_rho, _smallest_rho_on_device, verify_spectr, verify_spectr_on_device

from exact_checks import (DEVICE_GRID, check_device_form, check_reference_value, check_same_outcome_laws,
                          max_error_on_negative_set, verifier_fixture)
# The exact checks shared with the other multi-path verifiers, collected here on the device form:
from exact_checks import test_single_path_is_token_level  # noqa: F401
from exact_checks import test_temperature_zero, test_greedy_target_sampled_draft  # noqa: F401
from exact_checks import test_negative_control_set_is_lossless_unpatched, test_large_vocab_embeds_tiny  # noqa: F401
from test_spectr import _excess, _random_pair

verifier = verifier_fixture(verify_spectr_on_device)


@pytest.mark.parametrize("vocab,block_len,num_paths,kind", DEVICE_GRID)
def test_device_form_is_lossless(vocab, block_len, num_paths, kind):
    # rho agrees with the host's to ~1e-12 relative, so E[tau] does to about that
    check_device_form(verify_spectr_on_device, verify_spectr, vocab, block_len, num_paths, kind, expected_tol=1e-9)


@pytest.mark.parametrize("num_paths,expected", [(1, 10 / 9), (2, 1.405487), (3, 1.593306)])
def test_spec_reference_values(num_paths, expected):
    check_reference_value(verify_spectr_on_device, num_paths, expected, tol=1e-6)


@pytest.mark.parametrize("vocab,block_len,num_paths,seed", [(3, 2, 3, 0), (4, 2, 2, 1), (3, 3, 2, 2)])
def test_outcome_law_is_the_host_forms(vocab, block_len, num_paths, seed):
    """Per drafted tuple, the law of (path, accepted length, next token) equals the host form's to
    1e-9 (rho to ~1e-12; the forms consume their randomness differently, so only laws compare)."""
    inst = random_instance(vocab, block_len, num_paths, seed, "mixed")
    check_same_outcome_laws(verify_spectr_on_device, verify_spectr, inst, tuples=40, tol=1e-9)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("k", [2, 3, 5, 16])
def test_device_rho_is_valid_and_the_hosts(seed, k):
    """The grid search keeps the inequality at the returned rho (lossless) and lands within 1e-10 of
    the host's bisection; also on pairs with q = 0 < p and p = q = 0 tokens, and at V = 4096."""
    for vocab in (7 + seed, 4096):
        p, q = _random_pair(vocab, seed, zeros=seed % 2 == 1)
        rho = float(_smallest_rho_on_device(p, q, torch.tensor(float(k), dtype=torch.float64)))
        assert 1.0 <= rho <= k
        assert _excess(p, q, rho, k) >= 0.0
        assert rho == pytest.approx(_smallest_rho(p, q, k), rel=1e-10)


def test_device_rho_edge_cases():
    """The host's edge cases: disjoint supports, p = q, k = 1, one-hot rows, the closed form."""
    def rho(p, q, k):
        return float(_smallest_rho_on_device(p, q, torch.tensor(float(k), dtype=torch.float64)))

    p = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    hot_a = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    hot_b = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    assert rho(p, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64), 3) == 1.0
    assert rho(p, p.clone(), 3) == 1.0
    assert rho(p, q, 1) == 1.0
    assert rho(hot_a, hot_a, 4) == 1.0 and rho(hot_a, hot_b, 4) == 1.0
    assert rho(hot_a, q, 3) == pytest.approx((1 - 0.75 ** 3) / 0.25, rel=1e-12)


# ---------------------------------------------------------------------- negative control
def test_rho_one_for_several_draws_is_caught(monkeypatch):
    monkeypatch.setattr(spectr, "_smallest_rho_on_device", lambda p, q, k: torch.ones((), dtype=torch.float64))
    assert max_error_on_negative_set(verify_spectr_on_device) > 1e-6
