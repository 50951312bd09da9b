"""Chapter 33: the graph runner's static inputs, the fused add + RMSNorm kernel, settling
late tokens under asynchronous scheduling."""
from . import Mistake

MILESTONE = "tests/test_ch33_cuda_graphs_and_async.py"
SETTLE = (MILESTONE, "-k", "settle_token")
LOAD = (f"{MILESTONE}::test_load_inputs_writes_into_the_same_buffers",)
KERNEL = (MILESTONE, "-k", "fused_triton_kernel_matches")     # TRITON_INTERPRET=1 on a CPU

MISTAKES = [
    Mistake("serve/overlap.py", "settle_token",
            before="index = request.num_tokens - request.num_placeholders",
            after="index = request.num_tokens - 1",
            rule="a late token fills the OLDEST placeholder, not the newest entry",
            expect="settled token's index", tests=SETTLE),
    Mistake("serve/overlap.py", "settle_token",
            before="reason = check_stop(request, index)",
            after="reason = check_stop(request, request.num_tokens - 1)",
            rule="the stop rules look at the settled token, not at the newest entry (maybe a placeholder)",
            expect="settled token's index", tests=SETTLE),
    Mistake("serve/overlap.py", "settle_token",
            before="request.num_placeholders -= 1",
            after="pass",
            rule="settling a token leaves one placeholder fewer",
            expect="one placeholder fewer", tests=SETTLE),
    Mistake("serve/overlap.py", "settle_token",
            before="drop_placeholders(request)",
            after="pass",
            rule="tokens computed past a stop are not output: a finish drops the placeholders after it",
            expect="past a stop is not output", tests=SETTLE),
    Mistake("serve/graphs.py", "GraphRunner.load_inputs",
            before="self.input_ids[:size].copy_(batch.input_ids)",
            after="self.input_ids = batch.input_ids.clone()",
            rule="a captured graph reads fixed addresses: copy into the static buffers, never rebind them",
            expect="copy INTO the static buffers", tests=LOAD),
    Mistake("serve/graphs.py", "GraphRunner.load_inputs",
            before="self.block_table[:size, width:].fill_(0)",
            after="pass",
            rule="block-table columns past the batch's width hold 0, not an earlier step's blocks",
            expect="must be 0, not stale", tests=LOAD),
    Mistake("serve/graphs.py", "GraphRunner.load_inputs",
            before="self.seq_lens[:size].copy_(meta.seq_lens)",
            after="self.seq_lens[:size].copy_(batch.positions)",
            rule="seq_lens count the new token too: they are the batch's seq_lens, not its positions",
            expect="the new token included", tests=LOAD),
    Mistake("serve/graphs.py", "GraphRunner.load_inputs",
            before="        return size",
            after="        return len(batch.request_ids)",
            rule="the size returned is the bucket's (padding included): it names the graph to replay",
            expect="bucket size", tests=LOAD),
    Mistake("fused_kernels.py", "add_rms_norm_kernel",
            before="/ dim + eps",
            after="/ BLOCK + eps",
            rule="the mean of squares is over dim: the masked lanes up to BLOCK do not count",
            expect="masked lanes past dim must not count", tests=KERNEL),
    Mistake("fused_kernels.py", "add_rms_norm_kernel",
            before="wide = stream.to(tl.float32)",
            after="wide = x",
            rule="the row normalised is the residual sum x + delta, not x",
            expect="residual sum x + delta", tests=KERNEL),
    Mistake("fused_kernels.py", "add_rms_norm_kernel",
            before="(weight * normed)",
            after="normed",
            rule="the normalised row is multiplied by the norm's weight",
            expect="out is weight times", tests=KERNEL),
]

DECIDES = {
    "add_rms_norm_kernel":
        "how one program per row fuses the residual add and the norm, normalising the stored sum, with padding "
        "lanes kept out of the mean",
    "GraphRunner.load_inputs":
        "how to put a new batch in front of a captured graph: writing into its fixed buffers, never rebinding "
        "them, and what to clear in the unused columns",
    "settle_token":
        "which placeholder a late token replaces, which index the stop rules judge, and what to discard when that "
        "token ends the request",
}

DESIGN = ("settle_token",)
