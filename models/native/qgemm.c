/*
 * Grouped 4-bit and 8-bit weight matmuls with 16-bit activations, for CPUs.
 *
 * y[r, j] = sum_i W[j, i] * x[r, i], with W stored in blocks of 32 inputs as
 * GGUF stores them: Q4_1 (w = d * q + m, q in 0..15) or Q8_0 (w = d * q,
 * q in -127..127); the scales are half floats' values, stored as floats
 * (converting them costs more than reading the extra bytes). Each row of x is
 * first quantized per block of 32 to 16 bits (a = dx * qx, qx in
 * -32767..32767, with sx = dx * sum(qx) kept for Q4_1's offset term), so a
 * block's dot product is integer arithmetic (vpmaddwd):
 *
 *   Q4_1: sum(w a) = d dx sum(q qx) + m sx
 *   Q8_0: sum(w a) = d dx sum(q qx)
 *
 * llama.cpp quantizes activations to 8 bits instead (vpmaddubsw, a little
 * cheaper); on SmolLM2-135M that flips the output layer's choice often enough
 * to change answers ("What is the capital of France?" no longer says Paris,
 * in llama.cpp too), while 16 bits keep the activations closer than bfloat16.
 * Kind 2 (Q4_1A8, panels only) is that choice for the 4-bit layers, for a
 * model definition that asks for it (quantization "int4-a8"; see block_q8a).
 *
 * Two layouts of the same weights: GGUF's own blocks (sy_qgemm, for weights
 * whose outputs are not a multiple of 16) and panels of 16 outputs (sy_pgemm,
 * below: AVX512-VNNI, or AVX2 in two halves), 3-4 times faster at every batch
 * size than the blocks on an AVX512 EPYC, 2-4 times on an AVX2 EPYC.
 *
 * Every output is computed by the same instructions in the same order
 * whatever the number of rows or threads (threads split the outputs, never
 * the inputs), so a row's result does not depend on what it is batched with.
 *
 * Built at run time by models/native/__init__.py with the machine's own
 * instruction set (-march=native) and OpenMP; the library shares PyTorch's
 * libgomp (same soname, already loaded), so the calling thread's
 * torch.set_num_threads applies. Without AVX2 a portable loop runs.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_max_threads(void) { return 1; }
static int omp_get_thread_num(void) { return 0; }
static int omp_get_num_threads(void) { return 1; }
static int omp_in_parallel(void) { return 0; }
#endif

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define SY_AVX2 1
#else
#define SY_AVX2 0
#endif

#define QK 32

/*
 * The KV cache holds IEEE half floats (binary16, as uint16_t): a decoding
 * step's attention streams every key and value of its rows' slots, and at a
 * few hundred positions those outweigh the 4-bit weights; half floats halve
 * them. Stored rounded to nearest even, read back exactly, the same in every
 * kernel below: the AVX-512, AVX2 and scalar code give the same bits.
 */
typedef uint16_t sy_half;

#if SY_AVX2
static inline float half_to_float(sy_half h) { return _cvtsh_ss(h); }
static inline sy_half float_to_half(float f) { return (sy_half)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
static inline __m256 load8h(const sy_half *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline float half_to_float(sy_half h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t bits;
    if (e == 0x1f) bits = sign | 0x7f800000u | (m << 13); /* inf, nan */
    else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) bits = sign;
    else { /* subnormal: m 2^-24, exact in a float */
        float f = (float)m * 5.9604644775390625e-08f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline sy_half float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax >= 0x7f800000u) return (sy_half)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    if (ax >= 0x477ff000u) return (sy_half)(sign | 0x7c00); /* rounds past 65504: inf */
    if (ax < 0x38800000u) { /* below 2^-14: a subnormal half, m 2^-24 */
        float a;
        memcpy(&a, &ax, 4);
        return (sy_half)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
    }
    const uint32_t rounded = ax + 0xfff + ((ax >> 13) & 1); /* to nearest, ties to even */
    return (sy_half)(sign | ((rounded - 0x38000000u) >> 13));
}
#endif

/* n floats to half floats. */
static inline void store_half(sy_half *out, const float *x, int n) {
    int i = 0;
#if SY_AVX2
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) out[i] = float_to_half(x[i]);
}

typedef struct {
    float d; /* scale (a half float's value) */
    float m; /* minimum (a half float's value) */
    uint8_t qs[QK / 2]; /* element i in the low nibble of byte i, i + 16 in its high nibble */
} block_q4_1;

typedef struct {
    float d;
    int8_t qs[QK];
} block_q8_0;

typedef struct {
    float d;
    float s; /* d * sum(qs) */
    int16_t qs[QK];
} block_q16;

int sy_block_q4_1_size(void) { return (int)sizeof(block_q4_1); }
int sy_block_q8_0_size(void) { return (int)sizeof(block_q8_0); }
int sy_avx2(void) { return SY_AVX2; }

#if defined(__AVX512F__)
/* A block of 32 floats as integers in -top..top (two vectors of 16 int32) with
   its scale d = amax / top: round to nearest, ties away from zero. */
static inline float quantize_block512(const float *v, int top, __m512i *q0, __m512i *q1) {
    const __m512 sign = _mm512_set1_ps(-0.0f), half = _mm512_set1_ps(0.5f);
    __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    float d = amax / (float)top, id = d > 0.0f ? 1.0f / d : 0.0f;
    __m512 s0 = _mm512_mul_ps(v0, _mm512_set1_ps(id)), s1 = _mm512_mul_ps(v1, _mm512_set1_ps(id));
    /* |s| + 0.5 truncated, with s's sign: ties away from zero, as roundf */
    __m512i a = _mm512_cvttps_epi32(_mm512_or_ps(_mm512_add_ps(_mm512_andnot_ps(sign, s0), half), _mm512_and_ps(sign, s0)));
    __m512i b = _mm512_cvttps_epi32(_mm512_or_ps(_mm512_add_ps(_mm512_andnot_ps(sign, s1), half), _mm512_and_ps(sign, s1)));
    const __m512i hi = _mm512_set1_epi32(top), lo = _mm512_set1_epi32(-top);
    *q0 = _mm512_max_epi32(_mm512_min_epi32(a, hi), lo);
    *q1 = _mm512_max_epi32(_mm512_min_epi32(b, hi), lo);
    return d;
}
#endif

/* The same without vectors: |s| + 0.5 truncated with s's sign, as the vector lanes
   do it (roundf would differ from them where |s| + 0.5 rounds up in float). */
static inline __attribute__((unused)) float quantize_block_scalar(const float *v, int top,
                                                                  int32_t q[QK]) {
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) {
        float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    float d = amax / (float)top, id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < QK; i++) {
        const float sc = v[i] * id;
        int r = (int)(fabsf(sc) + 0.5f);
        r = sc < 0.0f ? -r : r;
        q[i] = r > top ? top : r < -top ? -top : r;
    }
    return d;
}

/* One row of k floats to k / 32 16-bit blocks (round to nearest, ties away from zero). */
static void quantize_row_q16(const float *x, block_q16 *out, int k) {
    for (int b = 0; b < k / QK; b++) {
        const float *v = x + b * QK;
#if defined(__AVX512F__)
        __m512i q0, q1;
        const float d = quantize_block512(v, 32767, &q0, &q1);
        _mm256_storeu_si256((__m256i *)out[b].qs, _mm512_cvtepi32_epi16(q0));
        _mm256_storeu_si256((__m256i *)(out[b].qs + 16), _mm512_cvtepi32_epi16(q1));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif SY_AVX2
        /* The same operations as above, 8 lanes at a time. */
        const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
        __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m256 idv = _mm256_set1_ps(id);
        const __m256i top = _mm256_set1_epi32(32767), bottom = _mm256_set1_epi32(-32767);
        __m256i q[4];
        const __m256 vs[4] = {v0, v1, v2, v3};
        for (int j = 0; j < 4; j++) {
            __m256 sc = _mm256_mul_ps(vs[j], idv);
            __m256i qj = _mm256_cvttps_epi32(
                _mm256_or_ps(_mm256_add_ps(_mm256_andnot_ps(sign, sc), half), _mm256_and_ps(sign, sc)));
            q[j] = _mm256_max_epi32(_mm256_min_epi32(qj, top), bottom);
        }
        /* packs interleaves 128-bit lanes: put them back in order */
        __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
        __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
        _mm256_storeu_si256((__m256i *)out[b].qs, p01);
        _mm256_storeu_si256((__m256i *)(out[b].qs + 16), p23);
        __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
        const int sum = _mm_cvtsi128_si32(t4);
#else
        int32_t q[QK];
        const float d = quantize_block_scalar(v, 32767, q);
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            out[b].qs[i] = (int16_t)q[i];
            sum += q[i];
        }
#endif
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}

/*
 * 8-bit activations (kind 2, Q4_1A8: the same Q4_1 weights): a row's block of
 * 32 as a = dx * qx, qx in -127..127 (llama.cpp's Q8_0 for activations), so a
 * block's products are u8 x s8 (vpdpbusd: 64 products into 16 int32 lanes,
 * twice vpdpwssd's; vpmaddubsw with AVX2). About a quarter less time for the
 * 4-bit layers of a step of 8 rows on a Zen 4 (bench/README.md), at the price of the
 * activations' precision: the answers are no longer the float32 rendition's
 * (bench/quality.py), which is why it is a choice (quantization "int4-a8")
 * and not the default.
 */
typedef struct {
    float d;
    float s; /* d * sum(qs) */
    int8_t qs[QK];
} block_q8a;

/* One row of k floats to k / 32 8-bit blocks: the operations of quantize_row_q16
   with 127 for 32767, in every build. */
static inline void quantize_row_q8a(const float *x, block_q8a *out, int k) {
    for (int b = 0; b < k / QK; b++) {
        const float *v = x + b * QK;
#if defined(__AVX512F__)
        __m512i q0, q1;
        const float d = quantize_block512(v, 127, &q0, &q1);
        _mm_storeu_si128((__m128i *)out[b].qs, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(out[b].qs + 16), _mm512_cvtepi32_epi8(q1));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
        int32_t q[QK];
        const float d = quantize_block_scalar(v, 127, q);
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            out[b].qs[i] = (int8_t)q[i];
            sum += q[i];
        }
#endif
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}

#if SY_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if SY_AVX2
/* e^x, 8 lanes (Cephes' expf: x = n ln 2 + r, a degree-5 polynomial in r; within 2
   ulp of expf, and e^x = 0 below -88.4). The same lane operations whatever the
   lane, so a value's result does not depend on its neighbours. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* [sum(a[0]), ..., sum(a[7])]. */
static inline __m256 hsum8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#define TILE_ROWS 4

/* y[r, j] for rows r0 .. r0 + nr - 1 (nr <= TILE_ROWS) of one weight row w: each
   weight block is unpacked once for the tile. */
static void dot_q4_1(const block_q4_1 *w, const block_q16 *x, int blocks, int nr,
                     float *out[TILE_ROWS]) {
#if SY_AVX2
    const __m128i low = _mm_set1_epi8(0x0f);
    __m256 acc[TILE_ROWS];
    float offset[TILE_ROWS];
    for (int r = 0; r < nr; r++) {
        acc[r] = _mm256_setzero_ps();
        offset[r] = 0.0f;
    }
    for (int b = 0; b < blocks; b++) {
        __m128i packed = _mm_loadu_si128((const __m128i *)w[b].qs);
        __m256i first = _mm256_cvtepu8_epi16(_mm_and_si128(packed, low));
        __m256i second = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low));
        const float d = w[b].d, m = w[b].m;
        for (int r = 0; r < nr; r++) {
            const block_q16 *xb = x + (size_t)r * blocks + b;
            __m256i a0 = _mm256_loadu_si256((const __m256i *)xb->qs);
            __m256i a1 = _mm256_loadu_si256((const __m256i *)(xb->qs + 16));
            __m256i p = _mm256_add_epi32(_mm256_madd_epi16(first, a0), _mm256_madd_epi16(second, a1));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(p), acc[r]);
            offset[r] += m * xb->s;
        }
    }
    for (int r = 0; r < nr; r++) *out[r] = hsum(acc[r]) + offset[r];
#else
    for (int r = 0; r < nr; r++) {
        float total = 0.0f;
        for (int b = 0; b < blocks; b++) {
            const block_q16 *xb = x + (size_t)r * blocks + b;
            int sum = 0;
            for (int i = 0; i < QK / 2; i++) {
                sum += (w[b].qs[i] & 0x0f) * xb->qs[i] + (w[b].qs[i] >> 4) * xb->qs[i + QK / 2];
            }
            total += w[b].d * xb->d * (float)sum + w[b].m * xb->s;
        }
        *out[r] = total;
    }
#endif
}

static void dot_q8_0(const block_q8_0 *w, const block_q16 *x, int blocks, int nr,
                     float *out[TILE_ROWS]) {
#if SY_AVX2
    __m256 acc[TILE_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256i first = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w[b].qs));
        __m256i second = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[b].qs + 16)));
        const float d = w[b].d;
        for (int r = 0; r < nr; r++) {
            const block_q16 *xb = x + (size_t)r * blocks + b;
            __m256i a0 = _mm256_loadu_si256((const __m256i *)xb->qs);
            __m256i a1 = _mm256_loadu_si256((const __m256i *)(xb->qs + 16));
            __m256i p = _mm256_add_epi32(_mm256_madd_epi16(first, a0), _mm256_madd_epi16(second, a1));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) *out[r] = hsum(acc[r]);
#else
    for (int r = 0; r < nr; r++) {
        float total = 0.0f;
        for (int b = 0; b < blocks; b++) {
            const block_q16 *xb = x + (size_t)r * blocks + b;
            int sum = 0;
            for (int i = 0; i < QK; i++) sum += w[b].qs[i] * xb->qs[i];
            total += w[b].d * xb->d * (float)sum;
        }
        *out[r] = total;
    }
#endif
}

/* Block i of a kind's row activations: block_q8a for kind 2, block_q16 otherwise. */
static inline const void *x_block(int kind, const void *xq, size_t i) {
    return kind == 2 ? (const void *)((const block_q8a *)xq + i)
                     : (const void *)((const block_q16 *)xq + i);
}

/* The scale and sum of a row's block (d, then s: block_q16's and block_q8a's first fields). */
static inline const float *block_ds(int kind, const void *xq, size_t i) {
    return (const float *)x_block(kind, xq, i);
}

/* One row of k floats to a kind's activation blocks, at xq. */
static inline void quantize_row(int kind, const float *x, void *xq, int k) {
    if (kind == 2) quantize_row_q8a(x, xq, k);
    else quantize_row_q16(x, xq, k);
}

/*
 * y[rows, n] = x[rows, k] @ W[n, k]^T for W in Q4_1 (kind 0) or Q8_0 (kind 1)
 * blocks, row-major, n rows of k / 32 blocks. Returns 0, or -1 if out of memory.
 */
int sy_qgemm(int kind, const float *x, int rows, int k, const void *weight, int n, float *y) {
    if (kind != 0 && kind != 1) return -2; /* Q4_1A8 is laid out in panels only */
    const int blocks = k / QK;
    block_q16 *xq = malloc(sizeof(block_q16) * (size_t)blocks * (size_t)rows);
    if (!xq) return -1;
    for (int r = 0; r < rows; r++) quantize_row_q16(x + (size_t)r * k, xq + (size_t)r * blocks, k);
    /* Outputs in tiles of 8 (each thread's weights stream once), rows in tiles of
       TILE_ROWS (each weight block unpacked once per tile). */
    const int tiles = (n + 7) / 8;
#pragma omp parallel for schedule(dynamic, 4) /* as in sy_pgemm */
    for (int t = 0; t < tiles; t++) {
        int end = t * 8 + 8 < n ? t * 8 + 8 : n;
        for (int j = t * 8; j < end; j++) {
            for (int r0 = 0; r0 < rows; r0 += TILE_ROWS) {
                int nr = rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS;
                float *out[TILE_ROWS];
                for (int r = 0; r < nr; r++) out[r] = y + (size_t)(r0 + r) * n + j;
                const block_q16 *xr = xq + (size_t)r0 * blocks;
                if (kind == 0)
                    dot_q4_1((const block_q4_1 *)weight + (size_t)j * blocks, xr, blocks, nr, out);
                else
                    dot_q8_0((const block_q8_0 *)weight + (size_t)j * blocks, xr, blocks, nr, out);
            }
        }
    }
    free(xq);
    return 0;
}

/* -- panels: the same products, weights laid out by output ------------------- */

/*
 * On CPUs with AVX512-VNNI (vpdpwssd: 32 16-bit products summed into 16 int32
 * lanes per instruction) the weights are laid out so that each vector lane is
 * one output: a panel holds 16 outputs by one block of 32 inputs, as pairs of
 * inputs side by side per lane, and a row's pair of 16-bit activations is
 * broadcast to every lane. A block's integer sums then need one conversion per
 * 16 outputs rather than one per output, and every lane's sum is exact:
 *
 *   Q4_1 panel, 256 bytes: double pair t (0..7), lane l, j (0, 1): low nibble
 *        q[l][4t + j], high nibble q[l][4t + 2 + j];
 *   Q8_0 panel, 512 bytes: pair p (0..15), lane l, j: q[l][2p + j];
 *
 * with the scales (and Q4_1's minimums) as 16 half floats per panel (they
 * are half floats' values: a 4-bit weight streams 0.625 bytes, not 0.75). The
 * arithmetic per output is that of the blocks above, in the same order
 * whatever the batch: per block, d dx sum(q qx) (+ m sx), added in block order.
 */
#if SY_AVX2
/*
 * A panel's block PANEL_AHEAD blocks after c, asked into this core's L2 (a
 * prefetch: the same bits, and no fault past the end). The products read
 * weights once, from memory: on their own the hardware prefetchers, which
 * stop at every 4 KiB page, kept a decoding step's products at about a third
 * of the memory's bandwidth (6-12 GB/s against 30 for a plain sum over the
 * same bytes, 2 cores of a Zen 4). With it, measured on a Zen 4 EPYC,
 * decoding steps of SmolLM2-135M at 1 / 4 / 8 / 16 rows took 11 / 27 / 20 /
 * 14 % less time (AVX512-VNNI; the AVX2 build 29 / 2 / 17 / 7 %), and the
 * engine's tokens/s at 1 / 4 / 8 / 16 clients rose 5 / 49 / 31 / 12 %
 * (bench/README.md); 16 and 32 blocks ahead gained less, 128 as much.
 */
#define PANEL_AHEAD 64
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *c, size_t psize) {
    const char *p = (const char *)c + (size_t)PANEL_AHEAD * psize;
    for (size_t o = 0; o < psize; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SY_PANELS 1
#define PR 8 /* rows per register tile (panel_any says how many panels a tile takes) */
#define TEAM_ROWS 4 /* the most decoding rows a step keeps in one region (sy_decode_layers) */

/*
 * Q4_1A8 panels (256 bytes, the same codes as Q4_1's in another order): octet o
 * (0..3), lane l, j (0..3): low nibble q[l][8o + j], high nibble q[l][8o + 4 + j].
 * A 64-byte load is 16 lanes of 4 codes for one 4-byte group of a row's 8-bit
 * activations (low nibbles) and 4 for the next (high nibbles): vpdpbusd.
 */

/* y[r, 16 g .. 16 g + 31] (two lanes groups g, g + 1 when g2) for nr <= PR rows,
   nr <= 4 when g2 (panel_any); xq holds block_q16 (kinds 0, 1) or block_q8a (kind 2). */
static inline __attribute__((always_inline)) void panel_tile(
    int kind, const void *xq, int blocks, const uint8_t *codes, const uint16_t *d,
    const uint16_t *m, int g, int g2, int nr, float *y, int n) {
    const size_t psize = kind == 1 ? 512 : 256;
    const block_q16 *x16 = xq;
    const block_q8a *x8 = xq;
    __m512 acc[PR][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi16(0x0f), nibbles = _mm512_set1_epi8(0x0f);
    for (int b = 0; b < blocks; b++) {
        const uint8_t *c0 = codes + ((size_t)g * blocks + b) * psize;
        const uint8_t *c1 = c0 + (size_t)blocks * psize;
        prefetch_ahead(c0, psize);
        if (g2) prefetch_ahead(c1, psize);
        __m512i sum[PR][2];
        for (int r = 0; r < nr; r++) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
        if (kind == 0) {
            for (int t = 0; t < 8; t++) {
                __m512i v0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(c0 + 32 * t)));
                __m512i a0 = _mm512_and_si512(v0, low), b0 = _mm512_srli_epi16(v0, 4), a1, b1;
                if (g2) {
                    __m512i v1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(c1 + 32 * t)));
                    a1 = _mm512_and_si512(v1, low), b1 = _mm512_srli_epi16(v1, 4);
                }
                for (int r = 0; r < nr; r++) {
                    const int16_t *qx = x16[(size_t)r * blocks + b].qs + 4 * t;
                    int32_t lo, hi;
                    memcpy(&lo, qx, 4);
                    memcpy(&hi, qx + 2, 4);
                    __m512i xlo = _mm512_set1_epi32(lo), xhi = _mm512_set1_epi32(hi);
                    sum[r][0] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(sum[r][0], a0, xlo), b0, xhi);
                    if (g2) sum[r][1] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(sum[r][1], a1, xlo), b1, xhi);
                }
            }
        } else if (kind == 2) {
            for (int o = 0; o < 4; o++) {
                const __m512i v0 = _mm512_loadu_si512((const void *)(c0 + 64 * o));
                const __m512i a0 = _mm512_and_si512(v0, nibbles);
                const __m512i b0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nibbles);
                __m512i a1 = a0, b1 = b0;
                if (g2) {
                    const __m512i v1 = _mm512_loadu_si512((const void *)(c1 + 64 * o));
                    a1 = _mm512_and_si512(v1, nibbles);
                    b1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nibbles);
                }
                for (int r = 0; r < nr; r++) {
                    const int8_t *qx = x8[(size_t)r * blocks + b].qs + 8 * o;
                    int32_t lo, hi;
                    memcpy(&lo, qx, 4);
                    memcpy(&hi, qx + 4, 4);
                    const __m512i xlo = _mm512_set1_epi32(lo), xhi = _mm512_set1_epi32(hi);
                    sum[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum[r][0], a0, xlo), b0, xhi);
                    if (g2) sum[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum[r][1], a1, xlo), b1, xhi);
                }
            }
        } else {
            for (int p = 0; p < 16; p++) {
                __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(c0 + 32 * p))), w1;
                if (g2) w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(c1 + 32 * p)));
                for (int r = 0; r < nr; r++) {
                    int32_t pair;
                    memcpy(&pair, x16[(size_t)r * blocks + b].qs + 2 * p, 4);
                    __m512i xv = _mm512_set1_epi32(pair);
                    sum[r][0] = _mm512_dpwssd_epi32(sum[r][0], w0, xv);
                    if (g2) sum[r][1] = _mm512_dpwssd_epi32(sum[r][1], w1, xv);
                }
            }
        }
        const size_t s0 = ((size_t)g * blocks + b) * 16, s1 = s0 + (size_t)blocks * 16;
        for (int h = 0; h < 1 + g2; h++) {
            const size_t s = h ? s1 : s0;
            const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + s)));
            const __m512 mv = kind != 1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + s)))
                                        : _mm512_setzero_ps();
            for (int r = 0; r < nr; r++) {
                const float *xb = block_ds(kind, xq, (size_t)r * blocks + b);
                acc[r][h] = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(xb[0])),
                                            _mm512_cvtepi32_ps(sum[r][h]), acc[r][h]);
                if (kind != 1)
                    acc[r][h] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xb[1]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < nr; r++) {
        float *out = y + (size_t)r * n + (size_t)g * 16;
        _mm512_storeu_ps(out, acc[r][0]);
        if (g2) _mm512_storeu_ps(out + 16, acc[r][1]);
    }
}

#define PANEL_CASE(R)                                                               \
    case R:                                                                         \
        if (g2) panel_tile(kind, xq, blocks, codes, d, m, g, 1, R, y, n);           \
        else panel_tile(kind, xq, blocks, codes, d, m, g, 0, R, y, n);              \
        break;

#define PANEL_CASE1(R)                                                              \
    case R:                                                                         \
        panel_tile(kind, xq, blocks, codes, d, m, g, 0, R, y, n);                   \
        if (g2) panel_tile(kind, xq, blocks, codes, d, m, g + 1, 0, R, y, n);       \
        break;

/*
 * A tile of 1-4 rows takes two panels (32 outputs) at once, each row's
 * activations loaded once for both; one of 5-8 rows takes one panel at a time
 * (PANEL_CASE1: 8 rows' sums and accumulators for two panels would need every
 * vector register and more), each weight unpacked once for all of them.
 * Tiles of 8 instead of two of 4 (the output layer at 5-16 rows, a 16-row
 * step's 8 rows a thread, prompts), measured on a Zen 5 EPYC (2026-12-06,
 * python -m bench.engine --concurrency 8 16, the two libraries in turn, three
 * rounds, medians of ~250 / ~160 steps): 8-row steps 5.80 / 5.52 / 5.53 ms
 * against 6.26 / 6.07 / 5.99, 16-row steps 10.00 / 9.91 / 9.86 against 10.61
 * / 10.38 / 10.16. The same instructions in the same order for every output:
 * the same bits.
 */
static void panel_any(int kind, const void *xq, int blocks, const uint8_t *codes,
                      const uint16_t *d, const uint16_t *m, int g, int g2, int nr, float *y, int n) {
    switch (nr) {
        PANEL_CASE1(8) PANEL_CASE1(7) PANEL_CASE1(6) PANEL_CASE1(5)
        PANEL_CASE(4) PANEL_CASE(3) PANEL_CASE(2) PANEL_CASE(1)
    }
}
#elif SY_AVX2
#define SY_PANELS 1
#define PR 4 /* rows per register tile */
/* A whole tile: without VNNI the products are bound by the multiply-adds and the
   weights' unpacking, which one tile of 4 rows shares while split 2 + 2 does
   not (sy_decode_layers). */
#define TEAM_ROWS PR

/*
 * The same panels for AVX2 (vpmaddwd: 16 16-bit products summed in pairs into 8
 * int32 lanes): a panel's 16 lanes are two vectors of 8, lanes 0-7 in the
 * first 16 bytes of each 32-byte group, lanes 8-15 in the next. The integer
 * sums are exact and the float operations per lane are those above, in the
 * same order, so both kernels give the same bits.
 */
static inline __attribute__((always_inline)) void panel_tile8(
    int kind, const void *xq, int blocks, const uint8_t *codes, const uint16_t *d,
    const uint16_t *m, int g, int nr, float *y, int n) {
    const size_t psize = kind == 1 ? 512 : 256;
    const block_q16 *x16 = xq;
    const block_q8a *x8 = xq;
    __m256 acc[PR][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi16(0x0f), nibbles = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < blocks; b++) {
        const uint8_t *c = codes + ((size_t)g * blocks + b) * psize;
        prefetch_ahead(c, psize);
        __m256i sum[PR][2];
        for (int r = 0; r < nr; r++) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
        if (kind == 0) {
            /* Not unrolled: GCC 12 unrolls the 8 double pairs whole, and with
               few rows it then keeps products on the stack to sum them later.
               Rolled, Q4_1 products of 1 / 2 rows ran 1.02-1.18x / 1.16-1.26x
               as fast (the model's shapes, both builds timed in turn, medians
               of 201 pairs; a Zen 4 exposing AVX2 only, 2026-12-07), the same
               bits; from 3 rows no change, and unrolled by 2 as by 1. Q8_0's
               loop below measured no gain rolled (bench/README.md). */
#pragma GCC unroll 1
            for (int t = 0; t < 8; t++) {
                __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + 32 * t)));
                __m256i v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + 32 * t + 16)));
                __m256i a0 = _mm256_and_si256(v0, low), b0 = _mm256_srli_epi16(v0, 4);
                __m256i a1 = _mm256_and_si256(v1, low), b1 = _mm256_srli_epi16(v1, 4);
                for (int r = 0; r < nr; r++) {
                    const int16_t *qx = x16[(size_t)r * blocks + b].qs + 4 * t;
                    int32_t lo, hi;
                    memcpy(&lo, qx, 4);
                    memcpy(&hi, qx + 2, 4);
                    __m256i xlo = _mm256_set1_epi32(lo), xhi = _mm256_set1_epi32(hi);
                    sum[r][0] = _mm256_add_epi32(
                        sum[r][0], _mm256_add_epi32(_mm256_madd_epi16(a0, xlo), _mm256_madd_epi16(b0, xhi)));
                    sum[r][1] = _mm256_add_epi32(
                        sum[r][1], _mm256_add_epi32(_mm256_madd_epi16(a1, xlo), _mm256_madd_epi16(b1, xhi)));
                }
            }
        } else if (kind == 2) {
            /* vpmaddubsw (u8 codes x s8 activations, pairs summed into 16-bit lanes, at
               most 2 * 15 * 127: no saturation) then vpmaddwd by ones: vpdpbusd's exact
               sums; lanes 0-7 in the first 32 bytes of each 64. */
            for (int o = 0; o < 4; o++) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(c + 64 * o));
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(c + 64 * o + 32));
                const __m256i a0 = _mm256_and_si256(v0, nibbles);
                const __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibbles);
                const __m256i a1 = _mm256_and_si256(v1, nibbles);
                const __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibbles);
                for (int r = 0; r < nr; r++) {
                    const int8_t *qx = x8[(size_t)r * blocks + b].qs + 8 * o;
                    int32_t lo, hi;
                    memcpy(&lo, qx, 4);
                    memcpy(&hi, qx + 4, 4);
                    const __m256i xlo = _mm256_set1_epi32(lo), xhi = _mm256_set1_epi32(hi);
                    const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(a0, xlo), _mm256_maddubs_epi16(b0, xhi));
                    const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(a1, xlo), _mm256_maddubs_epi16(b1, xhi));
                    sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(p0, ones));
                    sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(p1, ones));
                }
            }
        } else {
            for (int p = 0; p < 16; p++) {
                __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 32 * p)));
                __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 32 * p + 16)));
                for (int r = 0; r < nr; r++) {
                    int32_t pair;
                    memcpy(&pair, x16[(size_t)r * blocks + b].qs + 2 * p, 4);
                    __m256i xv = _mm256_set1_epi32(pair);
                    sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(w0, xv));
                    sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(w1, xv));
                }
            }
        }
        const size_t s = ((size_t)g * blocks + b) * 16;
        for (int h = 0; h < 2; h++) {
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + s + 8 * h)));
            const __m256 mv = kind != 1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + s + 8 * h)))
                                        : _mm256_setzero_ps();
            for (int r = 0; r < nr; r++) {
                const float *xb = block_ds(kind, xq, (size_t)r * blocks + b);
                acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_set1_ps(xb[0])),
                                            _mm256_cvtepi32_ps(sum[r][h]), acc[r][h]);
                if (kind != 1)
                    acc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xb[1]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < nr; r++) {
        float *out = y + (size_t)r * n + (size_t)g * 16;
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
    }
}

#define PANEL_CASE(R)                                                               \
    case R:                                                                         \
        panel_tile8(kind, xq, blocks, codes, d, m, g, R, y, n);                     \
        if (g2) panel_tile8(kind, xq, blocks, codes, d, m, g + 1, R, y, n);         \
        break;

static void panel_any(int kind, const void *xq, int blocks, const uint8_t *codes,
                      const uint16_t *d, const uint16_t *m, int g, int g2, int nr, float *y, int n) {
    switch (nr) {
        PANEL_CASE(4) PANEL_CASE(3) PANEL_CASE(2) PANEL_CASE(1)
    }
}
#else
#define SY_PANELS 0
#define TEAM_ROWS 3
#endif

int sy_panels(void) { return SY_PANELS; }

#define PRIVATE_ROWS 16 /* rows every thread quantizes for itself (sy_pgemm) */


/*
 * y[rows, n] = x[rows, k] @ W[n, k]^T for W in panels (kind 0: Q4_1, 1: Q8_0,
 * 2: Q4_1A8): codes [n / 16, k / 32, panel], d and m [n / 16, k / 32, 16] half
 * floats (m unused for Q8_0); n a multiple of 16. Returns 0, -1 if out of memory, -2 where the
 * library was built without AVX2 or AVX512-VNNI.
 */
#if SY_PANELS
/*
 * sy_pgemm's work, by the calling thread's team (the caller is inside a
 * parallel region): x quantized into xq (each thread's own copy of every row
 * when private, else one copy shared out), then the panels shared out. Every
 * thread of the team must call it; it returns after the products' barrier.
 */
static void pgemm_team(int kind, const float *x, int rows, int k, const uint8_t *codes,
                       const uint16_t *d, const uint16_t *m, int n, float *y, block_q16 *xq,
                       int private) {
    const int blocks = k / QK, pairs = (n / 16 + 1) / 2;
    /* Q4_1A8's 8-bit blocks go in the same buffer (smaller than the 16-bit ones). */
    if (private) {
        for (int r = 0; r < rows; r++)
            quantize_row(kind, x + (size_t)r * k, (void *)x_block(kind, xq, (size_t)r * blocks), k);
    } else {
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            quantize_row(kind, x + (size_t)r * k, (void *)x_block(kind, xq, (size_t)r * blocks), k);
    }
    /* Handed out in shrinking runs of consecutive pairs of panels (guided):
       each thread streams long runs of contiguous weights, which the prefetch
       ahead (prefetch_ahead) finds where the thread goes next, and when the OS
       takes a core from one thread (a worker shares the machine with the API,
       Redis and other processes), the other takes over the small runs left at
       the end rather than the step waiting for it. One pair at a time, as
       before 2026-12-03, jumped between the threads' streams: steps of 1 / 2 /
       3 decoding rows took 36 / 39 / 38 % less time guided (Zen 4, both
       prefetching; bench/README.md). */
#pragma omp for schedule(guided)
    for (int t = 0; t < pairs; t++) {
        const int g = 2 * t, g2 = 2 * t + 1 < n / 16;
        for (int r0 = 0; r0 < rows; r0 += PR) {
            const int nr = rows - r0 < PR ? rows - r0 : PR;
            panel_any(kind, x_block(kind, xq, (size_t)r0 * blocks), blocks, codes, d, m, g, g2,
                      nr, y + (size_t)r0 * n, n);
        }
    }
}
#endif

int sy_pgemm(int kind, const float *x, int rows, int k, const uint8_t *codes, const uint16_t *d,
             const uint16_t *m, int n, float *y) {
#if SY_PANELS
    const int blocks = k / QK;
    /* Up to PRIVATE_ROWS rows (a decoding step), every thread quantizes them all for
       itself: a few microseconds, and no barrier between quantizing and the
       products, where a step waits longest when the OS has taken a core from one
       of its threads. */
    const int private = rows <= PRIVATE_ROWS;
    /* Inside sy_decode_layers' split (a thread's own rows) it runs on one thread. */
    const int alone = omp_in_parallel();
    const int copies = private && !alone ? omp_get_max_threads() : 1;
    block_q16 *buffer = malloc(sizeof(block_q16) * (size_t)blocks * (size_t)rows * (size_t)copies);
    if (!buffer) return -1;
#pragma omp parallel if (!alone)
    pgemm_team(kind, x, rows, k, codes, d, m, n, y,
               buffer + (private ? (size_t)omp_get_thread_num() * blocks * rows : 0), private);
    free(buffer);
    return 0;
#else
    (void)kind, (void)x, (void)rows, (void)k, (void)codes, (void)d, (void)m, (void)n, (void)y;
    return -2;
#endif
}

/* -- the layer's other parts, for the same steps ----------------------------- */

/*
 * The index of a row's first largest value, as torch.argmax gives it (a NaN
 * counts as the largest, its first one): greedy decoding's token. PyTorch's
 * own takes about 65 us for a 49,152-word vocabulary on an AVX2 EPYC, a
 * tenth of a small model's decoding step; this one reads the row once.
 */
static int64_t argmax_row(const float *x, int n) {
#if SY_AVX2
    if (n >= 8) {
        __m256 best = _mm256_loadu_ps(x);
        __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
        __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = at;
        const __m256i eight = _mm256_set1_epi32(8);
        int i = 8;
        for (; i + 8 <= n; i += 8) {
            idx = _mm256_add_epi32(idx, eight);
            const __m256 v = _mm256_loadu_ps(x + i);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ); /* strictly: a lane keeps its first */
            best = _mm256_blendv_ps(best, v, gt);
            at = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), gt));
        }
        if (!_mm256_movemask_ps(nan)) {
            float bv[8];
            int32_t bi[8];
            _mm256_storeu_ps(bv, best);
            _mm256_storeu_si256((__m256i *)bi, at);
            float m = bv[0];
            int64_t k = bi[0];
            for (int l = 1; l < 8; l++)
                if (bv[l] > m || (bv[l] == m && bi[l] < k)) m = bv[l], k = bi[l];
            int tail_nan = 0;
            for (; i < n; i++) {
                tail_nan |= isnan(x[i]);
                if (x[i] > m) m = x[i], k = i;
            }
            if (!tail_nan) return k;
            /* a NaN: the plain scan below finds the first one */
        }
    }
#endif
    int64_t k = 0;
    for (int i = 1; i < n && !isnan(x[k]); i++)
        if (x[i] > x[k] || isnan(x[i])) k = i;
    return k;
}

/* out[r] = argmax_row(x[r]) for each of rows rows of n floats. */
void sy_argmax_rows(const float *x, int rows, int n, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows > 1 && !omp_in_parallel())
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (size_t)r * n, n);
}

/*
 * x[rows, dim] += delta (when delta is not NULL), then
 * out = x / sqrt(mean(x^2) + eps) * weight, row by row (Llama's RMSNorm).
 */
void sy_add_rms_norm(float *x, const float *delta, int rows, int dim, const float *weight,
                     float eps, float *out) {
#pragma omp parallel for schedule(static) if (rows > 8 && !omp_in_parallel())
    for (int r = 0; r < rows; r++) {
        float *v = x + (size_t)r * dim;
        float *o = out + (size_t)r * dim;
        if (delta) {
            const float *dv = delta + (size_t)r * dim;
            for (int i = 0; i < dim; i++) v[i] += dv[i];
        }
        double sum = 0.0;
        for (int i = 0; i < dim; i++) sum += (double)v[i] * v[i];
        const float inv = 1.0f / sqrtf((float)(sum / dim) + eps);
        for (int i = 0; i < dim; i++) o[i] = v[i] * inv * weight[i];
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i] (gate and up side by side). */
void sy_silu_mul(const float *gate_up, int rows, int inter, float *out) {
#pragma omp parallel for schedule(static) if (rows > 8 && !omp_in_parallel())
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;
        float *o = out + (size_t)r * inter;
        int i = 0;
#if SY_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= inter; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* a . b for b in half floats. */
static float dot_half(const float *a, const sy_half *b, int n) {
#if SY_AVX2
    if (n % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8h(b + i), acc);
        return hsum(acc);
    }
#endif
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * half_to_float(b[i]);
    return s;
}

/*
 * scores[p] = exp(scores[p] - top) / total for p < n, total the sum of the
 * numerators (8 lanes' sums, then the tail's, in that order). Each weight is
 * one IEEE division, 8 at a time or alone: the same bits either way, done
 * once per position rather than once per position and output dimension.
 */
static void softmax_weights(float *scores, int n, float top) {
    float total = 0.0f;
    int p = 0;
#if SY_AVX2
    {
        const __m256 topv = _mm256_set1_ps(top);
        __m256 sums = _mm256_setzero_ps();
        for (; p + 8 <= n; p += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + p), topv));
            _mm256_storeu_ps(scores + p, e);
            sums = _mm256_add_ps(sums, e);
        }
        total = hsum(sums);
    }
#endif
    for (; p < n; p++) {
        scores[p] = expf(scores[p] - top);
        total += scores[p];
    }
    p = 0;
#if SY_AVX2
    {
        const __m256 tv = _mm256_set1_ps(total);
        for (; p + 8 <= n; p += 8) _mm256_storeu_ps(scores + p, _mm256_div_ps(_mm256_loadu_ps(scores + p), tv));
    }
#endif
    for (; p < n; p++) scores[p] /= total;
}

/*
 * Attention of one query per row over its slot of the KV cache.
 *
 * q: [rows, heads, hd] with row stride q_stride (floats); kv: one layer of the
 * cache, [slots, 2 * kv_heads, length, hd] half floats (keys, then values); row r attends
 * positions 0 .. lengths[r] - 1 of slot slots[r]; out: [rows, heads, hd].
 * Each (row, head) is computed alone, in the same order whatever the batch.
 * Returns 0, or -1 if out of memory.
 *
 * Rows of one slot at consecutive positions (a prompt being prefilled) are
 * attended ATT_ROWS at a time, and the query heads that share a key and value
 * head (grouped-query attention) together: their keys and values are read a
 * tile of ATT_TILE positions at a time, once for all of them, instead of once
 * per row and head (at 2,000 positions a row's keys and values are about 0.5 MB
 * a head in half floats; at 8 decoding rows of 400 positions, reading them once for the 3
 * heads of a group took a layer's attention from 262 to 185 us on a 2-core
 * Xeon). With AVX-512 the scores of a group's 3 heads are computed together
 * (scores8x3: each key converted once for the three), every group's weighted
 * sums share one reading of the values (weighted_sums64), and softmax divides
 * each weight once, not once per dimension: on a Zen 4 EPYC (2026-12-03, the
 * two libraries in turn, same bits) decoding steps of SmolLM2-135M at 8 / 16
 * rows took 6 / 5 % less time at 128 positions, 12 / 17 % at 1,000. Each
 * query's scores, sums and outputs are still computed by the same operations
 * in the same order as for one alone: only the loops are interleaved.
 */
#define ATT_ROWS 8
#define ATT_GROUP 8 /* the most query heads sharing one key and value head attended together */
#define ATT_TILE 64
/* Positions ahead whose keys and values are prefetched (a few KiB): the
   hardware's own prefetching left a decoding step's attention waiting on
   memory at a few hundred positions (-15 to -20 % at 400 and 1,000 positions
   of 8 and 16 rows on a 2-core Xeon). A prefetch past the end is harmless. */
#define ATT_AHEAD 32

#if SY_AVX2
#define WS_QUERIES 3 /* queries whose weighted sums share one reading of the values */
/*
 * For each query q < NQ: os[q][i0..i0+63] += sum over p in [p0, p1) of
 * ws[q][p] * values[p][i0..i0+63], position by position, as a multiply then
 * an add per dimension (no fused multiply-add): each dimension of each query
 * gets the same operations in the same order whether 8 (AVX2) or 16 (AVX-512)
 * dimensions go at a time, and whatever the other queries, so every path
 * gives the same bits. The values are read and converted once for the NQ
 * queries (the heads of a group share them).
 */
static inline __attribute__((always_inline)) void weighted_sums64(
    const float *const *ws, const int NQ, int p0, int p1, const sy_half *values, int hd, int i0,
    float *const *os) {
#if defined(__AVX512F__)
    __m512 acc[WS_QUERIES][4];
    for (int q = 0; q < NQ; q++)
        for (int j = 0; j < 4; j++) acc[q][j] = _mm512_loadu_ps(os[q] + i0 + 16 * j);
    for (int p = p0; p < p1; p++) {
        const sy_half *v = values + (size_t)p * hd + i0;
        _mm_prefetch((const char *)(v + ATT_AHEAD * hd), _MM_HINT_T0);
        _mm_prefetch((const char *)(v + ATT_AHEAD * hd + 32), _MM_HINT_T0);
        __m512 vj[4];
        for (int j = 0; j < 4; j++) vj[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v + 16 * j)));
        for (int q = 0; q < NQ; q++) {
            const __m512 w = _mm512_set1_ps(ws[q][p]);
            for (int j = 0; j < 4; j++) acc[q][j] = _mm512_add_ps(acc[q][j], _mm512_mul_ps(w, vj[j]));
        }
    }
    for (int q = 0; q < NQ; q++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(os[q] + i0 + 16 * j, acc[q][j]);
#else
    /* 16 registers: the 64 dimensions in two halves of 32. */
    for (int h = i0; h < i0 + 64; h += 32) {
        __m256 acc[WS_QUERIES][4];
        for (int q = 0; q < NQ; q++)
            for (int j = 0; j < 4; j++) acc[q][j] = _mm256_loadu_ps(os[q] + h + 8 * j);
        for (int p = p0; p < p1; p++) {
            const sy_half *v = values + (size_t)p * hd + h;
            _mm_prefetch((const char *)(v + ATT_AHEAD * hd), _MM_HINT_T0);
            __m256 vj[4];
            for (int j = 0; j < 4; j++) vj[j] = load8h(v + 8 * j);
            for (int q = 0; q < NQ; q++) {
                const __m256 w = _mm256_set1_ps(ws[q][p]);
                for (int j = 0; j < 4; j++) acc[q][j] = _mm256_add_ps(acc[q][j], _mm256_mul_ps(w, vj[j]));
            }
        }
        for (int q = 0; q < NQ; q++)
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(os[q] + h + 8 * j, acc[q][j]);
    }
#endif
}

/* weighted_sums64 for nq (1 .. WS_QUERIES) queries. */
static void weighted_sums(const float *const *ws, int nq, int p0, int p1, const sy_half *values,
                          int hd, int i0, float *const *os) {
    if (nq == 3) weighted_sums64(ws, 3, p0, p1, values, hd, i0, os);
    else if (nq == 2) weighted_sums64(ws, 2, p0, p1, values, hd, i0, os);
    else weighted_sums64(ws, 1, p0, p1, values, hd, i0, os);
}
#endif

#if SY_AVX2 && defined(__AVX512F__) && defined(__AVX512DQ__)
#define SCORES_X2 1
/* _mm256_hadd_ps in each 256-bit half: [a0+a1, a2+a3, b0+b1, b2+b3] per 128 bits. */
static inline __m512 hadd_halves(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xdd));
}

/*
 * The scores of positions p .. p + 7 for two queries at once, query a in the low
 * 256 bits and b in the high: each half gets exactly the operations attend_one's
 * 8-wide loop and hsum8 give one query (the same fused multiply-adds per lane,
 * the same pairwise sums in the same order), so the same bits, at twice the width.
 */
static inline void scores8x2(const float *qa, const float *qb, const sy_half *keys, int p, int hd,
                             float scale, __m256 *sa, __m256 *sb) {
    __m512 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
    for (int i = 0; i < 8 * hd; i += 32) /* 32 halves: one cache line */
        _mm_prefetch((const char *)(keys + (size_t)(p + ATT_AHEAD) * hd + i), _MM_HINT_T0);
    for (int d = 0; d < hd; d += 8) {
        const __m512 qv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qa + d)),
                                             _mm256_loadu_ps(qb + d), 1);
        for (int j = 0; j < 8; j++) {
            const __m512 k = _mm512_broadcast_f32x8(load8h(keys + (size_t)(p + j) * hd + d));
            acc[j] = _mm512_fmadd_ps(qv, k, acc[j]);
        }
    }
    const __m512 u0 = hadd_halves(hadd_halves(acc[0], acc[1]), hadd_halves(acc[2], acc[3]));
    const __m512 u1 = hadd_halves(hadd_halves(acc[4], acc[5]), hadd_halves(acc[6], acc[7]));
    /* hsum8's last step in each half: low 128 bits of u0 and u1 plus their high 128 bits */
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(u0, lo, u1), _mm512_permutex2var_ps(u0, hi, u1));
    const __m512 sc = _mm512_mul_ps(sum, _mm512_set1_ps(scale));
    *sa = _mm512_castps512_ps256(sc);
    *sb = _mm512_extractf32x8_ps(sc, 1);
}
#else
#define SCORES_X2 0
#endif

#if SY_AVX2 && defined(__AVX512F__) && defined(__AVX512VL__)
#define SCORES_X3 1
/*
 * The scores of positions p .. p + 7 for three queries (the heads of a group)
 * at once, each key converted once for the three: per query exactly the
 * operations of attend_one's 8-wide loop (the same fused multiply-adds per
 * lane, hsum8, the scale), in 24 of AVX-512's 32 vector registers.
 */
static inline void scores8x3(const float *const *q, const sy_half *keys, int p, int hd, float scale,
                             __m256 out[3]) {
    __m256 acc[3][8];
    for (int a = 0; a < 3; a++)
        for (int j = 0; j < 8; j++) acc[a][j] = _mm256_setzero_ps();
    for (int i = 0; i < 8 * hd; i += 32) /* 32 halves: one cache line */
        _mm_prefetch((const char *)(keys + (size_t)(p + ATT_AHEAD) * hd + i), _MM_HINT_T0);
    for (int d = 0; d < hd; d += 8) {
        const __m256 q0 = _mm256_loadu_ps(q[0] + d), q1 = _mm256_loadu_ps(q[1] + d);
        const __m256 q2 = _mm256_loadu_ps(q[2] + d);
        for (int j = 0; j < 8; j++) {
            const __m256 k = load8h(keys + (size_t)(p + j) * hd + d);
            acc[0][j] = _mm256_fmadd_ps(q0, k, acc[0][j]);
            acc[1][j] = _mm256_fmadd_ps(q1, k, acc[1][j]);
            acc[2][j] = _mm256_fmadd_ps(q2, k, acc[2][j]);
        }
    }
    const __m256 sv = _mm256_set1_ps(scale);
    for (int a = 0; a < 3; a++) out[a] = _mm256_mul_ps(hsum8(acc[a]), sv);
}
#else
#define SCORES_X3 0
#endif

/* One (row, head), as described above. Returns 0, or -1 if out of memory. */
static int attend_one(const float *qr, const sy_half *keys, const sy_half *values, int n, int hd,
                      float scale, float *o) {
    float local[1024];
    float *scores = n <= 1024 ? local : malloc(sizeof(float) * (size_t)n);
    if (!scores) return -1;
    float top = -INFINITY;
    int p = 0;
#if SY_AVX2
    if (hd % 8 == 0) {
        /* Scores of 8 positions at a time, their sums gathered in one vector. */
        const __m256 sv = _mm256_set1_ps(scale);
        __m256 tops = _mm256_set1_ps(-INFINITY);
        for (; p + 8 <= n; p += 8) {
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int i = 0; i < hd; i += 8) {
                const __m256 qv = _mm256_loadu_ps(qr + i);
                for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_fmadd_ps(qv, load8h(keys + (size_t)(p + j) * hd + i), acc[j]);
            }
            const __m256 sc = _mm256_mul_ps(hsum8(acc), sv);
            _mm256_storeu_ps(scores + p, sc);
            tops = _mm256_max_ps(tops, sc);
        }
        float t8[8];
        _mm256_storeu_ps(t8, tops);
        for (int j = 0; j < 8; j++) top = t8[j] > top ? t8[j] : top;
    }
#endif
    for (int tail = p; tail < n; tail++) {
        scores[tail] = dot_half(qr, keys + (size_t)tail * hd, hd) * scale;
        top = scores[tail] > top ? scores[tail] : top;
    }
    softmax_weights(scores, n, top);
    int i0 = 0;
#if SY_AVX2
    /* The output in registers, 64 dimensions at a time: each o[i] gets the same
       products, added in the same order, as in the loop below. */
    for (; i0 + 64 <= hd; i0 += 64) {
        for (int i = i0; i < i0 + 64; i++) o[i] = 0.0f;
        const float *ws[1] = {scores};
        float *os[1] = {o};
        weighted_sums(ws, 1, 0, n, values, hd, i0, os);
    }
#endif
    for (int i = i0; i < hd; i++) o[i] = 0.0f;
    for (int p = 0; p < n && i0 < hd; p++) {
        const float w = scores[p];
        const sy_half *v = values + (size_t)p * hd;
        for (int i = i0; i < hd; i++) o[i] += w * half_to_float(v[i]);
    }
    if (scores != local) free(scores);
    return 0;
}

#if SY_AVX2
/*
 * nr (<= ATT_ROWS * ATT_GROUP) queries over the same keys and values (rows of
 * one slot, times the heads of one group): qs[i], ns[i] and os[i] are query
 * i's vector, length and output; hd a multiple of 64. The operations of
 * attend_one for each query, in its order, with the keys and values read a
 * tile at a time for all queries. Returns 0, or -1 if out of memory.
 */
static int attend_rows(const float *const *qs, const int *ns, float *const *os, int nr,
                       const sy_half *keys, const sy_half *values, int hd, float scale) {
    int nmax = 0, all = 0;
    for (int i = 0; i < nr; i++) nmax = ns[i] > nmax ? ns[i] : nmax, all += ns[i];
    float *buffer = malloc(sizeof(float) * (size_t)all);
    if (!buffer) return -1;
    float *scores[ATT_ROWS * ATT_GROUP];
    __m256 tops[ATT_ROWS * ATT_GROUP];
    const __m256 sv = _mm256_set1_ps(scale);
    for (int i = 0, at = 0; i < nr; at += ns[i], i++) {
        scores[i] = buffer + at;
        tops[i] = _mm256_set1_ps(-INFINITY);
    }
    for (int t0 = 0; t0 < nmax; t0 += ATT_TILE) {
        int from[ATT_ROWS * ATT_GROUP]; /* where each query's scores of this tile go on alone */
        for (int i = 0; i < nr; i++) from[i] = t0;
        int g = 0; /* the first query not yet in a group of 3 or a pair */
#if SCORES_X3
        for (; g + 2 < nr; g += 3) {
            int both = t0 + ATT_TILE;
            for (int j = g; j < g + 3; j++) both = ns[j] < both ? ns[j] : both;
            int p = t0;
            for (; p + 8 <= both; p += 8) {
                __m256 sc[3];
                scores8x3(qs + g, keys, p, hd, scale, sc);
                for (int j = 0; j < 3; j++) {
                    _mm256_storeu_ps(scores[g + j] + p, sc[j]);
                    tops[g + j] = _mm256_max_ps(tops[g + j], sc[j]);
                }
            }
            from[g] = from[g + 1] = from[g + 2] = p;
        }
#endif
#if SCORES_X2
        for (; g + 1 < nr; g += 2) {
            const int i = g;
            const int ea = t0 + ATT_TILE < ns[i] ? t0 + ATT_TILE : ns[i];
            const int eb = t0 + ATT_TILE < ns[i + 1] ? t0 + ATT_TILE : ns[i + 1];
            const int both = ea < eb ? ea : eb;
            int p = t0;
            for (; p + 8 <= both; p += 8) {
                __m256 sa, sb;
                scores8x2(qs[i], qs[i + 1], keys, p, hd, scale, &sa, &sb);
                _mm256_storeu_ps(scores[i] + p, sa);
                _mm256_storeu_ps(scores[i + 1] + p, sb);
                tops[i] = _mm256_max_ps(tops[i], sa);
                tops[i + 1] = _mm256_max_ps(tops[i + 1], sb);
            }
            from[i] = from[i + 1] = p;
        }
#endif
        (void)g; /* unused where neither kernel builds (AVX2 alone) */
        for (int i = 0; i < nr; i++) {
            const int end = t0 + ATT_TILE < ns[i] ? t0 + ATT_TILE : ns[i];
            for (int p = from[i]; p + 8 <= end; p += 8) {
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
                for (int k = 0; k < 8 * hd && !SCORES_X2; k += 32)
                    _mm_prefetch((const char *)(keys + (size_t)(p + ATT_AHEAD) * hd + k), _MM_HINT_T0);
                for (int d = 0; d < hd; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qs[i] + d);
                    for (int j = 0; j < 8; j++)
                        acc[j] = _mm256_fmadd_ps(qv, load8h(keys + (size_t)(p + j) * hd + d), acc[j]);
                }
                const __m256 sc = _mm256_mul_ps(hsum8(acc), sv);
                _mm256_storeu_ps(scores[i] + p, sc);
                tops[i] = _mm256_max_ps(tops[i], sc);
            }
        }
    }
    for (int i = 0; i < nr; i++) {
        const int n = ns[i];
        float top = -INFINITY, t8[8];
        _mm256_storeu_ps(t8, tops[i]);
        for (int j = 0; j < 8; j++) top = t8[j] > top ? t8[j] : top;
        for (int tail = n / 8 * 8; tail < n; tail++) {
            scores[i][tail] = dot_half(qs[i], keys + (size_t)tail * hd, hd) * scale;
            top = scores[i][tail] > top ? scores[i][tail] : top;
        }
        softmax_weights(scores[i], n, top);
        for (int d = 0; d < hd; d++) os[i][d] = 0.0f;
    }
    /* The weighted sums a tile at a time, WS_QUERIES queries at once over the
       positions they all have in it, then each alone over the rest of its own:
       each query still adds its positions in order. */
    for (int t0 = 0; t0 < nmax; t0 += ATT_TILE) {
        for (int i = 0; i < nr; i += WS_QUERIES) {
            const int nq = nr - i < WS_QUERIES ? nr - i : WS_QUERIES;
            int common = t0 + ATT_TILE;
            for (int j = i; j < i + nq; j++) common = ns[j] < common ? ns[j] : common;
            for (int i0 = 0; i0 < hd && t0 < common; i0 += 64)
                weighted_sums((const float *const *)scores + i, nq, t0, common, values, hd, i0, os + i);
            for (int j = i; j < i + nq; j++) {
                const int end = t0 + ATT_TILE < ns[j] ? t0 + ATT_TILE : ns[j];
                const int start = common > t0 ? common : t0;
                for (int i0 = 0; i0 < hd && start < end; i0 += 64)
                    weighted_sums((const float *const *)scores + j, 1, start, end, values, hd, i0, os + j);
            }
        }
    }
    free(buffer);
    return 0;
}
#endif

/* nq queries over the same keys and values (attend_rows, or attend_one for one). */
static int attend_queries(const float *const *qs, const int *ns, float *const *os, int nq,
                          const sy_half *keys, const sy_half *values, int hd, float scale) {
#if SY_AVX2
    if (nq > 1) return attend_rows(qs, ns, os, nq, keys, values, hd, scale);
#endif
    return attend_one(qs[0], keys, values, ns[0], hd, scale, os[0]);
}

int sy_decode_attention(const float *q, int rows, int q_stride, int heads, int kv_heads, int hd,
                        const sy_half *kv, int length, const int64_t *slots,
                        const int64_t *lengths, float scale, float *out) {
    const int group = heads / kv_heads;
    const size_t head_size = (size_t)length * hd, slot_size = 2 * (size_t)kv_heads * head_size;
    /* Runs of up to ATT_ROWS rows of one slot at consecutive positions. */
    int *starts = malloc(sizeof(int) * ((size_t)rows + 1));
    if (!starts) return -1;
    int runs = 0;
    for (int r = 0; r < rows; r++) {
        const int joins = SY_AVX2 && hd % 64 == 0 && r > 0 && r - starts[runs - 1] < ATT_ROWS &&
                          slots[r] == slots[r - 1] && lengths[r] == lengths[r - 1] + 1;
        if (!joins) starts[runs++] = r;
    }
    starts[runs] = rows;
    int failed = 0;
    /* One task per run and group of heads sharing keys and values: they are read
       from memory once for the group's queries, not once per head. */
    const int tile = SY_AVX2 && hd % 64 == 0 && group <= ATT_GROUP;
    const int per = tile ? group : 1, tasks = runs * (heads / per);
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 2 && !omp_in_parallel())
    for (int task = 0; task < tasks; task++) {
        const int run = task / (heads / per), h0 = task % (heads / per) * per, g = h0 / group;
        const int r0 = starts[run], nr = starts[run + 1] - r0;
        const sy_half *keys = kv + (size_t)slots[r0] * slot_size + (size_t)g * head_size;
        const sy_half *values = keys + (size_t)kv_heads * head_size;
        const float *qs[ATT_ROWS * ATT_GROUP];
        float *os[ATT_ROWS * ATT_GROUP];
        int ns[ATT_ROWS * ATT_GROUP], nq = 0;
        for (int i = 0; i < nr; i++) {
            for (int h = h0; h < h0 + per; h++, nq++) {
                qs[nq] = q + (size_t)(r0 + i) * q_stride + (size_t)h * hd;
                os[nq] = out + ((size_t)(r0 + i) * heads + h) * hd;
                ns[nq] = (int)lengths[r0 + i];
            }
        }
        if (attend_queries(qs, ns, os, nq, keys, values, hd, scale)) failed = 1;
    }
    free(starts);
    return failed ? -1 : 0;
}

/*
 * Rotary embedding and the cache write of one step's rows, in place.
 *
 * qkv: [rows, (heads + 2 * kv_heads) * hd] with row stride row_stride; the
 * first heads + kv_heads heads (q, then k) hold each rotated pair side by
 * side and turn by freqs[positions[r]] ([max_positions, hd / 2, 2]: cos,
 * sin). Then the keys and values of row r go to position positions[r] of
 * slot slots[r] of kv ([slots, 2 * kv_heads, length, hd]).
 */
/* One head's rotary embedding, in place: each pair turned by f's (cos, sin). */
static inline void rope_head(float *x, const float *f, int half) {
    for (int i = 0; i < half; i++) {
        const float a = x[2 * i], b = x[2 * i + 1], c = f[2 * i], s = f[2 * i + 1];
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

void sy_rope_store(float *qkv, int rows, int row_stride, int heads, int kv_heads, int hd,
                   const int64_t *positions, const int64_t *slots, const float *freqs,
                   sy_half *kv, int length) {
    const int rotated = heads + kv_heads, half = hd / 2;
#pragma omp parallel for schedule(static) if (rows > 8 && !omp_in_parallel())
    for (int r = 0; r < rows; r++) {
        float *row = qkv + (size_t)r * row_stride;
        const float *f = freqs + (size_t)positions[r] * hd;
        for (int h = 0; h < rotated; h++) rope_head(row + (size_t)h * hd, f, half);
        sy_half *slot = kv + (size_t)slots[r] * 2 * kv_heads * length * hd;
        for (int h = 0; h < 2 * kv_heads; h++)
            store_half(slot + ((size_t)h * length + (size_t)positions[r]) * hd,
                       row + (size_t)(heads + h) * hd, hd);
    }
}

/* -- a whole decoding step's layers in one call -------------------------------- */

typedef struct {
    const uint8_t *codes; /* panels (sy_pgemm) */
    const uint16_t *d, *m;
    int kind, n, k;
} sy_matrix;

typedef struct {
    const float *norm1, *norm2;
    float eps1, eps2;
    const float *qkv_bias; /* NULL: none */
    sy_matrix qkv, o, gate_up, down;
    sy_half *kv; /* this layer's cache, [slots, 2 * kv_heads, length, hd], half floats */
} sy_layer;

int sy_layer_size(void) { return (int)sizeof(sy_layer); }

static int matmul(const sy_matrix *w, const float *x, int rows, float *y) {
    return sy_pgemm(w->kind, x, rows, w->k, w->codes, w->d, w->m, w->n, y);
}

/*
 * The layers for rows of a step (see sy_decode_layers), with the threads the caller
 * runs. With failed (not NULL) it is one thread's share of the rows of a step split
 * between the threads of a parallel region whose rows may share slots (a prompt
 * being prefilled): the threads meet after every layer's cache write, so that
 * each row attends keys and values of its slot that other threads stored, and
 * every thread meets as often as the others whatever fails (*failed is shared).
 */
static int layers_of_rows(const sy_layer *layers, int n_layers, float *x, float *delta, int rows,
                          int hidden, int heads, int kv_heads, int hd, int inter,
                          const int64_t *positions, const int64_t *slots, const int64_t *lengths,
                          const float *freqs, int length, float scale, int *failed) {
    const int width = (heads + 2 * kv_heads) * hd;
    float *h = malloc(sizeof(float) * (size_t)rows * hidden);
    float *qkv = malloc(sizeof(float) * (size_t)rows * width);
    float *attn = malloc(sizeof(float) * (size_t)rows * heads * hd);
    float *out = malloc(sizeof(float) * (size_t)rows * hidden);
    float *gate_up = malloc(sizeof(float) * (size_t)rows * 2 * inter);
    float *act = malloc(sizeof(float) * (size_t)rows * inter);
    int status = h && qkv && attn && out && gate_up && act ? 0 : -1;
    if (failed) {
        if (status) {
#pragma omp atomic write
            *failed = 1;
        }
#pragma omp barrier
        int any;
#pragma omp atomic read
        any = *failed;
        status = any ? -1 : 0; /* all go on, or all stop: no thread left at a barrier */
    }
    for (int l = 0; l < n_layers && (failed || !status); l++) {
        const sy_layer *L = layers + l;
        if (!status) {
            sy_add_rms_norm(x, l ? delta : NULL, rows, hidden, L->norm1, L->eps1, h);
            status = matmul(&L->qkv, h, rows, qkv);
        }
        if (!status) {
            if (L->qkv_bias)
                for (int r = 0; r < rows; r++)
                    for (int i = 0; i < width; i++) qkv[(size_t)r * width + i] += L->qkv_bias[i];
            sy_rope_store(qkv, rows, width, heads, kv_heads, hd, positions, slots, freqs, L->kv,
                          length);
        }
        if (failed) {
#pragma omp barrier
        }
        if (!status)
            status = sy_decode_attention(qkv, rows, width, heads, kv_heads, hd, L->kv, length,
                                         slots, lengths, scale, attn);
        if (!status) status = matmul(&L->o, attn, rows, out);
        if (!status) {
            sy_add_rms_norm(x, out, rows, hidden, L->norm2, L->eps2, h);
            status = matmul(&L->gate_up, h, rows, gate_up);
        }
        if (!status) {
            sy_silu_mul(gate_up, rows, inter, act);
            status = matmul(&L->down, act, rows, delta);
        }
    }
    free(h), free(qkv), free(attn), free(out), free(gate_up), free(act);
    return status;
}

#if SY_PANELS
/* matmul by the caller's team, each thread quantizing x into its own xq. */
static void matmul_team(const sy_matrix *w, const float *x, int rows, float *y, block_q16 *xq) {
    pgemm_team(w->kind, x, rows, w->k, w->codes, w->d, w->m, w->n, y, xq, 1);
}

/*
 * layers_of_rows for a few decoding rows (each in a slot of its own, at most
 * PRIVATE_ROWS), in one parallel region for the whole step instead of one per
 * product and attention: about 150 regions a step, each a start and an end
 * where a thread waits for the other, become 5 barriers a layer. Each thread
 * keeps its own copy of the residual stream and does the norms and the SiLU
 * on all rows itself (a few KiB: less than a barrier costs); the products
 * and attention are shared out. A row's rotary embedding and cache write are
 * done by the task that attends with its group of heads, which no other task
 * reads (a slot of its own). The operations on every value are those of
 * layers_of_rows, in the same order: the same bits.
 */
static int layers_in_team(const sy_layer *layers, int n_layers, float *x, float *delta, int rows,
                          int hidden, int heads, int kv_heads, int hd, int inter,
                          const int64_t *positions, const int64_t *slots, const int64_t *lengths,
                          const float *freqs, int length, float scale, int threads) {
    const int width = (heads + 2 * kv_heads) * hd, group = heads / kv_heads, half = hd / 2;
    const int per = SY_AVX2 && hd % 64 == 0 ? group : 1; /* queries attended together */
    const size_t head_size = (size_t)length * hd, slot_size = 2 * (size_t)kv_heads * head_size;
    int widest = hidden > heads * hd ? hidden : heads * hd;
    widest = widest > inter ? widest : inter;
    const size_t xq_size = (size_t)(widest / QK) * rows;
    const size_t own = (size_t)rows * (2 * (size_t)hidden + inter); /* stream, norm, SiLU */
    float *qkv = malloc(sizeof(float) * (size_t)rows * (width + heads * hd + hidden + 2 * inter));
    float *privates = malloc(sizeof(float) * own * threads);
    block_q16 *xqs = malloc(sizeof(block_q16) * xq_size * threads);
    if (!qkv || !privates || !xqs) {
        free(qkv), free(privates), free(xqs);
        return -1;
    }
    float *attn = qkv + (size_t)rows * width, *out = attn + (size_t)rows * heads * hd;
    float *gate_up = out + (size_t)rows * hidden;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        float *xr = privates + own * t, *h = xr + (size_t)rows * hidden;
        float *act = h + (size_t)rows * hidden;
        block_q16 *xq = xqs + xq_size * t;
        memcpy(xr, x, sizeof(float) * (size_t)rows * hidden);
        for (int l = 0; l < n_layers; l++) {
            const sy_layer *L = layers + l;
            sy_add_rms_norm(xr, l ? delta : NULL, rows, hidden, L->norm1, L->eps1, h);
            matmul_team(&L->qkv, h, rows, qkv, xq);
#pragma omp for schedule(dynamic, 1)
            for (int task = 0; task < rows * kv_heads; task++) {
                const int r = task / kv_heads, g = task % kv_heads;
                float *row = qkv + (size_t)r * width;
                const float *f = freqs + (size_t)positions[r] * hd;
                const int heads_of[3] = {g * group, heads + g, heads + kv_heads + g};
                const int count_of[3] = {group, 1, 1}; /* queries, key, value */
                for (int part = 0; part < 3 && L->qkv_bias; part++)
                    for (int i = heads_of[part] * hd; i < (heads_of[part] + count_of[part]) * hd; i++)
                        row[i] += L->qkv_bias[i];
                for (int part = 0; part < 2; part++)
                    for (int j = 0; j < count_of[part]; j++)
                        rope_head(row + (size_t)(heads_of[part] + j) * hd, f, half);
                sy_half *keys = L->kv + (size_t)slots[r] * slot_size + (size_t)g * head_size;
                sy_half *values = keys + (size_t)kv_heads * head_size;
                store_half(keys + (size_t)positions[r] * hd, row + (size_t)(heads + g) * hd, hd);
                store_half(values + (size_t)positions[r] * hd, row + (size_t)(heads + kv_heads + g) * hd,
                           hd);
                const float *qs[ATT_GROUP];
                float *os[ATT_GROUP];
                int ns[ATT_GROUP];
                for (int j = 0; j < group; j++) {
                    qs[j] = row + (size_t)(g * group + j) * hd;
                    os[j] = attn + ((size_t)r * heads + g * group + j) * hd;
                    ns[j] = (int)lengths[r];
                }
                for (int j = 0; j < group; j += per) /* as sy_decode_attention's tasks */
                    if (attend_queries(qs + j, ns + j, os + j, per, keys, values, hd, scale)) {
#pragma omp atomic write
                        failed = 1;
                    }
            }
            matmul_team(&L->o, attn, rows, out, xq);
            sy_add_rms_norm(xr, out, rows, hidden, L->norm2, L->eps2, h);
            matmul_team(&L->gate_up, h, rows, gate_up, xq);
            sy_silu_mul(gate_up, rows, inter, act);
            matmul_team(&L->down, act, rows, delta, xq);
        }
        if (t == 0) memcpy(x, xr, sizeof(float) * (size_t)rows * hidden);
    }
    free(qkv), free(privates), free(xqs);
    return failed ? -1 : 0;
}
#endif

#define SPLIT_ROWS 2 /* a step's rows per thread from which threads split rows */

/*
 * Every layer of a step of rows (one token each, in slot slots[r] at position
 * positions[r], attending positions 0 .. lengths[r] - 1): the same calls, in
 * the same order, as LlamaRuntime.forward makes one by one, without a trip
 * through Python between them. A prompt token being prefilled is a row like a
 * decoding one: every row's keys and values are stored (sy_rope_store) before
 * any row attends, so each attends its slot causally, and its bits are those
 * of the same token decoded alone. x [rows, hidden] is the residual stream,
 * updated in place; delta [rows, hidden] receives the last layer's MLP output,
 * not yet added to x (as forward leaves it). Returns 0, -1 if out of memory,
 * -2 without panels.
 *
 * A step of SPLIT_ROWS or more rows a thread is split by rows: each thread
 * takes its share of the rows through every layer alone, and the threads meet
 * once, at the end, instead of at each of the step's few hundred matrix
 * products and attentions. A worker shares
 * its cores with the API, Redis and the clients: where the OS takes a core
 * from one thread for a few milliseconds, the other goes on with its rows
 * instead of waiting at the next barrier. Each row gets the same operations
 * either way (its arithmetic never depends on the rows beside it), so the
 * same bits. A step with a prompt being prefilled (rows sharing a slot) is
 * split by rows too, and the threads meet once a layer, after every row's
 * keys and values are stored, before any row attends. A step of fewer
 * decoding rows, or of TEAM_ROWS at most, runs in one parallel region
 * (layers_in_team): each product's outputs and each attention are shared
 * out, with 5 barriers a layer. One of fewer rows with a prompt splits each
 * product's outputs between the threads, in a parallel region of its own.
 *
 * TEAM_ROWS is 4, one register tile of two panels: split 2 + 2, each
 * thread's tiles hold 2 rows, whose products wait on each other's latency,
 * and each thread reads every weight. With AVX2 alone, on a Zen 2 EPYC
 * (2026-12-03, steps of the same rows, the two libraries taken in turn,
 * medians of 8 rounds) 4 rows took 9.13 ms in the region against 10.24
 * split 2 + 2; 5 rows 12.94 against 11.79 (two tiles there, 4 + 1). With
 * AVX512-VNNI: on a Zen 5 EPYC (2026-12-06, python -m bench.engine
 * --concurrency 4, the two libraries in turn, three rounds) 4-row steps took
 * 3.94 / 3.48 / 3.46 ms (median of ~410) in the region against 4.82 / 4.41 /
 * 4.53 split, and the engine gave 890 / 1019 / 1038 tok/s at 4 clients
 * against 748 / 816 / 797; on a Zen 4 (2026-12-06) 5.82 against 5.96 ms.
 * In the region, 5 rows gained nothing on the Zen 5, 6 rows were mixed, 7 and
 * 8 rows slower, 8 with tiles of 8 rows too (5.60 / 5.90 against 5.35 / 5.55 ms):
 * the split's threads meet once a step instead of 5 times a layer. On a Zen 4
 * (2026-12-07, TEAM_ROWS 8 against 4, steps alone) 5 and 7 rows were 5-18 %
 * faster in the region (the split gives one thread a row more), 6 and 8 even,
 * but neither the engine nor the farm at 8 clients gained (bench/README.md).
 */
int sy_decode_layers(const sy_layer *layers, int n_layers, float *x, float *delta, int rows,
                     int hidden, int heads, int kv_heads, int hd, int inter,
                     const int64_t *positions, const int64_t *slots, const int64_t *lengths,
                     const float *freqs, int length, float scale) {
    const int team = omp_in_parallel() ? 1 : omp_get_max_threads();
    int distinct = 1;
    for (int r = 1; r < rows && distinct; r++)
        for (int s = 0; s < r && distinct; s++)
            if (slots[s] == slots[r]) distinct = 0;
    const int threads = rows / SPLIT_ROWS < team ? rows / SPLIT_ROWS : team;
#if SY_PANELS
    const int group = heads / kv_heads;
    if ((threads <= 1 || rows <= TEAM_ROWS) && team > 1 && distinct && rows <= PRIVATE_ROWS &&
        group <= ATT_GROUP)
        return layers_in_team(layers, n_layers, x, delta, rows, hidden, heads, kv_heads, hd, inter,
                              positions, slots, lengths, freqs, length, scale, team);
#endif
    if (threads <= 1)
        return layers_of_rows(layers, n_layers, x, delta, rows, hidden, heads, kv_heads, hd, inter,
                              positions, slots, lengths, freqs, length, scale, NULL);
    int status = 0, failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        const int r0 = rows * t / n, r1 = rows * (t + 1) / n;
        /* Every thread has rows (threads <= rows), and meets the others where needed. */
        const int mine =
            layers_of_rows(layers, n_layers, x + (size_t)r0 * hidden, delta + (size_t)r0 * hidden,
                           r1 - r0, hidden, heads, kv_heads, hd, inter, positions + r0,
                           slots + r0, lengths + r0, freqs, length, scale,
                           distinct ? NULL : &failed);
        if (mine) {
#pragma omp atomic write
            status = mine;
        }
    }
    return status;
}
