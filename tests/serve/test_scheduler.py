"""The scheduler alone, with toy iterators in place of the engine (no models, no server): iteration-level
interleaving, admission between iterations up to max_batch, cancellation, the bounded queue, errors."""

import asyncio
import threading
import time

import pytest

from gbv.serve.scheduler import Job, QueueFull, Scheduler

TIMEOUT_S = 10.0


def toy(name: str, steps: int, log: list, gate: threading.Event | None = None, closed: list | None = None,
        free_steps: int = 0):
    """Yields ``steps`` chunks, logging each step; returns ``name``. ``gate`` holds each step after the
    first ``free_steps`` until it is set."""
    try:
        for i in range(steps):
            if gate is not None and i >= free_steps:
                assert gate.wait(TIMEOUT_S)
            log.append((name, i))
            yield f"{name}{i}"
        return name
    finally:
        if closed is not None:
            closed.append(name)


async def until(predicate) -> bool:
    """Poll ``predicate`` (every 10 ms, at most TIMEOUT_S) without blocking the loop."""
    for _ in range(int(TIMEOUT_S / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


async def drain(job: Job) -> tuple[list, object]:
    """All chunks of ``job`` and its final event (done value or error)."""
    chunks = []
    while True:
        event = await asyncio.wait_for(job.events.get(), TIMEOUT_S)
        if event.kind == "chunk":
            chunks.append(event.data)
        else:
            return chunks, (event.kind, event.data)


def make_job(iterator) -> Job:
    return Job(iterator=iterator, loop=asyncio.get_running_loop(), events=asyncio.Queue())


def run(coro_fn, **kwargs):
    scheduler = Scheduler(**kwargs)
    scheduler.start()
    try:
        return asyncio.run(asyncio.wait_for(coro_fn(scheduler), 3 * TIMEOUT_S))
    finally:
        scheduler.stop()


def test_running_requests_advance_one_iteration_each_in_turn():
    log: list = []
    gate = threading.Event()

    async def scenario(scheduler):
        jobs = [make_job(toy(name, 3, log, gate)) for name in "ab"]
        for job in jobs:
            scheduler.submit(job)
        gate.set()
        return [await drain(job) for job in jobs]

    results = run(scenario, max_batch=4, max_queue=4)
    assert results == [(["a0", "a1", "a2"], ("done", "a")), (["b0", "b1", "b2"], ("done", "b"))]
    assert log == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]


def test_a_request_joins_between_iterations_and_max_batch_is_respected():
    log: list = []
    active_seen: list = []
    gate = threading.Event()

    async def scenario(scheduler):
        def counted(name, steps, **kwargs):
            for chunk in toy(name, steps, log, **kwargs):
                active_seen.append(scheduler.counts()["active"])
                yield chunk

        first = make_job(counted("a", 6, gate=gate, free_steps=1))
        scheduler.submit(first)
        await asyncio.wait_for(first.events.get(), TIMEOUT_S)  # "a" is running (held at its 2nd step)
        late = [make_job(counted(name, 2)) for name in "bc"]
        for job in late:
            scheduler.submit(job)
        assert await until(lambda: scheduler.counts() == {"active": 1, "queued": 2})  # worker inside a's step
        gate.set()
        await drain(first)
        for job in late:
            await drain(job)

    run(scenario, max_batch=2, max_queue=4)
    assert max(active_seen) == 2  # never more than max_batch
    order = [name for name, _ in log]
    assert order.index("b") < order.index("c")  # FIFO admission
    assert order.index("b") < len(order) - order[::-1].index("a") - 1  # "b" joined while "a" still ran
    assert order.index("c") > order.index("b") + 1  # "c" waited for a free slot


def test_cancel_frees_the_slot_and_closes_the_iterator():
    log: list = []
    closed: list = []

    async def scenario(scheduler):
        def slow_endless():  # one step per millisecond, so as not to flood the loop with events
            for chunk in toy("a", 10**9, log, closed=closed):
                time.sleep(0.001)
                yield chunk

        endless = make_job(slow_endless())
        scheduler.submit(endless)
        await asyncio.wait_for(endless.events.get(), TIMEOUT_S)
        scheduler.cancel(endless)
        assert await until(lambda: scheduler.counts() == {"active": 0, "queued": 0} and closed)
        after = make_job(toy("b", 1, log))
        scheduler.submit(after)
        return await drain(after)

    assert run(scenario, max_batch=1, max_queue=1) == (["b0"], ("done", "b"))
    assert closed == ["a"]


def test_full_queue_raises_and_a_failing_request_does_not_stop_the_others():
    gate = threading.Event()
    log: list = []

    def broken():
        yield "x"
        raise RuntimeError("boom")

    async def scenario(scheduler):
        running = make_job(toy("a", 2, log, gate))
        scheduler.submit(running)
        assert await until(lambda: scheduler.counts()["active"] == 1)  # "a" holds the slot (on the gate)
        waiting = make_job(broken())
        scheduler.submit(waiting)
        with pytest.raises(QueueFull):
            scheduler.submit(make_job(toy("c", 1, log)))
        gate.set()
        return await drain(running), await drain(waiting)

    done, failed = run(scenario, max_batch=1, max_queue=1)
    assert done == (["a0", "a1"], ("done", "a"))
    assert failed[0] == ["x"] and failed[1][0] == "error" and str(failed[1][1]) == "boom"


class _RecordingBatch:
    """A stand-in for ``BatchRows``: each row emits a chunk a step when added with ``emit``, and is done
    after ``steps`` steps; records the ``emit`` each key was added with."""

    def __init__(self, steps: int) -> None:
        self.steps, self.active, self.emit = steps, {}, {}

    def add(self, key, spec, emit: bool) -> list:
        self.active[key], self.emit[key] = 0, emit
        return []

    def step(self) -> list:
        events = []
        for key in list(self.active):
            self.active[key] += 1
            if self.emit[key]:
                events.append((key, "chunk", f"{key}:{self.active[key]}"))
            if self.active[key] == self.steps:
                del self.active[key]
                events.append((key, "done", key))
        return events


def test_a_batch_emits_chunks_only_for_streaming_handlers():
    """A non-streaming job is added to the batch without chunks (its handler waits for "done"), a
    streaming one with them."""
    batch = _RecordingBatch(steps=3)

    async def scenario(scheduler):
        loop = asyncio.get_running_loop()
        quiet = Job(iterator=None, loop=loop, events=asyncio.Queue(), stream=False)
        loud = Job(iterator=None, loop=loop, events=asyncio.Queue(), stream=True)
        scheduler.submit(quiet)
        scheduler.submit(loud)
        return quiet.id, loud.id, await drain(quiet), await drain(loud)

    quiet_id, loud_id, quiet, loud = run(scenario, batch_rows=batch)
    assert batch.emit == {quiet_id: False, loud_id: True}
    assert quiet == ([], ("done", quiet_id))
    assert loud == ([f"{loud_id}:1", f"{loud_id}:2", f"{loud_id}:3"], ("done", loud_id))


class _FailingOnceBatch(_RecordingBatch):
    """Its first step raises (a bug in a shared forward); later steps work. ``reset`` drops every row."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps)
        self.failed, self.cancelled = False, []

    def reset(self) -> list:
        keys = list(self.active)
        self.cancelled += keys
        self.active.clear()
        return keys

    def step(self) -> list:
        if not self.failed:
            self.failed = True
            raise IndexError("index 256 is out of bounds")
        return super().step()


def test_a_failing_batch_step_fails_its_rows_and_the_worker_serves_on():
    """A step that raises answers each of its rows with the error and frees them; the worker thread
    lives on and decodes the next request (before, the exception ended the worker and every later
    request waited forever)."""
    batch = _FailingOnceBatch(steps=2)

    async def scenario(scheduler):
        loop = asyncio.get_running_loop()
        first = [Job(iterator=None, loop=loop, events=asyncio.Queue(), stream=False) for _ in range(2)]
        for job in first:
            scheduler.submit(job)
        failed = [await drain(job) for job in first]
        later = Job(iterator=None, loop=loop, events=asyncio.Queue(), stream=False)
        scheduler.submit(later)
        return [job.id for job in first], failed, later.id, await drain(later)

    first_ids, failed, later_id, later = run(scenario, batch_rows=batch)
    assert [(chunks, kind) for chunks, (kind, _) in failed] == [([], "error"), ([], "error")]
    assert all(isinstance(error, IndexError) for _, (_, error) in failed)
    assert sorted(batch.cancelled) == sorted(first_ids)
    assert later == ([], ("done", later_id))
