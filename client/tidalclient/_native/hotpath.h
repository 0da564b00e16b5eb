/* tidalpool native hot path: planned allocation inside a session's device lease.
 *
 * One shared object, two callers:
 *   - PyTorch loads it with torch.cuda.memory.CUDAPluggableAllocator(path, "tidalpool_alloc",
 *     "tidalpool_free") and calls the two allocator functions from any thread;
 *   - Python (tidalpool/native.py, through ctypes) configures the lease, installs plans, marks
 *     iteration boundaries, reads counters and drains the trace ring.
 * Both see the same state: a process loads a library file once, whoever opens it first.
 *
 * State is kept per device index (0 <= device < TIDALPOOL_MAX_DEVICES), each behind its own
 * spinlock. No function here raises, aborts or blocks on I/O: the allocator returns NULL and
 * counts the failure; control functions return TIDALPOOL_OK or a negative TIDALPOOL_E* code.
 * No CUDA header is needed: a stream is an opaque pointer, an address a number.
 */
#ifndef TIDALPOOL_HOTPATH_H
#define TIDALPOOL_HOTPATH_H

#include <stddef.h>
#include <stdint.h>

#define TIDALPOOL_ABI 5            /* bumped whenever a signature, the event or the stats change */
#define TIDALPOOL_MAX_DEVICES 64
#define TIDALPOOL_MAX_STREAMS 16    /* streams tracked at once per device (see Stream ordering) */

enum {
    TIDALPOOL_OK = 0,
    TIDALPOOL_EDEVICE = -1,        /* device index out of range */
    TIDALPOOL_EINVAL = -2,         /* an argument or a plan is invalid */
    TIDALPOOL_EBUSY = -3,          /* blocks still live, or another drain is running */
    TIDALPOOL_ENOMEM = -4,         /* host memory for the tables ran out */
    TIDALPOOL_ENOLEASE = -5,       /* tidalpool_configure has not been called for the device */
};

/* Event kinds: three values of tidalpool.v1 EventKind (tidalcore.events; tests/unit/test_events.py
 * holds these to it). */
enum { TIDALPOOL_EV_ALLOC = 1, TIDALPOOL_EV_FREE = 2, TIDALPOOL_EV_ITER = 6 };

/* One trace event, 48 bytes.  seq numbers every event the device produced, dropped ones too,
 * so a gap in seq is exactly the events lost to a full ring. */
typedef struct {
    uint32_t kind;                 /* TIDALPOOL_EV_* */
    int32_t slot;                  /* plan slot of a planned block; -1 when placed online */
    uint64_t seq;
    uint64_t block;                /* block id (1, 2, ...); the iteration number for ITER */
    uint64_t size;                 /* bytes asked for (the block's size on FREE, 0 on ITER) */
    uint64_t offset;               /* from the lease's base */
    uint64_t t_ns;                 /* clock_gettime(CLOCK_MONOTONIC); 0 if not stamped */
} tidalpool_event;

/* tidalpool_stats fills these, in this order. */
enum {
    TIDALPOOL_ST_MALLOCS, TIDALPOOL_ST_FREES, TIDALPOOL_ST_HITS, TIDALPOOL_ST_MISSES,
    TIDALPOOL_ST_ONLINE, TIDALPOOL_ST_FALLBACKS, TIDALPOOL_ST_FAILURES, TIDALPOOL_ST_ZERO_ALLOCS,
    TIDALPOOL_ST_BAD_FREES, TIDALPOOL_ST_LIVE_BLOCKS, TIDALPOOL_ST_LIVE_BYTES,
    TIDALPOOL_ST_PEAK_LIVE_BYTES, TIDALPOOL_ST_USED_BYTES, TIDALPOOL_ST_EVENTS,
    TIDALPOOL_ST_OVERFLOW, TIDALPOOL_ST_ITERATION, TIDALPOOL_ST_PLAN_ID, TIDALPOOL_ST_PLANNED,
    TIDALPOOL_ST_FREE_RANGES, TIDALPOOL_ST_LARGEST_FREE, TIDALPOOL_ST_STREAMS,
    TIDALPOOL_ST_CROSS_STREAM, TIDALPOOL_ST_STREAM_WAITS, TIDALPOOL_ST_STREAM_ERRORS,
    TIDALPOOL_ST_UNTRACKED_STREAM, TIDALPOOL_ST_STREAM_RECORDS, TIDALPOOL_ST_STREAMS_RECYCLED,
    TIDALPOOL_ST_COUNT
};

/* -- the allocator (PyTorch's CUDAPluggableAllocator signatures) -------------------------- */

/* A block of `size` bytes in the device's lease, aligned, for work on `stream`; NULL when it
 * does not fit, when size is 0 or the device has no lease (all counted). */
void *tidalpool_alloc(size_t size, int device, void *stream);

/* tidalpool_alloc without the failure handler: NULL is all a failure gives.  For callers that
 * cannot let a C++ exception pass (ctypes, C). */
void *tidalpool_try_alloc(size_t size, int device, void *stream);

/* Returns a block.  NULL is ignored; a pointer that is not a live block (double free, foreign
 * pointer) is counted and ignored.  `size` and `stream` are not used: the block's own are. */
void tidalpool_free(void *ptr, size_t size, int device, void *stream);

/* Stream ordering.  A block is allocated for a stream and freed when the framework drops it,
 * possibly before the stream's queued work that uses it has run: reusing its bytes is safe on
 * the same stream (stream order) but not on another.  Each device remembers the streams it has
 * served (up to TIDALPOOL_MAX_STREAMS) and, for each, the streams that freed bytes since it
 * last waited for them; an allocation on a stream with such a debt first makes its stream
 * wait, on the GPU, for the work queued so far on each of those streams (an event recorded
 * there, a stream-wait on it; the host never blocks).  Conservative: it waits for whole
 * streams, not for the bytes reused.  A stream first seen owes every stream that has freed.
 * Work of one stream never waits.  The event and stream-wait functions are passed in, the CUDA
 * runtime's (cudaEventCreateWithFlags, cudaEventRecord, cudaStreamWaitEvent, cudaEventDestroy)
 * or the driver's (cuEventCreate, ...; same signatures), so no CUDA header or library is
 * linked; until they are, allocations that would wait are only counted (cross_stream).  A
 * wait whose call fails is counted (stream_errors) and stays owed, so the next allocation on
 * that stream tries again.  One set for the process; NULLs turn ordering off.  An event is
 * destroyed when its lease is released or reset, by the set that created it, even if the set
 * was replaced or turned off since.
 *
 * At most TIDALPOOL_MAX_STREAMS streams are tracked at once.  A stream seen when the table is
 * full takes the slot of a stream that no live block names, neither as its own nor as
 * recorded (streams_recycled); what the leaving stream is owed passes to a fence event: the
 * leaving stream first waits for the fence's last record, then the fence is recorded on it,
 * and every stream, present or seen later, owes the fence one wait.  Only while every slot is
 * named by a live block is a new stream untracked: counted (untracked_stream), its blocks
 * neither wait nor are waited for. */
typedef int (*tidalpool_event_create_fn)(void **event, unsigned flags);
typedef int (*tidalpool_event_record_fn)(void *event, void *stream);
typedef int (*tidalpool_stream_wait_fn)(void *stream, void *event, unsigned flags);
typedef int (*tidalpool_event_destroy_fn)(void *event);
void tidalpool_order_streams(tidalpool_event_create_fn create, tidalpool_event_record_fn record,
                             tidalpool_stream_wait_fn wait, tidalpool_event_destroy_fn destroy);

/* The block at `ptr` (its first byte) is used by work on `stream` as well as its own (PyTorch's
 * Tensor.record_stream; CUDAPluggableAllocator's record-stream function has this signature).
 * When the block is freed, every stream recorded as using it counts as freeing its bytes, so
 * an allocation on any other stream, the block's own included, first waits for that stream's
 * work queued so far.  The device is the one whose lease holds ptr; a pointer in no lease is
 * counted as a stray call, one in a lease that is not a live block as a bad free.  An
 * untracked stream (see above) is counted (untracked_stream) and not waited for. */
void tidalpool_record_stream(void *ptr, void *stream);

/* The same for a known device: TIDALPOOL_OK; TIDALPOOL_EINVAL when ptr is not a live block
 * of its lease (counted as a bad free); TIDALPOOL_ENOLEASE when the device has no lease. */
int tidalpool_record_stream_on(int device, void *ptr, void *stream);

/* What tidalpool_alloc calls when it returns NULL for a non-zero size, after releasing its
 * lock: (function, file, line, message), the arguments of c10::detail::torchCheckFail.  The
 * handler may throw a C++ exception through tidalpool_alloc (the library is built with
 * -fexceptions, so its frames unwind): PyTorch's pluggable allocator does not check for NULL,
 * and a NULL tensor would fault on the GPU, so the PyTorch glue passes torchCheckFail and the
 * failed allocation raises in Python.  The message names the device, the size asked and the
 * lease's state; it lives in thread-local storage until the thread's next failure.  One
 * handler for the process; NULL (the default) removes it. */
typedef void (*tidalpool_failure_fn)(const char *func, const char *file, uint32_t line,
                                     const char *message);
void tidalpool_on_failure(tidalpool_failure_fn fn);

/* -- control ------------------------------------------------------------------------------ */

/* tidalpool_free that says what happened: TIDALPOOL_OK, or TIDALPOOL_EINVAL for a pointer that
 * is not a live block (NULL included), counted as a bad free. */
int tidalpool_release(int device, void *ptr);

/* The id the trace gives the live block at ptr (its ALLOC event's `block`), or TIDALPOOL_EINVAL
 * when ptr is not a live block (counted as a bad free, as tidalpool_release counts it). */
int64_t tidalpool_block_id(int device, void *ptr);

uint32_t tidalpool_abi(void);

/* configure flags */
enum { TIDALPOOL_NO_TIMESTAMPS = 1 };  /* events carry t_ns = 0: saves a clock read per event */

/* The lease [base, base + capacity) of a device, capacity rounded down to `alignment` (a power
 * of two, base a multiple of it, base != 0).  ring_events: trace ring size (rounded up to a
 * power of two, at least 2).  max_misses: more plan misses than this in one iteration abandon
 * the plan at the next step.  flags: TIDALPOOL_NO_TIMESTAMPS or 0.  EBUSY while blocks are
 * live; counters restart from zero. */
int tidalpool_configure(int device, uint64_t base, uint64_t capacity, uint64_t alignment,
                        uint64_t ring_events, uint32_t max_misses, uint32_t flags);

/* Forgets the device's lease, blocks, plans, counters and ring: pointers handed out before are
 * unknown afterwards.  For the end of a session (the lease is gone) and for tests. */
int tidalpool_reset(int device);

/* A plan for the steady iteration: allocation i of an iteration takes offset plan_base +
 * offsets[i] when its size is sizes[i] and no live block holds any of those bytes (judged
 * here from the offsets and aligned sizes; the caller is not trusted).  It takes over at the next
 * step at which the plan in use, if any, holds no live block; its `height` bytes are then
 * reserved by best-fit in the lease.  n == 0 is allowed (height 0).  Replaces a pending plan. */
int tidalpool_install_plan(int device, uint64_t plan_id, uint64_t n, const uint64_t *sizes,
                           const uint64_t *offsets, uint64_t height);

/* An iteration boundary: judges and switches plans, resets the allocation index and records an
 * ITER event.  Returns the new iteration number (1, 2, ...) or a negative TIDALPOOL_E* code. */
int64_t tidalpool_step(int device);

/* Writes min(n, TIDALPOOL_ST_COUNT) counters; returns how many, or a negative code. */
int tidalpool_stats(int device, uint64_t *out, size_t n);

/* Moves up to `max` events, oldest first, into out; returns how many or a negative code
 * (EBUSY when another drain of the device is running: one consumer at a time). */
int64_t tidalpool_drain(int device, tidalpool_event *out, uint64_t max);

/* Writes up to `max` (offset, size) pairs of free ranges, by offset, into out[2 * max];
 * returns the number of free ranges (which may exceed max) or a negative code. */
int64_t tidalpool_free_ranges(int device, uint64_t *out, uint64_t max);

/* Calls to tidalpool_alloc/free with a device index out of range (they return NULL / nothing). */
uint64_t tidalpool_stray_calls(void);

/* -- benchmark support (bench.c) -------------------------------------------------------- */

/* Replays an allocation script `rounds` times, each round timed from its step to its last op.
 * op k: sizes[k] > 0 allocates into table[handles[k]], sizes[k] == 0 frees it; after each
 * round, for every pair j, table[renames[2j + 1]] = table[renames[2j]] (a survivor plays the
 * role of a block the next round frees).  round_ns[r] gets round r's nanoseconds.  Returns the
 * number of allocations that returned NULL, or a negative code. */
int64_t tidalpool_bench_replay(int device, uint64_t *table, uint64_t n_table,
                               const uint64_t *handles, const uint64_t *sizes, uint64_t n_ops,
                               const uint64_t *renames, uint64_t n_renames, uint32_t rounds,
                               int64_t *round_ns);

#endif
