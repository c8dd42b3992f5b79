"""A Qwen2-VL image request through the split stack: a core process and a frontend process without torch, a
``Chat`` with image parts from a client built from the protos only; its greedy ids equal the in-process
``LLM.chat``'s on the same images."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from frontend_svc import LLM, SamplingParams
from splitserve.entrypoints import stack
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc
from tests.conftest import real_or_builtin

ROOT = Path(__file__).resolve().parent.parent
CORE_ARGS = ["--num-kv-blocks", "64", "--max-model-len", "256"]
MAX_TOKENS = 8
QUESTION = "What is in these pictures?"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from splitserve.entrypoints.test_model import make_test_model

    path = make_test_model(tmp_path_factory.mktemp("qwen2-vl"), "qwen2_vl", tokenizer=real_or_builtin("llama2"))
    return str(path)


def _png(seed: int, height: int, width: int) -> bytes:
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_chat_with_images_through_the_split_stack_matches_llm_chat(
    model: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    first, second = _png(0, 50, 90), _png(1, 120, 60)  # different sizes: 6 and 8 image tokens
    uri = "data:image/png;base64," + base64.b64encode(first).decode()
    logs = tmp_path_factory.mktemp("split-logs")
    core = stack.start_core(model, logs, CORE_ARGS)
    frontend = None
    try:
        core.wait_serving()
        frontend = stack.start_service(
            "frontend",
            ["frontend", "--model", model, "--core", core.address],
            stack.free_port(),
            logs,
            launcher=[sys.executable, str(ROOT / "tests" / "torchless.py")],
        )
        frontend.wait_serving()
        content = [
            api.ContentPart(image=api.Image(url=uri)),  # a data: URI
            api.ContentPart(image=api.Image(data=second, mime_type="image/png")),  # raw bytes
            api.ContentPart(text=QUESTION),
        ]
        request = api.ChatRequest(
            messages=[api.ChatMessage(role="user", content=content)],
            sampling_params=api.SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=api.OUTPUT_KIND_FINAL_ONLY
            ),
        )
        with grpc.insecure_channel(frontend.address) as channel:
            [response] = list(api_grpc.GenerationStub(channel).Chat(request, timeout=60))
    finally:
        for process in [frontend, core]:
            if process is not None:
                process.stop()

    second_uri = "data:image/png;base64," + base64.b64encode(second).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": uri}},
                {"type": "image_url", "image_url": {"url": second_uri}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]
    with LLM(model, num_kv_blocks=64, max_model_len=256) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        [expected] = llm.chat(messages, params, use_tqdm=False)
    assert list(response.prompt_token_ids) == expected.prompt_token_ids
    assert expected.prompt_token_ids.count(llm.llm_engine.input_processor.mm_processor.image_token_id) == 14
    assert response.finished and list(response.outputs[0].token_ids) == expected.outputs[0].token_ids
    assert len(expected.outputs[0].token_ids) == MAX_TOKENS
