"""The skeleton: stubs found by the AST, bodies replaced, every other byte kept; drift
detection that ignores filled stubs; refusal to overwrite a learner's work."""
import ast
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from course import skeleton
from course.manifest import ROOT
from course.skeleton import SkeletonConflict, SkeletonError

from conftest import FAKE_CHAPTERS, write_tree


def generate(source_root, target_root, **kwargs):
    return skeleton.write_skeleton(source_root, target_root, known_chapters=FAKE_CHAPTERS, **kwargs)


def check(source_root, target_root):
    return skeleton.check_tree(source_root, target_root, known_chapters=FAKE_CHAPTERS)


def test_finds_every_stub_with_its_qualified_name_and_chapter(fake_package):
    stubs = skeleton.find_stubs((fake_package / "ops.py").read_text())
    assert [(s.qualname, s.chapter) for s in stubs] == [
        ("add", 1), ("Box.area", 2), ("Box.name", 2), ("outer.<locals>.inner", 3), ("only_doc", 3)]


def test_blanking_replaces_exactly_the_body():
    source = textwrap.dedent('''
        import os


        def f(x):
            """Brief.  (Your engine: Chapter 4)

            Details.
            """
            # how
            y = x + 1
            return y  # done
        # a trailing comment stays


        def g():
            return 2
    ''')
    expected = textwrap.dedent('''
        import os


        def f(x):
            """Brief.  (Your engine: Chapter 4)

            Details.
            """
            raise NotImplementedError("Your engine: Chapter 4: f")
        # a trailing comment stays


        def g():
            return 2
    ''')
    assert skeleton.blank_stubs(source) == expected


def test_keeps_tabs_crlf_and_docstring_only_bodies():
    source = 'class A:\r\n\tdef m(self):\r\n\t\t"""(Your engine: Chapter 1)"""\r\n\t\treturn 1\r\n'
    assert skeleton.blank_stubs(source) == (
        'class A:\r\n\tdef m(self):\r\n\t\t"""(Your engine: Chapter 1)"""\r\n'
        '\t\traise NotImplementedError("Your engine: Chapter 1: A.m")\r\n')
    only_doc = 'def f():\n    """(Your engine: Chapter 2)"""\n\nx = 1\n'
    assert skeleton.blank_stubs(only_doc) == (
        'def f():\n    """(Your engine: Chapter 2)"""\n'
        '    raise NotImplementedError("Your engine: Chapter 2: f")\n\nx = 1\n')
    no_final_newline = 'def f():\n    """(Your engine: Chapter 2)"""\n    return 1'
    assert skeleton.blank_stubs(no_final_newline).endswith('Chapter 2: f")')


def test_gating_blanks_only_later_chapters(fake_package):
    source = (fake_package / "ops.py").read_text()
    gated = skeleton.blank_stubs(source, after_chapter=2)
    assert "return total" in gated and "return w * h" in gated
    assert 'raise NotImplementedError("Your engine: Chapter 3: outer.<locals>.inner")' in gated
    assert skeleton.blank_stubs(source, after_chapter=3) == source


def outside_bodies(source):
    """The lines of a source that are not stub bodies, for the byte-preservation check."""
    lines = skeleton.split_lines(source)
    inside = set()
    for stub in skeleton.find_stubs(source):
        inside.update(range(stub.body_start, stub.body_end))
    return [line for i, line in enumerate(lines) if i not in inside]


def assert_skeleton_invariants(source, label):
    blanked = skeleton.blank_stubs(source, label)
    # Every byte outside the bodies survives, in order; each body is one raise line.
    assert outside_bodies(blanked) == outside_bodies(source), label
    stubs = skeleton.find_stubs(blanked, label)
    lines = skeleton.split_lines(blanked)
    assert all(s.body(lines).strip() == s.statement for s in stubs), label
    assert [s.qualname for s in stubs] == [s.qualname for s in skeleton.find_stubs(source, label)]
    assert skeleton.blank_stubs(blanked, label) == blanked, f"{label}: not idempotent"
    compile(blanked, label, "exec")


def test_round_trip_on_the_fake_package(fake_package):
    for path in fake_package.rglob("*.py"):
        assert_skeleton_invariants(path.read_text(), str(path))


def test_round_trip_on_the_real_solutions():
    files = sorted((ROOT / "solutions").rglob("*.py"))
    if not files:
        pytest.skip("solutions/ has no modules yet")
    for path in files:
        assert_skeleton_invariants(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))


def test_generated_stubs_raise_with_chapter_and_name(fake_package, tmp_path):
    target = tmp_path / "engine"
    generate(fake_package, target)
    namespace = {}
    exec(compile((target / "helpers.py").read_text(), "helpers", "exec"), namespace)
    ops = (target / "ops.py").read_text().replace("from .helpers import twice", "")
    exec(compile(ops, "ops", "exec"), namespace)
    with pytest.raises(NotImplementedError, match=r"^Your engine: Chapter 2: Box\.area$"):
        namespace["Box"]().area(2, 3)
    with pytest.raises(NotImplementedError, match="Chapter 3: only_doc"):
        namespace["only_doc"]()


def test_tree_copies_other_files_byte_for_byte_and_skips_caches(fake_package, tmp_path):
    (fake_package / "__pycache__").mkdir()
    (fake_package / "__pycache__" / "ops.cpython-311.pyc").write_bytes(b"\0")
    target = tmp_path / "engine"
    report = generate(fake_package, target)
    assert (target / "data/table.txt").read_bytes() == b"raw bytes\r\nstay as they are\n"
    assert (target / "helpers.py").read_bytes() == (fake_package / "helpers.py").read_bytes()
    assert not (target / "__pycache__").exists()
    assert sorted(report.written) == sorted(skeleton.package_files(fake_package))
    # A second run changes nothing; a file gone from the source goes from the target.
    assert generate(fake_package, target).written == []
    (fake_package / "helpers.py").unlink()
    (fake_package / "ops.py").write_text("X = 1\n")
    report = generate(fake_package, target)
    assert report.removed == ["helpers.py"] and not (target / "helpers.py").exists()
    shutil.rmtree(fake_package / "sub")
    (target / "sub" / "__pycache__").mkdir()
    assert sorted(generate(fake_package, target).removed) == ["sub/__init__.py", "sub/deep.py"]
    assert not (target / "sub").exists()


def test_concurrent_generation_of_one_tree_is_safe(fake_package, tmp_path):
    """pytest-xdist workers may build the same gated copy at the same moment."""
    files = skeleton.generate_tree(fake_package, after_chapter=1, known_chapters=FAKE_CHAPTERS)
    target = tmp_path / "cache" / "fake_at_1"
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: skeleton.materialize(files, target), range(16)))
    assert {rel: (target / rel).read_bytes() for rel in skeleton.package_files(target)} == files


def test_unknown_chapter_and_malformed_markers_are_errors(tmp_path):
    write_tree(tmp_path / "pkg", {"m.py": '''
        def f():
            """(Your engine: Chapter 99)"""
            return 1
    '''})
    with pytest.raises(SkeletonError, match=r"pkg/m.py:1: f: stub names Chapter 99"):
        generate(tmp_path / "pkg", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    bad = {
        "lowercase": 'def f():\n    """(your engine: chapter 1)"""\n    return 1\n',
        "class docstring": 'class C:\n    """(Your engine: Chapter 1)"""\n',
        "two chapters": 'def f():\n    """(Your engine: Chapter 1) (Your engine: Chapter 2)"""\n',
        "same line": 'def f():\n    """(Your engine: Chapter 1)"""; return 1\n',
        "nested stub": ('def f():\n    """(Your engine: Chapter 1)"""\n    def g():\n'
                        '        """(Your engine: Chapter 2)"""\n    return g\n'),
    }
    for what, source in bad.items():
        with pytest.raises(SkeletonError):
            skeleton.find_stubs(source, what)


def fill(path, old, new):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


STUB_RAISE_AREA = 'raise NotImplementedError("Your engine: Chapter 2: Box.area")'


def test_check_ignores_filled_stubs_but_names_drift(fake_package, tmp_path):
    target = tmp_path / "engine"
    generate(fake_package, target)
    assert check(fake_package, target) == []
    # A learner's filled stub, longer than the one-line raise, is not drift.
    fill(target / "ops.py", STUB_RAISE_AREA, "area = w * h\n        assert area >= 0\n        return area")
    assert check(fake_package, target) == []
    # An edit outside any stub body is, and the message names file and function.
    fill(target / "ops.py", "return twice(add(a, b))", "return twice(add(b, a))")
    fill(target / "sub/deep.py", "Uses Chapter 1's add.", "Uses add.")
    (target / "extra.py").write_text("")
    (target / "helpers.py").unlink()
    problems = "\n".join(check(fake_package, target))
    assert "engine/ops.py: doubled_sum: differs" in problems
    assert "engine/sub/deep.py: add_three: differs" in problems
    assert "engine/extra.py: not in fakepkg/" in problems
    assert "engine/helpers.py: missing" in problems
    assert "Box.area" not in problems


def test_check_notices_a_source_change_not_regenerated(fake_package, tmp_path):
    target = tmp_path / "engine"
    generate(fake_package, target)
    fill(fake_package / "ops.py", '"""Operations;', 'LIMIT = 3\n"""Operations;')
    fill(fake_package / "ops.py", "return inner() + 1", "return inner() + 2")
    problems = "\n".join(check(fake_package, target))
    assert "engine/ops.py: module level: differs" in problems
    assert "engine/ops.py: outer: differs" in problems


def test_regenerating_refuses_to_overwrite_filled_stubs(fake_package, tmp_path):
    target = tmp_path / "engine"
    generate(fake_package, target)
    fill(target / "ops.py", STUB_RAISE_AREA, "return w * h")
    fill(fake_package / "helpers.py", "2 * x", "x + x")      # the source moved on
    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    with pytest.raises(SkeletonConflict, match=r"engine/ops.py: Box.area"):
        generate(fake_package, target)
    assert before == {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    generate(fake_package, target, force=True)
    assert STUB_RAISE_AREA in (target / "ops.py").read_text()
    assert "x + x" in (target / "helpers.py").read_text()


def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_command_line_check_and_force(tmp_path):
    # The real book.toml governs chapter numbers here; the fake's 1-3 are all listed.
    source = write_tree(tmp_path / "src", {"m.py": '''
        def f():
            """(Your engine: Chapter 1)"""
            return 1
    '''})
    target = tmp_path / "dst"
    paths = ["--source", str(source), "--target", str(target)]
    assert run_cli("skeleton", "--check", *paths).returncode == 1
    assert run_cli("skeleton", *paths).returncode == 0
    assert run_cli("skeleton", "--check", *paths).returncode == 0
    fill(target / "m.py", 'raise NotImplementedError("Your engine: Chapter 1: f")', "return 1")
    (source / "m.py").write_text((source / "m.py").read_text() + "\nX = 1\n")
    result = run_cli("skeleton", "--check", *paths)
    assert result.returncode == 1 and "dst/m.py: module level" in result.stdout
    result = run_cli("skeleton", *paths)
    assert result.returncode == 2 and "dst/m.py: f" in result.stderr and "--force" in result.stderr
    assert run_cli("skeleton", "--force", *paths).returncode == 0


def test_real_stubs_name_chapters_of_the_manifest():
    if not (ROOT / "solutions").is_dir():
        pytest.skip("no solutions/ yet")
    skeleton.generate_tree(ROOT / "solutions")      # raises, naming each bad stub


def test_engine_is_the_skeleton_of_solutions():
    """The maintainer's guard: engine/ was regenerated after the last change to solutions/."""
    problems = skeleton.check_tree(ROOT / "solutions", ROOT / "engine")
    assert not problems, "engine/ is stale; run `python run.py skeleton`:\n" + "\n".join(problems)


def test_the_learners_package_docstring_is_its_own(fake_package, tmp_path):
    generate(fake_package, tmp_path / "engine")
    text = (tmp_path / "engine" / "__init__.py").read_text()
    assert text.startswith('"""' + skeleton.LEARNER_PACKAGE_DOC) and "A fake engine" not in text
    # A longer docstring keeps everything after its first paragraph (a map of the modules).
    (fake_package / "__init__.py").write_text('"""For maintainers.\n\nModules:\n    ops.py  the ops\n"""\nX = 1\n')
    generate(fake_package, tmp_path / "engine")
    text = (tmp_path / "engine" / "__init__.py").read_text()
    assert "For maintainers" not in text and text.endswith('\n\nModules:\n    ops.py  the ops\n"""\nX = 1\n')
    assert check(fake_package, tmp_path / "engine") == []
    engine_doc = (ROOT / "engine" / "__init__.py").read_text()
    assert "complete" not in engine_doc.split("\n\n")[0] and skeleton.LEARNER_PACKAGE_DOC in engine_doc


def _signatures(root):
    """{(file, qualified name): (arguments, return annotation) as AST dumps} of every stub."""
    found = {}
    for rel, stubs in skeleton.stubs_of_tree(root).items():
        by_line = {node.lineno: node for node in ast.walk(ast.parse((root / rel).read_text()))
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for stub in stubs:
            node = by_line[stub.lineno]
            found[rel, stub.qualname] = (ast.dump(node.args), ast.dump(node.returns) if node.returns else None)
    return found


def test_stubs_keep_their_annotations_in_the_skeleton():
    source = ("def f(x: 'torch.Tensor', n: int = 2) -> list[int]:\n"
              "    \"\"\"F.  (Your engine: Chapter 1)\"\"\"\n    return []\n")
    assert skeleton.blank_stubs(source).startswith("def f(x: 'torch.Tensor', n: int = 2) -> list[int]:\n")
    reference, learners = _signatures(ROOT / "solutions"), _signatures(ROOT / "engine")
    assert reference == learners, "engine/'s stubs must keep solutions/' signatures, annotations included"
    annotated = [name for name, (_, returns) in reference.items() if returns is not None]
    assert len(annotated) >= 50, f"only {len(annotated)} annotated stubs: the check would prove little"
