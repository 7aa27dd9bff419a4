"""A sliding-window model in transformers: the fused window against a mask.

A Mistral-style decoder from a random config (hidden 512, 8 heads, 2 key/value heads,
head dimension 64, ``--layers`` layers, intermediate 1408, vocabulary 32000, sliding
window ``--window``; nothing is downloaded), batch 1, float32: the prefill of a prompt
of ``--prefill`` tokens with a cache (the logits of its last token only, as
``generate`` computes them), on ``attn_implementation="fastattn"`` in two ways:

- ``fused``: fastattn's own masks (``fastattn.integrations.transformers.build_mask``):
  each layer gets a ``MaskDescription`` and calls the kernels with
  ``causal="bottom_right"`` and ``window=(window - 1, 0)``, so that key blocks outside
  the window are skipped;
- ``mask``: transformers' SDPA masks (``sdpa_mask``, what ``register()`` installed
  before the descriptions): a ``(1, 1, L, L)`` boolean mask, the window written into
  it, reaches the kernels.

Both run in the same model and process with the same threads; each round runs both,
the order alternating from round to round, after one warm-up round. Reported: the
seconds of each (median [min-max]), the time spent in the attention function, the
ratio ``mask time / fused time`` of each round (median [min-max]), and the largest
difference between the two last-token logits relative to their largest magnitude.

    python benchmarks/transformers_window.py --threads 2 --rounds 5

On a shared machine only the ratios of one run mean anything.
"""

import argparse
import statistics
import time

from transformers_llama import fmt, machine, save, summary

VARIANTS = ("fused", "mask")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill", type=int, default=16384, help="prompt tokens")
    p.add_argument("--window", type=int, default=4096, help="the config's sliding_window")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (after a warm-up)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    import fastattn
    import fastattn.integrations.transformers as fa_hf

    fastattn.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    names = {"fused": fa_hf.register(), "mask": "fastattn-sdpa-mask"}
    seconds_in_attention = dict.fromkeys(VARIANTS, 0.0)
    masks_seen = {variant: set() for variant in VARIANTS}

    def timed(variant):
        def attention(module, query, key, value, attention_mask, **kwargs):
            masks_seen[variant].add(type(attention_mask).__name__ if not isinstance(
                attention_mask, torch.Tensor) else tuple(attention_mask.shape))
            t = time.perf_counter()
            out = fa_hf.attention_forward(module, query, key, value, attention_mask,
                                          **kwargs)
            seconds_in_attention[variant] += time.perf_counter() - t
            return out
        return attention

    for variant, name in names.items():
        AttentionInterface.register(name, timed(variant))
    AttentionMaskInterface.register(names["mask"], sdpa_mask)
    config = transformers.MistralConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, head_dim=64,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
        sliding_window=args.window, max_position_embeddings=args.prefill + 16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=names["fused"]).eval()
    prompt = torch.randint(0, config.vocab_size, (1, args.prefill))

    seconds = {variant: [] for variant in VARIANTS}
    attention = {variant: [] for variant in VARIANTS}
    ratios, differences = [], []
    for r in range(args.rounds + 1):                     # round 0: warm-up
        order = VARIANTS if r % 2 else VARIANTS[::-1]
        logits = {}
        for variant in order:
            model.set_attn_implementation(names[variant])
            seconds_in_attention[variant] = 0.0
            with torch.no_grad():
                t = time.perf_counter()
                out = model(prompt, use_cache=True, logits_to_keep=1)
                elapsed = time.perf_counter() - t
            logits[variant] = out.logits[0, -1]
            del out
            if r:
                seconds[variant].append(elapsed)
                attention[variant].append(seconds_in_attention[variant])
        difference = (logits["fused"] - logits["mask"]).abs().max().item()
        differences.append(difference / logits["mask"].abs().max().item())
        if r:
            ratios.append(seconds["mask"][-1] / seconds["fused"][-1])
        print(f"round {r}/{args.rounds} done" + (" (warm-up)" if r == 0 else ""),
              flush=True)

    model_text = (f"Mistral-style: hidden 512, 8 heads, 2 KV heads, head_dim 64, "
                  f"{args.layers} layers, intermediate 1408, vocabulary 32000, "
                  f"sliding_window {args.window}, batch 1, float32")
    print(f"\n{model_text}; prefill of {args.prefill} tokens, {args.threads} threads, "
          f"{args.rounds} rounds (median [min-max])")
    report = {"machine": machine(), "torch": torch.__version__,
              "transformers": transformers.__version__, "fastattn": fastattn.__version__,
              "threads": args.threads, "rounds": args.rounds, "prefill": args.prefill,
              "model": model_text, "results": {}}
    for variant in VARIANTS:
        entry = {"seconds": summary(seconds[variant]),
                 "attention_seconds": summary(attention[variant]),
                 "per_round_seconds": seconds[variant],
                 "masks": sorted(map(str, masks_seen[variant]))}
        report["results"][variant] = entry
        print(f"  {variant:6s} {fmt(entry['seconds'], 3, ' s')}, in attention "
              f"{fmt(entry['attention_seconds'], 3, ' s')}; masks: {entry['masks']}")
    report["speedup"] = summary(ratios)
    report["per_round_speedup"] = ratios
    report["logits_relative_difference"] = max(differences)
    print(f"  speed-up of the fused window (mask time / fused time, paired): "
          f"{fmt(report['speedup'], 2, 'x')}")
    print(f"  last-token logits: largest difference {max(differences):.2e} of their "
          f"largest magnitude (median {statistics.median(differences):.2e})")
    if args.json:
        save(report, args.json)


if __name__ == "__main__":
    main()
