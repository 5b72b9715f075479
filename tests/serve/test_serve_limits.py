"""`gbv serve --max-batch 1 --max-queue 1 --api-key KEY`: 401 without the key, 429 with Retry-After
when the queue is full, and the queued request still completes once the slot frees."""

import threading

import httpx
import openai
from serve_helpers import API_KEY, wait_until

MODEL = "gbv-bundled"
TIMEOUT_S = 30.0


def client(server, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, timeout=TIMEOUT_S, max_retries=0)


def test_api_key_is_required_on_v1_but_not_on_health(limited_server):
    for key in ("wrong-key", ""):
        try:
            client(limited_server, key or "x").models.list()
        except openai.AuthenticationError as exc:
            assert exc.status_code == 401
            assert exc.body["code"] == "invalid_api_key"
        else:
            raise AssertionError("a wrong key was accepted")
    response = httpx.post(f"{limited_server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                          timeout=TIMEOUT_S)
    assert response.status_code == 401 and response.json()["error"]["message"]
    assert limited_server.health()["status"] == "ok"
    assert [m.id for m in client(limited_server).models.list().data] == [MODEL]


def test_full_queue_gets_429_with_retry_after(limited_server):
    api = client(limited_server)
    long = api.completions.create(model=MODEL, prompt="Question: count to a thousand.\nAnswer:", max_tokens=900,
                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(long))  # decoding now: the only slot is taken
    queued: dict = {}

    def wait_in_queue() -> None:
        queued["out"] = api.completions.create(model=MODEL, prompt="Question: 1 + 1?\nAnswer:", max_tokens=3,
                                               temperature=0)

    waiter = threading.Thread(target=wait_in_queue, daemon=True)
    waiter.start()
    try:
        assert wait_until(lambda: limited_server.health()["queued"] == 1, timeout_s=10)
        response = httpx.post(f"{limited_server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                              headers={"Authorization": f"Bearer {API_KEY}"}, timeout=TIMEOUT_S)
        assert response.status_code == 429
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        long.close()  # frees the slot: the queued request runs
    waiter.join(TIMEOUT_S)
    assert not waiter.is_alive() and queued["out"].usage.completion_tokens >= 1
    assert wait_until(lambda: limited_server.health()["active"] == 0, timeout_s=10)
