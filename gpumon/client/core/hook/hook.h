/* Declarations the parts of gpumon.client.core._hook share: the C twins of the client's Python
 * modules, one file each, built as one extension (setup.py):
 *
 *   step_core.c    HookCore, Step, Phase, Loader      gpumon/client/core/step_core.py
 *   cuda_runtime.c CudaRuntime, cuda_runtime()        gpumon/client/core/cuda_clock.py (CudaClock's events)
 *   format_step.c  format_step(), set_step_limits()   gpumon/wire/step_encoder.py (Formatter)
 *   step_finder.c  StepFinder                         gpumon/client/autowatch/steps.py
 *   run_hooks.c    HookState, Hooked                  gpumon/client/autowatch/state.py (PythonState)
 *   module.c       the module: its functions, types and interned names
 *
 * Each Python module is the reference its twin follows statement by statement; the tests drive
 * both through the same scripts (tests/client/test_core.py, test_autowatch_steps.py, ...).
 * Timestamps are CLOCK_MONOTONIC seconds as doubles, computed as time.perf_counter() computes
 * them on Linux, so they mix with the perf_counter() readings of the Python code around.
 * Symbols shared between the parts are hidden from outside the extension (-fvisibility=hidden).
 */

#ifndef GPUMON_HOOK_H
#define GPUMON_HOOK_H

#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE /* dl_iterate_phdr, RTLD_DEFAULT */
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#if !defined(__linux__)
#error "timestamps must match time.perf_counter(), which is CLOCK_MONOTONIC on Linux only"
#endif

/* Names interned once by the module's init (module.c). */
extern PyObject *str_append, *str_event, *str_memory, *str_share_gap_s, *str_data, *str_begin,
    *str_end, *str_device_interval_s;
extern PyObject *step_kwnames[5]; /* samples, tokens, flops, step, memory */
extern PyObject *str_shape, *str_step_ctx, *str_phase_ctx, *str_forward, *str_backward,
    *str_optimizer, *none3[3];
extern PyObject *str_view;
extern PyObject *str_give_up, *str_python_call, *str_python_backward, *str_python_fetch,
    *str_python_optimizer_pre, *str_python_optimizer_post, *str_is_compiling_flag;

#define OR_NONE(x) ((x) == NULL ? Py_None : (x))
/* Where CudaClock.memory()'s tuple holds the OOM count: cuda_clock.MEMORY_OOMS, the index of "ooms"
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

/* ---- step_core.c ------------------------------------------------------------------- */

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
    PyObject *cuda_before;  /* the clock set_cuda replaced, or NULL: kept one more swap,
                               since a step in progress may still hold it borrowed */
    PyObject *last_ooms;    /* int or None */
    PyObject *buffer;       /* deque of step tuples, shared with the sender */
    PyObject *append;       /* its bound append (a step's record costs no method lookup) */
    PyObject *first_step;   /* the monitor's callbacks */
    PyObject *step_failed;
    PyObject *phase_clock;
    PyObject *extensions;   /* StepExtensions, or NULL: none registered, nothing to call */
    PyObject *open_phase;   /* borrowed from its cached Phase: the open outermost phase, or NULL */
    char loading;           /* the loader waits for the next item */
    char extensions_called; /* the open step's extensions were told it began */
    double quiet_until;     /* until then no extension needs a call (set_quiet_until) */
    Py_buffer ring_view;    /* the step ring's mapping, held while ring != NULL (set_ring) */
    char *ring;             /* its bytes (gpumon/wire/ring.py's layout), or NULL: no ring */
    long long ring_capacity;
    long long ring_written;
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

extern PyTypeObject HookCoreType, StepType, PhaseType, LoaderType;
int data_wait(HookCore *self, double t0, double t1);
PyObject *Step_set_counts(Step *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Step_enter(Step *self, PyObject *unused);
PyObject *Step_exit(Step *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Phase_enter(Phase *self, PyObject *unused);
PyObject *Phase_exit(Phase *self, PyObject *const *args, Py_ssize_t nargs);

/* ---- step_finder.c ----------------------------------------------------------------- */

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

extern PyTypeObject StepFinderType;
int settle(StepFinder *self);
int begin_phase(StepFinder *self, Phase *phase);
int forward_begin(StepFinder *self);
int end_phase(StepFinder *self);
int finder_fetched(StepFinder *self, double t0, double t1, PyObject *batch, int got);
int forward_end(StepFinder *self);
int optimizer_end(StepFinder *self, PyObject *optimizer_id);

/* ---- run_hooks.c ------------------------------------------------------------------- */

extern PyTypeObject HookStateType, HookedType;

/* ---- cuda_runtime.c ---------------------------------------------------------------- */

extern PyTypeObject CudaRuntimeType;
PyObject *hook_cuda_runtime(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* ---- format_step.c ----------------------------------------------------------------- */

PyObject *hook_set_step_limits(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *hook_format_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
