/* AVX-512 pieces shared by the engine's AVX-512 operations (pocket_model_x86.c) and its AMX
 * products (pocket_model_amx.c). Include only where PM_HAVE_AVX512 holds; the callers' target
 * attributes include these functions' (avx512f, avx512bw). */
#ifndef POCKET_MODEL_X86_H
#define POCKET_MODEL_X86_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pocket_simd.h"

/* The two operand vectors (columns 8m + j and 8m + 4 + j) of nibble vector m of an INT4 or
 * INT5 tile block (pocket_model_ops.h): INT5 adds 16 to the bytes whose bit is set in the
 * block's masks. Values 0..15 (INT4) or 0..31 (INT5), one byte each. */
static inline __attribute__((always_inline, target("avx512f,avx512bw"))) void
pm_nibble_pair(const int bits, const uint8_t *blk, int m, __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i V = _mm512_load_si512((const void *)(blk + 64 * m));
    *lo = _mm512_and_si512(V, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(V, 4), m4);
    if (bits == 5) {
        uint64_t kl, kh;
        memcpy(&kl, blk + 256 + 16 * m, 8);
        memcpy(&kh, blk + 256 + 16 * m + 8, 8);
        const __m512i c16 = _mm512_set1_epi8(16);
        *lo = _mm512_mask_add_epi8(*lo, _cvtu64_mask64(kl), *lo, c16);
        *hi = _mm512_mask_add_epi8(*hi, _cvtu64_mask64(kh), *hi, c16);
    }
}

/* One piece of an online softmax: s holds len (a multiple of 16) scaled scores, -inf where a
 * key is masked. In place: s = e^(s - max) (0 where masked), with max the running maximum *m
 * taken over these scores too; *l becomes *l * corr + the piece's sum. Returns corr, the factor
 * for the accumulators of the earlier pieces (0 when there were none). */
static inline __attribute__((always_inline, target("avx512f"))) float
pm_softmax_piece(float *s, int len, float *m, float *l) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx = ninf;
    for (int j = 0; j < len; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
    const float cm = _mm512_reduce_max_ps(mx);
    const float old = *m, nm = old > cm ? old : cm;
    const float corr = old == -INFINITY ? 0.0f : expf(old - nm);
    const __m512 vnm = _mm512_set1_ps(nm);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < len; j += 16) {
        const __m512 sv = _mm512_loadu_ps(s + j);
        const __mmask16 ok = _mm512_cmp_ps_mask(sv, ninf, _CMP_NEQ_OQ);
        const __m512 pv = _mm512_maskz_mov_ps(ok, pocket_exp512(_mm512_sub_ps(sv, vnm)));
        _mm512_storeu_ps(s + j, pv);
        sum = _mm512_add_ps(sum, pv);
    }
    *l = *l * corr + _mm512_reduce_add_ps(sum);
    *m = nm;
    return corr;
}

#endif /* POCKET_MODEL_X86_H */
