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
 * `permute` is numpy's Generator(PCG64).permutation, exactly (mmapcache/torch/_sampler.py's seeded
 * permutations; tests hold it against numpy's), with its draws inlined.
 *
 * `codes`, `deal` and `group` are a mixture's draws (mmapcache/torch/_draws.py, whose numpy twins give the
 * same result): the sources of consecutive positions from their phases, each position's index dealt from its
 * source's draws, and ranges of positions counting-sorted by source, one pass a range instead of a sort.
 *
 * No numpy C API: buffers come through the buffer protocol, the output from a Python callable.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <endian.h>
#include <stdint.h>
#include <string.h>

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



static int
get_buffer(PyObject *obj, Py_buffer *view, int flags, const char *what)
{
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_TypeError, "_cgather: %s must be a C-contiguous%s buffer", what,
                     flags & PyBUF_WRITABLE ? " writable" : "");
        return -1;
    }
    return 0;
}

/* An int64 array (numpy int64/intp) of exactly `count` items, or count < 0 for any length. */
static int
get_int64s(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t count, const char *what)
{
    if (get_buffer(obj, view, PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0), what) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l") && strcmp(f, "n"))) {
        PyErr_Format(PyExc_TypeError, "_cgather: %s must hold int64, got format %s", what, view->format);
        PyBuffer_Release(view);
        return -1;
    }
    if (count >= 0 && view->len != count * 8) {
        PyErr_Format(PyExc_ValueError, "_cgather: %s must hold %zd items, got %zd", what, count, view->len / 8);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

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

/* -- a mixture's draws: dealt to positions, grouped by source (mmapcache/torch/_draws.py holds the numpy twins) */

/* An int64 buffer of `count` items (count < 0: any), its items checked to lie in [0, bound) when bound > 0. */
static int
get_codes(PyObject *obj, Py_buffer *view, Py_ssize_t count, long long bound, const char *what)
{
    if (get_int64s(obj, view, 0, count, what) < 0)
        return -1;
    const int64_t *code = view->buf;
    for (Py_ssize_t k = 0; k < view->len / 8; k++)
        if (code[k] < 0 || code[k] >= bound) {
            PyErr_Format(PyExc_ValueError, "_cgather: %s holds %lld, not in [0, %lld)", what, (long long)code[k],
                         bound);
            PyBuffer_Release(view);
            return -1;
        }
    return 0;
}

/* numpy's PCG64 (XSL-RR output of a 128-bit LCG) with its buffered 32-bit draws, and its Generator's
 * Fisher-Yates shuffle (random_interval: masked rejection), so that `permute` gives exactly
 * Generator(PCG64(key)).permutation(n): each draw inlined instead of called through a function pointer. */
typedef struct {
    unsigned __int128 state, inc;
    int has_uint32;
    uint32_t uinteger;
} Pcg64;

static inline uint64_t
pcg64_next64(Pcg64 *rng)
{
    const unsigned __int128 multiplier =
        ((unsigned __int128)2549297995355413924ULL << 64) | (unsigned __int128)4865540595714422341ULL;
    rng->state = rng->state * multiplier + rng->inc;
    uint64_t high = (uint64_t)(rng->state >> 64), low = (uint64_t)rng->state;
    unsigned rot = (unsigned)(rng->state >> 122);
    uint64_t x = high ^ low;
    return (x >> rot) | (x << ((-rot) & 63));
}

static inline uint32_t
pcg64_next32(Pcg64 *rng)
{
    if (rng->has_uint32) {
        rng->has_uint32 = 0;
        return rng->uinteger;
    }
    uint64_t next = pcg64_next64(rng);
    rng->has_uint32 = 1;
    rng->uinteger = (uint32_t)(next >> 32);
    return (uint32_t)(next & 0xffffffffULL);
}

static inline uint64_t
random_interval(Pcg64 *rng, uint64_t max)
{
    if (max == 0)
        return 0;
    uint64_t mask = max, value;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    mask |= mask >> 32;
    if (max <= 0xffffffffULL) {
        while ((value = (pcg64_next32(rng) & mask)) > max)
            ;
    } else {
        while ((value = (pcg64_next64(rng) & mask)) > max)
            ;
    }
    return value;
}

static int
get_u128(PyObject *obj, unsigned __int128 *value, const char *what)
{
    PyObject *low_mask = PyLong_FromUnsignedLongLong(0xffffffffffffffffULL), *sixty_four = PyLong_FromLong(64);
    PyObject *zero = PyLong_FromLong(0), *low = NULL, *high = NULL;
    int ok = -1;
    if (!low_mask || !sixty_four || !zero || !PyLong_Check(obj) || PyObject_RichCompareBool(obj, zero, Py_LT)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "permute: %s must be an integer in [0, 2**128)", what);
        goto done;
    }
    low = PyNumber_And(obj, low_mask);
    high = PyNumber_Rshift(obj, sixty_four);
    if (!low || !high)
        goto done;
    unsigned long long lo = PyLong_AsUnsignedLongLong(low), hi = PyLong_AsUnsignedLongLong(high);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "permute: %s must be an integer in [0, 2**128)", what);
        goto done;
    }
    *value = ((unsigned __int128)hi << 64) | lo;
    ok = 0;
done:
    Py_XDECREF(low_mask);
    Py_XDECREF(sixty_four);
    Py_XDECREF(zero);
    Py_XDECREF(low);
    Py_XDECREF(high);
    return ok;
}

PyDoc_STRVAR(permute_doc,
"permute(state, inc, has_uint32, uinteger, out) -> None\n\n"
"out (writable int64) := numpy's Generator(PCG64 with this state).permutation(len(out)): arange, then\n"
"the Generator's shuffle. state, inc: the bit generator's 128-bit state and increment; has_uint32,\n"
"uinteger: its buffered 32-bit draw (bit_generator.state['has_uint32'], ['uinteger']).");

static PyObject *
permute(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "permute takes 5 arguments, got %zd", nargs);
        return NULL;
    }
    Pcg64 rng;
    if (get_u128(args[0], &rng.state, "state") < 0 || get_u128(args[1], &rng.inc, "inc") < 0)
        return NULL;
    long has = PyLong_AsLong(args[2]);
    unsigned long long buffered = PyLong_AsUnsignedLongLong(args[3]);
    if ((has == -1 || buffered == (unsigned long long)-1) && PyErr_Occurred())
        return NULL;
    rng.has_uint32 = has != 0;
    rng.uinteger = (uint32_t)buffered;
    Py_buffer out = {0};
    if (get_int64s(args[4], &out, 1, -1, "out") < 0)
        return NULL;
    int64_t *order = out.buf;
    Py_ssize_t n = out.len / 8;
    for (Py_ssize_t i = 0; i < n; i++)
        order[i] = i;
    for (Py_ssize_t i = n - 1; i >= 1; i--) {
        uint64_t j = random_interval(&rng, (uint64_t)i);
        int64_t swapped = order[j];
        order[j] = order[i];
        order[i] = swapped;
    }
    PyBuffer_Release(&out);
    return Py_NewRef(Py_None);
}

PyDoc_STRVAR(codes_doc,
"codes(start_phase, step, modulus, cuts, out) -> None\n\n"
"The source of consecutive positions: out[k] = how many of cuts[1:] are at or below the phase\n"
"(start_phase + k * step) mod modulus (numpy's searchsorted(cuts[1:], phases, side='right')).\n\n"
"cuts: int64, non-decreasing, cuts[0] = 0 and cuts[-1] = modulus; 0 <= start_phase, step < modulus < 2**62;\n"
"out: writable int64.");

static PyObject *
codes(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "codes takes 5 arguments, got %zd", nargs);
        return NULL;
    }
    long long start = PyLong_AsLongLong(args[0]), step = PyLong_AsLongLong(args[1]);
    long long modulus = PyLong_AsLongLong(args[2]);
    if ((start == -1 || step == -1 || modulus == -1) && PyErr_Occurred())
        return NULL;
    if (modulus < 1 || modulus >= (1LL << 62) || start < 0 || start >= modulus || step < 0 || step >= modulus) {
        PyErr_SetString(PyExc_ValueError, "codes: 0 <= start_phase, step < modulus < 2**62");
        return NULL;
    }
    Py_buffer cuts = {0}, out = {0};
    PyObject *result = NULL;
    if (get_int64s(args[3], &cuts, 0, -1, "cuts") < 0 || get_int64s(args[4], &out, 1, -1, "out") < 0)
        goto done;
    Py_ssize_t ncuts = cuts.len / 8;
    const int64_t *cut = cuts.buf;
    if (ncuts < 2 || cut[0] != 0 || cut[ncuts - 1] != modulus) {
        PyErr_SetString(PyExc_ValueError, "codes: cuts run from 0 to the modulus");
        goto done;
    }
    for (Py_ssize_t j = 1; j < ncuts; j++)
        if (cut[j] < cut[j - 1]) {
            PyErr_SetString(PyExc_ValueError, "codes: cuts must not decrease");
            goto done;
        }
    int64_t *code = out.buf;
    Py_ssize_t count = out.len / 8, inner = ncuts - 2; /* cuts[1 .. ncuts - 2]: cuts[-1] is above every phase */
    long long phase = start;
    if (inner <= 8) {
        for (Py_ssize_t k = 0; k < count; k++) {
            int64_t c = 0;
            for (Py_ssize_t j = 1; j <= inner; j++)
                c += phase >= cut[j];
            code[k] = c;
            phase += step;
            if (phase >= modulus)
                phase -= modulus;
        }
    } else {
        for (Py_ssize_t k = 0; k < count; k++) {
            Py_ssize_t lo = 1, hi = inner + 1; /* the first of cuts[1 .. inner] above the phase, in [lo, hi] */
            while (lo < hi) {
                Py_ssize_t mid = lo + (hi - lo) / 2;
                if (cut[mid] <= phase)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            code[k] = lo - 1;
            phase += step;
            if (phase >= modulus)
                phase -= modulus;
        }
    }
    result = Py_NewRef(Py_None);
done:
    if (out.obj)
        PyBuffer_Release(&out);
    if (cuts.obj)
        PyBuffer_Release(&cuts);
    return result;
}

PyDoc_STRVAR(deal_doc,
"deal(codes, draws, out) -> None\n\n"
"Each position the next index drawn from its source: out[k] = draws[codes[k]][number of codes[k] before k].\n\n"
"codes: int64, the source of each position, in [0, len(draws)); draws: a tuple of int64 arrays, each\n"
"source's indices in the order of its positions, as many as the codes name it; out: writable int64, len(codes).");

static PyObject *
deal(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "deal takes codes, a tuple of draws and out");
        return NULL;
    }
    PyObject *result = NULL, *draws = args[1];
    Py_ssize_t sources = PyTuple_GET_SIZE(draws), opened = 0;
    Py_buffer codes = {0}, out = {0};
    Py_buffer *drawn = PyMem_Calloc((size_t)(sources ? sources : 1), sizeof(Py_buffer));
    Py_ssize_t *next = PyMem_Calloc((size_t)(sources ? sources : 1), sizeof(Py_ssize_t));
    if (!drawn || !next) {
        PyErr_NoMemory();
        goto done;
    }
    if (get_codes(args[0], &codes, -1, sources, "codes") < 0)
        goto done;
    if (get_int64s(args[2], &out, 1, codes.len / 8, "out") < 0)
        goto done;
    for (; opened < sources; opened++)
        if (get_int64s(PyTuple_GET_ITEM(draws, opened), &drawn[opened], 0, -1, "a source's draws") < 0)
            goto done;
    const int64_t *code = codes.buf;
    int64_t *into = out.buf;
    Py_ssize_t count = codes.len / 8;
    for (Py_ssize_t k = 0; k < count; k++) { /* each source's draws must cover its positions: counted first */
        if (next[code[k]]++ >= drawn[code[k]].len / 8) {
            PyErr_Format(PyExc_ValueError, "deal: source %lld has %zd draws, fewer than the codes name it",
                         (long long)code[k], drawn[code[k]].len / 8);
            goto done;
        }
    }
    memset(next, 0, (size_t)sources * sizeof(Py_ssize_t));
    for (Py_ssize_t k = 0; k < count; k++)
        into[k] = ((const int64_t *)drawn[code[k]].buf)[next[code[k]]++];
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t f = 0; f < opened; f++)
        PyBuffer_Release(&drawn[f]);
    if (out.obj)
        PyBuffer_Release(&out);
    if (codes.obj)
        PyBuffer_Release(&codes);
    PyMem_Free(drawn);
    PyMem_Free(next);
    return result;
}

PyDoc_STRVAR(group_doc,
"group(codes, drawn, sizes, sources, order, indices, counts) -> None\n\n"
"Ranges of positions, one after another, each grouped by source: a counting sort of each range.\n\n"
"codes, drawn: int64, a position each (its source, in [0, sources), and the index drawn); sizes: int64,\n"
"the ranges' lengths, summing to len(codes). Writes order (int64, len(codes)): each range's positions\n"
"(places in codes) by source, then in order; indices (int64, len(codes)): drawn[order]; counts (int64,\n"
"len(sizes) x sources): how many positions of each source each range has.");

static PyObject *
group(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "group takes 7 arguments, got %zd", nargs);
        return NULL;
    }
    Py_ssize_t sources = PyLong_AsSsize_t(args[3]);
    if (sources == -1 && PyErr_Occurred())
        return NULL;
    if (sources < 1) {
        PyErr_SetString(PyExc_ValueError, "group: sources must be >= 1");
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer codes = {0}, drawn = {0}, sizes = {0}, order = {0}, indices = {0}, counts = {0};
    Py_buffer *views[] = {&codes, &drawn, &sizes, &order, &indices, &counts};
    Py_ssize_t *next = PyMem_Malloc((size_t)sources * sizeof(Py_ssize_t));
    if (!next) {
        PyErr_NoMemory();
        goto done;
    }
    if (get_codes(args[0], &codes, -1, sources, "codes") < 0)
        goto done;
    Py_ssize_t count = codes.len / 8;
    if (get_int64s(args[1], &drawn, 0, count, "drawn") < 0 || get_codes(args[2], &sizes, -1, count + 1, "sizes") < 0
        || get_int64s(args[4], &order, 1, count, "order") < 0 || get_int64s(args[5], &indices, 1, count, "indices") < 0)
        goto done;
    Py_ssize_t ranges = sizes.len / 8;
    if (ranges > PY_SSIZE_T_MAX / 8 / sources) {
        PyErr_SetString(PyExc_ValueError, "group: too many ranges and sources");
        goto done;
    }
    if (get_int64s(args[6], &counts, 1, ranges * sources, "counts") < 0)
        goto done;
    const int64_t *code = codes.buf, *size = sizes.buf, *draw = drawn.buf;
    int64_t *place = order.buf, *index = indices.buf, *count_of = counts.buf;
    Py_ssize_t first = 0;
    for (Py_ssize_t r = 0; r < ranges; r++) {
        if (size[r] > count - first) {
            PyErr_Format(PyExc_ValueError, "group: the sizes sum to more than the %zd codes", count);
            goto done;
        }
        Py_ssize_t end = first + (Py_ssize_t)size[r];
        int64_t *of = count_of + r * sources;
        memset(of, 0, (size_t)sources * sizeof(int64_t));
        for (Py_ssize_t k = first; k < end; k++)
            of[code[k]]++;
        Py_ssize_t at = first;
        for (Py_ssize_t c = 0; c < sources; c++) {
            next[c] = at;
            at += (Py_ssize_t)of[c];
        }
        for (Py_ssize_t k = first; k < end; k++) {
            Py_ssize_t to = next[code[k]]++;
            place[to] = k;
            index[to] = draw[k];
        }
        first = end;
    }
    if (first != count) {
        PyErr_Format(PyExc_ValueError, "group: the sizes sum to %zd, not the %zd codes", first, count);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    for (size_t v = 0; v < sizeof views / sizeof *views; v++)
        if (views[v]->obj)
            PyBuffer_Release(views[v]);
    PyMem_Free(next);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", (PyCFunction)(void (*)(void))gather, METH_FASTCALL, gather_doc},
    {"pad", (PyCFunction)(void (*)(void))pad, METH_FASTCALL, pad_doc},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL, take_doc},
    {"take_parts", (PyCFunction)(void (*)(void))take_parts, METH_FASTCALL, take_parts_doc},
    {"codes", (PyCFunction)(void (*)(void))codes, METH_FASTCALL, codes_doc},
    {"permute", (PyCFunction)(void (*)(void))permute, METH_FASTCALL, permute_doc},
    {"deal", (PyCFunction)(void (*)(void))deal, METH_FASTCALL, deal_doc},
    {"group", (PyCFunction)(void (*)(void))group, METH_FASTCALL, group_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_cgather",
    .m_doc = "The compiled gather of a variable field, its padding, the one-pass read of fixed fields, and a mixture's "
             "draws dealt and grouped (see _cgather.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__cgather(void)
{
    return PyModule_Create(&module);
}
