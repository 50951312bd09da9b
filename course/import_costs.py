"""Import costs the course does not want to pay in every process.

jsonschema, when it loads, imports `rfc3987_syntax` if it is installed (Jupyter's
dependencies install it) to check the "iri" formats. That module compiles a Lark grammar at
import: about 2.5 s of CPU on this course's machines. nbformat imports jsonschema, and nbval
imports nbformat, so every pytest process (each xdist worker, each grading and mistakes
child, each edition check) paid it, though almost none ever checks an IRI.

`defer_iri_grammar` puts a stand-in module in its place whose `is_valid_syntax` loads the
real one on its first call: jsonschema's "iri" checks behave as before, and only a process
that runs one pays for the grammar.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

_IRI_MODULE = "rfc3987_syntax"


def defer_iri_grammar() -> None:
    """Install the stand-in, unless the real module is loaded already or not installed."""
    if _IRI_MODULE in sys.modules or importlib.util.find_spec(_IRI_MODULE) is None:
        return
    stand_in = types.ModuleType(_IRI_MODULE, "loads the real rfc3987_syntax on first use")

    def is_valid_syntax(term: str, value: str) -> bool:
        if sys.modules.get(_IRI_MODULE) is stand_in:
            del sys.modules[_IRI_MODULE]
        real = importlib.import_module(_IRI_MODULE)
        return bool(real.is_valid_syntax(term, value))

    vars(stand_in)["is_valid_syntax"] = is_valid_syntax
    sys.modules[_IRI_MODULE] = stand_in
