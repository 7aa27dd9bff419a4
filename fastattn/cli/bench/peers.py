"""Peers: OpenVINO, ONNX Runtime and JAX beside fastattn, each in its own process.

``fastattn bench --peers openvino,onnxruntime,jax`` times other CPU runtimes' attention
operators on the arrays fastattn gets, in the same dtype:

- **openvino**: the opset-13 ``ScaledDotProductAttention`` operation in a one-node
  model, compiled for ``"CPU"`` with ``INFERENCE_NUM_THREADS`` = the run's threads and
  ``INFERENCE_PRECISION_HINT`` = the case's dtype (``f32``, ``bf16``, ``f16``; without
  the hint the CPU plugin computes float32 models in bfloat16 where the CPU has it).
  Where the plugin reports that it computes in a narrower type than the case's (a
  float16 model in bf16 on a CPU without float16 arithmetic, AMD Zen 4 and 5 among
  them), the peer is n/a: it is not a kernel of that dtype.
  Grouped-query heads are reshaped (views, made once) to q (B, Hkv, G, Lq, E) against
  k and v (B, Hkv, 1, Lk, E), which the operation broadcasts.
- **onnxruntime**: the ONNX (opset 23) ``Attention`` operator in a one-node model built
  in memory with ``onnx.helper``, ``q_num_heads``/``kv_num_heads`` for grouped-query
  heads, on the CPU execution provider with ``intra_op_num_threads`` = the threads,
  inputs and output bound once (``io_binding``). A dtype whose optimised graph is not
  the single ``Attention`` node (onnxruntime would run the operator's function body, a
  chain of generic operators) is reported n/a, as is a dtype without any kernel.
- **jax**: ``jax.nn.dot_product_attention`` (XLA) under ``jax.jit``, arrays placed on
  the device once in its (B, L, H, E) layout, each call waited for
  (``block_until_ready``); 64-bit types enabled, so that float64 stays float64. The
  thread count of XLA's CPU pool follows the worker process's CPU affinity, set to the
  run's thread count of the usable cores (``XLA_FLAGS=--xla_cpu_multi_thread_eigen=
  false`` besides for one thread) before jax is imported.

Every peer runs plain or causal attention (the causal rule of all three is fastattn's
``causal=True``, top-left; ``causal="bottom_right"`` is the same rule when Lq == Lk,
and no rule for a single query row) and grouped-query heads. A case with what an adapter
does not pass on (a window, softcap, ALiBi, sinks, a ragged batch, bottom-right causal
with Lq != Lk, the backward pass) is reported ``n/a (reason)``, never timed as another
case.

Before it is timed, each peer's answer is compared with the float64 reference
(:func:`fastattn.reference.attention` on the same inputs cast to float64, over
:func:`sample_rows`) under the tolerance the bench applies to fastattn and PyTorch (the
dtype's tolerance per unit of the largest value); a peer outside it is reported
``wrong (max err X)`` and not timed.

Process isolation: each runtime keeps worker threads spinning for a while after a call,
and several runtimes in one process share (and fight over) its cores and OpenMP
runtimes. With ``--peers`` every contender of the attention rows (fastattn, the NumPy
baseline, PyTorch, each peer, and fastattn on a variant's counterpart and the read
probe) therefore runs in a worker process of its own (``multiprocessing``, spawn),
started once per run; each worker makes the case's inputs from the same seed (checked
bit-identical by a digest), and the parent asks the workers for one sample at a time,
in rounds of rotating order, each sample after a pause
(:data:`~fastattn.cli.bench.timing._SPIN_SETTLE_S`) that lets the previous worker's
threads stop spinning. Ratios are taken per round, as in one process.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import multiprocessing
import os
import tempfile
import time
from contextlib import ExitStack
from typing import (Any, Callable, Dict, Hashable, List, Mapping, NamedTuple, Optional,
                    Sequence, Tuple)

import numpy as np

from ... import reference
from .contenders import (Unavailable, _as_numpy_tuple, _import_torch, make_callable,
                         make_inputs)
from .grid import Case
from .report import _tolerance
from .timing import summary as _summary

__all__ = ["PEERS", "PEER_PACKAGES", "INSTALL_HINT", "NotApplicable", "PeerCall",
           "ADAPTERS", "installed", "not_installed", "case_support", "peer_causal",
           "make_peer_callable", "sample_rows", "reference_sample", "check_answer",
           "fastest_peer", "peer_geomeans", "WorkerPool"]

#: The peers ``--peers`` accepts, in the order they run within a round.
PEERS = ("openvino", "onnxruntime", "jax")

#: The import names each peer needs.
PEER_PACKAGES = {"openvino": ("openvino",), "onnxruntime": ("onnxruntime", "onnx"),
                 "jax": ("jax",)}

#: How to install them.
INSTALL_HINT = 'pip install "fastattn[peers]"'

#: Seconds a worker may take to answer one request (imports, building a case, a
#: warm-up, one sample) before it is stopped and its contender reported failed.
WORKER_TIMEOUT_S = 600.0

#: How many query rows :func:`sample_rows` takes at each of the start, middle and end.
SAMPLE_BLOCK = 64


class NotApplicable(Unavailable):
    """The peer cannot run this case as asked (a variant it is not given, a dtype it
    has no kernel for); the message says why."""


class PeerCall(NamedTuple):
    """A peer made ready for one case.

    Attributes
    ----------
    call : callable
        Runs the peer once on the case's inputs (the timed call); returns what
        ``output`` reads.
    output : callable
        Turns what ``call`` returned into a NumPy array of shape (B, H, Lq, Ev) in the
        case's dtype (a copy, outside the timed call).
    runs : str
        What the peer runs, in words (operator, threads, precision).
    """

    call: Callable[[], object]
    output: Callable[[object], np.ndarray]
    runs: str


def installed(peer: str) -> bool:
    """Whether the packages of ``peer`` are importable (found, not imported)."""
    try:
        return all(importlib.util.find_spec(name) is not None
                   for name in PEER_PACKAGES[peer])
    except (ImportError, ValueError):
        return False


def not_installed(peer: str) -> str:
    """The line for a peer that is not installed."""
    return f"{peer}: not installed ({INSTALL_HINT})"


# ------------------------------------------------------------------- what peers run

def peer_causal(case: Case) -> Optional[bool]:
    """The causal flag every peer takes (top-left, as ``causal=True``) that is the
    case's causal rule, or None when no flag is (bottom-right with Lq != Lk and more
    than one query row)."""
    kind = case.causal_kind
    if kind is None:
        return False
    if kind == "top_left" or case.Lq == case.Lk:
        return True
    if case.Lq == 1:                    # the last position: every key is allowed
        return False
    return None


def case_support(case: Case, peer: str, backward: bool = False) -> Optional[str]:
    """Why ``peer`` is not run on ``case`` (the ``n/a`` reason), or None.

    Parameters
    ----------
    case : Case
    peer : str
        One of :data:`PEERS`.
    backward : bool
        Whether the run times forward + backward (the peers run forward only).

    Returns
    -------
    str or None
    """
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; expected one of {PEERS}")
    if backward:
        return "forward only"
    for reason, present in (("sliding window", case.window is not None),
                            ("softcap", case.softcap is not None),
                            ("ALiBi", case.alibi), ("sinks", case.sinks),
                            ("ragged batch", case.lengths is not None)):
        if present:
            return reason
    if peer_causal(case) is None:
        return "causal=bottom_right with Lq != Lk"
    if peer == "openvino" and case.dtype == "float64":
        return "no float64 kernel"         # inference precisions: f32, bf16, f16
    return None


def _bits(a: np.ndarray) -> np.ndarray:
    """The 16-bit words of a bfloat16 array (uint16), else ``a``."""
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def _openvino(case: Case, arrays: Mapping[str, np.ndarray], threads: int) -> PeerCall:
    import openvino as ov
    try:
        from openvino import opset13 as ops
    except ImportError:                                # releases before 2024
        from openvino.runtime import opset13 as ops    # type: ignore[no-redef]
    types = {"float32": (ov.Type.f32, "f32"), "bfloat16": (ov.Type.bf16, "bf16"),
             "float16": (ov.Type.f16, "f16")}
    if case.dtype not in types:
        raise NotApplicable(f"no {case.dtype} kernel")
    element, hint = types[case.dtype]
    B, H, Hkv, Lq, Lk, E, Ev = (case.B, case.H, case.kv_heads, case.Lq, case.Lk,
                                case.E, case.ev)
    G = H // Hkv
    # grouped heads: query head h = kv * G + g against kv head kv, by broadcasting
    shapes = {"q": (B, Hkv, G, Lq, E), "k": (B, Hkv, 1, Lk, E),
              "v": (B, Hkv, 1, Lk, Ev)}
    params = [ops.parameter(list(s), element, name=n) for n, s in shapes.items()]
    node = ops.scaled_dot_product_attention(*params, causal=bool(peer_causal(case)))
    model = ov.Model([node], params, "fastattn_bench_sdpa")
    compiled = ov.Core().compile_model(model, "CPU", {
        "INFERENCE_NUM_THREADS": int(threads), "INFERENCE_PRECISION_HINT": hint})
    request = compiled.create_infer_request()
    # a tensor on shared memory does not keep its array alive: the timed call does
    inputs = [np.ascontiguousarray(arrays[n]).reshape(s) for n, s in shapes.items()]
    for i, a in enumerate(inputs):
        if case.dtype == "bfloat16":
            # the bindings show bf16 memory as 16-bit words: copy the bits in
            tensor = ov.Tensor(element, ov.Shape(list(a.shape)))
            tensor.data.view(np.uint16)[...] = _bits(a)
        else:
            tensor = ov.Tensor(a, shared_memory=True)
        request.set_input_tensor(i, tensor)
    precision = compiled.get_property("INFERENCE_PRECISION_HINT")
    precision = getattr(precision, "get_type_name", lambda: str(precision))()
    if precision not in (hint, "f32"):
        raise NotApplicable(f"no {case.dtype} kernel on this CPU: it computes in "
                            f"{precision}")
    ran = compiled.get_property("INFERENCE_NUM_THREADS")

    def call(_inputs=inputs):             # holds the arrays the tensors read
        request.infer(share_outputs=True)
        return request

    def output(req) -> np.ndarray:
        data = np.array(req.get_output_tensor(0).data)
        if case.dtype == "bfloat16":
            data = data.view(np.uint16).view(arrays["q"].dtype)
        return data.reshape(B, H, Lq, Ev)

    return PeerCall(call, output,
                    f"OpenVINO {ov.__version__.split('-')[0]} "
                    f"ScaledDotProductAttention (opset13), CPU, "
                    f"INFERENCE_NUM_THREADS={ran}, inference precision {precision}")


_ONNX_TYPES = {"float32": "FLOAT", "float16": "FLOAT16", "bfloat16": "BFLOAT16",
               "float64": "DOUBLE"}


def _onnxruntime(case: Case, arrays: Mapping[str, np.ndarray],
                 threads: int) -> PeerCall:
    import onnx
    import onnxruntime as ort
    from onnx import helper

    element = getattr(onnx.TensorProto, _ONNX_TYPES[case.dtype])
    shapes = {"q": (case.B, case.H, case.Lq, case.E),
              "k": (case.B, case.kv_heads, case.Lk, case.E),
              "v": (case.B, case.kv_heads, case.Lk, case.ev)}
    node = helper.make_node("Attention", ["q", "k", "v"], ["out"],
                            is_causal=int(bool(peer_causal(case))),
                            q_num_heads=case.H, kv_num_heads=case.kv_heads)
    graph = helper.make_graph(
        [node], "fastattn_bench_attention",
        [helper.make_tensor_value_info(n, element, s) for n, s in shapes.items()],
        [helper.make_tensor_value_info("out", element,
                                       (case.B, case.H, case.Lq, case.ev))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = min(model.ir_version, 10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(threads)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory() as folder:
        options.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
        try:
            session = ort.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
        except Exception as exc:       # noqa: BLE001 - the runtime's own error types
            text = str(exc)
            if "NOT_IMPLEMENTED" in text or "not implemented" in text.lower():
                raise NotApplicable(f"no {case.dtype} kernel") from None
            raise
        optimized = onnx.load(options.optimized_model_filepath)
        ops = [n.op_type for n in optimized.graph.node]
    if ops != ["Attention"]:
        # onnxruntime would run the operator's function body (generic operators)
        raise NotApplicable(f"no {case.dtype} kernel")
    binding = session.io_binding()
    inputs = {n: np.ascontiguousarray(arrays[n]) for n in shapes}
    for name, a in inputs.items():
        binding.bind_cpu_input(name, a)
    binding.bind_output("out", "cpu")

    def call(_inputs=inputs):             # holds the arrays bound (not owned)
        session.run_with_iobinding(binding)
        return binding

    def output(b) -> np.ndarray:
        return np.array(b.copy_outputs_to_cpu()[0])

    return PeerCall(call, output,
                    f"ONNX Runtime {ort.__version__} Attention (opset 23), CPU "
                    f"execution provider, intra_op_num_threads={threads}")


def jax_environment(threads: int) -> Dict[str, Any]:
    """What the JAX worker sets before it imports jax: ``JAX_PLATFORMS=cpu`` (a jax
    built with a GPU plugin would otherwise run on the accelerator), ``XLA_FLAGS`` (one
    thread: no multi-threaded Eigen) and the CPU affinity (``threads`` of the usable
    cores, when fewer than all of them). Returns what was set."""
    done: Dict[str, Any] = {}
    os.environ["JAX_PLATFORMS"] = "cpu"
    done["JAX_PLATFORMS"] = "cpu"
    if threads == 1:
        flags = os.environ.get("XLA_FLAGS", "")
        flags += " --xla_cpu_multi_thread_eigen=false"
        os.environ["XLA_FLAGS"] = flags.strip()
        done["XLA_FLAGS"] = os.environ["XLA_FLAGS"]
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        if threads < len(cores):
            os.sched_setaffinity(0, cores[:threads])
            done["affinity"] = cores[:threads]
    return done


def _jax(case: Case, arrays: Mapping[str, np.ndarray], threads: int) -> PeerCall:
    import jax
    jax.config.update("jax_enable_x64", True)
    causal = bool(peer_causal(case))
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                             is_causal=causal))
    # (B, H, L, E) -> jax's (B, L, H, E), once, committed to the CPU (the jitted call
    # runs where its inputs are)
    cpu = jax.devices("cpu")[0]
    q, k, v = (jax.device_put(np.ascontiguousarray(arrays[n].transpose(0, 2, 1, 3)),
                              cpu)
               for n in ("q", "k", "v"))
    try:
        fn.lower(q, k, v).compile()
    except ValueError as exc:
        if "not supported" in str(exc):     # e.g. float16 dot products on CPU
            raise NotApplicable(f"no {case.dtype} kernel") from None
        raise

    def call():
        return fn(q, k, v).block_until_ready()

    def output(result) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(result).transpose(0, 2, 1, 3))

    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count())
    return PeerCall(call, output,
                    f"jax {jax.__version__} jax.nn.dot_product_attention (XLA), jit, "
                    f"{cores} core(s) in the process's affinity"
                    + (", XLA_FLAGS=--xla_cpu_multi_thread_eigen=false"
                       if threads == 1 else "")
                    + (", its softmax in float32 (as jax computes it)"
                       if case.dtype == "float64" else ""))


#: peer -> adapter(case, arrays, threads) -> PeerCall
ADAPTERS: Dict[str, Callable[[Case, Mapping[str, np.ndarray], int], PeerCall]] = {
    "openvino": _openvino, "onnxruntime": _onnxruntime, "jax": _jax}


def make_peer_callable(case: Case, peer: str, arrays: Mapping[str, np.ndarray],
                       threads: int) -> PeerCall:
    """Build ``peer``'s operator for ``case`` once (graph, session or jitted function;
    the layouts it needs made outside the timed call).

    Parameters
    ----------
    case : Case
    peer : str
        One of :data:`PEERS`.
    arrays : dict
        From :func:`~fastattn.cli.bench.contenders.make_inputs`: q (B, H, Lq, E), k (B,
        Hkv, Lk, E), v (B, Hkv, Lk, Ev) in the case's dtype.
    threads : int
        The peer's thread count.

    Returns
    -------
    PeerCall

    Raises
    ------
    NotApplicable
        When the case has what the peer is not given (:func:`case_support`), or the
        peer has no kernel for its dtype.
    Unavailable
        When the peer is not installed.
    """
    why = case_support(case, peer)
    if why is not None:
        raise NotApplicable(why)
    if not installed(peer):
        raise Unavailable(f"not installed ({INSTALL_HINT})")
    return ADAPTERS[peer](case, arrays, threads)


# --------------------------------------------------------------- the correctness gate

def sample_rows(Lq: int, block: int = SAMPLE_BLOCK) -> np.ndarray:
    """The query rows an answer is checked on: all of them up to ``3 * block`` rows,
    else ``block`` rows at the start, the middle and the end (int64, sorted)."""
    if Lq <= 3 * block:
        return np.arange(Lq, dtype=np.int64)
    mid = Lq // 2 - block // 2
    return np.concatenate([np.arange(0, block), np.arange(mid, mid + block),
                           np.arange(Lq - block, Lq)]).astype(np.int64)


def reference_sample(case: Case, arrays: Mapping[str, np.ndarray]
                     ) -> Tuple[np.ndarray, np.ndarray]:
    """The float64 reference on the sampled rows of a dense case.

    Returns
    -------
    rows : ndarray of int64, shape (R,)
        From :func:`sample_rows`.
    expected : ndarray of float64, shape (B, H, R, Ev)
        :func:`fastattn.reference.attention` on q, k, v cast to float64, the case's
        causal rule as an explicit mask of the sampled rows (their positions among all
        rows).
    """
    rows = sample_rows(case.Lq)
    q, k, v = (np.asarray(arrays[n], dtype=np.float64) for n in ("q", "k", "v"))
    mask = None
    kind = case.causal_kind
    if kind is not None:
        offset = case.Lk - case.Lq if kind == "bottom_right" else 0
        mask = (np.arange(case.Lk)[None, :] <= (rows + offset)[:, None])[None, None]
    expected = reference.attention(q[:, :, rows], k, v, mask=mask, enable_gqa=case.gqa)
    return rows, expected


def check_answer(case: Case, got: np.ndarray, rows: np.ndarray,
                 expected: np.ndarray) -> Tuple[bool, Optional[float], float]:
    """Whether ``got`` (B, H, Lq, Ev) matches the float64 ``expected`` on ``rows``.

    The tolerance is the one the bench applies to fastattn and PyTorch:
    the dtype's tolerance per unit of the largest magnitude (here of ``expected``).

    Returns
    -------
    ok : bool
    max_err : float or None
        The largest absolute difference (None when the shapes differ or nothing
        finite came back).
    tolerance : float
    """
    tolerance = _tolerance(case.dtype, float(np.max(np.abs(expected), initial=0.0)))
    got = np.asarray(got)
    if got.shape != (case.B, case.H, case.Lq, case.ev):
        return False, None, tolerance
    err = float(np.max(np.abs(got[:, :, rows].astype(np.float64) - expected),
                       initial=0.0))
    if not math.isfinite(err):
        return False, None, tolerance
    return err <= tolerance, err, tolerance


# ------------------------------------------------------------ fastest peer, geo-mean

def fastest_peer(samples: Mapping[str, Sequence[float]],
                 fastattn: Sequence[float]) -> Optional[Dict[str, Any]]:
    """The peer with the smallest median time, and its per-round ratio to fastattn.

    Parameters
    ----------
    samples : mapping
        peer -> its seconds per call, one per round (the peers that were timed).
    fastattn : sequence of float
        fastattn's seconds per call in the same rounds.

    Returns
    -------
    dict or None
        ``name``, ``median_ms`` and ``ratio``: median/min/max/per_round of peer time /
        fastattn time (> 1: fastattn is faster); None without a timed peer or
        fastattn.

    Examples
    --------
    >>> best = fastest_peer({"a": [3.0, 4.0, 5.0], "b": [2.0, 2.0, 9.0]},
    ...                     [1.0, 2.0, 1.0])
    >>> best["name"], best["ratio"]["median"], best["ratio"]["per_round"]
    ('b', 2.0, [2.0, 1.0, 9.0])
    """
    timed = {name: list(s) for name, s in samples.items() if s}
    if not timed or not fastattn:
        return None
    name = min(timed, key=lambda n: (_summary(timed[n])["median"], n))
    per_round = [p / f for p, f in zip(timed[name], fastattn)]
    return {"name": name, "median_ms": _summary(timed[name])["median"] * 1e3,
            "ratio": dict(_summary(per_round), per_round=per_round)}


def _geomean(values: Sequence[float]) -> Optional[Dict[str, Any]]:
    vals = [x for x in values if x > 0 and math.isfinite(x)]
    if not vals:
        return None
    return {"geomean": float(math.exp(sum(map(math.log, vals)) / len(vals))),
            "shapes": len(vals)}


def peer_geomeans(rows: Sequence[Mapping[str, Any]]) -> Dict[str, Optional[dict]]:
    """Geometric means over rows of the median ratios peer time / fastattn time: of
    each row's fastest peer (``"fastest_peer"``) and of each peer.

    Examples
    --------
    >>> rows = [{"fastest_peer": {"name": "jax", "ratio": {"median": 2.0}},
    ...          "peers": {"jax": {"ratio": {"median": 2.0}}}},
    ...         {"fastest_peer": {"name": "openvino", "ratio": {"median": 8.0}},
    ...          "peers": {"jax": {"ratio": None},
    ...                    "openvino": {"ratio": {"median": 8.0}}}}]
    >>> g = peer_geomeans(rows)
    >>> g["fastest_peer"], g["jax"]["shapes"], g["openvino"]["geomean"]
    ({'geomean': 4.0, 'shapes': 2}, 1, 8.0)
    """
    out: Dict[str, Optional[dict]] = {"fastest_peer": _geomean(
        [r["fastest_peer"]["ratio"]["median"] for r in rows if r.get("fastest_peer")])}
    names = [n for n in PEERS if any(n in (r.get("peers") or {}) for r in rows)]
    names += sorted({n for r in rows for n in (r.get("peers") or {})} - set(names))
    for name in names:
        out[name] = _geomean([r["peers"][name]["ratio"]["median"] for r in rows
                              if (r.get("peers") or {}).get(name, {}).get("ratio")])
    return out


# ------------------------------------------------------------------------- workers

def _digest(arrays: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(name.encode() + str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.view(np.uint8).reshape(-1) if a.size else b"")
    return h.hexdigest()


def _portable(result) -> Tuple[np.ndarray, ...]:
    """NumPy arrays of a result (tensors converted), 16-bit floats widened to
    float32 (exactly), so that the parent reads them without ml_dtypes or torch."""
    out = []
    for a in _as_numpy_tuple(result):
        if a.dtype.kind == "V" or (a.dtype.itemsize == 2 and a.dtype.kind not in "iub"):
            a = a.astype(np.float32)
        out.append(a)
    return tuple(out)


class _Session:
    """The work of one contender's worker: build a case, time samples.

    ``name`` is ``"fastattn"``, ``"numpy"``, ``"torch"``, ``"counterpart"`` (fastattn
    on :meth:`Case.counterpart`), ``"read"`` (the bandwidth probe) or a peer.
    """

    def __init__(self, name: str, threads: int, probe_bytes: Optional[int] = None):
        self.name, self.threads, self.probe_bytes = name, threads, probe_bytes
        self.call: Optional[Callable[[], object]] = None
        self.number = 1
        self.probe: Optional[Tuple[Callable[[], object], int]] = None
        self.torch = None
        self.stack = ExitStack()
        self.digest: Optional[str] = None       # of the current case's inputs

    def start(self, configure: bool) -> None:
        """In a worker process (``configure``): the environment a peer reads at import
        (JAX), the thread limits of the NumPy baseline and PyTorch."""
        if configure and self.name == "jax":
            jax_environment(self.threads)
        if self.name == "torch":
            self.torch = _import_torch()
        if configure and self.name in ("fastattn", "numpy", "torch", "counterpart",
                                       "read"):
            from .threads import thread_limits
            self.stack.enter_context(thread_limits(self.threads, self.torch))

    def close(self) -> None:
        self.call = None
        self.stack.close()

    def build(self, case: Case, seed: int, backward: bool
              ) -> Tuple[Callable[[], object], Any, Optional[str]]:
        """The timed call, the function that reads its output (or None), what runs."""
        arrays = make_inputs(case, seed)
        self.digest = _digest(arrays)
        if self.name == "read":
            if self.probe is None:
                from .ceilings import read_probe
                self.probe = read_probe(self.probe_bytes)
            return self.probe[0], None, None
        if self.name == "counterpart":
            twin = case.counterpart()
            if twin is None:
                raise Unavailable("the case has no counterpart")
            return (make_callable(twin, "fastattn", arrays, self.threads,
                                  backward=backward), None, None)
        if self.name in ("fastattn", "numpy", "torch"):
            fn = make_callable(case, self.name, arrays, self.threads, backward=backward,
                               torch_module=self.torch)
            return fn, _portable, None
        why = case_support(case, self.name, backward)
        if why is not None:
            raise NotApplicable(why)
        peer = make_peer_callable(case, self.name, arrays, self.threads)
        return peer.call, (lambda r: (peer.output(r),)), peer.runs

    def prepare(self, case: Case, seed: int, backward: bool,
                min_sample_time: float) -> Dict[str, Any]:
        """Build, warm up and calibrate; the reply the parent reads."""
        self.call = None
        self.digest = None
        reply: Dict[str, Any] = {"name": self.name, "digest": None, "output": None,
                                 "runs": None}
        try:
            fn, read, runs = self.build(case, seed, backward)
        except NotApplicable as exc:
            return dict(reply, status="n/a", reason=str(exc), digest=self.digest)
        except Unavailable as exc:
            return dict(reply, status="unavailable", reason=str(exc),
                        digest=self.digest)
        except Exception as exc:                # noqa: BLE001 - report, do not crash
            return dict(reply, status="failed", reason=f"failed: {type(exc).__name__}: "
                        f"{exc}", digest=self.digest)
        reply.update(digest=self.digest, runs=runs)
        try:
            t0 = time.perf_counter()
            result = fn()
            t = time.perf_counter() - t0
            output = read(result) if read is not None else None
            del result
            if t < 0.25:                        # the first call pays one-off costs
                t0 = time.perf_counter()
                fn()
                t = time.perf_counter() - t0
        except Exception as exc:                # noqa: BLE001 - report, do not crash
            return dict(reply, status="failed",
                        reason=f"failed: {type(exc).__name__}: {exc}")
        self.call = fn
        self.number = max(1, math.ceil(min_sample_time / max(t, 1e-9)))
        return dict(reply, status="ok", output=output, number=self.number,
                    estimate=t * self.number,
                    probe_bytes=self.probe[1] if self.probe is not None else None)

    def sample(self, pause: float) -> float:
        """One timed sample after ``pause`` seconds (and, for a repeated call, one
        untimed call: the cores may have clocked down); seconds per call."""
        assert self.call is not None
        if pause:
            time.sleep(pause)
            if self.number > 1:
                self.call()
        t0 = time.perf_counter()
        for _ in range(self.number):
            self.call()
        return (time.perf_counter() - t0) / self.number

    def handle(self, message: tuple) -> Any:
        kind = message[0]
        if kind == "prepare":
            return self.prepare(*message[1:])
        if kind == "sample":
            return self.sample(*message[1:])
        raise ValueError(f"unknown request {kind!r}")


def _worker_main(conn, name: str, threads: int, probe_bytes: Optional[int]) -> None:
    """The body of a worker process: answer the parent's requests until it closes."""
    session = _Session(name, threads, probe_bytes)
    session.start(configure=True)
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                break
            if message[0] == "close":
                break
            try:
                conn.send(("ok", session.handle(message)))
            except Exception as exc:            # noqa: BLE001 - the parent reports it
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        session.close()
        conn.close()


class _ProcessWorker:
    """One contender's worker process (spawn), answering one request at a time."""

    def __init__(self, name: str, threads: int, probe_bytes: Optional[int]):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, name=f"fastattn-bench-{name}",
                                   args=(child, name, threads, probe_bytes),
                                   daemon=True)
        self.process.start()
        child.close()
        self.dead: Optional[str] = None

    def ask(self, *message) -> Any:
        if self.dead is not None:
            raise RuntimeError(self.dead)
        try:
            self.conn.send(message)
            if not self.conn.poll(WORKER_TIMEOUT_S):
                self.stop()
                self.dead = f"no answer within {WORKER_TIMEOUT_S:g} s"
                raise RuntimeError(self.dead)
            status, value = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.process.join(5)
            self.dead = (f"its worker process ended (exit code "
                         f"{self.process.exitcode})")
            raise RuntimeError(self.dead) from None
        if status != "ok":
            raise RuntimeError(value)
        return value

    def alive(self) -> bool:
        return self.dead is None and self.process.is_alive()

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("close",))
            except (OSError, BrokenPipeError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


class _InlineWorker:
    """The same requests answered in this process (tests of the protocol and the
    gate: no process started)."""

    def __init__(self, name: str, threads: int, probe_bytes: Optional[int]):
        self.session = _Session(name, threads, probe_bytes)
        self.session.start(configure=False)

    def ask(self, *message) -> Any:
        return self.session.handle(message)

    def alive(self) -> bool:
        return True

    def stop(self) -> None:
        self.session.close()


class WorkerPool:
    """A worker per contender, started on first use and kept for the whole run.

    Which contenders a case has is the caller's choice (:meth:`time_case`); the peers
    are the pool's.

    Parameters
    ----------
    threads : int
        Every contender's thread count.
    peers : sequence of str
        The peers asked for (installed or not: one that is not is reported).
    read_probe : bool
        Whether decode cases time the bandwidth probe in their rounds (the caller
        names the contender ``"read"`` for them).
    probe_bytes : int, optional
        The probe's buffer size (:func:`~fastattn.cli.bench.ceilings.read_probe`).
    inline : bool
        Answer in this process instead (no isolation: for tests).
    """

    def __init__(self, threads: int, peers: Sequence[str] = (), *,
                 read_probe: bool = False, probe_bytes: Optional[int] = None,
                 inline: bool = False):
        unknown = [p for p in peers if p not in PEERS]
        if unknown:
            raise ValueError(f"unknown peers {unknown}; expected names from {PEERS}")
        self.threads, self.peers = threads, tuple(peers)
        self.read_probe, self.probe_bytes, self.inline = read_probe, probe_bytes, inline
        self.workers: Dict[str, Any] = {}

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker."""
        for worker in self.workers.values():
            worker.stop()
        self.workers.clear()

    def _worker(self, name: str):
        """``name``'s worker; a new one where the last has died (a crash in one case
        leaves the next cases to a fresh process)."""
        worker = self.workers.get(name)
        if worker is not None and not worker.alive():
            worker.stop()
            worker = None
        if worker is None:
            kind = _InlineWorker if self.inline else _ProcessWorker
            worker = self.workers[name] = kind(name, self.threads, self.probe_bytes)
        return worker

    def time_case(self, case: Case, contenders: Sequence[str], *, backward: bool,
                  seed: int, max_rounds: int, min_rounds: int, time_budget: float,
                  min_sample_time: float,
                  arrays: Optional[Mapping[str, np.ndarray]] = None) -> Dict[str, Any]:
        """Prepare ``contenders`` and the peers on ``case`` in their workers, check
        the peers' answers, then time every contender that is ready in interleaved
        rounds.

        Returns
        -------
        dict
            ``samples`` (name -> seconds per call, one per round), ``outputs`` (name ->
            tuple of arrays, for fastattn, the NumPy baseline, PyTorch and the peers
            checked), ``numbers`` (calls per sample), ``skipped`` (name -> reason),
            ``peers`` (peer -> ``status``: ``"timed"``, ``"wrong"``, ``"n/a"``,
            ``"not installed"`` or ``"failed"``, ``reason``, ``max_abs_diff``,
            ``tolerance``, ``runs``), ``probe_bytes``, ``max_abs_diff_vs_float64``
            (name -> the largest difference from the float64 reference on the sampled
            rows, for every contender with a forward output, on a case without
            variants: the peers' cases).
        """
        from .timing import _SETTLE_S, _SPIN_SETTLE_S
        arrays = make_inputs(case, seed) if arrays is None else arrays
        digest = _digest(arrays)
        skipped: Dict[str, str] = {}
        peers: Dict[str, Dict[str, Any]] = {}
        replies: Dict[str, Dict[str, Any]] = {}
        for name in list(contenders) + list(self.peers):
            if name in self.peers:
                entry = {"status": None, "reason": None, "max_abs_diff": None,
                         "tolerance": None, "runs": None}
                peers[name] = entry
                why = case_support(case, name, backward)
                if why is not None:
                    entry.update(status="n/a", reason=why)
                    continue
                if not installed(name):
                    entry.update(status="not installed", reason=INSTALL_HINT)
                    continue
            try:
                reply = self._worker(name).ask("prepare", case, seed, backward,
                                               min_sample_time)
            except RuntimeError as exc:
                reply = {"status": "failed", "reason": f"failed: {exc}",
                         "digest": None}
            if reply.get("digest") not in (None, digest):
                raise RuntimeError(f"the {name} worker made other inputs than this "
                                   f"process from seed {seed}")
            if name in peers:
                peers[name].update(runs=reply.get("runs"))
                if reply["status"] != "ok":
                    if reply["status"] == "unavailable":
                        peers[name].update(status="not installed", reason=INSTALL_HINT)
                    else:
                        peers[name].update(status=reply["status"],
                                           reason=reply["reason"])
                    continue
            elif reply["status"] != "ok":
                skipped[name] = reply["reason"]
                continue
            replies[name] = reply

        outputs = {n: r["output"] for n, r in replies.items()
                   if r["output"] is not None}
        diffs: Dict[str, Optional[float]] = {}
        if outputs and not case.variant:        # the reference sample is plain
            rows, expected = reference_sample(case, arrays)
            for name, out in outputs.items():
                if backward or len(out) != 1:
                    continue
                ok, err, tol = check_answer(case, out[0], rows, expected)
                diffs[name] = err
                if name in peers:
                    peers[name].update(max_abs_diff=err, tolerance=tol)
                    if not ok:
                        peers[name]["status"] = "wrong"
                        peers[name]["reason"] = (
                            f"max err {err:.2g} > {tol:.2g}" if err is not None
                            else "no finite answer of the case's shape")
                        del replies[name]
        numbers = {n: r["number"] for n, r in replies.items()}
        order = [n for n in list(contenders) + list(self.peers) if n in replies]
        round_s = sum(replies[n]["estimate"] for n in order) or 1e-9
        rounds = max(1, int(min(max_rounds, max(min_rounds, time_budget // round_s))))
        samples: Dict[Hashable, List[float]] = {n: [] for n in order}
        pause = max(_SETTLE_S, _SPIN_SETTLE_S)   # every runtime's threads spin
        for r in range(rounds if order else 0):
            for name in order[r % len(order):] + order[:r % len(order)]:
                if name not in samples:
                    continue
                try:
                    samples[name].append(self._worker(name).ask("sample", pause))
                except RuntimeError as exc:
                    reason = f"failed: {exc}"
                    del samples[name]
                    if name in peers:
                        peers[name].update(status="failed", reason=reason)
                    else:
                        skipped[name] = reason
        done = {n: s for n, s in samples.items() if s}
        for name in peers:
            if name in done:
                peers[name]["status"] = "timed"
        probe = replies.get("read", {}).get("probe_bytes")
        return {"samples": done, "outputs": outputs, "numbers": numbers,
                "skipped": skipped, "peers": peers, "probe_bytes": probe,
                "max_abs_diff_vs_float64": diffs}
