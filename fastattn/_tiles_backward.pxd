# The arithmetic of the attention backward pass on tiles, for float and double.
#
# Like _tiles.pxd, every function is `cdef inline ... noexcept nogil` and takes (plan,
# work item, scratch); nothing allocates or knows about threads. The probabilities are
# rebuilt tile by tile from the forward's log-sum-exp, and the three gradient products
#
#     dV_j += P^T dO_i,    dK_j += dS^T (scale·Q_i),    dQ_i += dS K_j
#
# and the two score-like products S = (scale·Q_i) K_j^T and dP = dO_i V_j^T go through
# the one micro-GEMM (_gemm.pxd). A tile holds query rows i (at most BACKWARD_ROWS)
# against the KEY_BLOCK keys of block j, with row stride KEY_BLOCK.

from libc.math cimport INFINITY

from fastattn._gemm cimport gemm, real
from fastattn._parallel cimport Interrupt, interrupted
from fastattn._plan cimport KEY_BLOCK, KeyRange, Plan, tile_keys
from fastattn cimport _tiles

cdef enum:
    BACKWARD_ROWS = 64      # query rows per tile and per dQ reduction item; must not
                            # exceed KEY_BLOCK (transposed tiles have KEY_BLOCK rows)


cdef struct Gradients:
    # Every buffer C-contiguous, in the computation dtype (N output slices, U key/value
    # slices, n_chunks key chunks):
    const void* grad_out    # (N, Lq, Ev)
    const void* delta       # (N, Lq): rowsum(grad_out * out)
    void* dq_part           # (N, n_chunks, Lq, E): dQ of each output slice, per chunk
    void* dk                # (U, Lk, E)
    void* dv                # (U, Lk, Ev)
    Py_ssize_t n_chunks
    Py_ssize_t chunk_keys   # keys per chunk (a multiple of KEY_BLOCK)


cdef inline double row_dot(const real* x, const real* y, Py_ssize_t n) noexcept nogil:
    """sum_t x[t] * y[t], accumulated in double."""
    cdef Py_ssize_t t
    cdef double total = 0
    for t in range(n):
        total += <double> x[t] * <double> y[t]
    return total


cdef inline void pack_transposed(const real* x, Py_ssize_t x_rs, Py_ssize_t rows,
                                 Py_ssize_t cols, real* xt) noexcept nogil:
    """xt (cols, KEY_BLOCK) = x[:rows]^T, zero-padded to KEY_BLOCK columns: K_j^T or
    V_j^T, so that the score-like products read it with unit stride."""
    cdef Py_ssize_t c, t
    for t in range(cols):
        for c in range(rows):
            xt[t * KEY_BLOCK + c] = x[c * x_rs + t]
        for c in range(rows, KEY_BLOCK):
            xt[t * KEY_BLOCK + c] = 0


cdef inline void probs_tile(real* s, Py_ssize_t nrows, const real* lse,
                            Py_ssize_t lse_rs) noexcept nogil:
    """s (nrows, KEY_BLOCK) = exp(s - lse[r]) in place: the softmax probabilities
    rebuilt from the forward's log-sum-exp. A row with lse = -inf (no allowed key)
    becomes zeros, whatever its scores. The exp runs as one flat loop over the whole
    tile (the shape in which a compiler vectorises it)."""
    cdef Py_ssize_t r, c, x
    cdef real shift
    cdef real* srow
    for r in range(nrows):
        srow = s + r * KEY_BLOCK
        shift = lse[r * lse_rs] if lse[r * lse_rs] != -INFINITY else 0
        for c in range(KEY_BLOCK):
            srow[c] = srow[c] - shift
    for x in range(nrows * KEY_BLOCK):
        s[x] = _tiles.exp_(s[x])
    for r in range(nrows):
        if lse[r * lse_rs] == -INFINITY:
            srow = s + r * KEY_BLOCK
            for c in range(KEY_BLOCK):
                srow[c] = 0


cdef inline void dscores_tile(const real* p, real* dp, Py_ssize_t nrows,
                              const real* delta, const real* lse,
                              Py_ssize_t lse_rs) noexcept nogil:
    """dp (nrows, KEY_BLOCK) = p * (dp - delta[r]) in place: the gradient of the
    scores; rows with lse = -inf (no allowed key) become zeros."""
    cdef Py_ssize_t r, c
    cdef real d
    cdef real* drow
    cdef const real* prow
    for r in range(nrows):
        drow = dp + r * KEY_BLOCK
        if lse[r * lse_rs] == -INFINITY:
            for c in range(KEY_BLOCK):
                drow[c] = 0
        else:
            prow = p + r * KEY_BLOCK
            d = delta[r]
            for c in range(KEY_BLOCK):
                drow[c] = prow[c] * (drow[c] - d)


cdef inline void transpose_tile(const real* s, real* st, Py_ssize_t nrows,
                                Py_ssize_t ncols) noexcept nogil:
    """st[c, r] = s[r, c] for r < nrows, c < ncols; both with row stride KEY_BLOCK.

    The gradient products then read P^T and dS^T with unit stride along the summed
    axis, the access pattern the micro-GEMM keeps in registers."""
    cdef Py_ssize_t r, c
    for c in range(ncols):
        for r in range(nrows):
            st[c * KEY_BLOCK + r] = s[r * KEY_BLOCK + c]


cdef inline Py_ssize_t key_value_work_size(const Plan* p,
                                           Py_ssize_t chunk_keys) noexcept nogil:
    """Elements of scratch key_value_item needs, term by term."""
    cdef Py_ssize_t R = _tiles.round_up(BACKWARD_ROWS * KEY_BLOCK)
    return (_tiles.round_up(chunk_keys * p.E)       # kt: K_j^T of every block
            + _tiles.round_up(chunk_keys * p.Ev)    # vt: V_j^T of every block
            + _tiles.round_up(BACKWARD_ROWS * p.E)  # qs: scale * Q_i
            + _tiles.round_up(BACKWARD_ROWS * p.E)  # dqa: dQ_i over this chunk
            + 6 * R)                                # s, ds, pt, dst, dcap, zs


cdef inline void clear_chunk(const Plan* p, const Gradients* g, Py_ssize_t u,
                             Py_ssize_t chunk, real* like) noexcept nogil:
    """dK, dV of the keys of chunk `chunk` of key/value slice u = 0 (no output reads
    the slice)."""
    cdef Py_ssize_t k0 = chunk * g.chunk_keys
    cdef Py_ssize_t k1 = k0 + g.chunk_keys if k0 + g.chunk_keys < p.Lk else p.Lk
    cdef real* dk = <real*> g.dk + u * p.Lk * p.E
    cdef real* dv = <real*> g.dv + u * p.Lk * p.Ev
    cdef Py_ssize_t x
    for x in range(k0 * p.E, k1 * p.E):
        dk[x] = 0
    for x in range(k0 * p.Ev, k1 * p.Ev):
        dv[x] = 0


cdef inline void key_value_item(const Plan* p, const Gradients* g, Py_ssize_t u,
                                Py_ssize_t chunk, const Py_ssize_t* users,
                                Py_ssize_t n_users, real* work,
                                Interrupt* stop) noexcept nogil:
    """dK, dV of the keys of chunk `chunk` of key/value slice u, and the partial dQ of
    that chunk for every output slice in users[:n_users] (the slices that read u, in
    increasing order; users[0] locates k and v). Scratch: key_value_work_size().

    An item covers every query row, which can take a long time: it looks for Ctrl-C
    (``interrupted(stop)``) between query tiles and returns unfinished once one is
    pending (the driver then raises; nothing it wrote is used)."""
    cdef Py_ssize_t E = p.E, Ev = p.Ev, Lq = p.Lq
    cdef Py_ssize_t k0 = chunk * g.chunk_keys
    cdef Py_ssize_t k1 = k0 + g.chunk_keys if k0 + g.chunk_keys < p.Lk else p.Lk
    cdef Py_ssize_t nkb = (k1 - k0 + KEY_BLOCK - 1) // KEY_BLOCK
    cdef real* kt = work
    cdef real* vt = kt + _tiles.round_up(g.chunk_keys * E)
    cdef real* qs = vt + _tiles.round_up(g.chunk_keys * Ev)
    cdef real* dqa = qs + _tiles.round_up(BACKWARD_ROWS * E)
    cdef real* s = dqa + _tiles.round_up(BACKWARD_ROWS * E)
    cdef real* ds = s + _tiles.round_up(BACKWARD_ROWS * KEY_BLOCK)
    cdef real* pt = ds + _tiles.round_up(BACKWARD_ROWS * KEY_BLOCK)
    cdef real* dst = pt + _tiles.round_up(BACKWARD_ROWS * KEY_BLOCK)
    cdef const real* k = _tiles.k_rows(p, users[0], work)
    cdef const real* v = _tiles.v_rows(p, users[0], work)
    cdef real* dk = <real*> g.dk + u * p.Lk * E
    cdef real* dv = <real*> g.dv + u * p.Lk * Ev
    cdef Py_ssize_t k_rs = p.k.row_stride, v_rs = p.v.row_stride
    cdef Py_ssize_t nqb = (Lq + BACKWARD_ROWS - 1) // BACKWARD_ROWS
    cdef Py_ssize_t b, b_first, b_end, j0, bc, x, ui, n, ib, i0, nr, r, t, lo, hi
    cdef real scale = <real> p.scale
    cdef const real* q
    cdef const real* do_i
    cdef const real* lse_i
    cdef const real* delta_i
    cdef const unsigned char* mask_i
    cdef const real* bias_i
    cdef real* dq_out
    cdef KeyRange keys
    cdef real* dcap = dst + _tiles.round_up(BACKWARD_ROWS * KEY_BLOCK)
    cdef bint capped = p.softcap > 0
    cdef real* zs = dcap + _tiles.round_up(BACKWARD_ROWS * KEY_BLOCK)
    cdef bint dropped = p.dropout_p > 0

    for b in range(nkb):
        j0 = k0 + b * KEY_BLOCK
        bc = KEY_BLOCK if k1 - j0 > KEY_BLOCK else k1 - j0
        pack_transposed(k + j0 * k_rs, k_rs, bc, E, kt + b * KEY_BLOCK * E)
        pack_transposed(v + j0 * v_rs, v_rs, bc, Ev, vt + b * KEY_BLOCK * Ev)
    for x in range(k0 * E, k1 * E):
        dk[x] = 0
    for x in range(k0 * Ev, k1 * Ev):
        dv[x] = 0

    for ui in range(n_users):
        n = users[ui]
        for ib in range(nqb):
            if interrupted(stop):
                return
            i0 = ib * BACKWARD_ROWS
            nr = BACKWARD_ROWS if Lq - i0 > BACKWARD_ROWS else Lq - i0
            for x in range(nr * E):
                dqa[x] = 0
            # the blocks of this chunk that some row of the tile may attend to
            keys = tile_keys(p, n, i0, nr)
            lo, hi = keys.lo, keys.hi
            lo = k0 if lo < k0 else lo
            hi = k1 if hi > k1 else hi
            b_first = (lo - k0) // KEY_BLOCK
            b_end = (hi - k0 + KEY_BLOCK - 1) // KEY_BLOCK if hi > lo else b_first
            if b_end > b_first:
                q = _tiles.q_rows(p, n, i0, work)
                for r in range(nr):
                    for t in range(E):
                        qs[r * E + t] = q[r * p.q.row_stride + t] * scale
                do_i = <const real*> g.grad_out + (n * Lq + i0) * Ev
                lse_i = _tiles.lse_rows(p, n, i0, work)
                delta_i = <const real*> g.delta + n * Lq + i0
                mask_i = _tiles.mask_rows(p, n, i0)
                bias_i = _tiles.bias_rows(p, n, i0, work)
            for b in range(b_first, b_end):
                j0 = k0 + b * KEY_BLOCK
                bc = KEY_BLOCK if k1 - j0 > KEY_BLOCK else k1 - j0
                # S = (scale Q_i) K_j^T, the rules, P = exp(S - lse); dP = dO_i V_j^T
                gemm(qs, E, 1, kt + b * KEY_BLOCK * E, KEY_BLOCK, s, KEY_BLOCK,
                     nr, KEY_BLOCK, E, False)
                _tiles.apply_rules(s, KEY_BLOCK, 1, p, n, nr, i0, j0, bc, KEY_BLOCK,
                                   mask_i, bias_i, dcap if capped else NULL)
                probs_tile(s, nr, lse_i, p.lse.row_stride)
                gemm(do_i, Ev, 1, vt + b * KEY_BLOCK * Ev, KEY_BLOCK, ds, KEY_BLOCK,
                     nr, KEY_BLOCK, Ev, False)
                if dropped:
                    # O used P Z (Z: 0 or 1 / (1 - p)): dP is dO V^T Z, and dV takes P Z
                    for x in range(nr * KEY_BLOCK):
                        zs[x] = 1
                    _tiles.dropout_tile(p, n, zs, KEY_BLOCK, 1, nr, i0, j0, KEY_BLOCK)
                    for x in range(nr * KEY_BLOCK):
                        ds[x] = ds[x] * zs[x]
                dscores_tile(s, ds, nr, delta_i, lse_i, p.lse.row_stride)
                if capped:          # through the softcap: times 1 - tanh^2
                    for x in range(nr * KEY_BLOCK):
                        ds[x] = ds[x] * dcap[x]
                # dV_j += (P Z)^T dO_i ; dK_j += dS^T (scale Q_i) ; dQ_i += dS K_j
                if dropped:
                    for x in range(nr * KEY_BLOCK):
                        zs[x] = s[x] * zs[x]
                    transpose_tile(zs, pt, nr, bc)
                else:
                    transpose_tile(s, pt, nr, bc)
                transpose_tile(ds, dst, nr, bc)
                gemm(pt, KEY_BLOCK, 1, do_i, Ev, dv + j0 * Ev, Ev, bc, Ev, nr, True)
                gemm(dst, KEY_BLOCK, 1, qs, E, dk + j0 * E, E, bc, E, nr, True)
                gemm(ds, KEY_BLOCK, 1, k + j0 * k_rs, k_rs, dqa, E, nr, E, bc, True)
            dq_out = <real*> g.dq_part + ((n * g.n_chunks + chunk) * Lq + i0) * E
            for x in range(nr * E):
                dq_out[x] = dqa[x] * scale
