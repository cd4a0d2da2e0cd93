"""
Strict, typed configuration and the command-line entry point every script shares.

Defaults live in dataclasses (one typed place; the comment after a field is its --help text). Then, in
order: config files (Python files that assign keys) and --key=value overrides; the script gets an instance
of its dataclass (c.learning_rate). An unknown key, a value of the wrong type or a value outside its
choices is a ConfigError, so a typo never trains the wrong model.

Every error a user can cause and fix (a bad key, a missing dataset, a corrupt checkpoint, weights that
cannot be had) is a UserError; cli_main turns one into a single line on stderr and exit status 2.
"""

import difflib
import inspect
import os
import re
import sys
import types
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Optional


class UserError(ValueError):
    """Bad input the user can fix: one line that says what was wrong and what to do, exit status 2."""


class ConfigError(UserError):
    """A key or value the command line or a config file got wrong."""


class PretrainedError(UserError):
    """Weights that cannot be had or do not fit (hf.py, hf_encoders.py): one line for the user, no traceback."""


class DataError(UserError):
    """Data, a tokenizer or a file that cannot be used as given (missing, corrupt, of another vocabulary)."""


@dataclass
class Key:
    name: str
    type: type  # bool, int, float or str
    optional: bool  # None allowed
    default: object
    help: str
    choices: Optional[tuple] = None
    shown: Optional[str] = None  # --help's default column, where the default is decided at run time


def keys_of(cls, choices=None, defaults=None, helps=None, base=None, shown=None):
    """Keys from a dataclass: types from its annotations, help from the comment after each field. A class
    that extends base (model.ModelKeys) lists its own keys first, then base's. shown: --help's default
    column for keys whose real default is decided at run time."""
    hints = typing.get_type_hints(cls)
    comments = {}
    for klass in reversed(cls.__mro__[:-1]):
        comments.update(field_comments(klass))
    choices, defaults, helps = choices or {}, defaults or {}, helps or {}
    inherited = {f.name for f in fields(base)} if base else set()
    ordered = [f for f in fields(cls) if f.name not in inherited] + [f for f in fields(cls) if f.name in inherited]
    keys = []
    for f in ordered:
        base, optional = unwrap_optional(hints[f.name])
        default = defaults.get(f.name, f.default if f.default is not MISSING else None)
        keys.append(Key(f.name, base, optional, default, helps.get(f.name, comments.get(f.name, "")),
                        choices.get(f.name), (shown or {}).get(f.name)))
    return keys


def unwrap_optional(hint):
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (base,) = [a for a in args if a is not type(None)]
        return base, True
    return hint, False


def field_comments(cls):
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.*)$", line)
        if m:
            comments[m.group(1)] = m.group(2).strip()
    return comments


# ----------------------------------------------------------------------------------------------------


def parse_value(key, text):
    """A command-line string -> the key's type."""
    if key.optional and text.lower() in ("none", "null"):
        return None
    try:
        if key.type is bool:
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError
            return lowered in ("true", "1", "yes", "on")
        return key.type(text)
    except ValueError:
        raise ConfigError(f"--{key.name}={text}: expected {type_name(key)}") from None


def check_value(key, value, where):
    """A Python value (from a config file, or parsed) -> the key's type, or ConfigError."""
    if value is None:
        if key.optional:
            return None
    elif key.type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
    elif isinstance(value, key.type) and not (key.type is int and isinstance(value, bool)):
        pass
    else:
        raise ConfigError(f"{where}: {key.name} expects {type_name(key)}, got {type(value).__name__} {value!r}")
    if key.choices is not None and value not in key.choices:
        raise ConfigError(f"{where}: {key.name}={value!r} is not one of {', '.join(map(repr, key.choices))}")
    return value


def type_name(key):
    name = "true/false" if key.type is bool else key.type.__name__
    return f"{name} or None" if key.optional else name


def unknown_key(name, keys, where, renamed=None):
    """renamed: old key -> new key, for keys a script renamed (the error then names the new one)."""
    if renamed and name in renamed:
        return ConfigError(f"{where}: key {name!r} was renamed {renamed[name]!r}; use --{renamed[name]}=...")
    close = difflib.get_close_matches(name, keys, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; see --help for the list of keys"
    return ConfigError(f"{where}: unknown key {name!r}{hint}")


def read_config_file(path):
    """Executes a config file and returns the keys it assigned (names starting with _ are private;
    modules, functions and classes it defines or imports are ignored)."""
    if os.path.isdir(path):  # `python sample.py out-x`: a run's folder given where config files go
        raise ConfigError(f"{path} is a folder, not a config file; for a run's folder write --out_dir={path}")
    try:
        with open(path) as f:
            source = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    namespace = {}
    try:
        exec(compile(source, path, "exec"), namespace)
    except Exception as e:
        raise ConfigError(f"config file {path} failed: {type(e).__name__}: {e}") from None
    return {
        k: v for k, v in namespace.items()
        if not k.startswith("_") and not isinstance(v, (types.ModuleType, types.FunctionType, type))
    }  # fmt: skip


def parse(keys, argv, renamed=None):
    """argv: config file paths and --key=value, applied in order. Returns (values, explicit): every key's
    value and the names set by a file or the command line."""
    by_name = {k.name: k for k in keys}
    values = {k.name: k.default for k in keys}
    explicit = set()
    for arg in argv:
        if arg.startswith("--"):
            name, eq, text = arg[2:].partition("=")
            if not eq:
                raise ConfigError(f"{arg}: expected --key=value")
            if name not in by_name:
                raise unknown_key(name, by_name, "command line", renamed)
            assign(by_name, values, explicit, {name: parse_value(by_name[name], text)}, "command line")
        else:
            assign(by_name, values, explicit, read_config_file(arg), f"config file {arg}", renamed)
    return values, explicit


def parse_dict(keys, new, where):
    """Like parse, for a dict of Python values (e.g. an ablation variant)."""
    by_name = {k.name: k for k in keys}
    values, explicit = {k.name: k.default for k in keys}, set()
    assign(by_name, values, explicit, new, where)
    return values, explicit


def assign(by_name, values, explicit, new, where, renamed=None):
    for name, value in new.items():
        if name not in by_name:
            raise unknown_key(name, by_name, where, renamed)
        values[name] = check_value(by_name[name], value, where)
        explicit.add(name)


def help_text(keys, usage, about):
    lines = [f"usage: {usage}", "", about, "", "keys (default, type):"]
    width = max(len(k.name) for k in keys)
    for k in keys:
        kind = "|".join(map(str, k.choices)) if k.choices else type_name(k)
        default = k.shown or repr(k.default)
        lines.append(f"  --{k.name:<{width}} = {default:<14} ({kind})  {k.help}".rstrip())
    return "\n".join(lines)


def parse_config(cls, argv, usage, about, keys=None, renamed=None):
    """A script's argv -> (an instance of cls, the names a file or the command line set). --help prints
    every key (keys: default keys_of(cls)) and exits 0; anything wrong is a ConfigError."""
    keys = keys_of(cls) if keys is None else keys
    if "-h" in argv or "--help" in argv:
        print(help_text(keys, usage, about))
        sys.exit(0)
    values, explicit = parse(keys, argv, renamed)
    return cls(**values), explicit


def checked(build, *args, **kwargs):
    """build(*args, **kwargs) where a ValueError is a library's verdict on values the user chose (a model
    config, sampling settings, a weight format): it becomes a ConfigError, with the same message."""
    try:
        return build(*args, **kwargs)
    except UserError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def cli_main(command, argv=None):
    """Runs command(argv) (argv: sys.argv[1:] by default) as every script's main does: a UserError ends it
    with one line on stderr and exit status 2, Ctrl-C with one line and 130 (a script that has more to
    say about an interruption catches KeyboardInterrupt itself); returns what command returns."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return command(argv)
    except UserError as e:
        fail(e)
    except KeyboardInterrupt:
        print("\nerror: interrupted", file=sys.stderr)
        sys.exit(130)


def command_line(cls, usage, about, run, keys=None, renamed=None):
    """A script's main(argv=None): its keys parsed (config files, then --key=value), then run(config).

    What sample.py, chat.py, serve.py and interpret.py are, under cli_main's one error path.
    """

    def main(argv=None):
        return cli_main(lambda argv: run(parse_config(cls, argv, usage, about, keys, renamed)[0]), argv)

    return main


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # under torchrun: its failure summary shows the line
    if error_file and not os.path.exists(error_file):  # (else only "To enable traceback see: ..." below it)
        import json
        import time

        with open(error_file, "w") as f:
            json.dump({"message": f"error: {message}", "timestamp": int(time.time())}, f)
    sys.exit(2)


# ----------------------------------------------------------------------------------------------------
# Text typed on a command line (sample.py's --start and --stop, interpret.py's --start)


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text):
    """\\n, \\t, \\r and \\\\ typed on a command line (where the shell passes them as two characters) become
    a newline, a tab, a carriage return and one backslash; any other backslash stays as it is."""
    return re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m.group(1)], text)


def read_prompt(start):
    """The prompt a --start value gives: the file FILE:path holds, or the text with its escapes (unescape)."""
    if start.startswith("FILE:"):
        path = start[len("FILE:") :]
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ConfigError(f"start=FILE:{path}: cannot read the prompt file ({e.strerror})") from None
    return unescape(start)


# ----------------------------------------------------------------------------------------------------
# Progress of a long command's loop


PROGRESS_SECONDS = 15.0  # a plain progress line at most this often (tests set 0: every update)


class Progress:
    """How far a long loop has come, on stderr, as train.py shows its steps: a tqdm bar on a terminal, else
    (a log, a pipe) a plain line at most every PROGRESS_SECONDS with the count, the rate and the time
    left, so a reader can tell a slow run from a hung one. A loop that ends sooner prints nothing.
    Use as a context manager; update(n) after each n units of work."""

    def __init__(self, total, unit, what=""):
        import time

        self.total, self.unit, self.what, self.done = total, unit, what, 0
        self.clock = time.perf_counter
        self.start = self.last = self.clock()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=f" {unit}", desc=what or None, dynamic_ncols=True, leave=False)

    def update(self, n=1):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = self.clock()
        if now - self.last >= PROGRESS_SECONDS and self.done < self.total:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            left = (self.total - self.done) / rate if rate > 0 else float("inf")
            print(f"{self.what + ': ' if self.what else ''}{self.done:,} of {self.total:,} {self.unit}, "
                  f"{rate:,.1f}/s, about {clock_time(left)} left", file=sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def clock_time(seconds):
    """A duration for a person: 40 s, 12 min, 3.5 h."""
    if seconds == float("inf"):
        return "an unknown time"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
