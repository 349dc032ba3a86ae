"""Run the quant-onnx CLI in this process and send it SIGINT at a chosen point, as a user
pressing Ctrl-C would.

    python interrupt_runner.py MODULE:ATTR[.ATTR] K CLI-ARGS...

Before the K-th call of the named function (``onnxruntime:InferenceSession.run``,
``os:replace``...) the process sends itself SIGINT; Python raises KeyboardInterrupt there.
K = 0 only counts: the number of calls is printed to stderr as ``calls: N`` at exit, so a
test can pick a random K within a real run. Target ``-``: no patch, a plain CLI run.
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys


def _patch(target: str, k: int) -> list[int]:
    module_name, _, attr_path = target.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = attr_path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original = getattr(owner, name)
    calls = [0]

    def wrapped(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == k:
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)
    return calls


def main() -> int:
    # A process started in the background of a non-interactive shell inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler: give it back, as in a
    # terminal, so the test sees what a user pressing Ctrl-C sees however it was launched.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    target, k, *cli_args = sys.argv[1:]
    if target == "-":
        from quant_onnx.cli.main import main as plain_main

        return plain_main(cli_args)
    calls = _patch(target, int(k))
    if int(k) == 0:
        atexit.register(lambda: print(f"calls: {calls[0]}", file=sys.stderr))
    from quant_onnx.cli.main import main as cli_main

    return cli_main(cli_args)


if __name__ == "__main__":
    sys.exit(main())
