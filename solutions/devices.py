"""Chapter 40: the devices an engine runs on, and one model's layers spread over several.

Part one is the handful of questions the engine asks whatever it runs on: which device
(`pick_device`), has the queued work finished (`synchronize`), how much memory is left
(`memory_info`), which dtype to load weights in (`default_dtype`), and where host copies
of swapped K/V should live (`pinned`), and how a host tensor reaches the device without
waiting for it (`to_device`). Each answer differs between CUDA (and ROCm, which
PyTorch exposes as `torch.cuda`), Apple's MPS, Intel's XPU and the CPU; the rest of the
engine asks here instead of testing `device.type` itself.

Part two places contiguous ranges of decoder layers on different devices in one process (a
simple pipeline): `plan_layers` chooses the ranges from memory, `PlacedFlatModel` moves
the weights, gives Chapter 31's ModelRunner `layer_device(i)` so each layer's KV pool is
allocated beside that layer, and hands the residual stream from stage to stage, counting
every transfer.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .profiling import synchronizer
from .serve.flat_model import FlatModel, RopeTables

if TYPE_CHECKING:
    from .qwen3 import Qwen3Attention, Qwen3ForCausalLM
    from .serve.backends import KVCache
    from .serve.batch import BatchMeta
    from .serve.interfaces import AttentionBackend

AUTO_ORDER = ("cuda", "mps", "xpu", "cpu")     # what "auto" tries, fastest kind first


# --- part one: asking a device ----------------------------------------------------------------

def device_count(kind: str) -> int:
    """How many devices of `kind` ("cuda", "mps", "xpu", "cpu") this process can use."""
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "mps":
        return 1 if torch.backends.mps.is_available() else 0
    if kind == "xpu":
        xpu = getattr(torch, "xpu", None)            # builds without Intel support have no torch.xpu
        return xpu.device_count() if xpu is not None and xpu.is_available() else 0
    if kind == "cpu":
        return 1
    raise ValueError(f"unknown device kind {kind!r}: expected one of {', '.join(AUTO_ORDER)}")


def pick_device(choice: str | torch.device | None = "auto") -> torch.device:
    """The torch.device to run on.  (Your engine: Chapter 40)

    choice: "auto" or None -> the first kind of AUTO_ORDER ("cuda", "mps", "xpu", "cpu")
    with at least one device (device_count(kind) > 0), as torch.device(kind) without an
    index; anything else ("cuda", "cuda:1", "mps", "xpu:0", "cpu", or a torch.device) ->
    that device, unchanged.
    Errors: ValueError, every message quoting the choice as repr() ('tpu'), when it is not
    a device string torch understands, when its kind is not one of AUTO_ORDER, when no
    device of that kind is present (the message says "no <kind> device"), or when its index
    is not below device_count(kind) (the message says how many there are).
    Trap: "cuda" is also ROCm's name (PyTorch built for HIP answers torch.cuda), so never
    test for NVIDIA by name; ask device_count.
    """
    if choice is None or choice == "auto":
        kind = next(k for k in AUTO_ORDER if device_count(k) > 0)
        return torch.device(kind)
    try:
        device = torch.device(choice)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {choice!r} is not a device torch understands "
                         f"(try auto, cpu, cuda, cuda:1, mps, xpu)") from None
    if device.type not in AUTO_ORDER:
        raise ValueError(f"--device {choice!r}: the engine runs on {', '.join(AUTO_ORDER)}, not {device.type}")
    count = device_count(device.type)
    if count == 0:
        raise ValueError(f"--device {choice!r}: torch sees no {device.type} device here")
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {choice!r}: torch sees {count} {device.type} device(s), numbered from 0")
    return device


def visible_devices() -> list[torch.device]:
    """Every device this process can use: each CUDA and XPU device by index, MPS, the CPU."""
    found = []
    for kind in AUTO_ORDER:
        count = device_count(kind)
        if kind in ("cuda", "xpu"):
            found += [torch.device(kind, i) for i in range(count)]
        elif count:
            found.append(torch.device(kind))
    return found


def require_device(device: torch.device | str, asker: str) -> torch.device:
    """`device` as a torch.device, when this process has it. For a device that is absent
    (or numbered past the last one) torch's own queries fail with an AssertionError or a
    RuntimeError that does not say which device was asked for; this says it, as a
    ValueError. Kinds outside AUTO_ORDER ("meta") are left to the caller."""
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{asker}: {device!r} is not a device torch understands") from None
    if found.type in AUTO_ORDER:
        count = device_count(found.type)
        if count == 0 or (found.index is not None and found.index >= count):
            raise ValueError(f"{asker}: torch sees {count} {found.type} device(s) here, so no {str(found)!r}")
    return found


def synchronize(device: torch.device | str) -> None:
    """Wait until every kernel queued on `device` has finished (nothing to wait for on a CPU)."""
    synchronizer(device)()


@dataclass
class MemoryInfo:
    """What a device has, in bytes, and where the numbers come from."""
    free_bytes: int
    total_bytes: int
    source: str


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host RAM."""
    try:
        import psutil
    except ImportError:                       # psutil comes with Jupyter; without it, Linux's own table
        fields = {}
        with open("/proc/meminfo") as table:
            for line in table:
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0]) * 1024          # the table counts kiB
        return fields["MemAvailable"], fields["MemTotal"]
    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def memory_info(device: torch.device | str) -> MemoryInfo:
    """Free and total memory of `device` as its own runtime reports them.

    CUDA/ROCm: the driver's cudaMemGetInfo (other processes' use counts against free).
    MPS: the GPU shares the Mac's RAM; Metal recommends a working-set size, and what this
    process's Metal driver holds already is taken from it. XPU: the runtime's own query.
    CPU: the host's available RAM. ValueError for a device this process does not have."""
    device = require_device(device, "memory_info")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return MemoryInfo(int(free), int(total), "torch.cuda.mem_get_info")
    if device.type == "mps":
        total = int(torch.mps.recommended_max_memory())
        return MemoryInfo(max(0, total - int(torch.mps.driver_allocated_memory())), total,
                          "torch.mps.recommended_max_memory - driver_allocated_memory")
    if device.type == "xpu":
        free, total = torch.xpu.mem_get_info(device)
        return MemoryInfo(int(free), int(total), "torch.xpu.mem_get_info")
    if device.type == "cpu":
        free, total = _host_memory()
        return MemoryInfo(free, total, "host RAM (available)")
    raise ValueError(f"memory_info: no memory query for device type {device.type!r}")


def supports_bf16(device: torch.device | str) -> bool:
    """Whether bfloat16 tensors compute on `device` at useful speed (CPU: they work, slowly
    unless the core has AVX512-BF16 or AMX; we say no and keep float32 there). ValueError
    for a device this process does not have."""
    device = require_device(device, "supports_bf16")
    if device.type == "cuda":
        # torch.cuda.is_bf16_supported() also says yes for older GPUs that only emulate it
        # (slowly), and asks the current device rather than this one.
        return bool(torch.version.hip) or torch.cuda.get_device_properties(device).major >= 8
    if device.type == "mps":             # macOS 14 added bfloat16 to Metal; older systems refuse the dtype
        try:
            torch.ones(1, dtype=torch.bfloat16, device=device).sum().item()
        except (RuntimeError, TypeError):
            return False
        return True
    if device.type == "xpu":
        return bool(torch.xpu.is_bf16_supported())
    return False


def default_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype to load a real checkpoint in: bfloat16 where the device computes it,
    float16 on an MPS device without it, float32 on a CPU. ValueError for a device this
    process does not have (its dtype would be a guess)."""
    device = require_device(device, "default_dtype")
    if device.type == "cpu":
        return torch.float32
    if supports_bf16(device):
        return torch.bfloat16
    return torch.float16 if device.type == "mps" else torch.float32


PACKED_DTYPES = (torch.bfloat16, torch.float32)     # what oneDNN packs here: see PackedLinear
# Multiply-adds (rows x in_features x out_features) from which a float32 call goes to the packed
# weight: below it oneDNN's fixed ~12 microseconds a call outweigh its faster kernel (measured
# on SmolLM2's and the tiny seed model's shapes, 1 to 64 rows, one thread). In the engine 2**19
# beat 2**20 on the serving workload and matched it on the seed one, where packing every call
# lost a third.
PACKED_FLOAT32_MIN_WORK = 1 << 19


class PackedLinear:
    """The forward of one nn.Linear whose weight oneDNN has laid out once, ahead of time, in
    the blocked order its CPU matmul kernels read, instead of being handed torch's row-major
    weight at every call. The weight itself stays, so F.linear remains available.

    bfloat16: every call is packed, bit-identical to F.linear; at SmolLM2's decode shapes
    (torch 2.13, a Zen 4 core with AVX512-BF16) 1.1-1.6x faster at 16 rows, 1.3-2.3x at one.
    float32: a call is packed when rows x in_features x out_features reaches
    PACKED_FLOAT32_MIN_WORK (SmolLM2's LM head and MLP at every row count, its attention
    projections from 2-5 rows, the tiny seed model's from about 30 rows), F.linear otherwise;
    packed calls are 1.5-3x faster and differ from F.linear by float32 rounding only (another
    summation order), so a row's result may change in its last bits with the batch it is
    computed in, as F.linear's own results already do between one row and several. The packed
    copy costs host memory equal to the weights packed.

    Installed as the module's own `forward`, so its hooks (LoRA, Chapter 43) still run. What
    the packed copy cannot serve goes to F.linear: other dtypes and devices, autograd and
    torch.compile's tracing (inductor then chooses its own CPU matmul); a
    weight changed in place or replaced since packing is packed again first."""

    def __init__(self, module: nn.Linear, pack: bool = True) -> None:
        self.module = module
        # oneDNN's linear on a packed weight, looked up once: the attribute chain costs a
        # microsecond a call (and builds without oneDNN have no such operator).
        self.linear_on_packed = torch.ops.mkldnn._linear_pointwise.default
        self.packed_from: tuple[int, int] | None = None      # (data_ptr, version) of the weight packed
        self.packed: torch.Tensor | None = None
        if pack:
            self.pack()

    def __getstate__(self) -> dict[str, Any]:
        # The packed copy is an opaque oneDNN tensor that can be neither copied nor pickled:
        # a deep copy or a saved model carries the module alone and packs again on first use.
        return {"module": self.module}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["module"], pack=False)     # type: ignore[misc]

    def pack(self) -> None:
        weight = self.module.weight.detach()
        self.packed_from = self.identity(weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)

    @staticmethod
    def identity(weight: torch.Tensor) -> tuple[int, int]:
        """What tells a weight changed since packing: its storage and its version counter.
        Tensors made under torch.inference_mode keep no version counter; for them only a new
        tensor is noticed (an in-place change is not)."""
        return weight.data_ptr(), -1 if weight.is_inference() else weight._version

    def __call__(self, input: torch.Tensor) -> torch.Tensor:     # nn.Linear.forward's own parameter name
        # Called for every projection of every layer at every step: the usual case costs
        # one comparison of the weight's identity and a few flags.
        weight, bias = self.module.weight, self.module.bias
        if torch.compiler.is_compiling():       # an opaque oneDNN tensor cannot be traced (Chapter 33's compile)
            return nn.functional.linear(input, weight, bias)
        if input.dtype == torch.float32 and input.numel() * weight.shape[0] < PACKED_FLOAT32_MIN_WORK:
            return nn.functional.linear(input, weight, bias)        # numel is rows x in_features
        if input.dtype != weight.dtype or input.dtype not in PACKED_DTYPES or not (input.is_cpu and weight.is_cpu) or (
                torch.is_grad_enabled() and (weight.requires_grad or input.requires_grad)):
            return nn.functional.linear(input, weight, bias)
        if self.identity(weight) != self.packed_from:
            self.pack()
        return self.linear_on_packed(input, self.packed, bias, "none", [], "")


def prepack_linears(model: nn.Module) -> int:
    """Give every plain nn.Linear of `model` whose weight is bfloat16 or float32 on a CPU a
    PackedLinear forward, once, when the engine loads the model; returns how many it packed (0
    without oneDNN, on other devices and dtypes, and for subclasses such as quantized linears,
    whose forward is their own). Packing again is harmless: a packed module is skipped. The
    packed copies add one copy of those weights, in their dtype, to host memory."""
    if not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for module in model.modules():
        if (type(module) is nn.Linear and module.weight.dtype in PACKED_DTYPES
                and module.weight.device.type == "cpu" and "forward" not in vars(module)):
            module.forward = PackedLinear(module)        # type: ignore[method-assign]
            count += 1
    return count


def pinned(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (a CPU tensor) in page-locked memory when copies to and from `device` gain
    from it (CUDA, XPU: the copy engine reads it directly, asynchronously); unchanged for
    MPS (the GPU already shares the RAM) and the CPU."""
    device = torch.device(device)
    if device.type in ("cuda", "xpu") and device_count(device.type) > 0:
        return host.pin_memory()
    return host


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (a CPU tensor) copied to `device` without making the host wait for the
    device: through page-locked memory with non_blocking=True where `pinned` pins. A copy
    from pageable memory to a GPU first waits for every kernel already queued, so a batch
    uploaded that way waits for the step before it (Chapter 33)."""
    page_locked = pinned(host, device)
    return page_locked.to(device, non_blocking=page_locked is not host)


def describe(device: torch.device | str) -> dict[str, Any]:
    """One JSON-ready line about `device`: name, memory, dtype, and threads on a CPU."""
    device = torch.device(device)
    memory = memory_info(device)
    line: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        line["name"] = properties.name
        line["runtime"] = f"hip {torch.version.hip}" if torch.version.hip else f"cuda {torch.version.cuda}"
    elif device.type == "xpu":
        line["name"] = torch.xpu.get_device_properties(device).name
    elif device.type == "mps":
        line["name"] = "Apple GPU (Metal)"
    else:
        line["name"] = "CPU"
        line["threads"] = torch.get_num_threads()
        line["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    line.update(free_gib=round(memory.free_bytes / 2**30, 2), total_gib=round(memory.total_bytes / 2**30, 2),
                memory_source=memory.source, bf16=supports_bf16(device),
                default_dtype=str(default_dtype(device)).removeprefix("torch."),
                pinned_host_buffers=device.type in ("cuda", "xpu"))
    return line


# --- part two: layers on several devices ------------------------------------------------------

def plan_layers(layer_bytes: Sequence[int], free_bytes: Sequence[int]) -> list[int]:
    """The stage of each decoder layer, when stage s has free_bytes[s] bytes to give.
    (Your engine: Chapter 40)

    layer_bytes: L > 0 sizes in bytes (weights plus that layer's share of the KV pool);
    free_bytes: S > 0 budgets, one per stage, in pipeline order.
    Returns stage[i] for i in range(L): a list of ints that starts at 0, never decreases,
    steps by at most 1 and ends at S - 1, so each stage holds one contiguous, non-empty
    range of layers. Of all such plans it returns one whose fullest stage, measured as
    (bytes of its layers) / free_bytes[s], is as empty as possible; among equally good
    plans, the one that gives stage 0 the most layers, then stage 1, and so on.
    Errors: ValueError, each message stating the rule broken: L or S is 0 ("needs layers
    and stages"); S > L ("a stage with no layer", which would only relay); a negative size
    or a budget that is not positive (sizes ">= 0", budgets "> 0"); even the best plan
    overfills a stage ("do not fit", naming that stage and the bytes missing).
    Trap, as a property: two plans whose fullest stages are equally full tie exactly
    (3/9 and 1/3 are the same fill), so rounding never decides between them.
    """
    layers, stages = len(layer_bytes), len(free_bytes)
    if layers == 0 or stages == 0:
        raise ValueError(f"plan_layers needs layers and stages, got {layers} layers and {stages} stages")
    if stages > layers:
        raise ValueError(f"plan_layers: {stages} stages for {layers} layers would leave a stage with no layer")
    if any(size < 0 for size in layer_bytes) or any(budget <= 0 for budget in free_bytes):
        raise ValueError("plan_layers: layer sizes must be >= 0 bytes and every stage's budget > 0 bytes")
    starts = [0]
    for size in layer_bytes:
        starts.append(starts[-1] + size)

    def load(first: int, end: int, stage: int) -> Fraction:
        return Fraction(starts[end] - starts[first], free_bytes[stage])

    # peak[s][i]: the smallest possible fullest stage when layers i.. go on stages s..
    peak: list[list[Fraction | float]] = [[float("inf")] * (layers + 1) for _ in range(stages + 1)]
    peak[stages][layers] = Fraction(0)
    for stage in range(stages - 1, -1, -1):
        for first in range(layers - 1, -1, -1):
            for end in range(first + 1, layers - (stages - 1 - stage) + 1):
                peak[stage][first] = min(peak[stage][first], max(load(first, end, stage), peak[stage + 1][end]))
    best = peak[0][0]
    plan: list[int] = []
    first = 0
    for stage in range(stages):       # each stage takes the most layers that still allow the best peak
        end = max(e for e in range(first + 1, layers - (stages - 1 - stage) + 1)
                  if max(load(first, e, stage), peak[stage + 1][e]) <= best)
        plan += [stage] * (end - first)
        first = end
    if best > 1:
        loads = [sum(size for size, s in zip(layer_bytes, plan) if s == stage) for stage in range(stages)]
        worst = max(range(stages), key=lambda stage: Fraction(loads[stage], free_bytes[stage]))
        raise ValueError(f"plan_layers: the layers do not fit: stage {worst} would need {loads[worst]} bytes "
                         f"and has {free_bytes[worst]} ({loads[worst] - free_bytes[worst]} missing)")
    return plan


def layer_bytes(layer: nn.Module, kv_bytes: int = 0) -> int:
    """Bytes of one decoder layer's weights, plus the KV pool it will own."""
    return sum(p.numel() * p.element_size() for p in layer.parameters()) + kv_bytes


class PlacedFlatModel(FlatModel):
    """Chapter 31's FlatModel with its decoder layers spread over several devices.

    stage_devices[s] holds the layers with stage_of_layer[i] == s. The embedding and the
    LM head stay on stage 0 (the "home" device, where the engine's batch, sampler and
    generators live; tied embeddings need them together); the final norm runs on the last
    stage. A forward moves the residual stream [N, D] once at each stage boundary
    (S - 1 transfers), and compute_logits brings only the rows that need logits home
    ([L, D], one more transfer), not [L, vocab] logits. Two stages on the same device are
    still two stages: the transfers are counted, and cost nothing.
    The model's modules move in place (as model.to(device) would)."""

    def __init__(self, model: Qwen3ForCausalLM, stage_devices: Sequence[torch.device | str],
                 stage_of_layer: Sequence[int] | None = None) -> None:
        super().__init__(model)
        self.stage_devices = [torch.device(d) for d in stage_devices]
        layers = len(self.layers)
        if stage_of_layer is None:
            sizes = [layer_bytes(layer) for layer in self.layers]
            free = {d: memory_info(d).free_bytes for d in set(self.stage_devices)}    # one reading per device
            stage_of_layer = plan_layers(sizes, [free[d] for d in self.stage_devices])
        stage_of_layer = list(stage_of_layer)
        stages = len(self.stage_devices)
        steps_ok = all(b - a in (0, 1) for a, b in zip(stage_of_layer, stage_of_layer[1:]))
        if (len(stage_of_layer) != layers or not stage_of_layer or stage_of_layer[0] != 0
                or stage_of_layer[-1] != stages - 1 or not steps_ok):
            raise ValueError(f"stage_of_layer {stage_of_layer}: need one stage per layer ({layers}), starting at 0, "
                             f"ending at {stages - 1}, each stage one contiguous range")
        self.stage_of_layer = stage_of_layer
        self.backbone.embed_tokens.to(self.stage_devices[0])
        self.model.lm_head.to(self.stage_devices[0])
        for index, layer in enumerate(self.layers):
            layer.to(self.layer_device(index))
        self.backbone.norm.to(self.stage_devices[-1])
        self.transfers = 0              # residual-stream hand-overs between stages
        self.transfer_bytes = 0
        self.returns = 0                # rows brought home for the LM head
        self.return_bytes = 0
        self._step_inputs: dict[int, tuple[Any, ...]] = {}     # stage -> its copies of this step's inputs
        # id(input_layernorm of a stage's first layer) -> that stage: where the stream crosses
        self._openers = {id(self.layers[i].input_layernorm): stage_of_layer[i] for i in range(1, layers)
                         if stage_of_layer[i] != stage_of_layer[i - 1]}

    def layer_device(self, index: int) -> torch.device:
        """The device of decoder layer `index` (the ModelRunner puts its KV pool there)."""
        return self.stage_devices[self.stage_of_layer[index]]

    def pool_blocks(self, block_bytes: int, cpu_pool_bytes: int, utilization: float) -> int:
        """How many blocks the engine's pool may have (EngineConfig.num_blocks None): every
        layer's pool holds them all, on its layer's device, so the count is the smallest
        that fits on any device, given the layers each one holds.

        block_bytes: one block of one layer's pool. An accelerator gives what memory_info
        reports free now (the weights are already placed) less the (1 - utilization) share
        of its total that the engine leaves alone; those layers' pools split it. The CPU
        gives its layers their share of cpu_pool_bytes (EngineConfig.kv_cache_bytes, the
        whole pool's budget off CUDA), as an unplaced CPU engine does: all-CPU stages size
        the pool exactly as one CPU would. Activations are not profiled per device here:
        the (1 - utilization) share is their room."""
        if block_bytes < 1:
            raise ValueError(f"pool_blocks: a block takes at least one byte, got {block_bytes}")
        fits = []
        for device in dict.fromkeys(self.stage_devices):
            layers_here = sum(self.layer_device(i) == device for i in range(len(self.layers)))
            if device.type == "cpu":
                budget = cpu_pool_bytes * layers_here // len(self.layers)
            else:
                memory = memory_info(device)
                budget = int(memory.free_bytes - (1 - utilization) * memory.total_bytes)
            fits.append(max(0, budget) // (layers_here * block_bytes))
        return min(fits)

    def hand_over(self, stream: torch.Tensor, stage: int) -> torch.Tensor:
        """The residual stream moved to stage `stage`'s device.  (Your engine: Chapter 40)

        stream: [N, D] on the previous stage's device, the previous layer's branch already
        added. Returns the same values on stage_devices[stage] (same dtype, same shape).
        Counts one transfer in self.transfers and its bytes (N * D * element size) in
        self.transfer_bytes, EVEN when both stages share a device: the count is the
        pipeline's plumbing, what a real second device would have to carry.
        Traps: only a whole [N, D] stream crosses (moving the stream and the unadded branch
        separately would carry twice the bytes); and a copy TO the CPU must be blocking:
        with non_blocking=True it returns before the bytes arrive, and the CPU stage would
        read garbage (copies to an accelerator are queued in order, so they may be
        asynchronous).
        """
        self.transfers += 1
        self.transfer_bytes += stream.numel() * stream.element_size()
        target = self.stage_devices[stage]
        return stream.to(target, non_blocking=target.type != "cpu")

    def add_norm(self, norm: nn.Module, x: torch.Tensor,
                 delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """FlatModel.add_norm, crossing to the next stage when `norm` opens its first layer."""
        stage = self._stage_opened_by(norm)
        if stage is not None and delta is not None:
            x = self.hand_over(x + delta, stage)
            delta = None
        return super().add_norm(norm, x, delta)

    def _stage_opened_by(self, norm: nn.Module) -> int | None:
        """The stage whose first layer's input_layernorm is `norm` (None for stage 0: the
        stream starts there; and for every other norm)."""
        return self._openers.get(id(norm))

    def attention(self, layer: int, attn: Qwen3Attention, h: torch.Tensor, positions: torch.Tensor,
                  rope: RopeTables, kv: KVCache, meta: BatchMeta, backend: AttentionBackend) -> torch.Tensor:
        """FlatModel.attention with the step's positions, RoPE tables and metadata copied
        to this layer's device (once per stage per step)."""
        stage = self.stage_of_layer[layer]
        cached = self._step_inputs.get(stage)
        if cached is None or cached[0] is not meta:
            device = self.stage_devices[stage]
            if positions.device == device:
                cached = (meta, positions, rope, meta)
            else:
                moved = {f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
                         if isinstance(getattr(meta, f.name), torch.Tensor)}
                cached = (meta, positions.to(device), (rope[0].to(device), rope[1].to(device)),
                          dataclasses.replace(meta, **moved))
            self._step_inputs[stage] = cached
        _, positions, rope, meta = cached
        return super().attention(layer, attn, h, positions, rope, kv, meta, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [L, vocab] on the home device for the rows [L, D] that need them."""
        self.returns += 1
        self.return_bytes += hidden.numel() * hidden.element_size()
        return super().compute_logits(hidden.to(self.stage_devices[0]))
