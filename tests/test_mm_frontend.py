"""The frontend's image inputs: placeholder expansion, pixel tensors and placeholder ranges against transformers'
own processors on the same text and images, item hashes, the errors, the wire, and no torch on the way."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from frontend_svc import mm_processor
from frontend_svc.core_client import EngineCoreClient
from frontend_svc.engine_types import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineInfo
from frontend_svc.errors import ValidationError
from frontend_svc.input_processor import InputProcessor
from frontend_svc.llm_engine import LLMEngine
from frontend_svc.mm_processor import EncodedImage, load_mm_processor
from frontend_svc.sampling_params import SamplingParams
from frontend_svc.wire import chat_messages_from_api, generate_request_from_api, request_to_pb
from splitserve.base.mm_limits import parse_limit_mm_per_prompt
from splitserve.base.status import StatusCode
from splitserve.base.wire_enums import FinishReason
from splitserve.stubs.engine.v1 import engine_core_pb2 as core_pb
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc
from tests.conftest import real_or_builtin

LLAVA_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# llava-hf/llava-1.5-7b-hf's template: it iterates every message's parts, images first.
LLAVA_HF_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# A 56 px CLIP crop in 14 px patches: 4 * 4 patches + 1 CLS, less the CLS ("default" feature selection): 16 tokens.
LLAVA_TOKENS_PER_IMAGE = 16


def random_image(seed: int, height: int = 40, width: int = 70) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    path = tmp_path_factory.mktemp("llava")
    tokenizer = AutoTokenizer.from_pretrained(str(real_or_builtin("llama2")))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
    )
    processor.save_pretrained(str(path))
    image_token_index = tokenizer.convert_tokens_to_ids("<image>")  # 32000 with llama2's tokenizer
    (path / "config.json").write_text(json.dumps({"model_type": "llava", "image_token_index": image_token_index}))
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # transformers' Qwen2VLProcessor cannot be built without torchvision (its video processor): its parts are saved.
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = tmp_path_factory.mktemp("qwen2_vl")
    tokenizer = AutoTokenizer.from_pretrained(str(real_or_builtin("gpt2")))
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]}
    )
    tokenizer.save_pretrained(str(path))
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64).save_pretrained(str(path))
    (path / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    return path


def engine_info(path: Path, vocab_size: int) -> EngineInfo:
    return EngineInfo(
        model=str(path),
        max_model_len=4096,
        block_size=16,
        num_kv_blocks=256,
        kv_cache_tokens=4096,
        vocab_size=vocab_size,
        eos_token_ids=(),
        max_num_seqs=8,
        max_num_batched_tokens=4096,
        max_logprobs=20,
        dtype="float32",
    )


def make_input_processor(path: Path, limits: dict[str, int] | None = None) -> InputProcessor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return InputProcessor(tokenizer, engine_info(path, len(tokenizer)), load_mm_processor(path, tokenizer, limits))


class RecordingClient(EngineCoreClient):
    """A core client that keeps what it is sent."""

    def __init__(self, info: EngineInfo) -> None:
        self.info = info
        self.added: list[EngineCoreRequest] = []
        self.finish_with: int | None = None
        self.outputs: asyncio.Queue[EngineCoreOutputs] = asyncio.Queue()

    def get_engine_info(self) -> EngineInfo:
        return self.info

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        pass

    def get_output(self) -> EngineCoreOutputs:  # pragma: no cover - unused
        raise NotImplementedError

    def reset_prefix_cache(self) -> bool:  # pragma: no cover - unused
        raise NotImplementedError

    def shutdown(self) -> None:
        pass

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        self.added += requests
        if self.finish_with is not None:  # each request ends at once with this token
            for request in requests:
                output = EngineCoreOutput(request.request_id, [self.finish_with], finish_reason=FinishReason.LENGTH)
                self.outputs.put_nowait(EngineCoreOutputs(outputs=[output]))

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        pass

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self.outputs.get()  # none unless finish_with: the test reads what was sent


@pytest.fixture(scope="module")
def llava(llava_dir: Path) -> InputProcessor:
    return make_input_processor(llava_dir)


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> InputProcessor:
    return make_input_processor(qwen_dir)


def run(processor: InputProcessor, prompt: Any) -> Any:
    request, _ = processor.process_inputs("r", prompt, SamplingParams(max_tokens=1))
    return request


def test_llava_matches_the_processor(llava_dir: Path, llava: InputProcessor) -> None:
    from transformers import AutoProcessor

    images = [random_image(0), random_image(1, 90, 30)]
    text = "USER: <image>\nWhat is this? <image> And that?\nASSISTANT:"
    request = run(llava, {"prompt": text, "multi_modal_data": {"image": images}})
    oracle = AutoProcessor.from_pretrained(str(llava_dir))(text=text, images=images, return_tensors="np")
    assert request.prompt_token_ids == oracle["input_ids"][0].tolist()
    image_token_index = json.loads((llava_dir / "config.json").read_text())["image_token_index"]
    image_positions = np.flatnonzero(oracle["input_ids"][0] == image_token_index)
    assert len(image_positions) == 2 * LLAVA_TOKENS_PER_IMAGE
    for i, feature in enumerate(request.mm_features):
        assert (feature.modality, feature.length) == ("image", LLAVA_TOKENS_PER_IMAGE)
        assert feature.offset == image_positions[i * LLAVA_TOKENS_PER_IMAGE]
        assert feature.data["pixel_values"].shape == (3, 56, 56)
        assert feature.data["pixel_values"].dtype == np.float32
        np.testing.assert_array_equal(feature.data["pixel_values"], oracle["pixel_values"][i])


def qwen_oracle(qwen_dir: Path, text: str, images: list[Image.Image]) -> tuple[list[int], Any]:
    """Qwen2VLProcessor's expansion by hand (it cannot load here): its image processor's outputs, and each
    <|image_pad|> repeated grid_t * grid_h * grid_w / merge_size**2 times in the text before tokenizing."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    outputs = Qwen2VLImageProcessorPil.from_pretrained(str(qwen_dir))(images=images, return_tensors="np")
    pieces = text.split("<|image_pad|>")
    expanded = pieces[0]
    for grid, piece in zip(outputs["image_grid_thw"], pieces[1:], strict=True):
        expanded += "<|image_pad|>" * int(grid.prod() // 4) + piece
    return AutoTokenizer.from_pretrained(str(qwen_dir))(expanded).input_ids, outputs


def test_qwen2_vl_matches_the_processor(qwen_dir: Path, qwen: InputProcessor) -> None:
    images = [random_image(0, 56, 56), random_image(1, 100, 60)]
    text = f"Look {QWEN_IMAGE} and {QWEN_IMAGE}: which?"
    request = run(qwen, {"prompt": text, "multi_modal_data": {"image": images}})
    ids, outputs = qwen_oracle(qwen_dir, text, images)
    assert request.prompt_token_ids == ids
    # 56x56 is already a multiple of 28: a 4x4 grid of 14 px patches, merged 2x2: 4 tokens, 16 patches.
    first, second = request.mm_features
    assert first.data["image_grid_thw"].tolist() == [1, 4, 4] and first.length == 4
    assert first.data["pixel_values"].shape == (16, 3 * 2 * 14 * 14)
    grid = outputs["image_grid_thw"][1]
    assert second.data["image_grid_thw"].tolist() == grid.tolist()
    assert second.length == grid.prod() // 4
    np.testing.assert_array_equal(first.data["pixel_values"], outputs["pixel_values"][:16])
    np.testing.assert_array_equal(second.data["pixel_values"], outputs["pixel_values"][16:])
    pad_id = qwen.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for feature in request.mm_features:
        placeholder = request.prompt_token_ids[feature.offset : feature.offset + feature.length]
        assert placeholder == [pad_id] * feature.length
        assert request.prompt_token_ids[feature.offset - 1] == qwen.tokenizer.convert_tokens_to_ids("<|vision_start|>")
        assert request.prompt_token_ids[feature.offset + feature.length] == pad_id + 1  # <|vision_end|>


def test_token_id_prompts_expand_as_text_prompts(llava: InputProcessor) -> None:
    images = [random_image(2)]
    text = "USER: <image>\nDescribe.\nASSISTANT:"
    from_text = run(llava, {"prompt": text, "multi_modal_data": {"image": images}})
    ids = llava.tokenizer(text).input_ids
    from_ids = run(llava, {"prompt_token_ids": ids, "multi_modal_data": {"image": images[0]}})
    assert from_ids.prompt_token_ids == from_text.prompt_token_ids
    image_token = llava.tokenizer.convert_tokens_to_ids("<image>")
    assert from_ids.mm_features[0].offset == from_text.mm_features[0].offset == ids.index(image_token)


def test_identifier_is_the_picture_and_settings(llava: InputProcessor, qwen: InputProcessor) -> None:
    image = random_image(3)
    text = "<image> hi"

    def identifier(processor: InputProcessor, item: Any, prompt: str = text) -> str:
        return str(run(processor, {"prompt": prompt, "multi_modal_data": {"image": item}}).mm_features[0].identifier)

    same = identifier(llava, image)
    assert identifier(llava, EncodedImage(png_bytes(image), "image/png")) == same  # decoded pixels, not file bytes
    assert identifier(llava, random_image(3).copy()) == same
    changed = np.asarray(image).copy()
    changed[0, 0, 0] ^= 1
    assert identifier(llava, Image.fromarray(changed)) != same  # one bit of one pixel
    assert identifier(qwen, image, f"{QWEN_IMAGE} hi") != same  # other processor settings
    assert len(same) == 64 and int(same, 16) >= 0  # a sha256 hex digest


def test_chat_with_data_uri_images_matches_the_processor(llava_dir: Path, llava: InputProcessor) -> None:
    from transformers import AutoProcessor

    image = random_image(4)
    uri = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "What is it?"}],
        }
    ]
    rendered = llava.render_chat(messages)
    request = run(llava, rendered)
    processor = AutoProcessor.from_pretrained(str(llava_dir))
    oracle_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(oracle_messages, tokenize=False, add_generation_prompt=True)
    assert rendered["prompt"] == text == "USER: <image>\nWhat is it?ASSISTANT:"  # the template trims blocks' newlines
    oracle = processor(text=text, images=[image], return_tensors="np", add_special_tokens=False)
    assert request.prompt_token_ids == oracle["input_ids"][0].tolist()
    np.testing.assert_array_equal(request.mm_features[0].data["pixel_values"], oracle["pixel_values"][0])


def test_api_images_become_the_prompt_and_the_wire(qwen: InputProcessor) -> None:
    image = random_image(5, 56, 84)
    msg = api.GenerateRequest(prompt=f"{QWEN_IMAGE}x", images=[api.Image(data=png_bytes(image), mime_type="image/png")])
    request = run(qwen, generate_request_from_api(msg))
    spec = request_to_pb(request).mm_features[0]
    feature = request.mm_features[0]
    assert (spec.modality, spec.identifier, spec.offset, spec.length) == (
        "image",
        feature.identifier,
        feature.offset,
        feature.length,
    )
    pixels, grid = spec.data["pixel_values"], spec.data["image_grid_thw"]
    assert (pixels.dtype, list(pixels.shape), grid.dtype, list(grid.shape)) == ("float32", [24, 1176], "int64", [3])
    np.testing.assert_array_equal(np.frombuffer(pixels.data, "<f4").reshape(24, 1176), feature.data["pixel_values"])
    assert np.frombuffer(grid.data, "<i8").tolist() == [1, 4, 6]  # 56x84 px: 4x6 patches of 14 px

    chat = api.ChatRequest(
        messages=[
            api.ChatMessage(
                role="user",
                content=[api.ContentPart(image=api.Image(url=_data_uri(image))), api.ContentPart(text="Hi")],
            )
        ]
    )
    rendered = qwen.render_chat(chat_messages_from_api(chat.messages))
    assert rendered["prompt"] == f"<|im_start|>user\n{QWEN_IMAGE}Hi<|im_end|>\n<|im_start|>assistant\n"
    assert run(qwen, rendered).mm_features[0].identifier == feature.identifier


def _data_uri(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


@pytest.mark.parametrize(
    ("images", "field", "reason"),
    [
        ([api.Image(data=b"not an image", mime_type="image/png")], "images[0]", "cannot be decoded as an image"),
        ([api.Image(data=png_bytes(random_image(0))[:300])], "images[0]", "cannot be decoded as an image"),  # cut
        ([api.Image(data=b"x", mime_type="text/plain")], "images[0].mime_type", "is not supported"),
        ([api.Image(url="https://example.com/a.png")], "images[0]", "URLs are not fetched"),
        ([api.Image(url="data:image/png;base64,@@@")], "images[0]", "base64 is not valid"),
        ([api.Image(url="data:image/png,abc")], "images[0]", "must be base64"),
        ([api.Image()], "images[0]", "holds no image"),
    ],
)
def test_bad_images_are_refused_naming_the_field(
    llava: InputProcessor, images: list[api.Image], field: str, reason: str
) -> None:
    with pytest.raises(ValidationError) as e:
        run(llava, generate_request_from_api(api.GenerateRequest(prompt="<image>", images=images)))
    assert e.value.field == field and reason in e.value.description


def test_a_too_large_image_is_refused_with_its_size(llava: InputProcessor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mm_processor, "MAX_IMAGE_PIXELS", 100)
    image = api.Image(data=png_bytes(random_image(0)), mime_type="image/png")
    with pytest.raises(ValidationError) as e:
        run(llava, generate_request_from_api(api.GenerateRequest(prompt="<image>", images=[image])))
    assert (e.value.field, e.value.description) == (
        "images[0]",
        "is 70x40 pixels, more than the 100 this server decodes",
    )


def test_line_wrapped_base64_data_uris_are_taken(llava: InputProcessor) -> None:
    image = random_image(5)
    encoded = base64.b64encode(png_bytes(image)).decode()
    wrapped = "\r\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))  # MIME's 76-character lines

    def identifier(url: str) -> str:
        request = api.GenerateRequest(prompt="<image>", images=[api.Image(url=url)])
        return str(run(llava, generate_request_from_api(request)).mm_features[0].identifier)

    assert identifier("data:image/png;base64," + wrapped + "\n") == identifier(_data_uri(image))
    with pytest.raises(ValidationError, match="base64 is not valid"):
        identifier("data:image/png;base64," + wrapped.replace("\r\n", "\u00a0", 1))  # not ASCII whitespace


def test_the_image_processor_is_the_pil_one_even_with_torchvision(
    llava_dir: Path, qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torchvision "importable": transformers would pick its torchvision image processor unless told the backend.
    # (Not installed here, so it would still fall back to Pil: the backend it was asked for is what is checked.)
    from transformers import AutoTokenizer
    from transformers.models.auto import image_processing_auto

    resolve = image_processing_auto._resolve_backend
    asked: list[str | None] = []

    def spy(backend: str | None, use_fast: bool | None, base_class_name: str | None) -> str:
        asked.append(backend)
        return resolve(backend, use_fast, base_class_name)

    monkeypatch.setattr(image_processing_auto, "is_torchvision_available", lambda: True)
    monkeypatch.setattr(image_processing_auto, "_resolve_backend", spy)
    for path, name in ((llava_dir, "CLIPImageProcessorPil"), (qwen_dir, "Qwen2VLImageProcessorPil")):
        asked.clear()
        loaded = load_mm_processor(path, AutoTokenizer.from_pretrained(str(path)))
        assert loaded is not None
        assert type(loaded.processor.image_processor).__name__ == name
        assert asked and set(asked) == {"pil"}
        assert json.loads(loaded.settings)["image_processor_class"] == name  # in the item hash


def png_header(width: int, height: int) -> bytes:
    """A PNG's signature, IHDR (8-bit RGB) and an empty IDAT: what a request's few bytes can claim, no pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", b"")
    )


def test_a_request_over_the_pixel_budget_is_refused_from_the_headers(llava: InputProcessor) -> None:
    # Two 6000 x 6000 images: each under the per-image cap, 72 megapixels together. Their headers alone are sent:
    # the refusal comes before any decode (which would fail: no pixel data).
    assert mm_processor.MAX_IMAGE_PIXELS <= mm_processor.MAX_REQUEST_PIXELS == 64_000_000
    images = [api.Image(data=png_header(6000, 6000), mime_type="image/png")] * 2
    with pytest.raises(ValidationError) as e:
        run(llava, generate_request_from_api(api.GenerateRequest(prompt="<image><image>", images=images)))
    assert e.value.field == "images"
    assert e.value.description == (
        "2 images of 72000000 pixels in all, more than the 64000000 one request may hold; send fewer or smaller images"
    )
    with pytest.raises(ValidationError) as e:  # one image over the cap: refused by its size, before decoding
        request = api.GenerateRequest(prompt="<image>", images=[api.Image(data=png_header(9000, 8000))])
        run(llava, generate_request_from_api(request))
    assert (e.value.field, e.value.description) == (
        "images[0]",
        "is 9000x8000 pixels, more than the 64000000 this server decodes",
    )


@pytest.mark.parametrize(("name", "prompt"), [("llava", "<image> a <image>"), ("qwen", f"{QWEN_IMAGE} a {QWEN_IMAGE}")])
def test_images_are_processed_one_at_a_time(
    name: str, prompt: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    processor: InputProcessor = request.getfixturevalue(name)
    image_processor = processor.mm_processor.processor.image_processor  # type: ignore[union-attr]  # the fixture has a processor
    call = type(image_processor).__call__
    batch_sizes: list[int] = []

    def spy(self: Any, images: Any, **kwargs: Any) -> Any:
        batch_sizes.append(len(images))
        return call(self, images, **kwargs)

    images = [random_image(7), random_image(8, 30, 50)]
    monkeypatch.setattr(type(image_processor), "__call__", spy)
    one_by_one = run(processor, {"prompt": prompt, "multi_modal_data": {"image": images}})
    monkeypatch.undo()
    assert batch_sizes == [1, 1]
    batch = image_processor(images=images, return_tensors="np")  # the items are the batch's slices
    expected = np.asarray(batch["pixel_values"])
    pixel_values = np.concatenate([feature.data["pixel_values"] for feature in one_by_one.mm_features])
    np.testing.assert_array_equal(pixel_values.reshape(expected.shape), expected)


@pytest.mark.parametrize("mode", ["RGB", "1", "P", "I;16"])
def test_image_hash_is_the_digest_of_all_rows(mode: str) -> None:
    # Hashed in bands of HASH_BAND_ROWS rows: the same digest as the whole image's bytes at once.
    image = random_image(9, height=2 * mm_processor.HASH_BAND_ROWS + 5, width=33).convert(mode)
    digest = hashlib.sha256(b"settings")
    digest.update(f"\0{image.mode}\0{image.width}x{image.height}\0".encode())
    if mode == "P":
        digest.update(bytes(image.getpalette() or []))
        digest.update(repr(image.info.get("transparency")).encode())
    digest.update(image.tobytes())
    assert mm_processor.image_hash(image, "settings") == digest.hexdigest()


def test_count_errors(llava_dir: Path, llava: InputProcessor) -> None:
    image = random_image(6)
    with pytest.raises(ValidationError, match="2 images for 1 image placeholders") as e:
        run(llava, {"prompt": "<image>", "multi_modal_data": {"image": [image, image]}})
    assert e.value.field == "multi_modal_data"
    msg = api.GenerateRequest(prompt="no placeholder", images=[api.Image(data=png_bytes(image))])
    with pytest.raises(ValidationError, match="1 images for 0 image placeholders") as e:
        run(llava, generate_request_from_api(msg))
    assert e.value.field == "images"
    limited = make_input_processor(llava_dir, parse_limit_mm_per_prompt("image=1"))
    with pytest.raises(ValidationError, match=r"more than the 1 a prompt may hold \(--limit-mm-per-prompt image=1\)"):
        run(limited, {"prompt": "<image><image>", "multi_modal_data": {"image": [image, image]}})
    with pytest.raises(ValidationError, match="only 'image' inputs"):
        run(llava, {"prompt": "x", "multi_modal_data": {"video": [image]}})


def test_text_only_model_refuses_images(llava: InputProcessor) -> None:
    text_only = InputProcessor(llava.tokenizer, llava.info)  # no processor: config.json's model_type is not one
    with pytest.raises(ValidationError, match="this model takes no images") as e:
        run(text_only, {"prompt": "<image>", "multi_modal_data": {"image": random_image(7)}})
    assert e.value.field == "multi_modal_data"
    assert run(text_only, {"prompt": "plain", "multi_modal_data": {}}).mm_features == []


def test_load_is_none_for_text_only_models(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert load_mm_processor(tmp_path, None) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [("image=4", {"image": 4}), ('{"image": 2}', {"image": 2}), (None, {}), ({"image": 0}, {"image": 0})],
)
def test_limit_mm_per_prompt_forms(value: Any, expected: dict[str, int]) -> None:
    assert parse_limit_mm_per_prompt(value) == expected


@pytest.mark.parametrize("value", ["image", "video=1", "image=-1", "image=x", "{bad"])
def test_limit_mm_per_prompt_refused(value: str) -> None:
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        parse_limit_mm_per_prompt(value)


TORCHLESS_SCRIPT = """
import sys
import threading
import time
from frontend_svc.without_torch import hide_torch
hide_torch()
from collections.abc import Callable
from pathlib import Path
from PIL import Image
from transformers import AutoTokenizer
from frontend_svc.core_client import EngineCoreClient
from frontend_svc.engine_types import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineInfo
from frontend_svc.llm_engine import LLMEngine
from frontend_svc.input_processor import InputProcessor
from frontend_svc.mm_processor import load_mm_processor
info = EngineInfo("m", 4096, 16, 256, 4096, 40000, (), 8, 4096, 20, "float32")
for path, text in [(Path({llava!r}), "<image> a"), (Path({qwen!r}), "<|vision_start|><|image_pad|><|vision_end|> a")]:
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    processor = InputProcessor(tokenizer, info, load_mm_processor(path, tokenizer))
    image = Image.new("RGB", (60, 40))
    prompt = processor.process_multimodal({{"prompt": text, "multi_modal_data": {{"image": image}}}})
    print(len(prompt["prompt_token_ids"]), type(processor.mm_processor.processor.image_processor).__name__)
print("torch imported:", "torch" in sys.modules)
"""


def test_frontend_processes_images_without_torch(llava_dir: Path, qwen_dir: Path) -> None:
    script = TORCHLESS_SCRIPT.format(llava=str(llava_dir), qwen=str(qwen_dir))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[-1] == "torch imported: False"
    assert "CLIPImageProcessorPil" in lines[0] and "Qwen2VLImageProcessorPil" in lines[1]


def test_limit_mm_per_prompt_flag() -> None:
    from splitserve.entrypoints.cli import main

    assert main(["frontend", "--core", "localhost:1", "--limit-mm-per-prompt", "video=1"]) == 2


def test_engine_loads_the_processor_and_every_child_carries_the_images(llava_dir: Path, llava: InputProcessor) -> None:
    client = RecordingClient(engine_info(llava_dir, len(llava.tokenizer)))
    engine = LLMEngine(
        str(llava_dir), tokenizer=llava.tokenizer, engine_core_client=client, limit_mm_per_prompt="image=1"
    )
    prompt = {"prompt": "<image> hi", "multi_modal_data": {"image": random_image(8)}}
    engine.add_request("r", prompt, SamplingParams(n=2, max_tokens=1))
    expected = run(llava, prompt)
    assert [r.prompt_token_ids for r in client.added] == [expected.prompt_token_ids] * 2
    for request in client.added:
        (feature,) = request.mm_features
        assert (feature.identifier, feature.offset, feature.length) == (
            expected.mm_features[0].identifier,
            expected.mm_features[0].offset,
            LLAVA_TOKENS_PER_IMAGE,
        )
    with pytest.raises(ValidationError, match="--limit-mm-per-prompt image=1"):
        engine.add_request(
            "s", {"prompt": "<image><image>", "multi_modal_data": {"image": [random_image(8)] * 2}}, SamplingParams()
        )


def test_the_largest_image_on_the_wire(llava: InputProcessor, qwen: InputProcessor) -> None:
    assert llava.mm_processor is not None and qwen.mm_processor is not None
    assert llava.mm_processor.max_image_bytes == 3 * 56 * 56 * 4  # the crop, float32
    # max_pixels 28 * 28 * 64: 256 patches of 3 x 2 x 14 x 14 float32 (a still image repeated twice in time).
    assert qwen.mm_processor.max_image_bytes == 256 * 1176 * 4
    # 16 MiB holds 13 of them by bytes; 4095 tokens of prompt room hold 63 of 64 tokens each; the limit is 999.
    line = qwen.mm_processor.describe_limits(16 * 2**20, 4096, None)
    assert line.startswith("images: at most 999 per prompt (--limit-mm-per-prompt);")
    by_bytes, by_tokens = 16 * 2**20 // (256 * 1176 * 4), 4095 // 64
    assert line.endswith(
        f": {min(by_bytes, by_tokens)} such images fit in one request (by its bytes {by_bytes}, by the prompt's "
        f"4095 tokens (max_model_len - 1, 64 an image) {by_tokens})"
    )
    # A smaller prompt room is the bound; the core's smaller --limit-mm-per-prompt is named.
    line = qwen.mm_processor.describe_limits(16 * 2**20, 129, 1)
    assert line.startswith("images: at most 1 per prompt (the engine core's --limit-mm-per-prompt);")
    assert ": 1 such images fit in one request (by its bytes 13, by the prompt's 128 tokens" in line
    assert llava.mm_processor.max_image_tokens == LLAVA_TOKENS_PER_IMAGE
    # The image that reaches max_pixels makes that many bytes.
    request = run(qwen, {"prompt": f"{QWEN_IMAGE}", "multi_modal_data": {"image": random_image(9, 224, 224)}})
    assert request.mm_features[0].data["pixel_values"].nbytes == 256 * 1176 * 4


def test_async_llm_processes_images_off_the_event_loop(qwen_dir: Path, qwen: InputProcessor) -> None:
    from frontend_svc.async_llm import AsyncLLM

    images = [random_image(10, 56, 56), random_image(11, 84, 56)]
    prompt = {"prompt": f"{QWEN_IMAGE}{QWEN_IMAGE}?", "multi_modal_data": {"image": images}}

    async def add() -> list[EngineCoreRequest]:
        client = RecordingClient(engine_info(qwen_dir, len(qwen.tokenizer)))
        engine = AsyncLLM(str(qwen_dir), tokenizer=qwen.tokenizer, engine_core_client=client)
        try:
            await engine.add_request("r", prompt, SamplingParams(max_tokens=1))
        finally:
            engine.close()
        return client.added

    (request,) = asyncio.run(add())
    ids, outputs = qwen_oracle(qwen_dir, str(prompt["prompt"]), images)
    assert request.prompt_token_ids == ids
    assert [f.data["image_grid_thw"].tolist() for f in request.mm_features] == outputs["image_grid_thw"].tolist()


def test_qwen2_5_vl_uses_the_qwen2_vl_image_processor(qwen_dir: Path, qwen: InputProcessor, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(qwen_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    qwen2_5 = make_input_processor(tmp_path)
    prompt = {"prompt": f"{QWEN_IMAGE} x", "multi_modal_data": {"image": random_image(12, 70, 90)}}
    expected, actual = run(qwen, prompt), run(qwen2_5, prompt)
    assert actual.prompt_token_ids == expected.prompt_token_ids
    # The model type is one of the settings hashed: the two models never share an encoder-cache entry.
    assert actual.mm_features[0].identifier != expected.mm_features[0].identifier


def test_a_request_over_the_cores_receive_limit_is_refused_before_sending(
    llava_dir: Path, llava: InputProcessor
) -> None:
    import dataclasses

    from frontend_svc.grpc_client import CoreConnection, add_messages

    connection = CoreConnection("localhost:1", lambda outputs: None, lambda: None, lambda *args: None)
    # 100 kB: two 56 px LLaVA images (2 x 37632 bytes of float32 pixels) fit, three do not.
    connection.info = dataclasses.replace(
        engine_info(llava_dir, len(llava.tokenizer)), max_receive_message_bytes=100_000
    )
    for num_images, fits in [(2, True), (3, False)]:
        images = [random_image(20 + i) for i in range(num_images)]
        request = run(llava, {"prompt": "<image>" * num_images, "multi_modal_data": {"image": images}})
        messages = asyncio.run(add_messages([request]))
        if fits:
            connection.send_add([request], messages)
            assert connection._outbox.get_nowait() is messages[0] and request.request_id in connection.in_flight
            connection.in_flight.clear()
            continue
        with pytest.raises(ValidationError, match="more than the 100000 bytes it takes") as e:
            connection.send_add([request], messages)
        assert e.value.field == "request" and "fewer or smaller images" in e.value.description
        assert connection._outbox.empty() and request.request_id not in connection.in_flight


def test_grpc_chat_with_an_image_part(llava_dir: Path, llava: InputProcessor) -> None:
    """A Chat call built from the protos only, through the public servicer: the image part's data: URI reaches the
    core as pixels in the request, the answer comes back."""
    import grpc

    from frontend_svc.async_llm import AsyncLLM
    from frontend_svc.service import FrontendServerState, GenerationServicer

    image = random_image(30)
    part = api.ContentPart(image=api.Image(url=_data_uri(image)))
    chat = api.ChatRequest(
        messages=[api.ChatMessage(role="user", content=[part, api.ContentPart(text="What is it?")])],
        sampling_params=api.SamplingParams(max_tokens=1),
    )

    async def scenario() -> tuple[list[api.GenerateResponse], list[EngineCoreRequest]]:
        client = RecordingClient(engine_info(llava_dir, len(llava.tokenizer)))
        client.finish_with = 5
        engine = AsyncLLM(str(llava_dir), tokenizer=llava.tokenizer, engine_core_client=client)
        server = grpc.aio.server()
        state = FrontendServerState(model="m", tokenizer=llava.tokenizer, engine=engine)
        api_grpc.add_GenerationServicer_to_server(GenerationServicer(state), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                responses = [r async for r in api_grpc.GenerationStub(channel).Chat(chat, timeout=30)]
        finally:
            await server.stop(None)
            engine.close()
        return responses, client.added

    responses, (request,) = asyncio.run(scenario())
    expected = run(
        llava,
        llava.render_chat(
            [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]
        ),
    )
    assert list(responses[0].prompt_token_ids) == request.prompt_token_ids == expected.prompt_token_ids
    assert responses[-1].finished and list(responses[-1].outputs[0].token_ids) == [5]
    assert request.mm_features[0].identifier == expected.mm_features[0].identifier
    np.testing.assert_array_equal(
        request.mm_features[0].data["pixel_values"], expected.mm_features[0].data["pixel_values"]
    )


def test_a_conversation_with_images_gives_every_message_parts(llava: InputProcessor) -> None:
    image = random_image(31)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]},
    ]
    rendered = llava.render_chat(messages, chat_template=LLAVA_HF_TEMPLATE)
    assert rendered["prompt"] == "Be brief. USER: <image>\nWhat? ASSISTANT:"
    assert rendered["multi_modal_data"] == {"image": [image]}


def test_the_core_reads_the_items_as_sent(qwen: InputProcessor) -> None:
    """The contract with the core: its converter (``core_svc.wire``) reads back each item's place and tensors as
    the frontend made them; the hash is the core's own (the frontend's is not trusted), one per distinct item."""
    from core_svc.wire import request_from_pb

    images = [random_image(40, 56, 56), random_image(41, 28, 84)]
    request = run(qwen, {"prompt": f"{QWEN_IMAGE} and {QWEN_IMAGE}", "multi_modal_data": {"image": images}})
    core_request = request_from_pb(request_to_pb(request))
    assert core_request.prompt_token_ids == request.prompt_token_ids
    for sent, received in zip(request.mm_features, core_request.mm_features, strict=True):
        assert (received.modality, received.offset, received.length) == (sent.modality, sent.offset, sent.length)
        for key, array in sent.data.items():
            tensor = received.data[key]
            assert (tensor.dtype, tensor.shape) == (array.dtype.name, array.shape)
            np.testing.assert_array_equal(
                np.frombuffer(tensor.data, array.dtype.newbyteorder("<")).reshape(tensor.shape), array
            )
    assert len({f.identifier for f in core_request.mm_features}) == 2
    again = request_from_pb(request_to_pb(run(qwen, {"prompt": QWEN_IMAGE, "multi_modal_data": {"image": images[1:]}})))
    assert again.mm_features[0].identifier == core_request.mm_features[1].identifier


def test_preprocess_memory_is_estimated_from_the_headers(
    llava_dir: Path, llava: InputProcessor, qwen_dir: Path, qwen: InputProcessor
) -> None:
    """The budget's estimate of an image request: the largest image's preprocessing peak plus every item's tensors,
    which equal the model's own processor's. The peak (measured, docs/operations.md "Memory"): LLaVA 15 bytes a
    decoded pixel; Qwen2-VL the larger of that and 4 bytes a decoded pixel plus 40 a resized one."""
    from transformers import AutoProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = [random_image(50, 90, 30), random_image(51, 61, 117)]
    encoded = [EncodedImage(png_bytes(image), "image/png", f"images[{i}]") for i, image in enumerate(images)]
    llava_oracle = AutoProcessor.from_pretrained(str(llava_dir))
    llava_kept = sum(
        llava_oracle(text="<image>", images=[image], return_tensors="np")["pixel_values"].astype(np.float32).nbytes
        for image in images
    )
    llava_peak = max(15 * image.width * image.height for image in images)
    qwen_oracle = Qwen2VLImageProcessorPil.from_pretrained(str(qwen_dir))
    qwen_outputs = [qwen_oracle(images=[image], return_tensors="np") for image in images]
    qwen_kept = sum(o["pixel_values"].astype(np.float32).nbytes + 3 * 8 for o in qwen_outputs)
    # A still image's grid is [1, h / 14, w / 14]: its resized pixels are the grid's patches of 14 x 14.
    resized = [int(np.prod(o["image_grid_thw"])) * 14 * 14 for o in qwen_outputs]
    qwen_peak = max(
        max(15 * image.width * image.height, 4 * image.width * image.height + 40 * pixels)
        for image, pixels in zip(images, resized, strict=True)
    )
    assert 4 * 117 * 61 + 40 * resized[1] > 15 * 117 * 61  # for these small images the float phase is the peak
    assert llava.mm_processor is not None and qwen.mm_processor is not None
    assert llava.mm_processor.preprocess_memory_bytes(encoded, "images") == llava_peak + llava_kept
    assert qwen.mm_processor.preprocess_memory_bytes(encoded, "images") == qwen_peak + qwen_kept
    # A size the processor refuses is named before anything waits or decodes.
    with pytest.raises(ValidationError, match="aspect ratio must be smaller than 200") as e:
        qwen.mm_processor.preprocess_memory_bytes([random_image(52, 1, 300)], "images")
    assert e.value.field == "images[0]"


def _blocking_process(processor: InputProcessor) -> tuple[list[int], threading.Event, list[threading.Event]]:
    """Make ``processor``'s image processing wait for ``release`` (set by the test); returns the budget bytes in
    use as each call started, ``release``, and an event set as each of the first two calls starts."""
    assert processor.mm_processor is not None
    mm = processor.mm_processor
    original = mm.process
    in_use_at_start: list[int] = []
    release = threading.Event()
    started = [threading.Event(), threading.Event()]

    def process(prompt_token_ids: list[int], images: Any, field: str) -> Any:
        in_use_at_start.append(processor.budget.in_use_bytes)  # read on the worker thread: a snapshot
        started[len(in_use_at_start) - 1].set()
        release.wait(30)
        return original(prompt_token_ids, images, field)

    mm.process = process  # type: ignore[method-assign]  # instrumented for this test's processor only
    return in_use_at_start, release, started


def _image_charge(text: str, image: Image.Image, qwen_dir: Path) -> int:
    """What an image prompt is charged, computed apart: its text's bytes, and its images' memory at 128 bytes a
    budget byte (rounded up): Qwen2-VL's preprocessing peak (the larger of 15 bytes a decoded pixel and 4 a decoded
    pixel plus 40 a resized one) plus the processor's tensors."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    outputs = Qwen2VLImageProcessorPil.from_pretrained(str(qwen_dir))(images=[image], return_tensors="np")
    decoded, resized = image.width * image.height, int(np.prod(outputs["image_grid_thw"])) * 14 * 14
    peak = max(15 * decoded, 4 * decoded + 40 * resized)
    memory = peak + outputs["pixel_values"].astype(np.float32).nbytes + 3 * 8
    return len(text.encode()) - (-memory // 128)


async def _until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait on the event loop until ``condition()`` holds (a worker thread's work, seen from the loop)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the condition did not come true")
        await asyncio.sleep(0.001)


def test_a_second_image_request_waits_for_the_budget(qwen_dir: Path) -> None:
    from frontend_svc.tokenize_budget import TokenizeBudget

    processor = make_input_processor(qwen_dir)
    text = f"{QWEN_IMAGE} x"
    image = random_image(60, 120, 150)
    charge = _image_charge(text, image, qwen_dir)
    processor.budget = TokenizeBudget(budget_bytes=charge + charge // 2)  # one such request at a time
    in_use_at_start, release, started = _blocking_process(processor)
    prompt: Any = {"prompt": text, "multi_modal_data": {"image": image}}

    async def scenario() -> list[Any]:
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(processor.process_multimodal_async(prompt))
        assert await loop.run_in_executor(None, started[0].wait, 30)
        second = asyncio.ensure_future(processor.process_multimodal_async(prompt))
        await _until(lambda: processor.budget.num_waiting == 1)  # its estimate (a thread) done, it is in line
        assert processor.budget.num_waiting == 1 and processor.budget.in_use_bytes == charge
        assert not started[1].is_set()
        release.set()
        results = [await first, await second]
        assert processor.budget.in_use_bytes == 0 and processor.budget.num_waiting == 0
        return results

    first, second = asyncio.run(scenario())
    assert in_use_at_start == [charge, charge]  # the second started alone, once the first gave its bytes back
    assert first["prompt_token_ids"] == second["prompt_token_ids"]
    assert [f.identifier for f in first["mm_features"]] == [f.identifier for f in second["mm_features"]]


def test_an_image_request_cancelled_while_waiting_leaves_the_line(qwen_dir: Path) -> None:
    from frontend_svc.tokenize_budget import TokenizeBudget

    processor = make_input_processor(qwen_dir)
    text = f"{QWEN_IMAGE} x"
    image = random_image(61, 120, 150)
    charge = _image_charge(text, image, qwen_dir)
    processor.budget = TokenizeBudget(budget_bytes=charge + charge // 2)
    in_use_at_start, release, started = _blocking_process(processor)
    prompt: Any = {"prompt": text, "multi_modal_data": {"image": image}}

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(processor.process_multimodal_async(prompt))
        assert await loop.run_in_executor(None, started[0].wait, 30)
        waiting = asyncio.ensure_future(processor.process_multimodal_async(prompt))
        await _until(lambda: processor.budget.num_waiting == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # Out of the line, holding nothing: only the running request's bytes are in use.
        assert processor.budget.num_waiting == 0 and processor.budget.in_use_bytes == charge
        release.set()
        await first
        assert processor.budget.in_use_bytes == 0
        # The bytes are all there for the next one, which starts at once.
        await processor.process_multimodal_async(prompt)
        assert processor.budget.in_use_bytes == 0

    asyncio.run(scenario())
    assert in_use_at_start == [charge, charge]


def _qwen_images_bad_last() -> list[Any]:
    """Three good PNGs and, last, one whose aspect ratio (300:1) Qwen2-VL's smart_resize refuses: a request that
    must be refused whole, before the good ones are decoded."""
    good = [api.Image(data=png_bytes(random_image(70 + i, 60, 80)), mime_type="image/png") for i in range(3)]
    return [*good, api.Image(data=png_bytes(random_image(74, 1, 300)), mime_type="image/png")]


def _spy_decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fields of the images decoded (``mm_processor.load_image``) from here on."""
    decoded: list[str] = []
    load = mm_processor.load_image

    def spy(image: Image.Image, field: str) -> Image.Image:
        decoded.append(field)
        return load(image, field)

    monkeypatch.setattr(mm_processor, "load_image", spy)
    return decoded


def test_a_bad_last_image_refuses_the_request_before_anything_is_decoded(
    qwen: InputProcessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded = _spy_decodes(monkeypatch)
    request = generate_request_from_api(api.GenerateRequest(prompt=QWEN_IMAGE * 4, images=_qwen_images_bad_last()))
    # The budget's estimate refuses it (never a charge of 0), before the budget is taken.
    with pytest.raises(ValidationError, match="aspect ratio must be smaller than 200") as e:
        asyncio.run(qwen.process_multimodal_async(request))
    assert (e.value.field, e.value.status_code) == ("images[3]", StatusCode.INVALID_ARGUMENT)
    assert decoded == [] and qwen.budget.in_use_bytes == 0
    # Called directly, the processor checks every header before the first decode too.
    with pytest.raises(ValidationError, match="aspect ratio must be smaller than 200") as e:
        qwen.process_multimodal(request)
    assert e.value.field == "images[3]"
    assert decoded == []
    # Without the bad image the same request decodes every image, once.
    request["multi_modal_data"]["image"] = request["multi_modal_data"]["image"][:3]
    request["prompt"] = QWEN_IMAGE * 3
    asyncio.run(qwen.process_multimodal_async(request))
    assert decoded == ["images[0]", "images[1]", "images[2]"]


def test_the_estimate_reads_the_headers_off_the_event_loop(qwen: InputProcessor) -> None:
    threads: list[str] = []
    estimate = qwen.preprocess_memory_bytes

    def spy(prompt: Any) -> int:
        threads.append(threading.current_thread().name)
        return estimate(prompt)

    prompt = {"prompt": QWEN_IMAGE, "multi_modal_data": {"image": random_image(75)}}

    async def scenario() -> Any:
        loop_thread = threading.current_thread().name
        qwen.preprocess_memory_bytes = spy  # type: ignore[method-assign]  # this test's processor only
        try:
            return loop_thread, await qwen.process_multimodal_async(prompt)
        finally:
            del qwen.preprocess_memory_bytes

    loop_thread, result = asyncio.run(scenario())
    assert len(threads) == 1 and threads[0] != loop_thread
    assert len(result["mm_features"]) == 1


def test_the_smaller_of_the_frontends_and_the_cores_image_limits_is_refused(
    qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    from core_svc.engine_core import EngineInfo as CoreEngineInfo
    from core_svc.wire import engine_info_to_pb
    from frontend_svc.wire import engine_info_from_pb

    # The wire carries the core's limit; a core that does not tell it (unset field) is None, not 0 ("no images").
    core_info = CoreEngineInfo("m", 4096, 16, 256, 4080, "float32", 100, [2], 8, 4096, 20, False, 0)
    assert engine_info_from_pb(engine_info_to_pb(core_info)).image_limit_per_prompt == 0
    assert engine_info_from_pb(core_pb.EngineInfo(model="m")).image_limit_per_prompt is None
    decoded = _spy_decodes(monkeypatch)
    processor = make_input_processor(qwen_dir, {"image": 3})
    two = {"prompt": QWEN_IMAGE * 2, "multi_modal_data": {"image": [random_image(80), random_image(81)]}}
    four = {"prompt": QWEN_IMAGE * 4, "multi_modal_data": {"image": [random_image(80)] * 4}}
    processor.info = dataclasses.replace(processor.info, image_limit_per_prompt=1)
    for prompt in (two, four):
        with pytest.raises(ValidationError) as e:
            asyncio.run(processor.process_multimodal_async(prompt))
        assert e.value.field == "multi_modal_data"
        assert e.value.description == (
            f"has {len(prompt['multi_modal_data']['image'])} images, more than the 1 a prompt may hold on the "
            "engine core (the core's --limit-mm-per-prompt image=1)"
        )
    # The frontend's own limit, when it is the smaller, names its own flag.
    processor.info = dataclasses.replace(processor.info, image_limit_per_prompt=999)
    with pytest.raises(ValidationError, match=r"more than the 3 a prompt may hold \(--limit-mm-per-prompt image=3\)"):
        processor.process_multimodal(four)
    assert decoded == []
    assert len(processor.process_multimodal(two)["mm_features"]) == 2
