"""Setting up the peers the benchmarks compare against, without ever touching this interpreter's torch.

* **stocaching** pins ``numpy<2``, so it lives in its own virtualenv,
  ``benchmarks/.venv-stocaching`` (git-ignored), made by :func:`setup_stocaching`.
* **tensordict** (``MemoryMappedTensor``) installs into this interpreter, by
  :func:`setup_tensordict`, in one ``pip install`` that also pins torch to the
  build already installed: pip can then neither upgrade torch for it nor pick
  a CUDA wheel of the same version; if no tensordict release fits this torch,
  the install fails and the tensordict side is skipped.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv-stocaching"
STOCACHING_PYTHON = VENV / "bin" / "python"
READY = "mmapcache-bench-ready"  # written into VENV once its setup has completed
# tensordict 0.15 wants torch >= 2.11 and installs nothing else heavy (numpy, cloudpickle, pyvers).
TENSORDICT = "tensordict>=0.15,<0.16"

__all__ = [
    "STOCACHING_PYTHON",
    "TENSORDICT",
    "VENV",
    "setup_stocaching",
    "setup_tensordict",
    "stocaching_ready",
    "tensordict_version",
]


def torch_pin() -> str:
    """``torch==<this interpreter's exact build>``, local label included (``2.13.0+cpu``)."""
    import torch

    return f"torch=={torch.__version__}"


def setup_stocaching(venv: Path = VENV) -> Path:
    """Create ``venv`` afresh with stocaching, numpy<2, Pillow, psutil and exactly this machine's torch.

    torch is pinned to this interpreter's full version, local label included
    (``2.13.0+cpu``), in the same ``pip install`` as stocaching, so the
    resolver can neither pick another build (a CUDA wheel of the same
    version, gigabytes) nor upgrade it for a dependency. The venv counts as
    set up only once its interpreter has imported everything and matched the
    torch build: ``READY`` is written last, and a half-made venv (an
    interrupted or failed setup) is removed and made again.
    """
    import torch

    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    pin = torch_pin()
    print(f"installing stocaching, numpy<2, Pillow, psutil and {pin} into {venv}", flush=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", pin, "stocaching", "numpy<2", "Pillow", "psutil"], check=True
    )
    probe = "import numpy, PIL, psutil, stocaching, torch as t; print(t.__version__, t.version.cuda, numpy.__version__)"
    got = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True).stdout.split()
    if got[:2] != [torch.__version__, str(torch.version.cuda)] or not got[2].startswith("1."):
        want = f"torch {torch.__version__} (cuda {torch.version.cuda}), numpy 1.x"
        raise RuntimeError(f"{venv} has the wrong builds: expected {want}, got {got}")
    (venv / READY).write_text(" ".join(got) + "\n")
    return python


def stocaching_ready(python: str | Path = STOCACHING_PYTHON) -> bool:
    """Whether ``python`` can serve stocaching: any given interpreter, or the default venv once fully set up."""
    path = Path(python)
    if path.parent.parent == VENV:
        return (VENV / READY).exists() and path.exists()
    return path.exists()


def tensordict_version() -> str | None:
    """tensordict's version if it imports here, else None."""
    try:
        module = importlib.import_module("tensordict")
    except ImportError:
        return None
    return str(getattr(module, "__version__", "?"))


def setup_tensordict() -> str | None:
    """Install :data:`TENSORDICT` into this interpreter with torch pinned to its build; its version, or None.

    Returns None (and says why) when pip finds no tensordict for this torch:
    the benchmarks then skip that peer rather than let pip replace torch.
    """
    found = tensordict_version()
    if found is not None:
        return found
    import torch

    before = torch.__version__
    print(f"installing {TENSORDICT} next to {torch_pin()} (torch stays as it is)", flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", TENSORDICT, torch_pin()], check=False)
    after = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if after != before:  # cannot happen with the pin; checked because it would silently change every figure
        raise RuntimeError(f"pip changed torch from {before} to {after}")
    if done.returncode:
        print(f"no {TENSORDICT} installs next to torch {before}: the tensordict side is skipped", flush=True)
        return None
    importlib.invalidate_caches()
    return tensordict_version()
