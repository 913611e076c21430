/* gpumon.client.core._hook: the hook's hot path in C, the twin of the Python modules hook.h
 * lists (one file each). This file is the module: its functions, its types and the names the
 * parts share, interned once. */

#include "hook.h"

PyObject *str_append, *str_event, *str_memory, *str_share_gap_s, *str_data, *str_begin, *str_end,
    *str_device_interval_s;
PyObject *str_view;
PyObject *step_kwnames[5];
PyObject *str_shape, *str_step_ctx, *str_phase_ctx, *str_forward, *str_backward, *str_optimizer,
    *none3[3];
PyObject *str_give_up, *str_python_call, *str_python_backward, *str_python_fetch,
    *str_python_optimizer_pre, *str_python_optimizer_post, *str_is_compiling_flag;

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
    .m_name = "gpumon.client.core._hook",
    .m_doc = "The training thread's half of StepMonitor, in C (see gpumon.client.core.step_core).",
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
    INTERN(str_view, "view");
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
