# The backward driver, FlashAttention-2 style. Compiled with _drivers.pxi into every
# per-instruction-set module; self-contained: it cimports everything it uses.
#
# The probabilities are rebuilt tile by tile from the forward's log-sum-exp, never as
# an Lq x Lk matrix. Three passes, each over independent work items computed whole by
# one thread in a fixed order, so results are bit-identical for any number of threads
# and there are no atomics:
#
# 1. delta = rowsum(dO * O) for every query row of every output slice.
# 2. one item per (key/value slice u, chunk c of its keys): it owns dK and dV of those
#    keys and loops, in a fixed order, over every output slice n that reads slice u
#    (several under broadcasting or grouped-query attention: its "users") and over
#    that slice's query tiles, skipping the blocks the position rule hides from the
#    whole tile; it writes scale * dS K, summed over the chunk's keys, as the partial
#    dQ of (n, c) (_tiles_backward.key_value_item).
# 3. one item per (query slice, tile of query rows): dQ is the sum of the partials of
#    every output slice that reads it and every chunk, in that order.
#
# The number of key chunks depends only on the shapes (backward_chunks), so the order
# of every sum does too.

import numpy as np

from cython.parallel cimport parallel, prange
from libc.stdint cimport uint16_t

from fastattn._scratch import scratch

from fastattn cimport _tiles
from fastattn cimport _tiles_backward as _tb
from fastattn._csrc cimport fa_narrow_row
from fastattn._gemm cimport real
from fastattn._openmp cimport omp_get_thread_num
from fastattn._parallel cimport (Interrupt, aligned, interrupted, raise_interrupt,
                                 start_interrupt_checks)
from fastattn._plan cimport (BFLOAT16, DOT_FMA, FLOAT16, FLOAT32, KEY_BLOCK, AttentionPlan,
                             DType, Plan, dtype_code, element_size)

cdef enum:
    BACKWARD_MIN_ITEMS = 16     # split the keys into chunks until there are this many
    BACKWARD_MAX_CHUNKS = 8     # ... but never more chunks (each holds a partial dQ)


def backward_chunks(Py_ssize_t Lk, Py_ssize_t n_kv):
    """(keys per chunk, number of chunks) of the backward's key split for Lk keys and
    n_kv key/value slices: a function of the shapes only."""
    cdef Py_ssize_t blocks = (Lk + KEY_BLOCK - 1) // KEY_BLOCK
    cdef Py_ssize_t want, per
    if blocks == 0:
        return KEY_BLOCK, 0
    want = (BACKWARD_MIN_ITEMS + n_kv - 1) // n_kv if n_kv > 0 else 1
    want = max(1, min(want, BACKWARD_MAX_CHUNKS, blocks))
    per = (blocks + want - 1) // want
    return per * KEY_BLOCK, (blocks + per - 1) // per


def backward_kernel(AttentionPlan plan, grad_dtype):
    """What computes the backward's gradient products for this plan and a grad_out of
    ``grad_dtype``: "avx512_bf16" (vdpbf16ps, P and dS rounded to bfloat16) or "fma"
    (the float32 micro-GEMM)."""
    cdef _tb.Gradients g
    g.grad_kind = dtype_code(np.dtype(grad_dtype))
    if plan.plan.dtype == FLOAT32 and _tb.bf16_gradients(&plan.plan, &g):
        return "avx512_bf16"
    return "fma"


cdef bint _bf16_units_safe(const Plan* p, grad_out) except -1:
    """Do q, k, v, grad_out and the scale suit the bfloat16 units (see
    _tiles.bf16_units_safe)?"""
    cdef Py_ssize_t n
    cdef const uint16_t[::1] words
    if not _tiles.bf16_scale_safe(p.scale):
        return False
    for n in range(p.n_slices):
        if not _tiles.bf16_units_safe(p, n):
            return False
    if dtype_code(grad_out.dtype) == BFLOAT16 and grad_out.size:
        words = np.ascontiguousarray(grad_out).reshape(-1).view(np.uint16)
        return _tiles.bf16_words_in_range(&words[0], words.shape[0])
    return True


cdef int _check_users(const Py_ssize_t[::1] users, const Py_ssize_t[::1] starts,
                      Py_ssize_t n_out, what) except -1:
    """users[starts[u]:starts[u + 1]] lists output slices: n_out of them, each in range,
    the starts increasing from 0 to n_out. Returns 1 when every input slice u has the
    one user u (nothing shared), else 0."""
    cdef Py_ssize_t u, n_in = starts.shape[0] - 1
    cdef bint ok = (users.shape[0] == n_out and n_in >= 0 and starts[0] == 0
                    and starts[n_in] == n_out)
    cdef bint own = ok and n_in == n_out
    for u in range(n_in if ok else 0):
        if starts[u + 1] < starts[u]:
            ok = False
            break
        own = own and starts[u] == u
    for u in range(n_out if ok else 0):
        if not 0 <= users[u] < n_out:
            ok = False
            break
        own = own and users[u] == u
    if not ok:
        raise ValueError(f"internal error: {what} users/starts do not agree")
    return own


def backward(AttentionPlan plan, grad_out, out, dq, dk, dv, kv_users, kv_starts,
             q_users, q_starts, int num_threads):
    """dq (P, Lq, E), dk (U, Lk, E), dv (U, Lk, Ev) of the plan's attention.

    The plan holds q, k, v, the forward's lse, mask and bias; grad_out and out are
    C-contiguous (N, Lq, Ev) in the computation dtype or, when that is float32, in
    bfloat16 or float16 (read in place, widened exactly); so are dq, dk and dv (one
    dtype: 16-bit ones are summed in float32 and rounded once, as ``narrow`` rounds).
    kv_users[kv_starts[u]:kv_starts[u + 1]] lists, in increasing order, the output
    slices that read key/value slice u (of U); q_users/q_starts the same for the P
    query slices.
    """
    # the plan as the drivers use it: its bfloat16 products leave the bfloat16 units
    # when an operand or grad_out does not suit them (_tiles.bf16_units_safe)
    cdef Plan local = plan.plan
    cdef const Plan* p = &local
    cdef Py_ssize_t N = p.n_slices
    if local.dot_kernel != DOT_FMA and not _bf16_units_safe(p, grad_out):
        local.dot_kernel = DOT_FMA
    kv_users, kv_starts, q_users, q_starts = (
        np.ascontiguousarray(a, dtype=np.intp) for a in (kv_users, kv_starts, q_users,
                                                         q_starts))
    _check_users(kv_users, kv_starts, N, "key/value")
    cdef bint own_queries = _check_users(q_users, q_starts, N, "query")
    dtype = np.float32 if p.dtype == FLOAT32 else np.float64
    U = len(kv_starts) - 1
    P = len(q_starts) - 1

    def stored(a):      # in the computation dtype, or 16-bit beside float32
        return a.flags.c_contiguous and (a.dtype == dtype or (
            p.dtype == FLOAT32 and dtype_code(a.dtype) in (BFLOAT16, FLOAT16)))

    if not (grad_out.size == out.size == N * p.Lq * p.Ev and dq.size == P * p.Lq * p.E
            and dk.size == U * p.Lk * p.E and dv.size == U * p.Lk * p.Ev
            and dq.dtype == dk.dtype == dv.dtype
            and all(stored(a) for a in (grad_out, out, dq, dk, dv))):
        raise ValueError("internal error: backward buffers do not agree")
    _backward(p, grad_out, out, dq, dk, dv, kv_users, kv_starts, q_users, q_starts,
              own_queries, num_threads)


cdef _tb.ChunkScratch carve_chunk(const Plan* p, const _tb.Gradients* g,
                                  char* base) noexcept nogil:
    cdef _tb.ChunkScratch s
    _tb.chunk_scratch(p, g, base, &s)
    return s


cdef int _backward(const Plan* p, grad_out, out, dq, dk, dv, kv_users, kv_starts,
                   q_users, q_starts, bint own_queries, int num_threads) except -1:
    dtype = np.float32 if p.dtype == FLOAT32 else np.float64
    cdef Py_ssize_t N = p.n_slices, Lq = p.Lq, E = p.E, Ev = p.Ev
    cdef Py_ssize_t U = len(kv_starts) - 1
    cdef Py_ssize_t P = len(q_starts) - 1
    cdef Py_ssize_t chunk_keys, n_chunks
    chunk_keys, n_chunks = backward_chunks(p.Lk, U)
    cdef DType go_kind = dtype_code(grad_out.dtype), o_kind = dtype_code(out.dtype)
    cdef Py_ssize_t go_size = grad_out.dtype.itemsize, o_size = out.dtype.itemsize
    cdef const unsigned char[::1] go = grad_out.reshape(-1).view(np.uint8)
    cdef const unsigned char[::1] o = out.reshape(-1).view(np.uint8)
    cdef unsigned char[::1] delta = np.empty((N * Lq + 1) * (8 if dtype == np.float64
                                                           else 4), np.uint8)
    # the gradients as bytes: the computation dtype, or 16-bit words (out_kind)
    cdef DType out_kind = dtype_code(dq.dtype)
    cdef bint narrow = out_kind != p.dtype
    cdef unsigned char[::1] dq_bytes = _bytes(dq)
    cdef unsigned char[::1] dk_bytes = _bytes(dk)
    cdef unsigned char[::1] dv_bytes = _bytes(dv)
    # Each output slice's dQ of each chunk of keys goes to its own partial, summed in
    # a fixed order in step 3; with one chunk and every query slice read by its own
    # output slice alone, the partials are dQ itself and step 3 has nothing to do.
    cdef bint direct = n_chunks == 1 and own_queries
    cdef unsigned char[::1] dq_part = (
        scratch((N * n_chunks * Lq * E + 1) * element_size(p.dtype), np.uint8, "dq_part")
        if not direct else None)
    cdef const Py_ssize_t[::1] kvu = kv_users       # (checked by backward)
    cdef const Py_ssize_t[::1] kvs = kv_starts
    cdef _tb.Gradients g
    cdef Interrupt stop
    cdef Py_ssize_t r, w, u, c, rows = N * Lq
    cdef int nt
    start_interrupt_checks(&stop)

    # 1. delta = rowsum(dO * O)
    if rows > 0:
        nt = team(num_threads, rows)
        with nogil, parallel(num_threads=nt):
            for r in prange(rows, schedule="static"):
                set_delta(p, &delta[0], r, _tb.row_dot(&go[r * Ev * go_size], go_kind,
                                                       &o[r * Ev * o_size], o_kind, Ev))

    # 2. dK, dV and the partial dQ, per (key/value slice, chunk of keys)
    g.grad_out = &go[0] if go.shape[0] else NULL
    g.grad_kind = go_kind
    g.delta = &delta[0]
    g.dq_part = &dq_part[0] if not direct else &dq_bytes[0]
    g.dq = &dq_bytes[0] if direct and narrow else NULL
    g.dk = &dk_bytes[0]
    g.dv = &dv_bytes[0]
    g.out_kind = out_kind
    g.n_chunks = n_chunks
    g.chunk_keys = chunk_keys
    cdef Py_ssize_t n_items = U * n_chunks
    cdef _tb.ChunkScratch s
    cdef Py_ssize_t per = per_thread(_tb.chunk_scratch(p, &g, NULL, &s))
    cdef unsigned char[::1] work
    cdef char* base
    if n_items > 0:
        nt = team(num_threads, n_items)
        work = _scratch(nt * per, nt)
        base = <char*> aligned(&work[0])
        with nogil, parallel(num_threads=nt):
            s = carve_chunk(p, &g, base + omp_get_thread_num() * per)
            for w in prange(n_items, schedule="dynamic"):
                if interrupted(&stop):
                    continue
                u = w // n_chunks
                c = w % n_chunks
                if kvs[u + 1] > kvs[u]:
                    chunk_item(p, &g, u, c, &kvu[kvs[u]], kvs[u + 1] - kvs[u], &s,
                               &stop)
                else:           # a key/value slice no output reads: zero gradients
                    _tb.clear_chunk(p, &g, u, c)
        if stop.stop:
            return raise_interrupt()

    # 3. dQ of each query slice: its users' partials, every chunk, in order
    if P * Lq == 0 or E == 0 or direct:
        return 0
    if p.dtype == FLOAT32:
        sum_dq(p, &g, q_users, q_starts, P, num_threads, <float*> &dq_part[0],
               <float*> &dq_bytes[0], narrow)
    else:
        sum_dq(p, &g, q_users, q_starts, P, num_threads, <double*> &dq_part[0],
               <double*> &dq_bytes[0], narrow)
    return 0


cdef inline void set_delta(const Plan* p, unsigned char* delta, Py_ssize_t r,
                           double value) noexcept nogil:
    if p.dtype == FLOAT32:
        (<float*> delta)[r] = <float> value
    else:
        (<double*> delta)[r] = value


cdef inline void chunk_item(const Plan* p, const _tb.Gradients* g, Py_ssize_t u,
                            Py_ssize_t c, const Py_ssize_t* users, Py_ssize_t n_users,
                            const _tb.ChunkScratch* s, Interrupt* stop) noexcept nogil:
    """key_value_item for chunk c of key/value slice u: its dK, dV sums in place, or
    (16-bit gradients) in the item's float32 scratch, rounded by the item."""
    cdef Py_ssize_t k0 = c * g.chunk_keys
    if p.dtype == FLOAT32:
        if _tb.narrowing(g):
            _tb.key_value_item(p, g, u, c, users, n_users, s, <float*> s.dk,
                               <float*> s.dv, stop)
        else:
            _tb.key_value_item(p, g, u, c, users, n_users, s,
                               <float*> g.dk + (u * p.Lk + k0) * p.E,
                               <float*> g.dv + (u * p.Lk + k0) * p.Ev, stop)
    else:
        _tb.key_value_item(p, g, u, c, users, n_users, s,
                           <double*> g.dk + (u * p.Lk + k0) * p.E,
                           <double*> g.dv + (u * p.Lk + k0) * p.Ev, stop)


cdef int sum_dq(const Plan* p, const _tb.Gradients* g, q_users, q_starts,
                Py_ssize_t P, int num_threads, const real* dq_part, real* dq,
                bint narrow) except -1:
    """Step 3: dQ of each query slice (of P) = the sum, in order, of the partials of
    every output slice that reads it and every chunk; each item a tile of
    BACKWARD_ROWS rows (16-bit gradients: summed in a thread's float32 tile, rounded)."""
    cdef Py_ssize_t Lq = p.Lq, E = p.E, BR = _tb.BACKWARD_ROWS
    cdef Py_ssize_t q_tiles = (Lq + BR - 1) // BR, n_items = P * q_tiles
    cdef int nt = team(num_threads, n_items)
    cdef const Py_ssize_t[::1] qu = q_users
    cdef const Py_ssize_t[::1] qst = q_starts
    cdef real[::1] tiles
    cdef real* tile = NULL
    cdef real* dst = NULL
    cdef const real* part = NULL
    cdef Py_ssize_t w, u, i0, nr, ui, c, x
    if narrow:
        tiles = scratch(nt * BR * E, np.float32 if real is float else np.float64,
                        "dq_tile", nt)
    with nogil, parallel(num_threads=nt):
        if narrow:
            tile = &tiles[omp_get_thread_num() * BR * E]
        for w in prange(n_items, schedule="static"):
            u = w // q_tiles
            i0 = (w % q_tiles) * BR
            nr = Lq - i0 if Lq - i0 < BR else BR
            dst = tile if narrow else dq + (u * Lq + i0) * E
            for x in range(nr * E):
                dst[x] = 0
            for ui in range(qst[u], qst[u + 1]):
                for c in range(g.n_chunks):
                    part = dq_part + ((qu[ui] * g.n_chunks + c) * Lq + i0) * E
                    for x in range(nr * E):
                        dst[x] = dst[x] + part[x]
            if real is float:
                if narrow:
                    fa_narrow_row(dst, nr * E, <uint16_t*> dq + (u * Lq + i0) * E,
                                  g.out_kind)
    return 0


cdef unsigned char[::1] _bytes(a):
    """A gradient's buffer as bytes (a byte of its own when it is empty)."""
    return a.reshape(-1).view(np.uint8) if a.size else np.empty(1, np.uint8)
