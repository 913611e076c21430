/* CUDA events recorded through the CUDA runtime that torch has already loaded, with the GIL
 * held. torch.cuda.Event.record() releases the GIL around the call, and next to a thread
 * running Python the training thread can wait milliseconds to get it back; the runtime call
 * itself takes a few microseconds. Nothing here loads a library: the symbols are looked up in
 * what the process has loaded (the global scope, then any loaded libcudart), so a process
 * without CUDA finds none and cuda_runtime() returns None (the caller keeps torch's events). */

#include "hook.h" /* first: its _GNU_SOURCE gives dl_iterate_phdr */

#include <dlfcn.h>
#include <link.h>

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

PyObject *
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

PyTypeObject CudaRuntimeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumon.client.core._hook.CudaRuntime",
    .tp_doc = "CUDA events through the loaded CUDA runtime, the GIL held (see cuda_runtime()).",
    .tp_basicsize = sizeof(CudaRuntime),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)CudaRuntime_dealloc,
    .tp_traverse = (traverseproc)CudaRuntime_traverse,
    .tp_clear = (inquiry)CudaRuntime_clear,
    .tp_methods = CudaRuntime_methods,
    .tp_getset = CudaRuntime_getset,
};
