
#include "hook.h"

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

PyTypeObject HookStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client.core._hook.HookState",
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

PyTypeObject HookedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client.core._hook.Hooked",
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
