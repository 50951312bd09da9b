"""Engine core reliability (issue 6, part 5): grading a learner's engine that misbehaves.

Four copies of the reference engine, each with one fault in Chapter 31's engine core
(course.grading.faults): `schedule` loops forever, `schedule` raises, `schedule` calls os._exit,
`free` leaks a block per request. `python run.py grade` must charge each fault to the
milestones it breaks, with the reason, and still print the whole table (every chapter up to
31, the totals line) and write the JSON.

The default run grades a reduced Chapter 31 milestone (three tests: one the faults cannot
reach, one end-to-end generation, one that runs after it) so the four grades take seconds
each; `--stress` grades the real tests/test_ch31_engine_v2.py against all four.
"""
import json
import os
import subprocess
import sys

import pytest

from course import manifest
from course.grading import faults
from course.manifest import ROOT

from conftest import write_tree

CH31 = manifest.load().chapter(31)
MILESTONE_NAME = CH31.milestone.split("/")[-1]

REDUCED_MILESTONE = '''
    import pytest
    import torch

    from course.testing.oracles import TINY_EOS, assert_engine_idle, solo

    pytestmark = pytest.mark.chapter(31)


    def test_block_keys_chain(impl):
        hash_block = impl.load("serve.blocks").hash_block
        assert hash_block(None, [1, 2, 3]) != hash_block(None, [1, 2, 4])


    def test_generate_matches_solo_and_frees_everything(impl, tiny_model, ref_model):
        torch.set_num_threads(1)
        serve = impl.load("serve.engine")
        config = impl.load("serve.config").EngineConfig(block_size=4, num_blocks=32)
        engine = serve.EngineCore(tiny_model, config, eos_token_id=TINY_EOS)
        params = impl.load("serve.request").SamplingParams(max_tokens=6)
        prompts = [list(range(5, 19)), list(range(40, 47))]
        for prompt, out in zip(prompts, engine.generate(prompts, params)):
            assert out.output_token_ids == solo(ref_model, prompt, 6)
        assert_engine_idle(engine)


    def test_config_is_validated(impl):
        with pytest.raises(ValueError, match="block_size"):
            impl.load("serve.config").EngineConfig(block_size=0)
'''

# fault -> (what the failed generation test must say, does the test after it still pass)
EXPECTED = {
    "hang": ("Timeout", True),
    "raise": (faults.RAISED, True),
    "exit": (f"exited abruptly with status {faults.EXIT_STATUS} (os._exit?) during this test", True),
    "leak": ("blocks leaked", True),
}


# Per-test limits (seconds). The hang fails by its limit, and the limit is all it costs: a busy
# loop holding a core that long. The other faults must let the generation test run to its end
# (the models' set-up, a reference generation) on a loaded machine, so theirs stays generous.
HANG_TEST_TIMEOUT = 3
TEST_TIMEOUT = 10


def grade_command(checkout, json_path, *extra):
    return [sys.executable, str(ROOT / "run.py"), "grade", "--impl", str(checkout), "--json", str(json_path), *extra]


def run_all(commands, timeout):
    """Run the grade commands side by side; returns (returncode, stdout, stderr) per command."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append((p.returncode, out, err))
    return results


def test_grading_survives_a_broken_engine_core(tmp_path):
    tests_dir = write_tree(tmp_path / "milestones", {MILESTONE_NAME: REDUCED_MILESTONE})
    checkouts = {name: faults.broken_engine(tmp_path / name, name) for name in EXPECTED}
    commands = [grade_command(checkouts[name], tmp_path / f"{name}.json", "--upto", "31", "--tests-dir",
                              str(tests_dir), "--test-timeout",
                              str(HANG_TEST_TIMEOUT if name == "hang" else TEST_TIMEOUT), "--chapter-timeout", "150")
                for name in EXPECTED]
    titles = [c.title for c in manifest.load().chapters if c.number <= 31]
    for name, (code, out, err) in zip(EXPECTED, run_all(commands, timeout=280)):
        said, after_passes = EXPECTED[name]
        assert code == 1, f"[{name}] grade exited {code}, want 1 (a milestone failed)\n{out}\n{err[-2000:]}"
        # The whole table: every chapter up to 31 has its row, then the totals line.
        missing = [t for t in titles if t not in out]
        assert not missing, f"[{name}] the table lost rows for {missing[:3]}...\n{out}"
        assert "2/3 milestones passed in 1 chapter(s)" in out, f"[{name}] totals line missing or wrong\n{out}"
        data = json.loads((tmp_path / f"{name}.json").read_text())
        [ch31] = [c for c in data["chapters"] if c["number"] == 31]
        tests = {t["nodeid"].rpartition("::")[2]: t for t in ch31["tests"]}
        assert ch31["status"] == "partial", f"[{name}] chapter 31 is {ch31['status']}: {tests}"
        assert tests["test_block_keys_chain"]["outcome"] == "passed", f"[{name}] {tests['test_block_keys_chain']}"
        broken = tests["test_generate_matches_solo_and_frees_everything"]
        assert broken["outcome"] == "failed" and said in broken["message"], (
            f"[{name}] the generation test should fail saying {said!r}: {broken}")
        assert (tests["test_config_is_validated"]["outcome"] == "passed") == after_passes, (
            f"[{name}] the test after the fault: {tests['test_config_is_validated']}")
        assert said[:40] in out, f"[{name}] the table's failure list does not give the reason {said!r}\n{out}"
        assert all(c["status"] == "no milestone" for c in data["chapters"] if c["number"] != 31)


@pytest.mark.timeout(1800)
def test_grading_the_real_chapter_31_milestone_under_faults(request, tmp_path):
    """--stress: the real milestone file against every fault."""
    if not request.config.getoption("stress"):
        pytest.skip("grades the whole Chapter 31 milestone four times: run with --stress")
    checkouts = {name: faults.broken_engine(tmp_path / name, name) for name in EXPECTED}
    commands = [grade_command(checkouts[name], tmp_path / f"{name}.json", "--chapter", "31",
                              "--test-timeout", "5", "--chapter-timeout", "900") for name in EXPECTED]
    for name, (code, out, err) in zip(EXPECTED, run_all(commands, timeout=1500)):
        said, _ = EXPECTED[name]
        assert code == 1, f"[{name}] grade exited {code}\n{out}\n{err[-2000:]}"
        assert CH31.title in out and "milestones passed in 1 chapter(s)" in out, out
        [ch31] = json.loads((tmp_path / f"{name}.json").read_text())["chapters"]
        failed = [t for t in ch31["tests"] if t["outcome"] == "failed"]
        passed = [t for t in ch31["tests"] if t["outcome"] == "passed"]
        assert failed and passed, f"[{name}] want some milestones failed and some passed: {ch31['status']}"
        assert all(t["message"] for t in failed), f"[{name}] a failed milestone without a reason"
        assert any(said in t["message"] for t in failed), f"[{name}] no failure says {said!r}"
