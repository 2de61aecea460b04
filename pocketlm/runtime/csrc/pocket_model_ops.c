/* Portable operations of the inference engine (pm_ops_portable, see pocket_model_ops.h):
 * norms, attention, activations, float16 conversion, activation quantization and the products
 * on tiled weights, in plain C. They run where AVX-512 is not available (the scalar and avx2
 * kernel levels, other architectures); the AVX-512 attention (pocket_model_x86.c) falls back to
 * pm_attn_portable for more than 64 query heads per KV head, and the neon operations
 * (pocket_model_neon.c) use all of them but the int8-digit tiled products.
 */
#include <math.h>

#include "pocket_internal.h"
#include "pocket_model_ops.h"

static float dot_f32(const float *a, const float *b, int len) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int c = 0;
    for (; c + 8 <= len; c += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[c + l] * b[c + l];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; c < len; c++) s += a[c] * b[c];
    return s;
}

void pm_rmsnorm_portable(const float *x, const float *w, int n, int d, float eps, float *out) {
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * d;
        float *oi = out + (size_t)i * d;
        float ms = dot_f32(xi, xi, d) / (float)d;
        float r = sqrtf(ms + eps);
        for (int c = 0; c < d; c++) oi[c] = xi[c] / r * w[c];
    }
}

/* Key e of position pos / value idx = pos * hd + c of one KV head, as float32 (int8 scaled) */
static inline float key_at(const pm_attn_args *A, int pos, int e) {
    const size_t i = pm_k_index(pos, e, A->hd);
    switch (A->fmt) {
    case POCKET_KV_F16: return pocket_f16_to_f32(((const uint16_t *)A->K)[i]);
    case POCKET_KV_Q8: {
        const int B = PM_KV_QBLOCK;
        return (float)((const int8_t *)A->K)[i] *
               pocket_f16_to_f32(A->ks[pm_k_index(pos, e / B, A->hd / B)]);
    }
    default: return ((const float *)A->K)[i];
    }
}

static inline float value_at(const pm_attn_args *A, size_t idx) {
    switch (A->fmt) {
    case POCKET_KV_F16: return pocket_f16_to_f32(((const uint16_t *)A->V)[idx]);
    case POCKET_KV_Q8:
        return (float)((const int8_t *)A->V)[idx] * pocket_f16_to_f32(A->vs[idx / PM_KV_QBLOCK]);
    default: return ((const float *)A->V)[idx];
    }
}

void pm_attn_portable(const pm_attn_args *A) {
    const int G = A->G, hd = A->hd;
    for (int c = A->a; c < A->b;) {
        const int cend0 = (c / PM_SPAN + 1) * PM_SPAN, cend = cend0 < A->b ? cend0 : A->b;
        const int len = cend - c;
        for (int j = 0; j < len; j++)
            for (int g = 0; g < G; g++) {
                const float *qg = A->q + (size_t)g * hd;
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                int e = 0;
                for (; e + 8 <= hd; e += 8)
                    for (int l = 0; l < 8; l++) acc[l] += qg[e + l] * key_at(A, c + j, e + l);
                float sc = ((acc[0] + acc[4]) + (acc[1] + acc[5])) +
                           ((acc[2] + acc[6]) + (acc[3] + acc[7]));
                for (; e < hd; e++) sc += qg[e] * key_at(A, c + j, e);
                A->s[g * PM_SPAN + j] = sc * A->scale;
            }
        for (int g = 0; g < G; g++) {
            float *sg = A->s + g * PM_SPAN;
            float cm = sg[0];
            for (int j = 1; j < len; j++) cm = sg[j] > cm ? sg[j] : cm;
            const float old = A->m[g], nm = old > cm ? old : cm;
            const float corr = old == -INFINITY ? 0.0f : expf(old - nm);
            float sum = 0.0f;
            for (int j = 0; j < len; j++) {
                sg[j] = expf(sg[j] - nm);
                sum += sg[j];
            }
            A->l[g] = A->l[g] * corr + sum;
            A->m[g] = nm;
            if (corr != 1.0f)
                for (int e = 0; e < hd; e++) A->acc[(size_t)g * hd + e] *= corr;
        }
        for (int j = 0; j < len; j++) {
            const size_t vb = (size_t)(c + j) * hd;
            for (int g = 0; g < G; g++) {
                const float p = A->s[g * PM_SPAN + j];
                float *ag = A->acc + (size_t)g * hd;
                for (int e = 0; e < hd; e++) ag[e] += p * value_at(A, vb + e);
            }
        }
        c = cend;
    }
}

void pm_glu_portable(float *gate, const float *up, size_t len, int gelu) {
    if (gelu) {
        const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
        for (size_t k = 0; k < len; k++) {
            const float x = gate[k];
            gate[k] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))) * up[k];
        }
    } else {
        for (size_t k = 0; k < len; k++) {
            const float x = gate[k];
            gate[k] = x * (0.5f + 0.5f * tanhf(0.5f * x)) * up[k];
        }
    }
}

void pm_matmul_f32_portable(const float *x, int n, int cols, const float *w, int rows,
                            float *y, int rb, int re) {
    for (int r = rb; r < re; r++)
        for (int i = 0; i < n; i++)
            y[(size_t)i * rows + r] = dot_f32(x + (size_t)i * cols, w + (size_t)r * cols, cols);
}

/* float32 -> float16 bits, round to nearest even (NaN stays NaN, overflow -> inf). */
static uint16_t f32_to_f16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520: rounds to inf */
    if (ax < 0x38800000u) {                                     /* float16 subnormal or zero */
        float af;
        memcpy(&af, &ax, sizeof af);
        const float t = af * 16777216.0f; /* units of 2^-24, exact, < 1024 */
        const float r = (t + 12582912.0f) - 12582912.0f; /* round to nearest even */
        return (uint16_t)(sign | (uint32_t)r);
    }
    const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u;
    return (uint16_t)(sign | (r >> 13));
}

void pm_to_f16_portable(const float *x, uint16_t *out, size_t len) {
    for (size_t k = 0; k < len; k++) out[k] = f32_to_f16_bits(x[k]);
}

void pm_from_f16_portable(const uint16_t *h, float *out, size_t len) {
    for (size_t k = 0; k < len; k++) out[k] = pocket_f16_to_f32(h[k]);
}

/* Adapters held as float16 (pocket_weight.lora_f16) are converted exactly to float32 in
 * chunks of at most this many values, on the stack of the thread that reads them; the sums
 * run in the same order either way, so the results are those of the float32 values. */
#define PM_LORA_CHUNK 2048

void pm_lora_down_conv(pm_from_f16_fn conv, const pocket_weight *w, const float *x, int i0,
                       int i1, float *t) {
    const int r = w->lora_rank, cols = w->cols;
    const int cc = w->lora_f16 ? PM_LORA_CHUNK / r : cols; /* columns per chunk */
    float buf[PM_LORA_CHUNK];
    for (int i = i0; i < i1; i++)
        for (int k = 0; k < r; k++) t[(size_t)i * r + k] = 0.0f;
    for (int c0 = 0; c0 < cols; c0 += cc) {
        const int c1 = cols - c0 < cc ? cols : c0 + cc;
        const float *a0; /* A^T rows c0 .. c1 */
        if (w->lora_f16) {
            conv((const uint16_t *)w->lora_at + (size_t)c0 * r, buf,
                             (size_t)(c1 - c0) * r);
            a0 = buf;
        } else
            a0 = (const float *)w->lora_at + (size_t)c0 * r;
        for (int i = i0; i < i1; i++) {
            const float *xi = x + (size_t)i * cols;
            float *ti = t + (size_t)i * r;
            for (int c = c0; c < c1; c++) {
                const float xc = xi[c];
                const float *a = a0 + (size_t)(c - c0) * r;
                for (int k = 0; k < r; k++) ti[k] += xc * a[k];
            }
        }
    }
}

void pm_lora_up_conv(pm_from_f16_fn conv, const pocket_weight *w, const float *t, int n,
                     float *y, size_t ys, int c0, int c1) {
    const int r = w->lora_rank;
    const int oc = w->lora_f16 ? PM_LORA_CHUNK / r : c1 - c0; /* columns per chunk */
    float buf[PM_LORA_CHUNK];
    for (int o0 = c0; o0 < c1; o0 += oc) {
        const int o1 = c1 - o0 < oc ? c1 : o0 + oc, len = o1 - o0;
        if (w->lora_f16)
            for (int k = 0; k < r; k++)
                conv((const uint16_t *)w->lora_bt + (size_t)k * w->rows + o0,
                                 buf + (size_t)k * len, (size_t)len);
        for (int i = 0; i < n; i++) {
            float *yi = y + (size_t)i * ys;
            const float *ti = t + (size_t)i * r;
            for (int k = 0; k < r; k++) {
                const float tk = ti[k];
                const float *b = w->lora_f16 ? buf + (size_t)k * len
                                             : (const float *)w->lora_bt + (size_t)k * w->rows + o0;
                for (int o = 0; o < len; o++) yi[o0 + o] += tk * b[o];
            }
        }
    }
}

void pm_lora_down_portable(const pocket_weight *w, const float *x, int i0, int i1, float *t) {
    pm_lora_down_conv(pm_from_f16_portable, w, x, i0, i1, t);
}

void pm_lora_up_portable(const pocket_weight *w, const float *t, int n, float *y, size_t ys,
                         int c0, int c1) {
    pm_lora_up_conv(pm_from_f16_portable, w, t, n, y, ys, c0, c1);
}

void pm_quant_act_portable(const float *x, int n, int cols, int digits, int8_t *q1, int8_t *q2,
                           float *dd, float *bsum, int32_t *corr) {
    const size_t nblk = (size_t)n * (size_t)cols / 32;
    for (size_t b = 0; b < nblk; b++) {
        const float *p = x + 32 * b;
        float amax = 0.0f;
        for (int k = 0; k < 32; k++) {
            const float a = fabsf(p[k]);
            if (a > amax) amax = a; /* NaN never wins */
        }
        float d = amax / 127.0f, id = 1.0f / d;
        if (!(amax >= POCKET_ACT_TINY)) d = 0.0f, id = 0.0f;
        int32_t s1 = 0, s2 = 0;
        for (int k = 0; k < 32; k++) {
            float t = p[k] * id;
            t = t > -127.0f ? t : -127.0f; /* NaN -> -127 */
            t = t < 127.0f ? t : 127.0f;
            const float r1 = pocket_round_even_small(t);
            q1[32 * b + k] = (int8_t)r1;
            s1 += (int32_t)r1;
            if (digits == 2) {
                const float r2 = pocket_round_even_small((t - r1) * 128.0f);
                q2[32 * b + k] = (int8_t)r2;
                s2 += (int32_t)r2;
            }
        }
        const int32_t S = digits == 2 ? 128 * s1 + s2 : s1;
        dd[b] = digits == 2 ? d * (1.0f / 128.0f) : d;
        bsum[b] = dd[b] * (float)S;
        corr[b] = 128 * S;
    }
}

void pm_block_sums_portable(const float *x, int n, int cols, float *bsum) {
    const size_t nblk = (size_t)n * (size_t)cols / 32;
    for (size_t b = 0; b < nblk; b++) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int k = 0; k < 32; k += 8)
            for (int l = 0; l < 8; l++) acc[l] += x[32 * b + k + l];
        bsum[b] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    }
}

/* The record of tile t of w and its float16 scales *sc and minimums *mn: the record's own, or a
 * coded tile's decoded into buf (2 x 16 x PM_CODED_MAX_GROUPS values); a zero-point tile's
 * minimums are -zero_point * scale, computed where they are used. */
static const uint8_t *tile_steps(const pm_tiled *w, int t, const uint16_t **sc,
                                 const uint16_t **mn, uint16_t *buf) {
    const uint8_t *rec = pm_tile_record(w, t, sc, mn);
    if (w->coded) {
        pm_tiled_steps(w, rec, buf);
        *sc = buf;
        *mn = buf + (size_t)w->ng * 16;
    }
    return rec;
}

/* Float activations on tiled weights: per group (x_g . q_g) * scale + sum(x_g) * min (INT4, INT5),
 * or (x_g . (q_g + 128)) * scale - 128 * sum(x_g) * scale (INT8 stored offset). */
static void tiled_f32_portable(const pm_tiled *w, const pm_act *a, float *y, size_t ystride,
                               int tb, int te) {
    const int nb = w->nb, gpb = w->gpb, ng = w->ng;
    const float zp = -(float)w->zero_point; /* implicit minimums: -zero_point * scale */
    uint16_t steps[2 * 16 * PM_CODED_MAX_GROUPS];
    for (int t = tb; t < te; t++) {
        const uint16_t *sc, *mn;
        const uint8_t *rec = tile_steps(w, t, &sc, &mn, steps);
        const int r0 = 16 * t, nr = pm_tile_rows(w, t);
        for (int i = 0; i < a->n; i++) {
            const float *x = a->x + (size_t)i * a->cols, *bs = a->bsum + (size_t)i * nb;
            for (int rr = 0; rr < nr; rr++) {
                float acc = 0.0f;
                for (int g = 0; g < ng; g++) {
                    const float s = pocket_f16_to_f32(sc[16 * g + rr]);
                    float d = 0.0f, xs = 0.0f;
                    for (int j = 0; j < gpb; j++) {
                        const int b = g * gpb + j;
                        for (int k = 0; k < 32; k++)
                            d += (float)pm_tiled_value(w, rec, b, k, rr) * x[32 * b + k];
                        xs += bs[b];
                    }
                    acc += d * s;
                    if (w->bits != 8)
                        acc += (w->zero_point ? s * zp : pocket_f16_to_f32(mn[16 * g + rr])) * xs;
                    else
                        acc -= 128.0f * xs * s;
                }
                y[(size_t)i * ystride + r0 + rr] = acc;
            }
        }
    }
}

/* The int8-activation product of the tiled weights w over tiles [tb, te) (w's own values), or
 * of an INT8 matrix's nibble planes (pm_ops.matmul_planes): with lo the INT8 codes 16 hi + lo,
 * the INT8 operations (the same bits as the tiles they were split from); est (lo NULL) the
 * high nibbles as INT4 codes of scale 16 s and minimum s * -120.5 (one float product) on the
 * first activation digit (PM_EST_SCALE), in the INT4 operations' order. */
static void tiled_q8_portable(const pm_tiled *w, const pm_tiled *lo, int est, const pm_act *a,
                              float *y, size_t ystride, int tb, int te) {
    const int nb = w->nb, gpb = w->gpb, ng = w->ng;
    const float zp = -(float)w->zero_point; /* implicit minimums: -zero_point * scale */
    const int q8 = w->bits == 8 || lo;           /* INT8 codes: the corr offset, no minimums */
    const int dig2 = a->digits == 2 && !est;     /* the second digit's sums */
    const float smul = est ? PM_EST_SCALE(a) : 1.0f;
    uint16_t steps[2 * 16 * PM_CODED_MAX_GROUPS];
    for (int t = tb; t < te; t++) {
        const uint16_t *sc, *mn;
        const uint8_t *rec = tile_steps(w, t, &sc, &mn, steps);
        const uint8_t *rec2 = lo ? lo->data + (size_t)t * lo->tile_bytes : NULL;
        const int r0 = 16 * t, nr = pm_tile_rows(w, t);
        for (int i = 0; i < a->n; i++) {
            const int8_t *x1 = a->q1 + (size_t)i * a->cols, *x2 = a->q2 + (size_t)i * a->cols;
            const float *dd = a->dd + (size_t)i * nb, *bs = a->bsum + (size_t)i * nb;
            const int32_t *corr = a->corr + (size_t)i * nb;
            for (int rr = 0; rr < nr; rr++) {
                float acc = 0.0f, macc = 0.0f;
                for (int g = 0; g < ng; g++) {
                    const float s1 = pocket_f16_to_f32(sc[16 * g + rr]);
                    const float s = est ? smul * s1 : s1;
                    float xs = 0.0f;
                    for (int j = 0; j < gpb; j++) {
                        const int b = g * gpb + j;
                        int32_t i1 = 0, i2 = 0;
                        for (int k = 0; k < 32; k++) {
                            int v = pm_tiled_value(w, rec, b, k, rr);
                            if (lo) v = 16 * v + pm_tiled_value(lo, rec2, b, k, rr);
                            i1 += v * x1[32 * b + k];
                            if (dig2) i2 += v * x2[32 * b + k];
                        }
                        int32_t T = dig2 ? 128 * i1 + i2 : i1;
                        if (q8) T -= corr[b];
                        acc += (float)T * (s * dd[b]);
                        xs += bs[b];
                    }
                    if (!q8)
                        macc += (est ? s1 * -120.5f
                                 : w->zero_point ? s1 * zp
                                                 : pocket_f16_to_f32(mn[16 * g + rr])) * xs;
                }
                y[(size_t)i * ystride + r0 + rr] = acc + macc;
            }
        }
    }
}

void pm_matmul_tiled_portable(const pm_tiled *w, const pm_act *a, float *y, size_t ystride,
                              int tb, int te) {
    if (a->digits == 0)
        tiled_f32_portable(w, a, y, ystride, tb, te);
    else
        tiled_q8_portable(w, NULL, 0, a, y, ystride, tb, te);
}

void pm_matmul_planes_portable(const pm_tiled *hi, const pm_tiled *lo, const pm_act *a,
                               float *y, size_t ystride, int tb, int te) {
    tiled_q8_portable(hi, lo, lo == NULL, a, y, ystride, tb, te);
}

const pm_ops pm_ops_portable = PM_OPS("portable", pm_attn_portable, pm_glu_portable,
                                      pm_quant_act_portable, pm_matmul_tiled_portable,
                                      pm_lora_down_portable, pm_lora_up_portable,
                                      pm_matmul_planes_portable);
