"""Chapter 13: our Qwen3 against transformers' on the same weights: logit and greedy parity.

Loads the tiny test model (or --model PATH through the reference checkpoint loader) into
the implementation's Qwen3, builds transformers' Qwen3ForCausalLM with the same config and
weights, and runs Chapter 13's harness on --prompts random prompts. Prints one JSON line:
max and mean logit difference, argmax agreement, the first position over --atol per
prompt, and every greedy divergence (empty: token-for-token parity).
"""
import dataclasses
import json

from course.cli import add_device_argument, add_impl_argument, add_model_argument, resolve_device


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    add_model_argument(parser)
    parser.add_argument("--prompts", type=int, default=8, help="how many random prompts (default 8)")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    parser.add_argument("--atol", type=float, default=1e-3, help="logit tolerance to report against (default 1e-3)")


def run(args):
    import torch
    import transformers

    from course.impl import load
    from course.pytest_plugin import build_model

    impl = load(args.impl)
    device = resolve_device(args.device)
    ours = build_model(impl.package, device, args.model)
    hcfg = transformers.Qwen3Config(**dataclasses.asdict(ours.cfg), attn_implementation="eager")
    theirs = transformers.Qwen3ForCausalLM(hcfg).to(dtype=next(ours.parameters()).dtype)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    theirs = theirs.to(device).eval()
    generator = torch.Generator().manual_seed(args.seed)
    vocab = min(ours.cfg.vocab_size, 256 if args.model is None else ours.cfg.vocab_size)
    lengths = torch.randint(4, 24, (args.prompts,), generator=generator)
    prompts = [torch.randint(0, vocab, (int(n),), generator=generator).tolist() for n in lengths]
    report = impl.parity.parity_report(ours, theirs, prompts, args.new_tokens, args.atol)
    report = dict(impl=args.impl, model=args.model or "tiny", device=str(device), new_tokens=args.new_tokens, **report)
    print(json.dumps(report))
    return 0 if report["greedy_ok"] else 1
