"""Qwen2-VL multimodal rotary (M-RoPE) position ids for one sequence.

Text tokens get the same position on all three rows (temporal, height, width), counting up by
one. A run of image tokens for an image whose patch grid is (t, h, w) gets 3-D positions
`start + (t_idx, h_idx, w_idx)` over the merged grid (h/merge, w/merge); the text after it
continues at `start + max(h, w)/merge`. The response continues from there like text, so
positions of prompt + response computed in one call equal transformers' `get_rope_index`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def vision_positions(start: int, grid_thw: Sequence[int], merge: int) -> torch.Tensor:
    """(3, t*h*w/merge^2) positions of one image's tokens, offset by `start`."""
    t, h, w = (int(x) for x in grid_thw)
    gh, gw = h // merge, w // merge
    tt = torch.arange(t).view(t, 1, 1).expand(t, gh, gw)
    hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
    ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def image_token_count(grid_thw: Sequence[int], merge: int) -> int:
    """Number of LLM tokens one image with this patch grid occupies."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // (merge * merge)


def mrope_position_ids(
    input_ids: Sequence[int] | torch.Tensor,
    image_grid_thw: Sequence[Sequence[int]] | torch.Tensor,
    image_token_id: int,
    merge: int = 2,
) -> tuple[torch.Tensor, int]:
    """(3, L) position ids of one processor-expanded sequence, and the next position after it.

    `image_grid_thw` lists the images in order of appearance; each image's tokens must be one
    contiguous run of `image_token_id` of length t*h*w/merge^2.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    grids = [
        tuple(int(x) for x in g)
        for g in (image_grid_thw.tolist() if torch.is_tensor(image_grid_thw) else image_grid_thw)
    ]
    image_idx = (ids == image_token_id).nonzero().flatten().tolist()
    pieces: list[torch.Tensor] = []
    pos, cursor, k = 0, 0, 0  # next position, next token index, index into image_idx
    for grid in grids:
        if k >= len(image_idx):
            raise ValueError(f"{len(grids)} image grids but only {k} images' worth of image tokens")
        first, n = image_idx[k], image_token_count(grid, merge)
        if k + n > len(image_idx) or image_idx[k + n - 1] != first + n - 1:
            raise ValueError(f"image at token {first} needs {n} contiguous image tokens for grid {grid}")
        text_len = first - cursor
        pieces.append(torch.arange(pos, pos + text_len).expand(3, -1))
        pos += text_len
        pieces.append(vision_positions(pos, grid, merge))
        pos += max(grid[1], grid[2]) // merge
        cursor, k = first + n, k + n
    if k != len(image_idx):
        raise ValueError(f"{len(image_idx) - k} image tokens are not covered by the image grids")
    tail = len(ids) - cursor
    pieces.append(torch.arange(pos, pos + tail).expand(3, -1))
    return torch.cat(pieces, dim=1), pos + tail
