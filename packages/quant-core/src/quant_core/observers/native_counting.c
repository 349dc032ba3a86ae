/* Histogram counting in one pass over the values, built on first use by
 * quant_core.observers.native (plain C99, no Python headers, no library beyond libc).
 *
 * A value's bin is floor(x * scale) - offset, as in quant_core.observers.binning: the
 * scale is a power of two, so x * scale is exact or underflows to a signed zero (a
 * negative value that underflows to -0.0 belongs to bin floor = -1). The numpy path
 * subtracts two integers below 2**25 in float, which is exact, so a bin computed here on
 * integers is that path's bin, and the counts are equal.
 *
 * The values go through in blocks that stay in L1. For each block: its minimum, maximum
 * and NaN flag (vector code), which also tell whether every value of the block lies inside
 * the grid (floor is monotonic); then the bins without a check per value (a truncating
 * conversion, which is the floor for values >= 0, and one less where it rounded up
 * otherwise); then the counts, spread over interleaved copies.
 *
 * qc_count_<type>(x, n, scale, offset, bins, counts, range)
 *   counts: bins int64 counts, zeroed by the caller, filled only when every value lies
 *           inside the grid (returns 0); a value outside it, NaN or an infinity returns 1
 *           and leaves counts as they are.
 *   range:  when not NULL, range[0] and range[1] receive the exact minimum and maximum of
 *           all n values (NaN when one of them is NaN), whether or not they were counted:
 *           an observer that tried its current grid needs the range to pick another.
 *   bins <= 0 computes the range alone (and returns 1). |offset| + bins must stay below
 *   2**30 (the caller checks).
 *   Returns -1 when the scratch memory cannot be allocated.
 */
#include <math.h> /* NAN only: nothing from libm is linked */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Consecutive values spread over interleaved copies of the counts, so that a run of
 * values in one bin (the zeros after a ReLU) does not make each addition wait for the
 * previous one's store. */
#define LANES 8
/* Unused counts between two copies: copies exactly a power of two apart share cache sets. */
#define LANE_GAP 16
/* Below this many values one copy: zeroing and summing eight costs more than it saves. */
#define LANE_MIN_VALUES 16384
/* Values handled at a time: they and their bins stay in L1 between the block's passes. */
#define BLOCK 2048
/* The copies' counts (16 bits: eight copies of 2,048 bins fit L1), added to the int64
 * totals before one could overflow: a copy takes at most every LANES-th value. */
typedef uint16_t lane_t;
#define LANE_MAX 65535LL
/* Doubles from 2**52 up are integers. */
#define INTEGRAL_FROM 4503599627370496.0

typedef struct {
    double lo, hi;
    int nan;
} extremes_t;

/* floor(v * scale) in double, exact (v * scale is exact in double for float32 data and for
 * float64 data away from the ends of its range), with the underflow rule above. */
static double scaled_floor(double v, double scale) {
    const double s = v * scale;
    if (!(s < INTEGRAL_FROM && s > -INTEGRAL_FROM)) return s; /* integral, infinite or NaN */
    const double t = (double)(int64_t)s;
    double f = t > s ? t - 1.0 : t;
    if (f == 0.0 && v < 0.0) f = -1.0;
    return f;
}

/* The block's minimum, maximum and NaN flag. SSE2 (every x86-64) has vector min and max,
 * which compilers do not emit for a plain C loop without -ffinite-math-only (that would
 * drop the NaN test); min and max are exact in any grouping. Four vectors at a time into
 * four independent accumulators: one accumulator waits on the previous min's latency at
 * every step, which made this pass half the cost of the count. Elsewhere a scalar loop. */
#if defined(__SSE2__)
#include <emmintrin.h>
/* VEC: the SSE2 vector of T; SUFFIX: the intrinsics' type suffix (ps, pd). */
#define DEFINE_EXTREMES(NAME, T, VEC, SUFFIX)                                                 \
    static extremes_t NAME(const T *p, int m) {                                               \
        enum { WIDTH = sizeof(VEC) / sizeof(T), STEP = 4 * WIDTH };                           \
        VEC lo[4], hi[4], nan[4];                                                             \
        for (int a = 0; a < 4; ++a) {                                                         \
            lo[a] = hi[a] = _mm_set1_##SUFFIX(p[0]);                                          \
            nan[a] = _mm_setzero_##SUFFIX();                                                  \
        }                                                                                     \
        int k = 0;                                                                            \
        for (; k + STEP <= m; k += STEP)                                                      \
            for (int a = 0; a < 4; ++a) {                                                     \
                const VEC v = _mm_loadu_##SUFFIX(p + k + a * WIDTH);                          \
                nan[a] = _mm_or_##SUFFIX(nan[a], _mm_cmpunord_##SUFFIX(v, v));                \
                lo[a] = _mm_min_##SUFFIX(lo[a], v); /* a NaN keeps the running value */       \
                hi[a] = _mm_max_##SUFFIX(hi[a], v);                                           \
            }                                                                                 \
        for (; k < m; ++k) { /* the last values one at a time, in every lane */               \
            const VEC v = _mm_set1_##SUFFIX(p[k]);                                            \
            nan[0] = _mm_or_##SUFFIX(nan[0], _mm_cmpunord_##SUFFIX(v, v));                    \
            lo[0] = _mm_min_##SUFFIX(lo[0], v);                                               \
            hi[0] = _mm_max_##SUFFIX(hi[0], v);                                               \
        }                                                                                     \
        for (int a = 1; a < 4; ++a) {                                                         \
            nan[0] = _mm_or_##SUFFIX(nan[0], nan[a]);                                         \
            lo[0] = _mm_min_##SUFFIX(lo[0], lo[a]);                                           \
            hi[0] = _mm_max_##SUFFIX(hi[0], hi[a]);                                           \
        }                                                                                     \
        T l[WIDTH], h[WIDTH];                                                                 \
        _mm_storeu_##SUFFIX(l, lo[0]);                                                        \
        _mm_storeu_##SUFFIX(h, hi[0]);                                                        \
        extremes_t e = {l[0], h[0], _mm_movemask_##SUFFIX(nan[0]) != 0};                      \
        for (int j = 1; j < WIDTH; ++j) {                                                     \
            e.lo = l[j] < e.lo ? l[j] : e.lo;                                                 \
            e.hi = h[j] > e.hi ? h[j] : e.hi;                                                 \
        }                                                                                     \
        return e;                                                                             \
    }
DEFINE_EXTREMES(extremes_f32, float, __m128, ps)
DEFINE_EXTREMES(extremes_f64, double, __m128d, pd)
#else
#define DEFINE_EXTREMES(NAME, T)                                                              \
    static extremes_t NAME(const T *p, int m) {                                               \
        T lo = p[0], hi = p[0];                                                               \
        int nan = 0;                                                                          \
        for (int k = 0; k < m; ++k) {                                                         \
            const T v = p[k];                                                                 \
            nan |= v != v;                                                                    \
            lo = v < lo ? v : lo;                                                             \
            hi = v > hi ? v : hi;                                                             \
        }                                                                                     \
        extremes_t e = {lo, hi, nan};                                                         \
        return e;                                                                             \
    }
DEFINE_EXTREMES(extremes_f32, float)
DEFINE_EXTREMES(extremes_f64, double)
#endif

static void flush_lanes(lane_t *lanes, int lanes_used, int32_t stride, int32_t bins, int64_t *totals) {
    for (int l = 0; l < lanes_used; ++l)
        for (int32_t b = 0; b < bins; ++b) totals[b] += lanes[(int64_t)l * stride + b];
    memset(lanes, 0, sizeof(lane_t) * (size_t)lanes_used * (size_t)stride);
}

/* Bins of one block whose values all lie inside the grid (so |x * scale| < 2**30), each
 * offset by its copy of the counts. Two loops, so that each vectorizes: values >= 0 (the
 * truncation is the floor; -0.0 is 0 there too) and any values. */
#define DEFINE_BINS(NAME, T)                                                                  \
    static void NAME(const T *restrict p, int m, T scale, int32_t offset, int nonnegative,    \
                     const int32_t *restrict lane_of, int32_t *restrict index) {              \
        if (nonnegative) {                                                                    \
            for (int k = 0; k < m; ++k) index[k] = (int32_t)(p[k] * scale) - offset + lane_of[k]; \
            return;                                                                           \
        }                                                                                     \
        for (int k = 0; k < m; ++k) {                                                         \
            const T x = p[k], s = x * scale;                                                  \
            const int32_t t = (int32_t)s;                                                     \
            const int32_t floor_s = t - ((T)t > s) - ((s == (T)0) & (x < (T)0));              \
            index[k] = floor_s - offset + lane_of[k];                                         \
        }                                                                                     \
    }
DEFINE_BINS(bins_f32, float)
DEFINE_BINS(bins_f64, double)

#define DEFINE_COUNT(NAME, T, EXTREMES, BINS)                                                 \
    int NAME(const T *x, int64_t n, T scale, int32_t offset, int32_t bins, int64_t *counts,   \
             double *range) {                                                                 \
        if (n <= 0) { /* no values: every one counted, no range */                         \
            if (range) range[0] = range[1] = (double)NAN;                                     \
            return bins <= 0;                                                                 \
        }                                                                                     \
        const int lanes_used = n >= LANE_MIN_VALUES ? LANES : 1;                              \
        const int32_t stride = (bins > 0 ? bins : 0) + LANE_GAP;                              \
        lane_t *lanes = calloc((size_t)lanes_used * (size_t)stride, sizeof(lane_t));          \
        int64_t *totals = calloc((size_t)stride, sizeof(int64_t));                            \
        int32_t *lane_of = malloc(sizeof(int32_t) * BLOCK);                                   \
        int32_t *index = malloc(sizeof(int32_t) * BLOCK);                                     \
        int outside = bins <= 0; /* no grid: the range alone */                               \
        if (!lanes || !totals || !lane_of || !index) outside = -1;                            \
        else                                                                                  \
            for (int k = 0; k < BLOCK; ++k) lane_of[k] = lanes_used > 1 ? (k % LANES) * stride : 0; \
        extremes_t all = {x[0], x[0], 0};                                                     \
        int64_t since_flush = 0;                                                              \
        for (int64_t start = 0; start < n && outside >= 0; start += BLOCK) {                  \
            const int m = n - start < BLOCK ? (int)(n - start) : BLOCK;                       \
            const T *p = x + start;                                                           \
            if (outside && !range) break;                                                     \
            const extremes_t e = EXTREMES(p, m);                                              \
            all.nan |= e.nan;                                                                 \
            all.lo = e.lo < all.lo ? e.lo : all.lo;                                           \
            all.hi = e.hi > all.hi ? e.hi : all.hi;                                           \
            if (outside) continue; /* the range still reads every value */                    \
            if (e.nan || scaled_floor(e.lo, (double)scale) < (double)offset ||                \
                !(scaled_floor(e.hi, (double)scale) < (double)offset + (double)bins)) {       \
                outside = 1;                                                                  \
                continue;                                                                     \
            }                                                                                 \
            BINS(p, m, scale, offset, e.lo >= 0.0, lane_of, index);                           \
            for (int k = 0; k < m; ++k) lanes[index[k]] += 1;                                 \
            since_flush += m;                                                                 \
            if (since_flush + BLOCK > LANE_MAX * lanes_used) {                                 \
                flush_lanes(lanes, lanes_used, stride, bins, totals);                         \
                since_flush = 0;                                                              \
            }                                                                                 \
        }                                                                                     \
        if (range && outside >= 0) {                                                          \
            range[0] = all.nan ? (double)NAN : all.lo;                                        \
            range[1] = all.nan ? (double)NAN : all.hi;                                        \
        }                                                                                     \
        if (!outside) {                                                                       \
            flush_lanes(lanes, lanes_used, stride, bins, totals);                             \
            memcpy(counts, totals, sizeof(int64_t) * (size_t)bins);                           \
        }                                                                                     \
        free(lanes);                                                                          \
        free(totals);                                                                         \
        free(lane_of);                                                                        \
        free(index);                                                                          \
        return outside;                                                                       \
    }

DEFINE_COUNT(qc_count_f32, float, extremes_f32, bins_f32)
DEFINE_COUNT(qc_count_f64, double, extremes_f64, bins_f64)

/* The ABI version the loader checks, raised whenever a signature above changes. */
int qc_abi_version(void) { return 2; }
