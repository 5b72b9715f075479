"""`gbv serve` through the official `openai` client: completions, chat, streaming, 16 concurrent
streams equal to offline `gbv.generate` (greedy, and sampled with seeds), a disconnect mid-stream, 50
malformed bodies."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_helpers import wait_until

from gbv.data import load_prompts
from gbv.serve.prompts import transcript
from gbv.serve.schemas import MAX_BLOCK_LEN, MAX_NUM_PATHS

MODEL = "gbv-bundled"
TIMEOUT_S = 30.0


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def offline(pair, prompt: str, max_tokens: int, **kwargs) -> str:
    import gbv

    return gbv.generate(pair, prompt=prompt, temperature=0, max_new_tokens=max_tokens, **kwargs).text


def test_models_and_health(server):
    ids = [m.id for m in client(server).models.list().data]
    assert ids == [MODEL]
    health = server.health()
    assert health["status"] == "ok" and health["max_batch"] == 16
    assert {"active", "queued"} <= set(health)


def test_completion_greedy_equals_offline_and_reports_usage(server, pair):
    prompt = load_prompts("gsm8k", limit=1)[0]
    out = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"method": "gbv", "num_paths": 2, "block_len": 4})
    reference = offline(pair, prompt, 12, method="gbv", num_paths=2, block_len=4)
    assert out.choices[0].text == reference
    usage = out.usage
    assert usage.completion_tokens <= 12 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    extra = usage.model_extra
    assert extra["block_efficiency"] >= 1.0
    assert 1 <= len(extra["accepted_lengths"]) <= extra["target_calls"]
    assert all(0 <= tau <= 4 for tau in extra["accepted_lengths"])
    assert out.choices[0].finish_reason in ("stop", "length")


def test_a_non_streaming_completion_stops_at_a_stop_string_as_offline(server, pair):
    """A non-streaming request decodes without chunk events; its stop strings still cut it where
    offline ``gbv.generate`` cuts."""
    prompt = load_prompts("gsm8k", limit=2)[1]
    stop = offline(pair, prompt, 24)[6:9]
    out = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == offline(pair, prompt, 24, stop_strings=[stop])
    assert out.choices[0].finish_reason == "stop"


def test_chat_uses_the_transcript_prompt(server, pair):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 3 + 4?"}]
    out = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == offline(pair, transcript(messages), 10)


def test_streaming_completion_and_chat(server, pair):
    prompt = load_prompts("gsm8k", limit=2)[1]
    api = client(server)
    chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline(pair, prompt, 10)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    chat = list(api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=6, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chat)
    assert content == offline(pair, transcript([{"role": "user", "content": prompt}]), 6)


def test_16_concurrent_streams_complete_and_equal_offline(server, pair):
    prompts = load_prompts("gsm8k", limit=16)
    api = client(server)
    peak = {"active": 0}
    done = threading.Event()

    def watch() -> None:  # the running set must hold several requests at once (continuous batching)
        while not done.is_set():
            peak["active"] = max(peak["active"], server.health()["active"])
            time.sleep(0.02)

    def stream(prompt: str) -> str:
        parts = api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in parts if c.choices)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream, p) for p in prompts]
        references = [offline(pair, p, 8) for p in prompts]  # meanwhile, in this process
        texts = [f.result(timeout=60) for f in futures]
    done.set()
    watcher.join(5)
    assert texts == references
    assert peak["active"] >= 2


def test_concurrent_sampled_requests_with_seeds_equal_offline(server, pair):
    """Sampled requests with a seed and a fixed method, 16 at once in the shared batch, return exactly the
    text of offline ``gbv.generate`` with that seed: on the compiled CPU kernels a row's logits do not
    depend on the other rows (docs/ENGINE.md, "One sum order for every pass"). Before, about one
    sampled float32 row in 40 went another way at a draw near a boundary; these 16 happened not to
    (the test passed on 90fc94b three times), so the control that fails on the old kernels is
    ``tests/engine/test_batch.py``'s, whose rows decode in a fixed order."""
    from gbv.engine.host_kernels import host_kernels_unavailable

    if host_kernels_unavailable() is not None:
        pytest.skip("the compiled CPU kernels are not built here: rows match to rounding only")
    prompts = load_prompts("gsm8k", limit=16)
    settings = [dict(method="block", block_len=4), dict(method="gbv", num_paths=2, block_len=4),
                dict(method="specinfer", num_paths=3, block_len=3), dict(method="traversal", num_paths=2, block_len=5)]
    api = client(server)

    def complete(i: int) -> str:
        out = api.completions.create(model=MODEL, prompt=prompts[i], max_tokens=48, temperature=1.0, seed=50 + i,
                                     extra_body={**settings[i % 4], "ignore_eos": True})
        return out.choices[0].text

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(complete, range(16)))
    import gbv

    for i, text in enumerate(texts):
        assert text == gbv.generate(pair, prompt=prompts[i], temperature=1.0, max_new_tokens=48, seed=50 + i,
                                    eos_token_id=[], **settings[i % 4]).text, settings[i % 4]


def test_disconnect_mid_stream_frees_the_slot(server):
    api = client(server)
    stream = api.completions.create(model=MODEL, prompt="Question: count to a thousand.\nAnswer:", max_tokens=900,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    assert server.health()["active"] == 1
    stream.close()  # the client goes away mid-stream
    assert wait_until(lambda: server.health()["active"] == 0 and server.health()["queued"] == 0, timeout_s=10)
    again = api.completions.create(model=MODEL, prompt="Question: 1 + 1?\nAnswer:", max_tokens=3, temperature=0)
    assert again.usage.completion_tokens >= 1


def test_abandoned_non_streaming_request_frees_the_slot(server):
    body = {"prompt": "Question: count to a thousand.\nAnswer:", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=1.0))
    assert wait_until(lambda: server.health()["active"] == 0, timeout_s=10)


LONG_PROMPT = "hello " * 2000  # far beyond the bundled pair's 1024 positions

MALFORMED = [  # (body, param the error names); raw bytes are sent as they are
    (b"{bad", None), (b"", None), (b"[1, 2]", None), (b'"text"', None), (b"null", None), (b"\xff\xfe", None),
    ({}, "prompt"), ({"prompt": 123}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1.5]}, "prompt"), ({"prompt": LONG_PROMPT}, "prompt"),
    ({"prompt": [10**9]}, None),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"), ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"), ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"), ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": 3}, "temperature"), (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"), ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 2}, "n"), ({"prompt": "x", "n": "1"}, "n"),
    ({"prompt": "x", "method": "nope"}, "method"), ({"prompt": "x", "method": 3}, "method"),
    ({"prompt": "x", "num_paths": MAX_NUM_PATHS + 1}, "num_paths"), ({"prompt": "x", "num_paths": 0}, "num_paths"),
    ({"prompt": "x", "num_paths": "3"}, "num_paths"),
    ({"prompt": "x", "block_len": MAX_BLOCK_LEN + 1}, "block_len"), ({"prompt": "x", "block_len": -1}, "block_len"),
    ({"prompt": "x", "stop": 5}, "stop"), ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "seed": "x"}, "seed"), ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": "x", "stream_options": 3}, "stream_options"),
    ({"prompt": "x", "presence_penalty": 1}, "presence_penalty"), ({"prompt": "x", "logprobs": 3}, "logprobs"),
    ({"prompt": "x", "model": 5}, "model"),
    ("chat", {}, "messages"), ("chat", {"messages": []}, "messages"), ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": [1]}, "messages[0]"), ("chat", {"messages": [{"role": "bad", "content": "x"}]},
                                                 "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages"),
]


def test_50_malformed_bodies_get_400_and_the_server_keeps_serving(server):
    assert len(MALFORMED) == 50
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        for case in MALFORMED:
            path = "/v1/chat/completions" if case[0] == "chat" else "/v1/completions"
            body, param = case[-2], case[-1]
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = http.post(path, content=content, headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (case, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], case
            assert error["type"] == "invalid_request_error" and error["param"] == param, (case, error)
        assert http.get("/health").json()["status"] == "ok"
        ok = http.post("/v1/completions", json={"prompt": "Question: 2 + 2?\nAnswer:", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_openai_client_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError) as info:
        client(server).completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"method": "nope"})
    assert "unknown method" in str(info.value)
