"""Chapter 22 milestone: workloads and serving metrics.

Oracles: known distributions and numpy. Poisson arrivals must have exponential gaps (mean
1/rate, variance 1/rate^2, a Kolmogorov-Smirnov distance to the exponential CDF within the
1e-6 critical value) and Poisson counts per unit of time (variance equal to the mean);
`percentile` must equal numpy.percentile's default method; `summarize` must equal figures
computed here with numpy from the raw records. Tolerances are many standard errors wide, so
any correct sampler passes whatever its draw order; the seeds are fixed, so a run is
deterministic.
"""
import math

import numpy as np
import pytest

pytestmark = pytest.mark.chapter(22)


# --- Poisson arrivals ------------------------------------------------------------------------

@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_gaps_are_exponential(impl, rate):
    n = 20_000
    times = impl.workloads.poisson_arrivals(rate, n, seed=1)
    assert len(times) == n, f"asked for {n} arrival times, got {len(times)}"
    gaps = np.diff(np.concatenate([[0.0], np.asarray(times, dtype=np.float64)]))
    assert (gaps > 0).all(), "arrival times must increase, starting after time 0"
    mean, var = gaps.mean(), gaps.var()
    # Exponential(rate): mean 1/rate (standard error 1/(rate sqrt n)), variance 1/rate^2
    # (standard error sqrt(8/n)/rate^2). Allow 6 standard errors.
    assert abs(mean - 1 / rate) < 6 / (rate * math.sqrt(n)), f"mean gap {mean:.5f}, expected {1 / rate:.5f}"
    assert abs(var - 1 / rate**2) < 6 * math.sqrt(8 / n) / rate**2, (
        f"gap variance {var:.5g}, expected {1 / rate**2:.5g}")
    # Kolmogorov-Smirnov distance to the exponential CDF; 2.63/sqrt(n) is the 1e-6 critical value.
    ordered = np.sort(gaps)
    cdf = 1 - np.exp(-rate * ordered)
    ks = max((np.arange(1, n + 1) / n - cdf).max(), (cdf - np.arange(n) / n).max())
    assert ks < 2.63 / math.sqrt(n), f"KS distance {ks:.4f} to Exponential({rate}) is too large"


def test_poisson_counts_have_variance_equal_to_mean(impl):
    rate, horizon = 3.0, 4000
    times = np.asarray(impl.workloads.poisson_arrivals(rate, int(rate * horizon * 1.2), seed=2))
    counts = np.bincount(times[times < horizon].astype(int), minlength=horizon)
    assert abs(counts.mean() - rate) < 6 * math.sqrt(rate / horizon), f"mean arrivals per second {counts.mean():.3f}"
    dispersion = counts.var() / counts.mean()
    assert 0.85 < dispersion < 1.15, (
        f"variance/mean of counts per second is {dispersion:.3f}; a Poisson process gives 1")


def test_poisson_arrivals_are_seeded(impl):
    arrivals = impl.workloads.poisson_arrivals
    assert arrivals(2.0, 50, seed=7) == arrivals(2.0, 50, seed=7), "same seed must give the same arrival times"
    assert arrivals(2.0, 50, seed=7) != arrivals(2.0, 50, seed=8), "different seeds must give different times"
    assert all(isinstance(t, float) for t in arrivals(2.0, 5, seed=0)), "arrival times are floats"
    with pytest.raises(ValueError):
        arrivals(0.0, 5, seed=0)


# --- percentiles and summaries ---------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 5, 100, 101])
def test_percentile_matches_numpy(impl, n):
    rng = np.random.default_rng(n)
    values = list(rng.exponential(2.0, size=n))
    for q in (0, 1, 10, 25, 50, 75, 90, 99, 99.9, 100):
        try:
            got = impl.workloads.percentile(values, q)
        except IndexError as error:
            pytest.fail(f"p{q} of {n} values raised IndexError ({error}): ranks run from 0 (p0) to n - 1 (p100), "
                        "with linear interpolation between the two nearest ranks")
        want = float(np.percentile(values, q))
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12), (
            f"p{q} of {n} values: got {got}, numpy gives {want} (linear interpolation between the two nearest ranks)")


def test_percentile_small_cases(impl):
    percentile = impl.workloads.percentile
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5), "p50 of [1, 2, 3, 4] is 2.5 (values unsorted on input)"
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def make_records(workloads, seed=0, n=40):
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        arrival = float(rng.uniform(0, 10))
        first = arrival + float(rng.exponential(0.5))
        tokens = int(rng.integers(1, 30))
        finish = first + (tokens - 1) * float(rng.uniform(0.01, 0.05))
        records.append(workloads.RequestRecord(f"r{i}", arrival, first, finish, tokens))
    return records


def test_summarize_matches_numpy(impl):
    records = make_records(impl.workloads)
    got = impl.workloads.summarize(records)
    arrival = np.array([r.arrival_time for r in records])
    first = np.array([r.first_token_time for r in records])
    finish = np.array([r.finish_time for r in records])
    tokens = np.array([r.num_output_tokens for r in records])
    duration = finish.max() - arrival.min()
    multi = tokens >= 2
    expected = {"num_requests": len(records), "output_tokens": int(tokens.sum()), "duration_s": duration,
                "throughput_tok_s": tokens.sum() / duration, "requests_per_s": len(records) / duration}
    samples = {"ttft": first - arrival, "e2e": finish - arrival,
               "tpot": (finish[multi] - first[multi]) / (tokens[multi] - 1)}
    for name, values in samples.items():
        expected[f"{name}_mean"] = values.mean()
        for q in (50, 90, 99):
            expected[f"{name}_p{q}"] = np.percentile(values, q)
    missing = sorted(set(expected) - set(got))
    assert not missing, f"summarize() is missing keys {missing}"
    for key, want in expected.items():
        assert got[key] == pytest.approx(float(want), rel=1e-9), f"{key}: got {got[key]}, expected {float(want)}"


def test_tpot_ignores_single_token_requests(impl):
    rec = impl.workloads.RequestRecord
    records = [rec("a", 0.0, 1.0, 1.0, 1), rec("b", 0.0, 0.5, 2.5, 5)]
    got = impl.workloads.summarize(records)
    assert got["tpot_mean"] == pytest.approx(0.5), (
        f"tpot_mean {got['tpot_mean']}: request b has 4 gaps over 2 s (0.5 s/token) and a "
        f"one-token request has no TPOT at all")
    assert got["ttft_p50"] == pytest.approx(0.75)
    assert got["throughput_tok_s"] == pytest.approx(6 / 2.5)


def test_summarize_refuses_what_it_cannot_summarize(impl):
    rec = impl.workloads.RequestRecord
    with pytest.raises(ValueError):
        impl.workloads.summarize([])
    unfinished = rec("late", 0.0, 0.5, None, 3)
    try:
        impl.workloads.summarize([rec("a", 0.0, 1.0, 2.0, 4), unfinished])
    except ValueError as error:
        assert "late" in str(error), f"the refusal {error!r} must name the request without a finish_time, 'late'"
    else:
        pytest.fail("summarize accepted a request without a finish_time; it refuses one, naming it")


# --- workloads and replay --------------------------------------------------------------------

def test_shared_prefix_workload_shape(impl):
    items = impl.workloads.shared_prefix_workload()
    assert len(items) == 16
    prefix = items[0].prompt_ids[:192]
    for it in items:
        question = len(it.prompt_ids) - 192
        assert it.prompt_ids[:192] == prefix, f"{it.request_id}: does not start with the shared 192-token prefix"
        assert 8 <= question <= 48 and 8 <= it.max_tokens <= 40, f"{it.request_id}: lengths out of range"
        assert all(0 <= t < 256 for t in it.prompt_ids) and it.arrival_time == 0.0
    assert len({it.request_id for it in items}) == 16
    assert [it.prompt_ids for it in impl.workloads.shared_prefix_workload(seed=0)] == [it.prompt_ids for it in items]


def test_multi_turn_prompts_extend_the_previous_turn(impl):
    items = impl.workloads.multi_turn_workload(num_conversations=3, num_turns=4, seed=5)
    by_id = {it.request_id: it for it in items}
    for c in range(3):
        for t in range(1, 4):
            prev, cur = by_id[f"c{c}-t{t - 1}"], by_id[f"c{c}-t{t}"]
            assert cur.prompt_ids[:len(prev.prompt_ids)] == prev.prompt_ids, f"c{c}-t{t} does not extend c{c}-t{t - 1}"
            assert len(cur.prompt_ids) > len(prev.prompt_ids) + prev.max_tokens, (
                f"c{c}-t{t}: the prompt must hold the previous prompt, its answer and a new message")
            assert cur.arrival_time > prev.arrival_time


class FakeClock:
    """A clock the fake engine moves: each step costs exactly one second."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def skip_to(self, t):
        self.now = max(self.now, t)


class ChunkyEngine:
    """Serves requests one at a time, one second per step, up to `per_step` tokens per step;
    notes the clock at each add_request."""

    def __init__(self, clock, per_step):
        self.clock, self.per_step, self.queue, self.admitted = clock, per_step, [], {}

    def add_request(self, request_id, prompt_ids, max_new_tokens, stop_token_ids=()):
        self.admitted[request_id] = self.clock.now
        self.queue.append([request_id, max_new_tokens])

    @property
    def has_unfinished(self):
        return bool(self.queue)

    def step(self):
        self.clock.now += 1.0
        request_id, left = self.queue[0]
        take = min(self.per_step, left)
        self.queue[0][1] -= take
        if take == left:
            self.queue.pop(0)
        return [(request_id, [7] * take, take == left)]


def test_replay_records_queueing(impl):
    """Two requests at t=0 (3 and 2 tokens) and one at t=10 (1 token), served one token per
    second, one request at a time: b waits for a, c finds the server idle."""
    w = impl.workloads
    items = [w.WorkItem("a", [1], 3, 0.0), w.WorkItem("b", [1], 2, 0.0), w.WorkItem("c", [1], 1, 10.0)]
    clock = FakeClock()
    records = w.replay(ChunkyEngine(clock, per_step=1), items, clock=clock)
    expected = {"a": (1.0, 3.0), "b": (4.0, 5.0), "c": (1.0, 1.0)}     # (ttft, e2e)
    for request_id, (ttft, e2e) in expected.items():
        r = records[request_id]
        assert (r.ttft, r.e2e) == (ttft, e2e), (
            f"request {request_id}: ttft/e2e {(r.ttft, r.e2e)}, expected {(ttft, e2e)}")
    assert records["a"].tpot == 1.0 and records["c"].tpot is None


def test_replay_hands_requests_over_on_time_and_stamps_each_step(impl):
    """Items out of order: c (1 token) at t=10, a (3 tokens) and b (2 tokens) at t=0. The
    engine serves one request at a time, 2 tokens a second: a gets 2 tokens at t=1 and its
    last at t=2, b both at t=3; the engine is then idle until c arrives at 10 and is done at 11."""
    w = impl.workloads
    items = [w.WorkItem("c", [1], 1, 10.0), w.WorkItem("a", [1], 3, 0.0), w.WorkItem("b", [1], 2, 0.0)]
    clock = FakeClock()
    engine = ChunkyEngine(clock, per_step=2)
    records = w.replay(engine, items, clock=clock)
    assert sorted(records) == ["a", "b", "c"], f"one record per item, keyed by request_id; got {sorted(records)}"
    admitted = {"a": 0.0, "b": 0.0, "c": 10.0}
    assert engine.admitted == admitted, (
        f"handed to the engine at {engine.admitted}, expected {admitted}: each request is handed over in "
        f"order of arrival, as soon as the clock reaches its arrival_time (items may come in any order)")
    expected = {"a": ([1.0, 1.0, 2.0], 1.0, 2.0), "b": ([3.0, 3.0], 3.0, 3.0), "c": ([11.0], 11.0, 11.0)}
    for request_id, (times, first, finish) in expected.items():
        r = records[request_id]
        assert r.num_output_tokens == len(times), (
            f"request {request_id}: num_output_tokens {r.num_output_tokens}, expected {len(times)}: "
            f"num_output_tokens counts every token a step returned, not the steps")
        assert (r.token_times, r.finish_time) == (times, finish), (
            f"request {request_id}: token_times {r.token_times}, finish_time {r.finish_time}; expected {times}, "
            f"{finish}: one stamp per token, read from the clock when the step returns")
        assert r.first_token_time == first, (
            f"request {request_id}: first_token_time {r.first_token_time}, expected {first}: it is the stamp of "
            f"the step that returned the request's first token")
        assert r.arrival_time == admitted[request_id], f"request {request_id}: arrival_time is the item's"
