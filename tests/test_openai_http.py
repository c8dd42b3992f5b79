"""The OpenAI-compatible HTTP API of a split stack (a core process and a frontend process serving both APIs),
called with the official ``openai`` client and, for what it cannot send, plain HTTP. The right values come from
the same frontend's gRPC API (greedy text, seeded samples, logprobs) and from the tokenizer itself (usage)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import numpy as np
import openai
import pytest
import torch

from splitserve.entrypoints import stack
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc
from tests.conftest import real_or_builtin
from tests.test_grpc_split import CORE_ARGS, NUM_KV_BLOCKS, core_load, generate, joined, wait_core_empty
from tests.test_pooling import PROMPTS as POOLING_PROMPTS
from tests.test_pooling import assert_close
from tests.test_pooling import embed as pooling_embed
from tests.test_pooling import reference as pooled_reference
from tests.test_structured_outputs import SMALL_SCHEMA  # every value bounded: a document fits in the tokens given

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Tell me a story"}]
GREEDY = {"temperature": 0.0, "max_tokens": 12}
NO_EOS = {"ignore_eos": True}
MAX_BODY_MIB = 2  # the frontend's --max-receive-message-mib: the HTTP API's body limit too


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from splitserve.entrypoints.test_model import make_test_model

    return str(
        make_test_model(tmp_path_factory.mktemp("http-model"), "llama", "tiny", tokenizer=real_or_builtin("llama2"))
    )


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def services(model, tmp_path_factory):
    """One core and one frontend serving gRPC and HTTP; yields (core, frontend, the HTTP base URL)."""
    logs = tmp_path_factory.mktemp("http-logs")
    core = stack.start_core(model, logs, CORE_ARGS)
    frontend = None
    try:
        core.wait_serving()
        http_port = stack.free_port()
        limit = ["--max-receive-message-mib", str(MAX_BODY_MIB)]
        frontend = stack.start_frontend(model, [core.address], logs, ["--http-port", str(http_port), *limit])
        frontend.wait_serving()
        yield core, frontend, f"http://127.0.0.1:{http_port}"
    finally:
        for process in [frontend, core]:
            if process is not None:
                process.stop()


@pytest.fixture(scope="module")
def client(services, model):
    _, _, base_url = services
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def grpc_greedy(address: str, prompt: str, max_tokens: int = 12, **fields: Any) -> list[api.GenerateResponse]:
    params = api.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)
    return asyncio.run(generate(address, prompt, params))


def grpc_chat(address: str, messages: list[dict[str, str]], params: api.SamplingParams) -> list[api.GenerateResponse]:
    request = api.ChatRequest(
        messages=[api.ChatMessage(role=m["role"], content=[api.ContentPart(text=m["content"])]) for m in messages],
        sampling_params=params,
    )
    with grpc.insecure_channel(address) as channel:
        return list(api_grpc.GenerationStub(channel).Chat(request, timeout=60))


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The rendered conversation's token ids, by transformers itself."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def test_greedy_completions_equal_the_grpc_apis_and_usage_counts_the_tokens(services, client, tokenizer):
    _, frontend, _ = services
    for prompt in PROMPTS:
        expected_text, expected_ids = joined(grpc_greedy(frontend.address, prompt))
        response = client.completions.create(model=frontend_model(client), prompt=prompt, extra_body=NO_EOS, **GREEDY)
        assert response.id.startswith("cmpl-") and response.object == "text_completion"
        assert abs(response.created - time.time()) < 60
        (choice,) = response.choices
        assert (choice.index, choice.text, choice.finish_reason) == (0, expected_text, "length")
        assert response.usage is not None
        assert response.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
        assert response.usage.completion_tokens == len(expected_ids) == 12
        assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def frontend_model(client: openai.OpenAI) -> str:
    (model,) = client.models.list().data
    return model.id


def test_models_lists_the_served_model(client, model):
    (listed,) = client.models.list().data
    assert listed.id == model and listed.object == "model" and listed.owned_by == "splitserve"
    card = listed.model_dump()
    assert card["root"] == model and card["parent"] is None and card["max_model_len"] == 1024
    (permission,) = card["permission"]  # vLLM's one ModelPermission
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] and permission["allow_logprobs"] and not permission["allow_fine_tuning"]


def test_an_empty_model_name_is_the_served_model(services):
    _, _, base_url = services
    response = httpx.post(f"{base_url}/v1/completions", json={"model": "", "prompt": PROMPTS[0], **GREEDY})
    assert response.status_code == 200, response.text
    response = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "", "messages": CHAT, **GREEDY})
    assert response.status_code == 200, response.text


def test_streamed_completion_is_the_same_text_then_usage_then_done(services, tokenizer):
    _, frontend, base_url = services
    prompt = PROMPTS[0]
    expected_text, _ = joined(grpc_greedy(frontend.address, prompt))
    body = {"prompt": prompt, "stream": True, "stream_options": {"include_usage": True}, **GREEDY, **NO_EOS}
    events = sse_events(base_url, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == expected_text
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": len(tokenizer(prompt).input_ids),
        "completion_tokens": 12,
        "total_tokens": len(tokenizer(prompt).input_ids) + 12,
    }


def sse_events(base_url: str, path: str, body: dict[str, Any]) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream."""
    with httpx.stream("POST", base_url + path, json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_chat_equals_the_grpc_chat_streamed_or_not(services, client, tokenizer):
    _, frontend, _ = services
    expected_text, expected_ids = joined(
        grpc_chat(frontend.address, CHAT, api.SamplingParams(ignore_eos=True, **GREEDY))
    )
    response = client.chat.completions.create(model=frontend_model(client), messages=CHAT, extra_body=NO_EOS, **GREEDY)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.message.content == expected_text
    assert choice.finish_reason == "length"
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, CHAT))
    assert response.usage.completion_tokens == len(expected_ids) == 12

    stream = client.chat.completions.create(
        model=frontend_model(client),
        messages=CHAT,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
        **GREEDY,
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == response.usage.prompt_tokens


def test_n2_seeded_samples_equal_the_grpc_apis(services, client):
    _, frontend, _ = services
    params = api.SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    responses = asyncio.run(generate(frontend.address, PROMPTS[1], params))
    expected: dict[int, tuple[str, int]] = {0: ("", 0), 1: ("", 0)}
    for r in responses:
        for c in r.outputs:
            text, count = expected[c.index]
            expected[c.index] = (text + c.text, count + len(c.token_ids))
    assert expected[0][0] != expected[1][0]  # two samples, not one twice
    response = client.completions.create(
        model=frontend_model(client), prompt=PROMPTS[1], n=2, temperature=1.0, seed=11, max_tokens=10, extra_body=NO_EOS
    )
    assert {c.index: c.text for c in response.choices} == {i: expected[i][0] for i in (0, 1)}
    assert response.usage is not None and response.usage.completion_tokens == expected[0][1] + expected[1][1] == 20

    streamed = client.completions.create(
        model=frontend_model(client),
        prompt=PROMPTS[1],
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=10,
        stream=True,
        extra_body=NO_EOS,
    )
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {i: expected[i][0] for i in (0, 1)}


def grpc_logprobs(responses: list[api.GenerateResponse]) -> list[dict[int, tuple[float, int]]]:
    """Per position: token id -> (logprob, rank), from the gRPC API."""
    return [
        {e.token_id: (e.logprob, e.rank) for e in position.entries}
        for r in responses
        for position in r.outputs[0].logprobs
    ]


def test_completion_logprobs_equal_the_grpc_apis(services, client, tokenizer):
    _, frontend, _ = services
    responses = grpc_greedy(frontend.address, PROMPTS[0], max_tokens=6, logprobs=3)
    _, ids = joined(responses)
    expected = grpc_logprobs(responses)
    response = client.completions.create(
        model=frontend_model(client), prompt=PROMPTS[0], logprobs=3, extra_body=NO_EOS, temperature=0.0, max_tokens=6
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.token_logprobs == pytest.approx([expected[i][t][0] for i, t in enumerate(ids)], abs=1e-6)
    assert logprobs.tokens is not None and len(logprobs.tokens) == 6
    assert "".join(logprobs.tokens) == response.choices[0].text
    for position, top in zip(expected, logprobs.top_logprobs, strict=True):
        ranked = sorted((rank, lp) for lp, rank in position.values() if rank <= 3)
        assert sorted(top.values(), reverse=True) == pytest.approx([lp for _, lp in ranked], abs=1e-6)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]


def test_chat_logprobs_equal_the_grpc_apis(services, client):
    _, frontend, _ = services
    params = api.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    responses = grpc_chat(frontend.address, CHAT, params)
    _, ids = joined(responses)
    expected = grpc_logprobs(responses)
    response = client.chat.completions.create(
        model=frontend_model(client),
        messages=CHAT,
        logprobs=True,
        top_logprobs=2,
        temperature=0.0,
        max_tokens=5,
        extra_body=NO_EOS,
    )
    content = response.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([expected[i][t][0] for i, t in enumerate(ids)], abs=1e-6)
    for position, entry in zip(expected, content, strict=True):
        ranked = [lp for lp, rank in sorted(position.values(), key=lambda v: v[1]) if rank <= 2]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(ranked, abs=1e-6)
    assert "".join(c.token for c in content) == response.choices[0].message.content


def test_stop_strings_end_the_text_as_the_grpc_api(services, client):
    _, frontend, _ = services
    full, _ = joined(grpc_greedy(frontend.address, PROMPTS[0], max_tokens=20))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected_cut = full[: full.index(stop)]
    for include in (False, True):
        response = client.completions.create(
            model=frontend_model(client),
            prompt=PROMPTS[0],
            stop=[stop],
            temperature=0.0,
            max_tokens=20,
            extra_body={**NO_EOS, "include_stop_str_in_output": include},
        )
        (choice,) = response.choices
        assert choice.text == (expected_cut + stop if include else expected_cut)
        assert choice.finish_reason == "stop"
        assert choice.model_extra is not None and choice.model_extra["stop_reason"] == stop


def test_a_client_that_disconnects_mid_stream_frees_the_cores_request(services):
    """n = 32 long samples need more KV blocks than the core has (it preempts): minutes of work, unless the
    disconnect aborts them all."""
    core, _, base_url = services
    body = {"prompt": PROMPTS[0], "stream": True, "n": 32, "temperature": 1.0, "max_tokens": 900, **NO_EOS}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data: ")
            if received == 50:
                assert core_load(core.address).num_running_reqs == 32
                break  # closing the lines' iterator closes the connection
    start = time.monotonic()
    load = wait_core_empty(core.address)
    assert (load.num_running_reqs, load.num_waiting_reqs, load.num_free_kv_blocks) == (0, 0, NUM_KV_BLOCKS - 1)
    assert time.monotonic() - start < 30


# (endpoint, body, the field the 400 names): every field's bad value.
BAD_FIELDS = [
    ("completions", {"temperature": -1.0}, "temperature"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"top_p": 0.0}, "top_p"),
    ("completions", {"top_k": -2}, "top_k"),
    ("completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": 2, "temperature": 0.0}, "n"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 2000}, "max_tokens"),
    ("completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("completions", {"presence_penalty": 3.0}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3.0}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("completions", {"logprobs": 50}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"stop": ["ok", ""]}, "stop[1]"),
    ("completions", {"stop": 7}, "stop"),
    ("completions", {"seed": "x"}, "seed"),
    ("completions", {"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ("completions", {"logit_bias": {"10000000": 1.0}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": -101}}, "logit_bias"),
    ("completions", {"ignore_eos": "maybe"}, "ignore_eos"),  # a boolean takes "true" / "false" (vLLM's), not this
    ("completions", {"skip_special_tokens": 2}, "skip_special_tokens"),
    ("completions", {"include_stop_str_in_output": "never"}, "include_stop_str_in_output"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": [[]]}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [5, 10**6]}, "prompt[1]"),
    ("completions", {"prompt": [[5], [1.5]]}, "prompt"),
    ("completions", {"prompt": "x" * 1_000_000}, "prompt"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"best_of": 2}, "best_of"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": [{"content": "no role"}]}, "messages[0]"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"temperature": 5.0}, "temperature"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
        "response_format",
    ),
    ("completions", {"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs.json"),
    ("completions", {"structured_outputs": {"regex": "a[b"}}, "structured_outputs.regex"),
    ("chat", {"structured_outputs": {"choice": ["ok", ""]}}, "structured_outputs.choice[1]"),
    ("chat", {"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("completions", {"structured_outputs": "json"}, "structured_outputs"),
    ("completions", {"guided_regex": "a[b"}, "guided_regex"),
    ("chat", {"include_reasoning": False}, "include_reasoning"),
    ("chat", {"guided_choice": ["ok", ""]}, "guided_choice[1]"),
    ("chat", {"guided_json": "{not json"}, "guided_json"),
    ("completions", {"guided_regex": "a", "guided_choice": ["b"]}, "structured_outputs"),
    ("completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    (
        "chat",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
    ),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    # vLLM's fields: checked as vLLM's request rules check them, or refused by name where not implemented
    ("completions", {"prompt_logprobs": -2}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"allowed_token_ids": [10**6]}, "allowed_token_ids[0]"),
    ("chat", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {"cache_salt": ""}, "cache_salt"),
    ("completions", {"bad_words": [""]}, "bad_words[0]"),
    ("completions", {"use_beam_search": True, "stream": True}, "use_beam_search"),
    ("completions", {"use_beam_search": True, "n": 0}, "n"),
    ("chat", {"use_beam_search": True, "response_format": {"type": "json_object"}}, "use_beam_search"),
    ("completions", {"use_beam_search": True, "structured_outputs": {"regex": "a"}}, "use_beam_search"),
    ("chat", {"length_penalty": 2.0}, "length_penalty"),
    ("completions", {"truncate_prompt_tokens": 1025}, "truncate_prompt_tokens"),  # above max_model_len
    ("completions", {"truncate_prompt_tokens": 2, "truncation_side": "middle"}, "truncation_side"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
    ("chat", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),  # no tools
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, "tool_choice"),
    ("chat", {"tools": [{"function": {"name": ""}}], "tool_choice": "none"}, "tools[0].function.name"),
    ("chat", {"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0].function"),
    ("chat", {"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type"),
    (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": {"name": "g"}}},
        "tool_choice.function.name",
    ),
    (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}},
        "tool_choice.function",
    ),
    (
        "chat",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools[0].function.parameters",
    ),
    (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "guided_regex": "a"},
        "tool_choice",
    ),
    (
        "chat",
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "tool_choice",
    ),
    (
        "chat",
        {"tools": [{"function": {"name": "f"}}], "tool_choice": "required", "use_beam_search": True},
        "use_beam_search",
    ),
    ("completions", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
]


@pytest.mark.parametrize(("endpoint", "fields", "field"), BAD_FIELDS)
def test_bad_values_are_400_naming_the_field(services, endpoint, fields, field):
    _, _, base_url = services
    body = {"prompt": "hi"} if endpoint == "completions" else {"messages": CHAT}
    body = {**body, "max_tokens": 2, **fields}
    if "max_completion_tokens" in fields:
        del body["max_tokens"]
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    response = httpx.post(base_url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}: ")


def test_vllms_optional_fields_take_null_as_their_default(services):
    _, _, base_url = services
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "stream": None, "echo": None, "n": None}),
        ("/v1/chat/completions", {"messages": CHAT, "stream": None, "n": None, "logprobs": None}),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 0}),  # vLLM's default, without logprobs
    ]:
        response = httpx.post(base_url + path, json={**body, "max_tokens": 2}, timeout=60)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert choice["logprobs"] is None


def test_request_id_names_the_response_as_vllms(services):
    _, _, base_url = services
    for path, body, prefix in [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "cmpl-"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, "chatcmpl-"),
        ("/v1/embeddings", {"input": "hi"}, "embd-"),
    ]:
        response = httpx.post(base_url + path, json={**body, "request_id": "trace-42"}, timeout=60)
        assert response.status_code == 200 and response.json()["id"] == f"{prefix}trace-42", response.text


def test_allowed_token_ids_and_return_token_ids_as_vllm(services, tokenizer):
    _, _, base_url = services
    allowed = [tokenizer.convert_tokens_to_ids(t) for t in ("▁yes", "▁no")]
    body = {"prompt": PROMPTS[0], "allowed_token_ids": allowed, "return_token_ids": True, **GREEDY, **NO_EOS}
    (choice,) = httpx.post(base_url + "/v1/completions", json=body, timeout=60).json()["choices"]
    assert len(choice["token_ids"]) == 12 and set(choice["token_ids"]) <= set(allowed)
    assert choice["prompt_token_ids"] == tokenizer(PROMPTS[0]).input_ids
    full = tokenizer.decode(choice["prompt_token_ids"] + choice["token_ids"], skip_special_tokens=True)
    assert choice["text"] == full[len(tokenizer.decode(choice["prompt_token_ids"], skip_special_tokens=True)) :]
    body = {"messages": CHAT, "allowed_token_ids": allowed, "return_token_ids": True, **GREEDY, **NO_EOS}
    chat = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert chat["prompt_token_ids"] == chat_prompt_ids(tokenizer, CHAT)
    assert set(chat["choices"][0]["token_ids"]) <= set(allowed)
    # Streamed: the prompt's ids once, the choice's ids chunk by chunk.
    stream = {"prompt": PROMPTS[0], "allowed_token_ids": allowed, "return_token_ids": True, "stream": True}
    events = sse_events(base_url, "/v1/completions", {**stream, **GREEDY, **NO_EOS})
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c["choices"][0]] == [
        tokenizer(PROMPTS[0]).input_ids
    ]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]


def test_prompt_logprobs_equal_the_grpc_apis(services, tokenizer):
    _, frontend, base_url = services
    (first, *_) = grpc_greedy(frontend.address, PROMPTS[0], max_tokens=2, prompt_logprobs=2)
    expected = [{e.token_id: (e.logprob, e.rank) for e in p.entries} for p in first.prompt_logprobs]
    assert len(expected) == len(tokenizer(PROMPTS[0]).input_ids) and len(expected[1]) >= 2
    for path, body in [
        ("/v1/completions", {"prompt": PROMPTS[0]}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ]:
        response = httpx.post(
            base_url + path, json={**body, "prompt_logprobs": 2, "max_tokens": 2, "temperature": 0.0}, timeout=60
        ).json()
        positions = response["choices"][0]["prompt_logprobs"] if "prompt" in body else response["prompt_logprobs"]
        assert positions[0] is None  # the first prompt token has no logprob (vLLM's)
        if "prompt" not in body:  # chat's: beside the choices, a position per token of the rendered conversation
            assert len(positions) == len(chat_prompt_ids(tokenizer, CHAT))
            continue
        for position, want in zip(positions[1:], expected[1:], strict=True):
            got = {int(i): (v["logprob"], v["rank"]) for i, v in position.items()}
            assert got.keys() == want.keys()
            for token_id, (logprob, rank) in want.items():
                assert got[token_id][0] == pytest.approx(logprob, abs=1e-6) and got[token_id][1] == rank


def test_add_special_tokens_false_tokenizes_the_prompt_without_bos(services, tokenizer):
    _, frontend, base_url = services
    ids = tokenizer(PROMPTS[0], add_special_tokens=False).input_ids
    assert ids[0] != tokenizer.bos_token_id
    request = api.GenerateRequest(prompt_token_ids=ids, sampling_params=api.SamplingParams(**GREEDY, **NO_EOS))
    with grpc.insecure_channel(frontend.address) as channel:
        expected = list(api_grpc.GenerationStub(channel).Generate(request, timeout=60))
    body = {"prompt": PROMPTS[0], "add_special_tokens": False, "return_token_ids": True, **GREEDY, **NO_EOS}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=60).json()
    assert response["choices"][0]["prompt_token_ids"] == ids
    assert response["usage"]["prompt_tokens"] == len(ids)
    assert response["choices"][0]["text"] == joined(expected)[0]


def test_a_body_over_the_receive_limit_is_413_and_the_server_goes_on(services):
    _, _, base_url = services
    body = {"prompt": "x" * (MAX_BODY_MIB * 2**20 + 1), "max_tokens": 2}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(  # no Content-Length: counted as it arrives
        f"{base_url}/v1/completions", content=iter([json.dumps(body).encode()]), timeout=60
    )
    assert chunked.status_code == 413
    ok = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_the_official_client_reads_a_400_and_a_404(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=frontend_model(client), prompt="hi", max_tokens=2, temperature=-1.0)
    assert bad.value.param == "temperature" and bad.value.status_code == 400
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)


def test_an_image_part_goes_the_grpc_chats_way(services):
    """The test model is text-only: a well-formed data: URI image part is refused as the gRPC Chat refuses it."""
    _, _, base_url = services
    png = (
        "data:image/png;base64,"
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    )
    part = {"type": "image_url", "image_url": {"url": png}}
    content = [{"type": "text", "text": "what is it?"}, part]
    response = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "this model takes no images" in response.json()["error"]["message"]
    part["image_url"] = {"url": "http://example.com/cat.png"}
    response = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    assert response.json()["error"]["param"] == "messages[0].content[1].image_url"


def test_tokenize_detokenize_health_and_version(services, tokenizer, model):
    import splitserve

    _, _, base_url = services
    text = "Hello world, again"
    ids = list(tokenizer(text).input_ids)
    tokenized = httpx.post(f"{base_url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tokenized == {
        "count": len(ids),
        "max_model_len": 1024,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    no_special = httpx.post(f"{base_url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert no_special["tokens"] == list(tokenizer(text, add_special_tokens=False).input_ids)
    plain = httpx.post(f"{base_url}/tokenize", json={"prompt": text, "model": ""}).json()  # "": the served model
    assert plain["tokens"] == ids and plain["token_strs"] is None  # vLLM's: null unless asked for
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == chat_prompt_ids(tokenizer, CHAT)
    # messages as the chat API renders them: the final message left open, BOS added on request (vLLM's tests)
    turns = [*CHAT, {"role": "assistant", "content": "Once"}]
    body = {"messages": turns, "add_generation_prompt": False, "continue_final_message": True}
    expected = tokenizer.apply_chat_template(turns, tokenize=False, continue_final_message=True)
    assert httpx.post(f"{base_url}/tokenize", json=body).json()["tokens"] == list(
        tokenizer(expected, add_special_tokens=False).input_ids
    )
    with_bos = httpx.post(f"{base_url}/tokenize", json={"messages": CHAT, "add_special_tokens": True}).json()
    assert with_bos["tokens"] == [tokenizer.bos_token_id, *chat_prompt_ids(tokenizer, CHAT)]
    both = httpx.post(f"{base_url}/tokenize", json={"messages": turns, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    template = httpx.post(f"{base_url}/tokenize", json={"messages": CHAT, "chat_template": "{{ 'x' }}"})
    assert template.status_code == 400 and "--trust-request-chat-template" in template.text
    assert httpx.post(f"{base_url}/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    bad = httpx.post(f"{base_url}/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    missing = httpx.post(f"{base_url}/detokenize", json={})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "tokens"
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert httpx.get(f"{base_url}/load").json() == {"server_load": 0}  # vLLM's: the calls in flight, none now
    assert httpx.get(f"{base_url}/version").json() == {"version": splitserve.__version__}


def test_without_a_core_health_and_requests_are_503_and_the_key_is_required(model, tmp_path):
    """A frontend whose core is not there yet: /health 503, requests 503 (with the key), 401 without it."""
    http_port = stack.free_port()
    frontend = stack.start_frontend(
        model, [f"127.0.0.1:{stack.free_port()}"], tmp_path, ["--http-port", str(http_port), "--api-key", "k3y"]
    )
    base_url = f"http://127.0.0.1:{http_port}"
    try:
        for _ in range(600):  # until it listens (a minute at most)
            try:
                health = httpx.get(f"{base_url}/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert health.status_code == 503
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{base_url}/v1/completions", json=body).status_code == 401
        keyed = httpx.post(f"{base_url}/v1/completions", json=body, headers={"authorization": "Bearer k3y"})
        assert keyed.status_code == 503 and keyed.json()["error"]["code"] == "service_unavailable"
        unknown = httpx.post(
            f"{base_url}/v1/chat/completions",
            json={"model": "no-such-model", "messages": CHAT},
            headers={"authorization": "Bearer k3y"},
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert httpx.get(f"{base_url}/version").status_code == 200  # open, as /health
    finally:
        assert frontend.stop() == 0  # SIGTERM while it waits for a core: the HTTP server stops with it


def test_sigterm_drains_an_http_stream_then_both_servers_stop(services, model, tmp_path):
    """A second frontend on the module's core: SIGTERM while a stream runs; the stream still gets all its tokens
    and [DONE], /health answers 503 meanwhile, and the process exits 0."""
    core, _, _ = services
    http_port = stack.free_port()
    frontend = stack.start_frontend(model, [core.address], tmp_path, ["--http-port", str(http_port)])
    base_url = f"http://127.0.0.1:{http_port}"
    try:
        frontend.wait_serving()
        body = {"prompt": PROMPTS[0], "stream": True, "temperature": 0.0, "max_tokens": 400, **NO_EOS}
        body["stream_options"] = {"include_usage": True}
        payloads = []
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    payloads.append(line.removeprefix("data: "))
                    break
            frontend.process.send_signal(signal.SIGTERM)
            time.sleep(0.2)  # the signal handled: draining
            assert httpx.get(f"{base_url}/health", timeout=10).status_code == 503
            payloads += [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 400
        assert frontend.process.wait(60) == 0
    finally:
        frontend.stop()


MAX_MODEL_LEN = 1024  # CORE_ARGS' --max-model-len


def test_chat_without_max_tokens_takes_all_the_room_left_to_max_model_len(services, client, tokenizer):
    """vLLM's chat default: no max_tokens (or null) is max_model_len minus the prompt, not 16. A prompt of ~1000
    tokens leaves a short completion; its length is counted from the tokenizer's own rendering."""
    messages = [{"role": "user", "content": "one two three " * 330}]
    prompt_len = len(chat_prompt_ids(tokenizer, messages))
    assert 900 < prompt_len < MAX_MODEL_LEN - 16
    for extra in ({}, {"max_tokens": None}, {"max_completion_tokens": None}):
        response = client.chat.completions.create(
            model=frontend_model(client), messages=messages, temperature=0.0, extra_body={**NO_EOS, **extra}
        )
        assert response.usage is not None and response.usage.prompt_tokens == prompt_len
        assert response.usage.completion_tokens == MAX_MODEL_LEN - prompt_len
        assert response.choices[0].finish_reason == "length"
    completion = client.completions.create(model=frontend_model(client), prompt="hi", extra_body=NO_EOS)
    assert completion.usage is not None and completion.usage.completion_tokens == 16  # OpenAI's completions default


def test_chat_without_max_tokens_takes_the_models_default_when_it_has_one():
    from frontend_svc.openai_protocol import ChatCompletionRequest

    request = ChatCompletionRequest(messages=CHAT)
    with_default = request.to_sampling_params({"max_tokens": 50})
    assert (with_default.max_tokens, with_default.default_max_tokens) == (None, 50)
    without = request.to_sampling_params({})
    assert (without.max_tokens, without.default_max_tokens) == (None, None)
    explicit = ChatCompletionRequest(messages=CHAT, max_completion_tokens=7).to_sampling_params({"max_tokens": 50})
    assert explicit.max_tokens == 7


def test_a_client_that_disconnects_before_a_whole_completion_aborts_it_quietly(services):
    """A non-streaming request whose client goes away before any output: the core's requests are aborted (every
    block free again) and the frontend logs no ERROR (no InvalidStateError traceback)."""
    core, frontend, base_url = services
    assert frontend.log_path is not None
    log_start = frontend.log_path.stat().st_size
    body = {"prompt": PROMPTS[0], "n": 32, "temperature": 1.0, "max_tokens": 900, **NO_EOS}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=2))
    start = time.monotonic()
    load = wait_core_empty(core.address)
    assert (load.num_running_reqs, load.num_waiting_reqs, load.num_free_kv_blocks) == (0, 0, NUM_KV_BLOCKS - 1)
    assert time.monotonic() - start < 30
    time.sleep(0.5)  # the handler's end, logged or not
    with frontend.log_path.open("rb") as log:
        log.seek(log_start)
        new_lines = log.read().decode(errors="replace")
    assert " ERROR " not in new_lines and "Traceback" not in new_lines, new_lines


def test_a_request_that_can_never_fit_is_400_as_vllms():
    """RESOURCE_EXHAUSTED (more KV than the whole cache) is vLLM's 400; 413 stays the body limit's alone."""
    from frontend_svc.errors import RequestTooLargeError
    from frontend_svc.openai_api import error_response

    response = error_response(RequestTooLargeError("needs more KV than the whole cache"))
    assert response.status_code == 400
    assert json.loads(bytes(response.body))["error"]["type"] == "invalid_request_error"


def test_max_tokens_past_max_model_len_is_400_in_https_words(services, tokenizer):
    _, _, base_url = services
    chat = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2000}, timeout=60)
    error = chat.json()["error"]
    assert chat.status_code == 400 and error["param"] == "max_tokens"
    assert "max_tokens_unlimited" not in error["message"] and "gRPC" not in error["message"]
    assert "unset, or null, to take all the room left" in error["message"]
    completion = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2000}, timeout=60)
    assert completion.status_code == 400 and "gRPC" not in completion.json()["error"]["message"]


def test_a_refused_prompt_in_a_batch_is_named_by_its_index(services, tokenizer):
    _, _, base_url = services
    vocab_size = len(tokenizer)
    too_long = "word " * 2000
    assert len(tokenizer(too_long).input_ids) > MAX_MODEL_LEN
    cases = [
        (["hi", too_long], "prompt[1]"),
        ([[1, 2], [1, 2, vocab_size]], "prompt[1][2]"),
        ([[1, vocab_size], [1, 2]], "prompt[0][1]"),
    ]
    for prompt, field in cases:
        response = httpx.post(f"{base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field
        assert response.json()["error"]["message"].startswith(f"{field}: ")
    single = httpx.post(f"{base_url}/v1/completions", json={"prompt": too_long, "max_tokens": 2}, timeout=60)
    assert single.json()["error"]["param"] == "prompt"


def test_logit_bias_at_openais_limits_is_taken(services):
    _, _, base_url = services
    for bias in (-100, 100.0):
        body = {"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": bias}}
        assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code == 200


def test_a_chat_stream_with_n2_sends_the_role_once_per_choice(client):
    stream = client.chat.completions.create(
        model=frontend_model(client), messages=CHAT, n=2, temperature=1.0, seed=3, max_tokens=4, stream=True
    )
    chunks = list(stream)
    assert all(len(c.choices) == 1 for c in chunks)  # one choice per chunk, as vLLM's
    role_chunks = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert role_chunks == [0, 1]
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]


def test_unknown_routes_and_methods_are_openai_errors(services):
    _, _, base_url = services
    missing = httpx.get(f"{base_url}/v1/no-such-route", timeout=60)
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "invalid_request_error" and missing.json()["error"]["code"] == "not_found"
    wrong_method = httpx.get(f"{base_url}/v1/completions", timeout=60)
    assert wrong_method.status_code == 405 and "POST" in wrong_method.headers["allow"]
    assert wrong_method.json()["error"]["message"].startswith("GET /v1/completions: ")


def test_the_api_key_is_checked_before_the_body_is_read():
    """401 without reading a byte of the body (a client without the key cannot make the server buffer
    --max-receive-message-mib); with the key the body reaches the application whole."""
    from frontend_svc.http_server import ApiKeyCheck, BodyLimit

    reached: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append((await receive())["body"])

    async def call(headers: list[tuple[bytes, bytes]], path: str = "/v1/completions") -> tuple[list[Any], int]:
        received = 0
        sent: list[Any] = []

        async def receive() -> dict[str, Any]:
            nonlocal received
            received += 1
            return {"type": "http.request", "body": b'{"prompt": "hi"}', "more_body": False}

        async def send(message: Any) -> None:
            sent.append(message)

        wrapped = ApiKeyCheck(BodyLimit(app, 1000), "k3y")
        await wrapped({"type": "http", "path": path, "headers": headers}, receive, send)
        return sent, received

    sent, received = asyncio.run(call([(b"authorization", b"Bearer wrong")]))
    assert received == 0 and reached == []
    assert sent[0]["status"] == 401
    assert json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"
    sent, received = asyncio.run(call([(b"authorization", b"Bearer k3y")]))
    assert received == 1 and reached == [b'{"prompt": "hi"}'] and sent == []
    _, received = asyncio.run(call([], path="/health"))  # open without the key
    assert received == 1 and len(reached) == 2


def test_a_stream_whose_response_fails_before_its_body_still_releases_the_call():
    """The client gone before the headers are sent: the body generator never starts, so its ``finally`` never
    runs; the response's own end leaves the active calls and closes the engine requests (aborting them)."""
    from frontend_svc.openai_generation import Generation
    from frontend_svc.openai_protocol import CompletionRequest

    closed: list[str] = []

    class Engine:
        async def generate(
            self,
            prompt: Any,
            params: Any,
            request_id: str,
            trace_headers: dict[str, str] | None = None,
            priority: int = 0,
            cache_salt: str | None = None,
            lora_request: Any = None,
        ) -> Any:
            try:
                yield RequestOutput("r", "hi", [1], None, [], False)  # the first output
                await asyncio.Event().wait()  # the rest never comes: only a close ends it
            finally:
                closed.append(request_id)

    from frontend_svc.outputs import RequestOutput
    from frontend_svc.sampling_params import SamplingParams

    class State:
        active_calls = 0
        model = "m"
        tracer = None

    class Connection:
        async def receive(self) -> dict[str, Any]:
            await asyncio.Event().wait()  # never disconnects while the request starts
            return {}

    async def events(generation: Generation) -> Any:
        async for _, output in generation.outputs():
            yield {"output": output}

    async def gone(message: Any) -> None:
        raise OSError("the client is gone")

    async def run() -> tuple[int, int]:
        state = State()
        request = CompletionRequest(prompt="hi", stream=True)
        generation = Generation(state, Engine(), "cmpl-1", request, SamplingParams(), ["hi"])  # type: ignore[arg-type]  # fakes
        response = await generation.stream(Connection(), events)  # type: ignore[arg-type]  # a fake request
        during = state.active_calls
        with pytest.raises(OSError):
            await response({"type": "http"}, Connection().receive, gone)
        return during, state.active_calls

    assert asyncio.run(run()) == (1, 0)
    assert closed == ["cmpl-1"]


CHOICES = ["yes", "no", "maybe so"]


def test_response_format_json_schema_and_json_object_give_valid_json(client):
    """The test model's weights are random: only the grammar's mask makes the text valid. Whitespace is off
    (vLLM's ``structured_outputs.disable_any_whitespace``, merged with ``response_format``'s constraint as vLLM
    merges them), so the document ends within max_tokens."""
    import jsonschema

    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "pet", "schema": SMALL_SCHEMA, "strict": True},
    }
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    response = client.chat.completions.create(
        model=frontend_model(client),
        messages=CHAT,
        temperature=1.0,
        seed=5,
        n=2,
        max_tokens=120,
        response_format=response_format,
        extra_body=compact,
    )
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), SMALL_SCHEMA)
        assert choice.finish_reason == "stop"
    completion = client.completions.create(
        model=frontend_model(client),
        prompt=PROMPTS[0],
        temperature=0.0,
        max_tokens=120,
        extra_body={"response_format": {"type": "json_object"}, **compact},
    )
    # Greedy on random weights may fill an object until max_tokens: then the text is a cut-off object.
    choice = completion.choices[0]
    assert choice.text.startswith("{"), choice.text
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text), dict)
    else:
        assert choice.finish_reason == "length" and completion.usage is not None
        assert completion.usage.completion_tokens == 120
    text = client.chat.completions.create(
        model=frontend_model(client), messages=CHAT, max_tokens=3, response_format={"type": "text"}
    )
    assert text.choices[0].finish_reason is not None  # text stays accepted, unconstrained


def test_structured_outputs_choice_over_extra_body(client):
    for endpoint in ("chat", "completions"):
        for seed in (1, 2, 3):
            fields = {
                "temperature": 1.0,
                "seed": seed,
                "max_tokens": 20,
                "extra_body": {"structured_outputs": {"choice": CHOICES}},
            }
            if endpoint == "chat":
                chat = client.chat.completions.create(model=frontend_model(client), messages=CHAT, **fields)
                text = chat.choices[0].message.content
            else:
                completion = client.completions.create(model=frontend_model(client), prompt=PROMPTS[1], **fields)
                text = completion.choices[0].text
            assert text in CHOICES


def test_a_bad_schema_is_a_400_naming_the_field_through_the_client(client):
    bad_schema: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as from_format:
        client.chat.completions.create(
            model=frontend_model(client), messages=CHAT, max_tokens=5, response_format=bad_schema
        )
    assert from_format.value.param == "response_format" and "does not compile" in from_format.value.message
    with pytest.raises(openai.BadRequestError) as from_extra:
        client.completions.create(
            model=frontend_model(client),
            prompt="hi",
            max_tokens=5,
            extra_body={"structured_outputs": {"json": {"type": "strin"}}},
        )
    assert from_extra.value.param == "structured_outputs.json"


def test_grpc_embed_pools_each_input_as_transformers(services, model):
    """Generation.Embed: texts and token ids, MEAN and the default (LAST), against transformers' pooled
    last_hidden_state; bad inputs are INVALID_ARGUMENT naming the input; every block is free after."""
    core, frontend, _ = services
    core_address, address, http_model = core.address, frontend.address, Path(model)
    from transformers import AutoTokenizer

    text = "The capital of France is Paris, a city of many bridges."
    text_ids = AutoTokenizer.from_pretrained(http_model)(text).input_ids
    request = api.EmbedRequest(
        inputs=[api.EmbedInput(text=text), api.EmbedInput(tokens=api.TokenIds(token_ids=POOLING_PROMPTS[1]))],
        pooling_type=api.POOLING_TYPE_MEAN,
    )
    response = pooling_embed(address, request)
    assert [e.index for e in response.embeddings] == [0, 1]
    assert_close(list(response.embeddings[0].embedding), pooled_reference(http_model, tuple(text_ids), "MEAN", True))
    assert_close(
        list(response.embeddings[1].embedding), pooled_reference(http_model, tuple(POOLING_PROMPTS[1]), "MEAN", True)
    )
    assert response.usage.prompt_tokens == len(text_ids) + len(POOLING_PROMPTS[1])
    assert [e.prompt_tokens for e in response.embeddings] == [len(text_ids), len(POOLING_PROMPTS[1])]
    last = pooling_embed(address, api.EmbedRequest(inputs=[api.EmbedInput(text=text)], normalize=False))  # LAST default
    assert_close(list(last.embeddings[0].embedding), pooled_reference(http_model, tuple(text_ids), "LAST", False))
    bad = [
        (api.EmbedRequest(), "inputs"),
        (api.EmbedRequest(inputs=[api.EmbedInput(text=text), api.EmbedInput()]), "inputs[1]"),
        (
            api.EmbedRequest(
                inputs=[api.EmbedInput(text=text), api.EmbedInput(tokens=api.TokenIds(token_ids=[10**6]))]
            ),
            "inputs[1].prompt_token_ids[0]",
        ),
        (api.EmbedRequest(inputs=[api.EmbedInput(text=text)], dimensions=4), "dimensions"),
    ]
    for message, field in bad:
        with pytest.raises(grpc.RpcError) as info:
            pooling_embed(address, message)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(f"{field}: "), info.value.details()
    load = wait_core_empty(core_address)
    assert not load.num_running_reqs and not load.num_waiting_reqs and load.num_free_kv_blocks == NUM_KV_BLOCKS - 1


def test_openai_embeddings_equal_the_grpc_embed(services, model):
    """/v1/embeddings with the official client: float and base64 encodings, usage, 400 naming the field."""
    _, frontend, base_url = services
    address, http_model = frontend.address, Path(model)
    texts = ["Hello there", "A longer sentence about embeddings, to be computed in several chunks of prefill."]
    expected = pooling_embed(address, api.EmbedRequest(inputs=[api.EmbedInput(text=t) for t in texts]))
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        response = client.embeddings.create(model=str(http_model), input=texts)
        assert [d.index for d in response.data] == [0, 1]
        for data, reference_embedding in zip(response.data, expected.embeddings, strict=True):
            np.testing.assert_allclose(data.embedding, reference_embedding.embedding, atol=1e-6)
        assert response.usage.prompt_tokens == expected.usage.prompt_tokens == response.usage.total_tokens
        # base64: float32 little-endian bytes, as OpenAI's (the client decodes them itself: ask over raw HTTP)
        raw = client.embeddings.with_raw_response.create(
            model=str(http_model), input=[POOLING_PROMPTS[0]], encoding_format="base64"
        )
        body = json.loads(raw.text)
        vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
        assert_close(vector.tolist(), pooled_reference(http_model, tuple(POOLING_PROMPTS[0]), "LAST", True))
        # float: the JSON numbers themselves (the client asks for base64 unless told; ask over raw HTTP)
        floats = httpx.post(
            f"{base_url}/v1/embeddings",
            json={"model": str(http_model), "input": texts, "encoding_format": "float"},
            timeout=60,
        )
        assert floats.status_code == 200, floats.text
        for data, reference_embedding in zip(floats.json()["data"], expected.embeddings, strict=True):
            assert all(isinstance(value, float) for value in data["embedding"])
            np.testing.assert_allclose(data["embedding"], reference_embedding.embedding, atol=1e-6)
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=str(http_model), input=texts, dimensions=8)
        assert info.value.body["param"] == "dimensions"  # type: ignore[index]  # the error body is a dict here
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=str(http_model), input=[])
        assert info.value.body["param"] == "input"  # type: ignore[index]  # the error body is a dict here
    # vLLM's add_special_tokens: false embeds the text's own tokens (no BOS), as the gRPC API embeds those ids.
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(texts[0], add_special_tokens=False).input_ids
    bare = pooling_embed(address, api.EmbedRequest(inputs=[api.EmbedInput(tokens=api.TokenIds(token_ids=ids))]))
    body = {"input": [texts[0]], "add_special_tokens": False, "encoding_format": "float"}
    response = httpx.post(f"{base_url}/v1/embeddings", json=body, timeout=60).json()
    np.testing.assert_allclose(response["data"][0]["embedding"], bare.embeddings[0].embedding, atol=1e-6)
    assert response["usage"]["prompt_tokens"] == len(ids)
    # vLLM's chat embeddings: the conversation rendered without a generation prompt or added BOS, embedded as
    # the gRPC API embeds those ids.
    chat_tokenizer = AutoTokenizer.from_pretrained(model)
    rendered = chat_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    chat_ids = chat_tokenizer(rendered, add_special_tokens=False).input_ids
    chat_reference = pooling_embed(
        address, api.EmbedRequest(inputs=[api.EmbedInput(tokens=api.TokenIds(token_ids=chat_ids))])
    )
    chat = httpx.post(f"{base_url}/v1/embeddings", json={"messages": CHAT}, timeout=60).json()
    np.testing.assert_allclose(chat["data"][0]["embedding"], chat_reference.embeddings[0].embedding, atol=1e-6)
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    for body, param in (({"messages": CHAT, "input": "x"}, "messages"), ({}, "input")):
        refused = httpx.post(f"{base_url}/v1/embeddings", json=body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    # Encodings vLLM offers and this server does not: refused by name.
    for field, value in (("embed_dtype", "float16"), ("endianness", "big")):
        refused = httpx.post(f"{base_url}/v1/embeddings", json={"input": texts, field: value}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


def test_continuous_usage_counts_each_chunk_s_own_prompt_and_choice_and_needs_include_usage(services, tokenizer):
    """vLLM's continuous usage: each chunk counts its choice's prompt and that choice's tokens so far (two prompts
    of different lengths streamed together), chat's role chunks the prompt alone; without include_usage, none."""
    _, _, base_url = services
    body = {"prompt": PROMPTS, "stream": True, "return_token_ids": True, **GREEDY, **NO_EOS}
    both = {"include_usage": True, "continuous_usage_stats": True}
    chunks = [json.loads(e) for e in sse_events(base_url, "/v1/completions", {**body, "stream_options": both})[:-1]]
    prompt_tokens = [len(tokenizer(p).input_ids) for p in PROMPTS]
    assert prompt_tokens[0] != prompt_tokens[1]
    so_far = [0, 0]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        so_far[choice["index"]] += len(choice["token_ids"])
        expected = (prompt_tokens[choice["index"]], so_far[choice["index"]])
        assert (chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"]) == expected
        assert chunk["usage"]["total_tokens"] == sum(expected)
    assert chunks[-1]["usage"]["completion_tokens"] == 24 and chunks[-1]["usage"]["prompt_tokens"] == sum(prompt_tokens)

    alone = {"include_usage": False, "continuous_usage_stats": True}
    chunks = [json.loads(e) for e in sse_events(base_url, "/v1/completions", {**body, "stream_options": alone})[:-1]]
    assert chunks and all("usage" not in chunk for chunk in chunks)

    chat = {"messages": CHAT, "stream": True, "stream_options": both, **GREEDY, **NO_EOS}
    chunks = [json.loads(e) for e in sse_events(base_url, "/v1/chat/completions", chat)[:-1]]
    chat_prompt = len(chat_prompt_ids(tokenizer, CHAT))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["usage"] == {"prompt_tokens": chat_prompt, "completion_tokens": 0, "total_tokens": chat_prompt}
    assert [c["usage"]["prompt_tokens"] for c in chunks] == [chat_prompt] * len(chunks)
    assert chunks[-2]["usage"]["completion_tokens"] == 12


def test_whole_responses_carry_vllm_s_optional_fields_as_null(services):
    _, _, base_url = services
    response = httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPTS[0], **GREEDY}, timeout=60).json()
    (choice,) = response["choices"]
    assert (choice["prompt_logprobs"], choice["prompt_token_ids"], choice["token_ids"]) == (None, None, None)
    response = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": CHAT, **GREEDY}, timeout=60).json()
    assert (response["prompt_logprobs"], response["prompt_token_ids"]) == (None, None)
    assert response["choices"][0]["token_ids"] is None
    # asked for, they are filled (the rest of their behaviour: the tests above)
    body = {"prompt": PROMPTS[0], "return_token_ids": True, **GREEDY}
    (choice,) = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()["choices"]
    assert len(choice["token_ids"]) == 12 and choice["prompt_token_ids"]


def test_tools_with_tool_choice_none_and_documents_reach_the_template(services, tokenizer):
    """vLLM renders tools when tool_choice is "none" (no call is parsed from the reply) and documents; the llama2
    template ignores both, so the prompt is the plain conversation's."""
    _, _, base_url = services
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    body = {
        "messages": CHAT,
        "tools": tools,
        "tool_choice": "none",
        "documents": [{"text": "d"}],
        "return_token_ids": True,
    }
    response = httpx.post(f"{base_url}/v1/chat/completions", json={**body, **GREEDY}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["prompt_token_ids"] == chat_prompt_ids(tokenizer, CHAT)


def test_the_reply_takes_the_last_message_s_role_without_a_generation_prompt(services):
    """vLLM's get_chat_request_role: with add_generation_prompt false the model continues the last message, and
    the reply is in that message's role, streamed or not."""
    _, _, base_url = services
    body = {"messages": CHAT, "add_generation_prompt": False, **GREEDY}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).json()
    assert response["choices"][0]["message"]["role"] == "user"
    events = sse_events(base_url, "/v1/chat/completions", {**body, "stream": True})
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "user"
    response = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": CHAT, **GREEDY}, timeout=60).json()
    assert response["choices"][0]["message"]["role"] == "assistant"


def test_completions_max_tokens_null_is_the_room_left_and_empty_stream_options_need_no_stream(services, tokenizer):
    _, _, base_url = services
    max_model_len = httpx.get(f"{base_url}/v1/models", timeout=60).json()["data"][0]["max_model_len"]
    prompt = [1] + [450] * (max_model_len - 6)  # room for 5 tokens
    body = {"prompt": prompt, "max_tokens": None, "temperature": 0.0, **NO_EOS}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5
    assert response.json()["choices"][0]["finish_reason"] == "length"
    # left out, it is OpenAI's 16, which does not fit
    del body["max_tokens"]
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and "max_tokens" in response.text
    body = {"prompt": PROMPTS[0], "stream_options": {}, **GREEDY}
    assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code == 200
    body["stream_options"] = {"include_usage": False}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and "stream_options" in response.text


def test_chat_top_logprobs_minus_one_is_every_token_the_engine_returned():
    from frontend_svc.openai_responses import chat_logprobs
    from frontend_svc.outputs import CompletionOutput, Logprob

    position = {7: Logprob(-0.1, 1, "a"), 3: Logprob(-2.0, 2, "b"), 9: Logprob(-3.0, 3, "c")}
    completion = CompletionOutput(0, "a", [7], -0.1, [position])
    content = chat_logprobs(completion, -1, None)["content"]
    assert [entry["token"] for entry in content[0]["top_logprobs"]] == ["a", "b", "c"]
    assert [e["token"] for e in chat_logprobs(completion, 2, None)["content"][0]["top_logprobs"]] == ["a", "b"]


def test_use_beam_search_returns_transformers_beams(services, model, tokenizer):
    """vLLM's use_beam_search: n beams as the n choices, best first, on completions (two prompts) and chat; with
    EOS ignored they are transformers' generate(num_beams=n) sequences. The text is the generated tokens'."""
    from tests.helpers import hf_beam_search

    _, _, base_url = services
    width, max_tokens = 3, 6

    def hf_beams(prompt_ids: list[int]) -> list[list[int]]:
        beams = hf_beam_search(Path(model), prompt_ids, width, max_tokens)
        return [row[len(prompt_ids) :] for row in beams]

    body = {"prompt": PROMPTS, "use_beam_search": True, "n": width, "max_tokens": max_tokens, "temperature": 0.0}
    response = httpx.post(f"{base_url}/v1/completions", json={**body, **NO_EOS, "return_token_ids": True}, timeout=60)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == list(range(2 * width))
    for p, prompt in enumerate(PROMPTS):
        expected = hf_beams(tokenizer(prompt).input_ids)
        got = choices[p * width : (p + 1) * width]
        assert [c["token_ids"] for c in got] == expected
        assert [c["text"] for c in got] == [tokenizer.decode(ids) for ids in expected]
        assert all(c["finish_reason"] == "length" for c in got)
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 2 * width * max_tokens
    assert usage["prompt_tokens"] == sum(len(tokenizer(p).input_ids) for p in PROMPTS)

    chat = {"messages": CHAT, "use_beam_search": True, "n": width, "max_tokens": max_tokens, "temperature": 0.0}
    response = httpx.post(f"{base_url}/v1/chat/completions", json={**chat, **NO_EOS, "return_token_ids": True})
    assert response.status_code == 200, response.text
    expected = hf_beams(chat_prompt_ids(tokenizer, CHAT))
    assert [c["token_ids"] for c in response.json()["choices"]] == expected
    assert [c["message"]["role"] for c in response.json()["choices"]] == ["assistant"] * width
    length_penalty = httpx.post(f"{base_url}/v1/chat/completions", json={**chat, "length_penalty": 0.5})
    assert length_penalty.status_code == 200, length_penalty.text
    # echo: the prompt as sent before each beam's text
    echoed = {"prompt": PROMPTS[0], "use_beam_search": True, "n": 2, "max_tokens": 3, "echo": True, **NO_EOS}
    for choice in httpx.post(f"{base_url}/v1/completions", json=echoed, timeout=60).json()["choices"]:
        assert choice["text"].startswith(PROMPTS[0]) and not choice["text"].startswith("<s>")


def test_a_refused_prompt_ends_the_whole_beam_search_and_nothing_runs_on(services):
    """One prompt of two out of vocabulary, or too long for max_model_len (1024): a 400, as without beam search,
    and the other prompt's search stops with it: the core is left empty."""
    core, _, base_url = services
    body = {"use_beam_search": True, "n": 4, "max_tokens": 200, **NO_EOS}
    for prompt, field in (([[1, 15043, 3186], [1, 10**6]], "prompt[1]"), ([[1, 15043], [5] * 1024], "prompt")):
        refused = httpx.post(f"{base_url}/v1/completions", json={"prompt": prompt, **body}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"].startswith(field), refused.text
        load = wait_core_empty(core.address)
        assert not load.num_running_reqs and not load.num_waiting_reqs


def test_echo_puts_the_prompt_and_its_logprobs_first(services, model, tokenizer):
    """vLLM's echo: each choice's text begins with the prompt (text as sent, token ids decoded); with logprobs the
    prompt's tokens come first, the first one's logprob null and the others transformers' (a full forward)."""
    from tests.helpers import hf_model

    _, _, base_url = services
    plain = httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPTS[0], **GREEDY, **NO_EOS}).json()
    body = {"prompt": PROMPTS[0], "echo": True, **GREEDY, **NO_EOS}
    echoed = httpx.post(f"{base_url}/v1/completions", json=body).json()
    assert echoed["choices"][0]["text"] == PROMPTS[0] + plain["choices"][0]["text"]
    assert echoed["usage"] == plain["usage"]
    events = sse_events(base_url, "/v1/completions", {**body, "stream": True})
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]]
    assert texts[0].startswith(PROMPTS[0]) and "".join(texts) == echoed["choices"][0]["text"]

    ids = tokenizer(PROMPTS[1]).input_ids
    body = {"prompt": ids, "echo": True, "logprobs": 1, **GREEDY, **NO_EOS}
    (choice,) = httpx.post(f"{base_url}/v1/completions", json=body).json()["choices"]
    assert choice["text"].startswith(tokenizer.decode(ids))  # token ids decoded, BOS included
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 12
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    with torch.no_grad():
        reference = hf_model(Path(model))(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    expected = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert logprobs["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-3)
    assert "".join(logprobs["tokens"][: len(ids)]) == tokenizer.decode(ids)  # each token's text in context
    streamed = sse_events(base_url, "/v1/completions", {**body, "stream": True})
    first = json.loads(streamed[0])["choices"][0]["logprobs"]
    assert first["token_logprobs"][: len(ids)] == logprobs["token_logprobs"][: len(ids)]


def test_chat_echo_repeats_the_continued_message(services):
    _, _, base_url = services
    turns = [*CHAT, {"role": "assistant", "content": "Once"}]
    body = {"messages": turns, "add_generation_prompt": False, "continue_final_message": True, **GREEDY, **NO_EOS}
    plain = httpx.post(f"{base_url}/v1/chat/completions", json=body).json()["choices"][0]["message"]
    echoed = httpx.post(f"{base_url}/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]
    assert echoed["message"] == {"role": "assistant", "content": "Once" + plain["content"], "tool_calls": []}
    events = sse_events(base_url, "/v1/chat/completions", {**body, "echo": True, "stream": True})
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1] if json.loads(e)["choices"]]
    assert deltas[1] == {"content": "Once"}
    assert "".join(d.get("content") or "" for d in deltas) == "Once" + plain["content"]
    # after a generation prompt the reply starts a new message: nothing is echoed
    new_turn = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": CHAT, "echo": True, **GREEDY})
    fresh = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": CHAT, **GREEDY})
    assert new_turn.json()["choices"][0]["message"] == fresh.json()["choices"][0]["message"]


def test_chat_template_flags_set_the_template_and_content_format(services, model, tmp_path, tokenizer):
    """--chat-template (a file) renders every chat that brings none; --chat-template-content-format openai gives
    it the content as parts (this template prints the content, so the parts show). The same frontend has
    --enable-prompt-tokens-details."""
    core, _, _ = services
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content[0].text }}{% endfor %}")
    http_port = stack.free_port()
    flags = ["--http-port", str(http_port), "--chat-template", str(template), "--enable-prompt-tokens-details"]
    frontend = stack.start_frontend(
        model, [core.address], tmp_path, [*flags, "--chat-template-content-format", "openai"]
    )
    try:
        frontend.wait_serving()
        response = httpx.post(f"http://127.0.0.1:{http_port}/tokenize", json={"messages": CHAT}, timeout=60)
        assert response.json()["tokens"] == list(tokenizer("<user>Tell me a story", add_special_tokens=False).input_ids)
        # --enable-prompt-tokens-details: the prompt's tokens served from the prefix cache, 0 the first time and
        # its two full blocks of 16 the second (a prompt the other tests never send)
        body = {"prompt": list(range(300, 340)), "max_tokens": 1}
        for cached in (0, 32):
            usage = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60).json()["usage"]
            assert usage["prompt_tokens_details"] == {"cached_tokens": cached}
    finally:
        assert frontend.stop() == 0


def test_load_chat_template_reads_a_file_or_takes_the_template():
    from frontend_svc.config import FrontendConfig, load_chat_template

    assert load_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="looks like a file, but there is none"):
        load_chat_template("/no/such/template.jinja")
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        FrontendConfig(chat_template_content_format="parts")


def test_vllm_s_guided_fields_constrain_as_structured_outputs(client):
    """guided_choice / guided_regex / guided_json (a dict or its JSON text), vLLM's earlier names that clients
    still send, constrain the output as the structured_outputs keys they stand for."""
    import jsonschema

    for seed in (1, 2):
        completion = client.completions.create(
            model=frontend_model(client),
            prompt=PROMPTS[1],
            temperature=1.0,
            seed=seed,
            max_tokens=20,
            extra_body={"guided_choice": CHOICES, "guided_decoding_backend": "auto"},
        )
        assert completion.choices[0].text in CHOICES
    regex = client.completions.create(
        model=frontend_model(client), prompt=PROMPTS[0], max_tokens=20, extra_body={"guided_regex": "[0-9]{3}"}
    )
    assert re.fullmatch("[0-9]{3}", regex.choices[0].text)
    for schema in (SMALL_SCHEMA, json.dumps(SMALL_SCHEMA)):
        chat = client.chat.completions.create(
            model=frontend_model(client),
            messages=CHAT,
            temperature=1.0,
            seed=3,
            max_tokens=120,
            extra_body={"guided_json": schema, "structured_outputs": {"disable_any_whitespace": True}},
        )
        jsonschema.validate(json.loads(chat.choices[0].message.content or ""), SMALL_SCHEMA)


def test_reasoning_effort_is_a_template_variable_and_chat_template_kwargs_win():
    from frontend_svc.openai_protocol import ChatCompletionRequest

    request = ChatCompletionRequest(messages=CHAT, reasoning_effort="low", parallel_tool_calls=True)
    assert request.template_variables() == {"reasoning_effort": "low"}
    request = ChatCompletionRequest(
        messages=CHAT, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "x"}
    )
    assert request.template_variables() == {"reasoning_effort": "x"}
    assert ChatCompletionRequest(messages=CHAT).template_variables() is None


def test_bad_words_over_http_and_grpc_keep_the_word_out(services, tokenizer):
    """A word the greedy continuation has comes out when banned, through both public APIs."""
    _, frontend, base_url = services
    body = {"prompt": PROMPTS[0], "return_token_ids": True, **GREEDY, **NO_EOS}
    free = httpx.post(f"{base_url}/v1/completions", json=body).json()["choices"][0]["token_ids"]
    word = tokenizer.decode(free[:1]).strip()
    banned = httpx.post(f"{base_url}/v1/completions", json={**body, "bad_words": [word]}).json()["choices"][0]
    assert banned["token_ids"][0] != free[0] and free[0] not in banned["token_ids"]
    text, ids = joined(grpc_greedy(frontend.address, PROMPTS[0], bad_words=[word]))
    assert ids == banned["token_ids"] and text == banned["text"]


def test_invocations_answers_as_the_route_its_body_names(services):
    """vLLM's POST /invocations: messages -> chat completions, prompt -> completions, input -> embeddings."""
    _, _, base_url = services
    completion = {"prompt": PROMPTS[0], **GREEDY, **NO_EOS}
    chat = {"messages": CHAT, **GREEDY, **NO_EOS}
    for body, path in ((completion, "/v1/completions"), (chat, "/v1/chat/completions")):
        via = httpx.post(f"{base_url}/invocations", json=body, timeout=60).json()
        direct = httpx.post(f"{base_url}{path}", json=body, timeout=60).json()
        assert via["object"] == direct["object"] and via["choices"][0]["index"] == 0
        key = "text" if path == "/v1/completions" else "message"
        assert via["choices"][0][key] == direct["choices"][0][key] and via["usage"] == direct["usage"]
    embedded = httpx.post(f"{base_url}/invocations", json={"input": "hi"}, timeout=60).json()
    assert embedded["object"] == "list" and embedded["data"][0]["object"] == "embedding"
    for body, field in (({"neither": 1}, "body"), ({"prompt": PROMPTS[0], "temperature": "0"}, "temperature")):
        refused = httpx.post(f"{base_url}/invocations", json=body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


def test_booleans_take_json_strings_as_vllm_s_models_do(services):
    """vLLM's test_top_logprobs sends "logprobs": "true": a boolean field takes it; a number as a string stays
    refused."""
    _, _, base_url = services
    body = {"messages": CHAT, "logprobs": "true", "top_logprobs": 2, "max_tokens": 2, "stream": "false"}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    refused = httpx.post(f"{base_url}/v1/chat/completions", json={**body, "temperature": "0.5"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"


def test_return_tokens_as_token_ids_shows_logprob_tokens_by_id(services):
    """vLLM's return_tokens_as_token_ids: every logprob token (sampled and top, completions and chat, streamed
    too) is "token_id:<id>", the ids the choice's token_ids give."""
    _, _, base_url = services
    body = {"prompt": PROMPTS[0], "logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True}
    (choice,) = httpx.post(f"{base_url}/v1/completions", json={**body, **GREEDY}, timeout=60).json()["choices"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{i}" for i in choice["token_ids"]]
    assert all(key.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for key in top)
    chunks = [json.loads(e) for e in sse_events(base_url, "/v1/completions", {**body, **GREEDY, "stream": True})[:-1]]
    streamed = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == choice["logprobs"]["tokens"]
    chat = {"messages": CHAT, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    chat["return_token_ids"] = True
    (reply,) = httpx.post(f"{base_url}/v1/chat/completions", json={**chat, **GREEDY}, timeout=60).json()["choices"]
    assert [entry["token"] for entry in reply["logprobs"]["content"]] == [f"token_id:{i}" for i in reply["token_ids"]]
    assert reply["logprobs"]["content"][0]["bytes"] == list(f"token_id:{reply['token_ids'][0]}".encode())


def test_truncate_prompt_tokens_cuts_the_prompt_at_the_side_asked(services, tokenizer):
    """vLLM's truncate_prompt_tokens and truncation_side: token ids [10..17] cut to 4 keep [14..17] (the default,
    left) or [10..13] (right); a text prompt's and a chat's last tokens likewise."""
    _, _, base_url = services
    ids = list(range(10, 18))
    for side, kept in ((None, ids[-4:]), ("left", ids[-4:]), ("right", ids[:4])):
        body = {"prompt": ids, "truncate_prompt_tokens": 4, "return_token_ids": True, **GREEDY}
        if side is not None:
            body["truncation_side"] = side
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
        assert response["choices"][0]["prompt_token_ids"] == kept and response["usage"]["prompt_tokens"] == 4
    body = {"prompt": PROMPTS[1], "truncate_prompt_tokens": 3, "return_token_ids": True, **GREEDY}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
    assert response["choices"][0]["prompt_token_ids"] == tokenizer(PROMPTS[1]).input_ids[-3:]
    chat = {"messages": CHAT, "truncate_prompt_tokens": 5, "return_token_ids": True, **GREEDY}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=chat, timeout=60).json()
    assert response["prompt_token_ids"] == chat_prompt_ids(tokenizer, CHAT)[-5:]


# Forced tool choices (tool_choice "required" or a named function): the reply is constrained to the call's JSON.
TOOLS = [
    {"type": "function", "function": {"name": "pet", "description": "names a pet", "parameters": SMALL_SCHEMA}},
    {"type": "function", "function": {"name": "noop"}},  # no parameters: an empty object
]
PET = {"type": "function", "function": {"name": "pet"}}
COMPACT = {"disable_any_whitespace": True}
# vLLM's schema of a required choice's reply over TOOLS, written out: an array of at least one call, each one of
# the tools' names with that tool's parameters.
REQUIRED_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "anyOf": [
            {
                "properties": {"name": {"type": "string", "enum": ["pet"]}, "parameters": SMALL_SCHEMA},
                "required": ["name", "parameters"],
            },
            {
                "properties": {
                    "name": {"type": "string", "enum": ["noop"]},
                    "parameters": {"type": "object", "properties": {}},
                },
                "required": ["name", "parameters"],
            },
        ],
    },
}


def constrained_reply(base_url: str, schema: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """The choice of the same chat without tools under ``structured_outputs.json = schema``: the text a forced tool
    choice's reply is made of (the llama2 template renders no tools, so the prompt is the same)."""
    body = {"messages": CHAT, "structured_outputs": {"json": schema, **COMPACT}, **fields}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def streamed_choice(base_url: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """A streamed chat's tool-call delta entries, in order, and its finish reason."""
    entries, finish_reason = [], None
    for event in sse_events(base_url, "/v1/chat/completions", {**body, "stream": True})[:-1]:
        (choice,) = json.loads(event)["choices"]
        entries += choice["delta"].get("tool_calls", [])
        finish_reason = choice["finish_reason"] or finish_reason
        assert not choice["delta"].get("content"), choice  # a call's text goes out as the call's
    return entries, finish_reason


def test_a_named_tool_choice_is_a_call_whose_arguments_are_the_constrained_reply(services, client):
    """vLLM's named tool choice: the function's parameters schema constrains the reply, which is the call's
    arguments; content empty, finish reason the engine's ("stop", as OpenAI's); streamed, the first delta carries
    the call's id and name and the arguments follow as text."""
    import jsonschema

    _, _, base_url = services
    for seed in (0, 1, 2):
        sampling = {"temperature": 1.0, "seed": seed, "max_tokens": 120}
        expected = constrained_reply(base_url, SMALL_SCHEMA, **sampling)
        assert expected["finish_reason"] == "stop"
        response = client.chat.completions.create(
            model=frontend_model(client),
            messages=CHAT,
            tools=TOOLS,
            tool_choice=PET,
            extra_body={"structured_outputs": COMPACT},
            **sampling,
        )
        (choice,) = response.choices
        (call,) = choice.message.tool_calls or []
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id) and call.type == "function"
        assert call.function.name == "pet" and call.function.arguments == expected["message"]["content"]
        jsonschema.validate(json.loads(call.function.arguments), SMALL_SCHEMA)
        assert choice.message.content == "" and choice.finish_reason == "stop"
        body = {"messages": CHAT, "tools": TOOLS, "tool_choice": PET, "structured_outputs": COMPACT, **sampling}
        entries, finish_reason = streamed_choice(base_url, body)
        first, *rest = entries
        assert first["id"].startswith("chatcmpl-tool-") and first["function"]["name"] == "pet"
        assert all(e["index"] == 0 and "name" not in e["function"] and "id" not in e for e in rest)
        assert "".join(e["function"]["arguments"] for e in entries) == expected["message"]["content"]
        assert finish_reason == "stop"


@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_tool_choice_is_the_calls_of_the_constrained_array(services, parallel):
    """vLLM's required tool choice: the reply is an array of calls over the tools (REQUIRED_SCHEMA; one call at
    most with parallel_tool_calls false, OpenAI's meaning), parsed into tool_calls (arguments: the parameters as
    JSON), finish reason "tool_calls" (OpenAI's); streamed, each call whole in one delta once complete."""
    _, _, base_url = services
    schema = REQUIRED_SCHEMA if parallel else {**REQUIRED_SCHEMA, "maxItems": 1}
    numbers_of_calls = []  # of the whole replies checked
    for seed in range(5):
        sampling = {"temperature": 1.0, "seed": seed, "max_tokens": 120}
        expected = constrained_reply(base_url, schema, **sampling)
        if expected["finish_reason"] != "stop":  # an array of many calls cut by max_tokens (a cut reply: below)
            continue
        calls = [(c["name"], c["parameters"]) for c in json.loads(expected["message"]["content"])]
        numbers_of_calls.append(len(calls))
        body = {"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "structured_outputs": COMPACT}
        body["parallel_tool_calls"] = parallel
        response = httpx.post(f"{base_url}/v1/chat/completions", json={**body, **sampling}, timeout=60)
        (choice,) = response.json()["choices"]
        message = choice["message"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
        assert message["content"] == "" and choice["finish_reason"] == "tool_calls"
        assert len({c["id"] for c in message["tool_calls"]}) == len(calls)
        entries, finish_reason = streamed_choice(base_url, {**body, **sampling})
        assert [e["index"] for e in entries] == list(range(len(calls)))
        assert [(e["function"]["name"], json.loads(e["function"]["arguments"])) for e in entries] == calls
        assert finish_reason == "tool_calls"
    assert len(numbers_of_calls) >= 2  # seeds whose whole reply was checked
    if not parallel:
        assert set(numbers_of_calls) == {1}


def test_a_required_reply_cut_before_a_whole_call_is_its_text(services):
    """Cut off by max_tokens before its first call is complete, a required reply has no call to give: its text
    stays the content (streamed: on the last chunk), finish reason "length"."""
    _, _, base_url = services
    sampling = {"temperature": 0.0, "max_tokens": 6}
    expected = constrained_reply(base_url, REQUIRED_SCHEMA, **sampling)
    assert expected["finish_reason"] == "length"
    body = {"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "structured_outputs": COMPACT, **sampling}
    (choice,) = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).json()["choices"]
    assert choice["message"]["tool_calls"] == [] and choice["finish_reason"] == "length"
    assert choice["message"]["content"] == expected["message"]["content"]
    streamed = sse_events(base_url, "/v1/chat/completions", {**body, "stream": True})[:-1]
    events = [json.loads(e)["choices"][0] for e in streamed]
    assert "".join(e["delta"].get("content", "") for e in events) == expected["message"]["content"]
    assert events[-1]["finish_reason"] == "length"


def test_tool_choice_none_and_required_over_no_tools_leave_the_reply_text(services):
    """ "none" renders the tools and asks for no call; "required" over an empty list is "none" (OpenAI's, vLLM's)."""
    _, _, base_url = services
    plain = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": CHAT, **GREEDY}, timeout=60).json()
    for fields in ({"tools": TOOLS, "tool_choice": "none"}, {"tools": [], "tool_choice": "required"}):
        body = {"messages": CHAT, **fields, **GREEDY}
        response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).json()
        assert response["choices"][0]["message"] == plain["choices"][0]["message"]
        assert response["choices"][0]["message"]["tool_calls"] == []


@pytest.fixture(scope="module")
def auto_tools_url(services, model, tmp_path_factory):
    """A second frontend on the same core, started with vLLM's --enable-auto-tool-choice --tool-call-parser hermes
    and --reasoning-parser qwen3 (and --trust-request-chat-template); yields its HTTP base URL."""
    core, _, _ = services
    http_port = stack.free_port()
    flags = ["--http-port", str(http_port), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    flags += ["--trust-request-chat-template", "--reasoning-parser", "qwen3"]
    frontend = stack.start_frontend(model, [core.address], tmp_path_factory.mktemp("auto-tools-logs"), flags)
    try:
        frontend.wait_serving()
        yield f"http://127.0.0.1:{http_port}"
    finally:
        frontend.stop()


# A reply in the Hermes format, held to it by a regex (the weights are random): a line of text, then one call.
HERMES_REPLY = (
    r'Sure\.\n<tool_call>\n\{"name": "pet", "arguments": \{"kind": "(cat|dog)", "n": ([0-9])\}\}\n</tool_call>'
)


def test_auto_tool_choice_parses_the_model_s_hermes_calls(services, auto_tools_url):
    """With a tool-call parser, tools without a choice (or "auto") let the model decide; its Hermes calls are
    parsed out of the reply: the text before them the content, each call's arguments its JSON, finish reason
    "tool_calls". The right values come from the same reply got without tools, split by a regex of its own."""
    _, _, plain_url = services
    for seed in (0, 1):
        sampling = {"temperature": 1.0, "seed": seed, "max_tokens": 120, "skip_special_tokens": False}
        constrained = {"messages": CHAT, "structured_outputs": {"regex": HERMES_REPLY}, **sampling}
        expected = httpx.post(f"{plain_url}/v1/chat/completions", json=constrained, timeout=60).json()["choices"][0]
        assert expected["finish_reason"] == "stop"
        match = re.fullmatch(HERMES_REPLY, expected["message"]["content"])
        assert match is not None
        kind, n = match.groups()
        for choice_field in ({}, {"tool_choice": "auto"}):
            body = {**constrained, "tools": TOOLS, **choice_field}
            (choice,) = httpx.post(f"{auto_tools_url}/v1/chat/completions", json=body, timeout=60).json()["choices"]
            (call,) = choice["message"]["tool_calls"]
            assert call["function"] == {"name": "pet", "arguments": json.dumps({"kind": kind, "n": int(n)})}
            assert choice["message"]["content"] == "Sure.\n" and choice["finish_reason"] == "tool_calls"
            events = sse_events(auto_tools_url, "/v1/chat/completions", {**body, "stream": True})[:-1]
            deltas = [json.loads(e)["choices"][0] for e in events]
            assert "".join(d["delta"].get("content") or "" for d in deltas) == "Sure.\n"
            (entry,) = [e for d in deltas for e in d["delta"].get("tool_calls", [])]
            assert entry["index"] == 0 and entry["function"] == call["function"]
            assert deltas[-1]["finish_reason"] == "tool_calls"


def test_auto_tool_choice_leaves_a_reply_without_calls_as_text(services, auto_tools_url):
    _, _, plain_url = services
    body = {"messages": CHAT, "skip_special_tokens": False, **GREEDY}
    plain = httpx.post(f"{plain_url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    (choice,) = httpx.post(f"{auto_tools_url}/v1/chat/completions", json={**body, "tools": TOOLS}, timeout=60).json()[
        "choices"
    ]
    assert choice["message"] == {**plain["message"], "reasoning": None, "reasoning_content": None}  # none opened
    assert choice["finish_reason"] == plain["finish_reason"]
    # the plain frontend has no parser: "auto" is refused there, naming the field
    response = httpx.post(f"{plain_url}/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "auto"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in response.json()["error"]["message"]


# A chat template that renders the tools it is given (the llama2 tokenizer's renders none).
TOOLS_TEMPLATE = (
    "{% if tools %}Tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)


def test_tokenize_renders_the_tools_as_chat_does(auto_tools_url, tokenizer):
    """vLLM's TokenizeChatRequest takes tools: /tokenize of messages with tools counts the prompt a chat with them
    runs, which is transformers' rendering of the same template and tools."""
    expected = tokenizer.apply_chat_template(
        CHAT, tools=TOOLS, chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert "Tools: pet noop" in expected
    expected_ids = tokenizer(expected, add_special_tokens=False).input_ids
    body = {"messages": CHAT, "tools": TOOLS, "chat_template": TOOLS_TEMPLATE}
    tokenized = httpx.post(f"{auto_tools_url}/tokenize", json=body, timeout=60).json()
    assert tokenized["tokens"] == expected_ids and tokenized["count"] == len(expected_ids)
    chat = {**body, "tool_choice": "none", "return_token_ids": True, **GREEDY}
    response = httpx.post(f"{auto_tools_url}/v1/chat/completions", json=chat, timeout=60).json()
    assert response["prompt_token_ids"] == expected_ids
    bad = httpx.post(f"{auto_tools_url}/tokenize", json={**body, "tools": [{"function": {}}]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].function.name"


def test_tool_replies_keep_echo_and_streamed_token_ids(services):
    """A forced call's reply keeps the rest of the response as without tools: the echoed message before its
    (empty) content, vLLM's; streamed, every token id, also those of chunks whose call was still coming."""
    _, _, base_url = services
    turns = [*CHAT, {"role": "assistant", "content": "Once"}]
    body = {"messages": turns, "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    body.update(tools=TOOLS, tool_choice=PET, max_tokens=40, temperature=0.0, structured_outputs=COMPACT)
    (choice,) = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).json()["choices"]
    assert choice["message"]["content"] == "Once" and choice["message"]["tool_calls"][0]["function"]["name"] == "pet"
    required = {"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "return_token_ids": True}
    required.update(max_tokens=40, temperature=0.0)
    whole = httpx.post(f"{base_url}/v1/chat/completions", json=required, timeout=60).json()["choices"][0]
    events = sse_events(base_url, "/v1/chat/completions", {**required, "stream": True})[:-1]
    streamed = [t for e in events for c in json.loads(e)["choices"] for t in c.get("token_ids") or []]
    assert streamed == whole["token_ids"]


def test_tool_choice_null_is_none_and_a_bad_schema_is_named_where_it_came_from(services, auto_tools_url):
    """An explicit null tool_choice with tools is vLLM's "none" (left out, it is "auto"); a bad structured_outputs
    schema beside a choice that forces no call is named as structured_outputs.json, not as the tools."""
    _, _, plain_url = services
    plain = httpx.post(f"{plain_url}/v1/chat/completions", json={"messages": CHAT, **GREEDY}, timeout=60).json()
    body = {"messages": CHAT, "tools": TOOLS, "tool_choice": None, **GREEDY}
    response = httpx.post(f"{plain_url}/v1/chat/completions", json=body, timeout=60).json()
    assert response["choices"][0]["message"] == plain["choices"][0]["message"]
    bad = {"structured_outputs": {"json": {"type": "blob"}}, **GREEDY}
    for url, fields in (
        (plain_url, {"tools": [], "tool_choice": "required"}),
        (auto_tools_url, {"tools": TOOLS, "tool_choice": "auto"}),
    ):
        response = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, **fields, **bad}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs.json"
    # left out on the auto frontend, the choice is "auto": the tools are still checked
    response = httpx.post(
        f"{auto_tools_url}/v1/chat/completions",
        json={"messages": CHAT, "tools": [{"type": "retrieval"}], **GREEDY},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools[0].type"


def test_auto_tool_choice_keeps_one_call_without_parallel_tool_calls(services, auto_tools_url):
    """parallel_tool_calls false keeps the model's first call only (vLLM's); the right calls come from the reply
    got without tools, split by a regex of its own."""
    _, _, plain_url = services
    one = r'<tool_call>\{"name": "(pet|noop)", "arguments": \{\}\}</tool_call>'
    sampling = {"temperature": 1.0, "seed": 3, "max_tokens": 120, "skip_special_tokens": False}
    constrained = {"messages": CHAT, "structured_outputs": {"regex": one + one}, **sampling}
    expected = httpx.post(f"{plain_url}/v1/chat/completions", json=constrained, timeout=60).json()["choices"][0]
    match = re.fullmatch(one + one, expected["message"]["content"])
    assert match is not None and expected["finish_reason"] == "stop"
    for parallel, names in ((True, list(match.groups())), (False, [match.group(1)])):
        body = {**constrained, "tools": TOOLS, "parallel_tool_calls": parallel}
        (choice,) = httpx.post(f"{auto_tools_url}/v1/chat/completions", json=body, timeout=60).json()["choices"]
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == names
        assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
        events = sse_events(auto_tools_url, "/v1/chat/completions", {**body, "stream": True})[:-1]
        entries = [e for event in events for e in json.loads(event)["choices"][0]["delta"].get("tool_calls", [])]
        assert [e["function"]["name"] for e in entries] == names


# A thinking reply, held to the form by a regex (the weights are random): the reasoning block, then the answer.
THINKING = r"<think>\n([ab])c\n</think>\n\n(yes|no)"


def test_a_reasoning_parser_splits_the_reply_into_reasoning_and_content(services, auto_tools_url):
    """vLLM's --reasoning-parser (qwen3 here): the reply's <think> block is the message's reasoning (as vLLM's
    newer "reasoning" and its earlier "reasoning_content"), the rest its content, whole and streamed;
    include_reasoning false drops the reasoning. The right parts come from the same reply got from a frontend
    without a parser, split by a regex of its own."""
    _, _, plain_url = services
    for seed in (0, 1):
        body = {"messages": CHAT, "structured_outputs": {"regex": THINKING}, "temperature": 1.0, "seed": seed}
        body["max_tokens"] = 60
        expected = httpx.post(f"{plain_url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        match = re.fullmatch(THINKING, expected["message"]["content"])
        assert match is not None and expected["finish_reason"] == "stop"
        reasoning, content = f"\n{match.group(1)}c\n", f"\n\n{match.group(2)}"
        (choice,) = httpx.post(f"{auto_tools_url}/v1/chat/completions", json=body, timeout=60).json()["choices"]
        message = choice["message"]
        assert (message["reasoning"], message["reasoning_content"], message["content"]) == (
            reasoning,
            reasoning,
            content,
        )
        events = sse_events(auto_tools_url, "/v1/chat/completions", {**body, "stream": True})[:-1]
        deltas = [json.loads(e)["choices"][0]["delta"] for e in events]
        assert "".join(d.get("reasoning") or "" for d in deltas) == reasoning
        assert "".join(d.get("content") or "" for d in deltas) == content
        assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
        hidden = {**body, "include_reasoning": False}
        (choice,) = httpx.post(f"{auto_tools_url}/v1/chat/completions", json=hidden, timeout=60).json()["choices"]
        assert (choice["message"]["reasoning"], choice["message"]["content"]) == (None, content)
        events = sse_events(auto_tools_url, "/v1/chat/completions", {**hidden, "stream": True})[:-1]
        assert all("reasoning" not in json.loads(e)["choices"][0]["delta"] for e in events)


def test_a_reply_of_reasoning_only_has_null_content_with_or_without_tools(auto_tools_url):
    body = {"messages": CHAT, "structured_outputs": {"regex": "<think>hm</think>"}, "max_tokens": 30}
    for fields in ({}, {"tools": TOOLS}):
        response = httpx.post(f"{auto_tools_url}/v1/chat/completions", json={**body, **fields}, timeout=60).json()
        message = response["choices"][0]["message"]
        assert (message["reasoning"], message["content"], message["tool_calls"]) == ("hm", None, [])


def test_auto_tool_calls_are_parsed_from_the_content_after_the_reasoning(services, auto_tools_url):
    """vLLM's order: the reasoning is split off first, then the calls parsed out of the content after it."""
    _, _, plain_url = services
    call = r'<tool_call>\{"name": "(pet|noop)", "arguments": \{\}\}</tool_call>'
    body = {"messages": CHAT, "structured_outputs": {"regex": "<think>hm</think>" + call}, "temperature": 1.0}
    body.update(seed=2, max_tokens=60, skip_special_tokens=False)
    expected = httpx.post(f"{plain_url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    match = re.fullmatch("<think>hm</think>" + call, expected["message"]["content"])
    assert match is not None and expected["finish_reason"] == "stop"
    with_tools = {**body, "tools": TOOLS}
    (choice,) = httpx.post(f"{auto_tools_url}/v1/chat/completions", json=with_tools, timeout=60).json()["choices"]
    assert choice["message"]["reasoning"] == "hm" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [match.group(1)]
    assert choice["finish_reason"] == "tool_calls"
    events = sse_events(auto_tools_url, "/v1/chat/completions", {**with_tools, "stream": True})[:-1]
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "hm"
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == [match.group(1)]
