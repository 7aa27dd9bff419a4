# fastattn's public C-level API, for other Cython code:
#
#     from fastattn cimport kernels
#     kernels.attention_slice(q, k, v, out, lse, Lq, Lk, E, Ev, scale, kernels.CAUSAL_NONE)
#
# Every function is serial, takes row-major (C-contiguous) buffers as raw pointers plus
# sizes, holds no lock and never touches Python objects: call it from your own `nogil`
# code and your own `prange` loops. Each exists for float and for double (the fused
# type below; its member order, float then double, is part of the ABI).
#
# Stability: this file has no cimports; a released signature never changes (a new
# need gets a new function); functions are only added at the end.

ctypedef fused floating:
    float
    double

cdef enum:
    CAUSAL_NONE = 0          # every key
    CAUSAL_TOP_LEFT = 1      # query i sees keys j <= i
    CAUSAL_BOTTOM_RIGHT = 2  # query i sees keys j <= i + (Lk - Lq)

# s (m, n) = scale * q (m, e) @ k (n, e)^T: the dot products of every query with every key.
cdef void dot_scores(const floating* q, const floating* k, floating* s, Py_ssize_t m,
                     Py_ssize_t n, Py_ssize_t e, floating scale) noexcept nogil

# y (m, n) = softmax of each row of x (m, n), max-subtracted; a row of all -inf gives
# zeros. x and y may be the same buffer.
cdef void softmax_rows(const floating* x, floating* y, Py_ssize_t m,
                       Py_ssize_t n) noexcept nogil

# out (m, ev) = p (m, n) @ v (n, ev): the weighted sum of the value rows.
cdef void weighted_sum(const floating* p, const floating* v, floating* out, Py_ssize_t m,
                       Py_ssize_t n, Py_ssize_t ev) noexcept nogil

# Fused attention of one (batch, head) slice: out (Lq, Ev) = softmax(scale * q k^T) v,
# with q (Lq, E), k (Lk, E), v (Lk, Ev), and lse (Lq) = log-sum-exp of each row's
# scores (lse may be NULL). causal is one of the CAUSAL_* values. The score matrix is
# never formed: scratch is O(E * 64 + Ev) per 64 query rows, allocated here.
# Returns 0; -1 when that scratch could not be allocated, -2 for an unknown causal
# value (out is then untouched).
cdef int attention_slice(const floating* q, const floating* k, const floating* v,
                         floating* out, floating* lse, Py_ssize_t Lq, Py_ssize_t Lk,
                         Py_ssize_t E, Py_ssize_t Ev, floating scale,
                         int causal) noexcept nogil

# --- added in 0.2: the same three kernels with their sizes checked --------------------
#
# Each returns 0, or ERROR_BAD_SIZE (and writes nothing) when a size is negative or a
# buffer size (m * n, m * e, n * e, n * ev, m * ev) does not fit in a Py_ssize_t.
# attention_slice returns ERROR_BAD_SIZE in the same cases.

cdef enum:
    ERROR_NO_MEMORY = -1
    ERROR_BAD_CAUSAL = -2
    ERROR_BAD_SIZE = -3

cdef int dot_scores_checked(const floating* q, const floating* k, floating* s,
                            Py_ssize_t m, Py_ssize_t n, Py_ssize_t e,
                            floating scale) noexcept nogil

cdef int softmax_rows_checked(const floating* x, floating* y, Py_ssize_t m,
                              Py_ssize_t n) noexcept nogil

cdef int weighted_sum_checked(const floating* p, const floating* v, floating* out,
                              Py_ssize_t m, Py_ssize_t n, Py_ssize_t ev) noexcept nogil

# attention_slice with the attention variants of fastattn.attention (see the README's
# "Attention variants"), for one slice. Positions: key j sits at j, query i at i + d,
# d = kv_len - q_len for CAUSAL_BOTTOM_RIGHT (q_len, kv_len: the lengths below), else 0.
#   mask (Lq, Lk) or NULL: nonzero where query i may attend to key j
#   bias (Lq, Lk) or NULL: added to the (softcapped) scaled scores
#   window_left, window_right: query i attends only keys i + d - left <= j <= i + d + right;
#     WINDOW_UNBOUNDED (-1) for no limit on that side
#   softcap: c > 0 makes the scaled scores c * tanh(scores / c) (before the bias); 0: none
#   alibi_slope: -slope * |i + d - j| is added to the scores; 0: none
#   q_length, kv_length: rows i >= q_length are zeros (lse -inf), keys j >= kv_length
#     are never attended; LENGTH_ALL (-1) for Lq / Lk
#   dropout_p in [0, 1) with dropout_seed and slice_index: each weight is dropped with
#     probability dropout_p, the others scaled by 1 / (1 - dropout_p), drawn as
#     fastattn.attention draws slice slice_index (the C-order index of the slice in its
#     batch) with that seed; lse is that of the weights before dropout. 0: none
# Returns what attention_slice returns, or ERROR_BAD_ARGUMENT (nothing read or written)
# for a window side or length below -1, a length above Lq / Lk, a softcap negative or
# not finite, an alibi_slope not finite, dropout_p outside [0, 1) or a negative
# slice_index. With every variant absent it computes what attention_slice computes.

cdef enum:
    ERROR_BAD_ARGUMENT = -4
    WINDOW_UNBOUNDED = -1
    LENGTH_ALL = -1

cdef int attention_slice_variants(const floating* q, const floating* k,
                                  const floating* v, floating* out, floating* lse,
                                  Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t E,
                                  Py_ssize_t Ev, floating scale, int causal,
                                  const unsigned char* mask, const floating* bias,
                                  Py_ssize_t window_left, Py_ssize_t window_right,
                                  double softcap, double alibi_slope,
                                  Py_ssize_t q_length, Py_ssize_t kv_length,
                                  double dropout_p, unsigned long long dropout_seed,
                                  Py_ssize_t slice_index) noexcept nogil

# --- added in 0.3: attention sinks ----------------------------------------------------
#
# attention_slice_variants with one more variant, sink: an extra logit that joins every
# row's softmax and carries no value (gpt-oss's attention sinks): the weights become
# exp(s_ij) / (sum_j' exp(s_ij') + exp(sink)), lse includes it (a row with no allowed
# key gives zeros and lse = sink; rows i >= q_length stay zeros, lse -inf). The sink is
# applied after every other variant and is never masked, capped, scaled or dropped.
# -INFINITY: none (what attention_slice_variants computes). Returns what
# attention_slice_variants returns; ERROR_BAD_ARGUMENT also for a NaN or +inf sink.
# (Both functions return 0 at once when there is nothing to write: Lq == 0, or Ev == 0
# with lse NULL.)

cdef int attention_slice_sinks(const floating* q, const floating* k,
                               const floating* v, floating* out, floating* lse,
                               Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t E,
                               Py_ssize_t Ev, floating scale, int causal,
                               const unsigned char* mask, const floating* bias,
                               Py_ssize_t window_left, Py_ssize_t window_right,
                               double softcap, double alibi_slope, double sink,
                               Py_ssize_t q_length, Py_ssize_t kv_length,
                               double dropout_p, unsigned long long dropout_seed,
                               Py_ssize_t slice_index) noexcept nogil
