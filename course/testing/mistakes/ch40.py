"""Chapter 40: choosing a device, planning the layers over devices, handing the stream over."""
from . import Mistake

MILESTONE = "tests/test_ch40_other_hardware.py"
PICK = (MILESTONE, "-k", "auto or refused or index_past")
PLAN = (MILESTONE, "-k", "plan_layers")
HAND = f"{MILESTONE}::test_hand_over_counts_same_device_transfers"

MISTAKES = [
    Mistake("devices.py", "pick_device",
            before="kind = next(k for k in AUTO_ORDER if device_count(k) > 0)",
            after='kind = "cuda" if device_count("cuda") > 0 else "cpu"',
            rule="auto tries cuda, mps, xpu, then cpu",
            expect="auto must try", tests=PICK),
    Mistake("devices.py", "pick_device",
            before="if device.index is not None and device.index >= count:",
            after="if device.index is not None and device.index > count:",
            rule="an index must be below device_count(kind)",
            expect="must be below device_count", tests=PICK),
    Mistake("devices.py", "pick_device",
            before="if count == 0:",
            after="if count < 0:",
            rule="a kind with no device present is refused",
            expect="no device present is refused", tests=PICK),
    Mistake("devices.py", "pick_device",
            before='raise ValueError(f"--device {choice!r} is not a device torch understands "',
            after='raise ValueError(f"--device {choice} is not a device torch understands "',
            rule="every message quotes the choice as repr()",
            expect="quoting the choice as repr()", tests=PICK),
    Mistake("devices.py", "plan_layers",
            before="end = max(e for e in range(first + 1, layers - (stages - 1 - stage) + 1)",
            after="end = min(e for e in range(first + 1, layers - (stages - 1 - stage) + 1)",
            rule="among equally good plans, stage 0 takes the most layers, then stage 1, ...",
            expect="ties give stage 0 the most layers", tests=PLAN),
    Mistake("devices.py", "plan_layers",
            before="if best > 1:",
            after="if best >= 1:",
            rule="a plan whose fullest stage is exactly full fits",
            expect="fits when that stage is at most full", tests=PLAN),
    Mistake("devices.py", "plan_layers",
            before="max(load(first, end, stage), peak[stage + 1][end])",
            after="load(first, end, stage) + peak[stage + 1][end]",
            rule="the plan minimizes its FULLEST stage, not the sum of the stages' fill",
            expect="fullest stage", tests=PLAN),
    Mistake("devices.py", "plan_layers",
            before="if stages > layers:",
            after="if stages > layers + 1:",
            rule="more stages than layers is refused: a stage with no layer would only relay",
            expect="must be refused naming the rule", tests=PLAN),
    Mistake("devices.py", "PlacedFlatModel.hand_over",
            before="self.transfers += 1",
            after="self.transfers += int(stream.device != self.stage_devices[stage])",
            rule="every hand-over counts, even between stages on the same device",
            expect="even between stages on the same device", tests=(HAND,)),
    Mistake("devices.py", "PlacedFlatModel.hand_over",
            before="self.transfer_bytes += stream.numel() * stream.element_size()",
            after="self.transfer_bytes += stream.numel()",
            rule="the bytes are N * D * element size",
            expect="element size", tests=(HAND,)),
    Mistake("devices.py", "PlacedFlatModel.hand_over",
            before="self.transfer_bytes += stream.numel() * stream.element_size()",
            after="self.transfer_bytes += stream.numel() * 4",
            rule="the bytes depend on the stream's dtype (2 per bfloat16 value)",
            expect="whatever the dtype", tests=(HAND,)),
]

DECIDES = {
    "pick_device":
        "what 'auto' tries and in which order, and how an explicit choice is checked and refused with a message "
        "rather than silently replaced",
    "plan_layers":
        "how to search every contiguous split of layers over stages for the least-full fullest stage, exactly (no "
        "rounding) and with ties to the earlier stages",
    "PlacedFlatModel.hand_over":
        "what crosses a stage boundary (the whole stream, once), what is counted even on one device, and which "
        "copies may be asynchronous",
}

DESIGN = ("plan_layers",)
