/* HookCore, Step, Phase, Loader: the training thread's half of StepMonitor, the C twin of
 * gpumon/client/core/step_core.py, which is the reference: every method here follows its Python twin
 * statement by statement, and tests/client/test_core.py drives both through the same script and
 * compares every record. On a CPU-sized step most of the hook's cost is the interpreter's work at
 * the points the loop passes through each step (loader, step, phase boundaries), on caches the
 * step's kernels have evicted; C does the same work in a fraction of the instructions.
 *
 * The monitor holds a core and talks to it only through its methods (see step_core.py's module
 * docstring for the surface and the three callbacks). */
#include "hook.h"

/* phases[name] += seconds */
static int
add_seconds(PyObject *phases, PyObject *name, double seconds)
{
    PyObject *old = PyDict_GetItemWithError(phases, name); /* borrowed */
    if (old == NULL && PyErr_Occurred())
        return -1;
    double total = seconds;
    if (old != NULL) {
        total += PyFloat_AsDouble(old);
        if (total == -1.0 && PyErr_Occurred())
            return -1;
    }
    PyObject *value = PyFloat_FromDouble(total);
    if (value == NULL)
        return -1;
    int rc = PyDict_SetItem(phases, name, value);
    Py_DECREF(value);
    return rc;
}

/* The step ring (gpumon/wire/ring.py's layout; client/core/ring.py's StepRing.write is the
   Python twin): a count as it holds it, a non-negative int, else -1. */
static long long
ring_count(PyObject *value)
{
    if (value == NULL || !PyLong_CheckExact(value))
        return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || v < 0) {
        PyErr_Clear();
        return -1;
    }
    return v;
}

static double
ring_flops(PyObject *value)
{
    if (value != NULL && PyFloat_CheckExact(value))
        return PyFloat_AS_DOUBLE(value);
    if (value != NULL && PyLong_CheckExact(value)) {
        double v = PyLong_AsDouble(value);
        if (v == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return Py_NAN;
        }
        return v;
    }
    return Py_NAN;
}

#define RING_HEADER_BYTES 64
#define RING_CAPACITY_AT 8
#define RING_WRITTEN_AT 16

typedef struct {
    long long seq, step;
    double t0, t1;
    long long samples, tokens;
    double flops;
} RingEntry;

/* One completed step into the ring: a memcpy and the count's store, nothing that can fail or
   wait. The agent reads the ring only once this process has ended. */
static void
ring_write(HookCore *m, Step *step, double t0, double t1)
{
    RingEntry e = {m->seq, ring_count(step->step), t0, t1, ring_count(step->samples),
                   ring_count(step->tokens), ring_flops(step->flops)};
    long long written = m->ring_written;
    memcpy(m->ring + RING_HEADER_BYTES + (written % m->ring_capacity) * sizeof(RingEntry), &e,
           sizeof(RingEntry));
    m->ring_written = written + 1;
    __atomic_store_n((long long *)(m->ring + RING_WRITTEN_AT), written + 1, __ATOMIC_RELEASE);
}

static void
ring_release(HookCore *self)
{
    if (self->ring != NULL) {
        self->ring = NULL;
        PyBuffer_Release(&self->ring_view);
    }
}

static PyObject *
HookCore_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    HookCore *self = (HookCore *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->enabled = 1;
    self->device = 1;
    self->quiet_until = -Py_HUGE_VAL;
    self->phases = PyDict_New();
    self->marks = PyList_New(0);
    self->phase_cache = PyDict_New();
    self->cuda = Py_NewRef(Py_None);
    self->last_ooms = Py_NewRef(Py_None);
    self->buffer = Py_NewRef(Py_None);
    self->append = Py_NewRef(Py_None);
    self->first_step = Py_NewRef(Py_None);
    self->step_failed = Py_NewRef(Py_None);
    self->phase_clock = Py_NewRef(Py_None);
    if (self->phases == NULL || self->marks == NULL || self->phase_cache == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
HookCore_init(HookCore *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "first_step", "step_failed", "phase_clock", NULL};
    PyObject *buffer, *first_step, *step_failed, *phase_clock;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO", kwlist, &buffer, &first_step,
                                     &step_failed, &phase_clock))
        return -1;
    if (!PyCallable_Check(first_step) || !PyCallable_Check(step_failed) ||
        !PyCallable_Check(phase_clock)) {
        PyErr_SetString(PyExc_TypeError, "first_step, step_failed and phase_clock must be callable");
        return -1;
    }
    PyObject *append = PyObject_GetAttr(buffer, str_append);
    if (append == NULL)
        return -1;
    Py_XSETREF(self->buffer, Py_NewRef(buffer));
    Py_XSETREF(self->append, append);
    Py_XSETREF(self->first_step, Py_NewRef(first_step));
    Py_XSETREF(self->step_failed, Py_NewRef(step_failed));
    Py_XSETREF(self->phase_clock, Py_NewRef(phase_clock));
    return 0;
}

static int
HookCore_traverse(HookCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->phases);
    Py_VISIT(self->phase_event);
    Py_VISIT(self->marks);
    Py_VISIT(self->phase_cache);
    Py_VISIT(self->cuda);
    Py_VISIT(self->cuda_before);
    Py_VISIT(self->last_ooms);
    Py_VISIT(self->buffer);
    Py_VISIT(self->append);
    Py_VISIT(self->first_step);
    Py_VISIT(self->step_failed);
    Py_VISIT(self->phase_clock);
    Py_VISIT(self->extensions);
    return 0;
}

static int
HookCore_clear(HookCore *self)
{
    Py_CLEAR(self->phases);
    Py_CLEAR(self->phase_event);
    Py_CLEAR(self->marks);
    Py_CLEAR(self->phase_cache);
    Py_CLEAR(self->cuda);
    Py_CLEAR(self->cuda_before);
    Py_CLEAR(self->last_ooms);
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->append);
    Py_CLEAR(self->first_step);
    Py_CLEAR(self->step_failed);
    Py_CLEAR(self->phase_clock);
    Py_CLEAR(self->extensions);
    self->open_phase = NULL;
    ring_release(self);
    return 0;
}

static void
HookCore_dealloc(HookCore *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    HookCore_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
HookCore_step(HookCore *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *values[5] = {Py_None, Py_None, Py_None, Py_None, Py_None};
    if (nargs) {
        PyErr_SetString(PyExc_TypeError, "step() takes keyword arguments only");
        return NULL;
    }
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i);
        int j = 0;
        while (j < 5 && key != step_kwnames[j]) /* interned: the usual case */
            j++;
        for (int k = 0; j == 5 && k < 5; k++) {
            int eq = PyUnicode_Compare(key, step_kwnames[k]);
            if (eq == -1 && PyErr_Occurred())
                return NULL;
            if (eq == 0)
                j = k;
        }
        if (j < 5) {
            values[j] = args[nargs + i];
        } else {
            PyErr_Format(PyExc_TypeError, "step() got an unexpected keyword argument '%U'", key);
            return NULL;
        }
    }
    Step *step = PyObject_GC_New(Step, &StepType);
    if (step == NULL)
        return NULL;
    step->core = (HookCore *)Py_NewRef(self);
    step->samples = Py_NewRef(values[0]);
    step->tokens = Py_NewRef(values[1]);
    step->flops = Py_NewRef(values[2]);
    step->step = Py_NewRef(values[3]);
    step->memory = Py_NewRef(values[4]);
    PyObject_GC_Track(step);
    return (PyObject *)step;
}

static PyObject *
HookCore_phase(HookCore *self, PyObject *name)
{
    PyObject *ctx = PyDict_GetItemWithError(self->phase_cache, name); /* borrowed */
    if (ctx != NULL)
        return Py_NewRef(ctx);
    if (PyErr_Occurred())
        return NULL;
    PyObject *clock = PyObject_CallOneArg(self->phase_clock, name);
    if (clock == NULL)
        return NULL;
    int host_clock = PyObject_IsTrue(clock);
    Py_DECREF(clock);
    if (host_clock < 0)
        return NULL;
    Phase *phase = PyObject_GC_New(Phase, &PhaseType);
    if (phase == NULL)
        return NULL;
    phase->core = (HookCore *)Py_NewRef(self);
    phase->name = Py_NewRef(name);
    phase->host_clock = (char)host_clock;
    PyObject_GC_Track(phase);
    if (PyDict_SetItem(self->phase_cache, name, (PyObject *)phase) < 0) {
        Py_DECREF(phase);
        return NULL;
    }
    return (PyObject *)phase;
}

static PyObject *
HookCore_loader(HookCore *self, PyObject *iterable)
{
    Loader *loader = PyObject_GC_New(Loader, &LoaderType);
    if (loader == NULL)
        return NULL;
    loader->core = (HookCore *)Py_NewRef(self);
    loader->iterable = Py_NewRef(iterable);
    loader->iterator = NULL;
    PyObject_GC_Track(loader);
    return (PyObject *)loader;
}

int
data_wait(HookCore *self, double t0, double t1)
{
    if (!self->step_depth && !self->has_pending) {
        self->pending_t0 = t0;
        self->has_pending = 1;
    }
    return add_seconds(self->phases, str_data, t1 - t0);
}

static PyObject *
HookCore_data_wait(HookCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "data_wait(t0, t1) takes two perf_counter readings");
        return NULL;
    }
    double t0 = PyFloat_AsDouble(args[0]);
    if (t0 == -1.0 && PyErr_Occurred())
        return NULL;
    double t1 = PyFloat_AsDouble(args[1]);
    if (t1 == -1.0 && PyErr_Occurred())
        return NULL;
    if (data_wait(self, t0, t1) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
HookCore_set_cuda(HookCore *self, PyObject *clock)
{
    /* An extension may swap the clock from inside a step (a trace arms at step_begin) while
       the step's own code still holds the old one borrowed: keep it alive until the next swap. */
    PyObject *old = self->cuda;
    self->cuda = Py_NewRef(clock);
    Py_XSETREF(self->cuda_before, old);
    Py_RETURN_NONE;
}

static PyObject *
HookCore_set_extensions(HookCore *self, PyObject *extensions)
{
    Py_CLEAR(self->extensions);
    if (extensions != Py_None)
        self->extensions = Py_NewRef(extensions);
    Py_RETURN_NONE;
}

static PyObject *
HookCore_set_quiet_until(HookCore *self, PyObject *t)
{
    double until = PyFloat_AsDouble(t);
    if (until == -1.0 && PyErr_Occurred())
        return NULL;
    self->quiet_until = until;
    Py_RETURN_NONE;
}

static PyObject *
HookCore_set_ring(HookCore *self, PyObject *ring)
{
    ring_release(self);
    if (ring == Py_None)
        Py_RETURN_NONE;
    PyObject *view = PyObject_GetAttr(ring, str_view);
    if (view == NULL)
        return NULL;
    Py_buffer buffer;
    int rc = PyObject_GetBuffer(view, &buffer, PyBUF_WRITABLE | PyBUF_SIMPLE);
    Py_DECREF(view);
    if (rc < 0)
        return NULL;
    unsigned int capacity = 0;
    long long written = 0;
    if (buffer.len >= RING_HEADER_BYTES) {
        memcpy(&capacity, (char *)buffer.buf + RING_CAPACITY_AT, sizeof(capacity));
        memcpy(&written, (char *)buffer.buf + RING_WRITTEN_AT, sizeof(written));
    }
    if (capacity == 0 || written < 0 ||
        buffer.len < RING_HEADER_BYTES + (Py_ssize_t)capacity * (Py_ssize_t)sizeof(RingEntry)) {
        PyBuffer_Release(&buffer);
        PyErr_SetString(PyExc_ValueError, "set_ring: not a step ring's mapping");
        return NULL;
    }
    self->ring_view = buffer;
    self->ring = buffer.buf;
    self->ring_capacity = capacity;
    self->ring_written = written;
    Py_RETURN_NONE;
}

static PyObject *
HookCore_stop(HookCore *self, PyObject *unused)
{
    self->enabled = 0;
    Py_CLEAR(self->extensions);
    Py_RETURN_NONE;
}

static PyObject *
HookCore_get_steps(HookCore *self, void *closure)
{
    return PyLong_FromLongLong(self->seq);
}

static PyObject *
HookCore_get_in_step(HookCore *self, void *closure)
{
    return PyBool_FromLong(self->step_depth > 0);
}

static PyObject *
HookCore_get_last_ooms(HookCore *self, void *closure)
{
    return Py_NewRef(self->last_ooms);
}

static PyObject *
HookCore_get_open_phase(HookCore *self, void *closure)
{
    if (self->open_phase != NULL)
        return Py_NewRef(self->open_phase);
    if (self->loading)
        return Py_NewRef(str_data);
    Py_RETURN_NONE;
}

static PyObject *
HookCore_get_step_origin(HookCore *self, void *closure)
{
    if (self->step_depth <= 0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(self->has_pending ? self->pending_t0 : self->step_t0);
}

static PyGetSetDef HookCore_getset[] = {
    {"steps", (getter)HookCore_get_steps, NULL, "Steps completed so far, recorded or not.", NULL},
    {"step_origin", (getter)HookCore_get_step_origin, NULL,
     "The open step's record starts at this perf_counter reading (None outside a step).", NULL},
    {"in_step", (getter)HookCore_get_in_step, NULL, "Whether a step is open.", NULL},
    {"last_ooms", (getter)HookCore_get_last_ooms, NULL,
     "The allocator's OOM count at the last reading, if CUDA statistics were read.", NULL},
    {"open_phase", (getter)HookCore_get_open_phase, NULL,
     "The open outermost phase, 'data' while the loader waits for an item, else None.", NULL},
    {NULL},
};

static PyMethodDef HookCore_methods[] = {
    {"step", (PyCFunction)(void (*)(void))HookCore_step, METH_FASTCALL | METH_KEYWORDS,
     "step(*, samples=None, tokens=None, flops=None, step=None, memory=None)\n--\n\n"
     "A context manager around one training step (see StepMonitor.step)."},
    {"phase", (PyCFunction)HookCore_phase, METH_O,
     "phase(name)\n--\n\nA context manager timing part of a step (see StepMonitor.phase)."},
    {"loader", (PyCFunction)HookCore_loader, METH_O,
     "loader(iterable)\n--\n\n"
     "Yield iterable's items, timing each wait as the data phase of the next step."},
    {"data_wait", (PyCFunction)(void (*)(void))HookCore_data_wait, METH_FASTCALL,
     "data_wait(t0, t1)\n--\n\nCount t1 - t0 (perf_counter) as waiting for input."},
    {"set_cuda", (PyCFunction)HookCore_set_cuda, METH_O,
     "set_cuda(clock)\n--\n\n"
     "Time phases with clock's CUDA events and read its allocator statistics (None: host only)."},
    {"set_extensions", (PyCFunction)HookCore_set_extensions, METH_O,
     "set_extensions(extensions)\n--\n\n"
     "Call extensions at every step's start and end from now on (None: stop)."},
    {"set_quiet_until", (PyCFunction)HookCore_set_quiet_until, METH_O,
     "set_quiet_until(t)\n--\n\n"
     "Until perf_counter() reads t, steps begin and end without calling the extensions."},
    {"set_ring", (PyCFunction)HookCore_set_ring, METH_O,
     "set_ring(ring)\n--\n\n"
     "Write each completed step into ring's mapping too, as it ends (None: stop)."},
    {"stop", (PyCFunction)HookCore_stop, METH_NOARGS,
     "stop()\n--\n\nRecord no more steps and call no more extensions."},
    {NULL},
};

PyTypeObject HookCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client.core._hook.HookCore",
    .tp_doc = "HookCore(buffer, first_step, step_failed, phase_clock)\n--\n\n"
              "State the training thread owns, and the calls a training loop makes.",
    .tp_basicsize = sizeof(HookCore),
    .tp_weaklistoffset = offsetof(HookCore, weakreflist),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = HookCore_new,
    .tp_init = (initproc)HookCore_init,
    .tp_dealloc = (destructor)HookCore_dealloc,
    .tp_traverse = (traverseproc)HookCore_traverse,
    .tp_clear = (inquiry)HookCore_clear,
    .tp_methods = HookCore_methods,
    .tp_getset = HookCore_getset,
};

/* ---- Step --------------------------------------------------------------------------- */

static int
Step_traverse(Step *self, visitproc visit, void *arg)
{
    Py_VISIT(self->core);
    Py_VISIT(self->samples);
    Py_VISIT(self->tokens);
    Py_VISIT(self->flops);
    Py_VISIT(self->step);
    Py_VISIT(self->memory);
    return 0;
}

static int
Step_clear(Step *self)
{
    Py_CLEAR(self->core);
    Py_CLEAR(self->samples);
    Py_CLEAR(self->tokens);
    Py_CLEAR(self->flops);
    Py_CLEAR(self->step);
    Py_CLEAR(self->memory);
    return 0;
}

static void
Step_dealloc(Step *self)
{
    PyObject_GC_UnTrack(self);
    Step_clear(self);
    PyObject_GC_Del(self);
}

PyObject *
Step_set_counts(Step *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "set_counts(samples, tokens, flops)");
        return NULL;
    }
    Py_XSETREF(self->samples, Py_NewRef(args[0]));
    Py_XSETREF(self->tokens, Py_NewRef(args[1]));
    Py_XSETREF(self->flops, Py_NewRef(args[2]));
    Py_RETURN_NONE;
}

PyObject *
Step_enter(Step *self, PyObject *unused)
{
    HookCore *m = self->core;
    if (m == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "step of a cleared monitor");
        return NULL;
    }
    m->step_depth += 1;
    if (m->step_depth == 1) {
        if (!m->started) {
            m->started = 1;
            if (m->cuda == Py_None) {
                PyObject *r = PyObject_CallNoArgs(m->first_step);
                if (r == NULL) {
                    m->step_depth -= 1;
                    return NULL;
                }
                Py_DECREF(r);
            }
        }
        /* Stamped before the extensions start and after they end, so what they measure
           (communication inside the step, say) lies within the step's duration. */
        double t0 = m->step_t0 = now();
        m->extensions_called = m->extensions != NULL && !(t0 < m->quiet_until);
        if (m->extensions_called) {
            PyObject *r = PyObject_CallMethodNoArgs(m->extensions, str_begin);
            if (r == NULL) {
                m->step_depth -= 1;
                return NULL;
            }
            Py_DECREF(r);
        }
    }
    return Py_NewRef(self);
}

PyObject *
Step_exit(Step *self, PyObject *const *args, Py_ssize_t nargs)
{
    HookCore *m = self->core;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__exit__ takes three arguments");
        return NULL;
    }
    if (m == NULL)
        Py_RETURN_NONE;
    m->step_depth -= 1;
    if (m->step_depth)
        Py_RETURN_NONE;
    PyObject *fields = NULL;
    if (m->extensions != NULL && m->extensions_called) {
        PyObject *extensions = Py_NewRef(m->extensions); /* end() may unregister them */
        fields = PyObject_CallMethodOneArg(extensions, str_end,
                                           args[0] == Py_None ? Py_True : Py_False);
        Py_DECREF(extensions);
        if (fields == NULL)
            return NULL;
    }
    double t1 = now();
    if (args[0] != Py_None) {
        Py_XDECREF(fields);
        PyObject *fresh_phases = PyDict_New();
        if (fresh_phases == NULL)
            return NULL;
        Py_SETREF(m->phases, fresh_phases);
        PyObject *fresh_marks = PyList_New(0);
        if (fresh_marks == NULL)
            return NULL;
        Py_SETREF(m->marks, fresh_marks);
        m->has_pending = 0;
        PyObject *r = PyObject_CallFunctionObjArgs(m->step_failed, args[1], OR_NONE(self->step),
                                                   NULL);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
        Py_RETURN_NONE;
    }
    double t0 = m->step_t0;
    if (m->has_pending) {
        t0 = m->pending_t0;
        m->has_pending = 0;
    }
    if (fields == NULL)
        fields = Py_NewRef(Py_None);
    PyObject *fresh = PyDict_New();
    if (fresh == NULL) {
        Py_DECREF(fields);
        return NULL;
    }
    PyObject *phases = m->phases; /* the reference moves to the record */
    m->phases = fresh;
    PyObject *marks = NULL, *mem = NULL;
    if (m->cuda != Py_None) {
        PyObject *fresh_marks = PyList_New(0);
        if (fresh_marks == NULL)
            goto error;
        marks = m->marks;
        m->marks = fresh_marks;
        if (m->device) {
            PyObject *interval = PyObject_GetAttr(m->cuda, str_device_interval_s);
            if (interval == NULL)
                goto error;
            double interval_s = PyFloat_AsDouble(interval);
            Py_DECREF(interval);
            if (interval_s == -1.0 && PyErr_Occurred())
                goto error;
            m->next_device_t = t1 + interval_s;
            mem = PyObject_CallMethodNoArgs(m->cuda, str_memory);
            if (mem == NULL)
                goto error;
            if (mem == Py_None) {
                Py_CLEAR(mem);
            } else {
                PyObject *ooms = PySequence_GetItem(mem, MEMORY_OOMS);
                if (ooms == NULL)
                    goto error;
                Py_SETREF(m->last_ooms, ooms);
            }
        }
        m->device = t1 >= m->next_device_t;
    }
    if (mem == NULL)
        mem = Py_NewRef(OR_NONE(self->memory));
    if (marks == NULL)
        marks = Py_NewRef(Py_None);
    if (m->enabled) {
        PyObject *seq = PyLong_FromLongLong(m->seq);
        PyObject *start = PyFloat_FromDouble(t0);
        PyObject *end = PyFloat_FromDouble(t1);
        PyObject *record = NULL;
        /* A StepTuple: the fields of gpumon.client.core.step_tuple.StepFields, in its order. */
        if (seq != NULL && start != NULL && end != NULL)
            record = PyTuple_Pack(11, seq, OR_NONE(self->step), start, end, phases,
                                  OR_NONE(self->samples), OR_NONE(self->tokens),
                                  OR_NONE(self->flops), mem, marks, fields);
        Py_XDECREF(seq);
        Py_XDECREF(start);
        Py_XDECREF(end);
        if (record == NULL)
            goto error;
        PyObject *r = PyObject_CallOneArg(m->append, record);
        Py_DECREF(record);
        if (r == NULL)
            goto error;
        Py_DECREF(r);
        if (m->ring != NULL)
            ring_write(m, self, t0, t1);
    }
    m->seq += 1;
    Py_DECREF(phases);
    Py_DECREF(mem);
    Py_DECREF(marks);
    Py_DECREF(fields);
    Py_RETURN_NONE;
error:
    Py_DECREF(phases);
    Py_XDECREF(mem);
    Py_XDECREF(marks);
    Py_DECREF(fields);
    return NULL;
}

static PyMethodDef Step_methods[] = {
    {"__enter__", (PyCFunction)Step_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Step_exit, METH_FASTCALL, NULL},
    {"set_counts", (PyCFunction)(void (*)(void))Step_set_counts, METH_FASTCALL,
     "set_counts(samples, tokens, flops)\n--\n\n"
     "Set the step's counts, when they are known only after it started."},
    {NULL},
};

PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client.core._hook.Step",
    .tp_doc = "One step's context manager.",
    .tp_basicsize = sizeof(Step),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)Step_dealloc,
    .tp_traverse = (traverseproc)Step_traverse,
    .tp_clear = (inquiry)Step_clear,
    .tp_methods = Step_methods,
};

/* ---- Phase -------------------------------------------------------------------------- */

static int
Phase_traverse(Phase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->core);
    Py_VISIT(self->name);
    return 0;
}

static int
Phase_clear(Phase *self)
{
    Py_CLEAR(self->core);
    Py_CLEAR(self->name);
    return 0;
}

static void
Phase_dealloc(Phase *self)
{
    PyObject_GC_UnTrack(self);
    Phase_clear(self);
    PyObject_GC_Del(self);
}

PyObject *
Phase_enter(Phase *self, PyObject *unused)
{
    HookCore *m = self->core;
    if (m == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "phase of a cleared monitor");
        return NULL;
    }
    if (!m->phase_depth) {
        if (m->cuda != Py_None && m->device && !self->host_clock) {
            PyObject *event = NULL;
            Py_ssize_t n = PyList_GET_SIZE(m->marks);
            PyObject *last = n ? PyList_GET_ITEM(m->marks, n - 1) : NULL;
            if (last != NULL && PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) == 3) {
                double gap = now() - m->phase_end_t;
                PyObject *share = PyObject_GetAttr(m->cuda, str_share_gap_s);
                if (share == NULL)
                    return NULL;
                double share_gap_s = PyFloat_AsDouble(share);
                Py_DECREF(share);
                if (share_gap_s == -1.0 && PyErr_Occurred())
                    return NULL;
                if (gap < share_gap_s) /* starts as the previous phase ended: share its end event */
                    event = Py_NewRef(PyTuple_GET_ITEM(last, 2));
            }
            if (event == NULL) {
                event = PyObject_CallMethodNoArgs(m->cuda, str_event);
                if (event == NULL)
                    return NULL;
            }
            Py_XSETREF(m->phase_event, event);
        }
        /* A clock whose events are host-clock readings (a float, or a float carrying the CUDA
           event: a trace's clock) gives the reading the phase is timed from, so its range in
           the trace and the phase's host seconds are one measurement. */
        PyObject *stamp = m->phase_event;
        double t = m->phase_t0 = stamp != NULL && PyFloat_Check(stamp)
                                     ? PyFloat_AS_DOUBLE(stamp) : now();
        if (!m->step_depth && !m->has_pending) {
            m->pending_t0 = t;
            m->has_pending = 1;
        }
        m->open_phase = self->name;
    }
    m->phase_depth += 1;
    return Py_NewRef(self);
}

PyObject *
Phase_exit(Phase *self, PyObject *const *args, Py_ssize_t nargs)
{
    HookCore *m = self->core;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__exit__ takes three arguments");
        return NULL;
    }
    if (m == NULL)
        Py_RETURN_NONE;
    m->phase_depth -= 1;
    if (!m->phase_depth) {
        m->open_phase = NULL;
        PyObject *start = m->phase_event;
        if (start == NULL || start == Py_None) {
            if (add_seconds(m->phases, self->name, now() - m->phase_t0) < 0)
                return NULL;
        }
        else {
            m->phase_event = NULL; /* the reference moves to the mark */
            PyObject *end = PyObject_CallMethodNoArgs(m->cuda, str_event);
            if (end == NULL) {
                Py_DECREF(start);
                return NULL;
            }
            double t1 = PyFloat_Check(end) ? PyFloat_AS_DOUBLE(end) : now();
            if (add_seconds(m->phases, self->name, t1 - m->phase_t0) < 0) {
                Py_DECREF(start);
                Py_DECREF(end);
                return NULL;
            }
            PyObject *mark = PyTuple_Pack(3, self->name, start, end);
            Py_DECREF(start);
            Py_DECREF(end);
            if (mark == NULL)
                return NULL;
            int rc = PyList_Append(m->marks, mark);
            Py_DECREF(mark);
            if (rc < 0)
                return NULL;
            m->phase_end_t = now();
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef Phase_methods[] = {
    {"__enter__", (PyCFunction)Phase_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Phase_exit, METH_FASTCALL, NULL},
    {NULL},
};

PyTypeObject PhaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client.core._hook.Phase",
    .tp_doc = "A named phase's context manager, one per name and core (reused).",
    .tp_basicsize = sizeof(Phase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)Phase_dealloc,
    .tp_traverse = (traverseproc)Phase_traverse,
    .tp_clear = (inquiry)Phase_clear,
    .tp_methods = Phase_methods,
};

/* ---- Loader ------------------------------------------------------------------------- */

static int
Loader_traverse(Loader *self, visitproc visit, void *arg)
{
    Py_VISIT(self->core);
    Py_VISIT(self->iterable);
    Py_VISIT(self->iterator);
    return 0;
}

static int
Loader_clear(Loader *self)
{
    Py_CLEAR(self->core);
    Py_CLEAR(self->iterable);
    Py_CLEAR(self->iterator);
    return 0;
}

static void
Loader_dealloc(Loader *self)
{
    PyObject_GC_UnTrack(self);
    Loader_clear(self);
    PyObject_GC_Del(self);
}

static PyObject *
Loader_next(Loader *self)
{
    double t0 = now();
    if (self->iterator == NULL) {
        if (self->iterable == NULL)
            return NULL; /* exhausted */
        self->iterator = PyObject_GetIter(self->iterable);
        Py_CLEAR(self->iterable);
        if (self->iterator == NULL)
            return NULL;
    }
    HookCore *core = self->core;
    if (core != NULL)
        core->loading = 1;
    PyObject *item = (*Py_TYPE(self->iterator)->tp_iternext)(self->iterator);
    if (core != NULL)
        core->loading = 0;
    if (item == NULL) {
        /* Exhausted, or an error: either way this loader ends, as a generator would. */
        Py_CLEAR(self->iterator);
        return NULL;
    }
    if (self->core != NULL && data_wait(self->core, t0, now()) < 0) {
        Py_DECREF(item);
        return NULL;
    }
    return item;
}

PyTypeObject LoaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client.core._hook.Loader",
    .tp_doc = "Yields a loader's items, timing each wait as the data phase of the next step.",
    .tp_basicsize = sizeof(Loader),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)Loader_dealloc,
    .tp_traverse = (traverseproc)Loader_traverse,
    .tp_clear = (inquiry)Loader_clear,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)Loader_next,
};
