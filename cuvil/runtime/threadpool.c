/*
 * cuvil's parallel-for: a small pthread pool linked into every model library.
 *
 * Generated code calls cuvil_parallel_for(fn, ctx, n, cost) for a loop of n independent
 * iterations; fn(ctx, begin, end) runs a contiguous range of them. The caller's thread
 * works too. Jobs too small to amortise waking threads (n * cost below a threshold) run
 * inline, and so does a job submitted while the pool is busy (another Python thread calling
 * the model, or a nested loop): the pool never blocks one caller on another.
 *
 * Threads: CUVIL_NUM_THREADS if set (1 disables the pool), else the online CPUs. The pool
 * starts on first use and is rebuilt in a forked child, whose threads do not survive fork.
 * The only state is this pool; model code itself stays re-entrant.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#define HIDDEN __attribute__((visibility("hidden")))
#define MAX_THREADS 64
/* below this much work (iterations x per-iteration cost, about one multiply-add each) a
   job runs inline: waking a sleeping thread costs some microseconds */
#define MIN_PARALLEL_COST 32768

typedef void (*cuvil_task_fn)(void *ctx, int64_t begin, int64_t end);

struct pool {
    pthread_mutex_t lock;      /* guards every field below */
    pthread_cond_t wake;       /* workers wait here for a new job */
    pthread_cond_t done;       /* the submitter waits here for the last chunk */
    pthread_mutex_t busy;      /* held by the thread whose job is running */
    int threads;               /* workers started (the caller makes one more) */
    int64_t generation;        /* bumped for each job */
    cuvil_task_fn fn;
    void *ctx;
    int64_t n, chunk, next, remaining;
};

static struct pool pool = {
    PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
    PTHREAD_MUTEX_INITIALIZER, -1, 0, 0, 0, 0, 0, 0, 0,
};

/* Take chunks of job `generation` until none are left; returns how many iterations ran.
   A worker that wakes late must not take chunks of a later job with this job's fn. */
static int64_t run_chunks(int64_t generation, cuvil_task_fn fn, void *ctx, int64_t n,
                          int64_t chunk) {
    int64_t done = 0;
    for (;;) {
        pthread_mutex_lock(&pool.lock);
        if (pool.generation != generation) {
            pthread_mutex_unlock(&pool.lock);
            return done;
        }
        int64_t begin = pool.next;
        pool.next = begin + chunk;
        pthread_mutex_unlock(&pool.lock);
        if (begin >= n) return done;
        int64_t end = begin + chunk < n ? begin + chunk : n;
        fn(ctx, begin, end);
        done += end - begin;
    }
}

static void finish(int64_t count) {
    if (count == 0) return;
    pthread_mutex_lock(&pool.lock);
    pool.remaining -= count;
    if (pool.remaining == 0) pthread_cond_signal(&pool.done);
    pthread_mutex_unlock(&pool.lock);
}

static void *worker(void *arg) {
    (void)arg;
    int64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool.lock);
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        cuvil_task_fn fn = pool.fn;
        void *ctx = pool.ctx;
        int64_t n = pool.n, chunk = pool.chunk;
        pthread_mutex_unlock(&pool.lock);
        finish(run_chunks(seen, fn, ctx, n, chunk));
    }
    return NULL;
}

static int configured_threads(void) {
    const char *env = getenv("CUVIL_NUM_THREADS");
    long n = env && *env ? strtol(env, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    return (int)n;
}

static void reset_after_fork(void) {
    /* the child has only the forking thread: start afresh on its first job */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cond = PTHREAD_COND_INITIALIZER;
    pool.lock = fresh;
    pool.busy = fresh;
    pool.wake = fresh_cond;
    pool.done = fresh_cond;
    pool.threads = -1;
}

/* Start the workers once; called with `busy` held. */
static void start_pool(void) {
    if (pool.threads >= 0) return;
    static int atfork_registered;
    if (!atfork_registered) {
        pthread_atfork(NULL, NULL, reset_after_fork);
        atfork_registered = 1;
    }
    int wanted = configured_threads() - 1;
    pool.threads = 0;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < wanted; i++) {
        pthread_t t;
        if (pthread_create(&t, &attr, worker, NULL) != 0) break;
        pool.threads++;
    }
    pthread_attr_destroy(&attr);
}

HIDDEN void cuvil_parallel_for(cuvil_task_fn fn, void *ctx, int64_t n, int64_t cost) {
    if (n <= 0) return;
    if (n == 1 || n * (cost > 0 ? cost : 1) < MIN_PARALLEL_COST ||
        pthread_mutex_trylock(&pool.busy) != 0) {
        fn(ctx, 0, n);
        return;
    }
    start_pool();
    if (pool.threads == 0) {
        pthread_mutex_unlock(&pool.busy);
        fn(ctx, 0, n);
        return;
    }
    int64_t parts = (int64_t)(pool.threads + 1) * 4; /* a few chunks per thread balance load */
    int64_t chunk = (n + parts - 1) / parts;
    pthread_mutex_lock(&pool.lock);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.chunk = chunk;
    pool.next = 0;
    pool.remaining = n;
    int64_t generation = ++pool.generation;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);

    finish(run_chunks(generation, fn, ctx, n, chunk));
    pthread_mutex_lock(&pool.lock);
    while (pool.remaining > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.busy);
}
