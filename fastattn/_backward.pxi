# The parallel loops of the attention backward pass, included (after _drivers.pxi,
# whose pointer helpers and slice checks it uses) into every per-instruction-set
# driver module. FlashAttention-2 style:
#
# The probabilities are rebuilt tile by tile from the forward's log-sum-exp, never as an
# Lq x Lk matrix. Three passes, each over independent work items computed whole by one
# thread in a fixed order, so results are bit-identical for any number of threads and
# there are no atomics:
#
# 1. ``row_deltas``: delta = rowsum(dO * O) for every query row of every output slice.
# 2. ``key_value_grads``: one item per (key/value slice u, chunk c of its keys). It owns
#    dK and dV of those keys and loops, in a fixed order, over every output slice n that
#    reads slice u (several under broadcasting or grouped-query attention: ``users``) and
#    over that slice's query blocks, skipping the blocks a causal rule hides from the
#    whole chunk. For each tile it recomputes S and P = exp(S - lse), dP = dO V^T and
#    dS = P * (dP - delta), then accumulates dV += P^T dO and dK += scale dS^T Q into its
#    own rows, and writes scale * dS K, summed over the chunk's keys, as the partial dQ of
#    (n, c).
# 3. ``query_grads``: one item per (query slice p, block of query rows); dQ is the sum of
#    the partials of every output slice that reads p (``users``) and every chunk, in
#    that order.
#
# The number of key chunks depends only on the shapes (see ``fastattn._grad``), so the
# order of every sum does too.

from fastattn cimport _tiles_backward as _tb
from fastattn._tiles cimport KEY_BLOCK, real

cdef enum:
    BACKWARD_ROWS = 64      # query rows per tile and per dQ reduction item; must not
                            # exceed KEY_BLOCK (tiles and panels have KEY_BLOCK rows)


cdef inline Py_ssize_t imin(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return a if a < b else b


cdef inline void zero_rows(real* x, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t t
    for t in range(n):
        x[t] = 0


cdef inline void add_rows(const real* x, real* y, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t t
    for t in range(n):
        y[t] = y[t] + x[t]


def _check(bint ok, what):
    if not ok:
        raise ValueError(f"internal error: {what}")



def row_deltas(const real[::1] grad_out, const real[::1] out, real[::1] delta,
               Py_ssize_t rows, Py_ssize_t Ev, int num_threads):
    """delta (rows,) = rowsum(grad_out * out) over rows of Ev (summed in double)."""
    _check(grad_out.shape[0] == out.shape[0] == rows * Ev and delta.shape[0] == rows,
           "row_deltas buffers do not agree")
    if rows == 0:
        return
    cdef int nt = <int> min(num_threads, rows)
    cdef const real* gp = cptr(grad_out)
    cdef const real* op = cptr(out)
    cdef real* dp = wptr(delta)
    cdef Py_ssize_t r
    with nogil, parallel(num_threads=nt):
        for r in prange(rows, schedule="static"):
            dp[r] = <real> _tb.row_dot(gp + r * Ev, op + r * Ev, Ev)


cdef inline Py_ssize_t item_work_size(Py_ssize_t chunk_blocks, Py_ssize_t E,
                                      Py_ssize_t Ev) noexcept nogil:
    """Elements of scratch one key_value_grads item needs."""
    return (_tiles.round_up(chunk_blocks * KEY_BLOCK * E)
            + _tiles.round_up(chunk_blocks * KEY_BLOCK * Ev)
            + _tiles.round_up(BACKWARD_ROWS * E)
            + _tb.panel_size(E) + _tb.panel_size(Ev)
            + 4 * _tiles.round_up(BACKWARD_ROWS * KEY_BLOCK))


cdef void key_value_item(
        const real* q, const real* k, const real* v, const real* grad_out,
        const real* lse, const real* delta, real* dk, real* dv, real* dq_part,
        const Py_ssize_t* q_off, const Py_ssize_t* users, Py_ssize_t n_users,
        Py_ssize_t chunk, Py_ssize_t n_chunks, Py_ssize_t k0, Py_ssize_t k1,
        Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t E, Py_ssize_t Ev, real scale,
        Py_ssize_t shift,
        const unsigned char* mask, const Py_ssize_t* mask_off, Py_ssize_t mask_rs,
        Py_ssize_t mask_cs,
        const real* bias, const Py_ssize_t* bias_off, Py_ssize_t bias_rs,
        Py_ssize_t bias_cs, real* work) noexcept nogil:
    """dK, dV of keys k0..k1 of one key/value slice (k, v, dk, dv point at the slice)
    and the partial dQ of chunk `chunk` for every output slice in users[:n_users]."""
    cdef Py_ssize_t nkb = (k1 - k0 + KEY_BLOCK - 1) // KEY_BLOCK
    cdef real* kt = work
    cdef real* vt = kt + _tiles.round_up(nkb * KEY_BLOCK * E)
    cdef real* qs = vt + _tiles.round_up(nkb * KEY_BLOCK * Ev)      # scale * Q_i, panels
    cdef real* dop = qs + _tb.panel_size(E)                         # dO_i, panels
    cdef real* dqa = dop + _tb.panel_size(Ev)
    cdef real* s = dqa + _tiles.round_up(BACKWARD_ROWS * E)
    cdef real* ds = s + _tiles.round_up(BACKWARD_ROWS * KEY_BLOCK)
    cdef real* pt = ds + _tiles.round_up(BACKWARD_ROWS * KEY_BLOCK)
    cdef real* dst = pt + _tiles.round_up(BACKWARD_ROWS * KEY_BLOCK)
    cdef Py_ssize_t b, j0, bc, x, ui, n, ib, i0, nr, lim, nb, p
    cdef Py_ssize_t nqb = (Lq + BACKWARD_ROWS - 1) // BACKWARD_ROWS
    cdef const real* do_i
    cdef const real* lse_i
    cdef const real* delta_i
    cdef const unsigned char* mask_i
    cdef const real* bias_i
    cdef real* dq_out

    for b in range(nkb):
        j0 = k0 + b * KEY_BLOCK
        bc = imin(KEY_BLOCK, k1 - j0)
        _tiles.pack_keys(k + j0 * E, kt + b * KEY_BLOCK * E, bc, E)
        _tiles.pack_keys(v + j0 * Ev, vt + b * KEY_BLOCK * Ev, bc, Ev)
    for x in range(k0 * E, k1 * E):
        dk[x] = 0
    for x in range(k0 * Ev, k1 * Ev):
        dv[x] = 0

    for ui in range(n_users):
        n = users[ui]
        for ib in range(nqb):
            i0 = ib * BACKWARD_ROWS
            nr = imin(BACKWARD_ROWS, Lq - i0)
            for x in range(nr * E):
                dqa[x] = 0
            # the keys of this chunk that the block's last (most permissive) row reaches
            lim = _tiles.key_limit(i0 + nr - 1, shift, Lk)
            nb = 0 if lim <= k0 else imin(nkb, (lim - k0 + KEY_BLOCK - 1) // KEY_BLOCK)
            if nb > 0:
                _tb.pack_panels(q + q_off[n] + i0 * E, qs, nr, E, scale)
                do_i = grad_out + (n * Lq + i0) * Ev
                _tb.pack_panels(do_i, dop, nr, Ev, 1)
                lse_i = lse + n * Lq + i0
                delta_i = delta + n * Lq + i0
                mask_i = mask + mask_off[n] + i0 * mask_rs if mask != NULL else NULL
                bias_i = bias + bias_off[n] + i0 * bias_rs if bias != NULL else NULL
            for b in range(nb):
                j0 = k0 + b * KEY_BLOCK
                bc = imin(KEY_BLOCK, k1 - j0)
                _tb.product_tile(qs, kt + b * KEY_BLOCK * E, s, nr, E)
                _tiles.block_tile(s, nr, i0, j0, bc, Lk, shift, mask_i, mask_rs,
                                  mask_cs, bias_i, bias_rs, bias_cs)
                _tb.probs_tile(s, nr, lse_i)
                _tb.product_tile(dop, vt + b * KEY_BLOCK * Ev, ds, nr, Ev)
                _tb.dscores_tile(s, ds, nr, delta_i, lse_i)
                # dV_j += P^T dO_i ; dK_j += dS^T (scale Q_i) ; dQ_i += dS K_j
                _tb.transpose_tile(s, pt, nr, bc)
                _tb.transpose_tile(ds, dst, nr, bc)
                _tb.gemm_acc(pt, KEY_BLOCK, 1, do_i, Ev, dv + j0 * Ev, Ev, bc, nr, Ev)
                for p in range((E + KEY_BLOCK - 1) // KEY_BLOCK):
                    _tb.gemm_acc(dst, KEY_BLOCK, 1, qs + p * KEY_BLOCK * KEY_BLOCK,
                                 KEY_BLOCK, dk + j0 * E + p * KEY_BLOCK, E, bc, nr,
                                 imin(KEY_BLOCK, E - p * KEY_BLOCK))
                _tb.gemm_acc(ds, KEY_BLOCK, 1, k + j0 * E, E, dqa, E, nr, bc, E)
            dq_out = dq_part + ((n * n_chunks + chunk) * Lq + i0) * E
            _tb.scaled_copy(dqa, dq_out, nr * E, scale)


def key_value_grads(
        const real[::1] q, const real[::1] k, const real[::1] v,
        const real[::1] grad_out, const real[::1] lse, const real[::1] delta,
        real[::1] dk, real[::1] dv, real[::1] dq_part,
        const Py_ssize_t[::1] q_off, const Py_ssize_t[::1] users,
        const Py_ssize_t[::1] starts, Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t E,
        Py_ssize_t Ev, double scale, Py_ssize_t shift,
        const unsigned char[::1] mask, const Py_ssize_t[::1] mask_off,
        Py_ssize_t mask_rs, Py_ssize_t mask_cs,
        const real[::1] bias, const Py_ssize_t[::1] bias_off,
        Py_ssize_t bias_rs, Py_ssize_t bias_cs,
        Py_ssize_t chunk_blocks, Py_ssize_t n_chunks, int num_threads):
    """dk (U, Lk, E), dv (U, Lk, Ev) and dq_part (N, n_chunks, Lq, E).

    k, v are the U key/value slices; q, grad_out (N, Lq, Ev), lse and delta (N, Lq)
    are per output slice n, whose q slice starts at q_off[n]. users[starts[u]:
    starts[u + 1]] lists, in increasing order, the output slices that read k/v slice
    u. Keys are split into n_chunks chunks of chunk_blocks blocks of KEY_BLOCK.
    mask/bias and shift as in ``_drivers.attention``.
    """
    cdef Py_ssize_t N = q_off.shape[0]
    cdef Py_ssize_t U = starts.shape[0] - 1
    _check(U >= 0 and users.shape[0] == N, "users/starts do not agree")
    _check(starts[U] == N, "users/starts do not agree")
    _check(k.shape[0] == U * Lk * E and v.shape[0] == U * Lk * Ev
           and dk.shape[0] == U * Lk * E and dv.shape[0] == U * Lk * Ev,
           "key/value buffers do not agree")
    _check(grad_out.shape[0] == N * Lq * Ev and lse.shape[0] == N * Lq
           and delta.shape[0] == N * Lq and dq_part.shape[0] == N * n_chunks * Lq * E,
           "per-slice buffers do not agree")
    _check(n_chunks * chunk_blocks * KEY_BLOCK >= Lk
           and (n_chunks - 1) * chunk_blocks * KEY_BLOCK < Lk if n_chunks > 0
           else Lk == 0, "key chunks do not cover the keys")
    if N > 0:
        _check(np.asarray(users).min() >= 0 and np.asarray(users).max() < N,
               "users out of range")
    _check_slices(q_off, Lq * E, Lq * E - 1, q.shape[0], "q")
    cdef bint with_mask = mask.shape[0] > 0
    cdef bint with_bias = bias.shape[0] > 0
    if with_mask:
        _check_slices(mask_off, Lq * Lk, (Lq - 1) * mask_rs + (Lk - 1) * mask_cs,
                      mask.shape[0], "mask")
    if with_bias:
        _check_slices(bias_off, Lq * Lk, (Lq - 1) * bias_rs + (Lk - 1) * bias_cs,
                      bias.shape[0], "bias")

    cdef Py_ssize_t nwork = U * n_chunks
    if nwork == 0:
        return
    cdef int nt = <int> min(num_threads, nwork)
    cdef Py_ssize_t per = item_work_size(chunk_blocks, E, Ev)
    cdef real[::1] work = np.empty(max(nt * per, 1), dtype=np.asarray(dk).dtype)

    cdef const real* qp = cptr(q)
    cdef const real* kp = cptr(k)
    cdef const real* vp = cptr(v)
    cdef const real* gp = cptr(grad_out)
    cdef const real* lp = cptr(lse)
    cdef const real* dlp = cptr(delta)
    cdef real* dkp = wptr(dk)
    cdef real* dvp = wptr(dv)
    cdef real* dqp = wptr(dq_part)
    cdef const Py_ssize_t* qop = iptr(q_off)
    cdef const Py_ssize_t* up = iptr(users)
    cdef const Py_ssize_t* sp = iptr(starts)
    cdef const unsigned char* mp = bptr(mask) if with_mask else NULL
    cdef const real* bp = cptr(bias) if with_bias else NULL
    cdef const Py_ssize_t* mop = iptr(mask_off)
    cdef const Py_ssize_t* bop = iptr(bias_off)
    cdef real* wp = wptr(work)
    cdef real scale_r = <real> scale
    cdef Py_ssize_t chunk_keys = chunk_blocks * KEY_BLOCK
    cdef Py_ssize_t w, u, c, k0
    cdef real* my_work = NULL

    with nogil, parallel(num_threads=nt):
        my_work = wp + omp_get_thread_num() * per
        for w in prange(nwork, schedule="dynamic"):
            u = w // n_chunks
            c = w % n_chunks
            k0 = c * chunk_keys
            key_value_item(
                qp, kp + u * Lk * E, vp + u * Lk * Ev, gp, lp, dlp,
                dkp + u * Lk * E, dvp + u * Lk * Ev, dqp,
                qop, up + sp[u], sp[u + 1] - sp[u], c, n_chunks,
                k0, imin(Lk, k0 + chunk_keys), Lq, Lk, E, Ev, scale_r, shift,
                mp, mop, mask_rs, mask_cs, bp, bop, bias_rs, bias_cs, my_work)


def query_grads(const real[::1] dq_part, real[::1] dq, const Py_ssize_t[::1] users,
                const Py_ssize_t[::1] starts, Py_ssize_t Lq, Py_ssize_t E,
                Py_ssize_t n_chunks, int num_threads):
    """dq (P, Lq, E): for query slice p, the sum over the output slices n in
    users[starts[p]:starts[p + 1]] (in that order) and over the chunks of
    dq_part (N, n_chunks, Lq, E)."""
    cdef Py_ssize_t N = users.shape[0]
    cdef Py_ssize_t P = starts.shape[0] - 1
    _check(P >= 0, "users/starts do not agree")
    _check(starts[P] == N, "users/starts do not agree")
    _check(dq.shape[0] == P * Lq * E and dq_part.shape[0] == N * n_chunks * Lq * E,
           "dq buffers do not agree")
    if N > 0:
        _check(np.asarray(users).min() >= 0 and np.asarray(users).max() < N,
               "users out of range")
    cdef Py_ssize_t nqb = (Lq + BACKWARD_ROWS - 1) // BACKWARD_ROWS
    cdef Py_ssize_t nwork = P * nqb
    if nwork == 0 or E == 0:
        return
    cdef int nt = <int> min(num_threads, nwork)
    cdef const real* src = cptr(dq_part)
    cdef real* dst = wptr(dq)
    cdef const Py_ssize_t* up = iptr(users)
    cdef const Py_ssize_t* sp = iptr(starts)
    cdef Py_ssize_t w, p, i0, nr, ui, c
    cdef real* out = NULL
    cdef const real* part = NULL
    with nogil, parallel(num_threads=nt):
        for w in prange(nwork, schedule="static"):
            p = w // nqb
            i0 = (w % nqb) * BACKWARD_ROWS
            nr = imin(BACKWARD_ROWS, Lq - i0)
            out = dst + (p * Lq + i0) * E
            zero_rows(out, nr * E)
            for ui in range(sp[p], sp[p + 1]):
                for c in range(n_chunks):
                    part = src + ((up[ui] * n_chunks + c) * Lq + i0) * E
                    add_rows(part, out, nr * E)
