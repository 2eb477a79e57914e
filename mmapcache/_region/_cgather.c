/* `take` reads a batch of fixed fields in one pass: each slot's state (acquire), then each field's row
 * of the READY ones (one memcpy a row and field); _gather.take_ready is its numpy twin.
 *
 * The compiled gather of a variable field: one call reads a batch's descriptors, checks each value's
 * bounds and copies the values back to back into one buffer (mmapcache/_gather.py describes the numpy
 * fallback, which gives the same result; tests/region/test_cgather.py holds the two against each other).
 * `pad` then copies such a batch's rows into a padded array, one memcpy + one fill a row (Jagged.to_padded
 * falls back to a numpy masked assignment, which tests/region/test_cgather.py holds it against).
 *
 * Safety: a descriptor comes from a file that other processes write, and may be damaged. Each one is
 * read once, into memory of our own, and only those copies are checked and used: a row is copied only
 * when its offset and byte count lie within the region (overflow-checked), so no descriptor makes this
 * code read outside the mapping. A slot index outside the table is a caller's bug: IndexError.
 *
 * The copy runs without the GIL when it moves enough bytes to be worth it (DataLoader threads overlap);
 * the buffers stay valid because this call holds a buffer export of each (the mapping cannot be
 * unmapped under it: mmapcache lets the last reference unmap).
 *
 * The module also holds a mixture's draws, compiled in _cdraws.c (its functions added as the module is made).
 *
 * No numpy C API: buffers come through the buffer protocol, the output from a Python callable.
 */
#include "_cbuffers.h"

#include <endian.h>

#define MAX_DIMS 32
#define MAX_FIELDS 64 /* fixed fields one take() copies */
#define FREE_GIL_FROM (64 * 1024) /* bytes: below this, a GIL round trip costs more than it frees */
/* Rows are read in random order: ask for the first bytes of the value this many rows ahead (pass 2), so
 * that their cache misses overlap with the copies instead of queueing (measured: 8 or 16, the best). */
#define AHEAD 8
#define DESCRIPTORS_AHEAD 16 /* pass 1 */
/* take(): a slot's state is asked for this many rows ahead, its rows TAKE_ROWS_AHEAD rows ahead. Without
 * it each state is a cache miss (and, in a file without huge pages, a TLB miss) that the copy of its rows
 * waits for, one at a time: 256 random rows of 64 B took 3x np.take's time. Measured at 256 rows of 64 B
 * of a 96 MiB field: 16/8 rows ahead 0.65x np.take from an in-RAM array, 64/32 1.3x (16/8 to 256/128
 * made no difference from 1 KB rows up: a row's first line is what waits). */
#define STATES_AHEAD 64
#define TAKE_ROWS_AHEAD 32

enum { ROW_OK = 0, ROW_MISSING = 1, ROW_BAD = 2 };



PyDoc_STRVAR(gather_doc,
"gather(region, table, width, indices, rows, dims, unit, align, offsets, shapes, alloc) -> (values, bad)\n\n"
"The values of slots ``indices`` of a variable field, back to back in one buffer.\n\n"
"region: the variable region (bytes); table: the field's descriptors, ``width`` bytes each (uint64 LE\n"
"offset into the region, then one uint32 LE per dimension); rows: None (every position) or int64\n"
"positions of ``indices`` to read (the others are missing); dims: the field's shape, -1 where it\n"
"varies; unit: bytes of one unit (the fixed tail after the last varying dimension, times the\n"
"itemsize); align: every value's offset is a multiple of it (>= 1). Fills ``offsets`` (int64, len(indices) + 1, in units) and ``shapes`` (None, or int64\n"
"len(indices) x len(dims): each row's shape; a missing or bad row's head is 0, its tail the field's).\n"
"Calls ``alloc((total units, *tail))`` for a writable buffer of at least total units x unit bytes (the\n"
"values array), copies into it\n"
"and returns it with the list of positions whose descriptor is impossible (a dimension that differs\n"
"from a fixed one, a value that does not lie within the region, or an offset not a multiple of align).");

static PyObject *
gather(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_Format(PyExc_TypeError, "gather takes 11 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *result = NULL, *out = NULL, *bad = NULL;
    Py_buffer region = {0}, table = {0}, indices = {0}, rows = {0}, offsets = {0}, shapes = {0}, dest = {0};
    uint64_t *starts = NULL, *units = NULL, *raw = NULL;
    unsigned char *status = NULL;

    Py_ssize_t width = PyLong_AsSsize_t(args[2]);
    Py_ssize_t unit = PyLong_AsSsize_t(args[6]);
    Py_ssize_t align = PyLong_AsSsize_t(args[7]);
    if ((width == -1 || unit == -1 || align == -1) && PyErr_Occurred())
        return NULL;
    PyObject *dims = args[5];
    if (!PyTuple_Check(dims) || PyTuple_GET_SIZE(dims) < 1 || PyTuple_GET_SIZE(dims) > MAX_DIMS) {
        PyErr_SetString(PyExc_TypeError, "gather: dims must be a tuple of 1 to 32 ints");
        return NULL;
    }
    int ndim = (int)PyTuple_GET_SIZE(dims), head = 0;
    long long fixed[MAX_DIMS];
    for (int a = 0; a < ndim; a++) {
        fixed[a] = PyLong_AsLongLong(PyTuple_GET_ITEM(dims, a));
        if (fixed[a] == -1 && PyErr_Occurred())
            return NULL;
        if (fixed[a] < -1) {
            PyErr_SetString(PyExc_ValueError, "gather: a dimension must be -1 (varies) or >= 0");
            return NULL;
        }
        if (fixed[a] == -1)
            head = a + 1;
    }
    if (head == 0 || unit < 0 || align < 1 || width < 8 + 4 * (Py_ssize_t)ndim || width % 8) {
        PyErr_SetString(PyExc_ValueError, "gather: no varying dimension, a negative unit, an align below 1, or descriptors too narrow (or not whole words)");
        return NULL;
    }
    /* A unit of 0 bytes (a tail with a 0 in it) still counts units: at most one per byte of the region. */
    uint64_t per_unit = unit ? (uint64_t)unit : 1;

    if (get_buffer(args[0], &region, PyBUF_SIMPLE, "region") < 0)
        goto done;
    if (get_buffer(args[1], &table, PyBUF_SIMPLE, "table") < 0)
        goto done;
    if (get_int64s(args[3], &indices, 0, -1, "indices") < 0)
        goto done;
    Py_ssize_t count = indices.len / 8;
    if (args[4] != Py_None && get_int64s(args[4], &rows, 0, -1, "rows") < 0)
        goto done;
    if (get_int64s(args[8], &offsets, 1, count + 1, "offsets") < 0)
        goto done;
    if (args[9] != Py_None && get_int64s(args[9], &shapes, 1, count * ndim, "shapes") < 0)
        goto done;

    starts = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(uint64_t));
    units = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(uint64_t));
    status = PyMem_Malloc((size_t)(count ? count : 1));
    raw = PyMem_Malloc((size_t)(count ? count : 1) * (size_t)width);
    if (!starts || !units || !status || !raw) {
        PyErr_NoMemory();
        goto done;
    }
    if (rows.obj) {
        memset(status, ROW_MISSING, (size_t)count);
        const int64_t *wanted = rows.buf;
        for (Py_ssize_t r = 0; r < rows.len / 8; r++) {
            if (wanted[r] < 0 || wanted[r] >= count) {
                PyErr_Format(PyExc_IndexError, "gather: row %lld is not a position in a batch of %zd",
                             (long long)wanted[r], count);
                goto done;
            }
            status[wanted[r]] = ROW_OK;
        }
    } else {
        memset(status, ROW_OK, (size_t)count);
    }

    /* Pass 1: the descriptors copied into our own memory by a loop short enough that the CPU has many of
     * their cache misses in flight at once (a longer loop body, decoding as it goes, took 5x as long on
     * cold rows), then checked there: only these copies are used from now on. */
    const int64_t *idx = indices.buf;
    const unsigned char *base = table.buf;
    const uint64_t size = (uint64_t)region.len, slots = (uint64_t)(table.len / width);
    const size_t words = (size_t)width / 8;
    for (Py_ssize_t k = 0; k < count; k++) {
        if (status[k] == ROW_OK && (idx[k] < 0 || (uint64_t)idx[k] >= slots)) {
            PyErr_Format(PyExc_IndexError, "gather: slot %lld is outside a table of %llu", (long long)idx[k],
                         (unsigned long long)slots);
            goto done;
        }
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        if (status[k] != ROW_OK)
            continue;
        const unsigned char *from = base + (size_t)idx[k] * (size_t)width;
        uint64_t *to = raw + (size_t)k * words;
        if (k + DESCRIPTORS_AHEAD < count && status[k + DESCRIPTORS_AHEAD] == ROW_OK)
            __builtin_prefetch(base + (size_t)idx[k + DESCRIPTORS_AHEAD] * (size_t)width);
        for (size_t w = 0; w < words; w++)
            memcpy(to + w, from + 8 * w, 8);
    }
    int64_t *offs = offsets.buf, *shape_out = shapes.obj ? shapes.buf : NULL;
    uint64_t total_units = 0, total_bytes = 0;
    Py_ssize_t nbad = 0;
    offs[0] = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        uint32_t d[MAX_DIMS];
        uint64_t n = 0, start = 0;
        if (status[k] == ROW_OK) {
            const unsigned char *desc = (const unsigned char *)(raw + (size_t)k * words);
            uint64_t raw_start;
            memcpy(&raw_start, desc, 8);
            memcpy(d, desc + 8, 4 * (size_t)ndim);
            start = le64toh(raw_start);
            n = 1;
            int ok = 1;
            for (int a = 0; a < ndim; a++) {
                d[a] = le32toh(d[a]);
                if (fixed[a] >= 0 && (uint64_t)d[a] != (uint64_t)fixed[a])
                    ok = 0;
                if (a < head && __builtin_mul_overflow(n, (uint64_t)d[a], &n))
                    ok = 0;
            }
            uint64_t extent;
            if (!ok || __builtin_mul_overflow(n, per_unit, &extent) || start > size || extent > size - start || start % (uint64_t)align
                || total_units + n < total_units || total_units + n > (uint64_t)INT64_MAX) {
                status[k] = ROW_BAD;
                nbad++;
                n = 0;
            }
        }
        starts[k] = start;
        units[k] = n;
        total_units += n;
        total_bytes += n * (uint64_t)unit; /* within the region, so no overflow: a sum of <= count regions */
        offs[k + 1] = (int64_t)total_units;
        if (shape_out) {
            int64_t *s = shape_out + k * ndim;
            for (int a = 0; a < ndim; a++)
                s[a] = status[k] == ROW_OK ? (int64_t)d[a] : (a < head ? 0 : fixed[a]);
        }
    }

    bad = PyList_New(nbad);
    if (!bad)
        goto done;
    for (Py_ssize_t k = 0, j = 0; j < nbad; k++) {
        if (status[k] == ROW_BAD) {
            PyObject *position = PyLong_FromSsize_t(k);
            if (!position)
                goto done;
            PyList_SET_ITEM(bad, j++, position);
        }
    }

    /* Pass 2: one memcpy per row, into the caller's buffer. */
    PyObject *shape = PyTuple_New(1 + ndim - head);
    if (!shape)
        goto done;
    for (int a = 0; a <= ndim - head; a++) {
        PyObject *d = a ? PyLong_FromLongLong(fixed[head + a - 1]) : PyLong_FromUnsignedLongLong(total_units);
        if (!d) {
            Py_DECREF(shape);
            goto done;
        }
        PyTuple_SET_ITEM(shape, a, d);
    }
    out = PyObject_CallOneArg(args[10], shape);
    Py_DECREF(shape);
    if (!out)
        goto done;
    if (get_buffer(out, &dest, PyBUF_WRITABLE, "what alloc returned") < 0)
        goto done;
    if ((uint64_t)dest.len < total_bytes) {
        PyErr_Format(PyExc_ValueError, "gather: alloc gave %zd bytes for %llu", dest.len,
                     (unsigned long long)total_bytes);
        goto done;
    }
    {
        const char *src = region.buf;
        char *to = dest.buf;
        PyThreadState *saved = total_bytes >= FREE_GIL_FROM ? PyEval_SaveThread() : NULL;
        for (Py_ssize_t k = 0; k < count; k++) {
            size_t nbytes = (size_t)(units[k] * (uint64_t)unit);
            if (k + AHEAD < count && units[k + AHEAD]) {
                __builtin_prefetch(src + starts[k + AHEAD]);
                __builtin_prefetch(src + starts[k + AHEAD] + 64);
            }
            if (nbytes) {
                memcpy(to, src + starts[k], nbytes);
                to += nbytes;
            }
        }
        if (saved)
            PyEval_RestoreThread(saved);
    }
    result = PyTuple_Pack(2, out, bad);

done:
    PyMem_Free(starts);
    PyMem_Free(units);
    PyMem_Free(status);
    PyMem_Free(raw);
    if (dest.obj)
        PyBuffer_Release(&dest);
    if (shapes.obj)
        PyBuffer_Release(&shapes);
    if (offsets.obj)
        PyBuffer_Release(&offsets);
    if (rows.obj)
        PyBuffer_Release(&rows);
    if (indices.obj)
        PyBuffer_Release(&indices);
    if (table.obj)
        PyBuffer_Release(&table);
    if (region.obj)
        PyBuffer_Release(&region);
    Py_XDECREF(out);
    Py_XDECREF(bad);
    return result;
}

PyDoc_STRVAR(pad_doc,
"pad(values, offsets, fill, out) -> None\n\n"
"Rows of a batch padded into one array: row k (units offsets[k] to offsets[k + 1] of ``values``) is\n"
"copied to the start of row k of ``out``, and the rest of that row is filled with ``fill``.\n\n"
"values: the rows back to back (bytes); offsets: int64, len(rows) + 1, nondecreasing, from >= 0, in\n"
"units; fill: the bytes of one unit of padding (its length is the unit: the fixed tail times the\n"
"itemsize); out: writable, len(rows) rows of (longest x unit) bytes each, longest >= every row's length.");

static PyObject *
pad(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "pad takes 4 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer values = {0}, offsets = {0}, fill = {0}, out = {0};
    if (get_buffer(args[0], &values, PyBUF_SIMPLE, "values") < 0)
        goto done;
    if (get_int64s(args[1], &offsets, 0, -1, "offsets") < 0)
        goto done;
    if (get_buffer(args[2], &fill, PyBUF_SIMPLE, "fill") < 0)
        goto done;
    if (get_buffer(args[3], &out, PyBUF_WRITABLE, "out") < 0)
        goto done;
    Py_ssize_t count = offsets.len / 8 - 1;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "pad: offsets must hold len(rows) + 1 items");
        goto done;
    }
    const int64_t *offs = offsets.buf;
    const uint64_t unit = (uint64_t)fill.len;
    uint64_t row_bytes = 0;
    if (count && unit) {
        if ((uint64_t)out.len % ((uint64_t)count * unit)) {
            PyErr_Format(PyExc_ValueError, "pad: out holds %zd bytes, not a whole number of rows of %zd units of %llu bytes",
                         out.len, count, (unsigned long long)unit);
            goto done;
        }
        row_bytes = (uint64_t)out.len / (uint64_t)count;
    }
    /* Every offset checked before anything is copied: no row reads outside values or writes past its row. */
    if (offs[0] < 0) {
        PyErr_SetString(PyExc_ValueError, "pad: offsets must start at 0 or more");
        goto done;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        uint64_t nbytes;
        if (offs[k + 1] < offs[k] || __builtin_mul_overflow((uint64_t)(offs[k + 1] - offs[k]), unit, &nbytes)
            || nbytes > row_bytes) {
            PyErr_Format(PyExc_ValueError, "pad: row %zd (units %lld to %lld) does not fit a padded row of %llu bytes",
                         k, (long long)offs[k], (long long)offs[k + 1], (unsigned long long)row_bytes);
            goto done;
        }
    }
    if (unit && (uint64_t)offs[count] > (uint64_t)values.len / unit) {
        PyErr_Format(PyExc_ValueError, "pad: offsets end at unit %lld, past the %zd bytes of values",
                     (long long)offs[count], values.len);
        goto done;
    }
    if (count && unit) {
        const char *src = values.buf, *pattern = fill.buf;
        char *to = out.buf;
        int zeros = 1;
        for (uint64_t b = 0; b < unit; b++)
            zeros &= pattern[b] == 0;
        PyThreadState *saved = (uint64_t)out.len >= FREE_GIL_FROM ? PyEval_SaveThread() : NULL;
        for (Py_ssize_t k = 0; k < count; k++, to += row_bytes) {
            uint64_t nbytes = (uint64_t)(offs[k + 1] - offs[k]) * unit;
            memcpy(to, src + (uint64_t)offs[k] * unit, nbytes);
            if (zeros)
                memset(to + nbytes, 0, row_bytes - nbytes);
            else if (unit == 1)
                memset(to + nbytes, pattern[0], row_bytes - nbytes);
            else
                for (uint64_t at = nbytes; at < row_bytes; at += unit)
                    memcpy(to + at, pattern, unit);
        }
        if (saved)
            PyEval_RestoreThread(saved);
    }
    result = Py_NewRef(Py_None);

done:
    if (out.obj)
        PyBuffer_Release(&out);
    if (fill.obj)
        PyBuffer_Release(&fill);
    if (offsets.obj)
        PyBuffer_Release(&offsets);
    if (values.obj)
        PyBuffer_Release(&values);
    return result;
}

PyDoc_STRVAR(take_doc,
"take(table, record, ready, indices, sources, outs, hits, length[, at]) -> int\n\n"
"Rows of fixed fields for the slots ``indices`` that are READY, in one pass that reads each slot's state.\n\n"
"table: the slot table (``record`` bytes a slot, the state in its first byte); ready: the READY state;\n"
"indices: int64 slot positions >= 0 (one at or past the table's end is not READY); sources: a tuple of\n"
"one buffer per field, the field's rows back to back (one row per slot of the table); outs: a tuple of\n"
"writable buffers in the same order, whole rows of the field each, of which rows at .. at + len(indices) - 1\n"
"are written (at: 0 when not given; a batch read from several files takes one call a file); hits: None, or a\n"
"writable buffer of len(indices) bytes, set to 1 where the slot was READY (its rows copied) and 0 where not\n"
"(its rows left as they were). Returns how many were READY, or -1 as soon as an index is not in [0, length)\n"
"(the caller then raises: indices unchecked before). The state is read with acquire order, before the row.");

/* One file's part of a take: its slot table, indices and sources (buffers held until released). */
typedef struct {
    Py_buffer table, indices;
    Py_buffer src[MAX_FIELDS];
    Py_ssize_t opened; /* sources held */
    Py_ssize_t record, at, count;
    long ready;
    unsigned long long length;
    uint64_t slots;
    size_t rows[MAX_FIELDS];
} Part;

static void
release_part(Part *part)
{
    for (Py_ssize_t f = 0; f < part->opened; f++)
        PyBuffer_Release(&part->src[f]);
    part->opened = 0;
    if (part->indices.obj)
        PyBuffer_Release(&part->indices);
    if (part->table.obj)
        PyBuffer_Release(&part->table);
}

/* Holds a part's buffers (the caller releases them, also on failure) and checks them against outs. Returns 0,
 * 1 when an index is not in [0, length) (nothing is copied then: the caller raises), or -1 with an error set. */
static int
open_part(Part *part, PyObject *const *args, PyObject *sources, Py_ssize_t nfields, const Py_buffer *dst)
{
    part->record = PyLong_AsSsize_t(args[1]);
    part->ready = PyLong_AsLong(args[2]);
    part->length = PyLong_AsUnsignedLongLong(args[5]); /* a length may pass int64 */
    part->at = PyLong_AsSsize_t(args[6]);
    if ((part->record == -1 || part->ready == -1 || part->length == (unsigned long long)-1 || part->at == -1)
        && PyErr_Occurred())
        return -1;
    if (part->record < 1 || part->ready < 0 || part->ready > 255 || part->at < 0) {
        PyErr_SetString(PyExc_ValueError, "take: record must be >= 1, ready a byte and at >= 0");
        return -1;
    }
    if (!PyTuple_Check(sources) || PyTuple_GET_SIZE(sources) != nfields) {
        PyErr_Format(PyExc_TypeError, "take: sources and outs must be tuples of as many buffers (at most %d)",
                     MAX_FIELDS);
        return -1;
    }
    if (get_buffer(args[0], &part->table, PyBUF_SIMPLE, "table") < 0)
        return -1;
    if (get_int64s(args[3], &part->indices, 0, -1, "indices") < 0)
        return -1;
    part->count = part->indices.len / 8;
    part->slots = (uint64_t)(part->table.len / part->record);
    const int64_t *idx = part->indices.buf;
    const char *states = part->table.buf;
    for (Py_ssize_t k = 0; k < part->count; k++) {
        if (idx[k] < 0 || (uint64_t)idx[k] >= (uint64_t)part->length)
            return 1;
        if (k < STATES_AHEAD && (uint64_t)idx[k] < part->slots) /* the first states, asked for now */
            __builtin_prefetch(states + (uint64_t)idx[k] * (uint64_t)part->record);
    }
    for (; part->opened < nfields; part->opened++) {
        Py_ssize_t f = part->opened;
        if (get_buffer(PyTuple_GET_ITEM(sources, f), &part->src[f], PyBUF_SIMPLE, "a source") < 0)
            return -1;
        if (part->slots == 0) { /* an empty table (a cache of length 0): nothing is READY, nothing to copy */
            part->rows[f] = 0;
            continue;
        }
        if (part->src[f].len % (Py_ssize_t)part->slots) {
            PyErr_Format(PyExc_ValueError, "take: source %zd holds %zd bytes, not one row per slot of %llu", f,
                         part->src[f].len, (unsigned long long)part->slots);
            part->opened++;
            return -1;
        }
        part->rows[f] = (size_t)part->src[f].len / (size_t)part->slots;
        /* Whole rows, at least at + count of them (overflow-free: both sides are sizes of buffers in memory). */
        size_t rows = part->rows[f];
        if (rows ? (size_t)dst[f].len % rows || (size_t)dst[f].len / rows < (size_t)part->at + (size_t)part->count
                 : dst[f].len != 0) {
            PyErr_Format(PyExc_ValueError, "take: out %zd holds %zd bytes, not rows of %zu to write %zd from row %zd",
                         f, dst[f].len, rows, part->count, part->at);
            part->opened++;
            return -1;
        }
    }
    return 0;
}

/* The rows of the READY slots of every part into the outs, in one pass whose look-ahead runs on across parts.
 * hits: NULL or a byte a row of all parts, one after another; found: each part's READY slots. */
static void
copy_parts(const Part *parts, Py_ssize_t nparts, Py_ssize_t nfields, const Py_buffer *dst, unsigned char *hit,
           Py_ssize_t *found)
{
    /* Cursors STATES_AHEAD and TAKE_ROWS_AHEAD rows ahead of the copy: (part, row). */
    Py_ssize_t sp = 0, sk = 0, rp = 0, rk = 0;
#define ADVANCE(p, k)                                                                                                  \
    do {                                                                                                               \
        (k)++;                                                                                                         \
        while ((p) < nparts && (k) >= parts[p].count) {                                                               \
            (p)++;                                                                                                     \
            (k) = 0;                                                                                                   \
        }                                                                                                              \
    } while (0)
#define PREFETCH_ROWS(p, k)                                                                                            \
    do {                                                                                                               \
        uint64_t j = (uint64_t)((const int64_t *)parts[p].indices.buf)[k];                                            \
        if (j < parts[p].slots)                                                                                        \
            for (Py_ssize_t f = 0; f < nfields; f++)                                                                   \
                __builtin_prefetch((const char *)parts[p].src[f].buf + (size_t)j * parts[p].rows[f]);                \
    } while (0)
#define PREFETCH_STATE(p, k)                                                                                           \
    do {                                                                                                               \
        uint64_t j = (uint64_t)((const int64_t *)parts[p].indices.buf)[k];                                            \
        if (j < parts[p].slots)                                                                                        \
            __builtin_prefetch((const char *)parts[p].table.buf + j * (uint64_t)parts[p].record);                     \
    } while (0)
    while (sp < nparts && parts[sp].count == 0)
        sp++;
    rp = sp;
    for (Py_ssize_t n = 0; n < STATES_AHEAD && sp < nparts; n++) /* each part's first states: asked for as it opened */
        ADVANCE(sp, sk);
    for (Py_ssize_t n = 0; n < TAKE_ROWS_AHEAD && rp < nparts; n++) { /* the first rows, asked for now */
        PREFETCH_ROWS(rp, rk);
        ADVANCE(rp, rk);
    }
    Py_ssize_t row = 0;
    for (Py_ssize_t p = 0; p < nparts; p++) {
        const Part *part = &parts[p];
        const int64_t *idx = part->indices.buf;
        const unsigned char *states = part->table.buf;
        Py_ssize_t got = 0;
        for (Py_ssize_t k = 0; k < part->count; k++, row++) {
            if (sp < nparts) {
                PREFETCH_STATE(sp, sk);
                ADVANCE(sp, sk);
            }
            if (rp < nparts) {
                PREFETCH_ROWS(rp, rk);
                ADVANCE(rp, rk);
            }
            uint64_t i = (uint64_t)idx[k];
            /* Acquire: a READY state is read before the row it publishes (the writer's release store). */
            int ok = i < part->slots
                     && __atomic_load_n(states + i * (uint64_t)part->record, __ATOMIC_ACQUIRE) == part->ready;
            if (hit)
                hit[row] = (unsigned char)ok;
            if (!ok)
                continue;
            got++;
            for (Py_ssize_t f = 0; f < nfields; f++)
                memcpy((char *)dst[f].buf + (size_t)(part->at + k) * part->rows[f],
                       (const char *)part->src[f].buf + i * part->rows[f], part->rows[f]);
        }
        found[p] = got;
    }
#undef ADVANCE
#undef PREFETCH_ROWS
#undef PREFETCH_STATE
}

/* Holds the outs (writable buffers, a tuple of at most MAX_FIELDS); returns how many, or -1. */
static Py_ssize_t
open_outs(PyObject *outs, Py_buffer *dst)
{
    if (!PyTuple_Check(outs) || PyTuple_GET_SIZE(outs) > MAX_FIELDS) {
        PyErr_Format(PyExc_TypeError, "take: sources and outs must be tuples of as many buffers (at most %d)",
                     MAX_FIELDS);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(outs);
    for (Py_ssize_t f = 0; f < n; f++)
        if (get_buffer(PyTuple_GET_ITEM(outs, f), &dst[f], PyBUF_WRITABLE, "an out") < 0) {
            while (f--)
                PyBuffer_Release(&dst[f]);
            return -1;
        }
    return n;
}

static uint64_t
bytes_of(const Part *parts, Py_ssize_t nparts, Py_ssize_t nfields)
{
    uint64_t total = 0;
    for (Py_ssize_t p = 0; p < nparts; p++)
        for (Py_ssize_t f = 0; f < nfields; f++)
            total += (uint64_t)parts[p].count * parts[p].rows[f];
    return total;
}

static PyObject *
take(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8 && nargs != 9) {
        PyErr_Format(PyExc_TypeError, "take takes 8 or 9 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer dst[MAX_FIELDS], hits = {0};
    Part part = {0};
    Py_ssize_t nfields = open_outs(args[5], dst);
    if (nfields < 0)
        return NULL;
    PyObject *zero = NULL;
    if (nargs == 8 && !(zero = PyLong_FromLong(0)))
        goto done;
    /* The part's arguments in open_part's order: table, record, ready, indices, -, length, at. */
    PyObject *const part_args[7] = {args[0], args[1], args[2], args[3], NULL, args[7], nargs == 9 ? args[8] : zero};
    int opened = open_part(&part, part_args, args[4], nfields, dst);
    if (opened < 0)
        goto done;
    if (opened == 1) {
        result = PyLong_FromLong(-1);
        goto done;
    }
    if (args[6] != Py_None) {
        if (get_buffer(args[6], &hits, PyBUF_WRITABLE, "hits") < 0)
            goto done;
        if (hits.len != part.count) {
            PyErr_Format(PyExc_ValueError, "take: hits must hold %zd bytes, got %zd", part.count, hits.len);
            goto done;
        }
    }
    Py_ssize_t found = 0;
    if (part.slots == 0) { /* nothing is READY */
        if (hits.obj)
            memset(hits.buf, 0, (size_t)part.count);
    } else {
        PyThreadState *saved = bytes_of(&part, 1, nfields) >= FREE_GIL_FROM ? PyEval_SaveThread() : NULL;
        copy_parts(&part, 1, nfields, dst, hits.obj ? hits.buf : NULL, &found);
        if (saved)
            PyEval_RestoreThread(saved);
    }
    result = PyLong_FromSsize_t(found);

done:
    release_part(&part);
    for (Py_ssize_t f = 0; f < nfields; f++)
        PyBuffer_Release(&dst[f]);
    if (hits.obj)
        PyBuffer_Release(&hits);
    Py_XDECREF(zero);
    return result;
}

PyDoc_STRVAR(take_parts_doc,
"take_parts(parts, outs) -> tuple[int, ...]\n\n"
"take() of several files into one batch, in one pass: ``parts`` is a tuple of ``(table, record, ready,\n"
"indices, sources, length, at)``, one a file, each as take()'s arguments (no hits); every part's sources\n"
"have the rows of ``outs``. Returns each part's READY count, or -1 for a part with an index not in\n"
"[0, its length) (that part copies nothing).");

static PyObject *
take_parts(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "take_parts takes a tuple of parts and a tuple of outs");
        return NULL;
    }
    PyObject *result = NULL, *list = args[0];
    Py_ssize_t nparts = PyTuple_GET_SIZE(list), opened = 0, bad = 0;
    Py_buffer dst[MAX_FIELDS];
    Py_ssize_t nfields = open_outs(args[1], dst);
    if (nfields < 0)
        return NULL;
    Part *parts = PyMem_Calloc((size_t)(nparts ? nparts : 1), sizeof(Part));
    Py_ssize_t *found = PyMem_Calloc((size_t)(nparts ? nparts : 1), sizeof(Py_ssize_t));
    if (!parts || !found) {
        PyErr_NoMemory();
        goto done;
    }
    for (; opened < nparts; opened++) {
        PyObject *item = PyTuple_GET_ITEM(list, opened);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 7) {
            PyErr_SetString(PyExc_TypeError,
                            "take_parts: a part is (table, record, ready, indices, sources, length, at)");
            goto done;
        }
        PyObject *const *fields = &PyTuple_GET_ITEM(item, 0);
        int state = open_part(&parts[opened], fields, fields[4], nfields, dst);
        if (state < 0) {
            opened++;
            goto done;
        }
        if (state == 1) { /* an index out of range: this part reads nothing, and says so */
            parts[opened].count = 0;
            bad = 1;
        }
    }
    {
        PyThreadState *saved = bytes_of(parts, nparts, nfields) >= FREE_GIL_FROM ? PyEval_SaveThread() : NULL;
        copy_parts(parts, nparts, nfields, dst, NULL, found);
        if (saved)
            PyEval_RestoreThread(saved);
    }
    for (Py_ssize_t p = 0; bad && p < nparts; p++)
        if (parts[p].count == 0 && parts[p].indices.len)
            found[p] = -1;
    result = PyTuple_New(nparts);
    for (Py_ssize_t p = 0; result && p < nparts; p++) {
        PyObject *value = PyLong_FromSsize_t(found[p]);
        if (!value) {
            Py_CLEAR(result);
            break;
        }
        PyTuple_SET_ITEM(result, p, value);
    }

done:
    for (Py_ssize_t p = 0; p < opened && parts; p++)
        release_part(&parts[p]);
    for (Py_ssize_t f = 0; f < nfields; f++)
        PyBuffer_Release(&dst[f]);
    PyMem_Free(parts);
    PyMem_Free(found);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", (PyCFunction)(void (*)(void))gather, METH_FASTCALL, gather_doc},
    {"pad", (PyCFunction)(void (*)(void))pad, METH_FASTCALL, pad_doc},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL, take_doc},
    {"take_parts", (PyCFunction)(void (*)(void))take_parts, METH_FASTCALL, take_parts_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_cgather",
    .m_doc = "The compiled gather of a variable field, its padding, the one-pass read of fixed fields (see _cgather.c), "
             "and a mixture's draws (see _cdraws.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__cgather(void)
{
    PyObject *made = PyModule_Create(&module);
    if (made && PyModule_AddFunctions(made, cdraws_methods) < 0)
        Py_CLEAR(made);
    return made;
}
