/* A mixture's draws, compiled (mmapcache/torch/_draws.py and _sampler.py hold the numpy twins, which give the
 * same result; tests/region/test_cgather.py holds the two against each other):
 *
 * - `permute`: numpy's Generator(PCG64).permutation, exactly, its draws inlined (the seeded permutations);
 * - `codes`: the sources of consecutive positions, from their phases;
 * - `deal`: each position's index, dealt from its source's draws;
 * - `group`: ranges of positions counting-sorted by source, one pass a range instead of a sort.
 *
 * Part of the mmapcache._region._cgather extension: _cgather.c adds `cdraws_methods` to the module.
 */
#include "_cbuffers.h"

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

PyMethodDef cdraws_methods[] = {
    {"codes", (PyCFunction)(void (*)(void))codes, METH_FASTCALL, codes_doc},
    {"permute", (PyCFunction)(void (*)(void))permute, METH_FASTCALL, permute_doc},
    {"deal", (PyCFunction)(void (*)(void))deal, METH_FASTCALL, deal_doc},
    {"group", (PyCFunction)(void (*)(void))group, METH_FASTCALL, group_doc},
    {NULL, NULL, 0, NULL},
};
