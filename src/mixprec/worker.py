"""What `mixprec run` starts on each worker: `python <this file> script [args...]`.

The script runs as `python script args` would run it: `__name__ == "__main__"`, `sys.argv`,
`sys.path[0]` the script's folder, and nothing imported before it (this file is run by path,
not as `-m mixprec.worker`, so neither mixprec nor torch is imported ahead of a script that
sets OMP_NUM_THREADS or other variables torch reads at import). When the script ends without
an error, the worker frees what it left in its globals and then destroys the process group if
the script left one up, before the interpreter's own teardown: a gloo group still up at
interpreter exit sometimes aborted a finished worker ("terminate called without an active
exception", SIGABRT: the job failed after its last line ran), its worker threads' finished work
holding tensors that were then freed while the interpreter was being torn down. A script that fails keeps
its traceback and exit status, as under torchrun alone.
"""

import sys

# Run by path, this file's folder (mixprec's own, with logging.py and config.py) would be
# sys.path[0] and shadow the standard library: drop it before importing anything else.
if __name__ == "__main__":
    del sys.path[0]

import gc  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402


def run_script(script: str, args: list[str]) -> None:
    """Run script as __main__ with args, then tear down what it left (see the module doc)."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    script_globals = runpy.run_path(script, run_name="__main__")
    script_globals.clear()  # the script's models and optimizers go before their process group
    del script_globals
    gc.collect()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(f"usage: python {__file__} script [args...]")
    run_script(argv[0], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
