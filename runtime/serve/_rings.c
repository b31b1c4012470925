/*
 * zlc.runtime.serve._rings -- single-producer/single-consumer rings between ingress and the kernel.
 *
 * The ring operations live here, in C with C11 <stdatomic.h>, because Python has no memory
 * fences: a producer must publish a slot's contents before the counter that makes it visible
 * (release), and a consumer must read the counter before the slot (acquire). The Python side
 * (runtime/serve/rings.py) only wraps these in dataclasses and blocking helpers. docs/rings.md has the
 * same layout with the reasoning behind it.
 *
 * Why one module: it is one extension (one source in pyproject's ext-modules); the layout checks,
 * the counters' protocol and both rings' methods share static helpers, which a split would turn
 * into an exported internal header for no reader's benefit.
 *
 * REGION LAYOUT (all integers little-endian, host byte order; offsets in bytes from the region's
 * start, which must be 8-byte aligned -- mmap / SharedMemory are page aligned):
 *
 *   0x000  header (128 bytes)
 *          0x00 u64 magic          0x53474E4952434C5A ("ZLCRINGS"); stored last, with release
 *          0x08 u32 version        1
 *          0x0C u32 header_size    128
 *          0x10 u64 region_size    bytes the layout spans (the buffer may be larger)
 *          0x18 u32 n_rings        2
 *          0x1C u32 reserved       0
 *          0x20 ring descriptor 0: the request ring (32 bytes)
 *          0x40 ring descriptor 1: the result ring (32 bytes)
 *          0x60 reserved (32 bytes of 0)
 *          ring descriptor: +0x00 u32 kind (1 request, 2 result)  +0x04 u32 slot_size
 *                           +0x08 u32 capacity (slots, a power of two, <= 2^30)
 *                           +0x0C u32 chunk_tokens (request ring: tokens per slot; result ring: 0)
 *                           +0x10 u64 control_offset  +0x18 u64 slots_offset
 *   0x080  request ring control block (128 bytes)
 *          +0x00 u64 head   (own cache line; written only by the consumer)
 *          +0x40 u64 tail   (own cache line; written only by the producer)
 *   0x100  result ring control block (128 bytes, same shape)
 *   0x180  request slots: capacity x (64 + 4 * chunk_tokens) bytes
 *   ...    result slots:  capacity x 32 bytes, at the next 64-byte boundary
 *   region_size = end of the result slots, rounded up to 64.
 *
 *   head and tail are monotonically increasing u64 slot counters (they never wrap in practice;
 *   the arithmetic is modulo 2^64 anyway). Slot of counter c: c & (capacity - 1).
 *   Slots in use: tail - head (0 .. capacity). Empty: head == tail. Full: tail - head == capacity.
 *
 * REQUEST SLOT (64 + 4 * chunk_tokens bytes; chunk_tokens a multiple of 16, default 4096):
 *   0x00 u64 request_id   0x08 u32 flags   0x0C u32 max_tokens   0x10 f32 temperature
 *   0x14 f32 top_p        0x18 u64 seed    0x20 u32 n_tokens (in this slot)
 *   0x24 u32 total_tokens (the whole prompt)   0x28 u32 chunk_index   0x2C u32 top_k (0: off)
 *   0x30 f32 frequency_penalty   0x34 f32 presence_penalty   0x38 u32 top_logprobs   0x3C reserved (0)
 *   0x40 u32 tokens[chunk_tokens]
 *   A prompt longer than chunk_tokens is split into ceil(total / chunk_tokens) consecutive slots
 *   ("chunks"); every chunk repeats the header fields, and every chunk but the last has
 *   flags bit 31 (CONTINUE) set. All chunks of a request are published by one tail store, so a
 *   consumer sees a request whole or not at all. A request needing more slots than the ring has
 *   is refused with ValueError (it could never fit); an empty prompt takes one slot.
 *   flags bits 0..30 belong to the serving layer; bit 31 is the ring's.
 *
 * RESULT SLOT (32 bytes):
 *   0x00 u64 request_id   0x08 u32 token   0x0C u32 flags   0x10 u64 t_ns   0x18 f32 logprob
 *   0x1C u32 reserved (0)
 *   t_ns: CLOCK_MONOTONIC nanoseconds (time.monotonic_ns()); a push with t_ns = 0 stamps it.
 *
 * PROTOCOL (the only synchronization; slots themselves are plain memory):
 *   push: tail = load(tail, relaxed)            -- the producer's own counter
 *         head = load(head, acquire)            -- pairs with the consumer's release of head:
 *                                                  its reads of the freed slots are done
 *         if tail - head + need > capacity: return False (nothing written: backpressure)
 *         write the slot(s); store(tail, tail + need, release)
 *   pop:  head = load(head, relaxed)            -- the consumer's own counter
 *         tail = load(tail, acquire)            -- pairs with the producer's release of tail:
 *                                                  the slot contents are visible
 *         if head == tail: return None
 *         copy the slot(s) out; store(head, head + n, release)
 *   The producer keeps the last head it acquired (the consumer the last tail) in the ring object
 *   and reloads it only when it does not show enough room (entries): the counters only grow, so
 *   a stale copy errs on the safe side. Batch variants publish once per batch.
 *
 * Everything in the header is validated on attach (the layout is recomputed from the capacities
 * and must match field by field) and the counters on every operation (tail - head <= capacity),
 * so a malformed or corrupted region raises ValueError instead of reading out of bounds.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#if !defined(ATOMIC_LLONG_LOCK_FREE) || ATOMIC_LLONG_LOCK_FREE != 2
#error "zlc rings need always-lock-free 64-bit atomics (they are shared between processes)"
#endif
#if ULONG_MAX == UINT64_MAX && (!defined(ATOMIC_LONG_LOCK_FREE) || ATOMIC_LONG_LOCK_FREE != 2)
#error "zlc rings need always-lock-free 64-bit atomics (uint64_t is unsigned long here)"
#endif
_Static_assert(sizeof(_Atomic uint64_t) == sizeof(uint64_t), "atomic u64 must be a plain u64 in memory");
_Static_assert(sizeof(float) == 4, "f32 fields");

#define ZR_MAGIC 0x53474E4952434C5AULL /* "ZLCRINGS" little-endian */
#define ZR_VERSION 1u
#define ZR_HEADER_SIZE 128u
#define ZR_CONTROL_SIZE 128u
#define ZR_HEAD_OFFSET 0u
#define ZR_TAIL_OFFSET 64u
#define ZR_N_RINGS 2u
#define ZR_KIND_REQUEST 1u
#define ZR_KIND_RESULT 2u
#define ZR_REQ_HEADER_SIZE 64u
#define ZR_RES_SLOT_SIZE 32u
#define ZR_MAX_CAPACITY (1u << 30)
#define ZR_DEFAULT_CHUNK_TOKENS 4096u
#define ZR_MAX_CHUNK_TOKENS (1u << 20)
#define ZR_CHUNK_ALIGN 16u
#define ZR_REQ_CONTINUE 0x80000000u

/* The helpers both rings' push and push_many share are inlined into each, so every entry point
   gets a copy specialized for its ring and call shape (GCC does not do it unasked: a result push
   measured ~5% slower through the generic routine). */
#if defined(__GNUC__) || defined(__clang__)
#define ZR_INLINE static inline __attribute__((always_inline))
#else
#define ZR_INLINE static inline
#endif

typedef struct {
    uint32_t kind;
    uint32_t slot_size;
    uint32_t capacity;
    uint32_t chunk_tokens;
    uint64_t control_offset;
    uint64_t slots_offset;
} zr_desc;

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t header_size;
    uint64_t region_size;
    uint32_t n_rings;
    uint32_t reserved0;
    zr_desc rings[2];
    uint8_t reserved1[32];
} zr_header;

typedef struct {
    uint64_t request_id;
    uint32_t flags;
    uint32_t max_tokens;
    float temperature;
    float top_p;
    uint64_t seed;
    uint32_t n_tokens;
    uint32_t total_tokens;
    uint32_t chunk_index;
    uint32_t top_k;
    float frequency_penalty;
    float presence_penalty;
    uint32_t top_logprobs;
    uint32_t reserved;
    /* uint32_t tokens[chunk_tokens] follow at 0x40 */
} zr_req_slot;

typedef struct {
    uint64_t request_id;
    uint32_t token;
    uint32_t flags;
    uint64_t t_ns;
    float logprob;
    uint32_t reserved;
} zr_res_slot;

_Static_assert(sizeof(zr_desc) == 32, "descriptor layout");
_Static_assert(offsetof(zr_desc, control_offset) == 0x10, "descriptor layout");
_Static_assert(sizeof(zr_header) == ZR_HEADER_SIZE, "header layout");
_Static_assert(offsetof(zr_header, region_size) == 0x10, "header layout");
_Static_assert(offsetof(zr_header, n_rings) == 0x18, "header layout");
_Static_assert(offsetof(zr_header, rings) == 0x20, "header layout");
_Static_assert(offsetof(zr_header, reserved1) == 0x60, "header layout");
_Static_assert(sizeof(zr_req_slot) == ZR_REQ_HEADER_SIZE, "request slot layout");
_Static_assert(offsetof(zr_req_slot, temperature) == 0x10, "request slot layout");
_Static_assert(offsetof(zr_req_slot, seed) == 0x18, "request slot layout");
_Static_assert(offsetof(zr_req_slot, n_tokens) == 0x20, "request slot layout");
_Static_assert(offsetof(zr_req_slot, chunk_index) == 0x28, "request slot layout");
_Static_assert(offsetof(zr_req_slot, top_k) == 0x2C, "request slot layout");
_Static_assert(offsetof(zr_req_slot, top_logprobs) == 0x38, "request slot layout");
_Static_assert(sizeof(zr_res_slot) == ZR_RES_SLOT_SIZE, "result slot layout");
_Static_assert(offsetof(zr_res_slot, t_ns) == 0x10, "result slot layout");
_Static_assert(offsetof(zr_res_slot, logprob) == 0x18, "result slot layout");

/* ------------------------------------------------------------------------------------------ */
/* Layout                                                                                      */

typedef struct {
    uint64_t req_control, res_control, req_slots, res_slots, region_size;
    uint32_t req_slot_size;
} zr_layout;

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

static int is_pow2(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

/* Checks the parameters (ValueError naming the bad one) and fills the canonical layout. */
static int compute_layout(uint64_t req_cap, uint64_t res_cap, uint64_t chunk, zr_layout *L, const char *prefix) {
    if (!is_pow2(req_cap) || req_cap > ZR_MAX_CAPACITY) {
        PyErr_Format(PyExc_ValueError, "%srequest ring capacity must be a power of two in [1, 2**30], got %llu",
                     prefix, (unsigned long long)req_cap);
        return -1;
    }
    if (!is_pow2(res_cap) || res_cap > ZR_MAX_CAPACITY) {
        PyErr_Format(PyExc_ValueError, "%sresult ring capacity must be a power of two in [1, 2**30], got %llu",
                     prefix, (unsigned long long)res_cap);
        return -1;
    }
    if (chunk == 0 || chunk > ZR_MAX_CHUNK_TOKENS || chunk % ZR_CHUNK_ALIGN != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%schunk_tokens (prompt tokens per request slot) must be a multiple of %u in [%u, %u], got %llu",
                     prefix, ZR_CHUNK_ALIGN, ZR_CHUNK_ALIGN, ZR_MAX_CHUNK_TOKENS, (unsigned long long)chunk);
        return -1;
    }
    L->req_slot_size = (uint32_t)(ZR_REQ_HEADER_SIZE + 4 * chunk);
    L->req_control = ZR_HEADER_SIZE;
    L->res_control = L->req_control + ZR_CONTROL_SIZE;
    L->req_slots = L->res_control + ZR_CONTROL_SIZE;
    /* <= 2^30 slots of <= 2^22 + 64 bytes: no overflow in 64 bits */
    L->res_slots = round_up(L->req_slots + req_cap * L->req_slot_size, 64);
    L->region_size = round_up(L->res_slots + res_cap * ZR_RES_SLOT_SIZE, 64);
    return 0;
}

static uint64_t load_magic(const uint8_t *base) {
    return atomic_load_explicit((_Atomic uint64_t *)(void *)base, memory_order_acquire);
}

/* Validates a region (ValueError with the reason on any mismatch); fills *L and the parameters. */
static int validate_region(const uint8_t *base, Py_ssize_t len, zr_layout *L, uint32_t *req_cap,
                           uint32_t *res_cap, uint32_t *chunk) {
    if ((uintptr_t)base % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "ring region must start at an 8-byte aligned address "
                                          "(use mmap / SharedMemory, or an aligned slice)");
        return -1;
    }
    if (len < (Py_ssize_t)ZR_HEADER_SIZE) {
        PyErr_Format(PyExc_ValueError, "ring region too small: %zd bytes, the header alone takes %u", len,
                     ZR_HEADER_SIZE);
        return -1;
    }
    uint64_t magic = load_magic(base); /* acquire: pairs with init_region's release */
    const zr_header *h = (const zr_header *)(const void *)base;
    if (magic != ZR_MAGIC) {
        char msg[160]; /* PyErr_Format has no zero-padded hex */
        snprintf(msg, sizeof msg,
                 "bad ring region magic 0x%016llx (expected 0x%016llx \"ZLCRINGS\"): "
                 "not a zlc ring region, or not initialized yet",
                 (unsigned long long)magic, (unsigned long long)ZR_MAGIC);
        PyErr_SetString(PyExc_ValueError, msg);
        return -1;
    }
    if (h->version != ZR_VERSION) {
        PyErr_Format(PyExc_ValueError, "unsupported ring region version %u (this build reads version %u)",
                     h->version, ZR_VERSION);
        return -1;
    }
    if (h->header_size != ZR_HEADER_SIZE || h->n_rings != ZR_N_RINGS) {
        PyErr_Format(PyExc_ValueError, "malformed ring region header: header_size %u (expected %u), n_rings %u (expected %u)",
                     h->header_size, ZR_HEADER_SIZE, h->n_rings, ZR_N_RINGS);
        return -1;
    }
    const zr_desc *rq = &h->rings[0], *rs = &h->rings[1];
    if (rq->kind != ZR_KIND_REQUEST || rs->kind != ZR_KIND_RESULT) {
        PyErr_Format(PyExc_ValueError, "malformed ring region: ring kinds %u, %u (expected %u request, %u result)",
                     rq->kind, rs->kind, ZR_KIND_REQUEST, ZR_KIND_RESULT);
        return -1;
    }
    if (rs->chunk_tokens != 0) {
        PyErr_Format(PyExc_ValueError, "malformed ring region: result ring chunk_tokens %u (expected 0)",
                     rs->chunk_tokens);
        return -1;
    }
    if (compute_layout(rq->capacity, rs->capacity, rq->chunk_tokens, L, "malformed ring region header: ") < 0)
        return -1;
#define ZR_EXPECT(field, got, want)                                                                           \
    do {                                                                                                      \
        if ((uint64_t)(got) != (uint64_t)(want)) {                                                            \
            PyErr_Format(PyExc_ValueError, "malformed ring region header: %s is %llu, expected %llu", field, \
                         (unsigned long long)(got), (unsigned long long)(want));                              \
            return -1;                                                                                        \
        }                                                                                                     \
    } while (0)
    ZR_EXPECT("request slot_size", rq->slot_size, L->req_slot_size);
    ZR_EXPECT("result slot_size", rs->slot_size, ZR_RES_SLOT_SIZE);
    ZR_EXPECT("request control_offset", rq->control_offset, L->req_control);
    ZR_EXPECT("result control_offset", rs->control_offset, L->res_control);
    ZR_EXPECT("request slots_offset", rq->slots_offset, L->req_slots);
    ZR_EXPECT("result slots_offset", rs->slots_offset, L->res_slots);
    ZR_EXPECT("region_size", h->region_size, L->region_size);
#undef ZR_EXPECT
    if ((uint64_t)len < L->region_size) {
        PyErr_Format(PyExc_ValueError,
                     "ring region buffer is %zd bytes but its header describes %llu (truncated mapping?)", len,
                     (unsigned long long)L->region_size);
        return -1;
    }
    *req_cap = rq->capacity;
    *res_cap = rs->capacity;
    *chunk = rq->chunk_tokens;
    return 0;
}

/* A writable, contiguous buffer over the region (ValueError if read-only or not contiguous). */
static int get_region_buffer(PyObject *obj, Py_buffer *view) {
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "ring region must be a buffer (mmap, SharedMemory.buf, bytearray), not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "ring region must be a C-contiguous buffer (this %.100s is not)",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (view->readonly) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "ring region must be a writable buffer (this %.100s is read-only)",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Argument helpers                                                                            */

/* An unsigned int field (anything with __index__: int, numpy integers); ValueError if out of range. */
static int as_uint(PyObject *o, const char *name, uint64_t max, const char *range, uint64_t *out) {
    PyObject *i = PyNumber_Index(o);
    if (i == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(i);
    Py_DECREF(i);
    if ((v == (unsigned long long)-1 && PyErr_Occurred()) || v > max) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be in %s, got %R", name, range, o);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static int as_u64(PyObject *o, const char *name, uint64_t *out) {
    return as_uint(o, name, UINT64_MAX, "[0, 2**64)", out);
}

static int as_u32(PyObject *o, const char *name, uint32_t *out) {
    uint64_t v;
    if (as_uint(o, name, UINT32_MAX, "[0, 2**32)", &v) < 0)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

static int as_f32(PyObject *o, const char *name, float *out) {
    double d = PyFloat_AsDouble(o);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a float, not %.100s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = (float)d;
    return 0;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------------------------------ */
/* Ring objects                                                                                */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;               /* view is held (cleared by release()) */
    _Atomic uint64_t *head; /* consumer-owned counter */
    _Atomic uint64_t *tail; /* producer-owned counter */
    uint8_t *slots;
    uint64_t mask;
    uint32_t capacity;
    uint32_t slot_size;
    uint32_t chunk_tokens; /* request ring only */
    uint64_t cached_head;  /* producer side: the last head it acquired */
    uint64_t cached_tail;  /* consumer side: the last tail it acquired */
} RingObject;

static PyTypeObject RequestRingType;
static PyTypeObject ResultRingType;

static int ring_init_common(RingObject *self, PyObject *buffer, int which) {
    if (self->held) {
        PyErr_SetString(PyExc_RuntimeError, "ring already initialized");
        return -1;
    }
    if (get_region_buffer(buffer, &self->view) < 0)
        return -1;
    zr_layout L;
    uint32_t req_cap, res_cap, chunk;
    uint8_t *base = (uint8_t *)self->view.buf;
    if (validate_region(base, self->view.len, &L, &req_cap, &res_cap, &chunk) < 0) {
        PyBuffer_Release(&self->view);
        return -1;
    }
    uint64_t control = which == 0 ? L.req_control : L.res_control;
    self->head = (_Atomic uint64_t *)(void *)(base + control + ZR_HEAD_OFFSET);
    self->tail = (_Atomic uint64_t *)(void *)(base + control + ZR_TAIL_OFFSET);
    self->slots = base + (which == 0 ? L.req_slots : L.res_slots);
    self->capacity = which == 0 ? req_cap : res_cap;
    self->mask = (uint64_t)self->capacity - 1;
    self->slot_size = which == 0 ? L.req_slot_size : ZR_RES_SLOT_SIZE;
    self->chunk_tokens = which == 0 ? chunk : 0;
    self->cached_head = atomic_load_explicit(self->head, memory_order_acquire);
    self->cached_tail = atomic_load_explicit(self->tail, memory_order_acquire);
    self->held = 1;
    return 0;
}

static int RequestRing_init(RingObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"region", NULL};
    PyObject *buffer;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:RequestRing", kwlist, &buffer))
        return -1;
    return ring_init_common(self, buffer, 0);
}

static int ResultRing_init(RingObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"region", NULL};
    PyObject *buffer;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:ResultRing", kwlist, &buffer))
        return -1;
    return ring_init_common(self, buffer, 1);
}

static void Ring_dealloc(RingObject *self) {
    if (self->held) {
        self->held = 0;
        PyBuffer_Release(&self->view);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_held(RingObject *self) {
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "ring is released (its region was closed)");
        return -1;
    }
    return 0;
}

static PyObject *corrupt(RingObject *self, const char *what, uint64_t head, uint64_t tail) {
    PyErr_Format(PyExc_ValueError,
                 "%s ring corrupt: %s (head %llu, tail %llu, capacity %u); was it written by something "
                 "other than one producer and one consumer?",
                 Py_TYPE(self) == &RequestRingType ? "request" : "result", what, (unsigned long long)head,
                 (unsigned long long)tail, self->capacity);
    return NULL;
}

/* Free slots as the producer sees them (reloading head if the cached copy does not show `need`);
   -1 (ValueError set) if the counters are inconsistent. */
static int64_t producer_room(RingObject *self, uint64_t tail, uint64_t need) {
    uint64_t used = tail - self->cached_head;
    if (used > self->capacity || self->capacity - used < need) {
        self->cached_head = atomic_load_explicit(self->head, memory_order_acquire);
        used = tail - self->cached_head;
        if (used > self->capacity) {
            corrupt(self, "tail - head exceeds the capacity", self->cached_head, tail);
            return -1;
        }
    }
    return (int64_t)(self->capacity - used);
}

/* Slots published as the consumer sees them (reloading tail if the cached copy shows fewer than
   `want`); -1 (ValueError set) if the counters are inconsistent. */
static int64_t consumer_avail(RingObject *self, uint64_t head, uint64_t want) {
    uint64_t avail = self->cached_tail - head;
    if (avail > self->capacity || avail < want) {
        self->cached_tail = atomic_load_explicit(self->tail, memory_order_acquire);
        avail = self->cached_tail - head;
        if (avail > self->capacity) {
            corrupt(self, "tail - head exceeds the capacity", head, self->cached_tail);
            return -1;
        }
    }
    return (int64_t)avail;
}

static PyObject *Ring_occupancy(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_held(self) < 0)
        return NULL;
    uint64_t head = atomic_load_explicit(self->head, memory_order_acquire);
    uint64_t tail = atomic_load_explicit(self->tail, memory_order_acquire);
    uint64_t used = tail - head;
    if (used > self->capacity) /* a racing pair of loads can see head past tail; clamp */
        used = (int64_t)used < 0 ? 0 : self->capacity;
    return PyLong_FromUnsignedLongLong(used);
}

static PyObject *Ring_counters(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_held(self) < 0)
        return NULL;
    uint64_t head = atomic_load_explicit(self->head, memory_order_acquire);
    uint64_t tail = atomic_load_explicit(self->tail, memory_order_acquire);
    return Py_BuildValue("(KK)", (unsigned long long)head, (unsigned long long)tail);
}

static PyObject *Ring_release(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->held) {
        self->held = 0;
        PyBuffer_Release(&self->view);
    }
    Py_RETURN_NONE;
}

static PyObject *Ring_enter(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    return Py_NewRef(self);
}

static PyObject *Ring_exit(RingObject *self, PyObject *Py_UNUSED(args)) {
    return Ring_release(self, NULL);
}

static PyObject *Ring_get_capacity(RingObject *self, void *Py_UNUSED(c)) {
    return PyLong_FromUnsignedLong(self->capacity);
}

static PyObject *Ring_get_released(RingObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong(!self->held);
}

static PyObject *Ring_get_chunk_tokens(RingObject *self, void *Py_UNUSED(c)) {
    return PyLong_FromUnsignedLong(self->chunk_tokens);
}

/* ---- request ring ---- */

typedef struct {
    uint64_t request_id, seed;
    uint32_t flags, max_tokens, top_k, top_logprobs;
    float temperature, top_p, frequency_penalty, presence_penalty;
    PyObject *tokens; /* borrowed */
} req_args;

/* A token source: a C-contiguous buffer of 4-byte unsigned ints (array('I'), numpy uint32), or
   any sequence of ints. */
typedef struct {
    Py_buffer view;
    int is_view;
    PyObject *seq; /* PySequence_Fast result, when not a view */
    Py_ssize_t n;
} tok_src;

static int is_u32_format(const char *f) {
    if (f == NULL)
        return 0;
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    return (f[0] == 'I' || (f[0] == 'L' && sizeof(unsigned long) == 4)) && f[1] == '\0';
}

static int tok_open(PyObject *tokens, tok_src *t) {
    t->is_view = 0;
    t->seq = NULL;
    if (PyObject_CheckBuffer(tokens) && !PyBytes_Check(tokens) && !PyByteArray_Check(tokens)) {
        if (PyObject_GetBuffer(tokens, &t->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
            if (t->view.itemsize == 4 && t->view.ndim <= 1 && is_u32_format(t->view.format)) {
                t->is_view = 1;
                t->n = t->view.len / 4;
                return 0;
            }
            PyBuffer_Release(&t->view);
        } else {
            PyErr_Clear();
        }
    }
    if (PyBytes_Check(tokens) || PyByteArray_Check(tokens) || PyUnicode_Check(tokens)) {
        PyErr_Format(PyExc_TypeError, "tokens must be a sequence of ints or a uint32 array, not %.100s",
                     Py_TYPE(tokens)->tp_name);
        return -1;
    }
    t->seq = PySequence_Fast(tokens, "tokens must be a sequence of ints or a uint32 array");
    if (t->seq == NULL)
        return -1;
    t->n = PySequence_Fast_GET_SIZE(t->seq);
    return 0;
}

static void tok_close(tok_src *t) {
    if (t->is_view)
        PyBuffer_Release(&t->view);
    Py_XDECREF(t->seq);
    t->is_view = 0;
    t->seq = NULL;
}

/* Copies tokens [start, start + n) into dst (converting and range-checking a Python sequence). */
static int tok_copy(tok_src *t, Py_ssize_t start, Py_ssize_t n, uint32_t *dst) {
    if (t->is_view) {
        memcpy(dst, (const uint32_t *)t->view.buf + start, (size_t)n * 4);
        return 0;
    }
    PyObject **items = PySequence_Fast_ITEMS(t->seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = items[start + i];
        if (PyLong_CheckExact(o)) { /* the common case, without the __index__ round trip */
            unsigned long v = PyLong_AsUnsignedLong(o);
            if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > UINT32_MAX) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "token %zd must be in [0, 2**32), got %R", start + i, o);
                return -1;
            }
            dst[i] = (uint32_t)v;
        } else {
            uint64_t v;
            char name[48];
            snprintf(name, sizeof name, "token %zd", start + i);
            if (as_uint(o, name, UINT32_MAX, "[0, 2**32)", &v) < 0)
                return -1;
            dst[i] = (uint32_t)v;
        }
    }
    return 0;
}

static uint64_t req_slots_needed(RingObject *self, Py_ssize_t n) {
    return n == 0 ? 1 : ((uint64_t)n + self->chunk_tokens - 1) / self->chunk_tokens;
}

static int parse_req(PyObject *const *a, Py_ssize_t nargs, req_args *r) {
    if (nargs != 7 && nargs != 11) {
        PyErr_Format(PyExc_TypeError,
                     "a request is (request_id, tokens, max_tokens, temperature, top_p, seed, flags[, top_k, "
                     "frequency_penalty, presence_penalty, top_logprobs]): expected 7 or 11 fields, got %zd",
                     nargs);
        return -1;
    }
    r->top_k = r->top_logprobs = 0;
    r->frequency_penalty = r->presence_penalty = 0.0f;
    if (as_u64(a[0], "request_id", &r->request_id) < 0 || as_u32(a[2], "max_tokens", &r->max_tokens) < 0 ||
        as_f32(a[3], "temperature", &r->temperature) < 0 || as_f32(a[4], "top_p", &r->top_p) < 0 ||
        as_u64(a[5], "seed", &r->seed) < 0 || as_u32(a[6], "flags", &r->flags) < 0)
        return -1;
    if (nargs == 11 &&
        (as_u32(a[7], "top_k", &r->top_k) < 0 || as_f32(a[8], "frequency_penalty", &r->frequency_penalty) < 0 ||
         as_f32(a[9], "presence_penalty", &r->presence_penalty) < 0 ||
         as_u32(a[10], "top_logprobs", &r->top_logprobs) < 0))
        return -1;
    if (r->flags & ZR_REQ_CONTINUE) {
        PyErr_SetString(PyExc_ValueError, "request flags bit 31 (CONTINUE) is reserved for the ring's chunking");
        return -1;
    }
    r->tokens = a[1];
    return 0;
}

/* Writes one request into the unpublished slots from counter `pos` on (`tail` is the published
   tail). Returns the number of slots it took, 0 if the ring lacks room for it (nothing written),
   -1 on error (nothing published). */
static int64_t req_write(RingObject *self, uint64_t tail, uint64_t pos, const req_args *r) {
    tok_src t;
    if (tok_open(r->tokens, &t) < 0)
        return -1;
    uint64_t need = req_slots_needed(self, t.n);
    if (need > self->capacity) {
        PyErr_Format(PyExc_ValueError,
                     "prompt of %zd tokens needs %llu request slots of %u tokens, but the request ring has "
                     "only %u slots (longest prompt: %llu tokens)",
                     t.n, (unsigned long long)need, self->chunk_tokens, self->capacity,
                     (unsigned long long)self->capacity * self->chunk_tokens);
        tok_close(&t);
        return -1;
    }
    if (t.n > (Py_ssize_t)UINT32_MAX) { /* total_tokens is a u32 (capacity * chunk_tokens may exceed it) */
        PyErr_SetString(PyExc_ValueError, "prompt longer than 2**32 - 1 tokens");
        tok_close(&t);
        return -1;
    }
    int64_t room = producer_room(self, tail, pos - tail + need);
    if (room < 0 || (uint64_t)room < pos - tail + need) {
        tok_close(&t);
        return room < 0 ? -1 : 0;
    }
    Py_ssize_t done = 0;
    for (uint64_t c = 0; c < need; c++) {
        uint8_t *slot = self->slots + ((pos + c) & self->mask) * self->slot_size;
        zr_req_slot *s = (zr_req_slot *)(void *)slot;
        Py_ssize_t n = t.n - done < (Py_ssize_t)self->chunk_tokens ? t.n - done : (Py_ssize_t)self->chunk_tokens;
        memset(s, 0, sizeof *s);
        s->request_id = r->request_id;
        s->flags = r->flags | (c + 1 < need ? ZR_REQ_CONTINUE : 0);
        s->max_tokens = r->max_tokens;
        s->temperature = r->temperature;
        s->top_p = r->top_p;
        s->seed = r->seed;
        s->n_tokens = (uint32_t)n;
        s->total_tokens = (uint32_t)t.n;
        s->chunk_index = (uint32_t)c;
        s->top_k = r->top_k;
        s->frequency_penalty = r->frequency_penalty;
        s->presence_penalty = r->presence_penalty;
        s->top_logprobs = r->top_logprobs;
        if (tok_copy(&t, done, n, (uint32_t *)(void *)(slot + ZR_REQ_HEADER_SIZE)) < 0) {
            tok_close(&t);
            return -1;
        }
        done += n;
    }
    tok_close(&t);
    return (int64_t)need;
}

/* Reads the request at counter `head` (avail entries published). Returns a new tuple and sets
   *took, or NULL (ValueError on a corrupt slot chain). */
static PyObject *req_read(RingObject *self, uint64_t head, uint64_t avail, uint64_t *took) {
    const uint8_t *slot0 = self->slots + (head & self->mask) * self->slot_size;
    const zr_req_slot *s0 = (const zr_req_slot *)(const void *)slot0;
    uint64_t total = s0->total_tokens;
    uint64_t need = total == 0 ? 1 : (total + self->chunk_tokens - 1) / self->chunk_tokens;
    if (s0->chunk_index != 0)
        return corrupt(self, "a request starts with a continuation chunk", head, head + avail);
    if (need > avail)
        return corrupt(self, "a request's chunks run past the published tail", head, head + avail);
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(total * 4));
    if (bytes == NULL)
        return NULL;
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(bytes);
    uint64_t done = 0;
    for (uint64_t c = 0; c < need; c++) {
        const uint8_t *slot = self->slots + ((head + c) & self->mask) * self->slot_size;
        const zr_req_slot *s = (const zr_req_slot *)(const void *)slot;
        uint64_t expect_n = total - done < self->chunk_tokens ? total - done : self->chunk_tokens;
        uint32_t expect_flags = s0->flags & ~ZR_REQ_CONTINUE;
        if (c + 1 < need)
            expect_flags |= ZR_REQ_CONTINUE;
        if (s->request_id != s0->request_id || s->chunk_index != c || s->total_tokens != total ||
            s->n_tokens != expect_n || s->flags != expect_flags) {
            Py_DECREF(bytes);
            return corrupt(self, "inconsistent chunk in a multi-slot request", head, head + avail);
        }
        memcpy(dst + done * 4, slot + ZR_REQ_HEADER_SIZE, (size_t)expect_n * 4);
        done += expect_n;
    }
    *took = need;
    /* (request_id, tokens as bytes of u32, max_tokens, temperature, top_p, seed, flags, top_k,
       frequency_penalty, presence_penalty, top_logprobs) */
    PyObject *tup = Py_BuildValue("(KNIddKIIddI)", (unsigned long long)s0->request_id, bytes,
                                  (unsigned int)s0->max_tokens, (double)s0->temperature, (double)s0->top_p,
                                  (unsigned long long)s0->seed, (unsigned int)(s0->flags & ~ZR_REQ_CONTINUE),
                                  (unsigned int)s0->top_k, (double)s0->frequency_penalty,
                                  (double)s0->presence_penalty, (unsigned int)s0->top_logprobs);
    return tup;
}

static PyObject *RequestRing_pop(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_held(self) < 0)
        return NULL;
    uint64_t head = atomic_load_explicit(self->head, memory_order_relaxed);
    int64_t avail = consumer_avail(self, head, 1);
    if (avail < 0)
        return NULL;
    if (avail == 0)
        Py_RETURN_NONE;
    uint64_t took;
    PyObject *tup = req_read(self, head, (uint64_t)avail, &took);
    if (tup == NULL)
        return NULL;
    atomic_store_explicit(self->head, head + took, memory_order_release);
    return tup;
}

static PyObject *RequestRing_pop_many(RingObject *self, PyObject *arg) {
    if (check_held(self) < 0)
        return NULL;
    Py_ssize_t max_n = PyLong_AsSsize_t(arg);
    if (max_n == -1 && PyErr_Occurred())
        return NULL;
    if (max_n < 0) {
        PyErr_SetString(PyExc_ValueError, "pop_many: max_n must be >= 0");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL || max_n == 0)
        return out;
    uint64_t head = atomic_load_explicit(self->head, memory_order_relaxed);
    /* requests take 1..capacity slots each: refresh tail unless the cached copy shows a full ring */
    int64_t avail = consumer_avail(self, head, self->capacity);
    if (avail < 0) {
        Py_DECREF(out);
        return NULL;
    }
    uint64_t pos = head;
    while ((Py_ssize_t)PyList_GET_SIZE(out) < max_n && pos - head < (uint64_t)avail) {
        uint64_t took;
        PyObject *tup = req_read(self, pos, (uint64_t)avail - (pos - head), &took);
        if (tup == NULL || PyList_Append(out, tup) < 0) {
            Py_XDECREF(tup);
            Py_DECREF(out);
            return NULL; /* nothing consumed */
        }
        Py_DECREF(tup);
        pos += took;
    }
    if (pos != head)
        atomic_store_explicit(self->head, pos, memory_order_release);
    return out;
}

static PyObject *RequestRing_slots_needed(RingObject *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "slots_needed: n_tokens must be >= 0");
        return NULL;
    }
    if (check_held(self) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(req_slots_needed(self, n));
}

/* ---- result ring ---- */

static int parse_res(PyObject *const *a, Py_ssize_t nargs, zr_res_slot *s) {
    if (nargs < 2 || nargs > 5) {
        PyErr_Format(PyExc_TypeError, "a result is (request_id, token[, flags[, t_ns[, logprob]]]): got %zd fields",
                     nargs);
        return -1;
    }
    s->flags = 0;
    s->t_ns = 0;
    s->logprob = 0.0f;
    s->reserved = 0;
    if (as_u64(a[0], "request_id", &s->request_id) < 0 || as_u32(a[1], "token", &s->token) < 0 ||
        (nargs > 2 && as_u32(a[2], "flags", &s->flags) < 0) || (nargs > 3 && as_u64(a[3], "t_ns", &s->t_ns) < 0) ||
        (nargs > 4 && as_f32(a[4], "logprob", &s->logprob) < 0))
        return -1;
    return 0;
}

static PyObject *res_tuple(const zr_res_slot *s) {
    return Py_BuildValue("(KIIKd)", (unsigned long long)s->request_id, (unsigned int)s->token,
                         (unsigned int)s->flags, (unsigned long long)s->t_ns, (double)s->logprob);
}

static PyObject *ResultRing_pop(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_held(self) < 0)
        return NULL;
    uint64_t head = atomic_load_explicit(self->head, memory_order_relaxed);
    int64_t avail = consumer_avail(self, head, 1);
    if (avail <= 0) {
        if (avail < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    zr_res_slot s;
    memcpy(&s, self->slots + (head & self->mask) * ZR_RES_SLOT_SIZE, sizeof s);
    atomic_store_explicit(self->head, head + 1, memory_order_release);
    return res_tuple(&s);
}

static PyObject *ResultRing_pop_many(RingObject *self, PyObject *arg) {
    if (check_held(self) < 0)
        return NULL;
    Py_ssize_t max_n = PyLong_AsSsize_t(arg);
    if (max_n == -1 && PyErr_Occurred())
        return NULL;
    if (max_n < 0) {
        PyErr_SetString(PyExc_ValueError, "pop_many: max_n must be >= 0");
        return NULL;
    }
    uint64_t head = atomic_load_explicit(self->head, memory_order_relaxed);
    int64_t avail = max_n ? consumer_avail(self, head, (uint64_t)max_n < self->capacity ? (uint64_t)max_n : self->capacity) : 0;
    if (avail < 0)
        return NULL;
    Py_ssize_t k = max_n < avail ? max_n : (Py_ssize_t)avail;
    PyObject *out = PyList_New(k);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < k; i++) {
        zr_res_slot s;
        memcpy(&s, self->slots + ((head + (uint64_t)i) & self->mask) * ZR_RES_SLOT_SIZE, sizeof s);
        PyObject *t = res_tuple(&s);
        if (t == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    if (k > 0)
        atomic_store_explicit(self->head, head + (uint64_t)k, memory_order_release);
    return out;
}

/* ---- push (both rings) ---- */

/* One parsed record: a request (its tokens still the caller's object) or a result slot image. */
typedef union {
    req_args req;
    zr_res_slot res;
} record;

ZR_INLINE int parse_record(int request, PyObject *const *fields, Py_ssize_t nfields, record *r) {
    return request ? parse_req(fields, nfields, &r->req) : parse_res(fields, nfields, &r->res);
}

/* Writes one record into the unpublished slots from counter `pos` on (`tail` is the published
   tail): the slots it took, 0 if the ring lacks room (nothing written), -1 on error. A result
   takes one slot, whose room produce() has checked; `*stamp` is the batch's CLOCK_MONOTONIC time,
   read once, when the first result without a t_ns needs it. */
ZR_INLINE int64_t write_record(RingObject *self, int request, uint64_t tail, uint64_t pos, record *r,
                               uint64_t *stamp) {
    if (request)
        return req_write(self, tail, pos, &r->req);
    if (r->res.t_ns == 0)
        r->res.t_ns = *stamp ? *stamp : (*stamp = now_ns());
    memcpy(self->slots + (pos & self->mask) * ZR_RES_SLOT_SIZE, &r->res, sizeof r->res);
    return 1;
}

/* The producer side of both rings (PROTOCOL above): writes records in order into the slots after
   the published tail, then publishes the prefix that fits with one release store of tail. The
   records are `one` (push: parsed by the caller first, so a malformed call raises even on a full
   ring) or the field tuples of `seq` (push_many: a PySequence_Fast; each tuple is parsed just
   before it is written, so items past the first that does not fit are not looked at). A result
   takes one slot, so the room for the whole batch is checked once, up front (one head reload at
   most); a request takes 1..capacity slots, so req_write checks its room as it goes. `request` and
   `seq != NULL` are constants in each (inlined) copy. Returns the number of records published, or
   -1 on error (nothing published). */
ZR_INLINE Py_ssize_t produce(RingObject *self, int request, PyObject *seq, record *one) {
    Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(seq) : 1;
    uint64_t tail = atomic_load_explicit(self->tail, memory_order_relaxed);
    if (!request) {
        int64_t room = n ? producer_room(self, tail, (uint64_t)n < self->capacity ? (uint64_t)n : self->capacity) : 0;
        if (room < 0)
            return -1;
        if (n > room)
            n = (Py_ssize_t)room;
    }
    uint64_t pos = tail, stamp = 0;
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        record parsed, *r = one;
        if (seq != NULL) {
            PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
            if (!PyTuple_Check(it)) {
                PyErr_Format(PyExc_TypeError, "push_many: item %zd is %.100s, not a %s tuple", i,
                             Py_TYPE(it)->tp_name, request ? "request" : "result");
                return -1;
            }
            r = &parsed;
            if (parse_record(request, PySequence_Fast_ITEMS(it), PyTuple_GET_SIZE(it), r) < 0)
                return -1; /* nothing published */
        }
        int64_t took = write_record(self, request, tail, pos, r, &stamp);
        if (took < 0)
            return -1; /* nothing published */
        if (took == 0)
            break; /* the rest waits: order is kept */
        pos += (uint64_t)took;
    }
    if (pos != tail)
        atomic_store_explicit(self->tail, pos, memory_order_release);
    return i;
}

ZR_INLINE PyObject *ring_push(RingObject *self, int request, PyObject *const *args, Py_ssize_t nargs) {
    record r;
    if (check_held(self) < 0 || parse_record(request, args, nargs, &r) < 0)
        return NULL;
    Py_ssize_t k = produce(self, request, NULL, &r);
    if (k < 0)
        return NULL;
    return PyBool_FromLong(k > 0);
}

ZR_INLINE PyObject *ring_push_many(RingObject *self, int request, PyObject *items) {
    if (check_held(self) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(items, request ? "push_many takes a sequence of request tuples"
                                                   : "push_many takes a sequence of result tuples");
    if (seq == NULL)
        return NULL;
    Py_ssize_t k = produce(self, request, seq, NULL);
    Py_DECREF(seq);
    return k < 0 ? NULL : PyLong_FromSsize_t(k);
}

static PyObject *RequestRing_push(RingObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return ring_push(self, 1, args, nargs);
}

static PyObject *RequestRing_push_many(RingObject *self, PyObject *items) {
    return ring_push_many(self, 1, items);
}

static PyObject *ResultRing_push(RingObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return ring_push(self, 0, args, nargs);
}

static PyObject *ResultRing_push_many(RingObject *self, PyObject *items) {
    return ring_push_many(self, 0, items);
}

/* ---- type objects ---- */

static PyGetSetDef Ring_getset[] = {
    {"capacity", (getter)Ring_get_capacity, NULL, "slots in the ring (a power of two)", NULL},
    {"released", (getter)Ring_get_released, NULL, "True once release() gave the region back", NULL},
    {"chunk_tokens", (getter)Ring_get_chunk_tokens, NULL, "prompt tokens per request slot (0: result ring)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#define RING_COMMON_METHODS                                                                                       \
    {"occupancy", (PyCFunction)Ring_occupancy, METH_NOARGS, "slots in use (tail - head)"},                      \
        {"counters", (PyCFunction)Ring_counters, METH_NOARGS, "(head, tail): the raw u64 counters"},              \
        {"release", (PyCFunction)Ring_release, METH_NOARGS, "let go of the region's buffer (idempotent)"},      \
        {"__enter__", (PyCFunction)Ring_enter, METH_NOARGS, NULL},                                             \
        {"__exit__", (PyCFunction)Ring_exit, METH_VARARGS, NULL},

static PyMethodDef RequestRing_methods[] = {
    RING_COMMON_METHODS
    {"push", (PyCFunction)(void (*)(void))RequestRing_push, METH_FASTCALL,
     "push(request_id, tokens, max_tokens, temperature, top_p, seed, flags) -> bool\n"
     "False when the ring lacks room (nothing written); ValueError if the prompt can never fit."},
    {"push_many", (PyCFunction)RequestRing_push_many, METH_O,
     "push_many(requests) -> int: pushes the longest prefix that fits, publishes it once."},
    {"pop", (PyCFunction)RequestRing_pop, METH_NOARGS,
     "pop() -> (request_id, tokens: bytes of u32, max_tokens, temperature, top_p, seed, flags) | None"},
    {"pop_many", (PyCFunction)RequestRing_pop_many, METH_O, "pop_many(max_n) -> list of request tuples"},
    {"slots_needed", (PyCFunction)RequestRing_slots_needed, METH_O, "slots a prompt of n tokens takes"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef ResultRing_methods[] = {
    RING_COMMON_METHODS
    {"push", (PyCFunction)(void (*)(void))ResultRing_push, METH_FASTCALL,
     "push(request_id, token, flags=0, t_ns=0) -> bool (t_ns 0: stamped with CLOCK_MONOTONIC)"},
    {"push_many", (PyCFunction)ResultRing_push_many, METH_O,
     "push_many(results) -> int: pushes the longest prefix that fits, publishes it once."},
    {"pop", (PyCFunction)ResultRing_pop, METH_NOARGS, "pop() -> (request_id, token, flags, t_ns) | None"},
    {"pop_many", (PyCFunction)ResultRing_pop_many, METH_O, "pop_many(max_n) -> list of result tuples"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RequestRingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "zlc.runtime.serve._rings.RequestRing",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RequestRing(region): the request ring of an initialized ring region (a writable buffer)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RequestRing_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = RequestRing_methods,
    .tp_getset = Ring_getset,
};

static PyTypeObject ResultRingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "zlc.runtime.serve._rings.ResultRing",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ResultRing(region): the result ring of an initialized ring region (a writable buffer)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ResultRing_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = ResultRing_methods,
    .tp_getset = Ring_getset,
};

/* ------------------------------------------------------------------------------------------ */
/* Module functions                                                                            */

static int parse_caps(PyObject *args, PyObject *kwds, const char *fmt, char **kwlist, PyObject **buffer,
                      unsigned long long *req_cap, unsigned long long *res_cap, unsigned long long *chunk) {
    PyObject *rq, *rs, *ch = NULL;
    int ok = buffer ? PyArg_ParseTupleAndKeywords(args, kwds, fmt, kwlist, buffer, &rq, &rs, &ch)
                    : PyArg_ParseTupleAndKeywords(args, kwds, fmt, kwlist, &rq, &rs, &ch);
    if (!ok)
        return -1;
    uint64_t a, b, c = ZR_DEFAULT_CHUNK_TOKENS;
    if (as_u64(rq, "request_capacity", &a) < 0 || as_u64(rs, "result_capacity", &b) < 0 ||
        (ch != NULL && as_u64(ch, "chunk_tokens", &c) < 0))
        return -1;
    *req_cap = a;
    *res_cap = b;
    *chunk = c;
    return 0;
}

static PyObject *mod_region_size(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"request_capacity", "result_capacity", "chunk_tokens", NULL};
    unsigned long long a, b, c;
    zr_layout L;
    if (parse_caps(args, kwds, "OO|O:region_size", kwlist, NULL, &a, &b, &c) < 0 || compute_layout(a, b, c, &L, "") < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(L.region_size);
}

static PyObject *mod_init_region(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"region", "request_capacity", "result_capacity", "chunk_tokens", NULL};
    unsigned long long a, b, c;
    PyObject *buffer;
    zr_layout L;
    if (parse_caps(args, kwds, "OOO|O:init_region", kwlist, &buffer, &a, &b, &c) < 0 ||
        compute_layout(a, b, c, &L, "") < 0)
        return NULL;
    Py_buffer view;
    if (get_region_buffer(buffer, &view) < 0)
        return NULL;
    uint8_t *base = (uint8_t *)view.buf;
    if ((uintptr_t)base % 8 != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "ring region must start at an 8-byte aligned address "
                                          "(use mmap / SharedMemory, or an aligned slice)");
        return NULL;
    }
    if ((uint64_t)view.len < L.region_size) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "ring region buffer too small: %zd bytes, this layout needs %llu", view.len,
                     (unsigned long long)L.region_size);
        return NULL;
    }
    /* Unpublish first (an attacher that raced us sees no magic), then lay everything out. */
    atomic_store_explicit((_Atomic uint64_t *)(void *)base, 0, memory_order_release);
    memset(base + 8, 0, (size_t)L.region_size - 8);
    zr_header *h = (zr_header *)(void *)base;
    h->version = ZR_VERSION;
    h->header_size = ZR_HEADER_SIZE;
    h->region_size = L.region_size;
    h->n_rings = ZR_N_RINGS;
    h->rings[0] = (zr_desc){ZR_KIND_REQUEST, L.req_slot_size, (uint32_t)a, (uint32_t)c, L.req_control, L.req_slots};
    h->rings[1] = (zr_desc){ZR_KIND_RESULT, ZR_RES_SLOT_SIZE, (uint32_t)b, 0, L.res_control, L.res_slots};
    atomic_store_explicit((_Atomic uint64_t *)(void *)base, ZR_MAGIC, memory_order_release);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(L.region_size);
}

static PyObject *mod_region_info(PyObject *Py_UNUSED(m), PyObject *buffer) {
    Py_buffer view;
    if (get_region_buffer(buffer, &view) < 0)
        return NULL;
    zr_layout L;
    uint32_t a, b, c;
    int rc = validate_region((const uint8_t *)view.buf, view.len, &L, &a, &b, &c);
    PyBuffer_Release(&view);
    if (rc < 0)
        return NULL;
    return Py_BuildValue("{s:I,s:K,s:I,s:I,s:I,s:I,s:I,s:K,s:K,s:K,s:K}", "version", ZR_VERSION, "region_size",
                         (unsigned long long)L.region_size, "request_capacity", a, "result_capacity", b,
                         "chunk_tokens", c, "request_slot_size", L.req_slot_size, "result_slot_size",
                         ZR_RES_SLOT_SIZE, "request_control_offset", (unsigned long long)L.req_control,
                         "result_control_offset", (unsigned long long)L.res_control, "request_slots_offset",
                         (unsigned long long)L.req_slots, "result_slots_offset", (unsigned long long)L.res_slots);
}

static PyMethodDef module_methods[] = {
    {"region_size", (PyCFunction)(void (*)(void))mod_region_size, METH_VARARGS | METH_KEYWORDS,
     "region_size(request_capacity, result_capacity, chunk_tokens=4096) -> bytes the layout spans"},
    {"init_region", (PyCFunction)(void (*)(void))mod_init_region, METH_VARARGS | METH_KEYWORDS,
     "init_region(region, request_capacity, result_capacity, chunk_tokens=4096) -> region_size\n"
     "Zeroes the layout's bytes, writes the header, publishes the magic last (release)."},
    {"region_info", (PyCFunction)mod_region_info, METH_O,
     "region_info(region) -> dict: validates the header (ValueError if malformed) and returns the layout"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef rings_module = {
    PyModuleDef_HEAD_INIT, .m_name = "zlc.runtime.serve._rings",
    .m_doc = "SPSC request/result rings in a shared region, with C11 acquire/release (see docs/rings.md).",
    .m_size = -1, .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__rings(void) {
    if (PyType_Ready(&RequestRingType) < 0 || PyType_Ready(&ResultRingType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&rings_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RequestRingType);
    Py_INCREF(&ResultRingType);
    if (PyModule_AddObject(m, "RequestRing", (PyObject *)&RequestRingType) < 0 ||
        PyModule_AddObject(m, "ResultRing", (PyObject *)&ResultRingType) < 0 ||
        PyModule_AddIntConstant(m, "VERSION", ZR_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_SIZE", ZR_HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "CONTROL_SIZE", ZR_CONTROL_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "HEAD_OFFSET", ZR_HEAD_OFFSET) < 0 ||
        PyModule_AddIntConstant(m, "TAIL_OFFSET", ZR_TAIL_OFFSET) < 0 ||
        PyModule_AddIntConstant(m, "REQUEST_HEADER_SIZE", ZR_REQ_HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "RESULT_SLOT_SIZE", ZR_RES_SLOT_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "DEFAULT_CHUNK_TOKENS", ZR_DEFAULT_CHUNK_TOKENS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_CHUNK_TOKENS", ZR_MAX_CHUNK_TOKENS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_CAPACITY", ZR_MAX_CAPACITY) < 0 ||
        PyModule_AddObject(m, "MAGIC", PyLong_FromUnsignedLongLong(ZR_MAGIC)) < 0 ||
        PyModule_AddObject(m, "REQUEST_CONTINUE", PyLong_FromUnsignedLong(ZR_REQ_CONTINUE)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
