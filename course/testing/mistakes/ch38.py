"""Chapter 38: the HTTP server's stubs (server-sent events, admission, text streams, the engine loop)."""
from . import Mistake

MILESTONE = "tests/test_ch38_http_api.py"
SSE = f"{MILESTONE}::test_sse_event_frames_one_json_line_then_a_blank_line"
ADMISSION = f"{MILESTONE}::test_admission_control_bounds_the_server"
TEXT = (f"{MILESTONE}::test_text_stream_cuts_at_stop_strings_and_holds_back_prefixes",
        f"{MILESTONE}::test_text_stream_cuts_at_the_stop_string_completed_first_not_the_first_listed",
        f"{MILESTONE}::test_text_stream_stops_at_the_stop_string_completed_first_whatever_the_chunking",
        f"{MILESTONE}::test_text_stream_matches_a_char_by_char_oracle_for_any_chunking",
        f"{MILESTONE}::test_text_stream_equals_decode_then_cut")
LOOP = (f"{MILESTONE}::test_engine_loop_applies_aborts_before_the_next_step",
        f"{MILESTONE}::test_a_planted_delivery_fault_costs_its_submission_alone")

MISTAKES = [
    Mistake("server/app.py", "sse_event",
            before='json.dumps(data, ensure_ascii=False, separators=(",", ":"))',
            after="json.dumps(data)",
            rule="the payload is compact JSON with non-ASCII characters written as themselves",
            expect="compact JSON", tests=(SSE,)),
    Mistake("server/app.py", "sse_event",
            before="ensure_ascii=False",
            after="ensure_ascii=True",
            rule="non-ASCII characters are written as themselves: the stream is UTF-8",
            expect="non-ASCII written as itself", tests=(SSE,)),
    Mistake("server/app.py", "sse_event",
            before='return f"data: {payload}\\n\\n"',
            after='return f"data: {payload}\\n"',
            rule="an event ends with a blank line",
            expect="a blank line", tests=(SSE,)),
    Mistake("server/app.py", "sse_event",
            before="payload = data if isinstance(data, str) else json.dumps(",
            after="payload = json.dumps(",
            rule="[DONE] is sent as the bare string, not as JSON",
            expect="bare string [DONE]", tests=(SSE,)),
    Mistake("server/loop.py", "AdmissionControl.try_admit",
            before="if self.inside + count > self.capacity:",
            after="if self.inside + count >= self.capacity:",
            rule="the server holds up to its capacity, the last place included",
            expect="the last place included", tests=(ADMISSION,)),
    Mistake("server/loop.py", "AdmissionControl.try_admit",
            before="if count > self.capacity:",
            after="if count > self.capacity - self.inside:",
            rule="a request that may fit later is QueueFull (a 429), only one above the capacity a ValueError (a 400)",
            expect="QueueFull (a 429", tests=(ADMISSION,)),
    Mistake("server/loop.py", "AdmissionControl.try_admit",
            before="self.inside += count",
            after="self.inside += 1",
            rule="n samples take n places",
            expect="n samples take n places", tests=(ADMISSION,)),
    Mistake("server/text.py", "TextStream.push",
            before="_, start = min(completed)",
            after="_, start = completed[0]",
            rule="the text ends before the stop string completed first, not the first one listed",
            expect="completed FIRST", tests=TEXT),
    Mistake("server/text.py", "TextStream.push",
            before="_, start = min(completed)",
            after="start = min(at for _, at in completed)",
            rule="the stop string that ends first wins, not the one that starts first: the text sent does not "
                 "depend on how the output was cut into pushes",
            expect="whatever the chunking", tests=TEXT),
    Mistake("server/text.py", "TextStream.push",
            before="_, start = min(completed)",
            after="_, start = min(completed, key=lambda found: found[0])",
            rule="of two stop strings completed by the same character, the longer one cuts the text",
            expect="the longest, of two completed by the same character", tests=TEXT),
    Mistake("server/text.py", "TextStream.push",
            before="keep = stop_prefix_overlap(self.pending, self.stops)",
            after="keep = 0",
            rule="a tail that could still grow into a stop string is held back",
            expect="must wait", tests=TEXT),
    Mistake("server/text.py", "TextStream.push",
            before="if self.stopped:",
            after="if self.stopped and not token_ids:",
            rule="after a stop string every later push sends nothing",
            expect="every later push sends nothing", tests=TEXT),
    Mistake("server/text.py", "TextStream.push",
            before="self.pending[:start]",
            after="self.pending[:start + 1]",
            rule="the stop string itself is never sent",
            expect="just before the stop string", tests=TEXT),
    Mistake("server/loop.py", "EngineLoop.run_once",
            before="self.drop(submission, engine_id)",
            after="pass",
            rule="an abort in the inbox takes effect before the next step",
            expect="must not run in the next step", tests=LOOP),
    Mistake("server/loop.py", "EngineLoop.run_once",
            before="self.hand(submission, ACCEPTED)",
            after="pass",
            rule="an admitted submission hears ACCEPTED before any output",
            expect="hears ACCEPTED", tests=LOOP),
    Mistake("server/loop.py", "EngineLoop.run_once",
            before="self.routes.pop(output.request_id, None)",
            after="self.routes.get(output.request_id)",
            rule="a finished request's route is removed",
            expect="route is removed", tests=LOOP),
    Mistake("server/loop.py", "EngineLoop.run_once",
            before="self.hand(owner, output)",
            after="owner.deliver(output)",
            rule="deliveries go through self.hand: a deliver that raises costs its own submission alone",
            expect="costs its own submission alone", tests=LOOP),
]

DECIDES = {
    "sse_event":
        "how to frame one event so a client's parser splits the stream where it should: one compact line of UTF-8 "
        "JSON and the blank line that ends it",
    "EngineLoop.run_once":
        "in which order the inbox, the step and the routing happen so an abort is never a step late, and where "
        "each kind of failure is contained so it costs one request, not the loop",
    "AdmissionControl.try_admit":
        "when a request is refused for good (400) or for now (429), and how to refuse without changing the count",
    "TextStream.push":
        "which text may leave now and which tail must wait, so that no stop string, not even its start, ever "
        "reaches the client",
}

DESIGN = ("EngineLoop.run_once",)
