"""Chapter 16 milestone: the KV cache changes the cost of generate, never its output.

Oracles: the reference model run on the whole sequence with no cache at all (its logits,
and its greedy generate by full recompute, Chapter 8's algorithm), torch.cat for what a
cache must hold, and the float formula 2 x layers x batch x kv_heads x slots x head_dim x
bytes for its memory. Greedy parity is deterministic: the tiny model's greedy choices
have margins far above the ~1e-6 by which cached and recomputed logits differ.
"""
import pytest
import torch

from course.models import tiny_qwen3
from course.testing.milestone_helpers import prompt_ids, step_difference
from course.testing.oracles import reference_call, reference_generate, reference_tiny_qwen3

pytestmark = pytest.mark.chapter(16)

# (prompt length, new tokens): one-token prompts, a single new token, long and short runs.
CASES = [(1, 24), (2, 5), (7, 1), (7, 24), (31, 12), (100, 8)]


def small_cache(impl, batch=2, max_len=10, layers=2, kv_heads=2, head_dim=4):
    return impl.kv_cache.KVCache(layers, batch, kv_heads, head_dim, max_len)


def storage_bytes(tensors):
    """Bytes of the memory behind `tensors`, each block counted once, measured here rather than
    by the cache's own nbytes (views of one big block are one block)."""
    blocks = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(blocks.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_new_cache_is_empty_zeroed_and_owns_a_buffer_per_layer_and_tensor(impl, dtype):
    """What __init__ allocates, seen from outside: the layout, zeros, no sharing, exactly the formula."""
    layers, batch, kv_heads, head_dim, max_len = 3, 2, 2, 4, 10
    shape = (batch, kv_heads, max_len, head_dim)
    for attempt in range(5):
        # Leave NaN-filled memory behind, so that a cache which does not clear what it gets sees it.
        leftovers = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(2 * layers)]
        del leftovers
        cache = impl.kv_cache.KVCache(layers, batch, kv_heads, head_dim, max_len, dtype=dtype)
        assert cache.length == 0 and cache.max_len == max_len, "a new cache is empty: length 0, max_len as asked"
        buffers = list(cache.k) + list(cache.v)
        assert len(cache.k) == len(cache.v) == layers, (
            f"one key tensor and one value tensor per layer: {layers} layers, got {len(cache.k)} and {len(cache.v)}")
        found = [(tuple(t.shape), t.dtype) for t in buffers]
        assert all(item == (shape, dtype) for item in found), (
            f"each layer's keys and values are one tensor [batch, kv_heads, max_len, head_dim] = {shape} in the "
            f"dtype asked ({dtype}); found {sorted(set(found), key=str)}")
        dirty = [i for i, t in enumerate(buffers) if torch.count_nonzero(t.nan_to_num(1.0)) > 0]
        assert not dirty, (f"every slot reads 0 until written; tensors {dirty} of a new cache (attempt {attempt}) "
                           "hold leftover memory")
    for index, tensor in enumerate(buffers):
        tensor.fill_(index + 1)
    shared = [index for index, tensor in enumerate(buffers) if not bool((tensor == index + 1).all())]
    assert not shared, (f"writing one tensor changed another (tensors {shared}, keys first then values): no two "
                        "layers share storage, and keys and values do not share storage")
    element = torch.empty((), dtype=dtype).element_size()
    expected = 2 * layers * batch * kv_heads * max_len * head_dim * element
    held = storage_bytes(buffers)
    assert held == expected, (f"the cache holds {held} bytes of storage; the layout needs exactly {expected}: "
                              "max_len slots, no spare copy")


def test_update_stores_new_keys_and_returns_all_so_far(impl):
    cache = small_cache(impl)
    g = torch.Generator().manual_seed(0)
    k1, v1 = torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 2, 3, 4, generator=g)
    k, v = cache.update(0, k1, v1)
    assert k.shape == (2, 2, 3, 4), f"after writing 3 tokens, update should return 3 slots; got {tuple(k.shape)}"
    torch.testing.assert_close(k, k1)
    torch.testing.assert_close(v, v1)
    assert cache.length == 0, "update must not move length; the model calls advance once after all layers"
    assert k.data_ptr() == cache.k[0].data_ptr() and v.data_ptr() == cache.v[0].data_ptr(), (
        "update returns views into the cache's own buffers, not copies")
    k1b = torch.randn(2, 2, 3, 4, generator=g)
    cache.update(1, k1b, k1b)                       # layer 1 of the same step starts at slot 0 too
    cache.advance(3)
    k2, v2 = torch.randn(2, 2, 1, 4, generator=g), torch.randn(2, 2, 1, 4, generator=g)
    k, v = cache.update(0, k2, v2)
    assert k.shape[2] == 4, (f"after 3 tokens and 1 more, update must return all 4 slots so far, not only the "
                             f"new ones; got {k.shape[2]}")
    torch.testing.assert_close(k, torch.cat([k1, k2], dim=2), msg="layer 0 should hold step 1 then step 2")
    torch.testing.assert_close(v, torch.cat([v1, v2], dim=2), msg="values of layer 0, slots 0..3")
    k, _ = cache.update(1, k2, v2)
    torch.testing.assert_close(k, torch.cat([k1b, k2], dim=2), msg="layers must not share storage")
    assert torch.count_nonzero(cache.k[0][:, :, 4:]) == 0, "slots after the written ones must stay untouched"


def test_capacity_is_enforced_before_writing(impl):
    cache = small_cache(impl, max_len=10)
    ones = torch.ones(2, 2, 8, 4)
    cache.update(0, ones, ones)
    cache.advance(8)
    before = cache.k[0].clone()
    try:
        cache.update(0, torch.full((2, 2, 3, 4), 7.0), torch.full((2, 2, 3, 4), 7.0))
    except ValueError:
        pass
    except Exception as exc:
        pytest.fail(f"3 tokens at length 8 of a 10-slot cache: expected a ValueError raised before writing "
                    f"(check the capacity first), got {type(exc).__name__}: {exc}")
    else:
        pytest.fail("3 tokens at length 8 of a 10-slot cache must be refused with a ValueError")
    assert cache.length == 8, "a refused update must leave length alone"
    torch.testing.assert_close(cache.k[0], before, msg="a refused update must not write anything")
    try:
        k, _ = cache.update(0, torch.full((2, 2, 2, 4), 7.0), torch.full((2, 2, 2, 4), 7.0))
    except ValueError as error:
        pytest.fail(f"2 tokens at length 8 of a 10-slot cache were refused ({error}): the new tokens may fill "
                    "the cache exactly to max_len")
    assert k.shape[2] == 10, (f"2 tokens at length 8 fill the 10-slot cache exactly, and update returns all 10 "
                              f"slots; got {k.shape[2]}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cache_memory_is_the_formula(impl, dtype):
    model = tiny_qwen3(impl.package, dtype=dtype)
    cfg, batch, slots = model.cfg, 3, 50
    cache = impl.kv_cache.KVCache.for_model(model, batch, slots)
    element = torch.empty((), dtype=dtype).element_size()
    expected = 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * slots * cfg.head_dim * element
    assert cache.nbytes == expected, (
        f"{dtype}: expected {expected:,} bytes for {batch} x {slots} slots, got {cache.nbytes:,}")
    per_token = reference_call("cost.kv_bytes_per_token", cfg, dtype)
    assert cache.nbytes == per_token * batch * slots, "the cache is Chapter 2's bytes per token times its slots"
    storage = [t.data_ptr() for t in cache.k + cache.v]
    with torch.inference_mode():
        model(torch.arange(batch * 30).remainder(250).view(batch, 30), cache=cache)
    assert cache.length == 30
    assert cache.nbytes == expected and [t.data_ptr() for t in cache.k + cache.v] == storage, (
        "filling the cache must write into the tensors allocated up front, never allocate new ones")


@torch.inference_mode()
def test_cached_logits_equal_full_recompute(impl, tiny_model, ref_model, device):
    ids = prompt_ids(23, seed=1)
    cache = impl.kv_cache.KVCache.for_model(tiny_model, 1, 40)
    step_logits, fed = [], 0
    for chunk in (ids[:9], ids[9:10], ids[10:]):            # a prefill in three uneven pieces
        step_logits.append(tiny_model(torch.tensor([chunk], device=device), cache=cache)[0])
        fed += len(chunk)
        assert cache.length == fed, (f"the calls so far fed {fed} tokens; cache.length is {cache.length} (a forward "
                                     f"pass advances the cache once, by the tokens it fed, after the last layer)")
    full = ref_model(torch.tensor([ids], device=device))[0]
    torch.testing.assert_close(torch.cat(step_logits), full, atol=1e-4, rtol=1e-4,
                               msg="logits of a prefill fed in chunks through the cache differ from one full pass")
    tokens = list(ids)
    for step in range(6):                                    # decode: one token per call
        token = int(step_logits[-1][-1].argmax())
        tokens.append(token)
        step_logits.append(tiny_model(torch.tensor([[token]], device=device), cache=cache)[0])
        full = ref_model(torch.tensor([tokens], device=device))[0, -1]
        torch.testing.assert_close(step_logits[-1][-1], full, atol=1e-4, rtol=1e-4,
                                   msg=f"decode step {step}: cached logits differ from recomputing "
                                       f"all {len(tokens)} tokens")


def test_greedy_cached_equals_recompute(impl, tiny_model, ref_model):
    for length, new in CASES:
        ids = prompt_ids(length, seed=100 * length + new)
        expected = reference_generate(ref_model, ids, new, use_cache=False)
        got = impl.sampling.generate(tiny_model, ids, new, use_cache=True)
        assert got == expected, (f"prompt of {length} tokens, {new} new: cached generate differs from "
                                 f"full recompute at {step_difference(expected, got)}")


def test_cached_generate_feeds_the_prompt_once_then_one_token_per_call(impl, tiny_model):
    """The cost contract: one call for the whole prompt, then exactly the newest token."""
    ids, new = prompt_ids(9, seed=3), 6
    fed = []
    handle = tiny_model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append((args[0] if args else kwargs["input_ids"])[0].tolist()),
        with_kwargs=True)
    try:
        out = impl.sampling.generate(tiny_model, ids, new, use_cache=True)
    except ValueError as error:          # feeding more than the newest token overflows the cache
        pytest.fail(f"generate_cached fed the model {[len(f) for f in fed]} tokens per call, then {error}; "
                    f"expected the {len(ids)}-token prompt once, then each new token alone")
    finally:
        handle.remove()
    expected = [ids] + [[token] for token in out[:-1]]      # the last token is returned, never fed
    assert fed == expected, (f"generate_cached fed the model {[len(f) for f in fed]} tokens per call; expected the "
                             f"{len(ids)}-token prompt once, then each new token alone ({[len(f) for f in expected]})")


def test_rows_of_a_batch_share_one_cache(impl, ref_model, device, tiny_model):
    rows = [prompt_ids(12, seed=7), prompt_ids(12, seed=8)]
    cache = impl.kv_cache.KVCache.for_model(tiny_model, 2, 12 + 8)
    feed = torch.tensor(rows, device=device)
    outputs = [[], []]
    with torch.inference_mode():
        for _ in range(8):
            logits = tiny_model(feed, cache=cache)[:, -1]
            feed = logits.argmax(dim=-1, keepdim=True)
            for row, token in enumerate(feed[:, 0].tolist()):
                outputs[row].append(token)
    for row, ids in enumerate(rows):
        expected = reference_generate(ref_model, ids, 8, use_cache=False)
        assert outputs[row] == expected, f"row {row} of a 2-row cache: {step_difference(expected, outputs[row])}"


@pytest.mark.parametrize("length,new", [(40, 20), (47, 5), (48, 3), (30, 18)])
def test_generation_stops_at_the_context_limit(impl, device, length, new):
    limit = 48
    model = tiny_qwen3(impl.package, device=device, max_position_embeddings=limit)
    oracle = reference_tiny_qwen3(device, max_position_embeddings=limit)
    ids = prompt_ids(length, seed=length)
    expected = reference_generate(oracle, ids, new, use_cache=False)
    assert len(expected) == min(new, limit - length)
    got = impl.sampling.generate(model, ids, new, use_cache=True)
    assert got == expected, (f"prompt {length}, {new} new, context limit {limit}: "
                             f"{step_difference(expected, got)} (the sequence may grow to exactly {limit} tokens)")


def test_a_prompt_that_fills_the_default_context(impl, tiny_model, ref_model):
    limit = tiny_model.context_limit
    if limit > 2048:
        pytest.skip(f"a {limit}-token context is too long to recompute in a test")
    ids = prompt_ids(limit - 4, seed=3)
    expected = reference_generate(ref_model, ids, 10, use_cache=False)
    got = impl.sampling.generate(tiny_model, ids, 10, use_cache=True)
    assert len(expected) == 4
    assert got == expected, f"prompt of {limit - 4} tokens, context {limit}: {step_difference(expected, got)}"


def test_stop_tokens_end_cached_generation(impl, tiny_model, ref_model):
    ids = prompt_ids(9, seed=11)
    free = reference_generate(ref_model, ids, 12, use_cache=False)
    stop = free[5]
    expected = free[:free.index(stop) + 1]
    got = impl.sampling.generate(tiny_model, ids, 12, stop_token_ids=(stop,), use_cache=True)
    assert got == expected, f"stop token {stop}: expected {expected} (stop token included), got {got}"
    got = impl.sampling.generate(tiny_model, ids, 12, eos_token_id=stop, use_cache=True)
    assert got == expected, f"eos {stop}: expected {expected}, got {got}"
