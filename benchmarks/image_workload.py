"""The image workload of ``splitserve bench serve --images-per-request N``: seeded PNG images of a few sizes,
prompts in LLaVA-1.5's conversation format around the text workload's random token ids, and the frontend's
preprocessing rate (decode + hash + the model's image processor, ``MultiModalProcessor.process``) on one thread,
with no core."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from benchmarks.workload import RequestSet, make_request_set

# (width, height) in pixels: a thumbnail, VGA and XGA photos, in this order over the requests' images.
DEFAULT_IMAGE_SIZES = ((320, 240), (640, 480), (1024, 768))
MIME_TYPE = "image/png"


def parse_image_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``"320x240,640x480"`` -> ((320, 240), (640, 480)).

    Raises:
        ValueError: an entry that is not WIDTHxHEIGHT with positive integers, or none at all.
    """
    sizes = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        width, sep, height = entry.lower().partition("x")
        if not sep or not width.isdigit() or not height.isdigit() or int(width) < 1 or int(height) < 1:
            raise ValueError(f"image size {entry!r} is not WIDTHxHEIGHT (640x480)")
        sizes.append((int(width), int(height)))
    if not sizes:
        raise ValueError(f"no image sizes in {text!r}")
    return tuple(sizes)


def make_image(width: int, height: int, rng: np.random.Generator) -> bytes:
    """A PNG of ``width`` x ``height`` RGB pixels: a smooth colour gradient plus noise (``rng``), so the file
    compresses about as a photo does in PNG (a few bytes per pixel), not as a flat colour."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    noise = rng.integers(-24, 25, size=(height, width, 3))
    pixels = np.clip(base + noise, 0, 255).astype(np.uint8)  # [height, width, 3]
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def make_images(num_images: int, sizes: tuple[tuple[int, int], ...], seed: int | list[int] = 0) -> list[bytes]:
    """``num_images`` distinct PNGs (no two hash alike, so the core's encoder cache never hits), sizes cycling
    through ``sizes``, all from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    return [make_image(*sizes[i % len(sizes)], rng) for i in range(num_images)]


def make_image_request_set(
    num_requests: int,
    output_len: int,
    tokenizer: Any,
    images_per_request: int,
    sizes: tuple[tuple[int, int], ...],
    seed: int = 0,
) -> RequestSet:
    """The text workload's prompts (``make_request_set``, same seed) as LLaVA-1.5 conversations:
    ``USER: <image>\\n`` once per image, the random token ids, `` ASSISTANT:``; each request with its own
    ``images_per_request`` images (``make_images``).

    Raises:
        ValueError: the tokenizer does not have LLaVA's ``<image>`` token.
    """
    text = make_request_set(num_requests, output_len, tokenizer, seed)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    if not isinstance(image_token_id, int) or image_token_id == tokenizer.unk_token_id:
        raise ValueError("the image workload needs a LLaVA checkpoint (its tokenizer has no '<image>' token)")
    head = tokenizer("USER: " + "<image>\n" * images_per_request).input_ids  # with BOS
    tail = tokenizer(" ASSISTANT:", add_special_tokens=False).input_ids
    images = make_images(num_requests * images_per_request, sizes, seed)
    return RequestSet(
        prompts=[head + prompt + tail for prompt in text.prompts],
        output_len=output_len,
        seed=seed,
        images=[images[i * images_per_request : (i + 1) * images_per_request] for i in range(num_requests)],
        image_sizes=[list(size) for size in sizes],
    )


def with_fresh_images(requests: RequestSet, run_index: int) -> RequestSet:
    """The same prompts with new images of the same sizes (seed ``[requests.seed, run_index]``), so a later run
    finds none of its images in the core's encoder cache (nor its prompts in the prefix cache, whose block
    hashes carry the images' hashes)."""
    per_request = len(requests.images[0])
    sizes = tuple((int(w), int(h)) for w, h in requests.image_sizes)
    images = make_images(len(requests.prompts) * per_request, sizes, [requests.seed, run_index])
    return RequestSet(
        prompts=requests.prompts,
        output_len=requests.output_len,
        seed=requests.seed,
        images=[images[i * per_request : (i + 1) * per_request] for i in range(len(requests.prompts))],
        image_sizes=requests.image_sizes,
    )


def preprocess_rate(model: Path, sizes: tuple[tuple[int, int], ...], num_images: int, seed: int = 0) -> dict[str, Any]:
    """The frontend's image preprocessing on this thread alone: ``MultiModalProcessor.process`` (decode the PNG,
    hash its pixels, run the model's image processor on numpy, expand the placeholder) for ``num_images`` distinct
    images of each size in turn, after one warm-up image per size.

    Returns:
        ``images_per_s`` over all sizes and per size ("WxH" -> images/s), from wall time; ``cpu_s_per_image``
        from this thread's CPU time (``time.thread_time``), whose ratio to wall time shows one core at work.
    """
    from transformers import AutoTokenizer

    from frontend_svc.mm_processor import EncodedImage, load_mm_processor

    tokenizer = AutoTokenizer.from_pretrained(model)
    processor = load_mm_processor(model, tokenizer)
    if processor is None:
        raise ValueError(f"{model} is not a model the frontend takes images for")
    prompt = [processor.image_token_id]
    per_size: dict[str, float] = {}
    total_wall = total_cpu = 0.0
    for width, height in sizes:
        images = [EncodedImage(data, MIME_TYPE) for data in make_images(num_images + 1, ((width, height),), seed)]
        processor.process(prompt, images[:1], "images")  # warm-up: lazy imports, first allocations
        cpu_start, start = time.thread_time(), time.perf_counter()
        for image in images[1:]:
            processor.process(prompt, [image], "images")
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
        per_size[f"{width}x{height}"] = num_images / wall
        total_wall += wall
        total_cpu += cpu
    return {
        "processor": type(processor.processor.image_processor).__name__,
        "num_images_per_size": num_images,
        "images_per_s": num_images * len(sizes) / total_wall,
        "images_per_s_by_size": per_size,
        "cpu_s_per_image": total_cpu / (num_images * len(sizes)),
        "cpu_over_wall": total_cpu / total_wall,
    }
