"""``fastattn bench``: time fastattn against the NumPy baseline and PyTorch.

The instrument runs every contender in the same process, with the same number of
threads, on the same arrays, in interleaved rounds (A B C, B C A, C A B, ...: the order
rotates so that no contender always follows the same other). A speed-up is the
ratio ``time of the other / time of fastattn`` taken *per round*; the table reports the
median of those ratios with their min and max, because on a shared machine only ratios
measured side by side mean anything. The same run also measures the machine's
ceilings: sgemm (and dgemm) GFLOP/s of a 2048 x 2048 NumPy matmul and the memory read
bandwidth of a matrix-vector product over a buffer much larger than the L3 cache.

With ``--peers openvino,onnxruntime,jax`` (:mod:`~fastattn.cli.bench.peers`) the
attention rows also time those runtimes' attention operators on the same arrays in the
same dtype, each checked against the float64 reference before it is timed, and every
contender then runs in a worker process of its own, the workers taking turns one sample
at a time in the same rotating rounds; the table gains a "fastest peer" column and the
geometric mean against the fastest peer.

Counting conventions
--------------------
- Forward work is ``2 * B * H * Lq * Lk * (E + Ev)`` flops, i.e. ``4 * B * H * Lq * Lk * E``
  when ``Ev == E``. Under a causal mask only the query-key pairs that may attend are
  counted (``Lq * (Lq + 1) / 2`` of ``Lq * Lk`` for a square causal mask: about half);
  likewise under a sliding window (about ``Lq * (left + 1)`` pairs for
  ``window=(left, 0)``), and for a ragged batch only the real rows of each sequence,
  whatever way they reach the kernel (lengths, a padding mask or a packed varlen batch:
  the padded rows a padding mask still computes are waste, not work). Softcap, ALiBi
  and attention sinks change no count.
- With ``--backward`` the timed work is forward + backward, counted as
  ``(1 + 2.5) x`` the forward flops: the backward pass does five matrix products where
  the forward does two (the FlashAttention-2 convention).
- Decode shapes (one query row) are bound by memory, not arithmetic: their throughput is
  reported as the bytes of K and V read (each key/value head once, also under GQA)
  divided by the time, and compared with the run's measured read bandwidth.
- "% peak" is fastattn's GFLOP/s as a share of the run's sgemm GFLOP/s (dgemm for
  float64 shapes; for bfloat16 shapes, when PyTorch is installed, the GFLOP/s of a
  bfloat16 matmul of the same size through PyTorch where it is the faster of the two: a
  CPU without bfloat16 units widens to float32), or its bandwidth as a share of the
  measured read bandwidth for decode.
- ``--dtype`` puts every selected case in one dtype (float32, float64, bfloat16,
  float16); PyTorch runs in the same dtype. The default grid has a bfloat16 and
  float16 section; bfloat16 cases need ``ml_dtypes`` and are left out without it.

Attention variants
------------------
Cases may carry a sliding window, a softcap, ALiBi slopes, attention sinks (gpt-oss's
``s_aux``: one extra logit per head) or a ragged batch (real lengths of a padded batch,
handed over as ``q_lengths``/``kv_lengths``, as a boolean key-padding mask, or packed
for ``attention_varlen``). fastattn and the NumPy baseline take them natively; PyTorch's
SDPA gets the equivalent boolean ``attn_mask`` (window, ragged) or additive float mask
(ALiBi); SDPA has no softcap and takes no sinks, so for those cases the PyTorch column
is an eager composition (matmul, tanh, softmax, matmul; with sinks, the sink logit
concatenated to each row before the softmax and its weight dropped after it, as
transformers' eager gpt-oss attention does), named under the table. Each variant case
is also timed, in fastattn, against its counterpart without the variant, in the same
rounds (the "variants against their counterpart" table: e.g. the cost of sinks).

Serving rows
------------
After the attention shapes, a full run times the serving rows
(:mod:`~fastattn.cli.bench.serving`, ids starting with ``serve-``; ``--quick`` runs
one): decoding steps of (1, 32:8, 1, Lk, 128) at Lk = 8192 and 32768 over bfloat16,
int8 and float8 caches, contiguous (``fastattn.attention``) and paged in blocks of 16
and 64 tokens in a random order (``fastattn.attention_paged``; at 8192 tokens also
bfloat16 and int8 blocks of 16 stored head after head); a ragged decoding
batch of 32 sequences of 256 to 16384 tokens, paged; and a chunked prefill (4
sequences of 512 new queries over 2048 to 8192 tokens) beside ``attention_varlen`` on
the same contiguous keys and values. Each paged row also times the contiguous call on
the same data, its tokens and heads in the blocks' order, in the same rounds
(paged/contiguous: what the block table costs), and the decoding rows what a
caller writes today, gather the blocks and dequantize to bfloat16 with NumPy (then
fastattn) or PyTorch (then SDPA), per step. A decoding row counts the bytes of the
cache it reads: 2 per bfloat16 element, or 1 per code plus the float32 scales (4
bytes per token and head, each of K and V). Every contender's result is checked
against ``fastattn.reference.attention_paged`` on a subsample. The serving rows are
for inference: ``--backward``, ``--dtype`` and thread scaling leave them out.

Thread scaling and overhead
---------------------------
``--threads 1,2,4,8,16`` (several counts) prints, per shape, the time, GFLOP/s,
parallel efficiency and speed-up over PyTorch at each count, all counts interleaved in
the same rounds (:mod:`~fastattn.cli.bench.scaling`). Every run also times one tiny
(1, 1, 16, 16, 64) call per thread count beside PyTorch and a NumPy floor
(:mod:`~fastattn.cli.bench.overhead`).

The PyTorch operator
--------------------
``--torch-op`` adds a table of ``fastattn.torch.scaled_dot_product_attention`` (the
operator: tensors in, a tensor out) beside the NumPy API on the same memory and
PyTorch's SDPA, on (1, 8, 128, 128, 64) and the selected shapes: what the PyTorch
binding costs over the NumPy API, per call and as a ratio
(:mod:`~fastattn.cli.bench.torch_op`).

Heavy optional packages (torch, matplotlib, tqdm, threadpoolctl) are imported lazily,
inside the functions that need them.

The modules, by concern: :mod:`~fastattn.cli.bench.grid` (the shapes),
:mod:`~fastattn.cli.bench.threads`, :mod:`~fastattn.cli.bench.ceilings` (the machine),
:mod:`~fastattn.cli.bench.contenders`, :mod:`~fastattn.cli.bench.timing`
(interleaved rounds), :mod:`~fastattn.cli.bench.runner` (a run at one thread count),
:mod:`~fastattn.cli.bench.scaling` (a run over several),
:mod:`~fastattn.cli.bench.overhead` (the tiny call),
:mod:`~fastattn.cli.bench.torch_op` (the PyTorch operator),
:mod:`~fastattn.cli.bench.serving` (paged and quantized caches),
:mod:`~fastattn.cli.bench.report` (tables, JSON, plot) and
:mod:`~fastattn.cli.bench.command` (the options). This package re-exports their public
names. The settings (``grid.GRID``, ``grid.QUICK_GRID``, ``ceilings.GEMM_N``,
``ceilings.BANDWIDTH_BYTES``, ``runner.FULL_SETTINGS``, ``runner.QUICK_SETTINGS``,
``serving.SERVING_GRID``, ``serving.QUICK_SERVING_GRID``,
``overhead.OVERHEAD_SETTINGS``, ``timing._SETTLE_S``, ``timing._SPIN_SETTLE_S``)
are read from the module that defines them, at each run: that is the one to change.

Examples
--------
From the command line::

    fastattn bench --quick
    fastattn bench --threads 2 --json bench.json --plot bench.png
    fastattn bench --backward --only 2048
    fastattn bench --only 8192 --only ragged --threads 2
    fastattn bench --only serve- --threads 2
    fastattn bench --threads 1,2,4 --only "(1,8,2048,2048,64) causal"
    fastattn bench --torch-op --only "(1,8,512,512,64)" --threads 2

From Python:

>>> from fastattn.cli import bench
>>> [c.label for c in bench.QUICK_GRID][:2]
['(1,8,512,512,64)', '(4,8,256,256,64)']
"""

from .ceilings import measure_ceilings
from .command import add_arguments, run
# _import_torch also serves benchmarks/conftest.py and the tests
from .contenders import (CONTENDERS, Unavailable, _import_torch, make_callable,
                         make_inputs, torch_implementation)
from .grid import GRID, QUICK_GRID, Case
from .overhead import measure_overhead
from .report import format_report, format_serving, plot_report, write_json
from .runner import benchmark_report, geometric_means, run_benchmarks
from .scaling import run_scaling, scaling_report
from .serving import QUICK_SERVING_GRID, SERVING_GRID, ServingCase, run_serving
from .threads import default_threads, thread_limits
from .torch_op import TORCH_OP_CASE, measure_torch_op

__all__ = ["Case", "GRID", "QUICK_GRID", "CONTENDERS", "Unavailable", "add_arguments",
           "run", "run_benchmarks", "benchmark_report", "geometric_means",
           "measure_ceilings", "thread_limits", "make_inputs", "make_callable",
           "format_report", "write_json", "plot_report", "default_threads",
           "measure_overhead", "run_scaling", "scaling_report", "torch_implementation",
           "measure_torch_op", "TORCH_OP_CASE", "ServingCase", "SERVING_GRID",
           "QUICK_SERVING_GRID", "run_serving", "format_serving"]
