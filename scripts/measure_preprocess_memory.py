"""The peak memory of preprocessing one photo in the frontend, measured in a fresh process per case (so
``ru_maxrss`` is this case's high-water mark): the JPEG decoded by PIL and run through the model's Pil image
processor, as ``frontend_svc/mm_processor.py`` does. The numbers justify ``PREPROCESS_BYTES_PER_DECODED_PIXEL`` and
``PREPROCESS_BYTES_PER_RESIZED_PIXEL`` there (docs/operations.md, "Memory").

Usage: python scripts/measure_preprocess_memory.py [WIDTH HEIGHT]   (default 4032 3024, a 12-megapixel photo)
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np

CASE = r"""
import io, resource, sys
import numpy as np
from PIL import Image
kind, width, height = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if kind.startswith("qwen2_vl"):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    # Qwen2-VL-2B's preprocessor_config.json max_pixels, or transformers' default (28 * 28 * 1280).
    max_pixels = 28 * 28 * 16384 if kind == "qwen2_vl" else 28 * 28 * 1280
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels)
else:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    processor = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
data = sys.stdin.buffer.read()
warm = Image.fromarray(np.zeros((64, 64, 3), np.uint8))
processor(images=[warm], return_tensors="np")  # imports and first-call allocations out of the measurement
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
image = Image.open(io.BytesIO(data))
image.load()
outputs = processor(images=[image], return_tensors="np")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kept = sum(np.asarray(v).nbytes for v in outputs.values())
resized = int(outputs["image_grid_thw"].prod()) * 14 * 14 if "image_grid_thw" in outputs else 336 * 336
print((after - before) * 1024, kept, resized)
"""


def main() -> None:
    width, height = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) == 3 else (4032, 3024)
    pixels = np.random.RandomState(0).randint(0, 256, (height, width, 3), dtype=np.uint8)
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    del pixels
    results = {}
    for kind in ("qwen2_vl", "qwen2_vl_default_max_pixels", "llava"):
        run = subprocess.run(
            [sys.executable, "-c", CASE, kind, str(width), str(height)],
            input=buffer.getvalue(),
            capture_output=True,
            check=True,
        )
        peak_bytes, kept_bytes, resized_pixels = map(int, run.stdout.split())
        results[kind] = {
            "peak_mib": round(peak_bytes / 2**20, 1),
            "kept_mib": round(kept_bytes / 2**20, 1),
            "resized_pixels": resized_pixels,
            "peak_bytes_per_decoded_pixel": round(peak_bytes / (width * height), 2),
        }
    print(
        json.dumps(
            {"width": width, "height": height, **results},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
