/* CPU kernels for matmuls on GGUF-packed weights: y = x @ dequantize(W)^T with x float32.
 *
 * The weight stays as the file's GGML blocks: uint8 [rows, row_bytes], blocks running along a row.
 * The entry points, all called from gguf_cpu.py with raw data pointers (the Python side checks
 * dtypes, shapes and strides before it calls, so nothing here is exposed to unchecked input):
 *
 *   gemv(type, w, w_stride, rows, cols, x, T, x_stride, y, y_stride, threads)
 *       y[t, r] = sum_c x[t, c] * W[r, c], decoding each block once for up to eight rows of x: the
 *       decode path and a speculative verify step (T up to 16), each row of y bit for bit the same
 *       whatever T is.
 *   dequantize(type, w, w_stride, rows, cols, dst, threads, bf16=False)
 *       W as float32 [rows, cols] into dst: a prefill tile, which torch.mm then multiplies; with
 *       bf16, those float32 values rounded to bfloat16 (AVX-512 only), for a product in bfloat16.
 *   make_layer(...) / decode_layers(layers, x, pos, threads)
 *       decoder layers (the dense family's or Gemma 3's) for one token, x updated in place: the
 *       norms, GEMVs, RoPE, cache writes, attention and residual adds of a decode step in one call
 *       (see "one decoder layer for one token" and "the decode team" below).
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
 * takes cores from torch's. So OpenMP it is. The fused decode layers, which leave no torch op
 * between their phases, take the barrier-free idea onto OpenMP's own threads: "the decode team".)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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
typedef void (*DequantFn)(const uint8_t *, int, int, void *); /* float32 or bfloat16 rows */

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

/* GEMV over rows [r0, r1) for NT (1 to GEMV_GROUP) rows of x: two accumulators per row of x.
 * Every row of x gets the same sums in the same order whatever NT is and whichever rows of x share
 * its group, so a verify step's T tokens get bit for bit the y a one-token decode step gets for each:
 * speculative decoding's greedy identity does not rest on rounding luck. */
#define FMA_EMIT(W0, W1, OFF)                                                                        \
    do {                                                                                             \
        const __m512 w0e_ = (W0), w1e_ = (W1);                                                       \
        const int off_ = (OFF);                                                                      \
        for (int t_ = 0; t_ < NT; t_++) {                                                            \
            acc[t_][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[t_] + off_), w0e_, acc[t_][0]);          \
            acc[t_][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[t_] + off_ + 16), w1e_, acc[t_][1]);     \
        }                                                                                            \
    } while (0)

/* A dequantized row goes out with streaming stores where it is 64-byte aligned. The prefill's tile
 * is read by torch.mm on every thread, so its lines sit in the other cores' caches when the next
 * tile is decoded into the same scratch; plain stores then wait for each line's ownership, which
 * made the decoding several times slower than on its own (docs/BENCHMARKS.md, CPU GGUF, 2026-12-05). */
#define STORE_EMIT(W0, W1, OFF)                                                                      \
    do {                                                                                             \
        const int off_ = (OFF);                                                                      \
        if (streamed) {                                                                              \
            _mm512_stream_ps(dst + off_, (W0));                                                      \
            _mm512_stream_ps(dst + off_ + 16, (W1));                                                 \
        } else {                                                                                     \
            _mm512_storeu_ps(dst + off_, (W0));                                                      \
            _mm512_storeu_ps(dst + off_ + 16, (W1));                                                 \
        }                                                                                            \
    } while (0)

/* The same rows as bfloat16, rounded to nearest even in integer ops (AVX-512F alone; the values are
 * finite): the prefill's tile where torch.mm multiplies in bfloat16 (gguf_cpu.py, BF16_PREFILL). */
INLINE_AVX512 __m256i bf16_rne(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

#define STORE_BF16_EMIT(W0, W1, OFF)                                                                 \
    do {                                                                                             \
        const __m512i both_ = _mm512_inserti64x4(_mm512_castsi256_si512(bf16_rne(W0)), bf16_rne(W1), 1); \
        if (streamed)                                                                                \
            _mm512_stream_si512((__m512i *)(dst + (OFF)), both_);                                    \
        else                                                                                         \
            _mm512_storeu_si512(dst + (OFF), both_);                                                 \
    } while (0)

#define PREFETCH_BYTES 4096

/* The most rows of x one pass over the weight multiplies: each decoded block feeds 2 * NT FMAs
 * from registers. Eight keeps the 16 accumulators, the two decoded vectors and a block's table
 * inside the 32 vector registers (no spills in GCC's assembly). The rows of x a pass reads must
 * also stay in L1 (every weight row reads all of them): where NT rows of x take more than
 * GEMV_X_BYTES, a pass takes fewer of them, never fewer than four. Measured on SmolLM2's Q4_1
 * weights (Zen 4, one thread, T = 8): 576 columns, one pass of 8 costs 0.84x two passes of 4;
 * 1536 columns (48 KiB of x), 1.25x. */
#define GEMV_GROUP 8
#define GEMV_X_BYTES (24 * 1024)

/* Rows of x per pass for a weight of `cols` columns. */
static int gemv_group(int cols) {
    int fit = GEMV_X_BYTES / (cols * (int)sizeof(float));
    return fit >= GEMV_GROUP ? GEMV_GROUP : fit > 4 ? fit : 4;
}

INLINE_AVX512 void prefetch_row(const uint8_t *row, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)row + o, _MM_HINT_T0);
}

/* A row decoder writing VALUE rows (float32 or bfloat16) through STORE, streamed where STREAMED. */
#define DEFINE_DEQUANT(FN, VALUE, STORE, LOOP, STREAMED)                                             \
    static AVX512 void FN(const uint8_t *row, int cols, int block_values, void *out) {               \
        VALUE *dst = out;                                                                            \
        const int blocks = cols / block_values;                                                      \
        const int streamed = (STREAMED);                                                             \
        LOOP(row, blocks, STORE);                                                                    \
    }

#define DEFINE_KERNELS(NAME, LOOP)                                                                   \
    INLINE_AVX512 void gemv_##NAME##_nt(const Gemv *g, Py_ssize_t r0, Py_ssize_t r1, int t0, const int NT) { \
        const int blocks = g->cols / g->ti->block_values;                                            \
        const float *xs[GEMV_GROUP];                                                                 \
        for (int t = 0; t < NT; t++) xs[t] = g->x + (t0 + t) * g->x_stride;                          \
        const int row_bytes = blocks * g->ti->block_bytes;                                           \
        /* A row is a few hundred bytes and a thread's chunk a few dozen rows: the hardware          \
         * prefetcher alone leaves the loop waiting on memory, so fetch PREFETCH_BYTES ahead. */      \
        const Py_ssize_t ahead = (PREFETCH_BYTES + row_bytes - 1) / row_bytes;                       \
        for (Py_ssize_t p = r0; p < r0 + ahead && p < r1; p++) prefetch_row(g->w + p * g->w_stride, row_bytes); \
        for (Py_ssize_t r = r0; r < r1; r++) {                                                       \
            const uint8_t *row = g->w + r * g->w_stride;                                             \
            if (r + ahead < r1) prefetch_row(row + ahead * g->w_stride, row_bytes);                  \
            __m512 acc[GEMV_GROUP][2];                                                               \
            for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();                \
            LOOP(row, blocks, FMA_EMIT);                                                             \
            for (int t = 0; t < NT; t++)                                                             \
                g->y[(t0 + t) * g->y_stride + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1])); \
        }                                                                                            \
    }                                                                                                \
    static AVX512 void gemv_##NAME(const Gemv *g, Py_ssize_t r0, Py_ssize_t r1) {                    \
        /* ceil(T / group) passes of near-equal groups (T = 12: 6 + 6, not 8 + 4). */                 \
        const int group = gemv_group(g->cols);                                                       \
        const int passes = (g->T + group - 1) / group;                                               \
        for (int i = 0, t0 = 0; i < passes; i++) {                                                   \
            const int nt = (g->T - t0) / (passes - i);                                               \
            switch (nt) {                                                                            \
            case 1: gemv_##NAME##_nt(g, r0, r1, t0, 1); break;                                       \
            case 2: gemv_##NAME##_nt(g, r0, r1, t0, 2); break;                                       \
            case 3: gemv_##NAME##_nt(g, r0, r1, t0, 3); break;                                       \
            case 4: gemv_##NAME##_nt(g, r0, r1, t0, 4); break;                                       \
            case 5: gemv_##NAME##_nt(g, r0, r1, t0, 5); break;                                       \
            case 6: gemv_##NAME##_nt(g, r0, r1, t0, 6); break;                                       \
            case 7: gemv_##NAME##_nt(g, r0, r1, t0, 7); break;                                       \
            default: gemv_##NAME##_nt(g, r0, r1, t0, 8); break;                                      \
            }                                                                                        \
            t0 += nt;                                                                                \
        }                                                                                            \
    }                                                                                                \
    DEFINE_DEQUANT(dequant_##NAME, float, STORE_EMIT, LOOP, ((uintptr_t)dst & 63) == 0)              \
    DEFINE_DEQUANT(dequant_bf16_##NAME, uint16_t, STORE_BF16_EMIT, LOOP, ((uintptr_t)dst & 63) == 0) \
    DEFINE_DEQUANT(dequant_cached_##NAME, float, STORE_EMIT, LOOP, 0)

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

/* The type's AVX-512 kernels: its GEMV, its float32 and its bfloat16 row decoders (NULL: none). */
static void avx512_kernels(int type, int cols, GemvFn *gemv, DequantFn *dequant, DequantFn *dequant_rounded) {
    *gemv = NULL;
    *dequant = *dequant_rounded = NULL;
    switch (type) {
#define CASE(ID, NAME)                                                                               \
    case ID: *gemv = gemv_##NAME; *dequant = dequant_##NAME; *dequant_rounded = dequant_bf16_##NAME; break;
        CASE(T_Q4_0, q4_0) CASE(T_Q4_1, q4_1) CASE(T_Q5_0, q5_0) CASE(T_Q5_1, q5_1) CASE(T_Q8_0, q8_0)
        CASE(T_IQ4_NL, iq4_nl) CASE(T_MXFP4, mxfp4) CASE(T_Q2_K, q2_k) CASE(T_Q3_K, q3_k)
        CASE(T_Q4_K, q4_k) CASE(T_Q5_K, q5_k) CASE(T_Q6_K, q6_k) CASE(T_IQ4_XS, iq4_xs)
        CASE(T_F16, f16) CASE(T_BF16, bf16)
#undef CASE
    }
    if ((type == T_F16 || type == T_BF16) && cols % 32) {
        *gemv = NULL;
        *dequant = *dequant_rounded = NULL;
    }
}

/* The type's float32 row decoder with plain stores (NULL: none): the GEMM's panel, which its own
 * thread reads back at once from L1/L2. */
static DequantFn avx512_cached_decoder(int type, int cols) {
    if ((type == T_F16 || type == T_BF16) && cols % 32) return NULL;
    switch (type) {
#define CASE(ID, NAME)                                                                               \
    case ID: return dequant_cached_##NAME;
        CASE(T_Q4_0, q4_0) CASE(T_Q4_1, q4_1) CASE(T_Q5_0, q5_0) CASE(T_Q5_1, q5_1) CASE(T_Q8_0, q8_0)
        CASE(T_IQ4_NL, iq4_nl) CASE(T_MXFP4, mxfp4) CASE(T_Q2_K, q2_k) CASE(T_Q3_K, q3_k)
        CASE(T_Q4_K, q4_k) CASE(T_Q5_K, q5_k) CASE(T_Q6_K, q6_k) CASE(T_IQ4_XS, iq4_xs)
        CASE(T_F16, f16) CASE(T_BF16, bf16)
#undef CASE
    }
    return NULL;
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
static void parallel_chunks(RowsFn fn, const void *job, Py_ssize_t rows, Py_ssize_t chunk, int threads);

static void parallel_rows(RowsFn fn, const void *job, Py_ssize_t rows, int threads) {
    if (threads < 1) threads = 1;
    Py_ssize_t chunk = (rows / ((Py_ssize_t)threads * 8) + 3) & ~(Py_ssize_t)3;
    parallel_chunks(fn, job, rows, chunk < 16 ? 16 : chunk, threads);
}

/* fn over [0, rows) in chunks of `chunk` that the threads claim one at a time. */
static void parallel_chunks(RowsFn fn, const void *job, Py_ssize_t rows, Py_ssize_t chunk, int threads) {
    if (threads < 1) threads = 1;
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
    void *dst;      /* float32 rows, or bfloat16 ones where `fast` is a bfloat16 decoder */
    size_t value_bytes;
    DequantFn fast; /* NULL: the portable decoder (float32 only) */
} Dequant;

static void gemv_rows(const void *job, Py_ssize_t r0, Py_ssize_t r1) {
    const Gemv *g = job;
    g->kernel(g, r0, r1);
}

static void dequant_rows(const void *job, Py_ssize_t r0, Py_ssize_t r1) {
    const Dequant *d = job;
    for (Py_ssize_t r = r0; r < r1; r++) {
        char *row = (char *)d->dst + r * (Py_ssize_t)d->cols * d->value_bytes;
        if (d->fast)
            d->fast(d->w + r * d->w_stride, d->cols, d->ti->block_values, row);
        else
            portable_dequant_row(d->ti, d->w + r * d->w_stride, d->cols, (float *)row);
    }
#ifdef HAVE_AVX512_KERNELS
    if (d->fast) _mm_sfence(); /* the streaming stores are visible before the rows are read */
#endif
}

/* ---- the prefill GEMM on packed rows ----------------------------------------------------------------
 *
 * y [T][rows] = x [T][cols] @ W^T for a prompt's T tokens. Each thread decodes GEMM_MR weight rows at
 * a time into its own panel (plain stores: the panel stays in its L1/L2) and multiplies it with every
 * block of GEMM_NB tokens while it is there. The tokens are the vector lanes: x is first copied
 * transposed into blocks xt [block][cols][GEMM_NB], so a step over k broadcasts one weight value per
 * row and multiplies it with two vectors of tokens; the GEMM_MR x GEMM_NB sums stay in registers for
 * the whole row. The tiles for torch.mm instead write every weight value to memory as float32 and
 * read it back: at 128 tokens the GEMM takes 0.75x their time (docs/BENCHMARKS.md, CPU GGUF).
 * Each y value is one float32 sum over k in order (no split of k): accumulation order only. */
#ifdef HAVE_AVX512_KERNELS
#define GEMM_MR 12 /* 12 x 2 accumulators + 2 token vectors + the broadcast: 27 of 32 registers */
#define GEMM_NB 32
/* The xt a panel sweeps stays in the core's L2 (1-2 MiB on current x86 cores): at 2,000 tokens, with
 * the whole xt streamed from L3 for every panel, the GEMM ran at 0.62x torch.mm's speed, in groups at
 * 0.82x (the reason GEMM_MAX_T in gguf_cpu.py stops it before that). */
#define GEMM_GROUP_BYTES (1 << 20)

typedef struct {
    DequantFn decode;
    int block_values;
    const uint8_t *w;
    Py_ssize_t w_stride, rows;
    int cols, T;
    const float *x;
    Py_ssize_t x_stride;
    const float *xt; /* [ceil(T / GEMM_NB)][cols][GEMM_NB], zero past T */
    float *panels;   /* one panel of GEMM_MR rows per thread */
    int group;       /* tokens whose xt blocks take at most GEMM_GROUP_BYTES: each decoded panel
                        multiplies one group (a multiple of GEMM_NB) */
    float *y;
    Py_ssize_t y_stride;
} Gemm;

/* MR rows of the panel times the NV token vectors of one block, into y's `tokens` rows. */
INLINE_AVX512 void gemm_micro(const float *panel, int cols, const float *xt, float *y, Py_ssize_t y_stride,
                              int tokens, const int MR, const int NV) {
    __m512 acc[GEMM_MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int k = 0; k < cols; k++) {
        const __m512 x0 = _mm512_load_ps(xt + (size_t)k * GEMM_NB);
        const __m512 x1 = NV > 1 ? _mm512_load_ps(xt + (size_t)k * GEMM_NB + 16) : x0;
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            const __m512 w = _mm512_set1_ps(panel[(size_t)r * cols + k]);
            acc[r][0] = _mm512_fmadd_ps(w, x0, acc[r][0]);
            if (NV > 1) acc[r][1] = _mm512_fmadd_ps(w, x1, acc[r][1]);
        }
    }
    /* Out token by token: y's rows are often a multiple of 4 KiB apart (2,048 floats), so they share
     * one L1 set; writing row after row of the tile would cycle the set's ways MR times. */
    float sums[GEMM_MR][GEMM_NB];
    for (int r = 0; r < MR; r++) {
        _mm512_storeu_ps(sums[r], acc[r][0]);
        if (NV > 1) _mm512_storeu_ps(sums[r] + 16, acc[r][1]);
    }
    for (int t = 0; t < tokens; t++)
        for (int r = 0; r < MR; r++) y[t * y_stride + r] = sums[r][t];
}

#define GEMM_MICRO_CASE(MR)                                                                          \
    case MR:                                                                                         \
        if (nv == 1)                                                                                 \
            gemm_micro(panel, cols, xt, y, y_stride, tokens, MR, 1);                                 \
        else                                                                                         \
            gemm_micro(panel, cols, xt, y, y_stride, tokens, MR, 2);                                 \
        break;

static AVX512 void gemm_block(const float *panel, int mr, int cols, const float *xt, float *y, Py_ssize_t y_stride,
                              int tokens) {
    const int nv = tokens > 16 ? 2 : 1;
    switch (mr) {
        GEMM_MICRO_CASE(1) GEMM_MICRO_CASE(2) GEMM_MICRO_CASE(3) GEMM_MICRO_CASE(4) GEMM_MICRO_CASE(5)
        GEMM_MICRO_CASE(6) GEMM_MICRO_CASE(7) GEMM_MICRO_CASE(8) GEMM_MICRO_CASE(9) GEMM_MICRO_CASE(10)
        GEMM_MICRO_CASE(11) GEMM_MICRO_CASE(12)
    }
}

/* Items [i0, i1): item i is panel i % panels for the token group i / panels. */
static void gemm_items(const void *job, Py_ssize_t i0, Py_ssize_t i1) {
    const Gemm *g = job;
#ifdef _OPENMP
    const int thread = omp_get_thread_num();
#else
    const int thread = 0;
#endif
    float *panel = g->panels + (size_t)thread * GEMM_MR * g->cols;
    const Py_ssize_t panels = (g->rows + GEMM_MR - 1) / GEMM_MR;
    for (Py_ssize_t i = i0; i < i1; i++) {
        const Py_ssize_t r0 = i % panels * GEMM_MR;
        const int mr = g->rows - r0 < GEMM_MR ? (int)(g->rows - r0) : GEMM_MR;
        for (int k = 0; k < mr; k++)
            g->decode(g->w + (r0 + k) * g->w_stride, g->cols, g->block_values, panel + (size_t)k * g->cols);
        const int first = (int)(i / panels) * g->group, last = first + g->group < g->T ? first + g->group : g->T;
        for (int t0 = first; t0 < last; t0 += GEMM_NB) {
            const int tokens = last - t0 < GEMM_NB ? last - t0 : GEMM_NB;
            gemm_block(panel, mr, g->cols, g->xt + (size_t)(t0 / GEMM_NB) * g->cols * GEMM_NB,
                       g->y + t0 * g->y_stride + r0, g->y_stride, tokens);
        }
    }
}

/* Blocks [b0, b1) of xt from x [T][cols] (row stride x_stride), zeros past T: read down the block's
 * rows, written in xt's order. */
static void gemm_pack_x(const void *job, Py_ssize_t b0, Py_ssize_t b1) {
    const Gemm *g = job;
    for (Py_ssize_t b = b0; b < b1; b++) {
        const int t0 = (int)b * GEMM_NB, tokens = g->T - t0 < GEMM_NB ? g->T - t0 : GEMM_NB;
        const float *x = g->x + t0 * g->x_stride;
        float *dst = (float *)g->xt + (size_t)b * g->cols * GEMM_NB;
        for (int k = 0; k < g->cols; k++, dst += GEMM_NB) {
            int t = 0;
            for (; t < tokens; t++) dst[t] = x[t * g->x_stride + k];
            for (; t < GEMM_NB; t++) dst[t] = 0.0f;
        }
    }
}
#endif /* HAVE_AVX512_KERNELS */

/* ---- one decoder layer for one token ------------------------------------------------------------ */

/* The whole one-token layer in C: after the packed GEMVs, the rest of a small model's decode step
 * (norms, RoPE, the cache write, attention over one query row, the residual adds, the activation)
 * is a dozen torch calls a layer whose dispatch costs as much as the GEMVs themselves. Here it is a
 * few hundred floats of plain loops between the GEMVs, and one call from Python per layer.
 *
 * Every step computes what the torch path computes, in float32 and in the same order per value
 * (RMSNorm as x * rsqrt(mean(x^2) + eps) * w, RoPE as x * cos + swap(x) * sin, the residual as
 * (y + bias) + x); sums (the GEMVs, the norms' means, attention) differ in their order only.
 * Attention is one pass over each segment of keys with a running maximum (online softmax), the
 * segments' partial sums then merged (see AttendJob), so it needs no buffer of scores however long
 * the cache. */

#define MAX_PARTS 4

typedef struct {
    const TypeInfo *ti;
    const uint8_t *w;
    Py_ssize_t w_stride;
    Py_ssize_t rows;
    int cols;
} Part;

typedef struct {
    int n;
    Part parts[MAX_PARTS];
    Py_ssize_t rows; /* all parts', side by side in the output */
    const float *bias;
} Proj;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_GELU = 2 };

typedef struct {
    int hidden, heads, kv_heads, dim, ffn;
    float eps, attn_scale;
    int act;
    int sin_folded; /* sin already holds [-sin, sin] (the dense family); else the plain table (Gemma) */
    Py_ssize_t window; /* 0: attends to every earlier position */
    const float *norm_in, *norm_post_attn, *norm_pre_ff, *norm_post_ff; /* the post norms may be NULL */
    const float *qk_norm; /* [H + KV, D] or NULL */
    Proj qkv, o, gate_up, down;
    float *cache; /* [2, KV, cache_rows, D]: position p in row p % cache_rows */
    Py_ssize_t cache_rows;
    const float *cos, *sin; /* [table_rows, D] */
    Py_ssize_t table_rows;
} Layer;

static GemvFn pick_gemv(const TypeInfo *ti, int cols) {
#ifdef HAVE_AVX512_KERNELS
    if (use_avx512) {
        GemvFn fast;
        DequantFn unused, unused_bf16;
        avx512_kernels(ti->type, cols, &fast, &unused, &unused_bf16);
        if (fast) return fast;
    }
#else
    (void)cols;
#endif
    return portable_gemv_rows;
}

/* ---- the decode team: phases that never wait for a thread that has not started --------------------
 *
 * A decode step is ~150 short parallel phases a token (a few microseconds of work each). With an
 * OpenMP region per phase, every phase ends at a barrier that waits for every thread: where other
 * programs keep the cores busy, a thread the OS has not scheduled holds the step up for a whole
 * time slice, phase after phase (measured: a SmolLM2 token went from 13 ms on one thread to 700 ms
 * on two while another process used one core). So decode_layers opens one OpenMP region for all
 * of a token's layers: thread 0 runs them, and each phase is a job the other threads claim items of
 * as they come; thread 0 claims items too and then waits only for items a thread actually claimed.
 * A thread that wakes late finds nothing left. A busy machine then costs at most the parallelism,
 * and one wait at the region's end. (A pool of threads of our own did the same, but torch's OpenMP
 * threads, spinning after each torch op between tokens, then took its cores.)
 *
 * The claim word packs (job number : 24 | items : 20 | next item : 20), so a claim (a CAS) only
 * succeeds on the job it read, and the job's function and data stay valid while a claimed item is
 * unfinished (thread 0 does not move on before). Waiting threads spin, then sleep on a futex. */

#if defined(__linux__) && defined(_OPENMP)
#define HAVE_DECODE_TEAM 1
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TEAM_ITEM_BITS 20
#define TEAM_SPIN_CYCLES 150000ull /* ~50 us: covers the gaps between phases and layers */

static __thread int team_leading; /* set on thread 0 while it runs the layers: phases go to the team */

static struct {
    pthread_mutex_t user; /* one token at a time on the team */
    RowsFn fn;
    const void *job;
    uint64_t claim;    /* job : 24 | items : 20 | next : 20 */
    uint32_t seq;      /* bumped per job and at the end: the futex the others sleep on */
    uint32_t finished; /* the token's layers are done: leave the region */
    uint32_t done;     /* items finished in the current job: the futex thread 0 sleeps on */
    uint32_t sleepers;
    uint32_t leader_waits;
} team = {.user = PTHREAD_MUTEX_INITIALIZER};

static long futex(uint32_t *word, int op, uint32_t value) {
    return syscall(SYS_futex, word, op, value, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline uint64_t cycles(void) {
#if defined(__x86_64__)
    return __builtin_ia32_rdtsc();
#else
    static uint64_t n = 0;
    return n++;
#endif
}

/* Claims and runs items of the current job until none is left. */
static void team_work(void) {
    const uint64_t item_mask = (1ull << TEAM_ITEM_BITS) - 1;
    for (;;) {
        uint64_t c = __atomic_load_n(&team.claim, __ATOMIC_ACQUIRE);
        uint64_t next = c & item_mask, items = (c >> TEAM_ITEM_BITS) & item_mask;
        if (next >= items) return;
        if (!__atomic_compare_exchange_n(&team.claim, &c, c + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
        team.fn(team.job, (Py_ssize_t)next, (Py_ssize_t)next + 1);
        uint32_t finished = __atomic_add_fetch(&team.done, 1, __ATOMIC_SEQ_CST);
        if (finished == items && __atomic_load_n(&team.leader_waits, __ATOMIC_SEQ_CST))
            futex(&team.done, FUTEX_WAKE_PRIVATE, 1);
    }
}

/* The other threads of the region: every job's items until thread 0 says the layers are done. */
static void team_follow(void) {
    uint32_t seen = 0; /* every job bumps seq: the first one found is new */
    for (;;) {
        uint64_t start = cycles();
        uint32_t now;
        while ((now = __atomic_load_n(&team.seq, __ATOMIC_ACQUIRE)) == seen) {
            if (cycles() - start < TEAM_SPIN_CYCLES) {
                cpu_relax();
                continue;
            }
            __atomic_add_fetch(&team.sleepers, 1, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&team.seq, __ATOMIC_SEQ_CST) == seen) futex(&team.seq, FUTEX_WAIT_PRIVATE, seen);
            __atomic_sub_fetch(&team.sleepers, 1, __ATOMIC_SEQ_CST);
            start = cycles();
        }
        seen = now;
        team_work();
        if (__atomic_load_n(&team.finished, __ATOMIC_ACQUIRE)) return;
    }
}

static void team_publish(uint64_t claim) {
    __atomic_store_n(&team.claim, claim, __ATOMIC_RELEASE);
    __atomic_add_fetch(&team.seq, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&team.sleepers, __ATOMIC_SEQ_CST)) futex(&team.seq, FUTEX_WAKE_PRIVATE, INT32_MAX);
}

/* On thread 0 inside decode_layers: fn over items [0, n) on the team. */
static void team_run(RowsFn fn, const void *job, Py_ssize_t n) {
    team.fn = fn;
    team.job = job;
    __atomic_store_n(&team.done, 0, __ATOMIC_RELAXED);
    uint64_t number = ((__atomic_load_n(&team.claim, __ATOMIC_RELAXED) >> (2 * TEAM_ITEM_BITS)) + 1) & ((1ull << 24) - 1);
    team_publish((number << (2 * TEAM_ITEM_BITS)) | ((uint64_t)n << TEAM_ITEM_BITS));
    team_work();
    /* Only items another thread claimed can still be running: wait for those alone. */
    uint64_t start = cycles();
    uint32_t finished;
    while ((finished = __atomic_load_n(&team.done, __ATOMIC_SEQ_CST)) < (uint32_t)n) {
        if (cycles() - start < TEAM_SPIN_CYCLES) {
            cpu_relax();
            continue;
        }
        __atomic_store_n(&team.leader_waits, 1, __ATOMIC_SEQ_CST);
        if ((finished = __atomic_load_n(&team.done, __ATOMIC_SEQ_CST)) < (uint32_t)n)
            futex(&team.done, FUTEX_WAIT_PRIVATE, finished);
        __atomic_store_n(&team.leader_waits, 0, __ATOMIC_SEQ_CST);
    }
}
#endif

/* Runs fn over items [0, n) on up to `threads` threads, one item at a time: attention heads, or a
 * projection's chunks of rows. Inside decode_layers the team's, else an OpenMP region. */
static void parallel_items(RowsFn fn, const void *job, Py_ssize_t n, int threads) {
    if (threads <= 1 || n <= 1) {
        fn(job, 0, n);
        return;
    }
#ifdef HAVE_DECODE_TEAM
    /* Inside decode_layers, on thread 0: the phase is a job for the team (`threads` is its size). */
    if (team_leading && n < (1 << TEAM_ITEM_BITS)) {
        team_run(fn, job, n);
        return;
    }
#endif
    /* Claims of an eighth of a thread's share: one shared counter bumped per item (a prompt's q heads
     * are hundreds of items of a microsecond) kept its cache line moving between the cores. */
    const Py_ssize_t chunk = n / ((Py_ssize_t)threads * 8);
    parallel_chunks(fn, job, n, chunk > 1 ? chunk : 1, threads);
}

typedef struct {
    Gemv g[MAX_PARTS];
    Py_ssize_t first_chunk[MAX_PARTS + 1]; /* part i owns chunks [first_chunk[i], first_chunk[i + 1]) */
    Py_ssize_t chunk;
} PartsJob;

static void parts_chunks(const void *job, Py_ssize_t c0, Py_ssize_t c1) {
    const PartsJob *j = job;
    for (Py_ssize_t c = c0; c < c1; c++) {
        int i = 0;
        while (c >= j->first_chunk[i + 1]) i++;
        const Gemv *g = &j->g[i];
        Py_ssize_t r0 = (c - j->first_chunk[i]) * j->chunk;
        g->kernel(g, r0, r0 + j->chunk < g->rows ? r0 + j->chunk : g->rows);
    }
}

/* y[t][0 .. proj.rows) = x[t] @ W^T (+ bias) for the T tokens of x, x_stride floats apart: every
 * part's rows in one parallel region (a projection of parts in differing types, like Q4_K_M's
 * q/k/v, wakes the threads once, not once a part), each block decoded once for all T tokens. */
static void project(const Proj *p, const float *x, int T, Py_ssize_t x_stride, float *y, int threads) {
    PartsJob job;
    Py_ssize_t start = 0, bytes = 0;
    if (threads < 1) threads = 1;
    /* Chunks of 4-row groups, about 8 a thread over the whole projection (as parallel_rows). */
    job.chunk = (p->rows / ((Py_ssize_t)threads * 8) + 3) & ~(Py_ssize_t)3;
    if (job.chunk < 16) job.chunk = 16;
    job.first_chunk[0] = 0;
    for (int i = 0; i < p->n; i++) {
        const Part *part = &p->parts[i];
        Gemv g = {part->ti, part->w, part->w_stride, part->rows, part->cols, x, T, x_stride, y + start, p->rows,
                  pick_gemv(part->ti, part->cols)};
        job.g[i] = g;
        job.first_chunk[i + 1] = job.first_chunk[i] + (part->rows + job.chunk - 1) / job.chunk;
        start += part->rows;
        bytes += part->rows * part->w_stride;
    }
    parallel_items(parts_chunks, &job, job.first_chunk[p->n], bytes < PARALLEL_MIN_BYTES ? 1 : threads);
    if (p->bias)
        for (int t = 0; t < T; t++)
            for (Py_ssize_t r = 0; r < p->rows; r++) y[t * p->rows + r] = y[t * p->rows + r] + p->bias[r];
}

PORTABLE_CLONES static float sum_squares(const float *x, int n) {
    float sums[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) sums[k] += x[i + k] * x[i + k];
    for (; i < n; i++) sums[0] += x[i] * x[i];
    return ((sums[0] + sums[4]) + (sums[1] + sums[5])) + ((sums[2] + sums[6]) + (sums[3] + sums[7]));
}

/* out = x * rsqrt(mean(x^2) + eps) (* w): torch's rms_norm, and the reference's order. */
static void rms_norm_into(const float *x, const float *w, int n, float eps, float *out) {
    float rstd = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    if (w)
        for (int i = 0; i < n; i++) out[i] = (x[i] * rstd) * w[i];
    else
        for (int i = 0; i < n; i++) out[i] = x[i] * rstd;
}

/* Head vector v [D] in place: per-head RMSNorm times its weight (qk_norm rows), then RoPE. */
static void norm_rotate(float *v, const float *norm_w, const float *cos, const float *sin, int dim, float eps,
                        int sin_folded) {
    float src[512]; /* head_dim is checked to be <= 512 */
    if (norm_w) {
        rms_norm_into(v, NULL, dim, eps, src);
        for (int d = 0; d < dim; d++) src[d] = src[d] * norm_w[d];
    } else {
        memcpy(src, v, (size_t)dim * sizeof(float));
    }
    /* rotate_half: [-x2, x1] (folded tables hold -sin in their first half already). Two plain loops,
     * which the compiler vectorizes; per value the same operations as v = src * cos + other * sin. */
    const int half = dim / 2;
    const float flip = sin_folded ? 1.0f : -1.0f;
    for (int d = 0; d < half; d++) v[d] = src[d] * cos[d] + (flip * src[d + half]) * sin[d];
    for (int d = half; d < dim; d++) v[d] = src[d] * cos[d] + src[d - half] * sin[d];
}

PORTABLE_CLONES static float dot_f32(const float *a, const float *b, int n) { return dot(a, b, n); }

PORTABLE_CLONES static void axpy_scaled(float *acc, float rescale, const float *v, float p, int n) {
    for (int d = 0; d < n; d++) acc[d] = acc[d] * rescale + p * v[d];
}

#define ATTN_TILE 64
/* Query heads of one kv head an attention item takes at once (their states live on its stack). */
#define GROUP_MAX 8
/* Positions an attention work item covers: four tiles. */
#define ATTN_SEGMENT 256

/* The running state of one head's online softmax: acc = sum_i e^(s_i - max) v_i, total = sum_i e^(s_i - max). */
typedef struct {
    float max, total;
    float acc[512];
} Online;

/* One tile of n <= ATTN_TILE consecutive cache rows (keys, values point at its first row). */
static void attend_tile_portable(Online *o, const float *q, const float *keys, const float *values, int n, int dim,
                                 float scale) {
    float scores[ATTN_TILE];
    float tile_max = -INFINITY;
    for (int i = 0; i < n; i++) {
        scores[i] = dot_f32(q, keys + (Py_ssize_t)i * dim, dim) * scale;
        if (scores[i] > tile_max) tile_max = scores[i];
    }
    float new_max = tile_max > o->max ? tile_max : o->max;
    float rescale = expf(o->max - new_max); /* 0 on the first tile */
    o->total *= rescale;
    for (int i = 0; i < n; i++) {
        float p = expf(scores[i] - new_max);
        o->total += p;
        axpy_scaled(o->acc, i == 0 ? rescale : 1.0f, values + (Py_ssize_t)i * dim, p, dim);
    }
    o->max = new_max;
}

#ifdef HAVE_AVX512_KERNELS
/* e^x for 16 floats within ~1 ulp: x = n ln2 + r (ln2 in two parts, so r is exact enough), e^r by
 * its Taylor series to r^7 (|r| <= ln2 / 2: the next term is below 2^-27 of the result), times 2^n
 * by vscalefps, which also gives 0 and infinity for n out of range. */
INLINE_AVX512 __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f)); /* e^-104 is 0 in float32 */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* attend_tile_portable for dim % 16 == 0, in registers, and for the g <= GROUP_MAX query heads of one
 * kv head at once (head j's query at q + j * dim, its state o[j]): each key and value row is loaded
 * once for all of them. */
INLINE_AVX512 void attend_group_tile_body(Online *o, const int g, const float *q, const float *keys,
                                          const float *values, int n, int dim, float scale) {
    float scores[GROUP_MAX][ATTN_TILE];
    const int vecs = dim / 16;
    for (int i = 0; i < n; i++) {
        const float *k = keys + (Py_ssize_t)i * dim;
        __m512 s[GROUP_MAX];
        for (int j = 0; j < g; j++) s[j] = _mm512_setzero_ps();
        for (int v = 0; v < vecs; v++) {
            const __m512 kv = _mm512_loadu_ps(k + 16 * v);
            for (int j = 0; j < g; j++) s[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * dim + 16 * v), kv, s[j]);
        }
        for (int j = 0; j < g; j++) scores[j][i] = _mm512_reduce_add_ps(s[j]) * scale;
    }
    float rescale[GROUP_MAX];
    for (int j = 0; j < g; j++) {
        float tile_max = -INFINITY;
        for (int i = 0; i < n; i++) tile_max = scores[j][i] > tile_max ? scores[j][i] : tile_max;
        float new_max = tile_max > o[j].max ? tile_max : o[j].max;
        const __m512 m = _mm512_set1_ps(new_max);
        for (int i = 0; i < n; i += 16) {
            __mmask16 lanes = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
            __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores[j] + i), m));
            _mm512_mask_storeu_ps(scores[j] + i, lanes, e);
        }
        rescale[j] = _mm512_cvtss_f32(exp16(_mm512_set1_ps(o[j].max - new_max)));
        float total = o[j].total * rescale[j];
        for (int i = 0; i < n; i++) total += scores[j][i];
        o[j].total = total;
        o[j].max = new_max;
    }
    /* The values, VB vectors of a row at a time (row after row: each row's consecutive lines, not
     * one 64-byte column of every row per pass), into g * VB <= 16 accumulators in registers. */
    const int VB = g <= 2 ? 8 : g <= 4 ? 4 : 2;
    for (int v0 = 0; v0 < vecs; v0 += VB) {
        const int vb = vecs - v0 < VB ? 1 : VB; /* a tail (dim / 16 not a multiple of VB) goes singly */
        if (vb == 1 && VB > 1) {
            for (int v = v0; v < vecs; v++) {
                __m512 acc[GROUP_MAX];
                for (int j = 0; j < g; j++)
                    acc[j] = _mm512_mul_ps(_mm512_loadu_ps(o[j].acc + 16 * v), _mm512_set1_ps(rescale[j]));
                for (int i = 0; i < n; i++) {
                    const __m512 value = _mm512_loadu_ps(values + (Py_ssize_t)i * dim + 16 * v);
                    for (int j = 0; j < g; j++) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j][i]), value, acc[j]);
                }
                for (int j = 0; j < g; j++) _mm512_storeu_ps(o[j].acc + 16 * v, acc[j]);
            }
            break;
        }
        __m512 acc[GROUP_MAX][8];
        for (int j = 0; j < g; j++)
            for (int b = 0; b < VB; b++)
                acc[j][b] = _mm512_mul_ps(_mm512_loadu_ps(o[j].acc + 16 * (v0 + b)), _mm512_set1_ps(rescale[j]));
        for (int i = 0; i < n; i++) {
            const float *row = values + (Py_ssize_t)i * dim + 16 * v0;
            __m512 weight[GROUP_MAX];
            for (int j = 0; j < g; j++) weight[j] = _mm512_set1_ps(scores[j][i]);
            for (int b = 0; b < VB; b++) {
                const __m512 value = _mm512_loadu_ps(row + 16 * b);
                for (int j = 0; j < g; j++) acc[j][b] = _mm512_fmadd_ps(weight[j], value, acc[j][b]);
            }
        }
        for (int j = 0; j < g; j++)
            for (int b = 0; b < VB; b++) _mm512_storeu_ps(o[j].acc + 16 * (v0 + b), acc[j][b]);
    }
}

/* The body above for each group size as a constant, so that its loops over the heads unroll and
 * their accumulators stay in registers (with g a variable they lived on the stack). */
static AVX512 void attend_group_tile_avx512(Online *o, int g, const float *q, const float *keys,
                                            const float *values, int n, int dim, float scale) {
    switch (g) {
    case 1: attend_group_tile_body(o, 1, q, keys, values, n, dim, scale); break;
    case 2: attend_group_tile_body(o, 2, q, keys, values, n, dim, scale); break;
    case 3: attend_group_tile_body(o, 3, q, keys, values, n, dim, scale); break;
    case 4: attend_group_tile_body(o, 4, q, keys, values, n, dim, scale); break;
    case 5: attend_group_tile_body(o, 5, q, keys, values, n, dim, scale); break;
    case 6: attend_group_tile_body(o, 6, q, keys, values, n, dim, scale); break;
    case 7: attend_group_tile_body(o, 7, q, keys, values, n, dim, scale); break;
    default: attend_group_tile_body(o, 8, q, keys, values, n, dim, scale); break;
    }
}
#endif

static Py_ssize_t first_read(const Layer *L, Py_ssize_t at) {
    Py_ssize_t lo = at + 1 - L->cache_rows;
    if (L->window > 0 && at + 1 - L->window > lo) lo = at + 1 - L->window;
    return lo < 0 ? 0 : lo;
}

/* The segments of ATTN_SEGMENT positions that a token reading positions [lo, hi] splits into. */
static Py_ssize_t segments_of(Py_ssize_t lo, Py_ssize_t hi) { return (hi - lo + ATTN_SEGMENT) / ATTN_SEGMENT; }

/* The most segments any token of layer L reads (it reads at most cache_rows, or window, positions). */
static Py_ssize_t max_segments(const Layer *L) {
    Py_ssize_t most = L->window > 0 && L->window < L->cache_rows ? L->window : L->cache_rows;
    return segments_of(0, most - 1);
}

/* Attention, decode and verify alike. A token at position `at` reads positions [lo, at] of the cache
 * (position p in row p % cache_rows: at most two runs of consecutive rows). That range is cut into
 * segments of ATTN_SEGMENT positions from lo, and one work item is a (token, kv head, segment): the
 * kv head's query heads (all of its group, GROUP_MAX at a time) over the segment's rows, tile by
 * tile, each key and value row read once for the whole group. Items leave each head's partial
 * softmax (max, total, acc) in `parts`; merge_segments then combines a head's segments in order.
 * The split depends on lo and at only, never on the number of tokens or threads, so a verify step's
 * attention is bit for bit a decode step's. Splitting positions as well as heads keeps both threads
 * busy on a model with few kv heads (SmolLM2: 3, Gemma-3-270M: 1). */
typedef struct {
    const Layer *L;
    const float *qkv; /* [T][qkv.rows]: each token's rotated queries first */
    Py_ssize_t pos;   /* token t is at pos + t */
    Py_ssize_t segments; /* per token in `parts`: the most that any of the tokens reads */
    float *parts;     /* [T][heads][segments][2 + dim]: max, total, acc */
} AttendJob;

static void attend_items(const void *job, Py_ssize_t i0, Py_ssize_t i1) {
    const AttendJob *a = job;
    const Layer *L = a->L;
    const int dim = L->dim, kv_heads = L->kv_heads, group = L->heads / kv_heads;
    const Py_ssize_t width = 2 + dim;
    Online o[GROUP_MAX];
    for (Py_ssize_t i = i0; i < i1; i++) {
        Py_ssize_t t = i / ((Py_ssize_t)kv_heads * a->segments), kv = i / a->segments % kv_heads, seg = i % a->segments;
        Py_ssize_t at = a->pos + t, lo = first_read(L, at) + seg * ATTN_SEGMENT;
        if (lo > at) continue; /* this token reads fewer segments */
        Py_ssize_t hi = lo + ATTN_SEGMENT - 1 < at ? lo + ATTN_SEGMENT - 1 : at;
        const float *keys = L->cache + kv * L->cache_rows * dim;
        const float *values = L->cache + ((Py_ssize_t)kv_heads + kv) * L->cache_rows * dim;
        for (int h0 = 0; h0 < group; h0 += GROUP_MAX) {
            const int g = group - h0 < GROUP_MAX ? group - h0 : GROUP_MAX;
            const Py_ssize_t head = (Py_ssize_t)kv * group + h0;
            const float *q = a->qkv + t * L->qkv.rows + head * dim;
            for (int j = 0; j < g; j++) {
                o[j].max = -INFINITY;
                o[j].total = 0.0f;
                for (int d = 0; d < dim; d++) o[j].acc[d] = 0.0f;
            }
            for (Py_ssize_t p = lo; p <= hi;) {
                Py_ssize_t row = p % L->cache_rows, run = hi - p + 1; /* rows from `row` without wrapping */
                if (run > L->cache_rows - row) run = L->cache_rows - row;
                for (Py_ssize_t r = 0; r < run; r += ATTN_TILE) {
                    int n = run - r < ATTN_TILE ? (int)(run - r) : ATTN_TILE;
                    const float *k = keys + (row + r) * dim, *v = values + (row + r) * dim;
#ifdef HAVE_AVX512_KERNELS
                    if (use_avx512 && dim % 16 == 0) {
                        attend_group_tile_avx512(o, g, q, k, v, n, dim, L->attn_scale);
                        continue;
                    }
#endif
                    for (int j = 0; j < g; j++) attend_tile_portable(&o[j], q + j * dim, k, v, n, dim, L->attn_scale);
                }
                p += run;
            }
            for (int j = 0; j < g; j++) {
                float *part = a->parts + ((t * L->heads + head + j) * a->segments + seg) * width;
                part[0] = o[j].max;
                part[1] = o[j].total;
                memcpy(part + 2, o[j].acc, (size_t)dim * sizeof(float));
            }
        }
    }
}

/* out[t][h * dim ..] = each head's segments combined in order: the softmax-weighted sum of values. */
static void merge_segments(const AttendJob *a, int T, float *out) {
    const Layer *L = a->L;
    const int dim = L->dim;
    const Py_ssize_t width = 2 + dim;
    for (int t = 0; t < T; t++) {
        Py_ssize_t at = a->pos + t, segments = segments_of(first_read(L, at), at);
        for (int h = 0; h < L->heads; h++) {
            float *first = a->parts + ((Py_ssize_t)(t * L->heads + h) * a->segments) * width;
            float max = first[0], total = first[1], *acc = first + 2;
            for (Py_ssize_t seg = 1; seg < segments; seg++) {
                const float *part = first + seg * width;
                float new_max = part[0] > max ? part[0] : max;
                float mine = expf(max - new_max), theirs = expf(part[0] - new_max);
                total = total * mine + part[1] * theirs;
                for (int d = 0; d < dim; d++) acc[d] = acc[d] * mine + part[2 + d] * theirs;
                max = new_max;
            }
            float *o = out + ((Py_ssize_t)t * L->heads + h) * dim;
            for (int d = 0; d < dim; d++) o[d] = acc[d] / total;
        }
    }
}

/* The T tokens at positions at .. at + T - 1 attend: items on the threads where there is enough to
 * share. The last token reads the most positions (a window or the cache's rows bound them all). */
static void attend(const Layer *L, const float *qkv, Py_ssize_t at, int T, float *parts, float *out, int threads) {
    Py_ssize_t last = at + T - 1, lo = first_read(L, last), reads = (last - lo + 1) * T;
    AttendJob job = {L, qkv, at, segments_of(lo, last), parts};
    /* Threads only where a head's loop is long enough to pay for waking them. */
    int attend_threads = reads * L->dim * L->heads >= 64 * 1024 ? threads : 1;
    parallel_items(attend_items, &job, (Py_ssize_t)T * L->kv_heads * job.segments, attend_threads);
    merge_segments(&job, T, out);
}

static inline float activation(int act, float g) {
    switch (act) {
    case ACT_GELU_TANH: {
        /* torch's tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
        float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
        return 0.5f * g * (1.0f + tanhf(inner));
    }
    case ACT_GELU:
        return g * 0.5f * (1.0f + erff(g * 0.7071067811865476f));
    default:
        return g / (1.0f + expf(-g));
    }
}

#ifdef HAVE_AVX512_KERNELS
/* gate_up[i] = act(gate_up[i]) * gate_up[ffn + i] for SiLU, g / (1 + e^-g), and GELU's tanh form
 * as the same sigmoid: 0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)), without tanh's cancellation; into
 * out [ffn], which may be gate_up itself. */
static AVX512 void activate_avx512(int act, const float *gate_up, float *out, int ffn) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < ffn; i += 16) {
        __mmask16 lanes = ffn - i >= 16 ? 0xFFFF : (__mmask16)((1u << (ffn - i)) - 1);
        __m512 g = _mm512_maskz_loadu_ps(lanes, gate_up + i);
        __m512 arg = g; /* e^-arg is the sigmoid's */
        if (act == ACT_GELU_TANH) {
            __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
            __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                         _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), cube)));
            arg = _mm512_add_ps(inner, inner);
        }
        __m512 sig = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), arg))));
        _mm512_mask_storeu_ps(out + i, lanes, _mm512_mul_ps(sig, _mm512_maskz_loadu_ps(lanes, gate_up + ffn + i)));
    }
}
#endif

/* out [ffn] = act(gate) * up of one token's gate_up [2 ffn]; out may be gate_up itself. */
static void activate(int act, const float *gate_up, float *out, int ffn) {
#ifdef HAVE_AVX512_KERNELS
    if (use_avx512 && act != ACT_GELU) {
        activate_avx512(act, gate_up, out, ffn);
        return;
    }
#endif
    for (int i = 0; i < ffn; i++) out[i] = activation(act, gate_up[i]) * gate_up[ffn + i];
}

/* x += post_norm(y) where the layer has one, else x += y. */
static void add_residual(float *x, const float *y, const float *post_norm, int n, float eps, float *tmp) {
    if (post_norm) {
        rms_norm_into(y, post_norm, n, eps, tmp);
        y = tmp;
    }
    for (int i = 0; i < n; i++) x[i] = y[i] + x[i];
}

/* This thread's float scratch of at least n values (grown, never shrunk; one per calling thread). */
static float *scratch_floats(size_t n) {
    static __thread float *buffer = NULL;
    static __thread size_t size = 0;
    if (n > size) {
        float *grown = realloc(buffer, n * sizeof(float));
        if (!grown) return NULL;
        buffer = grown;
        size = n;
    }
    return buffer;
}

/* The floats of scratch layer_forward takes for T tokens. */
static size_t layer_scratch(const Layer *L, int T) {
    return (size_t)T * ((size_t)L->hidden * 2 + (size_t)L->qkv.rows + (size_t)L->heads * L->dim + 2 * (size_t)L->ffn) +
           (size_t)L->hidden + (size_t)T * L->heads * max_segments(L) * (2 + (size_t)L->dim);
}

/* The layer for T tokens at positions pos .. pos + T - 1; x [T][hidden] updated in place. The
 * projections take all T tokens at once (the weights are read once); token t attends to rows up
 * to pos + t: all T tokens in one phase where the cache has room for them, else each token writes
 * its row and attends in turn (see below). Each token's values are bit for bit those of T = 1. */
static void layer_forward(const Layer *L, float *x, int T, Py_ssize_t pos, int threads, float *scratch) {
    const int hidden = L->hidden, dim = L->dim, heads = L->heads, kv_heads = L->kv_heads, ffn = L->ffn;
    const Py_ssize_t qkv_rows = L->qkv.rows, attn_width = (Py_ssize_t)heads * dim;
    float *normed = scratch;                     /* [T][hidden] */
    float *qkv = normed + (size_t)T * hidden;    /* [T][(H + 2 KV) D] */
    float *attn = qkv + (size_t)T * qkv_rows;    /* [T][H D] */
    float *y = attn + (size_t)T * attn_width;    /* [T][hidden]: a projection's output */
    float *tmp = y + (size_t)T * hidden;         /* [hidden] */
    float *gate_up = tmp + hidden;               /* [T][2 F] */
    float *parts = gate_up + (size_t)T * 2 * ffn; /* [T][H][segments][2 + D]: attention's partial sums */

    for (int t = 0; t < T; t++) rms_norm_into(x + (size_t)t * hidden, L->norm_in, hidden, L->eps, normed + (size_t)t * hidden);
    project(&L->qkv, normed, T, hidden, qkv, threads);

    /* With no row of the cache reused inside this step (pos + T <= cache_rows), every token's keys
     * and values go in first and all the tokens attend in one phase: token t still reads rows up to
     * pos + t only. Else (a ring that wraps) each token writes and attends in order, so that a later
     * token's write never replaces a row an earlier one still reads. */
    const int together = T > 1 && pos + T <= L->cache_rows;
    for (int t = 0; t < T; t++) {
        float *q = qkv + (size_t)t * qkv_rows;
        Py_ssize_t at = pos + t;
        const float *cos = L->cos + at * dim, *sin = L->sin + at * dim;
        for (int h = 0; h < heads + kv_heads; h++)
            norm_rotate(q + (Py_ssize_t)h * dim, L->qk_norm ? L->qk_norm + (Py_ssize_t)h * dim : NULL, cos, sin, dim,
                        L->eps, L->sin_folded);
        Py_ssize_t row = at % L->cache_rows;
        for (int kv = 0; kv < kv_heads; kv++) {
            memcpy(L->cache + (kv * L->cache_rows + row) * dim, q + (Py_ssize_t)(heads + kv) * dim,
                   (size_t)dim * sizeof(float));
            memcpy(L->cache + ((kv_heads + kv) * L->cache_rows + row) * dim,
                   q + (Py_ssize_t)(heads + kv_heads + kv) * dim, (size_t)dim * sizeof(float));
        }
        if (!together) attend(L, q, at, 1, parts, attn + (size_t)t * attn_width, threads);
    }
    if (together) attend(L, qkv, pos, T, parts, attn, threads);

    project(&L->o, attn, T, attn_width, y, threads);
    for (int t = 0; t < T; t++)
        add_residual(x + (size_t)t * hidden, y + (size_t)t * hidden, L->norm_post_attn, hidden, L->eps, tmp);

    for (int t = 0; t < T; t++)
        rms_norm_into(x + (size_t)t * hidden, L->norm_pre_ff, hidden, L->eps, normed + (size_t)t * hidden);
    project(&L->gate_up, normed, T, hidden, gate_up, threads);
    for (int t = 0; t < T; t++) {
        float *row = gate_up + (size_t)t * 2 * ffn;
        activate(L->act, row, row, ffn); /* in place: down reads the first half */
    }
    /* down reads each token's activated half: the first F of its 2F floats. */
    project(&L->down, gate_up, T, 2 * (Py_ssize_t)ffn, y, threads);
    for (int t = 0; t < T; t++)
        add_residual(x + (size_t)t * hidden, y + (size_t)t * hidden, L->norm_post_ff, hidden, L->eps, tmp);
}

/* Layers [0, n) for one token: on thread 0 of one OpenMP region whose other threads follow the
 * phases as a team (see "the decode team"); on the calling thread alone where there is one thread,
 * or another caller has the team. */
static void run_layers(const Layer *const *layers, int n, float *x, int T, Py_ssize_t pos, int threads,
                       float *scratch) {
#ifdef HAVE_DECODE_TEAM
    if (threads > 1 && pthread_mutex_trylock(&team.user) == 0) {
        __atomic_store_n(&team.finished, 0, __ATOMIC_SEQ_CST);
#pragma omp parallel num_threads(threads)
        {
            if (omp_get_thread_num() == 0) {
                team_leading = 1;
                for (int i = 0; i < n; i++) layer_forward(layers[i], x, T, pos, threads, scratch);
                team_leading = 0;
                __atomic_store_n(&team.finished, 1, __ATOMIC_SEQ_CST);
                uint64_t number = ((__atomic_load_n(&team.claim, __ATOMIC_RELAXED) >> (2 * TEAM_ITEM_BITS)) + 1) & ((1ull << 24) - 1);
                team_publish(number << (2 * TEAM_ITEM_BITS)); /* a job of no items: wakes the others to leave */
            } else {
                team_follow();
            }
        }
        pthread_mutex_unlock(&team.user);
        return;
    }
#endif
    for (int i = 0; i < n; i++) layer_forward(layers[i], x, T, pos, threads, scratch);
}

static const char *LAYER_CAPSULE = "ds4desk.gguf_cpu.layer";

static void layer_free(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, LAYER_CAPSULE)); }

static const void *ptr_of(unsigned long long v) { return (const void *)(uintptr_t)v; }

/* proj: (parts, bias_ptr) with parts a tuple of (type, w_ptr, w_stride, rows, cols). */
static int parse_proj(PyObject *spec, int cols, Proj *out) {
    PyObject *parts;
    unsigned long long bias;
    if (!PyArg_ParseTuple(spec, "OK", &parts, &bias)) return -1;
    if (!PyTuple_Check(parts) || PyTuple_GET_SIZE(parts) < 1 || PyTuple_GET_SIZE(parts) > MAX_PARTS) {
        PyErr_SetString(PyExc_ValueError, "make_layer: a projection takes 1 to 4 parts");
        return -1;
    }
    out->n = (int)PyTuple_GET_SIZE(parts);
    out->rows = 0;
    out->bias = ptr_of(bias);
    for (int i = 0; i < out->n; i++) {
        int type, part_cols;
        unsigned long long w;
        Part *part = &out->parts[i];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(parts, i), "iKnni", &type, &w, &part->w_stride, &part->rows,
                              &part_cols))
            return -1;
        part->ti = type_info(type);
        part->w = ptr_of(w);
        part->cols = part_cols;
        if (part->ti == NULL || part_cols != cols || cols % part->ti->block_values || part->rows <= 0) {
            PyErr_SetString(PyExc_ValueError, "make_layer: a part's type or shape does not fit");
            return -1;
        }
        out->rows += part->rows;
    }
    return 0;
}

/* ---- prefill's row-wise ops ---------------------------------------------------------------------
 * The steps between a prompt's matmuls, each one pass over its rows in C with the decode layer's
 * own functions: in torch each is several ops, and on a small model (Gemma-3-270M, 128 tokens on
 * two cores) they cost about a tenth of the prefill. */

/* Below this many floats a row op runs on the calling thread: waking the pool costs more. */
#define ROWS_PARALLEL_MIN (32 * 1024)

typedef struct {
    float *x;             /* token t, head h: x + t * x_stride + h * dim */
    Py_ssize_t x_stride;
    int heads, dim;
    const float *weight;  /* NULL, one row [dim] for every head, or a row per head [heads][dim];
                           * with a rotation, NULL: no norm, only the rotation (norm_rotate) */
    int weight_per_head;
    float eps;
    const float *cos, *sin; /* NULL: no rotation; else token t's rows at + t * dim */
    int sin_folded;
    float *out;           /* like x (out_stride); with a rotation, out is x */
    Py_ssize_t out_stride;
} NormRows;

static void norm_rows(const void *job, Py_ssize_t i0, Py_ssize_t i1) {
    const NormRows *j = job;
    for (Py_ssize_t i = i0; i < i1; i++) {
        Py_ssize_t t = i / j->heads;
        int h = (int)(i % j->heads);
        const float *w = j->weight ? j->weight + (j->weight_per_head ? (Py_ssize_t)h * j->dim : 0) : NULL;
        float *x = j->x + t * j->x_stride + (Py_ssize_t)h * j->dim;
        if (j->cos)
            norm_rotate(x, w, j->cos + t * j->dim, j->sin + t * j->dim, j->dim, j->eps, j->sin_folded);
        else
            rms_norm_into(x, w, j->dim, j->eps, j->out + t * j->out_stride + (Py_ssize_t)h * j->dim);
    }
}

static PyObject *py_norm_rows(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr;
    Py_ssize_t x_stride, out_stride, tokens;
    int heads, dim, per_head, sin_folded, threads;
    float eps;
    if (!PyArg_ParseTuple(args, "KnniiKpfKKpKni", &x_ptr, &x_stride, &tokens, &heads, &dim, &w_ptr, &per_head, &eps,
                          &cos_ptr, &sin_ptr, &sin_folded, &out_ptr, &out_stride, &threads))
        return NULL;
    if (tokens < 0 || heads <= 0 || dim <= 0 || (cos_ptr && (dim > 512 || dim % 2 || out_ptr != x_ptr || !per_head)) ||
        (cos_ptr != 0) != (sin_ptr != 0)) {
        PyErr_SetString(PyExc_ValueError, "norm_rows: unsupported shape");
        return NULL;
    }
    NormRows job = {(float *)(uintptr_t)x_ptr, x_stride, heads, dim, (const float *)(uintptr_t)w_ptr, per_head, eps,
                    (const float *)(uintptr_t)cos_ptr, (const float *)(uintptr_t)sin_ptr, sin_folded,
                    (float *)(uintptr_t)out_ptr, out_stride};
    Py_ssize_t items = tokens * heads;
    if (items * dim < ROWS_PARALLEL_MIN) threads = 1;
    Py_BEGIN_ALLOW_THREADS
    parallel_items(norm_rows, &job, items, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

typedef struct {
    int act, ffn;
    const float *gate_up; /* token t: [2 ffn] at gate_up + t * gate_up_stride */
    Py_ssize_t gate_up_stride;
    float *out;           /* token t: [ffn] at out + t * out_stride */
    Py_ssize_t out_stride;
} GatedRows;

static void gated_rows(const void *job, Py_ssize_t t0, Py_ssize_t t1) {
    const GatedRows *j = job;
    for (Py_ssize_t t = t0; t < t1; t++)
        activate(j->act, j->gate_up + t * j->gate_up_stride, j->out + t * j->out_stride, j->ffn);
}

static PyObject *py_gated_rows(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long gate_up_ptr, out_ptr;
    Py_ssize_t gate_up_stride, out_stride, tokens;
    int act, ffn, threads;
    if (!PyArg_ParseTuple(args, "iKnniKni", &act, &gate_up_ptr, &gate_up_stride, &tokens, &ffn, &out_ptr, &out_stride,
                          &threads))
        return NULL;
    if (tokens < 0 || ffn <= 0 || act < ACT_SILU || act > ACT_GELU) {
        PyErr_SetString(PyExc_ValueError, "gated_rows: unsupported activation or shape");
        return NULL;
    }
    GatedRows job = {act, ffn, (const float *)(uintptr_t)gate_up_ptr, gate_up_stride, (float *)(uintptr_t)out_ptr,
                     out_stride};
    if (tokens * ffn < ROWS_PARALLEL_MIN) threads = 1;
    Py_BEGIN_ALLOW_THREADS
    parallel_items(gated_rows, &job, tokens, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_make_layer(PyObject *self, PyObject *args) {
    (void)self;
    Layer L;
    memset(&L, 0, sizeof(L));
    unsigned long long norm_in, norm_post_attn, norm_pre_ff, norm_post_ff, qk_norm, cache, cos, sin;
    PyObject *qkv, *o, *gate_up, *down;
    if (!PyArg_ParseTuple(args, "(iiiii)ffiin(KKKKK)OOOO(Kn)(KKn)", &L.hidden, &L.heads, &L.kv_heads, &L.dim,
                          &L.ffn, &L.eps, &L.attn_scale, &L.act, &L.sin_folded, &L.window, &norm_in,
                          &norm_post_attn, &norm_pre_ff, &norm_post_ff, &qk_norm, &qkv, &o, &gate_up, &down,
                          &cache, &L.cache_rows, &cos, &sin, &L.table_rows))
        return NULL;
    if (L.hidden <= 0 || L.heads <= 0 || L.kv_heads <= 0 || L.heads % L.kv_heads || L.dim <= 0 || L.dim > 512 ||
        L.dim % 2 || L.ffn <= 0 || L.cache_rows <= 0 || L.table_rows <= 0 || L.window < 0 || L.act < 0 ||
        L.act > ACT_GELU || !norm_in || !norm_pre_ff || !cache || !cos || !sin) {
        PyErr_SetString(PyExc_ValueError, "make_layer: bad dimensions or missing tensors");
        return NULL;
    }
    L.norm_in = ptr_of(norm_in);
    L.norm_post_attn = ptr_of(norm_post_attn);
    L.norm_pre_ff = ptr_of(norm_pre_ff);
    L.norm_post_ff = ptr_of(norm_post_ff);
    L.qk_norm = ptr_of(qk_norm);
    L.cache = (float *)(uintptr_t)cache;
    L.cos = ptr_of(cos);
    L.sin = ptr_of(sin);
    if (parse_proj(qkv, L.hidden, &L.qkv) || parse_proj(o, L.heads * L.dim, &L.o) ||
        parse_proj(gate_up, L.hidden, &L.gate_up) || parse_proj(down, L.ffn, &L.down))
        return NULL;
    if (L.qkv.rows != (Py_ssize_t)(L.heads + 2 * L.kv_heads) * L.dim || L.o.rows != L.hidden ||
        L.gate_up.rows != 2 * (Py_ssize_t)L.ffn || L.down.rows != L.hidden) {
        PyErr_SetString(PyExc_ValueError, "make_layer: projection rows do not fit the dimensions");
        return NULL;
    }
    Layer *owned = malloc(sizeof(Layer));
    if (!owned) return PyErr_NoMemory();
    *owned = L;
    PyObject *capsule = PyCapsule_New(owned, LAYER_CAPSULE, layer_free);
    if (!capsule) free(owned);
    return capsule;
}

#define MAX_LAYERS 1024
#define MAX_TOKENS 16 /* a verify step's drafts and the token before them */

/* decode_layers(layers, x_ptr, pos, threads[, count]): a tuple of make_layer's layers, in order, for
 * `count` tokens (1 to MAX_TOKENS) at pos ..; x [count][hidden] updated in place. */
static PyObject *py_decode_layers(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tuple;
    unsigned long long x_ptr;
    Py_ssize_t pos;
    int threads, count = 1;
    if (!PyArg_ParseTuple(args, "O!Kni|i", &PyTuple_Type, &tuple, &x_ptr, &pos, &threads, &count)) return NULL;
    if (count < 1 || count > MAX_TOKENS) {
        PyErr_SetString(PyExc_ValueError, "decode_layers: 1 to 16 tokens");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    if (n < 1 || n > MAX_LAYERS) {
        PyErr_SetString(PyExc_ValueError, "decode_layers: 1 to 1024 layers");
        return NULL;
    }
    const Layer *layers[MAX_LAYERS];
    size_t need = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const Layer *L = PyCapsule_GetPointer(PyTuple_GET_ITEM(tuple, i), LAYER_CAPSULE);
        if (!L) return NULL;
        if (i > 0 && L->hidden != layers[0]->hidden) {
            PyErr_SetString(PyExc_ValueError, "decode_layers: layers of different widths");
            return NULL;
        }
        /* The positions the last token reads, [last + 1 - window, last], must all be in the cache. */
        Py_ssize_t last = pos + count - 1;
        Py_ssize_t needed = L->window > 0 && L->window < last + 1 ? L->window : last + 1;
        if (pos < 0 || last >= L->table_rows || needed > L->cache_rows) {
            PyErr_SetString(PyExc_ValueError, "decode_layers: position outside the cache");
            return NULL;
        }
        size_t floats = layer_scratch(L, count);
        if (floats > need) need = floats;
        layers[i] = L;
    }
    float *scratch = scratch_floats(need);
    if (!scratch) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    run_layers(layers, (int)n, (float *)(uintptr_t)x_ptr, count, pos, threads < 1 ? 1 : threads, scratch);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- Python entry points ------------------------------------------------------------------------- */

/* gemv's and gemm's shared arguments (type, w_ptr, w_stride, rows, cols, x_ptr, T, x_stride, y_ptr,
 * y_stride, threads) into g (kernel unset) and *threads; 0 with a Python error set if they do not fit. */
static int parse_product(PyObject *args, const char *name, Gemv *g, int *threads) {
    int type, cols, T;
    unsigned long long w_ptr, x_ptr, y_ptr;
    Py_ssize_t w_stride, rows, x_stride, y_stride;
    if (!PyArg_ParseTuple(args, "iKnniKinKni", &type, &w_ptr, &w_stride, &rows, &cols, &x_ptr, &T, &x_stride,
                          &y_ptr, &y_stride, threads))
        return 0;
    const TypeInfo *ti = type_info(type);
    if (ti == NULL || cols <= 0 || cols % ti->block_values || T <= 0 || rows < 0) {
        PyErr_Format(PyExc_ValueError, "%s: unsupported type or shape", name);
        return 0;
    }
    *g = (Gemv){ti, (const uint8_t *)(uintptr_t)w_ptr, w_stride, rows, cols, (const float *)(uintptr_t)x_ptr, T,
                x_stride, (float *)(uintptr_t)y_ptr, y_stride, NULL};
    return 1;
}

static PyObject *py_gemv(PyObject *self, PyObject *args) {
    (void)self;
    Gemv g;
    int threads;
    if (!parse_product(args, "gemv", &g, &threads)) return NULL;
    g.kernel = portable_gemv_rows;
#ifdef HAVE_AVX512_KERNELS
    if (use_avx512) {
        GemvFn fast;
        DequantFn unused, unused_bf16;
        avx512_kernels(g.ti->type, g.cols, &fast, &unused, &unused_bf16);
        if (fast) g.kernel = fast;
    }
#endif
    if (g.rows * g.w_stride < PARALLEL_MIN_BYTES) threads = 1;
    Py_BEGIN_ALLOW_THREADS
    parallel_rows(gemv_rows, &g, g.rows, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_gemm(PyObject *self, PyObject *args) {
    /* False where this type or build has no AVX-512 decoder: the caller then takes its tiled path. */
    (void)self;
    Gemv p;
    int threads;
    if (!parse_product(args, "gemm", &p, &threads)) return NULL;
#ifdef HAVE_AVX512_KERNELS
    DequantFn decode = use_avx512 ? avx512_cached_decoder(p.ti->type, p.cols) : NULL;
    if (decode == NULL) Py_RETURN_FALSE;
    if (threads < 1) threads = 1;
    /* One allocation: xt's blocks, then a panel per thread (every part a multiple of 64 bytes). */
    const size_t xt_floats = (size_t)((p.T + GEMM_NB - 1) / GEMM_NB) * p.cols * GEMM_NB;
    const size_t panel_floats = ((size_t)GEMM_MR * p.cols + 15) & ~(size_t)15;
    float *xt = aligned_alloc(64, (xt_floats + panel_floats * threads) * sizeof(float));
    if (!xt) return PyErr_NoMemory();
    const int fit = GEMM_GROUP_BYTES / (GEMM_NB * p.cols * (int)sizeof(float));
    const int group = (fit > 1 ? fit : 1) * GEMM_NB;
    Gemm g = {decode, p.ti->block_values, p.w, p.w_stride, p.rows, p.cols, p.T, p.x, p.x_stride, xt,
              xt + xt_floats, group, p.y, p.y_stride};
    const Py_ssize_t items = (p.rows + GEMM_MR - 1) / GEMM_MR * ((p.T + group - 1) / group);
    Py_BEGIN_ALLOW_THREADS
    parallel_chunks(gemm_pack_x, &g, (p.T + GEMM_NB - 1) / GEMM_NB, 1, threads);
    /* Chunks of 4 items (48 rows, 192 bytes of a token's y): whole cache lines of y between the
     * threads' chunks where y's rows start on a line, and every claim tens of microseconds of work. */
    parallel_chunks(gemm_items, &g, items, 4, threads);
    Py_END_ALLOW_THREADS
    free(xt);
    Py_RETURN_TRUE;
#else
    (void)threads;
    Py_RETURN_FALSE;
#endif
}

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    (void)self;
    int type, cols, threads, bf16 = 0;
    unsigned long long w_ptr, dst_ptr;
    Py_ssize_t w_stride, rows;
    if (!PyArg_ParseTuple(args, "iKnniKi|p", &type, &w_ptr, &w_stride, &rows, &cols, &dst_ptr, &threads, &bf16))
        return NULL;
    const TypeInfo *ti = type_info(type);
    if (ti == NULL || cols <= 0 || cols % ti->block_values || rows < 0) {
        PyErr_SetString(PyExc_ValueError, "dequantize: unsupported type or shape");
        return NULL;
    }
    const uint8_t *w = (const uint8_t *)(uintptr_t)w_ptr;
    DequantFn fast = NULL, fast_bf16 = NULL;
#ifdef HAVE_AVX512_KERNELS
    if (use_avx512) {
        GemvFn unused;
        avx512_kernels(type, cols, &unused, &fast, &fast_bf16);
    }
#endif
    if (bf16 && fast_bf16 == NULL) {
        PyErr_SetString(PyExc_ValueError, "dequantize: bfloat16 rows need this type's AVX-512 decoder");
        return NULL;
    }
    Dequant job = {ti, w, w_stride, cols, (void *)(uintptr_t)dst_ptr, bf16 ? 2 : 4, bf16 ? fast_bf16 : fast};
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

static PyObject *py_has_avx512_bf16(PyObject *self, PyObject *args) {
    /* Whether the CPU multiplies bfloat16 natively (AVX512_BF16): oneDNN's bfloat16 products are then
     * about 3x its float32 ones, and without it slower than them. */
    (void)self;
    (void)args;
#ifdef HAVE_AVX512_KERNELS
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx512bf16"));
#else
    Py_RETURN_FALSE;
#endif
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
    {"gemm", py_gemm, METH_VARARGS,
     "gemm(type, w_ptr, w_stride, rows, cols, x_ptr, T, x_stride, y_ptr, y_stride, threads) -> bool: y = x @ W^T"},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(type, w_ptr, w_stride, rows, cols, dst_ptr, threads, bf16=False): W as float32 (or bfloat16) [rows, cols]"},
    {"make_layer", py_make_layer, METH_VARARGS,
     "make_layer(dims, eps, attn_scale, act, sin_folded, window, norms, qkv, o, gate_up, down, cache, tables)"},
    {"decode_layers", py_decode_layers, METH_VARARGS,
     "decode_layers(layers, x_ptr, pos, threads): one token through a tuple of layers, x updated in place"},
    {"norm_rows", py_norm_rows, METH_VARARGS,
     "norm_rows(x_ptr, x_stride, tokens, heads, dim, w_ptr, w_per_head, eps, cos_ptr, sin_ptr, sin_folded, out_ptr, "
     "out_stride, threads): RMSNorm of every head row (times its weight), then RoPE in place where cos_ptr"},
    {"gated_rows", py_gated_rows, METH_VARARGS,
     "gated_rows(act, gate_up_ptr, gate_up_stride, tokens, ffn, out_ptr, out_stride, threads): act(gate) * up"},
    {"kernel_isa", py_kernel_isa, METH_NOARGS, "the instruction set the kernels use: avx512 or portable"},
    {"has_avx512_bf16", py_has_avx512_bf16, METH_NOARGS, "whether the CPU has AVX512_BF16"},
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
