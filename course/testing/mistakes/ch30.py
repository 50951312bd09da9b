"""Chapter 30: Triton kernels (run under TRITON_INTERPRET=1 on a CPU, as the milestone does)."""
from . import Mistake

MILESTONE = "tests/test_ch30_first_triton_kernel.py"

MISTAKES = [
    Mistake("triton_kernels.py", "add_kernel",
            before="tl.store(out_ptr + offsets, x + y, mask=mask)",
            after="tl.store(out_ptr + offsets, x + y)",
            rule="the last program's lanes past n_elements store nothing",
            expect="mask the store",
            tests=(f"{MILESTONE}::test_add_kernel_never_writes_past_n_elements",)),
    Mistake("triton_kernels.py", "add_kernel",
            before="mask = offsets < n_elements",
            after="mask = offsets <= n_elements",
            rule="element n_elements itself is past the end",
            expect="at or past n_elements",
            tests=(f"{MILESTONE}::test_add_kernel_never_writes_past_n_elements",)),
    Mistake("triton_kernels.py", "add_kernel",
            before="offsets = pid * BLOCK + tl.arange(0, BLOCK)",
            after="offsets = tl.arange(0, BLOCK)",
            rule="program pid covers its own block, elements pid * BLOCK onwards",
            expect="elements differ from x + y",
            tests=(f"{MILESTONE}::test_vector_add[1000-256]",)),
    Mistake("triton_kernels.py", "softmax_kernel",
            before='other=-float("inf")',
            after="other=0.0",
            rule="padding lanes past n_cols read as -inf, so they add nothing to the row's sum",
            expect="mask padding lanes with -inf",
            tests=(f"{MILESTONE}::test_row_softmax[3-5]",)),
    Mistake("triton_kernels.py", "softmax_kernel",
            before="    x = x - tl.max(x, axis=0)\n",
            after="",
            rule="the row max is subtracted before exp, so huge logits do not overflow",
            expect="subtract the row max before exp",
            tests=(f"{MILESTONE}::test_softmax_survives_huge_logits_and_strided_rows",)),
    Mistake("triton_kernels.py", "softmax_kernel",
            before="x_ptr + row * x_row_stride + cols",
            after="x_ptr + row * n_cols + cols",
            rule="row r starts r row strides into the input, not r row lengths",
            expect="use the row stride, not the row length",
            tests=(f"{MILESTONE}::test_softmax_survives_huge_logits_and_strided_rows",)),
]

DECIDES = {
    "add_kernel": "which elements one program owns and how to keep the last program from touching lanes past the end",
    "softmax_kernel": (
        "how one program owns one row, what the padding lanes must hold so they vanish from the max and the "
        "sum, and where the float32 arithmetic begins"),
}

DESIGN = ("softmax_kernel",)
