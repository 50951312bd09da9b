"""Chapter 31: the block manager and its prefix cache, the scheduler, the flattened batch, the
engine's step. Three of these are bugs users found in nano-vllm: a prompt entirely in the
prefix cache still computes one token (issue 144), a block reused for other tokens loses its
old key (163), a block is published only once its tokens are written this step (208)."""
from . import Mistake

MILESTONE = "tests/test_ch31_engine_v2.py"
HASHING = f"{MILESTONE}::test_hash_block_chain_and_extra_keys"
LOOKUP = (MILESTONE, "-k", "find_cached_prefix or first_evicted or cache_key or hitting or entirely_cached")
ALLOCATION = (MILESTONE, "-k", "adopting or all_or_nothing or free_is_tail or hitting or publishing")
PUBLISHING = (MILESTONE, "-k", "written_by_this_step or publishing or cache_key or hitting or find_cached_prefix")
FREEING = (MILESTONE, "-k", "free_is_tail or hitting or abort")
BATCH = (MILESTONE, "-k", "slot_mapping or flattened_batch")
BATCH_COST = f"{MILESTONE}::test_build_batch_makes_as_many_tensor_operations_for_a_large_batch_as_a_small_one"
STOPPING = f"{MILESTONE}::test_check_stop_rules"

MISTAKES = [
    # --- hash_block -------------------------------------------------------------------------
    Mistake("serve/blocks.py", "hash_block",
            before="digest.update(ROOT_PARENT if parent is None else parent)",
            after="digest.update(ROOT_PARENT)",
            rule="a key depends on its parent: equal keys mean equal whole prefixes",
            expect="depend on its parent", tests=(HASHING,)),
    Mistake("serve/blocks.py", "hash_block",
            before='digest.update(array("q", tokens).tobytes())',
            after='digest.update(array("i", tokens).tobytes())',
            rule="tokens are packed as whole 64-bit integers, so distinct token lists never share bytes",
            expect="signed 64-bit", tests=(HASHING,)),
    Mistake("serve/blocks.py", "hash_block",
            before="if extra:\n        digest.update(repr(tuple(extra)).encode())",
            after="pass",
            rule="extra keys (adapter, salt, images) change the key",
            expect="extra keys must change the key", tests=(HASHING,)),
    # --- find_cached_prefix -----------------------------------------------------------------
    Mistake("serve/blocks.py", "BlockManager.find_cached_prefix",
            before="usable = (request.num_tokens - 1) // self.block_size",
            after="usable = request.num_tokens // self.block_size",
            rule="(nano-vllm issue 144) a prompt entirely in the prefix cache still computes its last "
                 "token: the block holding it is never matched",
            expect="must be computed", tests=LOOKUP),
    Mistake("serve/blocks.py", "BlockManager.find_cached_prefix",
            before="while len(run) < usable and keys[len(run)] in self.cached:\n"
                   "            run.append(self.cached[keys[len(run)]])",
            after="run = [self.cached[key] for key in keys[:usable] if key in self.cached]",
            rule="the match is a leading run: it stops at the first block that is not cached",
            expect="stops at the first miss", tests=LOOKUP),
    Mistake("serve/blocks.py", "BlockManager.find_cached_prefix",
            before="if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:",
            after="if not self.enable_prefix_caching:",
            rule="a request asking for prompt logprobs computes every prompt position: it reuses nothing",
            expect="prompt logprobs", tests=LOOKUP),
    Mistake("serve/blocks.py", "BlockManager.find_cached_prefix",
            before="self.stats[\"queries\"] += request.num_tokens",
            after="self.stats[\"queries\"] += self.block_size * usable",
            rule="the hit rate is found tokens over ALL looked-up prompt tokens",
            expect="hit rate", tests=LOOKUP),
    # --- allocate_slots ---------------------------------------------------------------------
    Mistake("serve/blocks.py", "BlockManager.allocate_slots",
            before="if fresh + idle_adopted > self.num_free:",
            after="if fresh > self.num_free:",
            rule="adopting a cached-free block uses up one of the free blocks",
            expect="adopting a cached-free block uses up a free block", tests=ALLOCATION),
    Mistake("serve/blocks.py", "BlockManager.allocate_slots",
            before="owned.extend(self._pop_free() for _ in range(fresh))",
            after="for _ in range(fresh):\n"
                  "            block = self.free_queue.popitem(last=False)[0]\n"
                  "            self.ref_count[block] = 1\n"
                  "            owned.append(block)",
            rule="(nano-vllm issue 163) a block handed out for new tokens loses its old key and leaves the "
                 "prefix cache",
            expect="hash dropped", tests=ALLOCATION),
    Mistake("serve/blocks.py", "BlockManager.allocate_slots",
            before="            if not owned:\n                del self.req_blocks[request.request_id]"
                   "     # leave no trace of a failed first try\n",
            after="",
            rule="a failed allocation changes nothing, not even an empty entry for the request",
            expect="leave no trace", tests=ALLOCATION),
    Mistake("serve/blocks.py", "BlockManager.allocate_slots",
            before="fresh = max(0, self.blocks_for(tokens) - len(owned) - len(cached_blocks))",
            after="fresh = self.blocks_for(num_new_tokens)",
            rule="only the blocks still missing are taken: tokens that fit the request's last block need none",
            expect="no new block needed", tests=ALLOCATION),
    Mistake("serve/blocks.py", "BlockManager.allocate_slots",
            before="            if self.ref_count[block] == 0:\n                self.free_queue.pop(block)\n",
            after="",
            rule="an adopted cached-free block leaves the free queue",
            expect="leaves the free queue", tests=ALLOCATION),
    # --- cache_full_blocks ------------------------------------------------------------------
    Mistake("serve/blocks.py", "BlockManager.cache_full_blocks",
            before="full = min(upto // self.block_size, len(keys), len(owned))",
            after="full = min(len(keys), len(owned))",
            rule="(nano-vllm issue 208) only blocks whose tokens are all written (or written this step) are "
                 "published: a request must not adopt a block another is still filling",
            expect="still filling", tests=PUBLISHING),
    Mistake("serve/blocks.py", "BlockManager.cache_full_blocks",
            before="if self.block_hash[block] is None and key not in self.cached:",
            after="if self.block_hash[block] is None:",
            rule="the first block published under a key keeps it; a duplicate stays private",
            expect="first block published", tests=PUBLISHING),
    Mistake("serve/blocks.py", "BlockManager.cache_full_blocks",
            before="upto = request.num_computed_tokens if num_tokens is None else num_tokens",
            after="upto = request.num_computed_tokens",
            rule="blocks are published when they are allocated (num_tokens counts as written), so the same "
                 "step can adopt them",
            expect="published when allocated", tests=PUBLISHING),
    # --- free -------------------------------------------------------------------------------
    Mistake("serve/blocks.py", "BlockManager.free",
            before="for block in reversed(self.req_blocks.pop(request.request_id, [])):",
            after="for block in self.req_blocks.pop(request.request_id, []):",
            rule="freed blocks join the back of the free queue tail first, so the shared head is reused last",
            expect="tail first", tests=FREEING),
    Mistake("serve/blocks.py", "BlockManager.free",
            before="                self.free_queue[block] = None",
            after="                self.free_queue[block] = None\n"
                  "                self.free_queue.move_to_end(block, last=False)",
            rule="freed blocks join the BACK of the free queue: the least recently freed is reused first",
            expect="back of the free queue", tests=FREEING),
    Mistake("serve/blocks.py", "BlockManager.free",
            before="            if left == 0:\n                self.free_queue[block] = None",
            after="            if left == 0:\n                self.free_queue[block] = None\n"
                  "                self.block_hash[block] = None",
            rule="a freed block keeps its key (cached-free) until it is reused",
            expect="keeps its hash", tests=FREEING),
    Mistake("serve/blocks.py", "BlockManager.free",
            before="            self.ref_count[block] = left\n            if left == 0:",
            after="            self.ref_count[block] = 0\n            if True:",
            rule="a block shared by several requests stays in use until the last one frees it",
            expect="stays in use", tests=(MILESTONE, "-k", "hitting")),
    # --- check_stop -------------------------------------------------------------------------
    Mistake("serve/engine.py", "EngineCore.check_stop",
            before="if produced >= params.min_tokens:",
            after="if True:",
            rule="min_tokens holds back EOS and stop tokens",
            expect="min_tokens holds back", tests=(STOPPING,)),
    Mistake("serve/engine.py", "EngineCore.check_stop",
            before="request.num_prompt_tokens + produced >= self.max_model_len",
            after="request.num_prompt_tokens + produced > self.max_model_len",
            rule="a request ends when prompt plus output reach max_model_len (no position left)",
            expect="context limit", tests=(STOPPING,)),
    Mistake("serve/engine.py", "EngineCore.check_stop",
            before="if token == request.eos_token_id and not params.ignore_eos:",
            after="if token == request.eos_token_id:",
            rule="ignore_eos lets a request run past EOS",
            expect="ignore_eos lets a request run past EOS", tests=(STOPPING,)),
    Mistake("serve/engine.py", "EngineCore.check_stop",
            before="position = index % request.num_tokens",
            after="position = request.num_tokens - 1",
            rule="check_stop judges the token at `index`, not always the newest",
            expect="not the newest", tests=(STOPPING,)),
    # --- build_batch ------------------------------------------------------------------------
    Mistake("serve/batch.py", "build_batch",
            before="slots.append(table[block] * block_size + offset)",
            after="slots.append(block * block_size + offset)",
            rule="a token's slot is in the PHYSICAL block the block table gives for its logical block",
            expect="physical block", tests=BATCH),
    Mistake("serve/batch.py", "build_batch",
            before="first_unknown = max(done, request.num_tokens - 1)",
            after="first_unknown = done + n - 1",
            rule="a chunk in the middle of a prompt samples no row",
            expect="samples nothing", tests=BATCH),
    Mistake("serve/batch.py", "build_batch",
            before="lengths.append(done + n)",
            after="lengths.append(n)",
            rule="seq_lens is the context length after this step (computed + new), not the new rows",
            expect="context length", tests=BATCH),
    Mistake("serve/batch.py", "build_batch",
            before="        return torch.tensor(values, dtype=dtype, device=device)",
            after="        nested = bool(values) and isinstance(values[0], list)\n"
                  "        shape = (len(values), len(values[0])) if nested else (len(values),)\n"
                  "        tensor = torch.zeros(shape, dtype=dtype, device=device)\n"
                  "        for i, value in enumerate(values):\n"
                  "            tensor[i] = torch.as_tensor(value, dtype=dtype)\n"
                  "        return tensor",
            rule="its number of tensor operations (copies to the device, launches) does not grow with the batch",
            expect="must not grow with the number of requests or rows", tests=(BATCH_COST,)),
    # --- _preempt ---------------------------------------------------------------------------
    Mistake("serve/scheduler.py", "Scheduler._preempt",
            before="self.waiting.add(request, front=True)",
            after="self.waiting.add(request)",
            rule="a preempted request resumes before everyone still waiting",
            expect="front of the waiting queue",
            tests=("tests/test_engine_rules.py", "-k", "preempted_request_resumes")),
    Mistake("serve/scheduler.py", "Scheduler._preempt",
            before="request.num_computed_tokens = 0                 # its K/V are forgotten",
            after="pass",
            rule="with recompute, a preempted request computes prompt and output again from position 0",
            expect="recompute mode", tests=(MILESTONE, "-k", "preempt_states")),
    Mistake("serve/scheduler.py", "Scheduler._preempt",
            before="request.swapped_out = True",
            after="pass",
            rule="a swapped-out request is marked swapped_out, so its next admission swaps it back in",
            expect="swapped_out", tests=(MILESTONE, "-k", "preempt_states")),
    Mistake("serve/scheduler.py", "Scheduler._preempt",
            before="        request.spec_token_ids = []\n",
            after="        request.spec_token_ids = []\n        self.blocks.free(request)\n",
            rule="swap_out names the blocks the request held when preempted, so their K/V reach the host",
            expect="held when preempted", tests=(MILESTONE, "-k", "preempt_states")),
    # --- write_kv ---------------------------------------------------------------------------
    Mistake("serve/backends.py", "write_kv",
            before="target = slot_mapping.masked_fill(slot_mapping < 0, scratch)",
            after="target = slot_mapping.masked_fill(slot_mapping < 0, 0)",
            rule="a padding row (slot -1) lands in the scratch block, never in a request's block",
            expect="scratch", tests=(f"{MILESTONE}::test_write_kv_and_the_scratch_block",)),
    Mistake("serve/backends.py", "write_kv",
            before="for pool, rows in ((k_cache, k), (v_cache, v)):",
            after="for pool, rows in ((k_cache, k), (v_cache, k)):",
            rule="values go to the value pool, keys to the key pool",
            expect="value pool", tests=(f"{MILESTONE}::test_write_kv_and_the_scratch_block",)),
    Mistake("serve/backends.py", "write_kv",
            before="scratch = k_cache.shape[0] * k_cache.shape[1] - 1",
            after="scratch = k_cache.shape[0] * k_cache.shape[1] - k_cache.shape[1]",
            rule="a padding row lands in the pool's very last slot",
            expect="last slot", tests=(f"{MILESTONE}::test_write_kv_and_the_scratch_block",)),
    # --- Scheduler.schedule -------------------------------------------------------------------
    Mistake("serve/scheduler.py", "Scheduler.schedule",
            before="while (self.waiting and budget > 0 and not out.preempted",
            after="while (self.waiting and budget > 0",
            rule="nothing is admitted in a step that preempted",
            expect="a step that preempted admitted",
            tests=("tests/test_engine_rules.py", "-k", "admitted_in_a_step_that_preempted")),
    Mistake("serve/scheduler.py", "Scheduler.schedule",
            before="                if request.num_computed_tokens == 0:\n                    blocks.forget_lookup",
            after="                if True:\n                    blocks.forget_lookup",
            rule="a swapped request never looked up, so its failed admission takes back no lookup",
            expect="lookup", tests=(f"{MILESTONE}::test_statistics_after_a_swap_in",)),
    Mistake("serve/scheduler.py", "Scheduler.schedule",
            before="                victim = self.running[-1]",
            after="                victim = request",
            rule="when blocks run short, the LAST running request is preempted",
            expect="the LAST running request is preempted",
            tests=("tests/test_engine_rules.py", "-k", "preempted_request_resumes")),
    Mistake("serve/scheduler.py", "Scheduler.schedule",
            before="complete = request.num_output_tokens >= request.params.max_tokens",
            after="complete = False",
            rule="a request that already has all its output tokens gets no row",
            expect="no row", tests=("tests/test_engine_rules.py", "-k", "all_its_output_tokens")),
    Mistake("serve/scheduler.py", "Scheduler.schedule",
            before="waits = not cfg.enable_chunked_prefill and budget < remaining <= cfg.max_num_batched_tokens",
            after="waits = False",
            rule="with chunked prefill off, a prompt that does not fit the budget left waits for a later step",
            expect="chunked prefill off", tests=("tests/test_engine_rules.py", "-k", "without_chunked_prefill")),
    Mistake("serve/scheduler.py", "Scheduler.schedule",
            before="            if request.status is Status.WAITING:\n"
                   "                request.num_cached_tokens = reused",
            after="            request.num_cached_tokens = reused",
            rule="num_cached_tokens records the prefix found at the FIRST admission, not a resumed one's",
            expect="num_cached_tokens", tests=(f"{MILESTONE}::test_statistics_after_a_swap_in",)),
    # --- EngineCore.step, execute_model, update -------------------------------------------------
    Mistake("serve/engine.py", "EngineCore.step",
            before="plan = self.schedule()",
            after="plan = self.scheduler.schedule()",
            rule="a step goes through its named parts (schedule keeps the plan and counts preemptions), "
                 "never around them",
            expect="named parts", tests=("tests/test_engine_rules.py", "-k", "public_parts or checks_its_plan_once")),
    Mistake("serve/engine.py", "EngineCore.execute_model",
            before="        for resumed, new_blocks in plan.swap_in:\n"
                   "            self.runner.swap_in(resumed, new_blocks)\n"
                   "        if batch is None:\n"
                   "            return None\n"
                   "        logits = self.runner.execute(batch)\n",
            after="        if batch is None:\n"
                  "            return None\n"
                  "        logits = self.runner.execute(batch)\n"
                  "        for resumed, new_blocks in plan.swap_in:\n"
                  "            self.runner.swap_in(resumed, new_blocks)\n",
            rule="a swapped-out request's K/V are copied back before the forward pass reads them",
            expect="differs from solo generate",
            tests=(f"{MILESTONE}::test_preempted_requests_resume_correctly",)),
    Mistake("serve/engine.py", "EngineCore.update",
            before="            if request.first_token_time is None:\n                request.first_token_time = now",
            after="            request.first_token_time = now",
            rule="first_token_time is stamped once, at the first token",
            expect="stamped once", tests=("tests/test_engine_rules.py", "-k", "first_token_time")),
    Mistake("serve/engine.py", "EngineCore.step",
            before="        return self.update(plan, self.sample_tokens(plan, batch, output.logits))",
            after="        return self.update(plan, self.sample_tokens(plan, batch, output.logits))[:1]",
            rule="a step returns an output for every request that gained a token or finished",
            expect="differs from solo generate", tests=(f"{MILESTONE}::test_preempted_requests_resume_correctly",)),
    Mistake("serve/engine.py", "EngineCore.step",
            before="        return self.update(plan, self.sample_tokens(plan, batch, output.logits))",
            after="        outputs = self.update(plan, self.sample_tokens(plan, batch, output.logits))\n"
                  "        self.steps += 1\n"
                  "        return outputs",
            rule="update counts the applied step; step does not count it again",
            expect="steps applied", tests=("tests/test_engine_rules.py", "-k", "checks_its_plan_once")),
    Mistake("serve/engine.py", "EngineCore.step",
            before="        output = self.execute_model(plan, batch)\n",
            after="        if batch is None:\n"
                  "            return []\n"
                  "        output = self.execute_model(plan, batch)\n",
            rule="a plan that schedules nobody still carries out its block copies",
            expect="still carries out its block copies",
            tests=("tests/test_engine_rules.py", "-k", "schedules_nobody")),
    Mistake("serve/engine.py", "EngineCore.execute_model",
            before="            self.runner.swap_in(resumed, new_blocks)\n",
            after="            pass\n",
            rule="every pair of plan.swap_in goes to the runner: a resumed request needs its K/V back",
            expect="differs from solo generate", tests=(f"{MILESTONE}::test_preempted_requests_resume_correctly",)),
    Mistake("serve/engine.py", "EngineCore.execute_model",
            before="        for victim, old_blocks in plan.swap_out:          # all copies out before any copy in\n"
                   "            self.runner.swap_out(victim, old_blocks)\n"
                   "        for resumed, new_blocks in plan.swap_in:\n"
                   "            self.runner.swap_in(resumed, new_blocks)\n"
                   "        if batch is None:\n"
                   "            return None\n"
                   "        logits = self.runner.execute(batch)\n",
            after="        for resumed, new_blocks in plan.swap_in:\n"
                  "            self.runner.swap_in(resumed, new_blocks)\n"
                  "        if batch is None:\n"
                  "            return None\n"
                  "        logits = self.runner.execute(batch)\n"
                  "        for victim, old_blocks in plan.swap_out:\n"
                  "            self.runner.swap_out(victim, old_blocks)\n",
            rule="a preempted request's blocks are copied out before the forward pass, which may write them "
                 "for their new owner",
            expect="differs from solo generate", tests=(f"{MILESTONE}::test_preempted_requests_resume_correctly",)),
    Mistake("serve/engine.py", "EngineCore.update",
            before="        self.steps += 1\n",
            after="",
            rule="self.steps counts every applied step",
            expect="steps applied", tests=("tests/test_engine_rules.py", "-k", "checks_its_plan_once")),
    Mistake("serve/engine.py", "EngineCore.update",
            before="                self.scheduler.finish(request, reason)",
            after="                self.scheduler.finish(request, Status.FINISHED_LENGTH)",
            rule="a request finishes with the status the stop rule gave (a stop token: 'stop')",
            expect="finishes as 'stop'", tests=("tests/test_engine_rules.py", "-k", "carry_the_stop_token")),
    Mistake("serve/engine.py", "EngineCore.update",
            before="            except Exception as exc:",
            after="            except ValueError as exc:",
            rule="one request's failure is never the step's: whatever its stop check raises, it finishes alone",
            expect="never the step's", tests=("tests/test_engine_faults.py", "-k", "stop_check_fails")),
    # --- ReferenceBackend.forward ----------------------------------------------------------------
    Mistake("serve/backends.py", "ReferenceBackend.forward",
            before="q_pos = k_pos[context - (last - first):]",
            after="q_pos = k_pos[:last - first]",
            rule="a request's query rows are the NEWEST tokens of its context",
            expect="attends causally", tests=(f"{MILESTONE}::test_reference_backend_matches_sdpa",)),
    Mistake("serve/backends.py", "ReferenceBackend.forward",
            before="allowed = (k_pos[None, :] > q_pos[:, None] - window) if window > 0 else None",
            after="allowed = (k_pos[None, :] >= q_pos[:, None] - window) if window > 0 else None",
            rule="with a window, a row reads only keys LESS than `window` positions behind it",
            expect="window", tests=(f"{MILESTONE}::test_reference_backend_matches_sdpa",)),
    Mistake("serve/backends.py", "ReferenceBackend.forward",
            before="gather_context(pool, meta.block_table[r], context)",
            after="gather_context(pool, meta.block_table[0], context)",
            rule="each request reads its keys through its OWN block table row",
            expect="block table", tests=(f"{MILESTONE}::test_reference_backend_matches_sdpa",)),
    # --- FlatModel.attention, FlatModel.forward ---------------------------------------------------
    Mistake("serve/flat_model.py", "FlatModel.attention",
            before="        backend.write(kv, k, v, meta)\n"
                   "        y = backend.forward(q, kv, meta, window=self.attention_windows[layer])",
            after="        y = backend.forward(q, kv, meta, window=self.attention_windows[layer])\n"
                  "        backend.write(kv, k, v, meta)",
            rule="this step's K/V are in the pool before attention reads it: each row sees its own key",
            expect="dense model", tests=(f"{MILESTONE}::test_flat_model_matches_dense_forward",)),
    Mistake("serve/flat_model.py", "FlatModel.attention",
            before="        k = apply_rope(k, cos, sin)\n",
            after="",
            rule="keys are rotated too: RoPE applies to q and k",
            expect="dense model", tests=(f"{MILESTONE}::test_flat_model_matches_dense_forward",)),
    Mistake("serve/flat_model.py", "FlatModel.attention",
            before="k = attn.k_norm(k.view(rows, cfg.num_key_value_heads, cfg.head_dim))",
            after="k = k.view(rows, cfg.num_key_value_heads, cfg.head_dim)",
            rule="QK-norm normalises the keys per head too, before RoPE",
            expect="dense model", tests=(f"{MILESTONE}::test_flat_model_matches_dense_forward",)),
    Mistake("serve/flat_model.py", "FlatModel.forward",
            before="positions, tables, kv_caches[index], meta,",
            after="positions, self.rope(positions, stream.dtype), kv_caches[index], meta,",
            rule="the RoPE tables are built once per step and shared by every layer",
            expect="once per step", tests=(f"{MILESTONE}::test_flat_model_matches_dense_forward",)),
    Mistake("serve/flat_model.py", "FlatModel.forward",
            before="return self.add_norm(self.backbone.norm, stream, branch)[0]",
            after="return stream + branch",
            rule="the hidden states end with the backbone's final norm",
            expect="dense model", tests=(f"{MILESTONE}::test_flat_model_matches_dense_forward",)),
    Mistake("serve/flat_model.py", "FlatModel.forward",
            before="branch = self.mlp(block.mlp, normed)",
            after="branch = self.mlp(block.mlp, stream)",
            rule="the MLP reads the post-attention NORMALISED stream",
            expect="dense model", tests=(f"{MILESTONE}::test_flat_model_matches_dense_forward",)),
    Mistake("serve/flat_model.py", "FlatModel.forward",
            before="return self.add_norm(self.backbone.norm, stream, branch)[0]",
            after="return self.backbone.norm(stream + branch)",
            rule="the final norm goes through add_norm like every other residual add and norm (Chapter 33 fuses it)",
            expect="goes through its seams", tests=(f"{MILESTONE}::test_flat_model_goes_through_its_seams",)),
]

DECIDES = {
    "write_kv":
        "how to scatter a step's keys and values into the pool on the device, padding rows included, without the "
        "host ever counting the real rows",
    "ReferenceBackend.forward":
        "how to recover each request's rows and its context from the flat batch's host lists and the block table, "
        "and which keys each row may see",
    "build_batch":
        "how to lay a step's requests out as flat tensors (rows, positions, slots, which rows are sampled) with "
        "a number of tensor operations that does not grow with the batch",
    "hash_block":
        "what a block's key must cover so that equal keys mean equal whole prefixes, and why the hash must be "
        "cryptographic and stable across processes",
    "BlockManager.find_cached_prefix":
        "how far a lookup may reuse cached blocks, stopping before the prompt's last token so its logits are "
        "still computed",
    "BlockManager.allocate_slots":
        "how to count what an allocation needs (adopted cached-free blocks included) before changing anything, so "
        "a refusal leaves no trace",
    "BlockManager.cache_full_blocks":
        "which of a request's blocks may be published now, and who keeps a key when two requests computed the "
        "same block",
    "BlockManager.free":
        "what a freed block keeps (its key) and in which order blocks rejoin the free queue so shared prefixes "
        "survive longest",
    "EngineCore.check_stop":
        "how the stop rules (stop tokens, EOS, min_tokens, max_tokens, the model's length) combine and which wins "
        "when several hold",
    "EngineCore.step":
        "how the step's named parts hand data to one another, and what a step with nothing scheduled still must "
        "do",
    "EngineCore.execute_model":
        "where a step's device work begins and ends: the block copies in a safe order, then one forward pass, "
        "touching no request state",
    "EngineCore.update":
        "how each scheduled request ends the step in exactly one state (failed, mid-prompt, produced tokens, "
        "finished) without one request's failure spoiling the others",
    "FlatModel.attention":
        "where this step's keys are written relative to the attention read, so every row sees its own key, and "
        "when to hand over to a module's own paged path",
    "FlatModel.forward":
        "how to run the decoder layers on flat rows through the seams later chapters override, building the RoPE "
        "tables once per step",
    "Scheduler._preempt":
        "what state a preempted request must give up or keep, for recompute and for swap, so it resumes correctly "
        "ahead of newer requests",
    "Scheduler.schedule":
        "how to split a token budget between running and waiting requests, whom to preempt when blocks run short, "
        "and when admission must stop",
}

DESIGN = ("Scheduler.schedule", "EngineCore.execute_model", "BlockManager.allocate_slots")
