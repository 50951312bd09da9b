"""Recorded oracle outputs: what the reference engine answered, for an edition without it.

A milestone whose oracle is reference code (solo `generate`, a reference cost model, a
reference backend) asks through `recorded(what, inputs, compute)`:

- in the full course (solutions/ present) it runs `compute()`, the reference itself; in
  record mode (the environment variable COURSE_RECORD_ORACLES names a folder, which
  `python run.py release` sets while it runs the milestones) it also keeps the answer under
  a key made from `what` and the content of `inputs`;
- in a learner's edition (no solutions/) it answers from tests/oracle_records/, which the
  release wrote, and a missing key fails the test in one line ("cannot run here: ...")
  saying the edition needs a fresh release.

Keys hash content, never identity: tensors by dtype, shape and bytes, models by their
parameters and context limit (so the reference tiny model and transformers' twin with the
same weights share a key; two architectures with the same weights do too, so such a question
adds what tells them apart, as Chapter 42 adds the family's name), generators by their state,
dataclasses by their fields. So a test asks the same
question in both worlds as long as its inputs are deterministic (seeded; Hypothesis runs
derandomized while recording and in an edition, see course.pytest_plugin).
Values are JSON with tensors, tuples, bytes, sets and dicts with other than str keys
tagged, gzip-compressed.
"""
from __future__ import annotations

import atexit
import base64
import dataclasses
import gzip
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import torch

from course import impl as impl_module
from course.manifest import ROOT

RECORD_ENV = "COURSE_RECORD_ORACLES"
RECORDS_DIR = Path("tests") / "oracle_records"       # inside a checkout or an edition
T = TypeVar("T")


class RecordMissing(impl_module.ImplError):
    """An edition asked for a reference answer its release did not record."""


def recorded(what: str, inputs: Any, compute: Callable[[], T]) -> T:
    """The reference's answer to `what` on `inputs`: computed where the reference exists
    (and kept when recording), replayed from the edition's records where it does not."""
    if impl_module.have_reference():
        if not os.environ.get(RECORD_ENV):
            return compute()
        key = key_of(what, inputs)          # before computing, which may advance a generator in inputs
        value = compute()
        _recording()[key] = {"what": what, "test": _current_test(), "value": encode(value)}
        return value
    key = key_of(what, inputs)
    entry = _replayed().get(key)
    if entry is None:
        raise RecordMissing(f"{_current_test() or 'this code'} needs the reference's {what}, and this edition has "
                            f"no record of it ({RECORDS_DIR}/ lacks key {key[:12]}): the edition must be released "
                            f"again (`python run.py release`)")
    return decode(entry["value"])


# --- keys ---------------------------------------------------------------------------------

def key_of(what: str, inputs: Any) -> str:
    digest = hashlib.sha256(what.encode())
    _feed(digest, inputs)
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        digest.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, bytes):
        digest.update(b"bytes:%d:" % len(value) + value)
    elif isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous()
        digest.update(f"tensor:{data.dtype}:{tuple(data.shape)}:".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    elif isinstance(value, torch.nn.Module):
        # Its weights and, where it has one, its context limit (generate stops there): the
        # reference's tiny model and transformers' twin with the same weights give one key.
        _feed(digest, ("module", getattr(value, "context_limit", None)))
        for name, param in sorted(value.named_parameters()):
            _feed(digest, name)
            _feed(digest, param)
    elif isinstance(value, torch.Generator):
        _feed(digest, ("generator", value.get_state()))
    elif isinstance(value, (torch.dtype, torch.device)):
        _feed(digest, str(value))
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}:{len(value)}[".encode())
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    elif isinstance(value, dict):
        digest.update(f"dict:{len(value)}{{".encode())
        for name in sorted(value, key=repr):
            _feed(digest, name)
            _feed(digest, value[name])
        digest.update(b"}")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        _feed(digest, (type(value).__name__, {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}))
    else:
        raise TypeError(f"oracle record keys take tensors, models, generators, dataclasses and plain data; "
                        f"not {type(value).__name__}")


# --- values -------------------------------------------------------------------------------

def encode(value: Any) -> Any:
    """A JSON-able form of value (tensors, tuples and bytes tagged)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous()
        raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
        return {"__tensor__": [str(data.dtype).removeprefix("torch."), list(data.shape),
                               base64.b64encode(raw).decode()]}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: encode(v) for k, v in value.items()}}
    if isinstance(value, dict):             # other keys (a Counter of pairs): a list of items
        return {"__items__": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, (set, frozenset)):  # in a stable order, so equal sets record equal
        return {"__set__": sorted((encode(v) for v in value), key=repr), "frozen": isinstance(value, frozenset)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
        names += [name for name, member in vars(type(value)).items() if isinstance(member, property)]
        return {"__fields__": {name: encode(getattr(value, name)) for name in names}}
    raise TypeError(f"an oracle record holds tensors and plain data, not {type(value).__name__}")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        dtype, shape, raw = value["__tensor__"]
        data = bytearray(base64.b64decode(raw))
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, dtype)).reshape(shape).clone()
    if "__bytes__" in value:
        return base64.b64decode(value["__bytes__"])
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__items__" in value:
        return {decode(k): decode(v) for k, v in value["__items__"]}
    if "__set__" in value:
        return (frozenset if value["frozen"] else set)(decode(v) for v in value["__set__"])
    if "__fields__" in value:          # a dataclass of the reference: its fields and properties by name
        return SimpleNamespace(**{k: decode(v) for k, v in value["__fields__"].items()})
    return {k: decode(v) for k, v in value["__dict__"].items()}


# --- the stores ---------------------------------------------------------------------------

_recorded: dict[str, dict] | None = None
_replay: dict[str, dict] | None = None


def _recording() -> dict[str, dict]:
    global _recorded
    if _recorded is None:
        _recorded = {}
        atexit.register(_flush)
    return _recorded


def _flush() -> None:
    """Record mode: this process's records go to their own file (pytest-xdist runs several)."""
    folder = Path(os.environ.get(RECORD_ENV, ""))
    if _recorded and folder.is_dir():
        write_store(folder / f"records-{os.getpid()}.json.gz", _recorded)


def write_store(path: Path, records: dict[str, dict]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as out:
        json.dump(records, out, sort_keys=True)


def read_stores(folder: Path) -> dict[str, dict]:
    """Every record in folder's *.json.gz files (later files win on a repeated key)."""
    merged: dict[str, dict] = {}
    for path in sorted(folder.glob("*.json.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as source:
            merged.update(json.load(source))
    return merged


def _replayed() -> dict[str, dict]:
    global _replay
    if _replay is None:
        _replay = read_stores(ROOT / RECORDS_DIR)
    return _replay


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
