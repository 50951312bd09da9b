"""Chapter 11: reading (and writing) a Hugging Face Qwen3 checkpoint directory.

A checkpoint directory holds config.json and the weights in safetensors files: either one
model.safetensors, or several shards plus model.safetensors.index.json, whose "weight_map"
says which shard holds each tensor. Our parameter names are Hugging Face's, so the mapping
is nearly the identity; what the loader really does is check: every parameter present
once, no stray tensors, every shape as the config promises, then cast and place each
tensor as it is read, so a model never exists twice in memory.
"""
from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .qwen3 import Qwen3Config, Qwen3ForCausalLM

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3Model")
MODEL_TYPE = "qwen3"
# Tensors some exporters wrote that hold nothing we load: rotary tables are recomputed.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


class CheckpointError(ValueError):
    """A checkpoint that cannot become our model. The message names the file and tensor."""


def read_config(path: str | Path) -> tuple[Qwen3Config, dict[str, Any]]:
    """config.json of the directory `path` -> (Qwen3Config, the raw dict).

    Refuses a config that does not describe a Qwen3 (model_type / architectures), because
    another family's tensors may well have the same names and shapes and still compute
    something else (Llama has no q_norm, Qwen2 has attention biases)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"{file}: not found; a checkpoint directory needs {CONFIG_FILE}")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from None
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    if model_type != MODEL_TYPE or (architectures and not set(architectures) & set(ARCHITECTURES)):
        raise CheckpointError(
            f"{file}: unknown architecture {architectures or None} (model_type {model_type!r}); "
            f"this loader reads Qwen3 checkpoints (model_type {MODEL_TYPE!r}, "
            f"architectures {list(ARCHITECTURES)})")
    return Qwen3Config.from_dict(raw), raw


def tensor_locations(path: str | Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor: {tensor name: Path}.  (Your engine: Chapter 11)

    A directory has either model.safetensors.index.json (sharded: its "weight_map" maps
    every tensor name to a shard file name in the same directory) or a single
    model.safetensors. Raise CheckpointError naming the file when neither exists, when the
    index has no (or an empty) "weight_map", or when the index names a shard that is not in
    the directory (the message names the missing shard). Read names only, from the files'
    headers: no tensor data is loaded here.
    """
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no \"weight_map\" of tensor names to shard files")
        locations = {}
        for name, shard in weight_map.items():
            file = root / shard
            if not file.is_file():
                raise CheckpointError(f"{index}: tensor {name!r} is in shard {shard}, which is not in {root}")
            locations[name] = file
        return locations
    single = root / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as handle:
            return {name: single for name in handle.keys()}
    present = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    raise CheckpointError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} found (the directory holds {present})")


def match_names(locations: dict[str, Path], parameter_names: Iterable[str], tied: bool) -> dict[str, str]:
    """Pair each checkpoint tensor with one of our parameters.  (Your engine: Chapter 11)

    locations: {checkpoint tensor name: file} from tensor_locations; parameter_names: our
    model's parameter names (`model.layers.0.self_attn.q_proj.weight`, ..., `lm_head.weight`),
    which equal Hugging Face's. Returns {checkpoint name: our name}.
      - A checkpoint saved from the bare Qwen3Model has no "model." prefix: its
        `layers.0.mlp.up_proj.weight` pairs with our `model.layers.0.mlp.up_proj.weight`
        (and `embed_tokens.weight`, `norm.weight` likewise).
      - With tied embeddings (`tied`), lm_head.weight IS the embedding: it is usually absent
        from the file; if present it is skipped (the embedding is loaded once).
      - Names ending in IGNORED_SUFFIXES are skipped.
    Raise CheckpointError naming the tensor and its file for a tensor that matches no
    parameter (or that two file names map onto), and naming the tensor for every parameter
    no file provides.
    """
    wanted = set(parameter_names)
    if tied:
        wanted.discard("lm_head.weight")
    pairs: dict[str, str] = {}
    for name, file in locations.items():
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        ours = name if name in wanted else f"model.{name}"
        if ours not in wanted:
            raise CheckpointError(f"unexpected tensor {name!r} in {file}: it matches no parameter of Qwen3ForCausalLM")
        if ours in pairs.values():
            raise CheckpointError(f"tensor {name!r} in {file} provides {ours!r} a second time")
        pairs[name] = ours
    missing = sorted(wanted - set(pairs.values()))
    if missing:
        files = sorted({str(f) for f in locations.values()})
        shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"missing tensor(s) {shown}: not in any of {files}")
    return pairs


def _resolve_dtype(dtype: torch.dtype | None, raw_config: dict[str, Any], locations: dict[str, Path]) -> torch.dtype:
    if dtype is not None:
        return dtype
    named = raw_config.get("dtype") or raw_config.get("torch_dtype")
    if named in DTYPES:
        return DTYPES[named]
    name, file = next(iter(locations.items()))
    with safe_open(file, framework="pt") as handle:
        stored = handle.get_slice(name).get_dtype()
    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}[stored]


@contextmanager
def skip_init() -> Iterator[None]:
    """Skip nn.Linear / nn.Embedding random initialisation while the model is built on
    "meta": the values would be thrown away, and drawing them on meta is slow."""
    names = ("normal_", "uniform_", "kaiming_uniform_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> Qwen3ForCausalLM:
    """A Hugging Face Qwen3 directory -> Qwen3ForCausalLM in eval mode.  (Your engine: Chapter 11)

    path: a directory with config.json and model.safetensors (or a sharded index and its
    shards); dtype: the parameters' dtype (None: the config's "dtype"/"torch_dtype", else
    the file's); device: where they live (None: cpu).
    Returns the model with every parameter loaded from the files (requires_grad False, in
    `dtype`, on `device`); with tie_word_embeddings, lm_head.weight IS the embedding tensor
    (the same object, as after __init__). No parameter is left on the "meta" device.
    Costs: memory for one copy of the weights (no random initialisation first, no second
    copy); each safetensors file opened once to read its tensors (the given _resolve_dtype
    may peek at one header first, when neither `dtype` nor the config names a dtype).
    Errors (all CheckpointError, with the message naming the tensor and the file):
    what tensor_locations and match_names raise; a tensor whose shape differs from the
    parameter's (both shapes in the message); a parameter that was never loaded.
    """
    cfg, raw = read_config(path)
    with torch.device("meta"), skip_init():
        model = Qwen3ForCausalLM(cfg)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    locations = tensor_locations(path)
    pairs = match_names(locations, expected, cfg.tie_word_embeddings)
    dtype = _resolve_dtype(dtype, raw, locations)
    device = torch.device(device if device is not None else "cpu")
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, ours in pairs.items():
        by_file.setdefault(locations[name], []).append((name, ours))
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device=str(device)) as handle:
            for name, ours in names:
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != expected[ours]:
                    raise CheckpointError(f"tensor {name!r} in {file} has shape {shape}, but the config "
                                          f"({Path(path) / CONFIG_FILE}) gives {ours!r} the shape {expected[ours]}")
                _set_parameter(model, ours, handle.get_tensor(name).to(dtype=dtype))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointError(f"{path}: parameters {left} were never loaded")
    return model.eval()


def save_checkpoint(model: Qwen3ForCausalLM, path: str | Path, max_shard_bytes: int | None = None) -> list[str]:
    """Write `model` as a Hugging Face-style directory that load_checkpoint (and
    transformers' from_pretrained) reads: config.json plus model.safetensors, or shards of
    at most max_shard_bytes each (a tensor larger than that gets a shard of its own) and
    model.safetensors.index.json. A tied lm_head is not written. Returns the file names."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for stale in [*root.glob("model*.safetensors"), root / INDEX_FILE]:
        stale.unlink(missing_ok=True)           # shards of an earlier save would confuse a reader
    cfg = model.cfg
    tensors = {name: p.detach().contiguous().cpu() for name, p in model.state_dict().items()
               if not (cfg.tie_word_embeddings and name == "lm_head.weight")}
    dtype = next(iter(tensors.values())).dtype
    config = dict(vars(cfg), architectures=["Qwen3ForCausalLM"], model_type=MODEL_TYPE,
                  dtype=str(dtype).removeprefix("torch."))
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if max_shard_bytes is None:
        save_file(tensors, root / SINGLE_FILE, metadata={"format": "pt"})
        return [CONFIG_FILE, SINGLE_FILE]
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, files = {}, []
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, root / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        files.append(file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [CONFIG_FILE, INDEX_FILE, *files]


def inventory(path: str | Path) -> list[dict[str, Any]]:
    """Every tensor of a checkpoint directory without loading data: a list of dicts with
    name, file, shape, dtype (as safetensors spells it) and nbytes, in file order."""
    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}
    rows = []
    locations = tensor_locations(path)
    for file in sorted(set(locations.values())):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                shape, kind = tuple(piece.get_shape()), piece.get_dtype()
                count = 1
                for n in shape:
                    count *= n
                rows.append(dict(name=name, file=file.name, shape=shape, dtype=kind,
                                 nbytes=count * sizes.get(kind, 0)))
    return rows


# --- Chapters 39 and 42: any family, from a directory or a GGUF file --------------------------

def _install(model: Qwen3ForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: Path,
             dtype: torch.dtype, device: torch.device, tied: bool,
             deferred: Collection[str] = ()) -> Qwen3ForCausalLM:
    """Put (our name, tensor) pairs into a model built on "meta": each shape checked against
    the parameter's, cast and moved as it arrives; every parameter provided once, except
    the names in `deferred` (a collection read after the loop: weights that another step
    installs)."""
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if tied:
        expected.pop("lm_head.weight", None)
    seen: set[str] = set()
    for name, tensor in tensors:
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {name!r} in {source}: it matches no parameter of "
                                  f"{type(model).__name__}")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"tensor {name!r} in {source} has shape {tuple(tensor.shape)}, but the config "
                                  f"gives it the shape {expected[name]}")
        _set_parameter(model, name, tensor.to(device=device, dtype=dtype))
        seen.add(name)
    missing = sorted(set(expected) - seen - set(deferred))
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_gguf(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
              keep_quantized: bool = False) -> Qwen3ForCausalLM:
    """A GGUF file -> the model of its family (general.architecture), in eval mode.

    Tensors are dequantized to `dtype` (default float32) and moved to `device` one at a
    time, straight from the memory map. With keep_quantized, quantized projection weights
    stay in their blocks as gguf.GGUFLinear modules (dequantized at each call); the
    embedding, norms and float tensors are dense."""
    from .families import build_model
    from .gguf import GGUFFile, GGUFLinear, hf_config, hf_name, hf_state
    gguf = GGUFFile(path)
    config = hf_config(gguf)
    with torch.device("meta"), skip_init():
        model = build_model(config)
    target = torch.device(device if device is not None else "cpu")
    blocks: dict[str, torch.Tensor] = {}          # our weight name -> uint8 blocks kept quantized

    def dense() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in hf_state(gguf, config, keep_quantized):
            if tensor.dtype == torch.uint8:
                blocks[name] = tensor
            else:
                yield name, tensor

    _install(model, dense(), gguf.path, dtype or torch.float32, target, model.cfg.tie_word_embeddings, blocks)
    type_ids = {hf_name(name): info.type_id for name, info in gguf.tensors.items()}
    for name, data in blocks.items():
        owner, _, leaf = name.removesuffix(".weight").rpartition(".")
        dense_shape = tuple(model.get_parameter(name).shape)
        quantized = GGUFLinear(data.to(target), type_ids[name], dense_shape[1])
        if quantized.weight.shape != dense_shape:
            raise CheckpointError(f"tensor {name!r} in {gguf.path} holds {tuple(quantized.weight.shape)}, "
                                  f"the config gives {dense_shape}")
        setattr(model.get_submodule(owner), leaf, quantized)
    return model


def load_model(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
               keep_quantized: bool = False) -> Qwen3ForCausalLM:
    """Any checkpoint -> its family's model: a GGUF file (load_gguf), or a Hugging Face
    directory whose config.json's "architectures" picks the family (Qwen3 through
    load_checkpoint; ValueError naming the known architectures for an unknown one)."""
    source = Path(path)
    if source.is_file() and source.suffix == ".gguf":
        return load_gguf(source, dtype, device, keep_quantized)
    if keep_quantized:
        raise CheckpointError(f"{source}: keep_quantized applies to GGUF files only")
    from .families import FAMILIES, family_for
    file = source / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"{source}: neither a .gguf file nor a directory with {CONFIG_FILE}")
    raw = json.loads(file.read_text(encoding="utf-8"))
    family = family_for(raw)
    if family is FAMILIES["qwen3"]:
        return load_checkpoint(source, dtype, device)
    with torch.device("meta"), skip_init():
        model = family.model_class(family.config_class.from_dict(raw))
    locations = tensor_locations(source)
    parameter_dtype = _resolve_dtype(dtype, raw, locations)
    target = torch.device(device if device is not None else "cpu")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in sorted(set(locations.values())):
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    yield (name if name.startswith(("model.", "lm_head.")) else f"model.{name}"), \
                        handle.get_tensor(name)

    return _install(model, tensors(), source, parameter_dtype, target, model.cfg.tie_word_embeddings)
