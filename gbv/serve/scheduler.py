"""Iteration-level scheduler: one worker thread owns the models and advances every running request.

The asyncio side (the FastAPI handlers) calls :meth:`Scheduler.submit` and :meth:`Scheduler.cancel`;
both are thread-safe and never block. Requests wait in a bounded FIFO (``max_queue``; a full queue
raises :class:`QueueFull`, answered with 429). The worker loop is::

    while running:
        drop cancelled rows (their slot is free at once)
        admit waiting requests into the running set, up to max_batch      # continuous batching
        _step_active(rows)                                                 # one iteration for every row
        deliver each row's events to its handler; finished rows leave

so a request that arrives while others decode joins them at the next iteration boundary instead of
waiting for the whole batch to finish. Events go back to the handler's event loop through
``loop.call_soon_threadsafe`` onto an :class:`asyncio.Queue` owned by that loop.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gbv.errors import GbvError


class QueueFull(Exception):
    """The waiting queue holds ``max_queue`` requests already (HTTP 429)."""


@dataclass
class Event:
    """What the worker tells a handler. ``kind``: ``chunk`` (``data`` = text or token ids committed
    since the previous chunk), ``done`` (``data`` = the engine's GenerationOutput) or ``error``
    (``data`` = the exception; a GbvError is bad input, anything else a server error). The app's
    disconnect watcher adds ``cancelled`` itself, to wake a handler whose client went away."""

    kind: str
    data: Any


@dataclass
class Job:
    """One request and the way back to its handler. It decodes either as a row of the scheduler's
    batch (``spec``: the validated request, from :func:`gbv.engine.generate.prepare_job`) or, on the
    plain Hugging Face path, through its own engine ``iterator``. ``params`` are the keyword
    arguments it was made with (``prompt_ids``, ``method``, sampling settings, ``seed``...)."""

    iterator: Iterator[Any] | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    params: dict[str, Any] = field(default_factory=dict)
    spec: Any = None
    # Whether the handler streams: only then does the batch send a chunk event a step (a non-streaming
    # handler waits for "done"; chunks cost each row an incremental detokenisation a step and a
    # wake-up of the event loop, which holds the GIL against the worker).
    stream: bool = True
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, kind: str, data: Any = None) -> None:
        """Thread-safe: put an event on the handler's queue from the worker thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, Event(kind, data))
        except RuntimeError:  # the handler's loop is closed (server shutting down): nobody listens
            pass


class Scheduler:
    """Owns the running set and the waiting queue; :meth:`start` launches the worker thread."""

    def __init__(self, max_batch: int = 16, max_queue: int = 64, batch_rows=None) -> None:
        """``batch_rows``: a :class:`gbv.engine.generate.BatchRows` (the tree engine): every active row
        then advances in the same forwards. None: each job steps its own iterator in turn."""
        if max_batch < 1 or max_queue < 0:
            raise GbvError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        self.batch_rows = batch_rows
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.iterations = 0  # scheduler iterations run (one _step_active call each)

    # ------------------------------------------------------------------ called from the asyncio side

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises :class:`QueueFull` when ``max_queue`` requests are waiting already."""
        with self._lock:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) >= self.max_queue and len(self._active) + len(self._waiting) >= self.max_batch:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (--max-queue {self.max_queue})")
            self._waiting.append(job)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """Ask the worker to drop ``job`` (client gone). A waiting job leaves the queue now; a running
        one leaves before the next iteration. Idempotent."""
        job.cancelled.set()
        with self._lock:
            try:
                self._waiting.remove(job)
            except ValueError:
                pass
            self._wake.notify()

    def counts(self) -> dict[str, int]:
        """``active`` (decoding now) and ``queued`` (waiting for a slot) requests."""
        with self._lock:
            return {"active": len(self._active), "queued": len(self._waiting)}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gbv-serve-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker thread

    def _loop(self) -> None:
        while True:
            with self._lock:
                gone = [job for job in self._active if job.cancelled.is_set()]
                self._active = [job for job in self._active if not job.cancelled.is_set()]
            for job in gone:  # free their caches / batch rows now rather than at garbage collection
                if self.batch_rows is not None:
                    self.batch_rows.cancel(job.id)
                elif job.iterator is not None:
                    job.iterator.close()
            with self._lock:
                while not self._stopping and not self._active and not self._waiting:
                    self._wake.wait()
                if self._stopping:
                    return
                while self._waiting and len(self._active) < self.max_batch:
                    self._active.append(self._waiting.popleft())
                rows = list(self._active)
            finished = self._step_active(rows)
            self.iterations += 1
            if finished:
                with self._lock:
                    self._active = [job for job in self._active if job not in finished]

    def _step_active(self, rows: list[Job]) -> list[Job]:
        """Advance every row of ``rows`` (the running set, at most ``max_batch`` jobs) by one engine
        iteration, send each row's new events (chunk / done / error) to its handler, and return the
        rows that are finished (done or failed) and must leave the running set.

        On the tree engine (``batch_rows``) every row advances in the same forwards
        (:meth:`_step_batch`). On the plain Hugging Face path this calls ``next()`` on each row's
        per-sequence iterator (:func:`gbv.engine.generate.stream_generate`; each ``next()`` runs at
        least one decoder iteration, the first one also the prefill) in turn.
        """
        if self.batch_rows is not None:
            return self._step_batch(rows)
        finished: list[Job] = []
        for job in rows:
            if job.cancelled.is_set():
                continue  # dropped at the next boundary; its client is gone
            try:
                chunk = next(job.iterator)
            except StopIteration as done:
                job.send("done", done.value)
                finished.append(job)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the others
                job.send("error", exc)
                finished.append(job)
            else:
                job.send("chunk", chunk)
        return finished

    def _step_batch(self, rows: list[Job]) -> list[Job]:
        """The batched form of :meth:`_step_active`: new jobs are prefilled into free rows of the batch,
        then one iteration runs for all of them together (one draft forward per depth, one target
        forward), each row with its own length, tree, method, sampling and generator."""
        batch = self.batch_rows
        by_id = {job.id: job for job in rows}
        events = []
        for job in rows:
            if job.id not in batch.active and not job.cancelled.is_set():
                try:
                    events += batch.add(job.id, job.spec, emit=job.stream)
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory for this row
                    events.append((job.id, "error", exc))
        try:
            events += batch.step()
        except Exception as exc:  # noqa: BLE001 - a bug in a shared step: fail its rows, keep serving
            # The step runs every row in the same forwards, so no row's state can be trusted after it
            # raised: every row is dropped at once (no cache moves) and answered with the error (500),
            # and the worker goes on with the next requests. Uncaught, the exception ended the worker
            # thread and every later request waited forever.
            events += [(key, "error", exc) for key in batch.reset() if key in by_id]
        finished = []
        for key, kind, value in events:
            job = by_id[key]
            job.send(kind, value)
            if kind in ("done", "error"):
                finished.append(job)
        return finished
