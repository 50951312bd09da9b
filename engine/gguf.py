"""Chapter 39: reading a GGUF file, dequantizing its blocks, and naming its tensors our way.

A GGUF file is one self-describing binary, little-endian throughout:

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:  key (string), value type (u32), value             x metadata count
    tensor infos: name (string), n_dims (u32), dims (u64 each),
                  ggml type (u32), offset (u64)                   x tensor count
    padding up to `general.alignment` (default 32)
    tensor data: each tensor at data_start + its offset (offsets are aligned too)

A string is a u64 byte length and that many UTF-8 bytes (no terminator); an array is an
element type (u32), a count (u64) and the elements. Dims are listed fastest-varying first
(ggml's ne[0] is the row length), so a [out, in] PyTorch weight is stored with dims
(in, out): the shape we use is the reversed list.

The tensor data is never read into Python objects: the file is memory-mapped and each tensor
is a zero-copy view of its bytes, so opening a 100 MB file costs the header only and the
operating system pages weights in as they are touched.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types: id -> (name, struct format for scalars; None for string / array).
VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("uint8", "<B"), 1: ("int8", "<b"), 2: ("uint16", "<H"), 3: ("int16", "<h"),
    4: ("uint32", "<I"), 5: ("int32", "<i"), 6: ("float32", "<f"), 7: ("bool", "<?"),
    8: ("string", None), 9: ("array", None), 10: ("uint64", "<Q"), 11: ("int64", "<q"),
    12: ("float64", "<d")}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorType:
    """How one ggml tensor type stores numbers: `block_size` values in `block_bytes` bytes."""
    name: str
    block_size: int
    block_bytes: int


# The tensor types this reader dequantizes (ggml's type ids).
TENSOR_TYPES = {0: TensorType("F32", 1, 4), 1: TensorType("F16", 1, 2), 2: TensorType("Q4_0", 32, 18),
                3: TensorType("Q4_1", 32, 20), 8: TensorType("Q8_0", 32, 34)}


class GGUFError(ValueError):
    """A file that is not a GGUF this reader understands; the message names the file and the part."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table. shape is PyTorch's order (the file's dims reversed);
    offset is absolute (from the start of the file)."""
    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int

    @property
    def type(self) -> TensorType:
        return TENSOR_TYPES[self.type_id]

    @property
    def nbytes(self) -> int:
        count = int(np.prod(self.shape, dtype=np.int64))
        return count // self.type.block_size * self.type.block_bytes


def read_value(buffer: memoryview, offset: int, value_type: int) -> tuple[Any, int]:
    """One metadata value of type `value_type` starting at byte `offset` of `buffer`.  (Your engine: Chapter 39)

    Returns (value, offset just past it). Value types are VALUE_TYPES' ids: the scalar
    ones unpack with their little-endian struct format (bool as a Python bool); 8 is a
    string (u64 byte length, then UTF-8 bytes) returned as str; 9 is an array (u32
    element type, u64 count, then the elements, each read as its own type, nested arrays
    allowed) returned as a Python list. Raises GGUFError for an unknown type id.
    Trap: every length and count is u64 and little-endian whatever the machine.
    """
    raise NotImplementedError("Your engine: Chapter 39: read_value")


class GGUFFile:
    """A GGUF file opened for reading: `version`, `metadata` (a plain dict of Python values,
    arrays as lists), `tensors` ({name: GGUFTensorInfo}, file order) and `data_start`.
    Tensor bytes stay in the memory map until `raw` or `tensor` asks for them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        # Copy-on-write map: writable views for torch (no warning, no copy), the file untouched.
        self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        buffer = self._map.data          # the map's bytes as a memoryview (no copy)
        if bytes(buffer[:4]) != MAGIC:
            raise GGUFError(f"{self.path}: starts with {bytes(buffer[:4])!r}, not the GGUF magic {MAGIC!r}")
        try:
            self._read_tables(buffer)
        except (struct.error, UnicodeDecodeError) as exc:      # a length or count pointing past the end
            raise GGUFError(f"{self.path}: truncated or corrupt header ({exc})") from None

    def _read_tables(self, buffer: memoryview) -> None:
        """Read the header, the metadata and the tensor table of the file in `buffer`.  (Your engine: Chapter 39)

        buffer: the whole file's bytes (the map; the caller has checked the magic and turns a
        struct.error, a count or length pointing past the end, into a GGUFError). The layout
        is the module docstring's. Afterwards:
          - self.version: the header's version (2 or 3; any other is a GGUFError naming it);
          - self.metadata: {key: value} for every entry, in file order, each value as
            read_value gives it;
          - self.alignment: the metadata's general.alignment, else DEFAULT_ALIGNMENT;
          - self.data_start: the first multiple of self.alignment at or after the end of
            the tensor table;
          - self.tensors: {name: GGUFTensorInfo} in file order, each with PyTorch's shape,
            its ggml type id and its ABSOLUTE offset in the file.
        Nothing of the tensor data is read. Errors: GGUFError naming the tensor and saying
        "runs past the end" when a tensor of a type this reader knows (TENSOR_TYPES) does
        not fit inside the file (unknown types are kept, and refused only when asked for).
        Trap, as a property: where the data section starts, and so where every tensor is,
        depends on an alignment that only the metadata can tell.
        """
        raise NotImplementedError("Your engine: Chapter 39: GGUFFile._read_tables")

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def raw(self, name: str) -> torch.Tensor:
        """The stored bytes of tensor `name`, zero-copy: uint8 [rows, bytes per row], where
        rows are all dims but the last (1 row for a 1-D tensor)."""
        info = self._info(name)
        rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        data = self._map[info.offset:info.offset + info.nbytes]
        return torch.from_numpy(data).view(rows, info.nbytes // rows)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` dequantized to float32, in PyTorch's shape."""
        info = self._info(name)
        return dequantize(self.raw(name), info.type_id).reshape(info.shape)

    def _info(self, name: str) -> GGUFTensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: no tensor named {name!r}")
        if info.type_id not in TENSOR_TYPES:
            known = ", ".join(t.name for t in TENSOR_TYPES.values())
            raise GGUFError(f"{self.path}: tensor {name!r} has ggml type {info.type_id}; this reader "
                            f"dequantizes {known}")
        return info


# --- dequantization: uint8 [rows, bytes per row] -> float32 [rows, values per row] -----------

def _blocks(data: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """[rows, n * block_bytes] -> [rows * n, block_bytes]: one block per row."""
    return data.reshape(-1, block_bytes)


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at bytes start, start + 1 of every block, as float32 [blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of Q4 blocks.  (Your engine: Chapter 39)

    packed: uint8 [blocks, 16], two 4-bit values per byte. Returns int16 [blocks, 32]
    with values 0..15, in ggml's order: the LOW nibbles of bytes 0..15 are values 0..15,
    the HIGH nibbles of bytes 0..15 are values 16..31.
    Trap: not low/high interleaved byte by byte (value 1 is byte 1's low nibble, not
    byte 0's high one).
    """
    raise NotImplementedError("Your engine: Chapter 39: unpack_nibbles")


def dequantize_q8_0(data: torch.Tensor) -> torch.Tensor:
    """Q8_0 bytes -> float32 values.  (Your engine: Chapter 39)

    data: uint8 [rows, n * 34]; each 34-byte block holds a float16 scale d (bytes 0-1) and
    32 signed int8 values q (bytes 2-33); value = d * q. Returns float32 [rows, n * 32].
    Trap: the scale is float16 (reinterpret the two bytes, do not convert them as
    integers), and the quants are signed.
    """
    raise NotImplementedError("Your engine: Chapter 39: dequantize_q8_0")


def dequantize_q4_0(data: torch.Tensor) -> torch.Tensor:
    """Q4_0 bytes -> float32: 18-byte blocks of a float16 scale d and 16 bytes of nibbles
    q (0..15), value = d * (q - 8). Returns float32 [rows, n * 32]."""
    blocks = _blocks(data, 18)
    return (_halves(blocks, 0) * (unpack_nibbles(blocks[:, 2:]) - 8).float()).reshape(data.shape[0], -1)


def dequantize_q4_1(data: torch.Tensor) -> torch.Tensor:
    """Q4_1 bytes -> float32 values.  (Your engine: Chapter 39)

    data: uint8 [rows, n * 20]; each 20-byte block holds a float16 scale d (bytes 0-1), a
    float16 minimum m (bytes 2-3) and 16 bytes of nibbles q (0..15, unpack_nibbles' order);
    value = d * q + m. Returns float32 [rows, n * 32].
    """
    raise NotImplementedError("Your engine: Chapter 39: dequantize_q4_1")


def dequantize(data: torch.Tensor, type_id: int) -> torch.Tensor:
    """uint8 [rows, bytes per row] of ggml type `type_id` -> float32 [rows, values per row]."""
    if type_id == 0:
        return data.contiguous().view(torch.float32).clone()
    if type_id == 1:
        return data.contiguous().view(torch.float16).float()
    kernels = {2: dequantize_q4_0, 3: dequantize_q4_1, 8: dequantize_q8_0}
    if type_id not in kernels:
        raise GGUFError(f"cannot dequantize ggml type {type_id}; known: {sorted(TENSOR_TYPES)}")
    return kernels[type_id](data)


class GGUFLinear(nn.Module):
    """A bias-free linear layer whose weight stays in its GGUF blocks (Q8_0, Q4_0, Q4_1, ...)
    and is dequantized at every call: memory of the quantized file, arithmetic of a dense
    matmul. `blocks` is a buffer (uint8 [out_features, bytes per row]), so .to(device) moves
    it and state_dict() saves it."""

    blocks: torch.Tensor                  # registered as a buffer in __init__

    def __init__(self, blocks: torch.Tensor, type_id: int, in_features: int) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.type_id, self.in_features, self.out_features = type_id, in_features, blocks.shape[0]
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight [out, in], rebuilt on demand (for inspection and tests)."""
        return dequantize(self.blocks, self.type_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={TENSOR_TYPES[self.type_id].name}")


# --- names and layouts ---------------------------------------------------------------------

# GGUF's names (llama.cpp's) -> the Hugging Face names our modules carry.
TOP_LEVEL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
# Architectures whose converter interleaved the rotary pairs of Q and K (see undo_rope_permutation).
PERMUTED_ROPE_ARCHITECTURES = ("llama", "mistral")


def hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, and the top-level
    names; GGUFError for a name no module of ours carries."""
    if name in TOP_LEVEL_NAMES:
        return TOP_LEVEL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise GGUFError(f"GGUF tensor {name!r} matches no module of our model")


def undo_rope_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder the output rows of a GGUF Q or K projection back to Hugging Face's layout.  (Your engine: Chapter 39)

    weight: [num_heads * head_dim, ...] (a dense weight [out, in], a bias [out], or GGUF
    blocks [out, bytes]: rows move whole, nothing inside a row changes); num_heads: query
    heads for Q, key/value heads for K. Returns the same rows in our order, same shape
    and dtype.
    Our apply_rope rotates channel c of a head together with channel c + head_dim / 2;
    llama.cpp rotates ADJACENT channels, so its converter stored every head's rows with
    the two channels of each of our rotary pairs side by side. Example, head_dim 8: a
    head's stored rows are our rows 0, 4, 1, 5, 2, 6, 3, 7, and the result holds them as
    0, 1, ..., 7. Each head is reordered within itself; the heads keep their order.
    """
    raise NotImplementedError("Your engine: Chapter 39: undo_rope_permutation")


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The metadata as a Hugging Face config.json dict (architectures, model_type and the
    fields our configs read), so GGUF and directories share one family registry."""
    meta, arch = gguf.metadata, gguf.architecture
    if not arch:
        raise GGUFError(f"{gguf.path}: no general.architecture in the metadata")

    def field(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{gguf.path}: metadata {arch}.{key} missing")
        return value

    heads = int(field("attention.head_count"))
    hidden = int(field("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        vocab = gguf.tensors["token_embd.weight"].shape[0]
    config = {"architectures": [GGUF_ARCHITECTURES.get(arch, arch)], "model_type": arch,
              "vocab_size": int(vocab), "hidden_size": hidden,
              "intermediate_size": int(field("feed_forward_length")),
              "num_hidden_layers": int(field("block_count")),
              "num_attention_heads": heads,
              "num_key_value_heads": int(field("attention.head_count_kv", heads)),
              "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
              "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon")),
              "rope_theta": float(field("rope.freq_base", 10000.0)),
              "max_position_embeddings": int(field("context_length")),
              "tie_word_embeddings": "output.weight" not in gguf.tensors,
              "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
              "eos_token_id": meta.get("tokenizer.ggml.eos_token_id")}
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
    return config


# general.architecture -> the Hugging Face class name the family registry is keyed by.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_state(gguf: GGUFFile, config: dict[str, Any],
             keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (our parameter name, tensor) for every tensor of the file: float32 tensors in
    our layout, or, with keep_quantized, the raw blocks (uint8 [out, bytes]) of quantized
    2-D weights other than the embedding (rows reordered just the same)."""
    permute = gguf.architecture in PERMUTED_ROPE_ARCHITECTURES
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for name, info in gguf.tensors.items():
        ours = hf_name(name)
        block_kind = name.split(".")[2] if name.startswith("blk.") else ""
        quantized = keep_quantized and info.type.block_size > 1 and name != "token_embd.weight"
        value = gguf.raw(name) if quantized else gguf.tensor(name)
        if permute and block_kind in heads:
            value = undo_rope_permutation(value, heads[block_kind])
        yield ours, value
