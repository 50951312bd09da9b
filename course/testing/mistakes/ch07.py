"""Chapter 7: the SwiGLU MLP and the pre-norm decoder layer."""
from . import Mistake

MILESTONE = "tests/test_ch07_mlp_and_decoder_layer.py"
SWIGLU = f"{MILESTONE}::test_mlp_matches_swiglu_formula"
COMPOSED = f"{MILESTONE}::test_decoder_layer_matches_hand_composition"
TRANSFORMERS_LAYER = f"{MILESTONE}::test_decoder_layer_matches_transformers"

MISTAKES = [
    Mistake("qwen3.py", "Qwen3MLP.forward",
            before="F.silu(self.gate_proj(x)) * self.up_proj(x)",
            after="self.gate_proj(x) * F.silu(self.up_proj(x))",
            rule="SiLU acts on the gate path, not the up path",
            expect="SiLU goes on the gate path only", tests=(SWIGLU,)),
    Mistake("qwen3.py", "Qwen3MLP.forward",
            before="F.silu(self.gate_proj(x)) * self.up_proj(x)",
            after="F.silu(self.gate_proj(x) * self.up_proj(x))",
            rule="SiLU acts on the gate alone, before the product with the up path",
            expect="SiLU goes on the gate path only", tests=(SWIGLU,)),
    Mistake("qwen3.py", "Qwen3MLP.forward",
            before="F.silu(",
            after="F.gelu(",
            rule="Qwen3's gate nonlinearity is SiLU",
            expect="down(silu(gate(x)) * up(x))", tests=(SWIGLU,)),
    Mistake("qwen3.py", "Qwen3MLP.forward",
            before="F.silu(self.gate_proj(x)) * self.up_proj(x)",
            after="F.silu(self.gate_proj(x)) + self.up_proj(x)",
            rule="the gate multiplies the up path elementwise",
            expect="down(silu(gate(x)) * up(x))", tests=(SWIGLU,)),
    Mistake("qwen3.py", "Qwen3DecoderLayer.forward",
            before="x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, cache, allowed)",
            after="x = self.input_layernorm(x)\n        x = x + self.self_attn(x, cos, sin, slots, cache, allowed)",
            rule="the stream itself is never normalised: the branch reads a normalised copy",
            expect="the stream itself is only added to", tests=(COMPOSED,)),
    Mistake("qwen3.py", "Qwen3DecoderLayer.forward",
            before="""        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, cache, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))""",
            after="""        attended = self.self_attn(self.input_layernorm(x), cos, sin, slots, cache, allowed)
        return x + attended + self.mlp(self.post_attention_layernorm(x))""",
            rule="the branches run in order: the MLP reads the stream after attention's output was added",
            expect="then h + mlp(post_attention_layernorm(h))", tests=(COMPOSED,)),
    Mistake("qwen3.py", "Qwen3DecoderLayer.forward",
            before="return x + self.mlp(self.post_attention_layernorm(x))",
            after="return self.post_attention_layernorm(x + self.mlp(x))",
            rule="pre-norm, not post-norm: the MLP reads the normalised stream and its output is added unnormalised",
            expect="pre-norm", tests=(COMPOSED,)),
    Mistake("qwen3.py", "Qwen3DecoderLayer.forward",
            before="return x + self.mlp(self.post_attention_layernorm(x))",
            after="return x + self.mlp(self.input_layernorm(x))",
            rule="each branch reads its own norm: the MLP's is post_attention_layernorm",
            expect="each branch reading its own norm", tests=(TRANSFORMERS_LAYER,)),
    Mistake("qwen3.py", "Qwen3DecoderLayer.forward",
            before="""        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, cache, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))""",
            after="""        attended = self.self_attn(self.input_layernorm(x), cos, sin, slots, cache, allowed)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(attended))""",
            rule="the MLP reads the stream with attention's output added, not attention's output alone",
            expect="the stream as it stands then", tests=(TRANSFORMERS_LAYER,)),
    Mistake("qwen3.py", "Qwen3DecoderLayer.forward",
            before="return x + self.mlp(",
            after="return x.float() + self.mlp(",
            rule="the residual stream stays in the model's dtype, the layer's output too",
            expect="keeps the stream in", tests=(TRANSFORMERS_LAYER,)),
    Mistake("qwen3.py", "Qwen3DecoderLayer.forward",
            before="cos, sin, slots, cache, allowed)",
            after="cos, sin, slots)",
            rule="cache and allowed reach self_attn unchanged",
            expect="to self_attn unchanged",
            tests=(f"{MILESTONE}::test_decoder_layer_passes_everything_to_attention",)),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "Qwen3MLP.forward": (
        "which of the two parallel projections the nonlinearity acts on and where the two paths "
        "meet before the down projection"
    ),
    "Qwen3DecoderLayer.forward": (
        "what the residual stream is and where it lives: what each branch reads (a normalised "
        "copy of the stream as it stands then), what it adds back, and that the stream itself "
        "is never normalised or changed in place and stays in the model's dtype"
    ),
}
DESIGN = ("Qwen3DecoderLayer.forward",)
