"""Chapter 43: images in the prompt.

A vision-language model of the Qwen-VL kind reads an image in three moves:

1. A vision encoder cuts the image into patches, runs a small transformer over them and
   merges each 2 x 2 square of neighbouring patches into ONE vector of the language model's
   width: an h x w grid of merged patches becomes h * w "image tokens".
2. The prompt holds h * w placeholder ids where the image goes. Their embeddings are
   replaced by the encoder's vectors; the language model never sees the placeholder ids.
3. Positions get three axes (M-RoPE): temporal, height, width. A text token at position p
   is (p, p, p); image token (row, col) of an image starting at p is (p, p + row, p + col);
   the text after the image continues from the largest position used + 1. RoPE's frequency
   pairs are shared out between the three axes (Qwen3-VL interleaves them: T H W T H W ...).

The encoder runs once per request when it is added (its output rows are kept in
request.extra, so a preempted request recomputes from the same rows); the block hash of
every block of that request includes a hash of the image's pixels.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..layers import rope_cos_sin

if TYPE_CHECKING:
    from .flat_model import FlatModel, RopeTables


@dataclass
class VisionConfig:
    """The tiny encoder's shape. out_hidden_size is the language model's hidden size."""
    out_hidden_size: int
    channels: int = 3
    patch_size: int = 4
    merge_size: int = 2                  # merge_size x merge_size patches -> one image token
    hidden_size: int = 32
    num_heads: int = 2
    num_layers: int = 2
    max_grid: int = 16                   # largest number of patches along a side


class VisionEncoder(nn.Module):
    """pixels [C, H, W] -> image tokens [(H / (p * m)) * (W / (p * m)), out_hidden_size],
    in row-major order of the merged grid (p = patch_size, m = merge_size)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.channels * cfg.patch_size ** 2, cfg.hidden_size)
        self.row_embed = nn.Embedding(cfg.max_grid, cfg.hidden_size)     # where a patch sits
        self.col_embed = nn.Embedding(cfg.max_grid, cfg.hidden_size)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(cfg.hidden_size, cfg.num_heads, 4 * cfg.hidden_size, dropout=0.0,
                                       batch_first=True, norm_first=True) for _ in range(cfg.num_layers))
        self.merge_norm = nn.LayerNorm(cfg.hidden_size * cfg.merge_size ** 2)
        self.project = nn.Linear(cfg.hidden_size * cfg.merge_size ** 2, cfg.out_hidden_size)

    def grid(self, pixels: torch.Tensor) -> tuple[int, int]:
        """(rows, cols) of image tokens for an image, or ValueError naming the rule it breaks."""
        cfg = self.cfg
        side = cfg.patch_size * cfg.merge_size
        if pixels.ndim != 3 or pixels.shape[0] != cfg.channels or not pixels.is_floating_point():
            raise ValueError(f"an image is a float tensor [{cfg.channels}, H, W], got {tuple(pixels.shape)} "
                             f"{pixels.dtype}")
        height, width = pixels.shape[1:]
        if height % side or width % side or not height or not width:
            raise ValueError(f"image sides must be positive multiples of {side} pixels, got {height} x {width}")
        if max(height, width) // cfg.patch_size > cfg.max_grid:
            raise ValueError(f"image of {height} x {width} pixels exceeds {cfg.max_grid} patches per side")
        return height // side, width // side

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        cfg, (rows, cols) = self.cfg, self.grid(pixels)
        p, m = cfg.patch_size, cfg.merge_size
        weight = self.patch_embed.weight
        # [C, H, W] -> patches [rows*m, cols*m, C*p*p]
        patches = pixels.to(weight).unfold(1, p, p).unfold(2, p, p).permute(1, 2, 0, 3, 4).flatten(2)
        x = self.patch_embed(patches)
        x = x + self.row_embed.weight[:rows * m, None] + self.col_embed.weight[None, :cols * m]
        x = x.reshape(1, rows * m * cols * m, -1)
        for block in self.blocks:
            x = block(x)
        # Gather each m x m square of neighbouring patches into one vector, then project.
        x = x.reshape(rows, m, cols, m, -1).permute(0, 2, 1, 3, 4).reshape(rows * cols, -1)
        return self.project(self.merge_norm(x))


# --- M-RoPE ------------------------------------------------------------------------------------

def mrope_positions(prompt: list[int], image_token_id: int, grids: list[tuple[int, int]]
                    ) -> tuple[torch.Tensor, int]:
    """Three-axis positions of a prompt with images.  (Your engine: Chapter 43)

    prompt: token ids, where image k is a contiguous run of grids[k][0] * grids[k][1]
    image_token_id placeholders, images in prompt order, two runs always apart (real
    prompts wrap each image in vision-start / vision-end tokens); the runs are checked.
    Returns (table [3, len(prompt)] int64, delta: int):
    - a text token at position p of the running counter gets (p, p, p); the counter moves by 1;
    - image k, starting when the counter is s, gives its token (row, col), in row-major
      order, the positions (s, s + row, s + col); afterwards the counter is
      s + max(rows, cols): the largest position used + 1;
    - delta = table.max() + 1 - len(prompt): a token generated at sequence position q
      (q >= len(prompt)) has position q + delta on all three axes.
    A prompt without images gives table rows equal to arange(len(prompt)) and delta 0.
    """
    table = torch.empty(3, len(prompt), dtype=torch.int64)
    counter, index, images = 0, 0, iter(grids)
    while index < len(prompt):
        if prompt[index] != image_token_id:
            table[:, index] = counter
            counter, index = counter + 1, index + 1
            continue
        rows, cols = next(images)
        row = torch.arange(rows).repeat_interleave(cols)
        col = torch.arange(cols).repeat(rows)
        span = slice(index, index + rows * cols)
        table[0, span] = counter
        table[1, span] = counter + row
        table[2, span] = counter + col
        counter, index = counter + max(rows, cols), index + rows * cols
    delta = int(table.max()) + 1 - len(prompt) if len(prompt) else 0
    return table, delta


def mrope_axis_of_frequency(half_dim: int, sections: tuple[int, int, int]) -> torch.Tensor:
    """[half_dim] int64: which axis (0 T, 1 H, 2 W) rotates each frequency pair. Qwen3-VL
    interleaves them, T H W T H W ..., H and W stopping after sections[1] and sections[2]
    pairs; every other pair is temporal. Interleaving gives each axis high AND low
    frequencies, where consecutive blocks (Qwen2-VL) gave width only the slowest ones."""
    index = torch.arange(half_dim)
    axis = torch.zeros(half_dim, dtype=torch.int64)
    for which in (1, 2):
        axis[(index % 3 == which) & (index < 3 * sections[which])] = which
    return axis


def mrope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, sections: tuple[int, int, int],
                  dtype: torch.dtype) -> RopeTables:
    """positions [3, N] -> (cos, sin) [N, 1, head_dim]: each frequency pair rotated by the
    position of its axis. With the three axes equal this is ordinary RoPE."""
    cos, sin = rope_cos_sin(positions, head_dim, theta, torch.float32)      # [3, 1, N, head_dim]
    axis = mrope_axis_of_frequency(head_dim // 2, sections).to(positions.device).repeat(2)
    pick = axis.view(1, 1, 1, -1).expand(1, 1, positions.shape[1], -1)
    cos, sin = cos.gather(0, pick)[0, 0], sin.gather(0, pick)[0, 0]
    return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


# --- wiring into the engine ---------------------------------------------------------------------

@dataclass
class VisionInputs:
    """What attach_vision leaves on a FlatModel (as `flat.vision`) for add_request."""
    encoder: VisionEncoder
    image_token_id: int
    sections: tuple[int, ...]


def attach_vision(flat: FlatModel, encoder: VisionEncoder, image_token_id: int,
                  sections: tuple[int, int, int]) -> None:
    """Make `flat` a vision-language model: add_request then accepts images, and the RoPE
    seam takes [3, N] positions (M-RoPE) as well as [N]."""
    if sum(sections) != flat.cfg.head_dim // 2:
        raise ValueError(f"M-RoPE sections {sections} must add up to head_dim / 2 = {flat.cfg.head_dim // 2}")
    if encoder.cfg.out_hidden_size != flat.cfg.hidden_size:
        raise ValueError(f"the encoder emits {encoder.cfg.out_hidden_size}-wide tokens, the model is "
                         f"{flat.cfg.hidden_size} wide")
    text_rope = flat.rope

    def rope(positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        if positions.ndim == 1:
            return text_rope(positions, dtype)
        return mrope_cos_sin(positions, flat.cfg.head_dim, flat.cfg.rope_theta, sections, dtype)

    flat.rope = rope
    encoder.to(next(flat.parameters()).device)
    # nn.Module's __setattr__ is typed for tensors and modules; this is a plain record.
    flat.vision = VisionInputs(encoder, image_token_id, tuple(sections))  # type: ignore[assignment]


def image_key(pixels: torch.Tensor) -> str:
    """A cryptographic hash of an image's shape and pixels (its block-hash key)."""
    data = pixels.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.blake2b(repr(tuple(data.shape)).encode(), digest_size=16)
    digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def image_inputs(flat: FlatModel, request_id: str, prompt: list[int], features: object
                 ) -> tuple[dict[str, Any], tuple]:
    """What add_request stores for a request with images: features = {"images": [pixels
    [C, H, W], ...]} in prompt order, each matched by a run of rows * cols image tokens.
    Returns (request.extra entries, block-hash keys); ValueError if anything does not fit."""
    vision = getattr(flat, "vision", None)
    if vision is None:
        raise ValueError(f"request {request_id!r}: image features need a vision encoder attached with "
                         f"serve.vision.attach_vision (Chapter 43)")
    if not isinstance(features, dict) or set(features) != {"images"} or not isinstance(features["images"], list):
        raise ValueError(f"request {request_id!r}: features must be {{'images': [pixel tensors]}}, got {features!r}")
    images, encoder = features["images"], vision.encoder
    if not images:
        raise ValueError(f"request {request_id!r}: features['images'] is empty; leave features out for text")
    strangers = [type(pixels).__name__ for pixels in images if not isinstance(pixels, torch.Tensor)]
    if strangers:
        raise ValueError(f"request {request_id!r}: images are pixel tensors [C, H, W], got {strangers[0]}")
    try:
        grids = [encoder.grid(pixels) for pixels in images]
    except ValueError as exc:
        raise ValueError(f"request {request_id!r}: {exc}") from None
    token = vision.image_token_id
    runs, index = [], 0
    while index < len(prompt):                       # the placeholder runs, in order
        if prompt[index] == token:
            end = index
            while end < len(prompt) and prompt[end] == token:
                end += 1
            runs.append(end - index)
            index = end
        else:
            index += 1
    wanted = [rows * cols for rows, cols in grids]
    if runs != wanted:
        raise ValueError(f"request {request_id!r}: the prompt's runs of image token {token} have lengths {runs}, "
                         f"but its {len(images)} image(s) need runs of {wanted}")
    embeds = torch.cat([encoder(pixels) for pixels in images])
    table, delta = mrope_positions(prompt, token, grids)
    where = torch.tensor([i for i, t in enumerate(prompt) if t == token], dtype=torch.int64)
    extra = {"image_embeds": embeds, "image_positions": where, "mrope_positions": table, "mrope_delta": delta}
    return extra, (("images", tuple(image_key(pixels) for pixels in images)),)
