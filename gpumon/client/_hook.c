/* gpumon.client._hook: the training thread's half of StepMonitor, in C (and the sender's
 * common step record, format_step).
 *
 * The same classes as gpumon/client/core/_core.py, which is the reference: every method here
 * follows its Python twin statement by statement, and tests/client/test_core.py drives both
 * through the same script and compares every record. On a CPU-sized step most of the hook's
 * cost is the interpreter's work at the points the loop passes through each step (loader,
 * step, phase boundaries), on caches the step's kernels have evicted; C does the same work in
 * a fraction of the instructions.
 *
 * The monitor holds a core and talks to it only through its methods (see _core.py's module
 * docstring for the surface and the three callbacks). Timestamps are CLOCK_MONOTONIC seconds
 * as doubles, computed as time.perf_counter() computes them on Linux, so they mix with the
 * perf_counter() readings of the Python code around.
 */

#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE /* dl_iterate_phdr, RTLD_DEFAULT */
#include <Python.h>
#include <structmember.h>
#include <dlfcn.h>
#include <link.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#if !defined(__linux__)
#error "timestamps must match time.perf_counter(), which is CLOCK_MONOTONIC on Linux only"
#endif

static PyObject *str_append, *str_event, *str_memory, *str_share_gap_s, *str_data, *str_begin,
    *str_end, *str_device_interval_s;
static PyObject *step_kwnames[5]; /* samples, tokens, flops, step, memory */

#define OR_NONE(x) ((x) == NULL ? Py_None : (x))
/* Where CudaClock.memory()'s tuple holds the OOM count: _cuda.MEMORY_OOMS, the index of "ooms"
   in the wire's MEM_WIRE_NAMES (tests/client/test_core.py holds both cores to it). */
#define MEMORY_OOMS 4

static inline double
now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long ns = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    return (double)ns / 1e9;
}

/* ---- HookCore ----------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    char enabled;
    char started;           /* the first step has begun */
    char device;            /* this step's phases get CUDA events (one step per device interval) */
    int step_depth;
    int phase_depth;
    int has_pending;
    long long seq;
    double step_t0;
    double pending_t0;
    double phase_t0;
    double phase_end_t;     /* when the last CUDA-timed phase's end event was recorded */
    double next_device_t;   /* the step after the first to end past this is GPU-timed */
    PyObject *phases;       /* dict: phase name -> host seconds */
    PyObject *phase_event;  /* CUDA event of the open phase, or NULL */
    PyObject *marks;        /* list of (name, start, end) */
    PyObject *phase_cache;  /* dict: name -> Phase */
    PyObject *cuda;         /* CudaClock or None */
    PyObject *last_ooms;    /* int or None */
    PyObject *buffer;       /* deque of step tuples, shared with the sender */
    PyObject *first_step;   /* the monitor's callbacks */
    PyObject *step_failed;
    PyObject *phase_clock;
    PyObject *extensions;   /* StepExtensions, or NULL: none registered, nothing to call */
    PyObject *open_phase;   /* borrowed from its cached Phase: the open outermost phase, or NULL */
    char loading;           /* the loader waits for the next item */
    char extensions_called; /* the open step's extensions were told it began */
    double quiet_until;     /* until then no extension needs a call (set_quiet_until) */
    PyObject *weakreflist;
} HookCore;

typedef struct {
    PyObject_HEAD
    HookCore *core;
    PyObject *samples, *tokens, *flops, *step, *memory;
} Step;

typedef struct {
    PyObject_HEAD
    HookCore *core;
    PyObject *name;
    char host_clock;
} Phase;

typedef struct {
    PyObject_HEAD
    HookCore *core;
    PyObject *iterable; /* until the first next(), as a generator would */
    PyObject *iterator;
} Loader;

static PyTypeObject HookCoreType, StepType, PhaseType, LoaderType;

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
    Py_XSETREF(self->buffer, Py_NewRef(buffer));
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
    Py_VISIT(self->last_ooms);
    Py_VISIT(self->buffer);
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
    Py_CLEAR(self->last_ooms);
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->first_step);
    Py_CLEAR(self->step_failed);
    Py_CLEAR(self->phase_clock);
    Py_CLEAR(self->extensions);
    self->open_phase = NULL;
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

static int
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
    Py_SETREF(self->cuda, Py_NewRef(clock));
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

static PyGetSetDef HookCore_getset[] = {
    {"steps", (getter)HookCore_get_steps, NULL, "Steps completed so far, recorded or not.", NULL},
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
    {"stop", (PyCFunction)HookCore_stop, METH_NOARGS,
     "stop()\n--\n\nRecord no more steps and call no more extensions."},
    {NULL},
};

static PyTypeObject HookCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client._hook.HookCore",
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

static PyObject *
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

static PyObject *
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

static PyObject *
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
        /* A StepTuple: the fields of gpumon.client.core._step_tuple.StepFields, in its order. */
        if (seq != NULL && start != NULL && end != NULL)
            record = PyTuple_Pack(11, seq, OR_NONE(self->step), start, end, phases,
                                  OR_NONE(self->samples), OR_NONE(self->tokens),
                                  OR_NONE(self->flops), mem, marks, fields);
        Py_XDECREF(seq);
        Py_XDECREF(start);
        Py_XDECREF(end);
        if (record == NULL)
            goto error;
        PyObject *r = PyObject_CallMethodOneArg(m->buffer, str_append, record);
        Py_DECREF(record);
        if (r == NULL)
            goto error;
        Py_DECREF(r);
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

static PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client._hook.Step",
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

static PyObject *
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
        double t = m->phase_t0 = now();
        if (!m->step_depth && !m->has_pending) {
            m->pending_t0 = t;
            m->has_pending = 1;
        }
        m->open_phase = self->name;
    }
    m->phase_depth += 1;
    return Py_NewRef(self);
}

static PyObject *
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
        if (add_seconds(m->phases, self->name, now() - m->phase_t0) < 0)
            return NULL;
        PyObject *start = m->phase_event;
        if (start != NULL && start != Py_None) {
            m->phase_event = NULL; /* the reference moves to the mark */
            PyObject *end = PyObject_CallMethodNoArgs(m->cuda, str_event);
            if (end == NULL) {
                Py_DECREF(start);
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

static PyTypeObject PhaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client._hook.Phase",
    .tp_doc = "A named phase's context manager, one per name and core (reused).",
    .tp_basicsize = sizeof(Phase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)Phase_dealloc,
    .tp_traverse = (traverseproc)Phase_traverse,
    .tp_clear = (inquiry)Phase_clear,
    .tp_methods = Phase_methods,
};

/* ---- StepFinder --------------------------------------------------------------------- */
/* gpumon.client.autowatch.steps.StepFinder for a monitor whose core is this module's: the
 * events `gpumon run`'s hooks see (a batch fetched, the outermost forward, the backward, an
 * optimizer step) open and close the core's Step and Phase here, without a Python frame in
 * between. steps.py is the reference, followed statement by statement;
 * tests/client/test_autowatch_steps.py drives both through every case and
 * test_both_finders_leave_the_same_steps through the same random events. */

typedef struct {
    PyObject_HEAD
    PyObject *monitor;
    PyObject *on_step_end;  /* callable, or None */
    HookCore *core;         /* the monitor's (its phases' core) */
    Step *step;             /* the open step, or NULL */
    Step *next_step;        /* the step context, reused from step to step; NULL until made */
    Phase **stack;          /* phases begun and not ended; the top one is open (strong refs) */
    Py_ssize_t depth, capacity;
    Phase *forward, *backward, *optimizer;
    PyObject *phases;       /* dict: name -> Phase */
    long long samples;
    char counted;           /* the step context holds a count of samples */
    char deferred;          /* an optimizer stepped in the open step; another may follow */
    char fetched;           /* a batch was ever fetched (steps.py: _last_optimizer is not None) */
    char lingering;
    char driven;
    unsigned long long last_optimizer; /* the last optimizer stepped since the last fetch, or 0 */
    PyObject *followed;     /* set of ints: optimizers seen followed by another on one batch */
} StepFinder;

static PyTypeObject StepFinderType;
static PyObject *str_shape, *str_step_ctx, *str_phase_ctx, *str_forward, *str_backward,
    *str_optimizer, *mapping_abc, *none3[3];

static int
phase_in(Phase *phase)
{
    PyObject *r = Phase_enter(phase, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int
phase_out(Phase *phase)
{
    PyObject *r = Phase_exit(phase, none3, 3);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int
push(StepFinder *self, Phase *phase)
{
    if (self->depth == self->capacity) {
        Py_ssize_t capacity = self->capacity ? self->capacity * 2 : 8;
        Phase **grown = PyMem_Realloc(self->stack, capacity * sizeof(Phase *));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->stack = grown;
        self->capacity = capacity;
    }
    self->stack[self->depth++] = (Phase *)Py_NewRef(phase);
    return 0;
}

/* The phase that was on top (a strong reference, the caller's). */
static Phase *
pop(StepFinder *self)
{
    return self->stack[--self->depth];
}

static Phase *
phase_of(PyObject *monitor, PyObject *name)
{
    PyObject *phase = PyObject_CallMethodOneArg(monitor, str_phase_ctx, name);
    if (phase != NULL && !Py_IS_TYPE(phase, &PhaseType)) {
        Py_DECREF(phase);
        PyErr_SetString(PyExc_TypeError, "the monitor's core is not gpumon.client._hook's");
        return NULL;
    }
    return (Phase *)phase;
}

static PyObject *
StepFinder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"monitor", "on_step_end", NULL};
    PyObject *monitor, *on_step_end = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O", kwlist, &monitor, &on_step_end))
        return NULL;
    StepFinder *self = (StepFinder *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->monitor = Py_NewRef(monitor);
    self->on_step_end = Py_NewRef(on_step_end);
    self->phases = PyDict_New();
    self->followed = PySet_New(NULL);
    if (self->phases == NULL || self->followed == NULL ||
        (self->forward = phase_of(monitor, str_forward)) == NULL ||
        (self->backward = phase_of(monitor, str_backward)) == NULL ||
        (self->optimizer = phase_of(monitor, str_optimizer)) == NULL ||
        PyDict_SetItem(self->phases, str_forward, (PyObject *)self->forward) < 0 ||
        PyDict_SetItem(self->phases, str_backward, (PyObject *)self->backward) < 0 ||
        PyDict_SetItem(self->phases, str_optimizer, (PyObject *)self->optimizer) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->core = (HookCore *)Py_XNewRef(self->forward->core);
    if (self->core == NULL) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_RuntimeError, "phase of a cleared monitor");
        return NULL;
    }
    return (PyObject *)self;
}

static int
StepFinder_traverse(StepFinder *self, visitproc visit, void *arg)
{
    Py_VISIT(self->monitor);
    Py_VISIT(self->on_step_end);
    Py_VISIT(self->core);
    Py_VISIT(self->step);
    Py_VISIT(self->next_step);
    for (Py_ssize_t i = 0; i < self->depth; i++)
        Py_VISIT(self->stack[i]);
    Py_VISIT(self->forward);
    Py_VISIT(self->backward);
    Py_VISIT(self->optimizer);
    Py_VISIT(self->phases);
    Py_VISIT(self->followed);
    return 0;
}

static int
StepFinder_clear(StepFinder *self)
{
    Py_CLEAR(self->monitor);
    Py_CLEAR(self->on_step_end);
    Py_CLEAR(self->core);
    Py_CLEAR(self->step);
    Py_CLEAR(self->next_step);
    while (self->depth)
        Py_DECREF(pop(self));
    Py_CLEAR(self->forward);
    Py_CLEAR(self->backward);
    Py_CLEAR(self->optimizer);
    Py_CLEAR(self->phases);
    Py_CLEAR(self->followed);
    return 0;
}

static void
StepFinder_dealloc(StepFinder *self)
{
    PyObject_GC_UnTrack(self);
    StepFinder_clear(self);
    PyMem_Free(self->stack);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* _phases.batch_size: the leading dimension of a tensor, or of the first tensor in a
   tuple/list/dict. 1 with *size set, 0 for none, -1 on error. */
static int
batch_size(PyObject *batch, int depth, long long *size)
{
    /* A tuple, list or dict has no shape: not looked for (a failed lookup raises). */
    int container = PyTuple_CheckExact(batch) || PyList_CheckExact(batch) || PyDict_CheckExact(batch);
    PyObject *shape = container ? Py_NewRef(Py_None) : PyObject_GetAttr(batch, str_shape);
    if (shape == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
    } else if (shape != Py_None) {
        if (PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) > 0
                && PyLong_CheckExact(PyTuple_GET_ITEM(shape, 0))) { /* a tensor's torch.Size */
            *size = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0));
            Py_DECREF(shape);
            return *size == -1 && PyErr_Occurred() ? -1 : 1;
        }
        Py_ssize_t n = PyObject_Size(shape);
        if (n <= 0) {
            Py_DECREF(shape);
            return n < 0 ? -1 : 0;
        }
        PyObject *first = PySequence_GetItem(shape, 0);
        Py_DECREF(shape);
        if (first == NULL)
            return -1;
        PyObject *number = PyNumber_Long(first);
        Py_DECREF(first);
        if (number == NULL)
            return -1;
        *size = PyLong_AsLongLong(number);
        Py_DECREF(number);
        return *size == -1 && PyErr_Occurred() ? -1 : 1;
    } else {
        Py_DECREF(shape);
    }
    if (depth >= 3)
        return 0;
    PyObject *first = NULL;
    if (PyTuple_CheckExact(batch) || PyList_CheckExact(batch)) { /* never a Mapping */
        if (PySequence_Fast_GET_SIZE(batch) == 0)
            return 0;
        first = Py_NewRef(PySequence_Fast_GET_ITEM(batch, 0));
    } else {
        int mapping = PyDict_Check(batch);
        if (!mapping) {
            if (mapping_abc == NULL) {
                PyObject *abc = PyImport_ImportModule("collections.abc");
                if (abc == NULL)
                    return -1;
                mapping_abc = PyObject_GetAttrString(abc, "Mapping");
                Py_DECREF(abc);
                if (mapping_abc == NULL)
                    return -1;
            }
            mapping = PyObject_IsInstance(batch, mapping_abc);
            if (mapping < 0)
                return -1;
        }
        if (mapping) { /* next(iter(batch.values()), None) */
            PyObject *values = PyObject_CallMethod(batch, "values", NULL);
            if (values == NULL)
                return -1;
            PyObject *it = PyObject_GetIter(values);
            Py_DECREF(values);
            if (it == NULL)
                return -1;
            first = PyIter_Next(it);
            Py_DECREF(it);
            if (first == NULL)
                return PyErr_Occurred() ? -1 : batch_size(Py_None, depth + 1, size);
        } else if (PyList_Check(batch) || PyTuple_Check(batch)) {
            if (PySequence_Size(batch) == 0)
                return 0;
            first = PySequence_GetItem(batch, 0);
            if (first == NULL)
                return -1;
        } else {
            return 0;
        }
    }
    int found = batch_size(first, depth + 1, size);
    Py_DECREF(first);
    return found;
}

static int
finder_open(StepFinder *self)
{
    if (self->next_step == NULL) {
        PyObject *step = PyObject_CallMethodNoArgs(self->monitor, str_step_ctx);
        if (step == NULL)
            return -1;
        if (!Py_IS_TYPE(step, &StepType)) {
            Py_DECREF(step);
            PyErr_SetString(PyExc_TypeError, "the monitor's core is not gpumon.client._hook's");
            return -1;
        }
        self->next_step = (Step *)step;
    }
    PyObject *r = Step_enter(self->next_step, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    Py_XSETREF(self->step, (Step *)Py_NewRef(self->next_step));
    return 0;
}

static int
end_phases(StepFinder *self)
{
    self->lingering = 0;
    if (self->depth) {
        if (phase_out(self->stack[self->depth - 1]) < 0)
            return -1;
        while (self->depth)
            Py_DECREF(pop(self));
    }
    return 0;
}

static int
finder_close(StepFinder *self)
{
    if (self->depth && end_phases(self) < 0)
        return -1;
    Step *step = self->step;
    self->deferred = 0;
    if (step == NULL)
        return 0;
    self->step = NULL; /* the reference is step's until the end */
    long long samples = self->samples;
    if (samples || self->counted) {
        self->samples = 0;
        self->counted = samples != 0;
        PyObject *count = samples ? PyLong_FromLongLong(samples) : Py_NewRef(Py_None);
        if (count == NULL) {
            Py_DECREF(step);
            return -1;
        }
        PyObject *counts[3] = {count, Py_None, Py_None};
        PyObject *r = Step_set_counts(step, counts, 3);
        Py_DECREF(count);
        if (r == NULL) {
            Py_DECREF(step);
            return -1;
        }
        Py_DECREF(r);
    }
    PyObject *r = Step_exit(step, none3, 3);
    Py_DECREF(step);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    if (self->on_step_end != Py_None) {
        r = PyObject_CallNoArgs(self->on_step_end);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

static int
settle(StepFinder *self)
{
    if (self->lingering) {
        self->lingering = 0;
        if (self->depth) {
            Phase *phase = pop(self);
            int rc = phase_out(phase);
            Py_DECREF(phase);
            return rc;
        }
    }
    return 0;
}

static int
begin_phase(StepFinder *self, Phase *phase)
{
    if (self->driven)
        return 0;
    if (self->lingering) {
        self->lingering = 0;
        if (self->depth) { /* (steps.py: a lingering forward is always on the stack) */
            Phase *top = pop(self);
            int rc = phase_out(top);
            Py_DECREF(top);
            if (rc < 0)
                return -1;
        }
    } else if (self->depth && phase_out(self->stack[self->depth - 1]) < 0) {
        return -1;
    }
    if (self->step == NULL && finder_open(self) < 0)
        return -1;
    if (push(self, phase) < 0)
        return -1;
    return phase_in(phase);
}

static int
forward_begin(StepFinder *self)
{
    if (self->driven)
        return 0;
    if (self->lingering && self->depth) { /* the top-level forward left open: continued */
        self->lingering = 0;
        return push(self, self->stack[self->depth - 1]);
    }
    self->lingering = 0;
    if (self->depth && phase_out(self->stack[self->depth - 1]) < 0)
        return -1;
    if (self->step == NULL && finder_open(self) < 0)
        return -1;
    if (push(self, self->forward) < 0)
        return -1;
    return phase_in(self->forward);
}

static int
end_phase(StepFinder *self)
{
    if (!self->depth)
        return 0;
    Phase *phase = pop(self);
    int rc = 0;
    if (self->depth) {
        Phase *top = self->stack[self->depth - 1];
        if (top == phase) /* a forward that continued a lingering one */
            self->lingering = 1;
        else if ((rc = phase_out(phase)) == 0)
            rc = phase_in(top);
    } else if (phase == self->forward) {
        rc = push(self, phase);
        self->lingering = 1;
    } else {
        rc = phase_out(phase);
    }
    Py_DECREF(phase);
    return rc;
}

#define DONE(rc) ((rc) < 0 ? NULL : Py_NewRef(Py_None))

/* The training thread waited from t0 to t1 for a batch (got: 0 when the loader was exhausted
   instead). */
static int
finder_fetched(StepFinder *self, double t0, double t1, PyObject *batch, int got)
{
    if (self->lingering && settle(self) < 0)
        return -1;
    if (self->deferred && !self->driven && finder_close(self) < 0)
        return -1;
    self->fetched = 1;
    self->last_optimizer = 0;
    if (!got)
        return 0;
    long long size = 0;
    int found = batch_size(batch, 0, &size);
    if (found < 0)
        return -1;
    if (found)
        self->samples += size;
    /* Outside a step this starts the next one at t0 (it opens at the next forward). */
    return data_wait(self->core, t0, t1);
}

static PyObject *
StepFinder_fetched(StepFinder *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "fetched(t0, t1, batch, got=True)");
        return NULL;
    }
    double t0 = PyFloat_AsDouble(args[0]);
    if (t0 == -1.0 && PyErr_Occurred())
        return NULL;
    double t1 = PyFloat_AsDouble(args[1]);
    if (t1 == -1.0 && PyErr_Occurred())
        return NULL;
    int got = 1;
    if (nargs == 4 && (got = PyObject_IsTrue(args[3])) < 0)
        return NULL;
    return DONE(finder_fetched(self, t0, t1, args[2], got));
}

static PyObject *
StepFinder_begin(StepFinder *self, PyObject *name)
{
    if (PyUnicode_Check(name) && PyUnicode_Compare(name, str_forward) == 0)
        return DONE(forward_begin(self));
    if (PyErr_Occurred())
        return NULL;
    PyObject *phase = PyDict_GetItemWithError(self->phases, name); /* borrowed */
    if (phase == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Phase *made = phase_of(self->monitor, name);
        if (made == NULL)
            return NULL;
        int rc = PyDict_SetItem(self->phases, name, (PyObject *)made);
        Py_DECREF(made);
        if (rc < 0)
            return NULL;
        phase = (PyObject *)made;
    }
    return DONE(begin_phase(self, (Phase *)phase));
}

static PyObject *
StepFinder_forward_begin(StepFinder *self, PyObject *unused)
{
    return DONE(forward_begin(self));
}

static PyObject *
StepFinder_backward_begin(StepFinder *self, PyObject *unused)
{
    return DONE(begin_phase(self, self->backward));
}

static PyObject *
StepFinder_optimizer_begin(StepFinder *self, PyObject *unused)
{
    return DONE(begin_phase(self, self->optimizer));
}

static PyObject *
StepFinder_end(StepFinder *self, PyObject *unused)
{
    return DONE(end_phase(self));
}

static int
forward_end(StepFinder *self)
{
    if (self->depth == 1) { /* the forward alone: left open */
        self->lingering = 1;
        return 0;
    }
    return end_phase(self);
}

static PyObject *
StepFinder_forward_end(StepFinder *self, PyObject *unused)
{
    return DONE(forward_end(self));
}

static PyObject *
StepFinder_settle(StepFinder *self, PyObject *unused)
{
    return DONE(settle(self));
}

/* That optimizer step ended (optimizer_id: its id()). */
static int
optimizer_end(StepFinder *self, PyObject *optimizer_id)
{
    if (self->driven)
        return 0;
    unsigned long long id = PyLong_AsUnsignedLongLong(optimizer_id);
    if (id == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (end_phase(self) < 0)
        return -1;
    if (self->fetched) {
        unsigned long long last = self->last_optimizer;
        if (last && last != id) {
            PyObject *key = PyLong_FromUnsignedLongLong(last);
            if (key == NULL)
                return -1;
            int rc = PySet_Add(self->followed, key);
            Py_DECREF(key);
            if (rc < 0)
                return -1;
        }
        self->last_optimizer = id;
    }
    int followed = PySet_GET_SIZE(self->followed) ? PySet_Contains(self->followed, optimizer_id) : 0;
    if (followed < 0)
        return -1;
    if (followed) {
        self->deferred = 1;
        return 0;
    }
    return finder_close(self);
}

static PyObject *
StepFinder_optimizer_end(StepFinder *self, PyObject *optimizer_id)
{
    return DONE(optimizer_end(self, optimizer_id));
}

static PyObject *
StepFinder_close(StepFinder *self, PyObject *unused)
{
    if (end_phases(self) < 0)
        return NULL;
    Step *step = self->step;
    self->step = NULL;
    if (step != NULL) {
        PyObject *error = PyObject_CallFunction(PyExc_RuntimeError, "s", "the step was left open");
        if (error == NULL) {
            Py_DECREF(step);
            return NULL;
        }
        PyObject *exc_args[3] = {PyExc_RuntimeError, error, Py_None};
        PyObject *r = Step_exit(step, exc_args, 3); /* not recorded */
        Py_DECREF(error);
        Py_DECREF(step);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    self->deferred = 0;
    self->samples = 0;
    Py_RETURN_NONE;
}

static PyObject *
StepFinder_get_in_step(StepFinder *self, void *closure)
{
    return PyBool_FromLong(self->step != NULL);
}

static PyObject *
StepFinder_get_flag(StepFinder *self, void *closure)
{
    return PyBool_FromLong(*((char *)self + (Py_ssize_t)closure));
}

static int
StepFinder_set_flag(StepFinder *self, PyObject *value, void *closure)
{
    int truth = value == NULL ? -1 : PyObject_IsTrue(value);
    if (truth < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "cannot delete it");
        return -1;
    }
    *((char *)self + (Py_ssize_t)closure) = (char)truth;
    return 0;
}

static PyObject *
StepFinder_get_monitor(StepFinder *self, void *closure)
{
    return Py_NewRef(self->monitor);
}

static PyObject *
StepFinder_get_on_step_end(StepFinder *self, void *closure)
{
    return Py_NewRef(self->on_step_end);
}

static int
StepFinder_set_on_step_end(StepFinder *self, PyObject *value, void *closure)
{
    if (value == NULL || (value != Py_None && !PyCallable_Check(value))) {
        PyErr_SetString(PyExc_TypeError, "on_step_end: a callable or None");
        return -1;
    }
    Py_SETREF(self->on_step_end, Py_NewRef(value));
    return 0;
}

static PyGetSetDef StepFinder_getset[] = {
    {"monitor", (getter)StepFinder_get_monitor, NULL, "The monitor the steps go to.", NULL},
    {"in_step", (getter)StepFinder_get_in_step, NULL, "Whether a step is open.", NULL},
    {"lingering", (getter)StepFinder_get_flag, NULL,
     "The top-level forward ended and is left open until the next event (settle()).",
     (void *)offsetof(StepFinder, lingering)},
    {"driven", (getter)StepFinder_get_flag, (setter)StepFinder_set_flag,
     "A watcher makes the steps and phases itself: only the data wait is reported from here.",
     (void *)offsetof(StepFinder, driven)},
    {"on_step_end", (getter)StepFinder_get_on_step_end, (setter)StepFinder_set_on_step_end,
     "Called after each step closes (None: nothing).", NULL},
    {NULL},
};

static PyMethodDef StepFinder_methods[] = {
    {"fetched", (PyCFunction)(void (*)(void))StepFinder_fetched, METH_FASTCALL,
     "fetched(t0, t1, batch, got=True)\n--\n\nThe training thread waited from t0 to t1 for a batch."},
    {"begin", (PyCFunction)StepFinder_begin, METH_O, "begin(name)\n--\n\nA phase begins."},
    {"forward_begin", (PyCFunction)StepFinder_forward_begin, METH_NOARGS, NULL},
    {"backward_begin", (PyCFunction)StepFinder_backward_begin, METH_NOARGS, NULL},
    {"optimizer_begin", (PyCFunction)StepFinder_optimizer_begin, METH_NOARGS, NULL},
    {"end", (PyCFunction)StepFinder_end, METH_NOARGS, NULL},
    {"forward_end", (PyCFunction)StepFinder_forward_end, METH_NOARGS, NULL},
    {"settle", (PyCFunction)StepFinder_settle, METH_NOARGS, NULL},
    {"optimizer_end", (PyCFunction)StepFinder_optimizer_end, METH_O, NULL},
    {"close", (PyCFunction)StepFinder_close, METH_NOARGS,
     "close()\n--\n\nDrop an open step without recording it."},
    {NULL},
};

static PyTypeObject StepFinderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client._hook.StepFinder",
    .tp_doc = "StepFinder(monitor, on_step_end=None)\n--\n\n"
              "gpumon.client.autowatch.steps.StepFinder in C, for a monitor on this module's core.",
    .tp_basicsize = sizeof(StepFinder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = StepFinder_new,
    .tp_dealloc = (destructor)StepFinder_dealloc,
    .tp_traverse = (traverseproc)StepFinder_traverse,
    .tp_clear = (inquiry)StepFinder_clear,
    .tp_methods = StepFinder_methods,
    .tp_getset = StepFinder_getset,
};

/* ---- HookState, Hooked -------------------------------------------------------------- */
/* The common case of `gpumon run`'s hooks (gpumon/client/autowatch/state.py) in C: the
 * training thread's outermost forward, backward, batch fetch and optimizer step, with the
 * process's step finder (the C one) and the model and optimizer it has already met. Each
 * event then costs the loop one C call between the hook point and the step finder; the model
 * call and the optimizer hooks keep one Python frame each, for the compile test the compiler
 * must be able to read. Whatever is not that case (no finder yet, a module or optimizer other
 * than the last one, the models still being learnt, a backward with no forward before it)
 * goes, before anything is changed, to the Python method of the same name (python_call, ...),
 * which is the reference: state.py's PythonState, which the hooks use as they are where the
 * core is Python. Errors in gpumon's own work go to self.give_up(error) and never reach the
 * loop. HookState is a base class: its fields are attributes of the Python state. */

typedef struct {
    PyObject_HEAD
    PyObject *finder;         /* the process's step finder, or None / NULL */
    PyObject *last_module;    /* weak reference to the last outermost module called, or None */
    PyObject *last_optimizer; /* weak reference to the last optimizer stepped, or None */
    PyObject *compiler;       /* what holds _is_compiling_flag (torch.compiler), or None */
    unsigned long main;       /* the training thread's ident */
    int module_depth;
    int optimizer_depth;
    int learning;
    char inert;
    char forward_seen;
} HookState;

static PyTypeObject HookStateType, HookedType;
static PyObject *str_give_up, *str_python_call, *str_python_backward, *str_python_fetch,
    *str_python_optimizer_pre, *str_python_optimizer_post, *str_is_compiling_flag;

/* The training thread of a watched process. */
static inline int
watching(HookState *self)
{
    return !self->inert && PyThread_get_thread_ident() == self->main;
}

/* The finder if it is this module's (borrowed), else NULL. */
static inline StepFinder *
c_finder(HookState *self)
{
    PyObject *finder = self->finder;
    return finder != NULL && Py_IS_TYPE(finder, &StepFinderType) ? (StepFinder *)finder : NULL;
}

/* Whether ref is a weak reference to obj. */
static inline int
refers_to(PyObject *ref, PyObject *obj)
{
    return ref != NULL && PyWeakref_CheckRef(ref) && PyWeakref_GET_OBJECT(ref) == obj;
}

/* An error is set, from gpumon's own work: self.give_up(error) stops watching the process, and
   the error goes no further. */
static void
give_up(HookState *self)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (value != NULL && traceback != NULL)
        PyException_SetTraceback(value, traceback);
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, str_give_up, OR_NONE(value));
    if (r == NULL)
        PyErr_Clear();
    Py_XDECREF(r);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
}

/* Run step(finder) with the error set (if any) put aside, and set again after. */
static void
aside(HookState *self, StepFinder *finder, int (*step)(StepFinder *))
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (step(finder) < 0)
        give_up(self);
    PyErr_Restore(type, value, traceback);
}

/* torch.export's non-strict tracing is on (torch.compiler._is_compiling_flag): the hooks stand
   aside. (The compiler's own tracing never runs C code: it reads the Python hooks' test.) */
static int
compiling(HookState *self)
{
    if (self->compiler == NULL || self->compiler == Py_None)
        return 0;
    PyObject *flag = PyObject_GetAttr(self->compiler, str_is_compiling_flag);
    if (flag == NULL) {
        PyErr_Clear();
        return 1;
    }
    int truth = flag == Py_False ? 0 : flag == Py_True ? 1 : PyObject_IsTrue(flag);
    Py_DECREF(flag);
    if (truth < 0) {
        PyErr_Clear();
        return 1;
    }
    return truth;
}

/* original(first, *args, **kwargs) */
static PyObject *
call_with(PyObject *original, PyObject *first, PyObject *args, PyObject *kwargs)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if ((kwargs == NULL || kwargs == Py_None || (PyDict_Check(kwargs) && !PyDict_GET_SIZE(kwargs)))
            && n < 8) {
        PyObject *stack[9];
        stack[0] = first;
        for (Py_ssize_t i = 0; i < n; i++)
            stack[i + 1] = PyTuple_GET_ITEM(args, i);
        return PyObject_Vectorcall(original, stack, n + 1, NULL);
    }
    PyObject *all = PyTuple_New(n + 1);
    if (all == NULL)
        return NULL;
    PyTuple_SET_ITEM(all, 0, Py_NewRef(first));
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(all, i + 1, Py_NewRef(PyTuple_GET_ITEM(args, i)));
    PyObject *result = PyObject_Call(original, all, kwargs == Py_None ? NULL : kwargs);
    Py_DECREF(all);
    return result;
}

/* self.<name>(original, *args, **kw) from a vector call's arguments. */
static PyObject *
call_python(HookState *self, PyObject *name, PyObject *original, PyObject *const *args,
            size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    Py_ssize_t total = n + (kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames));
    PyObject *small[10];
    PyObject **stack = total + 2 <= 10 ? small : PyMem_Malloc((total + 2) * sizeof(PyObject *));
    if (stack == NULL)
        return PyErr_NoMemory();
    stack[0] = (PyObject *)self;
    stack[1] = original;
    for (Py_ssize_t i = 0; i < total; i++)
        stack[i + 2] = args[i];
    PyObject *result = PyObject_VectorcallMethod(name, stack, n + 2, kwnames);
    if (stack != small)
        PyMem_Free(stack);
    return result;
}

/* hooks.py's call(original, module, args, kwargs): an outermost module call is the forward. */
static PyObject *
HookState_call(HookState *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "call(original, module, args, kwargs)");
        return NULL;
    }
    PyObject *original = args[0], *module = args[1];
    if (self->module_depth || !watching(self))
        return call_with(original, module, args[2], args[3]);
    StepFinder *finder = c_finder(self);
    if (finder == NULL || !refers_to(self->last_module, module)) {
        PyObject *stack[5] = {(PyObject *)self, original, module, args[2], args[3]};
        return PyObject_VectorcallMethod(str_python_call, stack, 5, NULL);
    }
    Py_INCREF(finder);
    if (forward_begin(finder) < 0) {
        give_up(self);
        Py_DECREF(finder);
        return call_with(original, module, args[2], args[3]);
    }
    self->module_depth = 1;
    self->forward_seen = 1;
    PyObject *result = call_with(original, module, args[2], args[3]);
    self->module_depth = 0;
    aside(self, finder, forward_end);
    Py_DECREF(finder);
    return result;
}

/* hooks.py's optimizer_pre(optimizer): an optimizer step begins. */
static PyObject *
HookState_optimizer_pre(HookState *self, PyObject *optimizer)
{
    if (!watching(self))
        Py_RETURN_NONE;
    StepFinder *finder = c_finder(self);
    if (finder == NULL || (!self->optimizer_depth && !refers_to(self->last_optimizer, optimizer)))
        return PyObject_CallMethodOneArg((PyObject *)self, str_python_optimizer_pre, optimizer);
    self->optimizer_depth += 1;
    if (self->optimizer_depth == 1 && begin_phase(finder, finder->optimizer) < 0)
        give_up(self);
    Py_RETURN_NONE;
}

/* hooks.py's optimizer_post(optimizer): an optimizer step ended; the outermost one ends the
   step. */
static PyObject *
HookState_optimizer_post(HookState *self, PyObject *optimizer)
{
    if (!watching(self) || !self->optimizer_depth)
        Py_RETURN_NONE;
    if (self->optimizer_depth > 1) {
        self->optimizer_depth -= 1;
        Py_RETURN_NONE;
    }
    StepFinder *finder = c_finder(self);
    if (finder == NULL || self->learning)
        return PyObject_CallMethodOneArg((PyObject *)self, str_python_optimizer_post, optimizer);
    self->optimizer_depth = 0;
    PyObject *id = PyLong_FromVoidPtr(optimizer);
    if (id == NULL) {
        give_up(self);
        Py_RETURN_NONE;
    }
    Py_INCREF(finder);
    if (optimizer_end(finder, id) < 0)
        give_up(self);
    else
        self->forward_seen = 0;
    Py_DECREF(finder);
    Py_DECREF(id);
    Py_RETURN_NONE;
}

/* The backward hook (torch.autograd.backward's wrapper). */
static PyObject *
hooked_backward(HookState *self, PyObject *original, PyObject *const *args, size_t nargsf,
                PyObject *kwnames)
{
    if (compiling(self) || !watching(self))
        return PyObject_Vectorcall(original, args, nargsf, kwnames);
    StepFinder *finder = c_finder(self);
    if (finder == NULL || !self->forward_seen)
        return call_python(self, str_python_backward, original, args, nargsf, kwnames);
    Py_INCREF(finder);
    if (begin_phase(finder, finder->backward) < 0) {
        give_up(self);
        Py_DECREF(finder);
        return PyObject_Vectorcall(original, args, nargsf, kwnames);
    }
    PyObject *result = PyObject_Vectorcall(original, args, nargsf, kwnames);
    aside(self, finder, end_phase);
    Py_DECREF(finder);
    return result;
}

/* The DataLoader hook (its iterators' __next__): the wait for a batch. */
static PyObject *
hooked_fetch(HookState *self, PyObject *original, PyObject *const *args, size_t nargsf,
             PyObject *kwnames)
{
    if (!watching(self) || PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL)
        return PyObject_Vectorcall(original, args, nargsf, kwnames);
    StepFinder *finder = c_finder(self);
    if (finder == NULL)
        return call_python(self, str_python_fetch, original, args, nargsf, kwnames);
    Py_INCREF(finder);
    if (finder->lingering && settle(finder) < 0) { /* a forward left open ends here */
        give_up(self);
        Py_DECREF(finder);
        return PyObject_Vectorcall(original, args, nargsf, kwnames);
    }
    double t0 = now();
    PyObject *batch = PyObject_Vectorcall(original, args, nargsf, kwnames);
    double t1 = now();
    if (batch == NULL) {
        if (PyErr_ExceptionMatches(PyExc_StopIteration)) {
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            self->optimizer_depth = 0; /* a batch is never fetched inside an optimizer step */
            if (finder_fetched(finder, t0, t1, Py_None, 0) < 0)
                give_up(self);
            PyErr_Restore(type, value, traceback);
        }
        Py_DECREF(finder);
        return NULL;
    }
    self->optimizer_depth = 0;
    if (finder_fetched(finder, t0, t1, batch, 1) < 0)
        give_up(self);
    Py_DECREF(finder);
    return batch;
}

static int
HookState_traverse(HookState *self, visitproc visit, void *arg)
{
    Py_VISIT(self->finder);
    Py_VISIT(self->last_module);
    Py_VISIT(self->last_optimizer);
    Py_VISIT(self->compiler);
    return 0;
}

static int
HookState_clear(HookState *self)
{
    Py_CLEAR(self->finder);
    Py_CLEAR(self->last_module);
    Py_CLEAR(self->last_optimizer);
    Py_CLEAR(self->compiler);
    return 0;
}

static void
HookState_dealloc(HookState *self)
{
    PyObject_GC_UnTrack(self);
    HookState_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self); /* (a subclass's dealloc releases its type) */
}

static PyMemberDef HookState_members[] = {
    {"finder", T_OBJECT, offsetof(HookState, finder), 0, "The process's step finder, or None."},
    {"last_module", T_OBJECT, offsetof(HookState, last_module), 0,
     "A weak reference to the last outermost module called, or None."},
    {"last_optimizer", T_OBJECT, offsetof(HookState, last_optimizer), 0,
     "A weak reference to the last optimizer stepped, or None."},
    {"compiler", T_OBJECT, offsetof(HookState, compiler), 0,
     "What holds _is_compiling_flag (torch.compiler), or None."},
    {"main", T_ULONG, offsetof(HookState, main), 0, "The training thread's ident."},
    {"module_depth", T_INT, offsetof(HookState, module_depth), 0, NULL},
    {"optimizer_depth", T_INT, offsetof(HookState, optimizer_depth), 0, NULL},
    {"learning", T_INT, offsetof(HookState, learning), 0,
     "Optimizer steps left before the wrap narrows (0: it does not)."},
    {"inert", T_BOOL, offsetof(HookState, inert), 0, "This process is not watched."},
    {"forward_seen", T_BOOL, offsetof(HookState, forward_seen), 0,
     "An outermost forward since the last optimizer step."},
    {NULL},
};

static PyMethodDef HookState_methods[] = {
    {"call", (PyCFunction)(void (*)(void))HookState_call, METH_FASTCALL,
     "call(original, module, args, kwargs)\n--\n\noriginal(module, *args, **kwargs), an "
     "outermost one timed as the forward."},
    {"optimizer_pre", (PyCFunction)HookState_optimizer_pre, METH_O, NULL},
    {"optimizer_post", (PyCFunction)HookState_optimizer_post, METH_O, NULL},
    {NULL},
};

static PyTypeObject HookStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client._hook.HookState",
    .tp_doc = "The common case of gpumon run's hooks, for a subclass that has the rest "
              "(python_call, python_backward, python_fetch, python_optimizer_pre, "
              "python_optimizer_post, give_up).",
    .tp_basicsize = sizeof(HookState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)HookState_dealloc,
    .tp_traverse = (traverseproc)HookState_traverse,
    .tp_clear = (inquiry)HookState_clear,
    .tp_members = HookState_members,
    .tp_methods = HookState_methods,
};

/* A hook that takes the place of a function (torch.autograd.backward) or of a method (a
   DataLoader iterator's __next__: it binds as a function does), with no Python frame of its
   own. functools.wraps can name it after what it wraps. */
typedef struct {
    PyObject_HEAD
    HookState *state;
    PyObject *original;
    PyObject *dict;
    vectorcallfunc vectorcall;
    char fetch; /* 1: a __next__, 0: the backward */
} Hooked;

static PyObject *
Hooked_vectorcall(Hooked *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (self->fetch)
        return hooked_fetch(self->state, self->original, args, nargsf, kwnames);
    return hooked_backward(self->state, self->original, args, nargsf, kwnames);
}

static PyObject *
Hooked_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"state", "original", "kind", NULL};
    PyObject *state, *original;
    const char *kind;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!Os", kwlist, &HookStateType, &state,
                                     &original, &kind))
        return NULL;
    int fetch = strcmp(kind, "fetch") == 0;
    if (!fetch && strcmp(kind, "backward") != 0) {
        PyErr_SetString(PyExc_ValueError, "kind: 'backward' or 'fetch'");
        return NULL;
    }
    Hooked *self = (Hooked *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->state = (HookState *)Py_NewRef(state);
    self->original = Py_NewRef(original);
    self->fetch = (char)fetch;
    self->vectorcall = (vectorcallfunc)Hooked_vectorcall;
    return (PyObject *)self;
}

static PyObject *
Hooked_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static int
Hooked_traverse(Hooked *self, visitproc visit, void *arg)
{
    Py_VISIT(self->state);
    Py_VISIT(self->original);
    Py_VISIT(self->dict);
    return 0;
}

static int
Hooked_clear(Hooked *self)
{
    Py_CLEAR(self->state);
    Py_CLEAR(self->original);
    Py_CLEAR(self->dict);
    return 0;
}

static void
Hooked_dealloc(Hooked *self)
{
    PyObject_GC_UnTrack(self);
    Hooked_clear(self);
    PyObject_GC_Del(self);
}

static PyGetSetDef Hooked_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject HookedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client._hook.Hooked",
    .tp_doc = "Hooked(state, original, kind)\n--\n\n"
              "gpumon run's backward ('backward') or DataLoader ('fetch') hook around original.",
    .tp_basicsize = sizeof(Hooked),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = Hooked_new,
    .tp_dealloc = (destructor)Hooked_dealloc,
    .tp_traverse = (traverseproc)Hooked_traverse,
    .tp_clear = (inquiry)Hooked_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Hooked, vectorcall),
    .tp_descr_get = Hooked_get,
    .tp_dictoffset = offsetof(Hooked, dict),
    .tp_getset = Hooked_getset,
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

static PyTypeObject LoaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client._hook.Loader",
    .tp_doc = "Yields a loader's items, timing each wait as the data phase of the next step.",
    .tp_basicsize = sizeof(Loader),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)Loader_dealloc,
    .tp_traverse = (traverseproc)Loader_traverse,
    .tp_clear = (inquiry)Loader_clear,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)Loader_next,
};

/* ---- CudaRuntime ------------------------------------------------------------------- */
/* CUDA events recorded through the CUDA runtime that torch has already loaded, with the GIL
 * held. torch.cuda.Event.record() releases the GIL around the call, and next to a thread
 * running Python the training thread can wait milliseconds to get it back; the runtime call
 * itself takes a few microseconds. Nothing here loads a library: the symbols are looked up in
 * what the process has loaded (the global scope, then any loaded libcudart), so a process
 * without CUDA finds none and cuda_runtime() returns None (the caller keeps torch's events). */

typedef int (*cuda_create_fn)(void **event, unsigned int flags);
typedef int (*cuda_record_fn)(void *event, void *stream);
typedef int (*cuda_query_fn)(void *event);
typedef int (*cuda_elapsed_fn)(float *ms, void *start, void *end);
typedef int (*cuda_destroy_fn)(void *event);
typedef int (*cuda_set_device_fn)(int device);

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
#define EVENT_POOL 1024

typedef struct {
    cuda_create_fn create;
    cuda_record_fn record;
    cuda_query_fn query;
    cuda_elapsed_fn elapsed;
    cuda_destroy_fn destroy;
    cuda_set_device_fn set_device;
} CudaApi;

typedef struct {
    PyObject_HEAD
    CudaApi api;
    int device;
    PyObject *current_stream; /* device -> raw cudaStream_t as int, or None: the default stream */
    long long record_errors;
    Py_ssize_t pooled;
    void *pool[EVENT_POOL];
} CudaRuntime;

static PyTypeObject CudaRuntimeType;

static int
resolve_api(void *handle, CudaApi *api)
{
    api->create = (cuda_create_fn)dlsym(handle, "cudaEventCreateWithFlags");
    api->record = (cuda_record_fn)dlsym(handle, "cudaEventRecord");
    api->query = (cuda_query_fn)dlsym(handle, "cudaEventQuery");
    api->elapsed = (cuda_elapsed_fn)dlsym(handle, "cudaEventElapsedTime");
    api->destroy = (cuda_destroy_fn)dlsym(handle, "cudaEventDestroy");
    api->set_device = (cuda_set_device_fn)dlsym(handle, "cudaSetDevice");
    return api->create && api->record && api->query && api->elapsed && api->destroy &&
           api->set_device;
}

typedef struct {
    CudaApi *api;
    int found;
    char path[4096];
} LoadedSearch;

static int
find_loaded_cudart(struct dl_phdr_info *info, size_t size, void *data)
{
    LoadedSearch *search = data;
    const char *name = info->dlpi_name;
    if (name == NULL || !*name)
        return 0;
    const char *base = strrchr(name, '/');
    base = base ? base + 1 : name;
    if (strncmp(base, "libcudart", 9) != 0)
        return 0;
    void *handle = dlopen(name, RTLD_NOW | RTLD_NOLOAD); /* already loaded: never loads one */
    if (handle == NULL)
        return 0;
    if (resolve_api(handle, search->api)) {
        search->found = 1;
        snprintf(search->path, sizeof search->path, "%s", name);
        return 1; /* the handle stays open: its functions are used from now on */
    }
    dlclose(handle);
    return 0;
}

/* The runtime's functions from the loaded libraries, or 0. *where names where they were found. */
static int
lookup_cuda_api(CudaApi *api, char *where, size_t where_size)
{
    if (resolve_api(RTLD_DEFAULT, api)) {
        snprintf(where, where_size, "global scope");
        return 1;
    }
    LoadedSearch search = {api, 0, {0}};
    dl_iterate_phdr(find_loaded_cudart, &search);
    if (search.found)
        snprintf(where, where_size, "%s", search.path);
    return search.found;
}

static PyObject *
hook_cuda_runtime(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "cuda_runtime(device, current_stream)");
        return NULL;
    }
    int device = PyLong_AsLong(args[0]);
    if (device == -1 && PyErr_Occurred())
        return NULL;
    if (args[1] != Py_None && !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "current_stream must be callable or None");
        return NULL;
    }
    CudaApi api;
    char where[4096];
    if (!lookup_cuda_api(&api, where, sizeof where))
        Py_RETURN_NONE;
    CudaRuntime *self = PyObject_GC_New(CudaRuntime, &CudaRuntimeType);
    if (self == NULL)
        return NULL;
    self->api = api;
    self->device = device;
    self->current_stream = Py_NewRef(args[1]);
    self->record_errors = 0;
    self->pooled = 0;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static void *
as_event(PyObject *handle)
{
    void *event = PyLong_AsVoidPtr(handle);
    if (event == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "not an event of this runtime");
    return event;
}

/* record(): a timing event recorded now on the current stream, as an int handle; None when
 * the runtime refused (counted in record_errors): a phase without events is host-timed. */
static PyObject *
CudaRuntime_record(CudaRuntime *self, PyObject *unused)
{
    void *stream = NULL;
    if (self->current_stream != Py_None) {
        PyObject *device = PyLong_FromLong(self->device);
        if (device == NULL)
            return NULL;
        PyObject *raw = PyObject_CallOneArg(self->current_stream, device);
        Py_DECREF(device);
        if (raw == NULL) { /* that private call failed: the default stream from now on */
            PyErr_Clear();
            Py_SETREF(self->current_stream, Py_NewRef(Py_None));
        } else {
            stream = PyLong_AsVoidPtr(raw);
            Py_DECREF(raw);
            if (stream == NULL && PyErr_Occurred())
                PyErr_Clear();
        }
    }
    void *event = NULL;
    if (self->pooled)
        event = self->pool[--self->pooled];
    else if (self->api.create(&event, 0) != CUDA_SUCCESS) {
        self->record_errors += 1;
        Py_RETURN_NONE;
    }
    if (self->api.record(event, stream) != CUDA_SUCCESS) {
        self->record_errors += 1;
        self->api.destroy(event);
        Py_RETURN_NONE;
    }
    return PyLong_FromVoidPtr(event);
}

/* query(event): whether the GPU has passed it (sets this thread's device first, as torch
 * does, so the sender thread never makes a context on another GPU). */
static PyObject *
CudaRuntime_query(CudaRuntime *self, PyObject *handle)
{
    void *event = as_event(handle);
    if (event == NULL)
        return NULL;
    if (self->api.set_device(self->device) != CUDA_SUCCESS) {
        PyErr_SetString(PyExc_RuntimeError, "cudaSetDevice failed");
        return NULL;
    }
    int rc = self->api.query(event);
    if (rc == CUDA_SUCCESS)
        Py_RETURN_TRUE;
    if (rc == CUDA_ERROR_NOT_READY)
        Py_RETURN_FALSE;
    PyErr_Format(PyExc_RuntimeError, "cudaEventQuery failed (%d)", rc);
    return NULL;
}

static PyObject *
CudaRuntime_elapsed_ms(CudaRuntime *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "elapsed_ms(start, end)");
        return NULL;
    }
    void *start = as_event(args[0]);
    if (start == NULL)
        return NULL;
    void *end = as_event(args[1]);
    if (end == NULL)
        return NULL;
    float ms = 0.0f;
    int rc = self->api.elapsed(&ms, start, end);
    if (rc != CUDA_SUCCESS) {
        PyErr_Format(PyExc_RuntimeError, "cudaEventElapsedTime failed (%d)", rc);
        return NULL;
    }
    return PyFloat_FromDouble((double)ms);
}

/* release(event): back to the pool once read (destroyed beyond EVENT_POOL). */
static PyObject *
CudaRuntime_release(CudaRuntime *self, PyObject *handle)
{
    void *event = as_event(handle);
    if (event == NULL)
        return NULL;
    if (self->pooled < EVENT_POOL)
        self->pool[self->pooled++] = event;
    else
        self->api.destroy(event);
    Py_RETURN_NONE;
}

static PyObject *
CudaRuntime_get_record_errors(CudaRuntime *self, void *closure)
{
    return PyLong_FromLongLong(self->record_errors);
}

static PyObject *
CudaRuntime_get_pooled(CudaRuntime *self, void *closure)
{
    return PyLong_FromSsize_t(self->pooled);
}

static int
CudaRuntime_traverse(CudaRuntime *self, visitproc visit, void *arg)
{
    Py_VISIT(self->current_stream);
    return 0;
}

static int
CudaRuntime_clear(CudaRuntime *self)
{
    Py_CLEAR(self->current_stream);
    return 0;
}

static void
CudaRuntime_dealloc(CudaRuntime *self)
{
    PyObject_GC_UnTrack(self);
    while (self->pooled) /* events handed out and never released stay with the process */
        self->api.destroy(self->pool[--self->pooled]);
    CudaRuntime_clear(self);
    PyObject_GC_Del(self);
}

static PyMethodDef CudaRuntime_methods[] = {
    {"record", (PyCFunction)CudaRuntime_record, METH_NOARGS,
     "record()\n--\n\nA timing event recorded now on the current stream (an int), or None."},
    {"query", (PyCFunction)CudaRuntime_query, METH_O,
     "query(event)\n--\n\nWhether the GPU has passed event."},
    {"elapsed_ms", (PyCFunction)(void (*)(void))CudaRuntime_elapsed_ms, METH_FASTCALL,
     "elapsed_ms(start, end)\n--\n\nGPU milliseconds between two completed events."},
    {"release", (PyCFunction)CudaRuntime_release, METH_O,
     "release(event)\n--\n\nGive a read event back for reuse."},
    {NULL},
};

static PyGetSetDef CudaRuntime_getset[] = {
    {"record_errors", (getter)CudaRuntime_get_record_errors, NULL,
     "Events the runtime refused to create or record.", NULL},
    {"pooled", (getter)CudaRuntime_get_pooled, NULL, "Events waiting for reuse.", NULL},
    {NULL},
};

static PyTypeObject CudaRuntimeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client._hook.CudaRuntime",
    .tp_doc = "CUDA events through the loaded CUDA runtime, the GIL held (see cuda_runtime()).",
    .tp_basicsize = sizeof(CudaRuntime),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)CudaRuntime_dealloc,
    .tp_traverse = (traverseproc)CudaRuntime_traverse,
    .tp_clear = (inquiry)CudaRuntime_clear,
    .tp_methods = CudaRuntime_methods,
    .tp_getset = CudaRuntime_getset,
};

/* ---- format_step -------------------------------------------------------------------- */
/* The common case of gpumon.wire.step_encoder.StepEncoder.encode, byte for byte: a step record's
 * head, phases and counts, when every value is one the encoder writes as it is (no field left
 * out, no phase clamped or folded, no allocator statistics or GPU-timed phases: those return
 * None and the encoder formats the record itself, counting what it leaves out). Numbers are
 * written by PyOS_double_to_string with the parameters Python's %-formatting and repr() pass
 * it, so the text is the text the encoder's templates would make.
 * tests/wire/test_step_encoder.py holds the two to the same output. */

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

static PyObject *
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
static PyObject *
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

/* ---- module ------------------------------------------------------------------------- */

static PyObject *
hook_perf_counter(PyObject *module, PyObject *unused)
{
    return PyFloat_FromDouble(now());
}

static PyMethodDef module_methods[] = {
    {"perf_counter", hook_perf_counter, METH_NOARGS,
     "The clock the hook reads: equal to time.perf_counter() on Linux."},
    {"format_step", (PyCFunction)(void (*)(void))hook_format_step, METH_FASTCALL,
     "format_step(prefix, step, default_step, t_start, duration, phases, samples, tokens, flops)\n--\n\n"
     "A step record up to its counts as StepEncoder.encode writes it, or None (it then does)."},
    {"set_step_limits", (PyCFunction)(void (*)(void))hook_set_step_limits, METH_FASTCALL,
     "set_step_limits(max_step, max_count, max_flops, max_phases)\n--\n\n"
     "What format_step writes as it is (the wire's limits); until set it returns None."},
    {"cuda_runtime", (PyCFunction)(void (*)(void))hook_cuda_runtime, METH_FASTCALL,
     "cuda_runtime(device, current_stream)\n--\n\n"
     "Events through the CUDA runtime the process has loaded, or None where it has none.\n"
     "current_stream(device) gives the raw current stream (None: the default stream)."},
    {NULL},
};

static struct PyModuleDef hook_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gpumon.client._hook",
    .m_doc = "The training thread's half of StepMonitor, in C (see gpumon.client.core._core).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__hook(void)
{
    if (PyType_Ready(&HookCoreType) < 0 || PyType_Ready(&StepType) < 0 ||
        PyType_Ready(&PhaseType) < 0 || PyType_Ready(&LoaderType) < 0 ||
        PyType_Ready(&CudaRuntimeType) < 0 || PyType_Ready(&StepFinderType) < 0 ||
        PyType_Ready(&HookStateType) < 0 || PyType_Ready(&HookedType) < 0)
        return NULL;
    none3[0] = none3[1] = none3[2] = Py_None;
#define INTERN(var, text)                               \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;
    INTERN(str_append, "append");
    INTERN(str_event, "event");
    INTERN(str_memory, "memory");
    INTERN(str_share_gap_s, "share_gap_s");
    INTERN(str_data, "data");
    INTERN(str_begin, "begin");
    INTERN(str_end, "end");
    INTERN(str_device_interval_s, "device_interval_s");
    INTERN(str_shape, "shape");
    INTERN(str_step_ctx, "step");
    INTERN(str_phase_ctx, "phase");
    INTERN(str_forward, "forward");
    INTERN(str_backward, "backward");
    INTERN(str_optimizer, "optimizer");
    INTERN(str_give_up, "give_up");
    INTERN(str_python_call, "python_call");
    INTERN(str_python_backward, "python_backward");
    INTERN(str_python_fetch, "python_fetch");
    INTERN(str_python_optimizer_pre, "python_optimizer_pre");
    INTERN(str_python_optimizer_post, "python_optimizer_post");
    INTERN(str_is_compiling_flag, "_is_compiling_flag");
    INTERN(step_kwnames[0], "samples");
    INTERN(step_kwnames[1], "tokens");
    INTERN(step_kwnames[2], "flops");
    INTERN(step_kwnames[3], "step");
    INTERN(step_kwnames[4], "memory");
#undef INTERN
    PyObject *module = PyModule_Create(&hook_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "HookCore", (PyObject *)&HookCoreType) < 0 ||
        PyModule_AddObjectRef(module, "Step", (PyObject *)&StepType) < 0 ||
        PyModule_AddObjectRef(module, "Phase", (PyObject *)&PhaseType) < 0 ||
        PyModule_AddObjectRef(module, "StepFinder", (PyObject *)&StepFinderType) < 0 ||
        PyModule_AddObjectRef(module, "HookState", (PyObject *)&HookStateType) < 0 ||
        PyModule_AddObjectRef(module, "Hooked", (PyObject *)&HookedType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
