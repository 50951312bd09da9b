"""Chapter 33: the graph runner's static inputs, the fused add + RMSNorm kernel, the
asynchronous step's order of the engine's parts, settling late tokens."""
from . import Mistake

MILESTONE = "tests/test_ch33_cuda_graphs_and_async.py"
SETTLE = (MILESTONE, "-k", "settle_token")
ORDER = (MILESTONE, "-k", "launches_the_next_step")
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
    Mistake("serve/overlap.py", "AsyncStepper.step",
            before="""        launched = self.launch(plan) if plan.scheduled or plan.swap_out or plan.swap_in else None
        outputs = self.settle(self.inflight) if self.inflight is not None else []
""",
            after="""        outputs = self.settle(self.inflight) if self.inflight is not None else []
        launched = self.launch(plan) if plan.scheduled or plan.swap_out or plan.swap_in else None
""",
            rule="step t+1 is launched before the host waits for step t's tokens: that is the overlap",
            expect="that is the overlap", tests=ORDER),
    Mistake("serve/overlap.py", "AsyncStepper.step",
            before="""        self.wait_for_tokens(plan)
        launched = self.launch(plan) if plan.scheduled or plan.swap_out or plan.swap_in else None
""",
            after="""        launched = self.launch(plan) if plan.scheduled or plan.swap_out or plan.swap_in else None
        self.wait_for_tokens(plan)
""",
            rule="the step in flight's tokens are waited for before the next plan's placeholder inputs are prepared",
            expect="wait_for_tokens comes before the plan is prepared", tests=ORDER),
    Mistake("serve/overlap.py", "AsyncStepper.step",
            before="""        outputs = self.settle(self.inflight) if self.inflight is not None else []
        self.inflight = None
        if launched is not None and launched.batch is not None and self.device_sampler is None:
            self.sample_on_host(launched)
""",
            after="""        if launched is not None and launched.batch is not None and self.device_sampler is None:
            self.sample_on_host(launched)
        outputs = self.settle(self.inflight) if self.inflight is not None else []
        self.inflight = None
""",
            rule="a host sampler samples step t+1 only once step t is settled, as the synchronous engine shows it",
            expect="only once step t is settled", tests=ORDER),
    Mistake("serve/overlap.py", "AsyncStepper.step",
            before="""        if launched is not None and launched.batch is not None and self.device_sampler is None:
            self.sample_on_host(launched)
        if launched is not None and plan.scheduled:
            self.count_launched(launched)
            self.inflight = launched
""",
            after="""        if launched is not None and plan.scheduled:
            self.count_launched(launched)
            self.inflight = launched
        if launched is not None and launched.batch is not None and self.device_sampler is None:
            self.sample_on_host(launched)
""",
            rule="step t+1's placeholders are appended only after the host sampled it: its sampler sees no placeholder",
            expect="only after it is sampled on the host", tests=ORDER),
    Mistake("serve/overlap.py", "AsyncStepper.step",
            before="        self.inflight = None\n",
            after="",
            rule="each launched step is settled exactly once, in the next call",
            expect="settled exactly once", tests=ORDER),
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
    "AsyncStepper.step":
        "the order of the engine's named parts in one asynchronous call: what must be launched before the host "
        "waits, what a host sampler must see, when placeholders are appended and which step in flight is settled",
    "settle_token":
        "which placeholder a late token replaces, which index the stop rules judge, and what to discard when that "
        "token ends the request",
}

DESIGN = ("AsyncStepper.step",)
