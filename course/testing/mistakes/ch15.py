"""Chapter 15: prefill and decode on the roofline (FLOPs and bytes per operation)."""
from . import Mistake

MILESTONE = "tests/test_ch15_prefill_and_decode.py"
FLOPS = f"{MILESTONE}::test_matmul_flops_per_op"
BYTES = f"{MILESTONE}::test_op_bytes_by_hand"

MISTAKES = [
    Mistake("roofline.py", "matmul_flops",
            before="return 2 * a.shape[0] * a.shape[1] * b.shape[1]",
            after="return a.shape[0] * a.shape[1] * b.shape[1]",
            rule="a multiply-accumulate is 2 FLOPs",
            expect="per multiply-accumulate",
            tests=(FLOPS,)),
    Mistake("roofline.py", "matmul_flops",
            before="return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]",
            after="return 2 * a.shape[1] * a.shape[2] * b.shape[2]",
            rule="a batched product counts every matrix of the batch",
            expect="per multiply-accumulate",
            tests=(FLOPS,)),
    Mistake("roofline.py", "matmul_flops",
            before="(aten.mm.default, aten.addmm.default)",
            after="(aten.mm.default,)",
            rule="addmm (a linear layer with a bias) is a matrix product too",
            expect="per multiply-accumulate",
            tests=(FLOPS,)),
    Mistake("roofline.py", "matmul_flops",
            before="return 2 * a.shape[0] * a.shape[1] * b.shape[1]",
            after="return 2 * a.shape[0] * a.shape[1] * b.shape[0]",
            rule="an [m, k] @ [k, n] product has m * k * n multiply-accumulates",
            expect="per multiply-accumulate",
            tests=(FLOPS,)),
    Mistake("roofline.py", "op_bytes",
            before="if func.is_view or func in FREE_OPS:",
            after="if func in FREE_OPS:",
            rule="a view moves no bytes",
            expect="moves nothing",
            tests=(BYTES,)),
    Mistake("roofline.py", "op_bytes",
            before="if not (t.numel() and t.untyped_storage().data_ptr() in seen):",
            after="if True:",
            rule="an output written into an input's storage is not counted twice",
            expect="copy_ of 3 new rows",
            tests=(BYTES,)),
    Mistake("roofline.py", "op_bytes",
            before="sum(2 * tensor_bytes(t) for t in outputs)",
            after="sum(tensor_bytes(t) for t in outputs)",
            rule="a gather reads the rows it picks and writes them: twice the output's bytes",
            expect="embedding of 5 rows",
            tests=(BYTES,)),
]

DECIDES = {
    "matmul_flops": "which of the dispatcher's operations are matrix products and where their matrices sit "
                    "among the arguments (a bias comes first), so that every product is counted once",
    "op_bytes": "what counts as memory traffic: how to recognise a view, a gather and an output that is "
                "an input's own memory, and how much a broadcast tensor really weighs",
}
DESIGN = ("op_bytes",)
