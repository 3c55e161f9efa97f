/* The two programs a Windows user starts: they run the embedded Python beside them.
 *
 *   potluck.exe      (console)  <dir>\python\python.exe  -s -X utf8 -m app.launcher <args>
 *   Potluck-App.exe  (windowed) <dir>\python\pythonw.exe -s -X utf8 -m app.launcher app <args>
 *
 * -s: the user's own site-packages (%APPDATA%\Python\Python313: .pth files, usercustomize)
 * would otherwise load into Potluck, despite the ._pth file. -X utf8: output through a pipe
 * is UTF-8, not cp1252 (a reply outside cp1252 raised UnicodeEncodeError). The engine passes
 * both on to the processes it starts (engine/boot/selfcmd.py).
 *
 * A compiled launcher rather than a .bat or .lnk to python.exe: shortcuts, the Run key and
 * the potluck:// handler need an .exe with our icon, a windowed start must not flash a
 * console, and the arguments (an invite link with any characters) must pass through as
 * typed. Built with mingw-w64 on Linux (installer/build-windows.sh); POTLUCK_GUI selects the
 * windowed flavour. */
#include <windows.h>
#include <wchar.h>

#ifdef POTLUCK_GUI
#define PYEXE L"pythonw.exe"
#define PREFIX L" -s -X utf8 -m app.launcher app"
#else
#define PYEXE L"python.exe"
#define PREFIX L" -s -X utf8 -m app.launcher"
#endif

/* the command line after our own program name, quoted or not, as CommandLineToArgvW reads it */
static const wchar_t *after_argv0(const wchar_t *cmd) {
    if (*cmd == L'"') {
        cmd++;
        while (*cmd && *cmd != L'"') cmd++;
        if (*cmd) cmd++;
    } else {
        while (*cmd && *cmd != L' ' && *cmd != L'\t') cmd++;
    }
    return cmd;  /* keeps its leading space: appended after our own arguments */
}

static int fail(const wchar_t *what, const wchar_t *path) {
    wchar_t msg[1024];
    _snwprintf(msg, sizeof msg / sizeof msg[0],
               L"Potluck cannot start: %ls\n%ls\n\nReinstalling Potluck repairs this.", what, path);
    msg[sizeof msg / sizeof msg[0] - 1] = 0;
#ifdef POTLUCK_GUI
    MessageBoxW(NULL, msg, L"Potluck", MB_ICONERROR | MB_OK);
#else
    fwprintf(stderr, L"%ls\n", msg);
#endif
    return 9009;
}

static BOOL WINAPI stay(DWORD event) {
    return event == CTRL_C_EVENT || event == CTRL_BREAK_EVENT;  /* Python handles them */
}

#ifdef POTLUCK_GUI
int WINAPI wWinMain(HINSTANCE h, HINSTANCE p, LPWSTR a, int show) {
#else
int wmain(void) {
#endif
    /* a long install path (beyond MAX_PATH's 260 characters) must work too: the buffer
     * grows until GetModuleFileNameW fits, up to Windows' 32767-character limit */
    DWORD cap = MAX_PATH, n = 0;
    wchar_t *dir = NULL;
    for (;;) {
        dir = HeapAlloc(GetProcessHeap(), 0, cap * sizeof(wchar_t));
        if (!dir) return 8;
        n = GetModuleFileNameW(NULL, dir, cap);
        if (n == 0) return fail(L"Windows did not say where it is", L"");
        if (n < cap) break;
        HeapFree(GetProcessHeap(), 0, dir);
        if (cap >= 32768) return fail(L"its folder path is too long", L"");
        cap *= 4;
    }
    wchar_t *slash = wcsrchr(dir, L'\\');
    if (slash) *slash = 0;
    size_t plen = wcslen(dir) + 32;
    wchar_t *python = HeapAlloc(GetProcessHeap(), 0, plen * sizeof(wchar_t));
    if (!python) return 8;
    _snwprintf(python, plen, L"%ls\\python\\%ls", dir, PYEXE);
    python[plen - 1] = 0;
    if (GetFileAttributesW(python) == INVALID_FILE_ATTRIBUTES)
        return fail(L"its Python is missing:", python);

    const wchar_t *rest = after_argv0(GetCommandLineW());
    size_t len = wcslen(python) + wcslen(PREFIX) + wcslen(rest) + 8;
    wchar_t *cmd = HeapAlloc(GetProcessHeap(), 0, len * sizeof(wchar_t));
    if (!cmd) return 8;
    _snwprintf(cmd, len, L"\"%ls\"%ls%ls", python, PREFIX, rest);
    cmd[len - 1] = 0;

    /* the console flavour shares its console and standard handles with Python; Ctrl+C
     * reaches both, so the launcher stays for Python's own exit code. A handler, not
     * SetConsoleCtrlHandler(NULL, TRUE): that "ignore Ctrl+C" is inherited, and Python
     * would never hear it (nor leave its pipeline gracefully) */
    SetConsoleCtrlHandler(stay, TRUE);
    STARTUPINFOW si = {sizeof si};
    PROCESS_INFORMATION pi;
    if (!CreateProcessW(python, cmd, NULL, NULL, TRUE, 0, NULL, NULL, &si, &pi))
        return fail(L"Windows refused to start", python);
    WaitForSingleObject(pi.hProcess, INFINITE);
    DWORD code = 1;
    GetExitCodeProcess(pi.hProcess, &code);
    return (int)code;
}
