"""Chapter 24: continuous batching on slots."""
from . import Mistake

MILESTONE = "tests/test_ch24_continuous_batching.py"
UPDATE = (f"{MILESTONE}::test_slot_rows_update_writes_each_row_at_its_own_length",)

MISTAKES = [
    Mistake("continuous.py", "SlotRows.update",
            before="starts[:, None] + torch.arange(length, device=keys.device)",
            after="max(self._starts) + torch.arange(length, device=keys.device)[None]",
            rule="each row's new entries land at that row's own length, not at the batch's longest",
            expect="at its own length",
            tests=UPDATE),
    Mistake("continuous.py", "SlotRows.update",
            before="return keys[slot:slot + 1, :, :end], values[slot:slot + 1, :, :end]",
            after="return keys[slot:slot + 1, :, start:end], values[slot:slot + 1, :, start:end]",
            rule="update returns every position so far, the slot's history first, not only the new entries",
            expect="its history first",
            tests=UPDATE),
    Mistake("continuous.py", "SlotRows.update",
            before="if start + length > self.cache.slot_len:",
            after="if start + length >= self.cache.slot_len:",
            rule="a row may fill its slot exactly to slot_len",
            expect="fill its slot to slot_len",
            tests=UPDATE),
    Mistake("continuous.py", "SlotRows.update",
            before="return keys[:, :, :end].index_select(0, self._index), values",
            after="return keys[:len(self.slot_ids), :, :end], values",
            rule="the returned row b is slot slot_ids[b], in the order the rows were given",
            expect="in the order the rows were given",
            tests=UPDATE),
    Mistake("continuous.py", "ContinuousBatchingEngine._prefill_chunk",
            before="start + self.chunk_size)",
            after="start + self.chunk_size - 1)",
            rule="a chunk is the next chunk_size prompt tokens, fewer only for the prompt's last chunk",
            expect="next 8 prompt tokens",
            tests=(f"{MILESTONE}::test_chunked_prefill_does_not_stall_decoding",)),
    Mistake("continuous.py", "ContinuousBatchingEngine._prefill_chunk",
            before="request.prompt_ids[start:end]",
            after="request.prompt_ids[:end]",
            rule="a chunk feeds only the prompt tokens not yet in the slot",
            expect="next 8 prompt tokens",
            tests=(f"{MILESTONE}::test_chunked_prefill_does_not_stall_decoding",)),
    Mistake("continuous.py", "ContinuousBatchingEngine._prefill_chunk",
            before="            return None\n",
            after="            pass\n",
            rule="a mid-prompt chunk's logits are not used: the first token comes with the prompt's last chunk",
            expect="first token at step 5",
            tests=(f"{MILESTONE}::test_chunked_prefill_does_not_stall_decoding",)),
    Mistake("continuous.py", "ContinuousBatchingEngine.step",
            before="                self.slots[request.slot] = None\n",
            after="                pass\n",
            rule="a finished request gives its slot back in the step that finishes it",
            expect="gives its slot back in the step that finishes it",
            tests=(f"{MILESTONE}::test_freed_slot_is_reused_at_the_next_step",)),
    Mistake("continuous.py", "ContinuousBatchingEngine.step",
            before="if self.slots[slot] is None and self.waiting:",
            after="if self.waiting:",
            rule="a step admits one waiting request per free slot, never into a slot a running request holds",
            expect="one waiting request per free slot",
            tests=(f"{MILESTONE}::test_freed_slot_is_reused_at_the_next_step",)),
    Mistake("continuous.py", "ContinuousBatchingEngine.step",
            before="request = self.waiting.popleft()",
            after="request = self.waiting.pop()",
            rule="admission is first come, first served: the oldest waiting request takes the free slot",
            expect="first come, first served",
            tests=(f"{MILESTONE}::test_freed_slot_is_reused_at_the_next_step",)),
    Mistake("continuous.py", "ContinuousBatchingEngine.step",
            before="                self.cache.reset(slot)\n",
            after="",
            rule="an admitted request starts on an empty slot: the previous owner's length is reset to 0",
            expect="starts on an empty slot",
            tests=(f"{MILESTONE}::test_freed_slot_is_reused_at_the_next_step",)),
    Mistake("continuous.py", "ContinuousBatchingEngine.step",
            before="            if first is not None:\n                new_tokens.append((request, first))",
            after="            new_tokens.append((request, first))",
            rule="a mid-prompt chunk yields no token: only the chunk that completes the prompt does",
            expect="a mid-prompt chunk yields no token",
            tests=(f"{MILESTONE}::test_every_request_matches_solo_generate",)),
    Mistake("continuous.py", "ContinuousBatchingEngine.step",
            before="list(zip(decoding, self._decode(decoding)))",
            after="list(zip(decoding, [t for r in decoding for t in self._decode([r])]))",
            rule="all decoding requests share one forward call per step",
            expect="one [4, 1] decode call per step",
            tests=(f"{MILESTONE}::test_one_prefill_call_per_request_and_one_decode_call_per_step",)),
]

DECIDES = {
    "SlotRows.update": (
        "how to write rows that start at different lengths into their own slots of one static cache in one "
        "indexed store, and which view of the cache to hand back to attention"),
    "ContinuousBatchingEngine._prefill_chunk": (
        "where a request's prefill progress lives between steps, and when a chunk's logits are a token to "
        "keep and when they are thrown away"),
    "ContinuousBatchingEngine.step": (
        "the scheduling of one step: which waiting requests take which free slots and in what order, how the "
        "running requests split into one shared decode call and per-request prefill chunks, and when a finished "
        "request's slot becomes free again"),
}

DESIGN = ("SlotRows.update", "ContinuousBatchingEngine.step")
