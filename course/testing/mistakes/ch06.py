"""Chapter 6: rotary position embeddings."""
from . import Mistake

MILESTONE = "tests/test_ch06_rope.py"
VALUES = f"{MILESTONE}::test_table_values"
APPLY = f"{MILESTONE}::test_apply_matches_complex_rotation"

MISTAKES = [
    Mistake("layers.py", "rope_cos_sin",
            before="angles = torch.cat([angles, angles], dim=-1)",
            after="angles = angles.repeat_interleave(2, dim=-1)",
            rule="rotate-half layout: channel c pairs with c + D/2, not with its neighbour c + 1",
            expect="column c and c + D/2", tests=(VALUES,)),
    Mistake("layers.py", "rope_cos_sin",
            before="* 2 / head_dim)",
            after="/ head_dim)",
            rule="frequency c is theta^(-2c/D)",
            expect="theta^(-2c/D)", tests=(VALUES,)),
    Mistake("layers.py", "rope_cos_sin",
            before="angles = positions.float()[..., None] * inv_freq",
            after="angles = positions.to(dtype)[..., None] * inv_freq",
            rule="angles come from exact integer positions in float32; only the finished table is cast",
            expect="in float32 from the integer positions", tests=(f"{MILESTONE}::test_large_positions_in_bfloat16",)),
    Mistake("layers.py", "rope_cos_sin",
            before="""    if angles.dim() == 2:
        angles = angles[None]
""",
            after="",
            rule="positions [T] give tables [1, 1, T, D] that broadcast over batch and heads",
            expect="[1, 1, 7, 16]", tests=(f"{MILESTONE}::test_table_shapes",)),
    Mistake("layers.py", "apply_rope",
            before="x * cos + rotate_half(x) * sin",
            after="x * cos - rotate_half(x) * sin",
            rule="each pair turns forwards by its angle (multiplied by e^(i angle), not its inverse)",
            expect="multiplied by e^(i angle)", tests=(APPLY,)),
    Mistake("layers.py", "apply_rope",
            before="x * cos + rotate_half(x) * sin",
            after="x * cos + torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2) * sin",
            rule="the pairs are (c, c + D/2), not neighbours (2c, 2c + 1)",
            expect="rotation of pairs (c, c + 8)", tests=(APPLY,)),
    Mistake("layers.py", "apply_rope",
            before="x * cos + rotate_half(x) * sin",
            after="x.float() * cos.float() + rotate_half(x).float() * sin.float()",
            rule="the result keeps x's dtype",
            expect="keeps x's shape and dtype", tests=(APPLY,)),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "rope_cos_sin": (
        "how the rotary tables are laid out (which channel pairs with which, a shape that "
        "broadcasts over batch and heads) and in which precision the angles are formed so that "
        "large positions stay exact in any output dtype"
    ),
    "apply_rope": (
        "how to rotate every channel pair with elementwise operations only, so that the same "
        "function serves any layout of the leading axes"
    ),
}
DESIGN = ("rope_cos_sin",)
