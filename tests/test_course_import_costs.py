"""course.import_costs: pytest processes do not compile jsonschema's IRI grammar unless they check an IRI."""
import subprocess
import sys

from course.manifest import ROOT

PROBE = """
import sys
import course
import nbformat, jsonschema                     # what nbval imports in every pytest process
print("grammar loaded at start:", "lark" in sys.modules)
checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
validator = jsonschema.Draft202012Validator({"format": "iri"}, format_checker=checker)
print("iri checks:", validator.is_valid("http://example.com/caf\\u00e9"), validator.is_valid("http://exa mple.com"))
"""


def test_the_iri_grammar_loads_on_first_use_and_checks_as_before():
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "grammar loaded at start: False" in run.stdout, "nbformat imported after course compiled the grammar"
    assert "iri checks: True False" in run.stdout, "jsonschema's iri format must still accept and refuse as before"
