# The C helpers of fastattn/src/ as the kernels call them: one declaration each.
#
# Each header compiles to the best the including module's instruction set allows, and
# says with a FA_HAVE_* flag whether it has its fast kernel there (elsewhere it holds
# stubs that are never called). Pointers to 32-bit words of bfloat16 pairs are passed
# as void*.

from libc.stdint cimport int8_t, uint16_t

from fastattn._plan cimport DType

cdef extern from "fa_exp.h":
    float fa_expf(float x) noexcept nogil
    double fa_exp(double x) noexcept nogil
    double fa_tanh(double x) noexcept nogil

cdef extern from "fa_half.h":
    void fa_widen_rows(const void* src, DType kind, Py_ssize_t src_rs, Py_ssize_t rows,
                       Py_ssize_t cols, float* dst) noexcept nogil
    float fa_widen(const void* src, DType kind, Py_ssize_t index) noexcept nogil
    void fa_narrow_row(const float* s, Py_ssize_t n, uint16_t* d,
                       DType kind) noexcept nogil
    bint fa_bf16_words_in_range(const uint16_t* h, Py_ssize_t n,
                                Py_ssize_t safe_exp) noexcept nogil

cdef extern from "fa_codes.h":
    # 8-bit codes of quantized caches (kind: INT8, FLOAT8_E4M3, FLOAT8_E5M2)
    float fa_widen_code(const void* src, DType kind, Py_ssize_t index) noexcept nogil
    void fa_widen_codes(const void* src, DType kind, Py_ssize_t src_rb, Py_ssize_t rows,
                        Py_ssize_t cols, const float* scale, Py_ssize_t scale_rs,
                        float* dst) noexcept nogil
    # the decode kernels read e4m3 codes in these units, NaN codes not told apart
    const float FA_E4M3_UNIT
    bint fa_e4m3_nan(const void* p, Py_ssize_t n) noexcept nogil

cdef extern from "fa_transpose.h":
    # 32-bit words (float32 or bfloat16 pairs), passed as void*
    void fa_transpose32(const void* src, Py_ssize_t src_rs, Py_ssize_t rows,
                        Py_ssize_t cols, void* dst, Py_ssize_t dst_rs,
                        Py_ssize_t dst_cols, const float* scale,
                        Py_ssize_t scale_step) noexcept nogil

cdef extern from "fa_dots.h":
    bint FA_HAVE_DOTS                   # this module has fa_dots, fa_pv (AVX-512, AVX2)
    const Py_ssize_t FA_PREFETCH_BYTES  # how far ahead they ask for rows
    # where a stream's rows lie: base + c * stride bytes, or rows[c] (a table)
    ctypedef struct fa_rows_t:
        const char* base
        Py_ssize_t stride
        const char** rows
        Py_ssize_t ahead    # rows the kernels ask for ahead (0: their default)
    # k, v: float32, bfloat16, float16 or 8-bit code rows (kind: their DType), read
    # in place (codes: without their scales); fa_pv with `add` carries on out's sums
    void fa_dots(const float* q, Py_ssize_t q_rs, Py_ssize_t R, fa_rows_t k, DType kind,
                 Py_ssize_t C, Py_ssize_t E, float* s, Py_ssize_t s_rs,
                 Py_ssize_t limit) noexcept nogil
    # fa_dots for several heads side by side in each key row (a token-major cache)
    ctypedef struct fa_heads_t:
        Py_ssize_t n, q, s, bytes
    void fa_dots_heads(const float* q, Py_ssize_t q_rs, Py_ssize_t R, fa_rows_t k,
                       DType kind, Py_ssize_t C, Py_ssize_t E, float* s,
                       Py_ssize_t s_rs, Py_ssize_t limit, fa_heads_t heads) noexcept nogil
    void fa_pv(const float* w, Py_ssize_t w_rs, Py_ssize_t R, fa_rows_t v, DType kind,
               Py_ssize_t C, Py_ssize_t Ev, float* out, Py_ssize_t out_rs, bint add,
               Py_ssize_t limit) noexcept nogil

cdef extern from "fa_bf16.h":
    bint FA_HAVE_AVX512_BF16            # this module has the kernel
    # qp: 32-bit words (bfloat16 pairs), passed as void*
    void fa_bf16_pack_queries(const uint16_t* q, Py_ssize_t q_rs, Py_ssize_t nrows,
                              Py_ssize_t E, void* qp) noexcept nogil
    void fa_bf16_scores(const uint16_t* k, Py_ssize_t k_rs, Py_ssize_t bc,
                        const void* qp, Py_ssize_t E2, float alpha,
                        float* st) noexcept nogil
    # the backward's gradient products (bp: 32-bit words, bfloat16 pairs of rows)
    void fa_bf16_product(const uint16_t* a, Py_ssize_t a_rs, Py_ssize_t M,
                         const void* bp, Py_ssize_t bp_rs, Py_ssize_t K2, Py_ssize_t N,
                         float alpha, float* c, Py_ssize_t ldc,
                         bint accumulate) noexcept nogil
    void fa_bf16_pair_rows(const uint16_t* x, Py_ssize_t x_rs, Py_ssize_t nrows,
                           Py_ssize_t N, void* bp) noexcept nogil
    void fa_bf16_transpose_keys(const uint16_t* k, Py_ssize_t k_rs, Py_ssize_t nkeys,
                                Py_ssize_t E, uint16_t* kt, Py_ssize_t kt_rs) noexcept nogil
    void fa_bf16_round_tile(const float* st, Py_ssize_t bc, uint16_t* a) noexcept nogil
    void fa_bf16_narrow_row(const float* s, Py_ssize_t n, uint16_t* d) noexcept nogil
    # vt, pp: 32-bit words (bfloat16 pairs), passed as void*
    bint fa_bf16_pack_values(const uint16_t* v, Py_ssize_t v_rs, Py_ssize_t bc,
                             Py_ssize_t Ev, void* vt) noexcept nogil
    void fa_bf16_pack_weights(const float* st, Py_ssize_t bc, Py_ssize_t nr, void* pp,
                              void* pl) noexcept nogil
    void fa_block_max_unscaled(const float* st, Py_ssize_t bc, Py_ssize_t nr,
                               float scale, float* m, float* m_sub,
                               float* alpha) noexcept nogil
    void fa_bf16_weight_pairs(const float* st, Py_ssize_t bc, Py_ssize_t nr, float scale,
                              const float* m_sub, const float* alpha, double* l,
                              void* pp) noexcept nogil
    void fa_bf16_pv(const void* vt, Py_ssize_t bc, Py_ssize_t Ev, const void* pp,
                    Py_ssize_t nr, float* acc, bint first,
                    const float* alpha) noexcept nogil

cdef extern from "fa_amx.h":
    bint FA_HAVE_AMX_BF16               # this module has the AMX kernels
    # qp, pp, vt: 32-bit words (bfloat16 pairs), passed as void*
    void fa_amx_begin() noexcept nogil
    void fa_amx_end() noexcept nogil
    void fa_amx_scores(const uint16_t* k, Py_ssize_t k_rs, Py_ssize_t bc, const void* qp,
                       Py_ssize_t E, Py_ssize_t nr, float alpha, float* st) noexcept nogil
    void fa_amx_pv(const void* vt, Py_ssize_t bc, Py_ssize_t Ev, const void* pp,
                   const void* pl, Py_ssize_t nr, float* acc, bint first) noexcept nogil
    # int8 key codes' scores (the decode path), exact: see fa_amx.h
    ctypedef struct fa_code_limbs_t:
        pass
    Py_ssize_t fa_code_sets(Py_ssize_t R) noexcept nogil    # sets of limbs for R rows
    bint fa_amx_code_limbs(const float* q, Py_ssize_t heads, Py_ssize_t R, Py_ssize_t E,
                           double scale, fa_code_limbs_t* lb) noexcept nogil
    void fa_amx_code_heads(fa_rows_t k, Py_ssize_t heads, Py_ssize_t bytes,
                           Py_ssize_t C, Py_ssize_t E, const fa_code_limbs_t* lb,
                           Py_ssize_t R, float* s, Py_ssize_t s_rs, int8_t* buf,
                           Py_ssize_t pf, Py_ssize_t pf_bytes,
                           Py_ssize_t limit) noexcept nogil
    # int8 value codes' product (the decode path), weights rounded to bfloat16
    Py_ssize_t fa_code_values_bytes(Py_ssize_t C) noexcept nogil    # its scratch
    bint fa_amx_code_values(const float* w, Py_ssize_t w_rs, Py_ssize_t R, fa_rows_t v,
                            Py_ssize_t C, Py_ssize_t Ev, float* out, Py_ssize_t out_rs,
                            void* scratch, Py_ssize_t pf, Py_ssize_t pf_bytes,
                            Py_ssize_t limit) noexcept nogil

cdef extern from "fa_pairs.h":
    # float8 codes (e4m3, e5m2) against bfloat16 queries on vdpbf16ps (the
    # decode path): see fa_pairs.h; qp: bfloat16 words, wp: 32-bit words (pairs)
    bint FA_HAVE_PAIRS                  # this module has the kernels
    bint fa_pairs_usable() noexcept nogil       # ... and this CPU runs them
    Py_ssize_t fa_pair_row_words(Py_ssize_t E) noexcept nogil
    bint fa_pair_queries(const float* q, Py_ssize_t q_rs, Py_ssize_t R, Py_ssize_t E,
                         double scale, uint16_t* qp, float* f) noexcept nogil
    void fa_pair_dots(const uint16_t* qp, Py_ssize_t R, fa_rows_t k, DType kind,
                      Py_ssize_t C, Py_ssize_t E, const float* f, float* s,
                      Py_ssize_t s_rs, Py_ssize_t limit, fa_heads_t heads) noexcept nogil
    bint fa_pair_weights(const float* w, Py_ssize_t w_rs, Py_ssize_t R, Py_ssize_t C,
                         void* wp, Py_ssize_t wp_rs) noexcept nogil
    void fa_pair_pv(const void* wp, Py_ssize_t wp_rs, Py_ssize_t R, fa_rows_t v,
                    DType kind, Py_ssize_t C, Py_ssize_t Ev, float* out,
                    Py_ssize_t out_rs, bint add, Py_ssize_t limit) noexcept nogil

cdef extern from "fa_softmax.h":
    bint FA_HAVE_BLOCK_SOFTMAX          # this module has them (AVX-512, AVX2)
    float fa_row_max(const float* x, Py_ssize_t n) noexcept nogil
    void fa_block_max(float* st, Py_ssize_t bc, Py_ssize_t nr, float scale, float* m,
                      float* m_sub, float* alpha) noexcept nogil
    void fa_block_exp(float* st, Py_ssize_t bc, Py_ssize_t nr, const float* m_sub,
                      const float* alpha, double* l) noexcept nogil

cdef extern from "fa_prefetch.h":
    void fa_prefetch_rows_to(const void* p, Py_ssize_t rows, Py_ssize_t bytes,
                             Py_ssize_t stride, bint near) noexcept nogil
    void fa_prefetch_span(const void* p, Py_ssize_t bytes) noexcept nogil

cdef extern from "philox.h":
    # counters are 32 and 64 bits by design (the C header converts)
    void fastattn_dropout_keep4(unsigned long long dropout_seed, Py_ssize_t slice_index,
                                Py_ssize_t row, Py_ssize_t key_group,
                                unsigned int dropout_threshold,
                                unsigned char keep[4]) noexcept nogil
    bint fastattn_dropout_keep(unsigned long long dropout_seed, Py_ssize_t slice_index,
                               Py_ssize_t row, Py_ssize_t key,
                               unsigned int dropout_threshold) noexcept nogil
