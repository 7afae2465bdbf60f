/*
 * _tracescan: a compiled fast path for decoding one batch of a Phantora Chrome trace.
 *
 * scan(batch, calls, dtypes) reads ``[`` + elements + ``]`` (the batches of
 * trace_decode.iter_batches) and returns the flow columns of its Communication events and the
 * (host, ts, dur) columns of its Computation events, or None when the batch holds anything it
 * does not handle exactly as the msgspec schema of trace_decode does. None is not an error: the
 * caller then decodes the batch with msgspec, which gives the result or names the broken rule.
 * So this scanner is strict: it accepts only well-formed JSON of the expected shapes (ASCII
 * strings without escapes in the fields it keeps, integers that fit int64, no key twice in any
 * object of an event (keys compared as written: a key with an escape in a skipped object, or an
 * object of more than 64 keys, is declined), nesting at most 64 deep) and answers None for
 * everything else. Numbers are converted as
 * msgspec converts them (correctly rounded floats; exact integers).
 *
 * The scan runs without the GIL (the batch buffer is held for its duration), so that inflating
 * the next part of the file on another thread goes on meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <locale.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64
#define MAX_OBJ_KEYS 64 /* keys of one object checked for duplicates; more: declined */
#define MAX_KEYS 16 /* at most this many call names / dtypes */

typedef struct {
    const char *p;
    Py_ssize_t n;
} Span;

/* ----------------------------------------------------------------------------- growable arrays */

typedef struct {
    char *data;
    size_t len, cap, item;
} Vec;

static int vec_push(Vec *v, const void *x) {
    if (v->len == v->cap) {
        size_t cap = v->cap ? 2 * v->cap : 4096;
        char *d = realloc(v->data, cap * v->item);
        if (!d) return -1;
        v->data = d;
        v->cap = cap;
    }
    memcpy(v->data + v->len * v->item, x, v->item);
    v->len++;
    return 0;
}

/* ----------------------------------------------------------------- span -> dense code tables */

typedef struct {
    uint64_t h;
    Span s;
    int32_t code;
} Slot;

typedef struct {
    Slot *slots;
    size_t cap, n;
    Vec order; /* Span per code */
} Table;

static uint64_t hash_span(Span s) {
    uint64_t h = 1469598103934665603ULL; /* FNV-1a, 8 bytes at a time for long spans */
    Py_ssize_t i = 0;
    for (; i + 8 <= s.n; i += 8) {
        uint64_t w;
        memcpy(&w, s.p + i, 8);
        h = (h ^ w) * 1099511628211ULL;
        h ^= h >> 29;
    }
    for (; i < s.n; i++) h = (h ^ (unsigned char)s.p[i]) * 1099511628211ULL;
    return h ^ (uint64_t)s.n;
}

static int table_grow(Table *t) {
    size_t cap = t->cap ? 2 * t->cap : 64;
    Slot *slots = calloc(cap, sizeof(Slot));
    if (!slots) return -1;
    for (size_t i = 0; i < t->cap; i++) {
        if (t->slots[i].s.p) {
            size_t j = t->slots[i].h & (cap - 1);
            while (slots[j].s.p) j = (j + 1) & (cap - 1);
            slots[j] = t->slots[i];
        }
    }
    free(t->slots);
    t->slots = slots;
    t->cap = cap;
    return 0;
}

/* code of s, -1 when unseen */
static int32_t table_find(const Table *t, Span s) {
    if (!t->cap) return -1;
    uint64_t h = hash_span(s);
    size_t j = h & (t->cap - 1);
    while (t->slots[j].s.p) {
        const Slot *sl = &t->slots[j];
        if (sl->h == h && sl->s.n == s.n && memcmp(sl->s.p, s.p, s.n) == 0) return sl->code;
        j = (j + 1) & (t->cap - 1);
    }
    return -1;
}

/* code of s (a new one when unseen), -1 on no memory */
static int32_t table_code(Table *t, Span s) {
    if (2 * (t->n + 1) > t->cap && table_grow(t) < 0) return -1;
    uint64_t h = hash_span(s);
    size_t j = h & (t->cap - 1);
    while (t->slots[j].s.p) {
        Slot *sl = &t->slots[j];
        if (sl->h == h && sl->s.n == s.n && memcmp(sl->s.p, s.p, s.n) == 0) return sl->code;
        j = (j + 1) & (t->cap - 1);
    }
    if (vec_push(&t->order, &s) < 0) return -1;
    t->slots[j].h = h;
    t->slots[j].s = s;
    t->slots[j].code = (int32_t)t->n;
    return (int32_t)t->n++;
}

/* ---------------------------------------------------------------------------------- parsing */

typedef struct {
    const char *end;
    locale_t c_locale;
} Ctx;

#define WS(p, e) while ((p) < (e) && (*(p) == ' ' || *(p) == '\n' || *(p) == '\r' || *(p) == '\t')) (p)++

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* A string at *pp ('"'); for kept strings (out != NULL) no escapes are accepted. ASCII only. */
static int parse_string(const char **pp, const char *e, Span *out) {
    const char *p = *pp;
    if (p >= e || *p != '"') return -1;
    p++;
    const char *start = p;
    for (;;) {
        if (p >= e) return -1;
        unsigned char c = (unsigned char)*p;
        if (c == '"') break;
        if (c < 0x20 || c >= 0x80) return -1;
        if (c == '\\') {
            if (out) return -1;
            p++;
            if (p >= e) return -1;
            c = (unsigned char)*p;
            if (c == 'u') {
                for (int k = 1; k <= 4; k++) {
                    if (p + k >= e) return -1;
                    char h = p[k];
                    if (!(is_digit(h) || (h >= 'a' && h <= 'f') || (h >= 'A' && h <= 'F'))) return -1;
                }
                /* surrogates would need pairing rules: leave them to msgspec */
                char h0 = p[1];
                if ((h0 == 'd' || h0 == 'D') && p[2] >= '8') return -1;
                p += 4;
            } else if (!strchr("\"\\/bfnrt", c) || c == 0) {
                return -1;
            }
        }
        p++;
    }
    if (out) {
        out->p = start;
        out->n = p - start;
    }
    *pp = p + 1;
    return 0;
}

/* The extent of a JSON number at *pp (grammar checked); sets is_int when it has no fraction or
 * exponent. */
static int number_extent(const char **pp, const char *e, int *is_int) {
    const char *p = *pp;
    *is_int = 1;
    if (p < e && *p == '-') p++;
    if (p >= e || !is_digit(*p)) return -1;
    if (*p == '0') {
        p++;
    } else {
        while (p < e && is_digit(*p)) p++;
    }
    if (p < e && *p == '.') {
        *is_int = 0;
        p++;
        if (p >= e || !is_digit(*p)) return -1;
        while (p < e && is_digit(*p)) p++;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        *is_int = 0;
        p++;
        if (p < e && (*p == '+' || *p == '-')) p++;
        if (p >= e || !is_digit(*p)) return -1;
        while (p < e && is_digit(*p)) p++;
    }
    *pp = p;
    return 0;
}

static int parse_int64(const char **pp, const char *e, int64_t *out) {
    const char *p = *pp, *q = *pp;
    int is_int;
    if (number_extent(&q, e, &is_int) < 0 || !is_int) return -1;
    int neg = 0;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    uint64_t v = 0;
    for (; p < q; p++) {
        unsigned d = (unsigned)(*p - '0');
        if (v > (UINT64_MAX - d) / 10) return -1;
        v = v * 10 + d;
    }
    if (neg) {
        if (v > (uint64_t)INT64_MAX + 1) return -1;
        *out = (int64_t)(0 - v);
    } else {
        if (v > (uint64_t)INT64_MAX) return -1;
        *out = (int64_t)v;
    }
    *pp = q;
    return 0;
}

static const double POW10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* A number into a correctly rounded double: exact mantissa and power of ten when both fit
 * (Clinger's fast path), else strtod_l in the C locale. Infinite results are refused. */
static int parse_double(const char **pp, const char *e, const Ctx *ctx, double *out) {
    const char *p = *pp, *q = *pp;
    int is_int;
    if (number_extent(&q, e, &is_int) < 0) return -1;
    int neg = 0;
    const char *s = p;
    if (*s == '-') {
        neg = 1;
        s++;
    }
    uint64_t m = 0;
    int digits = 0, exp10 = 0, ok = 1;
    for (; s < q && is_digit(*s); s++) {
        if (m || *s != '0') digits++;
        if (digits > 19) {
            ok = 0;
            break;
        }
        m = m * 10 + (unsigned)(*s - '0');
    }
    if (ok && s < q && *s == '.') {
        for (s++; s < q && is_digit(*s); s++) {
            if (m || *s != '0') digits++;
            if (digits > 19) {
                ok = 0;
                break;
            }
            m = m * 10 + (unsigned)(*s - '0');
            if (--exp10 < -400) { /* leading zeros do not count as digits: bound exp10 here */
                ok = 0;
                break;
            }
        }
    }
    if (ok && s < q && (*s == 'e' || *s == 'E')) {
        s++;
        int eneg = 0, ev = 0;
        if (*s == '+' || *s == '-') eneg = *s++ == '-';
        for (; s < q; s++) {
            if (ev < 100000) ev = ev * 10 + (*s - '0');
        }
        exp10 += eneg ? -ev : ev;
    }
    double v;
    if (ok && m <= (1ULL << 53) && exp10 >= -22 && exp10 <= 22) {
        v = (double)m;
        v = exp10 < 0 ? v / POW10[-exp10] : v * POW10[exp10];
    } else {
        char buf[128];
        Py_ssize_t n = q - p;
        if (n >= (Py_ssize_t)sizeof(buf) || !ctx->c_locale) return -1;
        memcpy(buf, p, n);
        buf[n] = 0;
        char *endp;
        v = strtod_l(buf, &endp, ctx->c_locale);
        if (endp != buf + n) return -1;
        neg = 0;
    }
    if (!(v - v == 0)) return -1; /* inf or nan */
    if (is_int && v == 0) neg = 0;  /* msgspec reads "-0" as the integer 0, so 0.0 */
    *out = neg ? -v : v;
    *pp = q;
    return 0;
}

/* After a member of an array or object: whitespace, then ',' (returns 1, *pp after the comma
 * and the whitespace after it) or `close` (returns 0, *pp after it); -1 otherwise. */
static int next_member(const char **pp, const char *e, char close) {
    const char *p = *pp;
    WS(p, e);
    if (p >= e) return -1;
    if (*p == ',') {
        p++;
        WS(p, e);
        *pp = p;
        return 1;
    }
    if (*p != close) return -1;
    *pp = p + 1;
    return 0;
}

/* A key of an object not seen before in it (JSON does not say which of two values counts, and
 * msgspec would keep the last silently): 0, k added to keys[0..*n); -1 when it is there already
 * or the object has too many keys to check here (the msgspec path then checks it). */
static int key_new(Span *keys, int *n, Span k) {
    for (int i = 0; i < *n; i++)
        if (keys[i].n == k.n && memcmp(keys[i].p, k.p, k.n) == 0) return -1;
    if (*n == MAX_OBJ_KEYS) return -1;
    keys[(*n)++] = k;
    return 0;
}

static int skip_value(const char **pp, const char *e, int depth);

static int skip_container(const char **pp, const char *e, int depth, char close) {
    const char *p = *pp + 1;
    if (depth > MAX_DEPTH) return -1;
    WS(p, e);
    if (p < e && *p == close) {
        *pp = p + 1;
        return 0;
    }
    Span keys[MAX_OBJ_KEYS];
    int n_keys = 0;
    for (;;) {
        if (close == '}') {
            const char *q = p;
            if (parse_string(&p, e, NULL) < 0) return -1;
            Span k = {q + 1, p - q - 2}; /* as written: one with an escape is not compared here */
            if (memchr(k.p, '\\', k.n) || key_new(keys, &n_keys, k) < 0) return -1;
            WS(p, e);
            if (p >= e || *p != ':') return -1;
            p++;
            WS(p, e);
        }
        if (skip_value(&p, e, depth + 1) < 0) return -1;
        int more = next_member(&p, e, close);
        if (more <= 0) {
            *pp = p;
            return more;
        }
    }
}

static int skip_literal(const char **pp, const char *e, const char *lit, Py_ssize_t n) {
    if (e - *pp < n || memcmp(*pp, lit, n) != 0) return -1;
    *pp += n;
    return 0;
}

static int skip_value(const char **pp, const char *e, int depth) {
    const char *p = *pp;
    if (p >= e) return -1;
    int is_int;
    switch (*p) {
        case '"': return parse_string(pp, e, NULL);
        case '{': return skip_container(pp, e, depth, '}');
        case '[': return skip_container(pp, e, depth, ']');
        case 't': return skip_literal(pp, e, "true", 4);
        case 'f': return skip_literal(pp, e, "false", 5);
        case 'n': return skip_literal(pp, e, "null", 4);
        default: return number_extent(pp, e, &is_int);
    }
}

/* Object walking: calls field(key, &p) for each member; field returns 0 (value consumed),
 * 1 (not a field of interest: skip the value) or -1. */
#define KEY_IS(k, lit) ((k).n == (Py_ssize_t)sizeof(lit) - 1 && memcmp((k).p, lit, sizeof(lit) - 1) == 0)

typedef int (*FieldFn)(void *st, Span key, const char **pp, const char *e);

static int walk_object(const char **pp, const char *e, int depth, FieldFn fn, void *st) {
    const char *p = *pp;
    if (p >= e || *p != '{' || depth > MAX_DEPTH) return -1;
    p++;
    WS(p, e);
    if (p < e && *p == '}') {
        *pp = p + 1;
        return 0;
    }
    Span others[MAX_OBJ_KEYS]; /* the keys fn skips (fn takes each of its own keys once) */
    int n_others = 0;
    for (;;) {
        Span key;
        if (parse_string(&p, e, &key) < 0) return -1;
        WS(p, e);
        if (p >= e || *p != ':') return -1;
        p++;
        WS(p, e);
        int r = fn(st, key, &p, e);
        if (r < 0) return -1;
        if (r == 1 && (key_new(others, &n_others, key) < 0 || skip_value(&p, e, depth + 1) < 0)) return -1;
        int more = next_member(&p, e, '}');
        if (more <= 0) {
            *pp = p;
            return more;
        }
    }
}

/* ------------------------------------------------------------------------------ the schema */

typedef struct {
    Span keys[MAX_KEYS];
    int n;
} KeySet;

static int keyset_find(const KeySet *ks, Span s) {
    for (int i = 0; i < ks->n; i++)
        if (ks->keys[i].n == s.n && memcmp(ks->keys[i].p, s.p, s.n) == 0) return i;
    return -1;
}

typedef struct {
    const Ctx *ctx;
    const KeySet *calls, *dtypes;
    const Table *comms;
    unsigned seen;
    /* event */
    Span name, cat;
    double ts, dur;
    int64_t tid;
    /* Communication */
    int has_comm;
    int64_t flow_id, nbytes, count, root;
    Span src, dst, comm;
    int32_t comm_code; /* code of comm when it was found in the table while scanning, else -1 */
    int call, dtype;
    /* Computation */
    int has_comp;
    Span host;
} Ev;

enum { F_NAME = 1, F_CAT = 2, F_TS = 4, F_DUR = 8, F_TID = 16, F_ARGS = 32 };
enum { G_ID = 1, G_BYTES = 2, G_SRC = 4, G_DST = 8 };
enum { P_COUNT = 1, P_DTYPE = 2, P_COMM = 4, P_ROOT = 8 };

#define ONCE(mask, bit) \
    do {                \
        if ((mask) & (bit)) return -1; \
        (mask) |= (bit); \
    } while (0)

/* key k names this field: take it once (bit of mask) and parse its value with `parse` */
#define FIELD(k, lit, mask, bit, parse) \
    if (KEY_IS(k, lit)) {               \
        ONCE(mask, bit);                \
        return (parse);                 \
    }

typedef struct {
    Ev *ev;
    unsigned seen;
} Sub;

static int flow_field(void *st, Span k, const char **pp, const char *e) {
    Sub *s = st;
    Ev *ev = s->ev;
    FIELD(k, "id", s->seen, G_ID, parse_int64(pp, e, &ev->flow_id))
    FIELD(k, "bytes", s->seen, G_BYTES, parse_int64(pp, e, &ev->nbytes))
    FIELD(k, "src", s->seen, G_SRC, parse_string(pp, e, &ev->src))
    FIELD(k, "dst", s->seen, G_DST, parse_string(pp, e, &ev->dst))
    return 1;
}

static int payload_field(void *st, Span k, const char **pp, const char *e) {
    Sub *s = st;
    Ev *ev = s->ev;
    FIELD(k, "count", s->seen, P_COUNT, parse_int64(pp, e, &ev->count))
    if (KEY_IS(k, "dtype")) {
        Span d;
        ONCE(s->seen, P_DTYPE);
        if (parse_string(pp, e, &d) < 0) return -1;
        ev->dtype = keyset_find(ev->dtypes, d);
        return ev->dtype < 0 ? -1 : 0;
    }
    if (KEY_IS(k, "comm")) {
        const char *start = *pp;
        ONCE(s->seen, P_COMM);
        /* A communicator object is repeated on every event of its communicator: when the text up
         * to the first '}' is one already validated, it is that value again (same bytes, same
         * parse), so it is not scanned again. */
        if (start < e && *start == '{') {
            const char *close = memchr(start, '}', e - start);
            if (close) {
                Span c = {start, close + 1 - start};
                ev->comm_code = table_find(ev->comms, c);
                if (ev->comm_code >= 0) {
                    ev->comm = c;
                    *pp = close + 1;
                    return 0;
                }
            }
        }
        if (skip_value(pp, e, 8) < 0) return -1;
        ev->comm.p = start;
        ev->comm.n = *pp - start;
        return 0;
    }
    FIELD(k, "root", s->seen, P_ROOT, parse_int64(pp, e, &ev->root))
    return 1;
}

static int call_field(void *st, Span k, const char **pp, const char *e) {
    Sub *s = st;
    Ev *ev = s->ev;
    if (s->seen) return -1; /* exactly one call per event */
    s->seen = 1;
    ev->call = keyset_find(ev->calls, k);
    if (ev->call < 0) return -1;
    Sub ps = {ev, 0};
    ev->root = -1;
    ev->comm_code = -1;
    if (walk_object(pp, e, 6, payload_field, &ps) < 0) return -1;
    return (ps.seen & (P_COUNT | P_DTYPE | P_COMM)) == (P_COUNT | P_DTYPE | P_COMM) ? 0 : -1;
}

static int expect(const char **pp, const char *e, char c) {
    const char *p = *pp;
    WS(p, e);
    if (p >= e || *p != c) return -1;
    p++;
    WS(p, e);
    *pp = p;
    return 0;
}

/* the '[' of a fixed-length array (a msgspec tuple) and the whitespace after it */
static int open_tuple(const char **pp, const char *e) {
    if (*pp >= e || **pp != '[') return -1;
    (*pp)++;
    WS(*pp, e);
    return 0;
}

/* whitespace and the ']' that ends the tuple: no further elements */
static int close_tuple(const char **pp, const char *e) {
    WS(*pp, e);
    if (*pp >= e || **pp != ']') return -1;
    (*pp)++;
    return 0;
}

/* [flow, {call: payload}] */
static int parse_communication(Ev *ev, const char **pp, const char *e) {
    if (open_tuple(pp, e) < 0) return -1;
    Sub fs = {ev, 0};
    if (walk_object(pp, e, 4, flow_field, &fs) < 0) return -1;
    if (fs.seen != (G_ID | G_BYTES | G_SRC | G_DST)) return -1;
    if (expect(pp, e, ',') < 0) return -1;
    Sub cs = {ev, 0};
    if (walk_object(pp, e, 4, call_field, &cs) < 0 || !cs.seen) return -1;
    if (close_tuple(pp, e) < 0) return -1;
    ev->has_comm = 1;
    return 0;
}

static int host_field(void *st, Span k, const char **pp, const char *e) {
    Sub *s = st;
    FIELD(k, "hostname", s->seen, 1, parse_string(pp, e, &s->ev->host))
    return 1;
}

/* [{hostname}, int, any] */
static int parse_computation(Ev *ev, const char **pp, const char *e) {
    int64_t ignored;
    if (open_tuple(pp, e) < 0) return -1;
    Sub hs = {ev, 0};
    if (walk_object(pp, e, 4, host_field, &hs) < 0 || !hs.seen) return -1;
    if (expect(pp, e, ',') < 0) return -1;
    if (parse_int64(pp, e, &ignored) < 0) return -1;
    if (expect(pp, e, ',') < 0) return -1;
    if (skip_value(pp, e, 4) < 0) return -1;
    if (close_tuple(pp, e) < 0) return -1;
    ev->has_comp = 1;
    return 0;
}

static int args_field(void *st, Span k, const char **pp, const char *e) {
    Sub *s = st;
    FIELD(k, "Communication", s->seen, 1, parse_communication(s->ev, pp, e))
    FIELD(k, "Computation", s->seen, 2, parse_computation(s->ev, pp, e))
    return 1;
}

static int event_field(void *st, Span k, const char **pp, const char *e) {
    Ev *ev = st;
    FIELD(k, "name", ev->seen, F_NAME, parse_string(pp, e, &ev->name))
    FIELD(k, "cat", ev->seen, F_CAT, parse_string(pp, e, &ev->cat))
    FIELD(k, "ts", ev->seen, F_TS, parse_double(pp, e, ev->ctx, &ev->ts))
    FIELD(k, "dur", ev->seen, F_DUR, parse_double(pp, e, ev->ctx, &ev->dur))
    FIELD(k, "tid", ev->seen, F_TID, parse_int64(pp, e, &ev->tid))
    if (KEY_IS(k, "args")) {
        ONCE(ev->seen, F_ARGS);
        Sub as = {ev, 0};
        return walk_object(pp, e, 2, args_field, &as);
    }
    return 1;
}

/* --------------------------------------------------------------------------------- the scan */

typedef struct {
    /* Communication columns */
    Vec ts, dur, tid, flow_id, nbytes, count, root, name, src, dst, comm, call, dtype;
    /* Computation columns */
    Vec cts, cdur, chost;
    Table names, hosts, comms;
    Py_ssize_t n_events;
    int nomem;
} Out;

static void out_init(Out *o) {
    memset(o, 0, sizeof(*o));
    Vec *f8[] = {&o->ts, &o->dur, &o->tid, &o->flow_id, &o->nbytes, &o->count, &o->root, &o->cts, &o->cdur};
    for (size_t i = 0; i < sizeof(f8) / sizeof(f8[0]); i++) f8[i]->item = 8;
    Vec *i4[] = {&o->name, &o->src, &o->dst, &o->comm, &o->chost};
    for (size_t i = 0; i < sizeof(i4) / sizeof(i4[0]); i++) i4[i]->item = 4;
    o->call.item = o->dtype.item = 1;
    o->names.order.item = o->hosts.order.item = o->comms.order.item = sizeof(Span);
}

static void out_free(Out *o) {
    Vec *all[] = {&o->ts,  &o->dur, &o->tid,  &o->flow_id, &o->nbytes, &o->count, &o->root,
                  &o->name, &o->src, &o->dst,  &o->comm,    &o->call,   &o->dtype, &o->cts,
                  &o->cdur, &o->chost, &o->names.order, &o->hosts.order, &o->comms.order};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) free(all[i]->data);
    free(o->names.slots);
    free(o->hosts.slots);
    free(o->comms.slots);
}

#define PUSH(v, x) \
    if (vec_push(&(v), &(x)) < 0) goto nomem

static int commit(Out *o, Ev *ev) {
    if ((ev->seen & (F_CAT | F_TS | F_DUR | F_ARGS)) != (F_CAT | F_TS | F_DUR | F_ARGS)) return -1;
    if (KEY_IS(ev->cat, "Communication")) {
        if (!ev->has_comm || (ev->seen & (F_NAME | F_TID)) != (F_NAME | F_TID)) return -1;
        int32_t cn = table_code(&o->names, ev->name), cs = table_code(&o->hosts, ev->src),
                cd = table_code(&o->hosts, ev->dst),
                cc = ev->comm_code >= 0 ? ev->comm_code : table_code(&o->comms, ev->comm);
        if (cn < 0 || cs < 0 || cd < 0 || cc < 0) goto nomem;
        int8_t call = (int8_t)ev->call, dtype = (int8_t)ev->dtype;
        PUSH(o->ts, ev->ts);
        PUSH(o->dur, ev->dur);
        PUSH(o->tid, ev->tid);
        PUSH(o->flow_id, ev->flow_id);
        PUSH(o->nbytes, ev->nbytes);
        PUSH(o->count, ev->count);
        PUSH(o->root, ev->root);
        PUSH(o->name, cn);
        PUSH(o->src, cs);
        PUSH(o->dst, cd);
        PUSH(o->comm, cc);
        PUSH(o->call, call);
        PUSH(o->dtype, dtype);
        return 0;
    }
    if (KEY_IS(ev->cat, "Computation")) {
        if (!ev->has_comp) return -1;
        int32_t ch = table_code(&o->hosts, ev->host);
        if (ch < 0) goto nomem;
        PUSH(o->cts, ev->ts);
        PUSH(o->cdur, ev->dur);
        PUSH(o->chost, ch);
        return 0;
    }
    return -1;
nomem:
    o->nomem = 1;
    return -1;
}

/* 0: scanned; -1: not for this scanner (or no memory: o->nomem) */
static int scan_batch(const char *p, const char *e, const Ctx *ctx, const KeySet *calls, const KeySet *dtypes,
                      Out *o) {
    WS(p, e);
    if (p >= e || *p != '[') return -1;
    p++;
    WS(p, e);
    if (p < e && *p == ']') return -1; /* an empty batch: the msgspec path reports it */
    for (;;) {
        Ev ev;
        memset(&ev, 0, sizeof(ev));
        ev.ctx = ctx;
        ev.calls = calls;
        ev.dtypes = dtypes;
        ev.comms = &o->comms;
        if (walk_object(&p, e, 1, event_field, &ev) < 0) return -1;
        if (commit(o, &ev) < 0) return -1;
        o->n_events++;
        int more = next_member(&p, e, ']');
        if (more < 0) return -1;
        if (!more) {
            WS(p, e);
            return p == e ? 0 : -1;
        }
    }
}

/* ------------------------------------------------------------------------------ the module */

static locale_t c_locale;

/* ks points into the bytes of the tuple seq (a tuple cannot change while the scan runs
 * without the GIL; the caller holds it). */
static int keyset_from(PyObject *seq, KeySet *ks, const char *what) {
    if (!PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple of bytes", what);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    if (n > MAX_KEYS) {
        PyErr_Format(PyExc_ValueError, "at most %d %s", MAX_KEYS, what);
        return -1;
    }
    ks->n = (int)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyTuple_GET_ITEM(seq, i);
        if (!PyBytes_Check(b)) {
            PyErr_Format(PyExc_TypeError, "%s must be a tuple of bytes", what);
            return -1;
        }
        ks->keys[i].p = PyBytes_AS_STRING(b);
        ks->keys[i].n = PyBytes_GET_SIZE(b);
    }
    return 0;
}

/* a bytearray, so that numpy arrays over it are writable, as msgspec's path gives them */
static PyObject *vec_bytes(Vec *v) { return PyByteArray_FromStringAndSize(v->data ? v->data : "", v->len * v->item); }

static PyObject *table_list(Table *t) {
    PyObject *list = PyList_New((Py_ssize_t)t->n);
    if (!list) return NULL;
    Span *spans = (Span *)t->order.data;
    for (size_t i = 0; i < t->n; i++) {
        PyObject *b = PyBytes_FromStringAndSize(spans[i].p, spans[i].n);
        if (!b) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, b);
    }
    return list;
}

static PyObject *scan(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer buf;
    PyObject *calls_obj, *dtypes_obj;
    KeySet calls, dtypes;
    if (!PyArg_ParseTuple(args, "y*OO", &buf, &calls_obj, &dtypes_obj)) return NULL;
    if (keyset_from(calls_obj, &calls, "calls") < 0 || keyset_from(dtypes_obj, &dtypes, "dtypes") < 0) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    Ctx ctx = {(const char *)buf.buf + buf.len, c_locale};
    Out o;
    out_init(&o);
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = scan_batch((const char *)buf.buf, ctx.end, &ctx, &calls, &dtypes, &o);
    Py_END_ALLOW_THREADS
    PyObject *res = NULL;
    if (r < 0) {
        if (o.nomem)
            PyErr_NoMemory();
        else
            res = Py_NewRef(Py_None);
    } else {
        /* n_events, 13 Communication columns, 3 Computation columns, 3 value lists */
        res = Py_BuildValue("nNNNNNNNNNNNNNNNNNNN", o.n_events, vec_bytes(&o.ts), vec_bytes(&o.dur), vec_bytes(&o.tid),
                            vec_bytes(&o.flow_id), vec_bytes(&o.nbytes), vec_bytes(&o.count), vec_bytes(&o.root),
                            vec_bytes(&o.name), vec_bytes(&o.src), vec_bytes(&o.dst), vec_bytes(&o.comm),
                            vec_bytes(&o.call), vec_bytes(&o.dtype), vec_bytes(&o.cts), vec_bytes(&o.cdur),
                            vec_bytes(&o.chost), table_list(&o.names), table_list(&o.hosts), table_list(&o.comms));
    }
    out_free(&o);
    PyBuffer_Release(&buf);
    return res;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(batch, calls, dtypes) -> tuple | None\n\n"
     "Columns of one batch ('[' + elements + ']'), or None when the batch is not for this scanner\n"
     "(decode it with msgspec then). calls / dtypes: the accepted NCCL call names and dtype names\n"
     "(tuples of bytes), whose indices are the call / dtype codes."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tracescan",
                                    "Compiled fast path for decoding Phantora trace batches.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tracescan(void) {
    if (!c_locale) c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
    return PyModule_Create(&module);
}
