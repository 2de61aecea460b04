/* The inner loop of the engine's AMX-BF16 products (pocket_model_amx.c, pm_amx_matmul) with
 * its operands in two memory layouts, against the tile unit's own rate, on one core.
 *
 *   gcc -O2 -march=sapphirerapids -o /tmp/amx_tile_loads benchmarks/amx_tile_loads.c
 *   /tmp/amx_tile_loads [K] [rounds]    # JSON lines: one per layout and round, then medians
 *
 * Per step of 32 input features the loop loads two activation tiles (bfloat16 hi and lo of 16
 * tokens) and, for each of four weight tiles, its two widened terms, then runs three products
 * per weight tile: 12 TDPBF16PS and 10 tile loads, 8 token tiles (a 128-token block) over the
 * same four widened weight tiles, as the engine does. Layouts:
 *   row_major:   activations [token][K] (a tile load strides K * 2 bytes per row), each weight
 *                tile widened into its own buffer (the four are K * 4 bytes apart);
 *   tile_major:  activations [token tile][step][16 x 32] (each tile load reads 1 KB in a row),
 *                the widened weights block-major (one step reads 8 KB in a row): the engine's;
 *   no_loads:    the same 12 products with no tile loads: the unit's ceiling.
 * The rounds alternate the layouts; the machine's neighbours move single rounds a lot.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void cpu_name(char *out, size_t n) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    snprintf(out, n, "unknown");
    if (!f) return;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10)) {
            char *v = strchr(line, ':');
            if (v) {
                snprintf(out, n, "%s", v + 2);
                out[strcspn(out, "\n")] = 0;
            }
            break;
        }
    fclose(f);
}

#define THREE(k, h, l)                                                                          \
    do {                                                                                        \
        _tile_loadd(6, h, 64);                                                                  \
        _tile_loadd(7, l, 64);                                                                  \
        _tile_dpbf16ps(k, 4, 6);                                                                \
        _tile_dpbf16ps(k, 5, 6);                                                                \
        _tile_dpbf16ps(k, 4, 7);                                                                \
    } while (0)

#define TOKEN_TILES 8

/* One pass: 8 token tiles x nb steps x 12 products; layout 0 row_major, 1 tile_major,
 * 2 no_loads. */
static void pass(int layout, int nb, const uint16_t *xh, const uint16_t *xl, const uint16_t *w,
                 float *c) {
    const size_t K = (size_t)nb * 32, wt = (size_t)nb * 512;
    for (int tt = 0; tt < TOKEN_TILES; tt++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int b = 0; b < nb; b++) {
            if (layout == 0) {
                const size_t o = (size_t)16 * tt * K + 32 * (size_t)b, ob = (size_t)512 * b;
                _tile_loadd(4, xh + o, K * 2);
                _tile_loadd(5, xl + o, K * 2);
                THREE(0, w + ob, w + wt + ob);
                THREE(1, w + 2 * wt + ob, w + 3 * wt + ob);
                THREE(2, w + 4 * wt + ob, w + 5 * wt + ob);
                THREE(3, w + 6 * wt + ob, w + 7 * wt + ob);
            } else if (layout == 1) {
                const size_t o = ((size_t)tt * nb + b) * 512;
                const uint16_t *q = w + (size_t)b * 4096;
                _tile_loadd(4, xh + o, 64);
                _tile_loadd(5, xl + o, 64);
                THREE(0, q, q + 512);
                THREE(1, q + 1024, q + 1536);
                THREE(2, q + 2048, q + 2560);
                THREE(3, q + 3072, q + 3584);
            } else {
                for (int k = 0; k < 3; k++) {
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_dpbf16ps(2, 4, 6);
                    _tile_dpbf16ps(3, 4, 6);
                }
            }
        }
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
    }
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const int K = argc > 1 ? atoi(argv[1]) : 576, rounds = argc > 2 ? atoi(argv[2]) : 7;
    if (K < 32 || K % 32 || rounds < 1 || rounds > 99) {
        fprintf(stderr, "usage: amx_tile_loads [K, a multiple of 32] [rounds, 1-99]\n");
        return 1;
    }
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        fprintf(stderr, "amx_tile_loads: the OS refused the AMX tile state\n");
        return 1;
    }
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    const int nb = K / 32;
    const size_t xn = (size_t)16 * TOKEN_TILES * K, wn = (size_t)8 * nb * 512;
    uint16_t *x = aligned_alloc(64, 2 * xn * sizeof(uint16_t));
    uint16_t *w = aligned_alloc(64, wn * sizeof(uint16_t));
    float *c = aligned_alloc(64, 1024 * sizeof(float));
    if (!x || !w || !c) return 1;
    for (size_t i = 0; i < 2 * xn; i++) x[i] = 0x3F80; /* 1.0 */
    for (size_t i = 0; i < wn; i++) w[i] = 0x3F80;
    char cpu[256];
    cpu_name(cpu, sizeof cpu);
    static const char *names[3] = {"row_major", "tile_major", "no_loads"};
    const long reps = 2000000000L / ((long)TOKEN_TILES * nb * 12 * 8192 / 64) + 1;
    double rate[3][99];
    for (int r = 0; r < rounds; r++)
        for (int layout = 0; layout < 3; layout++) {
            pass(layout, nb, x, x + xn, w, c); /* warm the caches */
            const double t0 = now();
            for (long i = 0; i < reps; i++) pass(layout, nb, x, x + xn, w, c);
            const double dt = now() - t0;
            const double products = (double)reps * TOKEN_TILES * nb * 12;
            rate[layout][r] = products * 8192 / dt / 1e9;
            printf("{\"bench\": \"amx_tile_loads\", \"cpu\": \"%s\", \"threads\": 1, \"K\": %d, "
                   "\"layout\": \"%s\", \"round\": %d, \"gmac_s\": %.1f, \"ns_per_product\": "
                   "%.2f}\n",
                   cpu, K, names[layout], r, rate[layout][r], dt / products * 1e9);
        }
    for (int layout = 0; layout < 3; layout++) {
        qsort(rate[layout], (size_t)rounds, sizeof(double), cmp);
        printf("{\"bench\": \"amx_tile_loads\", \"cpu\": \"%s\", \"threads\": 1, \"K\": %d, "
               "\"layout\": \"%s\", \"rounds\": %d, \"median_gmac_s\": %.1f, \"min_gmac_s\": "
               "%.1f, \"max_gmac_s\": %.1f}\n",
               cpu, K, names[layout], rounds, rate[layout][rounds / 2], rate[layout][0],
               rate[layout][rounds - 1]);
    }
    free(x);
    free(w);
    free(c);
    return 0;
}
