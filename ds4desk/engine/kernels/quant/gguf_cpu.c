/* CPU kernels for matmuls on GGUF-packed weights: y = x @ dequantize(W)^T with x float32.
 *
 * The weight stays as the file's GGML blocks: uint8 [rows, row_bytes], blocks running along a row.
 * Two entry points, both called from gguf_cpu.py with raw data pointers (the Python side checks
 * dtypes, shapes and strides before it calls, so nothing here is exposed to unchecked input):
 *
 *   gemv(type, w, w_stride, rows, cols, x, T, x_stride, y, y_stride, threads)
 *       y[t, r] = sum_c x[t, c] * W[r, c], decoding each block once for up to four rows of x: the
 *       decode path, reading the packed bytes once per token.
 *   dequantize(type, w, w_stride, rows, cols, dst, threads)
 *       W as float32 [rows, cols] into dst: a prefill tile, which torch.mm then multiplies.
 *
 * Every weight value is computed with the same float32 operations, in the same order, as the torch
 * reference (quant/gguf.py), so the dequantized weights are bit-exact and a matmul differs from the
 * reference by the order of its sums only. FMA contraction is therefore off for this file
 * (-ffp-contract=off); the sums use explicit FMA intrinsics.
 *
 * Two implementations of each type: portable C (any CPU: a block is decoded into a small buffer and
 * dotted; on x86-64 GCC builds it twice, for AVX2 and for the baseline, and the loader picks one), and
 * AVX-512 (F, BW, VL, DQ + F16C, FMA) kernels that decode a block in registers: 4-bit codes index a
 * 16-float table (scale * code + min, built once per block or sub-block) with vpermps, 5-bit codes a
 * 32-float table with vpermt2ps, the rest convert integer codes. The AVX-512 path is picked at run
 * time (cpuid), so one build runs on any x86-64.
 *
 * Threads: OpenMP, splitting rows into chunks that the threads claim one at a time. The extension
 * links libgomp.so.1 by its soname; torch's CPU wheel carries a libgomp with that same soname and
 * loads it first (gguf_cpu.py imports torch before this module), so both share one OpenMP runtime
 * and one thread pool, instead of two pools of spinning threads fighting over the cores.
 * (Measured against a pool of our own, spinning briefly then sleeping on a futex, whose caller never
 * waits for a worker that has not started: on a machine loaded by other programs it avoided the
 * multi-millisecond stalls of the OpenMP barrier in a GEMV alone, but a whole decode step, where
 * torch's own ops wait at the same barriers, was no faster, and a second set of spinning threads
 * takes cores from torch's. So OpenMP it is.)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "GGUF blocks are little-endian; this kernel reads them in place and needs a little-endian CPU"
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(GGUF_CPU_PORTABLE_ONLY)
#define HAVE_AVX512_KERNELS 1
#include <immintrin.h>
#endif

/* GGML type ids (formats.py). */
enum {
    T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30, T_MXFP4 = 39,
};

static const int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                         1,    13,   25,  38,  53,  69,  89,  113};
/* MXFP4's e2m1 values doubled (integers), with a scale halved to match, as GGML decodes it. */
static const int8_t MXFP4_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

typedef struct {
    int type;
    int block_values;
    int block_bytes;
} TypeInfo;

static const TypeInfo TYPES[] = {
    {T_F16, 1, 2},       {T_BF16, 1, 2},      {T_Q4_0, 32, 18},  {T_Q4_1, 32, 20}, {T_Q5_0, 32, 22},
    {T_Q5_1, 32, 24},    {T_Q8_0, 32, 34},    {T_Q2_K, 256, 84}, {T_Q3_K, 256, 110}, {T_Q4_K, 256, 144},
    {T_Q5_K, 256, 176},  {T_Q6_K, 256, 210},  {T_IQ4_NL, 32, 18}, {T_IQ4_XS, 256, 136}, {T_MXFP4, 32, 17},
};

static const TypeInfo *type_info(int type) {
    for (size_t i = 0; i < sizeof(TYPES) / sizeof(TYPES[0]); i++)
        if (TYPES[i].type == type) return &TYPES[i];
    return NULL;
}

/* ---- scalar helpers ------------------------------------------------------------------------------ */

static inline uint16_t u16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline float f32_of_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* IEEE half to float, exactly (subnormals, infinities and NaNs included). */
static inline float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    if (exponent == 0) {
        float magnitude = (float)mantissa * 5.9604644775390625e-08f; /* mantissa * 2^-24, exact */
        uint32_t bits;
        memcpy(&bits, &magnitude, 4);
        return f32_of_bits(bits | sign);
    }
    if (exponent == 31) return f32_of_bits(sign | 0x7F800000u | (mantissa << 13));
    return f32_of_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

static inline float fp16_at(const uint8_t *p) { return fp16_to_f32(u16_at(p)); }

/* MXFP4's halved scale 2^(e - 128): a float32 subnormal for e = 0 and 1. */
static inline float mxfp4_half_scale(uint8_t e) {
    return f32_of_bits(e < 2 ? (uint32_t)(e + 1) << 21 : (uint32_t)(e - 1) << 23);
}

/* Q4_K / Q5_K: sub-block j's 6-bit scale and minimum from the 12 packed bytes. */
static inline void k_scale_min(const uint8_t *p, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = p[j] & 63;
        *min = p[j + 4] & 63;
    } else {
        *scale = (p[j + 4] & 0x0F) | ((p[j - 4] >> 6) << 4);
        *min = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
    }
}

/* Q3_K: sub-block k's 6-bit scale, less 32. */
static inline int q3_k_scale(const uint8_t *p, int k) {
    int low = (p[k % 8] >> (4 * (k / 8))) & 0x0F;
    int top = (p[8 + k % 4] >> (2 * (k / 4))) & 3;
    return (low | (top << 4)) - 32;
}

/* IQ4_XS: sub-block i's 6-bit scale, less 32. */
static inline int iq4_xs_scale(const uint8_t *b, int i) {
    int top = (u16_at(b + 2) >> (2 * i)) & 3;
    int low = (b[4 + i / 2] >> (4 * (i % 2))) & 0x0F;
    return (low | (top << 4)) - 32;
}

typedef struct Gemv Gemv;
typedef void (*GemvFn)(const Gemv *, Py_ssize_t, Py_ssize_t);
typedef void (*DequantFn)(const uint8_t *, int, int, float *);

/* ---- portable decoders: one block to float32, in the reference's order of operations -------------- */

static inline __attribute__((always_inline)) void decode_block(int type, const uint8_t *b, float *out) {
    switch (type) {
    case T_F16:
        out[0] = fp16_at(b);
        return;
    case T_BF16:
        out[0] = f32_of_bits((uint32_t)u16_at(b) << 16);
        return;
    case T_Q4_0: {
        float d = fp16_at(b);
        for (int j = 0; j < 16; j++) {
            out[j] = d * ((float)(b[2 + j] & 0x0F) - 8.0f);
            out[j + 16] = d * ((float)(b[2 + j] >> 4) - 8.0f);
        }
        return;
    }
    case T_Q4_1: {
        float d = fp16_at(b), m = fp16_at(b + 2);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(b[4 + j] & 0x0F) + m;
            out[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
        return;
    }
    case T_Q5_0: {
        float d = fp16_at(b);
        uint32_t high = u32_at(b + 2);
        for (int j = 0; j < 16; j++) {
            int lo = (b[6 + j] & 0x0F) | (int)(((high >> j) & 1) << 4);
            int hi = (b[6 + j] >> 4) | (int)(((high >> (j + 16)) & 1) << 4);
            out[j] = d * ((float)lo - 16.0f);
            out[j + 16] = d * ((float)hi - 16.0f);
        }
        return;
    }
    case T_Q5_1: {
        float d = fp16_at(b), m = fp16_at(b + 2);
        uint32_t high = u32_at(b + 4);
        for (int j = 0; j < 16; j++) {
            int lo = (b[8 + j] & 0x0F) | (int)(((high >> j) & 1) << 4);
            int hi = (b[8 + j] >> 4) | (int)(((high >> (j + 16)) & 1) << 4);
            out[j] = d * (float)lo + m;
            out[j + 16] = d * (float)hi + m;
        }
        return;
    }
    case T_Q8_0: {
        float d = fp16_at(b);
        for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)b[2 + j] * d;
        return;
    }
    case T_IQ4_NL: {
        float d = fp16_at(b);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)IQ4_NL_VALUES[b[2 + j] & 0x0F];
            out[j + 16] = d * (float)IQ4_NL_VALUES[b[2 + j] >> 4];
        }
        return;
    }
    case T_MXFP4: {
        float half_scale = mxfp4_half_scale(b[0]);
        for (int j = 0; j < 16; j++) {
            out[j] = half_scale * (float)MXFP4_DOUBLED[b[1 + j] & 0x0F];
            out[j + 16] = half_scale * (float)MXFP4_DOUBLED[b[1 + j] >> 4];
        }
        return;
    }
    /* The super-block types, sub-block by sub-block: inner loops of a fixed length with no
     * division, which the compiler vectorizes. Sub-block s = 8h + q of 16 values (Q2_K, Q3_K, Q6_K)
     * starts at value 128h + 16q. */
    case T_Q2_K: {
        float d = fp16_at(b + 80), dmin = fp16_at(b + 82);
        for (int s = 0; s < 16; s++) {
            const uint8_t *codes = b + 16 + 32 * (s / 8) + 16 * (s % 2);
            int shift = 2 * ((s % 8) / 2);
            float scale = d * (float)(b[s] & 0x0F), min = dmin * (float)(b[s] >> 4);
            for (int l = 0; l < 16; l++) out[16 * s + l] = scale * (float)((codes[l] >> shift) & 3) - min;
        }
        return;
    }
    case T_Q3_K: {
        float d = fp16_at(b + 108);
        for (int s = 0; s < 16; s++) {
            const uint8_t *codes = b + 32 + 32 * (s / 8) + 16 * (s % 2);
            const uint8_t *high = b + 16 * (s % 2);
            int shift = 2 * ((s % 8) / 2), bit = s / 2;
            float scale = d * (float)q3_k_scale(b + 96, s);
            for (int l = 0; l < 16; l++) {
                int low = (codes[l] >> shift) & 3;
                out[16 * s + l] = scale * (float)(low - 4 * (1 - ((high[l] >> bit) & 1)));
            }
        }
        return;
    }
    case T_Q4_K:
    case T_Q5_K: {
        float d = fp16_at(b), dmin = fp16_at(b + 2);
        const uint8_t *codes = b + (type == T_Q4_K ? 16 : 48);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            k_scale_min(b + 4, j, &sc, &mn);
            float scale = d * (float)sc, min = dmin * (float)mn;
            const uint8_t *at = codes + 32 * (j / 2);
            int shift = 4 * (j % 2);
            if (type == T_Q4_K) {
                for (int l = 0; l < 32; l++) out[32 * j + l] = scale * (float)((at[l] >> shift) & 0x0F) - min;
            } else {
                for (int l = 0; l < 32; l++) {
                    int q = ((at[l] >> shift) & 0x0F) | (((b[16 + l] >> j) & 1) << 4);
                    out[32 * j + l] = scale * (float)q - min;
                }
            }
        }
        return;
    }
    case T_Q6_K: {
        float d = fp16_at(b + 208);
        for (int s = 0; s < 16; s++) {
            int h = s / 8, q = s % 8;
            const uint8_t *low = b + 64 * h + 16 * (q % 4), *high = b + 128 + 32 * h + 16 * (q % 2);
            int low_shift = 4 * (q / 4), high_shift = 2 * (q / 2);
            float scale = d * (float)(int8_t)b[192 + s];
            for (int l = 0; l < 16; l++) {
                int code = ((low[l] >> low_shift) & 0x0F) | (((high[l] >> high_shift) & 3) << 4);
                out[16 * s + l] = scale * ((float)code - 32.0f);
            }
        }
        return;
    }
    case T_IQ4_XS: {
        float d = fp16_at(b);
        for (int s = 0; s < 8; s++) {
            float scale = d * (float)iq4_xs_scale(b, s);
            for (int l = 0; l < 16; l++) {
                out[32 * s + l] = scale * (float)IQ4_NL_VALUES[b[8 + 16 * s + l] & 0x0F];
                out[32 * s + 16 + l] = scale * (float)IQ4_NL_VALUES[b[8 + 16 * s + l] >> 4];
            }
        }
        return;
    }
    }
}

/* The portable path is compiled twice, for AVX2 CPUs and for any x86-64, and the loader picks one
 * (GCC's function multi-versioning); other compilers and CPUs get the plain build. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(GGUF_CPU_PORTABLE_ONLY)
#define PORTABLE_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define PORTABLE_CLONES
#endif

/* Values decoded at a time by the portable path (whole blocks; the plain float types take 256). */
#define CHUNK 256

PORTABLE_CLONES static void portable_dequant_row(const TypeInfo *ti, const uint8_t *row, int cols, float *dst) {
    int blocks = cols / ti->block_values;
    for (int k = 0; k < blocks; k++) decode_block(ti->type, row + (size_t)k * ti->block_bytes, dst + (size_t)k * ti->block_values);
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int n) {
    /* Eight running sums, so the compiler vectorizes without reassociating anything itself. */
    float sums[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) sums[k] += a[i + k] * b[i + k];
    for (; i < n; i++) sums[0] += a[i] * b[i];
    return ((sums[0] + sums[4]) + (sums[1] + sums[5])) + ((sums[2] + sums[6]) + (sums[3] + sums[7]));
}

struct Gemv {
    const TypeInfo *ti;
    const uint8_t *w;
    Py_ssize_t w_stride;
    Py_ssize_t rows;
    int cols;
    const float *x;
    int T;
    Py_ssize_t x_stride;
    float *y;
    Py_ssize_t y_stride;
    GemvFn kernel; /* the rows kernel: AVX-512 or portable */
};

PORTABLE_CLONES static void portable_gemv_rows(const Gemv *g, Py_ssize_t r0, Py_ssize_t r1) {
    const TypeInfo *ti = g->ti;
    float buf[CHUNK];
    int per_chunk = ti->block_values >= CHUNK ? 1 : CHUNK / ti->block_values;
    int values = per_chunk * ti->block_values;
    for (Py_ssize_t r = r0; r < r1; r++) {
        const uint8_t *row = g->w + r * g->w_stride;
        for (int t = 0; t < g->T; t++) g->y[t * g->y_stride + r] = 0.0f;
        for (int c = 0; c < g->cols; c += values) {
            int n = g->cols - c < values ? g->cols - c : values;
            int blocks = n / ti->block_values;
            const uint8_t *at = row + (size_t)(c / ti->block_values) * ti->block_bytes;
            for (int k = 0; k < blocks; k++) decode_block(ti->type, at + (size_t)k * ti->block_bytes, buf + k * ti->block_values);
            for (int t = 0; t < g->T; t++) g->y[t * g->y_stride + r] += dot(buf, g->x + t * g->x_stride + c, n);
        }
    }
}

/* ---- AVX-512 kernels ----------------------------------------------------------------------------- */

#ifdef HAVE_AVX512_KERNELS
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define INLINE_AVX512 static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))

static int cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}

INLINE_AVX512 __m512 bcast_fp16(const uint8_t *p) {
    return _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(u16_at(p))));
}

/* 16 bytes as 16 int32 lanes. */
INLINE_AVX512 __m512i bytes16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

INLINE_AVX512 __m512 iota16(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* Each type's block loop as a macro over EMIT(w0, w1, off): w0, w1 the float32 weights of values
 * off..off+15 and off+16..off+31 of the row. ROW is the row's bytes, BLOCKS its block count. */

/* Blocks whose fp16 scales are converted together, ahead of their codes. */
#define SEGMENT 64

/* The fp16 scale (PAIRS 0) or scale-and-minimum pair (PAIRS 1) at the start of blocks [k0, k0 + n)
 * (n <= SEGMENT) as float32, pairs interleaved. Converting them 16 at a time here, instead of one
 * at a time in the block loop, leaves the loop a broadcast from memory per scale instead of three
 * shuffles; the shuffle ports are what the block loop runs out of first. */
INLINE_AVX512 void fp16_scales(const uint8_t *row, int block_bytes, int k0, int n, int pairs, float *out) {
    if (pairs) {
        uint32_t raw[SEGMENT];
        for (int k = 0; k < n; k++) raw[k] = u32_at(row + (size_t)(k0 + k) * block_bytes);
        for (int k = n; k < ((n + 7) & ~7); k++) raw[k] = 0;
        for (int k = 0; k < n; k += 8)
            _mm512_storeu_ps(out + 2 * k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(raw + k))));
    } else {
        uint16_t raw[SEGMENT];
        for (int k = 0; k < n; k++) raw[k] = u16_at(row + (size_t)(k0 + k) * block_bytes);
        for (int k = n; k < ((n + 15) & ~15); k++) raw[k] = 0;
        for (int k = 0; k < n; k += 16)
            _mm512_storeu_ps(out + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(raw + k))));
    }
}

/* Runs the statements after PAIRS over every block: b_ its bytes, k_ its index, d_ its fp16 scale
 * broadcast as float32 (and m_ the minimum stored right after it, with PAIRS 1). One broadcast load
 * of the 2 (or 4) bytes and one conversion give all 16 lanes. */
#define SCALED_BLOCKS(ROW, BLOCKS, BB, PAIRS, ...)                                                   \
    do {                                                                                             \
        for (int k_ = 0; k_ < (BLOCKS); k_++) {                                                      \
            const uint8_t *b_ = (ROW) + (size_t)k_ * (BB);                                           \
            __m512 d_, m_;                                                                           \
            if (PAIRS) {                                                                             \
                __m512 dm_ = _mm512_cvtph_ps(_mm256_set1_epi32((int)u32_at(b_)));                    \
                d_ = _mm512_moveldup_ps(dm_);                                                        \
                m_ = _mm512_movehdup_ps(dm_);                                                        \
            } else {                                                                                 \
                d_ = _mm512_cvtph_ps(_mm256_set1_epi16((short)u16_at(b_)));                          \
                m_ = d_;                                                                             \
            }                                                                                        \
            (void)m_;                                                                                \
            __VA_ARGS__                                                                              \
        }                                                                                            \
    } while (0)

/* 16 nibble codes in int32 lanes: vpermps reads the low 4 bits of an index, so the low nibbles
 * need no mask and the high ones a shift. */
#define NIBBLE_EMIT(EMIT, CODES_AT, TABLE, OFF)                                                      \
    do {                                                                                             \
        __m512i codes_ = bytes16(CODES_AT);                                                          \
        EMIT(_mm512_permutexvar_ps(codes_, TABLE),                                                   \
             _mm512_permutexvar_ps(_mm512_srli_epi32(codes_, 4), TABLE), OFF);                       \
    } while (0)

#define LOOP_Q4_0(ROW, BLOCKS, EMIT)                                                                 \
    do {                                                                                             \
        const __m512 shifted = _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f));                        \
        SCALED_BLOCKS(ROW, BLOCKS, 18, 0,                                                         \
                         __m512 table_ = _mm512_mul_ps(d_, shifted);            \
                         NIBBLE_EMIT(EMIT, b_ + 2, table_, k_ * 32););                               \
    } while (0)

#define LOOP_Q4_1(ROW, BLOCKS, EMIT)                                                                 \
    do {                                                                                             \
        const __m512 iota_ = iota16();                                                               \
        SCALED_BLOCKS(ROW, BLOCKS, 20, 1,                                                         \
                         __m512 table_ = _mm512_add_ps(_mm512_mul_ps(d_, iota_), \
                                                       m_);             \
                         NIBBLE_EMIT(EMIT, b_ + 4, table_, k_ * 32););                               \
    } while (0)

/* Q5: a 5-bit code indexes the 32-float table (low half: codes 0-15, high half: 16-31). */
#define Q5_EMIT(EMIT, CODES_AT, HIGH, TLO, THI, OFF)                                                 \
    do {                                                                                             \
        const __m512i sixteen_ = _mm512_set1_epi32(16);                                              \
        __m512i codes_ = bytes16(CODES_AT);                                                          \
        __m512i lo_ = _mm512_and_si512(codes_, _mm512_set1_epi32(0x0F));                             \
        __m512i hi_ = _mm512_srli_epi32(codes_, 4);                                                  \
        lo_ = _mm512_mask_or_epi32(lo_, (__mmask16)(HIGH), lo_, sixteen_);                           \
        hi_ = _mm512_mask_or_epi32(hi_, (__mmask16)((HIGH) >> 16), hi_, sixteen_);                   \
        EMIT(_mm512_permutex2var_ps(TLO, lo_, THI), _mm512_permutex2var_ps(TLO, hi_, THI), OFF);     \
    } while (0)

#define LOOP_Q5_0(ROW, BLOCKS, EMIT)                                                                 \
    do {                                                                                             \
        const __m512 low_codes_ = _mm512_sub_ps(iota16(), _mm512_set1_ps(16.0f));                    \
        const __m512 high_codes_ = iota16();                                                         \
        SCALED_BLOCKS(ROW, BLOCKS, 22, 0,                                                         \
                                                           \
                         uint32_t high_ = u32_at(b_ + 2);                                            \
                         __m512 tlo_ = _mm512_mul_ps(d_, low_codes_);                                \
                         __m512 thi_ = _mm512_mul_ps(d_, high_codes_);                               \
                         Q5_EMIT(EMIT, b_ + 6, high_, tlo_, thi_, k_ * 32););                        \
    } while (0)

#define LOOP_Q5_1(ROW, BLOCKS, EMIT)                                                                 \
    do {                                                                                             \
        const __m512 low_codes_ = iota16();                                                          \
        const __m512 high_codes_ = _mm512_add_ps(iota16(), _mm512_set1_ps(16.0f));                   \
        SCALED_BLOCKS(ROW, BLOCKS, 24, 1,                                                         \
                                                       \
                                                   \
                         uint32_t high_ = u32_at(b_ + 4);                                            \
                         __m512 tlo_ = _mm512_add_ps(_mm512_mul_ps(d_, low_codes_), m_);             \
                         __m512 thi_ = _mm512_add_ps(_mm512_mul_ps(d_, high_codes_), m_);            \
                         Q5_EMIT(EMIT, b_ + 8, high_, tlo_, thi_, k_ * 32););                        \
    } while (0)

#define LOOP_Q8_0(ROW, BLOCKS, EMIT)                                                                 \
    do {                                                                                             \
        SCALED_BLOCKS(ROW, BLOCKS, 34, 0,                                                         \
                                                           \
                         __m512 w0_ = _mm512_cvtepi32_ps(                                            \
                             _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b_ + 2))));      \
                         __m512 w1_ = _mm512_cvtepi32_ps(                                            \
                             _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b_ + 18))));     \
                         EMIT(_mm512_mul_ps(w0_, d_), _mm512_mul_ps(w1_, d_), k_ * 32););            \
    } while (0)

/* A 16-float table of integer codes (IQ4_NL's grid, MXFP4's doubled e2m1 values). */
INLINE_AVX512 __m512 grid16(const int8_t *values) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)values)));
}

#define LOOP_IQ4_NL(ROW, BLOCKS, EMIT)                                                               \
    do {                                                                                             \
        const __m512 grid_ = grid16(IQ4_NL_VALUES);                                                  \
        SCALED_BLOCKS(ROW, BLOCKS, 18, 0,                                                         \
                         __m512 table_ = _mm512_mul_ps(d_, grid_);              \
                         NIBBLE_EMIT(EMIT, b_ + 2, table_, k_ * 32););                               \
    } while (0)

#define LOOP_MXFP4(ROW, BLOCKS, EMIT)                                                                \
    do {                                                                                             \
        const __m512 grid_ = grid16(MXFP4_DOUBLED);                                                  \
        for (int k_ = 0; k_ < (BLOCKS); k_++) {                                                      \
            const uint8_t *b_ = (ROW) + (size_t)k_ * 17;                                             \
            __m512 table_ = _mm512_mul_ps(_mm512_set1_ps(mxfp4_half_scale(b_[0])), grid_);           \
            __m512i codes_ = bytes16(b_ + 1);                                                        \
            EMIT(_mm512_permutexvar_ps(codes_, table_),                                              \
                 _mm512_permutexvar_ps(_mm512_srli_epi32(codes_, 4), table_), k_ * 32);              \
        }                                                                                            \
    } while (0)

/* Lane j of v in all 16 lanes. */
INLINE_AVX512 __m512 lane(__m512 v, int j) { return _mm512_permutexvar_ps(_mm512_set1_epi32(j), v); }

/* Q4_K / Q5_K: the 12 packed bytes at p as float32 [d * scale_0..7, dmin * min_0..7], unpacked in
 * one vector (the layout is k_scale_min's): lanes 0-3 and 8-11 take the low 6 bits of bytes 0-3 and
 * 4-7; lanes 4-7 and 12-15 the low and high nibbles of bytes 8-11, with bits 4-5 from the top bit
 * pairs of bytes 0-3 and 4-7. */
INLINE_AVX512 __m512 k_scales_mins(const uint8_t *p, float d, float dmin) {
    const __m512i bytes = bytes16(p);
    const __m512i low_from = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    const __m512i top_from = _mm512_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7);
    const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i masks = _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
    __m512i low = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(low_from, bytes), shifts), masks);
    __m512i top = _mm512_maskz_slli_epi32(0xF0F0, _mm512_srli_epi32(_mm512_permutexvar_epi32(top_from, bytes), 6), 4);
    __m512 factors = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d), _mm512_set1_ps(dmin));
    return _mm512_mul_ps(factors, _mm512_cvtepi32_ps(_mm512_or_si512(low, top)));
}

/* Q4_K / Q5_K: sub-blocks 2c and 2c+1 share code bytes 32c..32c+31 (low / high nibbles). */
#define LOOP_Q4_K(ROW, BLOCKS, EMIT)                                                                 \
    do {                                                                                             \
        const __m512 iota_ = iota16();                                                               \
        for (int k_ = 0; k_ < (BLOCKS); k_++) {                                                      \
            const uint8_t *b_ = (ROW) + (size_t)k_ * 144;                                            \
            const __m512 sm_ = k_scales_mins(b_ + 4, fp16_at(b_), fp16_at(b_ + 2));                  \
            for (int c_ = 0; c_ < 4; c_++) {                                                         \
                __m512 t0_ = _mm512_sub_ps(_mm512_mul_ps(lane(sm_, 2 * c_), iota_), lane(sm_, 8 + 2 * c_)); \
                __m512 t1_ = _mm512_sub_ps(_mm512_mul_ps(lane(sm_, 2 * c_ + 1), iota_),              \
                                           lane(sm_, 9 + 2 * c_));                                   \
                __m512i a_ = bytes16(b_ + 16 + 32 * c_), z_ = bytes16(b_ + 32 + 32 * c_);            \
                EMIT(_mm512_permutexvar_ps(a_, t0_), _mm512_permutexvar_ps(z_, t0_), k_ * 256 + c_ * 64); \
                EMIT(_mm512_permutexvar_ps(_mm512_srli_epi32(a_, 4), t1_),                           \
                     _mm512_permutexvar_ps(_mm512_srli_epi32(z_, 4), t1_), k_ * 256 + c_ * 64 + 32); \
            }                                                                                        \
        }                                                                                            \
    } while (0)

#define LOOP_Q5_K(ROW, BLOCKS, EMIT)                                                                 \
    do {                                                                                             \
        const __m512 iota_ = iota16();                                                               \
        const __m512 iota16_ = _mm512_add_ps(iota16(), _mm512_set1_ps(16.0f));                      \
        const __m512i mask_ = _mm512_set1_epi32(0x0F), sixteen_ = _mm512_set1_epi32(16);             \
        for (int k_ = 0; k_ < (BLOCKS); k_++) {                                                      \
            const uint8_t *b_ = (ROW) + (size_t)k_ * 176;                                            \
            const __m512 sm_ = k_scales_mins(b_ + 4, fp16_at(b_), fp16_at(b_ + 2));                  \
            __m512i ha_ = bytes16(b_ + 16), hz_ = bytes16(b_ + 32);                                  \
            for (int c_ = 0; c_ < 4; c_++) {                                                         \
                const __m512i a_ = bytes16(b_ + 48 + 32 * c_), z_ = bytes16(b_ + 64 + 32 * c_);      \
                for (int f_ = 0; f_ < 2; f_++) {                                                     \
                    const int j_ = 2 * c_ + f_;                                                      \
                    __m512 s_ = lane(sm_, j_), m_ = lane(sm_, 8 + j_);                               \
                    __m512 tlo_ = _mm512_sub_ps(_mm512_mul_ps(s_, iota_), m_);                       \
                    __m512 thi_ = _mm512_sub_ps(_mm512_mul_ps(s_, iota16_), m_);                     \
                    __m512i lo_ = _mm512_and_si512(_mm512_srli_epi32(a_, 4 * f_), mask_);            \
                    __m512i hi_ = _mm512_and_si512(_mm512_srli_epi32(z_, 4 * f_), mask_);            \
                    __m512i bit_ = _mm512_set1_epi32(1 << j_);                                       \
                    lo_ = _mm512_mask_or_epi32(lo_, _mm512_test_epi32_mask(ha_, bit_), lo_, sixteen_); \
                    hi_ = _mm512_mask_or_epi32(hi_, _mm512_test_epi32_mask(hz_, bit_), hi_, sixteen_); \
                    EMIT(_mm512_permutex2var_ps(tlo_, lo_, thi_), _mm512_permutex2var_ps(tlo_, hi_, thi_), \
                         k_ * 256 + j_ * 32);                                                        \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    } while (0)

/* Q6_K: 16-value sub-block s = 8h + q takes low nibbles from ql[64h + 16(q%4) ..] (shift 4(q/4))
 * and high pairs from qh[32h + 16(q%2) ..] (shift 2(q/2)). Sub-blocks q, q+1, q+4, q+5 (q even)
 * share two ql and two qh loads, so one half of a block loads each byte once. */
INLINE_AVX512 __m512 q6_k_values(__m512i low, __m512i high_pairs, int shift, __m512 scale) {
    /* bits 4-5 of the code: the pair at `shift`, moved to bit 4 */
    __m512i high = shift <= 4 ? _mm512_slli_epi32(high_pairs, 4 - shift) : _mm512_srli_epi32(high_pairs, shift - 4);
    __m512i code = _mm512_or_si512(low, _mm512_and_si512(high, _mm512_set1_epi32(0x30)));
    return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_sub_epi32(code, _mm512_set1_epi32(32))));
}

#define LOOP_Q6_K(ROW, BLOCKS, EMIT)                                                                 \
    do {                                                                                             \
        const __m512i nibble_ = _mm512_set1_epi32(0x0F);                                             \
        for (int k_ = 0; k_ < (BLOCKS); k_++) {                                                      \
            const uint8_t *b_ = (ROW) + (size_t)k_ * 210;                                            \
            /* the 16 sub-block scales d * int8, in the order of the reference */                    \
            const __m512 scales_ = _mm512_mul_ps(                                                    \
                _mm512_set1_ps(fp16_at(b_ + 208)),                                                   \
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b_ + 192))))); \
            for (int h_ = 0; h_ < 2; h_++) {                                                         \
                const __m512i h0_ = bytes16(b_ + 128 + 32 * h_), h1_ = bytes16(b_ + 144 + 32 * h_);  \
                for (int q_ = 0; q_ < 4; q_ += 2) {                                                  \
                    const __m512i l0_ = bytes16(b_ + 64 * h_ + 16 * q_);                             \
                    const __m512i l1_ = bytes16(b_ + 64 * h_ + 16 * q_ + 16);                        \
                    const int s_ = 8 * h_ + q_;                                                      \
                    EMIT(q6_k_values(_mm512_and_si512(l0_, nibble_), h0_, q_, lane(scales_, s_)),    \
                         q6_k_values(_mm512_and_si512(l1_, nibble_), h1_, q_, lane(scales_, s_ + 1)), \
                         k_ * 256 + s_ * 16);                                                        \
                    EMIT(q6_k_values(_mm512_srli_epi32(l0_, 4), h0_, q_ + 4, lane(scales_, s_ + 4)), \
                         q6_k_values(_mm512_srli_epi32(l1_, 4), h1_, q_ + 4, lane(scales_, s_ + 5)), \
                         k_ * 256 + (s_ + 4) * 16);                                                  \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    } while (0)

/* Q3_K: sub-block s = 8h + q: low pairs from qs[32h + 16(q%2) ..] at shift 2(q/2), high bits from
 * hmask[16(s%2) ..] at bit s/2; a clear high bit takes 4 off. */
INLINE_AVX512 __m512 q3_k_sub(const uint8_t *b, int s, float d) {
    int h = s / 8, q = s % 8;
    __m512i low = _mm512_and_si512(_mm512_srli_epi32(bytes16(b + 32 + 32 * h + 16 * (q % 2)), 2 * (q / 2)),
                                   _mm512_set1_epi32(3));
    __mmask16 high = _mm512_test_epi32_mask(bytes16(b + 16 * (s % 2)), _mm512_set1_epi32(1 << (s / 2)));
    __m512i code = _mm512_mask_sub_epi32(low, (__mmask16)~high, low, _mm512_set1_epi32(4));
    return _mm512_mul_ps(_mm512_set1_ps(d * (float)q3_k_scale(b + 96, s)), _mm512_cvtepi32_ps(code));
}

#define LOOP_Q3_K(ROW, BLOCKS, EMIT)                                                                 \
    do {                                                                                             \
        for (int k_ = 0; k_ < (BLOCKS); k_++) {                                                      \
            const uint8_t *b_ = (ROW) + (size_t)k_ * 110;                                            \
            float d_ = fp16_at(b_ + 108);                                                            \
            for (int s_ = 0; s_ < 16; s_ += 2)                                                       \
                EMIT(q3_k_sub(b_, s_, d_), q3_k_sub(b_, s_ + 1, d_), k_ * 256 + s_ * 16);            \
        }                                                                                            \
    } while (0)

/* Q2_K: sub-block s = 8h + q: codes from qs[32h + 16(q%2) ..] at shift 2(q/2); a 4-float table. */
INLINE_AVX512 __m512 q2_k_sub(const uint8_t *b, int s, float d, float dmin) {
    int h = s / 8, q = s % 8;
    __m512i code = _mm512_srli_epi32(bytes16(b + 16 + 32 * h + 16 * (q % 2)), 2 * (q / 2));
    __m512 table = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(d * (float)(b[s] & 0x0F)), iota16()),
                                 _mm512_set1_ps(dmin * (float)(b[s] >> 4)));
    /* vpermps reads the low 4 bits of each index: clear bits 2-3 to keep the 2-bit code. */
    return _mm512_permutexvar_ps(_mm512_and_si512(code, _mm512_set1_epi32(3)), table);
}

#define LOOP_Q2_K(ROW, BLOCKS, EMIT)                                                                 \
    do {                                                                                             \
        for (int k_ = 0; k_ < (BLOCKS); k_++) {                                                      \
            const uint8_t *b_ = (ROW) + (size_t)k_ * 84;                                             \
            float d_ = fp16_at(b_ + 80), dmin_ = fp16_at(b_ + 82);                                   \
            for (int s_ = 0; s_ < 16; s_ += 2)                                                       \
                EMIT(q2_k_sub(b_, s_, d_, dmin_), q2_k_sub(b_, s_ + 1, d_, dmin_), k_ * 256 + s_ * 16); \
        }                                                                                            \
    } while (0)

#define LOOP_IQ4_XS(ROW, BLOCKS, EMIT)                                                               \
    do {                                                                                             \
        const __m512 grid_ = grid16(IQ4_NL_VALUES);                                                  \
        for (int k_ = 0; k_ < (BLOCKS); k_++) {                                                      \
            const uint8_t *b_ = (ROW) + (size_t)k_ * 136;                                            \
            float d_ = fp16_at(b_);                                                                  \
            for (int s_ = 0; s_ < 8; s_++) {                                                         \
                __m512 table_ = _mm512_mul_ps(_mm512_set1_ps(d_ * (float)iq4_xs_scale(b_, s_)), grid_); \
                __m512i codes_ = bytes16(b_ + 8 + 16 * s_);                                          \
                EMIT(_mm512_permutexvar_ps(codes_, table_),                                          \
                     _mm512_permutexvar_ps(_mm512_srli_epi32(codes_, 4), table_), k_ * 256 + s_ * 32); \
            }                                                                                        \
        }                                                                                            \
    } while (0)

/* The plain 16-bit floats, 32 values at a time (the AVX-512 path needs cols % 32 == 0). */
#define LOOP_F16(ROW, BLOCKS, EMIT)                                                                  \
    do {                                                                                             \
        for (int k_ = 0; k_ < (BLOCKS) / 32; k_++) {                                                 \
            const uint8_t *b_ = (ROW) + (size_t)k_ * 64;                                             \
            EMIT(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b_)),                           \
                 _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b_ + 32))), k_ * 32);          \
        }                                                                                            \
    } while (0)

#define LOOP_BF16(ROW, BLOCKS, EMIT)                                                                 \
    do {                                                                                             \
        for (int k_ = 0; k_ < (BLOCKS) / 32; k_++) {                                                 \
            const uint8_t *b_ = (ROW) + (size_t)k_ * 64;                                             \
            __m512i w0_ = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b_)), 16); \
            __m512i w1_ = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b_ + 32))), 16); \
            EMIT(_mm512_castsi512_ps(w0_), _mm512_castsi512_ps(w1_), k_ * 32);                       \
        }                                                                                            \
    } while (0)

/* GEMV over rows [r0, r1) for NT (1-4) rows of x: two accumulators per row of x. */
#define FMA_EMIT(W0, W1, OFF)                                                                        \
    do {                                                                                             \
        const __m512 w0e_ = (W0), w1e_ = (W1);                                                       \
        const int off_ = (OFF);                                                                      \
        for (int t_ = 0; t_ < NT; t_++) {                                                            \
            acc[t_][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[t_] + off_), w0e_, acc[t_][0]);          \
            acc[t_][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[t_] + off_ + 16), w1e_, acc[t_][1]);     \
        }                                                                                            \
    } while (0)

#define STORE_EMIT(W0, W1, OFF)                                                                      \
    do {                                                                                             \
        const int off_ = (OFF);                                                                      \
        _mm512_storeu_ps(dst + off_, (W0));                                                          \
        _mm512_storeu_ps(dst + off_ + 16, (W1));                                                     \
    } while (0)

#define PREFETCH_BYTES 4096

INLINE_AVX512 void prefetch_row(const uint8_t *row, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)row + o, _MM_HINT_T0);
}

#define DEFINE_KERNELS(NAME, LOOP)                                                                   \
    INLINE_AVX512 void gemv_##NAME##_nt(const Gemv *g, Py_ssize_t r0, Py_ssize_t r1, int t0, const int NT) { \
        const int blocks = g->cols / g->ti->block_values;                                            \
        const float *xs[4];                                                                          \
        for (int t = 0; t < NT; t++) xs[t] = g->x + (t0 + t) * g->x_stride;                          \
        const int row_bytes = blocks * g->ti->block_bytes;                                           \
        /* A row is a few hundred bytes and a thread's chunk a few dozen rows: the hardware          \
         * prefetcher alone leaves the loop waiting on memory, so fetch PREFETCH_BYTES ahead. */      \
        const Py_ssize_t ahead = (PREFETCH_BYTES + row_bytes - 1) / row_bytes;                       \
        for (Py_ssize_t p = r0; p < r0 + ahead && p < r1; p++) prefetch_row(g->w + p * g->w_stride, row_bytes); \
        for (Py_ssize_t r = r0; r < r1; r++) {                                                       \
            const uint8_t *row = g->w + r * g->w_stride;                                             \
            if (r + ahead < r1) prefetch_row(row + ahead * g->w_stride, row_bytes);                  \
            __m512 acc[4][2];                                                                        \
            for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();                \
            LOOP(row, blocks, FMA_EMIT);                                                             \
            for (int t = 0; t < NT; t++)                                                             \
                g->y[(t0 + t) * g->y_stride + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1])); \
        }                                                                                            \
    }                                                                                                \
    static AVX512 void gemv_##NAME(const Gemv *g, Py_ssize_t r0, Py_ssize_t r1) {                    \
        for (int t0 = 0; t0 < g->T; t0 += 4) {                                                       \
            switch (g->T - t0 >= 4 ? 4 : g->T - t0) {                                                \
            case 1: gemv_##NAME##_nt(g, r0, r1, t0, 1); break;                                       \
            case 2: gemv_##NAME##_nt(g, r0, r1, t0, 2); break;                                       \
            case 3: gemv_##NAME##_nt(g, r0, r1, t0, 3); break;                                       \
            default: gemv_##NAME##_nt(g, r0, r1, t0, 4); break;                                      \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    static AVX512 void dequant_##NAME(const uint8_t *row, int cols, int block_values, float *dst) {  \
        const int blocks = cols / block_values;                                                      \
        LOOP(row, blocks, STORE_EMIT);                                                               \
    }

DEFINE_KERNELS(q4_0, LOOP_Q4_0)
DEFINE_KERNELS(q4_1, LOOP_Q4_1)
DEFINE_KERNELS(q5_0, LOOP_Q5_0)
DEFINE_KERNELS(q5_1, LOOP_Q5_1)
DEFINE_KERNELS(q8_0, LOOP_Q8_0)
DEFINE_KERNELS(iq4_nl, LOOP_IQ4_NL)
DEFINE_KERNELS(mxfp4, LOOP_MXFP4)
DEFINE_KERNELS(q2_k, LOOP_Q2_K)
DEFINE_KERNELS(q3_k, LOOP_Q3_K)
DEFINE_KERNELS(q4_k, LOOP_Q4_K)
DEFINE_KERNELS(q5_k, LOOP_Q5_K)
DEFINE_KERNELS(q6_k, LOOP_Q6_K)
DEFINE_KERNELS(iq4_xs, LOOP_IQ4_XS)
DEFINE_KERNELS(f16, LOOP_F16)
DEFINE_KERNELS(bf16, LOOP_BF16)

static void avx512_kernels(int type, int cols, GemvFn *gemv, DequantFn *dequant) {
    *gemv = NULL;
    *dequant = NULL;
    switch (type) {
#define CASE(ID, NAME) case ID: *gemv = gemv_##NAME; *dequant = dequant_##NAME; break;
        CASE(T_Q4_0, q4_0) CASE(T_Q4_1, q4_1) CASE(T_Q5_0, q5_0) CASE(T_Q5_1, q5_1) CASE(T_Q8_0, q8_0)
        CASE(T_IQ4_NL, iq4_nl) CASE(T_MXFP4, mxfp4) CASE(T_Q2_K, q2_k) CASE(T_Q3_K, q3_k)
        CASE(T_Q4_K, q4_k) CASE(T_Q5_K, q5_k) CASE(T_Q6_K, q6_k) CASE(T_IQ4_XS, iq4_xs)
        CASE(T_F16, f16) CASE(T_BF16, bf16)
#undef CASE
    }
    if ((type == T_F16 || type == T_BF16) && cols % 32) {
        *gemv = NULL;
        *dequant = NULL;
    }
}
#endif /* HAVE_AVX512_KERNELS */

static int use_avx512 = 0;

/* ---- threading ----------------------------------------------------------------------------------- */

/* Below this many packed bytes a matmul runs on the calling thread: waking the pool costs more. */
#define PARALLEL_MIN_BYTES (48 * 1024)

typedef void (*RowsFn)(const void *job, Py_ssize_t r0, Py_ssize_t r1);

/* Runs fn over rows [0, rows) on up to `threads` threads, in chunks of whole 4-row groups that the
 * threads claim one at a time: a thread the OS has not scheduled yet (other programs, or torch's own
 * work, on the cores) leaves its share to the others instead of holding everyone up. */
static void parallel_rows(RowsFn fn, const void *job, Py_ssize_t rows, int threads) {
    if (threads < 1) threads = 1;
    Py_ssize_t chunk = (rows / ((Py_ssize_t)threads * 8) + 3) & ~(Py_ssize_t)3;
    if (chunk < 16) chunk = 16;
    Py_ssize_t chunks = (rows + chunk - 1) / chunk;
    if (threads == 1 || chunks <= 1) {
        fn(job, 0, rows);
        return;
    }
#ifdef _OPENMP
    Py_ssize_t next = 0;
#pragma omp parallel num_threads(threads) shared(next)
    {
        for (;;) {
            Py_ssize_t c = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (c >= chunks) break;
            fn(job, c * chunk, (c + 1) * chunk < rows ? (c + 1) * chunk : rows);
        }
    }
#else
    fn(job, 0, rows);
#endif
}

typedef struct {
    const TypeInfo *ti;
    const uint8_t *w;
    Py_ssize_t w_stride;
    int cols;
    float *dst;
    DequantFn fast; /* NULL: the portable decoder */
} Dequant;

static void gemv_rows(const void *job, Py_ssize_t r0, Py_ssize_t r1) {
    const Gemv *g = job;
    g->kernel(g, r0, r1);
}

static void dequant_rows(const void *job, Py_ssize_t r0, Py_ssize_t r1) {
    const Dequant *d = job;
    for (Py_ssize_t r = r0; r < r1; r++) {
        if (d->fast)
            d->fast(d->w + r * d->w_stride, d->cols, d->ti->block_values, d->dst + r * (Py_ssize_t)d->cols);
        else
            portable_dequant_row(d->ti, d->w + r * d->w_stride, d->cols, d->dst + r * (Py_ssize_t)d->cols);
    }
}

/* ---- Python entry points ------------------------------------------------------------------------- */

static PyObject *py_gemv(PyObject *self, PyObject *args) {
    (void)self;
    int type, cols, T, threads;
    unsigned long long w_ptr, x_ptr, y_ptr;
    Py_ssize_t w_stride, rows, x_stride, y_stride;
    if (!PyArg_ParseTuple(args, "iKnniKinKni", &type, &w_ptr, &w_stride, &rows, &cols, &x_ptr, &T, &x_stride,
                          &y_ptr, &y_stride, &threads))
        return NULL;
    const TypeInfo *ti = type_info(type);
    if (ti == NULL || cols <= 0 || cols % ti->block_values || T <= 0 || rows < 0) {
        PyErr_SetString(PyExc_ValueError, "gemv: unsupported type or shape");
        return NULL;
    }
    Gemv g = {ti, (const uint8_t *)(uintptr_t)w_ptr, w_stride, rows, cols, (const float *)(uintptr_t)x_ptr, T,
              x_stride, (float *)(uintptr_t)y_ptr, y_stride, portable_gemv_rows};
#ifdef HAVE_AVX512_KERNELS
    if (use_avx512) {
        GemvFn fast;
        DequantFn unused;
        avx512_kernels(type, cols, &fast, &unused);
        if (fast) g.kernel = fast;
    }
#endif
    if ((Py_ssize_t)rows * w_stride < PARALLEL_MIN_BYTES) threads = 1;
    Py_BEGIN_ALLOW_THREADS
    parallel_rows(gemv_rows, &g, rows, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    (void)self;
    int type, cols, threads;
    unsigned long long w_ptr, dst_ptr;
    Py_ssize_t w_stride, rows;
    if (!PyArg_ParseTuple(args, "iKnniKi", &type, &w_ptr, &w_stride, &rows, &cols, &dst_ptr, &threads)) return NULL;
    const TypeInfo *ti = type_info(type);
    if (ti == NULL || cols <= 0 || cols % ti->block_values || rows < 0) {
        PyErr_SetString(PyExc_ValueError, "dequantize: unsupported type or shape");
        return NULL;
    }
    const uint8_t *w = (const uint8_t *)(uintptr_t)w_ptr;
    float *dst = (float *)(uintptr_t)dst_ptr;
    DequantFn fast = NULL;
#ifdef HAVE_AVX512_KERNELS
    if (use_avx512) {
        GemvFn unused;
        avx512_kernels(type, cols, &unused, &fast);
    }
#endif
    Dequant job = {ti, w, w_stride, cols, dst, fast};
    if ((Py_ssize_t)rows * w_stride < PARALLEL_MIN_BYTES) threads = 1;
    Py_BEGIN_ALLOW_THREADS
    parallel_rows(dequant_rows, &job, rows, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_kernel_isa(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(use_avx512 ? "avx512" : "portable");
}

static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    /* For the tests: force the portable kernels ("portable") or pick the best again ("best"). */
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    use_avx512 = 0;
#ifdef HAVE_AVX512_KERNELS
    if (strcmp(name, "best") == 0) use_avx512 = cpu_has_avx512();
#endif
    return py_kernel_isa(self, NULL);
}

static PyMethodDef METHODS[] = {
    {"gemv", py_gemv, METH_VARARGS,
     "gemv(type, w_ptr, w_stride, rows, cols, x_ptr, T, x_stride, y_ptr, y_stride, threads): y = x @ W^T"},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(type, w_ptr, w_stride, rows, cols, dst_ptr, threads): W as float32 [rows, cols]"},
    {"kernel_isa", py_kernel_isa, METH_NOARGS, "the instruction set the kernels use: avx512 or portable"},
    {"set_isa", py_set_isa, METH_VARARGS, "set_isa('portable' | 'best'): for tests"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_gguf_cpu", "GGUF packed-weight CPU kernels", -1, METHODS,
                                   NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__gguf_cpu(void) {
#ifdef HAVE_AVX512_KERNELS
    use_avx512 = cpu_has_avx512();
#endif
    return PyModule_Create(&MODULE);
}
