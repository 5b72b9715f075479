"""``gbv serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over a model pair.

Where things are: request validation and the caps in :mod:`gbv.serve.schemas`, prompts for chat in
:mod:`gbv.serve.prompts`, the iteration-level scheduler (one worker thread owns the models) in
:mod:`gbv.serve.scheduler`, the FastAPI app in :mod:`gbv.serve.app`, the command in
:mod:`gbv.serve.cli`. User documentation: docs/SERVE.md.
"""
