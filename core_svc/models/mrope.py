"""Multimodal rotary position embedding (M-RoPE, Qwen2-VL paper section 2.1): three position streams (temporal,
height, width) rotate disjoint sections of each head's frequencies.

Text tokens carry the same position in all three streams; an image's placeholder tokens carry their (t, h, w)
place in the merged patch grid, offset by the position where the image starts. The positions of a prompt are a
pure function of its token count and its images' (offset, grid_thw); ``mrope_position_delta`` then gives every
later token's position: ``p + delta`` in all three streams for the token at index ``p``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core_svc.models.layers import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE whose frequency ``j`` takes its angle from stream ``s(j)``: ``mrope_section`` ``[n_t, n_h, n_w]``
    (summing to ``head_size // 2``) gives the first ``n_t`` frequencies to the temporal stream, the next ``n_h``
    to height, the last ``n_w`` to width, for both halves of the head, as transformers'
    ``Qwen2VLRotaryEmbedding.recomposition_frequencies`` (and vLLM's ``MRotaryEmbedding``).

    Raises:
        ValueError: ``mrope_section`` is not three sizes summing to ``len(inv_freq)``.
    """

    def __init__(
        self,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        max_position: int,
        dtype: torch.dtype,
        mrope_section: Sequence[int],
    ) -> None:
        if len(mrope_section) != 3 or sum(mrope_section) != len(inv_freq):
            raise ValueError(
                f"mrope_section {list(mrope_section)} must be 3 sizes summing to head_size // 2 = {len(inv_freq)}"
            )
        super().__init__(inv_freq, attention_scaling, max_position, dtype)
        # On the CPU explicitly: the loader builds models under torch.device("meta").
        stream = torch.repeat_interleave(torch.arange(3, device="cpu"), torch.tensor(list(mrope_section), device="cpu"))
        self.stream_of_dim = torch.cat((stream, stream))  # [head_size] int64: the stream each dimension follows

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` as ``RotaryEmbedding.tables`` for ``positions`` ``[3, num_tokens]`` int64 (temporal,
        height, width), or ``[num_tokens]`` (text only: the same position in all three streams)."""
        if positions.dim() == 1:
            return super().tables(positions)
        num_tokens, head_size = positions.shape[1], self.cos.shape[-1]
        index = self.stream_of_dim.to(positions.device).view(1, 1, head_size).expand(1, num_tokens, head_size)
        cos = self.cos[positions].gather(0, index)[0]  # [num_tokens, head_size]
        sin = self.sin[positions].gather(0, index)[0].clone()
        sin[:, : head_size // 2].neg_()
        return cos.unsqueeze(1), sin.unsqueeze(1)


def get_mrope_input_positions(
    prompt_len: int, image_items: Sequence[tuple[int, Sequence[int]]], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions of a prompt and its ``mrope_position_delta``, as transformers'
    ``Qwen2VLModel.get_rope_index`` and vLLM's ``MRotaryEmbedding.get_input_positions`` compute them.

    Text runs count on from the current position in all three streams. An image whose placeholders start at
    prompt index ``offset``, with patch grid ``(t, h, w)`` (``image_grid_thw``), covers
    ``t * h * w // merge**2`` tokens that get ``(start + i_t, start + i_h, start + i_w)`` over its merged grid
    ``(t, h // merge, w // merge)`` in row-major order; the text after it starts at
    ``start + max(t, h // merge, w // merge)`` (vLLM's ``max + 1``; transformers' ``max(h, w) // merge``, the
    same for images, whose ``t`` is 1).

    Args:
        prompt_len: tokens in the prompt.
        image_items: ``(offset, (t, h, w))`` per image, in any order; their placeholder ranges may not overlap.

    Returns:
        positions ``[3, prompt_len]`` int64 and ``delta = max(positions) + 1 - prompt_len`` (an int, <= 0).

    Raises:
        ValueError: an image's range falls outside the prompt or overlaps another, or a grid side is not a
            multiple of ``spatial_merge_size``.
    """
    chunks: list[torch.Tensor] = []
    index, current = 0, 0  # next prompt index, next position
    for offset, (t, h, w) in sorted(image_items, key=lambda item: item[0]):
        if h % spatial_merge_size or w % spatial_merge_size:
            raise ValueError(f"image grid {(t, h, w)} is not a multiple of spatial_merge_size {spatial_merge_size}")
        grid_t, grid_h, grid_w = t, h // spatial_merge_size, w // spatial_merge_size
        length = grid_t * grid_h * grid_w
        if offset < index or offset + length > prompt_len:
            raise ValueError(
                f"image placeholders [{offset}, {offset + length}) overlap another image or pass the prompt's "
                f"{prompt_len} tokens"
            )
        chunks.append(torch.arange(offset - index).expand(3, -1) + current)
        current += offset - index
        grid = torch.meshgrid(torch.arange(grid_t), torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
        chunks.append(torch.stack(grid).reshape(3, -1) + current)
        current += max(grid_t, grid_h, grid_w)
        index = offset + length
    chunks.append(torch.arange(prompt_len - index).expand(3, -1) + current)
    positions = torch.cat(chunks, dim=1)
    delta = (int(positions.max()) + 1 - prompt_len) if prompt_len else 0
    return positions, delta


def mrope_decode_positions(delta: int, start: int, end: int) -> torch.Tensor:
    """Positions ``[3, end - start]`` int64 of the tokens at sequence indices ``start..end-1`` past the prompt:
    ``index + delta`` in all three streams (vLLM's ``MRotaryEmbedding.get_next_input_positions``)."""
    return torch.arange(start + delta, end + delta).expand(3, -1).clone()


def mrope_positions(prompt_positions: torch.Tensor, delta: int, start: int, end: int) -> torch.Tensor:
    """Positions ``[3, end - start]`` int64 of a request's tokens ``start..end-1`` (a prefill chunk, a decode, or a
    recompute after preemption that spans prompt and outputs): the prompt's own ``prompt_positions``
    ``[3, prompt_len]`` where they reach, ``index + delta`` beyond (vLLM keeps the same per-request
    ``mrope_positions`` and ``mrope_position_delta``)."""
    prompt_len = prompt_positions.shape[1]
    head = prompt_positions[:, start:end]
    if end <= prompt_len:
        return head
    return torch.cat((head, mrope_decode_positions(delta, max(start, prompt_len), end)), dim=1)
