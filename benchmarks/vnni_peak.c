/* Peak rate of the int8 dot-product instruction the engine's products are built on
 * (AVX-512 VNNI vpdpbusd, 512-bit: 64 u8 x s8 multiply-adds), on one core.
 *
 *   gcc -O2 -mavx512f -mavx512vnni -o /tmp/vnni_peak benchmarks/vnni_peak.c
 *   /tmp/vnni_peak            # one JSON line
 *
 * Twelve independent accumulators hide the instruction's latency, so the loop runs at the
 * core's throughput. docs/engine.md compares the engine's prefill with this ceiling.
 */
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

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

#define STEP(r) r = _mm512_dpbusd_epi32(r, w, x);

int main(void) {
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    __m512i a0 = _mm512_set1_epi32(0), a1 = _mm512_set1_epi32(1), a2 = _mm512_set1_epi32(2),
            a3 = _mm512_set1_epi32(3), a4 = _mm512_set1_epi32(4), a5 = _mm512_set1_epi32(5),
            a6 = _mm512_set1_epi32(6), a7 = _mm512_set1_epi32(7), a8 = _mm512_set1_epi32(8),
            a9 = _mm512_set1_epi32(9), a10 = _mm512_set1_epi32(10), a11 = _mm512_set1_epi32(11);
    const long n = 100000000;
    double best = 0.0;
    for (int round = 0; round < 3; round++) {
        const double t0 = now();
        for (long k = 0; k < n; k++) {
            STEP(a0) STEP(a1) STEP(a2) STEP(a3) STEP(a4) STEP(a5)
            STEP(a6) STEP(a7) STEP(a8) STEP(a9) STEP(a10) STEP(a11)
            /* the accumulators stay distinct and in registers */
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),
                             "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11),
                             "+v"(w), "+v"(x));
        }
        const double rate = 12.0 * (double)n / (now() - t0);
        if (rate > best) best = rate;
    }
    __m512i s = _mm512_add_epi32(a0, a1);
    s = _mm512_add_epi32(s, _mm512_add_epi32(a2, a3));
    s = _mm512_add_epi32(s, _mm512_add_epi32(a4, a5));
    s = _mm512_add_epi32(s, _mm512_add_epi32(a6, a7));
    s = _mm512_add_epi32(s, _mm512_add_epi32(a8, a9));
    s = _mm512_add_epi32(s, _mm512_add_epi32(a10, a11));
    char cpu[256];
    cpu_name(cpu, sizeof cpu);
    printf("{\"command\": \"benchmarks/vnni_peak.c\", \"cpu\": \"%s\", \"threads\": 1, "
           "\"vpdpbusd_zmm_per_s\": %.4g, \"int8_macs_per_s\": %.4g, \"check\": %d}\n",
           cpu, best, 64.0 * best, _mm512_reduce_add_epi32(s) & 1);
    return 0;
}
