"""Chapter 43: images in the prompt.

A vision-language model of the Qwen-VL kind reads an image in three moves:

1. A vision encoder (the architecture of Qwen3-VL's vision tower) cuts the image into
   patch x patch squares, embeds each, adds a learned position embedding resampled to the
   image's grid, runs transformer blocks whose attention rotates queries and keys by each
   patch's (row, col) (2-D RoPE), and merges each 2 x 2 square of neighbouring patches into
   ONE vector of the language model's width: an h x w grid of merged patches becomes h * w
   "image tokens".
2. The prompt holds h * w placeholder ids where the image goes. Their embeddings are
   replaced by the encoder's vectors; the language model never sees the placeholder ids.
3. Positions get three axes (M-RoPE): temporal, height, width. A text token at position p
   is (p, p, p); image token (row, col) of an image starting at p is (p, p + row, p + col);
   the text after the image continues from the largest position used + 1. RoPE's frequency
   pairs are shared out between the three axes (Qwen3-VL interleaves them: T H W T H W ...).

The encoder runs once per request when it is added (its output rows are kept in
request.images, so a preempted request recomputes from the same rows); the block hash of
every block of that request includes a hash of the image's pixels. `load_qwen3_vl` fills
the encoder and a Qwen3 language model from a transformers Qwen3-VL state dict.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import apply_rope, rope_cos_sin
from .request import ImageInputs

if TYPE_CHECKING:
    from .flat_model import FlatModel, RopeTables


@dataclass
class VisionConfig:
    """The encoder's shape, with the field names of a Qwen3-VL checkpoint's vision_config.
    out_hidden_size is the language model's hidden size."""
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 4                  # pixels per patch side
    temporal_patch_size: int = 2         # frames per patch: an image is repeated to fill them
    spatial_merge_size: int = 2          # merge x merge patches -> one image token
    hidden_size: int = 32
    intermediate_size: int = 64
    num_heads: int = 2
    depth: int = 2                       # transformer blocks
    num_position_embeddings: int = 16    # a square table of learned positions (4 x 4 here)
    rope_theta: float = 10000.0

    @property
    def patch_dim(self) -> int:
        """Numbers in one flattened patch: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> VisionConfig:
        """From a Qwen3-VL config.json's "vision_config" (unknown keys ignored). DeepStack (vision
        features added inside the language model's first layers) is not part of this engine."""
        if values.get("deepstack_visual_indexes"):
            raise ValueError(f"deepstack_visual_indexes={list(values['deepstack_visual_indexes'])}: this encoder "
                             f"has no DeepStack mergers; only checkpoints without them load")
        if values.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_act={values['hidden_act']!r}: the encoder's MLP is GELU (tanh form), "
                             f"as in every Qwen3-VL checkpoint")
        known = {field.name for field in dataclasses.fields(cls)}
        picked = {name: value for name, value in values.items() if name in known}
        theta = (values.get("rope_parameters") or {}).get("rope_theta")
        if theta is not None:
            picked["rope_theta"] = theta
        return cls(**picked)


def patch_positions(rows: int, cols: int, merge: int) -> torch.Tensor:
    """(row, col) of every patch of a rows x cols patch grid, in the encoder's order.  (Your engine: Chapter 43)

    rows, cols: patches along each side, both multiples of merge. Returns int64 [rows * cols, 2].
    The order is the one Qwen-VL's image processor flattens patches in: merge x merge squares
    in row-major order of the squares, and inside a square its patches in row-major order, so
    that every run of merge * merge consecutive patches is one square (what the merger joins).
    Example, rows = cols = 4, merge = 2: (0,0) (0,1) (1,0) (1,1) (0,2) (0,3) (1,2) (1,3) (2,0) ...
    """
    raise NotImplementedError("Your engine: Chapter 43: patch_positions")


class VisionAttention(nn.Module):
    """Full (not causal) attention among one image's patches, queries and keys rotated by
    each patch's (row, col): the first half of every head's frequency pairs turn with the row,
    the second half with the column."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)           # each [n, heads, head_dim]
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.proj(y.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """A pre-norm transformer block (LayerNorm, not RMSNorm, as in most vision towers)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge neighbouring patches -> one vector of the language model's width: normalise
    each patch, lay the square's patches side by side, then a two-layer MLP."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        joined = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(joined, joined)
        self.linear_fc2 = nn.Linear(joined, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = self.norm(x).reshape(-1, self.linear_fc1.in_features)  # consecutive patches are one square
        return self.linear_fc2(F.gelu(self.linear_fc1(squares)))


class VisionEncoder(nn.Module):
    """Qwen3-VL's vision tower without DeepStack. encode(pixels [C, H, W]) -> image tokens
    [(H / (p * m)) * (W / (p * m)), out_hidden_size] in row-major order of the merged grid
    (p = patch_size, m = spatial_merge_size); forward takes the flattened patches an image
    processor makes, as transformers' Qwen3-VL does."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        side = round(cfg.num_position_embeddings ** 0.5)
        if side * side != cfg.num_position_embeddings or cfg.hidden_size % (4 * cfg.num_heads):
            raise ValueError(f"num_position_embeddings {cfg.num_position_embeddings} must be a square and "
                             f"hidden_size {cfg.hidden_size} a multiple of 4 * num_heads")
        self.cfg, self.side = cfg, side
        # A Conv3d whose kernel equals its stride is a Linear on flattened patches.
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def grid(self, pixels: torch.Tensor) -> tuple[int, int]:
        """(rows, cols) of image tokens for an image, or ValueError naming the rule it breaks."""
        cfg = self.cfg
        side = cfg.patch_size * cfg.spatial_merge_size
        if pixels.ndim != 3 or pixels.shape[0] != cfg.in_channels or not pixels.is_floating_point():
            raise ValueError(f"an image is a float tensor [{cfg.in_channels}, H, W], got {tuple(pixels.shape)} "
                             f"{pixels.dtype}")
        height, width = pixels.shape[1:]
        if height % side or width % side or not height or not width:
            raise ValueError(f"image sides must be positive multiples of {side} pixels, got {height} x {width}")
        return height // side, width // side

    def patchify(self, pixels: torch.Tensor) -> torch.Tensor:
        """An image [C, H, W] (already normalised) -> flattened patches [N, patch_dim] in
        patch_positions order, each patch (channel, frame, row, col) flattened with the image
        repeated in every frame: what Qwen-VL's image processor hands the model."""
        cfg = self.cfg
        rows, cols = self.grid(pixels)
        p, m = cfg.patch_size, cfg.spatial_merge_size
        squares = pixels.reshape(cfg.in_channels, rows, m, p, cols, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        frames = squares.unsqueeze(5).expand(*squares.shape[:5], cfg.temporal_patch_size, p, p)
        return frames.reshape(-1, cfg.patch_dim)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) [N, 2] -> cos, sin [N, 1, head_dim]: a quarter of head_dim's channels turn
        with the row, a quarter with the column, each quarter again in the second half."""
        quarter = self.cfg.hidden_size // self.cfg.num_heads // 2
        cos, sin = rope_cos_sin(positions.T, quarter, self.cfg.rope_theta)          # [2, 1, N, quarter]
        half = quarter // 2
        cos = torch.cat([cos[0, 0, :, :half], cos[1, 0, :, :half]], dim=-1).repeat(1, 2)
        sin = torch.cat([sin[0, 0, :, :half], sin[1, 0, :, :half]], dim=-1).repeat(1, 2)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def grid_positions(self, rows: int, cols: int) -> torch.Tensor:
        """The learned square table resampled (bilinear, corners aligned) to a rows x cols patch
        grid: [rows * cols, hidden] in patch_positions order."""
        table = self.pos_embed.weight.T.reshape(1, -1, self.side, self.side)
        resampled = F.interpolate(table, size=(rows, cols), mode="bilinear", align_corners=True)[0]
        where = patch_positions(rows, cols, self.cfg.spatial_merge_size)
        return resampled[:, where[:, 0], where[:, 1]].T

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """Flattened patches [rows * cols, patch_dim] of ONE image (rows x cols patches, in
        patch_positions order) -> image tokens [rows * cols / merge**2, out_hidden_size]."""
        cfg = self.cfg
        m = cfg.spatial_merge_size
        if patches.shape != (rows * cols, cfg.patch_dim) or rows % m or cols % m:
            raise ValueError(f"patches of a {rows} x {cols} grid (multiples of {m}) are [{rows * cols}, "
                             f"{cfg.patch_dim}], got {tuple(patches.shape)}")
        weight = self.patch_embed.weight
        x = self.patch_embed(patches.to(weight)) + self.grid_positions(rows, cols)
        cos, sin = self.rope(patch_positions(rows, cols, m).to(weight.device))
        rope = cos.to(weight.dtype), sin.to(weight.dtype)
        for block in self.blocks:
            x = block(x, rope)
        return self.merger(x)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """An image [C, H, W] -> its image tokens [rows * cols, out_hidden_size] (see grid)."""
        rows, cols = self.grid(pixels)
        m = self.cfg.spatial_merge_size
        return self(self.patchify(pixels.to(self.patch_embed.weight)), rows * m, cols * m)


def load_qwen3_vl(state_dict: Mapping[str, torch.Tensor], encoder: VisionEncoder, model: nn.Module) -> None:
    """Copy a transformers Qwen3VLForConditionalGeneration state dict into `encoder` and `model`
    (this package's Qwen3ForCausalLM: Qwen3-VL's language model is Qwen3, its RoPE aside).
    Names map "model.visual.X" -> encoder X, "model.language_model.X" -> model.model.X,
    "lm_head.weight" -> model.lm_head.weight; the Conv3d patch kernel becomes the Linear on
    flattened patches. ValueError names a tensor that is missing, extra or of the wrong shape."""
    targets = {f"model.visual.{name}": param for name, param in encoder.state_dict().items()}
    targets |= {f"model.language_model.{name[len('model.'):]}": param
                for name, param in model.state_dict().items() if name.startswith("model.")}
    targets["lm_head.weight"] = model.state_dict()["lm_head.weight"]
    targets["model.visual.patch_embed.proj.weight"] = targets.pop("model.visual.patch_embed.weight")
    targets["model.visual.patch_embed.proj.bias"] = targets.pop("model.visual.patch_embed.bias")
    extra = sorted(set(state_dict) - set(targets))
    missing = sorted(set(targets) - set(state_dict))
    if extra or missing:
        raise ValueError(f"Qwen3-VL weights do not fit: unexpected {extra[:3]}, missing {missing[:3]}")
    with torch.no_grad():
        for name, target in targets.items():
            source = state_dict[name]
            if name == "model.visual.patch_embed.proj.weight":
                source = source.reshape(source.shape[0], -1)       # [hidden, C, T, p, p] -> [hidden, patch_dim]
            if source.shape != target.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(source.shape)}, model expects "
                                 f"{tuple(target.shape)}")
            target.copy_(source)


# --- M-RoPE ------------------------------------------------------------------------------------

def mrope_positions(prompt: list[int], image_token_id: int, grids: list[tuple[int, int]]
                    ) -> tuple[torch.Tensor, int]:
    """Three-axis positions of a prompt with images.  (Your engine: Chapter 43)

    prompt: token ids, where image k is a contiguous run of grids[k][0] * grids[k][1]
    image_token_id placeholders, images in prompt order, two runs always apart (real
    prompts wrap each image in vision-start / vision-end tokens); the caller (image_inputs)
    has checked the runs against the grids, so this function raises nothing.
    Returns (table [3, len(prompt)] int64, delta: int):
    - a text token at position p of the running counter gets (p, p, p); the counter moves by 1;
    - image k, starting when the counter is s, gives its token (row, col), in row-major
      order, the positions (s, s + row, s + col); afterwards the counter is
      s + max(rows, cols): the largest position used + 1;
    - delta = table.max() + 1 - len(prompt): a token generated at sequence position q
      (q >= len(prompt)) has position q + delta on all three axes.
    A prompt without images gives table rows equal to arange(len(prompt)) and delta 0.
    """
    raise NotImplementedError("Your engine: Chapter 43: mrope_positions")


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
    """A vision encoder and how prompts mark images: what EngineCore(vision=...) takes, and
    what attach_vision leaves on the FlatModel (as `flat.vision`) for add_request."""
    encoder: VisionEncoder
    image_token_id: int
    sections: tuple[int, ...]


def attach_vision(flat: FlatModel, encoder: VisionEncoder, image_token_id: int,
                  sections: tuple[int, ...]) -> None:
    """Make `flat` a vision-language model: add_request then accepts images, and the RoPE
    seam takes [3, N] positions (M-RoPE) as well as [N]. EngineCore(vision=...) calls this
    before it builds anything on the model."""
    if len(sections) != 3 or sum(sections) != flat.cfg.head_dim // 2:
        raise ValueError(f"M-RoPE sections {sections} must be three numbers adding up to head_dim / 2 = "
                         f"{flat.cfg.head_dim // 2}")
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
    flat.vision = VisionInputs(encoder, image_token_id, tuple(sections))


def image_key(pixels: torch.Tensor) -> str:
    """A cryptographic hash of an image's shape and pixels (its block-hash key)."""
    data = pixels.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.blake2b(repr(tuple(data.shape)).encode(), digest_size=16)
    digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def image_inputs(flat: FlatModel, request_id: str, prompt: list[int], features: object
                 ) -> tuple[ImageInputs, tuple[tuple[str, tuple[str, ...]]]]:
    """What add_request stores for a request with images: features = {"images": [pixels
    [C, H, W], ...]} in prompt order, each matched by a run of rows * cols image tokens.
    Returns (request.images, block-hash keys); ValueError if anything does not fit."""
    vision = flat.vision
    if vision is None:
        raise ValueError(f"request {request_id!r}: image features need a vision encoder attached with "
                         f"(EngineCore(..., vision=serve.vision.VisionInputs(...)), Chapter 43)")
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
    embeds = torch.cat([encoder.encode(pixels) for pixels in images])
    table, delta = mrope_positions(prompt, token, grids)
    where = torch.tensor([i for i, t in enumerate(prompt) if t == token], dtype=torch.int64)
    return (ImageInputs(embeds, where, table, delta),
            (("images", tuple(image_key(pixels) for pixels in images)),))
