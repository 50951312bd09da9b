"""Chapter 41: one model served by several processes, one device each.

    launch.py   process groups (NCCL on GPUs, gloo on CPUs) and a launcher that never hangs
    tp.py       tensor parallelism: column/row-parallel linears, vocabulary-parallel
                embedding and LM head, shard_model (a Qwen3 cut into one rank's heads)
    pp.py       pipeline parallelism: stages by layer ranges, micro-batches, hidden states
                sent from stage to stage
    disagg.py   disaggregated prefill: K/V blocks shipped from a prefill engine to a decode
                engine through the scheduler's on_finish hook
"""
