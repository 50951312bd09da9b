"""Chapter 18: where decode time goes."""
from . import Mistake

MILESTONE = "tests/test_ch18_where_decode_time_goes.py"
STEP = f"{MILESTONE}::test_decode_step_seconds_times_the_right_step"
CHAIN = f"{MILESTONE}::test_launch_overhead_runs_a_chain"
REPORT = f"{MILESTONE}::test_decode_report_arithmetic"

MISTAKES = [
    Mistake("decode_timing.py", "decode_report",
            before="launch_seconds=num_ops * overhead_seconds",
            after="launch_seconds=overhead_seconds",
            rule="launch time is the number of operations times the overhead of one",
            expect="launch_seconds = num_ops * overhead_seconds",
            tests=(REPORT,)),
    Mistake("decode_timing.py", "decode_report",
            before="step_cost(model.cfg, 1, context, batch, _param_dtype(model))",
            after="step_cost(model.cfg, batch, context, 1, _param_dtype(model))",
            rule="a decode step is 1 new token per row over `context` cached ones, for `batch` rows",
            expect="step_cost",
            tests=(REPORT,)),
    Mistake("decode_timing.py", "decode_report",
            before="achieved_bandwidth=cost.bytes / step_seconds",
            after="achieved_bandwidth=cost.bytes / cost.time(hardware)",
            rule="achieved bandwidth is the bytes moved over the measured step time",
            expect="achieved bandwidth = bytes / step time",
            tests=(REPORT,)),
    Mistake("decode_timing.py", "decode_step_seconds",
            before="        cache.truncate(context)\n",
            after="",
            rule="every timed step starts from `context` cached tokens",
            expect="start from `context`",
            tests=(STEP,)),
    Mistake("decode_timing.py", "decode_step_seconds",
            before="    cache.advance(context)\n",
            after="",
            rule="the step is timed over a cache that holds `context` tokens",
            expect="start from `context`",
            tests=(STEP,)),
    Mistake("decode_timing.py", "decode_step_seconds",
            before="time_it(one_step, warmup=warmup,",
            after="time_it(one_step, warmup=0,",
            rule="warm-up steps run before the timed ones",
            expect="should make 4 calls",
            tests=(STEP,)),
    Mistake("decode_timing.py", "launch_overhead",
            before="for _ in range(num_ops):",
            after="for _ in range(num_ops - 1):",
            rule="the chain is num_ops operations long",
            expect="250 tiny operations expected",
            tests=(CHAIN,)),
    Mistake("decode_timing.py", "launch_overhead",
            before="time_it(chain, warmup=warmup,",
            after="time_it(chain, warmup=0,",
            rule="warm-up chains run before the timed ones",
            expect="250 tiny operations expected",
            tests=(CHAIN,)),
    Mistake("decode_timing.py", "launch_overhead",
            before="repeats=repeats, device=device).median / num_ops",
            after="repeats=1, device=device).median / num_ops",
            rule="the chain is timed `repeats` times",
            expect="250 tiny operations expected",
            tests=(CHAIN,)),
]

DECIDES = {
    "decode_step_seconds": "how to put a model in the state 'context tokens cached' cheaply and keep it there "
                           "across warm-up and repeats, when every call appends to the cache",
    "launch_overhead": "what computation isolates the fixed price of one operation (data too small to cost "
                       "anything, each operation depending on the last) and how to turn its time into a per-op figure",
    "decode_report": "which figures are measured and which predicted, which of them the batch changes, and how "
                     "to honour measurements the caller already has",
}
DESIGN = ("decode_step_seconds",)
