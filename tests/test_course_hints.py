"""Every stub of every chapter has at least one progressive hint in its chapter's notebook:
a collapsed admonition (`:class: dropdown`) whose title names the stub and says "hint".
(The docstring is the contract; the walk-through lives in the hints.)"""
import re

from course import manifest, skeleton
from course.manifest import ROOT

DROPDOWN = re.compile(r"```\{admonition\} ([^\n]*)\n\s*:class: dropdown")


def test_every_stub_has_a_hint():
    book = manifest.load()
    missing = []
    for stubs in skeleton.stubs_of_tree(ROOT / "solutions").values():
        for stub in stubs:
            text = (ROOT / book.chapter(stub.chapter).notebook_md).read_text(encoding="utf-8")
            titles = [t for t in DROPDOWN.findall(text) if "hint" in t.lower()]
            name = stub.qualname.rpartition(".")[2]
            if not any(re.search(rf"\b{re.escape(name)}\b", t) for t in titles):
                missing.append(f"Chapter {stub.chapter}: {stub.qualname}")
    assert not missing, "stubs without a hint dropdown in their chapter's notebook: " + ", ".join(missing)
