"""The cost of the PyTorch binding, and a transformers model end to end.

1. The operator against the NumPy API: ``fastattn.torch.scaled_dot_product_attention``
   on CPU tensors against ``fastattn.attention`` on the same, pre-made NumPy arrays
   (and PyTorch's own ``scaled_dot_product_attention``), ``--threads`` threads for all,
   in interleaved rounds whose order rotates; the medians and the median per-round
   difference (the binding's overhead).
2. With ``--model``: a Llama-style decoder from a random config (hidden 512, 8 heads,
   2 key/value heads, 4 layers; nothing is downloaded), float32, with
   ``attn_implementation="fastattn"`` against ``"sdpa"``: the forward pass over a
   prompt of ``--prefill`` tokens (logits of its last token only, as ``generate``
   computes them), and greedy decoding of ``--decode`` tokens after it, one forward
   pass a token (tokens per second with a cache of that length), alternating the two.

    python benchmarks/torch_overhead.py --threads 2 --model --prefill 2048 --decode 32

On a shared machine only numbers measured side by side mean anything.
"""

import argparse
import statistics
import time

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=5, default=[1, 8, 128, 128, 64],
                   metavar=("B", "H", "LQ", "LK", "E"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--model", action="store_true", help="also time the Llama-style model")
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3, help="model runs of each kind")
    return p.parse_args(argv)


def interleaved(fns, rounds):
    """Median seconds of each function and the per-round times, the order rotating."""
    names = list(fns)
    times = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            t = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t)
    return times


def operator_overhead(args):
    import torch

    import fastattn
    import fastattn.torch

    B, H, Lq, Lk, E = args.shape
    fastattn.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, Lq, E), dtype=np.float32)
    k = rng.standard_normal((B, H, Lk, E), dtype=np.float32)
    v = rng.standard_normal((B, H, Lk, E), dtype=np.float32)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    fns = {
        "NumPy API": lambda: fastattn.attention(q, k, v),
        "torch operator": lambda: fastattn.torch.scaled_dot_product_attention(tq, tk, tv),
        "PyTorch SDPA": lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv),
    }
    interleaved(fns, 20)                                       # warm up
    times = interleaved(fns, args.rounds)
    print(f"shape (B, H, Lq, Lk, E) = {tuple(args.shape)}, float32, "
          f"{args.threads} threads, {args.rounds} interleaved rounds")
    for name, ts in times.items():
        print(f"  {name:15s} median {statistics.median(ts) * 1e6:9.1f} us")
    diff = [a - b for a, b in zip(times["torch operator"], times["NumPy API"])]
    print(f"  overhead of the operator: median {statistics.median(diff) * 1e6:.1f} us "
          f"per call")


def model_end_to_end(args):
    import torch
    import transformers

    import fastattn
    import fastattn.integrations.transformers

    fastattn.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    # each implementation under its own name, timed: the seconds spent in attention
    in_attention = {"fastattn": 0.0, "sdpa": 0.0}

    def timed(function, name):
        def attention(*a, **kw):
            t = time.perf_counter()
            result = function(*a, **kw)
            in_attention[name] += time.perf_counter() - t
            return result
        return attention

    for name, function in [("fastattn", fastattn.integrations.transformers.attention_forward),
                           ("sdpa", sdpa_attention_forward)]:
        AttentionInterface.register(f"timed-{name}", timed(function, name))
        AttentionMaskInterface.register(f"timed-{name}", sdpa_mask)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=args.prefill + args.decode + 16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, config.vocab_size, (1, args.prefill))
    prefill = {"fastattn": [], "sdpa": []}
    decode = {"fastattn": [], "sdpa": []}
    attention = {"fastattn": [], "sdpa": []}
    tokens = {}
    with torch.no_grad():
        for r in range(args.repeat + 1):                        # the first: warm-up
            for impl in (["fastattn", "sdpa"] if r % 2 else ["sdpa", "fastattn"]):
                model.set_attn_implementation(f"timed-{impl}")
                in_attention[impl] = 0.0
                t = time.perf_counter()
                # the logits of the last token only, as generate() computes them
                out = model(ids, use_cache=True, logits_to_keep=1)
                t_prefill = time.perf_counter() - t
                t_prefill_attention = in_attention[impl]
                cache, step = out.past_key_values, out.logits[:, -1:].argmax(-1)
                chosen = [step]
                t = time.perf_counter()
                for _ in range(args.decode):                    # greedy, one token a step
                    out = model(step, past_key_values=cache, use_cache=True)
                    step = out.logits[:, -1:].argmax(-1)
                    chosen.append(step)
                t_decode = time.perf_counter() - t
                if r:
                    prefill[impl].append(t_prefill)
                    attention[impl].append(t_prefill_attention)
                    decode[impl].append(args.decode / t_decode)
                tokens.setdefault(impl, torch.cat(chosen, 1))
    print(f"Llama-style model (hidden 512, 8 heads, 2 KV heads, 4 layers), float32, "
          f"{args.threads} threads")
    for impl in ("fastattn", "sdpa"):
        print(f"  {impl:9s} prefill {args.prefill}: median "
              f"{statistics.median(prefill[impl]):.3f} s (in attention "
              f"{statistics.median(attention[impl]):.3f} s); decoding with a cache of "
              f"{args.prefill}: median {statistics.median(decode[impl]):.1f} tokens/s")
    print(f"  greedy ids equal: {torch.equal(tokens['fastattn'], tokens['sdpa'])}")


def main(argv=None):
    args = parse_args(argv)
    operator_overhead(args)
    if args.model:
        model_end_to_end(args)


if __name__ == "__main__":
    main()
