/* bench: replays an allocation script through the public allocator functions in a C loop, so
 * that a benchmark (bench/native.py) or a stress test times the allocator, not the caller. */
#define _POSIX_C_SOURCE 200809L
#include "hotpath.h"

#include <time.h>

static int64_t clock_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + (int64_t)t.tv_nsec;
}

int64_t tidalpool_bench_replay(int device, uint64_t *table, uint64_t n_table,
                               const uint64_t *handles, const uint64_t *sizes, uint64_t n_ops,
                               const uint64_t *renames, uint64_t n_renames, uint32_t rounds,
                               int64_t *round_ns) {
    if (device < 0 || device >= TIDALPOOL_MAX_DEVICES) return TIDALPOOL_EDEVICE;
    if ((n_ops && (!handles || !sizes || !table)) || (n_renames && !renames) ||
        (rounds && !round_ns))
        return TIDALPOOL_EINVAL;
    for (uint64_t k = 0; k < n_ops; k++)
        if (handles[k] >= n_table) return TIDALPOOL_EINVAL;
    for (uint64_t j = 0; j < 2 * n_renames; j++)
        if (renames[j] >= n_table) return TIDALPOOL_EINVAL;
    int64_t failed = 0;
    for (uint32_t r = 0; r < rounds; r++) {
        int64_t t0 = clock_ns();
        int64_t step = tidalpool_step(device);
        if (step < 0) return step;
        for (uint64_t k = 0; k < n_ops; k++) {
            uint64_t *slot = &table[handles[k]];
            if (sizes[k]) {
                void *ptr = tidalpool_alloc(sizes[k], device, NULL);
                failed += !ptr;
                *slot = (uint64_t)(uintptr_t)ptr;
            } else {
                tidalpool_free((void *)(uintptr_t)*slot, 0, device, NULL);
                *slot = 0;
            }
        }
        round_ns[r] = clock_ns() - t0;
        for (uint64_t j = 0; j < n_renames; j++) table[renames[2 * j + 1]] = table[renames[2 * j]];
    }
    return failed;
}
