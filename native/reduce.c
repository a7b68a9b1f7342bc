/* reduce.c -- element-wise reduction kernels: dst[i] = dst[i] OP src[i].
 *
 * Written as plain loops over restrict pointers so that -O3 -ftree-vectorize turns them into
 * SIMD code for the baseline ISA (SSE2 on x86-64, NEON on aarch64). On x86-64 glibc builds the
 * kernels are additionally compiled for AVX2 (x86-64-v3) with target_clones and picked at load
 * time (ifunc), so a portable wheel still runs at AVX2 speed where the CPU has it.
 *
 * float16 / bfloat16 are converted to float32, combined in float32 and rounded back to nearest
 * even once per combination (the same contract as NCCL: a ring allreduce over n ranks rounds
 * n-1 times). The conversions are branch-free bit manipulation so they vectorize too.
 * min/max propagate NaN (like numpy.minimum/maximum) and are commutative, so every algorithm
 * produces bit-identical results on all ranks.
 */
#define _GNU_SOURCE
#include "hr_internal.h"

#include <string.h>
#if defined(__linux__)
#include <features.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && defined(__GLIBC__) && !defined(HR_NO_CLONES)
#define HR_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define HR_CLONES
#endif

typedef union { uint32_t u; float f; } hr_fu;

static inline float h2f(uint16_t h) {
    /* F. Giesen's half_to_float, made branch-free with masks so that it vectorizes. */
    hr_fu o, magic, d;
    uint32_t e, m_inf, m_den;
    magic.u = 113u << 23;
    o.u = ((uint32_t)h & 0x7fffu) << 13;
    e = o.u & (0x7c00u << 13);
    o.u += (127u - 15u) << 23;
    d.u = o.u + (1u << 23);
    d.f -= magic.f;                                   /* renormalised denormal / zero */
    m_inf = 0u - (uint32_t)(e == (0x7c00u << 13));
    m_den = 0u - (uint32_t)(e == 0);
    o.u += m_inf & ((128u - 16u) << 23);              /* inf / nan */
    o.u = (d.u & m_den) | (o.u & ~m_den);
    o.u |= ((uint32_t)h & 0x8000u) << 16;
    return o.f;
}

static inline uint16_t f2h(float x) {
    /* F. Giesen's float_to_half_fast3_rtne, made branch-free with masks. */
    hr_fu f, dn, dm;
    uint32_t sign, infnan, norm, den, mant_odd, m_big, m_small;
    f.f = x;
    sign = f.u & 0x80000000u;
    f.u ^= sign;
    infnan = 0x7c00u | ((0u - (uint32_t)(f.u > (255u << 23))) & 0x0200u);
    dm.u = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    dn.f = f.f + dm.f;
    den = dn.u - dm.u;
    mant_odd = (f.u >> 13) & 1u;
    norm = (f.u + ((uint32_t)(15 - 127) << 23) + 0xfffu + mant_odd) >> 13;
    m_big = 0u - (uint32_t)(f.u >= ((127u + 16u) << 23));
    m_small = 0u - (uint32_t)(f.u < (113u << 23));
    norm = (den & m_small) | (norm & ~m_small);
    norm = (infnan & m_big) | (norm & ~m_big);
    return (uint16_t)(norm | (sign >> 16));
}

static inline float b2f(uint16_t b) {
    hr_fu o;
    o.u = (uint32_t)b << 16;
    return o.f;
}

static inline uint16_t f2b(float x) {
    hr_fu f;
    uint32_t r;
    f.f = x;
    r = (f.u + 0x7fffu + ((f.u >> 16) & 1u)) >> 16;          /* round to nearest even */
    return (uint16_t)(((f.u & 0x7fffffffu) > 0x7f800000u) ? ((f.u >> 16) | 0x40u) : r); /* qNaN */
}

#define OP_SUM(a, b) ((a) + (b))
#define OP_PROD(a, b) ((a) * (b))
#define OP_MIN(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define OP_MAX(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define IOP_MIN(a, b) ((a) < (b) ? (a) : (b))
#define IOP_MAX(a, b) ((a) > (b) ? (a) : (b))

#define KERNEL(NAME, T, OP)                                                                      \
    HR_CLONES static void NAME(T *restrict d, const T *restrict s, size_t n) {                   \
        size_t i;                                                                                \
        for (i = 0; i < n; i++) d[i] = OP(d[i], s[i]);                                           \
    }

#define KERNEL_CVT(NAME, TOF, FROMF, OP)                                                         \
    HR_CLONES static void NAME(uint16_t *restrict d, const uint16_t *restrict s, size_t n) {     \
        size_t i;                                                                                \
        for (i = 0; i < n; i++) {                                                                \
            float a = TOF(d[i]), b = TOF(s[i]);                                                  \
            d[i] = FROMF(OP(a, b));                                                              \
        }                                                                                        \
    }

/* Three-operand forms: d[i] = a[i] OP b[i] (d must not alias a or b). */
#define KERNEL3(NAME, T, OP)                                                                     \
    HR_CLONES static void NAME(T *restrict d, const T *restrict a, const T *restrict b,          \
                               size_t n) {                                                       \
        size_t i;                                                                                \
        for (i = 0; i < n; i++) d[i] = OP(a[i], b[i]);                                           \
    }

#define KERNEL3_CVT(NAME, TOF, FROMF, OP)                                                        \
    HR_CLONES static void NAME(uint16_t *restrict d, const uint16_t *restrict a,                 \
                               const uint16_t *restrict b, size_t n) {                           \
        size_t i;                                                                                \
        for (i = 0; i < n; i++) d[i] = FROMF(OP(TOF(a[i]), TOF(b[i])));                          \
    }

#define KERNELS_F(SUF, T)                                                                        \
    KERNEL(sum_##SUF, T, OP_SUM) KERNEL(prod_##SUF, T, OP_PROD)                                  \
    KERNEL(min_##SUF, T, OP_MIN) KERNEL(max_##SUF, T, OP_MAX)                                    \
    KERNEL3(sum3_##SUF, T, OP_SUM) KERNEL3(prod3_##SUF, T, OP_PROD)                              \
    KERNEL3(min3_##SUF, T, OP_MIN) KERNEL3(max3_##SUF, T, OP_MAX)
#define KERNELS_I(SUF, T)                                                                        \
    KERNEL(sum_##SUF, T, OP_SUM) KERNEL(prod_##SUF, T, OP_PROD)                                  \
    KERNEL(min_##SUF, T, IOP_MIN) KERNEL(max_##SUF, T, IOP_MAX)                                  \
    KERNEL3(sum3_##SUF, T, OP_SUM) KERNEL3(prod3_##SUF, T, OP_PROD)                              \
    KERNEL3(min3_##SUF, T, IOP_MIN) KERNEL3(max3_##SUF, T, IOP_MAX)
#define KERNELS_H(SUF, TOF, FROMF)                                                               \
    KERNEL_CVT(sum_##SUF, TOF, FROMF, OP_SUM) KERNEL_CVT(prod_##SUF, TOF, FROMF, OP_PROD)        \
    KERNEL_CVT(min_##SUF, TOF, FROMF, OP_MIN) KERNEL_CVT(max_##SUF, TOF, FROMF, OP_MAX)          \
    KERNEL3_CVT(sum3_##SUF, TOF, FROMF, OP_SUM) KERNEL3_CVT(prod3_##SUF, TOF, FROMF, OP_PROD)    \
    KERNEL3_CVT(min3_##SUF, TOF, FROMF, OP_MIN) KERNEL3_CVT(max3_##SUF, TOF, FROMF, OP_MAX)

KERNELS_F(f32, float)
KERNELS_F(f64, double)
KERNELS_I(i32, int32_t)
KERNELS_I(i64, int64_t)
KERNELS_H(f16, h2f, f2h)
KERNELS_H(bf16, b2f, f2b)

/* Integer sum/prod wrap around (two's complement) like numpy; done on unsigned types so the
 * overflow is defined behaviour. */
KERNEL(sum_u32w, uint32_t, OP_SUM)
KERNEL(prod_u32w, uint32_t, OP_PROD)
KERNEL(sum_u64w, uint64_t, OP_SUM)
KERNEL(prod_u64w, uint64_t, OP_PROD)
KERNEL3(sum3_u32w, uint32_t, OP_SUM)
KERNEL3(prod3_u32w, uint32_t, OP_PROD)
KERNEL3(sum3_u64w, uint64_t, OP_SUM)
KERNEL3(prod3_u64w, uint64_t, OP_PROD)
KERNELS_I(u8, uint8_t)

void hr_reduce(void *dst, const void *src, size_t n, int dtype, int redop) {
    int op = redop == HR_AVG ? HR_SUM : redop;
#define DISPATCH(SUF, T)                                                                         \
    switch (op) {                                                                                \
    case HR_SUM: sum_##SUF((T *)dst, (const T *)src, n); return;                                 \
    case HR_PROD: prod_##SUF((T *)dst, (const T *)src, n); return;                               \
    case HR_MIN: min_##SUF((T *)dst, (const T *)src, n); return;                                 \
    case HR_MAX: max_##SUF((T *)dst, (const T *)src, n); return;                                 \
    default: return;                                                                             \
    }
    switch (dtype) {
    case HR_F32: DISPATCH(f32, float)
    case HR_F64: DISPATCH(f64, double)
    case HR_F16: DISPATCH(f16, uint16_t)
    case HR_BF16: DISPATCH(bf16, uint16_t)
    case HR_U8: DISPATCH(u8, uint8_t)
    case HR_I32:
        if (op == HR_SUM) { sum_u32w((uint32_t *)dst, (const uint32_t *)src, n); return; }
        if (op == HR_PROD) { prod_u32w((uint32_t *)dst, (const uint32_t *)src, n); return; }
        DISPATCH(i32, int32_t)
    case HR_I64:
        if (op == HR_SUM) { sum_u64w((uint64_t *)dst, (const uint64_t *)src, n); return; }
        if (op == HR_PROD) { prod_u64w((uint64_t *)dst, (const uint64_t *)src, n); return; }
        DISPATCH(i64, int64_t)
    default: return;
    }
#undef DISPATCH
}

void hr_reduce3(void *dst, const void *a, const void *b, size_t n, int dtype, int redop) {
    int op = redop == HR_AVG ? HR_SUM : redop;
#define DISPATCH3(SUF, T)                                                                        \
    switch (op) {                                                                                \
    case HR_SUM: sum3_##SUF((T *)dst, (const T *)a, (const T *)b, n); return;                    \
    case HR_PROD: prod3_##SUF((T *)dst, (const T *)a, (const T *)b, n); return;                  \
    case HR_MIN: min3_##SUF((T *)dst, (const T *)a, (const T *)b, n); return;                    \
    case HR_MAX: max3_##SUF((T *)dst, (const T *)a, (const T *)b, n); return;                    \
    default: return;                                                                             \
    }
    if (dst == a) {
        hr_reduce(dst, b, n, dtype, redop);
        return;
    }
    switch (dtype) {
    case HR_F32: DISPATCH3(f32, float)
    case HR_F64: DISPATCH3(f64, double)
    case HR_F16: DISPATCH3(f16, uint16_t)
    case HR_BF16: DISPATCH3(bf16, uint16_t)
    case HR_U8: DISPATCH3(u8, uint8_t)
    case HR_I32:
        if (op == HR_SUM) { sum3_u32w(dst, a, b, n); return; }
        if (op == HR_PROD) { prod3_u32w(dst, a, b, n); return; }
        DISPATCH3(i32, int32_t)
    case HR_I64:
        if (op == HR_SUM) { sum3_u64w(dst, a, b, n); return; }
        if (op == HR_PROD) { prod3_u64w(dst, a, b, n); return; }
        DISPATCH3(i64, int64_t)
    default: return;
    }
#undef DISPATCH3
}

HR_CLONES static void div_f32(float *restrict b, size_t n, float d) {
    size_t i;
    for (i = 0; i < n; i++) b[i] = b[i] / d;
}
HR_CLONES static void div_f64(double *restrict b, size_t n, double d) {
    size_t i;
    for (i = 0; i < n; i++) b[i] = b[i] / d;
}
HR_CLONES static void div_f16(uint16_t *restrict b, size_t n, float d) {
    size_t i;
    for (i = 0; i < n; i++) b[i] = f2h(h2f(b[i]) / d);
}
HR_CLONES static void div_bf16(uint16_t *restrict b, size_t n, float d) {
    size_t i;
    for (i = 0; i < n; i++) b[i] = f2b(b2f(b[i]) / d);
}

void hr_divide(void *buf, size_t n, int dtype, int divisor) {
    switch (dtype) {
    case HR_F32: div_f32(buf, n, (float)divisor); break;
    case HR_F64: div_f64(buf, n, (double)divisor); break;
    case HR_F16: div_f16(buf, n, (float)divisor); break;
    case HR_BF16: div_bf16(buf, n, (float)divisor); break;
    default: break; /* integer avg is refused by the caller */
    }
}

