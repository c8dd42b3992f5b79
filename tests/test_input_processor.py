"""The InputProcessor without an engine: max_tokens against max_model_len, chat text parts joined, priorities
the wire can carry."""

from __future__ import annotations

from typing import Any

import pytest

from frontend_svc import SamplingParams, ValidationError
from frontend_svc.engine_types import EngineInfo
from frontend_svc.input_processor import InputProcessor, RequestOptions
from tests.conftest import real_or_builtin


def engine_info(max_model_len: int, vocab_size: int = 32000) -> EngineInfo:
    return EngineInfo(
        model="m",
        max_model_len=max_model_len,
        block_size=16,
        num_kv_blocks=1000,
        kv_cache_tokens=16000,
        vocab_size=vocab_size,
        eos_token_ids=(2,),
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_logprobs=20,
        dtype="float32",
    )


def load(path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def llama2_tokenizer():
    return load(real_or_builtin("llama2"))


# --- max_tokens within max_model_len (issue 12, item 5) ---


def test_prompt_plus_max_tokens_over_max_model_len_is_refused_naming_max_tokens(llama2_tokenizer):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=64))
    prompt = list(range(10, 18))  # 8 ids
    with pytest.raises(ValidationError) as info:
        processor.process_inputs("r", prompt, SamplingParams(max_tokens=61))
    assert info.value.field == "max_tokens"
    message = str(info.value)
    assert message.startswith("max_tokens: 61 is too large")
    assert "maximum context length is 64 tokens" in message
    assert "69 were requested (8 in the prompt, 61 in the completion)" in message
    assert "at most 56 fit" in message
    # Right at the limit: 8 + 56 = 64.
    request, _ = processor.process_inputs("r", prompt, SamplingParams(max_tokens=56))
    assert request.sampling_params.max_tokens == 56


def test_unset_max_tokens_takes_the_room_left(llama2_tokenizer):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=64))
    request, _ = processor.process_inputs("r", list(range(10, 18)), SamplingParams(max_tokens=None))
    assert request.sampling_params.max_tokens == 56


# --- chat text parts (issue 12, item 7) ---


def test_text_parts_of_a_message_are_joined_with_newlines(llama2_tokenizer):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=2048))
    parts = [{"type": "text", "text": "Translate:"}, {"type": "text", "text": "bonjour"}]
    rendered = processor.render_chat([{"role": "user", "content": parts}])
    expected = llama2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Translate:\nbonjour"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered["prompt"] == expected
    assert rendered["prompt_token_ids"] == llama2_tokenizer(expected, add_special_tokens=False).input_ids


# --- priority ---


@pytest.mark.parametrize("priority", [True, 1.5, "1", 2**31, -(2**31) - 1])
def test_a_priority_the_wire_cannot_carry_is_refused(llama2_tokenizer, priority):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=64))
    with pytest.raises(ValidationError) as info:
        processor.process_inputs("r", [5, 6], SamplingParams(), RequestOptions(priority=priority))
    assert info.value.field == "priority"
    request, _ = processor.process_inputs("r", [5, 6], SamplingParams(), RequestOptions(priority=-(2**31)))
    assert request.priority == -(2**31)
