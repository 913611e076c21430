/* The common case of gpumon.wire.step_encoder.StepEncoder.encode, byte for byte: a step record's
 * head, phases and counts, when every value is one the encoder writes as it is (no field left
 * out, no phase clamped or folded, no allocator statistics or GPU-timed phases: those return
 * None and the encoder formats the record itself, counting what it leaves out). Numbers are
 * written by PyOS_double_to_string with the parameters Python's %-formatting and repr() pass
 * it, so the text is the text the encoder's templates would make.
 * tests/wire/test_step_encoder.py holds the two to the same output. */

#include "hook.h"

#define FORMAT_CAP 4096

typedef struct {
    char text[FORMAT_CAP];
    Py_ssize_t n;
} Text;

static int
put(Text *t, const char *s, Py_ssize_t len)
{
    if (t->n + len > FORMAT_CAP)
        return -1;
    memcpy(t->text + t->n, s, len);
    t->n += len;
    return 0;
}

static int
put_str(Text *t, const char *s)
{
    return put(t, s, (Py_ssize_t)strlen(s));
}

static int
put_double(Text *t, double x, char code, int precision, int flags)
{
    char *s = PyOS_double_to_string(x, code, precision, flags, NULL);
    if (s == NULL)
        return -2;
    int rc = put_str(t, s);
    PyMem_Free(s);
    return rc;
}

/* A Python int in [0, high] written to t: 0; 1 outside the range or not an exact int. */
static int
put_count(Text *t, PyObject *value, long long high)
{
    if (!PyLong_CheckExact(value))
        return 1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -2;
    if (overflow || v < 0 || v > high)
        return 1;
    char digits[24];
    int len = snprintf(digits, sizeof digits, "%lld", v);
    return put(t, digits, len);
}

static long long format_max_step = -1, format_max_count = -1;
static double format_max_flops = -1.0;
static Py_ssize_t format_max_phases = -1;

PyObject *
hook_set_step_limits(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "set_step_limits(max_step, max_count, max_flops, max_phases)");
        return NULL;
    }
    long long max_step = PyLong_AsLongLong(args[0]);
    long long max_count = PyLong_AsLongLong(args[1]);
    double max_flops = PyFloat_AsDouble(args[2]);
    Py_ssize_t max_phases = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    format_max_step = max_step;
    format_max_count = max_count;
    format_max_flops = max_flops;
    format_max_phases = max_phases;
    Py_RETURN_NONE;
}

/* format_step(prefix, step, default_step, t_start, duration, phases, samples, tokens, flops) */
PyObject *
hook_format_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "format_step takes 9 arguments");
        return NULL;
    }
    if (format_max_phases < 0) /* the limits were never set */
        Py_RETURN_NONE;
    PyObject *prefix = args[0], *step = args[1], *phases = args[5];
    PyObject *samples = args[6], *tokens = args[7], *flops = args[8];
    if (!PyUnicode_Check(prefix) || !PyDict_CheckExact(phases) || !PyFloat_CheckExact(args[3]) ||
        !PyFloat_CheckExact(args[4]))
        Py_RETURN_NONE;
    double t_start = PyFloat_AS_DOUBLE(args[3]), duration = PyFloat_AS_DOUBLE(args[4]);
    Text t;
    t.n = 0;
    Py_ssize_t prefix_len;
    const char *prefix_text = PyUnicode_AsUTF8AndSize(prefix, &prefix_len);
    if (prefix_text == NULL)
        return NULL;
    int rc = put(&t, prefix_text, prefix_len);
    rc = rc ? rc : put_str(&t, ",\"step\":");
    if (rc == 0)
        rc = put_count(&t, step == Py_None ? args[2] : step, format_max_step);
    rc = rc ? rc : put_str(&t, ",\"t_start\":");
    rc = rc ? rc : put_double(&t, t_start, 'f', 6, 0);
    rc = rc ? rc : put_str(&t, ",\"duration\":");
    rc = rc ? rc : put_double(&t, duration, 'g', 9, 0);
    Py_ssize_t count = PyDict_GET_SIZE(phases);
    if (rc == 0 && count) {
        if (count > format_max_phases)
            Py_RETURN_NONE;
        rc = put_str(&t, ",\"phases\":{");
        Py_ssize_t pos = 0, i = 0;
        PyObject *name, *value;
        while (rc == 0 && PyDict_Next(phases, &pos, &name, &value)) {
            if (!PyUnicode_CheckExact(name) || !PyFloat_CheckExact(value))
                Py_RETURN_NONE;
            double seconds = PyFloat_AS_DOUBLE(value);
            if (!(seconds >= 0.0 && seconds <= duration)) /* NaN fails both: clamped there */
                Py_RETURN_NONE;
            Py_ssize_t len;
            const char *text = PyUnicode_AsUTF8AndSize(name, &len);
            if (text == NULL)
                return NULL;
            rc = put_str(&t, i++ ? ",\"" : "\"");
            rc = rc ? rc : put(&t, text, len);
            rc = rc ? rc : put_str(&t, "\":");
            rc = rc ? rc : put_double(&t, seconds, 'g', 9, 0);
        }
        rc = rc ? rc : put_str(&t, "}");
    }
    if (rc == 0 && samples != Py_None) {
        rc = put_str(&t, ",\"samples\":");
        rc = rc ? rc : put_count(&t, samples, format_max_count);
    }
    if (rc == 0 && tokens != Py_None) {
        rc = put_str(&t, ",\"tokens\":");
        rc = rc ? rc : put_count(&t, tokens, format_max_count);
    }
    if (rc == 0 && flops != Py_None) {
        if (!PyFloat_CheckExact(flops))
            Py_RETURN_NONE;
        double number = PyFloat_AS_DOUBLE(flops);
        if (!(number >= 0.0 && number <= format_max_flops))
            Py_RETURN_NONE;
        rc = put_str(&t, ",\"flops\":");
        rc = rc ? rc : put_double(&t, number, 'r', 0, Py_DTSF_ADD_DOT_0);
    }
    if (rc == -2)
        return NULL;
    if (rc != 0) /* past the buffer, or a value the encoder writes differently */
        Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(t.text, t.n, NULL);
}
