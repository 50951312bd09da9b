"""The course's own machinery: the manifest, stubs and the skeleton, implementation loading
and gating, progress, grading, notebook helpers and the book build. Nothing here is part of
the engine a learner builds; the engine lives in solutions/ (reference) and engine/."""
from .import_costs import defer_iri_grammar

defer_iri_grammar()     # before anything imports jsonschema (nbval does, in every pytest run)


def reference():
    """The full reference implementation (`solutions`, no stub removed) as a
    `course.impl.Impl`: `course.reference().sampling.generate`, `.load("serve.engine")`,
    and `.package` for the module itself. Oracles use it for solo generate."""
    from .impl import reference as _reference
    return _reference()
