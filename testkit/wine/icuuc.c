/* Test-only stand-in (never shipped): Qt6Core imports 20 ucnv_* functions from Windows 10's
 * system ICU (icuuc.dll), which Debian's wine 8 lacks, so QtCore cannot load at all. This
 * one knows no converter: ucnv_open fails with U_FILE_ACCESS_ERROR, and Qt falls back to
 * its own codecs (UTF-8, UTF-16, Latin-1), which is all Potluck's widgets use. */
#include <stddef.h>
#include <stdint.h>

typedef int UErrorCode;
#define U_FILE_ACCESS_ERROR 4
#define FAIL(err) do { if ((err) && *(err) <= 0) *(err) = U_FILE_ACCESS_ERROR; } while (0)

__declspec(dllexport) void *ucnv_open(const char *name, UErrorCode *err) { FAIL(err); return NULL; }
__declspec(dllexport) void ucnv_close(void *c) {}
__declspec(dllexport) void ucnv_reset(void *c) {}
__declspec(dllexport) int8_t ucnv_getMaxCharSize(const void *c) { return 1; }
__declspec(dllexport) const char *ucnv_getName(const void *c, UErrorCode *err) { FAIL(err); return NULL; }
__declspec(dllexport) void ucnv_getToUCallBack(const void *c, void **a, const void **b) { if (a) *a = NULL; if (b) *b = NULL; }
__declspec(dllexport) void ucnv_getFromUCallBack(const void *c, void **a, const void **b) { if (a) *a = NULL; if (b) *b = NULL; }
__declspec(dllexport) void ucnv_setToUCallBack(void *c, void *n, const void *ctx, void **o, const void **oc, UErrorCode *err) { FAIL(err); }
__declspec(dllexport) void ucnv_setFromUCallBack(void *c, void *n, const void *ctx, void **o, const void **oc, UErrorCode *err) { FAIL(err); }
__declspec(dllexport) void ucnv_cbToUWriteUChars(void *a, const void *s, int32_t l, int32_t o, UErrorCode *err) { FAIL(err); }
__declspec(dllexport) void ucnv_cbFromUWriteUChars(void *a, const void **s, const void *e, int32_t o, UErrorCode *err) { FAIL(err); }
__declspec(dllexport) void ucnv_toUnicode(void *c, void **t, const void *te, const char **s, const char *se, int32_t *o, int8_t f, UErrorCode *err) { FAIL(err); }
__declspec(dllexport) void ucnv_fromUnicode(void *c, char **t, const char *te, const void **s, const void *se, int32_t *o, int8_t f, UErrorCode *err) { FAIL(err); }
__declspec(dllexport) int32_t ucnv_toUCountPending(const void *c, UErrorCode *err) { FAIL(err); return 0; }
__declspec(dllexport) int32_t ucnv_fromUCountPending(const void *c, UErrorCode *err) { FAIL(err); return 0; }
__declspec(dllexport) const char *ucnv_getStandardName(const char *n, const char *s, UErrorCode *err) { FAIL(err); return NULL; }
__declspec(dllexport) const char *ucnv_getAvailableName(int32_t n) { return NULL; }
__declspec(dllexport) int32_t ucnv_countAvailable(void) { return 0; }
/* callback functions Qt passes by address: never called while no converter opens */
__declspec(dllexport) void UCNV_FROM_U_CALLBACK_SUBSTITUTE(void) {}
__declspec(dllexport) void UCNV_TO_U_CALLBACK_SUBSTITUTE(void) {}
