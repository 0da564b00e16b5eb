/* _exact: an exact, anytime search for dynamic storage allocation.
 *
 * Place rectangles with a fixed time interval [lower, upper) and a free offset
 * so that no two time-overlapping ones share an address and all lie below a
 * capacity.  Everything here is in alignment units; exact.py converts.
 *
 * The search follows MiniMalloc (Moffitt, ASPLOS'23).  It only builds
 * canonical solutions: buffers are placed in nondecreasing (offset, preorder
 * rank) order, each at its minimum offset (the highest top of placed buffers
 * overlapping it in time).  Pruning:
 *   - cross-section inference: in every section (a maximal set of buffers live
 *     together) max(current offset, floor) + unplaced total <= capacity, the
 *     floor being the lowest offset any unplaced buffer there can still take;
 *   - dominance: a buffer is never placed at or above the lowest top an
 *     unplaced buffer could reach (that buffer would fill the gap below);
 *   - a "hatless" buffer (no unplaced buffer overlaps it) is tried only once.
 * When the unplaced buffers fall apart in time, the parts are solved apart,
 * each ranked afresh.  Three preorders take turns under a doubling node limit.
 *
 *   b0 [==========)             sections: the buffers live just before each
 *   b1      [=============)     end time: s0 = {b0, b1, b2}, s1 = {b0, b1},
 *   b2 [====)                   s2 = {b1}; cuts[s]: unplaced buffers in both
 *           ^s0   ^s1     ^s2   s and s + 1 (2, 1): a zero cut splits the problem
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { FOUND, NOT_FOUND, ABORTED, TIMED_OUT, NO_MEMORY };

typedef int32_t idx;
typedef struct { idx at; int64_t old; } undo; /* at >= 0: min_off[at]; else floor[~at] */

typedef struct pre { double k[3]; idx i; } pre;

typedef struct {
    idx n, ns;
    int64_t cap, *lo, *hi, *size;
    idx *s_lo, *s_hi;          /* each buffer lives in sections [s_lo, s_hi) */
    idx *sec_at, *sec_buf;     /* CSR: the buffers of each section */
    idx *ov_at, *ov_buf;       /* CSR: the buffers overlapping each buffer in time */
    idx *rank, *wit;           /* preorder ranks (ties at one offset); a buffer of each section */
    struct pre *pre;           /* scratch for ranking */
    int order;                 /* which preorder this attempt uses */
    int64_t *min_off, *off, *sol, *floor, *total, *mark, tick;
    idx *cuts;                 /* unplaced buffers crossing boundary s | s + 1 */
    undo *log;
    size_t log_len, log_cap;
    idx *arena;                /* a stack of orderings, addressed by index */
    size_t arena_len, arena_cap;
    int64_t nodes_left, nodes;
    double deadline;
} solver;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Grows *p (of *cap elements of width w) to hold need elements; 0 on success. */
static int grow(void **p, size_t *cap, size_t need, size_t w) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 1024;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * w);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

/* Reserves k arena entries; returns their base index or -1. */
static long long push(solver *S, size_t k) {
    size_t base = S->arena_len;
    if (grow((void **)&S->arena, &S->arena_cap, base + k, sizeof(idx))) return -1;
    S->arena_len = base + k;
    return (long long)base;
}

static int note(solver *S, idx at, int64_t old) {
    if (grow((void **)&S->log, &S->log_cap, S->log_len + 1, sizeof(undo))) return -1;
    S->log[S->log_len].at = at;
    S->log[S->log_len++].old = old;
    return 0;
}

static inline int before(const solver *S, idx a, idx b) {
    if (S->min_off[a] != S->min_off[b]) return S->min_off[a] < S->min_off[b];
    return S->rank[a] < S->rank[b];
}

/* Shell sort by (min_off, rank): deterministic, in place, no allocation. */
static void sort_order(const solver *S, idx *v, idx m) {
    static const idx gaps[] = {3548, 1577, 701, 301, 132, 57, 23, 10, 4, 1};
    for (size_t g = 0; g < sizeof gaps / sizeof gaps[0]; g++) {
        idx gap = gaps[g];
        for (idx i = gap; i < m; i++) {
            idx x = v[i], j = i;
            for (; j >= gap && before(S, x, v[j - gap]); j -= gap) v[j] = v[j - gap];
            v[j] = x;
        }
    }
}

/* Places b at o, logging every change from log_len on.  Returns 1 if no unplaced
 * buffer overlaps b in time ("hatless"), 0 if one does, -1 when out of memory. */
static int place(solver *S, idx b, int64_t o) {
    int64_t top = o + S->size[b], id = ++S->tick;
    int hatless = 1;
    S->off[b] = S->sol[b] = o;
    for (idx k = S->ov_at[b]; k < S->ov_at[b + 1]; k++) {
        idx j = S->ov_buf[k];
        if (S->off[j] >= 0) continue;
        hatless = 0;
        if (S->min_off[j] >= top) continue;
        if (note(S, j, S->min_off[j])) return -1;
        S->min_off[j] = top;
        S->mark[j] = id;
    }
    for (idx s = S->s_lo[b]; s < S->s_hi[b]; s++) { /* the rest of s overlaps b */
        if (S->floor[s] < top) {
            if (note(S, ~s, S->floor[s])) return -1;
            S->floor[s] = top;
        }
        S->total[s] -= S->size[b];
        if (s + 1 < S->s_hi[b]) S->cuts[s]--;
    }
    return hatless;
}

static void unplace(solver *S, idx b, size_t log_base) {
    while (S->log_len > log_base) {
        undo u = S->log[--S->log_len];
        if (u.at >= 0) S->min_off[u.at] = u.old;
        else S->floor[~u.at] = u.old;
    }
    for (idx s = S->s_lo[b]; s < S->s_hi[b]; s++) {
        S->total[s] += S->size[b];
        if (s + 1 < S->s_hi[b]) S->cuts[s]++;
    }
    S->off[b] = -1;
}

/* Cross-section inference over sections [plo, phi), all later offsets being >= o:
 * 1 if every section can still hold its unplaced buffers, 0 if not, -1 if out of
 * memory.  floor[s] is a lower bound on the least min_off of the unplaced buffers
 * of s, and the min_off of wit[s], when unplaced, an upper bound; the exact least
 * is computed (and floor raised) only when the two bounds disagree on the answer. */
static int check(solver *S, idx plo, idx phi, int64_t o) {
    for (idx s = plo; s < phi; s++) {
        int64_t room = S->cap - S->total[s];
        idx w = S->wit[s];
        if (S->floor[s] > room || o > room) return 0;
        if (S->total[s] == 0 || (S->off[w] < 0 && S->min_off[w] <= room)) continue;
        int64_t least = INT64_MAX;
        for (idx k = S->sec_at[s]; k < S->sec_at[s + 1]; k++) {
            idx j = S->sec_buf[k];
            if (S->off[j] < 0 && S->min_off[j] < least) least = S->min_off[j], S->wit[s] = j;
        }
        if (least == INT64_MAX) continue;
        if (least > S->floor[s]) {
            if (note(S, ~s, S->floor[s])) return -1;
            S->floor[s] = least;
        }
        if (least > room) return 0;
    }
    return 1;
}

static int split(solver *S, idx plo, idx phi, size_t base, idx m, int64_t min_o);

/* Depth-first search over the m unplaced buffers at arena[base...], sorted by
 * (min_off, rank), of the part spanning sections [plo, phi). */
static int dfs(solver *S, idx plo, idx phi, size_t base, idx m, int64_t min_o, idx min_r) {
    if (m == 0) return FOUND;
    if (S->nodes_left-- <= 0) return ABORTED;
    if (((++S->nodes & 255) == 0 || m > 4096) && now() > S->deadline) return TIMED_OUT;
    int64_t min_h = INT64_MAX;
    for (idx i = 0; i < m; i++) {
        idx b = S->arena[base + (size_t)i];
        if (S->min_off[b] + S->size[b] < min_h) min_h = S->min_off[b] + S->size[b];
    }
    for (idx i = 0; i < m; i++) {
        idx b = S->arena[base + (size_t)i];
        int64_t o = S->min_off[b];
        if (o >= min_h) break; /* dominance: a gap below that some buffer would fill */
        if (o < min_o || (o == min_o && S->rank[b] < min_r)) continue; /* canonical order */
        size_t log_base = S->log_len, top = S->arena_len;
        int64_t id = S->tick + 1;
        int hatless = place(S, b, o), r = NOT_FOUND, apart = 0;
        int fits = hatless < 0 ? -1 : check(S, plo, phi, o);
        if (fits < 0) r = NO_MEMORY;
        else if (fits) {
            for (idx s = S->s_lo[b]; s + 1 < S->s_hi[b]; s++) apart |= S->cuts[s] == 0;
            if (apart) {
                r = split(S, plo, phi, base, m, o);
            } else {
                /* The child ordering: the unchanged keep their order; merge in the raised. */
                idx k = 0, u = 0, c = 0, t = 0;
                for (size_t q = log_base; q < S->log_len; q++) k += S->log[q].at >= 0;
                long long nb = push(S, (size_t)(m - 1 + k));
                if (nb < 0) r = NO_MEMORY;
                else {
                    idx *p = S->arena + base, *w = S->arena + nb, *tmp = w + (m - 1);
                    for (idx q = 0; q < m; q++) {
                        idx j = p[q];
                        if (j == b) continue;
                        if (S->mark[j] == id) tmp[t++] = j;
                        else w[k + u++] = j;
                    }
                    sort_order(S, tmp, t);
                    idx x = 0, y = k;
                    while (x < t || y < k + u)
                        w[c++] = (y >= k + u || (x < t && before(S, tmp[x], w[y]))) ? tmp[x++] : w[y++];
                    r = dfs(S, plo, phi, (size_t)nb, m - 1, o, S->rank[b]);
                }
            }
        }
        S->arena_len = top;
        unplace(S, b, log_base);
        if (r != NOT_FOUND) return r;
        if (hatless) break; /* nothing rests on b: other choices here cannot do better */
    }
    return NOT_FOUND;
}

static int by_pre(const void *a, const void *b);

/* Ranks the cnt buffers at v by the attempt's preorder: the widest lifetime (W), the
 * largest area (A) or the most crowded section, counting the unplaced only (T), first. */
static void rerank(solver *S, const idx *v, idx cnt) {
    static const char *orders[3] = {"WAT", "TAW", "TWA"};
    for (idx q = 0; q < cnt; q++) {
        idx i = v[q];
        int64_t most = 0;
        for (idx s = S->s_lo[i]; s < S->s_hi[i]; s++)
            if (S->total[s] > most) most = S->total[s];
        double width = (double)S->hi[i] - (double)S->lo[i];
        S->pre[q].i = i;
        for (int c = 0; c < 3; c++) {
            char key = orders[S->order][c];
            S->pre[q].k[c] = key == 'W' ? width : key == 'A' ? width * (double)S->size[i] : (double)most;
        }
    }
    qsort(S->pre, (size_t)cnt, sizeof(pre), by_pre);
    for (idx r = 0; r < cnt; r++) S->rank[S->pre[r].i] = r;
}

/* Solves apart each run of sections in [plo, phi) that no unplaced buffer joins,
 * taking the unplaced among the m buffers at arena[base...]; each part is ranked
 * afresh (its old ranks are kept and restored for the caller). */
static int split(solver *S, idx plo, idx phi, size_t base, idx m, int64_t min_o) {
    int r = FOUND;
    size_t top = S->arena_len;
    for (idx x = plo, y; x < phi && r == FOUND; x = y) {
        for (y = x + 1; y < phi && S->cuts[y - 1] > 0; y++) {}
        long long nb = push(S, 2 * (size_t)m);
        if (nb < 0) return NO_MEMORY;
        idx cnt = 0, *w = S->arena + nb, *old = w + m;
        for (idx q = 0; q < m; q++) {
            idx j = S->arena[base + (size_t)q];
            if (S->off[j] < 0 && S->s_lo[j] >= x && S->s_lo[j] < y) old[cnt] = S->rank[j], w[cnt++] = j;
        }
        rerank(S, w, cnt);
        sort_order(S, w, cnt);
        r = dfs(S, x, y, (size_t)nb, cnt, min_o, -1);
        w = S->arena + nb, old = w + m;
        for (idx q = 0; q < cnt; q++) S->rank[w[q]] = old[q];
        S->arena_len = top;
    }
    return r;
}

static int by_pre(const void *a, const void *b) {
    const pre *x = a, *y = b;
    for (int c = 0; c < 3; c++)
        if (x->k[c] != y->k[c]) return x->k[c] > y->k[c] ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

typedef struct { int64_t t; idx kind, i; } event; /* kind 0: end, 1: start */

static int by_event(const void *a, const void *b) {
    const event *x = a, *y = b;
    if (x->t != y->t) return x->t < y->t ? -1 : 1;
    if (x->kind != y->kind) return x->kind - y->kind;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* Sections, time overlaps (a sweep by lower: O(n log n + pairs)) and cuts.
 * Returns 0, or -1 when out of memory or past 2**31 entries. */
static int prepare(solver *S) {
    idx n = S->n, ns = 0, *first = S->rank, *cur = malloc(sizeof(idx) * ((size_t)n + 1));
    event *ev = malloc(sizeof(event) * (2 * (size_t)n + 1));
    if (!ev || !cur) {
        free(ev), free(cur);
        return -1;
    }
    for (idx i = 0; i < n; i++) {
        ev[2 * i] = (event){S->lo[i], 1, i};
        ev[2 * i + 1] = (event){S->hi[i], 0, i};
    }
    qsort(ev, 2 * (size_t)n, sizeof(event), by_event);
    int64_t last = 0;
    for (idx e = 0, k = 0; e < 2 * n; e++) { /* a section closes at each end time */
        if (ev[e].kind == 1) S->s_lo[ev[e].i] = ns, first[k++] = ev[e].i;
        else {
            if (ns == 0 || last < ev[e].t) ns++, last = ev[e].t;
            S->s_hi[ev[e].i] = ns;
        }
    }
    free(ev);
    S->ns = ns;
    size_t nsec = (size_t)ns + 1, members = 0, pairs = 0;
    S->sec_at = calloc(nsec, sizeof(idx)), S->ov_at = calloc((size_t)n + 1, sizeof(idx));
    S->floor = calloc(nsec, sizeof(int64_t)), S->total = calloc(nsec, sizeof(int64_t));
    S->cuts = calloc(nsec, sizeof(idx)), S->wit = calloc(nsec, sizeof(idx));
    if (!S->sec_at || !S->ov_at || !S->floor || !S->total || !S->cuts || !S->wit) goto fail;
    for (idx a = 0; a < n; a++) {
        idx i = first[a];
        members += (size_t)(S->s_hi[i] - S->s_lo[i]);
        for (idx s = S->s_lo[i]; s < S->s_hi[i]; s++) {
            S->sec_at[s + 1]++;
            S->total[s] += S->size[i];
            if (s + 1 < S->s_hi[i]) S->cuts[s]++;
        }
        for (idx b = a + 1; b < n && S->lo[first[b]] < S->hi[i]; b++)
            S->ov_at[i + 1]++, S->ov_at[first[b] + 1]++, pairs += 2;
    }
    if (members > INT32_MAX || pairs > INT32_MAX) goto fail;
    S->sec_buf = malloc(sizeof(idx) * (members + 1)), S->ov_buf = malloc(sizeof(idx) * (pairs + 1));
    if (!S->sec_buf || !S->ov_buf) goto fail;
    for (idx s = 0; s < ns; s++) S->sec_at[s + 1] += S->sec_at[s];
    for (idx i = 0; i < n; i++) S->ov_at[i + 1] += S->ov_at[i];
    memcpy(S->wit, S->sec_at, sizeof(idx) * (size_t)ns); /* cursors, for now */
    memcpy(cur, S->ov_at, sizeof(idx) * (size_t)n);
    for (idx a = 0; a < n; a++) {
        idx i = first[a];
        for (idx s = S->s_lo[i]; s < S->s_hi[i]; s++) S->sec_buf[S->wit[s]++] = i;
        for (idx b = a + 1; b < n && S->lo[first[b]] < S->hi[i]; b++)
            S->ov_buf[cur[i]++] = first[b], S->ov_buf[cur[first[b]]++] = i;
    }
    for (idx s = 0; s < ns; s++) S->wit[s] = S->sec_buf[S->sec_at[s]];
    free(cur);
    return 0;
fail:
    free(cur);
    return -1;
}

/* The whole search: round robin over the preorders with a doubling node limit. */
static int solve(solver *S, double limit_s) {
    S->deadline = now() + limit_s;
    if (prepare(S)) return NO_MEMORY;
    for (idx s = 0; s < S->ns; s++)
        if (S->total[s] > S->cap) return NOT_FOUND;
    long long base = push(S, (size_t)S->n);
    if (base < 0) return NO_MEMORY;
    for (idx i = 0; i < S->n; i++) S->arena[base + i] = i, S->off[i] = -1;
    for (int64_t limit = S->n > 0 ? S->n : 1;;) {
        limit = limit > INT64_MAX / 2 ? INT64_MAX : 2 * limit;
        for (int h = 0; h < 3; h++) {
            S->order = h;
            S->nodes_left = limit;
            int r = split(S, 0, S->ns, (size_t)base, S->n, 0);
            if (r != ABORTED) return r;
        }
    }
}

typedef struct { solver *S; double limit_s; int r; } job;

static void *run(void *p) {
    job *j = p;
    j->r = solve(j->S, j->limit_s);
    return NULL;
}

/* Runs the search on a thread whose stack fits its depth (a frame or two per buffer). */
static int solve_on_big_stack(solver *S, double limit_s) {
    job j = {S, limit_s, NO_MEMORY};
    pthread_attr_t attr;
    pthread_t t;
    int started = 0;
    if (pthread_attr_init(&attr) == 0) {
        started = pthread_attr_setstacksize(&attr, ((size_t)S->n + 256) * 1024) == 0 &&
                  pthread_create(&t, &attr, run, &j) == 0;
        pthread_attr_destroy(&attr);
    }
    if (started) pthread_join(t, NULL);
    else run(&j);
    return j.r;
}

static void release(solver *S) {
    void *all[] = {S->lo, S->hi, S->size, S->s_lo, S->s_hi, S->sec_at, S->sec_buf, S->ov_at,
                   S->ov_buf, S->rank, S->pre, S->wit, S->min_off, S->off, S->sol, S->floor,
                   S->total, S->mark, S->cuts, S->log, S->arena};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

static int64_t *copy_int64(Py_buffer *v, idx n) {
    int64_t *p = malloc(sizeof(int64_t) * ((size_t)n + 1));
    if (p && n) memcpy(p, v->buf, sizeof(int64_t) * (size_t)n);
    return p;
}

static PyObject *search(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer lb, ub, sb;
    long long cap;
    double limit_s;
    if (!PyArg_ParseTuple(args, "y*y*y*Ld:search", &lb, &ub, &sb, &cap, &limit_s)) return NULL;
    PyObject *result = NULL;
    solver S;
    memset(&S, 0, sizeof S);
    Py_ssize_t len = lb.len;
    if (len % 8 || ub.len != len || sb.len != len) {
        PyErr_SetString(PyExc_ValueError, "lowers, uppers and sizes must be int64 arrays of one length");
        goto done;
    }
    if (len / 8 > INT32_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "too many buffers");
        goto done;
    }
    if (cap < 0 || !(limit_s >= 0)) {
        PyErr_SetString(PyExc_ValueError, "capacity and time limit must be non-negative");
        goto done;
    }
    S.n = (idx)(len / 8);
    S.cap = cap;
    size_t n1 = (size_t)S.n + 1;
    S.lo = copy_int64(&lb, S.n), S.hi = copy_int64(&ub, S.n), S.size = copy_int64(&sb, S.n);
    S.s_lo = calloc(n1, sizeof(idx)), S.s_hi = calloc(n1, sizeof(idx));
    S.rank = calloc(n1, sizeof(idx)), S.pre = calloc(n1, sizeof(pre));
    S.min_off = calloc(n1, sizeof(int64_t)), S.off = calloc(n1, sizeof(int64_t));
    S.sol = calloc(n1, sizeof(int64_t)), S.mark = calloc(n1, sizeof(int64_t));
    if (!S.lo || !S.hi || !S.size || !S.s_lo || !S.s_hi || !S.rank || !S.pre || !S.min_off || !S.off ||
        !S.sol || !S.mark) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t sum = 0;
    for (idx i = 0; i < S.n; i++) {
        if (S.size[i] < 1 || S.size[i] > ((int64_t)1 << 62) - sum) {
            PyErr_Format(PyExc_ValueError, "buffer %d: size out of range [1, 2**62 in all]", (int)i);
            goto done;
        }
        if (S.lo[i] >= S.hi[i]) {
            PyErr_Format(PyExc_ValueError, "buffer %d: empty lifetime", (int)i);
            goto done;
        }
        sum += S.size[i];
    }
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = solve_on_big_stack(&S, limit_s);
    Py_END_ALLOW_THREADS
    if (r == NO_MEMORY) {
        PyErr_NoMemory();
        goto done;
    }
    if (r != FOUND) {
        result = Py_BuildValue("(sO)", r == NOT_FOUND ? "infeasible" : "timeout", Py_None);
        goto done;
    }
    PyObject *offsets = PyTuple_New(S.n);
    for (idx i = 0; offsets && i < S.n; i++) {
        PyObject *v = PyLong_FromLongLong(S.sol[i]);
        if (!v) Py_CLEAR(offsets);
        else PyTuple_SET_ITEM(offsets, i, v);
    }
    if (offsets) result = Py_BuildValue("(sN)", "feasible", offsets);
done:
    release(&S);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&ub);
    PyBuffer_Release(&sb);
    return result;
}

static PyMethodDef methods[] = {
    {"search", search, METH_VARARGS,
     "search(lowers, uppers, sizes, capacity, time_limit_s) -> (status, offsets | None)\n\n"
     "lowers, uppers, sizes: native int64 arrays (any contiguous buffer); units, not bytes.\n"
     "status is 'feasible' (with offsets), 'infeasible' or 'timeout'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_exact", "Exact search for dynamic storage allocation.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__exact(void) { return PyModule_Create(&module); }
