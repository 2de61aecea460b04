/* pocketlm native kernels: portable scalar kernels, CPU detection and dispatch, the thread pool
 * and the threaded drivers. The AVX2 / AVX-512 kernels live in pocket_x86.c; the neon level
 * (ARM64) has the engine's tiled products only (pocket_model_neon.c) and hands out the scalar
 * kernels here. */
#if !defined(_WIN32) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* pthread, sched_yield, getpid */
#endif

#include <math.h>

#include "pocket_internal.h"

#if !defined(_WIN32)
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <unistd.h>
#define POCKET_HAVE_THREADS 1
#else
#define POCKET_HAVE_THREADS 0
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

/* =========================================================================================
 * Scalar kernels. Written so that the compiler can vectorize the inner loops (8 independent
 * float lanes, integer dot products); used on every CPU without a SIMD level (e.g. ARM).
 * ========================================================================================= */

static float dot_lanes(const float *a, const float *b, size_t len) {
    /* len is a multiple of 8 */
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (size_t c = 0; c < len; c += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[c + l] * b[c + l];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static float dot_short(const float *a, const float *b, size_t len) {
    float s = 0.0f;
    for (size_t k = 0; k < len; k++) s += a[k] * b[k];
    return s;
}

/* Sum of x over each group: xs[i * ng + g]. */
static void group_sums(const float *x, size_t n, size_t cols, size_t gs, float *xs) {
    size_t ng = cols / gs;
    for (size_t i = 0; i < n; i++)
        for (size_t g = 0; g < ng; g++) {
            const float *p = x + i * cols + g * gs;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (size_t k = 0; k < gs; k += 8)
                for (int l = 0; l < 8; l++) acc[l] += p[k + l];
            xs[i * ng + g] =
                ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        }
}

static int q4_f32_scalar(const float *x, int n, int cols, const uint8_t *qw, const uint16_t *sc,
                         const uint16_t *mn, int rows, int group_size, float *y, int row_begin,
                         int row_end) {
    int rc = pocket_check_shape(n, cols, rows, group_size, row_begin, row_end);
    if (rc) return rc;
    if (n == 0 || row_begin == row_end) return POCKET_OK;
    if (!x || !qw || !sc || !mn || !y) return POCKET_EINVAL;
    size_t C = (size_t)cols, gs = (size_t)group_size, ng = C / gs, nb = C / 32;
    size_t N = (size_t)n, R = (size_t)rows;
    float *buf = (float *)malloc((C + ng + N * ng) * sizeof(float));
    if (!buf) return POCKET_ENOMEM;
    float *w = buf, *mf = w + C, *xs = mf + ng;
    group_sums(x, N, C, gs, xs);
    for (size_t r = (size_t)row_begin; r < (size_t)row_end; r++) {
        const uint8_t *q = qw + r * (C / 2);
        const uint16_t *s = sc + r * ng, *m = mn + r * ng;
        for (size_t b = 0; b < nb; b++) {
            float f = pocket_f16_to_f32(s[b * 32 / gs]); /* q * f is exact in float32 */
            for (size_t k = 0; k < 16; k++) {
                w[32 * b + k] = (float)(q[16 * b + k] & 15) * f;
                w[32 * b + 16 + k] = (float)(q[16 * b + k] >> 4) * f;
            }
        }
        for (size_t g = 0; g < ng; g++) mf[g] = pocket_f16_to_f32(m[g]);
        for (size_t i = 0; i < N; i++)
            y[i * R + r] = dot_lanes(x + i * C, w, C) + dot_short(xs + i * ng, mf, ng);
    }
    free(buf);
    return POCKET_OK;
}

static int q8_f32_scalar(const float *x, int n, int cols, const int8_t *qw, const uint16_t *sc,
                         int rows, int group_size, float *y, int row_begin, int row_end) {
    int rc = pocket_check_shape(n, cols, rows, group_size, row_begin, row_end);
    if (rc) return rc;
    if (n == 0 || row_begin == row_end) return POCKET_OK;
    if (!x || !qw || !sc || !y) return POCKET_EINVAL;
    size_t C = (size_t)cols, gs = (size_t)group_size, ng = C / gs;
    size_t N = (size_t)n, R = (size_t)rows;
    float *w = (float *)malloc(C * sizeof(float));
    if (!w) return POCKET_ENOMEM;
    for (size_t r = (size_t)row_begin; r < (size_t)row_end; r++) {
        const int8_t *q = qw + r * C;
        const uint16_t *s = sc + r * ng;
        for (size_t g = 0; g < ng; g++) {
            float f = pocket_f16_to_f32(s[g]); /* q * f is exact in float32 */
            for (size_t k = 0; k < gs; k++) w[g * gs + k] = (float)q[g * gs + k] * f;
        }
        for (size_t i = 0; i < N; i++) y[i * R + r] = dot_lanes(x + i * C, w, C);
    }
    free(w);
    return POCKET_OK;
}

static int quant_act_scalar(const float *x, int n, int cols, int8_t *qx, float *dx, float *sx) {
    if (n < 0 || cols <= 0 || cols % POCKET_QBLOCK) return POCKET_EINVAL;
    if (n == 0) return POCKET_OK;
    if (!x || !qx || !dx || !sx) return POCKET_EINVAL;
    size_t nblk = (size_t)n * (size_t)cols / 32;
    for (size_t b = 0; b < nblk; b++) {
        const float *p = x + 32 * b;
        float amax = 0.0f;
        for (int k = 0; k < 32; k++) {
            float a = fabsf(p[k]);
            if (a > amax) amax = a; /* NaN never wins */
        }
        float d = amax / 127.0f, id = 1.0f / d;
        if (!(amax >= POCKET_ACT_TINY)) d = 0.0f, id = 0.0f;
        int sum = 0;
        for (int k = 0; k < 32; k++) {
            float v = p[k] * id;
            v = v > -127.0f ? v : -127.0f; /* NaN -> -127, like the SIMD max */
            v = v < 127.0f ? v : 127.0f;
            int q = (int)pocket_round_even_small(v);
            qx[32 * b + k] = (int8_t)q;
            sum += q;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
    }
    return POCKET_OK;
}

static int q4_q8_scalar(const int8_t *qx, const float *dx, const float *sx, int n, int cols,
                        const uint8_t *qw, const uint16_t *sc, const uint16_t *mn, int rows,
                        int group_size, float *y, int row_begin, int row_end) {
    int rc = pocket_check_shape(n, cols, rows, group_size, row_begin, row_end);
    if (rc) return rc;
    if (n == 0 || row_begin == row_end) return POCKET_OK;
    if (!qx || !dx || !sx || !qw || !sc || !mn || !y) return POCKET_EINVAL;
    size_t C = (size_t)cols, gs = (size_t)group_size, ng = C / gs, nb = C / 32, gpb = gs / 32;
    size_t N = (size_t)n, R = (size_t)rows;
    float *buf = (float *)malloc((N * ng + nb + ng) * sizeof(float));
    if (!buf) return POCKET_ENOMEM;
    float *xs = buf, *swb = xs + N * ng, *mf = swb + nb;
    for (size_t i = 0; i < N; i++)
        for (size_t g = 0; g < ng; g++) {
            float s = 0.0f;
            for (size_t j = 0; j < gpb; j++) s += sx[i * nb + g * gpb + j];
            xs[i * ng + g] = s;
        }
    for (size_t r = (size_t)row_begin; r < (size_t)row_end; r++) {
        const uint8_t *q = qw + r * (C / 2);
        for (size_t b = 0; b < nb; b++) swb[b] = pocket_f16_to_f32(sc[r * ng + b / gpb]);
        for (size_t g = 0; g < ng; g++) mf[g] = pocket_f16_to_f32(mn[r * ng + g]);
        for (size_t i = 0; i < N; i++) {
            const int8_t *a = qx + i * C;
            float acc = 0.0f;
            for (size_t b = 0; b < nb; b++) {
                int32_t d = 0;
                for (size_t k = 0; k < 16; k++) {
                    int wb = q[16 * b + k];
                    d += (wb & 15) * a[32 * b + k] + (wb >> 4) * a[32 * b + 16 + k];
                }
                acc += (float)d * (swb[b] * dx[i * nb + b]);
            }
            y[i * R + r] = acc + dot_short(xs + i * ng, mf, ng);
        }
    }
    free(buf);
    return POCKET_OK;
}

static int q8_q8_scalar(const int8_t *qx, const float *dx, int n, int cols, const int8_t *qw,
                        const uint16_t *sc, int rows, int group_size, float *y, int row_begin,
                        int row_end) {
    int rc = pocket_check_shape(n, cols, rows, group_size, row_begin, row_end);
    if (rc) return rc;
    if (n == 0 || row_begin == row_end) return POCKET_OK;
    if (!qx || !dx || !qw || !sc || !y) return POCKET_EINVAL;
    size_t C = (size_t)cols, gs = (size_t)group_size, ng = C / gs, nb = C / 32, gpb = gs / 32;
    size_t N = (size_t)n, R = (size_t)rows;
    float *swb = (float *)malloc(nb * sizeof(float));
    if (!swb) return POCKET_ENOMEM;
    for (size_t r = (size_t)row_begin; r < (size_t)row_end; r++) {
        const int8_t *q = qw + r * C;
        for (size_t b = 0; b < nb; b++) swb[b] = pocket_f16_to_f32(sc[r * ng + b / gpb]);
        for (size_t i = 0; i < N; i++) {
            const int8_t *a = qx + i * C;
            float acc = 0.0f;
            for (size_t b = 0; b < nb; b++) {
                int32_t d = 0;
                for (size_t k = 0; k < 32; k++) d += q[32 * b + k] * a[32 * b + k];
                acc += (float)d * (swb[b] * dx[i * nb + b]);
            }
            y[i * R + r] = acc;
        }
    }
    free(swb);
    return POCKET_OK;
}

static const pocket_kernel_table table_scalar = {
    POCKET_LEVEL_SCALAR, "scalar", q4_f32_scalar, q8_f32_scalar,
    quant_act_scalar,    q4_q8_scalar, q8_q8_scalar,
};

#if POCKET_ARM_NEON
/* The neon level: the per-call kernels are the scalar ones (identical results); what the level
 * changes is the whole-model engine's operations (pm_ops_neon, chosen in pocket_model.c). */
static const pocket_kernel_table table_neon = {
    POCKET_LEVEL_NEON, "neon",       q4_f32_scalar, q8_f32_scalar,
    quant_act_scalar,  q4_q8_scalar, q8_q8_scalar,
};
#endif

/* =========================================================================================
 * CPU detection and dispatch
 * ========================================================================================= */

#if POCKET_X86_SIMD
static int x86_f16c(void) {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
    return __builtin_cpu_supports("f16c") != 0;
#else
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    return (c >> 29) & 1u;
#endif
}

static int x86_avx2_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && x86_f16c();
}

static int x86_avx512_ok(void) {
    __builtin_cpu_init(); /* __builtin_cpu_supports also checks that the OS saves zmm state */
    return x86_avx2_ok() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#endif

#if defined(__aarch64__)
/* The dot-product extension (SDOT / UDOT, ARMv8.2-A, optional up to ARMv8.3): on Linux from the
 * kernel's hardware capabilities; elsewhere only when the compiler's target already has it. */
static int arm_dotprod_ok(void) {
#if defined(__linux__) && defined(HWCAP_ASIMDDP)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__ARM_FEATURE_DOTPROD)
    return 1;
#else
    return 0;
#endif
}
#endif

unsigned pocket_cpu_features(void) {
    unsigned f = 0;
#if defined(__x86_64__)
    f |= POCKET_CPU_X86_64;
#endif
#if defined(__aarch64__)
    f |= POCKET_CPU_AARCH64 | POCKET_CPU_NEON;
    if (arm_dotprod_ok()) f |= POCKET_CPU_ASIMD_DOT;
#endif
#if POCKET_X86_SIMD
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) f |= POCKET_CPU_AVX2;
    if (__builtin_cpu_supports("fma")) f |= POCKET_CPU_FMA;
    if (x86_f16c()) f |= POCKET_CPU_F16C;
    if (__builtin_cpu_supports("avx512f")) f |= POCKET_CPU_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) f |= POCKET_CPU_AVX512BW;
    if (__builtin_cpu_supports("avx512dq")) f |= POCKET_CPU_AVX512DQ;
    if (__builtin_cpu_supports("avx512vl")) f |= POCKET_CPU_AVX512VL;
    if (__builtin_cpu_supports("avx512vnni")) f |= POCKET_CPU_AVX512VNNI;
    {
        unsigned a, b, c, d;
        if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4) & 1u) f |= POCKET_CPU_AVXVNNI;
        if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
            if ((d >> 25) & 1u) f |= POCKET_CPU_AMX_INT8;
            if ((d >> 22) & 1u) f |= POCKET_CPU_AMX_BF16;
        }
    }
#endif
    return f;
}

int pocket_level_compiled(int level) {
    if (level == POCKET_LEVEL_SCALAR) return 1;
#if POCKET_X86_SIMD
    if (level == POCKET_LEVEL_AVX2 || level == POCKET_LEVEL_AVX512) return 1;
#endif
#if POCKET_ARM_NEON
    if (level == POCKET_LEVEL_NEON) return 1;
#endif
    return 0;
}

int pocket_level_supported(int level) {
    switch (level) {
    case POCKET_LEVEL_SCALAR: return 1;
#if POCKET_X86_SIMD
    case POCKET_LEVEL_AVX2: return x86_avx2_ok();
    case POCKET_LEVEL_AVX512: return x86_avx512_ok();
#endif
#if POCKET_ARM_NEON
    case POCKET_LEVEL_NEON: return arm_dotprod_ok();
#endif
    default: return 0;
    }
}

int pocket_best_level(void) {
    for (int l = POCKET_LEVEL_COUNT - 1; l > 0; l--)
        if (pocket_level_supported(l)) return l;
    return POCKET_LEVEL_SCALAR;
}

const char *pocket_level_name(int level) {
    switch (level) {
    case POCKET_LEVEL_SCALAR: return "scalar";
    case POCKET_LEVEL_AVX2: return "avx2";
    case POCKET_LEVEL_AVX512: return "avx512";
    case POCKET_LEVEL_NEON: return "neon";
    default: return NULL;
    }
}

const pocket_kernel_table *pocket_kernels(int level) {
    if (level == POCKET_LEVEL_AUTO) level = pocket_best_level();
    if (!pocket_level_supported(level)) return NULL;
    switch (level) {
    case POCKET_LEVEL_SCALAR: return &table_scalar;
#if POCKET_X86_SIMD
    case POCKET_LEVEL_AVX2: return &pocket_table_avx2;
    case POCKET_LEVEL_AVX512: return &pocket_table_avx512;
#endif
#if POCKET_ARM_NEON
    case POCKET_LEVEL_NEON: return &table_neon;
#endif
    default: return NULL;
    }
}

/* =========================================================================================
 * Thread pool. A job is ntasks tasks with fixed contents (the drivers split rows into fixed
 * ranges, so results do not depend on which thread runs a task). Threads claim tasks from one
 * atomic word, generation << 32 | ntasks << 16 | next task: the caller takes part, and when a
 * worker is slow to wake (a busy machine), the caller simply runs more tasks itself instead of
 * waiting for it. Workers spin briefly for the next job (decode issues many small products
 * back to back), then sleep on a condition variable.
 * ========================================================================================= */

#define POCKET_SPIN_WORKER 4096 /* pause iterations before a worker sleeps */
#define POCKET_SPIN_WAIT 2048   /* pause iterations before the caller yields while waiting */
#define POCKET_MAX_TASKS 65535

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#if POCKET_HAVE_THREADS

struct pocket_pool {
    int nthreads; /* including the caller */
    int nworkers; /* threads actually started */
    pid_t pid;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_mutex_t submit;
    _Atomic int stop;
    _Atomic int sleepers;
    /* the current job: written by the caller while no task is in flight, read by a thread only
     * after it has claimed one of the job's tasks */
    pocket_task_fn fn;
    void *ctx;
    char pad0[64];
    _Atomic uint64_t claim;
    char pad1[64];
    _Atomic int done;
    char pad2[64];
};

/* Claim and run tasks of generation `gen` until none is left. */
static void pk_claim_run(pocket_pool *p, uint32_t gen) {
    uint64_t c = atomic_load(&p->claim);
    for (;;) {
        if ((uint32_t)(c >> 32) != gen) return;
        unsigned nt = (unsigned)(c >> 16) & 0xffffu, t = (unsigned)c & 0xffffu;
        if (t >= nt) return;
        if (atomic_compare_exchange_weak(&p->claim, &c, c + 1)) {
            p->fn(p->ctx, (int)t, (int)nt);
            atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
            c = atomic_load(&p->claim);
        }
    }
}

static void *pk_worker(void *arg) {
    pocket_pool *p = (pocket_pool *)arg;
    uint32_t seen = 0;
    for (;;) {
        uint64_t c;
        int spins = 0;
        while ((uint32_t)((c = atomic_load(&p->claim)) >> 32) == seen) {
            if (atomic_load_explicit(&p->stop, memory_order_relaxed)) return NULL;
            if (++spins < POCKET_SPIN_WORKER) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while ((uint32_t)(atomic_load(&p->claim) >> 32) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
            spins = 0;
        }
        seen = (uint32_t)(c >> 32);
        pk_claim_run(p, seen);
    }
}

pocket_pool *pocket_pool_create(int nthreads) {
    if (nthreads < 1 || nthreads > 1024) return NULL;
    void *mem = NULL;
    if (posix_memalign(&mem, 64, sizeof(pocket_pool)) != 0) return NULL;
    pocket_pool *p = (pocket_pool *)mem;
    memset(p, 0, sizeof *p);
    p->nthreads = nthreads;
    p->pid = getpid();
    atomic_init(&p->stop, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->claim, 0);
    atomic_init(&p->done, 0);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    pthread_mutex_init(&p->submit, NULL);
    int nw = nthreads - 1;
    if (nw > 0) {
        p->threads = (pthread_t *)calloc((size_t)nw, sizeof(pthread_t));
        if (!p->threads) nw = 0;
    }
    /* the workers block the signals sent to a process (they inherit the mask they are
       created with): a terminal's Ctrl-C must reach a thread that handles it, not a worker,
       where the host's handler (Python's) only notes it while its main thread sits in a read
       that nothing interrupts. Faults (SIGSEGV, SIGBUS, SIGFPE) stay unblocked: blocked, a
       worker's fault would kill the process with no handler run */
    static const int process_signals[] = {SIGINT,  SIGTERM, SIGHUP,  SIGQUIT, SIGUSR1,
                                          SIGUSR2, SIGPIPE, SIGCHLD, SIGALRM, SIGWINCH};
    sigset_t all, old;
    sigemptyset(&all);
    for (size_t k = 0; k < sizeof process_signals / sizeof process_signals[0]; k++)
        sigaddset(&all, process_signals[k]);
    int masked = pthread_sigmask(SIG_BLOCK, &all, &old) == 0;
    for (int k = 0; k < nw; k++) {
        if (pthread_create(&p->threads[k], NULL, pk_worker, p) != 0) break;
        p->nworkers++;
    }
    if (masked) pthread_sigmask(SIG_SETMASK, &old, NULL);
    return p;
}

void pocket_pool_destroy(pocket_pool *p) {
    if (!p) return;
    if (getpid() == p->pid) {
        atomic_store(&p->stop, 1);
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        for (int k = 0; k < p->nworkers; k++) pthread_join(p->threads[k], NULL);
        pthread_mutex_destroy(&p->mu);
        pthread_cond_destroy(&p->cv);
        pthread_mutex_destroy(&p->submit);
    }
    /* in a forked child the workers do not exist: only the memory is released */
    free(p->threads);
    free(p);
}

int pocket_pool_size(const pocket_pool *p) { return p ? p->nworkers + 1 : 1; }

void pocket_pool_run(pocket_pool *p, int ntasks, pocket_task_fn fn, void *ctx) {
    if (ntasks <= 0 || !fn) return;
    if (!p || ntasks == 1 || p->nworkers == 0 || ntasks > POCKET_MAX_TASKS ||
        getpid() != p->pid) {
        for (int t = 0; t < ntasks; t++) fn(ctx, t, ntasks);
        return;
    }
    pthread_mutex_lock(&p->submit);
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    uint32_t gen = (uint32_t)(atomic_load(&p->claim) >> 32) + 1u;
    /* seq_cst: pairs with the sleepers count of a worker going to sleep */
    atomic_store(&p->claim, ((uint64_t)gen << 32) | ((uint64_t)ntasks << 16));
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    pk_claim_run(p, gen);
    /* wait only for tasks that workers have claimed and are running */
    int spins = 0;
    while (atomic_load_explicit(&p->done, memory_order_acquire) < ntasks) {
        if (++spins < POCKET_SPIN_WAIT)
            cpu_relax();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&p->submit);
}

#else /* no threads: a pool of one */

struct pocket_pool {
    int nthreads;
};

pocket_pool *pocket_pool_create(int nthreads) {
    if (nthreads < 1) return NULL;
    pocket_pool *p = (pocket_pool *)calloc(1, sizeof *p);
    if (p) p->nthreads = 1;
    return p;
}

void pocket_pool_destroy(pocket_pool *p) { free(p); }

int pocket_pool_size(const pocket_pool *p) {
    (void)p;
    return 1;
}

void pocket_pool_run(pocket_pool *p, int ntasks, pocket_task_fn fn, void *ctx) {
    (void)p;
    if (!fn) return;
    for (int t = 0; t < ntasks; t++) fn(ctx, t, ntasks);
}

#endif

/* =========================================================================================
 * Threaded drivers
 * ========================================================================================= */

/* Multiply-accumulates below which one more task does not pay for waking a thread. */
#ifndef POCKET_MIN_TASK_WORK
#define POCKET_MIN_TASK_WORK (1 << 17)
#endif
#define POCKET_ROW_UNIT 16 /* row splits are multiples of this (64 bytes of y) */

typedef struct pk_job {
    const pocket_kernel_table *t;
    int bits, phase;
    const float *x;
    int n, cols, rows, gs;
    const void *qw;
    const uint16_t *sc, *mn;
    float *y;
    int8_t *qx;
    float *dx, *sx;
    int status;
} pk_job;

static void set_status(pk_job *j, int rc) {
    if (!rc) return;
#if POCKET_HAVE_THREADS
    __atomic_store_n(&j->status, rc, __ATOMIC_RELAXED);
#else
    j->status = rc;
#endif
}

static void pk_job_task(void *ctx, int task, int ntasks) {
    pk_job *j = (pk_job *)ctx;
    int rc = POCKET_OK, b, e;
    size_t C = (size_t)j->cols, nb = C / 32;
    if (j->phase == 0) { /* quantize the activations, split by tokens */
        pocket_split_range(j->n, 1, task, ntasks, &b, &e);
        if (e > b)
            rc = j->t->quantize_act_q8(j->x + (size_t)b * C, e - b, j->cols,
                                       j->qx + (size_t)b * C, j->dx + (size_t)b * nb,
                                       j->sx + (size_t)b * nb);
        set_status(j, rc);
        return;
    }
    pocket_split_range(j->rows, POCKET_ROW_UNIT, task, ntasks, &b, &e);
    if (e <= b) return;
    if (j->bits == 4) {
        if (j->qx)
            rc = j->t->matmul_q4_q8(j->qx, j->dx, j->sx, j->n, j->cols, (const uint8_t *)j->qw,
                                    j->sc, j->mn, j->rows, j->gs, j->y, b, e);
        else
            rc = j->t->matmul_q4_f32(j->x, j->n, j->cols, (const uint8_t *)j->qw, j->sc, j->mn,
                                     j->rows, j->gs, j->y, b, e);
    } else {
        if (j->qx)
            rc = j->t->matmul_q8_q8(j->qx, j->dx, j->n, j->cols, (const int8_t *)j->qw, j->sc,
                                    j->rows, j->gs, j->y, b, e);
        else
            rc = j->t->matmul_q8_f32(j->x, j->n, j->cols, (const int8_t *)j->qw, j->sc,
                                     j->rows, j->gs, j->y, b, e);
    }
    set_status(j, rc);
}

static int run_linear(const pocket_kernel_table *t, pocket_pool *pool, int nthreads,
                      int act_q8, int bits, const float *x, int n, int cols, const void *qw,
                      const uint16_t *sc, const uint16_t *mn, int rows, int gs, float *y) {
    int rc = pocket_check_shape(n, cols, rows, gs, 0, rows);
    if (rc) return rc;
    if (nthreads < 1 || (act_q8 != 0 && act_q8 != 1)) return POCKET_EINVAL;
    if (!t) return POCKET_EUNSUPPORTED;
    if (n == 0) return POCKET_OK;
    if (!x || !qw || !sc || !y || (bits == 4 && !mn)) return POCKET_EINVAL;

    int avail = pool ? pocket_pool_size(pool) : 1;
    if (avail > nthreads) avail = nthreads;
    pk_job j = {.t = t, .bits = bits, .x = x, .n = n, .cols = cols, .rows = rows, .gs = gs,
                .qw = qw, .sc = sc, .mn = mn, .y = y};
    void *work = NULL;
    if (act_q8) {
        size_t N = (size_t)n, C = (size_t)cols, nb = C / 32;
        size_t fbytes = 2 * N * nb * sizeof(float);
        work = malloc(fbytes + N * C);
        if (!work) return POCKET_ENOMEM;
        j.dx = (float *)work;
        j.sx = j.dx + N * nb;
        j.qx = (int8_t *)(j.sx + N * nb);
        int tq = n * (long long)cols >= 65536 ? avail : 1;
        if (tq > n) tq = n;
        j.phase = 0;
        pocket_pool_run(pool, tq, pk_job_task, &j);
        if (j.status) {
            free(work);
            return j.status;
        }
    }
    double macs = (double)n * (double)rows * (double)cols;
    long long by_work = (long long)(macs / POCKET_MIN_TASK_WORK);
    int units = (rows + POCKET_ROW_UNIT - 1) / POCKET_ROW_UNIT;
    int ntasks = avail;
    if (by_work < ntasks) ntasks = by_work < 1 ? 1 : (int)by_work;
    if (units < ntasks) ntasks = units;
    j.phase = 1;
    pocket_pool_run(pool, ntasks, pk_job_task, &j);
    free(work);
    return j.status;
}

int pocket_linear_q4_k(const pocket_kernel_table *kernels, pocket_pool *pool, int nthreads,
                       int act_q8, const float *x, int n, int cols, const uint8_t *qw,
                       const uint16_t *scales_f16, const uint16_t *mins_f16, int rows,
                       int group_size, float *y) {
    return run_linear(kernels, pool, nthreads, act_q8, 4, x, n, cols, qw, scales_f16, mins_f16,
                      rows, group_size, y);
}

int pocket_linear_q8_k(const pocket_kernel_table *kernels, pocket_pool *pool, int nthreads,
                       int act_q8, const float *x, int n, int cols, const int8_t *qw,
                       const uint16_t *scales_f16, int rows, int group_size, float *y) {
    return run_linear(kernels, pool, nthreads, act_q8, 8, x, n, cols, qw, scales_f16, NULL,
                      rows, group_size, y);
}
