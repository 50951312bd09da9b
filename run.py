#!/usr/bin/env python3
"""The course's command line: `python run.py <command> [options]`.

Commands live in course/commands/<name>.py; `python run.py` lists them.
"""
import sys
from pathlib import Path

# Make `course` importable however run.py is started (python run.py, ./run.py, another cwd).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from course.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
