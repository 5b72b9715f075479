"""Loading target/draft pairs (local directory or hub name) and the bundled offline pair.

``gbv.load_pair`` is :func:`gbv.models.loading.load_pair`; the bundled pair's files are located by
:func:`gbv.models.bundled.bundled_paths` (model card: ``gbv/models/bundled/README.md``).
"""
