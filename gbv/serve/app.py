"""The FastAPI app: OpenAI-compatible completions and chat completions over a :class:`Scheduler`.

Handlers run on the asyncio loop and do only cheap work there (JSON, validation, tokenizing the
prompt); the models run on the scheduler's worker thread. A handler submits a :class:`Job` and reads
its events from an :class:`asyncio.Queue`; a client that goes away cancels its job (its slot is freed
before the next iteration).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gbv.engine.decoder import engine_for
from gbv.engine.generate import (BatchRows, GenerationOutput, all_methods, max_positions, prepare_job,
                                 shared_vocab, stream_generate)
from gbv.errors import GbvError
from gbv.serve.prompts import chat_prompt_ids
from gbv.serve.scheduler import Event, Job, QueueFull, Scheduler
from gbv.serve.schemas import ApiError, Defaults, SamplingRequest, bad, parse_request

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


def context_limit(pair, method: str) -> int | None:
    """Positions the models can hold (the smaller of target and, unless ``ar``, draft), or None."""
    return max_positions(pair.target, pair.draft if method != "ar" else None)


def _finish_reason(output: GenerationOutput) -> str:
    return "length" if output.stats.stop_reason == "max_new_tokens" else "stop"


def _usage(output: GenerationOutput, prompt_tokens: int) -> dict[str, Any]:
    stats = output.stats
    return {"prompt_tokens": prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": prompt_tokens + stats.new_tokens,
            "block_efficiency": stats.block_efficiency, "accepted_lengths": list(stats.accepted_lengths),
            "target_calls": stats.target_calls}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(pair, defaults: Defaults | None = None, max_batch: int = 16, max_queue: int = 64,
               api_key: str | None = None, model_name: str = "gbv") -> FastAPI:
    """The app serving ``pair`` (a :class:`gbv.models.loading.ModelPair` with a tokenizer) as ``model_name``.
    The scheduler's worker starts and stops with the app (its lifespan)."""
    defaults = defaults or Defaults()
    batch_rows = None
    if engine_for(pair.target, pair.draft) == "tree":  # the lean engine's families: rows share forwards
        from gbv.engine.batch import BatchTreeDecoder

        vocab = shared_vocab(pair.target, pair.draft, pair.tokenizer)
        batch_rows = BatchRows(pair, BatchTreeDecoder(pair.target, pair.draft, vocab, pair.device, max_batch))
    scheduler = Scheduler(max_batch=max_batch, max_queue=max_queue, batch_rows=batch_rows)
    methods = all_methods() if pair.draft is not None else ("ar",)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="gbv serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type_=kind)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        err = ApiError(500, f"internal server error: {type(exc).__name__}: {exc}", type_="server_error")
        return JSONResponse(err.body(), status_code=500)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (the server's --api-key)",
                           type_="invalid_request_error", code="invalid_api_key")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, **scheduler.counts(), "max_batch": scheduler.max_batch,
                "max_queue": scheduler.max_queue, "iterations": scheduler.iterations}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "gbv"}]}

    async def read_body(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad(None, f"the request body is not valid JSON ({exc})") from None

    def prompt_ids(req: SamplingRequest) -> list[int]:
        tokenizer = pair.tokenizer
        if req.messages is not None:
            ids = chat_prompt_ids(tokenizer, req.messages)
            param = "messages"
        elif req.prompt is not None:
            ids = list(tokenizer(req.prompt, add_special_tokens=True)["input_ids"])
            param = "prompt"
        else:
            ids, param = list(req.prompt_ids or []), "prompt"
        if not ids:
            raise bad(param, f"'{param}' encodes to no tokens")
        limit = context_limit(pair, req.method)
        if limit is not None and len(ids) >= limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; the model context is {limit} positions "
                                f"(shorten the prompt)", param=param, code="context_length_exceeded")
        return ids

    def make_job(req: SamplingRequest, ids: list[int]) -> Job:
        params = dict(prompt_ids=ids, method=req.method, num_paths=req.num_paths, block_len=req.block_len,
                      temperature=req.temperature, top_p=req.top_p, max_new_tokens=req.max_tokens,
                      eos_token_id=[] if req.ignore_eos else None, stop_strings=req.stop or None, seed=req.seed)
        try:  # validates now; decodes on the worker thread
            if batch_rows is not None:
                spec, iterator = prepare_job(pair, **params), None
            else:
                spec, iterator = None, stream_generate(pair, **params)
        except GbvError as exc:
            raise bad(None, str(exc)) from None
        return Job(iterator=iterator, loop=asyncio.get_running_loop(), events=asyncio.Queue(), params=params,
                   spec=spec, stream=bool(req.stream))

    def submit(job: Job) -> None:
        try:
            scheduler.submit(job)
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: {exc}; retry after {RETRY_AFTER_S} s",
                           type_="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    async def watch_disconnect(request: Request, job: Job) -> None:
        """Cancel ``job`` when the client closes the connection (works for any ASGI spec version)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                scheduler.cancel(job)
                job.events.put_nowait(Event("cancelled", None))  # wakes the handler waiting on the job
                return

    async def handle(request: Request, chat: bool):
        check_auth(request)
        req = parse_request(await read_body(request), chat=chat, defaults=defaults, methods=methods)
        ids = prompt_ids(req)
        job = make_job(req, ids)
        submit(job)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        base = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model_name}
        if req.stream:
            return StreamingResponse(stream_events(request, job, base, chat, req, len(ids)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(watch_disconnect(request, job))
        try:
            while True:
                event = await job.events.get()
                if event.kind == "error":
                    raise _engine_error(event.data)
                if event.kind == "cancelled":  # the client is gone: nobody reads an answer
                    raise ApiError(499, "client closed the request", type_="client_closed_request")
                if event.kind == "done":
                    break
        finally:
            watcher.cancel()
            scheduler.cancel(job)  # no-op when finished; frees the slot when this handler is cancelled
        output: GenerationOutput = event.data
        text = output.text or ""
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": _finish_reason(output)}
            return {**base, "object": "chat.completion", "choices": [choice], "usage": _usage(output, len(ids))}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish_reason(output)}
        return {**base, "choices": [choice], "usage": _usage(output, len(ids))}

    async def stream_events(request: Request, job: Job, base: dict, chat: bool, req: SamplingRequest,
                            prompt_tokens: int) -> AsyncIterator[str]:
        def chunk(text: str | None, finish: str | None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {**base, "choices": [choice], **({"usage": None} if req.include_usage else {})}

        watcher = asyncio.create_task(watch_disconnect(request, job))
        try:
            if chat:
                first = chunk("", None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield _sse(first)
            while True:
                event = await job.events.get()
                if event.kind == "chunk":
                    yield _sse(chunk(event.data, None))
                elif event.kind == "done":
                    output: GenerationOutput = event.data
                    yield _sse(chunk(None, _finish_reason(output)))
                    if req.include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(output, prompt_tokens)})
                    break
                elif event.kind == "cancelled":
                    return
                else:
                    yield _sse(_engine_error(event.data).body())
                    break
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            scheduler.cancel(job)  # no-op when finished; frees the slot of a client that went away

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _engine_error(exc: BaseException) -> ApiError:
    """GbvError from the engine is bad input (400); anything else is the server's fault (500)."""
    if isinstance(exc, GbvError):
        return bad(None, str(exc))
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", type_="server_error")
