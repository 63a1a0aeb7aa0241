# A warm standby (agents/standby.py): a worker's interpreter, started with the worker's own
# command-line flags, environment, cwd and umask, that imports torch and restart.warm_imports
# and then waits for the agent to say what to run. It then becomes that worker: the
# environment, sys.argv and sys.path[0] of `python script.py` / `python -m mod`, the script
# run in the very __main__ module Python made for this file. Stdlib only, any Python 3.8+.
# No docstring: __main__'s __doc__ must be None, as before any script runs.
_FRESH = dict(globals())  # what CPython put in __main__ for a script, nothing of ours yet


def _standby(fresh):
    import io
    import json
    import os
    import socket
    import sys

    me = os.path.abspath(__file__)
    channel = socket.socket(fileno=int(sys.argv[1]))
    reader = channel.makefile("rb")

    def say(**what):
        try:
            channel.sendall((json.dumps(what) + "\n").encode())
        except OSError:
            pass

    prepare = json.loads(reader.readline() or b"{}")
    # Where the cold worker's sys.path[0] points (its script's directory, or the cwd for
    # -m), so that warm imports find the user's modules as the worker would.
    first = os.path.abspath(sys.path[0] or ".") if sys.path else None
    if not getattr(sys.flags, "safe_path", False) and first == os.path.dirname(me):
        sys.path[0] = prepare.get("path0") or sys.path[0]
    for name in prepare.get("imports") or ():
        try:
            __import__(name)
        except BaseException as exc:  # said to the agent, which starts that worker cold
            say(failed=f"import {name}: {type(exc).__name__}: {exc}"[:500])
            os._exit(0)
    for name in prepare.get("likely") or ():
        try:  # what the worker will most likely import (agents/standby.py)
            __import__(name)
        except Exception:
            pass  # then the worker imports it, or fails to, as a cold one does
    say(ready=True)
    line = reader.readline()
    if not line:  # the agent closed the channel: not needed any more
        os._exit(0)
    start = json.loads(line)
    reader.close()
    channel.close()

    os.environ.clear()
    os.environ.update(start["env"])
    if os.getcwd() != start["cwd"]:
        os.chdir(start["cwd"])
    sys.argv = list(start["sys_argv"])
    try:
        sys.orig_argv = list(start["argv"])
    except AttributeError:
        pass
    hooks = sys.modules.get("sitecustomize")  # ours: its per-rank parts read RANK
    for hook in ("_orchestrator_hook", "_orchestrator_sampler"):
        try:
            getattr(hooks, hook)()
        except Exception:
            pass

    import runpy
    from importlib.machinery import SourceFileLoader

    namespace = sys.modules["__main__"].__dict__
    try:
        code = path = None
        if not start.get("module"):
            path = os.path.abspath(start["script"])
            try:
                with io.open_code(path) as f:
                    source = f.read()
            except OSError as exc:  # as Python says it, with its exit status
                sys.stderr.write("%s: can't open file %r: [Errno %d] %s\n"
                                 % (start["argv"][0], path, exc.errno, exc.strerror))
                raise SystemExit(2) from None
            code = compile(source, path, "exec", dont_inherit=True)
        # From here on, only this function's own names: its globals are the script's.
        namespace.clear()
        namespace.update(fresh, __annotations__={})
        if code is None:  # runpy fills in the module's __file__, __loader__, __spec__
            del namespace["__file__"], namespace["__cached__"]
            runpy._run_module_as_main(start["module"], True)
        else:
            namespace.update(__file__=path, __cached__=None,
                             __loader__=SourceFileLoader("__main__", path))
            exec(code, namespace)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        kind, value, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename == me:
            tb = tb.tb_next  # the traceback a cold worker prints: from its script on
        # The exception's own __traceback__ is what gets printed: cut that one.
        sys.excepthook(kind, value.with_traceback(tb), tb)
        raise SystemExit(1) from None


_standby(_FRESH)
