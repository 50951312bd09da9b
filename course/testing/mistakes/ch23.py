"""Chapter 23: chunked prefill."""
from . import Mistake

MILESTONE = "tests/test_ch23_chunked_prefill.py"

MISTAKES = [
    Mistake("chunked.py", "prefill_chunked",
            before="prompt_ids[start:end]",
            after="prompt_ids[:end]",
            rule="each call feeds the next piece of the prompt only, never the tokens already in the cache",
            expect="expected calls of",
            tests=(f"{MILESTONE}::test_calls_are_chunks",)),
    Mistake("chunked.py", "prefill_chunked",
            before="logits if keep_logits else logits[-1:]",
            after="logits[-1:]",
            rule="keep_logits=True returns the logits of every prompt position",
            expect="keep_logits=True must give",
            tests=(f"{MILESTONE}::test_chunked_logits_equal_one_shot",)),
    Mistake("chunked.py", "prefill_chunked",
            before="kept[-1][0]",
            after="kept[0][0]",
            rule="the result is the logits of the prompt's last position, from the last chunk",
            expect="last position's logits",
            tests=(f"{MILESTONE}::test_chunked_logits_equal_one_shot",)),
    Mistake("chunked.py", "prefill_chunked",
            before="logits = model(ids, cache=cache)[0]",
            after="logits = model(ids)[0]",
            rule="every chunk goes through the cache, so it attends to the chunks before it",
            expect="differ from the one-shot prefill",
            tests=(f"{MILESTONE}::test_chunked_logits_equal_one_shot",)),
    Mistake("chunked.py", "generate_chunked",
            before="prefill_chunked(model, cache, prompt_ids, chunk_size)",
            after="prefill_chunked(model, cache, prompt_ids, len(prompt_ids))",
            rule="the prompt goes in chunks of chunk_size, then one call per new token",
            expect="in chunks of chunk_size",
            tests=(f"{MILESTONE}::test_generate_chunked_calls",)),
    Mistake("chunked.py", "generate_chunked",
            before="stops = set(stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set())",
            after="stops = set(stop_token_ids)",
            rule="the EOS token ends the output, included",
            expect="the EOS token ends the output",
            tests=(f"{MILESTONE}::test_generate_chunked_stops",)),
    Mistake("chunked.py", "generate_chunked",
            before="len(out) >= max_new_tokens",
            after="len(out) > max_new_tokens",
            rule="generation stops after max_new_tokens tokens",
            expect="differs from generate",
            tests=(f"{MILESTONE}::test_generate_chunked_equals_generate",)),
    Mistake("chunked.py", "serve_two",
            before="chunk_spans(len(long_prompt), len(long_prompt) if chunk_size is None else chunk_size)",
            after="chunk_spans(len(long_prompt), len(long_prompt))",
            rule="each step carries B's next chunk, not B's whole prompt",
            expect="each step runs B's next chunk",
            tests=(f"{MILESTONE}::test_serve_two_interleaves_b_chunks_with_a_decodes",)),
    Mistake("chunked.py", "serve_two",
            before="gaps.append(now - (last if last is not None else 0.0))",
            after="gaps.append(now)",
            rule="a_gaps are the waits between A's tokens, not times since B arrived",
            expect="running sums must be a_token_times",
            tests=(f"{MILESTONE}::test_serve_two_interleaves_b_chunks_with_a_decodes",)),
    Mistake("chunked.py", "serve_two",
            before="b_steps += 1",
            after="b_steps = 1",
            rule="b_steps counts every step that carried B's prefill",
            expect="take 3 steps",
            tests=(f"{MILESTONE}::test_serve_two_interleaves_b_chunks_with_a_decodes",)),
    Mistake("chunked.py", "serve_two",
            before="if end == len(long_prompt):",
            after="if step == len(spans):",
            rule="B's first token comes out of the step that runs B's last chunk",
            expect="B's first token comes out in step 3",
            tests=(f"{MILESTONE}::test_serve_two_interleaves_b_chunks_with_a_decodes",)),
]

DECIDES = {
    "prefill_chunked": (
        "how to cut the prompt into calls so that each call continues the cache the last one left, and which "
        "rows of logits are worth keeping"),
    "serve_two": (
        "where each of two requests keeps its state between steps (its own cache, its pending logits, how "
        "much of B's prompt is in) and in which order a step does their work, so that A's stall and B's first"
        " token can be timed"),
    "generate_chunked": (
        "how to reuse the decode loop of Chapter 16 unchanged behind a chunked prefill, with one cache sized "
        "for prompt and output"),
}

DESIGN = ("serve_two",)
