"""Developer sessions: one isolated virtualenv per distribution, plus cross-package
checks. `nox` runs the default set (every test session, lint, layering, typecheck);
`nox -s demo` runs the main job on the built-in example.

Each package session installs only that package (from its local path, with the
local paths of the packages it depends on) and what it declares, then proves the
backend it must not see is absent: torch is not importable in the ONNX session,
onnxruntime is not importable in the torch session.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True
nox.options.sessions = [
    "core",
    "algos",
    "algos_torch",
    "onnx",
    "torch_fx",
    "npu",
    "integration",
    "lint",
    "layering",
    "typecheck",
]

# The local CPU wheel; a looser spec would pull several GB of CUDA packages.
TORCH = "torch==2.13.0"
TEST_DEPS = ("pytest>=7", "hypothesis>=6")
CORE = "packages/quant-core"
ALGOS = "packages/quant-algos"
ONNX = "packages/quant-onnx"
TORCH_FX = "packages/quant-torch-fx"
NPU = "packages/quant-npu-export"
ALL_SOURCES = [f"{p}/src" for p in (CORE, ALGOS, ONNX, TORCH_FX, NPU)]


def _assert_absent(session: nox.Session, module: str) -> None:
    session.run(
        "python",
        "-c",
        f"import importlib.util, sys; sys.exit(f'{module} must not be installed here' "
        f"if importlib.util.find_spec('{module}') else 0)",
    )


def _pytest(session: nox.Session, *paths: str) -> None:
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths, *session.posargs)


@nox.session
def core(session: nox.Session) -> None:
    """quant-core alone: numpy and attrs are its only runtime dependencies."""
    session.install(CORE)
    session.run(
        "python",
        "-c",
        "import importlib.metadata as m; reqs = m.requires('quant-core') or []; "
        "runtime = sorted(r.split('>')[0].split('=')[0].strip() for r in reqs if 'extra' not in r); "
        "assert runtime == ['attrs', 'numpy'], runtime; import quant_core; print('quant-core deps:', runtime)",
    )
    session.install(*TEST_DEPS)
    _assert_absent(session, "onnx")
    _assert_absent(session, "torch")
    _pytest(session, f"{CORE}/tests")


@nox.session
def algos(session: nox.Session) -> None:
    """quant-algos without its torch extra: closed-form algorithms work, AdaRound and
    AdaQuant fail with a message naming the extra."""
    session.install(CORE, ALGOS, *TEST_DEPS)
    _assert_absent(session, "torch")
    _pytest(session, f"{ALGOS}/tests")


@nox.session
def algos_torch(session: nox.Session) -> None:
    """quant-algos with the [torch] extra: AdaRound and AdaQuant."""
    session.install(TORCH)
    session.install(CORE, f"{ALGOS}[torch]", *TEST_DEPS)
    _pytest(session, f"{ALGOS}/tests")


@nox.session
def onnx(session: nox.Session) -> None:
    """quant-onnx, the ONNX backend, installed without torch."""
    session.install(CORE, ALGOS, f"{ONNX}[images]", *TEST_DEPS)
    _assert_absent(session, "torch")
    _pytest(session, f"{ONNX}/tests")


@nox.session
def torch_fx(session: nox.Session) -> None:
    """quant-torch-fx, the torch backend, installed without onnxruntime."""
    session.install(TORCH)
    session.install(CORE, ALGOS, TORCH_FX, *TEST_DEPS)
    _assert_absent(session, "onnxruntime")
    _pytest(session, f"{TORCH_FX}/tests")


@nox.session
def npu(session: nox.Session) -> None:
    """quant-npu-export over the ONNX backend."""
    session.install(CORE, ALGOS, ONNX, NPU, *TEST_DEPS)
    _pytest(session, f"{NPU}/tests")


@nox.session
def integration(session: nox.Session) -> None:
    """Everything installed together: cross-package flows in tests-integration/."""
    session.install(TORCH)
    session.install(CORE, f"{ALGOS}[torch]", f"{ONNX}[images]", TORCH_FX, NPU, *TEST_DEPS)
    _pytest(session, "tests-integration")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint rules and formatting."""
    session.install("ruff==0.17.6")  # rules drift between releases; bump deliberately
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def layering(session: nox.Session) -> None:
    """Import contracts (.importlinter): packages import only from lower levels, the
    ONNX backend never imports torch and the torch backend never imports onnxruntime."""
    session.install("import-linter>=2.0")
    session.run("lint-imports", "--config", ".importlinter", env={"PYTHONPATH": ":".join(ALL_SOURCES)})


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy: strict for quant_core, standard for the packages above it."""
    session.install("mypy>=1.8", "numpy>=1.24", "attrs>=23.1")
    session.run("mypy", "--strict", f"{CORE}/src/quant_core")
    session.run(
        "mypy",
        "--ignore-missing-imports",
        "--follow-imports=silent",
        f"{ALGOS}/src/quant_algos",
        env={"MYPYPATH": f"{CORE}/src"},
    )
    # The torch backend is checked against torch's own annotations (standard mode).
    session.install(TORCH)
    session.install("onnx>=1.15", "tqdm>=4.60")
    session.run(
        "mypy",
        "--follow-imports=silent",
        f"{TORCH_FX}/src/quant_torch_fx",
        env={"MYPYPATH": f"{CORE}/src:{ALGOS}/src"},
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The main job on the built-in example: quantize the Fashion-MNIST ResNet-18-shape
    model with the a8w8 preset and compare it with the float model."""
    session.install(CORE, ALGOS, ONNX)
    session.run("python", "tools/demo.py", *session.posargs)
