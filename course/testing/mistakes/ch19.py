"""Chapter 19: the fast decoder (a static cache, fixed buffers, CUDA graphs on a GPU)."""
from . import Mistake

MILESTONE = "tests/test_ch19_fast_decoder.py"
UPDATE = f"{MILESTONE}::test_static_cache_update_writes_at_device_length"
STEP = f"{MILESTONE}::test_step_takes_an_int_or_a_tensor_and_refuses_a_full_decoder"

MISTAKES = [
    Mistake("fast_decoder.py", "StaticKVCache.update",
            before="self.length[:, None] + self.offsets[:new]",
            after="self.length[:1, None] + self.offsets[:new]",
            rule="each row's new entries land at that row's own length",
            expect="their own lengths",
            tests=(UPDATE,)),
    Mistake("fast_decoder.py", "StaticKVCache.update",
            before="self.offsets[:new]",
            after="self.offsets[1:new + 1]",
            rule="the first new entry goes to slot length, not length + 1",
            expect="their own lengths",
            tests=(UPDATE,)),
    Mistake("fast_decoder.py", "StaticKVCache.update",
            before="self.v[layer].scatter_(2, index, v)",
            after="self.v[layer].scatter_(2, index, k)",
            rule="the values go to the same slots as the keys",
            expect="values must go to the same slots",
            tests=(UPDATE,)),
    Mistake("fast_decoder.py", "StaticKVCache.update",
            before="return self.k[layer], self.v[layer]",
            after="return self.k[layer][:, :, :new], self.v[layer][:, :, :new]",
            rule="update returns the whole buffers, so every call sees tensors of one shape",
            expect="must return the whole",
            tests=(UPDATE,)),
    Mistake("fast_decoder.py", "FastDecoder.step",
            before="if self.filled >= self.max_len:",
            after="if self.filled > self.max_len:",
            rule="a full decoder refuses a step with ValueError before writing",
            expect="refuses a step with ValueError",
            tests=(STEP,)),
    Mistake("fast_decoder.py", "FastDecoder.step",
            before="        self.filled += 1\n",
            after="",
            rule="each step counts the token it fed",
            expect="each step counts the token it fed",
            tests=(STEP,)),
    Mistake("fast_decoder.py", "FastDecoder.step",
            before="self.input_ids.copy_(token.reshape(1, 1))",
            after="self.input_ids = token.reshape(1, 1)",
            rule="every step reads the one preallocated input_ids buffer (a CUDA graph replays its address)",
            expect="preallocated input_ids buffer",
            tests=(f"{MILESTONE}::test_no_allocation_for_step_inputs",)),
    Mistake("fast_decoder.py", "FastDecoder.generate",
            before="self.filled + 1 >= self.max_len",
            after="self.filled >= self.max_len",
            rule="the sequence (prompt plus output) grows to max_len at most",
            expect="must stop after 5 tokens",
            tests=(f"{MILESTONE}::test_max_len_bounds_prompt_plus_output",)),
    Mistake("fast_decoder.py", "FastDecoder.generate",
            before="len(prompt_ids) >= self.max_len",
            after="len(prompt_ids) > self.max_len",
            rule="a prompt that fills max_len leaves no room for output",
            expect="leaves no room for output",
            tests=(f"{MILESTONE}::test_max_len_bounds_prompt_plus_output",)),
    Mistake("fast_decoder.py", "FastDecoder.generate",
            before="        if eos_token_id is not None:\n            stops.add(eos_token_id)\n",
            after="",
            rule="the EOS token ends the output, included",
            expect="the EOS token ends the output",
            tests=(f"{MILESTONE}::test_eos_and_stop_tokens",)),
]

DECIDES = {
    "StaticKVCache.update": "how to write each row's new entries at slots that only the device knows, with no "
                            "host read and no shape that depends on the length, so that a recorded graph stays right",
    "FastDecoder.step": "how to feed a token into buffers a recorded graph already points at, and when to replay "
                        "the graph instead of running the model, keeping the host's count of used slots honest",
    "FastDecoder.generate": "how to split a request into one eager prefill and static steps, and when to stop so "
                            "that the last token is returned but never fed into a full cache",
}
DESIGN = ("StaticKVCache.update",)
