"""Chapter 31: every knob of the engine core in one validated object.

Some fields name features that later chapters build (CUDA graphs, asynchronous scheduling,
the full sampler, quantized pools). Their defaults keep them off; the string options are
Literal types, so a misspelt value is a type error before it is a ValueError here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, get_args

Policy = Literal["fcfs", "priority", "aging"]
PreemptionMode = Literal["recompute", "swap"]
SamplerName = Literal["simple", "full"]
KVCacheDtype = Literal["auto", "int8", "fp8"]
CudaGraphs = Literal["off", "auto", "on", "static"]
DeviceQueueMode = Literal["auto", "cuda", "thread", "inline"]
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]

# field -> the values it takes (the Literal's arguments)
CHOICES: dict[str, tuple[str, ...]] = {
    "policy": get_args(Policy),
    "preemption_mode": get_args(PreemptionMode),
    "sampler": get_args(SamplerName),
    "kv_cache_dtype": get_args(KVCacheDtype),
    "cuda_graphs": get_args(CudaGraphs),
    "device_queue": get_args(DeviceQueueMode),
    "dtype": get_args(ModelDtype),
}


@dataclass
class SchedulerConfig:
    """What the Scheduler reads; EngineConfig takes every one of these fields too.

    max_num_batched_tokens   token budget of one step (all requests' new tokens together)
    max_num_seqs             most requests running at once
    enable_chunked_prefill   split prompts across steps; off: a prompt must fit one budget
    long_prefill_token_threshold  cap on one request's tokens per step (0: no cap)
    policy                   the waiting queue's order (serve.scheduler.create_request_queue):
                             "fcfs", "priority" (smaller priority value first), or "aging"
                             ("priority", one level better per aging_seconds waited)
    aging_seconds            the wait that earns one priority level under "aging"
    preemption_mode          "recompute" or "swap"
    max_loras                most distinct LoRA adapters running at once (Chapter 43)
    """
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: Policy = "fcfs"
    aging_seconds: float = 10.0
    preemption_mode: PreemptionMode = "recompute"
    max_loras: int = 4


@dataclass
class EngineConfig(SchedulerConfig):
    """Configuration of EngineCore: the SchedulerConfig fields, and

    block_size               tokens per KV block
    num_blocks               pool size in blocks; None sizes it from memory: on CUDA by
                             profiling (gpu_memory_utilization), elsewhere kv_cache_bytes
    kv_cache_bytes           pool bytes (all layers, K and V) when num_blocks is None off CUDA
    enable_prefix_caching    reuse cached full blocks through hash chains
    attention_backend        a name in serve.backends' registry
    seed                     seeds the engine's generator for unseeded sampled requests
    sampler                  "simple" (Chapter 31) or "full" (Chapter 34)
    max_model_len            positions a request may reach; None: the model's context limit
    gpu_memory_utilization   share of the GPU the weights, activations and pool may use
    kv_cache_dtype           "auto" (the model's dtype) or a quantized pool (Chapter 32)
    cuda_graphs              decode steps in padded static shapes (Chapter 33): "off"; "auto"
                             (CUDA graphs on CUDA with a graph-safe backend); "on" (graphs,
                             or an error); "static" (the padded path run eagerly, any device)
    compile_decode           decode steps of the padded path run one torch.compile'd forward
                             per bucket, attention outside the graph as an opaque operator
                             (Chapter 33); needs cuda_graphs other than "off". On CUDA with
                             graphs on, the compiled forward is what the graphs capture
    async_scheduling         schedule step t+1 while step t runs (Chapter 33)
    device_queue             where the asynchronous engine runs each step's device part
                             (serve.overlap.DeviceQueue): "cuda", "thread", "inline", or
                             "auto" ("cuda" on a CUDA device, else "inline")
    debug_checks             check the scheduler's and block manager's invariants
                             (course/testing/engine_checks.py) inside every step: slow, for tests
    dtype                    the weights' and KV pool's dtype: "auto" keeps the model's; a name
                             ("bfloat16": AMX/AVX512-BF16 matmuls on a recent CPU, tensor cores
                             on a GPU) casts the model's weights IN PLACE when the core is built
                             (Chapter 32). Norm statistics, RoPE angles and logits stay float32.
    """
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 256 << 20
    enable_prefix_caching: bool = True
    attention_backend: str = "reference"
    seed: int = 0
    sampler: SamplerName = "simple"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: KVCacheDtype = "auto"
    cuda_graphs: CudaGraphs = "off"
    compile_decode: bool = False
    async_scheduling: bool = False
    device_queue: DeviceQueueMode = "auto"
    debug_checks: bool = False
    dtype: ModelDtype = "auto"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> EngineConfig:
        """Raise ValueError naming the field and the rule it breaks."""
        def positive(name: str, allow_none: bool = False, low: int = 1) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"EngineConfig.{name} must be an integer >= {low}, got {value!r}")

        positive("max_num_batched_tokens")
        positive("max_num_seqs")
        positive("block_size")
        positive("num_blocks", allow_none=True)
        positive("kv_cache_bytes")
        positive("long_prefill_token_threshold", low=0)
        positive("max_model_len", allow_none=True)
        positive("seed", low=0)
        positive("max_loras")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"EngineConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.attention_backend, str) or not self.attention_backend:
            raise ValueError(f"EngineConfig.attention_backend must be a backend name, got {self.attention_backend!r}")
        if (isinstance(self.aging_seconds, bool) or not isinstance(self.aging_seconds, (int, float))
                or not 0 < self.aging_seconds < math.inf):
            raise ValueError(f"EngineConfig.aging_seconds must be a finite number of seconds > 0, "
                             f"got {self.aging_seconds!r}")
        if (isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling", "debug_checks",
                     "compile_decode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.compile_decode and self.cuda_graphs == "off":
            raise ValueError("EngineConfig.compile_decode=True compiles the padded decode path, which "
                             "EngineConfig.cuda_graphs='off' does not run: give cuda_graphs 'static', 'auto' or 'on'")
        return self

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(**{f.name: getattr(self, f.name) for f in fields(SchedulerConfig)})
