"""``python -m dpool [--device-ids 0,1 | cpu,cpu] [--max-restarts K] script.py [args...]``: run a script unchanged,
with dpool installed (see :func:`dpool.install`): its ``nn.DataParallel``, HF Trainers and Lightning
``strategy="dp"`` run on dpool workers. ``python -m dpool -m pkg.module [args...]`` runs a module, as ``python -m``.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
import types
from typing import Sequence

_USAGE_EXAMPLES = """\
examples:
  python -m dpool train.py --epochs 3             # nn.DataParallel, HF Trainer, Lightning "dp": on dpool
  python -m dpool --device-ids cpu,cpu train.py   # two CPU workers for every model
  python -m dpool --device-ids 0,1 -m pkg.train   # a module, on GPUs 0 and 1
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dpool", epilog=_USAGE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a Python script unchanged, with nn.DataParallel, HF Trainer and Lightning's strategy=\"dp\" "
                    "on dpool workers.")
    parser.add_argument("--device-ids", metavar="IDS",
                        help="comma-separated workers for every model: GPU indices (0,1) or cpu entries (cpu,cpu). "
                             "Default: what the script asks for; else every visible GPU, or one CPU worker per "
                             "physical core (a Trainer: its own devices)")
    parser.add_argument("--max-restarts", type=int, default=None, metavar="K",
                        help="worker deaths or hangs each model survives (default: 0)")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="run the target as a module (python -m pkg.module), not a file")
    parser.add_argument("target", metavar="script.py | pkg.module", help="what to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


def _device_ids(text: str) -> list[int | str]:
    return [int(d) if d.strip().isdigit() else d.strip() for d in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    opts = parser.parse_args(argv)
    options: dict = {}
    if opts.max_restarts is not None:
        if opts.max_restarts < 0:
            parser.error(f"--max-restarts must be 0 or more, got {opts.max_restarts}")
        options["max_restarts"] = opts.max_restarts
    given = None if opts.device_ids is None else _device_ids(opts.device_ids)
    if opts.module:
        import importlib.util

        try:
            found = importlib.util.find_spec(opts.target)
        except (ImportError, ValueError):
            found = None
        if found is None:
            parser.error(f"no module named {opts.target!r}")
    elif not os.path.isfile(opts.target):
        parser.error(f"can't open file {opts.target!r}: no such file")

    import dpool
    from dpool.devices import check_devices, parse_devices
    from dpool.errors import DpoolError

    device_ids = None
    try:
        if given is not None:
            device_ids = parse_devices(given)
            check_devices(device_ids)  # (GPUs that exist, no mix of CPU and GPU)
    except DpoolError as exc:
        parser.error(f"--device-ids {opts.device_ids}: {exc}")
    _show_dpool_log()
    dpool.install(device_ids, **options)
    where = ",".join(device_ids) if device_ids else "the script's, or the default"
    print(f"dpool {dpool.__version__}: installed (workers: {where}); nn.DataParallel, HF Trainer and Lightning "
          f"strategy=\"dp\" run on dpool workers", file=sys.stderr, flush=True)
    sys.argv = [opts.target, *opts.args]
    try:
        if opts.module:
            runpy.run_module(opts.target, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(opts.target)  # (__file__ and the traceback's file name: absolute, as Python's)
            sys.path[0] = os.path.dirname(path)
            runpy.run_path(path, run_name="__main__")
    except KeyboardInterrupt:
        raise  # (Python's own handling: the traceback, and the exit status of a process ended by SIGINT)
    except Exception as exc:  # the traceback as Python prints it for the script, without this file's frames
        traceback.print_exception(type(exc), exc, _script_frames(exc.__traceback__))
        return 1
    return 0


def _script_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the script's first frame on (this file's and runpy's frames left out)."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return tb


def _show_dpool_log() -> None:
    """dpool's INFO records (workers started, pools closed) on stderr, unless DPOOL_LOG_LEVEL says otherwise: how
    one sees that a script runs on dpool."""
    import logging

    logger = logging.getLogger("dpool")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("dpool: %(message)s"))
        logger.addHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
