"""The Python API on an in-process core: LLM, LLMEngine, AsyncLLM, n > 1, stop strings, cancellation, memory."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import os
import re
import subprocess
import sys
import weakref

import pytest
import torch

from frontend_svc import LLM, AsyncLLM, LLMEngine, RequestOutputKind, SamplingParams, ValidationError
from frontend_svc.llm import speed_postfix
from tests.conftest import real_or_builtin
from tests.helpers import hf_greedy

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def llama2_model(tmp_path_factory):
    """A tiny llama checkpoint with the real llama2 tokenizer (the builtin one where it is absent)."""
    from splitserve.entrypoints.test_model import make_test_model

    return make_test_model(
        tmp_path_factory.mktemp("llama2-tiny"), "llama", "tiny", tokenizer=real_or_builtin("llama2"), seed=0
    )


@pytest.fixture(scope="module")
def llm(llama2_model):
    with LLM(str(llama2_model), num_kv_blocks=257) as instance:
        yield instance


def free_blocks(llm_or_engine) -> int:
    engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    return engine.engine_core.engine_core.scheduler.kv_cache_manager.num_free_blocks


def test_generate_greedy_matches_transformers(llm, llama2_model):
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        assert output.prompt_token_ids == prompt_ids
        reference = hf_greedy(llama2_model, prompt_ids, 24).token_ids
        completion = output.outputs[0]
        assert completion.token_ids == reference
        # The text continues the prompt: what transformers' decode of prompt + completion adds to the prompt's.
        full = tokenizer.decode(prompt_ids + reference, skip_special_tokens=True)
        assert completion.text == full[len(tokenizer.decode(prompt_ids, skip_special_tokens=True)) :]
        assert completion.text.strip() == tokenizer.decode(reference, skip_special_tokens=True).strip()
        assert completion.finish_reason == "length" and output.finished


def test_progress_bar_counts_completions_and_shows_input_and_output_speed(llm):
    """vLLM's bar: completions (n per prompt) and, as requests finish, the input and output tokens of all their
    completions over the same elapsed time, so the two speeds stand in the ratio of the two token counts."""
    from tqdm import tqdm

    bar_text = io.StringIO()
    made: list[dict] = []

    def make_bar(**kwargs):
        made.append(kwargs)
        return tqdm(**{**kwargs, "dynamic_ncols": False}, file=bar_text)  # ncols None on a StringIO: no cut

    prompts = [*PROMPTS, "Hello"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(n=2, seed=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
    ]
    outputs = llm.generate(prompts, params, use_tqdm=make_bar)
    assert [len(o.outputs) for o in outputs] == [1, 2, 1, 1]
    num_input_tokens = sum(len(o.prompt_token_ids) * len(o.outputs) for o in outputs)
    num_output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert num_output_tokens == 5 + 2 * 9 + 30 + 2
    assert made[0]["total"] == 5 and made[0]["desc"] == "Processed prompts"
    final = re.split(r"[\r\n]", bar_text.getvalue().rstrip())[-1]
    assert final.startswith("Processed prompts: 100%") and " 5/5 [" in final, final
    speeds = re.fullmatch(r".*, est\. speed input: ([0-9.]+) toks/s, output: ([0-9.]+) toks/s\]", final)
    assert speeds is not None, final
    input_speed, output_speed = float(speeds[1]), float(speeds[2])
    # Both speeds are printed to 2 decimals (each within 0.005 of its true value), whose ratio is the tokens' ratio.
    ratio = num_input_tokens / num_output_tokens
    assert output_speed > 0 and abs(input_speed - ratio * output_speed) <= 0.005 * (1 + ratio) + 1e-9, final


def test_speed_postfix_is_vllms():
    assert speed_postfix(300, 600, 2.0) == "est. speed input: 150.00 toks/s, output: 300.00 toks/s"
    assert speed_postfix(7, 1, 0.0) == "est. speed input: 0.00 toks/s, output: 0.00 toks/s"


def test_a_program_using_llm_sees_the_model_and_kv_cache_sizes_on_stderr(llama2_model):
    """A plain script (no logging configured) shows vLLM's startup lines: the model's size and load time, the KV
    cache in blocks, tokens and GiB, and how many requests of max_model_len tokens fit at once."""
    code = f"from frontend_svc import LLM; LLM({str(llama2_model)!r}, num_kv_blocks=65, max_model_len=100).close()"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    stderr = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environ
    ).stderr
    lines = re.findall(r"^\S+ \S+ INFO (\S+: .*)$", stderr, flags=re.MULTILINE)
    loading = [line for line in lines if line.startswith("core_svc.model_loader: Model loading took ")]
    kv_cache = [line for line in lines if re.match(r"core_svc\.engine_core: (CPU KV cache|Maximum concurrency)", line)]
    num_parameters = json.loads((llama2_model / "splitserve_test_model.json").read_text())["num_parameters"]
    size = f"{num_parameters * 4 / 2**20:.2f} MiB ({num_parameters:,} parameters, float32)"  # float32: 4 bytes
    assert len(loading) == 1, stderr
    assert re.fullmatch(rf".*: Model loading took {re.escape(size)} and [0-9.]+ seconds", loading[0])
    # 65 blocks of 16 tokens allocated, K and V of every layer's KV heads, float32; the null block holds no tokens:
    # 64 blocks usable, and a request of 100 tokens needs 7 of them, so 64 / 7 fit at once.
    config = json.loads((llama2_model / "config.json").read_text())
    head_size = config["hidden_size"] // config["num_attention_heads"]
    kv_bytes = 65 * 16 * 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_size * 4
    assert kv_cache == [
        f"core_svc.engine_core: CPU KV cache size: 1,024 tokens (64 blocks x 16 tokens, {kv_bytes / 2**20:.2f} MiB, "
        "float32)",
        "core_svc.engine_core: Maximum concurrency for 100 tokens per request: 9.14x",
    ]


@pytest.mark.parametrize(
    ("env", "setup", "expected"),
    [
        ({}, "", [r"\S+ \S+ INFO core_svc\.x: ours"]),  # once, although configured twice
        ({"SPLITSERVE_LOG_LEVEL": "warning"}, "", []),
        ({"SPLITSERVE_CONFIGURE_LOGGING": "0"}, "", []),  # Python's default: warnings only
        # The application's configuration decides, and each line is printed once.
        (
            {},
            "logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s'); ",
            [r"core_svc\.x ours", "app theirs"],
        ),
    ],
)
def test_the_python_api_logs_info_to_stderr_unless_the_application_configured_logging(env, setup, expected):
    code = (
        f"import logging; {setup}from splitserve.base.logging_config import configure_library_logging; "
        "configure_library_logging(); configure_library_logging(); "
        "logging.getLogger('core_svc.x').info('ours'); logging.getLogger('app').info('theirs')"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")} | env
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environ)
    lines = result.stderr.splitlines()
    assert len(lines) == len(expected), lines
    for pattern, line in zip(expected, lines, strict=True):
        assert re.fullmatch(pattern, line), line


def test_chat_renders_the_chat_template(llm):
    tokenizer = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "Name three colors."}]
    expected = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True, return_dict=False)
    outputs = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert outputs[0].prompt_token_ids == expected
    # A message's text parts are joined with "\n", as vLLM, llama.cpp and TensorRT-LLM join them.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Translate:"}, {"type": "text", "text": "bonjour"}]}]
    joined = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Translate:\nbonjour"}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    assert llm.chat(parts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0].prompt_token_ids == joined
    with pytest.raises(ValidationError, match=r"messages\[0\].content\[0\].image_url: must be a data: URI"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)
    # A text-only model: an image, however well formed, is refused.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(ValidationError, match="messages: this model takes no images"):
        llm.chat([{"role": "user", "content": [image]}], use_tqdm=False)


# A template that shows what reaches it: a variable of its own, tools, and each message's name, tool calls and the
# call a tool message answers.
TOOLS_TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }}|{% endif %}"
    "{% if tools %}tools={{ tools | map(attribute='function.name') | join(',') }}|{% endif %}"
    "{% for m in messages %}{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}:{{ m.content }}"
    "{% if m.tool_calls %}[call {{ m.tool_calls[0].function.name }}]{% endif %}"
    "{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %};{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_chat_takes_vllms_rendering_arguments_and_tool_messages(llm):
    tokenizer = llm.get_tokenizer()
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    conversation = [
        {"role": "user", "content": "Weather?", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    # vLLM's positional order: sampling_params, use_tqdm, lora_request, chat_template, content format, ...
    (output,) = llm.chat(
        conversation,
        params,
        False,
        None,
        TOOLS_TEMPLATE,
        add_generation_prompt=False,
        continue_final_message=True,
        tools=tools,
        chat_template_kwargs={"greeting": "hi"},
    )
    # continue_final_message: the text ends where the last message's content does (transformers cuts the rest).
    expected = "hi|tools=weather|user(bob):Weather?;assistant:[call weather];tool:sunny[for c1];assistant:It is"
    assert output.prompt == expected
    assert output.prompt_token_ids == tokenizer(expected, add_special_tokens=False).input_ids
    with pytest.raises(ValidationError, match="continue_final_message: cannot be True with add_generation_prompt"):
        llm.chat(conversation, params, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValidationError, match="chat_template_content_format: must be one of auto, string, openai"):
        llm.chat(conversation, params, use_tqdm=False, chat_template_content_format="parts")
    # "openai": every content a list of parts, which this template (printing the content) shows as such
    (as_parts,) = llm.chat(
        conversation[:1], params, False, None, TOOLS_TEMPLATE, "openai", chat_template_kwargs={"greeting": "hi"}
    )
    assert "user(bob):[{'type': 'text', 'text': 'Weather?'}];" in as_parts.prompt


def test_generate_takes_tokenization_kwargs(llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    (plain,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    (bare,) = llm.generate(PROMPTS[0], params, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})
    assert plain.prompt_token_ids == tokenizer(PROMPTS[0]).input_ids
    assert (
        bare.prompt_token_ids == tokenizer(PROMPTS[0], add_special_tokens=False).input_ids == plain.prompt_token_ids[1:]
    )
    assert bare.prompt == PROMPTS[0]


def test_n_completions(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    first = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert sorted(c.index for c in first.outputs) == [0, 1, 2, 3]
    texts = [c.text for c in sorted(first.outputs, key=lambda c: c.index)]
    assert len(set(texts)) == 4  # distinct seeds, distinct completions
    again = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert [c.text for c in sorted(again.outputs, key=lambda c: c.index)] == texts
    # Child i is seeded seed + i: child 1 of seed 42 is child 0 of seed 43.
    shifted = llm.generate(
        PROMPTS[0], SamplingParams(n=1, temperature=1.0, seed=43, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    assert shifted.outputs[0].text == texts[1]


def test_final_only_returns_all_n_together_and_parent_abort_ends_children(llama2_model):
    engine = LLMEngine(str(llama2_model), num_kv_blocks=257)
    try:
        params = SamplingParams(
            n=3, temperature=1.0, seed=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        engine.add_request("all", PROMPTS[0], params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs) == 3

        engine.add_request("cut", PROMPTS[1], SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
        engine.step()
        engine.abort_request("cut")
        assert not engine.has_unfinished_requests()
        assert not engine.engine_core.engine_core.has_unfinished_requests()
        engine.step()
        assert free_blocks(engine) == 256
    finally:
        engine.close()


def test_stop_string_aborts_in_the_core_and_frees_blocks(llm):
    tokenizer = llm.get_tokenizer()
    free_run = llm.generate(
        PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop = free_run.text[5:8]
    stopped = llm.generate(
        PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free_run.text[: free_run.text.index(stop)]
    assert len(stopped.token_ids) < 30 and stopped.token_ids == free_run.token_ids[: len(stopped.token_ids)]
    assert tokenizer.decode(stopped.token_ids).startswith(stopped.text.strip())
    core = llm.llm_engine.engine_core.engine_core
    assert not core.has_unfinished_requests()
    assert free_blocks(llm) == 256


def test_bad_requests_are_refused_and_others_go_on(llm):
    with pytest.raises(ValidationError, match="prompt: cannot be empty"):
        llm.generate([[]], use_tqdm=False)  # text "" is not empty: it tokenizes to BOS, as in vLLM
    vocab_size = len(llm.get_tokenizer())
    with pytest.raises(ValidationError, match=rf"prompt_token_ids\[1\]: token id {vocab_size} is out of vocabulary"):
        llm.generate([[5, vocab_size]], use_tqdm=False)
    with pytest.raises(ValidationError, match="min_tokens: 3000 is above the derived max_tokens"):
        llm.generate("hi", SamplingParams(min_tokens=3000, max_tokens=None), use_tqdm=False)
    with pytest.raises(ValidationError, match="logprobs: asked for 50"):
        llm.generate("hi", SamplingParams(logprobs=50), use_tqdm=False)
    with pytest.raises(ValidationError, match="prompt: has 2048 tokens"):
        llm.generate([[5] * 2048], use_tqdm=False)
    # Prompt + max_tokens over max_model_len (2048) is cut short at max_model_len, as vLLM's LLM cuts it.
    long = llm.generate([[5] * 2040], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert len(long[0].outputs[0].token_ids) == 8 and long[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValidationError, match="request_id: has 1025 characters, more than the 1024 allowed"):
        llm.llm_engine.add_request("r" * 1025, "hi", SamplingParams(max_tokens=3))
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.add_request("r" * 1024, "hi", SamplingParams(temperature=0.0, max_tokens=3))
    while llm.llm_engine.has_unfinished_requests():
        finished = [o for o in llm.llm_engine.step() if o.finished]
    assert finished[0].request_id == "r" * 1024 and len(finished[0].outputs[0].token_ids) == 3
    out = llm.generate(["hi", "there"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]


def test_priority_one_int_for_every_prompt_and_on_chat(llm):
    """As vLLM's LLM, one int applies to every prompt (it raised TypeError); chat takes it too. This core runs
    FCFS, so a non-zero priority reaches the core and is refused there, naming the field."""
    params = SamplingParams(temperature=0.0, max_tokens=3)
    with pytest.raises(ValidationError, match="priority: got 1 but Priority scheduling is not enabled"):
        llm.generate(PROMPTS[:2], params, priority=1, use_tqdm=False)
    with pytest.raises(ValidationError, match="priority: got 1 but Priority scheduling is not enabled"):
        llm.chat([{"role": "user", "content": "Hi"}], params, priority=1, use_tqdm=False)
    with pytest.raises(ValidationError, match="priority: has 1 entries for 2 prompts"):
        llm.generate(PROMPTS[:2], params, priority=[0], use_tqdm=False)
    with pytest.raises(ValidationError, match="priority: must be a 32-bit integer"):
        llm.generate(PROMPTS[:2], params, priority=True, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    for priority in (0, [0, 0]):
        outputs = llm.generate(PROMPTS[:2], params, priority=priority, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    chat = llm.chat([{"role": "user", "content": "Hi"}], params, priority=0, use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) == 3


def test_async_generate_streams_and_cancels(llama2_model, llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0]

    async def scenario():
        engine = AsyncLLM(str(llama2_model), num_kv_blocks=257)
        try:
            delta = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            text, ids, finished_flags = "", [], []
            async for output in engine.generate(PROMPTS[0], delta, "a"):
                text += output.outputs[0].text
                ids += output.outputs[0].token_ids
                finished_flags.append(output.finished)
            assert (text, ids) == (expected.text, expected.token_ids)
            assert finished_flags[-1] and not any(finished_flags[:-1])

            n3 = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, output_kind=RequestOutputKind.DELTA)
            flags = [o.finished async for o in engine.generate(PROMPTS[1], n3, "b")]
            assert flags[-1] and not any(flags[:-1])  # only the last output says finished

            async def consume(request_id, long_params):
                async for _ in engine.generate(PROMPTS[2], long_params, request_id):
                    pass

            long_params = SamplingParams(n=2, temperature=1.0, max_tokens=500, ignore_eos=True)
            task = asyncio.create_task(consume("c", long_params))
            other = asyncio.create_task(consume("d", SamplingParams(max_tokens=20, ignore_eos=True)))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await other  # the other request is unaffected
            for _ in range(100):  # the abort reaches the core thread
                if not engine.engine_core.engine_core.has_unfinished_requests():
                    break
                await asyncio.sleep(0.05)
            assert not engine.engine_core.engine_core.has_unfinished_requests()
            assert not engine.output_processor.has_unfinished_requests()
        finally:
            engine.close()
        assert engine.engine_core.engine_core is None

    asyncio.run(scenario())


def test_core_memory_is_released_on_close_and_on_garbage_collection(llama2_model):
    llm = LLM(str(llama2_model), num_kv_blocks=65)
    core = weakref.ref(llm.llm_engine.engine_core.engine_core)
    llm.close()
    gc.collect()
    assert core() is None

    llm = LLM(str(llama2_model), num_kv_blocks=65)
    kv_cache = weakref.ref(llm.llm_engine.engine_core.engine_core.model_runner.kv_caches[0])
    del llm
    gc.collect()
    assert kv_cache() is None


def test_importing_the_frontend_imports_no_torch_and_no_core():
    code = "import sys, frontend_svc; print(sorted(m for m in ('torch', 'core_svc', 'kernels') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_async_edge_cases(llama2_model):
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def drain(engine, request_id, params, prompt=PROMPTS[0]):
        return [o async for o in engine.generate(prompt, params, request_id)]

    async def wait_until_core_idle(engine):
        for _ in range(200):
            if not engine.engine_core.engine_core.has_unfinished_requests():
                return True
            await asyncio.sleep(0.02)
        return False

    async def scenario(engine):
        # Cancelled while its add is still queued for the core thread: the engine lives on, nothing leaks.
        task = asyncio.create_task(drain(engine, "early", long))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await wait_until_core_idle(engine)
        assert len(await drain(engine, "next", SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA))) >= 1

        # Two requests with the same caller id: cancelling one leaves the other alone.
        one = asyncio.create_task(drain(engine, "same", long))
        two = asyncio.create_task(drain(engine, "same", SamplingParams(max_tokens=30, ignore_eos=True)))
        await asyncio.sleep(0.2)
        one.cancel()
        with pytest.raises(asyncio.CancelledError):
            await one
        survivor = (await two)[-1].outputs[0]
        assert survivor.finish_reason == "length" and len(survivor.token_ids) == 30

        # Closing the engine ends every waiting stream with EngineDeadError instead of leaving it hanging.
        streams = [asyncio.create_task(drain(engine, f"s{i}", long)) for i in range(3)]
        await asyncio.sleep(0.2)
        engine.close()
        results = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), timeout=10)
        assert all(type(r).__name__ == "EngineDeadError" for r in results)
        with pytest.raises(Exception, match="closed|shut down"):
            await drain(engine, "after", long)

    engine = AsyncLLM(str(llama2_model), num_kv_blocks=257)
    asyncio.run(scenario(engine))


def test_async_llm_serves_a_second_event_loop_and_is_collected_unclosed(llama2_model):
    engine = AsyncLLM(str(llama2_model), num_kv_blocks=65)
    params = SamplingParams(max_tokens=3, temperature=0.0)

    async def once(llm):
        return [o async for o in llm.generate(PROMPTS[0], params, "r")][-1].outputs[0].token_ids

    first = asyncio.run(once(engine))
    assert asyncio.run(asyncio.wait_for(once(engine), timeout=30)) == first
    core = weakref.ref(engine.engine_core.engine_core)
    del engine
    gc.collect()
    assert core() is None


def test_async_llm_reports_its_state_as_vllms(llama2_model):
    async def scenario() -> tuple[int, int, bool]:
        engine = AsyncLLM(str(llama2_model), num_kv_blocks=65)
        params = SamplingParams(n=2, max_tokens=50, temperature=1.0, ignore_eos=True)
        stream = engine.generate(PROMPTS[0], params, "r")
        await anext(stream)
        await engine.check_health()
        assert engine.is_running and not engine.errored and engine.dead_error is None
        in_flight = engine.get_num_unfinished_requests()  # each of the n completions
        await stream.aclose()
        while engine.get_num_unfinished_requests():  # the abort's bookkeeping runs as a task
            await asyncio.sleep(0.01)
        after = engine.get_num_unfinished_requests()
        engine.shutdown()
        return in_flight, after, engine.errored

    assert asyncio.run(scenario()) == (2, 0, True)


def test_engine_abort_by_internal_parent_id(llama2_model):
    engine = LLMEngine(str(llama2_model), num_kv_blocks=257)
    try:
        internal_id = engine.add_request("a", PROMPTS[0], SamplingParams(n=3, max_tokens=50, ignore_eos=True))
        engine.step()
        engine.abort_request(internal_id, internal=True)
        assert not engine.has_unfinished_requests()
        assert not engine.engine_core.engine_core.has_unfinished_requests()
    finally:
        engine.close()


def test_generate_raises_a_failed_request_and_leaves_nothing_running(llama2_model, monkeypatch):
    """A step that fails (the forward raises for a prompt starting with POISON_TOKEN_ID) ends its requests
    with INTERNAL. LLM.generate raises that error with the core's message, as vLLM's LLM raises, instead of
    returning an output with finish reason "error" and no message, and aborts the call's other requests: with
    max_num_seqs 1 the poison request runs alone, the other waits and is aborted; n = 2: child 0 fails alone,
    child 1 waits and is aborted. Nothing stays in the frontend or the core; the next call is served as before."""
    from core_svc.models.llama import LlamaForCausalLM
    from frontend_svc import InternalError
    from tests.faulty_core import FAULT_MESSAGE, POISON_TOKEN_ID, faulty_forward

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    good, poison = [5, 6, 7, 8], [POISON_TOKEN_ID, 6, 7, 8]
    with LLM(str(llama2_model), num_kv_blocks=257, max_num_seqs=1) as llm:
        reference = llm.generate([good], params, use_tqdm=False)[0].outputs[0].token_ids
        monkeypatch.setattr(LlamaForCausalLM, "forward", faulty_forward("poison", LlamaForCausalLM.forward))
        core = llm.llm_engine.engine_core.engine_core
        two = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True)
        message = f"the engine core failed while running this request: {FAULT_MESSAGE}"
        # LLM numbers its requests from 0: the reference was "0", the first call "1" and "2", the second "3".
        for prompts, call_params, failed_id in [([poison, good], params, "1"), ([poison], two, "3")]:
            with pytest.raises(InternalError) as info:
                llm.generate(prompts, call_params, use_tqdm=False)
            assert (str(info.value), info.value.request_id) == (message, failed_id)
            assert not llm.llm_engine.has_unfinished_requests() and not core.scheduler.requests
            assert free_blocks(llm) == 256
        assert llm.generate([good], params, use_tqdm=False)[0].outputs[0].token_ids == reference


def test_engine_step_raises_each_failed_request_once(llama2_model, monkeypatch):
    """max_consecutive_failed_steps 1: the first failed step declares the core dead. Its own request "p" gets
    INTERNAL; "w", waiting (max_num_seqs 1), gets UNAVAILABLE: two errors from one step. step() raises the
    first, the next step() the second (from that same step: the dead core is not stepped again), each naming
    its request; then nothing is left, and the dead core refuses new requests with EngineDeadError."""
    from core_svc.models.llama import LlamaForCausalLM
    from frontend_svc import EngineDeadError, InternalError
    from tests.faulty_core import POISON_TOKEN_ID, faulty_forward

    monkeypatch.setattr(LlamaForCausalLM, "forward", faulty_forward("poison", LlamaForCausalLM.forward))
    engine = LLMEngine(str(llama2_model), num_kv_blocks=257, max_num_seqs=1, max_consecutive_failed_steps=1)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        engine.add_request("p", [POISON_TOKEN_ID, 6, 7], params)
        engine.add_request("w", [5, 6, 7], params)
        with pytest.raises(InternalError) as first:
            engine.step()
        with pytest.raises(EngineDeadError) as second:
            engine.step()
        assert (first.value.request_id, second.value.request_id) == ("p", "w")
        assert str(second.value).startswith("the engine core is dead: 1 steps in a row failed")
        assert not engine.has_unfinished_requests()
        with pytest.raises(EngineDeadError, match="the engine core is dead"):
            engine.add_request("late", [5, 6, 7], params)
    finally:
        engine.close()


def test_async_llm_dead_core_and_failed_output_handler_errors_name_no_python_class(llama2_model, monkeypatch):
    """Callers (and a server's clients, as UNAVAILABLE) read these errors: the fault's message, never its class.
    A core declared dead made later requests fail with "the engine core failed: EngineUnavailableError('the
    engine core is dead: ...')", and a fault in the output handler with "the engine failed: RuntimeError('boom')"."""
    from core_svc.models.llama import LlamaForCausalLM
    from frontend_svc import EngineDeadError, InternalError
    from tests.faulty_core import POISON_TOKEN_ID, faulty_forward

    params = SamplingParams(temperature=0.0, max_tokens=4)
    monkeypatch.setattr(LlamaForCausalLM, "forward", faulty_forward("poison", LlamaForCausalLM.forward))

    async def scenario() -> tuple[str, str]:
        dead = AsyncLLM(str(llama2_model), num_kv_blocks=65, max_consecutive_failed_steps=1)
        try:
            with pytest.raises(InternalError):  # its request fails, and the core is dead
                async for _ in dead.generate([POISON_TOKEN_ID, 6, 7], params, "p"):
                    pass
            while dead._handler_state.dead_error is None:  # the core's death reaches the output handler
                await asyncio.sleep(0.01)
            with pytest.raises(EngineDeadError) as late:
                await dead.add_request("late", [5, 6, 7], params)
            # vLLM's state queries say so too.
            assert dead.errored and dead.is_stopped and not dead.is_running
            assert dead.dead_error is dead._handler_state.dead_error
            with pytest.raises(EngineDeadError):
                await dead.check_health()
        finally:
            dead.close()
        broken = AsyncLLM(str(llama2_model), num_kv_blocks=65)
        try:

            async def failing() -> None:
                raise RuntimeError("boom")

            broken.engine_core.get_output_async = failing  # type: ignore[method-assign]  # the fault under test
            with pytest.raises(EngineDeadError) as failed:
                async for _ in broken.generate([5, 6, 7], params, "q"):
                    pass
        finally:
            broken.close()
        return str(late.value), str(failed.value)

    late, failed = asyncio.run(scenario())
    assert late == (
        "the engine core has failed: the engine core failed: the engine core is dead: 1 steps in a row failed "
        "(the last: injected fault)"
    )
    assert failed == "the engine failed: boom"


def test_vllm_engine_arguments_are_taken_renamed_or_refused_naming_them(llama2_model, tmp_path):
    """vLLM's LLM(...) arguments: those that set nothing here at their neutral values, renamed ones as splitserve's,
    dtype aliases, other values refused naming the argument; with chunked prefill off the budget left at its
    default becomes max_model_len (vLLM's)."""
    import json
    import shutil

    neutral = {
        "tensor_parallel_size": 1,
        "trust_remote_code": True,
        "disable_log_stats": False,
        "swap_space": 4,
        "tokenizer_mode": "auto",
        "revision": None,
        "compilation_config": 0,
        "distributed_executor_backend": "mp",
    }
    with LLM(str(llama2_model), dtype="float", num_gpu_blocks_override=64, **neutral) as llm:
        info = llm.llm_engine.engine_info
        assert info.num_kv_blocks == 64 and info.dtype == "float32"
        config = llm.llm_engine.get_model_config()  # vLLM's, as scripts read it
        assert config is not None and llm.model_config == config
        vocab_size = json.loads((llama2_model / "config.json").read_text())["vocab_size"]
        assert (config.max_model_len, config.dtype, config.get_vocab_size()) == (2048, "float32", vocab_size)
        (output,) = llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 2
    for name, value, why in [
        ("tensor_parallel_size", 2, "a model runs on one device"),
        ("skip_tokenizer_init", True, "the frontend needs the tokenizer"),
        ("revision", "main", "default revision"),
    ]:
        with pytest.raises(ValueError, match=rf"{name}={value!r} is not supported: .*{why}"):
            LLM(str(llama2_model), **{name: value})
    with pytest.raises(ValueError, match="seed must be an integer, got None"):
        LLM(str(llama2_model), seed=None)
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1, got 0"):
        LLM(str(llama2_model), stream_interval=0)

    long_context = tmp_path / "long"
    shutil.copytree(llama2_model, long_context)
    config = json.loads((long_context / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (long_context / "config.json").write_text(json.dumps(config))
    with LLM(str(long_context), num_kv_blocks=300, enable_chunked_prefill=False) as llm:
        assert llm.llm_engine.engine_info.max_num_batched_tokens == 4096
        (output,) = llm.generate([[5] * 3000], SamplingParams(max_tokens=2), use_tqdm=False)
        assert output.num_cached_tokens == 0 and len(output.outputs[0].token_ids) == 2


def test_tokenization_kwargs_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    tokenizer = llm.get_tokenizer()
    text = PROMPTS[2]
    ids = tokenizer(text).input_ids
    params = SamplingParams(temperature=0.0, max_tokens=2)
    cut = {"truncate_prompt_tokens": 3}
    (from_text,) = llm.generate(text, params, use_tqdm=False, tokenization_kwargs=cut)
    (from_ids,) = llm.generate([ids], params, use_tqdm=False, tokenization_kwargs=cut)
    assert from_text.prompt_token_ids == from_ids.prompt_token_ids == ids[-3:]
    assert from_text.prompt == text and from_text.outputs[0].token_ids == from_ids.outputs[0].token_ids
    with pytest.raises(ValidationError, match="truncate_prompt_tokens: must be -1 or a positive count, got 0"):
        llm.generate(text, params, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 0})
    chat = [{"role": "user", "content": text}]
    text_rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)  # LLM.chat's
    rendered = tokenizer(text_rendered, add_special_tokens=False).input_ids
    (plain,) = llm.chat(chat, params, use_tqdm=False)
    (with_bos,) = llm.chat(chat, params, use_tqdm=False, tokenization_kwargs={"add_special_tokens": True})
    (chat_cut,) = llm.chat(chat, params, use_tqdm=False, tokenization_kwargs=cut)
    assert plain.prompt_token_ids == rendered
    # the tokenizer's own special tokens on the rendered text (BOS; the builtin tokenizer's EOS too)
    assert with_bos.prompt_token_ids == tokenizer(text_rendered).input_ids
    assert chat_cut.prompt_token_ids == rendered[-3:]
    with pytest.raises(ValidationError, match="tokenization_kwargs.truncation: LLM.chat takes"):
        llm.chat(chat, params, use_tqdm=False, tokenization_kwargs={"truncation": True})


def test_bad_words_are_banned_as_transformers_bans_their_token_sequences(llm, llama2_model):
    """vLLM's bad_words: each word's token sequences (alone, and with a leading space where that is another
    token), banned as transformers' generate(bad_words_ids=...) bans them: the greedy continuation changes where the
    word would have come."""
    from frontend_svc.sampling_params import bad_words_token_ids
    from tests.helpers import hf_model

    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer(PROMPTS[0]).input_ids
    free = hf_greedy(llama2_model, prompt_ids, 8).token_ids
    words = [tokenizer.decode(free[:1]).strip(), tokenizer.decode(free[3:4]).strip()]
    sequences = bad_words_token_ids(tokenizer, words)
    with torch.no_grad():
        banned = (
            hf_model(llama2_model)
            .generate(
                torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False, bad_words_ids=sequences, pad_token_id=0
            )[0, len(prompt_ids) :]
            .tolist()
        )
    assert banned != free
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, bad_words=words)
    (output,) = llm.generate([prompt_ids], params, use_tqdm=False)
    assert output.outputs[0].token_ids == banned
    with pytest.raises(ValidationError, match=r"bad_words\[1\]: must be a non-empty word"):
        SamplingParams(bad_words=["x", " "])


def test_bad_words_token_sequences_are_vllms():
    """With a tokenizer that marks a word's start (GPT-2's Ġ), a word is banned alone and inside text: both its
    tokens; with SentencePiece, whose encoding already starts the word, once."""
    from transformers import AutoTokenizer

    from frontend_svc.sampling_params import bad_words_token_ids
    from tests.conftest import SHARED_TOKENIZERS

    folder = SHARED_TOKENIZERS / "gpt2"
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("the gpt2 tokenizer is not in ../shared/tokenizers")
    gpt2 = AutoTokenizer.from_pretrained(folder)
    assert bad_words_token_ids(gpt2, ["hello"]) == [
        gpt2.convert_tokens_to_ids(["hello"]),
        gpt2.convert_tokens_to_ids(["Ġhello"]),
    ]
    assert bad_words_token_ids(gpt2, ["  hello"]) == bad_words_token_ids(gpt2, ["hello"])  # leading spaces stripped
