"""Chapter 14: profiling (a timer that waits for the device, shares by kind)."""
from . import Mistake

MILESTONE = "tests/test_ch14_profiling.py"
TREE = f"{MILESTONE}::test_op_shares_on_a_hand_built_tree"
DEVICE = f"{MILESTONE}::test_timer_waits_for_the_device"

MISTAKES = [
    Mistake("profiling.py", "op_shares",
            before="                break\n",
            after="",
            rule="each event's time goes to its innermost labelled range",
            expect="innermost kind",
            tests=(TREE,)),
    Mistake("profiling.py", "op_shares",
            before="event.self_device_time_total if device_time else event.self_cpu_time_total",
            after="event.cpu_time_total",
            rule="shares add self times, never inclusive ones (a parent's time already holds its children's)",
            expect="self time",
            tests=(TREE,)),
    Mistake("profiling.py", "op_shares",
            before="node: FunctionEvent | None = event\n",
            after="node: FunctionEvent | None = event.cpu_parent\n",
            rule="a labelled range's own self time belongs to its own kind",
            expect="the range's own self time included",
            tests=(TREE,)),
    Mistake("profiling.py", "op_shares",
            before="event.self_device_time_total if device_time else event.self_cpu_time_total",
            after="event.self_cpu_time_total",
            rule="with device_time the shares add device self times",
            expect="self time",
            tests=(TREE,)),
    Mistake("profiling.py", "time_it",
            before="        sync()\n        start = time.perf_counter()",
            after="        start = time.perf_counter()",
            rule="the clock starts after the device has finished earlier work",
            expect="sync before starting the clock",
            tests=(DEVICE,)),
    Mistake("profiling.py", "time_it",
            before="        fn()\n        sync()\n",
            after="        fn()\n",
            rule="the clock stops after the device has finished the call's work",
            expect="sync before reading the clock",
            tests=(DEVICE,)),
    Mistake("profiling.py", "time_it",
            before="for _ in range(warmup):",
            after="for _ in range(warmup - 1):",
            rule="warmup untimed calls run before the timed ones",
            expect="should call fn 4 times",
            tests=(DEVICE,)),
]

DECIDES = {
    "time_it": "where the waits for the device go so that each sample covers exactly one timed call's work, "
               "and which calls stay untimed",
    "op_shares": "which of the profiler's times to add so that nothing is counted twice, and how to find "
                 "the kind each event's time belongs to in a tree of nested labelled ranges",
}
DESIGN = ("op_shares",)
