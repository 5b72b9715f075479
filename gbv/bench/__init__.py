"""Benchmarks: ``gbv bench`` sweeps datasets x methods x K x L x temperature on a model pair, or
(``--exact``) computes the same tables exactly on random tiny instances. See :mod:`gbv.bench.cli`."""
