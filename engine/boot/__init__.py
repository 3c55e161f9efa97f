"""What a process needs before anything heavy imports: how the program starts a copy of
itself (selfcmd) and which torch build it imports (overlay). Standard library only, no
torch, so the app (which never imports torch) may use it too."""
