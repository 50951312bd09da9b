"""Chapter 35: constrained decoding (regex DFA, token masks, the JSON pushdown guide)."""
from . import Mistake

MILESTONE = "tests/test_ch35_constrained_decoding.py"
PDA_MILESTONE = "tests/test_ch35_json_pda.py"
CLOSURE = f"{MILESTONE}::test_epsilon_closure_follows_cycles"
SUBSETS = f"{MILESTONE}::test_determinize_builds_the_subset_automaton"
MASKS = (MILESTONE, "-k", "mask_allows_exactly")
ADVANCE = f"{MILESTONE}::test_advance_refuses_forbidden_tokens_and_eos_before_a_match"
PUSHDOWN = f"{PDA_MILESTONE}::test_pushdown_step_keeps_the_stack_of_open_containers"
AGREEMENT = (PDA_MILESTONE, "-k", "mask_agrees or depth_and_whitespace")

MISTAKES = [
    Mistake("regex_dfa.py", "epsilon_closure",
            before="for target in nfa.empty[stack.pop()]:",
            after="for target in nfa.empty[stack[-1]] + [edge[2] for edge in nfa.edges[stack.pop()]]:",
            rule="only empty moves count: a byte move is not an empty move",
            expect="a byte move is not an empty move", tests=(CLOSURE,)),
    Mistake("regex_dfa.py", "epsilon_closure",
            before="""    seen = set(states)
    stack = list(seen)""",
            after="""    seen: set[int] = set()
    stack = list(states)""",
            rule="the closure includes the states it starts from",
            expect="includes the states it starts from", tests=(CLOSURE,)),
    Mistake("regex_dfa.py", "epsilon_closure",
            before="""                seen.add(target)
                stack.append(target)""",
            after="""                seen.add(target)""",
            rule="every state reachable by a chain of empty moves is in the closure, not only the direct targets",
            expect="every state reachable by empty moves", tests=(CLOSURE,)),
    Mistake("regex_dfa.py", "epsilon_closure",
            before="return frozenset(seen)",
            after="return seen",
            rule="the closure is a frozenset, so equal closures hash equal and can name DFA states",
            expect="hash equal", tests=(CLOSURE,)),
    Mistake("regex_dfa.py", "determinize",
            before="row[cuts[k]:bounds[k + 1]] = state_after(frozenset(moved))",
            after="row[cuts[k]:bounds[k + 1] - 1] = state_after(frozenset(moved))",
            rule="every byte of a byte class leads where the class leads, its last byte included",
            expect="each byte class's columns", tests=(SUBSETS,)),
    Mistake("regex_dfa.py", "determinize",
            before="row[lo:hi + 1] = after",
            after="row[lo:hi] = after",
            rule="an edge (lo, hi, target) reads every byte from lo to hi, hi included",
            expect="hi included", tests=(SUBSETS,)),
    Mistake("regex_dfa.py", "determinize",
            before="[nfa.accept in subset for subset in order]",
            after="[nfa.accept in subset for subset in order[:1]] + [True] * (len(order) - 1)",
            rule="a DFA state accepts exactly when its subset holds nfa.accept",
            expect="holds nfa.accept", tests=(SUBSETS,)),
    Mistake("regex_dfa.py", "determinize",
            before="first = epsilon_closure(nfa, [nfa.start])",
            after="first = frozenset([nfa.start])",
            rule="DFA state 0 is the epsilon closure of nfa.start",
            expect="the epsilon closure of nfa.start", tests=(SUBSETS,)),
    Mistake("regex_dfa.py", "determinize",
            before="closure = reached if closed else epsilon_closure(nfa, reached)",
            after="closure = reached",
            rule="a byte leads to the epsilon closure of the NFA states it reaches",
            expect="the epsilon closure of the NFA states it reaches", tests=(SUBSETS,)),
    Mistake("serve/guided.py", "TokenIndex.compute_mask",
            before="if vocabulary.eos_token_id is not None and self.dfa.accepting[state]:",
            after="if vocabulary.eos_token_id is not None:",
            rule="EOS is allowed exactly in accepting states",
            expect="allowed exactly on a complete match", tests=MASKS),
    Mistake("serve/guided.py", "TokenIndex.compute_mask",
            before="""        if vocabulary.eos_token_id is not None and self.dfa.accepting[state]:
            allowed[vocabulary.eos_token_id] = True
""",
            after="",
            rule="EOS has no node in the trie, yet it is allowed in every accepting state",
            expect="allowed exactly on a complete match", tests=MASKS),
    Mistake("serve/guided.py", "TokenIndex.compute_mask",
            before="live = np.flatnonzero(before >= 0)",
            after="live = np.arange(stop - first)",
            rule="once a prefix meets -1 every token that starts with it is refused: a dead node's children "
                 "are never stepped",
            expect="should be forbidden", tests=MASKS),
    Mistake("serve/guided.py", "TokenIndex.compute_mask",
            before="reached[first + live] = table[before[live], trie.byte[first:stop][live]]",
            after="reached[live] = table[before[live], trie.byte[first:stop][live]]",
            rule="node ids count across levels: the nodes of d bytes start at levels[d]",
            expect="should be", tests=MASKS),
    Mistake("serve/guided.py", "TokenIndex.compute_mask",
            before="for depth in range(1, len(trie.levels) - 1):",
            after="for depth in range(1, len(trie.levels) - 2):",
            rule="a token is allowed only when all of its bytes are read, the longest tokens' last byte included",
            expect="should be allowed", tests=MASKS),
    Mistake("serve/guided.py", "TokenIndex.compute_mask",
            before="allowed[torch.from_numpy(vocabulary.token_ids[reached[trie.token_node] >= 0])] = True",
            after="""leaves = np.ones(trie.num_nodes, dtype=bool)
        leaves[trie.parent[1:]] = False
        ends = trie.token_node[leaves[trie.token_node]]
        allowed[torch.from_numpy(vocabulary.token_ids[leaves[trie.token_node]][reached[ends] >= 0])] = True""",
            rule="a token that ends at a node with children is allowed by its own bytes, like one that ends at a leaf",
            expect="should be allowed", tests=MASKS),
    Mistake("serve/guided.py", "RegexGuide.advance",
            before="""            if not self.accepting:
                raise ValueError(f"token {token_id} (EOS) before the text matches the pattern")
""",
            after="",
            rule="EOS is refused before the text is a complete match",
            expect="EOS before the text is a complete match", tests=(ADVANCE,)),
    Mistake("serve/guided.py", "RegexGuide.advance",
            before="""        following = self.index.dfa.walk(self.state, data) if data else -1
        if following < 0:""",
            after="""        following = self.index.dfa.walk(self.state, data) if data else -1
        self.state = following
        if following < 0:""",
            rule="a refused token leaves the guide unchanged",
            expect="leave the guide unchanged", tests=(ADVANCE,)),
    Mistake("serve/guided.py", "RegexGuide.advance",
            before="following = self.index.dfa.walk(self.state, data) if data else -1",
            after="following = self.index.dfa.walk(self.state, data)",
            rule="a token with no bytes is never allowed",
            expect="a token with no bytes is never allowed", tests=(ADVANCE,)),
    Mistake("serve/guided.py", "RegexGuide.advance",
            before="""        if self.ended:
            raise ValueError(f"token {token_id} after the guided text ended")
""",
            after="",
            rule="nothing may follow EOS",
            expect="nothing may follow EOS", tests=(ADVANCE,)),
    Mistake("json_pda.py", "pushdown_step",
            before="if len(stack) >= max_depth:",
            after="if len(stack) > max_depth:",
            rule="a PUSH that would open more than max_depth containers returns DEEPER",
            expect="returns DEEPER", tests=(PUSHDOWN,)),
    Mistake("json_pda.py", "pushdown_step",
            before="""        if len(stack) >= max_depth:
            return DEEPER
        stack.append(target % 3)""",
            after="""        stack.append(target % 3)
        if len(stack) > max_depth:
            return DEEPER""",
            rule="a PUSH refused for depth leaves the stack unchanged",
            expect="leaves the stack unchanged", tests=(PUSHDOWN,)),
    Mistake("json_pda.py", "pushdown_step",
            before="""        stack.pop()
        target += stack[-1] if stack else NONE""",
            after="""        target += stack[-1] if stack else NONE
        stack.pop()""",
            rule="after a POP the state's top is the kind of the new innermost container, not the closed one",
            expect="the kind of the innermost open container", tests=(PUSHDOWN,)),
    Mistake("json_pda.py", "pushdown_step",
            before="stack.append(target % 3)",
            after="stack.append(state % 3)",
            rule="a PUSH appends the kind its target state names (the container it opens)",
            expect="an opening bracket appends its kind", tests=(PUSHDOWN,)),
    Mistake("json_pda.py", "JsonIndex.walk_tokens",
            before="peak[opens] = np.maximum(peak[opens], heights[opens] - len(known))",
            after="peak[opens] = np.maximum(peak[opens], heights[opens])",
            rule="peak counts only the containers a token opens beyond those open at the start",
            expect="must allow exactly the tokens advance", tests=AGREEMENT),
    Mistake("json_pda.py", "JsonIndex.walk_tokens",
            before="below = stacks[closes, heights[closes]]",
            after="below = stacks[closes, heights[closes] + 1]",
            rule="after a token closes a container, the state's top is the kind below it",
            expect="must allow exactly the tokens advance", tests=AGREEMENT),
    Mistake("json_pda.py", "JsonIndex.walk_tokens",
            before="reading = reading[:np.searchsorted(rows[reading], count)]",
            after="",
            rule="a padding 0 is not one of the token's bytes: a token's walk ends with its last byte",
            expect="must allow exactly the tokens advance", tests=AGREEMENT),
    Mistake("json_pda.py", "JsonIndex.walk_tokens",
            before="reaching[closes[blind]] = True",
            after="reaching[closes[blind]] = False",
            rule="a token that closes a container whose kind below the walk does not know is reported as reaching",
            expect="must allow exactly the tokens advance", tests=AGREEMENT),
]

DECIDES = {
    "pushdown_step":
        "how a byte's transition and the container stack move together, and how a refused or too-deep byte leaves "
        "the stack untouched",
    "JsonIndex.walk_tokens":
        "how to walk thousands of tokens through a pushdown automaton at once without a Python stack per token, "
        "tracking only what a token's walk needs",
    "epsilon_closure":
        "how to collect the states reachable by empty moves when those moves form cycles, as a value that can "
        "name a DFA state",
    "determinize":
        "how to name DFA states by sets of NFA states, explore them until none is new, and avoid filling 256 "
        "columns byte by byte",
    "TokenIndex.compute_mask":
        "how to test every token's bytes against the DFA from one state at once by walking the token trie level "
        "by level, each shared prefix read once and a dead prefix's subtree never read, instead of a loop over "
        "the vocabulary",
    "RegexGuide.advance": "when a token or EOS may be accepted, and how a refusal leaves the guide unchanged",
}

DESIGN = ("JsonIndex.walk_tokens", "determinize")
