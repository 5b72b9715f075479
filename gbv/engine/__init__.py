"""The decoding loop: draft K paths, score them in one target pass, verify, commit (docs/ENGINE.md).

``generate.py`` the loop and the API (:func:`gbv.generate`), ``decoder.py`` one sequence's state and iteration step, ``sampling.py`` logits -> processed
probabilities, ``cache.py`` KV-cache replicate / select / crop, ``stats.py`` counters and timings,
``cli.py`` the ``gbv generate`` command.
"""
