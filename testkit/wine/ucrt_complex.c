/* Test-only stand-in (never shipped): Debian's wine 8 exports ucrtbase's C99 complex
 * functions (crealf, cabsf, carg, cexp, cpow, ... 79 of them) as "unimplemented" stubs
 * that abort the process when called; numpy and torch call some while importing. Windows
 * 10's ucrtbase implements them all.
 *
 * This DLL is built as a stand-in for VERSION.dll, which python313.dll imports, so wine
 * loads it (WINEDLLOVERRIDES=version=n,b, copied into the prefix's system32) into every
 * Python process before anything calls a complex function. Its exports forward to
 * kernelbase, where wine (like Windows 10) implements the version API. On attach it
 * rewrites the start of each stub that still is one (`sub rsp,0x28; lea rcx,[rip+..]`:
 * a wine that implements a function, or real Windows, is left alone) into a jump to
 * mingw-w64's implementation below, wrapped to MSVC's ABI: _Fcomplex (8 bytes) travels in
 * an integer register, _Dcomplex (16 bytes) by reference and is returned through a
 * hidden pointer, which is what gcc does for structs of those sizes on this target; MSVC's
 * long double is double. */
#include <windows.h>
#include <complex.h>
#include <math.h>

typedef struct { double v[2]; } Dc;
typedef struct { float v[2]; } Fc;

static double complex D(Dc z) { return __builtin_complex(z.v[0], z.v[1]); }
static float complex F(Fc z) { return __builtin_complex(z.v[0], z.v[1]); }
static Dc d_(double complex z) { Dc r = {{creal(z), cimag(z)}}; return r; }
static Fc f_(float complex z) { Fc r = {{crealf(z), cimagf(z)}}; return r; }

#define UNARY(n) \
    static Dc p_##n(Dc z) { return d_(n(D(z))); } \
    static Fc p_##n##f(Fc z) { return f_(n##f(F(z))); }
#define REAL(n, expr, exprf) \
    static double p_##n(Dc z) { double complex x = D(z); return expr; } \
    static float p_##n##f(Fc z) { float complex x = F(z); return exprf; }

UNARY(cacos) UNARY(cacosh) UNARY(casin) UNARY(casinh) UNARY(catan) UNARY(catanh)
UNARY(ccos) UNARY(ccosh) UNARY(cexp) UNARY(clog) UNARY(csin) UNARY(csinh) UNARY(csqrt)
UNARY(ctan) UNARY(ctanh) UNARY(conj) UNARY(cproj)
static Dc p_clog10(Dc z) { return d_(clog(D(z)) / log(10.0)); }
static Fc p_clog10f(Fc z) { return f_(clogf(F(z)) / logf(10.0f)); }
REAL(cabs, cabs(x), cabsf(x)) REAL(carg, carg(x), cargf(x)) REAL(cimag, cimag(x), cimagf(x))
REAL(creal, creal(x), crealf(x)) REAL(norm, creal(x) * creal(x) + cimag(x) * cimag(x),
                                      crealf(x) * crealf(x) + cimagf(x) * cimagf(x))
static Dc p_cpow(Dc x, Dc y) { return d_(cpow(D(x), D(y))); }
static Fc p_cpowf(Fc x, Fc y) { return f_(cpowf(F(x), F(y))); }
static Dc p_Cbuild(double re, double im) { Dc r = {{re, im}}; return r; }
static Fc p_FCbuild(float re, float im) { Fc r = {{re, im}}; return r; }
static Dc p_Cmulcc(Dc x, Dc y) { return d_(D(x) * D(y)); }
static Fc p_FCmulcc(Fc x, Fc y) { return f_(F(x) * F(y)); }
static Dc p_Cmulcr(Dc x, double y) { return d_(D(x) * y); }
static Fc p_FCmulcr(Fc x, float y) { return f_(F(x) * y); }

#define D_AND_F(n) {#n, (void *)p_##n}, {#n "f", (void *)p_##n##f}, {#n "l", (void *)p_##n}
static const struct { const char *name; void *fn; } TABLE[] = {
    D_AND_F(cacos), D_AND_F(cacosh), D_AND_F(casin), D_AND_F(casinh), D_AND_F(catan),
    D_AND_F(catanh), D_AND_F(ccos), D_AND_F(ccosh), D_AND_F(cexp), D_AND_F(clog),
    D_AND_F(clog10), D_AND_F(csin), D_AND_F(csinh), D_AND_F(csqrt), D_AND_F(ctan),
    D_AND_F(ctanh), D_AND_F(conj), D_AND_F(cproj), D_AND_F(cabs), D_AND_F(carg),
    D_AND_F(cimag), D_AND_F(creal), D_AND_F(norm), D_AND_F(cpow),
    {"_Cbuild", (void *)p_Cbuild}, {"_FCbuild", (void *)p_FCbuild}, {"_LCbuild", (void *)p_Cbuild},
    {"_Cmulcc", (void *)p_Cmulcc}, {"_FCmulcc", (void *)p_FCmulcc}, {"_LCmulcc", (void *)p_Cmulcc},
    {"_Cmulcr", (void *)p_Cmulcr}, {"_FCmulcr", (void *)p_FCmulcr}, {"_LCmulcr", (void *)p_Cmulcr},
};

static const unsigned char STUB[] = {0x48, 0x83, 0xec, 0x28, 0x48, 0x8d, 0x0d};

static void patch_stubs(void) {
    HMODULE ucrt = LoadLibraryA("ucrtbase.dll");
    if (!ucrt) return;
    for (size_t i = 0; i < sizeof TABLE / sizeof TABLE[0]; i++) {
        unsigned char *p = (unsigned char *)GetProcAddress(ucrt, TABLE[i].name);
        if (!p || memcmp(p, STUB, sizeof STUB) != 0) continue;
        DWORD old;
        if (!VirtualProtect(p, 12, PAGE_EXECUTE_READWRITE, &old)) continue;
        p[0] = 0x48; p[1] = 0xb8;                    /* movabs rax, fn */
        memcpy(p + 2, &TABLE[i].fn, 8);
        p[10] = 0xff; p[11] = 0xe0;                  /* jmp rax */
        VirtualProtect(p, 12, old, &old);
        FlushInstructionCache(GetCurrentProcess(), p, 12);
    }
}

/* VERSION.dll's two functions that kernelbase lacks; nothing Potluck runs calls them */
DWORD WINAPI plk_VerInstallFileA(DWORD f, LPCSTR a, LPCSTR b, LPCSTR c, LPCSTR d, LPCSTR e, LPSTR g, PUINT h) {
    return 0x2000; /* VIF_CANNOTCREATE */
}
DWORD WINAPI plk_VerInstallFileW(DWORD f, LPCWSTR a, LPCWSTR b, LPCWSTR c, LPCWSTR d, LPCWSTR e, LPWSTR g, PUINT h) {
    return 0x2000;
}

BOOL WINAPI DllMain(HINSTANCE h, DWORD reason, LPVOID reserved) {
    if (reason == DLL_PROCESS_ATTACH) {
        DisableThreadLibraryCalls(h);
        patch_stubs();
    }
    return TRUE;
}
