/* The buffer checks _cgather.c and _cdraws.c share (one extension, mmapcache._region._cgather). */
#ifndef MMAPCACHE_CBUFFERS_H
#define MMAPCACHE_CBUFFERS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

static inline int
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
static inline int
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

/* The mixture draws' functions (_cdraws.c), added to the module as it is made. */
extern PyMethodDef cdraws_methods[];

#endif
