"""What rounding the softmax weights to bfloat16 before the product with V would cost.

fastattn's bfloat16 attention keeps the weights P in float32 for P·V where the CPU has
no AMX (AVX512-BF16 alone), because the error contract (the README's "Reduced
precision" section) asks for an error against a float64 recomputation no larger than
PyTorch's bfloat16 SDPA on the same inputs. PyTorch rounds P to bfloat16. This script
recomputes attention in float64 with only the roundings in question, on the inputs of
a small grid (standard normal q, k, v times `scale`, causal or not, several seeds):

- ``p32``: P kept in float32, the output rounded once to bfloat16 (fastattn);
- ``p16``: P rounded to bfloat16 before P·V, the row sums from the float32 P
  (PyTorch's order of roundings);
- ``p16 sums``: P rounded to bfloat16 and the row sums from the rounded P;

and prints, for each, on how many inputs its max error is at most PyTorch's (its SDPA
in bfloat16 on the same inputs, against the same float64 recomputation).

    python benchmarks/weight_rounding_error.py

Needs PyTorch. On PyTorch 2.13 (CPU build): p32 90 of 90, p16 88 of 90, p16 sums 73 of
90.
"""

import argparse
import itertools

SHAPES = [(2, 4, 128, 128, 64), (1, 8, 1, 700, 128), (1, 2, 200, 300, 80),
          (1, 8, 512, 512, 64), (1, 4, 1024, 1024, 128)]


def max_errors(torch, shape, causal, scale, seed):
    """{name: max |result - float64 recomputation|} for PyTorch and the three
    roundings, on bfloat16 inputs drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    B, H, Lq, Lk, E = shape
    q, k, v = ((torch.randn(B, H, L, E, generator=g) * scale).to(torch.bfloat16)
               for L in (Lq, Lk, Lk))
    q64, k64, v64 = (x.double() for x in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) / E ** 0.5
    if causal:
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool).tril(), float("-inf"))
    exact = torch.softmax(s, -1) @ v64
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    s32 = s.float().double()                    # the scores as float32 sums leave them
    p = torch.exp(s32 - s32.amax(-1, keepdim=True)).float().double()
    p16 = p.to(torch.bfloat16).double()
    results = {
        "PyTorch": theirs.double(),
        "p32": p @ v64 / p.sum(-1, keepdim=True),
        "p16": p16 @ v64 / p.sum(-1, keepdim=True),
        "p16 sums": p16 @ v64 / p16.sum(-1, keepdim=True),
    }
    return {name: (r.to(torch.bfloat16).double() - exact).abs().max().item()
            for name, r in results.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args(argv)
    import torch
    wins, total = {}, 0
    for shape, causal, scale, seed in itertools.product(
            SHAPES, (False, True), (1.0, 2.0, 4.0), range(args.seeds)):
        err = max_errors(torch, shape, causal, scale, seed)
        total += 1
        for name in ("p32", "p16", "p16 sums"):
            wins[name] = wins.get(name, 0) + (err[name] <= err["PyTorch"])
    print(f"inputs whose max error is at most PyTorch's bfloat16 SDPA's ({total} inputs, "
          f"torch {torch.__version__}):")
    for name, n in wins.items():
        print(f"  {name:9s} {n} of {total}")


if __name__ == "__main__":
    main()
