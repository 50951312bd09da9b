"""Writes xgrammar.json and outlines-core.json: the JSON schemas the two projects' own tests
compile, each with the texts those tests say must be accepted or refused, for
tests/test_guide_schemas.py (licence and sources in README.md here).

Only data is taken: schemas and instance texts. Each record is
{"source": file, "test": test name, "schema", "options", "accepted": [texts], "refused": [texts]},
one per (test, schema, options); "options" are the peer's converter options the test passed
(whitespace, strict mode), which the suite maps onto ours or skips.

- xgrammar (Python tests): the test files run under pytest against a stand-in `xgrammar`
  module that records each schema given to Grammar.from_json_schema and each text given to
  the acceptance check. The stand-in cannot know the peer's verdict, so each test is re-run
  answering call by call: a call whose answer makes the test fail right after it has its
  answer flipped, until the test passes; the answers that pass are the test's expectations.
  A test that fails for another reason (it expects an error, it needs a tokenizer) keeps
  only the calls settled before the failure.
- outlines-core (Rust tests): the table of (schema, regex, matching texts, non-matching
  texts) in src/json_schema/mod.rs's test_schema_matches_regex is read as Rust literals.

Run it from the repository root with the two repositories' git directories:

    python tests/data/peer_tables/make_peer_tables.py XGRAMMAR_GIT OUTLINES_CORE_GIT
"""
import json
import pathlib
import subprocess
import sys
import tempfile
import types

import pytest

HERE = pathlib.Path(__file__).parent
# test_grammar_matcher_json_schema.py is left out: it needs a tokenizer (transformers) to import.
XGRAMMAR_FILES = ("tests/python/test_json_schema_converter.py", "tests/python/test_json_schema_direct_converter.py")
OUTLINES_FILE = "src/json_schema/mod.rs"
MAX_RERUNS = 400


def git_show(git_dir: str, path: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, "show", f"HEAD:{path}"], check=True,
                          capture_output=True, text=True).stdout


def git_commit(git_dir: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


# --- xgrammar: its tests run against a recording stand-in ---------------------------------------

class Recorder:
    """The state of one test's run: the answers to give, and the calls made so far."""

    def __init__(self):
        self.answers: list[bool] = []
        self.calls: list[tuple[object, dict, str]] = []   # (schema, options, text)
        self.schemas: list[tuple[object, dict]] = []

    def accept(self, grammar, text: str, **_ignored) -> bool:
        self.calls.append((grammar.schema, grammar.options, text))
        index = len(self.calls) - 1
        return self.answers[index] if index < len(self.answers) else True


RECORDER = Recorder()


class StandInGrammar:
    def __init__(self, schema, options):
        self.schema, self.options = schema, options

    @classmethod
    def from_json_schema(cls, schema, **options):
        if not isinstance(schema, str):               # a pydantic model class or a dict
            schema = schema.model_json_schema() if hasattr(schema, "model_json_schema") else schema
            schema = json.dumps(schema)
        grammar = cls(json.loads(schema), {key: value for key, value in options.items() if value is not None})
        RECORDER.schemas.append((grammar.schema, grammar.options))
        return grammar


def unavailable(*_args, **_kwargs):
    raise NotImplementedError("the stand-in records schemas only")


def install_stand_in() -> None:
    package = types.ModuleType("xgrammar")
    testing = types.ModuleType("xgrammar.testing")
    package.Grammar = StandInGrammar
    package.testing = testing
    for name in ("GrammarFunctor", "_generate_float_regex", "_generate_range_regex", "_json_schema_to_ebnf",
                 "_get_masked_tokens_from_bitmask", "_get_matcher_from_grammar_and_tokenizer_info"):
        setattr(testing, name, unavailable)
    testing._is_grammar_accept_string = RECORDER.accept
    package.__getattr__ = lambda name: unavailable      # GrammarMatcher, TokenizerInfo ...: not recorded
    testing.__getattr__ = lambda name: unavailable
    sys.modules["xgrammar"], sys.modules["xgrammar.testing"] = package, testing


class AnswerSearch:
    """A pytest plugin that runs each test until the recorded answers let it pass."""

    def __init__(self, source: str):
        self.source = source
        self.records: dict = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem):
        arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        answers: list[bool] = []                          # answers chosen so far; later calls get True
        settled, refused_by_peer = 0, False
        for _ in range(MAX_RERUNS):
            RECORDER.answers, RECORDER.calls, RECORDER.schemas = list(answers), [], []
            try:
                pyfuncitem.obj(**arguments)
                settled, refused_by_peer = len(RECORDER.calls), False
                break
            except BaseException as error:              # noqa: BLE001 - pytest.fail raises outside Exception
                refused_by_peer = "DID NOT RAISE" in str(error)
                failed_at = len(RECORDER.calls) - 1
                if failed_at < len(answers):            # no call, or both answers fail here: not a verdict
                    settled = max(failed_at, 0)
                    break
                answers += [True] * (failed_at - len(answers)) + [False]
        self.keep(pyfuncitem.originalname, RECORDER.schemas, RECORDER.calls[:settled], answers, refused_by_peer)
        return True

    def keep(self, test, schemas, calls, answers, refused_by_peer):
        for schema, options in schemas:
            entry = self.entry(test, schema, options)
            if refused_by_peer and not calls:          # the test expected the peer to refuse the schema
                entry["peer_refuses"] = True
        for (schema, options, text), accepted in zip(calls, answers + [True] * len(calls)):
            entry = self.entry(test, schema, options)
            bucket = entry["accepted" if accepted else "refused"]
            if text not in bucket:
                bucket.append(text)

    def entry(self, test, schema, options):
        key = (test, json.dumps(schema, sort_keys=True), json.dumps(options, sort_keys=True))
        if key not in self.records:
            self.records[key] = {"source": self.source, "test": test, "schema": schema, "options": options,
                                 "accepted": [], "refused": []}
        return self.records[key]


def xgrammar_table(git_dir: str) -> list[dict]:
    install_stand_in()
    records = []
    with tempfile.TemporaryDirectory() as folder:
        for path in XGRAMMAR_FILES:
            local = pathlib.Path(folder) / pathlib.Path(path).name
            local.write_text(git_show(git_dir, path), encoding="utf-8")
            plugin = AnswerSearch(path)
            pytest.main([str(local), "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", folder,
                         "-c", "/dev/null", "--no-header", "-o", "addopts="], plugins=[plugin])
            records += plugin.records.values()
    return records


# --- outlines-core: the Rust table read as literals ---------------------------------------------

def rust_items(text: str, start: int, closer: str) -> tuple[list[str], int]:
    """Splits text[start:] at top-level commas up to the bracket `closer`; returns the pieces
    and the index after the closer. Strings (r#"..."#, r"...", "...") and // comments are skipped whole."""
    pieces, depth, index, begin = [], 0, start, start
    while True:
        char = text[index]
        if text.startswith("//", index):
            index = text.index("\n", index)
            continue
        if char == "r" and text[index + 1] in '#"' and not text[index - 1].isalnum():
            hashes = len(text[index + 1:]) - len(text[index + 1:].lstrip("#"))
            end = text.index('"' + "#" * hashes, index + 2 + hashes)
            index = end + 1 + hashes
            continue
        if char == '"':
            index += 1
            while text[index] != '"':
                index += 2 if text[index] == "\\" else 1
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0 and char == closer:
                pieces.append(without_comments(text[begin:index]))
                return [piece for piece in pieces if piece], index + 1
            depth -= 1
        elif char == "," and depth == 0:
            pieces.append(without_comments(text[begin:index]))
            begin = index + 1
        index += 1


def without_comments(piece: str) -> str:
    return "\n".join(line for line in piece.splitlines() if not line.strip().startswith("//")).strip()


def rust_string(literal: str) -> str:
    literal = literal.strip()
    if literal.startswith("r"):
        hashes = len(literal[1:]) - len(literal[1:].lstrip("#"))
        return literal[2 + hashes:len(literal) - 1 - hashes]
    return json.loads(literal)       # the table's plain literals use only JSON's escapes


def rust_strings(vector: str) -> list[str]:
    inner = vector.strip()
    assert inner.startswith("vec![") and inner.endswith("]"), inner[:40]
    pieces, _ = rust_items(inner, len("vec!["), "]")
    return [rust_string(piece) for piece in pieces]


def outlines_table(git_dir: str) -> list[dict]:
    source = git_show(git_dir, OUTLINES_FILE)
    body = source.index("[", source.index("for (schema, regex, a_match, not_a_match) in"))
    rows, _ = rust_items(source, body + 1, "]")
    records = []
    for row in rows:
        assert row.startswith("("), row[:40]
        schema, _regex, matching, not_matching = rust_items(row, 1, ")")[0]
        records.append({"source": OUTLINES_FILE, "test": "test_schema_matches_regex",
                        "schema": json.loads(rust_string(schema)), "options": {},
                        "accepted": rust_strings(matching), "refused": rust_strings(not_matching)})
    return records


def main(xgrammar_git: str, outlines_git: str) -> None:
    for name, git_dir, table in (("xgrammar", xgrammar_git, xgrammar_table),
                                 ("outlines-core", outlines_git, outlines_table)):
        records = table(git_dir)
        out = HERE / f"{name}.json"
        document = {"repository": name, "commit": git_commit(git_dir), "cases": records}
        out.write_text(json.dumps(document, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
        print(f"{name}: {len(records)} schemas, {sum(len(r['accepted']) + len(r['refused']) for r in records)} "
              f"texts written to {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
