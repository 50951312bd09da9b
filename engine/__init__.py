"""Your engine, to build chapter by chapter: the course's code with the bodies of
the stubs left for you to write. The course's skeleton generator made this package from
the reference engine, keeping everything but the stub bodies: a function whose
docstring names its chapter as "(Your engine: Chapter N)" raises NotImplementedError until
you write it, and everything else already works. Each chapter's notebook introduces its
stubs; `pytest --impl engine tests/test_chNN_*.py` checks them and `python run.py progress`
says where you are. Modules import each other relatively, so this package loads under any
name.

The modules, in the order the book builds them (chapters in brackets):

    cost.py            [1-2]      parameters, FLOPs and bytes from a config; step_cost, Hardware, GPUS
    tokenizer.py       [3]        ByteTokenizer, embed, lm_logits
    layers.py          [4, 6]     rms_norm, RMSNorm, rope_cos_sin, apply_rope
    attention.py       [5]        causal_attention: the mask comes from positions
    qwen3.py           [7, 9-10]  Qwen3Config, the MLP, attention, decoder layer, Qwen3ForCausalLM
    sampling.py        [8, 16]    sample (greedy, temperature, top-k/p, min-p) and generate
    checkpoint.py      [11]       load_checkpoint / save_checkpoint of Hugging Face directories
    numerics.py        [12]       ulp, measure_error, tolerance_for, batch_drift
    parity.py          [13]       compare_logits, greedy_parity: ours against another model
    profiling.py       [14]       time_it, synchronizer, op_shares, profile_forward
    roofline.py        [15]       matmul_flops, op_bytes, measure_hardware, measure_step
    kv_cache.py        [16]       KVCache (one row per sequence) and ModelCache, the cache protocol
    pipeline.py        [17]       Pipeline: checkpoint directory and text in, text out
    decode_timing.py   [18]       decode_step_seconds, launch_overhead, decode_report
    fast_decoder.py    [19]       StaticKVCache, FastDecoder (CUDA graphs on a GPU)
    quant.py           [20]       int8 weight-only quantization: Int8Linear, quantize_model
    static_batch.py    [21]       left_pad, padding_mask, generate_batch
    workloads.py       [22]       WorkItem workloads, RequestRecord metrics, replay, StepEngine
    chunked.py         [23]       prefill_chunked, generate_chunked, serve_two (a decode beside a long prefill)
    continuous.py      [24]       SlotKVCache, ContinuousBatchingEngine (a request per row)
    paged.py           [25]       PagedKVCache, PrefixCache, PagedEngine (blocks shared by prefix)
    speculative.py     [26]       propose, accept_greedy / accept_sampled, speculative_generate
    moe.py             [27]       Qwen3MoeConfig, the sparse MoE block, Qwen3MoeForCausalLM
    kv_quant.py        [28]       quantize_kv, QuantizedKVCache
    flash.py           [29]       online_softmax_update, flash_attention (tiles in PyTorch)
    triton_kernels.py  [30]       vector_add, softmax: first Triton kernels
    serve/             [31-32]    the engine core: requests, scheduler, block manager, one
                                  flat batch per step, attention backends (its __init__
                                  maps its modules)
    paged_kernels.py   [32]       Triton paged attention and KV store over the block pool
    bpe.py             [36]       byte-level BPE: train_bpe, BPETokenizer (GGUF metadata, chat
                                  template), IncrementalDetokenizer, StopStringMatcher
    server/            [38]       the OpenAI-compatible HTTP server: protocol, engine loop, app
    gguf.py            [39]       GGUFFile reader, dequantization (F16, Q8_0, Q4_0, Q4_1), GGUFLinear
    parallel/          [41]       several processes, one device each: tensor and pipeline
                                  parallelism, disaggregated prefill (torch.distributed)
    families.py        [42]       the model-family registry: Llama, Qwen2, Mistral, scaled RoPE
                                  (checkpoint.load_model picks the family from a config or GGUF)
    mla.py             [42]       DeepSeek-V2's latent attention: one small cached vector per
                                  token, absorbed into multi-query attention over the pool
"""
