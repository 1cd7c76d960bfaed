"""Parse engine command lines with the engines' own argument parsers, without a GPU.

Used by tests/it/serving_engines.rs. Reads JSON from stdin: {"vllm": [argv, ...], "sglang": [argv,
...], "vllm_router": [...], "sglang_router": [...]} where each argv is what `infer`
generated (`vllm serve MODEL ...`, `python3 -m sglang.launch_server ...`, `vllm-router ...`,
`python3 -m sglang_router.launch_router ...`; the routers' parsed URLs are returned as
`prefill_urls` and `decode_urls`). Prints one JSON object: for each engine, its version and, for
each argv, {"ok", "error", "problems", "values"}:

- the real parser of the installed engine (vLLM: `make_arg_parser` under a `serve`
  subcommand, as `vllm serve` builds it; SGLang: `ServerArgs.add_cli_args`), with
  abbreviations turned off, so that every flag must be spelled in full;
- every flag must be one of the parser's own option strings (`problems` otherwise);
- every value must round-trip: the parsed value equals the flag's type applied to the
  text written (`problems` otherwise);
- vLLM's own pre-start checks of the parsed arguments (`validate_parsed_serve_args`).

Importing vLLM and SGLang needs torch, CUDA extensions and dozens of packages that a CPU
test machine does not have. As vLLM's documentation build does, the modules that are not
installed are replaced by inert stand-ins at import time (a meta path finder); the parsers
themselves, their config dataclasses (pydantic) and their validation are the real code.
"""

import abc
import argparse
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import os
import sys
import types

# --- stand-ins for modules that are not installed -------------------------------------

_real_version = importlib.metadata.version


def _version(name):
    try:
        return _real_version(name)
    except importlib.metadata.PackageNotFoundError:
        # transformers then treats torch as absent, which it is.
        return "0.0.0"


importlib.metadata.version = _version


class _StubType(abc.ABCMeta):
    """Classes that answer any attribute, subscript, union or number conversion."""

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub(name)

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __iter__(cls):
        return iter(())

    def __len__(cls):
        return 0

    def __int__(cls):
        return 0

    def __index__(cls):
        return 0

    def __float__(cls):
        return 0.0


class _Stub(metaclass=_StubType):
    """An instance of a stand-in: callable, a no-op decorator, falsy, a context manager."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub(name)

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _stub("result")()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __str__(self):
        return ""

    def __index__(self):
        return 0

    def __int__(self):
        return 0

    def __float__(self):
        return 0.0

    def __getitem__(self, item):
        return self

    def __lt__(self, other):
        return False

    def __gt__(self, other):
        return False

    def __le__(self, other):
        return True

    def __ge__(self, other):
        return True

    def __eq__(self, other):
        return self is other or isinstance(other, _Stub)

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return id(self)

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()


def _same(self, *args, **kwargs):
    return self


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
            "matmul", "lshift", "rshift"):
    setattr(_Stub, f"__{_op}__", _same)
    setattr(_Stub, f"__r{_op}__", lambda self, other: other if isinstance(other, str) else self)


def _stub(name):
    return _StubType(str(name), (_Stub,), {})


# Accelerator back-ends torch would have: absent, so that the engines choose none of them.
_ABSENT = {"torch": {"npu", "xpu", "musa", "mlu", "hpu", "mps"}}


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name in _ABSENT.get(self.__name__, ()):
            raise AttributeError(name)
        value = _stub(name)
        setattr(self, name, value)
        return value


# Parts of vLLM itself that are GPU machinery (compiled ops registered at import).
_STUBBED_INSIDE = ("vllm._C", "vllm._moe_C", "vllm.vllm_flash_attn", "vllm.ir")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        if top in sys.stdlib_module_names or top.startswith("_"):
            return None
        if any(fullname == m or fullname.startswith(m + ".") for m in _STUBBED_INSIDE):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if top in ("vllm", "sglang"):
            return None
        if top in sys.modules and not isinstance(sys.modules[top], _StubModule):
            return None
        if "." not in fullname:
            for finder in sys.meta_path:
                if finder is self:
                    continue
                try:
                    spec = finder.find_spec(fullname, path, target)
                except Exception:
                    spec = None
                if spec is not None:
                    return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

# --- checks ---------------------------------------------------------------------------


def _option_actions(parser):
    return dict(parser._option_string_actions)


def _expected(action, text):
    if action.type is None or not callable(action.type):
        return text
    return action.type(text)


def _plain(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def check(parser, args, validate=None):
    """Parse `args` (the flags after the program) and check full names and round trips."""
    result = {"ok": False, "error": None, "problems": [], "values": {}}
    actions = _option_actions(parser)
    pairs = []  # (flag, value text or None)
    i = 0
    while i < len(args):
        word = args[i]
        if word.startswith("-") and len(word) > 1 and not _is_number(word):
            flag, _, inline = word.partition("=")
            action = actions.get(flag)
            if action is None:
                result["problems"].append(f"{flag}: not one of the parser's option strings")
                i += 1
                continue
            if not flag.startswith("--"):
                result["problems"].append(f"{flag}: a short form, not the full name")
            if inline:
                pairs.append((flag, inline))
            elif action.nargs == 0:
                pairs.append((flag, None))
            elif i + 1 < len(args):
                pairs.append((flag, args[i + 1]))
                i += 1
        i += 1
    try:
        namespace = parser.parse_args(args)
    except SystemExit as error:
        result["error"] = f"the parser exited ({error.code})"
        return result
    except Exception as error:  # noqa: BLE001 (any parser failure is the answer)
        result["error"] = f"{type(error).__name__}: {error}"
        return result
    for flag, text in pairs:
        action = actions[flag]
        value = getattr(namespace, action.dest, None)
        if text is None:
            if isinstance(action, argparse.BooleanOptionalAction):
                expected = not flag.startswith("--no-")
            else:
                expected = action.const if action.const is not None else True
        else:
            try:
                expected = _expected(action, text)
            except Exception as error:  # noqa: BLE001
                result["problems"].append(f"{flag} {text}: its type rejects it ({error})")
                continue
        if isinstance(action, argparse._AppendAction):
            # Repeated flags with several words each (the routers' `--prefill URL PORT`):
            # the router's own reading of them is checked by its validator.
            result["values"][action.dest] = _plain(value)
            continue
        if value != expected:
            result["problems"].append(f"{flag} {text}: parsed as {value!r}, expected {expected!r}")
        result["values"][action.dest] = _plain(value)
    if validate is not None:
        try:
            validate(namespace)
        except Exception as error:  # noqa: BLE001
            result["error"] = f"{type(error).__name__}: {error}"
            return result
    result["ok"] = not result["problems"]
    return result


def _is_number(word):
    try:
        float(word)
        return True
    except ValueError:
        return False


def vllm_parser():
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    commands = top.add_subparsers(dest="subparser")
    serve = make_arg_parser(commands.add_parser("serve"))
    top.allow_abbrev = False
    serve.allow_abbrev = False
    return top, serve, validate_parsed_serve_args


def sglang_parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    return parser


def router_parser(package):
    """The PD router's parser (`sglang_router` or `vllm_router`), as its `launch_router`
    builds it but with abbreviations off, and a validator that reads the arguments as the
    router does (`RouterArgs.from_cli_args`, its `_validate_router_args`)."""
    module = importlib.import_module(f"{package}.router_args")
    router_args = module.RouterArgs
    parser = argparse.ArgumentParser(prog=package, allow_abbrev=False)
    router_args.add_cli_args(parser, use_router_prefix=False, exclude_host_port=False)
    read = {}

    def validate(namespace):
        args = router_args.from_cli_args(namespace)
        args._validate_router_args()
        read["prefill_urls"] = _plain(args.prefill_urls)
        read["decode_urls"] = _plain(args.decode_urls)

    return parser, validate, read


# The routers' command lines: (what `infer` writes before the flags, the package).
ROUTERS = {
    "sglang_router": (["python3", "-m", "sglang_router.launch_router"], "sglang_router"),
    "vllm_router": (["vllm-router"], "vllm_router"),
}


def main():
    request = json.load(sys.stdin)
    answer = {}
    if request.get("vllm"):
        top, serve, validate = vllm_parser()
        results = []
        for argv in request["vllm"]:
            if argv[:2] != ["vllm", "serve"]:
                results.append({"ok": False, "error": "not a `vllm serve` line", "problems": [], "values": {}})
                continue
            # Flags are checked against the `serve` parser; the whole line goes through the
            # top-level parser as `vllm serve ...` does.
            result = check(serve, argv[2:])
            if result["error"] is None:
                try:
                    namespace = top.parse_args(argv[1:])
                    validate(namespace)
                    result["values"]["model_tag"] = namespace.model_tag
                except SystemExit as error:
                    result["ok"], result["error"] = False, f"the parser exited ({error.code})"
                except Exception as error:  # noqa: BLE001
                    result["ok"], result["error"] = False, f"{type(error).__name__}: {error}"
            results.append(result)
        answer["vllm"] = {"version": _real_version("vllm"), "results": results}
    if request.get("sglang"):
        parser = sglang_parser()
        results = []
        for argv in request["sglang"]:
            if argv[:3] != ["python3", "-m", "sglang.launch_server"]:
                results.append({"ok": False, "error": "not a `sglang.launch_server` line", "problems": [], "values": {}})
                continue
            results.append(check(parser, argv[3:]))
        answer["sglang"] = {"version": _real_version("sglang"), "results": results}
    for name, (program, package) in ROUTERS.items():
        if not request.get(name):
            continue
        results = []
        for argv in request[name]:
            if argv[: len(program)] != program:
                results.append({"ok": False, "error": f"not a `{' '.join(program)}` line", "problems": [], "values": {}})
                continue
            parser, validate, read = router_parser(package)
            result = check(parser, argv[len(program):], validate)
            result["values"].update(read)
            results.append(result)
        answer[name] = {"version": _real_version(package.replace("_", "-")), "results": results}
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
