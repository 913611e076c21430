
#include "hook.h"

static PyObject *mapping_abc; /* collections.abc.Mapping, looked up at the first batch that needs it */
/* gpumon.client.autowatch.steps.StepFinder for a monitor whose core is this module's: the
 * events `gpumon run`'s hooks see (a batch fetched, the outermost forward, the backward, an
 * optimizer step) open and close the core's Step and Phase here, without a Python frame in
 * between. steps.py is the reference, followed statement by statement;
 * tests/client/test_autowatch_steps.py drives both through every case and
 * test_both_finders_leave_the_same_steps through the same random events. */

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
        PyErr_SetString(PyExc_TypeError, "the monitor's core is not gpumon.client.core._hook's");
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
            PyErr_SetString(PyExc_TypeError, "the monitor's core is not gpumon.client.core._hook's");
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

int
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

int
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

int
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

int
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
int
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

int
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
int
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

PyTypeObject StepFinderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client.core._hook.StepFinder",
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
