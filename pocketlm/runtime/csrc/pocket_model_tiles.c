/* Quantized weights of the inference engine repacked into 16-row tiles (pm_tiled, layout in
 * pocket_model_ops.h), and release of the source pages of a read-only file mapping.
 *
 * At creation, the weights of the products that run on the tiled kernels (every product on
 * AVX-512; the int8-activation ones elsewhere) are repacked into tiles, the same size as the
 * original; the others use the kernels of pocket_kernels.h on the caller's layout. With
 * config.release_source, the source pages are handed back to the kernel as the repacking goes,
 * so a large matrix never sits in memory whole beside its copy. A tied embedding is looked up
 * in the head's tiles when the head is tiled (pm_tiled_row: its released pages stay released);
 * a separate one in the file drops the pages each lookup maps (pm_release_around).
 */
#if !defined(_WIN32) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* madvise, MADV_* */
#endif

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "pocket_internal.h"
#include "pocket_model_internal.h"

/* Zeroed memory for tiles. On Linux a private anonymous mapping: its pages arrive zeroed
 * from the kernel, so the repack writes them once, where zeroed heap memory would be written
 * three times (the kernel's zeroing on first touch, memset, the repack). With `huge`, the
 * mapping asks for transparent huge pages (MADV_HUGEPAGE; the kernel merges the tiles'
 * adjacent mappings, so the small matrices get them too): the products stream the weights
 * through 2 MB pages instead of 4 KB ones, with a TLB miss per 2 MB and the hardware prefetchers
 * free to run across what were page boundaries (docs/engine.md, "Huge pages": one-token steps
 * gained, whole generations did not measurably, so it is off by default). Where the kernel
 * has them off (or not in madvise mode) the advice is a no-op. */
static uint8_t *tiles_alloc(size_t bytes, int huge) {
#if defined(__linux__)
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#if defined(MADV_HUGEPAGE)
    if (huge) (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return (uint8_t *)p;
#else
    (void)huge;
    return (uint8_t *)pm_zalloc(bytes, 1);
#endif
}

void pm_tiled_free(pm_tiled *t) {
    if (t->data) {
#if defined(__linux__)
        munmap(t->data, (size_t)t->ntiles * t->tile_bytes);
#else
        free(t->data);
#endif
    }
    memset(t, 0, sizeof *t);
}

/* Hand the whole pages inside [p, p + n) back to the kernel. Only for read-only file mappings
 * (config.release_source): a page touched again is read back from the file. */
static void release_range(const void *p, size_t n) {
#if defined(__linux__) && defined(MADV_DONTNEED)
    long page = sysconf(_SC_PAGESIZE);
    if (!p || !n || page <= 0) return;
    uintptr_t a = (uintptr_t)p, ps = (uintptr_t)page;
    uintptr_t lo = (a + ps - 1) / ps * ps, hi = (a + n) / ps * ps;
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
#else
    (void)p;
    (void)n;
#endif
}

/* Hand back the pages that hold [p, p + n), whole pages around it included: only for a
 * read-only file mapping, where a dropped page is read back from the page cache when next
 * touched. */
void pm_release_around(const void *p, size_t n) {
#if defined(__linux__) && defined(MADV_DONTNEED)
    long page = sysconf(_SC_PAGESIZE);
    if (!p || !n || page <= 0) return;
    uintptr_t a = (uintptr_t)p, ps = (uintptr_t)page;
    uintptr_t lo = a / ps * ps, hi = (a + n + ps - 1) / ps * ps;
    (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
#else
    (void)p;
    (void)n;
#endif
}

/* Release the source pages of rows [r0, r1) of a quantized weight. */
static void release_rows(const pocket_weight *w, size_t r0, size_t r1) {
    if (w->type != POCKET_WT_Q4 && w->type != POCKET_WT_Q5 && w->type != POCKET_WT_Q8) return;
    const size_t ng = (size_t)w->cols / (size_t)w->group_size, row_bytes = pm_row_bytes(w);
    const size_t n = r1 - r0;
    release_range((const uint8_t *)w->data + r0 * row_bytes, n * row_bytes);
    release_range(w->scales + r0 * ng, n * ng * sizeof(uint16_t));
    if (w->type != POCKET_WT_Q8 && !w->mins_in_memory)
        release_range(w->mins + r0 * ng, n * ng * sizeof(uint16_t));
}

void pm_tiled_release_source(const pocket_weight *w) { release_rows(w, 0, (size_t)w->rows); }

/* The embedding rows are read from the file mapping a few at a time, in no order: tell the
 * kernel not to read ahead around each one (its usual 128 KB readahead per fault made a
 * 512-token prompt pull ~70 MB of Gemma's embedding into memory for 0.3 MB of rows). */
void pm_advise_random_rows(const pocket_weight *w) {
#if defined(__linux__) && defined(MADV_RANDOM)
    if (w->type != POCKET_WT_Q4 && w->type != POCKET_WT_Q5 && w->type != POCKET_WT_Q8) return;
    const size_t rows = (size_t)w->rows, cols = (size_t)w->cols, ng = cols / (size_t)w->group_size;
    const size_t row_bytes = pm_row_bytes(w);
    const void *ranges[3] = {w->data, w->scales,
                             w->type != POCKET_WT_Q8 && !w->mins_in_memory ? w->mins : NULL};
    const size_t sizes[3] = {rows * row_bytes, rows * ng * sizeof(uint16_t),
                             rows * ng * sizeof(uint16_t)};
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) return;
    for (int k = 0; k < 3; k++) {
        if (!ranges[k]) continue;
        uintptr_t a = (uintptr_t)ranges[k], ps = (uintptr_t)page;
        uintptr_t lo = (a + ps - 1) / ps * ps, hi = (a + sizes[k]) / ps * ps;
        if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_RANDOM);
    }
#else
    (void)w;
#endif
}

/* Tiles repacked between releases of their source rows: the source of a large matrix (a 262k
 * x 640 embedding used as the head) never sits in memory whole beside its copy. */
#define PM_RELEASE_TILES 256

int pm_tiled_alloc(const pocket_weight *w, pm_tiled *t, pm_tiled *lo, int huge, int coded,
                   int zero_point) {
    memset(t, 0, sizeof *t);
    if (lo) memset(lo, 0, sizeof *lo);
    if (w->type != POCKET_WT_Q4 && w->type != POCKET_WT_Q5 && w->type != POCKET_WT_Q8)
        return POCKET_EINVAL;
    if (lo && w->type != POCKET_WT_Q8) return POCKET_EINVAL;
    if (coded && (w->type != POCKET_WT_Q4 || w->group_size != 32 || !w->scale_codes ||
                  !w->min_codes || !w->code_steps || w->cols / 32 > PM_CODED_MAX_GROUPS || lo))
        return POCKET_EINVAL;
    if (zero_point && (coded || lo || w->type == POCKET_WT_Q8 || zero_point != w->zero_point ||
                       w->cols / w->group_size > PM_CODED_MAX_GROUPS))
        return POCKET_EINVAL;
    /* the nibble planes of INT8 (lo): t the INT4 blocks of the high nibbles and the scales (no
     * minimums), lo the low nibbles' blocks only */
    const int mins = w->type != POCKET_WT_Q8;
    t->bits = lo ? 4 : w->type;
    t->rows = w->rows;
    t->cols = w->cols;
    t->group_size = w->group_size;
    t->ntiles = (w->rows + 15) / 16;
    t->nb = w->cols / 32;
    t->ng = w->cols / w->group_size;
    t->gpb = w->group_size / 32;
    t->block_bytes = t->bits == 4 ? 256 : t->bits == 5 ? 320 : 512;
    t->scale_off = (size_t)t->nb * t->block_bytes;
    t->coded = coded;
    t->code_groups = coded ? (w->code_groups ? w->code_groups : t->ng) : 0;
    t->zero_point = zero_point;
    t->tile_bytes = pocket_round_up(
        t->scale_off + (coded ? (size_t)t->ng * 32 + 64 * (size_t)(t->ng / t->code_groups)
                              : (size_t)t->ng * 32 * (mins && !zero_point ? 2 : 1)),
        64);
    t->data = tiles_alloc((size_t)t->ntiles * t->tile_bytes, huge);
    if (!t->data) return POCKET_ENOMEM;
    if (!lo) return POCKET_OK;
    *lo = *t;
    lo->tile_bytes = lo->scale_off;
    lo->data = tiles_alloc((size_t)lo->ntiles * lo->tile_bytes, huge);
    if (lo->data) return POCKET_OK;
    pm_tiled_free(t);
    pm_tiled_free(lo);
    return POCKET_ENOMEM;
}

/* The low nibbles of one source block (byte k: column k low, 16 + k high) into lane i of
 * the 4 vectors at blk (vector m, byte j: column 8m + j low, 8m + 4 + j high). */
static inline void fill_nibbles(uint8_t *blk, const uint8_t *src) {
    for (int j = 0; j < 4; j++) {
        blk[0 + j] = (uint8_t)((src[j] & 15) | (src[4 + j] << 4));
        blk[64 + j] = (uint8_t)((src[8 + j] & 15) | (src[12 + j] << 4));
        blk[128 + j] = (uint8_t)((src[j] >> 4) | (src[4 + j] & 0xF0));
        blk[192 + j] = (uint8_t)((src[8 + j] >> 4) | (src[12 + j] & 0xF0));
    }
}

/* The 16 source bytes of an INT4 block (byte k: column k low nibble, column 16 + k high) of
 * the nibbles v[0..32). */
static inline void nibble_block(const uint8_t *v, uint8_t *src) {
    for (int k = 0; k < 16; k++) src[k] = (uint8_t)((v[k] & 15) | (v[16 + k] << 4));
}

/* float16 bits of the float32 product code * step (exact: an 8-bit code times a float16),
 * rounded to nearest even */
static uint16_t coded_step(int code, uint16_t step) {
    const float v = (float)code * pocket_f16_to_f32(step);
    uint16_t h;
    pm_to_f16_portable(&v, &h, 1);
    return h;
}

/* The codes of row r of coded weight w into lane i of coded tile record rec; 1 if a group's
 * codes do not give the row's float16 scale or minimum. */
static int fill_coded(const pocket_weight *w, const pm_tiled *t, uint8_t *rec, size_t r, int i) {
    const size_t ng = (size_t)t->ng;
    uint8_t *sc = rec + t->scale_off;
    int8_t *mc = (int8_t *)sc + ng * 16;
    uint16_t *st = (uint16_t *)(sc + ng * 32);
    const size_t gps = (size_t)t->code_groups, nsteps = ng / gps;
    const uint16_t *steps = w->code_steps + r * 2 * nsteps; /* d, dmin of each run */
    for (size_t k = 0; k < nsteps; k++) {
        st[32 * k + (size_t)i] = steps[2 * k];
        st[32 * k + 16 + (size_t)i] = steps[2 * k + 1];
    }
    int bad = 0;
    for (size_t g = 0; g < ng; g++) {
        const uint8_t s = w->scale_codes[r * ng + g];
        const int8_t m = w->min_codes[r * ng + g];
        const uint16_t d = steps[2 * (g / gps)], dmin = steps[2 * (g / gps) + 1];
        sc[16 * g + (size_t)i] = s;
        mc[16 * g + (size_t)i] = m;
        bad |= coded_step(s, d) != w->scales[r * ng + g] || coded_step(m, dmin) != w->mins[r * ng + g];
    }
    return bad;
}

/* Lane i's float16 scales and minimums of coded tile record rec into out (the layout of
 * pm_tiled_steps: [ng x 16 scales][ng x 16 mins], lane i of each group). */
static void coded_lane(const pm_tiled *w, const uint8_t *rec, size_t i, uint16_t *out) {
    const pm_coded c = pm_coded_parts(w, rec);
    for (size_t g = 0; g < c.ng; g++) {
        const uint16_t *sg = c.st + 32 * (g / c.gps); /* g's d, dmin */
        out[16 * g + i] = coded_step(c.sc[16 * g + i], sg[i]);
        out[16 * (c.ng + g) + i] = coded_step(c.mc[16 * g + i], sg[16 + i]);
    }
}

void pm_tiled_steps(const pm_tiled *w, const uint8_t *rec, uint16_t *out) {
    for (size_t i = 0; i < 16; i++) coded_lane(w, rec, i, out);
}

int pm_tiled_fill(const pocket_weight *w, pm_tiled *t, pm_tiled *lo, int tb, int te,
                  int release) {
    const int q4 = w->type == POCKET_WT_Q4, q5 = w->type == POCKET_WT_Q5;
    const size_t C = (size_t)w->cols, ng = (size_t)t->ng, row_bytes = pm_row_bytes(w);
    int bad = 0;
    for (int tl = tb; tl < te; tl++) {
        uint8_t *rec = t->data + (size_t)tl * t->tile_bytes;
        uint8_t *rlo = lo ? lo->data + (size_t)tl * lo->tile_bytes : NULL;
        uint16_t *sc = (uint16_t *)(rec + t->scale_off), *mn = sc + ng * 16;
        for (int i = 0; i < 16; i++) {
            const size_t r = (size_t)tl * 16 + (size_t)i;
            if (r >= (size_t)w->rows) {
                if (!q4 && !q5 && !lo) /* zero weights are stored as 128 (planes: scale 0) */
                    for (int b = 0; b < t->nb; b++)
                        for (int k = 0; k < 32; k++)
                            rec[(size_t)b * 512 + 64 * (k / 4) + 4 * i + (k & 3)] = 128;
                continue;
            }
            if (t->coded)
                bad |= fill_coded(w, t, rec, r, i);
            else
                for (size_t g = 0; g < ng; g++) {
                    sc[16 * g + i] = w->scales[r * ng + g];
                    /* a scale or minimum that is not a finite float16 (exponent all ones):
                     * damaged weights, whatever product reads them */
                    bad |= (w->scales[r * ng + g] & 0x7C00u) == 0x7C00u ||
                           ((q4 || q5) && (w->mins[r * ng + g] & 0x7C00u) == 0x7C00u);
                    if (t->zero_point) /* implicit minimums: checked, not stored */
                        bad |= !(pocket_f16_to_f32(w->mins[r * ng + g]) ==
                                 -(float)t->zero_point * pocket_f16_to_f32(w->scales[r * ng + g]));
                    else if (q4 || q5)
                        mn[16 * g + i] = w->mins[r * ng + g];
                }
            if (q4) {
                const uint8_t *src = (const uint8_t *)w->data + r * row_bytes;
                for (int b = 0; b < t->nb; b++, src += 16)
                    fill_nibbles(rec + (size_t)b * 256 + 4 * i, src);
            } else if (q5) {
                /* source block b: a little-endian uint32 of high bits (bit k: column k), then
                 * the nibbles as INT4; the high bits go to bit 4i + j of mask (m, j >= 4) */
                const uint8_t *src = (const uint8_t *)w->data + r * row_bytes;
                for (int b = 0; b < t->nb; b++, src += 20) {
                    uint8_t *blk = rec + (size_t)b * 320;
                    fill_nibbles(blk + 4 * i, src + 4);
                    const uint32_t qh = (uint32_t)src[0] | (uint32_t)src[1] << 8 |
                                        (uint32_t)src[2] << 16 | (uint32_t)src[3] << 24;
                    for (int k = 0; k < 32; k++)
                        if ((qh >> k) & 1) {
                            const int m = k / 8, j = k % 8, bit = 4 * i + (j & 3);
                            blk[256 + 16 * m + 8 * (j >= 4) + bit / 8] |= (uint8_t)(1u << (bit % 8));
                        }
                }
            } else if (lo) { /* q + 128 = 16 hi + lo */
                const int8_t *src = (const int8_t *)w->data + r * C;
                for (int b = 0; b < t->nb; b++, src += 32) {
                    uint8_t vh[32], vl[32], nib[16];
                    for (int k = 0; k < 32; k++) {
                        const uint8_t u = (uint8_t)(src[k] + 128);
                        vh[k] = (uint8_t)(u >> 4);
                        vl[k] = (uint8_t)(u & 15);
                    }
                    nibble_block(vh, nib);
                    fill_nibbles(rec + (size_t)b * 256 + 4 * i, nib);
                    nibble_block(vl, nib);
                    fill_nibbles(rlo + (size_t)b * 256 + 4 * i, nib);
                }
            } else {
                const int8_t *src = (const int8_t *)w->data + r * C;
                for (int b = 0; b < t->nb; b++, src += 32) {
                    uint8_t *blk = rec + (size_t)b * 512 + 4 * i;
                    for (int k = 0; k < 32; k++)
                        blk[64 * (k / 4) + (k & 3)] = (uint8_t)(src[k] + 128);
                }
            }
        }
        if (release && (tl + 1 - tb) % PM_RELEASE_TILES == 0)
            release_rows(w, (size_t)(tl + 1 - PM_RELEASE_TILES) * 16, (size_t)(tl + 1) * 16);
    }
    if (release) /* the rest of the range, and the pages that straddled chunk ends */
        release_rows(w, (size_t)tb * 16,
                     (size_t)te * 16 < (size_t)w->rows ? (size_t)te * 16 : (size_t)w->rows);
    return bad;
}

/* Row r of a tiled matrix as floats: the same values (and float operations) as dequantizing
 * the source row. */
void pm_tiled_row(const pm_tiled *w, size_t r, float *x) {
    const uint8_t *rec = w->data + (r / 16) * w->tile_bytes;
    const uint16_t *sc = (const uint16_t *)(rec + w->scale_off), *mn = sc + (size_t)w->ng * 16;
    const int i = (int)(r % 16), per_group = w->group_size;
    uint16_t steps[2 * 16 * PM_CODED_MAX_GROUPS]; /* a coded tile: lane i's steps decoded */
    if (w->coded) {
        coded_lane(w, rec, (size_t)i, steps);
        sc = steps;
        mn = steps + (size_t)w->ng * 16;
    }
    for (int b = 0; b < w->nb; b++)
        for (int k = 0; k < 32; k++) {
            const int c = 32 * b + k, g = c / per_group;
            const int q = pm_tiled_value(w, rec, b, k, i);
            const float s = pocket_f16_to_f32(sc[16 * g + i]);
            if (w->bits == 8) {
                x[c] = (float)(q - 128) * s;
                continue;
            }
            /* implicit minimums: -zero_point * scale, exact in float32 */
            const float mv = w->zero_point ? -(float)w->zero_point * s
                                           : pocket_f16_to_f32(mn[16 * g + i]);
            x[c] = (float)q * s + mv;
        }
}

void pm_tiled_row_planes(const pm_tiled *hi, const pm_tiled *lo, size_t r, float *x) {
    const uint8_t *rh = hi->data + (r / 16) * hi->tile_bytes, *rl = lo->data + (r / 16) * lo->tile_bytes;
    const uint16_t *sl = (const uint16_t *)(rh + hi->scale_off);
    const int i = (int)(r % 16);
    for (int b = 0; b < hi->nb; b++)
        for (int k = 0; k < 32; k++) {
            const int c = 32 * b + k, g = c / hi->group_size;
            const int u = 16 * pm_tiled_value(hi, rh, b, k, i) + pm_tiled_value(lo, rl, b, k, i);
            x[c] = (float)(u - 128) * pocket_f16_to_f32(sl[16 * g + i]);
        }
}
