"""``infinikv serve``: the OpenAI-compatible endpoints, per-request KV policies, batching, bad input,
back-pressure and client disconnects, on a tiny random model served in-process on a free loopback port
(and one end-to-end test on SmolLM2)."""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import socket
import threading
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn

from infinikv import GenerationConfig, Generator
from infinikv import generate as generate_module
from infinikv.engine import Engine, EngineConfig
from infinikv.serve import app as app_module
from infinikv.serve.app import GracefulServer, ServerSettings, create_app
from infinikv.serve.kv_policy import kv_report
from infinikv.serve.schemas import MAX_DEPTH
from infinikv.testing import tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Prompts of different lengths; on the tiny model none of them meets </s> within 3,000 greedy tokens, so a
# long request really runs long.
PROMPTS = [
    "hello",
    "The quick brown fox",
    "Once upon a time",
    "x y z",
    "a much longer prompt with several words in it, more than the others",
    "Tell me",
]


@contextmanager
def serving(loaded_or_loader, **kwargs) -> Iterator[tuple[str, object]]:
    """Run the app with uvicorn in a thread on a free loopback port; yields (base url, app)."""
    app = create_app(loaded_or_loader, **kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def model():
    loaded = tiny_model("llama")
    loaded.tokenizer.chat_template = CHAT_TEMPLATE
    return loaded


@pytest.fixture(scope="module")
def server(model):
    with serving(model, settings=ServerSettings(max_batch=8, max_queue=16)) as (url, app):
        yield url, app


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def metric(app, name: str, **labels: str) -> float:
    return app.state.infinikv.metrics.registry.get_sample_value(name, labels) or 0.0


def alone(model, prompt: str, max_tokens: int, policy: str = "dense") -> str:
    return Generator(model, policy).generate(prompt, GenerationConfig(max_new_tokens=max_tokens))[0].text


# -- the endpoints -------------------------------------------------------------------------------------------
def test_health_and_models(server, client):
    url, _ = server
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]


def test_health_is_503_while_loading(model):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return model

    with serving(slow_load) as (url, _):
        assert httpx.get(f"{url}/health").status_code == 503
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "loading"
        release.set()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").status_code == 200


def test_completion_matches_the_generator(model, client):
    response = client.completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=12, temperature=0)
    assert response.object == "text_completion"
    assert response.choices[0].text == alone(model, PROMPTS[1], 12)
    assert response.choices[0].finish_reason == "length"
    prompt_tokens = len(model.tokenizer(PROMPTS[1])["input_ids"])
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == prompt_tokens + 12
    kv = response.model_extra["kv"]
    assert kv["policy"] == "dense" and kv["stats"]["batch_size"] >= 1


def test_streamed_completion_equals_the_whole_one(client):
    whole = client.completions.create(model="tiny-llama", prompt=PROMPTS[2], max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny-llama",
            prompt=PROMPTS[2],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_uses_the_template_and_streams(model, client):
    messages = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=10, temperature=0
    )
    templated = model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == alone(model, templated, 10)
    stream = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_stream_ends_with_done(server):
    url, _ = server
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["kv"]["policy"] == "dense"


def test_sampling_with_a_seed_repeats(client):
    def draw() -> str:
        args = dict(model="tiny-llama", prompt=PROMPTS[3], max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
        return client.completions.create(**args).choices[0].text

    assert draw() == draw()


def test_stop_string_cuts_the_text(model, client):
    full = alone(model, PROMPTS[1], 30)
    stop = full[10:13]
    response = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=[stop]
    )
    assert response.choices[0].text == full[: full.find(stop)]
    assert response.choices[0].finish_reason == "stop"


# -- the per-request KV policy -------------------------------------------------------------------------------
def test_extra_body_chooses_the_policy_and_its_knobs(model, client):
    offload = client.completions.create(
        model="tiny-llama",
        prompt=PROMPTS[4],
        max_tokens=8,
        temperature=0,
        extra_body={"kv_policy": "offload"},
    )
    kv = offload.model_extra["kv"]
    assert kv["policy"] == "offload" and kv["stats"]["bytes_h2d"] > 0
    assert offload.choices[0].text == alone(model, PROMPTS[4], 8)  # offload is exact
    quest = client.completions.create(
        model="tiny-llama",
        prompt=PROMPTS[4],
        max_tokens=8,
        temperature=0,
        extra_body={"kv_policy": "quest", "kv_budget": 0.25, "kv_page_size": 4},
    )
    kv = quest.model_extra["kv"]
    assert kv["policy"] == "quest" and kv["knobs"]["budget"] == 0.25 and kv["knobs"]["page_size"] == 4
    assert kv["stats"]["mean_tokens_attended"] > 0


# -- bad input -----------------------------------------------------------------------------------------------
BAD = {
    "malformed JSON": '{"prompt": "hi", ',
    "not an object": "[1, 2]",
    "missing prompt": {"max_tokens": 4},
    "prompt of the wrong type": {"prompt": 42},
    "empty prompt": {"prompt": "   "},
    "two prompts": {"prompt": ["a", "b"]},
    "prompt over the context": {"prompt": "a" * 5000, "max_tokens": 4},
    "max_tokens zero": {"prompt": "hi", "max_tokens": 0},
    "max_tokens absurd": {"prompt": "hi", "max_tokens": 10**9},
    "max_tokens a float": {"prompt": "hi", "max_tokens": 4.5},
    "temperature a string": {"prompt": "hi", "temperature": "hot"},
    "temperature too high": {"prompt": "hi", "temperature": 7},
    "temperature NaN": '{"prompt": "hi", "temperature": NaN}',
    "top_p zero": {"prompt": "hi", "top_p": 0},
    "top_p infinite": '{"prompt": "hi", "top_p": Infinity}',
    "n above one": {"prompt": "hi", "n": 2},
    "stream not a bool": {"prompt": "hi", "stream": "yes"},
    "stop too many": {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]},
    "unknown model": {"prompt": "hi", "model": "gpt-9"},
    "logprobs": {"prompt": "hi", "logprobs": 3},
    "unknown policy": {"prompt": "hi", "kv_policy": "magic"},
    "unknown knob": {"prompt": "hi", "kv_policy": "quest", "kv_alpha": 3},
    "knob out of range": {"prompt": "hi", "kv_policy": "quest", "kv_budget": -1},
    "knob of the wrong type": {"prompt": "hi", "kv_policy": "quest", "kv_page_size": "big"},
    "nested 100,000 deep": '{"prompt": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "a lone surrogate in the prompt": '{"prompt": "hi \\udcff"}',
    "a lone surrogate in a stop string": '{"prompt": "hi", "stop": ["\\udcff"]}',
    "an integer of 5,000 digits": '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}",
    # an error that quotes a lone surrogate the client sent is still a JSON answer
    "a lone surrogate as the policy": '{"prompt": "hi", "kv_policy": "\\ud800"}',
    "a lone surrogate as the model": '{"prompt": "hi", "model": "\\ud800"}',
    "a lone surrogate naming a deep field": '{"\\ud800": ' + "[" * 40 + "]" * 40 + ', "prompt": "hi"}',
    "vLLM's top_k": {"prompt": "hi", "top_k": 5},
    "repetition_penalty": {"prompt": "hi", "repetition_penalty": 1.3},
}
UNKNOWN_MODEL = ("unknown model", "a lone surrogate as the model")
BAD_CHAT = {
    "no messages": {"messages": []},
    "message without content": {"messages": [{"role": "user"}]},
    "unknown role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "a lone surrogate in a message": '{"messages": [{"role": "user", "content": "\\udcff"}]}',
    "both token limits": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "max_completion_tokens": 2,
    },
}


JSON_HEADERS = {"content-type": "application/json"}


def _post(url: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, headers=JSON_HEADERS)


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", b) for b in BAD.values()] + [("/v1/chat/completions", b) for b in BAD_CHAT.values()],
    ids=list(BAD) + list(BAD_CHAT),
)
def test_bad_input_is_a_4xx_with_an_openai_error(server, path, body):
    url, _ = server
    response = _post(url, path, body)
    not_found = any(body is BAD[name] for name in UNKNOWN_MODEL)
    assert response.status_code == (404 if not_found else 400), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    # ... and the server still answers.
    assert _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(
    ("knob", "value"),
    [("block_size", 10**9), ("select_every", 10**9)],  # an allocation, a loop: each sized by the knob
)
def test_a_knob_past_what_it_can_take_is_refused_before_any_work(server, knob, value):
    url, _ = server
    body = {"prompt": "hi", "max_tokens": 2, "kv_policy": "infinigen", f"kv_{knob}": value}
    response = _post(url, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == f"kv_{knob}"
    assert _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200


class _DroppingTokenizer:
    """The served tokenizer, but a prompt of only zero-width spaces tokenizes to no ids (as text that a
    tokenizer's normaliser removes entirely does)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, text, **kwargs):
        return {"input_ids": []} if not text.replace("\u200b", "") else self.tokenizer(text, **kwargs)


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_a_prompt_of_no_tokens_is_a_400(model, scheduler):
    settings = ServerSettings(max_batch=8, max_queue=16, scheduler=scheduler)
    with serving(model, settings=settings) as (url, app):
        state = app.state.infinikv
        state.tokenizer = _DroppingTokenizer(state.tokenizer)
        response = _post(url, "/v1/completions", {"prompt": "\u200b\u200b", "max_tokens": 2})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"] == "the prompt has no tokens once tokenized"
        assert _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_bad_knob_names_its_parameter(server):
    response = _post(server[0], "/v1/completions", {"prompt": "hi", "kv_policy": "quest", "kv_alpha": 3})
    assert response.json()["error"]["param"] == "kv_alpha"
    assert "has no knob alpha" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),  # the OpenAI API's seed is a signed 64-bit integer
        ({"seed": 2**64}, "seed"),
        ({"stop": ["a", ""]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["\udcff"]}, "stop"),  # a lone surrogate: not UTF-8
        ({"prompt": "hi \udcff"}, "prompt"),
        ({"kv_policy": "magic"}, "kv_policy"),
        ({"kv_policy": 3}, "kv_policy"),
        ({"kv_policy": "quest", "kv_budget": 0.5, "kv_alpha": 3}, "kv_alpha"),
        ({"kv_policy": "quest", "kv_budget": -1}, "kv_budget"),
        ({"kv_page_size": 4}, "kv_page_size"),  # the server's policy, dense, has no knobs
        ({"kv_policy": "quest", "kv_page_size": 1.5}, "kv_page_size"),
        ({"kv_policy": "quest", "kv_page_size": 2.0}, "kv_page_size"),  # an integer knob takes no float
        ({"kv_policy": "quant", "kv_group_size": 1.5}, "kv_group_size"),
        ({"kv_policy": "quant", "kv_group_size": 2.0}, "kv_group_size"),
        # the tiny model has 4 layers: refused on arrival, not by the policy in the worker
        ({"kv_policy": "infinigen", "kv_own_query_layers": "99"}, "kv_own_query_layers"),
        ({"kv_policy": "infinigen", "kv_own_query_layers": "1,4"}, "kv_own_query_layers"),
        ({"kv_policy": "quant", "kv_group_size": 3}, "kv_group_size"),  # head_dim 16: not a divisor
    ],
)
def test_a_refused_setting_names_its_request_field(server, fields, param):
    """The generation config and the policy registry judge the values; the 400 names the request's field,
    in a one-line message that says it by that name."""
    response = _post(server[0], "/v1/completions", {"prompt": "hi", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    message = error["message"]
    assert len(message.splitlines()) == 1 and "max_new_tokens" not in message
    assert param.removeprefix("kv_") in message


def test_a_default_knob_the_model_cannot_take_fails_the_load(model):
    """The server's own own_query_layers naming a layer the model lacks is the operator's mistake: the load
    fails with the message, rather than every request being refused for a field it did not send."""
    with serving(lambda: model, policy="infinigen", knobs={"own_query_layers": "9"}) as (url, _):
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert "own_query_layers: this model's layers are 0-3" in health.json()["error"]


def _nested(depth: int) -> str:
    """A completion body with an extra field whose value makes the body ``depth`` levels deep."""
    inner = depth - 1  # the body object is the first level
    return '{"prompt": "hi", "max_tokens": 1, "x": ' + "[" * inner + "]" * inner + "}"


def test_deep_nesting_is_refused_before_parsing(server):
    """The depth is bounded on the raw body, not by the parser running out of stack: one level over the
    bound is refused though Python's parser would take it, and the error names the top-level field."""
    url, _ = server
    assert _post(url, "/v1/completions", _nested(MAX_DEPTH)).status_code == 200
    over = _post(url, "/v1/completions", _nested(MAX_DEPTH + 1))
    assert over.status_code == 400, over.text
    assert over.json()["error"]["param"] == "x" and "nested deeper" in over.json()["error"]["message"]
    # brackets inside strings do not count; a top-level array names no field
    assert _post(url, "/v1/completions", {"prompt": "[{" * 40, "max_tokens": 1}).status_code == 200
    array = _post(url, "/v1/completions", "[" * 100_000 + "]" * 100_000)
    assert array.status_code == 400 and array.json()["error"]["param"] is None


def test_a_string_left_open_is_read_once_by_the_nesting_scan(server):
    """A string that never closes runs to the end of the body: the brackets after it are inside it (before,
    each quote in it started a scan to the end, in time quadratic in the body's length)."""
    body = '{"prompt": "' + '\\"' * 2000 + "[" * 40
    response = _post(server[0], "/v1/completions", body)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_nulls_are_the_defaults(server):
    """The OpenAI API takes null for n, stream and stream_options.include_usage: one choice, not streamed,
    with its usage. (Greedy: the API's default temperature of 1 may sample the end of text first.)"""
    fields = {"n": None, "stream": None, "stream_options": {"include_usage": None}}
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, **fields}
    response = _post(server[0], "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("value", [0, 10**9])
def test_max_completion_tokens_is_named_in_its_errors(server, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": value}
    response = _post(server[0], "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_completion_tokens"
    assert error["message"].startswith("max_completion_tokens") or "you requested" in error["message"]


def test_bench_serve_at_a_url_with_v1_is_one_line(server, capsys):
    import signal

    from infinikv.cli import main

    handler = signal.getsignal(signal.SIGTERM)  # bench-serve installs its own
    try:
        assert main(["bench-serve", "--url", f"{server[0]}/v1", "--no-warmup"]) == 2
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "HTTP 404" in err and "without /v1" in err, err


def test_the_static_scheduler_runs_every_kv_configuration_on_one_engine(model, monkeypatch):
    """One engine, so one memory budget (``--kv-memory``'s), however many configurations the requests
    bring."""
    engines = []

    class Counted(generate_module.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(generate_module, "Engine", Counted)
    memory = 64 * 2**20
    settings = ServerSettings(scheduler="static", engine=EngineConfig(kv_memory=memory))
    with serving(model, settings=settings) as (url, _):
        for budget in (8, 9, 10):
            body = {"prompt": PROMPTS[0], "max_tokens": 2, "kv_policy": "quest", "kv_budget": budget}
            assert _post(url, "/v1/completions", body).status_code == 200
    assert len(engines) == 1
    assert engines[0].config.kv_memory == memory


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_a_shutdown_ends_what_is_left_with_a_503(model, monkeypatch, scheduler):
    """Once the graceful timeout passes, a running request and waiting ones, streamed or not, each get an
    OpenAI-shaped 503 (uvicorn alone cancelled their tasks: a plain-text 500, an empty stream)."""
    step = Engine.step

    def slow_step(self):  # so the running request outlasts the graceful timeout
        time.sleep(0.01)
        return step(self)

    monkeypatch.setattr(Engine, "step", slow_step)
    app = create_app(model, settings=ServerSettings(max_batch=1, max_queue=16, scheduler=scheduler))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = GracefulServer(app, 0.5, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    answers = {}

    def ask(name: str, stream: bool) -> None:
        body = {"prompt": "hi", "max_tokens": 300, "temperature": 0, "stream": stream}  # no EOS in 300
        answers[name] = httpx.post(f"{url}/v1/completions", json=body, timeout=30)

    asking = [threading.Thread(target=ask, args=job) for job in [("running", False), ("waiting", False)]]
    asking.append(threading.Thread(target=ask, args=("streamed", True)))
    for thread_of_one in asking:
        thread_of_one.start()
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    while app.state.infinikv.scheduler.in_flight < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    server.should_exit = True
    for thread_of_one in asking:
        thread_of_one.join(30)
    thread.join(30)
    sock.close()
    for name in ("running", "waiting"):
        assert answers[name].status_code == 503, answers[name].text
        assert answers[name].json()["error"]["message"] == "the server is shutting down"
    events = answers["streamed"].text.strip().split("\n\n")
    assert json.loads(events[-2].removeprefix("data: "))["error"]["message"] == "the server is shutting down"
    assert events[-1] == "data: [DONE]"


def _strict_json(text: str):
    """``text`` parsed as JSON proper: no Infinity or NaN."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the answer"))


def test_infinite_alpha_answers_with_valid_json(server):
    """``kv_alpha`` may be infinite (then the budget alone decides); the answer's kv field says "inf",
    as JSON has no infinity, whole and streamed."""
    url, _ = server
    body = '{"prompt": "hi", "max_tokens": 2, "kv_policy": "infinigen", "kv_alpha": Infinity'
    response = _post(url, "/v1/completions", body + "}")
    assert response.status_code == 200, response.text
    assert _strict_json(response.text)["kv"]["knobs"]["alpha"] == "inf"
    with httpx.stream(
        "POST", f"{url}/v1/completions", content=body + ', "stream": true}', headers=JSON_HEADERS
    ) as streamed:
        lines = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    assert _strict_json(lines[-1][6:])["kv"]["knobs"]["alpha"] == "inf"


# -- errors nobody foresaw -----------------------------------------------------------------------------------
def test_an_unexpected_error_is_a_500_and_the_connection_still_serves(server, monkeypatch):
    """An exception inside a route is a whole OpenAI-shaped 500, and the keep-alive connection it came on
    takes the next request."""
    url, app = server
    errors0 = metric(app, "infinikv_requests_total", policy="none", status="500")

    def broken(*_args, **_kwargs):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(app_module, "prompt_ids", broken)
    target = httpx.URL(url)
    connection = http.client.HTTPConnection(target.host, target.port, timeout=60)
    # greedy: a sampled first token may end the text, which leaves no completion token to count
    body = json.dumps({"prompt": "hi", "max_tokens": 1, "temperature": 0})
    try:
        connection.request("POST", "/v1/completions", body, JSON_HEADERS)
        failed = connection.getresponse()
        error = json.loads(failed.read())["error"]
        assert failed.status == 500 and failed.getheader("connection") != "close"
        assert error == {
            "message": "internal error: broken on purpose",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        monkeypatch.undo()
        connection.request("POST", "/v1/completions", body, JSON_HEADERS)  # the same socket
        served = connection.getresponse()
        assert served.status == 200 and json.loads(served.read())["usage"]["completion_tokens"] == 1
    finally:
        connection.close()
    assert metric(app, "infinikv_requests_total", policy="none", status="500") - errors0 == 1


def test_an_unknown_path_or_method_is_an_openai_error(server):
    url, _ = server
    for path, status in (("/v1/nowhere", 404), ("/v1/completions", 405)):
        response = httpx.get(f"{url}{path}")
        assert response.status_code == status
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


def test_a_failed_step_fails_the_requests_it_ran_and_not_those_waiting(model, monkeypatch):
    """One running request at a time: the first one's step fails (its policy raises once another request
    waits), so it gets a 500; the waiting one is still served, with the text it gets alone."""
    from infinikv.policies.streaming import StreamingPolicy

    with serving(model, settings=ServerSettings(max_batch=1, max_queue=16)) as (url, app):
        engine = app.state.infinikv.scheduler.engine
        decode = StreamingPolicy.decode

        def failing(self, *args, **kwargs):
            if engine.waiting:  # the other request is queued in the engine: fail this step
                raise RuntimeError("broken on purpose")
            return decode(self, *args, **kwargs)

        monkeypatch.setattr(StreamingPolicy, "decode", failing)

        async def send_both() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                body = {"prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0}
                first = asyncio.create_task(
                    http.post("/v1/completions", json={**body, "kv_policy": "streaming"})
                )
                await _wait_for(lambda: bool(engine.running))  # the first one runs: the second must wait
                second = http.post("/v1/completions", json={**body, "prompt": PROMPTS[1], "max_tokens": 4})
                return list(await asyncio.gather(first, second))

        failed, served = asyncio.run(send_both())
        assert failed.status_code == 500 and "broken on purpose" in failed.json()["error"]["message"]
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["text"] == alone(model, PROMPTS[1], 4)


def test_a_cancellation_that_fails_does_not_stop_the_server(model, monkeypatch):
    """Ending a request whose client left reads its policy's statistics and closes its cache; where that
    fails, the server goes on serving."""
    from infinikv.policies.streaming import StreamingPolicy

    def broken(self):
        raise RuntimeError("broken on purpose")

    with serving(model, settings=ServerSettings(max_batch=1)) as (url, app):
        monkeypatch.setattr(StreamingPolicy, "stats", broken)

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                blocker = await _Blocker(http, url, kv_policy="streaming").start()
                await blocker.close()
            await _wait_for(lambda: app.state.infinikv.scheduler.in_flight == 0)

        asyncio.run(scenario())
        monkeypatch.undo()
        answer = _post(url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == alone(model, PROMPTS[1], 4)


# -- each prompt tokenised once ------------------------------------------------------------------------------
def test_each_prompt_is_tokenised_once(model, server, client, monkeypatch):
    """The server tokenises a prompt once and hands the token ids on: neither its own tokenizer copy nor the
    worker's tokenizer (the same class) sees the text a second time; chat prompts are templated once."""
    seen: list[str] = []
    tokenize = type(model.tokenizer).__call__

    def counting(self, text, *args, **kwargs):
        seen.extend([text] if isinstance(text, str) else text)
        return tokenize(self, text, *args, **kwargs)

    monkeypatch.setattr(type(model.tokenizer), "__call__", counting)
    response = client.completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=6, temperature=0)
    messages = [{"role": "user", "content": "Count once."}]
    chat = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0)
    streamed = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[3], max_tokens=6, temperature=0, stream=True
    )
    streamed_text = "".join(c.choices[0].text for c in streamed if c.choices)
    templated = model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert seen == [PROMPTS[1], templated, PROMPTS[3]]
    monkeypatch.undo()
    assert response.choices[0].text == alone(model, PROMPTS[1], 6)
    assert chat.choices[0].message.content == alone(model, templated, 6)
    assert streamed_text == alone(model, PROMPTS[3], 6)


# -- batching, back-pressure, disconnects --------------------------------------------------------------------
async def _wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


class _Blocker:
    """A long streaming request that holds the worker until ``close`` (its client leaves)."""

    def __init__(self, http: httpx.AsyncClient, url: str, max_tokens: int = 3000, **fields: object):
        body = {"prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0, "stream": True, **fields}
        self.request = http.stream("POST", f"{url}/v1/completions", json=body)

    async def start(self) -> _Blocker:
        """Wait for the first text, so the worker is busy with this request."""
        response = await self.request.__aenter__()
        # Keep the line iterator: if it were garbage-collected, closing it would close the connection.
        self.lines = response.aiter_lines()
        async for line in self.lines:
            if line.startswith("data: "):
                break
        return self

    async def close(self) -> None:
        await self.request.__aexit__(None, None, None)


@pytest.fixture(scope="module")
def static_server(model):
    settings = ServerSettings(max_batch=8, max_queue=16, scheduler="static")
    with serving(model, settings=settings) as (url, app):
        yield url, app


def test_concurrent_requests_are_batched_and_equal_alone(static_server):
    """The static scheduler: requests that wait while a batch runs go together into the next one."""
    url, app = static_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    max_tokens = 24
    reference = [
        client.completions.create(model="tiny-llama", prompt=p, max_tokens=max_tokens, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    ]
    count0 = metric(app, "infinikv_batch_size_count", policy="dense")
    sum0 = metric(app, "infinikv_batch_size_sum", policy="dense")

    async def scenario() -> list[str]:
        async_client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        async with httpx.AsyncClient(timeout=60) as http:
            blocker = await _Blocker(http, url).start()
            tasks = [
                asyncio.create_task(
                    async_client.completions.create(
                        model="tiny-llama", prompt=p, max_tokens=max_tokens, temperature=0
                    )
                )
                for p in PROMPTS
            ]
            await _wait_for(lambda: metric(app, "infinikv_queue_length") == len(PROMPTS))
            await blocker.close()  # the blocker's client leaves: its row is cancelled
            responses = await asyncio.gather(*tasks)
        return [r.choices[0].text for r in responses]

    assert asyncio.run(scenario()) == reference
    # Two batches: the cancelled blocker alone, then all six requests together.
    assert metric(app, "infinikv_batch_size_count", policy="dense") - count0 == 2
    assert metric(app, "infinikv_batch_size_sum", policy="dense") - sum0 == 1 + len(PROMPTS)


def test_disconnect_cancels_the_generation(server):
    url, app = server
    scheduler = app.state.infinikv.scheduler
    generated0 = metric(app, "infinikv_generation_tokens_total", policy="dense")
    cancelled0 = metric(app, "infinikv_requests_total", policy="dense", status="499")

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            blocker = await _Blocker(http, url).start()
            await blocker.close()
        await _wait_for(lambda: scheduler.in_flight == 0)

    asyncio.run(scenario())
    assert metric(app, "infinikv_requests_total", policy="dense", status="499") - cancelled0 == 1
    assert metric(app, "infinikv_generation_tokens_total", policy="dense") - generated0 < 3000
    assert metric(app, "infinikv_requests_running") == 0 and metric(app, "infinikv_queue_length") == 0


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_a_request_past_its_deadline_is_cancelled_and_answered_504(model, scheduler):
    """--request-timeout: a generation still running at its deadline ends there, plain (a 504 with an
    OpenAI-shaped error) or streamed (the stream ends with that error); the server goes on serving."""
    settings = ServerSettings(scheduler=scheduler, request_timeout=0.5)
    with serving(model, settings=settings) as (url, app):
        long = {"prompt": PROMPTS[0], "max_tokens": 3000, "temperature": 0}
        started = time.monotonic()
        answer = _post(url, "/v1/completions", long)
        assert answer.status_code == 504 and time.monotonic() - started < 30
        error = answer.json()["error"]
        assert error["type"] == "timeout_error" and error["code"] == "request_timeout"
        assert "deadline of 0.5 s" in error["message"]
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=60
        ) as stream:
            events = [
                line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")
            ]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
        assert metric(app, "infinikv_requests_total", policy="dense", status="504") == 2
        assert _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert app.state.infinikv.scheduler.in_flight == 0


def test_a_request_that_leaves_while_waiting_is_counted_under_its_policy(model):
    """A request whose client leaves before the engine admits it (here behind a running one, one row at a
    time) ran no policy; its metrics still go under the policy's name."""
    with serving(model, settings=ServerSettings(max_batch=1)) as (url, app):

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                running = await _Blocker(http, url).start()
                waiting = http.stream(
                    "POST", f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True}
                )
                await waiting.__aenter__()
                await _wait_for(lambda: metric(app, "infinikv_queue_length") == 1)
                await waiting.__aexit__(None, None, None)
                await _wait_for(
                    lambda: metric(app, "infinikv_requests_total", policy="dense", status="499") == 1
                )
                await running.close()
            await _wait_for(lambda: app.state.infinikv.scheduler.in_flight == 0)

        asyncio.run(scenario())
        names = {
            sample.labels.get("policy")
            for family in app.state.infinikv.metrics.registry.collect()
            for sample in family.samples
        }
        assert "DenseConfig" not in names
        assert metric(app, "infinikv_batch_size_count", policy="dense") == 2


def test_full_queue_is_429_with_retry_after(model):
    with serving(model, settings=ServerSettings(max_batch=1, max_queue=1)) as (url, app):

        async def scenario() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as http:
                running = await _Blocker(http, url).start()
                waiting = http.stream(
                    "POST", f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True}
                )
                await waiting.__aenter__()  # headers arrive once the request is queued
                refused = await http.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                await waiting.__aexit__(None, None, None)
                await running.close()
            await _wait_for(lambda: app.state.infinikv.scheduler.in_flight == 0)
            return refused

        refused = asyncio.run(scenario())
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        assert _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_metrics_are_prometheus_text(server, client):
    url, _ = server
    client.completions.create(
        model="tiny-llama", prompt="hi", max_tokens=2, extra_body={"kv_policy": "offload"}
    )
    text = httpx.get(f"{url}/metrics").text
    for name in (
        'infinikv_requests_total{policy="offload",status="200"}',
        'infinikv_prompt_tokens_total{policy="offload"}',
        'infinikv_generation_tokens_total{policy="offload"}',
        "infinikv_queue_length ",
        'infinikv_batch_size_count{policy="offload"}',
        'infinikv_decode_tokens_per_second{policy="offload"}',
        'infinikv_kv_bytes{policy="offload",where="host"}',
        'infinikv_bytes_h2d_total{policy="offload"}',
    ):
        assert name in text, name


# -- end to end on SmolLM2 -----------------------------------------------------------------------------------
@pytest.mark.real_model
def test_smollm2_end_to_end(smollm2):
    with serving(smollm2) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        answers = {}
        for policy in ("dense", "offload"):
            response = client.chat.completions.create(
                model=smollm2.name,
                messages=messages,
                max_tokens=12,
                temperature=0,
                extra_body={"kv_policy": policy},
            )
            assert response.model_extra["kv"]["policy"] == policy
            answers[policy] = response.choices[0].message.content
        assert "Paris" in answers["dense"]
        assert answers["offload"] == answers["dense"]
        infinigen = client.chat.completions.create(
            model=smollm2.name,
            messages=messages,
            max_tokens=6,
            temperature=0,
            extra_body={"kv_policy": "infinigen", "kv_budget": 0.5, "kv_min_tokens": 0},  # a short chat
        ).model_extra["kv"]
        assert infinigen["knobs"]["budget"] == 0.5
        assert 0 < infinigen["stats"]["kv_fetch_fraction"] < 1
        stream = client.completions.create(
            model=smollm2.name, prompt="The capital of Italy is", max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices)


# -- the command line ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--policy", "magic"], "unknown policy 'magic'"),
        (["serve", "--policy", "dense", "--budget", "0.5"], "has no knob budget"),
        (["serve", "--port", "70000"], "--port must be in 1..65535"),
        (["serve", "--host", "192.0.2.1"], "cannot listen on 192.0.2.1:8000"),
        (["bench-serve", "--url", "http://127.0.0.1:1", "--requests", "0"], "must be positive"),
    ],
)
def test_cli_mistakes_are_one_line(capsys, argv, message):
    from infinikv.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_negative_graceful_timeout_is_refused_as_the_command_line_is_read(capsys):
    from infinikv.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--graceful-timeout", "-1"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "expected a number of seconds >= 0" in err
    assert len(err.strip().splitlines()) == 1


def test_a_port_in_use_is_one_line_before_the_model_loads(capsys):
    import socket

    from infinikv.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1


def test_kv_report_keeps_numbers_and_per_layer_lists():
    """The kv field's stats: numbers and per-layer lists of numbers (InfiniGen's alpha per layer), not text,
    flags or nested records; the policy's knobs apart."""
    stats = {
        "policy": "infinigen",
        "knobs": {"budget": 0.2, "alpha": 0.0},
        "bytes_h2d": 10,
        "alpha_used": [None, None, 4.0, 6.0],
        "alpha_source": "calibrated: ...",
        "pinned": True,
        "selected_tokens_per_layer": [None, {"mean": 1.0, "max": 2}],
        "prompt_tokens": 5,
    }
    report = kv_report(types.SimpleNamespace(stats=stats))
    assert report["knobs"] == {"alpha": 0.0, "budget": 0.2}
    assert report["stats"] == {"bytes_h2d": 10, "alpha_used": [None, None, 4.0, 6.0]}


def test_kv_report_writes_non_finite_numbers_as_strings():
    """JSON has no infinity or NaN: in knobs and statistics they become strings, None stays None."""
    stats = {
        "policy": "infinigen",
        "knobs": {"budget": 0.2, "alpha": math.inf},
        "alpha_used": [None, math.inf, -math.inf],
        "selector_s": math.nan,
    }
    report = kv_report(types.SimpleNamespace(stats=stats))
    assert report["knobs"] == {"budget": 0.2, "alpha": "inf"}
    assert report["stats"] == {"alpha_used": [None, "inf", "-inf"], "selector_s": "nan"}
    json.dumps(report, allow_nan=False)


# -- continuous batching -------------------------------------------------------------------------------------
def test_a_request_joins_a_running_stream_and_finishes_first(model):
    """A short request sent while a long stream runs is admitted at the next step (it does not wait for the
    stream to end), and each gets the text it gets alone."""
    with serving(model, settings=ServerSettings(max_batch=8, max_queue=16)) as (url, _app):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        long_prompt, short_prompt = PROMPTS[0], PROMPTS[2]
        order: list[str] = []
        first_text = threading.Event()

        def long_stream() -> None:
            stream = client.completions.create(
                model="tiny-llama", prompt=long_prompt, max_tokens=400, temperature=0, stream=True
            )
            text = ""
            for chunk in stream:
                text += chunk.choices[0].text
                first_text.set()
            order.append("long")
            results["long"] = text

        results: dict[str, str] = {}
        thread = threading.Thread(target=long_stream)
        thread.start()
        assert first_text.wait(30)
        short = client.completions.create(
            model="tiny-llama", prompt=short_prompt, max_tokens=4, temperature=0
        )
        order.append("short")
        thread.join(60)
        assert order == ["short", "long"]
        assert short.choices[0].text == alone(model, short_prompt, 4)
        assert results["long"] == alone(model, long_prompt, 400)


def test_requests_with_different_policies_and_seeds_share_steps(model):
    with serving(model, settings=ServerSettings(max_batch=8, max_queue=16)) as (url, app):
        bodies = [
            {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "kv_policy": "h2o"},
            {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0.9, "seed": 4, "kv_policy": "quest"},
            {"prompt": PROMPTS[3], "max_tokens": 12, "temperature": 0.7, "top_p": 0.8, "seed": 9},
        ]

        async def send_all() -> list[dict]:
            async with httpx.AsyncClient(timeout=60) as http:
                answers = await asyncio.gather(*(http.post(f"{url}/v1/completions", json=b) for b in bodies))
            return [answer.json() for answer in answers]

        answers = asyncio.run(send_all())
        for body, answer in zip(bodies, answers, strict=True):
            config = GenerationConfig(
                max_new_tokens=12,
                temperature=body["temperature"],
                top_p=body.get("top_p", 1.0),
                seed=body.get("seed"),
            )
            own = Generator(model, body.get("kv_policy", "dense")).generate(body["prompt"], config)[0]
            assert answer["choices"][0]["text"] == own.text
        assert max(a["kv"]["stats"]["batch_size"] for a in answers) > 1
        assert metric(app, "infinikv_kv_blocks", state="total") > 0


def test_a_repeated_document_hits_the_prefix_cache(model):
    document = "The river ran past the orchard and the copper lantern. " * 6
    with serving(model, settings=ServerSettings(max_batch=8, max_queue=16)) as (url, app):
        answers = [
            httpx.post(
                f"{url}/v1/completions",
                json={"prompt": document + question, "max_tokens": 6, "temperature": 0},
                timeout=60,
            ).json()
            for question in ("Who?", "Where?")
        ]
        assert answers[0]["kv"]["stats"]["prefix_hit_tokens"] == 0
        assert answers[1]["kv"]["stats"]["prefix_hit_tokens"] >= 128
        assert metric(app, "infinikv_prefix_cache_tokens_total", result="hit") >= 128
        assert metric(app, "infinikv_prefix_cache_tokens_total", result="miss") > 0
        assert answers[1]["choices"][0]["text"] == alone(model, document + "Where?", 6)
    with serving(model, settings=ServerSettings(engine=EngineConfig(prefix_cache=False))) as (url, app):
        for _ in range(2):
            answer = httpx.post(f"{url}/v1/completions", json={"prompt": document, "max_tokens": 2}).json()
            assert answer["kv"]["stats"]["prefix_hit_tokens"] == 0


def test_a_full_pool_makes_requests_wait_or_preempts_and_refuses_what_never_fits(model):
    """A pool of six 16-token blocks: concurrent requests wait or are preempted, and each still answers
    with its own text; a request that needs more blocks than the pool has is a 400 naming the prompt."""
    per_block = 2 * 4 * 2 * 16 * 4 * 16  # K and V, 4 layers, 2 KV heads, head_dim 16, float32, 16 tokens
    engine = EngineConfig(block_tokens=16, chunk_tokens=16, kv_memory=6 * per_block)
    with serving(model, settings=ServerSettings(engine=engine)) as (url, app):
        prompts = ["one two three four five six", "seven eight nine ten", "alpha beta gamma delta"]

        async def send_all() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(
                    *(
                        http.post(
                            f"{url}/v1/completions", json={"prompt": p, "max_tokens": 40, "temperature": 0}
                        )
                        for p in prompts
                    )
                )

        answers = asyncio.run(send_all())
        assert [a.status_code for a in answers] == [200] * 3
        for prompt, answer in zip(prompts, answers, strict=True):
            assert answer.json()["choices"][0]["text"] == alone(model, prompt, 40)
        assert metric(app, "infinikv_preemptions_total") >= 1
        too_long = httpx.post(f"{url}/v1/completions", json={"prompt": "word " * 30, "max_tokens": 100})
        assert too_long.status_code == 400 and "blocks" in too_long.json()["error"]["message"]
        assert too_long.json()["error"]["param"] == "prompt"


def test_the_static_scheduler_is_kept_behind_a_setting(model):
    with serving(model, settings=ServerSettings(scheduler="static")) as (url, app):
        answer = httpx.post(
            f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0}
        ).json()
        assert answer["choices"][0]["text"] == alone(model, PROMPTS[0], 5)
        assert type(app.state.infinikv.scheduler).__name__ == "StaticScheduler"
