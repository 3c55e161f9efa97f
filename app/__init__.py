"""Potluck desktop app (PySide6): tray, chat window, host/join flows.

A thin client of the node's local control API; torch never runs in this process.
Filled in by the desktop-app work; the engine and CLI stand on their own meanwhile.
"""
