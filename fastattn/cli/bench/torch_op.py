"""``--torch-op``: the PyTorch operator, tensors in and a tensor out, beside what it wraps.

For each shape, three contenders in the same interleaved rounds, on the same memory:

- ``numpy_api``: :func:`fastattn.attention` on pre-made NumPy arrays (what the
  operator calls);
- ``operator``: :func:`fastattn.torch.scaled_dot_product_attention` on tensors that
  share those arrays' memory (``torch.from_numpy``), or :func:`fastattn.torch.attention`
  where the case needs the NumPy API's keywords (bottom-right causal, decode);
- ``torch``: PyTorch's own ``scaled_dot_product_attention`` (as in the main table).

The operator's cost over the NumPy API (argument checks, the tensor <-> array views,
the dispatcher where it is needed) is reported as the per-round ratio
``operator / numpy_api`` and as the per-round difference in microseconds. The run
always starts with :data:`TORCH_OP_CASE`, (1, 8, 128, 128, 64) float32: the shape on
which the operator is to take at most 1.1x the time of the NumPy API.

Forward calls are made as a user makes them, outside ``torch.no_grad()``, on tensors
that do not require a gradient (so the operator skips the dispatcher, see
:func:`fastattn.torch._direct`); with ``backward`` the operator's inputs require a
gradient and the time is forward + ``torch.autograd.grad`` (the custom operator with
its autograd formula), against the NumPy API's ``attention`` + ``attention_backward``
and PyTorch's autograd through SDPA.

Ragged cases given by lengths (``q_lengths``/``kv_lengths`` or a packed varlen batch)
are left out: the operator takes PyTorch's arguments, which have no lengths (the
key-padding-mask flavour of the same batch is timed).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

from .contenders import (Unavailable, _max_abs_diff, _to_torch, make_callable,
                         make_inputs)
from .grid import Case
from .timing import interleaved, summary

__all__ = ["TORCH_OP_CASE", "TORCH_OP_CONTENDERS", "make_operator_callable",
           "measure_torch_op", "torch_op_cases"]

#: The shape on which the operator is to take at most 1.1x the time of the NumPy API.
TORCH_OP_CASE = Case(1, 8, 128, 128, 64)

#: The contenders of the section, in the order they run within a round.
TORCH_OP_CONTENDERS = ("numpy_api", "operator", "torch")


def _import_fastattn_torch():
    try:
        import fastattn.torch as fastattn_torch
    except ImportError as exc:
        raise Unavailable(f"fastattn.torch does not import: {exc}") from None
    return fastattn_torch


def torch_op_cases(grid: Sequence[Case]) -> List[Case]:
    """:data:`TORCH_OP_CASE` and the cases of ``grid`` the operator can take (not
    those given by lengths), without repeats."""
    cases = [TORCH_OP_CASE]
    for case in grid:
        if case.ragged_flavour in ("lengths", "varlen") or case in cases:
            continue
        cases.append(case)
    return cases


def make_operator_callable(case: Case, arrays, threads: int, *, torch_module,
                           backward: bool = False) -> Callable[[], object]:
    """A zero-argument function that runs the fastattn operator once on tensors
    sharing ``arrays``' memory (forward; or forward + backward with ``backward``).

    Raises :class:`Unavailable` without PyTorch or for a case given by lengths.
    """
    if torch_module is None:
        raise Unavailable("PyTorch is not installed (pip install torch)")
    if case.ragged_flavour in ("lengths", "varlen"):
        raise Unavailable("the operator takes no lengths (time the mask flavour)")
    torch = torch_module
    ft = _import_fastattn_torch()
    tq, tk, tv = (_to_torch(torch, arrays[n]) for n in ("q", "k", "v"))
    kw = dict(enable_gqa=case.gqa, window=case.window, softcap=case.softcap,
              num_threads=threads)
    if case.alibi:
        kw["alibi_slopes"] = torch.from_numpy(arrays["alibi_slopes"])
    if case.sinks:
        kw["sinks"] = torch.from_numpy(arrays["sinks"])
    mask = (torch.from_numpy(arrays["padding_mask"])
            if case.ragged_flavour == "mask" else None)
    kind = case.causal_kind
    if kind == "bottom_right":            # the NumPy API's keywords, on tensors
        def forward(q, k, v):
            return ft.attention(q, k, v, mask=mask, causal=kind, **kw)
    else:                                 # the drop-in, as a PyTorch user calls it
        def forward(q, k, v):
            return ft.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=kind == "top_left", **kw)
    if not backward:
        return lambda: forward(tq, tk, tv)
    for t in (tq, tk, tv):
        t.requires_grad_(True)
    tdo = _to_torch(torch, arrays["do"])

    def forward_backward():
        return torch.autograd.grad(forward(tq, tk, tv), (tq, tk, tv), tdo)
    return forward_backward


def _bench_case(case: Case, threads: int, *, torch_module, backward: bool, seed: int,
                max_rounds: int, min_rounds: int, time_budget: float,
                min_sample_time: float) -> dict:
    arrays = make_inputs(case, seed)
    calls: Dict[str, Callable[[], object]] = {}
    skipped: Dict[str, str] = {}
    for name in TORCH_OP_CONTENDERS:
        try:
            if name == "operator":
                calls[name] = make_operator_callable(
                    case, arrays, threads, torch_module=torch_module, backward=backward)
            else:
                calls[name] = make_callable(
                    case, "fastattn" if name == "numpy_api" else "torch", arrays,
                    threads, backward=backward, torch_module=torch_module)
        except Unavailable as exc:
            skipped[name] = str(exc)
    samples, outputs, numbers, failed = interleaved(
        calls, max_rounds=max_rounds, min_rounds=min_rounds, time_budget=time_budget,
        min_sample_time=min_sample_time)
    skipped.update(failed)
    times = {name: dict({key: x * 1e3 for key, x in summary(s).items()},
                        samples=[x * 1e3 for x in s], number=numbers[name])
             for name, s in samples.items() if s}
    ratios: Dict[str, Optional[dict]] = {"overhead": None, "vs_torch": None}
    overhead_us = None
    op, api = samples.get("operator"), samples.get("numpy_api")
    if op and api:
        ratios["overhead"] = summary([o / a for o, a in zip(op, api)])
        overhead_us = summary([(o - a) * 1e6 for o, a in zip(op, api)])
    if op and samples.get("torch"):
        ratios["vs_torch"] = summary([t / o for t, o in zip(samples["torch"], op)])
    diffs = {}
    if "operator" in outputs:
        for other in ("numpy_api", "torch"):
            if other in outputs:
                diffs[other] = _max_abs_diff(outputs["operator"], outputs[other], case)
    return {"label": case.label, "id": case.id, "dtype": case.dtype,
            "backward": backward,
            "operator_runs": ("fastattn.torch.attention" if case.causal_kind
                              == "bottom_right" else
                              "fastattn.torch.scaled_dot_product_attention"),
            "rounds": min((len(s) for s in samples.values()), default=0),
            "times_ms": times, "ratios": ratios, "overhead_us": overhead_us,
            "max_abs_diff_operator_vs": diffs, "skipped": skipped}


def measure_torch_op(cases: Optional[Sequence[Case]] = None,
                     threads: Optional[int] = None, *, torch_module=None,
                     backward: bool = False, seed: int = 0, max_rounds: int = 11,
                     min_rounds: int = 3, time_budget: float = 6.0,
                     min_sample_time: float = 0.02, _progress=None) -> List[dict]:
    """Time the operator beside the NumPy API and PyTorch's SDPA, case by case.

    Parameters
    ----------
    cases : sequence of Case, optional
        Default ``[TORCH_OP_CASE]``; see :func:`torch_op_cases`. With ``backward``,
        decode cases are left out.
    threads : int, optional
        ``num_threads=`` of the fastattn calls (the NumPy API and the operator);
        PyTorch's count is whatever :func:`~fastattn.cli.bench.thread_limits` set.
        Default :func:`~fastattn.cli.bench.default_threads`.
    torch_module : module
        The imported ``torch`` (without it every operator entry is skipped).
    backward : bool
        Time forward + backward.
    seed, max_rounds, min_rounds, time_budget, min_sample_time
        As in :func:`~fastattn.cli.bench.run_benchmarks`.

    Returns
    -------
    list of dict
        One row per case: ``label``, ``id``, ``dtype``, ``backward``,
        ``operator_runs``, ``rounds``, ``times_ms`` (``numpy_api``/``operator``/
        ``torch``: median/min/max/samples in ms), ``ratios`` (``overhead``: operator
        time / NumPy API time, ``vs_torch``: PyTorch time / operator time;
        median/min/max of per-round values, or None), ``overhead_us`` (per-round
        operator - NumPy API time in microseconds, median/min/max, or None),
        ``max_abs_diff_operator_vs`` (``numpy_api``, ``torch``) and ``skipped``.
    """
    from .threads import default_threads
    threads = default_threads() if threads is None else threads
    cases = [TORCH_OP_CASE] if cases is None else list(cases)
    if backward:
        cases = [c for c in cases if not c.decode]
    rows = []
    for case in cases:
        if _progress is not None:
            _progress.start(f"torch operator {case.label}")
        rows.append(_bench_case(
            case, threads, torch_module=torch_module, backward=backward, seed=seed,
            max_rounds=max_rounds, min_rounds=min_rounds, time_budget=time_budget,
            min_sample_time=min_sample_time))
        if _progress is not None:
            _progress.advance()
    return rows
