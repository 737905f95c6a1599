/* tests/c/nvtx_inject.c - an NVTX injection library for tests.
 *
 * Loaded by NVTX itself when NVTX_INJECTION64_PATH names this file; fills
 * the domain-create, domain-range push and pop slots and appends one line
 * per event to the file named by NNLOOM_NVTX_LOG:
 *   "create <domain>", "push <domain> <name>", "pop <domain>".
 * Lets tests check nnloom's ranges without Nsight.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nvtx3/nvToolsExt.h>

#define MAX_DOMAINS 64

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char domain_names[MAX_DOMAINS][64]; /* index + 1 is the handle */
static int n_domains;

static void log_line(const char *fmt, const char *a, const char *b) {
    const char *path = getenv("NNLOOM_NVTX_LOG");
    if (path == NULL) return;
    FILE *f = fopen(path, "a");
    if (f == NULL) return;
    fprintf(f, fmt, a, b);
    fputc('\n', f);
    fclose(f);
}

static const char *domain_name(nvtxDomainHandle_t d) {
    size_t i = (size_t)(uintptr_t)d;
    return (i >= 1 && i <= (size_t)n_domains) ? domain_names[i - 1] : "?";
}

static nvtxDomainHandle_t create_domain(const char *name) {
    pthread_mutex_lock(&lock);
    int i;
    for (i = 0; i < n_domains; i++)
        if (strcmp(domain_names[i], name) == 0) break;
    if (i == n_domains && n_domains < MAX_DOMAINS) {
        snprintf(domain_names[n_domains++], sizeof domain_names[0], "%s", name);
        log_line("create %s%s", name, "");
    }
    pthread_mutex_unlock(&lock);
    return (nvtxDomainHandle_t)(uintptr_t)(i + 1);
}

static int push(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a) {
    const char *msg = (a && a->messageType == NVTX_MESSAGE_TYPE_ASCII) ? a->message.ascii : "?";
    pthread_mutex_lock(&lock);
    log_line("push %s %s", domain_name(d), msg);
    pthread_mutex_unlock(&lock);
    return 0;
}

static int pop(nvtxDomainHandle_t d) {
    pthread_mutex_lock(&lock);
    log_line("pop %s%s", domain_name(d), "");
    pthread_mutex_unlock(&lock);
    return 0;
}

int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_table) {
    const NvtxExportTableCallbacks *cb =
        (const NvtxExportTableCallbacks *)get_table(NVTX_ETID_CALLBACKS);
    if (cb == NULL) return 0;
    NvtxFunctionTable table = NULL;
    unsigned int size = 0;
    if (!cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size) || table == NULL)
        return 0;
    if (size > NVTX_CBID_CORE2_DomainCreateA)
        *table[NVTX_CBID_CORE2_DomainCreateA] = (NvtxFunctionPointer)create_domain;
    if (size > NVTX_CBID_CORE2_DomainRangePushEx)
        *table[NVTX_CBID_CORE2_DomainRangePushEx] = (NvtxFunctionPointer)push;
    if (size > NVTX_CBID_CORE2_DomainRangePop)
        *table[NVTX_CBID_CORE2_DomainRangePop] = (NvtxFunctionPointer)pop;
    return 1;
}
