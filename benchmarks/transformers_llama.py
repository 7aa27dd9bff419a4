"""A transformers model end to end: ``attn_implementation="fastattn"`` against ``"sdpa"``.

A Llama-style decoder from a random config (hidden 512, 8 heads, 2 key/value heads,
4 layers, intermediate 1408, vocabulary 32000; nothing is downloaded), batch 1, run
in the same process with the same threads for both implementations:

- ``prefill``: the forward pass over a prompt of ``--prefill`` tokens with a cache
  (the logits of its last token only, as ``generate`` computes them);
- ``decode``: greedy decoding of ``--decode`` tokens after that prompt, one forward
  pass a token (tokens per second with a cache of ``--prefill`` tokens);
- ``train``: one training step, forward + ``loss.backward()`` of the language-model
  loss over ``--train`` tokens (gradients reset between steps, no optimizer).

Both implementations run in the same model (one registered attention function
switches between them, at no cost). Each round runs every measurement for both, the
order alternating from round to round; decoding alternates token by token, each
implementation on its own cache. A speed-up is ``sdpa time / fastattn time`` of the
same round (for decode: of the same token, i.e. the ratio of tokens per second),
reported as median [min-max] over the rounds (tokens), after one warm-up round. The time spent in attention is measured in the same
runs: each registered attention function is wrapped with a timer (forward), and in
training a pair of identity autograd functions around it stamps the time its backward
starts and ends (autograd runs the nodes of one device one at a time, the highest
sequence number first, so nothing else runs in between). The share of attention in
the model's time is reported per implementation.

    python benchmarks/transformers_llama.py --threads 2 --rounds 5
    python benchmarks/transformers_llama.py --only decode --decode 64 --json llama.json

On a shared machine only the ratios of one run mean anything.
"""

import argparse
import json
import os
import platform
import statistics
import time

IMPLEMENTATIONS = ("fastattn", "sdpa")
MEASUREMENTS = ("prefill", "decode", "train")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill", type=int, default=2048, help="prompt tokens")
    p.add_argument("--decode", type=int, default=32, help="tokens decoded after it")
    p.add_argument("--train", type=int, default=1024, help="tokens of a training step")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (after a warm-up)")
    p.add_argument("--only", default=",".join(MEASUREMENTS),
                   help="comma-separated subset of " + ",".join(MEASUREMENTS))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--json", metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    args.only = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = set(args.only) - set(MEASUREMENTS)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}; choose from {MEASUREMENTS}")
    return args


def machine():
    """The CPU's model name, its core count and its AVX-512/AMX flags (Linux), else the
    platform's machine name."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), platform.machine())
    flags = sorted({w for w in info.split() if w in (
        "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")})
    return f"{name}, {os.cpu_count()} logical CPUs, {' '.join(flags) or 'no AVX-512'}"


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def save(report, path):
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"saved to {path}")


def fmt(s, digits=2, unit=""):
    return (f"{s['median']:.{digits}f}{unit} [{s['min']:.{digits}f}-"
            f"{s['max']:.{digits}f}]")


class Clock:
    """Seconds spent in each implementation's attention, forward and backward."""

    def __init__(self):
        self.forward = dict.fromkeys(IMPLEMENTATIONS, 0.0)
        self.backward = dict.fromkeys(IMPLEMENTATIONS, 0.0)

    def reset(self):
        for name in IMPLEMENTATIONS:
            self.forward[name] = self.backward[name] = 0.0


def timed_attention(torch, function, name, clock):
    """``function`` (an AttentionInterface entry) with its forward and, when autograd
    records it, its backward timed into ``clock``."""

    class Enter(torch.autograd.Function):      # before attention: its backward ends it
        @staticmethod
        def forward(ctx, box, q, k, v):
            ctx.box = box
            return q.view_as(q), k.view_as(k), v.view_as(v)

        @staticmethod
        def backward(ctx, dq, dk, dv):
            clock.backward[name] += time.perf_counter() - ctx.box["start"]
            return None, dq, dk, dv

    class Leave(torch.autograd.Function):      # after attention: its backward starts it
        @staticmethod
        def forward(ctx, box, out):
            ctx.box = box
            return out.view_as(out)

        @staticmethod
        def backward(ctx, dout):
            ctx.box["start"] = time.perf_counter()
            return None, dout

    def attention(module, query, key, value, *args, **kwargs):
        track = torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value))
        if track:
            box = {}
            query, key, value = Enter.apply(box, query, key, value)
        t = time.perf_counter()
        out, weights = function(module, query, key, value, *args, **kwargs)
        clock.forward[name] += time.perf_counter() - t
        if track:
            out = Leave.apply(box, out)
        return out, weights
    return attention


def main(argv=None):
    args = parse_args(argv)
    import torch
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    import fastattn
    import fastattn.integrations.transformers as fa_hf

    fastattn.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    clock = Clock()
    # one registered attention function that runs the implementation of the moment:
    # switching costs nothing, so decoding can alternate token by token
    timed = {name: timed_attention(torch, function, name, clock) for name, function in
             (("fastattn", fa_hf.attention_forward), ("sdpa", sdpa_attention_forward))}
    now = {"impl": "sdpa"}
    AttentionInterface.register(
        "bench-switch", lambda *a, **kw: timed[now["impl"]](*a, **kw))
    AttentionMaskInterface.register("bench-switch", sdpa_mask)   # both use SDPA's masks
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=max(args.prefill + args.decode, args.train) + 16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="bench-switch", dtype=getattr(torch, args.dtype))
    prompt = torch.randint(0, config.vocab_size, (1, args.prefill))
    train_ids = torch.randint(0, config.vocab_size, (1, args.train))

    def run(impl, fn):
        """(seconds, seconds in attention, result) of fn() on implementation impl."""
        now["impl"] = impl
        clock.reset()
        t = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t
        return seconds, clock.forward[impl] + clock.backward[impl], result

    def prefill():
        return model(prompt, use_cache=True, logits_to_keep=1)

    def train_step():
        model.zero_grad(set_to_none=True)
        loss = model(train_ids, labels=train_ids).loss
        loss.backward()
        return loss.item()

    results = {m: {n: {"seconds": [], "attention": []} for n in IMPLEMENTATIONS}
               for m in MEASUREMENTS}
    ratios = {m: [] for m in MEASUREMENTS}
    tokens, losses = {}, {}

    def record(m, measured):
        for name, (seconds, a) in measured.items():
            results[m][name]["seconds"].append(seconds)
            results[m][name]["attention"].append(a)
        ratios[m].append(measured["sdpa"][0] / measured["fastattn"][0])

    for r in range(args.rounds + 1):                     # round 0: warm-up
        order = list(IMPLEMENTATIONS) if r % 2 else list(reversed(IMPLEMENTATIONS))
        if "prefill" in args.only or "decode" in args.only:
            model.eval()
            with torch.no_grad():
                measured, cache, step, chosen = {}, {}, {}, {}
                for name in order:
                    seconds, a, out = run(name, prefill)
                    measured[name] = (seconds, a)
                    cache[name] = out.past_key_values
                    step[name] = out.logits[:, -1:].argmax(-1)
                    chosen[name] = [step[name]]
                if r and "prefill" in args.only:
                    record("prefill", measured)
                # decoding: the two implementations alternate token by token, each on
                # its own cache; a ratio per token
                for i in range(args.decode if "decode" in args.only else 0):
                    measured = {}
                    for name in (order if i % 2 else order[::-1]):
                        seconds, a, out = run(name, lambda: model(
                            step[name], past_key_values=cache[name], use_cache=True))
                        measured[name] = (seconds, a)
                        step[name] = out.logits[:, -1:].argmax(-1)
                        chosen[name].append(step[name])
                    if r:
                        record("decode", measured)
                for name in order:
                    tokens.setdefault(name, torch.cat(chosen[name], 1))
                del cache
        if "train" in args.only:
            model.train()
            measured = {}
            for name in order:
                seconds, a, loss = run(name, train_step)
                measured[name] = (seconds, a)
                losses.setdefault(name, loss)
            model.zero_grad(set_to_none=True)
            if r:
                record("train", measured)
        print(f"round {r}/{args.rounds} done" + (" (warm-up)" if r == 0 else ""),
              flush=True)

    report = {"machine": machine(),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "fastattn": fastattn.__version__, "threads": args.threads,
              "dtype": args.dtype, "rounds": args.rounds,
              "model": f"Llama-style: hidden 512, 8 heads, 2 KV heads, {args.layers} "
                       f"layers, intermediate 1408, vocabulary 32000, batch 1",
              "results": {}}
    print(f"\n{report['model']}, {args.dtype}, {args.threads} threads, "
          f"{args.rounds} rounds (median [min-max]; decode: over every token of every "
          f"round)")
    titles = {"prefill": f"prefill {args.prefill} tokens",
              "decode": f"decode {args.decode} tokens a round, cache {args.prefill}",
              "train": f"train step (forward + backward) {args.train} tokens"}
    for m in args.only:
        per = results[m]
        entry = {"speedup": summary(ratios[m])}
        print(titles[m] + ":")
        for name in IMPLEMENTATIONS:
            secs = per[name]["seconds"]
            share = [a / s for a, s in zip(per[name]["attention"], secs)]
            e = {"seconds": summary(secs), "attention_share": summary(share),
                 "attention_seconds": summary(per[name]["attention"])}
            if m == "decode":
                e["tokens_per_s"] = summary([1 / s for s in secs])
                print(f"  {name:9s} {e['tokens_per_s']['median']:8.1f} tokens/s "
                      f"[{e['tokens_per_s']['min']:.1f}-{e['tokens_per_s']['max']:.1f}]"
                      f", attention {fmt(e['attention_share'], 3)} of the time")
            else:
                print(f"  {name:9s} {e['seconds']['median']:8.3f} s "
                      f"[{e['seconds']['min']:.3f}-{e['seconds']['max']:.3f}], "
                      f"attention {fmt(e['attention_share'], 3)} of the time")
            entry[name] = e
        print(f"  speed-up of fastattn (sdpa time / fastattn time, paired): "
              f"{fmt(entry['speedup'], 3, 'x')}")
        report["results"][m] = entry
    if tokens:
        same = torch.equal(tokens["fastattn"], tokens["sdpa"])
        report["greedy_ids_equal"] = same
        print(f"greedy ids equal: {same}")
    if losses:
        report["train_loss"] = losses
        print(f"training losses: fastattn {losses['fastattn']:.6f}, "
              f"sdpa {losses['sdpa']:.6f}")
    if args.json:
        save(report, args.json)


if __name__ == "__main__":
    main()
