"""The dispatcher behind `python run.py <command>`.

A command is a module course/commands/<name>.py with a docstring (its first line is the
help text), `add_arguments(parser)` and `run(args)` returning an exit status (None means 0).
Dropping a file there is all it takes to add one. Only the chosen command's module is
imported, so a slow or broken command never slows or breaks the others, and the command
list comes from the files' docstrings without importing them.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

COMMANDS_DIR = Path(__file__).resolve().parent / "commands"


class CommandError(Exception):
    """A failure the user can act on: printed as one line, exit status 2."""


def available() -> dict[str, str]:
    """{command name: one-line summary}, from the files in course/commands/."""
    found = {}
    for path in sorted(COMMANDS_DIR.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        except SyntaxError:
            doc = "(this command's file does not parse)"
        found[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def _usage(commands: dict[str, str]) -> str:
    width = max((len(name) for name in commands), default=0)
    lines = ["usage: python run.py <command> [options]    (python run.py <command> -h for its options)",
             "", "commands:"]
    lines += [f"  {name.ljust(width)}  {summary}" for name, summary in commands.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = available()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage(commands))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"run.py: unknown command {name!r}\n\n{_usage(commands)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"course.commands.{name}")
    parser = argparse.ArgumentParser(prog=f"python run.py {name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    from .impl import ImplError
    from .manifest import ManifestError
    from .skeleton import SkeletonConflict, SkeletonError
    try:
        status = module.run(args)
    except (CommandError, ImplError, ManifestError, SkeletonError, SkeletonConflict) as exc:
        print(f"run.py {name}: error: {exc}", file=sys.stderr)
        return 2
    except NotImplementedError as exc:         # a stub the learner has not written yet
        print(f"run.py {name}: error: {exc} is not written yet (its chapter's milestone checks it once it is)",
              file=sys.stderr)
        return 2
    return int(status or 0)


# --- shared options, so every command spells them the same way -------------------------------

def add_impl_argument(parser, default: str | None = None) -> None:
    """--impl; its default is the reference (solutions) where the checkout has it, else (a
    learner's edition) the learner's engine."""
    from .impl import have_reference
    choices = "solutions, engine" if have_reference() else "engine"
    default = default or ("solutions" if have_reference() else "engine")
    parser.add_argument("--impl", default=default, metavar="SPEC",
                        help=f"implementation: {choices}, a checkout path, optionally @N (default: {default})")


def default_dtype(device) -> "torch.dtype":
    """The dtype a real checkpoint is loaded in (Chapter 40's rule, kept here so that a command
    never needs the learner's stub or the reference for it): float32 on a CPU, bfloat16 where
    the device computes it, else float16 on MPS and float32 elsewhere."""
    import torch
    device = torch.device(device)
    if device.type == "cpu":
        return torch.float32
    if device.type == "cuda" and torch.cuda.is_available():      # Ampere and later (or ROCm) compute bfloat16
        fast = bool(torch.version.hip) or torch.cuda.get_device_properties(device).major >= 8
        return torch.bfloat16 if fast else torch.float32
    if device.type == "xpu":
        return torch.bfloat16
    return torch.float16 if device.type == "mps" else torch.float32


def add_device_argument(parser) -> None:
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="cpu, cuda, cuda:N, mps, xpu, or auto (cuda, mps, xpu, cpu: the first present); "
                             "default: cuda when available, else cpu")


def add_model_argument(parser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="a Hugging Face checkpoint directory, a .gguf file, or smollm2 (SmolLM2-135M-Instruct, "
                             "fetched on first use; default: the tiny test model)")


def add_threads_argument(parser, help: str = "torch threads (default: 1 on CPU, torch's choice on CUDA)") -> None:
    """--threads, which course.commands._setup.set_threads applies."""
    parser.add_argument("--threads", type=int, default=None, help=help)


def resolve_device(choice: str | None):
    """The torch.device a command should use for `--device` (None: cuda when available),
    checked by the reference's Chapter 40 device module (the machinery never depends on a
    learner's unfinished stub)."""
    import torch

    from course import reference
    from course.impl import have_reference
    choice = choice or ("cuda" if torch.cuda.is_available() else "cpu")
    if not have_reference():            # a learner's edition: torch's own answer, no stub consulted
        if choice == "auto":
            present = [kind for kind in ("cuda", "mps", "xpu")
                       if getattr(torch, kind, None) is not None and getattr(torch, kind).is_available()]
            return torch.device(present[0] if present else "cpu")
        if choice.startswith("cuda") and not torch.cuda.is_available():
            raise CommandError(f"--device {choice}: torch sees no CUDA device here")
        return torch.device(choice)
    try:
        return reference().devices.pick_device(choice)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
