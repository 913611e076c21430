/* NVML entry points the peers (nvitop-exporter, gpustat) call that the fake NVML lacks.
 *
 * Compiled together with gpumon/testing/fakenvml/fake_nvml.c into one libnvidia-ml.so.1 by
 * benchmarks/bench_peers.py, so every agent in the comparison loads the same library.
 * Without these, pynvml looks a missing symbol up again on every call and raises: that
 * would bill the peers for a cost a real driver does not have, and gpustat would fail.
 * Each answers as an H100 SXM training node does: no graphics processes, idle video
 * engines, no fan, confidential computing off, no new per-process samples.
 */

#define NVML_SUCCESS 0
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                      void *infos)
{
    (void)device;
    (void)infos;
    *count = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                      void *infos)
{
    return nvmlDeviceGetGraphicsRunningProcesses_v3(device, count, infos);
}

static nvmlReturn_t idle_engine(unsigned int *utilization, unsigned int *sampling_period_us)
{
    *utilization = 0;
    *sampling_period_us = 167000;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                             unsigned int *sampling_period_us)
{
    (void)device;
    return idle_engine(utilization, sampling_period_us);
}

nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                             unsigned int *sampling_period_us)
{
    (void)device;
    return idle_engine(utilization, sampling_period_us);
}

nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, int counter, unsigned int *kib_per_s)
{
    (void)device;
    *kib_per_s = counter == 0 ? 1264128u : 2401472u; /* TX, RX */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t device, unsigned int *speed)
{
    (void)device;
    (void)speed;
    return NVML_ERROR_NOT_SUPPORTED; /* SXM boards have no fan of their own */
}

nvmlReturn_t nvmlDeviceGetConfComputeMemSizeInfo(nvmlDevice_t device, void *info)
{
    (void)device;
    (void)info;
    return NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, void *samples,
                                             unsigned int *count, unsigned long long last_seen)
{
    (void)device;
    (void)samples;
    (void)last_seen;
    *count = 0;
    return NVML_ERROR_NOT_FOUND;
}
