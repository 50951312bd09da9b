"""The bench runs Chapter 32's text quotes, read back from their saved JSON lines
(bench-runs/*.jsonl) and laid out as the tables its cells print. No plotting here, so a
test can render them without loading matplotlib."""
import json
import pathlib
import statistics

from course.notebook import table

# The profile's parts as the table heads them: words that can wrap, so the table fits the
# book's column (bench.PROFILE_PARTS names them with underscores).
PART_NAMES = {"build_batch": "build batch", "lm_head": "LM head", "other_forward": "rest of the forward",
              "bookkeeping": "after sampling"}


def read_bench_run(path):
    """(how the run was made, run.py bench's JSON lines) of a saved run: the file's first line
    holds the command, its start and end and the load average; the rest are the lines exactly
    as `python run.py bench` printed them."""
    header, *lines = [json.loads(text) for text in pathlib.Path(path).read_text(encoding="utf-8").splitlines()
                      if text.strip()]
    return header, lines


def _or_none(value):
    """A margin as printed: 0.0 is an exact tie, None means no divergence at all."""
    return "none" if value is None else value


def round_ratios(lines, workload, mine, theirs):
    """`mine`'s tok/s over `theirs`' in each round of one workload (the bench interleaves the
    contenders round by round, so round i of both ran minutes apart at most). `theirs` is a
    contender's label, or "best of transformers": the fastest hf contender of that round."""
    runs = {line["contender"]: line["tok_s_rounds"] for line in lines
            if line.get("workload") == workload and "tok_s_rounds" in line}
    if theirs == "best of transformers":
        rivals = [rounds for label, rounds in runs.items() if label.startswith("hf")]
        other = [max(values) for values in zip(*rivals)] if rivals else None
    else:
        other = runs.get(theirs)
    if mine not in runs or not other:
        return None
    return [a / b for a, b in zip(runs[mine], other)]


def bench_run_tables(path, pairs=(("core/vectorised", "core/reference"), ("core/vectorised", "best of transformers"),
                                  ("core/vectorised", "ch24 slots"), ("core/vectorised", "llama.cpp batched, F32"),
                                  ("core/vectorised", "llama.cpp batched, Q4_1"))):
    """A saved run as the reader's tables: how it was made; every contender's best round and
    every round; each pair's ratio of best rounds and its spread over the rounds; and the
    profiles (share of a core step per part) when the run has them. Each row starts with a
    label no other row contains ("serving:scale=0.25: core/vectorised", "…: ratio …",
    "…: profile …"), so a sentence can name the row it quotes."""
    header, lines = read_bench_run(path)
    made = (f"{header['command']}\nstarted {header['started']}, finished {header['finished']}; load average "
            f"{header['load_average_at_start']} at the start, {header['load_average_at_end']} at the end")
    shown = [made]
    roofs = [line["roofline"] for line in lines if "roofline" in line and "contender" not in line]
    for roof in roofs:
        rates = ", ".join(f"{dtype} {rate} TFLOP/s" for dtype, rate in roof["matmul_tflops"].items())
        shown.append(f"this machine, {roof['threads']} thread: matmul {rates}; copy bandwidth "
                     f"{roof['memory_gb_s']} GB/s")
    runs = [line for line in lines if "contender" in line]
    roofline = any("roofline" in line for line in runs)
    rows = []
    for line in runs:
        row = [f"{line['workload']}: {line['contender']}", line["tok_s"],
               ", ".join(f"{rate:g}" for rate in line["tok_s_rounds"])]
        if roofline:
            share = line.get("roofline", {})
            row += [share.get("of_matmul_peak", ""), share.get("of_memory_bandwidth", "")]
        rows.append(row)
    dtypes = ", ".join(dict.fromkeys(line["dtype"] for line in runs))
    headers = [f"workload: contender ({dtypes})", "tok/s, best round", "tok/s, every round"]
    shown.append(table(rows, headers + (["of matmul rate", "of bandwidth"] if roofline else [])))
    held = [line for line in runs if "agreement" in line]
    if held:        # a reduced-precision run: held to transformers by agreement, not equality
        shown.append(table([[f"{line['workload']}: {line['contender']}", line["agreement"]["identical_requests"],
                             line["agreement"]["tokens_in_common_prefix"],
                             _or_none(line["agreement"]["widest_divergence_margin"])] for line in held],
                           [f"against {held[0]['agreement_with']}", "requests identical",
                            "share of tokens before a divergence", "widest margin at a divergence"]))
    ratios = []
    for workload in dict.fromkeys(line["workload"] for line in runs):
        for mine, theirs in pairs:
            each = round_ratios(runs, workload, mine, theirs)
            if each is None:
                continue
            best = ratio_of_best(runs, workload, mine, theirs)
            ratios.append([f"{workload}: ratio {mine} / {theirs}", f"{best:.2f}", f"{statistics.median(each):.2f}",
                           f"{min(each):.2f} to {max(each):.2f}"])
    if ratios:
        shown.append(table(ratios, ["workload: ratio", "of best rounds", "median round", "rounds, lowest to highest"]))
    profiles = [line for line in lines if "profile" in line]
    if profiles:
        parts = list(profiles[0]["percent_of_step_time"])
        shown.append(table([[f"{line['workload']}: profile {line['profile']}",
                             *(f"{line['percent_of_step_time'][part]:.1f}" for part in parts)] for line in profiles],
                           ["workload: profile, percent of a step"] + [PART_NAMES.get(part, part) for part in parts]))
    return shown


def ratio_of_best(lines, workload, mine, theirs):
    """`mine`'s best round over `theirs`' best (over the best hf contender's, for "best of
    transformers"), as the bench's summary line computes it."""
    best = {line["contender"]: line["tok_s"] for line in lines if line.get("workload") == workload}
    other = max(v for k, v in best.items() if k.startswith("hf")) if theirs == "best of transformers" else best[theirs]
    return best[mine] / other
