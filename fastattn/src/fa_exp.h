/* exp for the kernels of fastattn: branch-free, so that a loop of it vectorises on any
   instruction set without -ffast-math.

   exp(x) by range reduction x = n ln2 + r, |r| <= ln2/2, a polynomial for e^r (Cephes'
   degree 5 for float, Taylor degree 13 for double; both within ~1 ulp) and 2^n as the
   product of two powers of two built in the exponent bits (each normal for every n).
   exp(-inf) = 0, exp(NaN) = NaN, +inf above the overflow limit. A result below the
   smallest normal number of the type (FLT_MIN, DBL_MIN) is 0: that is the kernels'
   rule for a weight that underflows (a key whose weight exp(s - max) is below it
   counts as weight 0, and a NaN or inf in its value does not reach the row). */
#ifndef FASTATTN_FA_EXP_H
#define FASTATTN_FA_EXP_H

#include <float.h>
#include <math.h>
#include <stdint.h>

static inline float fa_expf(float x) {
    union { float f; int32_t i; } t, s1, s2, m;
    float xc, n, r, p, e;
    int32_t k, k1;
    xc = x < -88.0f ? -88.0f : x;                /* (below FLT_MIN) NaN passes both */
    xc = xc > 88.72283f ? 88.72283f : xc;
    m.f = 12582912.0f;                           /* 1.5 * 2^23: round to integer */
    t.f = xc * 1.44269504088896341f + m.f;
    n = t.f - m.f;
    r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    k = t.i - m.i;                               /* n, in [-127, 128] */
    k1 = k >> 1;
    s1.i = (k1 + 127) << 23;                     /* 2^(n/2), 2^(n - n/2): normal */
    s2.i = (k - k1 + 127) << 23;
    e = p * s1.f * s2.f;
    e = e < FLT_MIN ? 0.0f : e;
    return x > 88.72283f ? (float)INFINITY : e;
}

/* The double exp's argument reduction: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two
   parts, the first exact in a product with n); *n gets n. x must lie in
   [-709, 709.79]. */
static inline double fa_exp_reduce(double x, int64_t* n) {
    union { double f; int64_t i; } t, m;
    double nf, r;
    m.f = 6755399441055744.0;                    /* 1.5 * 2^52 */
    t.f = x * 1.4426950408889634 + m.f;
    nf = t.f - m.f;
    r = x - nf * 0.693145751953125;
    r = r - nf * 1.42860682030941723212e-6;
    *n = t.i - m.i;
    return r;
}

/* (e^r - 1 - r) / r^2 for |r| <= ln2 / 2 but for its last two Taylor steps: the
   terms from r^12 / 12! down to 1 / 2!, in Horner's order. */
static inline double fa_exp_series(double r) {
    double p = 1.0 / 6227020800.0;
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    return p * r + 0.5;
}

static inline double fa_exp(double x) {
    union { double f; int64_t i; } s1, s2;
    double xc, r, p, e;
    int64_t k, k1;
    xc = x < -709.0 ? -709.0 : x;                /* (below DBL_MIN) */
    xc = xc > 709.782712893384 ? 709.782712893384 : xc;
    r = fa_exp_reduce(xc, &k);                   /* k in [-1023, 1024] */
    p = fa_exp_series(r);
    p = p * r + 1.0;
    p = p * r + 1.0;
    k1 = k >> 1;
    s1.i = (k1 + 1023) << 52;
    s2.i = (k - k1 + 1023) << 52;
    e = p * s1.f * s2.f;
    e = e < DBL_MIN ? 0.0 : e;
    return x > 709.782712893384 ? (double)INFINITY : e;
}

/* tanh(x) for double, branch-free: tanh|x| = expm1(2|x|) / (expm1(2|x|) + 2) with the
   sign of x, where expm1(y) = 2^n (e^r - 1) + (2^n - 1) and e^r - 1 is summed without
   its leading 1, so that small |x| keep their relative precision (1 - 2 / (e^2x + 1)
   cancels them away). |x| > 20 gives +-1 (as tanh does in double); NaN stays NaN. */
static inline double fa_tanh(double x) {
    union { double f; int64_t i; } s;
    double a, y, r, p, em;
    int64_t n;
    a = x < 0 ? -x : x;
    y = a > 40.0 ? 40.0 : 2.0 * a;               /* (NaN: compares false, stays NaN) */
    r = fa_exp_reduce(y, &n);
    p = fa_exp_series(r) * (r * r) + r;          /* e^r - 1 */
    s.i = (n + 1023) << 52;                      /* 2^n, n in [0, 58] */
    em = s.f * p + (s.f - 1.0);
    em = em / (em + 2.0);
    return x < 0 ? -em : em;
}

#endif
