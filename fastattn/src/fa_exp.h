/* exp for the kernels of fastattn: branch-free, so that a loop of it vectorises on any
   instruction set without -ffast-math.

   exp(x) by range reduction x = n ln2 + r, |r| <= ln2/2, a polynomial for e^r (Cephes'
   degree 5 for float, Taylor degree 13 for double; both within ~1 ulp) and 2^n built in
   the exponent bits. exp(-inf) = 0, exp(NaN) = NaN, +inf above the overflow limit;
   results below ~1e-38 (float) / ~1e-307 (double) are flushed to 0. */
#ifndef FASTATTN_FA_EXP_H
#define FASTATTN_FA_EXP_H

#include <math.h>
#include <stdint.h>

static inline float fa_expf(float x) {
    union { float f; int32_t i; } t, s, m;
    float xc, n, r, p;
    xc = x < -87.3f ? -87.3f : x;                /* NaN passes both clamps */
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
    s.i = (t.i - m.i + 126) << 23;               /* 2^(n-1); 0 when n = -126 */
    p = p * s.f * 2.0f;
    return x > 88.72283f ? (float)INFINITY : p;
}

static inline double fa_exp(double x) {
    union { double f; int64_t i; } t, s, m;
    double xc, n, r, p;
    xc = x < -708.39 ? -708.39 : x;
    xc = xc > 709.782712893384 ? 709.782712893384 : xc;
    m.f = 6755399441055744.0;                    /* 1.5 * 2^52 */
    t.f = xc * 1.4426950408889634 + m.f;
    n = t.f - m.f;
    r = xc - n * 0.693145751953125;
    r = r - n * 1.42860682030941723212e-6;
    p = 1.0 / 6227020800.0;
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
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    s.i = (t.i - m.i + 1022) << 52;              /* 2^(n-1) */
    p = p * s.f * 2.0;
    return x > 709.782712893384 ? (double)INFINITY : p;
}

#endif
