/* hotpath: planned allocation in a device lease, with an online best-fit fallback and a
 * lock-free trace ring.  The interface and its contracts are in hotpath.h.
 *
 *   lease  base                                                           base + capacity
 *          +-----------+--------------------------------+---------+------+--------------+
 *          | online    | plan region: slot i at         | online  | free | online       |
 *          | (learned) | region + offsets[i]            | (miss)  |      |              |
 *          +-----------+--------------------------------+---------+------+--------------+
 *          best-fit owns the whole lease; the plan region is one of its live ranges
 *
 * Allocation k of an iteration is a hit when the plan has a slot k of exactly that size and
 * no live block holds bytes of slot k; anything else is a miss and goes to best-fit, outside
 * the region, where nothing can overlap it.  Since only hits live in the region, its live
 * blocks never overlap one another, so one of them overlaps slot k's [start, end) exactly when
 * the live slot of greatest start below `end` ends after `start`.  Slots are ranked by start
 * once, at install; the held ranks are a bitmap with a summary level above it for every 64
 * words below, so that check is a few word operations, whatever the plan:
 *
 *   level 1  |1|0|1|...                   bit w: word w of level 0 holds a bit
 *   level 0  |0100..01|0000..00|0010..00|  bit r: a live block holds the slot of rank r
 *             ranks 0-63 64-127   128-191     (slots by start; ties by index)
 * Best-fit: the smallest free range that fits, ties to the lowest offset, carved from its low
 * end; a release merges with both neighbours.  Free ranges sit in one array sorted by offset
 * (a few tens in training); live blocks in an open-addressing table keyed by offset.  Memory
 * for both grows on allocation, never on free, so a free cannot fail.
 *
 * Every call runs under the device's spinlock (PyTorch calls from any thread).  Under that
 * lock the allocator is the single producer of the device's event ring; the single consumer
 * (tidalpool_drain) never takes the lock:
 *
 *   ring[cap]:  ... | read | read | ev  | ev  | ev  | free | ...     head, tail: counters that
 *                                 ^tail             ^head              only grow; slot = i & mask
 *   producer: write ring[head & mask], then head = head + 1 (release); full -> overflow += 1
 *   consumer: copy [tail, head) (head acquired), then tail = tail + n (release)
 */
#define _POSIX_C_SOURCE 200809L
#include "hotpath.h"

#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct { uint64_t start, size; } range;
typedef struct {
    uint64_t key, block, size;       /* key: offset + 1; 0 empty */
    int32_t slot;
    int16_t stream;                  /* index in the pool's streams; -1 untracked */
    uint16_t users;                  /* bit j: recorded as used by stream j too */
} entry;
_Static_assert(TIDALPOOL_MAX_STREAMS <= 16, "entry.users holds a bit per ordered stream");
/* The streams that gave their slot to others: one event whose wait covers all their work
 * queued before they left (bit FENCE of owes and freers; see recycle). */
#define FENCE TIDALPOOL_MAX_STREAMS

typedef struct {
    uint64_t size, offset;           /* bytes asked; start in the region */
    uint32_t rank;                   /* place among the slots by start (ties by index) */
    uint32_t below;                  /* slots whose start is below this one's aligned end */
} plan_slot;

#define LEVELS 6                     /* 64^6 ranks: any plan (n <= INT32_MAX) */
typedef struct {
    uint64_t id, n, height, base;    /* base: the region's offset in the lease, once in use */
    plan_slot *slot;
    uint64_t *end;                   /* by rank: the slot's aligned end in the region */
    uint64_t *held[LEVELS];          /* bitmaps over ranks, in one allocation (held[0]) */
    unsigned levels;                 /* the top level is a single word */
    uint64_t cursor, live, iteration_misses;
    int active;                      /* 0 once abandoned: no new hits, live slots drain */
} plan;

typedef struct {
    _Alignas(64) atomic_int lock;
    atomic_int draining;
    uint64_t generation;             /* bumped by configure and reset */
    int configured;
    uint64_t base, capacity, align, shift;
    uint32_t max_misses;
    int stamp;                       /* events get a clock_gettime time */
    range *free;
    uint64_t nfree, free_cap;
    entry *tab;
    uint64_t tab_cap, tab_count;     /* tab_cap: a power of two, at least twice tab_count */
    unsigned tab_shift;              /* 64 - log2(tab_cap): the hash keeps the product's top bits */
    plan *plan, *pending;
    uint64_t next_block, iteration, seq;
    uint64_t c[TIDALPOOL_ST_COUNT];  /* the counters kept incrementally */
    void *streams[TIDALPOOL_MAX_STREAMS];
    void *events[FENCE + 1];              /* created on first need, destroyed by forget */
    tidalpool_event_destroy_fn destroys[FENCE + 1]; /* each event's: its creator's set's */
    uint32_t owes[TIDALPOOL_MAX_STREAMS]; /* bit j: stream j freed bytes since this one waited */
    uint32_t nstreams, freers, victim;    /* freers: bit j once stream j has freed bytes */
    tidalpool_event *ring;
    uint64_t ring_mask, tail_seen;   /* tail_seen: the producer's last look at tail */
    _Alignas(64) atomic_uint_fast64_t head;
    _Alignas(64) atomic_uint_fast64_t tail;
} pool;

static pool pools[TIDALPOOL_MAX_DEVICES];
static atomic_uint_fast64_t stray;
static atomic_uint_fast64_t leased; /* bit d: device d is configured (record_stream's search) */

static pool *at(int device) {
    return device >= 0 && device < TIDALPOOL_MAX_DEVICES ? &pools[device] : NULL;
}

static void lock(atomic_int *l) {
    for (unsigned spins = 0; atomic_exchange_explicit(l, 1, memory_order_acquire); spins++) {
        while (atomic_load_explicit(l, memory_order_relaxed))
            if (++spins > 100) sched_yield(); /* the holder may have been descheduled */
    }
}

static void unlock(atomic_int *l) { atomic_store_explicit(l, 0, memory_order_release); }

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void emit(pool *p, uint32_t kind, int32_t slot, uint64_t block, uint64_t size,
                 uint64_t offset) {
    uint64_t seq = p->seq++;
    uint64_t head = atomic_load_explicit(&p->head, memory_order_relaxed);
    if (head - p->tail_seen > p->ring_mask) {
        p->tail_seen = atomic_load_explicit(&p->tail, memory_order_acquire);
        if (head - p->tail_seen > p->ring_mask) {
            p->c[TIDALPOOL_ST_OVERFLOW]++;
            return;
        }
    }
    tidalpool_event *e = &p->ring[head & p->ring_mask];
    *e = (tidalpool_event){kind, slot, seq, block, size, offset, p->stamp ? now_ns() : 0};
    atomic_store_explicit(&p->head, head + 1, memory_order_release);
}

/* -- best-fit over the free ranges -------------------------------------------------------- */

static int fit_alloc(pool *p, uint64_t size, uint64_t *offset) {
    uint64_t best = p->nfree;
    for (uint64_t i = 0; i < p->nfree; i++)
        if (p->free[i].size >= size && (best == p->nfree || p->free[i].size < p->free[best].size))
            best = i;
    if (best == p->nfree) return -1;
    range *r = &p->free[best];
    *offset = r->start;
    if (r->size == size) {
        memmove(r, r + 1, (p->nfree - best - 1) * sizeof *r);
        p->nfree--;
    } else {
        r->start += size;
        r->size -= size;
    }
    return 0;
}

static void fit_release(pool *p, uint64_t start, uint64_t size) {
    uint64_t lo = 0, hi = p->nfree; /* i: the first free range after start */
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (p->free[mid].start < start) lo = mid + 1;
        else hi = mid;
    }
    uint64_t i = lo;
    int left = i > 0 && p->free[i - 1].start + p->free[i - 1].size == start;
    int right = i < p->nfree && start + size == p->free[i].start;
    if (left && right) {
        p->free[i - 1].size += size + p->free[i].size;
        memmove(&p->free[i], &p->free[i + 1], (p->nfree - i - 1) * sizeof(range));
        p->nfree--;
    } else if (left) {
        p->free[i - 1].size += size;
    } else if (right) {
        p->free[i].start = start;
        p->free[i].size += size;
    } else { /* room is reserved in advance: see reserve() */
        memmove(&p->free[i + 1], &p->free[i], (p->nfree - i) * sizeof(range));
        p->free[i] = (range){start, size};
        p->nfree++;
    }
}

/* -- live blocks: linear probing keyed by offset ------------------------------------------ */

static uint64_t home(const pool *p, uint64_t key) { /* Fibonacci hashing of offset / align */
    return (((key - 1) >> p->shift) * 0x9E3779B97F4A7C15u) >> p->tab_shift;
}

static uint64_t find(const pool *p, uint64_t key) { /* key's index, or an empty one */
    uint64_t i = home(p, key);
    while (p->tab[i].key && p->tab[i].key != key) i = (i + 1) & (p->tab_cap - 1);
    return i;
}

static void erase(pool *p, uint64_t i) { /* backward shift: no tombstones */
    uint64_t mask = p->tab_cap - 1;
    for (uint64_t j = (i + 1) & mask; p->tab[j].key; j = (j + 1) & mask) {
        uint64_t h = home(p, p->tab[j].key);
        if (((j - h) & mask) >= ((j - i) & mask)) {
            p->tab[i] = p->tab[j];
            i = j;
        }
    }
    p->tab[i].key = 0;
    p->tab_count--;
}

/* Room for one more live range: a table entry, and a free range it may later split off. */
static int reserve(pool *p) {
    if (2 * (p->tab_count + 1) > p->tab_cap) {
        uint64_t cap = p->tab_cap ? 2 * p->tab_cap : 1024, old_cap = p->tab_cap;
        unsigned shift = p->tab_cap ? p->tab_shift - 1 : 64 - 10;
        entry *old = p->tab, *tab = calloc(cap, sizeof *tab);
        if (!tab) return -1;
        p->tab = tab, p->tab_cap = cap, p->tab_shift = shift;
        for (uint64_t i = 0; i < old_cap; i++)
            if (old[i].key) p->tab[find(p, old[i].key)] = old[i];
        free(old);
    }
    uint64_t need = p->tab_count + 3; /* live blocks + the plan region + 1 separate free ranges */
    if (need > p->free_cap) {
        uint64_t cap = 2 * need;
        range *f = realloc(p->free, cap * sizeof *f);
        if (!f) return -1;
        p->free = f, p->free_cap = cap;
    }
    return 0;
}

/* -- plans --------------------------------------------------------------------------------- */

static void plan_free(plan *pl) {
    if (!pl) return;
    free(pl->slot), free(pl->end), free(pl->held[0]);
    free(pl);
}

static uint64_t align_up(uint64_t n, uint64_t align) { return (n + align - 1) & ~(align - 1); }

static void drop_plan(pool *p) {
    plan *pl = p->plan;
    if (pl->height) fit_release(p, pl->base, align_up(pl->height, p->align));
    plan_free(pl);
    p->plan = NULL;
}

typedef struct { uint64_t offset, index; } keyed;

static int by_offset(const void *a, const void *b) {
    const keyed *x = a, *y = b;
    if (x->offset != y->offset) return (x->offset > y->offset) - (x->offset < y->offset);
    return (x->index > y->index) - (x->index < y->index);
}

/* Ranks, aligned ends and `below` from the slots' sizes and offsets; bitmaps, all clear. */
static int rank_slots(plan *pl, uint64_t align) {
    uint64_t n = pl->n, words = 0, at[LEVELS]; /* at[k]: level k's first word */
    keyed *order = malloc((n + 1) * sizeof *order);
    pl->end = malloc((n + 1) * sizeof *pl->end);
    pl->levels = 0;
    for (uint64_t bits = n;; bits = (bits + 63) / 64) { /* a bit per word of the level below */
        at[pl->levels++] = words;
        words += bits ? (bits + 63) / 64 : 1;
        if (bits <= 64) break;
    }
    pl->held[0] = calloc(words, sizeof *pl->held[0]);
    if (!order || !pl->end || !pl->held[0]) {
        free(order);
        return -1;
    }
    for (unsigned k = 1; k < pl->levels; k++) pl->held[k] = pl->held[0] + at[k];
    for (uint64_t i = 0; i < n; i++) order[i] = (keyed){pl->slot[i].offset, i};
    qsort(order, n, sizeof *order, by_offset);
    for (uint64_t r = 0; r < n; r++) {
        plan_slot *s = &pl->slot[order[r].index];
        uint64_t lo = r + 1, hi = n; /* below: the first rank starting at or past the end */
        pl->end[r] = s->offset + align_up(s->size, align);
        while (lo < hi) {
            uint64_t mid = lo + (hi - lo) / 2;
            if (order[mid].offset < pl->end[r]) lo = mid + 1;
            else hi = mid;
        }
        s->rank = (uint32_t)r, s->below = (uint32_t)lo;
    }
    free(order);
    return 0;
}

/* Rank r becomes held: its bit, and each summary bit up to a word that already had one. */
static void hold_rank(plan *pl, uint64_t r) {
    for (unsigned k = 0; k < pl->levels; k++, r >>= 6) {
        uint64_t was = pl->held[k][r >> 6];
        pl->held[k][r >> 6] = was | (uint64_t)1 << (r & 63);
        if (was) break;
    }
}

static void unhold_rank(plan *pl, uint64_t r) {
    for (unsigned k = 0; k < pl->levels; k++, r >>= 6)
        if ((pl->held[k][r >> 6] &= ~((uint64_t)1 << (r & 63)))) break;
}

/* The greatest held rank <= x, or -1: up the levels to the first word with such a bit, then
 * down through the highest bit of each word below it. */
static int64_t held_at_or_below(const plan *pl, uint64_t x) {
    unsigned k = 0;
    for (;; k++) {
        uint64_t w = pl->held[k][x >> 6] & (~(uint64_t)0 >> (63 - (x & 63)));
        if (w) {
            x = (x & ~(uint64_t)63) | (uint64_t)(63 - __builtin_clzll(w));
            break;
        }
        if (!(x >> 6)) return -1; /* no word before this one */
        x = (x >> 6) - 1;          /* the words before, one level up */
    }
    while (k--) x = x << 6 | (uint64_t)(63 - __builtin_clzll(pl->held[k][x]));
    return (int64_t)x;
}

int tidalpool_install_plan(int device, uint64_t plan_id, uint64_t n, const uint64_t *sizes,
                           const uint64_t *offsets, uint64_t height) {
    pool *p = at(device);
    if (!p) return TIDALPOOL_EDEVICE;
    if (n && (!sizes || !offsets)) return TIDALPOOL_EINVAL;
    if (n > INT32_MAX) return TIDALPOOL_EINVAL; /* slots are int32 in events */
    lock(&p->lock);
    int configured = p->configured;
    uint64_t align = p->align, capacity = p->capacity, generation = p->generation;
    unlock(&p->lock);
    if (!configured) return TIDALPOOL_ENOLEASE;
    if (height > capacity) return TIDALPOOL_EINVAL;
    for (uint64_t i = 0; i < n; i++)
        if (!sizes[i] || sizes[i] > height || align_up(sizes[i], align) > height ||
            offsets[i] % align || offsets[i] > height - align_up(sizes[i], align))
            return TIDALPOOL_EINVAL;
    plan *pl = calloc(1, sizeof *pl);
    if (!pl) return TIDALPOOL_ENOMEM;
    pl->id = plan_id, pl->n = n, pl->height = height, pl->active = 1;
    pl->slot = malloc((n + 1) * sizeof *pl->slot);
    for (uint64_t i = 0; pl->slot && i < n; i++)
        pl->slot[i] = (plan_slot){sizes[i], offsets[i], 0, 0};
    if (!pl->slot || rank_slots(pl, align)) {
        plan_free(pl);
        return TIDALPOOL_ENOMEM;
    }
    lock(&p->lock);
    int same = p->generation == generation;
    plan *old = same ? p->pending : pl;
    if (same) p->pending = pl;
    unlock(&p->lock);
    plan_free(old);
    return same ? TIDALPOOL_OK : TIDALPOOL_EBUSY;
}

/* -- the allocator ------------------------------------------------------------------------ */

/* Slot `cursor` of the plan for size bytes, or -1: a miss (counted) or no plan in use. */
static int64_t take(pool *p, uint64_t size) {
    plan *pl = p->plan;
    if (!pl || !pl->active) return -1;
    uint64_t i = pl->cursor++;
    int fits = i < pl->n && pl->slot[i].size == size;
    if (fits) { /* the live slot of greatest start below slot i's end must end by its start */
        int64_t r = held_at_or_below(pl, pl->slot[i].below - 1);
        fits = r < 0 || pl->end[r] <= pl->slot[i].offset;
    }
    if (!fits) {
        p->c[TIDALPOOL_ST_MISSES]++;
        pl->iteration_misses++;
        return -1;
    }
    hold_rank(pl, pl->slot[i].rank);
    pl->live++;
    p->c[TIDALPOOL_ST_HITS]++;
    return (int64_t)i;
}

/* -- streams ------------------------------------------------------------------------------- */

static struct {
    _Atomic(tidalpool_event_create_fn) create;
    _Atomic(tidalpool_event_record_fn) record;
    _Atomic(tidalpool_stream_wait_fn) wait;
    _Atomic(tidalpool_event_destroy_fn) destroy;
} cuda;

void tidalpool_order_streams(tidalpool_event_create_fn create, tidalpool_event_record_fn record,
                             tidalpool_stream_wait_fn wait, tidalpool_event_destroy_fn destroy) {
    int all = create && record && wait && destroy;
    atomic_store(&cuda.create, all ? create : NULL);
    atomic_store(&cuda.record, all ? record : NULL);
    atomic_store(&cuda.wait, all ? wait : NULL);
    atomic_store(&cuda.destroy, all ? destroy : NULL);
}

#define CU_EVENT_DISABLE_TIMING 0x2

static int recycle(pool *p);

/* The stream's index, a new one owing every stream that has freed; once the table is full a
 * new stream takes the slot of one with no live block (recycle), else it is -1: untracked. */
static int32_t stream_index(pool *p, void *stream) {
    for (uint32_t i = 0; i < p->nstreams; i++)
        if (p->streams[i] == stream) return (int32_t)i;
    int32_t i = p->nstreams < TIDALPOOL_MAX_STREAMS ? (int32_t)p->nstreams++ : recycle(p);
    if (i < 0) {
        p->c[TIDALPOOL_ST_UNTRACKED_STREAM]++;
        return -1;
    }
    p->streams[i] = stream;
    p->owes[i] = p->freers; /* bytes freed before it was seen */
    return i;
}

/* Frees the slot of a stream that no live block names (own or recorded), round robin, and
 * returns it; -1 when every slot is named or the driver refused each (counted).  The live blocks
 * are scanned here, off the allocation path, which keeps no count per stream.  Streams may
 * still owe the leaving stream a wait, and streams seen later would have: the fence takes
 * that debt over.  The leaving stream waits for the fence's last record (the streams that
 * left before it), then the fence is recorded on it, so one wait on the fence covers the work
 * queued so far by every stream that has left; every stream owes it, and every new one. */
static int recycle(pool *p) {
    uint32_t named = 0;
    for (uint64_t i = 0; i < p->tab_cap; i++) {
        const entry *e = &p->tab[i];
        if (e->key) named |= e->users | (e->stream >= 0 ? 1u << e->stream : 0u);
    }
    tidalpool_event_record_fn record = atomic_load_explicit(&cuda.record, memory_order_relaxed);
    tidalpool_stream_wait_fn wait = atomic_load_explicit(&cuda.wait, memory_order_relaxed);
    tidalpool_event_create_fn create = atomic_load_explicit(&cuda.create, memory_order_relaxed);
    tidalpool_event_destroy_fn destroy = atomic_load_explicit(&cuda.destroy, memory_order_relaxed);
    for (uint32_t n = 0; n < TIDALPOOL_MAX_STREAMS; n++) {
        uint32_t j = (p->victim + n) % TIDALPOOL_MAX_STREAMS;
        if (named >> j & 1) continue;
        if (record && wait && create) { /* else nothing orders streams: debts only counted */
            void *fence = p->events[FENCE];
            if (fence ? wait(p->streams[j], fence, 0) : create(&fence, CU_EVENT_DISABLE_TIMING)) {
                p->c[TIDALPOOL_ST_STREAM_ERRORS]++; /* this stream may be gone: try another */
                continue;
            }
            if (!p->events[FENCE]) { /* just created */
                p->events[FENCE] = fence;
                p->destroys[FENCE] = destroy;
            }
            if (record(fence, p->streams[j])) {
                p->c[TIDALPOOL_ST_STREAM_ERRORS]++;
                continue;
            }
        }
        uint32_t bit = 1u << j, fence_bit = 1u << FENCE;
        for (uint32_t k = 0; k < TIDALPOOL_MAX_STREAMS; k++)
            p->owes[k] = (p->owes[k] & ~bit) | fence_bit;
        p->freers = (p->freers & ~bit) | fence_bit;
        p->victim = (j + 1) % TIDALPOOL_MAX_STREAMS;
        p->c[TIDALPOOL_ST_STREAMS_RECYCLED]++;
        return (int32_t)j;
    }
    return -1;
}

/* Stream i waits, on the GPU, for the work queued so far on every stream it owes.  A wait
 * whose driver call fails stays owed (the next allocation on i tries again) and is counted. */
static void settle(pool *p, int32_t i) {
    p->c[TIDALPOOL_ST_CROSS_STREAM]++;
    tidalpool_event_record_fn record = atomic_load_explicit(&cuda.record, memory_order_relaxed);
    tidalpool_stream_wait_fn wait = atomic_load_explicit(&cuda.wait, memory_order_relaxed);
    tidalpool_event_create_fn create = atomic_load_explicit(&cuda.create, memory_order_relaxed);
    tidalpool_event_destroy_fn destroy = atomic_load_explicit(&cuda.destroy, memory_order_relaxed);
    if (!record || !wait || !create) {
        p->owes[i] = 0; /* nothing to wait with: only counted */
        return;
    }
    for (uint32_t j = 0, owed = p->owes[i]; owed; j++, owed >>= 1) {
        if (!(owed & 1)) continue;
        void *event = p->events[j];
        if (j == FENCE && !event) { /* the streams left while nothing ordered streams */
            p->owes[i] &= ~(1u << j);
            continue;
        }
        if (!event && create(&event, CU_EVENT_DISABLE_TIMING)) {
            p->c[TIDALPOOL_ST_STREAM_ERRORS]++;
            continue;
        }
        if (!p->events[j]) { /* kept only once created */
            p->events[j] = event;
            p->destroys[j] = destroy;
        }
        if ((j != FENCE && record(event, p->streams[j])) || wait(p->streams[i], event, 0)) {
            p->c[TIDALPOOL_ST_STREAM_ERRORS]++;
            continue;
        }
        p->owes[i] &= ~(1u << j);
        p->c[TIDALPOOL_ST_STREAM_WAITS]++;
    }
}

/* Stream i freed bytes: every other stream owes it a wait. */
static void freed_on(pool *p, int32_t i) {
    if (i < 0) return;
    p->freers |= 1u << i;
    for (uint32_t k = 0; k < p->nstreams; k++)
        if ((int32_t)k != i) p->owes[k] |= 1u << i;
}

/* A block of `size` bytes, or NULL; *tables is set when host memory for the tables ran out. */
static void *alloc_locked(pool *p, uint64_t size, void *stream, int *tables) {
    if (!p->configured) {
        p->c[TIDALPOOL_ST_FAILURES]++;
        return NULL;
    }
    if (!size) {
        p->c[TIDALPOOL_ST_ZERO_ALLOCS]++;
        return NULL;
    }
    if (reserve(p)) {
        p->c[TIDALPOOL_ST_FAILURES]++;
        *tables = 1;
        return NULL;
    }
    int64_t slot = take(p, size);
    uint64_t offset;
    if (slot >= 0) {
        offset = p->plan->base + p->plan->slot[slot].offset;
    } else if (size > p->capacity || fit_alloc(p, align_up(size, p->align), &offset)) {
        p->c[TIDALPOOL_ST_FAILURES]++;
        return NULL;
    } else {
        p->c[TIDALPOOL_ST_ONLINE]++;
    }
    int32_t si = stream_index(p, stream);
    if (si >= 0 && p->owes[si]) settle(p, si);
    uint64_t block = p->next_block++;
    p->tab[find(p, offset + 1)] = (entry){offset + 1, block, size, (int32_t)slot, (int16_t)si, 0};
    p->tab_count++;
    p->c[TIDALPOOL_ST_MALLOCS]++;
    uint64_t live = p->c[TIDALPOOL_ST_LIVE_BYTES] += size;
    if (live > p->c[TIDALPOOL_ST_PEAK_LIVE_BYTES]) p->c[TIDALPOOL_ST_PEAK_LIVE_BYTES] = live;
    emit(p, TIDALPOOL_EV_ALLOC, (int32_t)slot, block, size, offset);
    return (void *)(uintptr_t)(p->base + offset);
}

static _Atomic(tidalpool_failure_fn) on_failure;
static _Thread_local char failure_message[320];

void tidalpool_on_failure(tidalpool_failure_fn fn) { atomic_store(&on_failure, fn); }

/* Why allocating `size` failed, into failure_message (under the lock: the numbers agree). */
static void describe_failure(const pool *p, int device, uint64_t size, int tables) {
    char *m = failure_message;
    size_t n = sizeof failure_message;
    if (!p->configured) {
        snprintf(m, n, "tidalpool: %llu bytes asked on device %d, which has no lease (no"
                 " session attached, or it ended)", (unsigned long long)size, device);
    } else if (tables) {
        snprintf(m, n, "tidalpool: out of host memory for the allocator's tables (%llu bytes"
                 " asked on device %d)", (unsigned long long)size, device);
    } else {
        uint64_t free_bytes = 0, largest = 0;
        for (uint64_t i = 0; i < p->nfree; i++) {
            free_bytes += p->free[i].size;
            if (p->free[i].size > largest) largest = p->free[i].size;
        }
        snprintf(m, n, "tidalpool: out of memory in the lease of device %d: %llu bytes asked;"
                 " lease %llu bytes, %llu live in %llu blocks, %llu free, largest free range"
                 " %llu", device, (unsigned long long)size, (unsigned long long)p->capacity,
                 (unsigned long long)p->c[TIDALPOOL_ST_LIVE_BYTES],
                 (unsigned long long)p->tab_count, (unsigned long long)free_bytes,
                 (unsigned long long)largest);
    }
}

static void *alloc_on(size_t size, int device, void *stream, int notify) {
    pool *p = at(device);
    if (!p) {
        atomic_fetch_add_explicit(&stray, 1, memory_order_relaxed);
        return NULL;
    }
    lock(&p->lock);
    int tables = 0;
    void *r = alloc_locked(p, size, stream, &tables);
    tidalpool_failure_fn fn = NULL;
    if (!r && size && notify && (fn = atomic_load_explicit(&on_failure, memory_order_relaxed)))
        describe_failure(p, device, size, tables);
    unlock(&p->lock);
    if (fn) fn("tidalpool_alloc", __FILE__, __LINE__, failure_message); /* may throw (C++) */
    return r;
}

void *tidalpool_alloc(size_t size, int device, void *stream) {
    return alloc_on(size, device, stream, 1);
}

void *tidalpool_try_alloc(size_t size, int device, void *stream) {
    return alloc_on(size, device, stream, 0);
}

/* The table index of the live block whose first byte is ptr, or -1 (counted as a bad free). */
static int64_t live_at(pool *p, uintptr_t ptr) {
    if (p->tab_count && ptr >= p->base && ptr - p->base < p->capacity) {
        uint64_t i = find(p, ptr - p->base + 1);
        if (p->tab[i].key) return (int64_t)i;
    }
    p->c[TIDALPOOL_ST_BAD_FREES]++;
    return -1;
}

static int free_locked(pool *p, uintptr_t ptr) {
    int64_t found = live_at(p, ptr);
    if (found < 0) return TIDALPOOL_EINVAL;
    uint64_t i = (uint64_t)found;
    entry e = p->tab[i];
    erase(p, i);
    uint64_t offset = e.key - 1;
    if (e.slot >= 0) {
        plan *pl = p->plan;
        unhold_rank(pl, pl->slot[e.slot].rank);
        if (!--pl->live && !pl->active) drop_plan(p);
    } else {
        fit_release(p, offset, align_up(e.size, p->align));
    }
    freed_on(p, e.stream);
    for (int32_t j = 0; e.users >> j; j++)
        if (e.users >> j & 1) freed_on(p, j); /* and by every stream recorded as using it */
    p->c[TIDALPOOL_ST_FREES]++;
    p->c[TIDALPOOL_ST_LIVE_BYTES] -= e.size;
    emit(p, TIDALPOOL_EV_FREE, e.slot, e.block, e.size, offset);
    return TIDALPOOL_OK;
}

int tidalpool_release(int device, void *ptr) {
    pool *p = at(device);
    if (!p) return TIDALPOOL_EDEVICE;
    lock(&p->lock);
    int r = free_locked(p, (uintptr_t)ptr);
    unlock(&p->lock);
    return r;
}

int64_t tidalpool_block_id(int device, void *ptr) {
    pool *p = at(device);
    if (!p) return TIDALPOOL_EDEVICE;
    lock(&p->lock);
    int64_t i = live_at(p, (uintptr_t)ptr);
    int64_t id = i < 0 ? TIDALPOOL_EINVAL : (int64_t)p->tab[i].block;
    unlock(&p->lock);
    return id;
}

void tidalpool_free(void *ptr, size_t size, int device, void *stream) {
    (void)size, (void)stream;
    if (!at(device)) atomic_fetch_add_explicit(&stray, 1, memory_order_relaxed);
    else if (ptr) tidalpool_release(device, ptr);
}

/* Under the lock: 0 when ptr is in no lease of p, 1 once recorded, -1 (a bad free) when it is
 * in the lease but not a live block. */
static int record_locked(pool *p, uintptr_t ptr, void *stream) {
    if (!p->configured || ptr < p->base || ptr - p->base >= p->capacity) return 0;
    int64_t i = live_at(p, ptr);
    if (i < 0) return -1;
    int32_t si = stream_index(p, stream);
    if (si >= 0 && si != p->tab[i].stream) p->tab[i].users |= (uint16_t)(1u << si);
    p->c[TIDALPOOL_ST_STREAM_RECORDS]++;
    return 1;
}

int tidalpool_record_stream_on(int device, void *ptr, void *stream) {
    pool *p = at(device);
    if (!p) return TIDALPOOL_EDEVICE;
    lock(&p->lock);
    int configured = p->configured;
    int found = configured ? record_locked(p, (uintptr_t)ptr, stream) : 0; /* -1: not live */
    if (configured && !found) p->c[TIDALPOOL_ST_BAD_FREES]++;
    unlock(&p->lock);
    return !configured ? TIDALPOOL_ENOLEASE : found > 0 ? TIDALPOOL_OK : TIDALPOOL_EINVAL;
}

void tidalpool_record_stream(void *ptr, void *stream) {
    uint64_t devices = atomic_load_explicit(&leased, memory_order_acquire);
    for (int d = 0; devices; d++, devices >>= 1) {
        if (!(devices & 1)) continue;
        lock(&pools[d].lock);
        int found = record_locked(&pools[d], (uintptr_t)ptr, stream);
        unlock(&pools[d].lock);
        if (found) return;
    }
    atomic_fetch_add_explicit(&stray, 1, memory_order_relaxed); /* in no lease */
}

/* -- control ------------------------------------------------------------------------------ */

uint32_t tidalpool_abi(void) { return TIDALPOOL_ABI; }

uint64_t tidalpool_stray_calls(void) { return atomic_load(&stray); }

static void forget(pool *p) { /* under both the lock and the drain flag */
    for (uint32_t i = 0; i <= FENCE; i++) /* with the set that created it, even if replaced */
        if (p->events[i] && p->destroys[i]) p->destroys[i](p->events[i]); /* errors ignored */
    memset(p->streams, 0, sizeof p->streams);
    memset(p->events, 0, sizeof p->events);
    memset(p->destroys, 0, sizeof p->destroys);
    memset(p->owes, 0, sizeof p->owes);
    p->nstreams = p->freers = p->victim = 0;
    atomic_fetch_and(&leased, ~((uint64_t)1 << (p - pools)));
    plan_free(p->plan), plan_free(p->pending);
    free(p->free), free(p->tab), free(p->ring);
    uint64_t generation = p->generation + 1;
    p->configured = 0;
    p->base = p->capacity = p->align = p->shift = 0;
    p->max_misses = 0, p->stamp = 0;
    p->free = NULL, p->nfree = p->free_cap = 0;
    p->tab = NULL, p->tab_cap = p->tab_count = 0, p->tab_shift = 0;
    p->plan = p->pending = NULL;
    p->next_block = 1, p->iteration = p->seq = 0;
    memset(p->c, 0, sizeof p->c);
    p->ring = NULL, p->ring_mask = p->tail_seen = 0;
    atomic_store(&p->head, 0);
    atomic_store(&p->tail, 0);
    p->generation = generation;
}

static void hold(pool *p) { /* the lock and the drain flag: nobody else touches p */
    lock(&p->lock);
    lock(&p->draining);
}

static void release(pool *p) {
    unlock(&p->draining);
    unlock(&p->lock);
}

int tidalpool_reset(int device) {
    pool *p = at(device);
    if (!p) return TIDALPOOL_EDEVICE;
    hold(p);
    forget(p);
    release(p);
    return TIDALPOOL_OK;
}

int tidalpool_configure(int device, uint64_t base, uint64_t capacity, uint64_t alignment,
                        uint64_t ring_events, uint32_t max_misses, uint32_t flags) {
    pool *p = at(device);
    if (!p) return TIDALPOOL_EDEVICE;
    if (flags & ~(uint32_t)TIDALPOOL_NO_TIMESTAMPS || !alignment || alignment & (alignment - 1) ||
        !base || base % alignment || capacity > UINTPTR_MAX - base ||
        ring_events > ((uint64_t)1 << 32))
        return TIDALPOOL_EINVAL;
    uint64_t cap = 2;
    while (cap < ring_events) cap *= 2;
    tidalpool_event *ring = malloc(cap * sizeof *ring);
    range *free_ranges = malloc(4 * sizeof *free_ranges);
    if (!ring || !free_ranges) {
        free(ring), free(free_ranges);
        return TIDALPOOL_ENOMEM;
    }
    hold(p);
    if (p->tab_count) {
        release(p);
        free(ring), free(free_ranges);
        return TIDALPOOL_EBUSY;
    }
    forget(p);
    p->base = base, p->align = alignment, p->capacity = capacity & ~(alignment - 1);
    while (((uint64_t)1 << p->shift) < alignment) p->shift++;
    p->max_misses = max_misses;
    p->stamp = !(flags & TIDALPOOL_NO_TIMESTAMPS);
    p->free = free_ranges, p->free_cap = 4;
    if (p->capacity) p->free[p->nfree++] = (range){0, p->capacity};
    p->ring = ring, p->ring_mask = cap - 1;
    p->configured = 1;
    atomic_fetch_or(&leased, (uint64_t)1 << (p - pools));
    release(p);
    return TIDALPOOL_OK;
}

int64_t tidalpool_step(int device) {
    pool *p = at(device);
    if (!p) return TIDALPOOL_EDEVICE;
    lock(&p->lock);
    if (!p->configured) {
        unlock(&p->lock);
        return TIDALPOOL_ENOLEASE;
    }
    plan *pl = p->plan;
    if (pl && pl->active && pl->iteration_misses > p->max_misses) {
        pl->active = 0; /* back to online; the region goes with its last block */
        p->c[TIDALPOOL_ST_FALLBACKS]++;
        if (!pl->live) drop_plan(p);
    }
    if (p->pending && (!p->plan || !p->plan->live)) {
        if (p->plan) drop_plan(p);
        plan *next = p->pending;
        uint64_t base = 0;
        if (!next->height ||
            (!reserve(p) && !fit_alloc(p, align_up(next->height, p->align), &base))) {
            next->base = base; /* else no room for the region now: try at the next step */
            p->plan = next, p->pending = NULL;
        }
    }
    if (p->plan) p->plan->cursor = 0, p->plan->iteration_misses = 0;
    int64_t iteration = (int64_t)++p->iteration;
    emit(p, TIDALPOOL_EV_ITER, -1, (uint64_t)iteration, 0, 0);
    unlock(&p->lock);
    return iteration;
}

int tidalpool_stats(int device, uint64_t *out, size_t n) {
    pool *p = at(device);
    if (!p) return TIDALPOOL_EDEVICE;
    uint64_t c[TIDALPOOL_ST_COUNT];
    lock(&p->lock);
    memcpy(c, p->c, sizeof c);
    uint64_t free_bytes = 0, largest = 0;
    for (uint64_t i = 0; i < p->nfree; i++) {
        free_bytes += p->free[i].size;
        if (p->free[i].size > largest) largest = p->free[i].size;
    }
    c[TIDALPOOL_ST_LIVE_BLOCKS] = p->tab_count;
    c[TIDALPOOL_ST_USED_BYTES] = p->capacity - free_bytes;
    c[TIDALPOOL_ST_EVENTS] = p->seq;
    c[TIDALPOOL_ST_ITERATION] = p->iteration;
    c[TIDALPOOL_ST_PLAN_ID] = p->plan ? p->plan->id : 0;
    c[TIDALPOOL_ST_PLANNED] = p->plan && p->plan->active;
    c[TIDALPOOL_ST_FREE_RANGES] = p->nfree;
    c[TIDALPOOL_ST_LARGEST_FREE] = largest;
    c[TIDALPOOL_ST_STREAMS] = p->nstreams;
    unlock(&p->lock);
    if (n > TIDALPOOL_ST_COUNT) n = TIDALPOOL_ST_COUNT;
    if (n && !out) return TIDALPOOL_EINVAL;
    if (n) memcpy(out, c, n * sizeof *c);
    return (int)n;
}

int64_t tidalpool_free_ranges(int device, uint64_t *out, uint64_t max) {
    pool *p = at(device);
    if (!p) return TIDALPOOL_EDEVICE;
    if (max && !out) return TIDALPOOL_EINVAL;
    lock(&p->lock);
    uint64_t n = p->nfree;
    for (uint64_t i = 0; i < n && i < max; i++) {
        out[2 * i] = p->free[i].start;
        out[2 * i + 1] = p->free[i].size;
    }
    unlock(&p->lock);
    return (int64_t)n;
}

int64_t tidalpool_drain(int device, tidalpool_event *out, uint64_t max) {
    pool *p = at(device);
    if (!p) return TIDALPOOL_EDEVICE;
    if (max && !out) return TIDALPOOL_EINVAL;
    if (atomic_exchange_explicit(&p->draining, 1, memory_order_acquire)) return TIDALPOOL_EBUSY;
    int64_t r = 0;
    if (p->ring) {
        uint64_t tail = atomic_load_explicit(&p->tail, memory_order_relaxed);
        uint64_t head = atomic_load_explicit(&p->head, memory_order_acquire);
        uint64_t n = head - tail < max ? head - tail : max;
        uint64_t first = tail & p->ring_mask, k = p->ring_mask + 1 - first; /* up to the end */
        if (k > n) k = n;
        if (k) memcpy(out, &p->ring[first], k * sizeof *out);
        if (n > k) memcpy(out + k, p->ring, (n - k) * sizeof *out);
        atomic_store_explicit(&p->tail, tail + n, memory_order_release);
        r = (int64_t)n;
    }
    unlock(&p->draining);
    return r;
}
