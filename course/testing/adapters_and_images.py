"""Chapter 43's oracles, shared by its milestone and the feature-pair tests: LoRA adapters
made with peft for the tiny model, a tiny Qwen3-VL from transformers, and the engines and
greedy runs built on them.

- `ADAPTERS`, `peft_adapters(folder)`: three random adapters (different ranks, scalings and
  targets) on transformers' twin of the tiny model, saved with `save_pretrained`.
- `peft_greedy(peft_model, adapter, prompt, max_new)`: greedy tokens with one adapter alone.
- `IMAGE`, `SECTIONS`, `qwen3_vl_model()`: a Qwen3VLForConditionalGeneration whose language
  model is the tiny Qwen3, and a Qwen2-VL image processor that only patchifies.
- `images(seed, *sizes)`, `pixel_values`, `qwen3_vl_logits`, `qwen3_vl_greedy`: pictures and
  transformers' answers for them.
- `our_vl_model`, `lora_engine`, `vision_engine`: the implementation's parts and engines
  (its modules come in through `impl` and `serve`; nothing here imports an implementation).
- `greedy(last_logits, prompt, max_new, ...)`: greedy decoding by full recompute of any
  model, with transformers' repetition penalty and an allowed set per step if asked.

transformers and peft are imported inside the functions: this module loads without them.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from course import models
from course.testing.oracles import TINY_EOS, make_engine

BLOCK = 8
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, rank, alpha, targets): different ranks, scalings and target sets in one bank.
ADAPTERS = {"sql": (1, 4, 8, ALL_TARGETS), "poet": (2, 2, 16, ["q_proj", "v_proj", "down_proj"]),
            "math": (3, 8, 8, ["k_proj", "o_proj", "gate_proj", "up_proj"])}


def transformers_twin() -> Any:
    """transformers' Qwen3ForCausalLM with the tiny config and course.models' deterministic
    weights: the tiny Qwen3 every chapter uses, built without the reference package (so a
    learner's edition has this oracle too)."""
    import transformers
    hcfg = transformers.Qwen3Config(**models.tiny_config_values(), attn_implementation="eager")
    return models.fill_deterministic(transformers.Qwen3ForCausalLM(hcfg)).eval()


def peft_adapters(folder: Path) -> Any:
    """A PeftModel holding the random ADAPTERS (peft's init_lora_weights=False), each saved
    with save_pretrained into its own subfolder of `folder`."""
    import peft
    torch.manual_seed(0)
    base = transformers_twin()
    peft_model = None
    for name, (seed, rank, alpha, targets) in ADAPTERS.items():
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
        torch.manual_seed(seed)
        if peft_model is None:
            peft_model = peft.get_peft_model(base, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    assert peft_model is not None
    peft_model.save_pretrained(str(folder))           # one subfolder per named adapter
    return peft_model.eval()


def peft_logits(peft_model: Any, adapter: str | None) -> Callable[[list[int]], torch.Tensor]:
    """tokens -> the last position's logits of the base model with `adapter` alone (None: the base)."""
    def last_logits(tokens: list[int]) -> torch.Tensor:
        if adapter is None:
            with peft_model.disable_adapter():
                return peft_model(torch.tensor([tokens])).logits[0, -1]
        peft_model.set_adapter(adapter)
        return peft_model(torch.tensor([tokens])).logits[0, -1]
    return last_logits


@torch.inference_mode()
def greedy(last_logits: Callable[[list[int]], torch.Tensor], prompt: Sequence[int], max_new: int,
           eos_token_id: int | None = TINY_EOS, repetition_penalty: float = 1.0,
           allowed: Sequence[Collection[int]] | None = None) -> list[int]:
    """Greedy new tokens by full recompute. repetition_penalty applies transformers'
    RepetitionPenaltyLogitsProcessor to the prompt and the tokens so far; allowed[i], when
    given, are the only tokens step i may pick (decoding ends after len(allowed) steps)."""
    tokens = list(prompt)
    penalty = None
    if repetition_penalty != 1.0:
        import transformers
        penalty = transformers.RepetitionPenaltyLogitsProcessor(repetition_penalty)
    steps = max_new if allowed is None else min(max_new, len(allowed))
    for step in range(steps):
        logits = last_logits(tokens).float()
        if penalty is not None:
            logits = penalty(torch.tensor([tokens]), logits[None])[0]
        if allowed is not None:
            keep = torch.full_like(logits, float("-inf"))
            ids = torch.tensor(sorted(allowed[step]))
            keep[ids] = logits[ids]
            logits = keep
        tokens.append(int(logits.argmax()))
        if tokens[-1] == eos_token_id:
            break
    return tokens[len(prompt):]


_PEFT_RUNS: dict = {}


def peft_greedy(peft_model: Any, adapter: str | None, prompt: Sequence[int], max_new: int) -> list[int]:
    """Greedy tokens of the base model with `adapter` alone (None: the base model), by full
    recompute, stopping at the tiny model's EOS. Cached: several tests ask the same question."""
    key = (id(peft_model), adapter, tuple(prompt), max_new)
    if key not in _PEFT_RUNS:
        _PEFT_RUNS[key] = peft_model, greedy(peft_logits(peft_model, adapter), prompt, max_new)
    return list(_PEFT_RUNS[key][1])


def lora_engine(impl: Any, serve: Any, model: Any, folder: Path, names: Sequence[str] = tuple(ADAPTERS),
                **config: Any) -> Any:
    """An engine of the implementation serving the adapters `names` saved in `folder`."""
    lora = impl.load("serve.lora")
    adapters = [lora.load_peft_adapter(folder / name) for name in names]
    return make_engine(serve, model, adapters=adapters, **{"block_size": BLOCK, "num_blocks": 96, **config})


# --- images ------------------------------------------------------------------------------------

IMAGE = 300                  # the placeholder id (the tiny vocabulary's prompts use ids below 256)
SECTIONS = (4, 2, 2)         # frequency pairs of the T, H, W axes (head_dim 16: 8 pairs)
MERGE = 2                    # the encoder merges 2 x 2 patches into one image token
PATCH = 4                    # pixels per patch side: an image token covers 8 x 8 pixels
VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": PATCH,
          "spatial_merge_size": MERGE, "temporal_patch_size": 2, "num_position_embeddings": 16,
          "deepstack_visual_indexes": []}


def qwen3_vl_model() -> tuple[Any, Any]:
    """transformers' Qwen3VLForConditionalGeneration (eager attention, no DeepStack) whose language
    model holds the tiny Qwen3's weights (clear greedy margins) and whose vision tower holds
    deterministic weights of unit-scale activations (transformers' own 0.02 initialisation
    would make every image look alike); and an image processor that patchifies without resizing."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    tiny = transformers_twin()
    cfg = SimpleNamespace(**models.tiny_config_values())
    text = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                max_position_embeddings=1024, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                 "mrope_section": list(SECTIONS), "mrope_interleaved": True})
    config = transformers.Qwen3VLConfig(text_config=text, vision_config={**VISION, "out_hidden_size": cfg.hidden_size},
                                        image_token_id=IMAGE, tie_word_embeddings=False)
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    weights = {f"model.language_model.{k[len('model.'):]}": v for k, v in tiny.state_dict().items()
               if k.startswith("model.")}
    weights["lm_head.weight"] = tiny.lm_head.weight
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            weights[f"model.visual.{name}"] = models.deterministic_tensor(f"visual.{name}", tuple(param.shape))
    model.load_state_dict(weights)
    processor = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                         do_resize=False, do_rescale=False, do_normalize=False)
    return model, processor


def pixel_values(qwen3_vl: tuple[Any, Any], pictures: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The image processor's flattened patches [N, C * 2 * 4 * 4] and grids [(1, h, w)] in patches."""
    out = qwen3_vl[1](images=list(pictures), return_tensors="pt", input_data_format="channels_first")
    return out["pixel_values"], out["image_grid_thw"]


def our_vl_model(impl: Any, qwen3_vl: tuple[Any, Any], device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """The implementation's VisionEncoder and Qwen3ForCausalLM, built with other random weights,
    then filled from transformers' state dict by load_qwen3_vl."""
    vision = impl.load("serve.vision")
    hf_model = qwen3_vl[0]
    encoder = vision.VisionEncoder(vision.VisionConfig.from_dict(hf_model.config.vision_config.to_dict()))
    model = models.tiny_qwen3(impl.package, seed=7)
    vision.load_qwen3_vl(hf_model.state_dict(), encoder, model)
    return encoder.eval().to(device), model.to(device)


def vision_engine(impl: Any, serve: Any, qwen3_vl: tuple[Any, Any], device: str | torch.device = "cpu",
                  **config: Any) -> Any:
    """An engine of the implementation on our_vl_model, taking image requests."""
    vision = impl.load("serve.vision")
    encoder, model = our_vl_model(impl, qwen3_vl, device)
    return make_engine(serve, model, vision=vision.VisionInputs(encoder, IMAGE, SECTIONS),
                       **{"block_size": BLOCK, "num_blocks": 96, **config})


def images(seed: int, *sizes: tuple[int, int]) -> list[torch.Tensor]:
    """Random pictures [3, h, w] in [0, 1), the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=g) for h, w in sizes]


@torch.inference_mode()
def qwen3_vl_logits(qwen3_vl: tuple[Any, Any], tokens: Sequence[int], pictures: Sequence[torch.Tensor],
                    model: Any = None) -> torch.Tensor:
    """Qwen3VLForConditionalGeneration's logits [T, vocab] for a sequence with its images
    (model: another Qwen3-VL with the same image processor; default qwen3_vl's own)."""
    ids = torch.tensor([list(tokens)])
    inputs = {"mm_token_type_ids": (ids == IMAGE).int()}
    if pictures:
        inputs["pixel_values"], inputs["image_grid_thw"] = pixel_values(qwen3_vl, pictures)
    return (model or qwen3_vl[0])(input_ids=ids, **inputs).logits[0]


_QWEN3_VL_RUNS: dict = {}


def qwen3_vl_greedy(qwen3_vl: tuple[Any, Any], prompt: Sequence[int], pictures: Sequence[torch.Tensor],
                    max_new: int) -> list[int]:
    """Greedy tokens by full recompute through transformers' whole model (positions from its
    own get_rope_index), stopping at the tiny model's EOS. Cached: three tests ask the same.
    transformers cannot continue a sequence whose generated token is the placeholder id (it
    takes it for an image token): these weights never generate it, but about one vision seed
    in nine does, so keep the seed when changing the vision weights."""
    key = (id(qwen3_vl[0]), tuple(prompt), tuple(image_key(p) for p in pictures), max_new)
    if key not in _QWEN3_VL_RUNS:
        tokens = greedy(lambda seq: qwen3_vl_logits(qwen3_vl, seq, pictures)[-1], prompt, max_new)
        _QWEN3_VL_RUNS[key] = qwen3_vl[0], tokens
    return list(_QWEN3_VL_RUNS[key][1])


def image_key(picture: torch.Tensor) -> tuple[tuple[int, ...], bytes]:
    return tuple(picture.shape), picture.numpy().tobytes()


PROMPTS = {      # name -> (prompt, grids of image tokens)
    "image first": ([IMAGE] * 6 + [5, 6, 7], [(2, 3)]),
    "image in the middle": ([5, 6, 7] + [IMAGE] * 6 + [8, 9], [(3, 2)]),
    "two images": ([4] + [IMAGE] * 4 + [7] + [IMAGE] + [9, 9], [(2, 2), (1, 1)]),
    "wide image, text last": ([1, 2] + [IMAGE] * 8 + [3, 4, 5, 6], [(2, 4)]),
    "no image": ([3, 1, 4, 1, 5], []),
}

REQUESTS = {    # request id -> (prompt case, picture sizes); two shapes beyond the 4 x 4 position table
    "middle": ("image in the middle", ((24, 16),)),
    "text": ("no image", ()),
    "two": ("two images", ((16, 16), (8, 8))),
    "wide": ("wide image, text last", ((16, 32),)),
}


def image_requests() -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    """REQUESTS as request id -> (prompt, pictures); request i's pictures come from seed i."""
    return {rid: (PROMPTS[case][0], images(seed, *sizes)) for seed, (rid, (case, sizes)) in enumerate(REQUESTS.items())}


def add_image_requests(serve: Any, engine: Any, **params: Any) -> None:
    """Queue REQUESTS on `engine` with SamplingParams(**params)."""
    for rid, (prompt, pictures) in image_requests().items():
        engine.add_request(rid, prompt, serve.request.SamplingParams(**params),
                           features={"images": pictures} if pictures else None)
