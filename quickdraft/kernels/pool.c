/* The kernels' thread pool: tasks are claimed from an atomic counter by the calling thread and by
 * workers alike, and a call returns as soon as every task is done.
 *
 * Why not OpenMP: its fork/join waits at a barrier for every thread of the team. On a 2-core
 * machine with one core busy elsewhere (a test run, a tokenizer, another process), a descheduled
 * worker made each of a decode step's ~150 parallel regions wait for a scheduler tick: a SmolLM2
 * step took 1.9 s instead of 20 ms. Here a worker that is not running claims no task, and the
 * caller does the work itself.
 */
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#include "kernels.h"

#define MAX_WORKERS 63
#define PAUSES 5000   /* idle polls with a pause (~0.1 ms in all): a decode step's calls come ~10-50 us apart, and
                       * longer spinning held the core from torch's own threads between forwards (a 4 us
                       * torch op took 1.5 ms right after a forward) */
#define YIELDS 200    /* then polls that yield the core (a busy machine's other work runs), then sleep */

typedef struct {
    void (*fn)(void *ctx, int64_t task);
    void *ctx;
    int64_t tasks;
    atomic_int_fast64_t next, done;
} Job;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_mutex_t submit;  /* one job at a time */
    Job *_Atomic job;
    atomic_uint_fast64_t generation;
    atomic_int active;       /* workers holding the job pointer: the caller's frame outlives them */
    int workers;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0};

static void run_tasks(Job *job) {
    for (;;) {
        const int64_t t = atomic_fetch_add(&job->next, 1);
        if (t >= job->tasks) return;
        job->fn(job->ctx, t);
        atomic_fetch_add(&job->done, 1);
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint_fast64_t seen = atomic_load(&pool.generation);
    for (;;) {
        int spins = 0;
        while (atomic_load(&pool.generation) == seen) {
            if (++spins < PAUSES) { _mm_pause(); continue; }
            if (spins < PAUSES + YIELDS) { sched_yield(); continue; }
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load(&pool.generation);
        atomic_fetch_add(&pool.active, 1);  /* before reading the job: see qd_parallel's end */
        Job *job = atomic_load(&pool.job);
        if (job) run_tasks(job);
        atomic_fetch_sub(&pool.active, 1);
    }
    return 0;
}

/* fn(ctx, t) for t in [0, tasks), on up to `threads` threads (the caller is one of them). */
void qd_parallel(void (*fn)(void *, int64_t), void *ctx, int64_t tasks, int threads) {
    if (threads <= 1 || tasks <= 1) {
        for (int64_t t = 0; t < tasks; t++) fn(ctx, t);
        return;
    }
    pthread_mutex_lock(&pool.submit);
    while (pool.workers < threads - 1 && pool.workers < MAX_WORKERS) {
        pthread_t th;
        if (pthread_create(&th, 0, worker, 0) != 0) break;  /* fewer workers: the caller does more */
        pthread_detach(th);
        pool.workers++;
    }
    Job job = {fn, ctx, tasks, 0, 0};
    atomic_store(&pool.job, &job);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add(&pool.generation, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_tasks(&job);
    while (atomic_load(&job.done) < tasks) sched_yield();  /* only tasks a worker already claimed */
    /* No worker may touch `job` (on this stack) after we return: hide it, then wait out those that
     * took its address before (they counted themselves active first). */
    atomic_store(&pool.job, (Job *)0);
    while (atomic_load(&pool.active) > 0) sched_yield();
    pthread_mutex_unlock(&pool.submit);
}
