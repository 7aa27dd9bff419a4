"""Would float16 attention meet its error bound with its products on bfloat16 units?

A CPU with AMX or AVX512-BF16 multiplies bfloat16 pairs; fastattn widens float16 q, k
and v to float32 and runs the float32 micro-GEMM. Handing float16 inputs to the
bfloat16 units would round them to bfloat16 first (8 significant bits where float16
has 11). The accuracy bound of float16 attention (the README's "Reduced precision"
section): a max error against a float64 recomputation at most 1.25 times that of
PyTorch's float16 SDPA on the same inputs, and a mean error no larger over a grid.

This script recomputes float16 attention in float64 with only the roundings in
question, on standard normal q, k, v (q and k times `scale`), causal or not:

- ``P float16``: the weights rounded once to float16 before P·V (what the bound
  allows; V as given);
- ``P bfloat16``: the weights rounded to bfloat16 (the values' product on the units,
  V kept in float16, i.e. split or widened);
- ``P, V bfloat16``: the weights and V rounded to bfloat16 (both products' right
  operands on the units; the scores are left exact);

and prints each one's max and mean error over PyTorch's (its float16 SDPA on the same
inputs, against the same recomputation), the worst case over the grid.

    python benchmarks/float16_on_bfloat16_units.py

Needs PyTorch. On PyTorch 2.13 (CPU build), 24 inputs: P float16 at most 1.12x the
max and 0.99x the mean; P bfloat16 up to 4.33x the max and 5.53x the mean; P, V
bfloat16 up to 12.69x the max and 8.70x the mean: the units would break the bound, so
float16 keeps its float32 products.
"""

import argparse
import itertools

SHAPES = [(2, 4, 256, 256, 64), (1, 4, 512, 512, 128), (1, 8, 197, 197, 64)]


def errors(torch, shape, causal, scale, seed):
    """{name: (max, mean) |result - float64 recomputation|} for PyTorch's float16 SDPA
    and the three roundings, on float16 inputs drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    B, H, Lq, Lk, E = shape
    q, k = ((torch.randn(B, H, L, E, generator=g) * scale).half() for L in (Lq, Lk))
    v = torch.randn(B, H, Lk, E, generator=g).half()
    q64, k64, v64 = (x.double() for x in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) / E ** 0.5
    if causal:
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool).tril(), float("-inf"))
    exact = torch.softmax(s, -1) @ v64
    s32 = s.float().double()                    # the scores as float32 sums leave them
    p = torch.exp(s32 - s32.amax(-1, keepdim=True)).float().double()
    l = p.sum(-1, keepdim=True)
    bf = torch.bfloat16
    results = {
        "PyTorch": torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal).double(),
        "P float16": p.half().double() @ v64 / l,
        "P bfloat16": p.to(bf).double() @ v64 / l,
        "P, V bfloat16": p.to(bf).double() @ v.to(bf).double() / l,
    }
    out = {}
    for name, r in results.items():
        err = (r.half().double() - exact).abs()
        out[name] = (err.max().item(), err.mean().item())
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=2)
    args = p.parse_args(argv)
    import torch
    worst = {}
    for shape, causal, scale, seed in itertools.product(
            SHAPES, (False, True), (1.0, 3.0), range(args.seeds)):
        err = errors(torch, shape, causal, scale, seed)
        theirs = err.pop("PyTorch")
        for name, (mx, mean) in err.items():
            was = worst.get(name, (0.0, 0.0))
            worst[name] = (max(was[0], mx / theirs[0]), max(was[1], mean / theirs[1]))
    print(f"float16 attention, worst over the grid, error / PyTorch's float16 SDPA's "
          f"(torch {torch.__version__}; the bound: max 1.25x, mean 1x):")
    for name, (mx, mean) in worst.items():
        print(f"  {name:14s} max {mx:.2f}x  mean {mean:.2f}x")


if __name__ == "__main__":
    main()
