"""Large pixel tensors and the message size limits: a core started without ``--max-receive-message-mib`` sizes its
receive limit for its model's images (``core_svc/request_size.py``), so a Qwen2-VL request whose pixel tensor is
larger than 16 MiB goes through the split stack and answers as in-process; under an explicit smaller limit the
frontend refuses it with INVALID_ARGUMENT naming the limit, and the other requests go on."""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from PIL import Image

from core_svc.config import CoreConfig
from core_svc.request_size import model_receive_limit
from frontend_svc import LLM, SamplingParams
from frontend_svc.outputs import RequestOutput
from splitserve.base.grpc_runtime import DEFAULT_MAX_RECEIVE_MESSAGE_BYTES, MAX_MESSAGE_BYTES
from splitserve.entrypoints import stack
from splitserve.stubs.engine.v1 import engine_core_pb2 as core_pb
from splitserve.stubs.engine.v1 import engine_core_pb2_grpc as core_grpc
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc
from tests.conftest import real_or_builtin

MIB = 2**20
MAX_MODEL_LEN = 1100
CORE_ARGS = ["--num-kv-blocks", "80", "--max-model-len", str(MAX_MODEL_LEN)]
# The test checkpoint's image processor, allowed 1024 x 1024 pixels: one 840 x 840 image (a multiple of 28) makes
# 60 x 60 patches of 3 x 2 x 14 x 14 float32 values = 16934400 bytes, 900 tokens.
MAX_PIXELS = 1024 * 1024
IMAGE_SIDE = 840
NUM_IMAGE_TOKENS = 900
PIXEL_TENSOR_BYTES = 60 * 60 * (3 * 2 * 14 * 14) * 4
PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is it?"
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from splitserve.entrypoints.test_model import make_test_model

    path = make_test_model(tmp_path_factory.mktemp("qwen2-vl-large"), "qwen2_vl", tokenizer=real_or_builtin("llama2"))
    config_file = path / "preprocessor_config.json"
    config = json.loads(config_file.read_text())
    config["max_pixels"] = MAX_PIXELS
    config["size"] = {**config.get("size", {}), "longest_edge": MAX_PIXELS}
    config_file.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def image_png() -> bytes:
    pixels = np.random.RandomState(3).randint(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def llm(model: str) -> Iterator[LLM]:
    """The model in-process (no gRPC, no message limit), one image a prompt."""
    with LLM(model, num_kv_blocks=80, max_model_len=MAX_MODEL_LEN, limit_mm_per_prompt="image=1") as llm:
        yield llm


@pytest.fixture(scope="module")
def expected(llm: LLM, image_png: bytes) -> list[int]:
    """The in-process answer to the large-image prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    image = Image.open(io.BytesIO(image_png))
    [output] = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, params, use_tqdm=False)
    mm_processor = llm.llm_engine.input_processor.mm_processor
    assert mm_processor is not None
    assert output.prompt_token_ids.count(mm_processor.image_token_id) == NUM_IMAGE_TOKENS
    assert len(output.outputs[0].token_ids) == MAX_TOKENS
    return output.outputs[0].token_ids


def _request(image_png: bytes) -> api.GenerateRequest:
    return api.GenerateRequest(
        prompt=PROMPT,
        images=[api.Image(data=image_png, mime_type="image/png")],
        sampling_params=api.SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=api.OUTPUT_KIND_FINAL_ONLY
        ),
    )


def _start_stack(model: str, logs: Path, core_args: list[str]) -> tuple[stack.ServiceProcess, stack.ServiceProcess]:
    core = stack.start_core(model, logs, [*CORE_ARGS, *core_args])
    try:
        core.wait_serving()
        frontend = stack.start_frontend(model, [core.address], logs)
        frontend.wait_serving()
    except BaseException:
        core.stop()
        raise
    return core, frontend


def test_a_pixel_tensor_over_16_mib_passes_with_default_flags(
    model: str, image_png: bytes, expected: list[int], tmp_path: Path
) -> None:
    # Text 16 MiB, plus the pixels of max_model_len - 1 image tokens (fewer than 999 images' worth) at 4 patch
    # rows of 1176 float32 values a token, plus 1 KiB for each of the (at most 999) items.
    sized = 16 * MIB + (MAX_MODEL_LEN - 1) * (4 * 1176 * 4) + 999 * 1024
    assert PIXEL_TENSOR_BYTES > 16 * MIB
    core, frontend = _start_stack(model, tmp_path, [])
    try:
        with grpc.insecure_channel(core.address) as channel:
            info = core_grpc.EngineCoreStub(channel).GetEngineInfo(core_pb.GetEngineInfoRequest(), timeout=10)
        assert info.max_receive_message_bytes == sized
        with grpc.insecure_channel(frontend.address) as channel:
            [response] = list(api_grpc.GenerationStub(channel).Generate(_request(image_png), timeout=120))
    finally:
        assert frontend.stop() == 0
        assert core.stop() == 0
    assert response.finished and list(response.outputs[0].token_ids) == expected
    assert core.log_path is not None
    log = core.log_path.read_text()
    assert f"receive limit {sized} bytes" in log and "--max-receive-message-mib sets another" in log


def test_a_request_over_an_explicit_limit_is_refused_and_the_others_go_on(
    model: str, image_png: bytes, tmp_path: Path
) -> None:
    """The frontend's side of the check runs in this process (``AsyncLLM`` over gRPC to the core: the same
    ``GrpcCoreClient`` a frontend server uses; its ValidationError is the servers' INVALID_ARGUMENT), sparing a
    frontend process's start."""
    from frontend_svc.async_llm import AsyncLLM
    from frontend_svc.errors import ValidationError

    core = stack.start_core(
        model, tmp_path, [*CORE_ARGS, "--max-receive-message-mib", "8", "--limit-mm-per-prompt", "image=1"]
    )

    async def final(engine: AsyncLLM, prompt: Any, request_id: str) -> RequestOutput:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        return [output async for output in engine.generate(prompt, params, request_id)][-1]

    async def scenario() -> tuple[ValidationError, RequestOutput, RequestOutput]:
        engine = AsyncLLM(model, core_address=core.address)  # its own --limit-mm-per-prompt: 999
        try:
            # The core's smaller image limit, told in EngineInfo, refuses two images here, before preprocessing.
            assert engine.engine_info.image_limit_per_prompt == 1
            two = {"prompt": PROMPT * 2, "multi_modal_data": {"image": [Image.new("RGB", (28, 28))] * 2}}
            with pytest.raises(ValidationError) as too_many:
                await final(engine, two, "two")
            assert (too_many.value.field, too_many.value.description) == (
                "multi_modal_data",
                "has 2 images, more than the 1 a prompt may hold on the engine core (the core's "
                "--limit-mm-per-prompt image=1)",
            )
            running = asyncio.ensure_future(final(engine, "Hello there", "during"))
            large = {"prompt": PROMPT, "multi_modal_data": {"image": Image.open(io.BytesIO(image_png))}}
            with pytest.raises(ValidationError) as refused:
                await final(engine, large, "large")
            return refused.value, await running, await final(engine, "Hello there", "after")
        finally:
            engine.close()

    try:
        core.wait_serving()
        refused, during, after = asyncio.run(scenario())
    finally:
        assert core.stop() == 0
    assert refused.field == "request" and refused.status_code.name == "INVALID_ARGUMENT"
    assert refused.description.startswith("is ") and f"more than the {8 * MIB} bytes it takes" in refused.description
    # The stream to the core went on: the request beside it and one after it answer, alike (greedy).
    assert during.finished and len(during.outputs[0].token_ids) == 16
    assert after.outputs[0].token_ids == during.outputs[0].token_ids


def test_the_python_api_gives_its_limit_to_the_in_process_core(llm: LLM) -> None:
    """``LLM(limit_mm_per_prompt=...)``: the frontend refuses more images, and the in-process core (which sizes
    nothing: no message crosses a wire) refuses more items on its own."""
    mm_processor = llm.llm_engine.input_processor.mm_processor
    core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]  # the in-process client's
    assert mm_processor is not None and mm_processor.image_limit == 1
    assert core.config.image_limit == 1
    assert llm.llm_engine.engine_info.max_receive_message_bytes == 0
    assert llm.llm_engine.engine_info.image_limit_per_prompt == 1  # told through EngineInfo as over gRPC


@pytest.mark.parametrize(
    ("model_type", "config", "preprocessor", "limit", "max_model_len", "expected"),
    [
        # A text model: the text part alone.
        ("llama", {"max_position_embeddings": 4096}, {}, None, None, 16 * MIB),
        # Qwen2-VL-2B's files: 16384 tokens an image (294 MiB), 999 of them would be far more than the 32767
        # tokens of room, whose pixels are 18816 bytes each (4 x 1176 float32); 999 items' overhead.
        (
            "qwen2_vl",
            {"text_config": {"max_position_embeddings": 32768}},
            {"max_pixels": 12845056},
            None,
            None,
            16 * MIB + 32767 * 18816 + 999 * 1024,
        ),
        # The same with one image a prompt: the count bound is the smaller one.
        (
            "qwen2_vl",
            {"text_config": {"max_position_embeddings": 32768}},
            {"max_pixels": 12845056},
            "image=1",
            None,
            16 * MIB + 12845056 * 24 + 1024,
        ),
        # 128K tokens of room and 999 images: more than gRPC takes, capped at 2 GiB - 1.
        ("qwen2_vl", {"max_position_embeddings": 131072}, {"max_pixels": 12845056}, None, None, 2**31 - 1),
        # LLaVA-1.5: a 336 px crop (1354752 bytes, 576 tokens); --max-model-len 4096: 4095 tokens of room at 2352
        # bytes a token, 999 items' overhead.
        (
            "llava",
            {"vision_config": {"image_size": 336, "patch_size": 14}, "text_config": {}},
            {},
            None,
            4096,
            16 * MIB + 4095 * 2352 + 999 * 1024,
        ),
        # No vision_config: LlavaConfig's own (a 336 px crop in 14 px patches, as the core's model builds it), not
        # CLIPVisionConfig's 224 / 32.
        ("llava", {"text_config": {}}, {}, None, 4096, 16 * MIB + 4095 * 2352 + 999 * 1024),
    ],
)
def test_the_receive_limit_is_sized_from_the_models_files(
    tmp_path: Path,
    model_type: str,
    config: dict[str, object],
    preprocessor: dict[str, object],
    limit: str | None,
    max_model_len: int | None,
    expected: int,
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    if preprocessor:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    core_config = CoreConfig(model=str(tmp_path), limit_mm_per_prompt=limit, max_model_len=max_model_len)
    sized = model_receive_limit(tmp_path, core_config, DEFAULT_MAX_RECEIVE_MESSAGE_BYTES, MAX_MESSAGE_BYTES)
    assert sized.receive_bytes == expected


def _qwen_image_processor_folder(path: Path, layout: str, max_pixels: int) -> Path:
    """A Qwen2-VL folder whose image processor settings are in preprocessor_config.json ("preprocessor") or nested
    in processor_config.json's "image_processor" (transformers 5's processor ``save_pretrained``: "nested")."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "text_config": {}}))
    settings = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=max_pixels).to_dict()
    if layout == "preprocessor":
        (path / "preprocessor_config.json").write_text(json.dumps(settings))
    else:
        (path / "processor_config.json").write_text(json.dumps({"image_processor": settings}))
    return path


def test_both_image_processor_layouts_give_the_frontends_bounds(tmp_path: Path) -> None:
    """The core's receive limit and its largest image (``mm_feature_violation``'s bound) come from the settings the
    frontend's processor loads, whichever file holds them."""
    from transformers import AutoImageProcessor

    from core_svc.model_loader import _image_processor_config
    from core_svc.models.qwen2_vl import image_max_pixels
    from frontend_svc.mm_processor import IMAGE_PROCESSOR_BACKEND

    max_pixels = 28 * 28 * 300
    core_config = CoreConfig(model=str(tmp_path), limit_mm_per_prompt="image=2", max_model_len=4096)
    limits = []
    for layout in ("preprocessor", "nested"):
        path = _qwen_image_processor_folder(tmp_path / layout, layout, max_pixels)
        frontend = AutoImageProcessor.from_pretrained(str(path), backend=IMAGE_PROCESSOR_BACKEND)
        assert frontend.size["longest_edge"] == max_pixels
        # The core's largest image: 300 tokens, as the frontend's processor makes of an image at max_pixels.
        assert image_max_pixels(_image_processor_config(path, "qwen2_vl")) == max_pixels
        largest = frontend(images=[Image.new("RGB", (28 * 20, 28 * 15))], return_tensors="np")
        assert int(np.prod(largest["image_grid_thw"])) // 4 == max_pixels // 28**2 == 300
        limit = model_receive_limit(path, core_config, DEFAULT_MAX_RECEIVE_MESSAGE_BYTES, MAX_MESSAGE_BYTES)
        limits.append(limit.receive_bytes)
    # Two images of 300 tokens (fewer than 4095 of room), 18816 bytes a token, 1 KiB each besides.
    assert limits == [16 * MIB + 2 * (300 * 18816 + 1024)] * 2


@pytest.mark.parametrize(
    ("model_type", "config", "files", "message"),
    [
        (
            "llava",
            {"vision_config": {"patch_size": None}},
            {},
            "config.json: 'vision_config.patch_size' must be a positive integer, got None",
        ),
        (
            "llava",
            {"vision_config": {"image_size": None}},
            {},
            "config.json: 'vision_config.image_size' must be a positive integer, got None",
        ),
        ("qwen2_vl", {"vision_config": {"patch_size": None}}, {}, "cannot be read as a transformers config: "),
        (
            "qwen2_vl",
            {},
            {"preprocessor_config.json": {"size": 448}},
            "preprocessor_config.json: 'size' must be a JSON object such as {\"longest_edge\": ...}, got 448",
        ),
        (
            "qwen2_vl",
            {},
            {"processor_config.json": {"image_processor": {"max_pixels": "many"}}},
            "processor_config.json [image_processor]: 'max_pixels' must be a positive integer, got 'many'",
        ),
    ],
)
def test_a_bad_vision_or_image_processor_setting_is_a_one_line_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model_type: str,
    config: dict[str, Any],
    files: dict[str, Any],
    message: str,
) -> None:
    from splitserve.entrypoints.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    assert main(["core", str(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: {tmp_path}/") and message in line and "Traceback" not in err
    if files:  # the model loader reads the same settings, with the same error
        from core_svc.errors import ModelLoadError
        from core_svc.model_loader import _image_processor_config

        with pytest.raises(ModelLoadError, match=re.escape(message)):
            _image_processor_config(tmp_path, model_type)
