"""Chapter 43: LoRA's batched shrink and expand, image patches and M-RoPE positions, a step's features."""
from . import Mistake

MILESTONE = "tests/test_ch43_adapters_and_images.py"
LORA = f"{MILESTONE}::test_shrink_and_expand_match_one_matmul_per_row"
PATCHES = (MILESTONE, "-k", "patch_order")
MROPE = (MILESTONE, "-k", "mrope_positions_match")
IMAGES = (MILESTONE, "-k", "image_and_text_requests_in_one_batch and chunks")
ADAPTERS = f"{MILESTONE}::test_many_adapters_in_one_batch_match_peft_alone[96]"

MISTAKES = [
    Mistake("serve/lora.py", "lora_shrink",
            before="lora_a.index_select(0, slots).to(x.dtype)",
            after="lora_a.index_select(0, slots)",
            rule="t comes back in x's dtype, the bank's matrices cast to it",
            expect="in x's (shrink)", tests=(LORA,)),
    Mistake("serve/lora.py", "lora_shrink",
            before="lora_a.index_select(0, slots)",
            after="lora_a.index_select(0, slots.sort().values)",
            rule="row i uses its own request's slot, in row order",
            expect="t[i] = lora_a[slots[i]] @ x[i]", tests=(LORA,)),
    Mistake("serve/lora.py", "lora_shrink",
            before="lora_a.index_select(0, slots)",
            after="lora_a.index_select(0, slots.clamp(min=1))",
            rule="slot 0 is the all-zero slot of rows without an adapter, not the first adapter",
            expect="t[i] = lora_a[slots[i]] @ x[i]", tests=(LORA,)),
    Mistake("serve/lora.py", "lora_expand",
            before="return base + scaling.to(base.dtype).index_select(0, slots).unsqueeze(-1) * update",
            after="return base.add_(scaling.to(base.dtype).index_select(0, slots).unsqueeze(-1) * update)",
            rule="a NEW tensor is returned: base is left unchanged",
            expect="in place", tests=(LORA,)),
    Mistake("serve/lora.py", "lora_expand",
            before="scaling.to(base.dtype).index_select(0, slots).unsqueeze(-1) * update",
            after="update",
            rule="each row's update is scaled by its slot's alpha / r",
            expect="scaling[slots[i]]", tests=(LORA,)),
    Mistake("serve/lora.py", "lora_expand",
            before="lora_b.index_select(0, slots).to(base.dtype)",
            after="lora_b.index_select(0, slots)",
            rule="the result is in base's dtype, the bank's matrices cast to it",
            expect="base's (expand) dtype", tests=(LORA,)),
    Mistake("serve/vision.py", "patch_positions",
            before=".permute(0, 2, 1, 3, 4)",
            after="",
            rule="patches come square by square, not row by row of the whole grid",
            expect="merge x merge squares in row-major order", tests=PATCHES),
    Mistake("serve/vision.py", "patch_positions",
            before="torch.stack([row, col], dim=-1)",
            after="torch.stack([col, row], dim=-1)",
            rule="each patch is (row, col)",
            expect="(row, col) pairs", tests=PATCHES),
    Mistake("serve/vision.py", "patch_positions",
            before=".permute(0, 2, 1, 3, 4)",
            after=".permute(0, 2, 3, 1, 4)",
            rule="inside a square its patches are in row-major order",
            expect="each square's patches in row-major order", tests=PATCHES),
    Mistake("serve/vision.py", "mrope_positions",
            before="counter + max(rows, cols), index + rows * cols",
            after="counter + rows * cols, index + rows * cols",
            rule="after an image the counter is s + max(rows, cols), not s + its token count",
            expect="s + max(rows, cols)", tests=MROPE),
    Mistake("serve/vision.py", "mrope_positions",
            before="delta = int(table.max()) + 1 - len(prompt)",
            after="delta = int(table.max()) - len(prompt)",
            rule="delta = table.max() + 1 - len(prompt)",
            expect="table.max() + 1", tests=MROPE),
    Mistake("serve/vision.py", "mrope_positions",
            before="row = torch.arange(rows).repeat_interleave(cols)\n        col = torch.arange(cols).repeat(rows)",
            after="row = torch.arange(rows).repeat(cols)\n        col = torch.arange(cols).repeat_interleave(rows)",
            rule="an image's tokens are in row-major order",
            expect="in row-major order, (s, s + row, s + col)", tests=MROPE),
    Mistake("serve/runner.py", "ModelRunner.prepare_features",
            before="inside = (images.positions >= computed) & (images.positions < computed + n)",
            after="inside = images.positions >= computed",
            rule="a chunk places exactly the image rows whose positions fall in its [c, c + n)",
            expect="places exactly the image rows", tests=IMAGES),
    Mistake("serve/runner.py", "ModelRunner.prepare_features",
            before="axes[:, start + prompt_rows:start + n] += images.mrope_delta",
            after="axes[:, start + prompt_rows:start + n] += 0",
            rule="after the prompt a position p becomes p + mrope_delta on all three axes",
            expect="p + mrope_delta", tests=IMAGES),
    Mistake("serve/runner.py", "ModelRunner.prepare_features",
            before="table[:, computed:computed + prompt_rows]",
            after="table[:, :prompt_rows]",
            rule="a chunk's rows take the table's columns of ITS positions c .. c + n - 1",
            expect="places exactly the image rows", tests=IMAGES),
    Mistake("serve/runner.py", "ModelRunner.prepare_features",
            before="slots[start:start + n] = request.lora_slot",
            after="slots[start:start + 1] = request.lora_slot",
            rule="every row of a request carries its adapter slot, not only its first",
            expect="carries its request's adapter slot", tests=(ADAPTERS,)),
]

DECIDES = {
    "lora_shrink":
        "how to give every row its own adapter's A in one batched computation, with no loop over rows or requests",
    "lora_expand":
        "how to add every row's scaled low-rank update to a new output without touching the base, so slot 0's "
        "rows stay exactly the base",
    "ModelRunner.prepare_features":
        "how to map each request's absolute positions onto the step's rows, so adapter slots, image rows (even an "
        "image cut by a chunk) and three-axis positions land where they belong",
    "patch_positions":
        "how to produce the encoder's square-by-square patch order from a grid's shape with tensor operations, so "
        "every run of merge x merge patches is one square",
    "mrope_positions":
        "how a running position counter advances over text and over each image's grid, and what delta continues "
        "it after the prompt",
}

DESIGN = ("ModelRunner.prepare_features",)
