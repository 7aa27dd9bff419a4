# cython: wraparound=True, boundscheck=True
# (Python-level code working on shapes and strides: negative indices mean what they
# mean in Python here; nothing in this module is a hot loop.)

"""Build the Plan of one call (see ``_plan.pxd``) from validated arguments.

This is the one place where arrays become pointers and strides: every operand is
broadcast to the output's batch shape as a NumPy view (a broadcast axis gets stride 0,
nothing is copied), the batch axes that every operand steps through alike are merged,
and the pointers, element strides and sizes go into a C struct that the drivers read.
An operand is copied only when its last axis does not have unit stride (the kernels
read rows as contiguous vectors) or, rarely, when more than MAX_BATCH_AXES batch axes
remain after merging.

Because every operand is a NumPy view of its own shape, every slice the kernels visit
lies inside its buffer: the bounds are checked here, once, by construction.
"""

import math

import numpy as np

cimport cython

from cpython.buffer cimport (PyBUF_RECORDS_RO, PyBUF_STRIDES, PyBuffer_Release,
                             PyObject_GetBuffer)
from libc.math cimport sqrt
from libc.stdint cimport int32_t, int64_t

from fastattn._validation import is_bfloat16 as _is_bfloat16
from fastattn._validation import query_offset as _query_offset
from fastattn._validation import softcap_range as _softcap_range

cdef extern from "philox.h":
    unsigned int fastattn_dropout_threshold(double dropout_p) noexcept nogil

#: Sizes the Python side may need (the kernels' constants, not copies of them).
SIZES = {"KEY_BLOCK": KEY_BLOCK, "QUERY_TILE": QUERY_TILE,
         "DECODE_KEYS": DECODE_KEYS, "MAX_BATCH_AXES": MAX_BATCH_AXES}

_DTYPES = {np.dtype(np.float32): FLOAT32, np.dtype(np.float64): FLOAT64,
           np.dtype(np.uint8): UINT8, np.dtype(np.bool_): UINT8,
           np.dtype(np.float16): FLOAT16, np.dtype(np.int8): INT8}
_FLOAT8 = {"float8_e4m3fn": FLOAT8_E4M3, "float8_e5m2": FLOAT8_E5M2}


cdef DType dtype_code(dtype) except *:
    """The DType of a NumPy dtype (bfloat16 is ml_dtypes', recognised by name)."""
    code = _DTYPES.get(dtype)
    if code is not None:
        return code
    if _is_bfloat16(dtype):
        return BFLOAT16
    if dtype.itemsize == 1 and dtype.name in _FLOAT8:
        return _FLOAT8[dtype.name]
    raise KeyError(dtype)


@cython.auto_pickle(False)
cdef class AttentionPlan:
    """One attention problem as the drivers see it (read-only from Python)."""

    @property
    def n_slices(self):
        return self.plan.n_slices

    @property
    def batch_shape(self):
        return tuple(self.plan.batch_shape[d] for d in range(self.plan.n_batch_axes))

    @property
    def sizes(self):
        """(Lq, Lk, E, Ev)."""
        return (self.plan.Lq, self.plan.Lk, self.plan.E, self.plan.Ev)

    @property
    def groups(self):
        return self.plan.groups

    @property
    def dtype(self):
        return np.dtype(np.float32) if self.plan.dtype == FLOAT32 else np.dtype(np.float64)

    @property
    def dot_kernel(self):
        """How the fused pass computes the scores: "amx_bf16" (bfloat16 q and k, AMX
        tiles), "avx512_bf16" (bfloat16 q and k, vdpbf16ps), each in a driver module
        that has the kernel, or "fma" (the micro-GEMM)."""
        return {DOT_AMX_BF16: "amx_bf16",
                DOT_AVX512_BF16: "avx512_bf16"}.get(self.plan.dot_kernel, "fma")

    @property
    def amx_codes(self):
        """Whether a decoding step's scores of 16-bit queries against int8 key codes run
        on AMX-INT8 tiles (exactly), where each item's query rows allow it."""
        return bool(self.plan.amx_codes)

    @property
    def amx_values(self):
        """Whether a decoding step's product of its weights with int8 value codes runs
        on AMX-BF16 tiles (the weights times the scales rounded once to bfloat16, as
        for bfloat16 values), where an item has 5 or more query rows per key head."""
        return bool(self.plan.amx_values)

    @property
    def pair_codes(self):
        """Whether a decoding step's scores of bfloat16 queries against float8 key codes
        (e4m3, e5m2) run on AVX512-BF16 dot products (vdpbf16ps, the codes widened
        exactly to bfloat16 by byte lookups; where the CPU also has AVX512-VBMI)."""
        return bool(self.plan.pair_codes)

    @property
    def pair_values(self):
        """Whether a decoding step's product of its weights with float8 value codes runs
        on vdpbf16ps (the weights times the scales rounded once to bfloat16, as for
        bfloat16 values; bfloat16 queries, precision=None)."""
        return bool(self.plan.pair_values)

    @property
    def positions(self):
        """(query_offset, window_left, window_right); None for an unbounded side."""
        p = &self.plan
        return (p.query_offset,
                None if p.window_left >= NO_LIMIT else p.window_left,
                None if p.window_right >= NO_LIMIT else p.window_right)

    @property
    def bottom_right(self):
        """Whether the causal rule's offset is each sequence's own Lk - Lq."""
        return bool(self.plan.bottom_right)

    @property
    def softcap(self):
        """The scores' cap c (``c * tanh(s / c)``), or None for none."""
        return self.plan.softcap if self.plan.softcap > 0 else None

    def operand(self, name):
        """Where the kernels read (or write) operand `name` ("q", "k", "v", "out",
        "lse", "mask", "bias"): (address, batch strides, row stride, column stride) in
        elements, or None when absent. For tests and debugging."""
        cdef Operand* op = _slot(&self.plan, name)
        if op.data == NULL:
            return None
        return (<size_t> op.data,
                tuple(op.batch_strides[d] for d in range(self.plan.n_batch_axes)),
                op.row_stride, op.col_stride)

    def __repr__(self):
        Lq, Lk, E, Ev = self.sizes
        return (f"<AttentionPlan batch={self.batch_shape} Lq={Lq} Lk={Lk} E={E} Ev={Ev} "
                f"groups={self.groups} positions={self.positions} dtype={self.dtype}>")


# ------------------------------------------------------------------------- operands

cdef object _unit_last_axis(a):
    """a itself when its rows are contiguous vectors, else a C-contiguous copy."""
    if a.ndim and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        return np.ascontiguousarray(a)
    return a


cdef list _element_strides(a):
    cdef Py_ssize_t size = a.itemsize
    return [s // size for s in a.strides]


cdef tuple _merge_batch_axes(tuple batch, list strides, bint keep_last):
    """Drop size-1 axes and merge neighbours every operand steps through alike.

    ``strides`` holds, per operand, its element strides along the batch axes. Returns
    the new batch shape and strides; with ``keep_last`` the last axis (GQA heads) is
    never merged or dropped, so its index can still be divided by the group size.
    """
    nd = len(batch)
    axes = [d for d in range(nd) if batch[d] != 1 or (keep_last and d == nd - 1)]
    shape = [batch[d] for d in axes]
    strides = [[s[d] for d in axes] for s in strides]
    d = len(shape) - 2
    while d >= 0:
        if not (keep_last and d + 1 == len(shape) - 1) and all(
                s[d] == s[d + 1] * shape[d + 1] for s in strides):
            shape[d] *= shape[d + 1]
            del shape[d + 1]
            for s in strides:
                s[d] = s[d + 1]
                del s[d + 1]
        d -= 1
    return shape, strides


cdef void _set_array(Operand* op, a, Py_ssize_t row_stride,
                     Py_ssize_t col_stride) except *:
    """set_operand(op, ...) for array a: where its element [0, ..., 0] lives (bfloat16
    and float8 read as 16- and 8-bit words), its DType, and the strides given (in
    elements)."""
    cdef Py_buffer view
    cdef DType code = dtype_code(a.dtype)
    if code == BFLOAT16 or code == FLOAT8_E4M3 or code == FLOAT8_E5M2:
        a = a.view(np.uint16 if code == BFLOAT16 else np.uint8)
    PyObject_GetBuffer(a, &view, PyBUF_RECORDS_RO)
    set_operand(op, <char*> view.buf, code, row_stride, col_stride)
    PyBuffer_Release(&view)


cdef void _fill_operand(Operand* op, a, list batch_strides, Py_ssize_t head_divisor,
                        Py_ssize_t nb) except *:
    """op = a (an array whose last two axes are rows and columns), its first nb batch
    axes stepping as batch_strides says."""
    cdef Py_ssize_t d
    es = _element_strides(a)
    _set_array(op, a, es[-2], es[-1])
    for d in range(nb):
        op.batch_strides[d] = batch_strides[d]
    op.head_divisor = head_divisor


cdef Operand* _slot(Plan* p, str name) except NULL:
    if name == "q":
        return &p.q
    if name == "k":
        return &p.k
    if name == "v":
        return &p.v
    if name == "out":
        return &p.out
    if name == "lse":
        return &p.lse
    if name == "mask":
        return &p.mask
    if name == "bias":
        return &p.bias
    if name == "alibi_slopes":
        return &p.alibi_slopes
    if name == "sinks":
        return &p.sinks
    if name == "k_scale":
        return &p.k_scale
    if name == "v_scale":
        return &p.v_scale
    raise KeyError(name)


def make_plan(batch, Lq, Lk, E, Ev, scale, dtype, *, q=None, k=None, v=None, out=None,
              lse=None, mask=None, bias=None, k_scale=None, v_scale=None, groups=1,
              causal=None, query_offset=None,
              window=(None, None), softcap=None, alibi_slopes=None, sinks=None,
              q_lengths=None, kv_lengths=None, dropout_p=0.0, dropout_seed=None,
              dropout_slice_base=0, bf16_dot=False, amx=False, round_weights=False):
    """The AttentionPlan of one call, from arrays already checked by ``_validation``.

    Parameters
    ----------
    batch : tuple of int
        The output's batch shape; query head h reads key/value head h // groups.
    q, k, v, out, mask, bias : ndarray or None
        ``(*batch_x, rows, cols)`` arrays broadcastable to the output batch (k and v
        with ``batch[-1] // groups`` heads); the data arrays in ``dtype``, the mask
        boolean. They are read (written, for ``out``) in place.
    lse : ndarray of shape (*batch, Lq) or None
    k_scale, v_scale : float32 ndarray broadcastable to k.shape[:-1], v.shape[:-1]
        The scales of 8-bit k and v codes (a quantized cache), one per row.
    causal : None, "top_left" or "bottom_right"
        Sets ``window_right = 0`` and, unless ``query_offset`` is given, the query
        offset (``_validation.query_offset``).
    query_offset : int, optional
        Query row i sits at key position i + query_offset.
    window : (left, right)
        Extra limits on the keys around each query's position (None: unbounded).
    softcap : float > 0, optional
        Scores become ``softcap * tanh(scores / softcap)`` before the bias.
    alibi_slopes : ndarray, optional
        Broadcastable to ``batch``: ``-slope * |i + d - j|`` is added to the scores.
    sinks : ndarray, optional
        Broadcastable to ``batch``: one extra logit per slice in every row's softmax,
        with no value (attention sinks).
    q_lengths, kv_lengths : ndarray of int of shape (batch[0],), optional
        Valid query rows and keys of each sequence (axis 0 of the batch).
    dropout_p, dropout_seed : float in [0, 1), int
        Weights dropped with probability dropout_p (Philox keyed by the seed, the
        slice, i and j: src/philox.h), the others scaled by 1 / (1 - dropout_p).
    dropout_slice_base : int
        Slice n draws its pattern as slice ``dropout_slice_base + n`` (a packed batch
        computed one sequence at a time).
    bf16_dot : bool
        The CPU's AVX512-BF16 dot products may compute the scores (``fastattn._dispatch``
        decides); used when q and k are bfloat16 with rows of an even number of
        contiguous elements, by the driver modules that have the kernel.
    amx : bool
        AMX tiles may compute the products (``fastattn._dispatch`` decides): used when q
        and k are bfloat16 with rows of a multiple of 32 contiguous elements (and, for
        the values' product, v bfloat16 with Ev a multiple of 16); before ``bf16_dot``.
    round_weights : bool
        Where the bfloat16 units compute the values' product (bfloat16 v, Ev a
        multiple of 16), the weights may be rounded once to bfloat16 for it
        (``precision=None``); else they keep 16 bits on AMX (a high and a low
        bfloat16 part) and meet V in float32 on AVX512-BF16 (``"highest"``).
    """
    batch = tuple(batch)
    nd = len(batch)
    named = []          # (name, array broadcast to its batch, head divisor)
    for name, a, rows, cols, kv in (("q", q, Lq, E, False), ("k", k, Lk, E, True),
                                    ("v", v, Lk, Ev, True), ("out", out, None, None, False),
                                    ("mask", mask, Lq, Lk, False),
                                    ("bias", bias, Lq, Lk, False)):
        if a is None:
            continue
        if name == "out":               # written in place: the caller's own array
            named.append((name, a, 1))
            continue
        if name in ("q", "k", "v", "bias"):
            a = _unit_last_axis(a)
        if name == "mask":
            a = a.view(np.uint8)
        own = batch
        if kv and groups > 1:
            own = batch[:-1] + (batch[-1] // groups,)
        shape = own + (rows, cols)
        if a.shape != shape:            # (a view that broadcasts; checked by NumPy)
            a = np.broadcast_to(a, shape)
        named.append((name, a, groups if kv else 1))
    if lse is not None:
        named.append(("lse", lse.reshape(batch + (Lq, 1)), 1))
    own = batch[:-1] + (batch[-1] // groups,) if groups > 1 else batch
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None:              # one per key row: rows of one element
            sc = sc[..., None]
            if sc.shape != own + (Lk, 1):
                sc = np.broadcast_to(sc, own + (Lk, 1))
            named.append((name, sc, groups))
    for name, per_slice in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if per_slice is not None:
            values = np.broadcast_to(np.asarray(per_slice, dtype), batch)
            named.append((name, values.reshape(batch + (1, 1)), 1))
    lengths = [None if x is None else np.ascontiguousarray(x, dtype=np.intp)
               for x in (q_lengths, kv_lengths)]
    for x, name in zip(lengths, ("q_lengths", "kv_lengths")):
        if x is not None and (nd == 0 or x.shape != (batch[0],)):
            raise ValueError(f"{name} must have shape (batch[0],) = "
                             f"{batch[:1]}, got {x.shape}")

    strides = [_element_strides(a)[:nd] for _, a, _ in named]
    shape, merged = _merge_batch_axes(batch, strides, groups > 1)
    if len(shape) > MAX_BATCH_AXES:
        return _copied_plan(batch, Lq, Lk, E, Ev, scale, dtype, named, groups, causal,
                            query_offset, window,
                            dict(softcap=softcap, sinks=sinks, q_lengths=q_lengths,
                                 kv_lengths=kv_lengths, dropout_p=dropout_p,
                                 dropout_seed=dropout_seed,
                                 dropout_slice_base=dropout_slice_base,
                                 bf16_dot=bf16_dot, amx=amx,
                                 round_weights=round_weights))

    cdef AttentionPlan holder = AttentionPlan()
    cdef Plan* p = &holder.plan
    cdef Py_ssize_t nb = len(shape)
    cdef Py_ssize_t d
    plan_init(p, dtype_code(np.dtype(dtype)), Lq, Lk, E, Ev, scale)
    p.n_batch_axes = nb
    for d in range(nb):
        p.batch_shape[d] = shape[d]
    p.n_slices = math.prod(batch)
    p.groups = groups
    if query_offset is None:
        query_offset = _query_offset(causal, Lq, Lk)
    limit = Lq + Lk + abs(query_offset) + 1     # anything wider is no limit
    left, right = window
    if causal is not None:
        right = 0 if right is None else min(right, 0)
    p.query_offset = query_offset
    p.window_left = NO_LIMIT if left is None or left >= limit else left
    p.window_right = NO_LIMIT if right is None or right >= limit else right
    p.bottom_right = causal == "bottom_right"
    p.softcap = 0 if softcap is None else softcap
    p.slices_per_sequence = max(1, math.prod(batch[1:])) if nd else 1
    cdef const Py_ssize_t[::1] view
    if lengths[0] is not None and lengths[0].size:
        view = lengths[0]
        p.q_lengths = &view[0]
    if lengths[1] is not None and lengths[1].size:
        view = lengths[1]
        p.kv_lengths = &view[0]
    p.dropout_p = dropout_p
    p.dropout_seed = 0 if dropout_seed is None else dropout_seed
    p.dropout_threshold = fastattn_dropout_threshold(dropout_p)
    p.dropout_slice_base = dropout_slice_base
    for (name, a, divisor), s in zip(named, merged):
        _fill_operand(_slot(p, name), a, s, divisor, nb)
    _choose_dot_kernel(p, bf16_dot, amx, round_weights)
    holder._arrays = tuple(a for _, a, _ in named) + tuple(lengths)
    return holder


cdef inline bint _float8(DType d) noexcept:
    return d == FLOAT8_E4M3 or d == FLOAT8_E5M2


cdef void _choose_dot_kernel(Plan* p, bint bf16_dot, bint amx,
                             bint round_weights) noexcept:
    """What computes the plan's products: AMX tiles (``amx``) or ``vdpbf16ps``
    (``bf16_dot``) where q and k are bfloat16 rows the kernels can read as pairs, else
    the micro-GEMM; and whether they may round the weights (``round_weights``). With
    ``amx``, a decoding step's scores of 16-bit queries against int8 key codes run on
    AMX-INT8 tiles (E 64 or 128), exactly, and, for bfloat16 queries that may round
    the weights, its product with int8 value codes on AMX-BF16 tiles (Ev a multiple
    of 64; src/fa_amx.h). With ``bf16_dot``, a decoding step's scores of bfloat16
    queries against float8 key codes (e4m3, e5m2) run on vdpbf16ps, and so does its
    product with float8 value codes where the weights may be rounded (src/fa_pairs.h;
    the driver module takes them where the CPU has AVX512-VBMI)."""
    p.round_weights = round_weights
    p.dot_kernel = DOT_FMA
    p.amx_codes = (amx and p.dtype == FLOAT32 and p.k.dtype == INT8
                   and p.q.dtype in (BFLOAT16, FLOAT16) and p.k.col_stride == 1
                   and (p.E == 64 or p.E == 128))
    p.amx_values = (amx and round_weights and p.dtype == FLOAT32
                    and p.v.dtype == INT8 and p.v_scale.data != NULL
                    and p.q.dtype == BFLOAT16 and p.v.col_stride == 1
                    and p.Ev > 0 and p.Ev % 64 == 0)
    p.pair_codes = (bf16_dot and p.dtype == FLOAT32 and _float8(p.k.dtype)
                    and p.q.dtype == BFLOAT16 and p.k.col_stride == 1 and p.E > 0)
    p.pair_values = (bf16_dot and round_weights and p.dtype == FLOAT32
                     and _float8(p.v.dtype) and p.q.dtype == BFLOAT16
                     and p.v.col_stride == 1 and p.Ev > 0)
    if (p.q.dtype == BFLOAT16 and p.k.dtype == BFLOAT16 and p.q.col_stride == 1
            and p.k.col_stride == 1):
        if amx and p.E > 0 and p.E % 32 == 0:
            p.dot_kernel = DOT_AMX_BF16
        elif bf16_dot and p.E % 2 == 0:
            p.dot_kernel = DOT_AVX512_BF16


# ------------------------------------------------------------------ packed batches

cdef void _packed_operand(Operand* op, a, bint heads_first, Py_ssize_t head_divisor,
                          const Py_ssize_t* starts) except *:
    """op = a packed array: (total, H, cols) (or, heads_first, (H, total) with one
    element per row), one batch axis of the sequences (stride 0: the rows of sequence
    b start at starts[b]) and one of the heads."""
    es = _element_strides(a)
    if heads_first:
        _set_array(op, a, es[1], 1)
        op.batch_strides[1] = es[0]
    else:
        _set_array(op, a, es[0], es[2])
        op.batch_strides[1] = es[1]
    op.head_divisor = head_divisor
    op.row_starts = starts


cdef list _per_sequence_and_head(Plan* p, alibi_slopes, sinks, Py_ssize_t B,
                                 Py_ssize_t Hq, dtype):
    """The plan's alibi_slopes and sinks operands (each broadcastable to (B, Hq), or
    None) for slice n = b * Hq + h; the arrays they read, to keep alive."""
    kept = []
    for name, values in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if values is not None:
            values = np.broadcast_to(np.asarray(values, dtype), (B, Hq)).reshape(
                B, Hq, 1, 1)
            _fill_operand(_slot(p, name), values, _element_strides(values)[:2], 1, 2)
            kept.append(values)
    return kept


def packed_plan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale, dtype, *,
                k_scale=None, v_scale=None, groups=1, causal=None, window=(None, None),
                softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0,
                dropout_seed=None, bf16_dot=False, amx=False, round_weights=False):
    """The AttentionPlan of a packed batch of sequences (``attention_varlen``), from
    arrays already checked by ``_validation.varlen_args``: every sequence and head is
    a slice of one plan, so one parallel region computes the whole batch.

    Parameters
    ----------
    q : ndarray of shape (total_q, Hq, E)
    k, v : ndarray of shape (total_k, Hkv, E), (total_k, Hkv, Ev)
    out : ndarray of shape (total_q, Hq, Ev)
        Written in place; every row belongs to one sequence and is written.
    lse : ndarray of shape (Hq, total_q) or None
    cu_seqlens_q, cu_seqlens_k : ndarray of int of shape (B + 1,)
        Sequence b owns rows cu[b]:cu[b + 1] (checked: non-decreasing from 0 to the
        totals). Slice n = b * Hq + h is head h of sequence b (its dropout slice
        index too); its lengths are the sequence's, Lq and Lk the longest.
    alibi_slopes, sinks : ndarray broadcastable to (B, Hq), optional
    k_scale, v_scale : float32 ndarray broadcastable to (total_k, Hkv), optional
        The scales of 8-bit k and v codes (a quantized cache), one per row.
    causal, window, softcap, dropout_p, dropout_seed, bf16_dot, amx, round_weights
        As for :func:`make_plan`; "bottom_right" aligns each sequence's own last
        query with its last key.
    """
    B = len(cu_seqlens_q) - 1
    Hq = q.shape[1]
    q, k, v = (_unit_last_axis(a) for a in (q, k, v))
    starts_q = np.ascontiguousarray(cu_seqlens_q, dtype=np.intp)
    starts_k = np.ascontiguousarray(cu_seqlens_k, dtype=np.intp)
    q_lengths = np.diff(starts_q)
    kv_lengths = np.diff(starts_k)
    Lq = int(q_lengths.max(initial=0))
    Lk = int(kv_lengths.max(initial=0))
    cdef AttentionPlan holder = AttentionPlan()
    cdef Plan* p = &holder.plan
    plan_init(p, dtype_code(np.dtype(dtype)), Lq, Lk, q.shape[2], v.shape[2], scale)
    p.n_batch_axes = 2
    p.batch_shape[0], p.batch_shape[1] = B, Hq
    p.n_slices = B * Hq
    p.groups = groups
    p.packed = True
    p.slices_per_sequence = Hq
    if causal is not None:
        right = 0 if window[1] is None else min(window[1], 0)
    else:
        right = window[1]
    limit = 2 * (Lq + Lk) + 1        # wider than any |i + d - j| of any sequence
    p.query_offset = 0
    p.window_left = NO_LIMIT if window[0] is None or window[0] >= limit else window[0]
    p.window_right = NO_LIMIT if right is None or right >= limit else right
    p.bottom_right = causal == "bottom_right"
    p.softcap = 0 if softcap is None else softcap
    cdef const Py_ssize_t[::1] view
    if B:
        view = q_lengths
        p.q_lengths = &view[0]
        view = kv_lengths
        p.kv_lengths = &view[0]
    p.dropout_p = dropout_p
    p.dropout_seed = 0 if dropout_seed is None else dropout_seed
    p.dropout_threshold = fastattn_dropout_threshold(dropout_p)
    cdef const Py_ssize_t[::1] sq = starts_q
    cdef const Py_ssize_t[::1] sk = starts_k
    _packed_operand(&p.q, q, False, 1, &sq[0])
    _packed_operand(&p.k, k, False, groups, &sk[0])
    _packed_operand(&p.v, v, False, groups, &sk[0])
    _packed_operand(&p.out, out, False, 1, &sq[0])
    if lse is not None:
        _packed_operand(&p.lse, lse, True, 1, &sq[0])
    scales = []
    for name, sc, rows in (("k_scale", k_scale, k), ("v_scale", v_scale, v)):
        if sc is not None:              # one per key row and head: rows of one element
            sc = np.broadcast_to(sc, rows.shape[:2])[..., None]
            _packed_operand(_slot(p, name), sc, False, groups, &sk[0])
            scales.append(sc)
    per_head = _per_sequence_and_head(p, alibi_slopes, sinks, B, Hq, dtype)
    _choose_dot_kernel(p, bf16_dot, amx, round_weights)
    holder._arrays = (q, k, v, out, lse, starts_q, starts_k, q_lengths, kv_lengths,
                      *scales, *per_head)
    return holder


# ------------------------------------------------------------------ paged caches

cdef void _set_paged(Operand* op, char* data, DType dtype, const Py_ssize_t* strides,
                     Py_ssize_t block_size, Py_ssize_t head_divisor,
                     const Py_ssize_t* pages, Py_ssize_t pages_stride) noexcept:
    """op = a paged cache (num_blocks, block_size, Hkv, cols) at `data`, element
    strides `strides`: the rows of sequence b (batch axis 0, stride 0) in the blocks
    its entries of `pages` name, the heads on batch axis 1."""
    set_operand(op, data, dtype, strides[1], strides[3])
    op.batch_strides[1] = strides[2]
    op.head_divisor = head_divisor
    op.pages = pages
    op.pages_stride = pages_stride
    op.page_rows = block_size
    op.page_stride = strides[0]


cdef void _paged_operand(Operand* op, a, Py_ssize_t head_divisor,
                         const Py_ssize_t* pages, Py_ssize_t pages_stride) except *:
    """_set_paged for the array a."""
    cdef Py_ssize_t strides[4]
    cdef Py_ssize_t d
    es = _element_strides(a)
    for d in range(4):
        strides[d] = es[d]
    _set_array(op, a, es[1], es[3])         # (where a lives, and its DType)
    _set_paged(op, op.data, op.dtype, strides, a.shape[1], head_divisor, pages,
               pages_stride)


cdef void _sequence_major_operand(Operand* op, a) except *:
    """op = a (B, L, H, cols) array read as slices (B, H) of L rows."""
    es = _element_strides(a)
    _set_array(op, a, es[1], es[3])
    op.batch_strides[0] = es[0]
    op.batch_strides[1] = es[2]


def paged_plan(q, k_cache, v_cache, block_table, kv_lengths, out, lse, cu_seqlens_q,
               scale, dtype, *, k_scale=None, v_scale=None, groups=1, causal=True,
               window=(None, None), softcap=None, alibi_slopes=None, sinks=None,
               bf16_dot=False, amx=False, round_weights=False):
    """The AttentionPlan of attention over a paged key-value cache
    (``attention_paged``), from arrays checked by ``_validation.paged_args``: slice
    n = b * Hq + h is head h of sequence b, its keys the first kv_lengths[b] rows of
    the blocks block_table[b] names (read in place, in any order), its queries the
    last positions of those keys (bottom-right).

    Parameters
    ----------
    q : ndarray of shape (B, Lq, Hq, E), or (total_q, Hq, E) with cu_seqlens_q
    k_cache, v_cache : ndarray of shape (num_blocks, block_size, Hkv, E / Ev)
    block_table : intp C-contiguous ndarray of shape (B, max_blocks)
        Every entry a sequence needs lies in [0, num_blocks) (checked).
    kv_lengths : ndarray of int of shape (B,)
    out : ndarray of q's shape with E replaced by Ev
        Written in place.
    lse : ndarray of shape (B, Hq, Lq), or (Hq, total_q), or None
    cu_seqlens_q : ndarray of int of shape (B + 1,), or None
    k_scale, v_scale : float32 ndarray broadcastable to (num_blocks, block_size, Hkv)
        The scales of 8-bit codes (a quantized cache), one per row.
    causal : bool
        The causal rule (window_right = 0); the positions are bottom-right either way.
    window, softcap, alibi_slopes, sinks, bf16_dot, amx, round_weights
        As for :func:`make_plan` (alibi_slopes and sinks broadcastable to (B, Hq)).
    """
    B, max_blocks = block_table.shape
    Hq = q.shape[-2]
    packed = cu_seqlens_q is not None
    q, k_cache, v_cache = (_unit_last_axis(a) for a in (q, k_cache, v_cache))
    lengths = np.ascontiguousarray(kv_lengths, dtype=np.intp)
    Lk = int(lengths.max(initial=0))
    if packed:
        starts_q = np.ascontiguousarray(cu_seqlens_q, dtype=np.intp)
        q_lengths = np.diff(starts_q)
        Lq = int(q_lengths.max(initial=0))
    else:
        starts_q = q_lengths = None
        Lq = q.shape[1]
    cdef AttentionPlan holder = AttentionPlan()
    cdef Plan* p = &holder.plan
    plan_init(p, dtype_code(np.dtype(dtype)), Lq, Lk, q.shape[-1], v_cache.shape[-1],
              scale)
    p.n_batch_axes = 2
    p.batch_shape[0], p.batch_shape[1] = B, Hq
    p.n_slices = B * Hq
    p.groups = groups
    p.packed = packed
    p.slices_per_sequence = Hq
    p.bottom_right = True
    right = window[1]
    if causal:
        right = 0 if right is None else min(right, 0)
    limit = 2 * (Lq + Lk) + 1        # wider than any |i + d - j| of any sequence
    p.window_left = NO_LIMIT if window[0] is None or window[0] >= limit else window[0]
    p.window_right = NO_LIMIT if right is None or right >= limit else right
    p.softcap = 0 if softcap is None else softcap
    cdef const Py_ssize_t[::1] view
    if B:
        view = lengths
        p.kv_lengths = &view[0]
        if packed:
            view = q_lengths
            p.q_lengths = &view[0]
    cdef const Py_ssize_t[::1] sq
    if packed:
        sq = starts_q
        _packed_operand(&p.q, q, False, 1, &sq[0])
        _packed_operand(&p.out, out, False, 1, &sq[0])
        if lse is not None:
            _packed_operand(&p.lse, lse, True, 1, &sq[0])
    else:
        _sequence_major_operand(&p.q, q)
        _sequence_major_operand(&p.out, out)
        if lse is not None:
            _fill_operand(&p.lse, lse.reshape(B, Hq, Lq, 1),
                          _element_strides(lse)[:2], 1, 2)
    cdef const Py_ssize_t[:, ::1] table = block_table
    cdef const Py_ssize_t* pages = &table[0, 0] if B and max_blocks else NULL
    kept = [q, k_cache, v_cache, out, lse, block_table, lengths, starts_q, q_lengths]
    _paged_operand(&p.k, k_cache, groups, pages, max_blocks)
    _paged_operand(&p.v, v_cache, groups, pages, max_blocks)
    for name, sc, cache in (("k_scale", k_scale, k_cache), ("v_scale", v_scale, v_cache)):
        if sc is not None:              # one per row of a block: rows of one element
            sc = np.broadcast_to(sc, cache.shape[:3])[..., None]
            _paged_operand(_slot(p, name), sc, groups, pages, max_blocks)
            kept.append(sc)
    kept += _per_sequence_and_head(p, alibi_slopes, sinks, B, Hq, dtype)
    _choose_dot_kernel(p, bf16_dot, amx, round_weights)
    holder._arrays = tuple(kept)
    return holder


# ------------------------------------------------------------------ the common call

_NDARRAY = np.ndarray
_FLOAT16 = np.dtype(np.float16)
_FLOAT32 = np.dtype(np.float32)
_FLOAT64 = np.dtype(np.float64)
_INT8 = np.dtype(np.int8)
_INT32 = np.dtype(np.int32)
_INT64 = np.dtype(np.int64)
_bfloat16 = None            # ml_dtypes' bfloat16 dtype, once an array has shown it
_SOFTCAP_RANGES = {_FLOAT32: _softcap_range(_FLOAT32), _FLOAT64: _softcap_range(_FLOAT64)}

cdef struct Plain4:
    # a 4-D array of the common call, as plain_plan reads it
    char* data
    DType dtype
    Py_ssize_t shape[4]
    Py_ssize_t strides[4]       # in elements


cdef bint _plain_array(a, Plain4* x, bint codes=False, Py_ssize_t ndim=4) except -1:
    """Whether ``a`` is a 4-D (or ``ndim``-D) float32, float64, float16 or bfloat16
    ndarray (with ``codes``, int8 or float8 too) in native byte order, aligned, no
    axis of size 0, rows of contiguous elements; fills ``x`` (its first ``ndim``
    axes) when it is."""
    global _bfloat16
    cdef Py_buffer view
    cdef Py_ssize_t d, size
    if type(a) is not _NDARRAY:
        return False
    dtype = a.dtype
    if dtype is _FLOAT32:
        x.dtype = FLOAT32
    elif dtype is _FLOAT64:
        x.dtype = FLOAT64
    elif dtype is _FLOAT16:
        x.dtype = FLOAT16
    elif dtype is _bfloat16 or (_bfloat16 is None and _is_bfloat16(dtype)
                                and dtype.isnative):
        _bfloat16 = dtype
        x.dtype = BFLOAT16
    elif codes and dtype is _INT8:
        x.dtype = INT8
    elif codes and dtype.itemsize == 1 and dtype.name in _FLOAT8:
        x.dtype = _FLOAT8[dtype.name]
    else:
        return False        # other dtypes, and any in the other byte order
    # strides without a format: NumPy then exports bfloat16 too (the dtype is known)
    PyObject_GetBuffer(a, &view, PyBUF_STRIDES)
    try:
        if view.ndim != ndim:
            return False
        size = view.itemsize
        if <size_t> view.buf % <size_t> size:
            return False
        for d in range(ndim):
            if view.shape[d] < 1 or view.strides[d] % size:
                return False
            x.shape[d] = view.shape[d]
            x.strides[d] = view.strides[d] // size
        if x.shape[ndim - 1] > 1 and x.strides[ndim - 1] != 1:
            return False
        x.data = <char*> view.buf
        return True
    finally:
        PyBuffer_Release(&view)


cdef void _plain_operand(Operand* op, const Plain4* x,
                         Py_ssize_t head_divisor) noexcept:
    set_operand(op, x.data, x.dtype, x.strides[2], x.strides[3])
    op.batch_strides[0] = x.strides[0]
    op.batch_strides[1] = x.strides[1]
    op.head_divisor = head_divisor


cdef object _plain_scale(scale, sinks, Py_ssize_t E, Py_ssize_t Hq, comp):
    """The common call's scale (None: 1 / sqrt(E), as _validation.resolve_scale), or
    None where scale is not None or a float, or sinks neither None nor a C-contiguous
    ndarray of shape (Hq,) in the computation dtype ``comp``."""
    if sinks is not None and not (type(sinks) is _NDARRAY and sinks.dtype is comp
                                  and sinks.shape == (Hq,) and sinks.flags.c_contiguous):
        return None
    if scale is None:
        return 1.0 / sqrt(<double> E)
    return scale if type(scale) is float else None


cdef AttentionPlan _heads_plan(comp, Py_ssize_t B, Py_ssize_t Hq, Py_ssize_t groups,
                               Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t E, Py_ssize_t Ev,
                               double scale):
    """A new plan of B sequences of Hq query heads (slice n = b * Hq + h, groups query
    heads per K/V head) in the computation dtype ``comp``, its operands and rules
    still to set."""
    cdef AttentionPlan holder = AttentionPlan()
    cdef Plan* p = &holder.plan
    plan_init(p, FLOAT64 if comp is _FLOAT64 else FLOAT32, Lq, Lk, E, Ev, scale)
    p.n_batch_axes = 2
    p.batch_shape[0], p.batch_shape[1] = B, Hq
    p.n_slices = B * Hq
    p.groups = groups
    p.slices_per_sequence = Hq
    return holder


cdef int _plain_causal(causal) except -2:
    """The short paths' causal rule: 0 for False, 1 for True or "top_left" (the
    PyTorch operator's name), 2 for "bottom_right"; -1 for anything else (the general
    path checks it)."""
    if causal is False:
        return 0
    if causal is True or (type(causal) is str and causal == "top_left"):
        return 1
    if type(causal) is str and causal == "bottom_right":
        return 2
    return -1


cdef bint _plain_window(window, Py_ssize_t span, Py_ssize_t sides[2]) except -1:
    """Is ``window`` one the short path takes: None, or a tuple or list of two sides,
    each None or a Python int >= 0 (anything else: False, and the general path checks
    it)? Fills ``sides`` (left, right) with each side, or -1 where it restricts
    nothing: None, or ``span = Lq + Lk`` or more (as ``variant_args`` says)."""
    cdef Py_ssize_t d
    sides[0] = sides[1] = -1
    if window is None:
        return True
    if not ((type(window) is tuple or type(window) is list) and len(window) == 2):
        return False
    for d in range(2):
        w = window[d]
        if w is None:
            continue
        if type(w) is not int or w < 0:
            return False
        if w < span:
            sides[d] = w
    return True


cdef tuple _plain_numbers(DType q_dtype, scale, sinks, softcap, Py_ssize_t E,
                          Py_ssize_t Hq):
    """(computation dtype, scale, cap) of a short path's call whose q has ``q_dtype``
    (:func:`_plain_scale`, :func:`_plain_softcap`), or None where its scale, sinks or
    softcap are not the short paths' (the general path checks them)."""
    comp = _FLOAT64 if q_dtype == FLOAT64 else _FLOAT32
    scale = _plain_scale(scale, sinks, E, Hq, comp)
    cdef double cap = _plain_softcap(softcap, comp)
    if scale is None or cap < 0:
        return None
    return comp, scale, cap


cdef double _plain_softcap(softcap, comp) except -2:
    """The cap the short path takes: 0 for None, else a Python float within
    ``softcap_range`` of the computation dtype ``comp``; -1 for anything else (the
    general path checks it)."""
    if softcap is None:
        return 0
    if type(softcap) is not float:
        return -1
    lo, hi = _SOFTCAP_RANGES[comp]
    if not lo <= softcap <= hi:         # (NaN is not either)
        return -1
    return softcap


cdef void _set_sinks(Plan* p, sinks) except *:
    """The plan's sinks as the short paths take them (None, or one per query head of
    the computation dtype: batch stride 0, head stride 1)."""
    if sinks is not None:
        _set_array(&p.sinks, sinks, 0, 1)
        p.sinks.batch_strides[1] = 1


cdef void _set_window(Plan* p, const Py_ssize_t sides[2], bint causal) noexcept:
    """The plan's window from _plain_window's sides, as make_plan and paged_plan set
    it: a bounded side as it is; under the causal rule the right side 0."""
    p.window_right = 0 if causal else NO_LIMIT  # j <= i + query_offset, or none
    if sides[0] >= 0:
        p.window_left = sides[0]
    if sides[1] >= 0 and not causal:
        p.window_right = sides[1]


def plain_plan(q, k, v, causal, scale, enable_gqa, bint bf16_dot=False,
               bint amx=False, lse=None, sinks=None, bint round_weights=False,
               window=None, softcap=None, kv_lengths=None, k_scale=None,
               v_scale=None):
    """The plan of the commonest call and its new output, or None for any other call.

    The commonest call: ``q (B, Hq, Lq, E)``, ``k (B, Hkv, Lk, E)`` and
    ``v (B, Hkv, Lk, Ev)`` NumPy arrays (not subclasses) of one dtype, float32,
    float64, bfloat16 or float16, native byte order, aligned, rows of contiguous
    elements, every size at least 1; ``Hq == Hkv``, or a multiple of it with
    ``enable_gqa`` True; ``causal`` False, True, "top_left" or "bottom_right";
    ``scale`` None or a float; no mask, bias or variant but ``sinks``, None or a
    C-contiguous ndarray of shape (Hq,) in the computation dtype (gpt-oss's),
    ``window``, None or a tuple or list of two sides, each None or a Python int >= 0
    (a sliding-window layer's), ``softcap``, None or a Python float the
    computation dtype takes (Gemma 2's), and ``kv_lengths``, None or an int32 or
    int64 ndarray of shape (B,), each in [0, Lk] (a padded cache's). ``k`` and ``v``
    may instead be a quantized cache beside a float32, bfloat16 or float16 ``q``: int8
    codes with both scales, or float8 codes with scales or none, each scale a float32
    ndarray of shape (B, Hkv, Lk) (one per token and head, as
    :func:`fastattn.quantize_kv` makes them; any layout without negative strides, a
    token-major cache's seen heads first too); float k and v take no scales. A decoding
    step or a prefill in a PyTorch model is this call. ``bf16_dot`` and ``amx`` say which
    bfloat16 kernels may compute it, and ``round_weights`` how, as for
    :func:`make_plan`.

    With ``lse``, the backward's plan instead: no output, the forward's log-sum-exp
    read from ``lse``, a C-contiguous ndarray of shape (B, Hq, Lq) in the computation
    dtype (else None).

    It is the plan :func:`make_plan` builds for the same call, written directly from
    the arrays' buffers (the batch axes are not merged: that changes no arithmetic),
    so the results are the same bits; the checks, and every error message, stay with
    the general path, which any other call takes.

    Returns
    -------
    (AttentionPlan, ndarray of shape (B, Hq, Lq, Ev) or None) or None
        The output has the inputs' dtype: for 16-bit inputs the kernels compute its
        rows in float32 and round each once as they write it (``_tiles.narrow_out``).
    """
    cdef Plain4 x[3]
    cdef Py_ssize_t B, Hq, Hkv, Lq, Lk, E, Ev, groups
    cdef Py_ssize_t k_strides[4]
    cdef Py_ssize_t v_strides[4]
    cdef Py_ssize_t sides[2]
    cdef double cap
    cdef bint codes = lse is None           # (the backward refuses quantized caches)
    if not (_plain_array(q, &x[0]) and _plain_array(k, &x[1], codes)
            and _plain_array(v, &x[2], codes)):
        return None
    B, Hq, Lq, E = x[0].shape[0], x[0].shape[1], x[0].shape[2], x[0].shape[3]
    Hkv, Lk, Ev = x[1].shape[1], x[1].shape[2], x[2].shape[3]
    if (x[2].dtype != x[1].dtype or x[1].shape[0] != B or x[2].shape[0] != B
            or x[1].shape[3] != E or x[2].shape[1] != Hkv or x[2].shape[2] != Lk
            or not _plain_cache_scales(x, k_scale, v_scale, k_strides, v_strides)):
        return None
    if Hq == Hkv:
        groups = 1
    elif enable_gqa is True and Hq % Hkv == 0:
        groups = Hq // Hkv
    else:
        return None
    cdef Py_ssize_t rule = _plain_causal(causal)
    if rule < 0:
        return None
    cdef bint bottom_right = rule == 2
    causal = rule > 0
    if not _plain_window(window, Lq + Lk, sides):
        return None
    numbers = _plain_numbers(x[0].dtype, scale, sinks, softcap, E, Hq)
    if numbers is None:
        return None
    comp, scale, cap = numbers
    lengths = None
    if kv_lengths is not None:
        lengths = np.empty(B, np.intp)
        if not _plain_lengths(kv_lengths, B, Lk, lengths):
            return None
    cdef Plain4 o
    o.data = NULL
    out = None
    if lse is not None:
        if not (type(lse) is _NDARRAY and lse.dtype is comp and lse.shape == (B, Hq, Lq)
                and lse.flags.c_contiguous):
            return None
    else:       # (16-bit inputs: the kernels round their float32 rows into it)
        out = np.empty((B, Hq, Lq, Ev), dtype=q.dtype)
    if out is not None:
        _plain_array(out, &o)
    cdef AttentionPlan holder = _heads_plan(comp, B, Hq, groups, Lq, Lk, E, Ev, scale)
    cdef Plan* p = &holder.plan
    _set_window(p, sides, causal)
    p.softcap = cap
    if bottom_right:                            # (as make_plan and query_offset say)
        p.query_offset = Lk - Lq
        p.bottom_right = True
    cdef const Py_ssize_t[::1] lv
    if lengths is not None:
        lv = lengths
        p.kv_lengths = &lv[0]
    _plain_operand(&p.q, &x[0], 1)
    _plain_operand(&p.k, &x[1], groups)
    _plain_operand(&p.v, &x[2], groups)
    if out is not None:
        _plain_operand(&p.out, &o, 1)
    else:                                   # (B, Hq, Lq) as rows of one element
        _set_array(&p.lse, lse, 1, 1)
        p.lse.batch_strides[0], p.lse.batch_strides[1] = Hq * Lq, Lq
    _plain_row_scales(&p.k_scale, k_scale, k_strides, groups)
    _plain_row_scales(&p.v_scale, v_scale, v_strides, groups)
    _set_sinks(p, sinks)
    _choose_dot_kernel(p, bf16_dot, amx, round_weights)
    holder._arrays = (q, k, v, out, lse, sinks, lengths, k_scale, v_scale)
    return holder, out


cdef bint _plain_cache_scales(const Plain4* x, k_scale, v_scale,
                              Py_ssize_t* k_strides, Py_ssize_t* v_strides) except -1:
    """Whether q (x[0]) and the k and v of ``x[1:3]`` (one dtype, checked by the
    caller) make a common call with these scales: k and v in q's float dtype and no
    scales, or a quantized cache beside a float32 or 16-bit q with the scales
    :func:`_row_scales` takes (both for int8 codes, either or none for float8), whose
    element strides ``k_strides`` and ``v_strides`` get."""
    if not is_code(x[1].dtype):
        return x[1].dtype == x[0].dtype and k_scale is None and v_scale is None
    if x[0].dtype == FLOAT64 or (x[1].dtype == INT8 and (k_scale is None
                                                          or v_scale is None)):
        return False
    return ((k_scale is None or _row_scales(k_scale, &x[1], k_strides))
            and (v_scale is None or _row_scales(v_scale, &x[2], v_strides)))


cdef void _plain_row_scales(Operand* op, sc, const Py_ssize_t* strides,
                            Py_ssize_t groups) except *:
    """op = the scales ``sc`` (None: absent) of a (B, Hkv, L, cols) cache, a float32
    ndarray of shape (B, Hkv, L) of element strides ``strides`` (_row_scales): one
    per key row, rows of one element (as make_plan reads them)."""
    if sc is None:
        return
    set_operand(op, _data_of(sc), FLOAT32, strides[2], 0)
    op.batch_strides[0], op.batch_strides[1] = strides[0], strides[1]
    op.head_divisor = groups


# ------------------------------------------------------------ the common paged call

cdef bint _int_vector(a, Py_ssize_t n, Py_buffer* view) except -1:
    """Whether ``a`` is an aligned int32 or int64 ndarray of shape (n,) (or, for n <
    0, 2-D); fills ``view`` (released by the caller) when it is."""
    if type(a) is not _NDARRAY or not (a.dtype is _INT32 or a.dtype is _INT64):
        return False
    if a.ndim != (2 if n < 0 else 1) or (n >= 0 and a.shape[0] != n):
        return False
    cdef Py_ssize_t d
    PyObject_GetBuffer(a, view, PyBUF_STRIDES)
    if <size_t> view.buf % <size_t> view.itemsize:
        PyBuffer_Release(view)
        return False
    for d in range(view.ndim):
        if view.strides[d] % view.itemsize:
            PyBuffer_Release(view)
            return False
    return True


cdef inline int64_t _int_at(const Py_buffer* view, Py_ssize_t i,
                            Py_ssize_t j) noexcept:
    """Element [i] (or [i, j]) of an int32 or int64 view."""
    cdef const char* at = <const char*> view.buf + i * view.strides[0]
    if view.ndim == 2:
        at += j * view.strides[1]
    if view.itemsize == 4:
        return (<const int32_t*> at)[0]
    return (<const int64_t*> at)[0]


cdef bint _paged_table(block_table, kv_lengths, Py_ssize_t B, Py_ssize_t block_size,
                       Py_ssize_t num_blocks, Py_ssize_t[::1] lengths,
                       Py_ssize_t[:, ::1] table) except -1:
    """The block table and lengths as ``_validation.paged_args`` leaves them (intp,
    the entries a sequence does not need set to 0) in ``table`` and ``lengths``, or
    False where they are not int32/int64 ndarrays of shapes (B, max_blocks) and (B,)
    or a length or a needed entry is out of range (the general path says which)."""
    cdef Py_buffer tv
    cdef Py_ssize_t b, i, max_blocks = table.shape[1], need
    cdef int64_t block
    if not (_plain_lengths(kv_lengths, B, max_blocks * block_size, lengths)
            and _int_vector(block_table, -1, &tv)):
        return False
    try:
        if tv.shape[0] != B or tv.shape[1] != max_blocks:
            return False
        for b in range(B):
            need = (lengths[b] + block_size - 1) // block_size
            for i in range(max_blocks):
                block = _int_at(&tv, b, i) if i < need else 0
                if block < 0 or block >= num_blocks:
                    return False
                table[b, i] = <Py_ssize_t> block
        return True
    finally:
        PyBuffer_Release(&tv)


cdef bint _plain_lengths(kv_lengths, Py_ssize_t B, Py_ssize_t Lk,
                         Py_ssize_t[::1] lengths) except -1:
    """``kv_lengths`` as ``_validation.check_lengths`` (or ``paged_args``, with Lk the
    table's rows) leaves them, in ``lengths`` (intp), or False where they are not an
    int32/int64 ndarray of shape (B,) with every length in [0, Lk] (the general path
    says what is wrong)."""
    cdef Py_buffer lv
    cdef Py_ssize_t b
    cdef int64_t n
    if not _int_vector(kv_lengths, B, &lv):
        return False
    try:
        for b in range(B):
            n = _int_at(&lv, b, 0)
            if n < 0 or n > Lk:
                return False
            lengths[b] = <Py_ssize_t> n
        return True
    finally:
        PyBuffer_Release(&lv)


cdef bint _row_scales(sc, const Plain4* cache, Py_ssize_t* strides) except -1:
    """Is ``sc`` a quantized cache's float32 scales, one per token and head: an
    aligned ndarray of the cache's shape without its last axis, in any layout without
    negative strides (the cache's own: a token-major cache's scales seen heads first,
    a paged cache's blocks stored heads first)? ``strides`` gets its three axes'
    element strides (as :func:`_element_strides` finds them) and 0, the column stride
    of its rows of one element (as the general path's ``sc[..., None]`` has it)."""
    cdef Py_ssize_t d
    if not (type(sc) is _NDARRAY and sc.dtype is _FLOAT32 and sc.ndim == 3
            and sc.shape[0] == cache.shape[0] and sc.shape[1] == cache.shape[1]
            and sc.shape[2] == cache.shape[2] and sc.flags.aligned):
        return False
    byte_strides = sc.strides
    for d in range(3):
        if byte_strides[d] < 0 or byte_strides[d] % 4:
            return False
        strides[d] = byte_strides[d] // 4
    strides[3] = 0
    return True


cdef void _sequence_major(Operand* op, const Plain4* x) noexcept:
    """_sequence_major_operand for a (B, L, H, cols) array read by _plain_array."""
    set_operand(op, x.data, x.dtype, x.strides[1], x.strides[3])
    op.batch_strides[0], op.batch_strides[1] = x.strides[0], x.strides[2]


cdef char* _data_of(a) except NULL:
    """Where an ndarray's element [0, ..., 0] lives."""
    cdef Py_buffer view
    PyObject_GetBuffer(a, &view, PyBUF_STRIDES)
    cdef char* data = <char*> view.buf
    PyBuffer_Release(&view)
    return data


def plain_paged_plan(q, k_cache, v_cache, block_table, kv_lengths, k_scale, v_scale,
                     causal, scale, sinks, bint bf16_dot=False, bint amx=False,
                     window=None, softcap=None, cu_seqlens_q=None):
    """The plan of the commonest ``attention_paged`` call and its new output, or None
    for any other call.

    The commonest call, a decoding step of an LLM server: ``q (B, Lq, Hq, E)`` and
    the caches ``(num_blocks, block_size, Hkv, E / Ev)`` as for :func:`plain_plan`
    (the caches may also hold int8 or float8 codes beside a float32, bfloat16 or
    float16 q, else they have q's dtype), ``Hq`` a multiple of ``Hkv``; a quantized
    cache's scales None (float8 only) or float32 ndarrays of shape
    ``(num_blocks, block_size, Hkv)`` (one per token and head, as
    :func:`fastattn.quantize_kv` makes them, in any layout without negative strides:
    blocks stored heads first keep their scales so), a float cache's None;
    ``block_table`` (B, max_blocks) and ``kv_lengths`` (B,) int32 or int64 ndarrays,
    every length in range and every block a sequence needs inside the cache;
    ``causal`` True or False; ``scale`` None or a float; ``sinks``, ``window`` and
    ``softcap`` as for :func:`plain_plan` (a side of ``Lq`` plus the longest length
    or more restricts nothing, as the general path says); no ALiBi, lse or ``out``.
    With ``cu_seqlens_q`` (chunked prefill, or a batch of decoding steps packed), q is
    ``(total_q, Hq, E)`` and ``cu_seqlens_q`` an int32 or int64 ndarray of shape
    (B + 1,) from 0, non-decreasing, to total_q.

    It is the plan :func:`paged_plan` builds for the same call, written directly from
    the arrays' buffers, so the results are the same bits; the checks, and every error
    message, stay with the general path, which any other call takes.

    Returns
    -------
    (AttentionPlan, ndarray of shape (B, Lq, Hq, Ev) or (total_q, Hq, Ev)) or None
        The output has q's dtype (16-bit rows rounded once as the kernels write them).
    """
    cdef Plain4 x[4]
    cdef Py_ssize_t B, Lq, Hq, E, Ev, num_blocks, block_size, Hkv, max_blocks, b, Lk
    cdef Py_ssize_t k_strides[4]
    cdef Py_ssize_t v_strides[4]
    cdef Py_ssize_t sides[2]
    cdef double cap
    cdef bint packed = cu_seqlens_q is not None
    if not (_plain_array(q, &x[0], False, 3 if packed else 4)
            and _plain_array(k_cache, &x[1], True)
            and _plain_array(v_cache, &x[2], True)
            and type(block_table) is _NDARRAY and block_table.ndim == 2
            and block_table.shape[0] >= 1):
        return None
    if packed:
        B, Lq, Hq, E = block_table.shape[0], 0, x[0].shape[1], x[0].shape[2]
    else:
        B, Lq, Hq, E = x[0].shape[0], x[0].shape[1], x[0].shape[2], x[0].shape[3]
    num_blocks, block_size, Hkv = x[1].shape[0], x[1].shape[1], x[1].shape[2]
    Ev = x[2].shape[3]
    if (x[2].dtype != x[1].dtype or x[2].shape[0] != num_blocks
            or x[2].shape[1] != block_size or x[2].shape[2] != Hkv
            or x[1].shape[3] != E or Hq % Hkv
            or not (causal is True or causal is False)
            or not _plain_cache_scales(x, k_scale, v_scale, k_strides, v_strides)):
        return None
    numbers = _plain_numbers(x[0].dtype, scale, sinks, softcap, E, Hq)
    if numbers is None:
        return None
    comp, scale, cap = numbers
    max_blocks = block_table.shape[1]
    lengths = np.empty(B, np.intp)
    table = np.empty((B, max_blocks), np.intp)
    if not _paged_table(block_table, kv_lengths, B, block_size, num_blocks, lengths,
                        table):
        return None
    cdef const Py_ssize_t[::1] lv = lengths
    cdef const Py_ssize_t[:, ::1] tv = table
    cdef const Py_ssize_t[::1] lq
    cdef const Py_ssize_t[::1] sq
    starts_q = q_lengths = None
    if packed:
        starts_q = np.empty(B + 1, np.intp)
        q_lengths = np.empty(B, np.intp)
        if not _plain_starts(cu_seqlens_q, B + 1, x[0].shape[0], starts_q, q_lengths):
            return None
        lq = q_lengths
        sq = starts_q
        for b in range(B):
            Lq = max(Lq, lq[b])
    Lk = 0
    for b in range(B):
        Lk = max(Lk, lv[b])
    if not _plain_window(window, Lq + Lk, sides):
        return None
    if packed:
        out = np.empty((x[0].shape[0], Hq, Ev), dtype=q.dtype)
        _plain_array(out, &x[3], False, 3)
    else:
        out = np.empty((B, Lq, Hq, Ev), dtype=q.dtype)
        _plain_array(out, &x[3])
    cdef AttentionPlan holder = _heads_plan(comp, B, Hq, Hq // Hkv, Lq, Lk, E, Ev,
                                            scale)
    cdef Plan* p = &holder.plan
    p.bottom_right = True
    _set_window(p, sides, causal)
    p.softcap = cap
    p.kv_lengths = &lv[0]
    if packed:
        p.packed = True
        p.q_lengths = &lq[0]
        _plain_packed(&p.q, &x[0], 1, &sq[0])
        _plain_packed(&p.out, &x[3], 1, &sq[0])
    else:
        _sequence_major(&p.q, &x[0])
        _sequence_major(&p.out, &x[3])
    cdef const Py_ssize_t* pages = &tv[0, 0] if max_blocks else NULL
    _set_paged(&p.k, x[1].data, x[1].dtype, x[1].strides, block_size, p.groups, pages,
               max_blocks)
    _set_paged(&p.v, x[2].data, x[2].dtype, x[2].strides, block_size, p.groups, pages,
               max_blocks)
    # scales: one per row of a block, rows of one element
    if k_scale is not None:
        _set_paged(&p.k_scale, _data_of(k_scale), FLOAT32, k_strides, block_size,
                   p.groups, pages, max_blocks)
    if v_scale is not None:
        _set_paged(&p.v_scale, _data_of(v_scale), FLOAT32, v_strides, block_size,
                   p.groups, pages, max_blocks)
    _set_sinks(p, sinks)
    _choose_dot_kernel(p, bf16_dot, amx, True)
    holder._arrays = (q, k_cache, v_cache, out, table, lengths, k_scale, v_scale,
                      sinks, starts_q, q_lengths)
    return holder, out


# ------------------------------------------------------------ the common packed call

cdef bint _plain_starts(cu, Py_ssize_t n, Py_ssize_t total, Py_ssize_t[::1] starts,
                        Py_ssize_t[::1] lengths) except -1:
    """``cu`` as ``_validation.check_cu_seqlens_one`` leaves it, in ``starts`` (intp),
    and its sequences' lengths in ``lengths``, or False where it is not an int32/int64
    ndarray of shape (n,) from 0, non-decreasing, to ``total`` (the general path says
    what is wrong)."""
    cdef Py_buffer view
    cdef Py_ssize_t i
    cdef int64_t c, last = 0
    if not _int_vector(cu, n, &view):
        return False
    try:
        for i in range(n):
            c = _int_at(&view, i, 0)
            if c < last or (i == 0 and c != 0):
                return False
            starts[i] = <Py_ssize_t> c
            if i:
                lengths[i - 1] = <Py_ssize_t> (c - last)
            last = c
        return last == total
    finally:
        PyBuffer_Release(&view)


cdef void _plain_packed(Operand* op, const Plain4* x, Py_ssize_t head_divisor,
                        const Py_ssize_t* starts) noexcept:
    """_packed_operand for a (total, H, cols) array read by _plain_array."""
    set_operand(op, x.data, x.dtype, x.strides[0], x.strides[2])
    op.batch_strides[1] = x.strides[1]
    op.head_divisor = head_divisor
    op.row_starts = starts


def plain_packed_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, sinks,
                      bint bf16_dot=False, bint amx=False, window=None, softcap=None):
    """The plan of the commonest ``attention_varlen`` call and its new output, or None
    for any other call.

    The commonest call: ``q (total_q, Hq, E)``, ``k (total_k, Hkv, E)`` and
    ``v (total_k, Hkv, Ev)`` ndarrays of one float dtype as for :func:`plain_plan`
    (every size at least 1), ``Hq`` a multiple of ``Hkv``; ``cu_seqlens_q`` and
    ``cu_seqlens_k`` int32 or int64 ndarrays of one length B + 1, each from 0,
    non-decreasing, to its total; ``causal`` False, True, "top_left" or
    "bottom_right"; ``scale``, ``sinks``, ``window`` and ``softcap`` as for
    :func:`plain_plan` (a side of twice the longest sequence or more restricts
    nothing, as the general path says); no ALiBi, dropout, quantized cache, lse or
    ``out``. transformers' continuous batching makes this call.

    It is the plan :func:`packed_plan` builds for the same call, written directly from
    the arrays' buffers, so the results are the same bits; the checks, and every error
    message, stay with the general path, which any other call takes.

    Returns
    -------
    (AttentionPlan, ndarray of shape (total_q, Hq, Ev)) or None
        The output has q's dtype (16-bit rows rounded once as the kernels write them).
    """
    cdef Plain4 x[4]
    cdef Py_ssize_t total_q, total_k, Hq, Hkv, E, Ev, n, b, Lq = 0, Lk = 0
    cdef Py_ssize_t sides[2]
    cdef double cap
    if not (_plain_array(q, &x[0], False, 3) and _plain_array(k, &x[1], False, 3)
            and _plain_array(v, &x[2], False, 3)):
        return None
    total_q, Hq, E = x[0].shape[0], x[0].shape[1], x[0].shape[2]
    total_k, Hkv, Ev = x[1].shape[0], x[1].shape[1], x[2].shape[2]
    if (x[1].dtype != x[0].dtype or x[2].dtype != x[0].dtype or x[1].shape[2] != E
            or x[2].shape[0] != total_k or x[2].shape[1] != Hkv or Hq % Hkv):
        return None
    if type(cu_seqlens_q) is not _NDARRAY or cu_seqlens_q.ndim != 1:
        return None
    n = cu_seqlens_q.shape[0]
    if n < 2:
        return None
    starts_q = np.empty(n, np.intp)
    starts_k = np.empty(n, np.intp)
    q_lengths = np.empty(n - 1, np.intp)
    kv_lengths = np.empty(n - 1, np.intp)
    if not (_plain_starts(cu_seqlens_q, n, total_q, starts_q, q_lengths)
            and _plain_starts(cu_seqlens_k, n, total_k, starts_k, kv_lengths)):
        return None
    cdef const Py_ssize_t[::1] lq = q_lengths
    cdef const Py_ssize_t[::1] lk = kv_lengths
    for b in range(n - 1):
        Lq = max(Lq, lq[b])
        Lk = max(Lk, lk[b])
    cdef Py_ssize_t rule = _plain_causal(causal)
    if rule < 0:
        return None
    cdef bint bottom_right = rule == 2
    causal = rule > 0
    if not _plain_window(window, 2 * max(Lq, Lk), sides):
        return None
    numbers = _plain_numbers(x[0].dtype, scale, sinks, softcap, E, Hq)
    if numbers is None:
        return None
    comp, scale, cap = numbers
    out = np.empty((total_q, Hq, Ev), dtype=q.dtype)
    _plain_array(out, &x[3], False, 3)
    cdef AttentionPlan holder = _heads_plan(comp, n - 1, Hq, Hq // Hkv, Lq, Lk, E, Ev,
                                            scale)
    cdef Plan* p = &holder.plan
    p.packed = True
    p.bottom_right = bottom_right
    _set_window(p, sides, causal)
    p.softcap = cap
    p.q_lengths = &lq[0]
    p.kv_lengths = &lk[0]
    p.dropout_threshold = fastattn_dropout_threshold(0)
    cdef const Py_ssize_t[::1] sq = starts_q
    cdef const Py_ssize_t[::1] sk = starts_k
    _plain_packed(&p.q, &x[0], 1, &sq[0])
    _plain_packed(&p.k, &x[1], Hq // Hkv, &sk[0])
    _plain_packed(&p.v, &x[2], Hq // Hkv, &sk[0])
    _plain_packed(&p.out, &x[3], 1, &sq[0])
    _set_sinks(p, sinks)
    _choose_dot_kernel(p, bf16_dot, amx, True)
    holder._arrays = (q, k, v, out, starts_q, starts_k, q_lengths, kv_lengths, sinks)
    return holder, out


def _copied_plan(batch, Lq, Lk, E, Ev, scale, dtype, named, groups, causal,
                 query_offset, window, variants):
    """More batch axes than a Plan holds even after merging: copy the inputs to
    C-contiguous arrays of the output's whole batch (GQA heads repeated), which
    merge to one axis. Rare (it needs many axes that broadcast differently)."""
    arrays = {}
    for name, a, divisor in named:
        if divisor > 1:
            a = np.repeat(a, divisor, axis=-3)
        full = batch + a.shape[-2:]
        if name in ("out", "lse"):
            arrays[name] = a            # written by the kernels: never copied
        else:
            arrays[name] = np.ascontiguousarray(np.broadcast_to(a, full))
    if "mask" in arrays:
        arrays["mask"] = arrays["mask"].view(np.bool_)
    if "lse" in arrays:
        arrays["lse"] = arrays["lse"].reshape(batch + (Lq,))
    for name in ("alibi_slopes", "sinks"):
        if name in arrays:
            variants[name] = arrays[name].reshape(-1)
    if variants["q_lengths"] is not None or variants["kv_lengths"] is not None:
        # one flat axis: each slice carries the length of its own sequence
        per = max(1, math.prod(batch[1:]))
        for key in ("q_lengths", "kv_lengths"):
            if variants[key] is not None:
                variants[key] = np.repeat(np.asarray(variants[key], np.intp), per)
    flat = (math.prod(batch),)

    def one_axis(a, trailing):
        return None if a is None else a.reshape(flat + trailing)

    g = arrays.get
    for name in ("k_scale", "v_scale"):
        if name in arrays:
            variants[name] = arrays[name].reshape(flat + (Lk,))
    return make_plan(flat, Lq, Lk, E, Ev, scale, dtype,
                     q=one_axis(g("q"), (Lq, E)), k=one_axis(g("k"), (Lk, E)),
                     v=one_axis(g("v"), (Lk, Ev)),
                     out=None if g("out") is None else g("out").reshape(
                         flat + g("out").shape[-2:]),
                     lse=one_axis(g("lse"), (Lq,)), mask=one_axis(g("mask"), (Lq, Lk)),
                     bias=one_axis(g("bias"), (Lq, Lk)), groups=1, causal=causal,
                     query_offset=query_offset, window=window, **variants)
