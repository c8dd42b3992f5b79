"""The InputProcessor without an engine: chat text parts joined, priorities the wire can carry."""

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
