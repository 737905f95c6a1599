/* cuda/nvtx.c - NVTX ranges in nnloom's own domain.
 *
 * NVTX 3 is header-only: with no tool attached every call is a cheap no-op;
 * Nsight (or any library named by NVTX_INJECTION64_PATH) fills in the
 * function table on the first call. The domain is created once. Ranges are
 * off when the build has no NVTX headers (LOOM_CUDA_HAVE_NVTX unset, CMake
 * option NNLOOM_NVTX) or when NNLOOM_NVTX=0 in the environment. The per-
 * thread depth is kept in every build so balance can be tested anywhere.
 */
#include "cuda_internal.h"

#ifdef LOOM_CUDA_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

#ifdef LOOM_CUDA_HAVE_NVTX
static LOOM_PARAM(Nvtx, "NNLOOM_NVTX", 1)
#endif

static _Thread_local int range_depth;

bool loom_cuda_nvtx_enabled(void) {
#ifdef LOOM_CUDA_HAVE_NVTX
    return loom_param_Nvtx() != 0;
#else
    return false;
#endif
}

#ifdef LOOM_CUDA_HAVE_NVTX
static nvtxDomainHandle_t domain(void) {
    static nvtxDomainHandle_t d;
    static int ready;
    if (LOOM_UNLIKELY(!__atomic_load_n(&ready, __ATOMIC_ACQUIRE))) {
        /* two threads may both create it: NVTX returns the same handle for
         * the same name, so the race is harmless */
        d = nvtxDomainCreateA("nnloom");
        __atomic_store_n(&ready, 1, __ATOMIC_RELEASE);
    }
    return d;
}
#endif

void loom_cuda_range_push(const char *name) {
    range_depth++;
#ifdef LOOM_CUDA_HAVE_NVTX
    if (loom_param_Nvtx() == 0) return;
    nvtxEventAttributes_t a = {0};
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = name;
    nvtxDomainRangePushEx(domain(), &a);
#else
    (void)name;
#endif
}

void loom_cuda_range_pop(void) {
    if (range_depth > 0) range_depth--;
#ifdef LOOM_CUDA_HAVE_NVTX
    if (loom_param_Nvtx() == 0) return;
    nvtxDomainRangePop(domain());
#endif
}

int loom_cuda_range_depth(void) { return range_depth; }
