/* A stand-in for libcudart with the six functions gpumon's C core looks up, for tests on
 * machines without a GPU: events remember the "GPU time" the test set when they were recorded,
 * and the stream they were recorded on; the test says when the GPU has passed them. Each
 * record also asks the interpreter whether its caller holds the GIL. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>

typedef struct { double t; void *stream; int alive; } FakeEvent;

static double gpu_time_ms;
static int completed = 1;
static int created, destroyed, recorded, set_device_calls, last_device = -1;
static void *last_stream;
static int fail_records;
static int records_without_gil;

void fake_set_time_ms(double ms) { gpu_time_ms = ms; }
void fake_set_completed(int done) { completed = done; }
void fake_fail_records(int fail) { fail_records = fail; }
int fake_created(void) { return created; }
int fake_destroyed(void) { return destroyed; }
int fake_recorded(void) { return recorded; }
int fake_last_device(void) { return last_device; }
int fake_records_without_gil(void) { return records_without_gil; }
void *fake_last_stream(void) { return last_stream; }

int cudaEventCreateWithFlags(void **event, unsigned int flags)
{
    FakeEvent *e = calloc(1, sizeof *e);
    if (e == NULL)
        return 2; /* cudaErrorMemoryAllocation */
    e->alive = 1;
    created++;
    *event = e;
    return 0;
}

int cudaEventRecord(void *event, void *stream)
{
    if (fail_records)
        return 709; /* cudaErrorContextIsDestroyed */
    int (*gil_held)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Check");
    if (gil_held == NULL || !gil_held())
        records_without_gil++;
    FakeEvent *e = event;
    e->t = gpu_time_ms;
    e->stream = stream;
    last_stream = stream;
    recorded++;
    return 0;
}

int cudaEventQuery(void *event) { return completed ? 0 : 600; /* cudaErrorNotReady */ }

int cudaEventElapsedTime(float *ms, void *start, void *end)
{
    if (!completed)
        return 600;
    *ms = (float)(((FakeEvent *)end)->t - ((FakeEvent *)start)->t);
    return 0;
}

int cudaEventDestroy(void *event)
{
    ((FakeEvent *)event)->alive = 0;
    destroyed++;
    free(event);
    return 0;
}

int cudaSetDevice(int device)
{
    set_device_calls++;
    last_device = device;
    return 0;
}
