/*
 * fake_nvml.c - a scenario-driven stand-in for libnvidia-ml.so.1.
 *
 * The unmodified nvidia-ml-py binding (pynvml) loads this library through
 * ctypes, so gpumon's NVML collector can be exercised on machines without a
 * GPU.  Everything the library reports comes from a plain-text scenario file
 * named by the FAKE_NVML_SCENARIO environment variable; the format is
 * documented in README.md next to this file.
 *
 * NVML conventions followed here:
 *   - every entry point returns an nvmlReturn_t code (values as in nvml.h);
 *   - calls made before nvmlInit (or after the last nvmlShutdown) return
 *     NVML_ERROR_UNINITIALIZED; init is reference counted;
 *   - versioned structs carry version = sizeof(struct) | (ver << 24) and a
 *     wrong version gives NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
 *   - strings are NUL-terminated and the caller's length is honoured
 *     (NVML_ERROR_INSUFFICIENT_SIZE when it is too short);
 *   - list getters follow the two-call INSUFFICIENT_SIZE pattern;
 *   - device handles are pointers into a static array and stay valid;
 *   - all state sits behind one mutex; nvmlEventSetWait_v2 blocks on a
 *     condition variable (so the mutex is released while it waits) and a
 *     scenario "hang" sleeps without holding the mutex.
 *
 * Build:  gcc -shared -fPIC -O2 -pthread -Wall -Werror \
 *             -o libnvidia-ml.so.1 fake_nvml.c
 * Add -DFAKE_NVML_OLD_DRIVER for a library that lacks the newer symbols
 * (see README.md).
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

/* ------------------------------------------------------------------ */
/* NVML types and constants (subset of nvml.h)                          */
/* ------------------------------------------------------------------ */

typedef int nvmlReturn_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_ALREADY_INITIALIZED 5
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_INSUFFICIENT_POWER 8
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_IRQ_ISSUE 11
#define NVML_ERROR_LIBRARY_NOT_FOUND 12
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_CORRUPTED_INFOROM 14
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_RESET_REQUIRED 16
#define NVML_ERROR_OPERATING_SYSTEM 17
#define NVML_ERROR_LIB_RM_VERSION_MISMATCH 18
#define NVML_ERROR_IN_USE 19
#define NVML_ERROR_MEMORY 20
#define NVML_ERROR_NO_DATA 21
#define NVML_ERROR_VGPU_ECC_NOT_SUPPORTED 22
#define NVML_ERROR_INSUFFICIENT_RESOURCES 23
#define NVML_ERROR_FREQ_NOT_SUPPORTED 24
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_DEPRECATED 26
#define NVML_ERROR_NOT_READY 27
#define NVML_ERROR_GPU_NOT_FOUND 28
#define NVML_ERROR_INVALID_STATE 29
#define NVML_ERROR_RESET_TYPE_NOT_SUPPORTED 30
#define NVML_ERROR_UNKNOWN 999

#define NVML_STRUCT_VERSION(type, ver) ((unsigned int)(sizeof(type) | ((ver) << 24)))

#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define NVML_VALUE_TYPE_UNSIGNED_LONG_LONG 3

#define NVML_GPU_UTILIZATION_SAMPLES 1
#define NVML_MEMORY_UTILIZATION_SAMPLES 2

#define NVML_FI_DEV_MEMORY_TEMP 82
#define NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION 83
#define NVML_FI_DEV_NVLINK_LINK_COUNT 91
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX 138
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX 139
#define NVML_FI_DEV_PCIE_COUNT_TX_BYTES 197
#define NVML_FI_DEV_PCIE_COUNT_RX_BYTES 198
#define NVML_SCOPE_ALL_LINKS 0xFFFFFFFFu

#define nvmlEventTypeSingleBitEccError 0x1ULL
#define nvmlEventTypeDoubleBitEccError 0x2ULL
#define nvmlEventTypePState 0x4ULL
#define nvmlEventTypeXidCriticalError 0x8ULL
#define nvmlEventTypeClock 0x10ULL

#define NVML_GPM_METRICS_GET_VERSION 1
#define NVML_GPM_SUPPORT_VERSION 1
#define NVML_GPM_METRIC_MAX 477 /* as in nvidia-ml-py 13.x */

#define NVML_DEVICE_ARCH_HOPPER 9

struct fake_gpu;
struct fake_evset;
struct fake_gpm_sample;
typedef struct fake_gpu *nvmlDevice_t;
typedef struct fake_evset *nvmlEventSet_t;
typedef struct fake_gpm_sample *nvmlGpmSample_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 NVML_STRUCT_VERSION(nvmlMemory_v2_t, 2)

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int version;
    unsigned int sensorType;
    int temperature;
} nvmlTemperature_v1_t;
#define nvmlTemperature_v1 NVML_STRUCT_VERSION(nvmlTemperature_v1_t, 1)

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;
typedef nvmlProcessInfo_v2_t nvmlProcessInfo_t; /* v3 has the same layout */

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct {
    unsigned long long timeStamp;
    nvmlValue_t sampleValue;
} nvmlSample_t;

typedef struct {
    unsigned int version;
    unsigned int isSupportedDevice;
} nvmlGpmSupport_t;

typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    struct {
        const char *shortName;
        const char *longName;
        const char *unit;
    } metricInfo;
} nvmlGpmMetric_t;

typedef struct {
    unsigned int version;
    unsigned int numMetrics;
    nvmlGpmSample_t sample1;
    nvmlGpmSample_t sample2;
    nvmlGpmMetric_t metrics[]; /* caller sizes it (NVML_GPM_METRIC_MAX) */
} nvmlGpmMetricsGet_t;

_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t layout");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t layout");
_Static_assert(nvmlMemory_v2 == 0x02000028, "nvmlMemory_v2 version");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout");
_Static_assert(sizeof(nvmlTemperature_v1_t) == 12, "nvmlTemperature_v1_t layout");
_Static_assert(nvmlTemperature_v1 == 0x100000C, "nvmlTemperature_v1 version");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t layout");
_Static_assert(sizeof(nvmlProcessInfo_v2_t) == 24, "nvmlProcessInfo_v2_t layout");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t layout");
_Static_assert(sizeof(nvmlSample_t) == 16, "nvmlSample_t layout");
_Static_assert(sizeof(nvmlGpmMetric_t) == 40, "nvmlGpmMetric_t layout");
_Static_assert(offsetof(nvmlGpmMetricsGet_t, metrics) == 24, "nvmlGpmMetricsGet_t layout");

#define API __attribute__((visibility("default")))

/* ------------------------------------------------------------------ */
/* Scenario model                                                       */
/* ------------------------------------------------------------------ */

#define MAX_GPUS 32
#define MAX_PROCS 64
#define MAX_XIDS 32
#define MAX_HANGS 32
#define GPM_IDS 128 /* metric ids below this can be configured */
#define SAMPLE_BUFFER 120 /* driver-side utilisation sample ring (20 s) */
#define SAMPLES_PER_S 6
#define RELOAD_CHECK_S 0.05
#define WAIT_SLICE_S 0.05

enum {
    CT_NVL_TX,
    CT_NVL_RX,
    CT_PCIE_TX,
    CT_PCIE_RX,
    CT_ENERGY,
    CT_GPM0, /* CT_GPM0 + metric id: integral of the configured GPM value */
    NCTR = CT_GPM0 + GPM_IDS
};

/* groups of calls a scenario can mark NOT_SUPPORTED */
enum {
    G_MEMORY = 1 << 0,
    G_UTILIZATION = 1 << 1,
    G_POWER = 1 << 2,
    G_ENERGY = 1 << 3,
    G_TEMPERATURE = 1 << 4,
    G_CLOCKS = 1 << 5,
    G_CLOCK_REASONS = 1 << 6,
    G_ECC = 1 << 7,
    G_NVLINK = 1 << 8,
    G_PCIE = 1 << 9,
    G_GPM = 1 << 10,
    G_MIG = 1 << 11,
    G_PROCESSES = 1 << 12,
    G_EVENTS = 1 << 13,
    G_SAMPLES = 1 << 14,
};

static const struct {
    const char *name;
    unsigned int bit;
} k_groups[] = {
    {"memory", G_MEMORY},       {"utilization", G_UTILIZATION},
    {"power", G_POWER},         {"energy", G_ENERGY},
    {"temperature", G_TEMPERATURE}, {"clocks", G_CLOCKS},
    {"clock_reasons", G_CLOCK_REASONS}, {"ecc", G_ECC},
    {"nvlink", G_NVLINK},       {"pcie", G_PCIE},
    {"gpm", G_GPM},             {"mig", G_MIG},
    {"processes", G_PROCESSES}, {"events", G_EVENTS},
    {"samples", G_SAMPLES},
};

/* entry points a `hang` line can name (all but nvmlErrorString) */
static const char *const k_symbols[] = {
    "nvmlInitWithFlags", "nvmlInit_v2", "nvmlShutdown",
    "nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion",
    "nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetIndex",
    "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetArchitecture", "nvmlDeviceGetMigMode", "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetClockInfo", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetPowerManagementLimit", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureV", "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetSupportedClocksEventReasons",
    "nvmlDeviceGetSupportedClocksThrottleReasons", "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetFieldValues", "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2", "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents", "nvmlDeviceGetSupportedEventTypes",
    "nvmlEventSetWait_v2", "nvmlEventSetFree", "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc", "nvmlGpmSampleFree", "nvmlGpmSampleGet", "nvmlGpmMetricsGet",
    "nvmlDeviceGetSamples",
};

static const struct {
    const char *name;
    unsigned int value;
} k_archs[] = {
    {"kepler", 2}, {"maxwell", 3}, {"pascal", 4}, {"volta", 5}, {"turing", 6},
    {"ampere", 7}, {"ada", 8},     {"hopper", 9}, {"blackwell", 10},
};

static const struct {
    unsigned int id;
    const char *key; /* scenario key */
    const char *short_name, *long_name, *unit;
} k_gpm[] = {
    {1, "gpm_graphics_util", "GR_UTIL", "Graphics utilization", "%"},
    {2, "gpm_sm_util", "SM_UTIL", "SM utilization", "%"},
    {3, "gpm_sm_occupancy", "SM_OCCUPANCY", "SM occupancy", "%"},
    {4, "gpm_integer_util", "INTEGER_UTIL", "Integer utilization", "%"},
    {5, "gpm_tensor_util", "ANY_TENSOR_UTIL", "Any tensor utilization", "%"},
    {6, "gpm_dfma_tensor_util", "DFMA_TENSOR_UTIL", "DFMA tensor utilization", "%"},
    {7, "gpm_hmma_tensor_util", "HMMA_TENSOR_UTIL", "HMMA tensor utilization", "%"},
    {8, "gpm_dmma_tensor_util", "DMMA_TENSOR_UTIL", "DMMA tensor utilization", "%"},
    {9, "gpm_imma_tensor_util", "IMMA_TENSOR_UTIL", "IMMA tensor utilization", "%"},
    {10, "gpm_dram_bw_util", "DRAM_BW_UTIL", "DRAM bandwidth utilization", "%"},
    {11, "gpm_fp64_util", "FP64_UTIL", "FP64 utilization", "%"},
    {12, "gpm_fp32_util", "FP32_UTIL", "FP32 utilization", "%"},
    {13, "gpm_fp16_util", "FP16_UTIL", "FP16 utilization", "%"},
    {20, "gpm_pcie_tx_mib_per_s", "PCIE_TX", "PCIe TX bandwidth", "MiB/s"},
    {21, "gpm_pcie_rx_mib_per_s", "PCIE_RX", "PCIe RX bandwidth", "MiB/s"},
    {60, "gpm_nvlink_rx_mib_per_s", "NVLINK_RX", "NVLink RX bandwidth, all links", "MiB/s"},
    {61, "gpm_nvlink_tx_mib_per_s", "NVLINK_TX", "NVLink TX bandwidth, all links", "MiB/s"},
};
#define GPM_NVLINK_TOTAL_RX 60
#define GPM_NVLINK_TOTAL_TX 61
#define GPM_NVLINK_L0_RX 62 /* L<n>_RX = 62 + 2n, L<n>_TX = 63 + 2n, n < 18 */
#define GPM_NVLINK_PER_LINK_MAX 18

struct hang {
    char sym[64];
    double secs;
};

struct xid {
    unsigned long long code;
    double at_s;       /* seconds after init, as written */
    double appeared_s; /* when this line first appeared (0 for the initial file) */
};

struct proc {
    unsigned int pid;
    unsigned long long used;
};

#define UNSET_U32 0xFFFFFFFFu

struct gpu_cfg {
    char name[96];
    char uuid[96];
    char pci_bus_id[32];
    unsigned int pci_domain, pci_bus, pci_device;
    unsigned int pci_device_id, pci_subsystem_id;
    unsigned int arch;
    unsigned long long mem_total, mem_used, mem_reserved;
    unsigned int util_gpu, util_mem;
    unsigned int power_mw, power_limit_mw;
    unsigned int temp_c, mem_temp_c;
    unsigned int clk[4], max_clk[4]; /* graphics, sm, mem, video */
    unsigned long long reasons, supported_reasons;
    unsigned long long ecc[2][2]; /* [corrected/uncorrected][volatile/aggregate] */
    unsigned int mig_current, mig_pending;
    unsigned int nvlink_links;
    double ctr_base[NCTR];
    double ctr_rate[NCTR];
    unsigned char gpm_has[GPM_IDS];
    int energy_rate_set;
    unsigned int unsupported;
    int lost;
    double lost_after_s; /* < 0: never */
    int nproc;
    struct proc procs[MAX_PROCS];
    int nxid;
    struct xid xids[MAX_XIDS];
    int nhang;
    struct hang hangs[MAX_HANGS];
};

struct scenario {
    char driver_version[80];
    char nvml_version[80];
    int cuda_version;
    nvmlReturn_t init_error;
    int gpu_count; /* -1: max gpu index + 1 */
    int ngpus;
    int nhang;
    struct hang hangs[MAX_HANGS];
    unsigned char gpu_seen[MAX_GPUS];
    struct gpu_cfg gpu[MAX_GPUS];
};

/* ------------------------------------------------------------------ */
/* Live state                                                           */
/* ------------------------------------------------------------------ */

struct counter {
    double anchor_val; /* counter value at anchor_t */
    double anchor_t;   /* monotonic seconds */
};

#define DEV_MAGIC 0x6e766d6cu
struct fake_gpu {
    unsigned int magic;
    int index;
    struct counter ctr[NCTR];
};

#define EVSET_MAGIC 0x65767374u
struct evreg {
    int gpu;
    unsigned long long mask;
    double t; /* seconds after init when registered */
};
struct evkey {
    int gpu;
    unsigned long long code;
    double at_s;
};
struct fake_evset {
    unsigned int magic;
    int nreg;
    struct evreg reg[MAX_GPUS];
    int ndel, capdel;
    struct evkey *del; /* events already delivered to this set */
    int waiters;
    int freed;
};

#define GPM_MAGIC 0x67706d73u
struct fake_gpm_sample {
    unsigned int magic;
    int filled;
    int gpu;
    double t;
    unsigned int links;
    unsigned char has[GPM_IDS];
    double acc[GPM_IDS];
    double rate[GPM_IDS];
    double anchor_t[GPM_IDS];
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cond;
static int g_refcount;
static struct scenario *g_sc;
static struct fake_gpu g_dev[MAX_GPUS];
static double g_t0;           /* monotonic seconds at init */
static long long g_t0_real_us; /* wall clock at init, microseconds */
static char g_path[4096];
static struct {
    long long mtime_ns;
    long long size;
    unsigned long long ino;
} g_file;
static double g_last_check;

__attribute__((constructor)) static void fake_nvml_ctor(void)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&g_cond, &attr);
    pthread_condattr_destroy(&attr);
    for (int i = 0; i < MAX_GPUS; i++) {
        g_dev[i].magic = DEV_MAGIC;
        g_dev[i].index = i;
    }
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static long long real_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

static void sleep_s(double secs)
{
    struct timespec ts;
    ts.tv_sec = (time_t)secs;
    ts.tv_nsec = (long)((secs - (double)ts.tv_sec) * 1e9);
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
    }
}

/* ------------------------------------------------------------------ */
/* Error strings                                                        */
/* ------------------------------------------------------------------ */

static const struct {
    nvmlReturn_t code;
    const char *name; /* for scenario files */
    const char *text; /* nvmlErrorString */
} k_errors[] = {
    {NVML_SUCCESS, "SUCCESS", "Success"},
    {NVML_ERROR_UNINITIALIZED, "UNINITIALIZED", "Uninitialized"},
    {NVML_ERROR_INVALID_ARGUMENT, "INVALID_ARGUMENT", "Invalid Argument"},
    {NVML_ERROR_NOT_SUPPORTED, "NOT_SUPPORTED", "Not Supported"},
    {NVML_ERROR_NO_PERMISSION, "NO_PERMISSION", "Insufficient Permissions"},
    {NVML_ERROR_ALREADY_INITIALIZED, "ALREADY_INITIALIZED", "Already Initialized"},
    {NVML_ERROR_NOT_FOUND, "NOT_FOUND", "Not Found"},
    {NVML_ERROR_INSUFFICIENT_SIZE, "INSUFFICIENT_SIZE", "Insufficient Size"},
    {NVML_ERROR_INSUFFICIENT_POWER, "INSUFFICIENT_POWER", "Insufficient External Power"},
    {NVML_ERROR_DRIVER_NOT_LOADED, "DRIVER_NOT_LOADED", "Driver Not Loaded"},
    {NVML_ERROR_TIMEOUT, "TIMEOUT", "Timeout"},
    {NVML_ERROR_IRQ_ISSUE, "IRQ_ISSUE", "Interrupt Request Issue"},
    {NVML_ERROR_LIBRARY_NOT_FOUND, "LIBRARY_NOT_FOUND", "NVML Shared Library Not Found"},
    {NVML_ERROR_FUNCTION_NOT_FOUND, "FUNCTION_NOT_FOUND", "Function Not Found"},
    {NVML_ERROR_CORRUPTED_INFOROM, "CORRUPTED_INFOROM", "Corrupted infoROM"},
    {NVML_ERROR_GPU_IS_LOST, "GPU_IS_LOST", "GPU is lost"},
    {NVML_ERROR_RESET_REQUIRED, "RESET_REQUIRED", "GPU requires restart"},
    {NVML_ERROR_OPERATING_SYSTEM, "OPERATING_SYSTEM",
     "The operating system has blocked the request."},
    {NVML_ERROR_LIB_RM_VERSION_MISMATCH, "LIB_RM_VERSION_MISMATCH",
     "RM has detected an NVML/RM version mismatch."},
    {NVML_ERROR_IN_USE, "IN_USE", "In use by another client"},
    {NVML_ERROR_MEMORY, "MEMORY", "Insufficient Memory"},
    {NVML_ERROR_NO_DATA, "NO_DATA", "No data"},
    {NVML_ERROR_VGPU_ECC_NOT_SUPPORTED, "VGPU_ECC_NOT_SUPPORTED",
     "The requested vgpu operation is not available on target device, because ECC is "
     "enabled"},
    {NVML_ERROR_INSUFFICIENT_RESOURCES, "INSUFFICIENT_RESOURCES", "Insufficient resources"},
    {NVML_ERROR_FREQ_NOT_SUPPORTED, "FREQ_NOT_SUPPORTED", "Frequency not supported"},
    {NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "ARGUMENT_VERSION_MISMATCH",
     "Argument version mismatch"},
    {NVML_ERROR_DEPRECATED, "DEPRECATED", "Deprecated"},
    {NVML_ERROR_NOT_READY, "NOT_READY", "Not ready"},
    {NVML_ERROR_GPU_NOT_FOUND, "GPU_NOT_FOUND", "GPU not found"},
    {NVML_ERROR_INVALID_STATE, "INVALID_STATE", "Invalid state"},
    {NVML_ERROR_RESET_TYPE_NOT_SUPPORTED, "RESET_TYPE_NOT_SUPPORTED",
     "Reset type not supported"},
    {NVML_ERROR_UNKNOWN, "UNKNOWN", "Unknown Error"},
};

API const char *nvmlErrorString(nvmlReturn_t result)
{
    for (size_t i = 0; i < sizeof k_errors / sizeof k_errors[0]; i++)
        if (k_errors[i].code == result)
            return k_errors[i].text;
    return "Unknown Error";
}

/* ------------------------------------------------------------------ */
/* Scenario parsing                                                     */
/* ------------------------------------------------------------------ */

static void gpu_defaults(struct gpu_cfg *g, int index)
{
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "NVIDIA H100 80GB HBM3");
    snprintf(g->uuid, sizeof g->uuid, "GPU-fa4e0000-0000-4000-8000-%012x", (unsigned)index);
    g->pci_bus_id[0] = '\0'; /* derived in finish_gpu */
    g->pci_device_id = 0x233010DEu;
    g->pci_subsystem_id = 0x16C110DEu;
    g->arch = NVML_DEVICE_ARCH_HOPPER;
    g->mem_total = 85520809984ULL;
    g->power_mw = 70000;
    g->power_limit_mw = 700000;
    g->temp_c = 35;
    g->mem_temp_c = UNSET_U32; /* no memory sensor unless the scenario gives one */
    g->clk[0] = UNSET_U32;
    g->clk[1] = 1980;
    g->clk[2] = 2619;
    g->clk[3] = 1545;
    g->max_clk[0] = UNSET_U32;
    g->max_clk[1] = 1980;
    g->max_clk[2] = 2619;
    g->max_clk[3] = 1980;
    g->supported_reasons = 0x1FFULL;
    g->lost_after_s = -1.0;
}

static void scenario_defaults(struct scenario *s)
{
    memset(s, 0, sizeof *s);
    snprintf(s->driver_version, sizeof s->driver_version, "550.54.15");
    snprintf(s->nvml_version, sizeof s->nvml_version, "12.550.54.15");
    s->cuda_version = 12040;
    s->gpu_count = -1;
    for (int i = 0; i < MAX_GPUS; i++)
        gpu_defaults(&s->gpu[i], i);
}

struct parse_ctx {
    const char *path;
    int line;
};

__attribute__((format(printf, 2, 3))) static int perr(const struct parse_ctx *c,
                                                      const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "fake_nvml: %s:%d: ", c->path, c->line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return -1;
}

static int parse_u64(const char *s, unsigned long long *out)
{
    char *end;
    if (!s || !*s || *s == '-')
        return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end)
        return -1;
    *out = v;
    return 0;
}

static int parse_u32(const char *s, unsigned int *out)
{
    unsigned long long v;
    if (parse_u64(s, &v) || v > 0xFFFFFFFFULL)
        return -1;
    *out = (unsigned int)v;
    return 0;
}

static int parse_nonneg(const char *s, double *out)
{
    char *end;
    if (!s || !*s)
        return -1;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !(v >= 0.0) || v > 1e300)
        return -1;
    *out = v;
    return 0;
}

static int parse_error_code(const char *s, nvmlReturn_t *out)
{
    unsigned int v;
    if (!parse_u32(s, &v)) {
        *out = (nvmlReturn_t)v;
        return 0;
    }
    if (!strncmp(s, "NVML_ERROR_", 11))
        s += 11;
    for (size_t i = 0; i < sizeof k_errors / sizeof k_errors[0]; i++)
        if (!strcmp(k_errors[i].name, s)) {
            *out = k_errors[i].code;
            return 0;
        }
    return -1;
}

static int copy_str(char *dst, size_t size, const char *src)
{
    size_t n = strlen(src);
    if (n + 1 > size)
        return -1;
    memcpy(dst, src, n + 1);
    return 0;
}

static int parse_hang(const struct parse_ctx *c, struct hang *hangs, int *nhang,
                      char **tok, int ntok)
{
    /* tok[0] == "hang" */
    struct hang h;
    int known = 0;
    if (ntok != 3)
        return perr(c, "expected: hang SYMBOL SECONDS");
    for (size_t i = 0; i < sizeof k_symbols / sizeof k_symbols[0]; i++)
        if (!strcmp(k_symbols[i], tok[1]))
            known = 1;
    if (!known)
        return perr(c, "hang: unknown NVML symbol '%s'", tok[1]);
    if (copy_str(h.sym, sizeof h.sym, tok[1]) || parse_nonneg(tok[2], &h.secs))
        return perr(c, "hang: bad seconds '%s'", tok[2]);
    for (int i = 0; i < *nhang; i++)
        if (!strcmp(hangs[i].sym, h.sym)) {
            hangs[i] = h;
            return 0;
        }
    if (*nhang >= MAX_HANGS)
        return perr(c, "too many hang lines (max %d)", MAX_HANGS);
    hangs[(*nhang)++] = h;
    return 0;
}

enum ktype { K_U32, K_U64, K_CTR_BASE, K_CTR_RATE };
static const struct {
    const char *key;
    enum ktype type;
    size_t off; /* K_U32 / K_U64 */
    int ctr;    /* K_CTR_* */
} k_gpu_keys[] = {
    {"pci_device_id", K_U32, offsetof(struct gpu_cfg, pci_device_id), 0},
    {"pci_subsystem_id", K_U32, offsetof(struct gpu_cfg, pci_subsystem_id), 0},
    {"memory_total", K_U64, offsetof(struct gpu_cfg, mem_total), 0},
    {"memory_used", K_U64, offsetof(struct gpu_cfg, mem_used), 0},
    {"memory_reserved", K_U64, offsetof(struct gpu_cfg, mem_reserved), 0},
    {"util_gpu", K_U32, offsetof(struct gpu_cfg, util_gpu), 0},
    {"util_memory", K_U32, offsetof(struct gpu_cfg, util_mem), 0},
    {"power_mw", K_U32, offsetof(struct gpu_cfg, power_mw), 0},
    {"power_limit_mw", K_U32, offsetof(struct gpu_cfg, power_limit_mw), 0},
    {"temperature_c", K_U32, offsetof(struct gpu_cfg, temp_c), 0},
    {"memory_temperature_c", K_U32, offsetof(struct gpu_cfg, mem_temp_c), 0},
    {"graphics_clock_mhz", K_U32, offsetof(struct gpu_cfg, clk[0]), 0},
    {"sm_clock_mhz", K_U32, offsetof(struct gpu_cfg, clk[1]), 0},
    {"mem_clock_mhz", K_U32, offsetof(struct gpu_cfg, clk[2]), 0},
    {"video_clock_mhz", K_U32, offsetof(struct gpu_cfg, clk[3]), 0},
    {"max_graphics_clock_mhz", K_U32, offsetof(struct gpu_cfg, max_clk[0]), 0},
    {"max_sm_clock_mhz", K_U32, offsetof(struct gpu_cfg, max_clk[1]), 0},
    {"max_mem_clock_mhz", K_U32, offsetof(struct gpu_cfg, max_clk[2]), 0},
    {"max_video_clock_mhz", K_U32, offsetof(struct gpu_cfg, max_clk[3]), 0},
    {"clock_event_reasons", K_U64, offsetof(struct gpu_cfg, reasons), 0},
    {"supported_clock_event_reasons", K_U64, offsetof(struct gpu_cfg, supported_reasons), 0},
    {"ecc_corrected_volatile", K_U64, offsetof(struct gpu_cfg, ecc[0][0]), 0},
    {"ecc_corrected_aggregate", K_U64, offsetof(struct gpu_cfg, ecc[0][1]), 0},
    {"ecc_uncorrected_volatile", K_U64, offsetof(struct gpu_cfg, ecc[1][0]), 0},
    {"ecc_uncorrected_aggregate", K_U64, offsetof(struct gpu_cfg, ecc[1][1]), 0},
    {"mig_mode", K_U32, offsetof(struct gpu_cfg, mig_current), 0},
    {"mig_pending_mode", K_U32, offsetof(struct gpu_cfg, mig_pending), 0},
    {"nvlink_links", K_U32, offsetof(struct gpu_cfg, nvlink_links), 0},
    {"nvlink_tx_kib", K_CTR_BASE, 0, CT_NVL_TX},
    {"nvlink_rx_kib", K_CTR_BASE, 0, CT_NVL_RX},
    {"nvlink_tx_kib_per_s", K_CTR_RATE, 0, CT_NVL_TX},
    {"nvlink_rx_kib_per_s", K_CTR_RATE, 0, CT_NVL_RX},
    {"pcie_tx_bytes", K_CTR_BASE, 0, CT_PCIE_TX},
    {"pcie_rx_bytes", K_CTR_BASE, 0, CT_PCIE_RX},
    {"pcie_tx_bytes_per_s", K_CTR_RATE, 0, CT_PCIE_TX},
    {"pcie_rx_bytes_per_s", K_CTR_RATE, 0, CT_PCIE_RX},
    {"energy_mj", K_CTR_BASE, 0, CT_ENERGY},
    {"energy_mj_per_s", K_CTR_RATE, 0, CT_ENERGY},
};

static int parse_gpu_line(const struct parse_ctx *c, struct scenario *s, char **tok,
                          int ntok, const char *rest_after_key)
{
    unsigned int idx;
    if (ntok < 3 || parse_u32(tok[1], &idx) || idx >= MAX_GPUS)
        return perr(c, "expected: gpu INDEX KEY VALUE... (INDEX < %d)", MAX_GPUS);
    struct gpu_cfg *g = &s->gpu[idx];
    const char *key = tok[2];
    char **v = tok + 3;
    int nv = ntok - 3;
    s->gpu_seen[idx] = 1;

    if (!strcmp(key, "name")) {
        if (!*rest_after_key || copy_str(g->name, sizeof g->name, rest_after_key))
            return perr(c, "name: missing or longer than %zu bytes", sizeof g->name - 1);
        return 0;
    }
    if (!strcmp(key, "unsupported")) {
        if (nv < 1)
            return perr(c, "unsupported: list at least one group");
        for (int i = 0; i < nv; i++) {
            size_t j, n = sizeof k_groups / sizeof k_groups[0];
            for (j = 0; j < n; j++)
                if (!strcmp(k_groups[j].name, v[i]))
                    break;
            if (j == n)
                return perr(c, "unsupported: unknown group '%s'", v[i]);
            g->unsupported |= k_groups[j].bit;
        }
        return 0;
    }
    if (!strcmp(key, "hang"))
        return parse_hang(c, g->hangs, &g->nhang, tok + 2, ntok - 2);
    if (!strcmp(key, "process")) {
        struct proc p;
        if (nv != 2 || parse_u32(v[0], &p.pid) || parse_u64(v[1], &p.used))
            return perr(c, "expected: gpu N process PID USED_BYTES");
        if (g->nproc >= MAX_PROCS)
            return perr(c, "too many processes (max %d)", MAX_PROCS);
        g->procs[g->nproc++] = p;
        return 0;
    }
    if (!strcmp(key, "xid")) {
        struct xid x = {0};
        if (nv != 3 || parse_u64(v[0], &x.code) || strcmp(v[1], "at_s") ||
            parse_nonneg(v[2], &x.at_s))
            return perr(c, "expected: gpu N xid CODE at_s SECONDS");
        if (g->nxid >= MAX_XIDS)
            return perr(c, "too many xid lines (max %d)", MAX_XIDS);
        g->xids[g->nxid++] = x;
        return 0;
    }
    if (nv != 1)
        return perr(c, "%s: expected exactly one value", key);
    if (!strcmp(key, "uuid")) {
        if (copy_str(g->uuid, sizeof g->uuid, v[0]))
            return perr(c, "uuid too long");
        return 0;
    }
    if (!strcmp(key, "pci_bus_id")) {
        unsigned int dom, bus, dev, fn;
        char extra;
        if (sscanf(v[0], "%x:%x:%x.%x%c", &dom, &bus, &dev, &fn, &extra) != 4 ||
            bus > 0xFF || dev > 0x1F || fn > 7)
            return perr(c, "pci_bus_id: expected DDDDDDDD:BB:DD.F, got '%s'", v[0]);
        snprintf(g->pci_bus_id, sizeof g->pci_bus_id, "%08X:%02X:%02X.%X", dom, bus, dev, fn);
        g->pci_domain = dom;
        g->pci_bus = bus;
        g->pci_device = dev;
        return 0;
    }
    if (!strcmp(key, "architecture")) {
        for (size_t i = 0; i < sizeof k_archs / sizeof k_archs[0]; i++)
            if (!strcmp(k_archs[i].name, v[0])) {
                g->arch = k_archs[i].value;
                return 0;
            }
        if (parse_u32(v[0], &g->arch))
            return perr(c, "architecture: unknown '%s'", v[0]);
        return 0;
    }
    if (!strcmp(key, "lost")) {
        unsigned int b;
        if (parse_u32(v[0], &b) || b > 1)
            return perr(c, "lost: expected 0 or 1");
        g->lost = (int)b;
        return 0;
    }
    if (!strcmp(key, "lost_after_s")) {
        if (parse_nonneg(v[0], &g->lost_after_s))
            return perr(c, "lost_after_s: bad seconds '%s'", v[0]);
        return 0;
    }
    for (size_t i = 0; i < sizeof k_gpm / sizeof k_gpm[0]; i++)
        if (!strcmp(k_gpm[i].key, key)) {
            if (parse_nonneg(v[0], &g->ctr_rate[CT_GPM0 + k_gpm[i].id]))
                return perr(c, "%s: bad value '%s'", key, v[0]);
            g->gpm_has[k_gpm[i].id] = 1;
            return 0;
        }
    for (size_t i = 0; i < sizeof k_gpu_keys / sizeof k_gpu_keys[0]; i++) {
        if (strcmp(k_gpu_keys[i].key, key))
            continue;
        char *base = (char *)g;
        switch (k_gpu_keys[i].type) {
        case K_U32:
            if (parse_u32(v[0], (unsigned int *)(base + k_gpu_keys[i].off)))
                return perr(c, "%s: bad unsigned 32-bit value '%s'", key, v[0]);
            return 0;
        case K_U64:
            if (parse_u64(v[0], (unsigned long long *)(base + k_gpu_keys[i].off)))
                return perr(c, "%s: bad unsigned 64-bit value '%s'", key, v[0]);
            return 0;
        case K_CTR_BASE:
            if (parse_nonneg(v[0], &g->ctr_base[k_gpu_keys[i].ctr]))
                return perr(c, "%s: bad counter value '%s'", key, v[0]);
            return 0;
        case K_CTR_RATE:
            if (parse_nonneg(v[0], &g->ctr_rate[k_gpu_keys[i].ctr]))
                return perr(c, "%s: bad rate '%s'", key, v[0]);
            if (k_gpu_keys[i].ctr == CT_ENERGY)
                g->energy_rate_set = 1;
            return 0;
        }
    }
    return perr(c, "unknown gpu key '%s'", key);
}

static int gpm_metric_line(const struct parse_ctx *c, struct scenario *s, char **tok, int ntok)
{
    /* gpu N gpm_metric ID VALUE */
    unsigned int idx, id;
    double val;
    if (ntok != 5 || parse_u32(tok[1], &idx) || idx >= MAX_GPUS || parse_u32(tok[3], &id) ||
        id == 0 || id >= GPM_IDS || parse_nonneg(tok[4], &val))
        return perr(c, "expected: gpu N gpm_metric ID VALUE (0 < ID < %d)", GPM_IDS);
    s->gpu_seen[idx] = 1;
    s->gpu[idx].ctr_rate[CT_GPM0 + id] = val;
    s->gpu[idx].gpm_has[id] = 1;
    return 0;
}

static int finish(const struct parse_ctx *c, struct scenario *s)
{
    int maxidx = -1;
    for (int i = 0; i < MAX_GPUS; i++)
        if (s->gpu_seen[i])
            maxidx = i;
    if (s->gpu_count >= 0) {
        if (maxidx >= s->gpu_count)
            return perr(c, "gpu %d configured but gpu_count is %d", maxidx, s->gpu_count);
        s->ngpus = s->gpu_count;
    } else {
        s->ngpus = maxidx + 1;
    }
    for (int i = 0; i < MAX_GPUS; i++) {
        struct gpu_cfg *g = &s->gpu[i];
        if (!g->pci_bus_id[0]) {
            g->pci_domain = 0;
            g->pci_bus = 0x10u + (unsigned)i;
            g->pci_device = 0;
            snprintf(g->pci_bus_id, sizeof g->pci_bus_id, "%08X:%02X:00.0", 0u, g->pci_bus);
        }
        if (g->clk[0] == UNSET_U32)
            g->clk[0] = g->clk[1];
        if (g->max_clk[0] == UNSET_U32)
            g->max_clk[0] = g->max_clk[1];
        if (!g->energy_rate_set)
            g->ctr_rate[CT_ENERGY] = (double)g->power_mw; /* mW == mJ/s */
        if (g->mem_used + g->mem_reserved > g->mem_total)
            return perr(c, "gpu %d: memory_used + memory_reserved exceed memory_total", i);
        if (g->util_gpu > 100 || g->util_mem > 100)
            return perr(c, "gpu %d: utilisation above 100", i);
    }
    return 0;
}

/* Returns a malloc'd scenario, or NULL with *err set (message on stderr). */
static struct scenario *load_scenario(const char *path, nvmlReturn_t *err)
{
    struct parse_ctx c = {path, 0};
    FILE *f = fopen(path, "r");
    if (!f) {
        *err = NVML_ERROR_DRIVER_NOT_LOADED;
        return NULL;
    }
    struct scenario *s = malloc(sizeof *s);
    if (!s) {
        fclose(f);
        *err = NVML_ERROR_MEMORY;
        return NULL;
    }
    scenario_defaults(s);
    char line[1024], orig[1024];
    int rc = 0;
    while (fgets(line, sizeof line, f)) {
        c.line++;
        size_t len = strlen(line);
        if (len == sizeof line - 1 && line[len - 1] != '\n' && !feof(f)) {
            rc = perr(&c, "line too long");
            break;
        }
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        len = strlen(line);
        while (len && isspace((unsigned char)line[len - 1]))
            line[--len] = '\0';
        memcpy(orig, line, len + 1);

        char *tok[16];
        size_t start[16];
        int ntok = 0;
        char *p = line;
        while (*p && ntok < 16) {
            while (isspace((unsigned char)*p))
                p++;
            if (!*p)
                break;
            start[ntok] = (size_t)(p - line);
            tok[ntok++] = p;
            while (*p && !isspace((unsigned char)*p))
                p++;
            if (*p)
                *p++ = '\0';
        }
        if (ntok == 0)
            continue;
        if (ntok == 16 && *p) {
            rc = perr(&c, "too many words on one line");
            break;
        }

        if (!strcmp(tok[0], "gpu")) {
            if (ntok >= 3 && !strcmp(tok[2], "gpm_metric"))
                rc = gpm_metric_line(&c, s, tok, ntok);
            else
                rc = parse_gpu_line(&c, s, tok, ntok, ntok > 3 ? orig + start[3] : "");
        } else if (!strcmp(tok[0], "hang")) {
            rc = parse_hang(&c, s->hangs, &s->nhang, tok, ntok);
        } else if (ntok != 2) {
            rc = perr(&c, "%s: expected exactly one value", tok[0]);
        } else if (!strcmp(tok[0], "driver_version")) {
            if (copy_str(s->driver_version, sizeof s->driver_version, tok[1]))
                rc = perr(&c, "driver_version too long");
        } else if (!strcmp(tok[0], "nvml_version")) {
            if (copy_str(s->nvml_version, sizeof s->nvml_version, tok[1]))
                rc = perr(&c, "nvml_version too long");
        } else if (!strcmp(tok[0], "cuda_driver_version")) {
            unsigned int v;
            if (parse_u32(tok[1], &v) || v > 0x7FFFFFFF)
                rc = perr(&c, "cuda_driver_version: bad value '%s'", tok[1]);
            else
                s->cuda_version = (int)v;
        } else if (!strcmp(tok[0], "init_error")) {
            if (parse_error_code(tok[1], &s->init_error))
                rc = perr(&c, "init_error: unknown error '%s'", tok[1]);
        } else if (!strcmp(tok[0], "gpu_count")) {
            unsigned int v;
            if (parse_u32(tok[1], &v) || v > MAX_GPUS)
                rc = perr(&c, "gpu_count: expected 0..%d", MAX_GPUS);
            else
                s->gpu_count = (int)v;
        } else {
            rc = perr(&c, "unknown key '%s'", tok[0]);
        }
        if (rc)
            break;
    }
    if (!rc && ferror(f))
        rc = perr(&c, "read error");
    fclose(f);
    if (!rc)
        rc = finish(&c, s);
    if (rc) {
        free(s);
        *err = NVML_ERROR_UNKNOWN;
        return NULL;
    }
    *err = NVML_SUCCESS;
    return s;
}

/* ------------------------------------------------------------------ */
/* Counters, reload, common entry/exit                                  */
/* ------------------------------------------------------------------ */

static double ctr_value(int gpu, int ctr, double t)
{
    const struct counter *k = &g_dev[gpu].ctr[ctr];
    return k->anchor_val + g_sc->gpu[gpu].ctr_rate[ctr] * (t - k->anchor_t);
}

static unsigned long long ctr_u64(int gpu, int ctr, double t)
{
    double v = ctr_value(gpu, ctr, t);
    if (v <= 0.0)
        return 0;
    if (v >= 1.8e19)
        return ~0ULL;
    return (unsigned long long)v;
}

/* Install a freshly parsed scenario.  Counters keep counting across a
 * re-read unless their base value line changed (then they restart from it). */
static void install(struct scenario *ns, int first)
{
    double t = now_s();
    struct scenario *os = g_sc;
    for (int i = 0; i < MAX_GPUS; i++) {
        struct gpu_cfg *ng = &ns->gpu[i];
        int fresh = first || i >= os->ngpus;
        for (int c = 0; c < NCTR; c++) {
            struct counter *k = &g_dev[i].ctr[c];
            if (fresh) {
                k->anchor_val = ng->ctr_base[c];
                k->anchor_t = t;
            } else if (ng->ctr_base[c] != os->gpu[i].ctr_base[c]) {
                k->anchor_val = ng->ctr_base[c];
                k->anchor_t = t;
            } else if (ng->ctr_rate[c] != os->gpu[i].ctr_rate[c]) {
                k->anchor_val = ctr_value(i, c, t);
                k->anchor_t = t;
            }
        }
        for (int x = 0; x < ng->nxid; x++) {
            ng->xids[x].appeared_s = first ? 0.0 : t - g_t0;
            if (fresh)
                continue;
            for (int y = 0; y < os->gpu[i].nxid; y++) {
                const struct xid *ox = &os->gpu[i].xids[y];
                if (ox->code == ng->xids[x].code && ox->at_s == ng->xids[x].at_s) {
                    ng->xids[x].appeared_s = ox->appeared_s;
                    break;
                }
            }
        }
    }
    g_sc = ns;
    free(os);
    pthread_cond_broadcast(&g_cond);
}

static int file_key(const char *path, long long *mtime, long long *size,
                    unsigned long long *ino)
{
    struct stat st;
    if (stat(path, &st))
        return -1;
    *mtime = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    *size = (long long)st.st_size;
    *ino = (unsigned long long)st.st_ino;
    return 0;
}

/* Called with the lock held while initialised. */
static void maybe_reload(void)
{
    double t = now_s();
    long long mtime, size;
    unsigned long long ino;
    if (t - g_last_check < RELOAD_CHECK_S)
        return;
    g_last_check = t;
    if (file_key(g_path, &mtime, &size, &ino))
        return; /* vanished: keep what we have */
    if (mtime == g_file.mtime_ns && size == g_file.size && ino == g_file.ino)
        return;
    g_file.mtime_ns = mtime;
    g_file.size = size;
    g_file.ino = ino;
    nvmlReturn_t err;
    struct scenario *ns = load_scenario(g_path, &err);
    if (!ns) {
        fprintf(stderr, "fake_nvml: keeping the previous scenario\n");
        return;
    }
    install(ns, 0);
}

static double hang_for(const char *fn, int gpu)
{
    if (gpu >= 0) {
        const struct gpu_cfg *g = &g_sc->gpu[gpu];
        for (int i = 0; i < g->nhang; i++)
            if (!strcmp(g->hangs[i].sym, fn))
                return g->hangs[i].secs;
    }
    for (int i = 0; i < g_sc->nhang; i++)
        if (!strcmp(g_sc->hangs[i].sym, fn))
            return g_sc->hangs[i].secs;
    return 0.0;
}

/* Sleep for a configured hang without holding the lock.  Lock held on
 * entry and on return; returns UNINITIALIZED if shut down meanwhile. */
static nvmlReturn_t apply_hang(const char *fn, int gpu)
{
    double secs = hang_for(fn, gpu);
    if (secs <= 0.0)
        return NVML_SUCCESS;
    pthread_mutex_unlock(&g_lock);
    sleep_s(secs);
    pthread_mutex_lock(&g_lock);
    if (!g_refcount)
        return NVML_ERROR_UNINITIALIZED;
    maybe_reload();
    return NVML_SUCCESS;
}

static nvmlReturn_t leave(nvmlReturn_t r)
{
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* Lock, check init, reload, hang.  On success the lock is held. */
static nvmlReturn_t api_enter(const char *fn)
{
    pthread_mutex_lock(&g_lock);
    if (!g_refcount)
        return leave(NVML_ERROR_UNINITIALIZED);
    maybe_reload();
    nvmlReturn_t r = apply_hang(fn, -1);
    if (r)
        return leave(r);
    return NVML_SUCCESS;
}

static int handle_index(nvmlDevice_t d)
{
    uintptr_t p = (uintptr_t)d, b = (uintptr_t)&g_dev[0];
    if (p < b || p >= (uintptr_t)&g_dev[MAX_GPUS] || (p - b) % sizeof g_dev[0])
        return -1;
    int i = (int)((p - b) / sizeof g_dev[0]);
    return i < g_sc->ngpus ? i : -1;
}

static int is_lost(int i)
{
    const struct gpu_cfg *g = &g_sc->gpu[i];
    return g->lost || (g->lost_after_s >= 0.0 && now_s() - g_t0 >= g->lost_after_s);
}

/* Like api_enter for calls on one device: also validates the handle and
 * reports GPU_IS_LOST / NOT_SUPPORTED (for any of `groups`). */
static nvmlReturn_t dev_enter(nvmlDevice_t d, const char *fn, unsigned int groups, int *idx,
                              struct gpu_cfg **cfg)
{
    pthread_mutex_lock(&g_lock);
    if (!g_refcount)
        return leave(NVML_ERROR_UNINITIALIZED);
    maybe_reload();
    int i = handle_index(d);
    if (i < 0)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t r = apply_hang(fn, i);
    if (r)
        return leave(r);
    if ((i = handle_index(d)) < 0) /* the scenario may have shrunk meanwhile */
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (is_lost(i))
        return leave(NVML_ERROR_GPU_IS_LOST);
    if (g_sc->gpu[i].unsupported & groups)
        return leave(NVML_ERROR_NOT_SUPPORTED);
    *idx = i;
    *cfg = &g_sc->gpu[i];
    return NVML_SUCCESS;
}

#define DEV_ENTER(dev, groups)                                                   \
    int I_;                                                                      \
    struct gpu_cfg *G;                                                           \
    do {                                                                         \
        nvmlReturn_t r_ = dev_enter((dev), __func__, (groups), &I_, &G);         \
        if (r_ != NVML_SUCCESS)                                                  \
            return r_;                                                           \
    } while (0)

#define API_ENTER()                                                              \
    do {                                                                         \
        nvmlReturn_t r_ = api_enter(__func__);                                   \
        if (r_ != NVML_SUCCESS)                                                  \
            return r_;                                                           \
    } while (0)

static nvmlReturn_t put_str(char *buf, unsigned int len, const char *s)
{
    size_t n = strlen(s) + 1;
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (n > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, s, n);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* Init / shutdown / system                                             */
/* ------------------------------------------------------------------ */

static nvmlReturn_t do_init(const char *fn)
{
    pthread_mutex_lock(&g_lock);
    if (g_refcount > 0) {
        g_refcount++;
        return leave(NVML_SUCCESS);
    }
    const char *path = getenv("FAKE_NVML_SCENARIO");
    if (!path || !*path || strlen(path) >= sizeof g_path)
        return leave(NVML_ERROR_DRIVER_NOT_LOADED);
    long long mtime, size;
    unsigned long long ino;
    if (file_key(path, &mtime, &size, &ino))
        return leave(NVML_ERROR_DRIVER_NOT_LOADED);
    nvmlReturn_t err;
    struct scenario *s = load_scenario(path, &err);
    if (!s)
        return leave(err);
    if (s->init_error != NVML_SUCCESS) {
        err = s->init_error;
        free(s);
        return leave(err);
    }
    snprintf(g_path, sizeof g_path, "%s", path);
    g_file.mtime_ns = mtime;
    g_file.size = size;
    g_file.ino = ino;
    g_t0 = now_s();
    g_t0_real_us = real_us();
    g_last_check = g_t0;
    g_sc = NULL;
    install(s, 1);
    g_refcount = 1;
    nvmlReturn_t r = apply_hang(fn, -1);
    return leave(r);
}

API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return do_init(__func__);
}

API nvmlReturn_t nvmlInit_v2(void)
{
    return do_init(__func__);
}

API nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_lock);
    if (!g_refcount)
        return leave(NVML_ERROR_UNINITIALIZED);
    maybe_reload();
    nvmlReturn_t r = apply_hang(__func__, -1);
    if (r)
        return leave(r);
    if (--g_refcount == 0) {
        free(g_sc);
        g_sc = NULL;
        pthread_cond_broadcast(&g_cond);
    }
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    API_ENTER();
    return leave(put_str(version, length, g_sc->driver_version));
}

API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    API_ENTER();
    return leave(put_str(version, length, g_sc->nvml_version));
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    API_ENTER();
    if (!cudaDriverVersion)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *cudaDriverVersion = g_sc->cuda_version;
    return leave(NVML_SUCCESS);
}

#ifndef FAKE_NVML_OLD_DRIVER
API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    API_ENTER();
    if (!cudaDriverVersion)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *cudaDriverVersion = g_sc->cuda_version;
    return leave(NVML_SUCCESS);
}
#endif

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    API_ENTER();
    if (!deviceCount)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *deviceCount = (unsigned int)g_sc->ngpus;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    pthread_mutex_lock(&g_lock);
    if (!g_refcount)
        return leave(NVML_ERROR_UNINITIALIZED);
    maybe_reload();
    if (!device || index >= (unsigned int)g_sc->ngpus)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t r = apply_hang(__func__, (int)index);
    if (r)
        return leave(r);
    if (index >= (unsigned int)g_sc->ngpus)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (is_lost((int)index))
        return leave(NVML_ERROR_GPU_IS_LOST);
    *device = &g_dev[index];
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ */
/* Device identity                                                      */
/* ------------------------------------------------------------------ */

API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    DEV_ENTER(device, 0);
    (void)G;
    if (!index)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)I_;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    DEV_ENTER(device, 0);
    return leave(put_str(name, length, G->name));
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    DEV_ENTER(device, 0);
    return leave(put_str(uuid, length, G->uuid));
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    DEV_ENTER(device, 0);
    if (!pci)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0",
             G->pci_domain & 0xFFFFu, G->pci_bus & 0xFFu, G->pci_device & 0x1Fu);
    pci->domain = G->pci_domain;
    pci->bus = G->pci_bus;
    pci->device = G->pci_device;
    pci->pciDeviceId = G->pci_device_id;
    pci->pciSubSystemId = G->pci_subsystem_id;
    memcpy(pci->busId, G->pci_bus_id, sizeof pci->busId);
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch)
{
    DEV_ENTER(device, 0);
    if (!arch)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *arch = G->arch;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                      unsigned int *pendingMode)
{
    DEV_ENTER(device, G_MIG);
    if (!currentMode || !pendingMode)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *currentMode = G->mig_current;
    *pendingMode = G->mig_pending;
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ */
/* Clocks, memory, utilisation, power, temperature                      */
/* ------------------------------------------------------------------ */

API nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, unsigned int type,
                                           unsigned int *clock)
{
    DEV_ENTER(device, G_CLOCKS);
    if (!clock || type > 3)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *clock = G->max_clk[type];
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, unsigned int type,
                                        unsigned int *clock)
{
    DEV_ENTER(device, G_CLOCKS);
    if (!clock || type > 3)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *clock = G->clk[type];
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    DEV_ENTER(device, G_MEMORY);
    if (!memory)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    /* v1 counts the driver-reserved memory as used */
    memory->total = G->mem_total;
    memory->used = G->mem_used + G->mem_reserved;
    memory->free = G->mem_total - memory->used;
    return leave(NVML_SUCCESS);
}

#ifndef FAKE_NVML_OLD_DRIVER
API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    DEV_ENTER(device, G_MEMORY);
    if (!memory)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != nvmlMemory_v2)
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory->total = G->mem_total;
    memory->reserved = G->mem_reserved;
    memory->used = G->mem_used;
    memory->free = G->mem_total - G->mem_used - G->mem_reserved;
    return leave(NVML_SUCCESS);
}
#endif

API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util)
{
    DEV_ENTER(device, G_UTILIZATION);
    if (!util)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    util->gpu = G->util_gpu;
    util->memory = G->util_mem;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    DEV_ENTER(device, G_POWER);
    if (!power)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *power = G->power_mw;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit)
{
    DEV_ENTER(device, G_POWER);
    if (!limit)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *limit = G->power_limit_mw;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensorType,
                                          unsigned int *temp)
{
    DEV_ENTER(device, G_TEMPERATURE);
    if (!temp || sensorType != 0)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *temp = G->temp_c;
    return leave(NVML_SUCCESS);
}

#ifndef FAKE_NVML_OLD_DRIVER
API nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_v1_t *temp)
{
    DEV_ENTER(device, G_TEMPERATURE);
    if (!temp)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (temp->version != nvmlTemperature_v1)
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (temp->sensorType != 0)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    temp->temperature = (int)G->temp_c;
    return leave(NVML_SUCCESS);
}
#endif

static nvmlReturn_t reasons(nvmlDevice_t device, const char *fn, int supported,
                            unsigned long long *out)
{
    int idx;
    struct gpu_cfg *g;
    nvmlReturn_t r = dev_enter(device, fn, G_CLOCK_REASONS, &idx, &g);
    if (r)
        return r;
    if (!out)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *out = supported ? g->supported_reasons : g->reasons;
    return leave(NVML_SUCCESS);
}

#ifndef FAKE_NVML_OLD_DRIVER
API nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                        unsigned long long *reasonsOut)
{
    return reasons(device, __func__, 0, reasonsOut);
}

API nvmlReturn_t nvmlDeviceGetSupportedClocksEventReasons(nvmlDevice_t device,
                                                          unsigned long long *reasonsOut)
{
    return reasons(device, __func__, 1, reasonsOut);
}
#endif

API nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                           unsigned long long *reasonsOut)
{
    return reasons(device, __func__, 0, reasonsOut);
}

API nvmlReturn_t nvmlDeviceGetSupportedClocksThrottleReasons(nvmlDevice_t device,
                                                             unsigned long long *reasonsOut)
{
    return reasons(device, __func__, 1, reasonsOut);
}

API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int errorType,
                                             unsigned int counterType,
                                             unsigned long long *eccCounts)
{
    DEV_ENTER(device, G_ECC);
    if (!eccCounts || errorType > 1 || counterType > 1)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *eccCounts = G->ecc[errorType][counterType];
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ */
/* Field values                                                         */
/* ------------------------------------------------------------------ */

static unsigned long long link_share(unsigned long long total, unsigned int link,
                                     unsigned int links)
{
    unsigned __int128 a = (unsigned __int128)total * (link + 1) / links;
    unsigned __int128 b = (unsigned __int128)total * link / links;
    return (unsigned long long)(a - b);
}

API nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                          nvmlFieldValue_t *values)
{
    DEV_ENTER(device, 0);
    if (valuesCount < 0 || (valuesCount > 0 && !values))
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    double t = now_s();
    long long ts = real_us();
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        unsigned long long val = 0;
        nvmlReturn_t r = NVML_SUCCESS;
        int ctr = -1;
        v->timestamp = ts;
        v->latencyUsec = 0;
        switch (v->fieldId) {
        case NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
            if (G->unsupported & G_ENERGY)
                r = NVML_ERROR_NOT_SUPPORTED;
            else
                val = ctr_u64(I_, CT_ENERGY, t);
            break;
        case NVML_FI_DEV_MEMORY_TEMP:
            if ((G->unsupported & G_TEMPERATURE) || G->mem_temp_c == UNSET_U32)
                r = NVML_ERROR_NOT_SUPPORTED;
            else
                val = G->mem_temp_c;
            break;
        case NVML_FI_DEV_NVLINK_LINK_COUNT:
            if (G->unsupported & G_NVLINK)
                r = NVML_ERROR_NOT_SUPPORTED;
            else
                val = G->nvlink_links;
            break;
        case NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
        case NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX:
            ctr = v->fieldId == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX ? CT_NVL_TX : CT_NVL_RX;
            if (G->unsupported & G_NVLINK) {
                r = NVML_ERROR_NOT_SUPPORTED;
            } else if (v->scopeId == NVML_SCOPE_ALL_LINKS) {
                val = ctr_u64(I_, ctr, t);
            } else if (v->scopeId < G->nvlink_links) {
                val = link_share(ctr_u64(I_, ctr, t), v->scopeId, G->nvlink_links);
            } else {
                r = NVML_ERROR_INVALID_ARGUMENT;
            }
            break;
        case NVML_FI_DEV_PCIE_COUNT_TX_BYTES:
        case NVML_FI_DEV_PCIE_COUNT_RX_BYTES:
            ctr = v->fieldId == NVML_FI_DEV_PCIE_COUNT_TX_BYTES ? CT_PCIE_TX : CT_PCIE_RX;
            if (G->unsupported & G_PCIE)
                r = NVML_ERROR_NOT_SUPPORTED;
            else
                val = ctr_u64(I_, ctr, t);
            break;
        default:
            r = NVML_ERROR_NOT_SUPPORTED;
        }
        v->nvmlReturn = r;
        if (r == NVML_SUCCESS) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
            v->value.ullVal = val;
        }
    }
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ */
/* Processes                                                            */
/* ------------------------------------------------------------------ */

static nvmlReturn_t processes(nvmlDevice_t device, const char *fn, unsigned int *infoCount,
                              nvmlProcessInfo_t *infos)
{
    int idx;
    struct gpu_cfg *g;
    nvmlReturn_t r = dev_enter(device, fn, G_PROCESSES, &idx, &g);
    if (r)
        return r;
    if (!infoCount)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int n = (unsigned int)g->nproc;
    if (*infoCount < n) {
        *infoCount = n;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if (n > 0 && !infos)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int inst = g->mig_current ? 0u : 0xFFFFFFFFu;
    for (unsigned int i = 0; i < n; i++) {
        infos[i].pid = g->procs[i].pid;
        infos[i].usedGpuMemory = g->procs[i].used;
        infos[i].gpuInstanceId = inst;
        infos[i].computeInstanceId = inst;
    }
    *infoCount = n;
    return leave(NVML_SUCCESS);
}

#ifndef FAKE_NVML_OLD_DRIVER
API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                         unsigned int *infoCount,
                                                         nvmlProcessInfo_t *infos)
{
    return processes(device, __func__, infoCount, infos);
}
#endif

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
                                                         unsigned int *infoCount,
                                                         nvmlProcessInfo_v2_t *infos)
{
    return processes(device, __func__, infoCount, infos);
}

/* ------------------------------------------------------------------ */
/* Utilisation samples                                                  */
/* ------------------------------------------------------------------ */

static unsigned long long sample_ts(long long k)
{
    return (unsigned long long)(g_t0_real_us + k * 1000000LL / SAMPLES_PER_S);
}

API nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t device, unsigned int type,
                                      unsigned long long lastSeenTimeStamp,
                                      unsigned int *sampleValType, unsigned int *sampleCount,
                                      nvmlSample_t *samples)
{
    DEV_ENTER(device, G_UTILIZATION | G_SAMPLES);
    if (!sampleValType || !sampleCount)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (type != NVML_GPU_UTILIZATION_SAMPLES && type != NVML_MEMORY_UTILIZATION_SAMPLES)
        return leave(NVML_ERROR_NOT_SUPPORTED);
    long long kmax = (long long)((now_s() - g_t0) * SAMPLES_PER_S);
    long long k = kmax - SAMPLE_BUFFER + 1;
    if (k < 1)
        k = 1;
    while (k <= kmax && sample_ts(k) <= lastSeenTimeStamp)
        k++;
    long long n = kmax - k + 1;
    *sampleValType = NVML_VALUE_TYPE_UNSIGNED_INT;
    if (n <= 0)
        return leave(NVML_ERROR_NOT_FOUND);
    if (!samples) {
        *sampleCount = (unsigned int)n;
        return leave(NVML_SUCCESS);
    }
    if (*sampleCount == 0) {
        *sampleCount = (unsigned int)n;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if ((long long)*sampleCount < n)
        n = *sampleCount; /* oldest first; the rest comes with the next call */
    unsigned int v = type == NVML_GPU_UTILIZATION_SAMPLES ? G->util_gpu : G->util_mem;
    for (long long i = 0; i < n; i++) {
        samples[i].timeStamp = sample_ts(k + i);
        samples[i].sampleValue.ullVal = 0;
        samples[i].sampleValue.uiVal = v;
    }
    *sampleCount = (unsigned int)n;
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ */
/* Events                                                               */
/* ------------------------------------------------------------------ */

static unsigned long long supported_events(const struct gpu_cfg *g)
{
    unsigned long long m = nvmlEventTypeXidCriticalError | nvmlEventTypePState |
                           nvmlEventTypeClock;
    if (!(g->unsupported & G_ECC))
        m |= nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError;
    return m;
}

static struct fake_evset *evset_ok(nvmlEventSet_t set)
{
    return (set && set->magic == EVSET_MAGIC && !set->freed) ? set : NULL;
}

API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    API_ENTER();
    if (!set)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    struct fake_evset *s = calloc(1, sizeof *s);
    if (!s)
        return leave(NVML_ERROR_MEMORY);
    s->magic = EVSET_MAGIC;
    *set = s;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                                  unsigned long long *eventTypes)
{
    DEV_ENTER(device, G_EVENTS);
    if (!eventTypes)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *eventTypes = supported_events(G);
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                          nvmlEventSet_t set)
{
    DEV_ENTER(device, G_EVENTS);
    struct fake_evset *s = evset_ok(set);
    if (!s)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (eventTypes & ~supported_events(G))
        return leave(NVML_ERROR_NOT_SUPPORTED);
    for (int i = 0; i < s->nreg; i++)
        if (s->reg[i].gpu == I_) {
            s->reg[i].mask |= eventTypes;
            return leave(NVML_SUCCESS);
        }
    s->reg[s->nreg].gpu = I_;
    s->reg[s->nreg].mask = eventTypes;
    s->reg[s->nreg].t = now_s() - g_t0;
    s->nreg++;
    return leave(NVML_SUCCESS);
}

static int delivered(const struct fake_evset *s, int gpu, const struct xid *x)
{
    for (int i = 0; i < s->ndel; i++)
        if (s->del[i].gpu == gpu && s->del[i].code == x->code && s->del[i].at_s == x->at_s)
            return 1;
    return 0;
}

/* Earliest undelivered XID for this set; returns its gpu (or -1). */
static int next_event(const struct fake_evset *s, const struct xid **out, double *due_out)
{
    int best = -1;
    double best_due = 0.0;
    for (int r = 0; r < s->nreg; r++) {
        int gi = s->reg[r].gpu;
        if (gi >= g_sc->ngpus || !(s->reg[r].mask & nvmlEventTypeXidCriticalError))
            continue;
        const struct gpu_cfg *g = &g_sc->gpu[gi];
        for (int x = 0; x < g->nxid; x++) {
            const struct xid *e = &g->xids[x];
            double due = e->at_s > e->appeared_s ? e->at_s : e->appeared_s;
            if (due < s->reg[r].t || delivered(s, gi, e))
                continue;
            if (best < 0 || due < best_due) {
                best = gi;
                best_due = due;
                *out = e;
            }
        }
    }
    *due_out = best_due;
    return best;
}

static struct timespec abs_mono(double t)
{
    struct timespec ts;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                     unsigned int timeoutms)
{
    API_ENTER();
    struct fake_evset *s = evset_ok(set);
    if (!s || !data)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    double deadline = now_s() + timeoutms / 1000.0;
    nvmlReturn_t r;
    s->waiters++;
    for (;;) {
        if (!g_refcount) {
            r = NVML_ERROR_UNINITIALIZED;
            break;
        }
        if (s->freed) {
            r = NVML_ERROR_INVALID_ARGUMENT;
            break;
        }
        maybe_reload();
        const struct xid *e = NULL;
        double due;
        int gi = next_event(s, &e, &due);
        double t = now_s();
        if (gi >= 0 && g_t0 + due <= t) {
            if (s->ndel == s->capdel) {
                int cap = s->capdel ? s->capdel * 2 : 16;
                struct evkey *nd = realloc(s->del, (size_t)cap * sizeof *nd);
                if (!nd) {
                    r = NVML_ERROR_MEMORY;
                    break;
                }
                s->del = nd;
                s->capdel = cap;
            }
            s->del[s->ndel].gpu = gi;
            s->del[s->ndel].code = e->code;
            s->del[s->ndel].at_s = e->at_s;
            s->ndel++;
            memset(data, 0, sizeof *data);
            data->device = &g_dev[gi];
            data->eventType = nvmlEventTypeXidCriticalError;
            data->eventData = e->code;
            data->gpuInstanceId = 0xFFFFFFFFu;
            data->computeInstanceId = 0xFFFFFFFFu;
            r = NVML_SUCCESS;
            break;
        }
        if (t >= deadline) {
            r = NVML_ERROR_TIMEOUT;
            break;
        }
        double wake = deadline;
        if (gi >= 0 && g_t0 + due < wake)
            wake = g_t0 + due;
        if (t + WAIT_SLICE_S < wake)
            wake = t + WAIT_SLICE_S; /* to notice scenario rewrites */
        struct timespec ts = abs_mono(wake);
        pthread_cond_timedwait(&g_cond, &g_lock, &ts); /* releases g_lock */
    }
    s->waiters--;
    if (s->freed && s->waiters == 0) {
        s->magic = 0;
        free(s->del);
        free(s);
    }
    return leave(r);
}

API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    API_ENTER();
    struct fake_evset *s = evset_ok(set);
    if (!s)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    s->freed = 1;
    if (s->waiters) {
        pthread_cond_broadcast(&g_cond); /* the last waiter frees it */
    } else {
        s->magic = 0;
        free(s->del);
        free(s);
    }
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ */
/* GPU performance monitoring (Hopper and newer)                        */
/* ------------------------------------------------------------------ */

#ifndef FAKE_NVML_OLD_DRIVER
static int gpm_supported(const struct gpu_cfg *g)
{
    return g->arch >= NVML_DEVICE_ARCH_HOPPER && !(g->unsupported & G_GPM);
}

API nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *gpmSupport)
{
    DEV_ENTER(device, 0);
    if (!gpmSupport)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (gpmSupport->version != NVML_GPM_SUPPORT_VERSION)
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    gpmSupport->isSupportedDevice = (unsigned int)gpm_supported(G);
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *gpmSample)
{
    API_ENTER();
    if (!gpmSample)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    struct fake_gpm_sample *s = calloc(1, sizeof *s);
    if (!s)
        return leave(NVML_ERROR_MEMORY);
    s->magic = GPM_MAGIC;
    *gpmSample = s;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t gpmSample)
{
    API_ENTER();
    if (!gpmSample || gpmSample->magic != GPM_MAGIC)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    gpmSample->magic = 0;
    free(gpmSample);
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t gpmSample)
{
    DEV_ENTER(device, G_GPM);
    if (!gpm_supported(G))
        return leave(NVML_ERROR_NOT_SUPPORTED);
    if (!gpmSample || gpmSample->magic != GPM_MAGIC)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    struct fake_gpm_sample *s = gpmSample;
    double t = now_s();
    s->filled = 1;
    s->gpu = I_;
    s->t = t;
    s->links = G->nvlink_links;
    for (int id = 0; id < GPM_IDS; id++) {
        s->has[id] = G->gpm_has[id];
        s->acc[id] = ctr_value(I_, CT_GPM0 + id, t);
        s->rate[id] = G->ctr_rate[CT_GPM0 + id];
        s->anchor_t[id] = g_dev[I_].ctr[CT_GPM0 + id].anchor_t;
    }
    return leave(NVML_SUCCESS);
}

static int gpm_info(unsigned int id)
{
    for (size_t i = 0; i < sizeof k_gpm / sizeof k_gpm[0]; i++)
        if (k_gpm[i].id == id)
            return (int)i;
    return -1;
}

API nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *metricsGet)
{
    API_ENTER();
    if (!metricsGet)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (metricsGet->version != NVML_GPM_METRICS_GET_VERSION)
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    const struct fake_gpm_sample *s1 = metricsGet->sample1, *s2 = metricsGet->sample2;
    if (metricsGet->numMetrics > NVML_GPM_METRIC_MAX || !s1 || !s2 ||
        s1->magic != GPM_MAGIC || s2->magic != GPM_MAGIC || !s1->filled || !s2->filled ||
        s1->gpu != s2->gpu || !(s2->t > s1->t))
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    double dt = s2->t - s1->t;
    for (unsigned int i = 0; i < metricsGet->numMetrics; i++) {
        nvmlGpmMetric_t *m = &metricsGet->metrics[i];
        unsigned int id = m->metricId, base = id, divisor = 1;
        m->value = 0.0;
        m->metricInfo.shortName = m->metricInfo.longName = m->metricInfo.unit = NULL;
        if (id >= GPM_NVLINK_L0_RX && id < GPM_NVLINK_L0_RX + 2 * GPM_NVLINK_PER_LINK_MAX) {
            unsigned int link = (id - GPM_NVLINK_L0_RX) / 2;
            base = (id - GPM_NVLINK_L0_RX) % 2 ? GPM_NVLINK_TOTAL_TX : GPM_NVLINK_TOTAL_RX;
            divisor = s2->links;
            if (link >= s2->links)
                base = GPM_IDS; /* no such link */
        }
        if (base >= GPM_IDS || !s1->has[base] || !s2->has[base]) {
            m->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            continue;
        }
        double v;
        if (s1->rate[base] == s2->rate[base] && s2->anchor_t[base] <= s1->t)
            v = s2->rate[base]; /* unchanged over the interval: exact */
        else
            v = (s2->acc[base] - s1->acc[base]) / dt; /* time-weighted mean */
        m->value = v / divisor;
        m->nvmlReturn = NVML_SUCCESS;
        int info = gpm_info(id);
        if (info >= 0) {
            m->metricInfo.shortName = k_gpm[info].short_name;
            m->metricInfo.longName = k_gpm[info].long_name;
            m->metricInfo.unit = k_gpm[info].unit;
        }
    }
    return leave(NVML_SUCCESS);
}
#endif /* !FAKE_NVML_OLD_DRIVER */
