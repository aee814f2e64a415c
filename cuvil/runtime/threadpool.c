/*
 * cuvil's parallel-for: a small pthread pool linked into every model library.
 *
 * Generated code calls cuvil_parallel_for(fn, ctx, n, cost) for a loop of n independent
 * iterations; fn(ctx, begin, end) runs a contiguous range of them. The loop is cut into a few
 * chunks per thread, as even as whole iterations allow (sizes differ by at most one). Each
 * thread taking part owns a run of consecutive chunks (the caller the first, worker i the
 * (i + 2)-th), which it claims from the front; a thread done with its own takes the others'
 * from their backs. So a thread runs the same part of every loop of the same shape, call
 * after call: the rows of C a product's thread writes are those the next node's same thread
 * reads, from its own cache (with chunks claimed first come, first served, half of them were
 * in the other core's cache, and half of a product's weights too). Jobs too
 * small to amortise waking threads (n * cost below a threshold) run inline, and so does a job
 * submitted while the pool is busy (another thread calling a model, or a nested loop): the
 * pool serves one parallel loop at a time and never blocks one caller on another.
 *
 * One pool per process: every library carries this file, but a loader hands the pool of the
 * first library it loads to the others (cuvil_<model>_use_thread_pool), so models loaded
 * side by side never start more threads than there are CPUs. The shared part is the versioned
 * `struct cuvil_pool` below; each library keeps only its own per-thread call limit.
 *
 * cuvil_parallel_threads() tells generated code how many threads a loop started now would
 * get (1 inside another loop's body or while the pool is busy), so that it can cut work into
 * as many even blocks (a matrix product repacks its operand per block: no more than needed).
 *
 * Waiting: a worker spins for SPIN_NS on the job word (the next loop of a model usually comes
 * within microseconds), then sleeps on a condition variable, and exits after IDLE_NS asleep;
 * the next job starts it again. The submitter waits for the last chunk the same way. Spinning
 * yields the CPU every few microseconds: when a process has more runnable threads than CPUs,
 * the thread being waited for may be queued behind the spinner on the same CPU. It happens
 * in every fresh process on a 2-CPU machine: numpy's OpenBLAS threads spin for ~0.1 s after
 * `import numpy`, one keeps a CPU, and the caller and its worker share the other; yielding
 * cut a first run there by 10-15% (inception_v1 35.7 -> 29.9 ms, bert 40.7 -> 36.0).
 *
 * cuvil_populate(p, bytes) backs fresh zero memory that is about to be written whole (the
 * weights derived at the first run) with pages before the writes, in parallel on the pool:
 * in 2 MiB pages where the system allows, and in one system call per chunk instead of one page
 * fault per 4 KiB page. cuvil_release(p, bytes) drops the library's weights that the first run
 * transformed and nothing reads again from the process's resident memory.
 *
 * Threads: CUVIL_NUM_THREADS if set (1 disables the pool), else the CPUs this process may
 * run on. The pool is rebuilt in a forked child, whose threads do not survive fork, and its
 * workers are stopped and joined when the library is unloaded or the process exits.
 *
 * Windows (winpthreads, linked in statically): a DLL's destructor runs under the loader lock,
 * which a thread needs to exit, so joining workers there would deadlock. A DLL that starts a
 * worker pins itself instead (it stays loaded until the process exits, when Windows has ended
 * every other thread before the destructor runs); the loader only unloads libraries that use
 * another library's pool and so start no threads.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity */
#endif
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __linux__
#include <sys/mman.h>
#include <sys/prctl.h>
#endif
#include <time.h>
#include <unistd.h>
#ifdef _WIN32
#include <windows.h>
#endif

#define HIDDEN __attribute__((visibility("hidden")))
#define MAX_THREADS 64
/* each worker's stack (see start_workers) */
#define WORKER_STACK_BYTES (4u << 20)
#define CHUNKS_PER_THREAD 4 /* a few chunks per thread balance uneven iterations */
/* below this much work (iterations x per-iteration cost, about one multiply-add each) a
   job runs inline: waking a sleeping thread costs some microseconds */
#define MIN_PARALLEL_COST 32768
/* spin this long for the next job before sleeping: the serial stretches between a model's
   parallel loops are short now that pools and copies are parallel too; a longer spin took
   a core from other processes on a shared host for no measurable gain */
#define SPIN_NS 50000LL
#define IDLE_NS 1000000000LL     /* an idle worker exits after sleeping this long */
#define POOL_VERSION 2u
#define CACHE_LINE 64

typedef void (*cuvil_task_fn)(void *ctx, int64_t begin, int64_t end);

/* What libraries share. Only ever extended at the end, with `version` bumped. */
struct cuvil_pool {
    uint32_t version;
    uint32_t struct_size;
    /* `limit`: at most this many threads take part, the caller included (0: no limit) */
    void (*parallel_for)(cuvil_task_fn fn, void *ctx, int64_t n, int64_t cost, int32_t limit);
    /* version 2: threads a loop started now would use under `limit` (1: it would run inline) */
    int32_t (*threads)(int32_t limit);
};

enum { SLOT_EMPTY, SLOT_RUNNING, SLOT_EXITED };

/* The job word, which workers wait on: the job's generation (32 bits, never 0) | its chunks.
   Each thread taking part has a range word: generation | first chunk left (16) | end of its
   chunks (16). A claim is a compare-and-swap on a whole range word, so a worker that wakes
   late can never claim a chunk of a later job, nor one past the end of a range. */
#define JOB(gen, chunks) (((uint64_t)(gen) << 32) | (uint64_t)(chunks))
#define JOB_GEN(w) ((uint32_t)((w) >> 32))
#define RANGE(gen, front, back) (((uint64_t)(gen) << 32) | ((uint64_t)(front) << 16) | (back))
#define RANGE_FRONT(w) ((uint32_t)(w) >> 16 & 0xFFFFu)
#define RANGE_BACK(w) ((uint32_t)(w) & 0xFFFFu)

static struct {
    pthread_mutex_t busy;  /* held by the thread whose job the pool runs */
    pthread_mutex_t lock;  /* guards sleeping, slots, threads */
    pthread_cond_t wake;   /* sleeping workers wait here for a job */
    pthread_cond_t done;   /* a sleeping submitter waits here for the last chunk */
    int threads;           /* threads a job may use (workers + caller); 0 before first use */
    int stopping;          /* set when the library is unloaded */
    int running;           /* a job is in flight (a hint for cuvil_parallel_threads) */
    /* the job: written by the submitter before it publishes `word`, stable until the job
       ends; read with relaxed atomics because late workers may read while it is rewritten.
       A cache line of its own: every claim writes `word` and every finished chunk `pending`,
       and neither should evict what the other threads only read. */
    _Alignas(CACHE_LINE) cuvil_task_fn fn;
    void *ctx;
    int64_t n;
    int64_t chunks;
    int32_t workers;       /* workers 0 .. workers-1 take part */
    int sleepers;          /* workers waiting on `wake` */
    int submitter_asleep;
    _Alignas(CACHE_LINE) uint64_t word;
    _Alignas(CACHE_LINE) int64_t pending; /* chunks not finished yet */
    /* the chunks each thread taking part owns: the caller's first, then worker i's at i + 1;
       a line each, since every claim writes one */
    struct {
        _Alignas(CACHE_LINE) uint64_t word;
    } range[MAX_THREADS];
    struct {
        pthread_t thread;
        int state;
        uint32_t seen;     /* generation the worker starts after */
    } slot[MAX_THREADS - 1];
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define LOAD_RELAXED(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)
#define STORE_RELAXED(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELAXED)

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Claim one chunk of job `gen` from the range of thread `part`: its first chunk left (`own`)
   or its last. Returns the chunk, or -1 when that range has none left. */
static int64_t claim(uint32_t gen, int part, int own) {
    uint64_t w = LOAD(pool.range[part].word);
    for (;;) {
        if (JOB_GEN(w) != gen || RANGE_FRONT(w) >= RANGE_BACK(w)) return -1;
        uint64_t next = own ? w + (1u << 16) : w - 1;
        if (__atomic_compare_exchange_n(&pool.range[part].word, &w, next, 1, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return own ? RANGE_FRONT(w) : RANGE_BACK(w) - 1;
        /* w now holds the current word */
    }
}

static void run_chunk(int64_t i) {
    /* the job cannot end before this chunk is done: its fields are stable */
    int64_t n = LOAD_RELAXED(pool.n), chunks = LOAD_RELAXED(pool.chunks);
    int64_t begin = i * n / chunks, end = (i + 1) * n / chunks; /* even: sizes differ by 1 */
    LOAD_RELAXED(pool.fn)(LOAD_RELAXED(pool.ctx), begin, end);
    if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_SEQ_CST) == 0 &&
        __atomic_load_n(&pool.submitter_asleep, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_signal(&pool.done);
        pthread_mutex_unlock(&pool.lock);
    }
}

/* Run chunks of job `gen` as thread `self` (0: the caller, i + 1: worker i) until none are
   left: its own range from the front, then the others' from their backs. */
static void run_chunks(uint32_t gen, int self) {
    int64_t i;
    while ((i = claim(gen, self, 1)) >= 0) run_chunk(i);
    /* a late worker may read a later job's count: its claims then fail on the generation */
    int parts = LOAD_RELAXED(pool.workers) + 1;
    for (int found = 1; found;) {
        found = 0;
        for (int q = 1; q < parts; q++) {
            int part = (self + q) % parts;
            while ((i = claim(gen, part, 0)) >= 0) {
                run_chunk(i);
                found = 1;
            }
        }
    }
}

/* Wait until a generation after `seen` is published (spinning first if `spin`); 0 when the
   worker should exit instead: idle past `idle_until` (CLOCK_MONOTONIC ns), or the library is
   going away. Generations are never 0. */
static uint32_t wait_for_job(uint32_t seen, int spin, int64_t idle_until) {
    int64_t spin_end = now_ns() + SPIN_NS;
    for (int i = 1; spin; i++) {
        uint32_t gen = JOB_GEN(LOAD(pool.word));
        if (gen != seen) return gen;
        if (LOAD_RELAXED(pool.stopping)) return 0;
        cpu_relax();
        if (i % 64 == 0) {
            if (now_ns() > spin_end) break;
            sched_yield(); /* see "Waiting" at the top */
        }
    }
    int64_t left = idle_until - now_ns();
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until); /* the clock pthread_cond_timedwait uses */
    if (left > 0) {
        int64_t ns = until.tv_nsec + left;
        until.tv_sec += ns / 1000000000LL;
        until.tv_nsec = ns % 1000000000LL;
    }
    pthread_mutex_lock(&pool.lock);
    __atomic_add_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
    uint32_t gen;
    for (;;) {
        gen = JOB_GEN(__atomic_load_n(&pool.word, __ATOMIC_SEQ_CST));
        if (gen != seen || pool.stopping) break;
        if (pthread_cond_timedwait(&pool.wake, &pool.lock, &until) == ETIMEDOUT) {
            gen = JOB_GEN(__atomic_load_n(&pool.word, __ATOMIC_SEQ_CST));
            break;
        }
    }
    __atomic_sub_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
    if (gen == seen || pool.stopping) gen = 0;
    pthread_mutex_unlock(&pool.lock);
    return gen;
}

static void *worker(void *arg) {
    int index = (int)(intptr_t)arg;
    /* named, so that top -H, gdb and tests tell the pool's threads from the process's others */
#if defined(__linux__)
    prctl(PR_SET_NAME, "cuvil-pool", 0, 0, 0);
#elif defined(__APPLE__)
    pthread_setname_np("cuvil-pool");
#endif
    uint32_t gen = pool.slot[index].seen; /* written before this thread was created */
    int took_part = 1;
    /* idle means not taking part: jobs limited to fewer threads do not keep this one alive */
    int64_t idle_until = now_ns() + IDLE_NS;
    while ((gen = wait_for_job(gen, took_part, idle_until)) != 0) {
        took_part = index < LOAD_RELAXED(pool.workers);
        if (took_part) {
            run_chunks(gen, index + 1);
            idle_until = now_ns() + IDLE_NS;
        }
    }
    pthread_mutex_lock(&pool.lock);
    pool.slot[index].state = SLOT_EXITED; /* joined by whoever restarts the slot */
    pthread_mutex_unlock(&pool.lock);
    return NULL;
}

static int configured_threads(void) {
    const char *env = getenv("CUVIL_NUM_THREADS");
    long n = 0;
    if (env && *env) n = strtol(env, NULL, 10);
#if defined(_WIN32)
    DWORD_PTR process_cpus, system_cpus;
    if (n < 1 && GetProcessAffinityMask(GetCurrentProcess(), &process_cpus, &system_cpus))
        n = __builtin_popcountll((unsigned long long)process_cpus);
    if (n < 1) {
        SYSTEM_INFO info;
        GetSystemInfo(&info);
        n = (long)info.dwNumberOfProcessors;
    }
#else
#ifdef __linux__
    cpu_set_t cpus;
    if (n < 1 && sched_getaffinity(0, sizeof cpus, &cpus) == 0) n = CPU_COUNT(&cpus);
#endif
    if (n < 1) n = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    return (int)n;
}

#ifndef _WIN32
static void reset_after_fork(void) {
    /* the child has only the forking thread: start afresh on its first job */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cond = PTHREAD_COND_INITIALIZER;
    pool.lock = fresh;
    pool.busy = fresh;
    pool.wake = fresh_cond;
    pool.done = fresh_cond;
    pool.sleepers = 0;
    pool.submitter_asleep = 0;
    pool.running = 0; /* a job of another thread was cut short by the fork */
    for (int i = 0; i < MAX_THREADS - 1; i++) pool.slot[i].state = SLOT_EMPTY;
}
#endif

/* Start workers 0 .. count-1 where they do not run; returns how many run (all unless
   pthread_create failed or the library is going away). Called with `busy` held. */
static int start_workers(int count, uint32_t gen) {
    int i = 0;
    while (i < count && LOAD_RELAXED(pool.slot[i].state) == SLOT_RUNNING) i++;
    if (i == count) return count;
    pthread_mutex_lock(&pool.lock);
#ifdef _WIN32
    static int pinned;
    HMODULE self;
    if (!pinned)  /* see the top of the file: a DLL running workers is never unloaded */
        pinned = GetModuleHandleExW(GET_MODULE_HANDLE_EX_FLAG_FROM_ADDRESS |
                                    GET_MODULE_HANDLE_EX_FLAG_PIN, (LPCWSTR)(void *)&pool, &self);
    if (!pinned) count = i; /* cannot pin: run on the calling thread alone */
#endif
    /* the GEMM kernel keeps a block of B's panels on its stack (128 KB with AVX-512):
       musl gives threads 128 KB of stack by default, glibc 8 MB; the pages are only reserved */
    pthread_attr_t attr;
    int sized = pthread_attr_init(&attr) == 0;
    if (sized) pthread_attr_setstacksize(&attr, WORKER_STACK_BYTES);
    for (; i < count && !pool.stopping; i++) {
        if (pool.slot[i].state == SLOT_RUNNING) continue;
        if (pool.slot[i].state == SLOT_EXITED) pthread_join(pool.slot[i].thread, NULL);
        pool.slot[i].state = SLOT_EMPTY;
        pool.slot[i].seen = gen;
        if (pthread_create(&pool.slot[i].thread, sized ? &attr : NULL, worker,
                           (void *)(intptr_t)i) != 0) break;
        pool.slot[i].state = SLOT_RUNNING;
    }
    if (sized) pthread_attr_destroy(&attr);
    pthread_mutex_unlock(&pool.lock);
    return i;
}

/* The pool's size, read from the environment on first use. */
static int pool_size(void) {
    int threads = __atomic_load_n(&pool.threads, __ATOMIC_ACQUIRE);
    if (threads != 0) return threads;
    pthread_mutex_lock(&pool.lock);
    if (pool.threads == 0) {
#ifndef _WIN32
        pthread_atfork(NULL, NULL, reset_after_fork);
#endif
        __atomic_store_n(&pool.threads, configured_threads(), __ATOMIC_RELEASE);
    }
    threads = pool.threads;
    pthread_mutex_unlock(&pool.lock);
    return threads;
}

static int32_t pool_threads(int32_t limit) {
    if (limit == 1 || __atomic_load_n(&pool.running, __ATOMIC_RELAXED)) return 1;
    int threads = pool_size();
    return limit > 0 && limit < threads ? limit : threads;
}

static void pool_parallel_for(cuvil_task_fn fn, void *ctx, int64_t n, int64_t cost,
                              int32_t limit) {
    if (n <= 0) return;
    if (n == 1 || n * (cost > 0 ? cost : 1) < MIN_PARALLEL_COST || limit == 1 ||
        pthread_mutex_trylock(&pool.busy) != 0) {
        fn(ctx, 0, n);
        return;
    }
    int threads = pool_size();
    if (limit > 0 && limit < threads) threads = limit;
    int64_t chunks = (int64_t)threads * CHUNKS_PER_THREAD;
    if (chunks > n) chunks = n;
    int workers = (int)(chunks < threads ? chunks : threads) - 1;
    uint32_t gen = JOB_GEN(pool.word);
    workers = start_workers(workers, gen);
    if (workers == 0) {
        pthread_mutex_unlock(&pool.busy);
        fn(ctx, 0, n);
        return;
    }
    __atomic_store_n(&pool.running, 1, __ATOMIC_RELAXED);
    STORE_RELAXED(pool.fn, fn);
    STORE_RELAXED(pool.ctx, ctx);
    STORE_RELAXED(pool.n, n);
    STORE_RELAXED(pool.chunks, chunks);
    STORE_RELAXED(pool.workers, workers);
    __atomic_store_n(&pool.pending, chunks, __ATOMIC_RELAXED);
    if (++gen == 0) gen = 1; /* 0 means "exit" to workers */
    for (int part = 0; part <= workers; part++) /* as even as whole chunks allow */
        __atomic_store_n(&pool.range[part].word,
                         RANGE(gen, part * chunks / (workers + 1),
                               (part + 1) * chunks / (workers + 1)), __ATOMIC_RELAXED);
    __atomic_store_n(&pool.word, JOB(gen, chunks), __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }

    run_chunks(gen, 0);
    int64_t spin_end = now_ns() + SPIN_NS;
    for (int i = 1; LOAD(pool.pending) > 0; i++) {
        cpu_relax();
        if (i % 64 != 0) continue;
        if (now_ns() <= spin_end) {
            sched_yield(); /* see "Waiting" at the top */
        } else {
            pthread_mutex_lock(&pool.lock);
            __atomic_store_n(&pool.submitter_asleep, 1, __ATOMIC_SEQ_CST);
            while (__atomic_load_n(&pool.pending, __ATOMIC_SEQ_CST) > 0)
                pthread_cond_wait(&pool.done, &pool.lock);
            __atomic_store_n(&pool.submitter_asleep, 0, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&pool.lock);
        }
    }
    __atomic_store_n(&pool.running, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&pool.busy);
}

/* The most threads this library's loops use on the calling thread (0: the pool's size).
   A pthread key, not __thread: TLS in a dlopened library calls __tls_get_addr, which would
   make the library depend on the dynamic loader itself (no manylinux policy allows it). */
static pthread_key_t limit_key;
static int limit_key_ready;
static pthread_once_t limit_key_once = PTHREAD_ONCE_INIT;

static void make_limit_key(void) {
    if (pthread_key_create(&limit_key, NULL) == 0)
        __atomic_store_n(&limit_key_ready, 1, __ATOMIC_RELEASE);
}

static int32_t call_limit(void) {
    if (!__atomic_load_n(&limit_key_ready, __ATOMIC_ACQUIRE)) return 0;
    return (int32_t)(intptr_t)pthread_getspecific(limit_key);
}

#ifndef _WIN32
/* Before the library is unmapped (dlclose, or exit): no worker may still run its code. */
__attribute__((destructor)) static void stop_workers(void) {
    pthread_mutex_lock(&pool.lock);
    __atomic_store_n(&pool.stopping, 1, __ATOMIC_RELAXED);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (int i = 0; i < MAX_THREADS - 1; i++) {
        pthread_mutex_lock(&pool.lock);
        int state = pool.slot[i].state;
        pool.slot[i].state = SLOT_EMPTY;
        pthread_mutex_unlock(&pool.lock);
        if (state != SLOT_EMPTY) pthread_join(pool.slot[i].thread, NULL);
    }
    if (__atomic_load_n(&limit_key_ready, __ATOMIC_ACQUIRE)) pthread_key_delete(limit_key);
}
#endif

static const struct cuvil_pool own_pool = {POOL_VERSION, sizeof(struct cuvil_pool),
                                           pool_parallel_for, pool_threads};
static const struct cuvil_pool *active_pool = &own_pool;

HIDDEN void cuvil_parallel_for(cuvil_task_fn fn, void *ctx, int64_t n, int64_t cost) {
    if (n <= 0) return;
    int32_t limit = call_limit();
    if (n == 1 || n * (cost > 0 ? cost : 1) < MIN_PARALLEL_COST || limit == 1) {
        fn(ctx, 0, n);
        return;
    }
    __atomic_load_n(&active_pool, __ATOMIC_ACQUIRE)->parallel_for(fn, ctx, n, cost, limit);
}

HIDDEN int32_t cuvil_parallel_threads(void) {
    int32_t limit = call_limit();
    if (limit == 1) return 1;
    return __atomic_load_n(&active_pool, __ATOMIC_ACQUIRE)->threads(limit);
}

#ifdef __linux__
/* madvise advice by value: the C library the code is built against may predate them */
#define ADVICE_HUGEPAGE 14       /* Linux 2.6.38: back the range with transparent huge pages */
#define ADVICE_POPULATE_WRITE 23 /* Linux 5.14: fault the range in writable, now */
#define HUGE_PAGE (2 << 20)      /* x86_64's and aarch64's (4 KiB pages) PMD size */

static void populate_chunks(void *ctx, int64_t begin, int64_t end) {
    const uintptr_t *range = ctx; /* [start, stop) in whole pages */
    /* chunks are the huge pages the range overlaps: no two threads fault the same one */
    uintptr_t base = range[0] & ~(uintptr_t)(HUGE_PAGE - 1);
    uintptr_t lo = base + (uintptr_t)begin * HUGE_PAGE, hi = base + (uintptr_t)end * HUGE_PAGE;
    if (lo < range[0]) lo = range[0];
    if (hi > range[1]) hi = range[1];
    /* an older kernel refuses the advice: the writes then fault the pages in one by one */
    madvise((void *)lo, hi - lo, ADVICE_POPULATE_WRITE);
}
#endif

HIDDEN void cuvil_populate(void *p, int64_t bytes) {
#ifdef __linux__
    if (bytes <= 0) return;
    uintptr_t start = (uintptr_t)p, stop = start + (uintptr_t)bytes;
    /* huge pages only where whole ones fit: the neighbours of the range keep theirs */
    uintptr_t huge_lo = (start + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
    uintptr_t huge_hi = stop & ~(uintptr_t)(HUGE_PAGE - 1);
    if (huge_hi > huge_lo) madvise((void *)huge_lo, huge_hi - huge_lo, ADVICE_HUGEPAGE);
    /* whole pages, rounded outwards: populating does not change what the neighbours hold */
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t range[2] = {start & ~(page - 1), (stop + page - 1) & ~(page - 1)};
    uintptr_t base = range[0] & ~(uintptr_t)(HUGE_PAGE - 1);
    int64_t chunks = (int64_t)((range[1] - base + HUGE_PAGE - 1) / HUGE_PAGE);
    /* cost: zeroing a chunk is about as much work as HUGE_PAGE / 4 multiply-adds */
    cuvil_parallel_for(populate_chunks, range, chunks, HUGE_PAGE / 4);
#else
    (void)p;
    (void)bytes;
#endif
}

/* cuvil_release(p, bytes): the library's own weights that nothing reads any more (the 3x3
 * kernels a Winograd conv derived its transformed weights from, at the first run) leave the
 * process's resident memory: they are pages of the library's file, which the kernel drops and
 * would read again from the file if they were touched. Only the whole pages inside the range:
 * its neighbours may share the edge pages. Elsewhere a no-op (the pages stay resident). */
HIDDEN void cuvil_release(const void *p, int64_t bytes) {
#ifdef __linux__
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = ((uintptr_t)p + page - 1) & ~(page - 1);
    uintptr_t hi = ((uintptr_t)p + (uintptr_t)(bytes > 0 ? bytes : 0)) & ~(page - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
#else
    (void)p;
    (void)bytes;
#endif
}

/* One bit of CPUID (reg 0-3: EAX, EBX, ECX, EDX), 0 where there is no such leaf or no CPUID.
 * For kernels that use instructions beyond their copy's CPU level (the int8 GEMM's VNNI, not
 * part of x86-64-v4): they ask once and keep the answer. LLVM IR has no CPUID, and inline
 * assembly would need the target's assembler in the compiler, which llvmlite lacks. */
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
HIDDEN int32_t cuvil_cpuid_bit(int32_t leaf, int32_t subleaf, int32_t reg, int32_t bit) {
    uint32_t r[4] = {0, 0, 0, 0};
    if (__get_cpuid_max((uint32_t)leaf & 0x80000000u, 0) < (uint32_t)leaf) return 0;
    __cpuid_count(leaf, subleaf, r[0], r[1], r[2], r[3]);
    return (int32_t)((r[reg & 3] >> (bit & 31)) & 1u);
}

/* Whether AMX-BF16 tiles may run (the bf16 GEMM kernel asks once): the CPU has AMX-TILE and
 * AMX-BF16 (CPUID 7.0 EDX bits 24 and 22), the OS saves the tile state (XCR0 bits 17 and 18)
 * and, on Linux, hands it to this process, which must ask before its first tile instruction
 * (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; the grant covers every thread). */
#if defined(__linux__)
#include <sys/syscall.h>
#endif
HIDDEN int32_t cuvil_amx_ready(void) {
    if (!cuvil_cpuid_bit(7, 0, 3, 24) || !cuvil_cpuid_bit(7, 0, 3, 22)
        || !cuvil_cpuid_bit(1, 0, 2, 27) /* OSXSAVE: xgetbv is there */)
        return 0;
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    if ((lo & (3u << 17)) != (3u << 17)) return 0;
#if defined(__linux__) && defined(SYS_arch_prctl)
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0)
        return 0;
#endif
    return 1;
}

/* Whether bf16 products may use the CPU's bf16 instructions (the bf16 GEMM kernel's gate asks
 * once): CUVIL_BF16=0 sends them to their float32 path, as on CPUs without (docs/precision.md;
 * results then match those CPUs', and the tests run that path here). */
HIDDEN int32_t cuvil_bf16_allowed(void) {
    const char *env = getenv("CUVIL_BF16");
    return !(env != NULL && env[0] == '0' && env[1] == 0);
}
#elif defined(__aarch64__)
/* AArch64 has no CPUID: (word, -, -, bit) names a bit of Linux's HWCAP words (1: AT_HWCAP = 16,
 * 2: AT_HWCAP2 = 26, the kernel's uapi auxvec.h). macOS is asked about I8MM (HWCAP2 bit 13)
 * with sysctl, Windows about the dot product (HWCAP bit 20) only, as codegen's dispatcher
 * asks them (AARCH64_CPU_FLAGS); other questions and systems answer no, and the kernels take
 * their plain path. */
#if defined(__linux__)
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif
HIDDEN int32_t cuvil_cpuid_bit(int32_t word, int32_t unused_a, int32_t unused_b, int32_t bit) {
    (void)unused_a, (void)unused_b;
#if defined(__linux__)
    return (int32_t)((getauxval(word == 2 ? 26 : 16) >> (bit & 63)) & 1ul);
#elif defined(__APPLE__)
    int value = 0;
    size_t size = sizeof value;
    return word == 2 && bit == 13
           && sysctlbyname("hw.optional.arm.FEAT_I8MM", &value, &size, 0, 0) == 0 && value;
#elif defined(_WIN32)
    return word == 1 && bit == 20 && IsProcessorFeaturePresent(43); /* PF_ARM_V82_DP_... */
#else
    (void)word, (void)bit;
    return 0;
#endif
}
#endif

/* What the library's exports cuvil_<model>_thread_pool, _use_thread_pool and
   _set_thread_limit (see the header) call. The exported wrappers carry the model's name and
   are generated with the CPU dispatcher (codegen/dispatch.py), so this file compiles to the
   same object for every model: zig's cache serves it after the first build. */
HIDDEN const struct cuvil_pool *cuvil_pool_active(void) {
    return __atomic_load_n(&active_pool, __ATOMIC_ACQUIRE);
}

HIDDEN int32_t cuvil_pool_use(const struct cuvil_pool *other) {
    if (other == NULL) other = &own_pool;
    /* a later version only adds fields at the end */
    if (other->version < POOL_VERSION || other->struct_size < sizeof(struct cuvil_pool)) return -1;
    __atomic_store_n(&active_pool, other, __ATOMIC_RELEASE);
    return 0;
}

HIDDEN void cuvil_pool_set_thread_limit(int32_t threads) {
    if (threads < 0) threads = 0;
    if (threads == 0 && !__atomic_load_n(&limit_key_ready, __ATOMIC_ACQUIRE)) return;
    pthread_once(&limit_key_once, make_limit_key);
    if (__atomic_load_n(&limit_key_ready, __ATOMIC_ACQUIRE))
        pthread_setspecific(limit_key, (void *)(intptr_t)threads);
}
