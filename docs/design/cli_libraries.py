"""Measured comparison of typed CLI libraries for linattn's command line.

Compares jsonargparse, tyro and simple-parsing (each deriving flags, help and config-file
parsing from dataclasses) against plain argparse with a hand-written flag per field plus a
small stdlib helper (docstring help, one-line errors with "did you mean", a JSON/TOML loader,
``--set key=value`` overrides, and the attention union chosen by name).

The config below mirrors linattn's training config: nested frozen dataclasses, a Union of
frozen attention dataclasses, a Literal, an optional string and a tuple, each field
documented in a Google-style "Attributes:" docstring.

Run (stdlib + the three libraries only; never in linattn's own venv)::

    python3 -m venv /tmp/clivenv
    /tmp/clivenv/bin/pip install jsonargparse tyro simple-parsing docstring-parser
    /tmp/clivenv/bin/python docs/design/cli_libraries.py

Every measurement runs in a fresh subprocess (``python cli_libraries.py --worker LIB MODE``);
timings are the median of 5. The script writes ``cli_libraries.md`` beside itself; nothing in
it is typed by hand.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal, Union

# --------------------------------------------------------------------------------------------
# The representative config (shared by every variant)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearConfig:
    """Kernelised linear attention.

    Attributes:
        feature_map: Feature map applied to queries and keys.
    """

    feature_map: str = "elu"


@dataclass(frozen=True)
class LocalConfig:
    """Sliding-window softmax attention.

    Attributes:
        window: Tokens each query attends to.
    """

    window: int = 128


@dataclass(frozen=True)
class ModelConfig:
    """Model shape.

    Attributes:
        vocab_size: Size of the token vocabulary.
        d_model: Width of the residual stream.
        n_layers: Number of blocks.
        attention: Attention mechanism and its settings.
    """

    vocab_size: int
    d_model: int = 128
    n_layers: int = 2
    attention: Union[LinearConfig, LocalConfig] = LinearConfig()


@dataclass(frozen=True)
class DataConfig:
    """Training data.

    Attributes:
        source: Where batches come from.
        path: File to read when source is "file".
    """

    source: Literal["recall", "file"] = "recall"
    path: str | None = None


@dataclass(frozen=True)
class TrainConfig:
    """Training run.

    Attributes:
        model: Model configuration.
        data: Data configuration.
        lr: Peak learning rate.
        max_steps: Number of optimiser steps.
        betas: Adam betas.
        out: Output directory.
    """

    model: ModelConfig
    data: DataConfig = DataConfig()
    lr: float = 1e-3
    max_steps: int = 1000
    betas: tuple[float, float] = (0.9, 0.95)
    out: str = "runs/train"


ATTENTION = {"linear": LinearConfig, "local": LocalConfig}

# What the "typical command line" of every variant must parse to.
EXPECTED_TYPICAL = TrainConfig(
    model=ModelConfig(vocab_size=256, d_model=64, attention=LocalConfig(window=64)),
    data=DataConfig(source="file", path="data.txt"),
    lr=3e-4, max_steps=50, betas=(0.9, 0.99), out="/tmp/run",
)
# What the shared config files (train.json / train.toml) must load to.
EXPECTED_FILE = TrainConfig(model=ModelConfig(vocab_size=32, d_model=64), lr=3e-4, max_steps=7, betas=(0.9, 0.99))
# What the "attention union in a file" test must load to.
EXPECTED_UNION_FILE = TrainConfig(model=ModelConfig(vocab_size=32, attention=LocalConfig(window=64)))
# linattn's own file syntax for the attention union (chosen by "name").
LINATTN_UNION_FILE = {"model": {"vocab_size": 32, "attention": {"name": "local", "window": 64}}}
# The shared file with the union member chosen on the command line afterwards.
EXPECTED_FILE_LOCAL = dataclasses.replace(
    EXPECTED_FILE, model=dataclasses.replace(EXPECTED_FILE.model, attention=LocalConfig(window=64)))
FILE_CONTENT = {"model": {"vocab_size": 32, "d_model": 64}, "lr": 3e-4, "max_steps": 7, "betas": [0.9, 0.99]}
TOML_CONTENT = 'lr = 0.0003\nmax_steps = 7\nbetas = [0.9, 0.99]\n\n[model]\nvocab_size = 32\nd_model = 64\n'

# --------------------------------------------------------------------------------------------
# Hand-written stdlib helpers (the "argparse + small helper" option; tyro reuses the loader)
# --------------------------------------------------------------------------------------------


def doc_help(cls) -> dict[str, str]:
    """``{field: text}`` from the class's Google-style "Attributes:" docstring."""
    import re

    return {m[1]: m[2].strip() for m in re.finditer(r"^\s{8}(\w+): (.+)$", cls.__doc__ or "", re.M)}


def load_file(path: str) -> dict:
    """A .json or .toml file as a dict."""
    import json
    import tomllib

    with open(path, "rb") as f:
        return tomllib.load(f) if path.endswith(".toml") else json.load(f)


def apply_set(d: dict, item: str) -> None:
    """Apply one ``key.sub=value`` override (value read as JSON when it parses) to nested dict d."""
    import json

    key, _, text = item.partition("=")
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    set_path(d, key, value)


def set_path(d: dict, key: str, value) -> None:
    """d["a"]["b"] = value for key "a.b", creating the parents."""
    *parents, last = key.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[last] = value


def from_dict(d: dict) -> TrainConfig:
    """A nested dict (attention chosen by ``"name"``) as a TrainConfig; unknown keys raise."""
    m = dict(d.get("model", {}))
    att = dict(m.pop("attention", {"name": "linear"}))
    m["attention"] = ATTENTION[att.pop("name", "linear")](**att)
    top = {k: v for k, v in d.items() if k not in ("model", "data")}
    if "betas" in top:
        top["betas"] = tuple(top["betas"])
    return TrainConfig(model=ModelConfig(**m), data=DataConfig(**d.get("data", {})), **top)


# --------------------------------------------------------------------------------------------
# The variants: each builds its parser and parses argv into a TrainConfig
# --------------------------------------------------------------------------------------------


def parse_argparse(argv: list[str], opts: set[str]) -> TrainConfig:
    import argparse

    class OneLineParser(argparse.ArgumentParser):
        def error(self, message):  # one line naming the flag, with "did you mean"
            import difflib

            if message.startswith("unrecognized arguments: "):
                bad = message.split(": ", 1)[1].split()[0].split("=")[0]
                close = difflib.get_close_matches(bad, list(self._option_string_actions), n=1)
                message += f" (did you mean {close[0]}?)" if close else ""
            self.exit(2, f"{self.prog}: error: {message}\n")

    cls = argparse.ArgumentParser if "stdlib-error" in opts else OneLineParser
    p = cls(prog="train", description="Training run.", allow_abbrev="abbrev" in opts)
    p.add_argument("--config", help="A .json or .toml TrainConfig file.")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Override any field.")
    t, m, d = doc_help(TrainConfig), doc_help(ModelConfig), doc_help(DataConfig)
    p.add_argument("--vocab-size", type=int, dest="model.vocab_size", help=m["vocab_size"])
    p.add_argument("--d-model", type=int, dest="model.d_model", help=m["d_model"])
    p.add_argument("--n-layers", type=int, dest="model.n_layers", help=m["n_layers"])
    p.add_argument("--attention", choices=sorted(ATTENTION), dest="model.attention.name", help=m["attention"])
    p.add_argument("--attention-feature-map", dest="model.attention.feature_map",
                   help=doc_help(LinearConfig)["feature_map"] + " (linear)")
    p.add_argument("--attention-window", type=int, dest="model.attention.window",
                   help=doc_help(LocalConfig)["window"] + " (local)")
    p.add_argument("--data-source", choices=["recall", "file"], dest="data.source", help=d["source"])
    p.add_argument("--data-path", dest="data.path", help=d["path"])
    p.add_argument("--lr", type=float, help=t["lr"])
    p.add_argument("--max-steps", type=int, dest="max_steps", help=t["max_steps"])
    p.add_argument("--betas", type=float, nargs=2, help=t["betas"])
    p.add_argument("--out", help=t["out"])
    ns = vars(p.parse_args(argv))
    cfg = load_file(ns.pop("config")) if ns.get("config") else {}
    for item in ns.pop("set"):
        apply_set(cfg, item)
    for key, value in ns.items():
        if value is not None:
            set_path(cfg, key, value)
    try:
        return from_dict(cfg)
    except (TypeError, KeyError) as e:
        p.error(str(e))


def parse_jsonargparse(argv: list[str], opts: set[str]) -> TrainConfig:
    from jsonargparse import ActionConfigFile, ArgumentParser

    kwargs = {"parser_mode": jsonargparse_toml_mode()} if "toml" in opts else {}
    p = ArgumentParser(prog="train", description="Training run.", **kwargs)
    p.add_argument("--config", action=ActionConfigFile)
    p.add_class_arguments(TrainConfig)
    ns = p.instantiate(p.parse_args(argv))
    return TrainConfig(**{f.name: ns[f.name] for f in dataclasses.fields(TrainConfig)})


def jsonargparse_toml_mode() -> str:
    """TOML is not a built-in jsonargparse mode; the mode also parses single values, so fall back to YAML."""
    import tomllib

    import yaml
    from jsonargparse import set_loader

    def toml_or_yaml(text):
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            return yaml.safe_load(text)

    set_loader("toml_or_yaml", toml_or_yaml)
    return "toml_or_yaml"


def parse_tyro(argv: list[str], opts: set[str]) -> TrainConfig:
    import tyro

    default = None
    if "--config" in argv:  # no config-file support: peel it off and pass the loaded instance
        i = argv.index("--config")
        default = from_dict(load_file(argv[i + 1]))
        argv = argv[:i] + argv[i + 2:]
    return tyro.cli(TrainConfig, args=argv, prog="train", default=default)


def parse_simple_parsing(argv: list[str], opts: set[str]) -> TrainConfig:
    import simple_parsing

    return simple_parsing.parse(TrainConfig, args=argv, add_config_path_arg=True, prog="train")


# name -> (module imported for (a), parse function, glue functions counted as "lines of glue")
VARIANTS = {
    "argparse": ("argparse", parse_argparse, [parse_argparse, doc_help, load_file, apply_set, set_path, from_dict]),
    "jsonargparse": ("jsonargparse", parse_jsonargparse, [parse_jsonargparse, jsonargparse_toml_mode]),
    "tyro": ("tyro", parse_tyro, [parse_tyro, load_file, from_dict]),
    "simple-parsing": ("simple_parsing", parse_simple_parsing, [parse_simple_parsing]),
}

# Command lines, in each variant's own spelling.
ARGV = {
    "argparse": dict(
        base=["--vocab-size", "8"],
        typical="--vocab-size 256 --d-model 64 --lr 3e-4 --max-steps 50 --betas 0.9 0.99 --attention local "
                "--attention-window 64 --data-source file --data-path data.txt --out /tmp/run",
        local="--attention local --attention-window 64",
        abbrev=["--max-ste", "5"],
        config="--config {path}",
        union_file={"model": {"vocab_size": 32, "attention": {"name": "local", "window": 64}}},
    ),
    "jsonargparse": dict(
        base=["--model.vocab_size", "8"],
        typical="--model.vocab_size 256 --model.d_model 64 --lr 3e-4 --max_steps 50 --betas [0.9,0.99] "
                "--model.attention LocalConfig --model.attention.window 64 --data.source file "
                "--data.path data.txt --out /tmp/run",
        local="--model.attention LocalConfig --model.attention.window 64",
        abbrev=["--max_ste", "5"],
        config="--config {path}",
        union_file={"model": {"vocab_size": 32,
                              "attention": {"class_path": "LocalConfig", "init_args": {"window": 64}}}},
    ),
    "tyro": dict(
        base=["--model.vocab-size", "8"],
        typical="--model.vocab-size 256 --model.d-model 64 --lr 3e-4 --max-steps 50 --betas 0.9 0.99 "
                "--data.source file --data.path data.txt --out /tmp/run "
                "model.attention:local-config --model.attention.window 64",
        local="model.attention:local-config --model.attention.window 64",
        abbrev=["--max-ste", "5"],
        config="--config {path}",
        union_file={"model": {"vocab_size": 32, "attention": {"name": "local", "window": 64}}},
    ),
    "simple-parsing": dict(
        base=["--vocab_size", "8"],
        typical="--vocab_size 256 --d_model 64 --lr 3e-4 --max_steps 50 --betas 0.9 0.99 --source file "
                "--path data.txt --out /tmp/run localconfig --window 64",
        local="localconfig --window 64",
        abbrev=["--max_ste", "5"],
        config="--config_path {path}",
        union_file={"model": {"vocab_size": 32, "attention": {"window": 64}}},
    ),
}

# How the config file is loaded, per variant (measured below whether it works).
CONFIG_HOW = {
    "argparse": "hand-written loader (json / tomllib by suffix)",
    "jsonargparse": "native `ActionConfigFile` (JSON via its YAML loader)",
    "tyro": "hand-written loader, result passed as `default=`",
    "simple-parsing": "native `add_config_path_arg=True` (json/yaml/toml by suffix)",
}


# --------------------------------------------------------------------------------------------
# Worker: runs inside a fresh subprocess
# --------------------------------------------------------------------------------------------


def worker(lib: str, mode: str, argv: list[str]) -> None:
    module, parse, _ = VARIANTS[lib]
    opts = set(filter(None, os.environ.get("CLI_OPTS", "").split(",")))
    if mode == "import":
        before = set(sys.modules)
        t0 = time.perf_counter()
        __import__(module)
        dt = time.perf_counter() - t0
        print(f"{dt * 1e3:.3f} {len(set(sys.modules) - before)}")
        return
    __import__(module)  # import is measured separately
    if mode == "parse":  # build parser + parse the typical command line
        t0 = time.perf_counter()
        cfg = parse(ARGV[lib]["typical"].split(), opts)
        dt = time.perf_counter() - t0
        print(f"{dt * 1e3:.3f} {'OK' if cfg == EXPECTED_TYPICAL else 'MISMATCH ' + repr(cfg)}")
        return
    cfg = parse(argv, opts)  # mode == "run": errors go to stderr as the library prints them
    print(f"RESULT {cfg!r}")


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def main() -> None:
    import datetime
    import importlib.metadata as md
    import inspect
    import json
    import platform
    import statistics
    import subprocess
    import tempfile

    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.abspath(__file__)
    env = dict(os.environ, COLUMNS="100", LINES="50", NO_COLOR="1", TERM="dumb", PYTHONDONTWRITEBYTECODE="1")
    env.pop("FORCE_COLOR", None)
    tmp = tempfile.mkdtemp(prefix="cli_libraries_")

    def run(lib, mode, argv=(), opts=""):
        e = dict(env, CLI_OPTS=opts)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, script, "--worker", lib, mode, *argv], cwd=tmp, env=e,
                           capture_output=True, text=True, timeout=120)
        wall = time.perf_counter() - t0
        out = (r.stdout + r.stderr).rstrip("\n")
        return r.returncode, out, wall

    def median_of(lib, mode, n=5):
        vals, extra, walls = [], [], []
        for _ in range(n):
            rc, out, wall = run(lib, mode)
            assert rc == 0, out
            first, rest = out.splitlines()[-1].split(" ", 1)
            vals.append(float(first))
            extra.append(rest)
            walls.append(wall * 1e3)
        return statistics.median(vals), extra[-1], statistics.median(walls)

    with open(os.path.join(tmp, "train.json"), "w") as f:
        json.dump(FILE_CONTENT, f)
    with open(os.path.join(tmp, "train.toml"), "w") as f:
        f.write(TOML_CONTENT)
    with open(os.path.join(tmp, "linattn.json"), "w") as f:
        json.dump(LINATTN_UNION_FILE, f)

    def outcome(rc, out, expected):
        res = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if rc == 0 and res and res[-1] == f"RESULT {expected!r}":
            return "yes"
        if rc == 0 and res:
            got = eval(res[-1][len("RESULT "):], globals())  # a TrainConfig repr printed by the worker
            return "NO: silently wrong value: " + ", ".join(diff(got, expected))
        tail = out.splitlines()[-1] if out else ""
        return f"NO: exit {rc}" + (", traceback" if "Traceback" in out else "") + f" (`{tail[:90]}`)"

    def diff(got, expected, prefix=""):
        out = []
        for f in dataclasses.fields(expected):
            g, e = getattr(got, f.name), getattr(expected, f.name)
            if dataclasses.is_dataclass(e) and type(g) is type(e):
                out += diff(g, e, prefix + f.name + ".")
            elif g != e:
                out.append(f"`{prefix}{f.name}={g!r}` (expected `{e!r}`)")
        return out

    def source_lines(fn):
        return sum(1 for ln in inspect.getsource(fn).splitlines() if ln.strip() and not ln.strip().startswith("#"))

    rows, verbatim = [], {}
    for lib, (module, _, glue) in VARIANTS.items():
        print(f"measuring {lib} ...", file=sys.stderr)
        a = ARGV[lib]
        imp_ms, n_mod, _ = median_of(lib, "import")
        parse_ms, parse_ok, wall_ms = median_of(lib, "parse")
        cases = {
            "misspelled flag `--max-step 5`": a["base"] + ["--max-step", "5"],
            "misspelled flag, not a prefix `--max-stpes 5`": a["base"] + ["--max-stpes", "5"],
            "bad value `--lr abc`": a["base"] + ["--lr", "abc"],
            "abbreviated flag `" + " ".join(a["abbrev"]) + "`": a["base"] + a["abbrev"],
            "attention union from the CLI `" + a["local"] + "`": a["base"] + a["local"].split(),
        }
        res = {name: run(lib, "run", argv) for name, argv in cases.items()}
        verbatim[lib] = {name: (" ".join(argv), res[name][0], res[name][1]) for name, argv in cases.items()}

        rc_h, help_out, _ = run(lib, "run", ["--help"])
        verbatim[lib]["`--help`"] = ("--help", rc_h, help_out)
        conf = {}
        for name, fname, opts, expected in [
            ("JSON", "train.json", "", EXPECTED_FILE),
            ("TOML", "train.toml", "", EXPECTED_FILE),
            ("TOML (custom loader)", "train.toml", "toml", EXPECTED_FILE),
            ("union in JSON", "union.json", "", EXPECTED_UNION_FILE),
            ("linattn schema", "linattn.json", "", EXPECTED_UNION_FILE),
            ("file + CLI union", "train.json", "", EXPECTED_FILE_LOCAL),
        ]:
            if name == "TOML (custom loader)" and lib != "jsonargparse":
                continue
            with open(os.path.join(tmp, "union.json"), "w") as f:
                json.dump(a["union_file"], f)
            argv = a["config"].format(path=fname).split()
            if name == "file + CLI union":
                argv += a["local"].split()
            rc, out, _ = run(lib, "run", argv, opts)
            conf[name] = outcome(rc, out, expected)
            shown = {"union.json": f"{fname} = {json.dumps(a['union_file'])}",
                     "linattn.json": f"{fname} = {json.dumps(LINATTN_UNION_FILE)}"}.get(fname, fname)
            verbatim[lib][f"config file: {name}"] = (
                " ".join(argv) + (f"   (CLI_OPTS={opts})" if opts else "") + f"   # {shown}", rc, out)

        miss = res["misspelled flag `--max-step 5`"]
        miss2 = res["misspelled flag, not a prefix `--max-stpes 5`"]
        bad = res["bad value `--lr abc`"]
        abbrev = res["abbreviated flag `" + " ".join(a["abbrev"]) + "`"]
        union = res["attention union from the CLI `" + a["local"] + "`"]
        exp_local = TrainConfig(model=ModelConfig(vocab_size=8, attention=LocalConfig(window=64)))
        exp_abbrev = TrainConfig(model=ModelConfig(vocab_size=8), max_steps=5)

        def meant(out):
            return "yes" if ("did you mean" in out.lower() or "perhaps you meant" in out.lower()) else "no"

        def names(out, flag):
            return f", names `{flag}`: " + ("yes" if flag in out else "no")

        def n_lines(rc, out):
            return f"{len(out.splitlines())} (exit {rc})"

        glue_lines = sum(source_lines(fn) for fn in glue)
        try:
            version = md.version(lib) if lib != "argparse" else f"stdlib (Python {platform.python_version()})"
        except md.PackageNotFoundError:
            version = "?"
        rows.append(dict(
            lib=lib, version=version, imp=f"{imp_ms:.1f}", mods=str(n_mod), parse=f"{parse_ms:.1f}",
            wall=f"{wall_ms:.0f}", parse_ok=parse_ok, glue=str(glue_lines),
            miss=("accepted silently (abbreviation)" if miss[0] == 0
                  else n_lines(*miss[:2]) + names(miss[1], "--max-step")), miss_meant=meant(miss[1]),
            miss2=n_lines(*miss2[:2]) + names(miss2[1], "--max-stpes"), miss2_meant=meant(miss2[1]),
            bad=n_lines(*bad[:2]) + names(bad[1], "lr"),
            abbrev=(("accepted as --max-steps" + (" (deprecation warning)" if "deprecat" in abbrev[1].lower() else ""))
                    if outcome(abbrev[0], abbrev[1], exp_abbrev) == "yes" else f"rejected (exit {abbrev[0]})"),
            union=outcome(union[0], union[1], exp_local), union_syntax=f"`{a['local']}`",
            help_lines=len(help_out.splitlines()),
            help_doc="yes" if "Peak learning rate" in help_out else "no",
            help_nested_doc="yes" if "Tokens each query attends to" in help_out else "no",
            conf=conf, how=CONFIG_HOW[lib],
        ))

    # The stdlib-default argparse (allow_abbrev=True, usage + error lines), for the error rows only.
    std = {name: run("argparse", "run", ARGV["argparse"]["base"] + extra, "stdlib-error,abbrev")
           for name, extra in [("misspelled flag `--max-step 5` (stdlib defaults)", ["--max-step", "5"]),
                               ("misspelled flag, not a prefix `--max-stpes 5` (stdlib defaults)", ["--max-stpes", "5"]),
                               ("bad value `--lr abc` (stdlib defaults)", ["--lr", "abc"])]}

    # ---------------------------------------------------------------- write the report
    cmd = f"{sys.executable} docs/design/cli_libraries.py"
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    L = []
    w = L.append
    w("# Typed CLI libraries for linattn: measured comparison\n")
    w(f"Generated by `{cmd}` on {now} (Python {platform.python_version()}, {platform.machine()}, "
      f"{platform.system()}); every number and output below comes from that run. "
      "Each measurement is a fresh subprocess; timings are the median of 5. "
      "Help and errors were rendered with COLUMNS=100, NO_COLOR=1, output not a TTY.\n")
    w("The config: nested frozen dataclasses `TrainConfig(model: ModelConfig, data: DataConfig, lr, max_steps, "
      "betas: tuple[float, float], out)`, `ModelConfig.attention: Union[LinearConfig, LocalConfig]`, "
      "`DataConfig.source: Literal[...]`, `DataConfig.path: str | None`, every field documented in an "
      "\"Attributes:\" docstring (see the script). The argparse variant has a hand-written flag per field, "
      "takes its help from the docstrings, prints one-line errors with a difflib \"did you mean\", loads "
      "JSON/TOML and applies `--set key=value` (all in the glue lines counted below).\n")
    w("## Timings and size\n")
    w("| library | version | (a) import ms | modules added by import | (b) build + parse ms | "
      "process wall ms (startup+import+parse) | typical line parsed correctly | lines of glue code in the script |")
    w("|---|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        w(f"| {r['lib']} | {r['version']} | {r['imp']} | {r['mods']} | {r['parse']} | {r['wall']} | "
          f"{r['parse_ok']} | {r['glue']} |")
    w("\n(a) is `perf_counter` around `import <lib>` alone after interpreter start-up (the config module's own "
      "`dataclasses`/`typing` are already loaded). (b) is building the parser and parsing the typical command line "
      "below, library already imported. Process wall includes Python start-up (~same for all). "
      "Glue lines: non-blank, non-comment source lines (docstrings included) of the variant's function and "
      "the helpers it uses.\n")
    w("## Behaviour\n")
    w("| library | (c) `--max-step 5`: output lines, exit, names the flag | (g) did you mean | `--max-stpes 5`: lines | did you mean | "
      "(d) `--lr abc`: lines | abbreviated flag | (f) union member from CLI | (f) syntax | "
      "(h) `--help` lines | field docs in help | union member docs in top help |")
    w("|---|---|---|---|---|---|---|---|---|---:|---|---|")
    for r in rows:
        w(f"| {r['lib']} | {r['miss']} | {r['miss_meant']} | {r['miss2']} | {r['miss2_meant']} | {r['bad']} | "
          f"{r['abbrev']} | {r['union']} | {r['union_syntax']} | {r['help_lines']} | {r['help_doc']} | "
          f"{r['help_nested_doc']} |")
    w("\n## (e) Config files\n")
    w("Shared files: `train.json` = `" + json.dumps(FILE_CONTENT) + "`, `train.toml` = the same in TOML. "
      "\"union in JSON\" selects `LocalConfig(window=64)` in the library's own file syntax (shown in the "
      "verbatim section). yes = loaded to exactly the expected config.\n")
    w("| library | how | JSON | TOML | union member in JSON, library's syntax | "
      "union member in JSON, linattn's `{\"name\": \"local\", \"window\": 64}` | JSON file + union member chosen on CLI |")
    w("|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["conf"]
        toml = c["TOML"] + (f"; with a {source_lines(jsonargparse_toml_mode)}-line custom loader (`jsonargparse_toml_mode`): {c['TOML (custom loader)']}" if "TOML (custom loader)" in c else "")
        w(f"| {r['lib']} | {r['how']} | {c['JSON']} | {toml} | {c['union in JSON']} | {c['linattn schema']} | "
          f"{c['file + CLI union']} |")
    w("\n## Typical command line per library\n")
    for lib in VARIANTS:
        w(f"- {lib}: `{ARGV[lib]['typical']}`")
    w("\n## Verbatim outputs\n")
    w("Each block: the arguments after `train`, the exit code, then stdout+stderr as printed.\n")
    for lib in VARIANTS:
        w(f"### {lib}\n")
        for name, (argv, rc, out) in verbatim[lib].items():
            w(f"**{name}** — `train {argv}` → exit {rc}\n")
            w("```text\n" + out + "\n```\n")
        if lib == "argparse":
            w("**For reference, argparse with stdlib defaults** (`allow_abbrev=True`, stock `error()`):\n")
            for name, (rc, out, _) in std.items():
                w(f"*{name}* → exit {rc}\n")
                w("```text\n" + out + "\n```\n")
    path = os.path.join(here, "cli_libraries.md")
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main()
