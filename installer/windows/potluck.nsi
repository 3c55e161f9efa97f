; Potluck-Setup-<version>.exe: installs the stage installer/windows/layout.py assembled.
;   makensis -DVERSION=0.1.0 -DSTAGE=<stage dir> -DOUTFILE=<exe> installer/windows/potluck.nsi
;
; Per-user (no admin prompt): %LOCALAPPDATA%\Programs\Potluck, Start-menu shortcut, optional
; desktop shortcut and "Start Potluck when I sign in", the potluck:// link handler, and an
; "Apps & features" entry. Silent: Potluck-Setup.exe /S [/DESKTOP=0|1] [/AUTOSTART=0|1] [/D=dir]
; Silent uninstall: uninstall.exe /S keeps the user's models and settings; /S /PURGE removes them.

Unicode true
Target amd64-unicode            ; the app is 64-bit only; so is the installer
!ifdef FAST        ; POTLUCK_FAST_NSIS=1: a quick, larger build while working on the installer
SetCompressor zlib
!else
SetCompressor /SOLID lzma
SetCompressorDictSize 64
!endif
RequestExecutionLevel user
ManifestDPIAware true

!include MUI2.nsh
!include FileFunc.nsh
!include LogicLib.nsh
!include Sections.nsh

!define APP "Potluck"
!define UNINST_KEY "Software\Microsoft\Windows\CurrentVersion\Uninstall\Potluck"
!define RUN_KEY "Software\Microsoft\Windows\CurrentVersion\Run"
; app/autostart.py reads and writes this same value, so the Settings checkbox agrees
!define RUN_VALUE "Potluck"
!define CLASS_KEY "Software\Classes\potluck"

Name "${APP}"
OutFile "${OUTFILE}"
InstallDir "$LOCALAPPDATA\Programs\Potluck"
InstallDirRegKey HKCU "${UNINST_KEY}" "InstallLocation"
BrandingText "${APP} ${VERSION}"
VIProductVersion "${VERSION}.0"
VIAddVersionKey "ProductName" "${APP}"
VIAddVersionKey "ProductVersion" "${VERSION}"
VIAddVersionKey "FileDescription" "${APP} installer"
VIAddVersionKey "FileVersion" "${VERSION}"
VIAddVersionKey "LegalCopyright" "Apache-2.0"

!define MUI_ICON "${STAGE}\potluck.ico"
!define MUI_UNICON "${STAGE}\potluck.ico"
!define MUI_ABORTWARNING
!define MUI_WELCOMEPAGE_TEXT "Potluck pools friends' home GPUs to run one model none of you could run alone.$\r$\n$\r$\nIt installs for you only (no administrator needed) and works offline with its small built-in model."
!define MUI_FINISHPAGE_RUN "$INSTDIR\Potluck-App.exe"
!define MUI_FINISHPAGE_RUN_TEXT "Start Potluck now"

!insertmacro MUI_PAGE_WELCOME
!insertmacro MUI_PAGE_COMPONENTS
!insertmacro MUI_PAGE_DIRECTORY
!insertmacro MUI_PAGE_INSTFILES
!insertmacro MUI_PAGE_FINISH
!insertmacro MUI_UNPAGE_CONFIRM
!insertmacro MUI_UNPAGE_INSTFILES
!insertmacro MUI_LANGUAGE "English"

Section "Potluck" SecMain
  SectionIn RO
  ; an update replaces the program wholesale: files an older version had must not linger
  RMDir /r "$INSTDIR\lib"
  RMDir /r "$INSTDIR\python"
  SetOutPath "$INSTDIR"
  File /r "${STAGE}\*"
  WriteUninstaller "$INSTDIR\uninstall.exe"

  CreateShortCut "$SMPROGRAMS\Potluck.lnk" "$INSTDIR\Potluck-App.exe" "" "$INSTDIR\potluck.ico" 0

  ; potluck://join/<code>: an invite link clicked in a chat app opens the join dialog
  WriteRegStr HKCU "${CLASS_KEY}" "" "URL:Potluck invite"
  WriteRegStr HKCU "${CLASS_KEY}" "URL Protocol" ""
  WriteRegStr HKCU "${CLASS_KEY}\DefaultIcon" "" "$INSTDIR\potluck.ico"
  WriteRegStr HKCU "${CLASS_KEY}\shell\open\command" "" '"$INSTDIR\Potluck-App.exe" "%1"'

  WriteRegStr HKCU "${UNINST_KEY}" "DisplayName" "${APP}"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayVersion" "${VERSION}"
  WriteRegStr HKCU "${UNINST_KEY}" "Publisher" "Potluck"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayIcon" "$INSTDIR\potluck.ico"
  WriteRegStr HKCU "${UNINST_KEY}" "InstallLocation" "$INSTDIR"
  WriteRegStr HKCU "${UNINST_KEY}" "UninstallString" '"$INSTDIR\uninstall.exe"'
  WriteRegStr HKCU "${UNINST_KEY}" "QuietUninstallString" '"$INSTDIR\uninstall.exe" /S'
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoModify" 1
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoRepair" 1
  ${GetSize} "$INSTDIR" "/S=0K" $0 $1 $2
  WriteRegDWORD HKCU "${UNINST_KEY}" "EstimatedSize" $0
SectionEnd

Section "Desktop shortcut" SecDesktop
  CreateShortCut "$DESKTOP\Potluck.lnk" "$INSTDIR\Potluck-App.exe" "" "$INSTDIR\potluck.ico" 0
SectionEnd

Section /o "Start Potluck when I sign in" SecAutostart
  WriteRegStr HKCU "${RUN_KEY}" "${RUN_VALUE}" '"$INSTDIR\Potluck-App.exe"'
SectionEnd

!insertmacro MUI_FUNCTION_DESCRIPTION_BEGIN
  !insertmacro MUI_DESCRIPTION_TEXT ${SecMain} "The app, its own Python and the built-in model."
  !insertmacro MUI_DESCRIPTION_TEXT ${SecDesktop} "A Potluck icon on the desktop."
  !insertmacro MUI_DESCRIPTION_TEXT ${SecAutostart} "Potluck waits in the tray after you sign in, ready to share or chat. You can change this later in Settings."
!insertmacro MUI_FUNCTION_DESCRIPTION_END

; /DESKTOP=0|1 and /AUTOSTART=0|1 choose the optional parts in a silent install
Function .onInit
  ${GetParameters} $R0
  ClearErrors
  ${GetOptions} $R0 "/DESKTOP=" $R1
  ${IfNot} ${Errors}
    ${If} $R1 == "0"
      !insertmacro UnselectSection ${SecDesktop}
    ${Else}
      !insertmacro SelectSection ${SecDesktop}
    ${EndIf}
  ${EndIf}
  ClearErrors
  ${GetOptions} $R0 "/AUTOSTART=" $R1
  ${IfNot} ${Errors}
    ${If} $R1 == "1"
      !insertmacro SelectSection ${SecAutostart}
    ${Else}
      !insertmacro UnselectSection ${SecAutostart}
    ${EndIf}
  ${EndIf}
FunctionEnd

Section "Uninstall"
  ; only what the installer put there: $INSTDIR may be a folder the user chose and shares
  RMDir /r "$INSTDIR\lib"
  RMDir /r "$INSTDIR\python"
  Delete "$INSTDIR\potluck.exe"
  Delete "$INSTDIR\Potluck-App.exe"
  Delete "$INSTDIR\potluck.ico"
  Delete "$INSTDIR\uninstall.exe"
  RMDir "$INSTDIR"
  Delete "$SMPROGRAMS\Potluck.lnk"
  Delete "$DESKTOP\Potluck.lnk"
  DeleteRegValue HKCU "${RUN_KEY}" "${RUN_VALUE}"
  DeleteRegKey HKCU "${CLASS_KEY}"
  DeleteRegKey HKCU "${UNINST_KEY}"

  ; models can be many GB the user may want to keep for a reinstall: ask, default keep
  ${GetParameters} $R0
  ClearErrors
  ${GetOptions} $R0 "/PURGE" $R1
  ${IfNot} ${Errors}
    RMDir /r "$LOCALAPPDATA\potluck"
  ${ElseIf} ${FileExists} "$LOCALAPPDATA\potluck\*"
    MessageBox MB_YESNO|MB_ICONQUESTION|MB_DEFBUTTON2 \
      "Also remove Potluck's downloaded models and settings?$\r$\n($LOCALAPPDATA\potluck)" \
      /SD IDNO IDNO keep
    RMDir /r "$LOCALAPPDATA\potluck"
    keep:
  ${EndIf}
SectionEnd
