"""Developer sessions: one isolated virtualenv per distribution, plus cross-package
checks. `nox` runs the default set (every test session, lint, layering, typecheck);
`nox -s demo` runs the main job on the built-in example.

Each package session installs only that package (from its local path, with the
local paths of the packages it depends on) and what it declares, then proves the
backend it must not see is absent: torch is not importable in the ONNX session,
onnxruntime is not importable in the torch session.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True
nox.options.sessions = [
    "core",
    "core_onnx",
    "algos",
    "algos_torch",
    "onnx",
    "torch_fx",
    "npu",
    "npu_alone",
    "npu_torch",
    "integration",
    "zoo",
    "packaging",
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
def core_onnx(session: nox.Session) -> None:
    """quant-core with its [onnx] extra: the ONNX QDQ layer both backends write and the NPU
    tools read through, with onnx alone (neither onnxruntime nor torch)."""
    session.install(f"{CORE}[onnx]", *TEST_DEPS)
    _assert_absent(session, "onnxruntime")
    _assert_absent(session, "torch")
    _pytest(session, f"{CORE}/tests/test_onnx_qdq.py", f"{CORE}/tests/test_doctests.py")


@nox.session
def npu_alone(session: nox.Session) -> None:
    """quant-npu-export as users install it: neither onnxruntime nor torch comes with it, and
    its console script runs."""
    session.install(CORE, ALGOS, NPU)
    _assert_absent(session, "onnxruntime")
    _assert_absent(session, "torch")
    session.run("quant-npu", "targets")


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
    """quant-onnx, the ONNX backend, installed without torch. The test that writes and
    quantizes a model over 2 GiB (about 45 s, 2.6 GB of disk) runs on its own, after."""
    session.install(CORE, ALGOS, f"{ONNX}[images]", *TEST_DEPS)
    _assert_absent(session, "torch")
    _pytest(session, f"{ONNX}/tests", "-m", "not big_model")
    _pytest(session, f"{ONNX}/tests", "-m", "big_model")


@nox.session
def torch_fx(session: nox.Session) -> None:
    """quant-torch-fx, the torch backend, installed without onnxruntime."""
    session.install(TORCH)
    session.install(CORE, ALGOS, TORCH_FX, *TEST_DEPS)
    _assert_absent(session, "onnxruntime")
    _pytest(session, f"{TORCH_FX}/tests")


@nox.session
def npu(session: nox.Session) -> None:
    """quant-npu-export over the ONNX backend, without torch; its console script runs."""
    session.install(CORE, ALGOS, ONNX, NPU, *TEST_DEPS)
    _assert_absent(session, "torch")
    session.run("quant-npu", "targets")
    _pytest(session, f"{NPU}/tests")


@nox.session
def npu_torch(session: nox.Session) -> None:
    """quant-npu-export with its [torch] extra: the Vitis AI-style flow (quant_npu.vitis) runs
    with every other test of the package (the `npu` session skips it: no torch there)."""
    session.install(TORCH)
    session.install(CORE, ALGOS, ONNX, TORCH_FX, f"{NPU}[torch]", *TEST_DEPS)
    _pytest(session, f"{NPU}/tests")


@nox.session
def integration(session: nox.Session) -> None:
    """Everything installed together: cross-package flows in tests-integration/."""
    session.install(TORCH)
    session.install(CORE, f"{ALGOS}[torch]", f"{ONNX}[images]", TORCH_FX, NPU, *TEST_DEPS)
    _pytest(session, "tests-integration")


@nox.session
def zoo(session: nox.Session) -> None:
    """The model zoo's CI subset at 64 px (tools/bench/zoo.py --check): a CNN, hard-swish + SE,
    SiLU + SE, ViT, MobileViT, ASPP and LR-ASPP segmentation, a YOLOv8-style detector and a
    ConvTranspose decoder, with random weights and 16 calibration samples, through both backends
    (and torchao PT2E, reported only), plus the models of the tool's EXPECTED_FAILURES. Fails when
    a model stops running end to end on one of our backends, or when a listed failure starts to
    pass. Coverage and fidelity are the full run's job (`python -m tools.bench.zoo`). timm and
    torchao come without their dependencies: timm's torchvision imports are served by tools/zoo_shims."""
    session.install(TORCH)
    session.install(CORE, f"{ALGOS}[torch]", f"{ONNX}[images]", TORCH_FX, NPU)
    session.install("--no-deps", "timm==1.0.31", "torchao==0.18.0")
    _assert_absent(session, "torchvision")
    session.run("python", "-m", "tools.bench.zoo", "--check", "--quick", "--no-measures", *session.posargs)


@nox.session
def packaging(session: nox.Session) -> None:
    """Wheels built with `hatch build` for every distribution, installed one at a time
    from the top level down (each pulling what it needs from the others' wheels), make one
    consistent environment (`pip check`) whose installed copies pass the integration tests."""
    session.install("hatch")
    wheels = Path(session.create_tmp()).resolve() / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    for package in (CORE, ALGOS, ONNX, TORCH_FX, NPU):
        with session.chdir(package):
            session.run("hatch", "build", "--target", "wheel", str(wheels))
    built = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    if built != ["quant_algos", "quant_core", "quant_npu_export", "quant_onnx", "quant_torch_fx"]:
        session.error(f"expected one wheel per distribution, got {built}")
    # The local wheels first, then whatever pip already finds (the CPU torch wheel).
    find_links = {"PIP_FIND_LINKS": " ".join(filter(None, [str(wheels), os.environ.get("PIP_FIND_LINKS")]))}
    session.install(TORCH)
    for requirement in ("quant-npu-export", "quant-torch-fx", "quant-onnx[images,torch]", "quant-algos[torch]",
                        "quant-core"):  # fmt: skip
        session.install(requirement, env=find_links)
    session.run("python", "-m", "pip", "check")
    session.run(
        "python",
        "-c",
        "import sys, quant_core, quant_algos, quant_onnx, quant_torch_fx, quant_npu; "
        "stray = [m.__name__ for m in (quant_core, quant_algos, quant_onnx, quant_torch_fx, quant_npu) "
        "if 'site-packages' not in m.__file__]; sys.exit(f'not the installed wheels: {stray}' if stray else 0)",
    )
    session.install(*TEST_DEPS)
    # test_bench_smoke puts the source folders first on sys.path (it tests repo tools, not the wheels).
    _pytest(session, "tests-integration", "--ignore", "tests-integration/test_bench_smoke.py")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint rules and formatting."""
    session.install("ruff==0.17.6")  # rules drift between releases; bump deliberately
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def layering(session: nox.Session) -> None:
    """Import contracts (.importlinter): packages import only from lower levels, the
    ONNX backend never imports torch and the torch backend never imports onnxruntime.
    Then no rule twice: no backend defines a planner or driver decision again
    (tools/check_decisions.py)."""
    session.install("import-linter>=2.0")
    session.run("lint-imports", "--config", ".importlinter", env={"PYTHONPATH": ":".join(ALL_SOURCES)})
    session.run("python", "tools/check_decisions.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy: strict for quant_core, standard for every package above it (onnx's own type
    hints are used; the torch backend is checked against torch's annotations, onnxruntime
    is left untyped)."""
    session.install("mypy>=1.8", "numpy>=1.24", "attrs>=23.1", "tqdm>=4.60", "onnx>=1.16", "types-protobuf")
    env = {"MYPYPATH": ":".join(ALL_SOURCES)}
    session.run("mypy", "--strict", f"{CORE}/src/quant_core", env=env)
    for package in (ALGOS, ONNX, NPU):
        session.run("mypy", "--ignore-missing-imports", "--follow-imports=silent", *_package_dirs(package), env=env)
    session.install(TORCH)
    session.run("mypy", "--follow-imports=silent", *_package_dirs(TORCH_FX), env=env)


def _package_dirs(package: str) -> list[str]:
    """The import package directory under ``package``/src (one per distribution)."""
    return [str(p) for p in sorted(Path(package, "src").iterdir()) if (p / "__init__.py").exists()]


@nox.session
def demo(session: nox.Session) -> None:
    """The main job on the built-in example: the Fashion-MNIST MobileNetV2-shape model
    through both backends (PTQ a8w8, xint8, xint8_adaround; QAT) and the NPU
    simulator, one table with accuracy, size and latency (tools/demo.py)."""
    session.install(TORCH)
    session.install(CORE, f"{ALGOS}[torch]", f"{ONNX}[torch]", TORCH_FX, NPU)
    session.run("python", "tools/demo.py", *session.posargs)
