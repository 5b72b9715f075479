"""SpecInfer, recursive rejection sampling with replacement (SPEC section 4).

Exact losslessness by enumeration (:func:`gbv.theory.exact_analysis` replays every branch of the very
verifier code), SPEC section 10 values, temperature 0 (SPEC section 8), and a negative control:
skipping duplicate draws must be caught by the same exact check. The checks shared with the other
multi-path verifiers come from ``exact_checks``.
"""

from __future__ import annotations

import pytest

from gbv.verify import get_verifier
from gbv.verify import specinfer
from gbv.verify.specinfer import verify_specinfer

from exact_checks import check_reference_value, max_error_on_negative_set, verifier_fixture
# The exact checks shared with the other multi-path verifiers, collected here as this file's tests:
from exact_checks import test_single_path_is_token_level  # noqa: F401
from exact_checks import test_temperature_zero, test_greedy_target_sampled_draft  # noqa: F401
from exact_checks import test_negative_control_set_is_lossless_unpatched, test_large_vocab_embeds_tiny  # noqa: F401

verifier = verifier_fixture(verify_specinfer)  # what the shared tests run on


@pytest.mark.parametrize("num_paths,expected", [(1, 10 / 9), (2, 4 / 3), (3, 1087 / 729)])
def test_spec_reference_values(num_paths, expected):
    check_reference_value(verify_specinfer, num_paths, expected, tol=1e-12)


def test_registry():
    assert get_verifier("specinfer") is verify_specinfer


# ---------------------------------------------------------------------- negative control
def test_skipping_duplicate_draws_is_caught(monkeypatch):
    def first_copy_only(draws):
        return list(dict.fromkeys(draws))  # each distinct token once, in first-appearance order

    monkeypatch.setattr(specinfer, "_trial_order", first_copy_only)
    assert max_error_on_negative_set(verify_specinfer) > 1e-6
