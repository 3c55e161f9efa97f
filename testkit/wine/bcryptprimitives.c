/* Test-only stand-in (never shipped): Windows 10's bcryptprimitives.dll!ProcessPrng, which
 * Rust's standard library imports (tokenizers, safetensors, cryptography, llguidance,
 * pydantic_core); Debian's wine 8 has no such DLL ("DLL load failed while importing
 * _rust"). The same bytes come from RtlGenRandom (advapi32!SystemFunction036). */
#include <windows.h>

BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);

BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len) {
    while (len) {
        ULONG n = len > 0x10000000 ? 0x10000000 : (ULONG)len;
        if (!SystemFunction036(data, n)) return FALSE;
        data += n;
        len -= n;
    }
    return TRUE;
}
