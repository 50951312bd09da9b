"""Chapter 27: mixture of experts (Qwen3-MoE's router and sparse block)."""
from . import Mistake

MILESTONE = "tests/test_ch27_mixture_of_experts.py"
ROUTER = f"{MILESTONE}::test_router_matches_transformers"
BLOCK = f"{MILESTONE}::test_sparse_block_matches_transformers_on_any_shape"

MISTAKES = [
    Mistake("moe.py", "Qwen3MoeSparseMoeBlock.route",
            before="if self.norm_topk_prob:",
            after="if True:",
            rule="the top-k weights are renormalised only when norm_topk_prob is set",
            expect="routing weights differ",
            tests=(ROUTER,)),
    Mistake("moe.py", "Qwen3MoeSparseMoeBlock.route",
            before="weights, experts = probs.topk(self.top_k, dim=-1)",
            after="weights, experts = logits.topk(self.top_k, dim=-1)",
            rule="the weights are softmax probabilities over all experts, taken before the top k",
            expect="routing weights differ",
            tests=(ROUTER,)),
    Mistake("moe.py", "Qwen3MoeSparseMoeBlock.route",
            before="torch.softmax(logits, dim=-1, dtype=torch.float32)",
            after="torch.softmax(logits, dim=0, dtype=torch.float32)",
            rule="each row's softmax runs over the experts, not over the rows",
            expect="routed to different experts",
            tests=(ROUTER,)),
    Mistake("moe.py", "Qwen3MoeSparseMoeBlock.forward",
            before=" * weights[token, slot, None]",
            after="",
            rule="each row's output is the routing-weighted sum of its chosen experts' outputs",
            expect="routing-weighted sum",
            tests=(BLOCK,)),
    Mistake("moe.py", "Qwen3MoeSparseMoeBlock.forward",
            before="out.index_add_(0, token, y.to(out.dtype))",
            after="out[token] = y.to(out.dtype)",
            rule="a row's expert outputs add up; the last expert does not overwrite the others",
            expect="routing-weighted sum",
            tests=(BLOCK,)),
    Mistake("moe.py", "Qwen3MoeSparseMoeBlock.forward",
            before="for e in experts.unique().tolist():",
            after="for e in range(len(self.experts)):",
            rule="an expert no row chose never runs",
            expect="never an expert no row chose",
            tests=(f"{MILESTONE}::test_each_chosen_expert_runs_once_per_call",)),
]

DECIDES = {
    "Qwen3MoeSparseMoeBlock.route": (
        "how to pick each row's top_k experts and weights, and in which precision the router's softmax must "
        "run so the same experts win as in transformers"),
    "Qwen3MoeSparseMoeBlock.forward": (
        "how to group the rows by the experts they chose so each chosen expert runs once on a batch of its "
        "rows, and how to add the weighted results back to their rows"),
}

DESIGN = ("Qwen3MoeSparseMoeBlock.forward",)
